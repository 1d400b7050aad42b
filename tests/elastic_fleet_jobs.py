"""A job for the fleet tests of elastic sessions (tests/test_elastic_fleet.py), run on every
worker of a LocalWorkers pool: a session whose destination axis ``dp`` holds whole units
(engines of ``tp = 2`` ranks) that are lost whole, admitted whole and grown, ranks that leave on
purpose, and source ranks that come back to their own positions (``await-rejoin``).

Every committed step's destination storages are verified byte for byte against the synthetic
weights of that step (the same as ``layoutlang apply --elastic``). What each rank saw is
returned as plain data; nothing here asserts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

import layoutlang
from elastic import ElasticSession
from layoutlang.cli.elastic_job import synthetic_sources
from layoutlang.cli.launch import worker_context
from layoutlang.errors import DataLossError, RuntimeFailure
from layoutlang.io.weights import verify


def _ctl(store: Any, namespace: str) -> Any:
    return dist.PrefixStore(f"{namespace}-ctl", store)


def fleet_job(
    text: str,
    steps: int,
    *,
    namespace: str,
    joiners: Sequence[int] = (),
    idle: Sequence[int] = (),
    kill: tuple[int, int] | None = None,
    leave: tuple[Sequence[int], int] | None = None,
    vanish_after: tuple[int, int] | None = None,
    rejoin: bool = False,
    await_joiners: tuple[int, Sequence[int]] | None = None,
    stall: tuple[Sequence[int], int, float] | None = None,
    members: Sequence[int] | None = None,
    timeout: float = 40.0,
    **options: Any,
) -> dict:
    """Refit ``steps`` times on this worker's rank.

    ``kill=(rank, step)``: that rank SIGKILLs itself halfway through the step's transfer.
    ``leave=(ranks, step)``: those ranks leave the session on purpose once ``step`` committed.
    ``vanish_after=(rank, step)``: that rank's process exits (no notice) once ``step``
    committed; the others wait until the test says it was restarted (key ``restarted``) and
    call :meth:`ElasticSession.admit`. ``rejoin``: this worker is that rank's new process.
    A rank that a session stops with :class:`DataLossError` while source positions are
    vacant waits for the restart too, calls ``admit`` and goes on. ``await_joiners=(step,
    ranks)``: the others refit that step only once those ranks asked to join (so that they
    are admitted after it, whatever the machine's speed). ``stall=(ranks, step, seconds)``:
    those ranks stay alive (heartbeats going) but do not begin that step for that long, as
    an engine whose control plane never calls it.
    """
    rank, store, port = worker_context["rank"], worker_context["store"], worker_context["port"]
    if rank in idle:
        return {"rank": rank, "idle": True}
    ctl = _ctl(store, namespace)
    program = layoutlang.loads(text)
    checked: list[dict] = []
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "checked": checked, "data_loss": []}

    def progress(step: int, done: int, total: int) -> None:
        if kill is not None and (rank, step) == kill and done == max(1, total // 2):
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        session = ElasticSession(
            program, rank=rank, store=store, port=port, namespace=namespace, join=rank in joiners or rejoin,
            members=members, timeout=timeout, memory_budget=8192, **options,
        )
    except RuntimeFailure as err:
        return out | {"error": str(err), "kind": err.kind}
    with session:
        out["admitted"] = {"generation": session.generation, "members": session.members,
                           "next_step": session.next_step, "holds_committed": session.holds_committed}
        committed = session.committed_step
        if rank in session.destination.mesh and session.holds_committed and committed is not None:
            v = verify(session.destination, rank, session.destinations, version=committed)
            out["admitted"].update(verified_step=committed, ok=v.ok, bytes=v.bytes)
        while session.next_step < steps:
            step = session.next_step
            if stall is not None and rank in stall[0] and step == stall[1]:
                time.sleep(stall[2])
            if await_joiners is not None and step == await_joiners[0] and rank not in await_joiners[1]:
                while not set(await_joiners[1]) <= {*session.members, *session.asking}:
                    time.sleep(0.02)
            try:
                report = session.refit(step, synthetic_sources, progress=progress)
            except DataLossError as err:  # source positions vacant: wait for their rank, admit it
                out["data_loss"].append({"step": step, "message": str(err), "vacant": session.vacant})
                ctl.wait(["restarted"], dist.constants.default_pg_timeout)
                session.admit()
                continue
            except RuntimeFailure as err:
                return out | {"error": str(err), "kind": err.kind}
            result: dict[str, Any] = {"step": step, "generation": report.generation,
                                      "destination": report.destination}
            if rank in session.destination.mesh:
                v = verify(session.destination, rank, session.destinations, version=step)
                result.update(ok=v.ok, bytes=v.bytes)
            checked.append(result)
            if leave is not None and rank in leave[0] and step == leave[1]:
                session.leave()
                return out | {"left_after": step}
            if vanish_after is not None and step == vanish_after[1]:
                if rank == vanish_after[0] and not rejoin:
                    os._exit(0)  # gone without a word, between steps
                ctl.wait(["restarted"], dist.constants.default_pg_timeout)
                if not rejoin:
                    session.admit()
        return out | {
            "generation": session.generation,
            "members": session.members,
            "destination_ranks": list(session.destination.mesh.ranks),
            "destination_shape": dict(session.destination.mesh.axes),
            "source_ranks": list(session.source.mesh.ranks),
            "recoveries": [r.to_json() for r in session.recoveries],
        }

