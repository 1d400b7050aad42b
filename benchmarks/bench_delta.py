"""Delta refits against dense refits of the 1.15 GiB program of bench_refit.py, side by side.

The program is ``benchmarks/refit_1g.layout`` (Megatron TP2 x DP2 on ranks 0..3 -> vLLM TP4 on
ranks 4..7, fp32, domains of 2 ranks), on one pool of 8 gloo worker processes on loopback.
Every rank builds two Resharders of it (``memory_budget`` 256 MiB each): one runs with
``delta=True`` into destination storages it keeps from run to run, the other dense into
storages of its own. Before each timed pair of runs, every training rank changes a
``density`` fraction of its source elements (random positions, new random values); then
both refits run from a barrier, in alternating order, and every inference rank compares the
delta refit's storages with the dense refit's bit for bit (exit status 1 if one differs).

Printed per density: the best and median time of each (max over ranks, from the barrier),
delta's speedup, the bytes on the wire (the delta report's, headers included) against the
dense bytes, and peak memory per rank: the kernel's RSS high-water mark, and what delta
keeps (the senders' copies of what they sent). Target (issue 25): at a density of 2% or
less, at least 5x fewer wire bytes and at least 2x faster; never above 1.01x the dense bytes.

    python benchmarks/bench_delta.py                 # densities 0 1e-4 1e-2 0.02 0.1 0.5 1, 3 runs each
    python benchmarks/bench_delta.py --quick         # dims / 8, one run: a smoke test
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import layoutlang  # noqa: E402
from layoutlang.cli.launch import LocalWorkers  # noqa: E402
from layoutlang.io.weights import fill_synthetic  # noqa: E402
from layoutlang.runtime import Resharder  # noqa: E402

MiB = 2**20
WORLD = 8
DENSITIES = (0.0, 1e-4, 1e-2, 0.02, 0.1, 0.5, 1.0)
BYTES_TARGET, SPEED_TARGET, TARGET_DENSITY = 5.0, 2.0, 0.02

_STATE: dict[str, Any] = {}


def setup(text: str, path: str, memory_budget: int, timeout: float) -> dict[str, Any]:
    """Both Resharders, the synthetic sources, and each one's destinations (collective)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    program = layoutlang.loads(text, path=path)
    delta = Resharder(program, rank=rank, memory_budget=memory_budget, timeout=timeout)
    dense = Resharder(program, rank=rank, memory_budget=memory_budget, timeout=timeout)
    sources = delta.allocate("source")
    if rank in delta.plan.source.mesh:
        fill_synthetic(delta.plan.source, rank, sources)
    _STATE.update(
        rank=rank, delta=delta, dense=dense, sources=sources,
        held=delta.allocate("destination"), fresh=dense.allocate("destination"),
        generator=torch.Generator().manual_seed(rank),
    )
    delta.run(sources, _STATE["held"], delta=True)  # the first delta run is dense: the base
    dense.run(sources, _STATE["fresh"])
    return {"rank": rank, "source_bytes": sum(t.numel() * t.element_size() for t in sources.values())}


def change(density: float) -> int:
    """Change ``density`` of this rank's source elements (random positions and values)."""
    changed = 0
    for tensor in _STATE["sources"].values():
        flat = tensor.view(-1)
        count = round(density * flat.numel())
        if count:
            where = torch.randint(0, flat.numel(), (count,), generator=_STATE["generator"])
            flat[where] = torch.randn(count, generator=_STATE["generator"]).to(flat.dtype)
            changed += count
    return changed


def timed(method: str) -> dict[str, Any]:
    """One refit from a barrier; the delta's report when ``method`` is delta."""
    dist.barrier()
    start = time.perf_counter()
    if method == "delta":
        _STATE["delta"].run(_STATE["sources"], _STATE["held"], delta=True)
        report = _STATE["delta"].last_report.delta
        out = {"wire": report.wire_bytes, "dense": report.dense_bytes, "kept": report.kept_bytes,
               "messages": report.messages}
    else:
        _STATE["dense"].run(_STATE["sources"], _STATE["fresh"])
        out = {}
    out["seconds"] = time.perf_counter() - start
    return out


