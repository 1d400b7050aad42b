"""An elastic session: repeated refits of one reshard that survive the loss and return of ranks.

Every rank of the reshard (and any joiner) builds an :class:`ElasticSession` and calls
:meth:`ElasticSession.run` (or :meth:`~ElasticSession.refit` per step). A refit is one unit:
it *commits* only when every member of the generation has finished it. When a member fails
(its process exits, its heartbeat stops, an exchange with it fails) or hangs past the
deadline, the survivors

1. notice: every transport wait watches all members' heartbeats and exit notifications,
   so a survivor that is no peer of the failed rank notices as fast as one that is (an
   exit is final; a silent rank is confirmed by one more deadline of silence);
2. settle the step: the first survivor to act writes ``aborted`` into the step's commit
   record (compare-and-set; a step that every member finished stays ``committed``, and
   then the next step is the one aborted, so every survivor ends in the same state);
3. agree on the next generation's members (compare-and-set: one writer per generation);
4. derive the new layouts from the agreed member lists, a pure function every rank
   computes alike: lost ranks leave the source and the destination by their remesh
   policies (default ``drop-replica``), joiners take the destination positions of lost
   ranks (``fill-spares``). Before anything moves, a region of the weights that no
   surviving rank holds stops every survivor with :class:`~elastic.DataLossError`;
5. build the new generation's group at once (gloo: a new group under the generation's
   prefix; NCCL: shrink or grow the communicator) and call the ``on_shrink`` /
   ``on_grow`` hooks;
6. when the destination holds committed weights (a grow between steps) and some rank now
   holds boxes it did not hold, run a *recovery plan* from the surviving inference
   replicas first, then the training side (:func:`layoutlang.plan.plan_recovery`), and
   commit it like a step;
7. retry the aborted step on the new generation.

A failure during any of this (a second failure during recovery) starts the same sequence
again at the next generation, from the last state every member committed. Nothing
restarts: survivors keep their processes and their storages (reused where a rank's boxes
did not change).

A joiner (``join=True``) asks to be admitted; members admit joiners in a step's commit
record (so every member grows after the same step) while the destination has positions
of lost ranks to fill.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from layoutlang.errors import AgreementError, ExecutionError
from layoutlang.model import Layout, Program
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.plan import DEFAULT_BUCKET_BYTES, Plan, plan_layouts, plan_recovery
from layoutlang.runtime import Executor

from .groups import GlooGenerations
from .membership import (
    DEFAULT_DEADLINE,
    DEFAULT_INTERVAL,
    ExcludedError,
    FailureDetector,
    Heartbeat,
    Membership,
    MembershipError,
    failed_peers,
)
from .remesh import check_recoverable, remesh

__all__ = ["Change", "ElasticSession", "GenerationChanged", "MemberFailure", "Recovery", "StepReport"]

StepFn = Callable[[int, "ElasticSession"], Mapping[str, torch.Tensor]]

_COMMITTED, _ABORTED = "committed", "aborted"
_ENTRY = "entry"  # the commit record of entering a generation
# How often a waiting rank reads the store for failures: a tenth of the default deadline,
# few enough requests that the store stays responsive with hundreds of waiting ranks.
_WATCH_PERIOD = 0.1


class MemberFailure(ExecutionError):
    """Members of the current generation failed (``failures``: rank -> reason)."""

    kind = "member-failure"

    def __init__(self, rank: int, generation: int, failures: Mapping[int, str]):
        self.failures = dict(failures)
        described = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        super().__init__(f"rank {rank}: generation {generation} lost members ({described})")


class GenerationChanged(ExecutionError):
    """A newer generation was agreed, or the current step was aborted, while this rank waited."""

    kind = "generation-changed"


@attrs.frozen
class Change:
    """A membership change, as the ``on_shrink`` and ``on_grow`` hooks see it."""

    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...]  # members of the previous generation that are gone
    joined: tuple[int, ...]
    reasons: dict[int, str]  # lost rank -> why this rank counted it as failed
    source: Layout  # the layouts of the new generation
    destination: Layout


@attrs.frozen
class Recovery:
    """One membership change as this rank lived it; times are ``time.time()`` stamps."""

    generation: int
    lost: tuple[int, ...]
    joined: tuple[int, ...]
    reasons: dict[int, str]
    noticed_at: float  # this rank noticed the failure (or the grow decision)
    agreed_at: float  # the new generation's members were agreed
    group_at: float  # its group was built
    first_byte_at: float | None  # the first exchange on the new group completed (None: none yet)
    recovery_moves: int  # moves of the recovery plan (0: none was needed)
    recovered_bytes: int  # bytes this rank received through it

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["reasons"] = {str(k): v for k, v in self.reasons.items()}
        out["lost"], out["joined"] = list(self.lost), list(self.joined)
        return out


@attrs.frozen
class StepReport:
    """One committed refit, on this rank."""

    step: int
    generation: int
    attempts: int
    seconds: float
    received_bytes: int
    members: tuple[int, ...]
    source: str
    destination: str
    recoveries: tuple[Recovery, ...]

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["members"] = list(self.members)
        out["recoveries"] = [r.to_json() for r in self.recoveries]
        return out


@attrs.frozen
class _State:
    """What every member committed last: a generation's layouts and this rank's storages."""

    generation: int
    source: Layout
    destination: Layout
    destinations: dict  # this rank's destination storages
    valid: bool  # the destinations hold the weights of the last committed step


def _same_holdings(old: Layout, new: Layout, rank: int) -> bool:
    """Whether ``rank`` holds the same boxes in the same storages in both layouts."""
    if rank not in old.mesh or rank not in new.mesh:
        return False
    if old.storages_on(rank) != new.storages_on(rank):
        return False
    return all(old.boxes(t, rank) == new.boxes(t, rank) for t in old.tensors)


class ElasticSession:
    """Repeated refits of one reshard over an elastic group (the recovery sequence is
    described in :mod:`elastic.session` and in the failure-recovery guide).

    ``program`` and ``reshard`` name the refit: its source layout is the training side, its
    destination the inference side. ``rank`` is this process's job rank; ``store`` is a
    torch.distributed Store hosted by a process that outlives the workers, also reachable
    as a TCPStore at ``host:port`` (the heartbeat thread opens its own client). The first
    generation's members are ``members`` (default: every rank of both meshes); a
    replacement rank passes ``join=True`` and waits until admitted.

    ``source_policy`` / ``destination_policy`` (and ``source_axis`` / ``destination_axis``)
    are the remesh policies applied when ranks are lost; ``deadline`` is how long a member
    may stay silent before it is suspected (a second deadline of silence confirms it);
    ``timeout`` bounds every wait.
    ``on_shrink(change)`` / ``on_grow(change)`` run on every member of a new generation once
    its group is built. ``backend`` builds each generation's group:
    :class:`~elastic.GlooGenerations` (default) or :class:`~elastic.NcclGenerations`.

    Use it as a context manager (or call :meth:`close`) to stop its heartbeat.
    """

    def __init__(
        self,
        program: Program,
        reshard: str | None = None,
        *,
        rank: int,
        store: Any,
        port: int,
        host: str = "127.0.0.1",
        members: Iterable[int] | None = None,
        join: bool = False,
        namespace: str = "elastic",
        source_policy: str = "drop-replica",
        destination_policy: str = "drop-replica",
        source_axis: str | None = None,
        destination_axis: str | None = None,
        deadline: float = DEFAULT_DEADLINE,
        heartbeat_interval: float = DEFAULT_INTERVAL,
        timeout: float = 60.0,
        memory_budget: int = 2 * DEFAULT_BUCKET_BYTES,
        backend: Any = None,
        on_shrink: Callable[[Change], None] | None = None,
        on_grow: Callable[[Change], None] | None = None,
        device: Any = "cpu",
    ):
        statement = program.reshard(reshard)
        self.program = program
        self.reshard = statement.name
        self.original_source = program.layout(statement.source)
        self.original_destination = program.layout(statement.destination)
        self.domain_size = program.topology.domain_size
        self.bucket_bytes = max(1, memory_budget // 2)
        self.rank = int(rank)
        self.store = store
        self.host, self.port = host, port
        self.policies = {"source": (source_policy, source_axis), "destination": (destination_policy, destination_axis)}
        self.deadline = deadline
        self.timeout = timeout
        self.backend = backend if backend is not None else GlooGenerations(timeout=timeout)
        self.on_shrink, self.on_grow = on_shrink, on_grow
        self.device = torch.device(device)
        self.membership = Membership(store, self.rank, namespace=namespace, deadline=deadline)
        self.heartbeat = Heartbeat(host, port, self.rank, namespace=namespace, interval=heartbeat_interval)
        # Store clients for group builds, opened ahead: connecting a client can take seconds
        # (a TCPStore connection now and then stalls), which must not fall inside a recovery.
        self._build_clients: queue.SimpleQueue = queue.SimpleQueue()
        self._build_clients.put(self._connect())
        self.group: Any = None
        self.transport: Any = None
        self.detector: FailureDetector | None = None
        self.plan: Plan | None = None
        self.executor: Executor | None = None
        self.committed: _State | None = None  # the last state every member committed
        self.committed_step: int | None = None  # the step whose weights the destination holds
        self.next_step = 0
        self.recoveries: list[Recovery] = []
        self.last_report: StepReport | None = None
        self._confirmed: set[int] = set()  # ranks whose silence a second look confirmed
        self._pending: _State | None = None  # the state a generation's entry commits
        self._detector_options: dict[str, Any] = {}
        self._open: str | None = None  # the commit record being worked on: "commit/{s}" or "entry"
        self._step_fn: StepFn | None = None
        self._last_watch = 0.0
        self._closed = False
        try:
            if join:
                self._join()
            else:
                ranks = set(self.original_source.mesh.ranks) | set(self.original_destination.mesh.ranks)
                initial = sorted(ranks if members is None else {int(m) for m in members})
                if self.rank not in initial:
                    raise ExecutionError(
                        f"rank {self.rank} is not a member of the first generation {initial}; "
                        "a replacement rank joins with join=True"
                    )
                self.membership.agree(0, initial)
                empty = _State(-1, self.original_source, self.original_destination, {}, False)
                self._enter(empty, noticed=time.time(), reasons={}, first=True)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- properties
    @property
    def generation(self) -> int:
        return int(self.membership.generation)

    @property
    def members(self) -> list[int]:
        return list(self.membership.members)

    @property
    def source(self) -> Layout:
        """The source (training) layout of the current generation."""
        return self.committed.source

    @property
    def destination(self) -> Layout:
        """The destination (inference) layout of the current generation."""
        return self.committed.destination

    @property
    def destinations(self) -> dict[str, torch.Tensor]:
        """This rank's destination storages (of :attr:`destination`)."""
        return self.committed.destinations

    # ----------------------------------------------------------------- public API
    def run(
        self,
        step_fn: StepFn,
        steps: int,
        *,
        on_step: Callable[[int, ElasticSession], None] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> list[StepReport]:
        """Refit from :attr:`next_step` up to step ``steps - 1``.

        ``step_fn(step, session)`` returns this rank's source storages of ``session.source``
        for ``step`` (``{}`` off the source mesh). It may be asked again for a step that is
        retried, and for the last committed step when a recovery reads the training side.
        ``on_step(step, session)`` runs after each committed refit; ``progress(step, done,
        total)`` after each of the executor's steps.
        """
        reports = []
        while self.next_step < steps:
            step = self.next_step
            reports.append(self.refit(step, step_fn, progress=progress))
            if on_step is not None:
                on_step(step, self)
        return reports

    def refit(self, step: int, step_fn: StepFn, *, progress: Callable[[int, int, int], None] | None = None) -> StepReport:
        """One refit that commits on every member of some generation (the recovery sequence of :mod:`elastic.session`)."""
        begin = time.perf_counter()
        first_recovery = len(self.recoveries)
        attempts, received, joiners = 0, 0, []
        self._step_fn = step_fn
        self._open = f"commit/{step}"
        while True:
            attempts += 1
            try:
                received = self._run_step(step, step_fn, progress)
                outcome = self._commit(self._open)
                if outcome["state"] != _COMMITTED:
                    raise GenerationChanged(f"rank {self.rank}: step {step} was aborted by another member")
            except ExecutionError as err:
                if isinstance(err, (ExcludedError, AgreementError)):
                    raise
                if self._recover(err, step):
                    break  # every member had finished the step before the failure: it stands
                self._open = f"commit/{step}"
                continue
            joiners = outcome.get("joiners") or []
            self._committed_step(step)
            break
        report = StepReport(
            step, self.generation, attempts, time.perf_counter() - begin, received, tuple(self.members),
            self.source.name, self.destination.name, tuple(self.recoveries[first_recovery:]),
        )
        self.last_report = report
        if joiners:
            self._grow(joiners)
        return report

    def close(self) -> None:
        """Stop the heartbeat and give up the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.heartbeat.stop()
        if self.group is not None:
            self.backend.abandon(self.group)

    def __enter__(self) -> ElasticSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------- watching
    def _watch(self) -> None:
        """Raised into every wait: a failed member, a newer generation, an aborted record."""
        now = time.monotonic()
        if now - self._last_watch < _WATCH_PERIOD:
            return
        self._last_watch = now
        failures = self.detector.poll()
        if failures:
            confirmed = self._confirm(set(failures), failures)
            self.detector.forgive(set(failures) - confirmed)
            if confirmed:
                raise MemberFailure(self.rank, self.generation, {r: failures[r] for r in confirmed})
        if self.membership.members_of(self.generation + 1) is not None:
            raise GenerationChanged(f"rank {self.rank}: generation {self.generation + 1} was agreed")
        if self._open is not None and (self._record(self._open) or {}).get("state") == _ABORTED:
            raise GenerationChanged(f"rank {self.rank}: {self._open} of generation {self.generation} was aborted")

    def _record(self, name: str) -> dict | None:
        key = self.membership.key(self.generation, name)
        if not self.membership.store.check([key]):
            return None
        return json.loads(bytes(self.membership.store.get(key)).decode())

    def _decide(self, name: str, record: dict) -> dict:
        """Compare-and-set a commit record of this generation; returns the winning record."""
        key = self.membership.key(self.generation, name)
        return json.loads(bytes(self.membership.store.compare_set(key, "", json.dumps(record).encode())).decode())

    def _commit(self, name: str) -> dict:
        """Wait (watching) until every member has finished ``name``; the record decides."""
        store = self.membership.store
        done = self.membership.key(self.generation, f"done/{name}")
        store.add(done, 1)
        end = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            record = self._record(name)
            if record is not None:
                return record
            if int(store.add(done, 0)) >= len(self.members):
                joiners = self._admissible_joiners() if name.startswith("commit/") else []
                return self._decide(name, {"state": _COMMITTED, "joiners": joiners})
            if time.monotonic() > end:
                raise MemberFailure(self.rank, self.generation, {})
            self._watch()
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    # ---------------------------------------------------------------------- steps
    def _run_step(self, step: int, step_fn: StepFn, progress) -> int:
        if self.executor is None:
            return 0
        sources = step_fn(step, self) if self.rank in self.source.mesh else {}
        report = self.executor.run(
            sources, self.destinations, progress=None if progress is None else lambda n, total: progress(step, n, total)
        )
        last = self.recoveries[-1] if self.recoveries else None
        if last is not None and last.first_byte_at is None and last.generation == self.generation:
            self.recoveries[-1] = attrs.evolve(last, first_byte_at=getattr(self.transport, "first_completed_at", None))
        return sum(report.received.values()) - report.received["local"]

    def _committed_step(self, step: int) -> None:
        self.committed_step = step
        self.next_step = step + 1
        self.committed = attrs.evolve(self.committed, valid=True)
        self._open = None

    def _admissible_joiners(self) -> list[int]:
        """Joiners asking for the next generation: as many as the destination has lost positions."""
        replaced = self._replacements(self.generation)
        members = set(self.members)
        open_positions = [r for r in self.original_destination.mesh.ranks if r not in members and r not in replaced]
        joiners = [j for j in self.membership.join_requests(self.generation + 1) if j not in members]
        return sorted(joiners)[: len(open_positions)]

    # ------------------------------------------------------------------- recovery
    def _recover(self, trigger: ExecutionError, step: int | None) -> bool:
        """Move to the next generation after ``trigger``. Returns True when the open step
        turned out committed (every member had finished it before the failure)."""
        noticed = time.time()
        reasons = dict(getattr(trigger, "failures", {}) or {})
        if not isinstance(trigger, (MemberFailure, GenerationChanged)):
            reasons.update(failed_peers(trigger, self.detector))
        step_committed = False
        while True:
            self._settle(step)
            if self._open is None and step is not None and self.committed_step == step:
                step_committed = True
            g = self.generation + 1
            members = self.membership.members_of(g)
            if members is None:
                members = self._propose(g, reasons)
            self.membership.enter(g, members)  # ExcludedError: the survivors left this rank out
            self.heartbeat.set_generation(g)
            try:
                self._enter(self.committed, noticed=noticed, reasons=reasons)
            except ExecutionError as err:
                if isinstance(err, (ExcludedError, AgreementError)):
                    raise
                noticed = time.time()
                reasons = dict(getattr(err, "failures", {}) or {})
                continue
            return step_committed

    def _settle(self, step: int | None) -> None:
        """Decide the open commit record of this generation, the same way on every member.

        Compare-and-set ``aborted``: the record ends ``committed`` only if every member had
        finished. A committed step or entry lets members go on to the next step (unless the
        step admitted joiners: then everyone grows first), so that next step is aborted too,
        and the destinations, possibly half rewritten by it, no longer count as valid.
        """
        if self._open is None:
            return
        name, self._open = self._open, None
        outcome = self._decide(name, {"state": _ABORTED})
        if outcome["state"] == _ABORTED:
            if name != _ENTRY:  # a step half done: only its source holds its weights
                self.committed = attrs.evolve(self.committed, valid=False)
            return
        if name == _ENTRY:
            self.committed = self._pending
        else:
            self._committed_step(step)
            if outcome.get("joiners"):
                return  # every member grows before any next step: the destinations stay valid
        self._decide(f"commit/{self.next_step}", {"state": _ABORTED})
        self.committed = attrs.evolve(self.committed, valid=False)

    def _propose(self, generation: int, reasons: dict[int, str]) -> list[int]:
        """The next members: without the failed ones, found within about two deadlines."""
        failed = set(reasons) | set(self.detector.poll())
        end = time.monotonic() + 2 * self.deadline
        while not failed and time.monotonic() < end:
            members = self.membership.members_of(generation)
            if members is not None:
                return members
            failed = set(self.detector.poll())
            time.sleep(0.02)
        for rank, why in self.detector.failures.items():
            reasons.setdefault(rank, why)
        failed = self._confirm(failed, reasons)
        # Nobody found failed (a transient error): the next generation keeps every member.
        return self.membership.propose(generation, [m for m in self.members if m not in failed])

    def _confirm(self, suspects: set[int], reasons: dict[int, str]) -> set[int]:
        """The suspects that really failed. An exit is final; silence is not: on a machine
        stalled for a moment (an overloaded host) every heartbeat pauses at once, so a rank
        suspected for silence is watched afresh for one more deadline, and stays a member
        if its heartbeat advances."""
        final = {
            r for r in suspects
            if r in self._confirmed
            or reasons.get(r, "").startswith(("its process exited", "heartbeat did not advance"))
        }  # an exit, or silence that a check already confirmed
        silent = sorted(r for r in suspects - final if r in self.members)
        if not silent:
            return final
        fresh = self.membership.detector(**self._detector_options)
        still = fresh.check(silent)
        for rank in set(silent) - set(still):
            reasons.pop(rank, None)
        self._confirmed |= set(still)
        return final | set(still)

    def _grow(self, joiners: list[int]) -> None:
        """Admit ``joiners`` after the committed step (every member does this at the same step)."""
        noticed = time.time()
        g = self.generation + 1
        resume = self.membership.key(g, "resume")  # where a joiner learns the step to refit next
        self.membership.store.set(resume, json.dumps({"step": self.next_step}).encode())
        members = self.membership.propose(g, self.members + list(joiners))
        self.membership.enter(g, members)
        self.heartbeat.set_generation(g)
        try:
            self._enter(self.committed, noticed=noticed, reasons={})
        except ExecutionError as err:
            if isinstance(err, (ExcludedError, AgreementError)):
                raise
            self._recover(err, None)

    def _join(self) -> None:
        """Joiner side: ask to be admitted; wait for a generation that includes this rank."""
        end = time.monotonic() + self.timeout
        requested = None
        while True:
            latest = self.membership.latest() or 0
            if requested is None or latest >= requested:
                members = self.membership.members_of(requested) if requested is not None else None
                if members is not None and self.rank in members:
                    break
                requested = latest + 1
                self.membership.request_join(requested)
            if time.monotonic() > end:
                raise MembershipError(f"rank {self.rank}: not admitted into any generation within {self.timeout:g} s")
            time.sleep(0.02)
        resume_key = self.membership.key(requested, "resume")
        self.membership.store.wait([resume_key], _timedelta(self.timeout))
        self.next_step = json.loads(bytes(self.membership.store.get(resume_key)).decode())["step"]
        self.committed_step = self.next_step - 1
        previous = requested - 1
        source, destination = self._layouts(previous)
        # the members' committed state: this rank holds nothing of it yet
        self.committed = _State(previous, source, destination, {}, True)
        self.membership.enter(requested, members)
        self.heartbeat.set_generation(requested)
        try:
            self._enter(self.committed, noticed=time.time(), reasons={})
        except ExecutionError as err:  # a failure while this rank was being admitted
            if isinstance(err, (ExcludedError, AgreementError)):
                raise
            self._recover(err, None)

    # ------------------------------------------------------------ layouts, groups
    def _replacements(self, generation: int) -> dict[int, int]:
        """Lost destination rank -> the joiner in its place, after ``generation``: a pure
        function of the agreed member lists (joiners fill open positions in mesh order)."""
        replaced: dict[int, int] = {}
        before = self.membership.members_of(0) or []
        for g in range(1, generation + 1):
            after = self.membership.members_of(g) or []
            lost = set(before) - set(after)
            for position, joiner in list(replaced.items()):
                if joiner in lost:
                    del replaced[position]
            joined = sorted(set(after) - set(before))
            open_positions = [r for r in self.original_destination.mesh.ranks if r not in after and r not in replaced]
            replaced.update(zip(open_positions, joined))
            before = after
        return replaced

    def _layouts(self, generation: int) -> tuple[Layout, Layout]:
        """The source and destination layouts of ``generation`` (pure: see the module doc)."""
        members = set(self.membership.members_of(generation) or [])
        replaced = self._replacements(generation)
        source, destination = self.original_source, self.original_destination
        if replaced:
            hit = [r for r in destination.mesh.ranks if r in replaced]
            destination = remesh(
                destination, hit, "fill-spares", spares=[replaced[r] for r in hit],
                name=f"{destination.name}_gen{generation}", mesh_name=f"{destination.mesh.name}_gen{generation}",
            )
        out = []
        for side, layout, base in (("source", source, self.original_source), ("destination", destination, self.original_destination)):
            gone = [r for r in layout.mesh.ranks if r not in members]
            if gone:
                policy, axis = self.policies[side]
                layout = remesh(
                    layout, gone, policy, axis=axis,
                    name=f"{base.name}_gen{generation}", mesh_name=f"{base.mesh.name}_gen{generation}",
                )
            out.append(layout)
        return out[0], out[1]

    def _connect(self) -> Any:
        import torch.distributed as dist

        return dist.TCPStore(self.host, self.port, is_master=False, timeout=_timedelta(self.timeout))

    def _refill(self) -> None:
        """Open a build client in the background, for the next build."""
        threading.Thread(target=lambda: self._build_clients.put(self._connect()), daemon=True).start()

    def _build(self, previous_group: Any) -> Any:
        """Build the generation's group while watching its members: a member that fails
        during the rendezvous ends it at once instead of after the group's timeout.

        The build runs in a thread with a store client of its own: a client holds its lock
        for the whole of a blocking wait, so a shared one would stop the watch until the
        rendezvous timed out. A build given up on is abandoned when it finishes, and its
        client (perhaps still waiting) is replaced."""
        result: dict[str, Any] = {}
        given_up = threading.Event()
        membership = self.membership
        try:
            client = self._build_clients.get_nowait()
        except queue.Empty:
            client = self._connect()

        def target() -> None:
            try:
                group = self.backend.build(client, membership, previous_group, timeout=self.timeout)
                result["group"] = group
                if given_up.is_set():
                    self.backend.abandon(group)
            except BaseException as err:  # handed to the waiting thread
                result["error"] = err

        thread = threading.Thread(target=target, name=f"elastic-build-{self.rank}", daemon=True)
        thread.start()
        end = time.monotonic() + self.timeout
        try:
            while thread.is_alive():
                thread.join(0.01)
                if thread.is_alive():
                    self._watch()
                    if time.monotonic() > end:
                        raise MemberFailure(self.rank, self.generation, {})
        except BaseException:
            given_up.set()
            if "group" in result:  # finished just now: abandoning twice is harmless
                self.backend.abandon(result["group"])
            self._refill()
            raise
        self._build_clients.put(client)
        if "error" in result:
            raise result["error"]
        return result["group"]

    def _enter(self, state: _State, *, noticed: float, reasons: dict[int, str], first: bool = False) -> None:
        """Enter the current generation from the committed ``state`` (module doc, steps 4-6).

        The entry commits like a step (record ``entry``): no member refits in a generation
        before every member has entered it, so a failure during entry leaves every member
        at the same committed state.
        """
        g, members = self.generation, self.members
        self._open = _ENTRY
        previous_members = self.membership.members_of(state.generation) if state.generation >= 0 else members
        lost = tuple(sorted(set(previous_members) - set(members)))
        joined = tuple(sorted(set(members) - set(previous_members)))
        gone = sorted((set(state.source.mesh.ranks) | set(state.destination.mesh.ranks)) - set(members))
        # Never silent loss: the source holds the weights of the step being refit; a valid
        # destination holds those of the last committed step too.
        check_recoverable([state.destination, state.source] if state.valid else [state.source], gone)
        source, destination = self._layouts(g)
        agreed = time.time()
        self._detector_options = {
            "previous": state.generation if state.generation >= 0 else None,
            "startup": self.timeout if first or joined else None,  # ranks still starting up
        }
        self.detector = self.membership.detector(**self._detector_options)
        previous_group = self.group
        self.group = self._build(previous_group)
        if previous_group is not None:
            self.backend.abandon(previous_group)
        group_at = time.time()
        self.transport = self.group.transport(watch=self._watch)
        change = Change(g, tuple(members), lost, joined, dict(reasons), source, destination)
        if lost and self.on_shrink is not None:
            self.on_shrink(change)
        if joined and self.on_grow is not None:
            self.on_grow(change)

        moves = recovered = 0
        destinations = self._allocate(destination, state)
        if state.valid and not all(_same_holdings(state.destination, destination, r) for r in destination.mesh.ranks):
            moves, recovered = self._run_recovery(state, destination, destinations, gone)
        self._pending = _State(g, source, destination, destinations, state.valid)
        outcome = self._commit(_ENTRY)
        if outcome["state"] != _COMMITTED:
            raise GenerationChanged(f"rank {self.rank}: entering generation {g} was aborted")
        self._open = None
        self.committed = self._pending
        self._compile()
        if not first:
            self.recoveries.append(
                Recovery(
                    g, lost, joined, dict(reasons), noticed, agreed, group_at,
                    getattr(self.transport, "first_completed_at", None), moves, recovered,
                )
            )

    def _allocate(self, layout: Layout, state: _State) -> dict[str, torch.Tensor]:
        """This rank's storages of ``layout``: the committed ones where its boxes did not change."""
        if self.rank not in layout.mesh:
            return {}
        if _same_holdings(state.destination, layout, self.rank) and state.destinations:
            return dict(state.destinations)
        out = {}
        for name, shape in layout.storages_on(self.rank).items():
            dtype = torch_dtype(layout.tensors[layout.storage(name, self.rank).parts[0]].dtype)
            out[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return out

    def _run_recovery(self, state: _State, destination: Layout, destinations: dict, gone: list[int]) -> tuple[int, int]:
        """``destination`` from the surviving inference replicas first, then the training side."""
        plan = plan_recovery(
            [state.destination, state.source], destination, gone,
            name=f"recover {destination.name}", domain_size=self.domain_size, bucket_bytes=self.bucket_bytes,
        )
        if self.rank not in plan.destination.mesh and not any(self.rank in s.mesh for s in plan.sources):
            return plan.num_moves, 0  # a member in no layout (a spare) has no part in it
        executor = Executor(plan, self.rank, self.transport, timeout=self.timeout)
        training: Mapping[str, torch.Tensor] = {}
        if executor.reads_source(1):
            training = self._step_fn(self.committed_step, self)
        report = executor.run([state.destinations, training], destinations)
        return plan.num_moves, sum(report.received.values()) - report.received["local"]

    def _compile(self) -> None:
        """The refit plan of the current layouts, and this rank's executor."""
        self.plan = plan_layouts(
            self.source, self.destination, name=self.reshard, domain_size=self.domain_size,
            bucket_bytes=self.bucket_bytes,
        )
        participants = set(self.source.mesh.ranks) | set(self.destination.mesh.ranks)
        self.executor = (
            Executor(self.plan, self.rank, self.transport, timeout=self.timeout) if self.rank in participants else None
        )


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
