"""Elastic communicators: refits that survive the loss and return of ranks.

:class:`ElasticSession` runs repeated refits and recovers from failures without restarting
anyone (``elastic.session``). It is built from: ``elastic.membership`` (heartbeats, exit
notifications, per-operation deadlines; compare-and-set agreement on each generation's
members), ``elastic.groups`` and ``elastic.nccl_backend`` (each generation's group: a new
gloo group under its own store prefix, or an NCCL communicator shrunk and grown),
``elastic.remesh`` (the layouts after a loss, and the never-silent-loss check),
``elastic.commit`` (the commit records of steps and generations), ``elastic.recovery``
(watch, settle, agree, remesh, rebuild, recovery plans; the :class:`Recovery` timeline)
and layoutlang's recovery plans. ``layoutlang apply --elastic`` is
:mod:`layoutlang.cli.elastic_job`; elastic never imports the command line.
"""

from layoutlang.errors import DataLossError, JobEndedError, MembershipError
from layoutlang.plan.loss import check_recoverable, lost_regions

from .auth import JobSecret
from .groups import ElasticGroup, GlooGenerations, GlooTransport, abandon, admit, build_group
from .membership import (
    ExcludedError,
    ExitWatcher,
    FailureDetector,
    GenerationChanged,
    Heartbeat,
    MemberFailure,
    Membership,
    decode_members,
    encode_members,
    failed_peers,
    generation_key,
)
from .nccl_backend import NcclGenerations, NcclGroup
from .recovery import Change, Recovery
from .remesh import data_parallel_axes, remesh
from .session import ElasticSession, StepReport

__all__ = [
    "Change",
    "DataLossError",
    "ElasticGroup",
    "ElasticSession",
    "ExcludedError",
    "ExitWatcher",
    "FailureDetector",
    "GenerationChanged",
    "GlooGenerations",
    "GlooTransport",
    "Heartbeat",
    "JobEndedError",
    "JobSecret",
    "MemberFailure",
    "Membership",
    "MembershipError",
    "NcclGenerations",
    "NcclGroup",
    "Recovery",
    "StepReport",
    "abandon",
    "admit",
    "build_group",
    "check_recoverable",
    "data_parallel_axes",
    "decode_members",
    "encode_members",
    "failed_peers",
    "generation_key",
    "lost_regions",
    "remesh",
]
