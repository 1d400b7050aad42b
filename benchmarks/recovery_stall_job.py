"""The worker side of ``bench_recovery.py``'s stall case: elastic refits while one rank stalls.

Every worker of the pool runs :func:`stall_job`: an :class:`elastic.ElasticSession` refitting
``steps`` steps of synthetic weights. Rank ``stalled`` SIGSTOPs itself halfway through the
transfer of refit ``stall_step`` (an overloaded host), after writing ``time.time()`` under
``{namespace}-ctl/stalled`` for the parent, which continues it with SIGCONT after the stall.
Each worker returns the seconds of each of its refits, whether every destination byte
verified, and what its failure detector did (rechecks, suspects left at the end).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch.distributed as dist

from elastic import ElasticSession
from layoutlang import lang
from layoutlang.cli.elastic_job import synthetic_sources
from layoutlang.cli.launch import worker_context
from layoutlang.io.weights import verify


def stall_job(
    layout: str, steps: int, *, namespace: str, stalled: int, stall_step: int, memory_budget: int, deadline: float = 1.0
) -> dict[str, Any]:
    rank, store, port = worker_context["rank"], worker_context["store"], worker_context["port"]
    ctl = dist.PrefixStore(f"{namespace}-ctl", store)

    def progress(step: int, done: int, total: int) -> None:
        if rank == stalled and step == stall_step and done == max(1, total // 2):
            ctl.set("stalled", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # the parent sends SIGCONT

    program = lang.load(layout)
    seconds: list[float] = []
    verified = True
    with ElasticSession(
        program,
        rank=rank,
        store=store,
        port=port,
        namespace=namespace,
        deadline=deadline,
        memory_budget=memory_budget,
    ) as session:
        for step in range(steps):
            start = time.perf_counter()
            session.refit(step, synthetic_sources, progress=progress)
            seconds.append(time.perf_counter() - start)
            if rank in session.destination.mesh:
                verified &= verify(session.destination, rank, session.destinations, version=step).ok
        return {
            "rank": rank,
            "seconds": seconds,
            "verified": verified,
            "generation": session.generation,
            "members": session.members,
            "rechecks": session.rechecks,
            "suspected": {str(r): why for r, why in session.suspected.items()},
        }
