"""The C++ per-dim interval math (``layoutlang.core._core``) against its pure-Python twin.

Checked against ``tests/oracle.py`` (which materialises index lists) and against
hand-worked values from DESIGN.md:

- ``chunk_bounds`` follows ``torch.chunk`` (9 rows over 4 -> 3, 3, 3, 0);
- ``dim_runs`` gives the runs a mesh coordinate holds of one dim: nesting of several axes in
  mesh-axis order, DTensor's ``_StridedShard`` (``blocks``), ``chunks`` smaller than the
  axis, and padding; property tests on random specs check that C++ and twin agree, that
  every replica covers each index exactly once, and that runs are non-empty, sorted and
  contiguous in local positions;
- ``intersect_boxes`` against a brute-force intersection of the boxes' point sets.

A dim spec is the C++ core's ``(pad, ((axis, chunks, blocks), ...))`` form.
"""

from __future__ import annotations

import itertools
from collections import Counter

import oracle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layoutlang.core import _core
from layoutlang.errors import LayoutValueError, core_errors

pytestmark = pytest.mark.timeout(120)

# Deterministic, no example database written into the repository, no per-example deadline.
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SMALL_PRIMES = [2, 3, 5, 7, 11, 13]


def all_coords(axis_sizes):
    return [list(c) for c in itertools.product(*(range(s) for s in axis_sizes))]


# The core's named results in the oracle's plain form, so the two compare directly.


def chunk_bounds(n, k, i):
    bounds = _core.chunk_bounds(n, k, i)
    return (bounds.start, bounds.stop)


def dim_runs(n, spec, coords, axis_sizes):
    """(local length, [(global start, length, local start)]) from the core's DimRuns."""
    held = _core.dim_runs(n, spec, coords, axis_sizes)
    return (held.length, [(r.global_start, r.length, r.local_start) for r in held.runs])


def intersect_boxes(a_off, a_size, b_off, b_size):
    """(offsets, sizes) of the core's Box, or None."""
    box = _core.intersect_boxes(a_off, a_size, b_off, b_size)
    return None if box is None else (box.offsets, box.sizes)


# ----------------------------------------------------------------- hand-checked values


def test_chunk_bounds_of_9_rows_over_4_leaves_the_last_chunk_empty():
    assert [chunk_bounds(9, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 9)]
    assert [oracle.chunk_bounds(9, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 9)]


def test_chunk_bounds_leaves_two_trailing_chunks_empty_when_chunk_size_rounds_up():
    # torch.chunk(arange(6), 5) has 3 chunks of 2: chunks 3 and 4 are empty.
    assert [chunk_bounds(6, 5, i) for i in range(5)] == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 6),
        (6, 6),
    ]


def test_dim_runs_of_10_on_2x4_nests_left_to_right():
    """DESIGN: n=10 on (2, 4) with [S(0), S(0)] -> 2, 2, 1, 0, 2, 2, 1, 0."""
    spec = (1, ((0, 0, 1), (1, 0, 1)))
    got = [dim_runs(10, spec, c, [2, 4]) for c in all_coords([2, 4])]
    assert [sum(r[1] for r in runs) for _, runs in got] == [2, 2, 1, 0, 2, 2, 1, 0]
    assert [runs for _, runs in got] == [
        [(0, 2, 0)], [(2, 2, 0)], [(4, 1, 0)], [],
        [(5, 2, 0)], [(7, 2, 0)], [(9, 1, 0)], [],
    ]  # fmt: skip
    assert [length for length, _ in got] == [2, 2, 1, 0, 2, 2, 1, 0]


def test_dim_runs_of_strided_gate_up_over_4_ranks_holds_rows_of_both_halves():
    """vLLM's fused gate_up ([gate | up], 8 rows each) as _StridedShard(0, split_factor=2) over 4."""
    spec = (1, ((0, 0, 2),))
    got = [dim_runs(16, spec, [r], [4]) for r in range(4)]
    assert got == [(4, [(2 * r, 2, 0), (8 + 2 * r, 2, 2)]) for r in range(4)]


def test_dim_runs_with_fewer_chunks_than_the_axis_replicates_each_chunk():
    """2 kv heads on tp=4 (chunks=2): ranks 0, 1 hold head 0; ranks 2, 3 hold head 1."""
    spec = (1, ((0, 2, 1),))
    got = [dim_runs(2, spec, [r], [4]) for r in range(4)]
    assert got == [(1, [(0, 1, 0)]), (1, [(0, 1, 0)]), (1, [(1, 1, 0)]), (1, [(1, 1, 0)])]


def test_dim_runs_with_padding_drops_the_pad_but_keeps_the_local_length():
    """A vocabulary of 10 padded to 8 (16 rows) over 4: rank 2 holds 8:10, rank 3 only padding."""
    spec = (8, ((0, 0, 1),))
    got = [dim_runs(10, spec, [r], [4]) for r in range(4)]
    assert got == [(4, [(0, 4, 0)]), (4, [(4, 4, 0)]), (4, [(8, 2, 0)]), (4, [])]


def test_dim_runs_of_an_empty_dim_has_no_runs():
    """A dim of size 0 holds nothing: no (zero-length) run, sharded or not."""
    assert dim_runs(0, (1, ()), [0], [2]) == (0, [])
    assert dim_runs(0, (1, ((0, 0, 1),)), [0], [2]) == (0, [])


