"""Recovery: from a failure to the next generation, the same way on every member.

The steps (the numbers of :mod:`elastic.session`'s sequence):

1. *notice* (:class:`Watch`): every wait watches all members' heartbeats and exit
   notifications, a newer generation and the open commit record; a rank suspected for
   silence is confirmed by one more deadline of silence before it counts as failed, and
   forgiven by the failure detector when its heartbeat advances meanwhile;
2. *settle* (:meth:`Recoverer.recover`): compare-and-set ``aborted`` into the open commit
   record (:mod:`elastic.commit`), so every survivor ends in the same committed state;
3. *agree* (:meth:`Watch.propose`): the next generation's members, without the failed ones
   (compare-and-set: one writer per generation);
4. *remesh* (:class:`RefitSpec`): the layouts of the new generation, a pure function of the
   agreed member lists (:func:`elastic.remesh.generation_layouts`), after the check that no
   region of the weights is lost (:class:`~layoutlang.errors.DataLossError`);
5. *rebuild* (:class:`GroupBuilder`): the generation's group, built while the members are
   watched; then the ``on_shrink`` / ``on_grow`` hooks;
6. a *recovery plan* when the destination holds committed weights that some rank now
   lacks, committed like a step (the ``entry`` record): the ranks whose holdings did not
   change keep their storages (:func:`layoutlang.plan.loss.same_holdings`), and the plan
   fills the others alone (:func:`layoutlang.plan.refill.plan_refill`);
7. *retry*: the session refits the aborted step again (:meth:`ElasticSession.refit`).

A failure during any of this starts again at the next generation, from the last state
every member committed. :class:`Recovery` is one such change as this rank lived it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from layoutlang.errors import (
    AgreementError,
    DataLossError,
    ExecutionError,
    JobEndedError,
    LayoutError,
    LayoutValueError,
)
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.model import Layout
from layoutlang.plan import DEFAULT_BUCKET_BYTES, Plan, plan_layouts, plan_recovery
from layoutlang.plan.data import _COLUMNS as _PLAN_COLUMNS
from layoutlang.plan.data import plan_arrays
from layoutlang.plan.loss import same_holdings
from layoutlang.plan.refill import plan_refill
from layoutlang.runtime import Executor

from .commit import ABORTED, COMMITTED, ENTRY, CommitRecords, CommittedState, record_step, step_record
from .membership import (
    LEFT,
    ExcludedError,
    FailureDetector,
    GenerationChanged,
    Heartbeat,
    MemberFailure,
    Membership,
    MembershipError,
    failed_peers,
)
from .remesh import (
    Positions,
    SidePolicy,
    check_recoverable,
    check_unit_axis,
    destination_positions,
    generation_layouts,
    needs_spares,
    open_positions,
    original_ranks,
    unit_size,
    vacant,
)

__all__ = [
    "IDLE",
    "UNIT_LOST",
    "Change",
    "GroupBuilder",
    "Recoverer",
    "Recovery",
    "Refill",
    "RefitSpec",
    "Watch",
    "per_rank_plans",
    "recoverable",
    "whole_units",
]

_log = logging.getLogger(__name__)

#: the reason given for the other ranks of a failed rank's unit (its engine)
UNIT_LOST = "its unit lost a rank"
#: the reason given for a member whose heartbeat goes on but that never began a step which
#: the others waited on for the whole timeout (final: its heartbeat proves nothing)
IDLE = "alive, but it never began step"

#: A session whose first generation's meshes hold at least this many ranks together compiles
#: per-rank refit plans unless told otherwise (``ElasticSession(per_rank=...)``): every
#: survivor compiles the new generation's plan inside each recovery, and the whole fleet's
#: plan of DeepSeek-V3 on 256 + 256 ranks takes it 2 s of CPU (11.6 million moves) where its
#: own part takes 0.05 s (docs/guides/failure-recovery.rst). A Resharder compiles once, so
#: it switches at a larger fleet (:data:`layoutlang.runtime.resharder.PER_RANK_PLAN_RANKS`).
PER_RANK_SESSION_RANKS = 512

# How often a waiting rank reads the store for failures: a tenth of the default deadline,
# few enough requests that the store stays responsive with hundreds of waiting ranks.
_WATCH_PERIOD = 0.1

#: A rank's source storages of a step (the training side a recovery plan may read).
Sources = Callable[[int], Mapping[str, torch.Tensor]]


def whole_units(ranks: Iterable[int], unit: int) -> list[int]:
    """The ranks among ``ranks`` whose whole unit is there, sorted. Units are aligned runs of
    rank numbers (unit ``k`` is ranks ``k * unit .. k * unit + unit - 1``): a joining engine
    asks for an aligned run (:meth:`ElasticSession.allocate_ranks`)."""
    present = set(ranks)
    if unit == 1:
        return sorted(present)
    return sorted(r for r in present if all(u in present for u in range(r - r % unit, r - r % unit + unit)))


def per_rank_plans(source: Layout, destination: Layout) -> bool:
    """Whether a session of these first-generation layouts compiles per-rank refit plans by
    default: when their meshes hold at least :data:`PER_RANK_SESSION_RANKS` ranks together.
    (Every tensor of a session's refit moves by the reshard policy, which is what per-rank
    plans need.) Decided once, from the first generation, so that a session keeps one kind of
    plan through its generations."""
    return len(set(source.mesh.ranks) | set(destination.mesh.ranks)) >= PER_RANK_SESSION_RANKS


def recoverable(err: ExecutionError) -> bool:
    """Whether a session recovers from ``err``: an excluded rank must rejoin, and ranks
    that compiled different plans would compile them again."""
    return not isinstance(err, (ExcludedError, AgreementError))


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
    left: tuple[int, ...] = ()  # the lost ranks that left on purpose (Membership.leave)
    rejoined: tuple[int, ...] = ()  # ranks counted failed whose new process took their place


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
    left: tuple[int, ...] = ()  # the lost ranks that left on purpose
    rejoined: tuple[int, ...] = ()  # ranks whose new process took their own place back
    #: the recovery plan's bytes between ranks by where they were read: ``destination``
    #: (surviving replicas of the destination, e.g. another engine) or ``source`` (the
    #: training side); the whole plan's, the same on every member
    recovered_from: dict[str, int] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["reasons"] = {str(k): v for k, v in self.reasons.items()}
        for key in ("lost", "joined", "left", "rejoined"):
            out[key] = list(getattr(self, key))
        return out


@attrs.frozen
class RefitSpec:
    """What a session refits: the reshard's layouts in the first generation, how each side
    loses ranks (its remesh policy and axis), and how plans are compiled."""

    name: str
    source: Layout
    destination: Layout
    source_policy: SidePolicy = ("drop-replica", None)
    destination_policy: SidePolicy = ("drop-replica", None)
    domain_size: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    #: the destination axis whose coordinates are units (engines): a unit is lost whole,
    #: admitted whole, and with ``grow`` joiners beyond the open positions add units
    unit_axis: str | None = None
    grow: bool = False
    #: each rank compiles only its own part of the pairwise refit plan (:meth:`plan`), in time
    #: and memory that grow with what it moves, not with the fleet; False: the whole fleet's plan
    per_rank: bool = False

    def __attrs_post_init__(self) -> None:
        if self.unit_axis is not None:
            check_unit_axis(self.destination, self.unit_axis)
        elif self.grow:
            raise LayoutValueError("growing the destination needs its unit axis (unit_axis=)")

    @property
    def unit(self) -> int:
        """The ranks of one unit (1 without a unit axis)."""
        return unit_size(self.destination, self.unit_axis)

    @property
    def returning(self) -> frozenset[int]:
        """Ranks that hold positions of their own in the first generation's layouts."""
        return original_ranks(self.source, self.destination)

    def positions(self, history: Sequence[Sequence[int]]) -> Positions:
        """Who holds the destination's positions after the generations ``history`` lists."""
        return destination_positions(
            history, self.destination.mesh, unit=self.unit, grow=self.grow, returning=self.returning
        )

    def layouts(self, history: Sequence[Sequence[int]]) -> tuple[Layout, Layout]:
        """The source and destination layouts of the last generation ``history`` lists."""
        return generation_layouts(
            self.source, self.destination, history,
            source_policy=self.source_policy, destination_policy=self.destination_policy,
            unit_axis=self.unit_axis, grow=self.grow,
        )

    def vacant(self, members: Sequence[int]) -> list[int]:
        """Source ranks whose positions wait for them to come back (``await-rejoin``)."""
        return vacant(self.source, members, self.source_policy)

    def unit_of(self, destination: Layout, rank: int) -> list[int]:
        """The ranks of ``rank``'s unit in ``destination`` (just ``rank`` without a unit axis,
        or when it is not in that layout)."""
        axis = self.unit_axis
        if axis is None or rank not in destination.mesh:
            return [rank]
        mesh = destination.mesh
        coordinate = mesh.coords(rank)[axis]
        return [r for r in mesh.ranks if mesh.coords(r)[axis] == coordinate]

    def plan(self, source: Layout, destination: Layout, rank: int | None = None) -> Plan:
        """The refit plan of a generation's layouts: the whole fleet's, or with
        :attr:`per_rank` the part of ``rank`` (None: every rank's) of the pairwise plan.

        A per-rank plan's fingerprint is a digest of the whole program (both layouts, the
        options, the mode), the same on every rank: members that agree on it run parts of one
        plan. A rank in neither layout (a member the remesh left out) gets an empty part of
        the same fingerprint."""
        if not self.per_rank or rank is None or rank in source.mesh or rank in destination.mesh:
            return plan_layouts(
                source, destination, name=self.name, domain_size=self.domain_size, bucket_bytes=self.bucket_bytes,
                mode="pairwise" if self.per_rank else None, rank=rank if self.per_rank else None,
            )
        empty = plan_arrays(
            {name: () for name, _ in _PLAN_COLUMNS}, num_buckets=0, lower_bound_bytes=0, broadcast_payload_bytes=0
        )
        return Plan(
            source, destination, self.name, ("reshard",) * len(source.tensors), self.domain_size,
            self.bucket_bytes, empty, mode="pairwise", rank=rank,
        )

    def recovery_plan(
        self, sources: Sequence[Layout], destination: Layout, gone: Sequence[int], fill: Sequence[int] | None = None
    ) -> Plan:
        """``destination`` from the surviving ranks of ``sources``, in order of preference;
        with ``fill``, only those ranks of it (the others keep their storages)."""
        if fill is not None:
            return plan_refill(
                sources, destination, gone, fill,
                name=f"recover {destination.name}", domain_size=self.domain_size, bucket_bytes=self.bucket_bytes,
            )
        return plan_recovery(
            sources, destination, gone,
            name=f"recover {destination.name}", domain_size=self.domain_size, bucket_bytes=self.bucket_bytes,
        )


