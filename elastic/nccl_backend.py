"""The NCCL generation backend: each generation's communicator by shrinking and growing.

Where the gloo backend builds a fresh process group per generation, NCCL keeps one
communicator alive across generations and changes its membership in place, so a failure
costs a shrink instead of a full re-initialization:

- **create**: when no member holds a usable communicator (the first generation, or every
  earlier communicator was aborted), every member calls :meth:`Communicator.create` with
  the id the lowest member publishes under ``{namespace}/gen{g}/nccl/init``; communicator
  ranks follow the sorted job ranks.
- **shrink**: members of the previous generation that are gone are excluded with
  ``ncclCommShrink`` in ``NCCL_SHRINK_ABORT`` mode (after a failure the parent need not be
  quiescent: NCCL ends its operations). Survivors keep their relative order. A shrink that
  excludes nobody renews a communicator that a failure left revoked or failed.
- **grow**: members added to the generation (joiners) come after any shrink: the existing
  members call :meth:`Communicator.grow` (the lowest existing job rank is the coordinator
  that publishes the single-use grow id under ``{namespace}/gen{g}/nccl/grow``), and the
  joiners call :meth:`Communicator.join`. Joiners are appended after the existing members,
  in job-rank order, so the job rank -> communicator rank map is *not* the sorted order:
  each :class:`NcclGroup` keeps it explicitly (``order``, :meth:`NcclGroup.rank_map`).
- **reuse**: when nothing changed and the communicator is healthy on every member, the
  generation reuses it (a generation can change for reasons of its own).

Which rule applies must be decided identically on every member, and a rank's own
``previous`` group is not enough: a joiner does not know the order of the existing
members, and a rank excluded earlier that comes back holds a stale communicator. So each
member first writes a small record, ``{namespace}/gen{g}/nccl/base/{rank}`` (JSON: the
generation of its usable communicator, or -1, its rank there and whether it is healthy),
and reads every member's record. The *base* is the newest generation any member holds a
usable communicator of; the members holding it are the existing members (in their
communicator order), every other member is a joiner, and a stale communicator is aborted.
Every decision is then a pure function of the records.

Failures of NCCL (and of the store rendezvous) during a build raise
:class:`~elastic.membership.MembershipError` naming the rank, the generation and the
members, with NCCL's message kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from layoutlang.errors import CudaError, MembershipError, NcclError, RuntimeFailure
from layoutlang.transport.nccl import Communicator, NcclTransport

from .groups import SignedRendezvous
from .membership import Membership, generation_key

__all__ = ["NcclGenerations", "NcclGroup"]

log = logging.getLogger(__name__)

_USABLE = ("ready", "failed", "revoked")  # states a shrink can start from


class NcclGroup:
    """The NCCL communicator of one generation: its members, this rank's place, how it was made.

    ``order`` lists the members' job ranks in communicator-rank order (joiners come after
    the existing members, so it need not be sorted); ``members`` is the sorted list.
    ``how`` says how the communicator was made: ``"create"``, ``"reuse"``, ``"shrink"``,
    ``"grow"``, ``"shrink+grow"`` or ``"join"``.
    """

    def __init__(
        self,
        generation: int,
        order: Sequence[int],
        rank: int,
        communicator: Communicator,
        build_seconds: float,
        *,
        how: str,
        on_failure: str = "revoke",
        device: Any = None,
    ):
        self.generation = generation
        self.order = list(order)
        self.members = sorted(self.order)
        self.rank = rank  # job rank
        self.communicator = communicator
        self.build_seconds = build_seconds
        self.how = how
        self.on_failure = on_failure
        self.device = device
        self.owns = True  # False once a later generation reuses the communicator

    def __repr__(self) -> str:
        return (
            f"NcclGroup(generation={self.generation}, order={self.order}, rank={self.rank}, "
            f"how={self.how!r}, state={self.communicator.state!r})"
        )

    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def group_rank(self) -> int:
        """This rank's rank in the communicator."""
        return self.order.index(self.rank)

    def rank_map(self) -> dict[int, int]:
        """Job rank -> communicator rank."""
        return {m: i for i, m in enumerate(self.order)}

    def transport(
        self,
        rank_map: Mapping[int, int] | None = None,
        rank: int | None = None,
        watch: Callable[[], None] | None = None,
    ) -> NcclTransport:
        """A Transport over this communicator; program ranks are job ranks unless ``rank_map``
        (program rank -> communicator rank) says otherwise. ``watch`` is called while waits
        are pending (see :class:`~layoutlang.transport.nccl.NcclTransport`)."""
        return NcclTransport(
            self.rank if rank is None else rank,
            self.communicator,
            self.rank_map() if rank_map is None else rank_map,
            on_failure=self.on_failure,
            device=self.device,
            watch=watch,
        )


