"""Process groups per generation, and a layoutlang Transport over them (gloo).

When a generation is agreed, its members build that generation's gloo process group at
once, under the generation's own store prefix (``{namespace}/gen{g}/pg``), by constructing
``torch.distributed.ProcessGroupGloo`` directly: nothing waits for the timeouts of the dead
group, and no key of an earlier generation is read. The group is not registered with
torch.distributed's default-group machinery; it is used through its own ``send``/``recv``
methods by :class:`GlooTransport`.

A member's rank in the group is its index in the sorted member list, so the group of
generation 1 of members ``[0, 1, 3]`` has ranks 0, 1, 2 for job ranks 0, 1, 3.

With the job's secret, nobody without it becomes a member of a group (the data plane is
authenticated, :func:`authenticated_group`): the addresses gloo publishes in the store are
signed (:class:`SignedRendezvous`: a forged or garbage address is never handed to gloo, it
is waited past), and before a group is used every pair of members proves it holds the
secret over the group's own connections (a *challenge*: each member sends every other one
an HMAC of the group's prefix and the pair). Each member then writes its verdict, signed;
unless every member's is good, the group is given up, the impostor named, and the group is
built again under a fresh prefix (:data:`REBUILDS` times at most).

Grow: the coordinator (the lowest surviving rank) reads the join requests of the next
generation and publishes its members including the joiners (:func:`admit`); joiners wait
for a generation that includes them (:meth:`Membership.wait_until_member`); then every
member builds the group of that generation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from layoutlang.errors import ExecutionError, MembershipError
from layoutlang.transport import Buffers, Pending, Transport

from .auth import RecordSigner, peek
from .membership import Membership, generation_key

#: how many times a group whose challenge failed is built again under a fresh prefix
REBUILDS = 3
#: the gloo tag of the challenge (a refit's exchanges use small tags from 0 up)
CHALLENGE_TAG = (1 << 30) + 17
_CHALLENGE_BYTES = 32

logger = logging.getLogger(__name__)

__all__ = [
    "ElasticGroup",
    "GlooGenerations",
    "GlooTransport",
    "SignedRendezvous",
    "abandon",
    "admit",
    "authenticated_group",
    "build_group",
    "keep_store",
    "prove_group",
]

# Groups of dead generations, kept alive so their threads never block a destructor.
_abandoned: list[Any] = []
# The Python stores of built groups: torch holds them from C++ only, and a Python store whose
# Python object is gone answers every later call (a subgroup's rendezvous) "Not implemented".
_kept_stores: list[Any] = []


class ElasticGroup:
    """The process group of one generation: its members, this rank's place, the gloo group."""

    def __init__(
        self, generation: int, members: Sequence[int], rank: int, pg: Any, build_seconds: float
    ):
        self.generation = generation
        self.members = list(members)
        self.rank = rank  # job rank
        self.group_rank = self.members.index(rank)
        self.pg = pg
        self.build_seconds = build_seconds

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_map(self) -> dict[int, int]:
        """Job rank -> group rank."""
        return {m: i for i, m in enumerate(self.members)}

    def transport(
        self,
        rank_map: Mapping[int, int] | None = None,
        rank: int | None = None,
        watch: Callable[[], None] | None = None,
    ) -> GlooTransport:
        """A Transport over this group; program ranks are job ranks unless ``rank_map`` says
        otherwise. ``watch`` is called while waiting (see :class:`GlooTransport`)."""
        return GlooTransport(
            self.pg,
            self.rank if rank is None else rank,
            self.rank_map() if rank_map is None else rank_map,
            watch=watch,
        )


class GlooGenerations:
    """The gloo generation backend of :class:`elastic.ElasticSession`: every generation's
    group is built afresh under its own store prefix (:func:`build_group`), whatever the
    previous one was; a dead generation's group is abandoned, never waited on."""

    name = "gloo"

    def __init__(self, *, timeout: float = 30.0):
        self.timeout = timeout

    def build(
        self, store: Any, membership: Membership, previous: ElasticGroup | None, *, timeout: float | None = None
    ) -> ElasticGroup:
        return build_group(store, membership, timeout=self.timeout if timeout is None else timeout)

    def abandon(self, group: ElasticGroup | None) -> None:
        abandon(group)


