"""Never silent loss: which regions of logical tensors no surviving rank holds.

Pure functions of layouts and a set of lost ranks (no communication). A region of a
logical tensor is *lost* when every rank holding it, in every given layout (e.g. the
inference layout *and* the training layout), is lost. Recovery plans
(:func:`layoutlang.plan.plan_recovery`) and elastic sessions stop with
:class:`DataLossError`, naming every lost box, before anything moves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .._text import tensor_region
from ..core import _core
from ..errors import DataLossError, LayoutValueError, core_errors
from ..model import Layout

__all__ = ["check_recoverable", "lost_regions", "rank_set", "same_holdings"]


def rank_set(lost: Iterable[int]) -> set[int]:
    """The lost ranks as a set of ints (a clear error for anything else)."""
    try:
        return {int(r) for r in lost}
    except TypeError:
        raise LayoutValueError(f"lost ranks must be an iterable of integers, not {lost!r}") from None


def _as_layouts(layouts: Layout | Iterable[Layout]) -> list[Layout]:
    if isinstance(layouts, Layout):
        return [layouts]
    out = list(layouts)
    for item in out:
        if not isinstance(item, Layout):
            raise LayoutValueError(f"expected layouts, got {type(item).__name__}")
    return out


def lost_regions(
    layouts: Layout | Iterable[Layout], lost: Iterable[int]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Every region of every logical tensor that no surviving rank of any of ``layouts`` holds.

    Returns ``(tensor, offsets, sizes)`` triples: disjoint boxes, exact for uneven, padded and
    strided layouts, in the order the tensors are first declared. Only tensors that a lost
    rank holds are looked at (anything never held at all is not a *loss*).

    The C++ core decides it replica group by replica group (``_core.lost_regions``): a
    tensor one of whose layouts still has a surviving member in every replica group is
    whole, which settles nearly every tensor without looking at a box. Only the others are
    cut at every boundary of the boxes surviving ranks hold; the cells nobody holds are
    merged greedily in row-major order (the last dim grown first, then earlier dims).

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh train [dp = 2, tp = 2]
    ... tensor "w" [8, 4] fp32
    ... layout fsdp on train { "w": tp = shard(0) }
    ... ''')
    >>> lost_regions(p.layouts["fsdp"], {1})  # rank 3 still holds rows 4:8
    []
    >>> lost_regions(p.layouts["fsdp"], {1, 3})
    [('w', (4, 0), (4, 4))]
    """
    layouts = _as_layouts(layouts)
    lost_ranks = sorted(rank_set(lost))
    names: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for tensor, logical in layout.tensors.items():
            shape = tuple(logical.shape)
            if names.setdefault(tensor, shape) != shape:
                raise LayoutValueError(
                    f"tensor '{tensor}' has shape {list(names[tensor])} in one layout and {list(shape)} in "
                    f"layout '{layout.name}'"
                )
    number = {name: i for i, name in enumerate(names)}
    ordered = list(names)
    with core_errors(ordered):
        found = _core.lost_regions(
            [layout.core for layout in layouts],
            [[number[name] for name in layout.resolved.names] for layout in layouts],
            [list(shape) for shape in names.values()],
            lost_ranks,
        )
    tensors, starts = found.tensor, found.dims_start
    offsets, sizes = found.offsets, found.sizes
    out = []
    for i, t in enumerate(tensors):
        name = ordered[t]
        ndim = len(names[name])
        begin = starts[i]
        out.append((name, tuple(offsets[begin : begin + ndim]), tuple(sizes[begin : begin + ndim])))
    return out