def test_dim_runs_rejects_chunks_that_do_not_divide_the_axis():
    with pytest.raises(LayoutValueError, match="3 chunks do not divide axis 0 of size 4"), core_errors():
        dim_runs(8, (1, ((0, 3, 1),)), [0], [4])


def test_oracle_reproduces_the_hand_checked_values():
    """The twin itself on DESIGN's examples, so a wrong twin cannot hide a wrong core."""
    assert [oracle.dim_runs(10, (1, ((0, 0, 1), (1, 0, 1))), c, [2, 4])[0] for c in all_coords([2, 4])] == [
        2, 2, 1, 0, 2, 2, 1, 0,
    ]  # fmt: skip
    assert oracle.dim_runs(8, (1, ((0, 0, 2),)), [0], [4]) == (2, [(0, 1, 0), (4, 1, 1)])
    assert oracle.dim_runs(10, (8, ((0, 0, 1),)), [3], [4]) == (4, [])
    assert oracle.dim_runs(0, (1, ()), [0], [2]) == (0, [])


# ------------------------------------------------------------------ property tests


@st.composite
def dim_cases(draw):
    """(n, spec, axis_sizes): 1-3 axes, a subset of them splitting the dim in random order."""
    n = draw(st.one_of(st.sampled_from([0, 1, *SMALL_PRIMES]), st.integers(0, 40)))
    axis_sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    order = draw(st.permutations(range(len(axis_sizes))))
    count = draw(st.integers(0, len(axis_sizes)))
    splits = []
    for axis in order[:count]:
        size = axis_sizes[axis]
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        chunks = draw(st.sampled_from([0, *divisors]))
        blocks = draw(st.integers(1, 4))
        splits.append((axis, chunks, blocks))
    pad = draw(st.integers(1, 8))
    return n, (pad, tuple(splits)), axis_sizes


@PROPERTY
@given(dim_cases())
def test_dim_runs_matches_the_oracle_at_every_coordinate(case):
    n, spec, axis_sizes = case
    for coords in all_coords(axis_sizes):
        assert dim_runs(n, spec, coords, axis_sizes) == oracle.dim_runs(
            n, spec, coords, axis_sizes
        ), coords


@PROPERTY
@given(dim_cases())
def test_dim_runs_of_one_replica_cover_every_index_exactly_once(case):
    """Fix the position inside every replica group; the chunks then tile [0, n) exactly."""
    n, spec, axis_sizes = case
    _, splits = spec
    split_axes = {
        axis: axis_sizes[axis] // (chunks or axis_sizes[axis]) for axis, chunks, _ in splits
    }
    for replica in itertools.product(*(range(group) for group in split_axes.values())):
        offset = dict(zip(split_axes, replica))
        held = Counter()
        for coords in all_coords(axis_sizes):
            # Axes that do not split the dim, and other replicas, are skipped.
            if any(coords[a] != 0 for a in range(len(axis_sizes)) if a not in split_axes):
                continue
            if any(coords[a] % split_axes[a] != offset[a] for a in split_axes):
                continue
            _, runs = dim_runs(n, spec, coords, axis_sizes)
            for start, length, _ in runs:
                held.update(range(start, start + length))
        assert held == Counter(range(n)), (replica, held)


@PROPERTY
@given(dim_cases())
def test_dim_runs_are_nonempty_sorted_and_contiguous_in_local_positions(case):
    n, spec, axis_sizes = case
    for coords in all_coords(axis_sizes):
        length, runs = dim_runs(n, spec, coords, axis_sizes)
        local = 0
        for start, size, local_start in runs:
            assert size > 0, runs
            assert local_start == local, runs
            assert start >= 0 and start + size <= n, runs
            local += size
        # Only padding may follow the last run.
        assert local <= length, (length, runs)
        if spec[0] == 1:
            assert local == length, (length, runs)


@PROPERTY
@given(dim_cases())
def test_dim_runs_do_not_depend_on_axes_that_do_not_split_the_dim(case):
    n, spec, axis_sizes = case
    split_axes = {axis for axis, _, _ in spec[1]}
    for coords in all_coords(axis_sizes):
        base = [c if a in split_axes else 0 for a, c in enumerate(coords)]
        assert dim_runs(n, spec, coords, axis_sizes) == dim_runs(
            n, spec, base, axis_sizes
        )


@PROPERTY
@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_bounds_matches_the_oracle(n, k):
    for i in range(k):
        assert chunk_bounds(n, k, i) == oracle.chunk_bounds(n, k, i)


@st.composite
def box_pairs(draw):
    ndim = draw(st.integers(1, 3))
    coord = st.integers(0, 6)
    size = st.integers(0, 5)
    return tuple(
        draw(st.lists(s, min_size=ndim, max_size=ndim)) for s in (coord, size, coord, size)
    )


@PROPERTY
@given(box_pairs())
def test_intersect_boxes_matches_a_brute_force_set_intersection(boxes):
    a_off, a_size, b_off, b_size = boxes
    got = intersect_boxes(a_off, a_size, b_off, b_size)
    expected = oracle.intersect_boxes(a_off, a_size, b_off, b_size)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (list(got[0]), list(got[1])) == expected
    common = oracle.box_points(a_off, a_size) & oracle.box_points(b_off, b_size)
    assert oracle.box_points(*got) == common
