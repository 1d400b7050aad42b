"""Point-to-point over torch.distributed (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._text import ranks_phrase
from ..errors import ExecutionError
from .base import Buffers, Pending, Transport

__all__ = ["TorchTransport"]


class _TorchPending(Pending):
    def __init__(self, transport: TorchTransport, works: Sequence[Any], labels: Sequence[str], peers: Sequence[int]):
        super().__init__(transport, labels, peers)
        self.works = list(works)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, label, peer in zip(self.works, self.labels, self.peers):
            remaining = max(0.001, deadline - time.monotonic())
            try:
                completed = work.wait(timedelta(seconds=remaining))
            except RuntimeError as err:
                raise ExecutionError(
                    f"rank {self.rank}: {label} failed or did not complete within {timeout:g} s "
                    f"(the peer may have died or hung): {str(err).splitlines()[0]}",
                    rank=self.rank,
                    peers=[peer],
                ) from None
            if completed is False:
                raise ExecutionError(
                    f"rank {self.rank}: {label} did not complete within {timeout:g} s", rank=self.rank, peers=[peer]
                )


class TorchTransport(Transport):
    """Point-to-point over torch.distributed (gloo on CPU, NCCL on GPU).

    ``group`` is the process group (default: the default group); ``rank_map`` maps program
    ranks to ranks of ``group`` (default: the same numbers), so a program whose ranks are
    sparse can run on a compact process group. ``device`` is where the buffers live
    (default: the current CUDA device for an NCCL group, else the CPU).
    """

    def __init__(
        self, rank: int, rank_map: Mapping[int, int] | None = None, group: Any = None, device: Any = None
    ):
        if not dist.is_initialized():
            raise ExecutionError("torch.distributed is not initialized: call init_process_group first", rank=rank)
        self.rank = rank
        self._device = device
        self.configure(group, rank_map)

    def configure(self, group: Any, rank_map: Mapping[int, int] | None = None) -> None:
        """Use process group ``group`` (None: the default group) with ``rank_map`` from now on."""
        self.group = group
        self._map = dict(rank_map) if rank_map is not None else None
        device = self._device
        if device is None:  # NCCL moves only GPU memory: small control messages go there too
            nccl = "nccl" in str(dist.get_backend(group))
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.variable_length = "gloo" in str(dist.get_backend(group))
        self._reset()

    def _peer(self, rank: int) -> int:
        return self._map[rank] if self._map is not None else rank

    def exchange(self, sends: Buffers, recvs: Buffers, tag: int) -> Pending:
        self._refuse_if_aborted(sends, recvs)
        ops, labels, peers = [], [], []
        for peer, buf in recvs:
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(peer), self.group, tag))
            labels.append(f"receiving {buf.numel()} bytes from rank {peer}")
            peers.append(peer)
        for peer, buf in sends:
            ops.append(dist.P2POp(dist.isend, buf, self._peer(peer), self.group, tag))
            labels.append(f"sending {buf.numel()} bytes to rank {peer}")
            peers.append(peer)
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as err:  # gloo refuses at once when a peer's connection is gone
            error = ExecutionError(
                f"rank {self.rank}: the exchange with {ranks_phrase(peers)} could not start "
                f"({'; '.join(labels)}; a peer may have died): {str(err).splitlines()[0]}",
                rank=self.rank,
                peers=peers,
            )
            self._failed(error)
            raise error from None
        return _TorchPending(self, list(works), labels, peers)

    def abort(self) -> None:
        """Abort the process group's pending operations where the backend can (NCCL; gloo's
        waits end at their deadline); later exchanges raise until :meth:`configure`."""
        self._mark_aborted()
        group = self.group if self.group is not None else dist.group.WORLD
        if group is not None:  # None: the default group is already destroyed
            group.abort()
