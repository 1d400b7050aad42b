"""Never silent loss: which regions of logical tensors no surviving rank holds.

Pure functions of layouts and a set of lost ranks (no communication). A region of a
logical tensor is *lost* when every rank holding it, in every given layout (e.g. the
inference layout *and* the training layout), is lost. Recovery plans
(:func:`layoutlang.plan.plan_recovery`) and elastic sessions stop with
:class:`DataLossError`, naming every lost box, before anything moves.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .._text import tensor_region
from ..errors import DataLossError, LayoutValueError
from ..model import Layout

__all__ = ["check_recoverable", "lost_regions", "rank_set"]


def rank_set(lost: Iterable[int]) -> set[int]:
    """The lost ranks as a set of ints (a clear error for anything else)."""
    try:
        return {int(r) for r in lost}
    except TypeError:
        raise LayoutValueError(
            f"lost ranks must be an iterable of integers, not {lost!r}"
        ) from None


def _as_layouts(layouts: Layout | Iterable[Layout]) -> list[Layout]:
    if isinstance(layouts, Layout):
        return [layouts]
    out = list(layouts)
    for item in out:
        if not isinstance(item, Layout):
            raise LayoutValueError(f"expected layouts, got {type(item).__name__}")
    return out


def _merge_cells(
    free: np.ndarray, bounds: list[np.ndarray]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Disjoint boxes exactly covering the True cells of a compressed grid (greedy, row-major)."""
    free = free.copy()
    out = []
    ndim = free.ndim
    for start in zip(*np.nonzero(free)):
        if not free[start]:
            continue
        end = list(start)
        for d in reversed(range(ndim)):  # grow the last dim first, then earlier dims
            while end[d] + 1 < free.shape[d]:
                probe = tuple(
                    slice(start[k], end[k] + 1) if k != d else slice(end[d] + 1, end[d] + 2)
                    for k in range(ndim)
                )
                if free[probe].all():
                    end[d] += 1
                else:
                    break
        free[tuple(slice(s, e + 1) for s, e in zip(start, end))] = False
        offsets = tuple(int(bounds[d][start[d]]) for d in range(ndim))
        sizes = tuple(int(bounds[d][end[d] + 1] - bounds[d][start[d]]) for d in range(ndim))
        out.append((offsets, sizes))
    return out


def lost_regions(
    layouts: Layout | Iterable[Layout], lost: Iterable[int]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Every region of every logical tensor that no surviving rank of any of ``layouts`` holds.

    Returns ``(tensor, offsets, sizes)`` triples: disjoint boxes, exact for uneven, padded and
    strided layouts (the tensor is cut at every box boundary and each cell is checked), in
    the order the tensors are first declared.
    """
    layouts = _as_layouts(layouts)
    lost_ranks = rank_set(lost)
    names: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for tensor, logical in layout.tensors.items():
            shape = tuple(logical.shape)
            if names.setdefault(tensor, shape) != shape:
                raise LayoutValueError(
                    f"tensor '{tensor}' has shape {list(names[tensor])} in one layout and {list(shape)} in "
                    f"layout '{layout.name}'"
                )
    out: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for tensor, shape in names.items():
        if 0 in shape:
            continue
        survivors: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        any_lost = False
        for layout in layouts:
            if tensor not in layout.tensors:
                continue
            for rank in layout.holders(tensor):
                if rank in lost_ranks:
                    any_lost = True
                    continue
                survivors.extend(
                    (b.offsets, b.sizes) for b in layout.boxes(tensor, rank) if b.numel
                )
        if not any_lost:
            # Nobody holding the tensor is lost; anything never held at all is not a *loss*.
            continue
        ndim = len(shape)
        cuts = [{0, n} for n in shape]
        for offsets, sizes in survivors:
            for d in range(ndim):
                cuts[d].add(offsets[d])
                cuts[d].add(offsets[d] + sizes[d])
        bounds = [np.array(sorted(c), dtype=np.int64) for c in cuts]
        free = np.ones(tuple(len(b) - 1 for b in bounds), dtype=bool)
        for offsets, sizes in survivors:
            index = tuple(
                slice(
                    int(np.searchsorted(bounds[d], offsets[d])),
                    int(np.searchsorted(bounds[d], offsets[d] + sizes[d])),
                )
                for d in range(ndim)
            )
            free[index] = False
        if free.any():
            out.extend((tensor, o, s) for o, s in _merge_cells(free, bounds))
    return out


def check_recoverable(
    layouts: Layout | Iterable[Layout], lost: Iterable[int], *, limit: int = 10
) -> None:
    """Raises :class:`DataLossError` naming the lost tensors and regions (at most ``limit``
    regions shown, then how many more) when some data is held only by lost ranks."""
    layouts = _as_layouts(layouts)
    lost_ranks = sorted(rank_set(lost))
    regions = lost_regions(layouts, lost_ranks)
    if not regions:
        return
    tensors = list(dict.fromkeys(t for t, _, _ in regions))
    elements = sum(int(np.prod(s)) for _, _, s in regions)
    shown = ", ".join(tensor_region(*r) for r in regions[:limit])
    more = len(regions) - limit
    rs = "rank" if len(lost_ranks) == 1 else "ranks"
    message = (
        f"data lost: {rs} {', '.join(map(str, lost_ranks))} held the only copies of {len(regions)} "
        f"region{'s' if len(regions) != 1 else ''} of {len(tensors)} tensor{'s' if len(tensors) != 1 else ''} "
        f"({elements} elements) in layout{'s' if len(layouts) != 1 else ''} "
        f"{', '.join(repr(layout.name) for layout in layouts)}: {shown}"
        + (f" and {more} more" if more > 0 else "")
    )
    raise DataLossError(
        message,
        regions,
        hint="restore these regions from a checkpoint, or give another layout that still holds them",
    )
