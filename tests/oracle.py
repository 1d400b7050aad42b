"""A pure-Python twin of layoutlang's per-dim interval math, kept only as a test oracle.

It answers the same questions as ``layoutlang.core._core.chunk_bounds``, ``dim_runs`` and
``intersect_boxes``, but the slow, obvious way: it materialises the list of global indices
a coordinate holds and cuts that list with a pure-Python ``torch.chunk``. It was written
from the semantics in DESIGN.md ("Semantics that must match PyTorch DTensor"), not from the
C++, so the two can disagree; ``tests/test_shard_math.py`` checks that they do not.
Nothing in layoutlang imports this module.

Naming: an *axis* is a mesh axis, a *dim* is a tensor dimension. A dim spec has the C++
core's form ``(pad, ((axis, chunks, blocks), ...))``; ``chunks`` 0 means the axis size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = [
    "box_points",
    "chunk_bounds",
    "dim_runs",
    "intersect_boxes",
    "local_sequence",
    "runs_of_sequence",
    "torch_chunk",
]

DimSpec = tuple[int, Sequence[tuple[int, int, int]]]
Run = tuple[int, int, int]  # (global start, length, local start)


def torch_chunk(items: Sequence[int], k: int) -> list[list[int]]:
    """``torch.chunk(items, k)`` on a list, with empty chunks appended to make ``k`` of them.

    Every chunk but the trailing ones has ceil(len / k) items; DTensor fills the chunks that
    ``torch.chunk`` does not return with empty ones, and so does this.
    """
    if k < 1:
        raise ValueError(f"cannot cut into {k} chunks")
    items = list(items)
    size = -(-len(items) // k)  # ceil
    chunks = [items[start : start + size] for start in range(0, len(items), size)] if size else []
    chunks += [[] for _ in range(k - len(chunks))]
    assert len(chunks) == k
    return chunks


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, stop) of chunk ``i`` of ``range(n)`` cut into ``k`` chunks.

    An empty chunk starts where the elements before it end.
    """
    chunks = torch_chunk(range(n), k)
    start = sum(len(c) for c in chunks[:i])
    return start, start + len(chunks[i])


def _pieces(chunks: int, axis_size: int) -> int:
    return axis_size if chunks == 0 else chunks


def local_sequence(
    n: int, spec: DimSpec, coords: Sequence[int], axis_sizes: Sequence[int]
) -> list[int]:
    """The global indices (padding included, as indices >= n) one coordinate holds, in local order."""
    pad, splits = spec
    pad = max(1, pad)
    padded = -(-n // pad) * pad
    sequence = list(range(padded))
    for axis, chunks, blocks in splits:
        axis_size = axis_sizes[axis]
        pieces = _pieces(chunks, axis_size)
        # Coordinates sharing a chunk are replicas: coord // (axis_size // pieces) picks it.
        pick = coords[axis] // (axis_size // pieces)
        if blocks <= 1:
            sequence = torch_chunk(sequence, pieces)[pick]
        else:
            sequence = list(
                itertools.chain.from_iterable(
                    torch_chunk(block, pieces)[pick] for block in torch_chunk(sequence, blocks)
                )
            )
    return sequence


def runs_of_sequence(sequence: Sequence[int], n: int) -> list[Run]:
    """Maximal runs of a local sequence, padding (indices >= n) dropped.

    Two neighbours in local order join one run when their global indices are neighbours too.
    """
    runs: list[list[int]] = []
    for local, index in enumerate(sequence):
        if index >= n:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index and runs[-1][2] + runs[-1][1] == local:
            runs[-1][1] += 1
        else:
            runs.append([index, 1, local])
    return [tuple(r) for r in runs]


def dim_runs(
    n: int, spec: DimSpec, coords: Sequence[int], axis_sizes: Sequence[int]
) -> tuple[int, list[Run]]:
    """``(local length incl. padding, [(global start, length, local start), ...])``."""
    sequence = local_sequence(n, spec, coords, axis_sizes)
    return len(sequence), runs_of_sequence(sequence, n)


def box_points(offsets: Sequence[int], sizes: Sequence[int]) -> set[tuple[int, ...]]:
    """Every index tuple inside the box."""
    return set(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))))


def intersect_boxes(
    a_offsets: Sequence[int],
    a_sizes: Sequence[int],
    b_offsets: Sequence[int],
    b_sizes: Sequence[int],
) -> tuple[list[int], list[int]] | None:
    """The box both boxes cover (as its smallest corner and extent), or None: by enumeration."""
    common = box_points(a_offsets, a_sizes) & box_points(b_offsets, b_sizes)
    if not common:
        return None
    lows = [min(p[d] for p in common) for d in range(len(a_offsets))]
    highs = [max(p[d] for p in common) for d in range(len(a_offsets))]
    return lows, [h - lo + 1 for lo, h in zip(lows, highs)]