def _key(membership: Membership, generation: int, name: str) -> str:
    key = generation_key(generation, f"nccl/{name}")
    return f"{membership.namespace}/{key}" if membership.namespace else key


class NcclGenerations:
    """A generation backend over NCCL: shrink and grow one communicator across generations.

    ``api`` and ``cuda`` default to the real libraries (tests pass ``NcclMock`` and
    ``CudaMock``); ``device`` and ``on_failure`` are given to every transport;
    ``timeout`` bounds each build's rendezvous and is the communicators' operation timeout.
    """

    name = "nccl"

    def __init__(
        self,
        *,
        api: Any = None,
        cuda: Any = None,
        device: Any = None,
        timeout: float = 30.0,
        on_failure: str = "revoke",
    ):
        if on_failure not in ("abort", "revoke"):
            raise ValueError(f"on_failure must be 'abort' or 'revoke', not {on_failure!r}")
        self.api, self.cuda, self.device = api, cuda, device
        self.timeout = float(timeout)
        self.on_failure = on_failure

    def __repr__(self) -> str:
        return f"NcclGenerations(timeout={self.timeout:g}, on_failure={self.on_failure!r})"

    # ------------------------------------------------------------------ build

    def build(
        self,
        store: Any,
        membership: Membership,
        previous: NcclGroup | None,
        *,
        timeout: float | None = None,
    ) -> NcclGroup:
        """The communicator of ``membership``'s current generation (every member calls it at once).

        ``store`` is the raw store (keys are under ``membership.namespace``); ``previous`` is
        this rank's group of the last generation it was a member of, or None.
        """
        g, rank = membership.generation, membership.rank
        if g is None:
            raise MembershipError(
                f"rank {rank}: enter a generation before building its communicator"
            )
        if previous is not None and (previous.rank != rank or previous.generation >= g):
            raise ValueError(
                f"rank {rank}: the previous group (rank {previous.rank}, generation "
                f"{previous.generation}) is not an earlier generation of this rank than {g}"
            )
        timeout = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        if membership.records.authenticated:
            # the build records and the unique ids are signed and hidden: nobody without the
            # secret feeds a forged one, or reads one to join the communicator
            store = SignedRendezvous(store, "", membership.records, timeout=timeout, hide=True)
        records = self._rendezvous(store, membership, g, previous, timeout)
        base, existing, joiners = self._roles(membership, records)
        if previous is not None and records[rank]["base"] != base:
            # Stale (this rank was excluded since) or unusable: the others moved on without it.
            self.abandon(previous)
            previous = None
        order = list(membership.members) if base < 0 else existing + joiners
        comm, how = self._communicator(store, membership, g, previous, base, existing, joiners, records, timeout)
        if comm.rank != order.index(rank) or comm.size != len(order):
            _quietly_abort(comm)
            raise MembershipError(
                f"rank {rank}: the communicator of generation {g} has rank {comm.rank} of {comm.size}, "
                f"expected {order.index(rank)} of {len(order)} (order {order})"
            )
        group = NcclGroup(
            g,
            order,
            rank,
            comm,
            time.monotonic() - start,
            how=how,
            on_failure=self.on_failure,
            device=self.device,
        )
        log.info("rank %d: generation %d over NCCL by %s: %s", rank, g, how, order)
        return group

    @staticmethod
    def _roles(membership: Membership, records: Mapping[int, Mapping[str, Any]]) -> tuple[int, list[int], list[int]]:
        """(the base generation, the existing members in communicator order, the joiners)."""
        members = list(membership.members)
        base = max(r["base"] for r in records.values())
        existing = sorted(
            (m for m in members if records[m]["base"] == base), key=lambda m: records[m]["rank"]
        )
        if base >= 0 and len({records[m]["rank"] for m in existing}) != len(existing):
            raise MembershipError(
                f"rank {membership.rank}: members {existing} claim clashing ranks in the communicator of "
                f"generation {base} (records {dict(records)})"
            )
        return base, existing, [m for m in members if m not in existing]

    def _communicator(
        self,
        store: Any,
        membership: Membership,
        g: int,
        previous: NcclGroup | None,
        base: int,
        existing: list[int],
        joiners: list[int],
        records: Mapping[int, Mapping[str, Any]],
        timeout: float,
    ) -> tuple[Communicator, str]:
        """The generation's communicator and how it was made (module doc: create, shrink and
        grow, join). NCCL failures, and store waits that time out, become a MembershipError
        naming the rank, the generation and the members, with NCCL's message kept."""
        rank, members = membership.rank, list(membership.members)
        made: list[Communicator] = []  # the communicators this build makes, released if a later step fails
        try:
            if base < 0:
                comm = Communicator.create(
                    store, members.index(rank), len(members), key=_key(membership, g, "init"),
                    api=self.api, cuda=self.cuda, timeout=timeout,
                )
                return comm, "create"
            if rank in existing:
                assert previous is not None  # its record names the base: it holds that communicator
                return self._shrink_and_grow(store, membership, g, previous, existing, joiners, records, made)
            order = existing + joiners
            comm = Communicator.join(
                store, order.index(rank), len(order), key=_key(membership, g, "grow"),
                api=self.api, cuda=self.cuda, timeout=timeout,
            )
            return comm, "join"
        except (NcclError, CudaError) as err:
            what, detail, hint = "building the NCCL communicator", err.message, err.hint
            cause: BaseException = err
        except RuntimeFailure:
            raise  # the layers below report their own failures
        except RuntimeError as err:  # a store wait timed out (DistStoreError)
            what, detail, hint, cause = "the NCCL rendezvous", _first_line(err), getattr(err, "hint", None), err
        for c in made:
            _quietly_abort(c)
        raise MembershipError(
            f"rank {rank}: {what} of generation {g} (members {members}) failed: {detail}", hint=hint
        ) from cause

    def _rendezvous(
        self, store: Any, membership: Membership, g: int, previous: NcclGroup | None, timeout: float
    ) -> dict[int, dict[str, Any]]:
        """Write this rank's record and read every member's (bounded by ``timeout``)."""
        rank, members = membership.rank, membership.members
        store.set(_key(membership, g, f"base/{rank}"), json.dumps(_record(previous)).encode())
        keys = [_key(membership, g, f"base/{m}") for m in members]
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError:
            missing = [m for m, k in zip(members, keys) if not store.check([k])]
            raise MembershipError(
                f"rank {rank}: members {missing} did not reach the NCCL build of generation {g} "
                f"(members {members}) within {timeout:g} s"
            ) from None
        records = {m: _parse_record(store.get(k)) for m, k in zip(members, keys)}
        malformed = [m for m, record in records.items() if record is None]
        if malformed:
            raise MembershipError(
                f"rank {rank}: malformed NCCL build record of rank {malformed[0]} in generation {g}"
            )
        return {m: record for m, record in records.items() if record is not None}


    def _shrink_and_grow(
        self,
        store: Any,
        membership: Membership,
        g: int,
        previous: NcclGroup,
        existing: list[int],
        joiners: list[int],
        records: Mapping[int, Mapping[str, Any]],
        made: list[Communicator],
    ) -> tuple[Communicator, str]:
        """The existing members' side: shrink away who is gone (or renew), then grow."""
        rank = membership.rank
        old = previous.rank_map()
        exclude = sorted(old[m] for m in previous.order if m not in existing)
        renew = not all(records[m]["healthy"] for m in existing)
        comm, steps = previous.communicator, []
        if exclude or renew:
            comm = comm.shrink(exclude, mode="abort")
            made.append(comm)
            steps.append("shrink")
        if joiners:
            size = len(existing) + len(joiners)
            coordinator = rank == min(existing)  # the lowest existing job rank publishes the id
            comm = comm.grow(store, size, key=_key(membership, g, "grow"), coordinator=coordinator)
            made.append(comm)
            steps.append("grow")
        if not steps:
            previous.owns = False  # handed on: abandoning the old generation must not abort it
            return comm, "reuse"
        return comm, "+".join(steps)

    # ---------------------------------------------------------------- abandon

    def abandon(self, group: NcclGroup | None) -> None:
        """Release a dead generation's communicator without waiting: abort it, unless a
        shrink or grow already retired it or a later generation reuses it. Never raises."""
        if group is None or not group.owns:
            return
        _quietly_abort(group.communicator)


