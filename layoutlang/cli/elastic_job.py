"""``layoutlang apply --elastic``: repeated refits that survive rank loss and replacement.

Every rank runs :func:`refit_job`: an :class:`~elastic.ElasticSession` over the program's
reshard that refits ``steps`` times, with synthetic weights that differ per step, and
verifies every destination byte after every committed step. Faults are injected from
inside the job, where they hurt most (``faults``: ``(rank, step, how)``):

- ``kill`` / ``stop``: the rank SIGKILLs (SIGSTOPs) itself halfway through the executor
  steps of that refit: in the middle of a transfer;
- ``on-shrink``: the rank SIGKILLs itself in the shrink hook, i.e. during a recovery;
- ``signal``: the rank (a spare member in no layout) SIGKILLs itself when rank
  ``trigger`` is halfway through that step's transfer: the failed rank is no peer of
  anyone's transfer.

Replacement ranks (``joiners``) ask to be admitted and take the positions of lost
inference ranks. :func:`run_local` starts the job on local worker processes (the embedded
default; the launcher hosts the store and watches the workers' exits); under torchrun,
:func:`run_torchrun` joins the agent's store.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from elastic import Change, ElasticSession
from elastic.membership import ExitWatcher

from .. import lang
from ..errors import DataLossError, LayoutError, RuntimeFailure
from ..io.torch_dtypes import torch_dtype
from ..io.weights import fill_synthetic, verify
from .apply_job import participants_of
from .launch import LocalWorkers, worker_context

__all__ = ["FAULTS", "ElasticOptions", "refit_job", "run_local", "run_torchrun", "summarize"]

FAULTS = ("kill", "stop", "on-shrink", "signal")


@attrs.frozen
class ElasticOptions:
    """What ``layoutlang apply --elastic`` runs."""

    path: str
    steps: int = 4
    reshard: str | None = None
    faults: tuple[tuple[int, int, str], ...] = ()
    replace: bool = False  # a replacement rank joins for every rank killed
    memory_budget: int = 512 * 2**20
    timeout: float = 60.0
    deadline: float = 1.0
    source_policy: str = "drop-replica"
    destination_policy: str = "drop-replica"
    source_axis: str | None = None
    destination_axis: str | None = None


def _die(how: str) -> None:
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    time.sleep(60)  # a stopped process gets here only when continued


def synthetic_sources(step: int, session: ElasticSession) -> dict[str, torch.Tensor]:
    """This rank's source storages holding the synthetic weights of ``step``."""
    layout, rank = session.source, session.rank
    storages = {
        name: torch.zeros(shape, dtype=torch_dtype(layout.tensors[layout.storage(name, rank).parts[0]].dtype))
        for name, shape in layout.storages_on(rank).items()
    }
    fill_synthetic(layout, rank, storages, version=step)
    return storages


