"""Transports move buffers between program ranks; they know nothing of plans or layouts.

:class:`Transport` is the lifecycle every transport follows (``configure``, ``exchange``,
``abort``, ``errored``) and :class:`Pending` the handle an exchange returns;
:class:`TorchTransport` runs it over torch.distributed (gloo on CPU, NCCL on GPU);
:mod:`layoutlang.transport.nccl` over the native NCCL core.
"""

from .base import Buffers, Pending, Transport
from .torch_distributed import TorchTransport

__all__ = ["Buffers", "Pending", "TorchTransport", "Transport"]
