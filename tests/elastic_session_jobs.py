"""The job every worker of the elastic session tests runs: repeated refits that verify every
destination byte after every committed step, with failures injected from inside the job.

``kills`` lists ``(rank, step, how)``: with ``how`` ``"kill"`` or ``"stop"`` that rank
SIGKILLs (SIGSTOPs) itself halfway through the executor's steps of that refit, in the
middle of a transfer; ``"on-shrink"`` kills it inside the shrink hook, i.e. during a
recovery; ``"signal"`` makes a rank in no layout (a spare member) kill itself when rank
``kill_trigger`` is halfway through that step's transfer, so the failed rank is no peer of
anyone's transfer. Joiners (``joiners``) ask to be admitted, then refit like the others.
Ranks in ``idle`` take no part.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import layoutlang
from elastic import ElasticSession
from layoutlang.errors import LayoutError
from layoutlang.execute import torch_dtype
from layoutlang.launch import worker_context
from layoutlang.weights import fill_synthetic, verify


def _die(how: str) -> None:
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    time.sleep(60)  # a stopped process gets here only if continued


def synthetic_sources(step: int, session: ElasticSession) -> dict[str, torch.Tensor]:
    """This rank's source storages holding the synthetic weights of ``step``."""
    layout, rank = session.source, session.rank
    storages = {
        name: torch.zeros(shape, dtype=torch_dtype(layout.tensors[layout.storage(name, rank).parts[0]].dtype))
        for name, shape in layout.storages_on(rank).items()
    }
    fill_synthetic(layout, rank, storages, version=step)
    return storages


def refit_job(
    text: str,
    steps: int,
    *,
    namespace: str,
    members: list[int] | None = None,
    joiners: tuple[int, ...] = (),
    kills: tuple[tuple[int, int, str], ...] = (),
    kill_trigger: int | None = None,
    idle: tuple[int, ...] = (),
    deadline: float = 1.0,
    memory_budget: int = 8192,
    **options,
):
    """Run ``steps`` refits of the program's reshard; returns what this rank saw."""
    rank, port, store = worker_context["rank"], worker_context["port"], worker_context["store"]
    if rank in idle:
        return {"idle": True}
    program = layoutlang.loads(text)
    ctl = dist.PrefixStore(f"{namespace}-ctl", store)
    mine = {how: step for r, step, how in kills if r == rank}

    def mark_and_die(how: str) -> None:
        ctl.set(f"killed/{rank}", str(time.time()).encode())
        _die(how)

    def progress(step: int, done: int, total: int) -> None:
        if done != max(1, total // 2):
            return
        if rank == kill_trigger and any(h == "signal" and s == step for _, s, h in kills):
            ctl.set("signal", str(time.time()).encode())
        for how in ("kill", "stop"):
            if mine.get(how) == step:
                mark_and_die(how)

    if "signal" in mine:

        def wait_for_signal() -> None:
            # a store client of its own: a client is not shared between threads
            own = dist.PrefixStore(f"{namespace}-ctl", dist.TCPStore("127.0.0.1", port, is_master=False))
            own.wait(["signal"])
            own.set(f"killed/{rank}", str(time.time()).encode())
            _die("kill")

        threading.Thread(target=wait_for_signal, daemon=True).start()

    shrinks: list[int] = []
    grows: list[int] = []
    checked: list[dict] = []

    def on_shrink(change) -> None:
        shrinks.append(change.generation)
        if "on-shrink" in mine:
            mark_and_die("kill")

    def on_step(step: int, session: ElasticSession) -> None:
        result = {"step": step, "generation": session.generation, "destination": session.destination.name}
        if rank in session.destination.mesh:
            v = verify(session.destination, rank, session.destinations, version=step)
            result.update(ok=v.ok, bytes=v.bytes, mismatches=list(v.mismatches))
        checked.append(result)

    try:
        session = ElasticSession(
            program, rank=rank, store=store, port=port, members=members, join=rank in joiners,
            namespace=namespace, deadline=deadline, timeout=40.0, memory_budget=memory_budget,
            on_shrink=on_shrink, on_grow=lambda change: grows.append(change.generation), **options,
        )
    except LayoutError as err:
        return {"error": str(err), "kind": err.kind}
    with session:
        joined = {}
        if rank in joiners and rank in session.destination.mesh:
            # what the recovery plan gave the joiner: the weights of the last committed step
            v = verify(session.destination, rank, session.destinations, version=session.committed_step)
            joined = {"step": session.committed_step, "ok": v.ok, "bytes": v.bytes, "mismatches": list(v.mismatches)}
        try:
            reports = session.run(synthetic_sources, steps, on_step=on_step, progress=progress)
        except LayoutError as err:
            regions = [[t, list(o), list(s)] for t, o, s in getattr(err, "regions", [])]
            return {"error": str(err), "kind": err.kind, "regions": regions, "checked": checked}
        return {
            "checked": checked,
            "reports": [r.to_json() for r in reports],
            "recoveries": [r.to_json() for r in session.recoveries],
            "shrinks": shrinks,
            "grows": grows,
            "joined": joined,
            "generation": session.generation,
            "members": session.members,
            "source": session.source.name,
            "destination": session.destination.name,
        }