class _Faults:
    """The faults this rank injects into its own refits (see the module doc)."""

    def __init__(self, rank: int, faults: Sequence[tuple[int, int, str]], trigger: int | None, ctl: Any):
        self.rank, self.trigger, self.ctl = rank, trigger, ctl
        self.signal_steps = {step for _, step, how in faults if how == "signal"}
        self.mine = {how: step for r, step, how in faults if r == rank}

    def die(self, how: str, client: Any = None) -> None:
        """Stamp the failure (the summary measures from it), then SIGKILL or SIGSTOP this rank."""
        (self.ctl if client is None else client).set(f"failed/{self.rank}", f"{time.time()!r} {how}")
        _die(how)

    def progress(self, step: int, done: int, total: int) -> None:
        """Halfway through a step's transfer: signal a spare, or die, as the faults say."""
        if done != max(1, total // 2):
            return
        if self.rank == self.trigger and step in self.signal_steps:
            self.ctl.set("signal", str(time.time()))
        for how in ("kill", "stop"):
            if self.mine.get(how) == step:
                self.die(how)

    def in_shrink(self) -> None:
        if "on-shrink" in self.mine:
            self.die("kill")

    def watch_for_signal(self, namespace: str, host: str, port: int) -> None:
        """A spare that dies on the trigger's signal waits for it in a thread of its own."""
        if "signal" not in self.mine:
            return

        def wait_for_signal() -> None:
            # a store client of its own: one client is never shared between threads
            own = dist.PrefixStore(f"{namespace}-ctl", dist.TCPStore(host, port, is_master=False))
            own.wait(["signal"])
            self.die("kill", own)

        threading.Thread(target=wait_for_signal, daemon=True).start()


@attrs.define
class _Seen:
    """What the job saw on this rank: the generations it shrank and grew into, and every
    committed step, verified where this rank holds destination storages."""

    rank: int
    shrinks: list[int] = attrs.Factory(list)
    grows: list[int] = attrs.Factory(list)
    checked: list[dict] = attrs.Factory(list)

    def on_step(self, step: int, session: ElasticSession) -> None:
        committed = session.last_report  # the generation the step committed in (a grow may follow)
        assert committed is not None  # on_step runs after the step's refit committed
        result = {"step": step, "generation": committed.generation, "destination": committed.destination}
        if self.rank in session.destination.mesh:
            v = verify(session.destination, self.rank, session.destinations, version=step)
            result.update(ok=v.ok, bytes=v.bytes, mismatches=list(v.mismatches))
        self.checked.append(result)


def refit_job(
    text_or_path: str,
    steps: int,
    *,
    namespace: str,
    rank: int | None = None,
    store: Any = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    members: Sequence[int] | None = None,
    joiners: Sequence[int] = (),
    faults: Sequence[tuple[int, int, str]] = (),
    trigger: int | None = None,
    idle: Sequence[int] = (),
    deadline: float = 1.0,
    memory_budget: int = 8192,
    timeout: float = 40.0,
    **options: Any,
) -> dict:
    """Run ``steps`` refits on this rank; returns what it saw (JSON-ready).

    ``text_or_path`` is a .layout file or program text. In a local worker, ``rank``,
    ``store`` and ``port`` default to the worker's.
    """
    rank = worker_context["rank"] if rank is None else rank
    store = worker_context["store"] if store is None else store
    port = worker_context["port"] if port is None else port
    if rank in idle:
        return {"rank": rank, "idle": True}
    program = lang.load(text_or_path) if os.path.exists(text_or_path) else lang.loads(text_or_path)
    injected = _Faults(rank, faults, trigger, dist.PrefixStore(f"{namespace}-ctl", store))
    injected.watch_for_signal(namespace, host, port)
    seen = _Seen(rank)

    def on_shrink(change: Change) -> None:
        seen.shrinks.append(change.generation)
        injected.in_shrink()

    base = {"rank": rank, "checked": seen.checked}
    try:
        session = ElasticSession(
            program, rank=rank, store=store, port=port, host=host, members=members, join=rank in joiners,
            namespace=namespace, deadline=deadline, timeout=timeout, memory_budget=memory_budget,
            on_shrink=on_shrink, on_grow=lambda change: seen.grows.append(change.generation), **options,
        )
    except (LayoutError, RuntimeFailure) as err:  # a bad option, or no first generation
        return base | {"error": str(err), "kind": err.kind}
    with session:
        joined = _joined(session) if rank in joiners else {}
        try:
            reports = session.run(synthetic_sources, steps, on_step=seen.on_step, progress=injected.progress)
        except (LayoutError, RuntimeFailure) as err:  # not recovered from: data loss, exclusion...
            lost = err.regions if isinstance(err, DataLossError) else []
            regions = [[t, list(o), list(s)] for t, o, s in lost]
            return base | {"error": str(err), "kind": err.kind, "regions": regions}
        return base | {
            "reports": [r.to_json() for r in reports],
            "recoveries": [r.to_json() for r in session.recoveries],
            "shrinks": seen.shrinks,
            "grows": seen.grows,
            "joined": joined,
            "generation": session.generation,
            "members": session.members,
            "source": session.source.name,
            "destination": session.destination.name,
        }


def _joined(session: ElasticSession) -> dict:
    """What the recovery plan gave a joiner: the weights of the last committed step, verified."""
    rank, step = session.rank, session.committed_step  # a joiner is admitted after a committed step
    if rank not in session.destination.mesh or step is None:
        return {}
    v = verify(session.destination, rank, session.destinations, version=step)
    return {"step": step, "ok": v.ok, "bytes": v.bytes, "mismatches": list(v.mismatches)}


# ------------------------------------------------------------------- launching


def _ranks(options: ElasticOptions) -> tuple[list[int], list[int]]:
    """(the reshard's ranks, the replacement ranks that join after them)."""
    participants = participants_of(options.path, options.reshard)
    killed = [r for r, _, how in options.faults if how in ("kill", "stop", "on-shrink")]
    first = max(participants) + 1
    return participants, list(range(first, first + len(killed))) if options.replace else []


def _job_arguments(options: ElasticOptions, namespace: str, joiners: Sequence[int], idle: Sequence[int]) -> dict:
    """The keyword arguments of :func:`refit_job` that ``options`` decides."""
    return {
        "namespace": namespace, "reshard": options.reshard, "joiners": joiners, "faults": options.faults,
        "idle": idle, "deadline": options.deadline, "memory_budget": options.memory_budget,
        "timeout": options.timeout, "source_policy": options.source_policy,
        "destination_policy": options.destination_policy, "source_axis": options.source_axis,
        "destination_axis": options.destination_axis,
    }


def _failed_times(store: Any, namespace: str, ranks: Sequence[int]) -> dict[int, tuple[float, str]]:
    """When and how each of ``ranks`` failed (the stamp it wrote just before), if it did."""
    ctl = dist.PrefixStore(f"{namespace}-ctl", store)
    out = {}
    for rank in ranks:
        if ctl.check([f"failed/{rank}"]):
            when, how = bytes(ctl.get(f"failed/{rank}")).decode().split()
            out[rank] = (float(when), how)
    return out


def run_local(options: ElasticOptions, namespace: str = "apply") -> dict:
    """Start one local worker per rank (and per replacement), run, and summarize."""
    participants, joiners = _ranks(options)
    size = max(participants + joiners) + 1
    idle = [r for r in range(size) if r not in participants and r not in joiners]
    failing = {r for r, _, how in options.faults}
    with LocalWorkers(size, timeout=options.timeout) as pool:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=namespace):
            pool.submit(refit_job, options.path, options.steps, **_job_arguments(options, namespace, joiners, idle))
            results: dict[int, dict] = {}
            end = time.monotonic() + options.timeout * (options.steps + 2)
            expected = set(participants + joiners) - failing
            while not expected <= set(results) and time.monotonic() < end:
                try:
                    rank, ok, value = pool._results.get(timeout=0.2)
                except queue.Empty:
                    if all(not p.is_alive() for r, p in enumerate(pool.processes) if r in expected - set(results)):
                        break
                    continue
                results[rank] = value if ok else {"rank": rank, "error": value[1], "kind": value[2]}
            failed = _failed_times(pool.store, namespace, sorted(failing))
        for rank, process in enumerate(pool.processes):  # a stopped rank is not waited for
            if rank in failing and process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)
    return summarize(options, results, failed, participants, joiners)


