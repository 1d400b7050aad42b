"""The executor's exchanges over an NCCL communicator."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..._text import ranks_phrase
from ...core import _core
from ...errors import CudaError, ExecutionError, NcclError, NcclTimeoutError
from ..base import Buffers, Pending, Transport
from .communicator import Communicator, Transfer

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------- transport

_MOCK_STREAMS = itertools.count(1)

#: Seconds between calls of a transport's ``watch`` while a wait is pending.
WATCH_SLICE = 0.05


class _NcclPending(Pending):
    def __init__(
        self,
        transport: NcclTransport,
        ticket: int,
        labels: list[str],
        peers: list[int],
        keep: list[torch.Tensor],
        back: list[tuple[torch.Tensor, torch.Tensor]],
    ):
        super().__init__(transport, labels, peers)
        self.nccl, self.ticket = transport, ticket
        self._keep, self._back = keep, back  # staging buffers live until the transfer is done

    def _wait(self, timeout: float) -> None:
        t = self.nccl
        if t.watch is None:
            done = self._wait_core(timeout)
        else:
            done = self._wait_watched(timeout, t.watch)
        if not done:
            action = t._fail()
            raise NcclTimeoutError(
                f"rank {t.rank}: the NCCL exchange with {ranks_phrase(self.peers)} did not complete within "
                f"{timeout:g} s ({'; '.join(self.labels)}); a peer may have died or hung; the communicator "
                f"was {action}",
                call="ncclCommGetAsyncError",
                code=8,
                rank=t.rank,
                peers=self.peers,
            )
        for host, device in self._back:
            host.copy_(device)
        self._keep, self._back = [], []
        if t.first_completed_at is None:
            t.first_completed_at = time.time()

    def _wait_core(self, timeout: float) -> bool:
        """One wait on the core (False: not done within ``timeout``, with no side effect)."""
        t = self.nccl
        try:
            return t.communicator.wait(self.ticket, timeout)
        except (NcclError, CudaError) as err:
            action = t._fail()
            raise NcclError(
                f"rank {t.rank}: the NCCL exchange with {ranks_phrase(self.peers)} failed "
                f"({'; '.join(self.labels)}): {err.message}; the communicator was {action}",
                call=err.call,
                code=err.code if isinstance(err, NcclError) else None,
                rank=t.rank,
                peers=self.peers,
            ) from None

    def _wait_watched(self, timeout: float, watch: Callable[[], None]) -> bool:
        """Wait in slices of at most WATCH_SLICE seconds, calling ``watch()`` between them.

        A slice that ends unfinished leaves the exchange pending (the core's wait has no
        side effect on a timeout), so only the overall deadline gives up. When ``watch``
        raises (a member that is not a peer of this exchange has failed), the failure
        policy is applied, since the exchange can no longer be trusted to finish, and the
        watch's exception propagates unchanged.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if self._wait_core(min(WATCH_SLICE, max(remaining, 0.0))):
                return True
            if time.monotonic() >= deadline:
                return False
            try:
                watch()
            except BaseException:
                self.nccl._fail()
                raise


