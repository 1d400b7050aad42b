#!/usr/bin/env python3
"""The refit session of live engines over real NCCL, on a machine with three or more GPUs (one
process per GPU): what layoutlang's vLLM integration runs when the trainer and the engines hold
CUDA devices (:func:`layoutlang.integrations.refit_session.fleet_session` picks
:class:`elastic.NcclGenerations`), without vLLM: the engines' storages are CUDA tensors.

Rank 0 is the trainer (it holds every tensor); every other GPU is an engine of one worker
(the destination ``[dp = N - 1, tp = 1]``). Steps, each reported PASS / FAIL / SKIP with its
time:

1. start    every rank enters the session's first generation (one communicator) and refits
            step 0; every destination byte is verified on every engine;
2. lose     the last engine's process exits without a word after step 1; the others' step 2
            notices it (heartbeat), shrinks the communicator (``ncclCommShrink``), retries
            and commits on the remaining engines, every byte verified;
3. join     a new process on the freed GPU joins as an engine: admitted after step 3, it
            receives the last committed step from another engine (the communicator grows:
            ``ncclCommGrow``) and refits step 4 with the others, every byte verified.

Shrink and grow need ncclCommShrink (2.27) and ncclCommGrow (2.29) in the NCCL that loads (see
``layoutlang doctor``); without them steps 2 and 3 are skipped. Exits 0 when every step passed
or was skipped, 1 otherwise; 0 with a note when fewer than three GPUs are visible. ``--cpu``
runs the same steps on CPU processes over gloo (a check of the script itself, which the test
suite runs: tests/test_refit_session_gpu_script.py).

    python tests/gpu/refit_session_gpu.py [--ranks N] [--timeout SECONDS] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
from gpu_steps import collect, verdicts

STEPS = ["start", "lose", "join"]
REFITS = 5


def program_text(engines: int) -> str:
    return f"""
mesh train [dp = 1] on ranks 0..0
mesh infer [dp = {engines}, tp = 1] on ranks 1..{engines}
tensor "w" [2048, 2048] bf16
tensor "e" [4096, 256] fp32
tensor "n" [2048] fp32
layout trainer on train {{ default: replicate }}
layout serve on infer {{ default: replicate }}
reshard refit: trainer -> serve
"""


def worker(rank: int, gpu: int | None, engines: int, port: int, secret: str, results, join: bool,
           timeout: float) -> None:
    def report(step: str, status: str, detail: str = "", started: float | None = None) -> None:
        results.put((rank, step, status, detail, time.monotonic() - started if started else 0.0))

    try:
        if gpu is not None:
            torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}" if gpu is not None else "cpu"
        import torch.distributed as dist

        import layoutlang
        from elastic import JobSecret
        from layoutlang.cli.elastic_job import synthetic_sources
        from layoutlang.integrations.refit_session import SessionAddress, fleet_session
        from layoutlang.io.weights import verify
        from layoutlang.transport.nccl import load_library

        lib = load_library() if gpu is not None else None
        can_resize = lib is None or (
            lib.has("ncclCommShrink") and lib.has("ncclCommGrow") and lib.has("ncclCommGetUniqueId")
        )
        backend = lib.describe() if lib is not None else "gloo (--cpu)"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        address = SessionAddress("127.0.0.1", port, "gpu-refit")
        t = time.monotonic()
        session = fleet_session(
            layoutlang.loads(program_text(engines)), None, rank=rank, store=store, address=address,
            secret=JobSecret.parse(secret), join=join, timeout=timeout, deadline=2.0, device=device,
        )

        def sources(step, s):
            return {k: v.to(device) for k, v in synthetic_sources(step, s).items()}

        def refit_and_verify(step: int) -> int:
            session.refit(step, sources)
            if rank not in session.destination.mesh:
                return 0
            check = verify(session.destination, rank, {k: v.cpu() for k, v in session.destinations.items()},
                           version=step)
            if not check.ok:
                raise RuntimeError(f"step {step}: " + "; ".join(check.mismatches[:3]))
            return check.bytes

        if join:
            caught = session.committed_step
            got = verify(session.destination, rank, {k: v.cpu() for k, v in session.destinations.items()},
                         version=caught)
            if not got.ok:
                raise RuntimeError(f"the weights of step {caught} it was given: " + "; ".join(got.mismatches[:3]))
            nbytes = refit_and_verify(session.next_step)
            report("join", "PASS", f"admitted ({getattr(session.group, 'how', 'rebuilt')}), step {caught} "
                                   f"verified, then step {session.committed_step} ({nbytes} bytes)", t)
            session.close()
            return
        nbytes = refit_and_verify(0)
        how = getattr(session.group, "how", "gloo group")
        report("start", "PASS", f"{backend}; step 0: {nbytes} bytes verified ({how})", t)
        refit_and_verify(1)
        if not can_resize:
            report("lose", "SKIP", f"{backend} lacks ncclCommShrink or ncclCommGrow")
            report("join", "SKIP", "needs shrink and grow")
            session.close()
            return
        victim = engines
        if rank == victim:
            report("lose", "EXIT", "the last engine stops without a word")
            results.close()
            results.join_thread()
            os._exit(0)
        t = time.monotonic()
        nbytes = refit_and_verify(2)
        report("lose", "PASS", f"{getattr(session.group, 'how', 'rebuilt')}: members {session.members}; "
                               f"{nbytes} bytes verified", t)
        results.put((rank, "shrunk", "", "", 0.0))  # the parent starts the joiner
        while not session.asking:  # it is admitted after the next step
            time.sleep(0.05)
        t = time.monotonic()
        for step in (3, 4):
            refit_and_verify(step)
        report("join", "PASS", f"{getattr(session.group, 'how', 'rebuilt')}: members {session.members}", t)
        session.close()
    except BaseException as err:
        results.put((rank, "error", "FAIL", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}", 0.0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="processes (default: every visible GPU)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for each wait of the session")
    parser.add_argument("--cpu", action="store_true", help="check the steps without a GPU: CPU processes over gloo")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.ranks or (4 if args.cpu else gpus)
    if not args.cpu and (gpus < 3 or world < 3 or world > gpus):
        print(f"refit_session_gpu: skipped: needs three or more GPUs ({gpus} visible)")
        return 0

    import multiprocessing as mp

    from elastic import JobSecret
    from elastic.auth import remember
    from elastic.store import serve_store

    ctx = mp.get_context("spawn")
    secret = JobSecret.generate()
    server = serve_store("127.0.0.1", 0, timeout=args.timeout)
    remember(server, secret)
    engines = world - 1
    results = ctx.Queue()

    def start(rank: int, gpu: int, join: bool):
        device = None if args.cpu else gpu
        p = ctx.Process(target=worker, args=(rank, device, engines, server.port, secret.text(), results, join,
                                             args.timeout))
        p.start()
        return p

    procs = [start(r, r, False) for r in range(world)]
    survivors = set(range(world - 1))
    started: list[Any] = []

    def joiner(shrunk: set[int]) -> Any | None:
        if shrunk != survivors or started:
            return None
        started.append(start(world, world - 1, True))  # a new engine on the freed GPU, a new rank
        return started[0]

    outcome, failures = collect(results, procs, STEPS, 10 * args.timeout, joiner)
    print(f"refit_session_gpu: a trainer and {engines} engines on " + ("CPU (gloo)" if args.cpu else f"{gpus} GPUs"))
    # an engine's detail (the last rank's), where it holds bytes
    ok = verdicts(outcome, {"start": world, "lose": world - 1, "join": world}, failures, detail_of=-1)
    print("refit_session_gpu: " + ("all steps passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