def run_torchrun(options: ElasticOptions, namespace: str = "apply") -> dict | None:
    """Join a torchrun job: the store is torchrun's (the agent's, or MASTER_ADDR:MASTER_PORT).

    Each rank writes its report into the store; the lowest rank of the final generation
    waits for the others' and returns the summary (the others return None). Recovery never
    goes through torchrun's restart: launch with ``--max-restarts 0`` and one agent per
    node, so that the loss of a node leaves the other agents running.
    """
    rank = int(os.environ["RANK"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=options.timeout))
    participants, joiners = _ranks(options)
    world = int(os.environ["WORLD_SIZE"])
    idle = [r for r in range(world) if r not in participants and r not in joiners]
    result = refit_job(
        options.path, options.steps, rank=rank, store=store, port=port, host=host,
        **_job_arguments(options, namespace, joiners, idle),
    )
    reports = dist.PrefixStore(f"{namespace}-reports", store)
    reports.set(str(rank), json.dumps(result))
    final = result.get("members")
    if not final or rank != min(final):
        return None
    results = {}
    for r in final:
        reports.wait([str(r)], timedelta(seconds=options.timeout))
        results[r] = json.loads(bytes(reports.get(str(r))).decode())
    failing = sorted({r for r, _, _ in options.faults})
    return summarize(options, results, _failed_times(store, namespace, failing), participants, joiners)


