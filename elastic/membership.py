"""Membership of an elastic group: heartbeats, failure detection, survivor agreement.

Everything lives in a torch.distributed Store hosted by a process that outlives the workers
(the launcher's TCPStore). Every key of a group is under the group's namespace and is
prefixed by its *generation* (one membership epoch)::

    {namespace}/gen{g}/members        JSON list of job ranks, written once (compare_set)
    {namespace}/gen{g}/hb/{rank}      heartbeat counter of a member, advanced every interval
    {namespace}/gen{g}/exited/{rank}  set by the launcher when the rank's process exited
    {namespace}/gen{g}/left/{rank}    set by a member that leaves on purpose (Membership.leave)
    {namespace}/gen{g}/exits          counter of those notifications (read on every poll)
    {namespace}/gen{g}/joins          counter of join requests for generation g
    {namespace}/gen{g}/join/{i}       the job rank of the i-th join request
    {namespace}/gen{g}/pg/...         the process group of generation g (elastic.groups)

The member lists, exit notifications and join requests are *signed records*: each value is
stored with an HMAC-SHA256 tag computed with the job's secret over its full key and the
value (:mod:`elastic.auth`); a record that fails its check is ignored as absent and logged.
Heartbeats are signed too (each beat writes the rank's own count, sealed): a forged or
replayed beat does not advance, so a stopped rank is found by its silence whatever an
attacker writes. The counters ``exits`` and ``joins`` are plain: a forged count only makes
a reader look for records that are not there. Member lists are write-once records
(:meth:`~elastic.auth.RecordSigner.read` with ``once``): one deleted or changed after a
member read it stops that member with :class:`~elastic.auth.StoreTampered`.

Keys are never reused across generations: a new generation starts from empty keys, so a
stale heartbeat or a half-built group of an earlier generation cannot be mistaken for a
live one. Ranks are *job ranks* (stable process identities); a member's rank in a
generation's process group is its index in the sorted member list.

Failure detection has three sources:

- heartbeats: a member whose counter has not advanced within ``deadline`` seconds (as
  observed by the detector's own clock, so no clock agreement is needed) has failed; a
  SIGSTOPped process stops heartbeating, so frozen past the deadline counts as failed;
- exit notifications: :class:`ExitWatcher` runs in the launcher and sets ``exited/{rank}``;
- per-operation deadlines: :func:`failed_peers` takes the ExecutionError of a transport
  wait and checks the heartbeats of the peers it names.

Agreement: :meth:`Membership.propose` writes generation g's member list with compare_set
on an absent key, so exactly one writer wins per generation and every proposer (and every
later reader) reads the winning list back; a rank not in it learns it is excluded
(:class:`ExcludedError`).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from layoutlang.errors import ExecutionError, MembershipError, RuntimeFailure

from .auth import JobSecret, RecordSigner, establish_job, peek

__all__ = [
    "ASKING",
    "LEFT",
    "ExcludedError",
    "ExitWatcher",
    "FailureDetector",
    "GenerationChanged",
    "Heartbeat",
    "MemberFailure",
    "Membership",
    "MembershipError",
    "decode_members",
    "encode_members",
    "failed_peers",
    "generation_key",
]

DEFAULT_INTERVAL = 0.2  # seconds between heartbeats
DEFAULT_DEADLINE = 1.0  # seconds without an advancing heartbeat before a member counts as failed
#: the reason given for a member that left the session on purpose (:meth:`Membership.leave`)
LEFT = "it left the session"
#: the generation a joiner's heartbeat counts under until it is admitted: none that is ever
#: agreed, so a rank that comes back under its old number never looks alive in the
#: generation it was lost from
ASKING = -1


class ExcludedError(MembershipError):
    """This rank is not a member of the agreed generation (the survivors excluded it)."""

    def __init__(self, rank: int, generation: int, members: Sequence[int]):
        super().__init__(
            f"rank {rank} is excluded from generation {generation} (members: {list(members)}); "
            "it was declared failed by the survivors and must rejoin to take part again"
        )
        self.rank, self.generation, self.members = rank, generation, list(members)


class MemberFailure(ExecutionError):
    """Members of the current generation failed (``failures``: rank -> reason). ``message``
    replaces the default one ("generation g lost members (...)"), e.g. for members of the
    first generation that never joined it."""

    kind = "member-failure"

    def __init__(self, rank: int, generation: int, failures: Mapping[int, str], *, message: str | None = None):
        self.failures = dict(failures)
        described = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        super().__init__(message or f"rank {rank}: generation {generation} lost members ({described})", rank=rank)


class GenerationChanged(ExecutionError):
    """A newer generation was agreed, or the current step was aborted, while this rank waited."""

    kind = "generation-changed"


def generation_key(generation: int, name: str) -> str:
    return f"gen{int(generation)}/{name}"


def encode_members(members: Iterable[int]) -> bytes:
    """Plain bytes: the JSON of the sorted, distinct job ranks (no pickle)."""
    return json.dumps(sorted({int(m) for m in members}), separators=(",", ":")).encode()


def decode_members(data: bytes) -> list[int]:
    try:
        value = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, ValueError):
        value = None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MembershipError(f"malformed member list in the store: {bytes(data)[:80]!r}")
    return value


def _namespaced(store: Any, namespace: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(namespace, store) if namespace else store


# ---------------------------------------------------------------------- heartbeats


class Heartbeat:
    """A daemon thread that advances ``gen{g}/hb/{rank}`` every ``interval`` seconds.

    Each beat writes this rank's count of beats sealed with ``records`` (the membership's
    signer, :class:`~elastic.auth.RecordSigner`; default: one with ``LAYOUTLANG_JOB_SECRET``):
    only a process with the job's secret advances it.

    It uses its own store client (``TCPStore(host, port)``), so it never shares a socket
    with the thread that runs collectives or agreement. ``generation`` may be changed while
    it runs (:meth:`set_generation`): the counter then advances under the new prefix, and
    keeps advancing under the previous one too, since peers that have not yet entered the
    new generation still watch the old keys (a rank that moved on early must not look dead
    to them). Only the current and the previous generation are kept.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        *,
        namespace: str = "elastic",
        generation: int = 0,
        interval: float = DEFAULT_INTERVAL,
        connect_timeout: float = 30.0,
        records: RecordSigner | None = None,
    ):
        import torch.distributed as dist

        self.rank, self.interval, self.namespace = int(rank), float(interval), namespace
        self.records = records if records is not None else RecordSigner(None, namespace)
        self._generation = int(generation)
        self._previous: int | None = None
        client = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=connect_timeout)
        )
        self._store = _namespaced(client, namespace)
        self._stop = threading.Event()
        self.beats = 0
        self._beat()  # the first beat before start() returns: the key exists from now on
        self._thread = threading.Thread(
            target=self._run, name=f"elastic-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    @property
    def generation(self) -> int:
        return self._generation

    def set_generation(self, generation: int) -> None:
        generation = int(generation)
        if generation != self._generation:
            self._previous, self._generation = self._generation, generation
        self._beat()

    def _beat(self) -> None:
        self.beats += 1
        previous = self._previous
        for generation in (self._generation,) if previous is None else (self._generation, previous):
            key = generation_key(generation, f"hb/{self.rank}")
            self._store.set(key, self.records.seal(key, str(self.beats).encode()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._beat_once():
                continue
            if self._stop.is_set():
                return
            time.sleep(self.interval)

    def _beat_once(self) -> bool:
        """One beat; False when the store could not take it (DistStoreError). A broken
        connection (DistNetworkError: the process serving the store is gone; a TCPStore client
        never reconnects) stops the heartbeat: every later beat would fail the same way, each
        with a warning of torch's."""
        import torch.distributed as dist

        try:
            self._beat()
        except dist.DistNetworkError:
            self._stop.set()
            return False
        except RuntimeError:
            return False
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- failure detection


class FailureDetector:
    """Watches the heartbeats and exit notifications of a generation's members.

    A member has failed when its ``exited`` key is set, or when its heartbeat counter has
    not changed for ``deadline`` seconds of this detector's clock (a member whose key never
    appeared counts from the detector's first poll). ``use_exits=False`` ignores exit
    notifications (heartbeats only). ``secret`` (default: ``LAYOUTLANG_JOB_SECRET``) checks
    the exit notifications: one that fails its check is ignored.
    """

    def __init__(
        self,
        store: Any,
        generation: int,
        members: Iterable[int],
        *,
        namespace: str = "elastic",
        deadline: float = DEFAULT_DEADLINE,
        use_exits: bool = True,
        self_rank: int | None = None,
        previous: int | None = None,
        startup: float | None = None,
        secret: JobSecret | bytes | str | None = None,
        joining: Iterable[int] = (),
        records: RecordSigner | None = None,
    ):
        self.store = _namespaced(store, namespace)
        # exit notifications and heartbeats are signed (``records``: the membership's signer)
        self.records = records if records is not None else RecordSigner(secret, namespace, store=store)
        # A member still busy in the previous generation beats only its keys: it is alive.
        self.previous = previous
        # A member never heard from may still be starting (importing torch): it has longer.
        self.startup = max(float(deadline), float(startup or 0))
        self.use_exits = use_exits
        self.self_rank = self_rank
        self._exits_seen = 0
        self.generation = int(generation)
        self.members = sorted(int(m) for m in members)
        # Joiners beat under ASKING until they enter: a joiner that died after asking is silent
        # there, and found within a deadline instead of after the startup allowance.
        self.joining = {int(r) for r in joining}
        self.deadline = float(deadline)
        self._seen: dict[int, tuple[int | None, float]] = {}
        # rank -> reason: an exit, or silence until reconsider() forgives it
        self.failures: dict[int, str] = {}

    def _counter(self, rank: int) -> int | None:
        generations = [self.generation]
        if self.previous is not None:
            generations.append(self.previous)
        if rank in self.joining:
            generations.append(ASKING)
        value = sum(beats(self.store, self.records, g, rank) for g in generations)
        return value or None

    def poll(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Read the store once; returns every failed member (rank -> reason) so far.

        Exit notifications are read only when the generation's exit counter moved. When the
        detector's own rank (``self_rank``) looks silent too, this process or the store was
        stalled (an overloaded machine): silence then proves nothing, and every member's
        clock starts again instead of declaring them all failed.
        """
        now = time.monotonic()
        ranks = self.members if ranks is None else list(ranks)
        exits_moved = False
        if self.use_exits:
            exits = int(self.store.add(generation_key(self.generation, "exits"), 0))
            exits_moved, self._exits_seen = exits != self._exits_seen, exits
        if self.self_rank is not None:
            own = self._counter(self.self_rank)
            last = self._seen.get(self.self_rank)
            if last is not None and own == last[0] and now - last[1] > self.deadline / 2:
                self._seen = {r: (v, now) for r, (v, _) in self._seen.items()}
                return dict(self.failures)
            if last is None or own != last[0]:
                self._seen[self.self_rank] = (own, now)
        for rank in self.members if exits_moved else ():
            if rank in self.failures:
                continue
            how = self.records.read(self.store, generation_key(self.generation, f"exited/{rank}"))
            if how is not None:
                self.failures[rank] = f"its process exited ({how.decode(errors='replace')})"
            elif self.records.read(self.store, generation_key(self.generation, f"left/{rank}")) is not None:
                self.failures[rank] = LEFT
        for rank in ranks:
            if rank in self.failures or rank == self.self_rank:
                continue
            value = self._counter(rank)
            last = self._seen.get(rank)
            if last is None or value != last[0]:
                self._seen[rank] = (value, now)
            elif now - last[1] > (self.deadline if value is not None else self.startup):
                what = "no heartbeat" if value is None else f"heartbeat stuck at {value}"
                self.failures[rank] = (
                    f"{what} for {now - last[1]:.2f} s (deadline {self.deadline:g} s)"
                )
        return dict(self.failures)

    def exits_moved(self) -> bool:
        """Whether an exit or a leave was announced since the last :meth:`poll` (one read)."""
        return self.use_exits and int(self.store.add(generation_key(self.generation, "exits"), 0)) != self._exits_seen

    def forgive(self, ranks: Iterable[int]) -> None:
        """Take back failures of ``ranks`` (their silence was not confirmed): they are
        watched again from now."""
        now = time.monotonic()
        for rank in ranks:
            self.failures.pop(rank, None)
            self._seen[rank] = (self._counter(rank), now)

    def reconsider(self, ranks: Iterable[int]) -> dict[int, str]:
        """Look again at ``ranks``, suspected for silence: each is watched afresh for one
        more deadline (:meth:`check`). A rank whose heartbeat advances meanwhile is
        forgiven, here, in this detector: it is no failure any more and its silence counts
        from now, so the next :meth:`poll` does not report it again (a slow rank is
        suspected once per stall, not at every poll after it). Returns the ranks that
        stayed silent; their failures are final ("heartbeat did not advance")."""
        ranks = sorted({int(r) for r in ranks})
        self.forgive(ranks)
        return self.check(ranks)

    def wait_for_failure(self, timeout: float, period: float = 0.05) -> dict[int, str]:
        """Poll until some member fails or ``timeout`` passes; returns the failures (maybe none)."""
        end = time.monotonic() + timeout
        while True:
            failures = self.poll()
            if failures or time.monotonic() >= end:
                return failures
            time.sleep(period)

    def check(self, ranks: Iterable[int], period: float = 0.05) -> dict[int, str]:
        """Decide within about ``deadline`` seconds whether each of ``ranks`` is alive.

        A rank is alive once its heartbeat is seen to advance; returns the failed ones.
        """
        ranks = sorted({int(r) for r in ranks})
        start = {r: self._counter(r) for r in ranks}
        end = time.monotonic() + self.deadline
        alive: set[int] = set()
        while True:
            self.poll(ranks)
            for r in ranks:
                if r not in self.failures and r not in alive and self._counter(r) != start[r]:
                    alive.add(r)
            pending = [r for r in ranks if r not in alive and r not in self.failures]
            if not pending:
                break
            if time.monotonic() >= end:
                for r in pending:
                    self.failures[r] = f"heartbeat did not advance within {self.deadline:g} s"
                break
            time.sleep(period)
        return {r: self.failures[r] for r in ranks if r in self.failures}


def beats(store: Any, records: RecordSigner, generation: int, rank: int) -> int:
    """The authentic count of ``rank``'s heartbeat under ``generation`` (0: none yet, or one
    that fails its check: a forged beat is no sign of life)."""
    key = generation_key(generation, f"hb/{rank}")
    data = peek(store, key)
    value = None if data is None else records.open(key, data)
    return int(value) if value is not None and value.isdigit() else 0


_PEER = re.compile(r"\b(?:from|to|peer) rank (\d+)")


def failed_peers(
    error: BaseException,
    detector: FailureDetector,
    rank_of: Mapping[int, int] | Callable[[int], int] | None = None,
) -> dict[int, str]:
    """The peers of a failed transport wait that have really failed (rank -> reason).

    The peers come from the error's typed ``peers`` field (every
    :class:`~layoutlang.errors.RuntimeFailure` has one; :class:`elastic.groups.GlooTransport`
    fills it) or, for an error that names none, from the ranks its message names ("from
    rank 3", "to rank 5"). ``rank_of`` maps the error's (program) ranks to job ranks. A slow
    peer whose heartbeat still advances is not reported: the caller may retry the operation.
    """
    peers: list[int] = list(error.peers) if isinstance(error, RuntimeFailure) else []
    if not peers:  # a transport that wrote its peers only into the message
        peers = sorted({int(m) for m in _PEER.findall(str(error))})
    if rank_of is not None:
        peers = [rank_of[p] if isinstance(rank_of, Mapping) else rank_of(p) for p in peers]
    return detector.check(peers) if peers else {}


# ------------------------------------------------------------------------ agreement


class Membership:
    """One rank's view of an elastic group's generations, over the shared store.

    ``secret`` (a :class:`~elastic.auth.JobSecret`, bytes, or text as in the environment;
    default: ``LAYOUTLANG_JOB_SECRET``) signs and checks this rank's records: member lists
    and join requests that fail the check are ignored, so a writer without the secret can
    neither exclude a member nor join.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        *,
        namespace: str = "elastic",
        deadline: float = DEFAULT_DEADLINE,
        secret: JobSecret | bytes | str | None = None,
    ):
        self.raw_store = store
        self.namespace = namespace
        self.store = _namespaced(store, namespace)
        self.records = RecordSigner(secret, namespace, store=store)
        self.rank = int(rank)
        self.deadline = float(deadline)
        self.generation: int | None = None
        self.members: list[int] = []

    def key(self, generation: int, name: str) -> str:
        return generation_key(generation, name)

    def current(self) -> int:
        """The generation this rank entered last (MembershipError before it entered any)."""
        if self.generation is None:
            raise MembershipError(f"rank {self.rank}: no generation entered yet")
        return self.generation

    def members_of(self, generation: int) -> list[int] | None:
        """The agreed members of ``generation``, or None when it has not been agreed yet."""
        value = self.records.read(self.store, self.key(generation, "members"), once=True)
        return None if value is None else decode_members(value)

    def propose(self, generation: int, members: Iterable[int]) -> list[int]:
        """Propose ``generation``'s members; returns the winning list (the first written).

        Idempotent: proposing again, or another list, returns the same winning list. A list
        that fails its check (a forgery) does not win: it is replaced by this proposal.
        """
        proposal = encode_members(members)
        if proposal == b"[]":
            raise MembershipError(
                f"rank {self.rank}: cannot propose an empty generation {generation}"
            )
        return decode_members(self.records.decide(self.store, self.key(generation, "members"), proposal))

    def enter(self, generation: int, members: Sequence[int]) -> list[int]:
        """Adopt an agreed generation; raise ExcludedError when this rank is not in it."""
        members = list(members)
        if self.rank not in members:
            raise ExcludedError(self.rank, generation, members)
        self.generation, self.members = int(generation), members
        return members

    def agree(self, generation: int, members: Iterable[int]) -> list[int]:
        """Propose, read back the winner, and enter it (ExcludedError if left out)."""
        return self.enter(generation, self.propose(generation, members))

    def wait_for(self, generation: int, timeout: float, period: float = 0.02) -> list[int]:
        """The members of ``generation`` once someone has written them (bounded wait)."""
        end = time.monotonic() + timeout
        while True:
            members = self.members_of(generation)
            if members is not None:
                return members
            if time.monotonic() >= end:
                raise MembershipError(
                    f"rank {self.rank}: generation {generation} was not agreed within {timeout:g} s"
                )
            time.sleep(period)

    def never_heard(self, generation: int, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat never appeared under ``generation`` (an
        authentic one): ranks that never joined it, e.g. a member of the first generation
        whose process did not start its session."""
        return [r for r in sorted({int(r) for r in ranks}) if beats(self.store, self.records, generation, r) == 0]

    def latest(self, start: int = 0) -> int | None:
        """The highest agreed generation at or after ``start`` (None when none is)."""
        g, found = start, None
        while self.members_of(g) is not None:
            found, g = g, g + 1
        return found

    def leave(self) -> None:
        """Leave the session on purpose: a signed ``left`` notice in the current generation,
        which the members' failure detectors read like an exit (reason :data:`LEFT`), so the
        next generation is agreed without this rank at once, not after a deadline of silence.
        Stop the heartbeat after this."""
        g = self.current()
        self.records.set(self.store, self.key(g, f"left/{self.rank}"), b"left")
        self.store.add(self.key(g, "exits"), 1)

    def has_left(self, generation: int, rank: int) -> bool:
        """Whether ``rank`` left ``generation`` on purpose (its signed notice is there)."""
        return self.records.read(self.store, self.key(generation, f"left/{rank}")) is not None

    # ------------------------------------------------------------------- grow

    def request_join(self, generation: int) -> None:
        """Ask to be admitted into ``generation`` (the next one after the latest agreed)."""
        index = self.store.add(self.key(generation, "joins"), 1) - 1
        self.records.set(self.store, self.key(generation, f"join/{index}"), str(self.rank).encode())

    def join_requests(self, generation: int) -> list[int]:
        """The ranks that asked to join ``generation`` so far (coordinator side); a request
        that fails its check (written without the job's secret) is ignored."""
        count = int(self.store.add(self.key(generation, "joins"), 0))
        ranks = []
        for i in range(count):
            # a request whose rank is not written yet is read next time
            value = self.records.read(self.store, self.key(generation, f"join/{i}"))
            if value is not None and value.isdigit():
                ranks.append(int(value))
        return sorted(set(ranks))

    def set_record(self, generation: int, name: str, value: bytes) -> None:
        """Write the signed record ``name`` of ``generation`` (e.g. where a joiner resumes)."""
        self.records.set(self.store, self.key(generation, name), value)

    def read_record(self, generation: int, name: str) -> bytes | None:
        """The authentic value of the record ``name`` of ``generation``; None when it is
        unwritten (or forged)."""
        return self.records.read(self.store, self.key(generation, name))

    def wait_record(self, generation: int, name: str, timeout: float, period: float = 0.02) -> bytes:
        """The authentic value of the record ``name`` of ``generation`` once written (a
        forgery is waited past); MembershipError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            value = self.records.read(self.store, self.key(generation, name))
            if value is not None:
                return value
            if time.monotonic() >= end:
                raise MembershipError(
                    f"rank {self.rank}: the record {name} of generation {generation} "
                    f"was not written within {timeout:g} s"
                )
            time.sleep(period)

    def wait_until_member(
        self, timeout: float, start: int = 0, period: float = 0.02
    ) -> tuple[int, list[int]]:
        """Joiner side: wait for a generation at or after ``start`` that includes this rank."""
        end = time.monotonic() + timeout
        g = start
        while True:
            members = self.members_of(g)
            if members is not None:
                if self.rank in members:
                    self.generation, self.members = g, members
                    return g, members
                g += 1
                continue
            if time.monotonic() >= end:
                raise MembershipError(
                    f"rank {self.rank}: not admitted into any generation within {timeout:g} s"
                )
            time.sleep(period)

    def asking_alive(self, ranks: Iterable[int], within: float | None = None, period: float = 0.05) -> list[int]:
        """Those of ``ranks`` (joiners) whose heartbeat under :data:`ASKING` advances within
        ``within`` seconds (default: the deadline): a join request outlives the process that
        made it, and a joiner that gave up or died must not be admitted."""
        ranks = sorted({int(r) for r in ranks})
        if not ranks:
            return []
        start = {r: beats(self.store, self.records, ASKING, r) for r in ranks}
        alive: set[int] = set()
        end = time.monotonic() + (self.deadline if within is None else within)
        while len(alive) < len(ranks) and time.monotonic() < end:
            time.sleep(period)
            alive |= {r for r in ranks if r not in alive and beats(self.store, self.records, ASKING, r) != start[r]}
        return sorted(alive)

    def detector(
        self,
        generation: int | None = None,
        members: Iterable[int] | None = None,
        deadline: float | None = None,
        use_exits: bool = True,
        previous: int | None = None,
        startup: float | None = None,
        joining: Iterable[int] = (),
    ) -> FailureDetector:
        g = self.current() if generation is None else generation
        return FailureDetector(
            self.raw_store,
            g,
            self.members if members is None else members,
            namespace=self.namespace,
            deadline=self.deadline if deadline is None else deadline,
            use_exits=use_exits,
            self_rank=self.rank,
            previous=previous,
            startup=startup,
            secret=self.records.secret,
            joining=joining,
            records=self.records,
        )


# ------------------------------------------------------------------- launcher side


class ExitWatcher:
    """Launcher side: watches worker processes and sets ``gen{g}/exited/{rank}`` on exit.

    ``processes`` maps job ranks to objects with ``is_alive()`` and ``exitcode``
    (multiprocessing.Process, or a Popen adapter). The key is written under the latest
    agreed generation and the one after it (a generation being agreed right now), so
    detectors of either see it. ``secret`` signs the notifications (default: the secret
    remembered for ``store``, as :class:`~layoutlang.cli.launch.LocalWorkers` does for its
    store, else ``LAYOUTLANG_JOB_SECRET``).
    """

    def __init__(
        self,
        store: Any,
        processes: Mapping[int, Any] | Sequence[Any],
        *,
        namespace: str = "elastic",
        period: float = 0.05,
        secret: JobSecret | bytes | str | None = None,
    ):
        self.store = _namespaced(store, namespace)
        self.records = RecordSigner(secret, namespace, store=store)
        self.processes = (
            dict(processes) if isinstance(processes, Mapping) else dict(enumerate(processes))
        )
        self.period = period
        self.exited: dict[int, int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-exit-watcher", daemon=True)
        self._thread.start()

    def _latest(self) -> int:
        g = 0
        while self.records.read(self.store, generation_key(g + 1, "members")) is not None:
            g += 1
        return g

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for rank, process in self.processes.items():
                if rank in self.exited or process.is_alive():
                    continue
                code = getattr(process, "exitcode", None)
                self.exited[rank] = code
                if not self._notify(rank, code):
                    return

    def _notify(self, rank: int, code: int | None) -> bool:
        """Write the exit of ``rank``; False when the store went away: the job is over."""
        try:
            if not self.records.job and self.records.authenticated:
                with contextlib.suppress(MembershipError):  # no session started yet: nobody reads it
                    establish_job(self.store, self.records, port=None, create=False, timeout=0)
            g = self._latest()
            for gen in (g, g + 1):
                self.records.set(self.store, generation_key(gen, f"exited/{rank}"), f"exit code {code}".encode())
                self.store.add(generation_key(gen, "exits"), 1)
        except RuntimeError:
            return False
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
