"""Jobs that tests/test_redistribute_reuse.py runs on every worker of a 4-rank gloo pool:
``layoutlang.runtime.redistribute`` keeps one Executor per (plan, rank, backend) between calls.

Each job returns plain data. The expected shards are cut from the full tensor with
``torch.chunk`` (DTensor's own rule for even shapes), not with layoutlang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from layoutlang.runtime.redistribute import _EXECUTORS, redistribute

WORLD = 4
_mesh: list[DeviceMesh] = []


def _the_mesh() -> DeviceMesh:
    """One 1-D mesh of every rank, built once per worker (DeviceMesh is collective)."""
    if not _mesh:
        _mesh.append(DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("x",)))
    return _mesh[0]


def _full(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


def _row_sharded(rows: int, cols: int) -> DTensor:
    mesh = _the_mesh()
    local = _full(rows, cols).chunk(WORLD, 0)[dist.get_rank()].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)),
                              stride=(cols, 1))


def _cached() -> list[Any]:
    return list(_EXECUTORS._entries.values())


def reuse() -> dict[str, Any]:
    """Three redistributes of one DTensor: twice to Shard(1) (the second reuses the first's
    Executor), then to Replicate (another plan: another Executor, both kept)."""
    _EXECUTORS.clear()
    rank = dist.get_rank()
    x = _row_sharded(8, 12)
    mesh = _the_mesh()
    first = redistribute_local(x, mesh, [Shard(1)])
    after_first = _cached()
    second = redistribute_local(x, mesh, [Shard(1)])
    after_second = _cached()
    replicated = redistribute_local(x, mesh, [Replicate()])
    after_third = _cached()
    expected = _full(8, 12).chunk(WORLD, 1)[rank]
    return {
        "one_after_first": len(after_first) == 1,
        "same_executor": len(after_second) == 1 and after_second[0] is after_first[0],
        "another_for_another_plan": len(after_third) == 2 and after_third[0] is after_first[0]
        and after_third[1] is not after_first[0] and after_third[1].plan is not after_first[0].plan,
        "values": torch.equal(first, expected) and torch.equal(second, expected)
        and torch.equal(replicated, _full(8, 12)),
    }


def bounded() -> dict[str, Any]:
    """Twelve redistributes of twelve shapes: at most MAX_ENTRIES Executors stay, the most
    recent ones; each result is right."""
    _EXECUTORS.clear()
    rank = dist.get_rank()
    mesh = _the_mesh()
    right = True
    for k in range(12):
        rows, cols = 4 * (k + 1), 8
        out = redistribute_local(_row_sharded(rows, cols), mesh, [Shard(1)])
        right = right and torch.equal(out, _full(rows, cols).chunk(WORLD, 1)[rank])
    shapes = [tuple(e.plan.source.tensors["tensor"].shape) for e in _cached()]
    return {"right": right, "kept": shapes}


def redistribute_local(x: DTensor, mesh: DeviceMesh, placements: list[Any]) -> torch.Tensor:
    out = redistribute(x, mesh, placements)
    return out.to_local()


def not_reused_after_a_failure() -> dict[str, Any]:
    """A run that raises (here before any byte moves, on every rank) leaves its Executor out
    of the cache: the next call builds a new one."""
    _EXECUTORS.clear()
    mesh = _the_mesh()
    x = _row_sharded(8, 12)
    redistribute_local(x, mesh, [Shard(1)])
    (executor,) = _cached()

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a transport that timed out")

    executor.run = fail
    try:
        redistribute_local(x, mesh, [Shard(1)])
        raised = False
    except RuntimeError:
        raised = True
    left = len(_cached())
    out = redistribute_local(x, mesh, [Shard(1)])
    (fresh,) = _cached()
    return {"raised": raised, "left": left, "fresh": fresh is not executor,
            "values": torch.equal(out, _full(8, 12).chunk(WORLD, 1)[dist.get_rank()])}