# --------------------------------------------------------------------- summary


def summarize(
    options: ElasticOptions,
    results: dict[int, dict],
    failed: dict[int, tuple[float, str]],
    participants: Sequence[int],
    joiners: Sequence[int],
) -> dict:
    """What the job did: per step, the generation and the verified bytes; per recovery, its
    timeline measured from the failure (the failed rank's own clock stamp, same machine)."""
    errors = {r: v for r, v in results.items() if "error" in v}
    done = {r: v for r, v in results.items() if "error" not in v and not v.get("idle")}
    steps = _steps(results)
    joined = {str(r): v["joined"] for r, v in done.items() if v.get("joined")}
    ok = (
        not errors
        and bool(steps)
        and all(not s["mismatches"] for s in steps.values())
        and max(steps) == options.steps - 1
        and all(j["ok"] for j in joined.values())
    )
    final = next(iter(done.values()), {})
    return {
        "ok": ok,
        "steps": [steps[s] for s in sorted(steps)],
        "recoveries": _timeline(done, failed),
        "joined": joined,  # what each replacement received by the recovery plan, verified
        "failed": {str(r): {"at": t, "how": how} for r, (t, how) in failed.items()},
        "errors": {str(r): {"kind": v.get("kind"), "message": v["error"]} for r, v in errors.items()},
        "generation": final.get("generation"),
        "members": final.get("members"),
        "source": final.get("source"),
        "destination": final.get("destination"),
        "participants": list(participants),
        "joiners": list(joiners),
    }


def _steps(results: dict[int, dict]) -> dict[int, dict]:
    """Step -> its generation, destination and the bytes the ranks verified."""
    steps: dict[int, dict] = {}
    for value in results.values():  # steps committed before an error count too
        for c in value.get("checked", []):
            entry = steps.setdefault(
                c["step"], {"step": c["step"], "generation": c["generation"], "destination": c["destination"],
                            "verified_bytes": 0, "mismatches": [], "ranks": 0},
            )
            if "ok" in c:
                entry["verified_bytes"] += c["bytes"]
                entry["mismatches"] += c["mismatches"]
                entry["ranks"] += 1
    return steps


def _timeline(done: dict[int, dict], failed: dict[int, tuple[float, str]]) -> list[dict]:
    """Every recovery, its phases in seconds from the failure (or from the grow decision)."""
    recoveries: dict[int, dict] = {}
    first_failure = min((t for t, _ in failed.values()), default=None)
    for value in done.values():
        for rec in value.get("recoveries", []):
            entry = recoveries.setdefault(
                rec["generation"], {"generation": rec["generation"], "lost": rec["lost"], "joined": rec["joined"],
                                    "reasons": {}, "noticed": [], "agreed": [], "group": [], "first_byte": [],
                                    "recovered_bytes": 0},
            )
            entry["reasons"].update(rec["reasons"])
            for key, field in (("noticed", "noticed_at"), ("agreed", "agreed_at"), ("group", "group_at"),
                               ("first_byte", "first_byte_at")):
                if rec[field] is not None:
                    entry[key].append(rec[field])
            entry["recovered_bytes"] += rec["recovered_bytes"]
    timeline = []
    for entry in sorted(recoveries.values(), key=lambda e: e["generation"]):
        failures = [failed[r][0] for r in entry["lost"] if r in failed]
        origin = min(failures) if failures else min(entry["noticed"], default=first_failure)
        out = {k: entry[k] for k in ("generation", "lost", "joined", "reasons", "recovered_bytes")}
        for key in ("noticed", "agreed", "group", "first_byte"):
            out[f"{key}_s"] = (min(entry[key]) - origin) if entry[key] and origin is not None else None
        out["from"] = "failure" if failures else "decision"
        timeline.append(out)
    return timeline
