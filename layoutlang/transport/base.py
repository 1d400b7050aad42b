"""The transport interface: one lifecycle for every transport, and the pending handle they share.

A transport moves buffers between program ranks and knows nothing of plans, layouts or
the language. Every transport has the same lifecycle (torchft's process-group wrappers
are the model):

- :meth:`Transport.configure` points it at a group of processes (a ``torch.distributed``
  process group, an NCCL communicator) and maps program ranks to ranks of that group;
  configuring anew (a new generation of an elastic group) clears an earlier failure;
- :meth:`Transport.exchange` posts every receive and send of one step at once and returns
  a :class:`Pending` handle, whose :meth:`~Pending.wait` completes them within a deadline
  or raises a :class:`~layoutlang.errors.RuntimeFailure` naming this rank and the peers;
- :meth:`Transport.abort` gives up on the group: pending exchanges end, later ones fail;
- :meth:`Transport.errored` is the failure that ended an exchange (or the abort) since the
  last ``configure``, or None.

Fakes and wrappers (tests that kill a rank mid-transfer) subclass :class:`Transport` and
are passed in where a transport is expected; nothing looks at a transport's type name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ExecutionError, RuntimeFailure

__all__ = ["Buffers", "Pending", "Transport"]

#: (peer, buffer) pairs: the program rank a contiguous 1-D uint8 buffer goes to or comes from
Buffers = Sequence[tuple[int, torch.Tensor]]


class Pending(abc.ABC):
    """One posted exchange. ``peers`` are the program ranks it exchanges with, ``labels``
    say what each posted operation moves (``receiving 64 bytes from rank 3``)."""

    def __init__(self, transport: Transport, labels: Sequence[str], peers: Sequence[int]):
        self.transport = transport
        self.rank = transport.rank
        self.labels = list(labels)
        self.peers = list(peers)

    def wait(self, timeout: float) -> None:
        """Complete every operation within ``timeout`` seconds, or raise a RuntimeFailure
        (an :class:`~layoutlang.errors.ExecutionError` naming the peers); the transport
        remembers the failure (:meth:`Transport.errored`)."""
        try:
            self._wait(timeout)
        except RuntimeFailure as err:
            self.transport._failed(err)
            raise

    @abc.abstractmethod
    def _wait(self, timeout: float) -> None:
        """The transport's own wait (raises a RuntimeFailure when the exchange fails)."""


class Transport(abc.ABC):
    """Moves buffers between program ranks; knows nothing about plans or layouts.

    ``rank`` is this process's program rank; ``device`` is where the buffers it moves live
    (small control messages, such as the agreement's, are made there).
    """

    rank: int
    device: torch.device
    _error: RuntimeFailure | None = None
    #: whether a receive may be posted longer than the message it gets (gloo delivers the
    #: shorter message; NCCL needs equal counts): what delta refits need (runtime/delta.py)
    variable_length: bool = False

    @abc.abstractmethod
    def configure(self, group: Any, rank_map: Mapping[int, int] | None = None) -> None:
        """Use ``group`` (the transport's kind of process group) from now on; ``rank_map`` maps
        program ranks to its ranks (None: the same numbers). Clears an earlier failure."""

    @abc.abstractmethod
    def exchange(self, sends: Buffers, recvs: Buffers, tag: int) -> Pending:
        """Post every receive and send at once; the returned handle's ``wait`` completes them.

        ``tag`` is the same on both ends of a message (transports that match messages in
        the order they are posted may ignore it).
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up on the group: pending exchanges end, later ones raise until ``configure``."""

    def errored(self) -> RuntimeFailure | None:
        """The failure that ended an exchange, or the abort, since the last ``configure``."""
        return self._error

    def _failed(self, error: RuntimeFailure) -> None:
        """Remember the first failure since the last ``configure``."""
        if self._error is None:
            self._error = error

    # The bookkeeping every transport's abort and configure share.
    _aborted: bool = False

    def _reset(self) -> None:
        """A new group: no abort and no failure any more (``configure`` calls it)."""
        self._aborted = False
        self._error = None

    def _mark_aborted(self) -> None:
        """Later exchanges raise until ``configure``; the abort is the transport's failure."""
        self._aborted = True
        self._failed(ExecutionError(f"rank {self.rank}: the transport was aborted", rank=self.rank))

    def _refuse_if_aborted(self, sends: Buffers, recvs: Buffers) -> None:
        """Raise instead of posting an exchange on a group this transport gave up on."""
        if self._aborted:
            raise ExecutionError(
                f"rank {self.rank}: the transport was aborted; configure it with a new group first",
                rank=self.rank,
                peers=[peer for peer, _ in (*recvs, *sends)],
            )