class NcclTransport(Transport):
    """The executor's transport over NCCL (the lifecycle of every
    :class:`~layoutlang.transport.base.Transport`: configure, exchange, abort, errored).

    ``rank`` is this process's program rank; ``rank_map`` maps program ranks to ranks of
    the communicator (default: the same numbers). Each exchange is one group of receives
    and sends enqueued on the current CUDA stream (``side_stream=True``: on a stream of
    its own that first waits for the current one, so local copies run while the transfers
    fly). ``on_failure`` is what a failure or timeout does to the communicator:
    ``"abort"`` (nothing survives) or ``"revoke"`` (it can be shrunk afterwards).
    CPU tensors (the executor's agreement messages) are staged through the device.

    ``watch``, when given, is called between slices of at most :data:`WATCH_SLICE` seconds
    while a wait is pending: it raises to give up on the exchange (an elastic session's
    failure detector uses it to notice a failed member that is not a peer of the exchange,
    whose failure would otherwise only show as a timeout). The failure policy is then
    applied and the watch's exception propagates unchanged.
    """

    def __init__(
        self,
        rank: int,
        communicator: Communicator,
        rank_map: Mapping[int, int] | None = None,
        *,
        on_failure: str = "abort",
        device: Any = None,
        side_stream: bool = False,
        watch: Callable[[], None] | None = None,
    ):
        if on_failure not in ("abort", "revoke"):
            raise ValueError(f"on_failure must be 'abort' or 'revoke', not {on_failure!r}")
        self.rank = rank
        self.on_failure = on_failure
        self.watch = watch
        self.first_completed_at: float | None = None  # time.time() of the first exchange waited to completion
        self.configure(communicator, rank_map)
        if device is None:
            # A runtime whose pointers are host addresses (the mock) moves CPU tensors.
            host = communicator.cuda.host_memory
            device = torch.device("cpu") if host else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        # The mock fabric completes an event when the receives posted before it on its
        # stream arrive: every transport gets a stream number of its own.
        self._mock_stream = next(_MOCK_STREAMS)  # used on the CPU only
        self._side = torch.cuda.Stream(self.device) if side_stream and self.device.type == "cuda" else None

    def configure(self, group: Communicator, rank_map: Mapping[int, int] | None = None) -> None:
        """Exchange over communicator ``group`` from now on; ``rank_map`` maps program ranks to
        its ranks (None: the same numbers). Clears an earlier failure."""
        self.communicator = group
        self._map = dict(rank_map) if rank_map is not None else None
        self._error = None

    @classmethod
    def from_store(
        cls,
        rank: int,
        participants: Sequence[int],
        store: Any,
        *,
        key: str = "layoutlang/nccl/executor",
        timeout: float = 300.0,
        api: _core.nccl.NcclApi | None = None,
        cuda: _core.nccl.CudaApi | None = None,
        **kwargs: Any,
    ) -> NcclTransport:
        """Create the communicator of ``participants`` (program ranks, in order) through ``store``."""
        ordered = sorted(set(participants))
        if rank not in ordered:
            raise ExecutionError(f"rank {rank} is not one of the participants {ordered}", rank=rank)
        comm = Communicator.create(
            store, ordered.index(rank), len(ordered), key=key, api=api, cuda=cuda, timeout=timeout
        )
        return cls(rank, comm, {r: i for i, r in enumerate(ordered)}, **kwargs)

    def _peer(self, rank: int) -> int:
        if self._map is None:
            return rank
        if rank not in self._map:
            raise ExecutionError(
                f"rank {self.rank}: program rank {rank} has no rank in the NCCL communicator",
                rank=self.rank,
                peers=[rank],
            )
        return self._map[rank]

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return self._mock_stream
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            return self._side.cuda_stream
        return torch.cuda.current_stream(self.device).cuda_stream

    def _fail(self) -> str:
        """Apply the failure policy; returns what was done ("aborted" or "revoked")."""
        if self.on_failure == "revoke":
            try:
                self.communicator.revoke()
                return "revoked"
            except (NcclError, CudaError) as err:
                log.warning("rank %d: revoke failed (%s); aborting", self.rank, err.message)
        try:
            self.communicator.abort()
        except NcclError as err:
            log.warning("rank %d: abort failed: %s", self.rank, err.message)
        return "aborted"

    def abort(self) -> None:
        """Abort the communicator: pending exchanges end, later ones raise until :meth:`configure`."""
        self._failed(ExecutionError(f"rank {self.rank}: the transport was aborted", rank=self.rank))
        self.communicator.abort()

    def _staged(
        self,
        buf: torch.Tensor,
        receive: bool,
        keep: list[torch.Tensor],
        back: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ExecutionError(
                f"rank {self.rank}: NCCL transport buffers are contiguous 1-D uint8 tensors", rank=self.rank
            )
        if buf.device.type == self.device.type:
            keep.append(buf)
            return buf
        if receive:
            device = torch.empty_like(buf, device=self.device)
            back.append((buf, device))
        else:
            device = buf.to(self.device)
        keep.append(device)
        return device

    def exchange(self, sends: Buffers, recvs: Buffers, tag: int) -> Pending:
        """Post every receive and send as one NCCL group; ``tag`` is ignored (NCCL matches
        point-to-point messages between two ranks in the order they are posted)."""
        keep: list[torch.Tensor] = []
        back: list[tuple[torch.Tensor, torch.Tensor]] = []
        labels: list[str] = []
        peers: list[int] = []
        posted_recvs: list[Transfer] = []
        posted_sends: list[Transfer] = []
        for peer, buf in recvs:
            staged = self._staged(buf, True, keep, back)
            posted_recvs.append((self._peer(peer), staged.data_ptr(), staged.numel()))
            labels.append(f"receiving {buf.numel()} bytes from rank {peer}")
            peers.append(peer)
        for peer, buf in sends:
            staged = self._staged(buf, False, keep, back)
            posted_sends.append((self._peer(peer), staged.data_ptr(), staged.numel()))
            labels.append(f"sending {buf.numel()} bytes to rank {peer}")
            peers.append(peer)
        try:
            ticket = self.communicator.exchange(posted_sends, posted_recvs, self._stream())
        except (NcclError, CudaError) as err:
            action = self._fail() if self.communicator.state in ("ready", "failed") else self.communicator.state
            error = NcclError(
                f"rank {self.rank}: the NCCL exchange with {ranks_phrase(peers)} could not start: {err.message}; "
                f"the communicator is {action}",
                call=err.call,
                code=err.code if isinstance(err, NcclError) else None,
                rank=self.rank,
                peers=peers,
            )
            self._failed(error)
            raise error from None
        return _NcclPending(self, ticket, labels, peers, keep, back)
