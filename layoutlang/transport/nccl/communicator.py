"""NCCL communicators: created from a unique id published in a torch.distributed Store."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from ...core import _core
from ...errors import NcclError, NcclUnavailableError, core_errors
from .library import load_cuda_runtime, load_library

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------- communicator


def _publish(store: Any, key: str, value: bytes, readers: Sequence[int], timeout: float) -> None:
    """Put ``value`` under ``key`` until every reader has taken it, then delete it.

    Deleting it makes a key safe to reuse: the next creation under the same key waits for
    a new value instead of reading this one. The publisher deletes before it creates its
    communicator, and creation completes on no rank before it starts on every rank, so no
    reader can reach a later creation while this value is still there.
    """
    store.set(key, value)
    acks = [f"{key}/read/{r}" for r in readers]
    if acks:
        store.wait(acks, timedelta(seconds=timeout))
    for k in [*acks, key]:
        store.delete_key(k)


def _receive(store: Any, key: str, rank: int, timeout: float) -> bytes:
    """The value another rank publishes under ``key`` (raw bytes, never unpickled)."""
    store.wait([key], timedelta(seconds=timeout))
    value = bytes(store.get(key))
    store.set(f"{key}/read/{rank}", b"1")
    return value


def new_unique_id(api: _core.nccl.NcclApi) -> bytes:
    """A fresh id for creating a communicator (ncclGetUniqueId), as 128 bytes."""
    with core_errors():
        return _core.nccl.unique_id(api)


#: One transfer of an exchange: (peer, pointer, bytes), the peer a rank of the communicator.
Transfer = tuple[int, int, int]


class Communicator:
    """An NCCL communicator (a thin Python face of ``_core.nccl.Communicator``).

    ``api`` and ``cuda`` default to the real libraries; tests pass ``NcclMock`` and
    ``CudaMock``. The failure operations keep NCCL's guarantees (see
    ``docs/reference/transports.rst``): :meth:`abort` ends the communicator at once;
    :meth:`revoke` stops in-flight operations and leaves it shrinkable; :meth:`shrink`
    excludes ranks (after a failure, default mode revokes first; ``mode="abort"`` lets
    NCCL terminate the parent's operations); :meth:`grow` adds ranks that :meth:`join`
    with the coordinator's single-use id. Shrink and grow release the parent.

    Every failure raises layoutlang's :class:`~layoutlang.errors.NcclError` family or
    :class:`~layoutlang.errors.CudaError`.
    """

    def __init__(self, core: _core.nccl.Communicator, api: _core.nccl.NcclApi, cuda: _core.nccl.CudaApi):
        self.core, self.api, self.cuda = core, api, cuda

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, state={self.state!r})"

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        size: int,
        *,
        key: str = "layoutlang/nccl/init",
        api: _core.nccl.NcclApi | None = None,
        cuda: _core.nccl.CudaApi | None = None,
        timeout: float = 300.0,
        blocking: bool = False,
    ) -> Communicator:
        """Every rank calls this; rank 0 creates the unique id and publishes it under ``key``
        until every rank has read it (so the key can be reused for the next communicator)."""
        api = api if api is not None else load_library()
        cuda = cuda if cuda is not None else load_cuda_runtime()
        if rank == 0:
            unique_id = new_unique_id(api)
            _publish(store, key, unique_id, range(1, size), timeout)
        else:
            unique_id = _receive(store, key, rank, timeout)
        return cls.init(api, cuda, size, rank, unique_id, blocking=blocking, timeout=timeout)

    @classmethod
    def init(
        cls,
        api: _core.nccl.NcclApi,
        cuda: _core.nccl.CudaApi,
        size: int,
        rank: int,
        unique_id: bytes,
        *,
        blocking: bool = False,
        timeout: float = 300.0,
    ) -> Communicator:
        """ncclCommInitRankConfig with an id every rank already has (:meth:`create` shares it)."""
        with core_errors():
            core = _core.nccl.Communicator.init(api, cuda, size, rank, unique_id, blocking=blocking, timeout=timeout)
        return cls(core, api, cuda)

    @classmethod
    def join(
        cls,
        store: Any,
        rank: int,
        size: int,
        *,
        key: str,
        api: _core.nccl.NcclApi | None = None,
        cuda: _core.nccl.CudaApi | None = None,
        timeout: float = 300.0,
        blocking: bool = False,
    ) -> Communicator:
        """A new rank joins a grow, with the id the coordinator published under ``key``."""
        api = api if api is not None else load_library()
        cuda = cuda if cuda is not None else load_cuda_runtime()
        unique_id = _receive(store, key, rank, timeout)
        with core_errors():
            core = _core.nccl.Communicator.join(api, cuda, size, rank, unique_id, blocking=blocking, timeout=timeout)
        return cls(core, api, cuda)

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def size(self) -> int:
        return self.core.size

    @property
    def state(self) -> str:
        """``ready``, ``failed``, ``revoked``, ``aborted`` or ``destroyed``."""
        return self.core.state

    def exchange(self, sends: Iterable[Transfer], recvs: Iterable[Transfer], stream: int) -> int:
        """One group of receives and sends, each ``(peer, pointer, bytes)``; returns a ticket."""
        with core_errors():
            return self.core.exchange(list(sends), list(recvs), stream)

    def wait(self, ticket: int, timeout: float) -> bool:
        with core_errors():
            return self.core.wait(ticket, timeout)

    def async_error(self) -> int:
        with core_errors():
            return self.core.async_error()

    def abort(self) -> None:
        with core_errors():
            self.core.abort()

    def revoke(self) -> None:
        with core_errors():
            self.core.revoke()

    def destroy(self) -> None:
        with core_errors():
            self.core.destroy()

    def shrink(self, exclude: Sequence[int], *, mode: str = "default", retire: bool = True) -> Communicator:
        """A communicator without the ranks in ``exclude`` (ranks of this communicator).

        ``mode="default"`` (NCCL_SHRINK_DEFAULT) needs a quiescent parent: after a failure
        the parent is revoked first. ``mode="abort"`` (NCCL_SHRINK_ABORT) lets NCCL end the
        parent's operations. With ``retire`` the parent is released afterwards.
        """
        if mode not in ("default", "abort"):
            raise ValueError(f"shrink mode must be 'default' or 'abort', not {mode!r}")
        try:
            with core_errors():
                child = self.core.shrink(list(exclude), mode == "abort")
        except NcclUnavailableError as err:
            if err.symbol == "ncclCommRevoke":
                err.hint = "this NCCL cannot revoke: shrink with mode='abort' instead"
            raise
        if retire:
            self._retire()
        return Communicator(child, self.api, self.cuda)

    def grow(self, store: Any, size: int, *, key: str, coordinator: bool) -> Communicator:
        """Grow to ``size`` ranks; every existing rank calls this. The coordinator asks NCCL
        for a single-use id (ncclCommGetUniqueId) and publishes it under ``key``; new ranks
        call :meth:`join` with the same key."""
        with core_errors():
            if coordinator:
                unique_id = self.core.grow_unique_id()
                _publish(store, key, unique_id, range(self.size, size), self.core.timeout)
                child = self.core.grow(size, unique_id)
            else:
                child = self.core.grow(size, None)
        self._retire()
        return Communicator(child, self.api, self.cuda)

    def _retire(self) -> None:
        """Release the parent of a shrink or grow. A revoked parent is destroyed (NCCL's
        path after revoke); any other is aborted: it is idle and shares nothing with its
        child, and abort is local, whereas finalize waits until the communicator is
        globally quiescent, i.e. for ranks a shrink excluded."""
        try:
            if self.state == "revoked":
                self.destroy()
            else:
                self.abort()
        except NcclError as err:
            log.warning("releasing the previous communicator: %s", err.message)
            self.abort()
