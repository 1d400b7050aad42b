"""DTensor in and out: redistribute a DTensor onto another mesh, which DTensor cannot do.

``DTensor.redistribute`` changes placements on one device mesh; across meshes it raises
``NotImplementedError``. :func:`redistribute` describes both sides as layoutlang layouts of
one logical tensor (DTensor's placements map one to one: ``Shard(d)`` to
:class:`~layoutlang.Shard`, ``Replicate`` to :class:`~layoutlang.Replicate`,
``_StridedShard(d, split_factor=sf)`` to ``Shard(d, blocks=sf)``), compiles the exact plan
and runs it with the executor. ``Partial`` placements hold unreduced sums, not shards: reduce
them first (``dtensor.redistribute(mesh, [Replicate()])`` or ``full_tensor()``).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import LayoutValueError
from ..io.torch_dtypes import dtype_name
from ..model import Layout, LogicalTensor, Mesh, Replicate, Rule, Shard
from ..plan import DEFAULT_BUCKET_BYTES, Plan, plan_layouts
from ..transport import TorchTransport
from .executor import Executor

__all__ = ["mesh_from_device_mesh", "placements_from_dtensor", "redistribute"]

_NAME = "tensor"


def mesh_from_device_mesh(device_mesh: Any, name: str = "mesh") -> Mesh:
    """The layoutlang Mesh of a DeviceMesh: same ranks, row-major, axes named as its dims."""
    shape = tuple(device_mesh.mesh.shape)
    names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(shape)))
    return Mesh(name, tuple(zip(names, shape)), device_mesh.mesh.flatten().tolist())


def _unsliced(device_mesh: Any, placements: Sequence[Any]) -> tuple[Any, list[Any]]:
    """A DTensor on a slice of a mesh (``world["tp"]``) lives, replicated, on every slice:
    describe it on the whole (root) mesh, so every rank describes the same layout."""
    from torch.distributed.tensor import Replicate as DReplicate

    root = device_mesh._get_root_mesh() if hasattr(device_mesh, "_get_root_mesh") else device_mesh
    if root is device_mesh or root is None:
        return device_mesh, list(placements)
    names, root_names = device_mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        raise LayoutValueError(
            "a DTensor on a sliced or flattened device mesh needs mesh dims named after its root mesh's dims"
        )
    full: list[Any] = [DReplicate()] * root.ndim
    for name, placement in zip(names, placements):
        full[root_names.index(name)] = placement
    return root, full


def placements_from_dtensor(placements: Sequence[Any]) -> tuple[Shard | Replicate, ...]:
    """DTensor placements as layoutlang placements; Partial is refused."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Shard | Replicate] = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(Shard(p.dim, blocks=int(p.split_factor)))
        elif isinstance(p, DShard):
            out.append(Shard(p.dim))
        elif isinstance(p, DReplicate):
            out.append(Replicate())
        else:
            raise LayoutValueError(
                f"placement {p!r} is not a shard or a replica (a Partial holds unreduced sums); "
                "reduce it first, e.g. dtensor.redistribute(mesh, [Replicate()])"
            )
    return tuple(out)


def _layout(name: str, mesh: Mesh, tensor: LogicalTensor, placements: tuple) -> Layout:
    rule = Rule(_NAME, dict(zip(mesh.axis_names, placements)))
    return Layout(name, mesh, {_NAME: tensor}, (rule,))


@functools.lru_cache(maxsize=64)
def _plan(
    source: tuple[Mesh, tuple[Shard | Replicate, ...]],
    destination: tuple[Mesh, tuple[Shard | Replicate, ...]],
    shape: tuple[int, ...],
    dtype: str,
    domain_size: int,
    bucket_bytes: int,
) -> Plan:
    tensor = LogicalTensor(_NAME, shape, dtype)
    (src_mesh, src_placements), (dst_mesh, dst_placements) = source, destination
    return plan_layouts(
        _layout("source", src_mesh, tensor, src_placements),
        _layout("destination", dst_mesh, tensor, dst_placements),
        name="redistribute",
        domain_size=domain_size,
        bucket_bytes=bucket_bytes,
    )