def build_group(store: Any, membership: Membership, *, timeout: float = 30.0) -> ElasticGroup:
    """Build the gloo group of ``membership``'s current generation (all members call it at once).

    ``store`` is the raw store (the namespace is ``membership.namespace``); ``timeout`` bounds
    the rendezvous and is the group's default operation timeout. With the job's secret the
    group is authenticated (:func:`authenticated_group`).
    """
    g = membership.generation
    if g is None:
        raise MembershipError(
            f"rank {membership.rank}: enter a generation before building its group"
        )
    start = time.monotonic()
    members = membership.members
    namespaced = dist.PrefixStore(membership.namespace, store) if membership.namespace else store
    pg = authenticated_group(
        namespaced, generation_key(g, "pg"), membership.records, members, membership.rank, timeout=timeout,
        what=f"the group of generation {g}",
    )
    return ElasticGroup(g, members, membership.rank, pg, time.monotonic() - start)


class SignedRendezvous(dist.Store):
    """The store a group's rendezvous goes through: what gloo writes (its address) is sealed
    with the job's secret, and what it reads must open with it. A value that does not (an
    address written by someone without the secret, or garbage) is waited past: the member's
    own write replaces one written before it; one written over it leaves the rendezvous
    without that address until ``timeout`` (:attr:`patience`), and then the build fails. :attr:`forged` lists
    the keys where such values were seen. ``hide``: values are also encrypted with a pad
    derived from the secret and the key (an NCCL unique id, which lets whoever reads it join
    the communicator, stays unknown to readers without the secret)."""

    def __init__(self, store: Any, prefix: str, records: RecordSigner, *, timeout: float, hide: bool = False):
        super().__init__()
        self.store, self.prefix, self.records, self.patience = store, prefix, records, timeout
        self.hide = hide
        self.forged: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _pad(self, key: str, value: bytes) -> bytes:
        if not self.hide:
            return value
        blocks = (len(value) + 31) // 32
        pad = b"".join(self.records.tag("rendezvous-pad", f"{key}\0{i}".encode()) for i in range(blocks))
        return bytes(a ^ b for a, b in zip(value, pad))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        full = self._key(key)
        self.store.set(full, self.records.seal(full, self._pad(full, data)))

    def get(self, key: str) -> bytes:
        full = self._key(key)
        end = time.monotonic() + self.patience
        while True:
            data = peek(self.store, full)
            if data is not None:
                value = self.records.open(full, data)
                if value is not None:
                    return self._pad(full, value)
                self.forged.add(key)
            if time.monotonic() >= end:
                raise MembershipError(f"no authentic value of {full!r} within {self.patience:g} s")
            time.sleep(0.01)

    def wait(self, keys: Any, timeout: Any = None) -> None:
        full = [self._key(k) for k in keys]
        if timeout is None:
            self.store.wait(full)
        else:
            self.store.wait(full, timeout)

    def check(self, keys: Any) -> bool:
        return bool(self.store.check([self._key(k) for k in keys]))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(self._key(key), amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        raise MembershipError("a group's rendezvous never compares and sets")  # gloo does not

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self._key(key)))

    def num_keys(self) -> int:
        return int(self.store.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.patience = timeout.total_seconds()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return True  # multi_get and multi_set, above

    def clone(self) -> SignedRendezvous:
        # torch clones a group's store for each new group built on it (a DeviceMesh's subgroups)
        return SignedRendezvous(self.store.clone(), self.prefix, self.records, timeout=self.patience, hide=self.hide)


def authenticated_group(
    store: Any, prefix: str, records: RecordSigner, members: Sequence[int], rank: int, *, timeout: float,
    what: str = "the group",
) -> Any:
    """A ``ProcessGroupGloo`` of ``members`` (job ranks; ``rank`` is this one) built under
    ``prefix`` of ``store``, every member of which holds the job's secret (``records``).

    Without a secret the group is built as it always was (nothing to prove). With it, the
    rendezvous goes through :class:`SignedRendezvous`, then the members challenge each other
    and agree on the verdict (module doc); a group that fails is given up and built again
    under ``{prefix}/{attempt}``, up to :data:`REBUILDS` times, and then
    :class:`~layoutlang.errors.MembershipError` names the members whose proof failed.
    """
    members = list(members)
    group_rank = members.index(rank)
    if not records.authenticated:
        return _gloo(store, prefix, group_rank, len(members), timeout, what, rank, members)
    failures: dict[int, str] = {}
    for attempt in range(REBUILDS + 1):
        attempt_prefix = f"{prefix}/{attempt}"
        rendezvous = SignedRendezvous(store, attempt_prefix, records, timeout=timeout)
        pg, verdict = None, "ok"
        try:
            pg = _gloo(rendezvous, "", group_rank, len(members), timeout, what, rank, members)
            failed = _challenge(pg, records, attempt_prefix, members, group_rank, timeout)
            if failed:
                verdict = "failed: " + ", ".join(f"rank {members[r]} {why}" for r, why in failed.items())
        except MembershipError as err:
            verdict = f"failed: {err}"
        if rendezvous.forged:
            logger.warning(
                "rank %d: %s: values written without the job's secret under %r (keys %s) were ignored",
                rank, what, attempt_prefix, sorted(rendezvous.forged),
            )
        failures = _agree_verdicts(store, records, attempt_prefix, members, group_rank, verdict, timeout)
        if not failures:
            assert pg is not None
            keep_store(rendezvous)
            return pg
        logger.warning("rank %d: %s under %r is given up: %s", rank, what, attempt_prefix,
                       "; ".join(f"rank {r}: {v}" for r, v in sorted(failures.items())))
        if pg is not None:
            _abandoned.append(pg)
            with contextlib.suppress(RuntimeError, AttributeError):
                pg.abort()
    raise MembershipError(
        f"rank {rank}: {what} (members {members}) failed its authentication {REBUILDS + 1} times: "
        + "; ".join(f"rank {r}: {v}" for r, v in sorted(failures.items()))
        + ". Someone without the job's secret writes the job's store or connects to its members"
    )


def keep_store(store: Any) -> None:
    """Keep a Python store that torch holds from C++ only (a group's :class:`SignedRendezvous`)
    alive as long as this process: otherwise later calls on it fail."""
    _kept_stores.append(store)


def prove_group(
    pg: Any, store: Any, records: RecordSigner, prefix: str, members: Sequence[int], rank: int, *, timeout: float,
    what: str = "the group",
) -> None:
    """Check that every member of an already built group ``pg`` holds the job's secret (the
    challenge and the verdicts of :func:`authenticated_group`); a group that fails raises
    :class:`~layoutlang.errors.MembershipError` naming the members whose proof failed. For a
    group that cannot be built again under another prefix (torch's default group)."""
    members = list(members)
    group_rank = members.index(rank)
    failed = _challenge(pg, records, prefix, members, group_rank, timeout)
    verdict = "ok" if not failed else "failed: " + ", ".join(f"rank {members[r]} {why}" for r, why in failed.items())
    failures = _agree_verdicts(store, records, prefix, members, group_rank, verdict, timeout)
    if failures:
        raise MembershipError(
            f"rank {rank}: {what} (members {members}) failed its authentication: "
            + "; ".join(f"rank {r}: {v}" for r, v in sorted(failures.items()))
            + ". Someone without the job's secret writes the job's store or connects to its members"
        )


def _gloo(
    store: Any, prefix: str, group_rank: int, size: int, timeout: float, what: str, rank: int, members: list[int]
) -> Any:
    try:
        return dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store) if prefix else store, group_rank, size, timedelta(seconds=timeout)
        )
    except (RuntimeError, MembershipError) as err:
        raise MembershipError(
            f"rank {rank}: building {what} (members {members}) failed: {str(err).splitlines()[0]}"
        ) from None