def compare() -> dict[str, Any]:
    """Whether the delta refit's destinations equal the dense refit's, bit for bit."""
    held, fresh = _STATE["held"], _STATE["fresh"]
    same = all(torch.equal(held[n].reshape(-1).view(torch.uint8), fresh[n].reshape(-1).view(torch.uint8))
               for n in held)
    return {"rank": _STATE["rank"], "identical": same,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _scaled(text: str, factor: int) -> str:
    """The program with its dimensions divided by ``factor`` (--quick)."""
    return re.sub(r"let (hidden|kv|ffn|vocab) = (\d+)", lambda m: f"let {m[1]} = {int(m[2]) // factor}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="dims / 8 and one run: a smoke test")
    parser.add_argument("--layout", default=str(HERE / "refit_1g.layout"), help="the program (8 ranks, 0..7)")
    parser.add_argument("--runs", type=int, default=None, help="timed pairs per density (default 3; --quick 1)")
    parser.add_argument("--densities", default=None, help="comma-separated fractions (default: " +
                        ",".join(f"{d:g}" for d in DENSITIES) + ")")
    parser.add_argument("--memory-budget", type=int, default=256 * MiB, help="each Resharder's, bytes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a worker task may take")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    densities = [float(d) for d in args.densities.split(",")] if args.densities else list(DENSITIES)
    if runs < 1 or any(not 0.0 <= d <= 1.0 for d in densities):
        parser.error("--runs must be at least 1 and every density within [0, 1]")
    text = Path(args.layout).read_text()
    if args.quick:
        text = _scaled(text, 8)
    print(f"bench_delta: {os.cpu_count()} cores, torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}")
    failed = False
    with LocalWorkers(WORLD, timeout=args.timeout) as pool:
        info = pool.run(setup, text, args.layout, args.memory_budget, args.timeout)
        total = sum(i["source_bytes"] for i in info[:4]) // 2  # two data-parallel replicas
        print(f"  program {args.layout}{' (dims / 8)' if args.quick else ''}: {total / MiB:,.0f} MiB of weights, "
              f"8 ranks; {runs} timed pair(s) per density, order alternating")
        print(f"  {'density':>8} {'delta s':>15} {'dense s':>15} {'speedup':>8} {'wire bytes':>14} "
              f"{'dense bytes':>14} {'fewer':>7}  encodings")
        for density in densities:
            times: dict[str, list[float]] = {"delta": [], "dense": []}
            wire = dense_bytes = 0
            messages: dict[str, int] = {}
            for run in range(runs):
                pool.run(change, density)
                for method in (("delta", "dense") if run % 2 == 0 else ("dense", "delta")):
                    results = pool.run(timed, method)
                    times[method].append(max(r["seconds"] for r in results))
                    if method == "delta":
                        wire = sum(r["wire"] for r in results)
                        dense_bytes = sum(r["dense"] for r in results)
                        messages = {k: sum(r["messages"][k] for r in results) for k in results[0]["messages"]}
                        kept = [r["kept"] for r in results]
                checks = pool.run(compare)
                if not all(c["identical"] for c in checks):
                    print(f"  FAILED: density {density:g}: ranks {[c['rank'] for c in checks if not c['identical']]} "
                          "differ from the dense refit")
                    failed = True
            best = {m: min(v) for m, v in times.items()}
            median = {m: statistics.median(v) for m, v in times.items()}
            speedup = median["dense"] / median["delta"]
            fewer = dense_bytes / wire if wire else float("inf")
            verdict = ""
            if wire > 1.01 * dense_bytes:
                verdict, failed = "  ABOVE 1.01x DENSE", True
            elif density <= TARGET_DENSITY and (fewer < BYTES_TARGET or speedup < SPEED_TARGET):
                verdict = "  MISSED (target: 5x fewer bytes, 2x faster)"
            encodings = ", ".join(f"{k} {v}" for k, v in messages.items() if v)
            print(f"  {density:>8g} {best['delta']:>6.3f} ({median['delta']:.3f}) {best['dense']:>6.3f} "
                  f"({median['dense']:.3f}) {speedup:>7.2f}x {wire:>14,} {dense_bytes:>14,} {fewer:>6.1f}x  "
                  f"{encodings}{verdict}")
        rss = [c["rss_mib"] for c in pool.run(compare)]
        print(f"  memory: kept copies per rank {', '.join(f'{k / MiB:.0f}' for k in kept)} MiB (the senders'); "
              f"peak RSS per rank {', '.join(f'{r:.0f}' for r in rss)} MiB (both Resharders' storages included)")
        print("  times: best (median) over the runs, max over ranks; speedup by median")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
