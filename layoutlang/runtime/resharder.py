"""The Resharder an RL framework calls at every refit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._text import rank_ranges, ranks_phrase
from ..errors import AgreementError, ExecutionError, LayoutError, LayoutValueError
from ..io.torch_dtypes import torch_dtype
from ..lang import load
from ..model import Program
from ..plan import DEFAULT_BUCKET_BYTES, Plan, compile_plan
from ..transport import TorchTransport, Transport
from .agreement import agree, raise_stopped
from .delta import DeltaOptions
from .executor import Executor, RunReport, device_of

#: A reshard whose two meshes hold at least this many ranks together runs per-rank plans
#: unless told otherwise (``Resharder(per_rank=...)``): the whole fleet's plan takes every
#: rank seconds and gigabytes to compile there (DeepSeek-V3 on 4096 + 4096 ranks: 15-23 s
#: and 4-5 GiB), its own part milliseconds (docs/guides/performance.rst).
PER_RANK_PLAN_RANKS = 1024

# ---------------------------------------------------------------------- resharder


class Resharder:
    """Reshards one program's weights at every refit: build once, call :meth:`run` each step.

    >>> resharder = Resharder(program, reshard="refit")           # on every rank  # doctest: +SKIP
    >>> resharder.run(sources={"w": my_shard}, destinations={"w": engine_param})  # doctest: +SKIP

    ``sources`` and ``destinations`` map storage names to this rank's tensors (the shapes
    ``layout.storages_on(rank)`` gives). Destinations are written in place; without them,
    :meth:`run` allocates and returns them. Every rank of both meshes must build the
    Resharder with the same program and options: their plans' fingerprints are compared
    before any byte moves.

    ``memory_budget`` bounds this rank's staging memory: plans are cut into buckets of half
    of it, since the executor keeps at most two buckets' messages in flight.

    ``per_rank`` chooses the plan each rank compiles: its own part of the pairwise plan
    (True: :func:`~layoutlang.plan.plan_layouts` with ``rank=``; time and memory grow with
    what the rank moves, not with the fleet), the whole fleet's plan (False), or (None, the
    default) per-rank plans when the reshard's meshes hold at least
    :data:`PER_RANK_PLAN_RANKS` ranks together and every tensor moves by the reshard policy.
    Every rank decides alike from the program; a rank that decided otherwise (another
    program, another option) is refused by the fingerprint agreement.

    Without ``transport``, the process group (``group``, else the default one) must hold a
    process for every rank of the reshard (program rank r is global process r, or
    ``rank_map[r]``): a smaller one raises :class:`~layoutlang.errors.LayoutValueError` naming
    both numbers on every rank at once, before the agreement.

    ``problem`` reports what this rank found wrong before the plan is agreed (an engine whose
    parameters do not match the destination layout): the agreement fails on every rank with
    it, naming this rank, and nothing moves.

    The rank's :class:`Executor` is built before that agreement, so what its constructor
    refuses on one rank alone stops every rank in it too: every rank raises
    :class:`~layoutlang.errors.AgreementError` naming the rank and why (the refusing rank
    raises its own :class:`~layoutlang.errors.LayoutError` in the same words when the refusal
    is a user's mistake). An unexpected exception there (a bug) reaches the agreement as an
    internal error, its type and message; the rank it happened on then raises it itself, with
    its traceback.
    """

    def __init__(
        self,
        program: Program | str,
        reshard: str | None = None,
        *,
        rank: int | None = None,
        rank_map: Mapping[int, int] | None = None,
        group: Any = None,
        transport: Transport | None = None,
        memory_budget: int = 2 * DEFAULT_BUCKET_BYTES,
        policy: str | None = None,
        timeout: float = 300.0,
        problem: str | None = None,
        per_rank: bool | None = None,
    ):
        if rank is None:
            process_rank = dist.get_rank()
            inverse = {v: k for k, v in (rank_map or {}).items()}
            rank = inverse.get(process_rank, process_rank)
        self.rank = rank
        self.timeout = timeout
        error = None
        plan = None
        loaded: Program | None = None
        try:
            loaded = program if isinstance(program, Program) else load(program)
            own = _per_rank(loaded, reshard, policy) if per_rank is None else per_rank
            plan = compile_plan(
                loaded, reshard, bucket_bytes=max(1, memory_budget // 2), policy=policy, rank=rank if own else None
            )
        except LayoutError as err:
            # Still take part in the agreement, so every rank learns why instead of waiting.
            error = str(err)
        if problem is not None:  # what the caller found is more specific than what follows from it
            error = problem
        self.program = loaded
        if plan is not None:
            participants = sorted(set(plan.source.mesh.ranks) | set(plan.destination.mesh.ranks))
        else:
            participants = _participants_of(self.program, reshard, rank_map, group)
        if rank not in participants:
            raise ExecutionError(
                f"rank {rank} belongs to no mesh of the reshard (its ranks: {rank_ranges(participants)})", rank=rank
            )
        if rank_map is not None and not set(participants) <= set(rank_map):
            missing = sorted(set(participants) - set(rank_map))
            raise ExecutionError(
                f"{ranks_phrase(missing)} of the reshard {'has' if len(missing) == 1 else 'have'} "
                "no process in this job (rank_map)",
                rank=rank,
            )
        if transport is None:
            _check_group_size(plan.name if plan else reshard, participants, rank_map, group, rank)
        self.transport = transport if transport is not None else TorchTransport(rank, rank_map, group)
        # The executor is built before the agreement: what its constructor refuses on this
        # rank alone (a per-rank plan of another rank, a quantized tensor moved by broadcast,
        # anything its schedule raises) then stops every rank at once instead of leaving the
        # others waiting in the run's agreement for the whole timeout.
        executor: Executor | None = None
        refused: LayoutError | ExecutionError | None = None
        bug: Exception | None = None
        if plan is not None and error is None:
            try:
                executor = Executor(plan, rank, self.transport, timeout=timeout)
            except (LayoutError, ExecutionError) as err:
                refused, error = err, err.message  # it names the rank (and the tensor)
            except Exception as err:  # a bug: every rank learns of it; this one raises it below
                bug, error = err, _internal(rank, plan, err)
        fingerprint = plan.fingerprint if plan else None
        ready = problem is None and refused is None and bug is None
        try:
            agree(self.transport, rank, participants, fingerprint, error, timeout, ready=ready)
        except AgreementError as stopped:
            raise_stopped(stopped, refused or bug)
        assert plan is not None and executor is not None  # else agree() raised on every rank
        self.plan: Plan = plan
        self.executor = executor
        self.last_report: RunReport | None = None

    @property
    def source_storages(self) -> dict[str, tuple[int, ...]]:
        """Storage name -> local shape of the sources this rank must provide."""
        return dict(self.executor.source_storages)

    @property
    def destination_storages(self) -> dict[str, tuple[int, ...]]:
        """Storage name -> local shape of the destinations this rank receives."""
        return dict(self.executor.destination_storages)

    def allocate(
        self, side: str = "destination", *, dtype: torch.dtype | None = None, device: Any = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Zero-filled storages for ``side`` ("source" or "destination"), in the logical dtype
        unless ``dtype`` is given.

        A destination the plan quantizes (``quantize`` statements, an FP8 refit) gets what its
        engine holds: the quantized storages in their fp8 dtype (``dtype`` does not apply to
        them) and, beside them, every scale storage of the rank, in its shape and the scales'
        dtype (``..._weight_scale_inv``, fp32; ``e8m0`` for MXFP8), as ``run`` expects them."""
        layout = self.plan.source if side == "source" else self.plan.destination
        shapes = self.source_storages if side == "source" else self.destination_storages
        quantized = layout.quantized() if side == "destination" and self.plan.quantization is not None else {}
        out = {}
        for name, shape in shapes.items():
            part = layout.storage(name, self.rank).parts[0]
            q = quantized.get(part)
            wanted = torch_dtype(q.values) if q is not None else dtype or torch_dtype(layout.tensors[part].dtype)
            out[name] = torch.zeros(shape, dtype=wanted, device=device)
        if quantized and self.rank in layout.mesh:
            scale_shapes = layout.scale_storages_on(self.rank)
            for tensor, q in quantized.items():
                for box in layout.scale_boxes(tensor, self.rank):
                    if box.storage is not None and box.storage not in out:
                        out[box.storage] = torch.zeros(
                            scale_shapes[box.storage], dtype=torch_dtype(q.scale.dtype), device=device
                        )
        return out

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        destinations: Mapping[str, torch.Tensor] | None = None,
        *,
        cast: bool = False,
        cast_sources: bool = False,
        on_complete: Callable[[str, torch.Tensor], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        not_ready: str | None = None,
        delta: bool | str | DeltaOptions = False,
    ) -> dict[str, torch.Tensor]:
        """Move this rank's part of the plan; returns the destination storages.

        ``on_complete(name, tensor)`` is called for each destination storage as soon as all its
        bytes have arrived; ``cast=True`` accepts destinations in another dtype (converted on
        arrival, e.g. fp32 master weights into bf16 inference weights); ``cast_sources=True``
        accepts sources in another dtype, converted to the layout's while they are packed (fp32
        master weights sent as a bf16 wire: half the bytes, the same values as
        ``weight.to(torch.bfloat16)``). ``not_ready`` reports a
        problem this rank found before running (e.g. reading its weights): every rank stops
        with it and nothing moves.

        ``delta=True`` sends only what changed since the previous run (every rank asks alike;
        :mod:`layoutlang.runtime.delta`): each sender keeps a copy of what it sent, each
        receiver patches the destination storages in place. Hand the same destination tensors
        at every run: a storage handed anew, or written by someone else since, is received
        dense (named in ``last_report.delta.stale``). Needs a gloo group. ``delta="digests"``:
        a sender keeps only a digest per 4 KiB block of what it sent (8 bytes per block instead
        of a copy), and the blocks whose digest changed travel whole.
        """
        if destinations is None:
            device = device_of(list(sources.values())) if sources else torch.device("cpu")
            destinations = self.allocate("destination", device=device)
        self.last_report = self.executor.run(
            sources,
            destinations,
            cast=cast,
            cast_sources=cast_sources,
            on_complete=on_complete,
            progress=progress,
            not_ready=not_ready,
            delta=delta,
        )
        return dict(destinations)


def _internal(rank: int, plan: Plan, err: Exception) -> str:
    """What the agreement says of a bug that stopped this rank building its executor."""
    return f"internal error building the executor of plan '{plan.name}' on rank {rank}: {type(err).__name__}: {err}"


def _per_rank(program: Program, reshard: str | None, policy: str | None) -> bool:
    """Whether a Resharder of this reshard compiles per-rank plans by default: when its
    meshes hold at least PER_RANK_PLAN_RANKS ranks and every tensor moves by reshard."""
    statement = program.reshard(reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    if len(set(source.mesh.ranks) | set(destination.mesh.ranks)) < PER_RANK_PLAN_RANKS:
        return False
    if policy is not None:
        return policy == "reshard"
    return all(statement.policy_for(name) == "reshard" for name in source.resolved.names)


def _check_group_size(
    reshard: str | None, participants: list[int], rank_map: Mapping[int, int] | None, group: Any, rank: int
) -> None:
    """Refuse, before the agreement and before any byte moves, a process group that lacks a
    process of the reshard: a rank without one would leave its peers waiting for the whole
    timeout and then blame a peer. Program rank r is global process r (rank_map[r] with a
    rank_map), as torch's point-to-point calls address peers, and must be in ``group``."""
    if not dist.is_initialized():
        return  # TorchTransport says so, in its own words
    processes = [rank_map[r] for r in participants] if rank_map is not None else participants
    members = set(dist.get_process_group_ranks(group)) if group is not None else None
    size = dist.get_world_size(group)
    if members is None and max(processes) < size:
        return
    if members is not None and members.issuperset(processes):
        return
    what = f"reshard '{reshard}'" if reshard else "the reshard"
    mapped = " (through rank_map)" if rank_map is not None else ""
    if members is None:
        problem = f"needs a process group of at least {max(processes) + 1:,} processes{mapped}"
    else:
        absent = sorted(set(processes) - members)
        held = rank_ranges(sorted(members))
        problem = f"needs processes {rank_ranges(absent)}{mapped}, which the process group (global ranks {held}) lacks"
    raise LayoutValueError(
        f"{what} {problem} (its meshes hold ranks {rank_ranges(participants)}), but the process group has "
        f"{size:,}; nothing was started",
        hint="start one process per rank of the reshard's meshes, or pass the group that holds them (group=)",
    )


def _participants_of(
    program: Program | None, reshard: str | None, rank_map: Mapping[int, int] | None, group: Any
) -> list[int]:
    """The ranks that take part when this rank could not compile the plan itself."""
    if rank_map:
        return sorted(rank_map)
    if program is not None:
        try:
            statement = program.reshard(reshard)
            source, destination = program.layout(statement.source), program.layout(statement.destination)
            return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))
        except LayoutError:
            pass  # the statement or a layout is what failed: every rank of the group takes part
    return list(range(dist.get_world_size(group)))