def _challenge(
    pg: Any, records: RecordSigner, prefix: str, members: list[int], group_rank: int, timeout: float
) -> dict[int, str]:
    """Prove to every other member, over the group's own connections, that this one holds the
    secret, and check their proofs; the group ranks whose proof failed (rank -> why)."""

    def proof(sender: int, receiver: int) -> torch.Tensor:
        tag = records.tag("group-challenge", f"{prefix}\0{members[sender]}\0{members[receiver]}".encode())
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8)

    others = [r for r in range(len(members)) if r != group_rank]
    received = {r: torch.zeros(_CHALLENGE_BYTES, dtype=torch.uint8) for r in others}
    works = [(r, pg.recv([received[r]], r, CHALLENGE_TAG)) for r in others]
    sent = [pg.send([proof(group_rank, r)], r, CHALLENGE_TAG) for r in others]
    failed: dict[int, str] = {}
    for r, work in works:
        error = _work_error(work, timeout)
        if error is not None:
            failed[r] = f"sent no proof ({error})"
        elif not torch.equal(received[r], proof(r, group_rank)):
            failed[r] = "sent a wrong proof (it does not hold the job's secret)"
    for work in sent:
        _work_error(work, timeout)
    return failed


def _agree_verdicts(
    store: Any, records: RecordSigner, prefix: str, members: list[int], group_rank: int, verdict: str, timeout: float
) -> dict[int, str]:
    """Write this member's verdict on the group (signed) and read everyone's: the members
    whose verdict is not good (rank -> verdict; empty: the group is used). A verdict that
    fails its check is waited past, as in the rendezvous."""
    keys = [f"{prefix}/verdict/{r}" for r in range(len(members))]
    records.set(store, keys[group_rank], verdict.encode())
    verdicts: dict[int, str] = {}
    end = time.monotonic() + timeout
    with contextlib.suppress(RuntimeError):  # a member that never writes: named below
        store.wait(keys, timedelta(seconds=timeout))  # one request, then one read of them all
        for r, (key, data) in enumerate(zip(keys, store.multi_get(keys))):
            value = records.open(key, data)
            if value is not None:
                verdicts[r] = value.decode(errors="replace")
    pause = 0.0005
    while len(verdicts) < len(members):  # a forged verdict is waited past
        for r, key in enumerate(keys):
            if r not in verdicts:
                value = records.read(store, key)
                if value is not None:
                    verdicts[r] = value.decode(errors="replace")
        if len(verdicts) == len(members):
            break
        if time.monotonic() >= end:
            missing = [members[r] for r in range(len(members)) if r not in verdicts]
            raise MembershipError(f"ranks {missing} gave no verdict on the group under {prefix!r} within {timeout:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return {members[r]: v for r, v in verdicts.items() if v != "ok"}


def abandon(group: ElasticGroup | None) -> None:
    """Give up a dead generation's group: abort its pending work, never wait on it."""
    if group is None:
        return
    _abandoned.append(group.pg)
    abort = getattr(group.pg, "abort", None)  # absent on older torch
    if abort is not None:
        with contextlib.suppress(RuntimeError):
            abort()


def admit(
    membership: Membership,
    survivors: Sequence[int],
    *,
    wait_for: Sequence[int] = (),
    timeout: float = 10.0,
) -> list[int]:
    """Coordinator side of grow: publish the next generation with the survivors and the joiners.

    Waits (bounded) until every rank of ``wait_for`` has asked to join, then proposes the
    next generation (``membership.generation + 1``) and enters it. Returns its members.
    """
    g = (membership.generation or 0) + 1
    end = time.monotonic() + timeout
    while True:
        joiners = membership.join_requests(g)
        if set(wait_for) <= set(joiners):
            break
        if time.monotonic() >= end:
            raise MembershipError(
                f"rank {membership.rank}: ranks {sorted(set(wait_for) - set(joiners))} did not ask to join "
                f"generation {g} within {timeout:g} s"
            )
        time.sleep(0.02)
    return membership.agree(g, list(survivors) + joiners)


class _GlooPending(Pending):
    def __init__(self, transport: GlooTransport, works: Sequence[Any], labels: Sequence[str], peers: Sequence[int]):
        super().__init__(transport, labels, peers)
        self.gloo = transport
        self.works = list(works)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        watch = self.gloo.watch
        if watch is None:
            self._wait_works(deadline, timeout)
        else:
            # Gloo's point-to-point works complete only inside wait(), so a helper thread
            # waits while this one watches: a failure anywhere in the group (not only of this
            # exchange's peers) ends the wait when watch() raises.
            future = self.gloo._waiter().submit(self._wait_works, deadline, timeout)
            pause = 0.001
            while not self._done(future, pause):
                watch()
                pause = min(pause * 2, 0.02)
        self.gloo.completed += 1
        if self.gloo.first_completed_at is None:
            self.gloo.first_completed_at = time.time()

    @staticmethod
    def _done(future: concurrent.futures.Future[None], pause: float) -> bool:
        """Whether the helper thread's wait ended within ``pause`` seconds (its error is raised)."""
        try:
            future.result(timeout=pause)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _wait_works(self, deadline: float, timeout: float) -> None:
        for work, label, peer in zip(self.works, self.labels, self.peers):
            error = _work_error(work, max(0.001, deadline - time.monotonic()))
            if error is not None:
                raise ExecutionError(
                    f"rank {self.rank}: {label} failed or did not complete within {timeout:g} s "
                    f"(the peer may have died or hung): {error}",
                    rank=self.rank,
                    peers=[peer],
                )


def _work_error(work: Any, remaining: float) -> str | None:
    """Wait for one gloo work; what went wrong (None: it completed)."""
    try:
        completed = work.wait(timedelta(seconds=remaining))
    except RuntimeError as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None if completed is not False else "timed out"


class GlooTransport(Transport):
    """layoutlang's Transport over a ProcessGroupGloo, with program rank -> group rank map.

    ``watch``, when given, is called every few milliseconds while an exchange is waited on;
    it raises to end the wait (an elastic session raises when any member has failed or a
    newer generation was agreed). ``completed`` counts the exchanges waited to completion;
    ``first_completed_at`` is the ``time.time()`` of the first.
    """

    def __init__(self, pg: Any, rank: int, rank_map: Mapping[int, int], *, watch: Callable[[], None] | None = None):
        self.rank = rank
        self.device = torch.device("cpu")
        self.variable_length = True  # gloo delivers a message into a longer receive
        self.watch = watch
        self.completed = 0
        self.first_completed_at: float | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.configure(pg, rank_map)

    def configure(self, group: Any, rank_map: Mapping[int, int] | None = None) -> None:
        """Use the gloo group ``group`` with ``rank_map`` (None: the same numbers) from now on."""
        self.pg = group
        self._map = dict(rank_map) if rank_map is not None else None
        self._reset()

    def _waiter(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"gloo-wait-{self.rank}")
        return self._pool

    def _peer(self, rank: int) -> int:
        if self._map is None:
            return rank
        try:
            return self._map[rank]
        except KeyError:
            raise ExecutionError(
                f"rank {self.rank}: rank {rank} is not a member of this group", rank=self.rank, peers=[rank]
            ) from None

    def exchange(self, sends: Buffers, recvs: Buffers, tag: int) -> Pending:
        self._refuse_if_aborted(sends, recvs)
        works, labels, peers = [], [], []
        posts = [(peer, buf, self.pg.recv, "receiving", "from") for peer, buf in recvs]
        posts += [(peer, buf, self.pg.send, "sending", "to") for peer, buf in sends]
        for peer, buf, post, verb, preposition in posts:
            label = f"{verb} {buf.numel() * buf.element_size()} bytes {preposition} rank {peer}"
            works.append(self._post(post, buf, peer, tag, label))
            labels.append(label)
            peers.append(peer)
        return _GlooPending(self, works, labels, peers)

    def _post(self, post: Callable[..., Any], buf: torch.Tensor, peer: int, tag: int, label: str) -> Any:
        group_rank = self._peer(peer)  # not a member: its own error, not a failed post
        try:
            return post([buf], group_rank, tag)
        except RuntimeError as err:  # gloo refuses at once when the peer's connection is gone
            error = ExecutionError(
                f"rank {self.rank}: {label} failed: {str(err).splitlines()[0]}", rank=self.rank, peers=[peer]
            )
            self._failed(error)
            raise error from None

    def abort(self) -> None:
        """Abort the group's pending work where torch can; later exchanges raise until
        :meth:`configure`."""
        self._mark_aborted()
        abort = getattr(self.pg, "abort", None)  # absent on older torch
        if abort is not None:
            with contextlib.suppress(RuntimeError):
                abort()