class _Executors:
    """The Executors of recent redistributes, kept between calls: building one (the rank's
    schedule, its scratch regions, and the staging arenas its first run allocates) costs more
    than a small redistribute itself. Keyed by (plan fingerprint, rank, backend of the default
    process group: the transport's device follows it); at most ``MAX_ENTRIES`` of them, whose
    arenas together hold at most the memory budget of the call that returns one (the least
    recently used go first). A call takes its Executor out while it runs and puts it back
    after a run that succeeded, so two threads never share one (and its arenas), and an
    Executor whose run failed (a transport that timed out) is never reused."""

    MAX_ENTRIES = 8

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, int, str], Executor] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: tuple[str, int, str]) -> Executor | None:
        with self._lock:
            return self._entries.pop(key, None)

    def give_back(self, key: tuple[str, int, str], executor: Executor, memory_budget: int) -> None:
        with self._lock:
            self._entries[key] = executor
            self._entries.move_to_end(key)
            while len(self._entries) > self.MAX_ENTRIES or (
                len(self._entries) > 1 and sum(map(_arena_bytes, self._entries.values())) > memory_budget
            ):
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _arena_bytes(executor: Executor) -> int:
    return sum(arena.nbytes for arena in executor._arenas)


#: the Executors :func:`redistribute` reuses between calls
_EXECUTORS = _Executors()


def _dtype_name(dtype: torch.dtype) -> str:
    name = dtype_name(dtype)
    if name is None:
        raise LayoutValueError(f"dtype {dtype} is not supported")
    return name


def redistribute(
    dtensor: Any,
    device_mesh: Any,
    placements: Sequence[Any],
    *,
    domain_size: int = 1,
    memory_budget: int = 2 * DEFAULT_BUCKET_BYTES,
    timeout: float = 300.0,
) -> Any:
    """``dtensor`` moved to ``device_mesh`` with ``placements`` (meshes may differ).

    Every rank of both meshes calls it (ranks of only one mesh too); on ranks of neither it
    does nothing. On ranks of the destination mesh it returns the new DTensor; elsewhere
    None. A DTensor on a slice of a mesh (``world["tp"]``) is taken as replicated over the
    other dims of the root mesh. Only the exact overlap of the shards moves; ``domain_size``
    groups ranks that share fast links.

    The plan and the rank's Executor (its schedule and staging arenas) are kept between
    calls, so a loop of redistributes of one shape and placement builds them once: at most
    8 Executors, whose arenas together stay within ``memory_budget``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(dtensor, DTensor):
        raise LayoutValueError(
            f"redistribute takes a DTensor on every rank; this rank passed {type(dtensor).__name__}",
            hint="a rank outside the source mesh passes the source DTensor too, made there without data: "
            "distribute_tensor(torch.empty(shape, dtype=dtype), source_mesh, source_placements, src_data_rank=None)",
            rank=dist.get_rank() if dist.is_initialized() else None,
        )
    rank = dist.get_rank()
    if len(placements) != device_mesh.ndim:
        raise LayoutValueError(f"{len(placements)} placements for a destination mesh of {device_mesh.ndim} dims")
    src_root, src_full = _unsliced(dtensor.device_mesh, dtensor.placements)
    dst_root, dst_full = _unsliced(device_mesh, placements)
    source_mesh = mesh_from_device_mesh(src_root, "source")
    destination_mesh = mesh_from_device_mesh(dst_root, "destination")
    src_placements = placements_from_dtensor(src_full)
    dst_placements = placements_from_dtensor(dst_full)
    if rank not in source_mesh and rank not in destination_mesh:
        return None  # as in DTensor: a rank outside both meshes has nothing to do
    plan = _plan(
        (source_mesh, src_placements),
        (destination_mesh, dst_placements),
        tuple(dtensor.shape),
        _dtype_name(dtensor.dtype),
        domain_size,
        max(1, memory_budget // 2),
    )
    key = (plan.fingerprint, rank, str(dist.get_backend()))
    executor = _EXECUTORS.take(key) or Executor(plan, rank, TorchTransport(rank), timeout=timeout)
    executor.timeout = timeout
    local = dtensor.to_local() if rank in source_mesh else None
    sources = {_NAME: local} if local is not None else {}
    destinations = {}
    if rank in destination_mesh:
        shape = plan.destination.storage_shape(_NAME, rank) or _empty_shape(plan, rank)
        device = local.device if local is not None else torch.device(device_mesh.device_type)
        destinations[_NAME] = torch.empty(shape, dtype=dtensor.dtype, device=device)
    executor.run(sources, destinations)
    _EXECUTORS.give_back(key, executor, memory_budget)
    if rank not in destination_mesh:
        return None
    return DTensor.from_local(
        destinations[_NAME],
        device_mesh,
        list(placements),
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )


def _empty_shape(plan: Plan, rank: int) -> tuple[int, ...]:
    return tuple(plan.destination.local_shape(_NAME, rank) or ())
