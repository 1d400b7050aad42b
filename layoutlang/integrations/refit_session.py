"""The refit session of live inference engines: one elastic session over the trainer ranks and
every worker of every engine.

A trainer and its inference engines are separate torch.distributed worlds (the trainer's
FSDP/TP group, each engine's own TP group), so their ranks share no process group. Their
refits run in an :class:`elastic.ElasticSession` beside both worlds, on a store every member
reaches: trainer rank 0 serves it (the default), or a process that outlives the trainer does
(an RL framework's controller, the torchrun agent's store), so that a restarted trainer finds
the session where it left it.

What the session is told about engines (:func:`fleet_session`):

- the destination mesh's first axis (``engine_axis``, default ``dp``) indexes engines: each
  coordinate is one engine, its other axes (``tp``) the engine's workers. An engine is lost
  whole (vLLM's executor dies with any of its workers), admitted whole, and the axis grows
  when an engine joins beyond the positions of lost ones and shrinks when one leaves;
- a training rank lost with no replica keeps its position (``await-rejoin``): refits raise
  :class:`~layoutlang.errors.DataLossError` while it is vacant, the engines keep serving
  their last committed weights and stay in the session, and a restarted trainer under the
  same ranks takes the positions back;
- engines are never waited for in a recovery: losing one drops its coordinate at once.

Every record of the session is signed with the job's secret (:mod:`elastic.auth`), which the
engines receive in their init info and never write anywhere. Joining engines take program
ranks from :func:`allocate_engine_ranks`, an aligned run per engine above every rank of the
program, so that the session sees whole units.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch

from elastic import ElasticSession, GlooGenerations, JobSecret, NcclGenerations
from elastic.auth import JOB_RECORD, RecordSigner, establish_job, peek, resolve_secret
from elastic.store import serve_store

from ..errors import ExecutionError, LayoutValueError
from ..model import Layout, Program
from ..runtime.delta import DeltaOptions

__all__ = [
    "DEFAULT_NAMESPACE",
    "SessionAddress",
    "allocate_engine_ranks",
    "engines_of",
    "fleet_session",
    "job_secret",
    "read_engine_ranks",
    "session_exists",
    "write_engine_ranks",
]

#: the session's keys live under this prefix of the store unless a namespace is given
DEFAULT_NAMESPACE = "layoutlang-refit"


@attrs.frozen
class SessionAddress:
    """Where a refit session lives: its store's address and the namespace of its keys."""

    host: str
    port: int
    namespace: str = DEFAULT_NAMESPACE

    def connect(self, *, serve: bool, timeout: float) -> Any:
        """The store: served here (listening on ``host`` only) or reached as a client."""
        import torch.distributed as dist

        try:
            if serve:
                return serve_store(self.host, self.port, timeout=timeout)
            return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError, OSError) as err:
            role = "serving" if serve else "reaching"
            raise ExecutionError(
                f"{role} the refit session's store at {self.host}:{self.port} failed ({timeout:g} s): "
                f"{str(err).splitlines()[0]}"
            ) from None


