#!/usr/bin/env python3
"""Multi-rank NCCL checks on a machine with two or more GPUs (one process per GPU).

Steps, in order, each reported PASS / FAIL / SKIP with its time:

1. create   every rank creates the communicator from a unique id published in a TCPStore;
2. ring     each rank sends 64 MiB to the next and receives from the previous, one group;
3. execute  the executor reshards a program over all ranks (every rank sends to every
            other) through NcclTransport, and every destination byte is verified;
4. shrink   the last rank stops (its process exits without cleanup); the others time out
            waiting for it, revoke, shrink it away (NCCL_SHRINK_DEFAULT) and exchange again;
5. grow     a new process joins on the freed GPU: rank 0 asks NCCL for a single-use id
            (ncclCommGetUniqueId) and publishes it; existing ranks grow, the new one joins;
            all ranks exchange again.

Steps 4-5 need ncclCommRevoke / ncclCommShrink (2.28 / 2.27) and ncclCommGrow (2.29) in the
NCCL that loads (see ``layoutlang doctor``; LAYOUTLANG_NCCL_LIBRARY can point at a newer
one). Exits 0 when every step passed or was skipped, 1 otherwise; 0 with a note when fewer
than two GPUs are visible.

    python tests/gpu/multi_gpu.py [--ranks N] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
from gpu_steps import collect, verdicts

STEPS = ["create", "ring", "execute", "shrink", "grow"]


def program_text(n: int) -> str:
    return f"""
mesh train [tp = {n}]
mesh infer [tp = {n}]
tensor "w" [4096, 4096] bf16
tensor "e" [{n * 64}, 1024] fp32
layout a on train {{ "w": tp = shard(0)  "e": tp = shard(1) }}
layout b on infer {{ "w": tp = shard(1)  "e": tp = shard(0) }}
reshard a -> b
"""


def ring(comm, rank_in_comm: int, size: int, nbytes: int = 64 << 20, timeout: float = 60.0) -> None:
    out = torch.full((nbytes,), (rank_in_comm + 1) % 251, dtype=torch.uint8, device="cuda")
    into = torch.zeros_like(out)
    stream = torch.cuda.current_stream().cuda_stream
    ticket = comm.exchange([((rank_in_comm + 1) % size, out.data_ptr(), nbytes)],
                           [((rank_in_comm - 1) % size, into.data_ptr(), nbytes)], stream)
    if not comm.wait(ticket, timeout):
        raise RuntimeError(f"ring exchange did not complete within {timeout} s")
    expected = ((rank_in_comm - 1) % size + 1) % 251
    if int(into[0]) != expected or int(into[-1]) != expected:
        raise RuntimeError(f"ring exchange delivered {int(into[0])}, expected {expected}")


def worker(rank: int, world: int, port: int, results, role: str, timeout: float) -> None:
    def report(step: str, status: str, detail: str = "", started: float | None = None) -> None:
        elapsed = time.monotonic() - started if started else 0.0
        results.put((rank, step, status, detail, elapsed))

    try:
        torch.cuda.set_device(rank)
        import torch.distributed as dist

        import layoutlang
        from layoutlang.errors import NcclError
        from layoutlang.io.weights import fill_synthetic, verify
        from layoutlang.runtime import Resharder
        from layoutlang.transport.nccl import Communicator, NcclTransport, load_library

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        lib = load_library()
        if role == "join":
            t = time.monotonic()
            comm = Communicator.join(store, rank, world, key="grow", timeout=timeout)
            ring(comm, comm.rank, comm.size)
            report("grow", "PASS", f"joined as rank {comm.rank} of {comm.size}", t)
            comm.destroy()
            return

        t = time.monotonic()
        comm = Communicator.create(store, rank, world, key="init", timeout=timeout)
        report("create", "PASS", lib.describe(), t)

        t = time.monotonic()
        ring(comm, rank, world)
        report("ring", "PASS", "64 MiB to the next rank", t)

        t = time.monotonic()
        program = layoutlang.loads(program_text(world))
        transport = NcclTransport(rank, comm, on_failure="revoke")
        resharder = Resharder(program, rank=rank, transport=transport, timeout=timeout)
        sources = resharder.allocate("source", device="cuda")
        fill_synthetic(resharder.plan.source, rank, sources)
        destinations = resharder.run(sources)
        check = verify(resharder.plan.destination, rank, destinations)
        if not check.ok:
            raise RuntimeError("; ".join(check.mismatches))
        report("execute", "PASS", f"{check.bytes} bytes verified", t)

        if not (lib.has("ncclCommRevoke") and lib.has("ncclCommShrink")):
            report("shrink", "SKIP", f"{lib.describe()} lacks ncclCommRevoke or ncclCommShrink")
            report("grow", "SKIP", "needs shrink first")
            comm.destroy()
            return
        victim = world - 1
        if rank == victim:
            report("shrink", "EXIT", "the last rank stops without cleanup")
            results.close()
            results.join_thread()
            os._exit(0)
        t = time.monotonic()
        into = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            stream = torch.cuda.current_stream().cuda_stream
            ticket = comm.exchange([], [(victim, into.data_ptr(), into.numel())], stream)
            finished = comm.wait(ticket, 10.0)
        except NcclError as err:  # NCCL noticed the dead peer itself
            finished = f"error: {err.call}"
        if finished is True:
            raise RuntimeError("a receive from the stopped rank completed")
        comm.revoke()
        smaller = comm.shrink([victim])
        ring(smaller, smaller.rank, smaller.size)
        report("shrink", "PASS", f"wait -> {finished or 'timeout'}; now rank {smaller.rank} of {smaller.size}", t)

        if not (lib.has("ncclCommGrow") and lib.has("ncclCommGetUniqueId")):
            report("grow", "SKIP", f"{lib.describe()} lacks ncclCommGrow or ncclCommGetUniqueId")
            smaller.destroy()
            return
        results.put((rank, "shrunk", "", "", 0.0))  # the parent starts the new rank
        t = time.monotonic()
        bigger = smaller.grow(store, world, key="grow", coordinator=smaller.rank == 0)
        ring(bigger, bigger.rank, bigger.size)
        report("grow", "PASS", f"rank {bigger.rank} of {bigger.size}", t)
        bigger.destroy()
    except BaseException as err:
        results.put((rank, "error", "FAIL", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}", 0.0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="processes (default: every visible GPU)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for each NCCL operation")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.ranks or gpus
    if gpus < 2 or world < 2 or world > gpus:
        print(f"multi_gpu: skipped: needs two or more GPUs ({gpus} visible)")
        return 0

    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=args.timeout)
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, world, server.port, results, "rank", args.timeout)) for r in range(world)
    ]
    for p in procs:
        p.start()
    survivors = set(range(world - 1))
    started: list = []

    def joiner(shrunk: set[int]):
        if shrunk != survivors or started:
            return None
        started.append(ctx.Process(target=worker, args=(world - 1, world, server.port, results, "join", args.timeout)))
        started[0].start()
        return started[0]

    outcome, failures = collect(results, procs, STEPS, 5 * args.timeout, joiner)
    print(f"multi_gpu: {world} ranks on {gpus} GPUs")
    expected = {step: world if step in ("create", "ring", "execute", "grow") else world - 1 for step in STEPS}
    ok = verdicts(outcome, expected, failures)
    print("multi_gpu: " + ("all steps passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
