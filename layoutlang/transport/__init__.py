"""Transports move buffers between program ranks; they know nothing of plans or layouts.

:class:`Transport` is the interface the executor needs; :class:`TorchTransport` runs it
over torch.distributed (gloo on CPU, NCCL on GPU); :mod:`layoutlang.transport.nccl` over
the native NCCL core.
"""

from .base import Pending, Transport
from .torch_distributed import TorchTransport

__all__ = ["Pending", "TorchTransport", "Transport"]