def job_secret(given: str | None, *, rank: int, group: Any = None) -> JobSecret:
    """The job's secret: ``given`` (hex or text), else ``LAYOUTLANG_JOB_SECRET``, else one that
    trainer rank 0 generates and broadcasts over ``group`` (None: the trainer's own default
    process group, when there is one; every trainer rank calls this at once; False: none),
    else (a trainer of one process) a fresh one."""
    secret = resolve_secret(given)
    if secret is not None:
        return secret
    import torch.distributed as dist

    if group is not False and dist.is_available() and dist.is_initialized():
        box = [secrets.token_hex(32) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        assert box[0] is not None
        return JobSecret.parse(box[0])
    if rank != 0:
        raise LayoutValueError(
            f"trainer rank {rank} has no job secret: give the same secret to every trainer rank "
            "(LayoutlangTrainerInitInfo.secret or LAYOUTLANG_JOB_SECRET), or a default process group"
        )
    return JobSecret.generate()


def fleet_session(
    program: Program,
    reshard: str | None,
    *,
    rank: int,
    store: Any,
    address: SessionAddress,
    secret: JobSecret,
    join: bool = False,
    engine_axis: str = "dp",
    timeout: float = 300.0,
    deadline: float = 2.0,
    memory_budget: int | None = None,
    device: Any = "cpu",
    problem: str | None = None,
    join_timeout: float | None = None,
    backend: Any = None,
    delta: bool | str | DeltaOptions = False,
    cast_sources: bool = False,
) -> ElasticSession:
    """This process's membership of the refit session (see the module doc): a trainer rank or
    an engine worker; ``join`` for a joining engine or a returning trainer rank (it waits up to
    ``join_timeout`` seconds, default ``timeout``, for a step boundary). Over NCCL (shrunk and
    grown communicators) where ``device`` is a CUDA device, gloo otherwise; ``backend``
    overrides that choice (a generation backend, e.g. NCCL over a mock fabric). ``delta``: the
    refits send only what changed (:ref:`delta-refits`; gloo only); ``cast_sources``: this rank's
    sources may hold another dtype (fp32 master weights), converted as they are packed."""
    device = torch.device(device)
    if backend is None:
        backend = (
            NcclGenerations(device=device, timeout=timeout) if device.type == "cuda"
            else GlooGenerations(timeout=timeout)
        )
    extra: dict[str, Any] = {} if memory_budget is None else {"memory_budget": memory_budget}
    return ElasticSession(
        program, reshard, rank=rank, store=store, port=address.port, host=address.host,
        namespace=address.namespace, join=join, secret=secret, timeout=timeout, deadline=deadline,
        source_policy="await-rejoin", destination_policy="drop-replica", destination_axis=engine_axis,
        unit_axis=engine_axis, grow=True, spares=False, backend=backend, device=device, problem=problem,
        join_timeout=join_timeout, delta=delta, cast_sources=cast_sources,
        **extra,
    )


def session_exists(store: Any, address: SessionAddress, secret: JobSecret) -> bool:
    """Whether the store already holds this session (its first generation was agreed): a
    restarted trainer then joins it instead of starting one."""
    import torch.distributed as dist

    namespaced = dist.PrefixStore(address.namespace, store)
    if peek(namespaced, JOB_RECORD) is None:
        return False
    return _records(store, address, secret).read(namespaced, "gen0/members") is not None


def _records(store: Any, address: SessionAddress, secret: JobSecret, *, wait: float = 30.0) -> RecordSigner:
    """A signer of the session's records, bound to its job (waited for up to ``wait`` seconds;
    a secret that is not the session's is refused: :class:`~layoutlang.errors.MembershipError`)."""
    import torch.distributed as dist

    records = RecordSigner(secret, address.namespace, store=store)
    establish_job(dist.PrefixStore(address.namespace, store), records, port=address.port, create=False, timeout=wait)
    return records


def engines_of(destination: Layout, engine_axis: str) -> list[tuple[int, ...]]:
    """The ranks of each engine of ``destination``: one run of ranks per coordinate of its
    first axis (the engine axis), in order."""
    mesh = destination.mesh
    if mesh.axis_names[0] != engine_axis:
        raise LayoutValueError(
            f"the engine axis '{engine_axis}' must be the first axis of mesh '{mesh.name}' "
            f"(axes {', '.join(mesh.axis_names)})",
            destination.span,
        )
    per = mesh.size // mesh.axis_size(engine_axis)
    return [tuple(mesh.ranks[i : i + per]) for i in range(0, mesh.size, per)]


def allocate_engine_ranks(store: Any, address: SessionAddress, program: Program, reshard: str | None,
                          engine_axis: str) -> list[int]:
    """Program ranks for a joining engine: a run aligned to the engine's size, above every rank
    of the program and of every earlier joining engine (a counter in the store; the same run
    is never handed out twice)."""
    import torch.distributed as dist

    statement = program.reshard(reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    size = len(engines_of(destination, engine_axis)[0])
    first = math.ceil((max(*source.mesh.ranks, *destination.mesh.ranks) + 1) / size) * size
    index = int(dist.PrefixStore(address.namespace, store).add("engine-ranks", 1)) - 1
    return list(range(first + index * size, first + (index + 1) * size))


def write_engine_ranks(store: Any, address: SessionAddress, secret: JobSecret, token: str,
                       ranks: Sequence[int]) -> None:
    """Record which program ranks an engine holds, under the token its client was given (a
    re-attaching trainer maps its clients to the session's engines by it); signed."""
    import torch.distributed as dist

    _records(store, address, secret).set(
        dist.PrefixStore(address.namespace, store), f"engines/{token}", json.dumps(sorted(ranks)).encode()
    )


def read_engine_ranks(store: Any, address: SessionAddress, secret: JobSecret, token: str) -> tuple[int, ...] | None:
    """The ranks recorded under ``token`` (None: none, or a record without the job's secret)."""
    import torch.distributed as dist

    value = _records(store, address, secret).read(dist.PrefixStore(address.namespace, store), f"engines/{token}")
    return None if value is None else tuple(int(r) for r in json.loads(value.decode()))

