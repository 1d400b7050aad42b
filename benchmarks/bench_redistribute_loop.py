"""A loop of small ``layoutlang.runtime.redistribute`` calls: the Executor built anew at every
call (as before the cache) against the one the cache keeps, side by side in one run.

4 gloo worker processes (:class:`layoutlang.cli.launch.LocalWorkers`), one 1-D DeviceMesh of
the 4 ranks, a DTensor of ``--rows`` x ``--cols`` fp32 rows-sharded (``Shard(0)``) moved to
``Shard(1)``, ``--calls`` times per round. Rounds alternate the two modes (``fresh``: the
Executor cache is emptied before every call, so each call builds its Executor, schedule and
arenas, as ``redistribute`` did before; ``reused``: the cache keeps it), ``--rounds`` of each;
``DTensor.redistribute`` of the same DTensor is timed in the same rounds for reference. The
plan itself is cached in both modes (it was before too). A call's time is the slowest rank's
mean over the round; the table gives the best round and the median. Every result is compared
with the expected shard (``torch.chunk`` of the full tensor).

    python benchmarks/bench_redistribute_loop.py            # 200 calls x 5 rounds of each
    python benchmarks/bench_redistribute_loop.py --quick    # 20 calls x 1 round
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's layoutlang

import torch
import torch.distributed as dist

WORLD = 4
MODES = ("fresh", "reused", "dtensor")
_STATE: dict[str, Any] = {}


def setup(rows: int, cols: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("x",))
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    local = full.chunk(WORLD, 0)[rank].clone()
    x = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    _STATE.update(mesh=mesh, x=x, expected=full.chunk(WORLD, 1)[rank].clone())


def loop(mode: str, calls: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    from layoutlang.runtime.redistribute import _EXECUTORS, redistribute

    mesh, x, expected = _STATE["mesh"], _STATE["x"], _STATE["expected"]
    right = True
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        if mode == "fresh":
            _EXECUTORS.clear()
        if mode == "dtensor":
            out = x.redistribute(mesh, [Shard(1)]).to_local()
            out = out.wait() if hasattr(out, "wait") else out
        else:
            out = redistribute(x, mesh, [Shard(1)]).to_local()
        right = right and torch.equal(out, expected)
    seconds = (time.perf_counter() - start) / calls
    return {"seconds": seconds, "right": right}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 calls, one round of each: a smoke test")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--calls", type=int, default=None, help="calls per round (default 200; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each mode (default 5; --quick 1)")
    args = parser.parse_args(argv)
    calls = args.calls or (20 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 5)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from layoutlang.cli.launch import LocalWorkers

    times: dict[str, list[float]] = {m: [] for m in MODES}
    right = True
    with LocalWorkers(WORLD, timeout=600) as pool:
        pool.run(setup, args.rows, args.cols)
        for mode in MODES:  # warm-up: the plan compiled, DTensor's caches filled
            pool.run(loop, mode, 2)
        for n in range(rounds):
            for mode in MODES:
                rows = pool.run(loop, mode, calls)
                times[mode].append(max(r["seconds"] for r in rows))
                right = right and all(r["right"] for r in rows)
                print(f"  round {n + 1} {mode:<8} {times[mode][-1] * 1e3:8.3f} ms per call "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    nbytes = args.rows * args.cols * 4
    print(f"bench_redistribute_loop: [{args.rows}, {args.cols}] fp32 ({nbytes / 2**10:.0f} KiB), Shard(0) -> "
          f"Shard(1) on {WORLD} gloo ranks, {calls} calls per round, {rounds} rounds of each, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    labels = {"fresh": "Executor built at every call (before)", "reused": "Executor reused (after)",
              "dtensor": "DTensor.redistribute (reference)"}
    for mode in MODES:
        print(f"  {labels[mode]:<40} best {min(times[mode]) * 1e3:7.3f} ms  median "
              f"{statistics.median(times[mode]) * 1e3:7.3f} ms per call")
    best = min(times["fresh"]) / min(times["reused"])
    median = statistics.median(times["fresh"]) / statistics.median(times["reused"])
    print(f"  reuse: {best:.2f}x faster by best round, {median:.2f}x by median")
    print(f"  results: {'every call returned the expected shard' if right else 'A RESULT DIFFERED'}")
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
