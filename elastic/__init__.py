"""Elastic communicators: refits that survive the loss and return of ranks.

:class:`ElasticSession` runs repeated refits and recovers from failures without restarting
anyone (``elastic.session``). It is built from: ``elastic.membership`` (heartbeats, exit
notifications, per-operation deadlines; compare-and-set agreement on each generation's
members), ``elastic.groups`` and ``elastic.nccl_backend`` (each generation's group: a new
gloo group under its own store prefix, or an NCCL communicator shrunk and grown),
``elastic.remesh`` (the layouts after a loss, and the never-silent-loss check) and
layoutlang's recovery plans. ``elastic.job`` is ``layoutlang apply --elastic``.
"""

from .groups import ElasticGroup, GlooGenerations, GlooTransport, abandon, admit, build_group
from .membership import (
    ExcludedError,
    ExitWatcher,
    FailureDetector,
    Heartbeat,
    Membership,
    MembershipError,
    decode_members,
    encode_members,
    failed_peers,
    generation_key,
)

__all__ = [
    "ElasticGroup",
    "ExcludedError",
    "GlooGenerations",
    "ExitWatcher",
    "FailureDetector",
    "GlooTransport",
    "Heartbeat",
    "Membership",
    "MembershipError",
    "abandon",
    "admit",
    "build_group",
    "decode_members",
    "encode_members",
    "failed_peers",
    "generation_key",
]

from .remesh import DataLossError, check_recoverable, data_parallel_axes, lost_regions, remesh

__all__ += ["DataLossError", "check_recoverable", "data_parallel_axes", "lost_regions", "remesh"]

from .nccl_backend import NcclGenerations, NcclGroup
from .session import Change, ElasticSession, GenerationChanged, MemberFailure, Recovery, StepReport

__all__ += [
    "Change",
    "ElasticSession",
    "GenerationChanged",
    "MemberFailure",
    "NcclGenerations",
    "NcclGroup",
    "Recovery",
    "StepReport",
]
