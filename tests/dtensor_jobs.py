"""Jobs that tests/test_dtensor_redistribute.py runs on every worker of an 8-rank gloo pool.

Each job cross-checks ``layoutlang.runtime.redistribute.redistribute`` against DTensor itself and
returns plain data (never tensors that the parent would have to compare).

DeviceMesh construction is collective (it creates a process group per mesh axis over the
default group), so every worker builds every mesh of :data:`MESHES`, once and in the same
order, including meshes it is not in. In torch 2.13 a rank outside a DeviceMesh gets
``get_coordinate() is None``, and ``distribute_tensor`` there returns a DTensor of the full
global shape whose local tensor is empty (shape ``(0,)``), without communicating; DTensor
itself cannot move a tensor from one mesh to another.

Placements are written as short strings so that test ids read well: ``R`` (Replicate),
``S<d>`` (Shard(d)), ``SS<d>/<sf>`` (``_StridedShard(d, split_factor=sf)``), ``P`` (Partial).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from layoutlang.errors import LayoutError, RuntimeFailure
from layoutlang.runtime.redistribute import redistribute

#: name -> (ranks as a nested list, row-major; mesh_dim_names or None)
MESHES: dict[str, tuple[Any, tuple[str, ...] | None]] = {
    "world2x4": ([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp")),
    "world8": (list(range(8)), ("world",)),
    "world2x2x2": ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ("pp", "dp", "tp")),
    "low2x2": ([[0, 1], [2, 3]], ("dp", "tp")),
    "low4": ([0, 1, 2, 3], ("tp",)),
    "high2x2": ([[4, 5], [6, 7]], ("x", "y")),
    "high4": ([4, 5, 6, 7], ("tp",)),
    "high4_reversed": ([7, 6, 5, 4], None),  # ranks out of order, no dim names
    "high2x2_columns": ([[4, 6], [5, 7]], None),  # row-major over a permuted rank list
    "mid6": ([2, 3, 4, 5, 6, 7], ("dp",)),
    "mid2x3": ([[2, 3, 4], [5, 6, 7]], ("dp", "tp")),
    "pair01": ([0, 1], ("tp",)),
    "one7": ([7], ("solo",)),
}

_built: dict[str, DeviceMesh] = {}


def meshes() -> dict[str, DeviceMesh]:
    """Every mesh of MESHES, built collectively on the first call (every worker calls it)."""
    if not _built:
        for name, (ranks, names) in MESHES.items():
            _built[name] = DeviceMesh("cpu", ranks, mesh_dim_names=names)
    return _built


def mesh_ranks(name: str) -> list[int]:
    return torch.tensor(MESHES[name][0]).flatten().tolist()


def placement(spec: str):
    if spec == "R":
        return Replicate()
    if spec == "P":
        return Partial()
    if spec.startswith("SS"):
        dim, sf = spec[2:].split("/")
        return _StridedShard(int(dim), split_factor=int(sf))
    if spec.startswith("S"):
        return Shard(int(spec[1:]))
    raise ValueError(spec)


def placements(specs: str) -> list:
    """``"S0,R"`` -> [Shard(0), Replicate()]."""
    return [placement(s) for s in specs.split(",")] if specs else []


DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "int64", "float16", "float64", "int8", "uint8", "int32", "bool",
                 "float8_e4m3fn", "complex64")
}


def full_tensor(shape, dtype: str) -> torch.Tensor:
    """The same tensor on every rank, with distinct values wherever the dtype allows."""
    numel = math.prod(shape)
    values = torch.arange(numel, dtype=torch.int64).reshape(tuple(shape))
    if dtype in ("bfloat16", "float16", "float8_e4m3fn"):
        # few mantissa bits: random normals are (nearly) all distinct where integers are not
        g = torch.Generator().manual_seed(1234 + numel)
        return torch.randn(tuple(shape), generator=g).to(DTYPES[dtype])
    if dtype in ("int8", "uint8"):
        return (values % 97).to(DTYPES[dtype])
    if dtype == "bool":
        return (values * 7 % 3 == 0)
    return (values * 7 - 3).to(DTYPES[dtype])


def by_coordinate(full: torch.Tensor, mesh: DeviceMesh, pls) -> torch.Tensor | None:
    """This rank's local tensor by its mesh coordinate, cut with DTensor's own placement
    classes axis by axis (no communication); None off the mesh."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    local = full
    for axis, p in enumerate(pls):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(local, mesh.size(axis), with_padding=False, contiguous=True)
        local = shards[coordinate[axis]]
    return local.contiguous()