def _record(previous: NcclGroup | None) -> dict[str, Any]:
    """This rank's build record: the generation of its usable communicator (or -1), its rank
    there, and whether it is healthy."""
    comm = previous.communicator if previous is not None else None
    if comm is not None and comm.state == "ready":
        # The state changes only when NCCL is asked: an error since the last call counts.
        with contextlib.suppress(NcclError, CudaError):
            comm.async_error()
    if previous is None or comm is None or comm.state not in _USABLE:
        return {"base": -1, "rank": -1, "healthy": False}
    return {"base": previous.generation, "rank": previous.group_rank, "healthy": comm.state == "ready"}


def _parse_record(data: bytes) -> dict[str, Any] | None:
    """A member's build record, or None when it is malformed."""
    try:
        value = json.loads(bytes(data).decode())
        return {"base": int(value["base"]), "rank": int(value["rank"]), "healthy": bool(value["healthy"])}
    except (ValueError, KeyError, TypeError):
        return None


def _first_line(err: BaseException) -> str:
    text = str(err)
    return text.splitlines()[0] if text else type(err).__name__


def _quietly_abort(comm: Communicator) -> None:
    try:
        if comm.state not in ("aborted", "destroyed"):
            comm.abort()
    except Exception as err:  # abandoning must never fail the caller
        log.warning("abandoning an NCCL communicator: %s", getattr(err, "message", err))
