"""Jobs that tests/test_live_layouts.py runs on every worker of a 4-rank gloo pool: state
dicts of real DTensors (FSDP2-style, TP, FSDP2 over TP, 2-D, uneven) read by
``layoutlang.integrations.dtensor``. Each job returns plain data."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from layoutlang import loads
from layoutlang.errors import LayoutError
from layoutlang.integrations.dtensor import layout_from_state_dict, local_storages, run_state_dict, state_dict_problems
from layoutlang.runtime import Resharder

#: name -> (global shape, placements on the (dp, tp) mesh)
TENSORS: dict[str, tuple[tuple[int, ...], tuple[Any, ...]]] = {
    "embed": ((10, 6), (Shard(0), Replicate())),  # FSDP only
    "q_proj": ((8, 6), (Replicate(), Shard(0))),  # column parallel
    "o_proj": ((6, 8), (Replicate(), Shard(1))),  # row parallel
    "fsdp_over_tp": ((8, 4), (_StridedShard(0, split_factor=2), Shard(0))),
    "two_dims": ((4, 6), (Shard(0), Shard(1))),
    "nested": ((8, 3), (Shard(0), Shard(0))),
    "uneven": ((7, 3), (Shard(0), Replicate())),  # 4 + 3 rows
    "norm": ((6,), (Replicate(), Replicate())),
    "gate_up": ((8, 4), (Replicate(), _StridedShard(0, split_factor=2))),  # [gate | up] per rank
}

_mesh: list[DeviceMesh] = []


def mesh() -> DeviceMesh:
    if not _mesh:
        _mesh.append(DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")))
    return _mesh[0]


def whole(name: str) -> torch.Tensor:
    shape, _ = TENSORS[name]
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def state_dict() -> dict[str, Any]:
    out: dict[str, Any] = {n: distribute_tensor(whole(n), mesh(), list(p)) for n, (_, p) in TENSORS.items()}
    out["plain"] = torch.ones(3)  # a plain tensor: replicated
    return out


def declarations() -> str:
    shapes = {n: s for n, (s, _) in TENSORS.items()} | {"plain": (3,)}
    return "".join(f'tensor "{n}" [{", ".join(map(str, s))}] fp32\n' for n, s in shapes.items())


def derived_layout() -> dict[str, Any]:
    """The layout text derived here, and per tensor whether layoutlang's boxes on this rank
    hold exactly the elements of DTensor's local tensor."""
    rank = dist.get_rank()
    weights = state_dict()
    text = layout_from_state_dict(weights)
    layout = loads(declarations() + text).layout("train")
    sources = local_storages(layout, weights, rank)
    agree = {}
    for name, local in sources.items():
        if name == "plain":
            agree[name] = torch.equal(local, weights[name])
            continue
        rebuilt = torch.full_like(local, float("nan"))
        for box in layout.boxes(name, rank):
            rebuilt[box.storage_index()] = whole(name)[box.slices()]
        agree[name] = torch.equal(rebuilt, weights[name].to_local())
    return {"text": text, "agree": agree, "problems": state_dict_problems(layout, weights, rank)}


def mismatched(rules: str, drop: str | None = None) -> list[str] | str:
    """The problems a hand-written layout has against the state dict (or its error)."""
    rank = dist.get_rank()
    weights = state_dict()
    if drop:
        weights.pop(drop)
    program = declarations() + "mesh train [dp = 2, tp = 2] on ranks 0..3\nlayout train on train {\n" + rules + "\n}\n"
    try:
        layout = loads(program).layout("train")
        local_storages(layout, weights, rank)
    except LayoutError as err:
        return str(err)
    return state_dict_problems(layout, weights, rank)


REFIT = """
mesh train [dp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "model.embed.weight" [8, 4] fp32
tensor "model.head.weight" [8, 4] fp32
layout fsdp on train { default: dp = shard(0) }
layout vllm on infer { default: tp = shard(1) }
reshard fsdp -> vllm
"""


def refit_from_state_dict(misspell_on: int | None) -> dict[str, Any]:
    """Every rank runs :func:`run_state_dict`: the trainers (0, 1) from their shards (rank
    ``misspell_on`` with one key misspelled), the engines (2, 3) from ``{}``. The outcome
    per rank: its error, or whether its storages hold the right elements."""
    rank = dist.get_rank()
    program = loads(REFIT)
    resharder = Resharder(program, rank=rank, timeout=30)
    full = {name: torch.arange(32, dtype=torch.float32).view(8, 4) + i for i, name in enumerate(program.tensors)}
    weights: dict[str, Any] = {}
    if rank < 2:
        weights = {name: t[4 * rank : 4 * rank + 4].clone() for name, t in full.items()}
        if rank == misspell_on:
            weights["model.embed.weights"] = weights.pop("model.embed.weight")
    try:
        out = run_state_dict(resharder, weights)
    except LayoutError as err:
        return {"error": f"{type(err).__name__}: {err.message}"}
    except Exception as err:  # AgreementError is a RuntimeFailure
        return {"error": f"{type(err).__name__}: {getattr(err, 'message', err)}"}
    tp = rank - 2
    right = {name: torch.equal(t, full[name][:, 2 * tp : 2 * tp + 2]) for name, t in out.items()} if rank >= 2 else {}
    return {"error": None, "right": right}