def in_mesh_order(name: str) -> bool:
    """Whether every process group of the mesh lists its ranks in increasing order.

    DeviceMesh builds its groups with ``new_group``, which sorts ranks (and a mesh axis that
    spans the world reuses the default group), so DTensor's collectives (``distribute_tensor``'s
    scatter, ``full_tensor``'s all-gather) follow sorted group ranks, while ``get_coordinate``
    and the local shapes follow the mesh's order: on a mesh like ``[7, 6, 5, 4]`` the two
    disagree inside torch itself. There the coordinate oracle is the only one that holds.
    """
    ranks = torch.tensor(MESHES[name][0])
    for axis in range(ranks.dim()):
        rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis])
        if any(row.tolist() != sorted(row.tolist()) for row in rows):
            return False
    return True


def distribute(full: torch.Tensor, mesh_name: str, pls, scatter: bool = True) -> DTensor:
    """``distribute_tensor(full, mesh, pls)``, scattering from the mesh's first rank.

    Two cases where that scatter cannot serve, both inside torch: on a mesh out of group
    order (see :func:`in_mesh_order`) it hands shards out by sorted group rank, and for an
    uneven ``_StridedShard`` its padded pieces differ in shape and it raises AssertionError
    (on every rank alike, before communicating). There ``src_data_rank=None`` (every rank
    cuts its own shard by its coordinate, no communication) is DTensor's own answer.
    """
    mesh = meshes()[mesh_name]
    if scatter and in_mesh_order(mesh_name):
        try:
            return distribute_tensor(full, mesh, pls)
        except AssertionError:
            pass
    return distribute_tensor(full, mesh, pls, src_data_rank=None)


def _describe(t: torch.Tensor | None):
    return None if t is None else {"shape": tuple(t.shape), "dtype": str(t.dtype)}