def same_holdings(before: Layout, after: Layout, ranks: Iterable[int]) -> list[bool]:
    """For each of ``ranks``: whether it holds the same storages (names and shapes) and the
    same boxes of every tensor, at the same places in them, in ``before`` and ``after``
    (a rank outside either mesh does not). The layouts must place the same tensors.

    This is what decides, after a membership change, which ranks keep their storages and
    which a recovery plan must fill. The C++ core (``_core.same_holdings``) compares replica
    groups: one comparison per distinct pair of placements and rank, not per tensor and rank.

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh infer [dp = 3, tp = 2]
    ... mesh shrunk [dp = 2, tp = 2] on ranks [0, 1, 4, 5]
    ... mesh swapped [dp = 3, tp = 2] on ranks [0, 1, 2, 3, 5, 4]
    ... tensor "w" [8, 4] fp32
    ... layout serve on infer { "w": tp = shard(0) }
    ... layout small on shrunk { "w": tp = shard(0) }
    ... layout swap on swapped { "w": tp = shard(0) }
    ... ''')
    >>> serve = p.layouts["serve"]
    >>> same_holdings(serve, p.layouts["small"], [0, 1, 4, 5])  # a replica dropped: the rest stay
    [True, True, True, True]
    >>> same_holdings(serve, p.layouts["swap"], [3, 4, 5])  # ranks 4 and 5 trade their rows
    [True, False, False]
    """
    ranks = [int(r) for r in ranks]
    if list(before.tensors) != list(after.tensors):
        if set(before.tensors) != set(after.tensors):
            raise LayoutValueError(f"layouts '{before.name}' and '{after.name}' place different logical tensors")
        after = Layout(
            after.name,
            after.mesh,
            {n: after.tensors[n] for n in before.tensors},
            after.rules,
            after.storages,
            after.span,
        )
    ids: dict[str, int] = {}
    sides = []
    for layout in (before, after):
        storages = layout.resolved.storages
        sides.append(
            (
                layout.core,
                [ids.setdefault(s.name, len(ids)) for s in storages],
                [list(s.view) if s.view is not None else None for s in storages],
            )
        )
    with core_errors(before.resolved.names):
        same = list(_core.same_holdings(*sides[0], *sides[1], ranks))
    # A stack none of whose elements lands on a rank is held there empty ([0, ...]): the model
    # knows these storages, the core does not, so they are compared here.
    empty_before, empty_after = _empty_stacks(before), _empty_stacks(after)
    return [s and empty_before.get(r, {}) == empty_after.get(r, {}) for r, s in zip(ranks, same)]


def _empty_stacks(layout: Layout) -> dict[int, dict[str, tuple[int, ...]]]:
    """Rank -> the stacked storages it holds empty (name -> shape)."""
    resolved = layout.resolved
    out: dict[int, dict[str, tuple[int, ...]]] = {}
    for sid, shapes in resolved.empty_stacks().items():
        for rank, shape in shapes.items():
            out.setdefault(rank, {})[resolved.storages[sid].name] = shape
    return out


def check_recoverable(layouts: Layout | Iterable[Layout], lost: Iterable[int], *, limit: int = 10) -> None:
    """Raises :class:`DataLossError` naming the lost tensors and regions (at most ``limit``
    regions shown, then how many more) when some data is held only by lost ranks."""
    layouts = _as_layouts(layouts)
    lost_ranks = sorted(rank_set(lost))
    regions = lost_regions(layouts, lost_ranks)
    if not regions:
        return
    tensors = list(dict.fromkeys(t for t, _, _ in regions))
    elements = sum(math.prod(s) for _, _, s in regions)
    shown = ", ".join(tensor_region(*r) for r in regions[:limit])
    more = len(regions) - limit
    rs = "rank" if len(lost_ranks) == 1 else "ranks"
    message = (
        f"data lost: {rs} {', '.join(map(str, lost_ranks))} held the only copies of {len(regions)} "
        f"region{'s' if len(regions) != 1 else ''} of {len(tensors)} tensor{'s' if len(tensors) != 1 else ''} "
        f"({elements} elements) in layout{'s' if len(layouts) != 1 else ''} "
        f"{', '.join(repr(layout.name) for layout in layouts)}: {shown}" + (f" and {more} more" if more > 0 else "")
    )
    raise DataLossError(
        message,
        regions,
        hint="restore these regions from a checkpoint, or give another layout that still holds them",
    )
