"""Move a DTensor to another device mesh, which ``DTensor.redistribute`` cannot do.

Run it from anywhere (about half a minute, most of it starting processes)::

    python examples/python/redistribute_dtensor.py

It starts four local worker processes, ranks 0..3 of one gloo group, and builds three
device meshes over them: ``train`` (ranks 0..1, ``tp``), ``infer`` (ranks 0..3 as 2 x 2,
``dp`` x ``tp``) and ``line`` (ranks 0..3, ``tp``). Every result is compared with
``distribute_tensor`` of the whole tensor on the destination mesh.
"""

from __future__ import annotations

import torch

from layoutlang.cli.launch import LocalWorkers


def job() -> dict:
    """What every rank runs; returns what this rank saw (plain data)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from layoutlang import LayoutError
    from layoutlang.runtime.redistribute import redistribute

    seen = {}
    # Building a DeviceMesh is collective: every rank builds every mesh, in the same order,
    # including the meshes it is not in.
    train = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    infer = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    line = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("tp",))

    weight = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # the same on every rank
    source = distribute_tensor(weight, train, [Shard(0)], src_data_rank=None)  # rows 0:4 | 4:8

    # 1. DTensor changes placements within one mesh only.
    try:
        source.redistribute(infer, [Replicate(), Shard(1)])
    except NotImplementedError as err:
        seen["dtensor"] = f"NotImplementedError: {err}"

    # 2. layoutlang moves it to another mesh: every rank of either mesh calls redistribute,
    # and gets a DTensor on `infer` (None on a rank outside the destination mesh).
    moved = redistribute(source, infer, [Replicate(), Shard(1)])
    oracle = distribute_tensor(weight, infer, [Replicate(), Shard(1)], src_data_rank=None)
    local = moved.to_local()
    seen["infer"] = f"local {list(local.shape)}, columns {int(local[0, 0])}:{int(local[0, -1]) + 1}"
    seen["infer_ok"] = torch.equal(local, oracle.to_local()) and torch.equal(
        moved.full_tensor(), weight
    )

    # 3. _StridedShard(0, split_factor=2) on a 1-D mesh is vLLM's fused gate_up layout:
    # each rank holds rows of both halves (its gate rows, then its up rows).
    fused = redistribute(source, line, [_StridedShard(0, split_factor=2)])
    oracle = distribute_tensor(weight, line, [_StridedShard(0, split_factor=2)], src_data_rank=None)
    seen["line"] = f"rows {(fused.to_local()[:, 0] // 6).int().tolist()}"
    seen["line_ok"] = torch.equal(fused.to_local(), oracle.to_local())

    # 4. Partial holds unreduced sums, not shards: refused on every rank before anything
    # moves. Reduce it on its own mesh first, then move it.
    partial = DTensor.from_local(weight / 4, line, [Partial()], run_check=False)
    try:
        redistribute(partial, infer, [Replicate(), Shard(1)])
    except LayoutError as err:
        seen["partial"] = f"{type(err).__name__}: {err.message}"
    reduced = partial.redistribute(line, [Replicate()])  # an all-reduce over `line`
    moved = redistribute(reduced, infer, [Replicate(), Shard(1)])
    seen["reduced_ok"] = torch.equal(moved.full_tensor(), weight)
    return seen


def main() -> None:
    with LocalWorkers(4, timeout=120.0) as workers:
        seen = workers.run(job)

    def same(key):  # what every rank saw, when all saw the same
        values = {s.get(key) for s in seen}
        return values.pop() if len(values) == 1 else f"ranks differ: {sorted(map(str, values))}"

    print(f"DTensor.redistribute to another mesh: {same('dtensor')}")
    print("layoutlang redistribute, train [Shard(0)] -> infer [Replicate(), Shard(1)]:")
    for rank, s in enumerate(seen):
        print(f"  rank {rank}: {s['infer']}")
    print(f"  equal to distribute_tensor, full_tensor() == weight: {same('infer_ok')}")
    print("layoutlang redistribute, train [Shard(0)] -> line [_StridedShard(0, split_factor=2)]:")
    for rank, s in enumerate(seen):
        print(f"  rank {rank}: {s['line']}")
    print(f"  equal to distribute_tensor: {same('line_ok')}")
    print(f"a Partial source, on every rank: {same('partial')}")
    print(f"reduced first, then moved: full_tensor() == weight: {same('reduced_ok')}")
    ok = all(same(k) is True for k in ("infer_ok", "line_ok", "reduced_ok"))
    ok = (
        ok
        and same("dtensor").startswith("NotImplementedError")
        and same("partial").startswith("LayoutValueError")
    )
    print("ok" if ok else "FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
