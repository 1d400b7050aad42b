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
   holds boxes it did not hold, run a *recovery plan* for those ranks alone, from the
   surviving inference replicas first, then the training side
   (:func:`layoutlang.plan.refill.plan_refill`), and commit it like a step;
7. retry the aborted step on the new generation.

A failure during any of this (a second failure during recovery) starts the same sequence
again at the next generation, from the last state every member committed. Nothing
restarts: survivors keep their processes and their storages (reused where a rank's boxes
did not change).

A joiner (``join=True``) asks to be admitted; members admit joiners in a step's commit
record (so every member grows after the same step) while the destination has positions
of lost ranks to fill.

The parts: :mod:`elastic.commit` (the commit records of steps and generations),
:mod:`elastic.recovery` (steps 1-6: watch, settle, agree, remesh, rebuild, recovery
plans; the :class:`~elastic.Recovery` timeline) and this module, the public session
(refits, retries, hooks).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from layoutlang.errors import DataLossError, ExecutionError, LayoutValueError
from layoutlang.model import Layout, Program
from layoutlang.plan import DEFAULT_BUCKET_BYTES, Plan
from layoutlang.plan.data import layout_digest
from layoutlang.plan.loss import lost_regions
from layoutlang.runtime.agreement import AGREEMENT_TAG, agree
from layoutlang.runtime.delta import DeltaOptions, DeltaReport

from .auth import JobSecret, establish_job
from .commit import COMMITTED, step_record
from .groups import GlooGenerations
from .membership import (
    ASKING,
    DEFAULT_DEADLINE,
    DEFAULT_INTERVAL,
    GenerationChanged,
    Heartbeat,
    MemberFailure,
    Membership,
)
from .recovery import Change, GroupBuilder, Recoverer, Recovery, RefitSpec, per_rank_plans, recoverable

__all__ = ["ElasticSession", "StepFn", "StepReport"]

#: ``step_fn(step, session)``: this rank's source storages of ``session.source`` for ``step``.
StepFn = Callable[[int, "ElasticSession"], Mapping[str, torch.Tensor]]
#: ``progress(step, done, total)``: after each of the executor's steps.
Progress = Callable[[int, int, int], None]


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
    #: a delta session's report of the try that committed (None: dense refits)
    delta: DeltaReport | None = None

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["members"] = list(self.members)
        out["recoveries"] = [r.to_json() for r in self.recoveries]
        if self.delta is None:
            del out["delta"]
        else:
            out["delta"] = attrs.asdict(self.delta)
        return out


