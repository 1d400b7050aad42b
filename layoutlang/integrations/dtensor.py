"""The training side of a refit, read from a ``state_dict`` of DTensors (FSDP2, TP, EP).

:func:`layout_from_state_dict` writes the ``mesh`` and ``layout`` statements a state dict
implies, from each DTensor's device mesh and placements (``Shard(d)`` -> ``axis =
shard(d)``; two mesh dims on one tensor dim -> ``(a, b) = shard(d)``, in DTensor's order,
``_StridedShard`` (FSDP2 over TP) reversing it; plain tensors replicated). Use it to start a
program, or to compare with one.

:func:`local_storages` hands the Resharder this rank's sources from the same state dict,
after checking every tensor against the layout: a storage the state dict lacks, a tensor the
layout does not place, a local shape or dtype that differs, and a shard whose offset DTensor
computes differently from the layout's. All problems are reported at once, each naming the
tensor and the rank. It raises on the rank whose state dict is wrong, and only there: the
other ranks of the reshard would wait for it. :func:`run_state_dict` runs a Resharder from
every rank's state dict instead, and a state dict that does not match stops every rank with
its rank's own words before a byte moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._text import counted, rank_ranges
from ..errors import LayoutError, LayoutValueError, did_you_mean
from ..io.torch_dtypes import torch_dtype
from ..model import Layout

__all__ = ["layout_from_state_dict", "local_storages", "run_state_dict", "state_dict_problems"]


def _mesh_of(tensor: Any) -> Any:
    return getattr(tensor, "device_mesh", None)


def _axis_names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"d{i}" for i in range(mesh.ndim))


def _placement_text(name: str, tensor: Any) -> str:
    """The rule body DTensor ``tensor``'s placements mean, in the language."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = tensor.device_mesh
    axes = _axis_names(mesh)
    by_dim: dict[int, list[tuple[int, int]]] = {}  # tensor dim -> (mesh dim, split factor; 0: plain)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, (Shard, _StridedShard)):  # torch 2.13: not a Shard subclass
            factor = int(placement.split_factor) if isinstance(placement, _StridedShard) else 0
            by_dim.setdefault(placement.dim, []).append((mesh_dim, factor))
            continue
        raise LayoutValueError(
            f"tensor '{name}': placement {placement} on mesh dim '{axes[mesh_dim]}' has no layout "
            "(only Shard and Replicate do; reduce a Partial before a refit)"
        )
    entries = []
    for dim, cuts in sorted(by_dim.items()):
        if len(cuts) == 1:
            ((mesh_dim, factor),) = cuts
            blocks = f", blocks = {factor}" if factor else ""
            entries.append(f"{axes[mesh_dim]} = shard({dim}{blocks})")
        elif not any(factor for _, factor in cuts):  # nested, in mesh-dim order
            entries.append(f"({', '.join(axes[m] for m, _ in cuts)}) = shard({dim})")
        elif len(cuts) == 2 and cuts[0][1] == mesh.size(cuts[1][0]) and not cuts[1][1]:
            # FSDP2 over TP: [_StridedShard(d, split_factor=tp), Shard(d)] on (dp, tp) is tp
            # cutting first, then dp cutting each tp piece
            entries.append(f"({axes[cuts[1][0]]}, {axes[cuts[0][0]]}) = shard({dim})")
        else:
            raise LayoutValueError(
                f"tensor '{name}': placements {tuple(tensor.placements)} cut dim {dim} in a way the "
                "language has no rule for; write its rule by hand"
            )
    return ", ".join(entries) if entries else "replicate"


def _ranks_text(mesh: Any) -> str:
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def layout_from_state_dict(
    state_dict: Mapping[str, Any],
    *,
    mesh: str = "train",
    layout: str = "train",
    rename: Callable[[str], str] | None = None,
) -> str:
    """The ``mesh`` and ``layout`` statements that ``state_dict`` implies, as program text.

    Every DTensor must live on the same device mesh (its dim names become the mesh's axes);
    plain tensors are taken as replicated. The most common placement becomes the
    ``default:`` rule. ``rename`` maps state-dict names to the program's tensor names.
    """
    device_mesh = None
    rules: dict[str, str] = {}
    for key, tensor in state_dict.items():
        name = rename(key) if rename else key
        tensor_mesh = _mesh_of(tensor)
        if tensor_mesh is None:
            rules[name] = "replicate"
            continue
        if device_mesh is None:
            device_mesh = tensor_mesh
        elif tensor_mesh != device_mesh:
            raise LayoutValueError(
                f"tensor '{name}' lives on another device mesh ({tensor_mesh}) than the first DTensor "
                f"({device_mesh}): write one layout per mesh"
            )
        rules[name] = _placement_text(name, tensor)
    if device_mesh is None:
        raise LayoutValueError("the state dict holds no DTensor: its mesh cannot be read from it")
    axes = ", ".join(f"{a} = {n}" for a, n in zip(_axis_names(device_mesh), device_mesh.mesh.shape))
    default, _ = Counter(rules.values()).most_common(1)[0]
    lines = [f"mesh {mesh} [{axes}] on ranks {_ranks_text(device_mesh)}", f"layout {layout} on {mesh} {{"]
    lines += [f'    "{name}": {body}' for name, body in rules.items() if body != default]
    lines += [f"    default: {default}", "}"]
    return "\n".join(lines) + "\n"


