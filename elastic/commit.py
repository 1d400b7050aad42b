"""Commit records: a refit, or the entry into a generation, counts only once every member finished it.

Each unit of work of a generation has one record in the shared store, written once by
compare-and-set on an absent key, and a counter of the members that finished it::

    {namespace}/gen{g}/entry                entering generation g
    {namespace}/gen{g}/commit/{step}        the refit of ``step`` in generation g
    {namespace}/gen{g}/done/{record}        members that finished it (a counter)
    {namespace}/gen{g}/done/{record}/{rank} the finish of one member (a signed marker)
    {namespace}/gen{g}/began/{record}/{rank} a member began working on it (a signed marker)

The member that sees the counter reach the size of the generation writes
``{"state": "committed", "joiners": [...]}`` (the ranks every member admits after the
step); the first member that notices a failure writes ``{"state": "aborted"}``. The first
writer wins and every member reads the winner, so either every member moves on or every
member recovers (:mod:`elastic.recovery`).

Records and markers are signed with the job's secret (:mod:`elastic.auth`, through the
membership's signer): a record that fails its check is ignored (and replaced when decided),
so a writer without the secret cannot make a step committed or aborted. The counter is
only a hint: the member that sees it reach the size of the generation commits only once
every member's signed marker is there, so a forged count cannot commit a step that some
member has not finished.

:class:`CommittedState` is what every member committed last: a generation's layouts and
this rank's destination storages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from layoutlang.model import Layout

from .membership import MemberFailure, Membership

__all__ = ["ABORTED", "COMMITTED", "ENTRY", "CommitRecords", "CommittedState", "record_step", "step_record"]

COMMITTED, ABORTED = "committed", "aborted"
ENTRY = "entry"  # the commit record of entering a generation

#: A commit record as the store holds it (JSON): ``state``, and ``joiners`` once committed.
Record = dict[str, Any]


def step_record(step: int) -> str:
    """The name of the commit record of the refit of ``step``."""
    return f"commit/{step}"


def record_step(name: str) -> int | None:
    """The step a commit record belongs to (None: the entry)."""
    return None if name == ENTRY else int(name.removeprefix("commit/"))


@attrs.frozen
class CommittedState:
    """What every member committed last: a generation's layouts and this rank's storages."""

    generation: int
    source: Layout
    destination: Layout
    destinations: dict[str, torch.Tensor]  # this rank's destination storages
    valid: bool  # the destinations hold the weights of the last committed step


class CommitRecords:
    """The commit records of this rank's current generation (``membership.generation``).

    ``open`` names the record this rank is working on (``commit/{step}`` or ``entry``), or
    None between records; a wait ends when another member aborts it (:meth:`open_aborted`).
    ``timeout`` bounds :meth:`commit`.
    """

    def __init__(self, membership: Membership, *, timeout: float):
        self.membership = membership
        self.timeout = timeout
        self.open: str | None = None

    def _key(self, name: str) -> str:
        return self.membership.key(self.membership.current(), name)

    def read(self, name: str) -> Record | None:
        """The record ``name`` of the current generation, or None when nobody decided it yet."""
        value = self.membership.records.read(self.membership.store, self._key(name), once=True)
        return None if value is None else json.loads(value.decode())

    def decide(self, name: str, record: Record) -> Record:
        """Compare-and-set the record ``name`` of the current generation; returns the winner."""
        won = self.membership.records.decide(self.membership.store, self._key(name), json.dumps(record).encode())
        return json.loads(won.decode())

    def abort(self, name: str) -> Record:
        """Try to abort ``name``; returns the winner (``committed`` if every member had finished)."""
        return self.decide(name, {"state": ABORTED})

    def open_aborted(self) -> bool:
        """Whether another member aborted the record this rank is working on."""
        return self.open is not None and (self.read(self.open) or {}).get("state") == ABORTED

    def commit(
        self, name: str, *, watch: Callable[[], None], joiners: Callable[[], list[int]] | None = None
    ) -> Record:
        """Say this rank finished ``name`` and wait (calling ``watch``) until the record is
        decided; returns it. The member that completes the count commits it, with the joiners
        that ``joiners()`` admits after a step. Past ``timeout``: :class:`MemberFailure`."""
        store, members = self.membership.store, len(self.membership.members)
        done = self._key(f"done/{name}")
        self.membership.records.set(store, f"{done}/{self.membership.rank}", b"done")  # before the count
        count = int(store.add(done, 1))
        end = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            # the count is a hint: the member that sees it complete checks every signed marker
            if count >= members and self._all_done(done):
                return self.decide(name, {"state": COMMITTED, "joiners": joiners() if joiners is not None else []})
            record = self.read(name)
            if record is not None:
                return record
            if time.monotonic() > end:
                raise MemberFailure(self.membership.rank, self.membership.current(), {})
            watch()
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
            count = int(store.add(done, 0))

    def begin(self, name: str) -> None:
        """Say this rank began working on ``name``: a member alive that never does is found by
        :meth:`not_begun` (it takes no part: an engine whose control plane never called it)."""
        self.membership.records.set(self.membership.store, self._key(f"began/{name}/{self.membership.rank}"), b"began")

    def not_begun(self, name: str) -> list[int]:
        """The members of this generation that never said they began ``name``."""
        store, records = self.membership.store, self.membership.records
        keys = {m: self._key(f"began/{name}/{m}") for m in self.membership.members}
        present = [m for m, k in keys.items() if store.check([k])]
        began = {m for m, value in zip(present, store.multi_get([keys[m] for m in present]))
                 if records.open(keys[m], value) == b"began"}
        return [m for m in self.membership.members if m not in began]

    def _all_done(self, done: str) -> bool:
        """Whether every member's signed finish marker of ``done`` is there (the count may be
        forged: it only says when to look)."""
        store, records = self.membership.store, self.membership.records
        keys = [f"{done}/{m}" for m in self.membership.members]
        if not store.check(keys):
            return False
        return all(records.open(k, v) == b"done" for k, v in zip(keys, store.multi_get(keys)))