def cross_check(cases: list[dict]) -> list[dict]:
    """Run every case on this rank; one result dict per case.

    A case: ``src``/``dst`` (mesh names), ``src_p``/``dst_p`` (placement strings), ``shape``,
    ``dtype``, optional ``domain_size``, ``memory_budget``, ``redistribute_oracle`` (also
    compare with ``DTensor.redistribute`` on the same mesh), ``noncontiguous`` (hand a
    source DTensor whose local tensor is a non-contiguous view).
    """
    ms = meshes()
    rank = dist.get_rank()
    out = []
    for case in cases:
        src_mesh, dst_mesh = ms[case["src"]], ms[case["dst"]]
        src_ranks, dst_ranks = mesh_ranks(case["src"]), mesh_ranks(case["dst"])
        if rank not in src_ranks and rank not in dst_ranks:
            out.append({"rank": rank, "skipped": True})
            continue
        full = full_tensor(case["shape"], case["dtype"])
        src_pl, dst_pl = placements(case["src_p"]), placements(case["dst_p"])
        ordered = in_mesh_order(case["dst"])
        # gloo's collectives know no float8: there DTensor's scatter and all-gather cannot run
        scatter = not case.get("no_collectives")
        source = distribute(full, case["src"], src_pl, scatter)
        if case.get("noncontiguous") and rank in src_ranks:
            local = source.to_local()
            view = local.t().contiguous().t() if local.dim() == 2 else local
            source = DTensor.from_local(view, src_mesh, src_pl, run_check=False, shape=full.shape, stride=full.stride())
        kwargs = {"timeout": 60.0}
        if "domain_size" in case:
            kwargs["domain_size"] = case["domain_size"]
        if "memory_budget" in case:
            kwargs["memory_budget"] = case["memory_budget"]
        start = time.monotonic()
        result = redistribute(source, dst_mesh, dst_pl, **kwargs)
        seconds = time.monotonic() - start
        row: dict[str, Any] = {
            "rank": rank, "ordered": ordered, "skipped": False, "seconds": seconds, "is_none": result is None
        }
        if rank in dst_ranks and result is not None:
            got = result.to_local()
            row["local"] = _describe(got)
            coordinate = by_coordinate(full, dst_mesh, dst_pl)
            row["equal_coordinate"] = bool(got.shape == coordinate.shape and torch.equal(got, coordinate))
            expected_dtensor = distribute(full, case["dst"], dst_pl, scatter)
            expected = expected_dtensor.to_local()
            row["expected"] = _describe(expected)
            row["equal_distribute"] = bool(got.shape == expected.shape and torch.equal(got, expected))
            # DTensor normalizes placements (Shard(-1) -> Shard(ndim - 1)): compare with its own
            row["placements_ok"] = tuple(result.placements) == tuple(expected_dtensor.placements)
            row["placements"] = repr(tuple(result.placements))
            row["shape_ok"] = tuple(result.shape) == tuple(full.shape)
            row["mesh_ok"] = result.device_mesh is dst_mesh or result.device_mesh == dst_mesh
            row["contiguous"] = got.is_contiguous()
            # the whole tensor from the returned DTensor's own view of itself: a DTensor op
            if ordered and scatter:
                row["full_tensor_ok"] = bool(torch.equal(result.full_tensor(), full))
            if not row["equal_distribute"] and got.shape == expected.shape and got.numel() <= 64:
                row["got_values"] = got.tolist()
                row["expected_values"] = expected.tolist()
        if case.get("redistribute_oracle"):
            # DTensor's own redistribute on the same mesh (collective over that mesh)
            try:
                oracle = source.redistribute(src_mesh, dst_pl).to_local()
                if rank in dst_ranks and result is not None:
                    got = result.to_local()
                    row["equal_redistribute"] = bool(got.shape == oracle.shape and torch.equal(got, oracle))
                    row["redistribute_shape"] = tuple(oracle.shape)
            except Exception as err:  # DTensor may not support a transition
                row["redistribute_error"] = f"{type(err).__name__}: {err}"[:300]
        out.append(row)
    return out


def redistribute_error(kind: str) -> str | None:
    """Call redistribute wrongly; return ``"<ErrorType>: <message>"`` (None if nothing raised)."""
    ms = meshes()
    mesh = ms["world2x4"]
    full = full_tensor((8, 4), "float32")
    try:
        if kind == "partial_source":
            source = DTensor.from_local(full.clone(), mesh, [Partial(), Replicate()], run_check=False)
            redistribute(source, ms["high2x2"], [Shard(0), Replicate()], timeout=20.0)
        elif kind == "partial_destination":
            source = distribute_tensor(full, mesh, [Shard(0), Replicate()])
            redistribute(source, ms["high2x2"], [Partial(), Replicate()], timeout=20.0)
        elif kind == "too_few_placements":
            source = distribute_tensor(full, mesh, [Shard(0), Replicate()])
            redistribute(source, ms["high2x2"], [Shard(0)], timeout=20.0)
        elif kind == "too_many_placements":
            source = distribute_tensor(full, mesh, [Shard(0), Replicate()])
            redistribute(source, ms["high4"], [Shard(0), Shard(1)], timeout=20.0)
        elif kind == "complex_dtype":
            source = distribute_tensor(full.to(torch.complex64), mesh, [Shard(0), Replicate()])
            redistribute(source, ms["high4"], [Shard(0)], timeout=20.0)
        elif kind == "not_a_dtensor":
            redistribute(full, ms["high4"], [Shard(0)], timeout=20.0)
        else:
            raise ValueError(kind)
    except (LayoutError, RuntimeFailure) as err:
        return f"{type(err).__name__}: {err.message}"
    return None


