"""Running plans: schedule, executor, agreement, the Resharder an RL framework calls, and
DTensor redistribution across meshes.

The executor only reads a :class:`~layoutlang.plan.Plan`. On each rank it turns the plan
into a *schedule*: for every bucket and stage, the local copies, and for every peer one
message to send and one to receive, each the concatenation of the regions exchanged with
that peer (16-byte aligned). Running a step packs the messages into staging buffers, posts
all receives and sends at once, performs the local copies while they fly, waits, and
unpacks into the destination storages (casting on arrival when a destination storage has
another dtype). The next step's messages are packed while the current ones are in flight
when they read only source storages, so buckets are pipelined; relays (stage 1) run after
the network stage that feeds them.

Transports (:mod:`layoutlang.transport`) only move buffers:
:class:`~layoutlang.transport.TorchTransport` uses torch.distributed point-to-point
operations (``batch_isend_irecv``; gloo on CPU, NCCL on GPU). Before the first byte moves,
every rank of the plan sends its plan fingerprint to the lowest rank, which answers with a
verdict: a mismatch (different programs, versions or options on different ranks) stops every
rank with an error naming the ranks that differ, and nothing is transferred.
"""

from .agreement import agree
from .delta import DeltaOptions
from .executor import Executor, RunReport
from .redistribute import redistribute
from .resharder import Resharder

__all__ = ["DeltaOptions", "Executor", "Resharder", "RunReport", "agree", "redistribute"]
