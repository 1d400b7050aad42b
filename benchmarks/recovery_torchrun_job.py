"""The torchrun worker of ``bench_recovery.py``: the refit job under restart-all recovery.

Launched by ``bench_recovery.py`` as::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nnodes 1 \\
        --nproc-per-node N --max-restarts 1 benchmarks/recovery_torchrun_job.py \\
        --layout FILE --out DIR --steps 3 --victim 6 --kill-step 1 --memory-budget BYTES

Every worker joins the default gloo group (torchrun's store and environment: ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; the group's keys under a prefix of the attempt,
see ``main``; ``--env-init``: plain ``env://``), loads the program, builds a
``layoutlang.Resharder`` (compiles the plan and agrees on it with every rank over the
default group: that agreement is the job's first exchange) and refits ``--steps`` times
with synthetic source weights (version = step), verifying every destination byte after
each step.

On the first attempt (``TORCHELASTIC_RESTART_COUNT == 0``) rank ``--victim`` writes
``time.time()`` to ``DIR/killed`` and SIGKILLs itself halfway through the executor's steps
of refit ``--kill-step``, in the middle of a transfer (what :func:`layoutlang.cli.elastic_job.refit_job`
does on the elastic path). torchrun's agent then tears down every worker and starts them all
again. A restarted worker writes ``DIR/restart.{rank}`` (JSON): the time the process started
(first statement of this script), the process group was up, the program was loaded, and
the Resharder returned (its plan agreement completed over the new group: the first byte
moved by the restarted job); it then resumes at the first refit that not every rank had
completed, and exits 0 after the last.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before any import: close to when torchrun started this process

# The imports follow STARTED on purpose (E402): the restart timeline counts them.
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

IMPORTED = time.time()

import layoutlang  # noqa: E402
from layoutlang.io.weights import fill_synthetic, verify  # noqa: E402
from layoutlang.runtime import Resharder  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", required=True)
    parser.add_argument("--out", required=True, help="folder for the kill and restart times")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--victim", type=int, default=6)
    parser.add_argument("--kill-step", type=int, default=1)
    parser.add_argument("--memory-budget", type=int, default=512 * 1024)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--env-init", action="store_true",
                        help="plain init_process_group('gloo') (env://), without a per-attempt store prefix")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    torch.set_num_threads(1)
    # the refits every rank of the previous attempt completed (read before any rank of this
    # attempt can write): this attempt resumes at the next one
    done = [int(p.read_text()) for p in out.glob("done.*")] if attempt > 0 else []

    timeout = timedelta(seconds=args.timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not args.env_init:
        # torchrun's agent hosts one TCPStore for every attempt (its default since torch 2.5),
        # and env:// adds no per-attempt prefix: a restarted worker may read a peer's gloo
        # address from the failed attempt before the peer's new process overwrites it, and
        # its connectFullMesh then times out on a dead port (pytorch/pytorch#135712). Scope
        # the group's keys by attempt, as torch asks of users of the shared store.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        store = dist.PrefixStore(f"bench_recovery/attempt_{attempt}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)  # env://
    group_up = time.time()
    program = layoutlang.load(args.layout)
    loaded = time.time()
    resharder = Resharder(program, rank=rank, memory_budget=args.memory_budget, timeout=args.timeout)
    agreed = time.time()  # the plan agreement (an exchange over the new group) completed
    plan = resharder.plan
    src, dst = plan.source, plan.destination

    first = 0
    if attempt > 0:
        first = min(done) + 1 if len(done) == plan_world(plan) else 0
        (out / f"restart.{rank}").write_text(json.dumps({
            "rank": rank, "attempt": attempt, "started": STARTED, "imported": IMPORTED, "group": group_up,
            "loaded": loaded, "first_byte": agreed, "resume_step": first,
        }))

    def progress_for(step: int):
        def progress(done: int, total: int) -> None:
            if attempt == 0 and rank == args.victim and step == args.kill_step and done == max(1, total // 2):
                (out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        return progress

    destinations = resharder.allocate("destination")
    checks = []
    for step in range(first, args.steps):
        sources = resharder.allocate("source")
        if rank in src.mesh:
            fill_synthetic(src, rank, sources, version=step)
        resharder.run(sources, destinations, progress=progress_for(step))
        if rank in dst.mesh:
            v = verify(dst, rank, destinations, version=step)
            checks.append({"step": step, "ok": v.ok, "bytes": v.bytes, "mismatches": list(v.mismatches)[:3]})
        (out / f"done.{rank}").write_text(str(step))
    if attempt > 0:
        (out / f"checked.{rank}").write_text(json.dumps(checks))
    dist.destroy_process_group()
    return 0


def plan_world(plan) -> int:
    return len(set(plan.source.mesh.ranks) | set(plan.destination.mesh.ranks))


if __name__ == "__main__":
    raise SystemExit(main())
