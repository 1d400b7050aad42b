"""Point-to-point over torch.distributed (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from ..errors import ExecutionError


class _TorchPending:
    def __init__(self, rank: int, works: list, labels: list[str]):
        self.rank, self.works, self.labels = rank, works, labels

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, label in zip(self.works, self.labels):
            remaining = max(0.001, deadline - time.monotonic())
            try:
                completed = work.wait(timedelta(seconds=remaining))
            except RuntimeError as err:
                raise ExecutionError(
                    f"rank {self.rank}: {label} failed or did not complete within {timeout:g} s "
                    f"(the peer may have died or hung): {str(err).splitlines()[0]}"
                ) from None
            if completed is False:
                raise ExecutionError(f"rank {self.rank}: {label} did not complete within {timeout:g} s")


class TorchTransport:
    """Point-to-point over torch.distributed (gloo on CPU, NCCL on GPU).

    ``rank_map`` maps program ranks to ranks of ``group`` (default: the same numbers), so a
    program whose ranks are sparse can run on a compact process group.
    """

    def __init__(
        self, rank: int, rank_map: Mapping[int, int] | None = None, group: Any = None, device: Any = None
    ):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ExecutionError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self.rank = rank
        self.group = group
        self._map = dict(rank_map) if rank_map is not None else None
        if device is None:  # NCCL moves only GPU memory: small control messages go there too
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
        self.device = torch.device(device)

    def _peer(self, rank: int) -> int:
        return self._map[rank] if self._map is not None else rank

    def exchange(self, sends, recvs, tag):
        dist = self._dist
        ops, labels = [], []
        for peer, buf in recvs:
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(peer), self.group, tag))
            labels.append(f"receiving {buf.numel()} bytes from rank {peer}")
        for peer, buf in sends:
            ops.append(dist.P2POp(dist.isend, buf, self._peer(peer), self.group, tag))
            labels.append(f"sending {buf.numel()} bytes to rank {peer}")
        works = dist.batch_isend_irecv(ops) if ops else []
        return _TorchPending(self.rank, list(works), labels)