class ElasticSession:
    """Repeated refits of one reshard over an elastic group (the recovery sequence is
    described in :mod:`elastic.session` and in the failure-recovery guide).

    ``program`` and ``reshard`` name the refit: its source layout is the training side, its
    destination the inference side. ``rank`` is this process's job rank; ``store`` is a
    torch.distributed Store hosted by a process that outlives the workers, also reachable
    as a TCPStore at ``host:port`` (the heartbeat thread opens its own client). The first
    generation's members are ``members`` (default: every rank of both meshes); one that never
    starts its session stops the others after ``timeout`` with
    :class:`~elastic.MemberFailure` naming it ("rank 3 never joined generation 0 within 8 s
    ..."). A replacement rank passes ``join=True`` and waits until admitted.

    ``source_policy`` / ``destination_policy`` (and ``source_axis`` / ``destination_axis``)
    are the remesh policies applied when ranks are lost; ``deadline`` is how long a member
    may stay silent before it is suspected (a second deadline of silence confirms it);
    ``timeout`` bounds every wait. When the destination policy cannot give up a lost
    position (every replica lost a rank, or ``fill-spares``), the recovery admits joiners
    into it and fills them from any surviving holder, the training side included; it waits
    up to ``spare_wait`` seconds (default ``timeout``) for enough joiners to ask, then
    fails with the positions it could not fill. ``spares=False``: a recovery admits nobody;
    joiners wait for the next step boundary (a fleet of engines, whose joiners take part in
    refits only from a step boundary on). A joiner waits up to ``join_timeout`` seconds
    (default ``timeout``) to be admitted.
    ``on_shrink(change)`` / ``on_grow(change)`` run on every member of a new generation once
    its group is built. ``backend`` builds each generation's group:
    :class:`~elastic.GlooGenerations` (default) or :class:`~elastic.NcclGenerations`.

    ``unit_axis`` names the destination axis whose coordinates are *units* (one inference
    engine each): a failed rank takes the rest of its unit with it (vLLM stops an engine
    whose worker died), joiners are admitted a whole unit at a time, and with ``grow`` the
    joiners beyond the open positions add coordinates to that axis (the fleet grows past its
    first size). It must be the destination mesh's first axis and data-parallel. A member
    leaves on purpose with :meth:`leave` (the unit axis shrinks). The source policy
    ``await-rejoin`` drops a lost source rank's replica where another replica holds the same
    shards (HSDP: the refits go on from it), and otherwise keeps its position vacant until a
    new process under the same rank joins and the members :meth:`admit` it; meanwhile
    :meth:`refit` raises :class:`~layoutlang.errors.DataLossError` and the destination keeps
    its last committed step. A source rank that comes back is admitted after a step too.

    ``problem`` is what this rank found wrong before the first generation (an engine that
    does not hold the destination layout): every member's constructor raises
    :class:`~layoutlang.errors.AgreementError` naming it, before a byte moves. A joiner's
    program must be the session's (a digest recorded by the first generation).

    ``secret`` is the job's secret (a :class:`~elastic.auth.JobSecret`, bytes, or text as in
    the environment variable; default: ``LAYOUTLANG_JOB_SECRET``, which the local launcher
    sets for its workers): it signs and checks the membership, commit and join records, so
    a process without it can neither forge a decision nor join (the failure-recovery
    guide's security model).

    ``delta=True`` (or ``"digests"``: senders keep a digest per block, not a copy): every
    refit sends only what changed since the version each receiver holds
    (:ref:`delta-refits`); the first refit of each generation moves dense (a new generation's
    group and plans start without versions), and so do the positions of joiners. Every member
    must ask alike (it is part of the program a joiner must share).

    ``cast_sources=True`` accepts sources in another dtype than the program declares (fp32
    master weights of a bf16 program), converted while they are packed, as
    :meth:`Resharder.run <layoutlang.runtime.Resharder.run>` does; a rank's own choice.

    ``per_rank=True``: each member compiles only its own part of every generation's refit
    plan (the pairwise plan, :ref:`per-rank-plans`), so that what a survivor compiles after a
    loss grows with what it moves, not with the fleet; ``False``: the whole fleet's plan;
    ``None`` (the default): per-rank plans when the first generation's meshes hold at least
    :data:`~elastic.recovery.PER_RANK_SESSION_RANKS` ranks together. Every member must choose
    alike (the plans' fingerprints differ otherwise, and a joiner's program digest).

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
        spare_wait: float | None = None,
        spares: bool = True,
        join_timeout: float | None = None,
        memory_budget: int = 2 * DEFAULT_BUCKET_BYTES,
        backend: Any = None,
        on_shrink: Callable[[Change], None] | None = None,
        on_grow: Callable[[Change], None] | None = None,
        device: Any = "cpu",
        secret: JobSecret | bytes | str | None = None,
        unit_axis: str | None = None,
        grow: bool = False,
        problem: str | None = None,
        delta: bool | str | DeltaOptions = False,
        cast_sources: bool = False,
        per_rank: bool | None = None,
    ):
        statement = program.reshard(reshard)
        self.program = program
        self.reshard = statement.name
        self.original_source = program.layout(statement.source)
        self.original_destination = program.layout(statement.destination)
        if per_rank is None:
            per_rank = per_rank_plans(self.original_source, self.original_destination)
        spec = RefitSpec(
            self.reshard, self.original_source, self.original_destination,
            source_policy=(source_policy, source_axis), destination_policy=(destination_policy, destination_axis),
            domain_size=program.topology.domain_size, bucket_bytes=max(1, memory_budget // 2),
            unit_axis=unit_axis, grow=grow, per_rank=per_rank,
        )
        self.rank = int(rank)
        self.delta = delta
        self.cast_sources = cast_sources
        self.store = store
        self.host, self.port = host, port
        self.deadline = deadline
        self.timeout = timeout
        self.backend = backend if backend is not None else GlooGenerations(timeout=timeout)
        self.on_shrink, self.on_grow = on_shrink, on_grow
        self.device = torch.device(device)
        self.membership = Membership(store, self.rank, namespace=namespace, deadline=deadline, secret=secret)
        # every record from here on is bound to this session's job (a joiner finds the job the
        # first members made; a process with another secret, or none, is refused here)
        self.job = establish_job(self.membership.store, self.membership.records, port=port, create=not join,
                                 timeout=timeout)
        # a joiner beats under a generation nobody watches until it is admitted: one that comes
        # back under its old rank must not look alive in the generation it was lost from
        self.heartbeat = Heartbeat(
            host, port, self.rank, namespace=namespace, interval=heartbeat_interval, generation=ASKING if join else 0,
            records=self.membership.records,
        )
        self._recoverer = Recoverer(
            spec, membership=self.membership, heartbeat=self.heartbeat,
            builder=GroupBuilder(self.backend, host=host, port=port, rank=self.rank, timeout=timeout),
            timeout=timeout, deadline=deadline, device=self.device, on_change=self._changed,
            spare_wait=timeout if spare_wait is None else spare_wait, spares=spares, join_timeout=join_timeout,
        )
        self.last_report: StepReport | None = None
        #: seconds of the last refit's phases on this rank (the try that committed): ``begin``
        #: (the step's begin record, a membership check), ``agree`` (the executor's checks and
        #: agreement before a byte moves), ``transfer`` (the executor moving bytes), ``commit``
        #: (waiting for every member's done marker and the commit record); and the executor's
        #: parts of ``transfer`` (``transfer.pack``, ``transfer.post``, ``transfer.wait``, ...:
        #: :attr:`~layoutlang.runtime.executor.Executor.timing`)
        self.phases: dict[str, float] = {}
        self._last_delta: DeltaReport | None = None
        self._last_transfer = 0.0
        self._closed = False
        self.digest = _program_digest(spec, bool(delta))  # what a sender keeps need not match
        try:
            if join:
                self._check_program()
                self._recoverer.join()
            else:
                self._start(members, problem)
        except BaseException:
            self.close()
            raise

    def _start(self, members: Iterable[int] | None, problem: str | None) -> None:
        """Agree on the first generation, enter it, and agree that every member compiled the
        same plan and is ready (``problem``: what this rank found wrong, e.g. an engine that
        does not hold the destination layout): otherwise every member raises
        :class:`~layoutlang.errors.AgreementError` before a byte moves."""
        ranks = set(self.original_source.mesh.ranks) | set(self.original_destination.mesh.ranks)
        initial = sorted(ranks if members is None else {int(m) for m in members})
        if self.rank not in initial:
            raise ExecutionError(
                f"rank {self.rank} is not a member of the first generation {initial}; "
                "a replacement rank joins with join=True",
                rank=self.rank,
            )
        self.membership.agree(0, initial)
        self.membership.set_record(0, "program", self.digest.encode())  # what joiners compare with
        try:
            self._recoverer.enter(self._recoverer.committed, noticed=time.time(), reasons={}, first=True)
        except ExecutionError as err:
            # a member that never started its session is why the first generation could not
            # form (its group waits for every member): name it, whichever wait ran out first
            absent = [r for r in self.membership.never_heard(0, initial) if r != self.rank]
            if not absent:
                raise
            raise self._never_joined(absent, err) from err
        plan = self._recoverer.plan
        assert plan is not None  # entering compiles the generation's plan
        agree(
            self._recoverer.transport, self.rank, self.members, plan.fingerprint, problem, self.timeout,
            failure="could not start the session", ready=problem is None,
        )

    def _never_joined(self, absent: list[int], err: ExecutionError) -> MemberFailure:
        """The failure of a first generation that the members ``absent`` never joined (no
        heartbeat of theirs ever appeared; ``err``: the failure they caused here)."""
        known = err.failures if isinstance(err, MemberFailure) else {}
        whys = {
            r: known[r] if known.get(r, "").startswith("its process exited")
            else "no heartbeat: the process did not start its session, or cannot reach the store"
            for r in absent
        }
        if len(set(whys.values())) == 1:
            detail = next(iter(whys.values()))
        else:
            detail = "; ".join(f"rank {r}: {why}" for r, why in whys.items())
        who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {', '.join(map(str, absent))}"
        return MemberFailure(
            self.rank, 0, {r: f"never joined generation 0 ({why})" for r, why in whys.items()},
            message=f"rank {self.rank}: {who} never joined generation 0 within {self.timeout:g} s ({detail})",
        )

    def _check_program(self) -> None:
        """A joiner's program must be the session's (the first generation's members recorded
        its digest): another program would compile other plans than the members'."""
        theirs = self.membership.read_record(0, "program")
        if theirs is not None and theirs.decode() != self.digest:
            raise LayoutValueError(
                f"rank {self.rank}: this rank's program differs from the one session '{self.membership.namespace}' "
                "started with (other layouts, tensors, reshard or options): it cannot join"
            )

    # ---------------------------------------------------------------- properties
    @property
    def generation(self) -> int:
        return self.membership.current()

    @property
    def members(self) -> list[int]:
        return list(self.membership.members)

    @property
    def source(self) -> Layout:
        """The source (training) layout of the current generation."""
        return self._recoverer.committed.source

    @property
    def destination(self) -> Layout:
        """The destination (inference) layout of the current generation."""
        return self._recoverer.committed.destination

    @property
    def destinations(self) -> dict[str, torch.Tensor]:
        """This rank's destination storages (of :attr:`destination`)."""
        return self._recoverer.committed.destinations

    @property
    def committed_step(self) -> int | None:
        """The step whose weights the destination holds (None: none yet)."""
        return self._recoverer.committed_step

    @property
    def holds_committed(self) -> bool:
        """Whether the destination storages hold :attr:`committed_step`'s weights: False once
        a step was aborted halfway (its storages half rewritten, a joiner's still empty)
        until its retry commits."""
        return self._recoverer.committed.valid

    @property
    def next_step(self) -> int:
        """The step :meth:`run` refits next."""
        return self._recoverer.next_step

    @property
    def recoveries(self) -> list[Recovery]:
        """Every membership change this rank went through."""
        return self._recoverer.recoveries

    @property
    def rechecks(self) -> int:
        """How many times a member suspected for silence was watched for one more deadline
        before it counted as failed. A slow member that catches up is forgiven and looked at
        again only after a new silence: one stall costs one recheck per member stalled."""
        return self._recoverer.watch.rechecks

    @property
    def suspected(self) -> dict[int, str]:
        """The members this rank's failure detector holds failed now (rank -> reason)."""
        return dict(self._recoverer.watch.detector.failures)

    @property
    def group(self) -> Any:
        """The current generation's group (an :class:`~elastic.ElasticGroup` or :class:`~elastic.NcclGroup`)."""
        return self._recoverer.group

    @property
    def plan(self) -> Plan | None:
        """The refit plan of the current generation."""
        return self._recoverer.plan

    @property
    def asking(self) -> list[int]:
        """The ranks asking to join the next generation (admitted after the next committed
        step, or by :meth:`admit`)."""
        return self.membership.join_requests(self.generation + 1)

    @property
    def vacant(self) -> list[int]:
        """Source ranks whose positions wait for them to come back (source policy
        ``await-rejoin``, where no replica holds what they held); while there are any,
        :meth:`refit` raises DataLossError."""
        members = set(self.members)
        return [r for r in self.source.mesh.ranks if r not in members]

    # ----------------------------------------------------------------- public API
    def run(
        self, step_fn: StepFn, steps: int, *, on_step: Callable[[int, ElasticSession], None] | None = None,
        progress: Progress | None = None,
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

    def refit(
        self, step: int, step_fn: StepFn, *, progress: Progress | None = None, not_ready: str | None = None
    ) -> StepReport:
        """One refit that commits on every member of some generation (retried after each
        recovery: the sequence of :mod:`elastic.session`). ``not_ready`` reports what this
        rank found wrong with its weights: every member stops with
        :class:`~layoutlang.errors.AgreementError` before a byte of the step moves, and the
        destinations keep the last committed step."""
        begin = time.perf_counter()
        recoverer = self._recoverer
        first_recovery = len(recoverer.recoveries)
        attempts, received = 0, 0
        joiners: list[int] = []
        committed_in: tuple[int, tuple[int, ...], str, str] | None = None  # see below
        recoverer.sources = lambda s: step_fn(s, self)
        while True:
            attempts += 1
            self._refuse_vacant(step)
            name = recoverer.commits.open = step_record(step)
            try:
                began = time.perf_counter()
                recoverer.commits.begin(name)
                recoverer.watch.now()  # a member that left (or died) since the last step: recover first
                ran = time.perf_counter()
                received = self._run_step(step, step_fn, progress, not_ready)
                finished = time.perf_counter()
                outcome = recoverer.commits.commit(name, watch=recoverer.watch, joiners=recoverer.admissible_joiners)
                timing = getattr(recoverer.executor, "timing", {})
                self.phases = {
                    "begin": ran - began, "agree": finished - ran - self._last_transfer,
                    "transfer": self._last_transfer, "commit": time.perf_counter() - finished,
                    **{f"transfer.{k}": v for k, v in timing.items() if k != "steps"},
                }
                if outcome["state"] != COMMITTED:
                    aborted = f"rank {self.rank}: step {step} was aborted by another member"
                    raise GenerationChanged(aborted, rank=self.rank)
            except ExecutionError as err:
                if not recoverable(err):
                    raise
                # The step may turn out committed in this generation (every member had finished
                # it; e.g. this rank's commit wait saw the next generation agreed, by a grow the
                # commit admitted, before it read the outcome): report it as committed here.
                here = (self.generation, tuple(self.members), self.source.name, self.destination.name)
                if recoverer.recover(err, step):
                    committed_in = here
                    break  # every member had finished the step before the failure: it stands
                continue  # retry on the new generation
            joiners = outcome.get("joiners") or []
            recoverer.mark_committed(step)
            break
        generation, members, source, destination = committed_in or (
            self.generation, tuple(self.members), self.source.name, self.destination.name
        )
        report = StepReport(
            step, generation, attempts, time.perf_counter() - begin, received, members,
            source, destination, tuple(recoverer.recoveries[first_recovery:]), self._last_delta,
        )
        self.last_report = report
        if joiners:
            recoverer.grow(joiners)
        return report

    def _refuse_vacant(self, step: int) -> None:
        """Raise DataLossError while source positions wait for their ranks (``await-rejoin``):
        nothing else holds what they held, so ``step`` cannot be refit; the destination keeps
        the last committed step's weights, and the session goes on once they are back."""
        gone = self.vacant
        if not gone:
            return
        regions = lost_regions([self.source], gone)
        kept = "no committed step" if self.committed_step is None else f"step {self.committed_step}"
        raise DataLossError(
            f"rank {self.rank}: step {step} cannot be refit: source rank{'s' if len(gone) > 1 else ''} "
            f"{', '.join(map(str, gone))} of layout '{self.source.name}' {'are' if len(gone) > 1 else 'is'} gone "
            f"and held the only copies of {len(regions)} region{'s' if len(regions) != 1 else ''}; the destination "
            f"keeps {kept}",
            regions,
            hint="restart the lost source ranks under the same ranks and job secret: they take their positions "
            "back (ElasticSession(join=True), then admit() on the members)",
        )

    def _run_step(self, step: int, step_fn: StepFn, progress: Progress | None, not_ready: str | None) -> int:
        """This rank's part of one try of ``step``; the bytes it received from other ranks."""
        executor = self._recoverer.executor
        self._last_delta = None
        self._last_transfer = 0.0
        if executor is None:
            return 0
        sources = step_fn(step, self) if self.rank in self.source.mesh and not_ready is None else {}
        report = executor.run(
            sources, self.destinations, not_ready=not_ready, delta=self.delta, cast_sources=self.cast_sources,
            progress=None if progress is None else lambda n, total: progress(step, n, total),
        )
        self._recoverer.note_first_byte()
        self._last_delta = report.delta
        self._last_transfer = report.seconds
        return sum(report.received.values()) - report.received["local"]

    def raw_exchange(self, repeats: int = 3) -> list[float]:
        """Replay this rank's messages of the current plan as plain gloo sends and receives on
        the session's group (the same sizes, peers and order, from buffers allocated once, with
        no checks, staging or records): seconds of each of ``repeats`` replays, after one
        untimed replay. Every member calls it at once; a benchmark compares a refit's time with
        this (what the same bytes cost on the same processes' wire)."""
        executor = self._recoverer.executor
        transport = self._recoverer.transport
        if executor is None:
            return [0.0] * repeats
        pg, peer_of = getattr(transport, "pg", None), getattr(transport, "_peer", None)
        if pg is None or peer_of is None:
            raise RuntimeError(
                f"rank {self.rank}: raw_exchange replays over a gloo group, not {type(transport).__name__}"
            )
        # filled, so that every page is this process's own: an untouched buffer reads as the
        # kernel's one zero page, which a send of real weights never does
        steps = [
            (
                [(peer_of(t.peer), torch.ones(t.wire_bytes, dtype=torch.uint8)) for t in step.send_transfers],
                [(peer_of(t.peer), torch.ones(t.wire_bytes, dtype=torch.uint8)) for t in step.recv_transfers],
                (step.bucket * 4 + step.stage) % AGREEMENT_TAG,
            )
            for step in executor.steps
        ]
        seconds = []
        for _ in range(1 + repeats):
            start = time.perf_counter()
            for sends, recvs, tag in steps:
                works = [pg.recv([buf], peer, tag) for peer, buf in recvs]
                works += [pg.send([buf], peer, tag) for peer, buf in sends]
                for work in works:
                    work.wait()
            seconds.append(time.perf_counter() - start)
        return seconds[1:]

    def _changed(self, change: Change) -> None:
        """The hooks of a new generation: ``on_shrink`` when members were lost, ``on_grow``
        when ranks joined (both, when it does both)."""
        if change.lost and self.on_shrink is not None:
            self.on_shrink(change)
        if change.joined and self.on_grow is not None:
            self.on_grow(change)

    def admit(self) -> None:
        """An admission point outside the steps, for ranks that come back to vacant source
        positions (a restarted training side, source policy ``await-rejoin``). Every live
        member calls it at once; the next generation leaves out the members that are gone and
        admits the returning ranks (asking with ``join=True``), waiting for all of them up to
        ``timeout`` seconds. Joiners of the destination are admitted after steps, as
        always."""
        self._recoverer.admit()

    def end(self, reason: str) -> None:
        """Record that the job is over (every member calls it once it has run its last step):
        joiners still asking to be admitted stop waiting at once with
        :class:`~layoutlang.errors.JobEndedError` naming ``reason``, rather than after their
        ``join_timeout``. A joiner admitted at the last step boundary is a member already and
        is not concerned. The members' generation and storages are unchanged."""
        self._recoverer.end(reason)

    def leave(self) -> None:
        """Leave the session on purpose and close it: the members agree on the next generation
        without this rank as soon as they notice (at their next wait), with the reason
        "it left the session", not after a deadline of silence. The destination's policy then
        drops its positions (an engine leaving shrinks the unit axis)."""
        if self._closed:
            return
        try:
            self.membership.leave()
        finally:
            self.close()

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


def _program_digest(spec: RefitSpec, delta: bool) -> str:
    """What a rank must share with the session's members to join it: the first generation's
    layouts, the reshard, and how generations are derived and planned."""
    h = hashlib.sha256()
    h.update(layout_digest(spec.source).encode())
    h.update(layout_digest(spec.destination).encode())
    options = (spec.name, spec.source_policy, spec.destination_policy, spec.domain_size, spec.bucket_bytes,
               spec.unit_axis, spec.grow, delta) + ((True,) if spec.per_rank else ())  # old digests stand
    h.update(repr(options).encode())
    return h.hexdigest()