@attrs.frozen
class Refill:
    """What a generation's recovery plan did: its moves, the bytes this rank received through
    it, and the whole plan's bytes between ranks by where they were read
    (:attr:`Recovery.recovered_from`)."""

    moves: int = 0
    received: int = 0
    read_from: dict[str, int] = attrs.Factory(dict)


class Watch:
    """What every wait of a session watches (step 1), and the suspects it confirms before
    the members agree on the next generation (step 3). Calling it raises into the wait:
    :class:`MemberFailure` for a confirmed failure, :class:`GenerationChanged` when a newer
    generation was agreed or the open commit record was aborted."""

    def __init__(self, membership: Membership, commits: CommitRecords, *, deadline: float):
        self.membership = membership
        self.commits = commits
        self.deadline = deadline
        self._detector: FailureDetector | None = None
        self._previous: int | None = None  # the detector's options (see restart)
        self._startup: float | None = None
        self._joining: tuple[int, ...] = ()
        self._confirmed: set[int] = set()  # ranks whose silence a second look confirmed
        self.rechecks = 0  # ranks suspected for silence and looked at again (see confirm)
        self._last = 0.0

    @property
    def detector(self) -> FailureDetector:
        """The failure detector of the current generation."""
        if self._detector is None:
            raise MembershipError(f"rank {self.membership.rank}: no generation entered yet")
        return self._detector

    def restart(self, *, previous: int | None, startup: float | None, joining: Sequence[int] = ()) -> None:
        """Watch the members of the current generation from now on. ``previous``: the
        generation they may still be busy in; ``startup``: how long a member never heard from
        may take to start (ranks still importing torch); ``joining``: members that beat as
        joiners until they enter (alive while that heartbeat advances)."""
        self._previous, self._startup, self._joining = previous, startup, tuple(joining)
        self._detector = self._fresh()

    def _fresh(self) -> FailureDetector:
        return self.membership.detector(previous=self._previous, startup=self._startup, joining=self._joining)

    def now(self) -> None:
        """Before a step begins: a member that exited or left since the last look (announced:
        one read of the store) raises at once, so the step is not begun without it. Silence is
        found by the waits of the step, at their pace."""
        if self.detector.exits_moved():
            self._last = 0.0
            self()

    def __call__(self) -> None:
        """Raised into every wait: a failed member, a newer generation, an aborted record."""
        now = time.monotonic()
        if now - self._last < _WATCH_PERIOD:
            return
        self._last = now
        rank, g = self.membership.rank, self.membership.current()
        failures = self.detector.poll()
        if failures:
            confirmed = self.confirm(set(failures), failures)  # the others are forgiven
            if confirmed:
                raise MemberFailure(rank, g, {r: failures[r] for r in confirmed})
        if self.membership.members_of(g + 1) is not None:
            raise GenerationChanged(f"rank {rank}: generation {g + 1} was agreed", rank=rank)
        if self.commits.open_aborted():
            raise GenerationChanged(f"rank {rank}: {self.commits.open} of generation {g} was aborted", rank=rank)

    def confirm(self, suspects: set[int], reasons: dict[int, str]) -> set[int]:
        """The suspects that really failed. An exit is final; silence is not: on a machine
        stalled for a moment (an overloaded host) every heartbeat pauses at once, so a rank
        suspected for silence is watched afresh for one more deadline, and stays a member
        if its heartbeat advances: the detector forgives it (it is watched from now, and
        suspected again only after a new silence) and its reason is dropped from
        ``reasons``. ``rechecks`` counts the ranks looked at again."""
        final = {
            r for r in suspects
            if r in self._confirmed
            or reasons.get(r, "").startswith(("its process exited", "heartbeat did not advance", LEFT, IDLE))
        }  # an exit, or silence that a check already confirmed
        silent = sorted(r for r in suspects - final if r in self.membership.members)
        if not silent:
            return final
        self.rechecks += len(silent)
        still = self.detector.reconsider(silent)
        for rank in set(silent) - set(still):
            reasons.pop(rank, None)
        self._confirmed |= set(still)
        return final | set(still)

    def failed_peers(self, err: BaseException) -> dict[int, str]:
        """The peers of a failed transport wait that really failed (rank -> reason)."""
        return failed_peers(err, self.detector)

    def propose(
        self, generation: int, reasons: dict[int, str],
        admit: Callable[[int, list[int]], list[int]] | None = None,
        units: Callable[[int], Sequence[int]] | None = None,
    ) -> list[int]:
        """The members of ``generation``: without the failed ones, found within about two
        deadlines (``reasons`` gains the reasons found meanwhile), and with the joiners
        ``admit(generation, survivors)`` names. ``units(rank)`` gives the ranks that leave
        with a failed one (the other workers of its engine: vLLM stops an engine whose
        worker died)."""
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
        failed = self.confirm(failed, reasons)
        if units is not None:
            for rank in sorted(failed):
                for other in units(rank):
                    if other not in failed:
                        reasons.setdefault(other, f"{UNIT_LOST} (rank {rank}: {reasons.get(rank, 'failed')})")
                        failed.add(other)
        # Nobody found failed (a transient error): the next generation keeps every member.
        survivors = [m for m in self.membership.members if m not in failed]
        joiners = admit(generation, survivors) if admit is not None else []
        return self.membership.propose(generation, survivors + joiners)