def _local(tensor: Any) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _dtensor_offset(tensor: Any) -> tuple[int, ...] | None:
    """DTensor's own offset of this rank's shard (None for a plain tensor)."""
    if _mesh_of(tensor) is None:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(o) for o in offset)


def state_dict_problems(
    layout: Layout,
    state_dict: Mapping[str, Any],
    rank: int,
    *,
    rename: Callable[[str], str] | None = None,
    allow_dtype: bool = False,
) -> list[str]:
    """Every way ``state_dict`` on ``rank`` differs from what ``layout`` places there
    (``allow_dtype`` accepts other dtypes, for ``cast_sources=True``)."""
    named = {(rename(k) if rename else k): v for k, v in state_dict.items()}
    problems = []
    held = layout.storages_on(rank)
    for storage, shape in held.items():
        parts = layout.storage(storage, rank).parts
        tensor = named.get(storage)
        if tensor is None:
            hint = did_you_mean(storage, named)
            problems.append(
                f"tensor '{storage}' is missing from rank {rank}'s state dict" + (f" ({hint})" if hint else "")
            )
            continue
        local = _local(tensor)
        if tuple(local.shape) != tuple(shape):
            problems.append(
                f"tensor '{storage}' on rank {rank}: the state dict's local shard is {list(local.shape)}, "
                f"the layout places {list(shape)}"
            )
            continue
        declared = layout.tensors[parts[0]].dtype
        if not allow_dtype and local.dtype != torch_dtype(declared):
            problems.append(
                f"tensor '{storage}' on rank {rank}: the state dict holds {local.dtype}, the program declares "
                f"{declared} (pass cast_sources=True to send it as declared)"
            )
        if list(parts) != [storage]:
            continue  # a fused or stacked storage: its shape is what a state dict can show
        offset = _dtensor_offset(tensor)
        boxes = layout.boxes(storage, rank)
        if offset is not None and len(boxes) == 1 and local.numel() and tuple(boxes[0].offsets) != offset:
            problems.append(
                f"tensor '{storage}' on rank {rank}: DTensor places this rank's shard at offset {list(offset)}, "
                f"the layout at {list(boxes[0].offsets)} ({layout.rule_for(storage)})"
            )
    for name in named:
        if name in held:
            continue
        if name in layout.tensors and layout.holders(name):
            holders = rank_ranges(layout.holders(name))
            problems.append(f"tensor '{name}': rank {rank} holds it in the state dict, the layout on {holders}")
        elif name not in layout.tensors and not _is_storage(layout, name):
            problems.append(f"tensor '{name}' of the state dict is neither a tensor nor a storage of the program")
    return problems


def _is_storage(layout: Layout, name: str) -> bool:
    try:
        layout.parts_shape(name, layout.mesh.ranks[0])
    except LayoutError:
        return False
    return True


def local_storages(
    layout: Layout,
    state_dict: Mapping[str, Any],
    rank: int,
    *,
    rename: Callable[[str], str] | None = None,
    allow_dtype: bool = False,
    checked: bool = True,
) -> dict[str, torch.Tensor]:
    """This rank's sources for a Resharder: storage name -> the local shard in ``state_dict``.

    Raises :class:`~layoutlang.LayoutValueError` listing every problem
    :func:`state_dict_problems` finds (``allow_dtype`` accepts other dtypes, for
    ``cast_sources=True``); ``checked=False`` skips the check, for a caller that just made it.
    """
    problems = state_dict_problems(layout, state_dict, rank, rename=rename, allow_dtype=allow_dtype) if checked else []
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise LayoutValueError(
            f"rank {rank}'s state dict does not match layout '{layout.name}' "
            f"({counted(len(problems), 'problem')}):\n  {shown}{more}"
        )
    named = {(rename(k) if rename else k): v for k, v in state_dict.items()}
    return {storage: _local(named[storage]).detach() for storage in layout.storages_on(rank)}


def run_state_dict(
    resharder: Any,
    state_dict: Mapping[str, Any],
    destinations: Mapping[str, torch.Tensor] | None = None,
    *,
    rename: Callable[[str], str] | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """``resharder.run`` (a :class:`~layoutlang.runtime.Resharder`) from this rank's
    ``state_dict``, called on every rank of the reshard (``{}`` on a rank that holds no
    source). The state dict is checked as :func:`local_storages` does, but a mismatch is not
    raised here: it goes into the run's agreement, so that every rank, the destination ranks
    included, stops with an :class:`~layoutlang.errors.AgreementError` that names this rank,
    its tensors and what is wrong with them, and nothing moves. ``options`` are ``run``'s
    (``cast_sources=True`` also accepts the state dict's other dtypes).
    """
    layout = resharder.plan.source
    rank = resharder.rank
    problems = state_dict_problems(
        layout, state_dict, rank, rename=rename, allow_dtype=bool(options.get("cast_sources", False))
    )
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        mismatch = f"rank {rank}'s state dict does not match layout '{layout.name}'"
        not_ready = f"{mismatch} ({counted(len(problems), 'problem')}): {shown}"
        return resharder.run({}, destinations, not_ready=not_ready, **options)
    sources = local_storages(layout, state_dict, rank, rename=rename, checked=False)
    return resharder.run(sources, destinations, **options)