def outside_both_meshes() -> dict:
    """Ranks 0..1 -> 4..7 while ranks 2..3, in neither mesh, call too."""
    ms = meshes()
    rank = dist.get_rank()
    full = full_tensor((6, 2), "float32")
    source = distribute_tensor(full, ms["pair01"], [Shard(0)])
    try:
        result = redistribute(source, ms["high4"], [Shard(1)], timeout=20.0)
    except (LayoutError, RuntimeFailure) as err:
        return {"rank": rank, "error": f"{type(err).__name__}: {err.message}"}
    row = {"rank": rank, "error": None, "is_none": result is None}
    if result is not None:
        row["equal"] = bool(torch.equal(result.to_local(), distribute_tensor(full, ms["high4"], [Shard(1)]).to_local()))
    return row


def warm() -> int:
    """Build every mesh; touch DTensor once so its first-call costs are not in a test."""
    ms = meshes()
    distribute_tensor(torch.zeros(4), ms["world8"], [Shard(0)])
    return dist.get_rank()


def transposed_source(src: str, dst: str) -> dict | None:
    """A DTensor view with a transposed global stride: ``distribute_tensor(...).t()``, whose
    local tensor is a non-contiguous view; moved to ``dst`` as Shard(0)."""
    ms = meshes()
    rank = dist.get_rank()
    full = full_tensor((9, 6), "float32")
    source = distribute_tensor(full, ms[src], [Shard(0)]).t()  # (6, 9) Shard(1), local non-contiguous
    result = redistribute(source, ms[dst], [Shard(0)], timeout=60.0)
    oracle = source.redistribute(ms[src], [Shard(0)]) if src == dst else None
    if result is None:
        return None
    expected = distribute_tensor(full.t().contiguous(), ms[dst], [Shard(0)])
    return {
        "rank": rank,
        "equal": bool(torch.equal(result.to_local(), expected.to_local())),
        "placements_ok": tuple(result.placements) == (Shard(0),),
        "stride": tuple(result.stride()),
        "oracle_stride": None if oracle is None else tuple(oracle.stride()),
        "oracle_equal": None if oracle is None else bool(torch.equal(result.to_local(), oracle.to_local())),
        "full_tensor_ok": bool(torch.equal(result.full_tensor(), full.t())),
        "sum_ok": bool(torch.equal((result + expected).full_tensor(), 2 * full.t())),
    }


def submesh_source(timeout: float) -> dict:
    """A DTensor on ``world2x4["tp"]``: each dp row of ranks sees its own 1-D source mesh
    (ranks 0..3 or 4..7), so the ranks describe different redistributions."""
    ms = meshes()
    rank = dist.get_rank()
    full = full_tensor((8, 2), "float32")
    sub = ms["world2x4"]["tp"]
    source = distribute_tensor(full, sub, [Shard(0)])
    start = time.monotonic()
    try:
        result = redistribute(source, ms["mid6"], [Shard(0)], timeout=timeout)
    except (LayoutError, RuntimeFailure) as err:
        return {"rank": rank, "sub": sub.mesh.tolist(), "error": f"{type(err).__name__}: {err.message}",
                "seconds": time.monotonic() - start}
    seconds = time.monotonic() - start
    out = {"rank": rank, "sub": sub.mesh.tolist(), "error": None, "is_none": result is None, "seconds": seconds}
    if result is not None:
        out["equal"] = bool(torch.equal(result.to_local(), distribute_tensor(full, ms["mid6"], [Shard(0)]).to_local()))
    return out