class GroupBuilder:
    """Builds each generation's group with ``backend`` while the members are watched (step 5).

    A member that fails during the rendezvous ends the build at once instead of after the
    group's timeout. The build runs in a thread with a store client of its own: a client
    holds its lock for the whole of a blocking wait, so a shared one would stop the watch
    until the rendezvous timed out. A build given up on is abandoned when it finishes, and
    its client (perhaps still waiting) is replaced.
    """

    def __init__(self, backend: Any, *, host: str, port: int, rank: int, timeout: float):
        self.backend = backend
        self.host, self.port, self.rank, self.timeout = host, port, rank, timeout
        # Store clients for group builds, opened ahead: connecting a client can take seconds
        # (a TCPStore connection now and then stalls), which must not fall inside a recovery.
        self._clients: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._clients.put(self._connect())

    def _connect(self) -> Any:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout))

    def _refill(self) -> None:
        """Open a build client in the background, for the next build."""
        threading.Thread(target=lambda: self._clients.put(self._connect()), daemon=True).start()

    def build(self, membership: Membership, previous: Any, watch: Callable[[], None]) -> Any:
        """The group of ``membership``'s current generation (``previous``: this rank's last one)."""
        result: dict[str, Any] = {}
        given_up = threading.Event()
        try:
            client = self._clients.get_nowait()
        except queue.Empty:
            client = self._connect()

        def target() -> None:
            try:
                group = self.backend.build(client, membership, previous, timeout=self.timeout)
                result["group"] = group
                if given_up.is_set():
                    self.backend.abandon(group)
            except BaseException as err:  # handed to the waiting thread
                result["error"] = err

        thread = threading.Thread(target=target, name=f"elastic-build-{self.rank}", daemon=True)
        thread.start()
        try:
            self._wait(thread, membership, watch)
        except BaseException:
            given_up.set()
            if "group" in result:  # finished just now: abandoning twice is harmless
                self.backend.abandon(result["group"])
            self._refill()
            raise
        self._clients.put(client)
        if "error" in result:
            raise result["error"]
        return result["group"]

    def _wait(self, thread: threading.Thread, membership: Membership, watch: Callable[[], None]) -> None:
        """Wait for the build thread, watching; past the timeout: :class:`MemberFailure`."""
        end = time.monotonic() + self.timeout
        while thread.is_alive():
            thread.join(0.01)
            if thread.is_alive():
                watch()
                if time.monotonic() > end:
                    raise MemberFailure(self.rank, membership.current(), {})


