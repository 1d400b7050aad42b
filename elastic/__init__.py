"""Elastic communicators: membership, shrink and grow, and remeshing during failure recovery.

The package is built on layoutlang's layouts and plans; see the design notes in the docs.
``elastic.membership`` detects failures (heartbeats, exit notifications, per-operation
deadlines) and agrees on each generation's members; ``elastic.groups`` builds the process
group of a generation at once under its own store prefix, and a Transport over it.
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