class Recoverer:
    """This rank's way through the generations of a session (the module doc's steps 2-6).

    It enters each generation from the state every member committed last (remesh, rebuild,
    a recovery plan, the entry's commit), and after a failure settles the open commit
    record, agrees on the next members and enters again. It holds what the session refits
    with: ``committed`` (the last committed state), ``committed_step`` / ``next_step``,
    the generation's ``group``, ``transport``, ``plan`` and ``executor``, and every
    :class:`Recovery` so far (``recoveries``).

    ``on_change(change)`` runs on every member once a new generation's group is built;
    ``sources(step)`` gives this rank's source storages of a step, for recovery plans that
    read the training side (the session sets it when it refits).
    """

    def __init__(
        self,
        spec: RefitSpec,
        *,
        membership: Membership,
        heartbeat: Heartbeat,
        builder: GroupBuilder,
        timeout: float,
        deadline: float,
        device: torch.device,
        on_change: Callable[[Change], None],
        spare_wait: float | None = None,
        spares: bool = True,
        join_timeout: float | None = None,
    ):
        self.spec = spec
        self.rank = membership.rank
        self.membership = membership
        self.heartbeat = heartbeat
        self.builder = builder
        self.timeout = timeout
        self.device = device
        self.on_change = on_change
        self.spare_wait = timeout if spare_wait is None else spare_wait  # see _spares_for
        self.spares = spares
        self.join_timeout = timeout if join_timeout is None else join_timeout  # see _admission
        self.sources: Sources | None = None
        self.commits = CommitRecords(membership, timeout=timeout)
        self.watch = Watch(membership, self.commits, deadline=deadline)
        # Before the first entry: the first generation's layouts, no storages yet.
        self.committed = CommittedState(-1, spec.source, spec.destination, {}, False)
        self._pending = self.committed  # the state a generation's entry commits
        self.committed_step: int | None = None  # the step whose weights the destination holds
        self.next_step = 0
        self.recoveries: list[Recovery] = []
        self.group: Any = None
        self.transport: Any = None
        self.plan: Plan | None = None
        self.executor: Executor | None = None

    # ------------------------------------------------------------- the member lists
    def history(self, generation: int) -> list[list[int]]:
        """The agreed members of every generation up to ``generation``."""
        return [self.membership.members_of(g) or [] for g in range(generation + 1)]

    def admissible_joiners(self) -> list[int]:
        """Joiners asking for the next generation that every member admits after a step:
        ranks of the first generation's source coming back to their own positions (a
        restarted training rank whose replica kept the refits going), and whole units, as
        many as fill the destination's open positions, and with ``grow`` every further whole
        unit (each a new coordinate of the unit axis)."""
        g = self.membership.current()
        members = set(self.membership.members)
        asking = [j for j in self.membership.join_requests(g + 1) if j not in members]
        if not asking:
            return []  # the usual case, decided by one read
        history = self.history(g)
        mesh = self.spec.destination.mesh
        wanted = open_positions(history, mesh, self.spec.positions(history))
        returning = self.spec.returning
        back = [j for j in asking if j in self.spec.source.mesh]
        new = whole_units([j for j in asking if j not in returning], self.spec.unit)
        # a request outlives the process that made it: admit only joiners still beating
        alive = set(self.membership.asking_alive([*back, *new]))
        new = whole_units([j for j in new if j in alive], self.spec.unit)
        new = new if self.spec.grow else new[: len(wanted) - len(wanted) % self.spec.unit]
        return sorted([j for j in back if j in alive] + new)

    # ------------------------------------------------------------------- commits
    def mark_committed(self, step: int) -> None:
        """Every member finished ``step``: the destination holds its weights."""
        self.committed_step = step
        self.next_step = step + 1
        self.committed = attrs.evolve(self.committed, valid=True)
        self.commits.open = None

    def note_first_byte(self) -> None:
        """Stamp the latest recovery with the first completed exchange on its group."""
        last = self.recoveries[-1] if self.recoveries else None
        if last is not None and last.first_byte_at is None and last.generation == self.membership.current():
            self.recoveries[-1] = attrs.evolve(last, first_byte_at=getattr(self.transport, "first_completed_at", None))

    # ---------------------------------------------------------------- entering
    def enter(self, state: CommittedState, *, noticed: float, reasons: dict[int, str], first: bool = False) -> None:
        """Enter the current generation from the committed ``state`` (steps 4-6).

        The entry commits like a step (record ``entry``): no member refits in a generation
        before every member has entered it, so a failure during entry leaves every member
        at the same committed state.
        """
        g, members = self.membership.current(), self.membership.members
        self.commits.open = ENTRY
        previous_members = self.membership.members_of(state.generation) if state.generation >= 0 else members
        lost = tuple(sorted(set(previous_members or []) - set(members)))
        joined = tuple(sorted(set(members) - set(previous_members or [])))
        rejoined = tuple(sorted(r for r in reasons if r in members))  # a new process in its old place
        for rank in lost:  # the member that proposed knew why; a leave is on record for everyone
            if rank not in reasons and state.generation >= 0 and self.membership.has_left(state.generation, rank):
                reasons[rank] = LEFT
        left = tuple(r for r in lost if reasons.get(r) == LEFT)
        gone = sorted((set(state.source.mesh.ranks) | set(state.destination.mesh.ranks)) - set(members))
        # Never silent loss: the source holds the weights of the step being refit; a valid
        # destination holds those of the last committed step too. Source positions that wait
        # for their ranks to come back (await-rejoin) lose the step being refit, loudly: every
        # refit raises DataLossError until they are back (ElasticSession.refit).
        if not self.spec.vacant(members):
            check_recoverable([state.destination, state.source] if state.valid else [state.source], gone)
        source, destination = self.spec.layouts(self.history(g))
        agreed = time.time()
        self.watch.restart(
            previous=state.generation if state.generation >= 0 else None,
            startup=self.timeout if first or joined or rejoined else None,  # ranks still starting up
            joining=(*joined, *rejoined),
        )
        self._rebuild()
        group_at = time.time()
        self.transport = self.group.transport(watch=self.watch)
        change = Change(g, tuple(members), lost, joined, dict(reasons), source, destination, left, rejoined)
        self.on_change(change)

        destinations, refill = self._destinations(state, destination, gone)
        self._pending = CommittedState(g, source, destination, destinations, state.valid)
        if self.commits.commit(ENTRY, watch=self.watch)["state"] != COMMITTED:
            raise GenerationChanged(f"rank {self.rank}: entering generation {g} was aborted", rank=self.rank)
        self.commits.open = None
        self.committed = self._pending
        self._compile()
        if not first:
            first_byte = getattr(self.transport, "first_completed_at", None)
            self.recoveries.append(
                Recovery(
                    g, lost, joined, dict(reasons), noticed, agreed, group_at, first_byte, refill.moves,
                    refill.received, left, rejoined, refill.read_from,
                )
            )

    def _rebuild(self) -> None:
        """Build the current generation's group; give up the previous one."""
        previous_group = self.group
        self.group = self.builder.build(self.membership, previous_group, self.watch)
        if previous_group is not None:
            self.builder.backend.abandon(previous_group)

    def _destinations(
        self, state: CommittedState, destination: Layout, gone: list[int]
    ) -> tuple[dict[str, torch.Tensor], Refill]:
        """This rank's storages of ``destination`` (the committed ones where its boxes did not
        change), filled by a recovery plan where they must hold committed weights; also what
        that plan did."""
        # Which ranks hold the same boxes as before: decided in the C++ core, replica group by
        # replica group, so it costs milliseconds with 45k tensors on 256 ranks.
        ranks = list(destination.mesh.ranks)
        same = dict(zip(ranks, same_holdings(state.destination, destination, ranks)))
        destinations = self._allocate(destination, state, same.get(self.rank, False))
        changed = [r for r in ranks if not same[r]]
        if state.valid and changed:
            return destinations, self._run_recovery(state, destination, destinations, gone, changed)
        return destinations, Refill()

    def _allocate(self, layout: Layout, state: CommittedState, unchanged: bool) -> dict[str, torch.Tensor]:
        """This rank's storages of ``layout``: the committed ones where its boxes did not
        change (``unchanged``)."""
        if self.rank not in layout.mesh:
            return {}
        if unchanged and state.destinations:
            return dict(state.destinations)
        out = {}
        for name, shape in layout.storages_on(self.rank).items():
            dtype = torch_dtype(layout.tensors[layout.storage(name, self.rank).parts[0]].dtype)
            out[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return out

    def _run_recovery(
        self,
        state: CommittedState,
        destination: Layout,
        destinations: dict[str, torch.Tensor],
        gone: list[int],
        changed: list[int],
    ) -> Refill:
        """The ``changed`` ranks of ``destination`` (those whose boxes changed: the others
        keep their committed storages) from the surviving inference replicas first, then
        the training side."""
        sources = [state.destination, state.source]
        plan = self.spec.recovery_plan(sources, destination, gone, fill=changed)
        read_from = dict(zip(("destination", "source"), plan.bytes_between_ranks_by_source()))
        if self.rank not in destination.mesh and not any(self.rank in s.mesh for s in sources):
            return Refill(plan.num_moves, 0, read_from)  # a member in no layout (a spare) has no part in it
        executor = Executor(plan, self.rank, self.transport, timeout=self.timeout)
        training: Mapping[str, torch.Tensor] = {}
        if executor.reads_source(1):
            training = self._training_sources()
        report = executor.run([state.destinations, training], destinations)
        return Refill(plan.num_moves, sum(report.received.values()) - report.received["local"], read_from)

    def _training_sources(self) -> Mapping[str, torch.Tensor]:
        """This rank's source storages of the last committed step."""
        if self.sources is None or self.committed_step is None:
            # A valid destination means a step was committed, and only refits commit steps.
            raise RuntimeError(f"rank {self.rank}: a recovery plan reads the training side before any refit")
        return self.sources(self.committed_step)

    def _compile(self) -> None:
        """The refit plan of the current layouts, and this rank's executor."""
        source, destination = self.committed.source, self.committed.destination
        self.plan = self.spec.plan(source, destination, self.rank)  # with per_rank: this rank's part
        participants = set(source.mesh.ranks) | set(destination.mesh.ranks)
        self.executor = (
            Executor(self.plan, self.rank, self.transport, timeout=self.timeout) if self.rank in participants else None
        )

    # ---------------------------------------------------------------- recovering
    def recover(self, trigger: ExecutionError, step: int | None, *, returning: bool = False) -> bool:
        """Move to the next generation after ``trigger``. Returns True when the open step
        turned out committed (every member had finished it before the failure). With
        ``returning`` (an admission point: :meth:`admit`), the next generation waits for the
        ranks that come back to vacant source positions."""
        noticed = time.time()
        reasons = dict(trigger.failures) if isinstance(trigger, MemberFailure) else {}
        if not isinstance(trigger, (MemberFailure, GenerationChanged)):
            reasons.update(self.watch.failed_peers(trigger))
        if not reasons and not isinstance(trigger, GenerationChanged) and step is not None \
                and self.commits.open == step_record(step):
            # nobody died, and a wait of the step ran out of time: a member alive that never
            # began the step takes no part (an engine its control plane never called)
            for rank in self.commits.not_begun(step_record(step)):
                reasons[rank] = f"{IDLE} {step} within {self.timeout:g} s"
        step_committed = False
        while True:
            self._settle()
            if self.commits.open is None and step is not None and self.committed_step == step:
                step_committed = True
            g = self.membership.current() + 1
            members = self.membership.members_of(g)
            if members is None:
                members = self.watch.propose(
                    g, reasons, admit=lambda g, survivors: self._joiners_for(g, survivors, returning=returning),
                    units=lambda rank: self.spec.unit_of(self.committed.destination, rank),
                )
            self.membership.enter(g, members)  # ExcludedError: the survivors left this rank out
            self.heartbeat.set_generation(g)
            try:
                self.enter(self.committed, noticed=noticed, reasons=reasons)
            except (DataLossError, LayoutError) as err:
                self.end(f"{type(err).__name__}: {err}")  # every member decides it alike
                raise
            except ExecutionError as err:
                if not recoverable(err):
                    raise
                noticed = time.time()
                reasons = dict(err.failures) if isinstance(err, MemberFailure) else {}
                continue
            return step_committed

    def _settle(self) -> None:
        """Decide the open commit record of this generation, the same way on every member.

        Compare-and-set ``aborted``: the record ends ``committed`` only if every member had
        finished. A committed step or entry lets members go on to the next step (unless the
        step admitted joiners: then everyone grows first), so that next step is aborted too,
        and the destinations, possibly half rewritten by it, no longer count as valid.
        """
        name = self.commits.open
        if name is None:
            return
        self.commits.open = None
        outcome = self.commits.abort(name)
        step = record_step(name)
        if outcome["state"] == ABORTED:
            if step is not None:  # a step half done: only its source holds its weights
                self.committed = attrs.evolve(self.committed, valid=False)
            return
        if step is None:
            self.committed = self._pending
        else:
            self.mark_committed(step)
            if outcome.get("joiners"):
                return  # every member grows before any next step: the destinations stay valid
        self.commits.abort(step_record(self.next_step))
        self.committed = attrs.evolve(self.committed, valid=False)

    def _enter_or_recover(self, noticed: float) -> None:
        """Enter the generation just agreed; a failure meanwhile moves on to the next one."""
        try:
            self.enter(self.committed, noticed=noticed, reasons={})
        except ExecutionError as err:
            if not recoverable(err):
                raise
            self.recover(err, None)

    # -------------------------------------------------------------- grow and join
    def admit(self) -> None:
        """An admission point outside the steps, which every live member calls at once: the
        next generation drops the members that are gone and admits the ranks that come back
        to their own vacant source positions (waiting for them up to ``timeout``)."""
        self.recover(GenerationChanged(f"rank {self.rank}: admitting returning ranks", rank=self.rank), None,
                     returning=True)

    def grow(self, joiners: list[int]) -> None:
        """Admit ``joiners`` after the committed step (every member does this at the same step)."""
        noticed = time.time()
        g = self.membership.current() + 1
        self._write_resume(g)
        members = self.membership.propose(g, self.membership.members + list(joiners))
        self.membership.enter(g, members)
        self.heartbeat.set_generation(g)
        self._enter_or_recover(noticed)

    def end(self, reason: str) -> None:
        """Record that the job cannot go on (a decision every member makes alike from the
        agreed members: data loss, a layout no policy can make), so that joiners still
        asking to be admitted stop waiting for an admission that will never come."""
        self.membership.set_record(0, "ended", reason.encode())

    def _write_resume(self, generation: int) -> None:
        """Tell the joiners of ``generation`` the members' committed state, which they enter
        it from (every member writes the same record: they agree on that state; signed, see
        :mod:`elastic.auth`)."""
        record = {
            "step": self.next_step,
            "committed_step": self.committed_step,
            "generation": self.committed.generation,
            "valid": self.committed.valid,
        }
        self.membership.set_record(generation, "resume", json.dumps(record).encode())

    def _joiners_for(self, generation: int, survivors: list[int], *, returning: bool = False) -> list[int]:
        """The joiners ``generation`` admits beside the ``survivors`` in a recovery: the
        spares the destination needs (:meth:`_spares_for`), and with ``returning`` the ranks
        that come back to source positions left vacant (``await-rejoin``: a restarted
        training side), waited for up to ``timeout`` seconds until every vacant position
        is asked for."""
        back = self._returning_for(generation, survivors) if returning else []
        joiners = back + self._spares_for(generation, survivors + back)
        if back:
            self._write_resume(generation)
        return joiners

    def _returning_for(self, generation: int, survivors: list[int]) -> list[int]:
        """The ranks asking to join ``generation`` that take back their own vacant source
        positions, once all of them ask (or ``timeout`` has passed, or another member
        proposed)."""
        vacant = set(self.spec.vacant(survivors))
        end = time.monotonic() + self.timeout
        while True:
            back = sorted(vacant & set(self.membership.join_requests(generation)))
            if len(back) == len(vacant) or time.monotonic() > end:
                return self.membership.asking_alive(back)
            if self.membership.members_of(generation) is not None:
                return back  # another member proposed: its list wins anyway (nothing to admit here)
            time.sleep(0.05)

    def _spares_for(self, generation: int, survivors: list[int]) -> list[int]:
        """The joiners ``generation`` must admit beside the ``survivors``: none while the
        destination's policy can give up the lost positions (drop a replica), else as many
        as there are open positions (every replica lost a rank, or the policy is
        ``fill-spares``), waiting up to ``spare_wait`` seconds for them to ask. The recovery plan then
        fills them from any surviving holder, the training side included (:meth:`enter`)."""
        destination, policy = self.spec.destination, self.spec.destination_policy
        if not self.spares:
            return []  # joiners wait for a step boundary (a fleet of engines: each joins between refits)
        history = self.history(generation - 1)

        def open_after(members: list[int]) -> list[int]:
            after = [*history, members]
            return open_positions(after, destination.mesh, self.spec.positions(after))

        wanted = open_after(survivors)
        if not needs_spares(destination, wanted, policy):
            return []
        end = time.monotonic() + self.spare_wait
        waited = False
        returning = self.spec.returning
        while True:
            asking = [j for j in self.membership.join_requests(generation) if j not in returning]
            joiners = whole_units([j for j in asking if j not in self.membership.members], self.spec.unit)
            joiners = joiners[: len(wanted) - len(wanted) % self.spec.unit]
            members = survivors + joiners
            if not needs_spares(destination, open_after(members), policy):
                break
            if time.monotonic() > end or self.membership.members_of(generation) is not None:
                break  # another member proposed, or no spare came: entering reports what is lost
            if not waited and self.spare_wait > 0:
                waited = True
                _log.warning(
                    "rank %d: layout '%s' lost positions %s that policy '%s' cannot give up; waiting up to "
                    "%g s for spare ranks to join", self.rank, destination.name, wanted, policy[0], self.spare_wait,
                )
            time.sleep(0.05)
        if joiners:
            self._write_resume(generation)
        return joiners

    def join(self) -> None:
        """Joiner side: ask to be admitted; wait for a generation that includes this rank."""
        requested, members = self._admission()
        resume = json.loads(self.membership.wait_record(requested, "resume", self.timeout).decode())
        self.next_step = resume["step"]
        self.committed_step = resume["committed_step"]
        previous = resume["generation"]
        source, destination = self.spec.layouts(self.history(previous))
        # the members' committed state: this rank holds nothing of it yet
        self.committed = CommittedState(previous, source, destination, {}, resume["valid"])
        self.membership.enter(requested, members)
        self.heartbeat.set_generation(requested)
        self._enter_or_recover(time.time())  # a failure while this rank was being admitted: recover

    def _admission(self) -> tuple[int, list[int]]:
        """Ask to join the next generation until one that includes this rank is agreed;
        returns it and its members."""
        end = time.monotonic() + self.join_timeout
        requested: int | None = None
        known = 0
        while True:
            latest = known = self.membership.latest(known) or known
            if requested is None or latest >= requested:
                members = self.membership.members_of(requested) if requested is not None else None
                if requested is not None and members is not None and self.rank in members:
                    return requested, members
                requested = latest + 1
                self.membership.request_join(requested)
            ended = self.membership.read_record(0, "ended")
            if ended is not None:
                raise JobEndedError(
                    f"rank {self.rank}: the job ended before admitting this rank ({ended.decode(errors='replace')})"
                )
            if time.monotonic() > end:
                raise MembershipError(
                    f"rank {self.rank}: not admitted into any generation within {self.join_timeout:g} s "
                    "(members admit joiners after a committed step)"
                )
            time.sleep(0.02)

