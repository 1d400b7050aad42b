"""``layoutlang.runtime.redistribute.redistribute`` against DTensor itself, on 8 gloo processes.

One pool of 8 worker processes (``LocalWorkers``) serves the whole module; the jobs live in
``dtensor_jobs.py``. Every worker builds every DeviceMesh of ``dtensor_jobs.MESHES`` once, in
the same order (DeviceMesh creates its process groups collectively, also on ranks outside
the mesh). In torch 2.13 a rank outside a DeviceMesh has ``get_coordinate() is None`` and
``distribute_tensor`` there gives a DTensor of the global shape with an empty local tensor.

What is compared with what, on every rank (``torch.equal`` of the local tensors):

- one mesh (2x4 ``(dp, tp)``, 1-D of 8, 2x2x2): layoutlang's result against
  ``dtensor.redistribute(mesh, placements).to_local()``, against
  ``distribute_tensor(full, mesh, placements).to_local()`` and against the rank's shard cut by
  its mesh coordinate with DTensor's placement classes (no communication);
- across meshes (disjoint 0..3 -> 4..7; overlapping 0..3 -> 2..7; different mesh shapes and
  numbers of axes; one-rank meshes; meshes whose ranks are out of order): against
  ``distribute_tensor(full, destination_mesh, placements)`` and the coordinate cut; ranks
  outside the destination mesh get None;
- the returned DTensor's placements (as DTensor normalizes them), global shape, and
  ``full_tensor()`` (a DTensor collective over the new mesh).

Placements are written ``R``, ``S<d>``, ``SS<d>/<sf>`` (``_StridedShard``), ``P`` (Partial);
a mesh's placements are comma-separated, one per mesh axis.

Two torch 2.13 limits shape the oracles (both inside torch, not layoutlang):
``distribute_tensor`` scatters by process-group rank, which DeviceMesh sorts, so on a mesh
like ``[7, 6, 5, 4]`` it hands rank 7 the last shard while ``get_coordinate()`` (and every
local shape) says the first; and it raises AssertionError for an uneven ``_StridedShard``.
There the oracle is ``distribute_tensor(..., src_data_rank=None)`` (each rank cuts its shard
by coordinate), see ``dtensor_jobs.distribute``.
"""

from __future__ import annotations

import itertools

import dtensor_jobs
import pytest

# The `pool` of every test (tests/conftest.py): a world of exactly 8 ranks for the meshes of
# dtensor_jobs.MESHES, built once by `warm` before the first test. The module's own: the
# workers keep those meshes, and the last test leaves point-to-point operations unmatched.
pytestmark = [pytest.mark.timeout(300), pytest.mark.workers(8, scope="module", warm=dtensor_jobs.warm)]

DTYPES = ["float32", "bfloat16", "int64"]


def case(src, src_p, dst, dst_p, shape, dtype="float32", **options):
    return dict(src=src, src_p=src_p, dst=dst, dst_p=dst_p, shape=tuple(shape), dtype=dtype, **options)


def case_id(c) -> str:
    shape = "x".join(map(str, c["shape"])) or "scalar"
    extra = "".join(f"-{k}{v}" for k, v in c.items() if k in ("domain_size", "memory_budget", "noncontiguous"))
    return f"{c['src']}[{c['src_p']}]-to-{c['dst']}[{c['dst_p']}]-{shape}-{c['dtype']}{extra}"


# ------------------------------------------------------------------------- cases

_SHAPES_2D = [(9, 4), (10, 6), (10, 3, 5)]
_PLACEMENTS_2X4 = ["R,R", "S0,R", "R,S0", "S0,S1", "S1,S0", "S0,S0", "R,S1"]

SAME_MESH = [
    case("world2x4", a, "world2x4", b, _SHAPES_2D[i % 3], DTYPES[i % 3], redistribute_oracle=True)
    for i, (a, b) in enumerate(itertools.permutations(_PLACEMENTS_2X4, 2))
]
SAME_MESH += [
    case("world8", a, "world8", b, shape, dtype, redistribute_oracle=True)
    for (a, b), shape, dtype in zip(
        itertools.permutations(["R", "S0", "S1", "SS0/2"], 2),
        itertools.cycle([(10, 3), (16, 5), (9,), (12, 9, 2)]),
        itertools.cycle(["int64", "float32", "bfloat16"]),
    )
    if not (shape == (9,) and "S1" in (a, b))
]
SAME_MESH += [
    # two axes on one dim, nested left to right; DTensor's _StridedShard for the other order
    case("world2x4", "S0,SS0/2", "world2x4", "R,R", (16, 2), redistribute_oracle=True),
    case("world2x4", "R,R", "world2x4", "S0,SS0/2", (16, 2), "int64", redistribute_oracle=True),
    case("world2x4", "SS0/4,S0", "world2x4", "S0,S0", (16, 2), redistribute_oracle=True),  # FSDP over TP
    case("world2x4", "S0,S0", "world2x4", "SS0/4,S0", (16, 3), "bfloat16", redistribute_oracle=True),
    case("world2x4", "S0,S0", "world2x4", "S1,S1", (10, 10), redistribute_oracle=True),  # 2,2,1,0,2,2,1,0
    case("world8", "SS0/2", "world8", "S1", (10, 9), redistribute_oracle=True),  # uneven strided
    case("world8", "S0", "world8", "S-1", (4, 9), redistribute_oracle=True),  # negative dim
    case("world8", "R", "world8", "S0", (3,), redistribute_oracle=True),  # 5 empty shards
    case("world8", "S0", "world8", "S1", (0, 4), redistribute_oracle=True),  # empty tensor
    case("world8", "R", "world8", "R", (), "int64", redistribute_oracle=True),  # scalar
    case("world8", "S0", "world8", "S0", (11, 2), redistribute_oracle=True),  # nothing moves
    case("world2x2x2", "S0,S1,S2", "world2x2x2", "R,S0,S0", (4, 6, 5), "int64", redistribute_oracle=True),
    case("world2x2x2", "S0,S0,S0", "world2x2x2", "R,S1,S1", (9, 9), redistribute_oracle=True),
    case("world2x2x2", "R,S0,R", "world2x2x2", "S1,R,S0", (7, 5, 3), "bfloat16", redistribute_oracle=True),
]

CROSS_MESH = [
    # disjoint: sources on 0..3, destinations on 4..7
    case("low2x2", "S0,S1", "high2x2", "S1,S0", (9, 5), "bfloat16"),
    case("low2x2", "S0,S0", "high2x2", "R,S0", (10, 3)),
    case("low2x2", "R,S1", "high2x2", "S0,S0", (10, 7, 2), "int64"),
    case("low4", "S0", "high4", "S1", (9, 13)),
    case("low4", "S1", "high4", "R", (5, 6), "int64"),
    case("low4", "R", "high2x2", "S1,S0", (9, 10), "bfloat16"),
    case("low2x2", "S1,R", "high4", "S0", (9, 4, 3)),
    case("low4", "SS0/2", "high4", "SS0/2", (8, 3), "int64"),  # vLLM gate_up on both sides
    case("low4", "SS0/2", "high4", "S0", (16, 2)),
    case("low4", "S0", "high4", "SS0/2", (12, 2), "bfloat16"),
    # overlapping: sources on 0..3, destinations on 2..7
    case("low4", "S0", "mid6", "S1", (9, 13)),
    case("low4", "S0", "mid6", "R", (10, 4), "bfloat16"),
    case("low2x2", "S1,S0", "mid2x3", "S0,S1", (7, 11), "int64"),
    case("low2x2", "R,R", "mid2x3", "S0,S0", (13,)),
    case("low4", "SS0/2", "mid6", "SS0/3", (13, 3)),  # uneven strided on both sides
    # a mesh inside the other, or the other way round; different numbers of axes
    case("world2x4", "S0,S1", "high4", "S0", (8, 8)),
    case("world2x4", "S1,S0", "high2x2", "R,S1", (10, 3, 2), "int64"),
    case("world8", "S0", "low2x2", "S0,S0", (10,), "bfloat16"),
    case("world8", "S0", "world2x2x2", "S2,R,S0", (5, 3, 6), "bfloat16"),
    case("world2x2x2", "S0,S1,S2", "mid2x3", "S1,S0", (4, 6, 4), "int64"),
    case("mid2x3", "S0,S1", "world2x4", "S1,S0", (9, 13)),
    case("mid6", "S0", "low2x2", "S0,S0", (10,)),
    case("high2x2", "S0,S1", "world2x2x2", "R,S0,S1", (6, 5), "int64"),
    # one-rank meshes
    case("one7", "R", "low4", "S0", (5, 2)),
    case("low4", "S0", "one7", "R", (5, 2), "bfloat16"),
    case("pair01", "S0", "one7", "S0", (5, 2, 2), "int64"),
    # ranks out of order (row-major over the given list; DTensor's scatter cannot serve here)
    case("low4", "S0", "high4_reversed", "S0", (9,)),
    case("low4", "R", "high4_reversed", "S0", (8, 2), "int64"),
    case("high4_reversed", "S0", "low4", "R", (8,), "int64"),
    case("high4_reversed", "S0", "mid6", "S0", (13, 2), "bfloat16"),
    case("world2x4", "S0,S1", "high2x2_columns", "S1,S0", (10, 6)),
    case("high2x2_columns", "S0,S0", "world8", "S0", (10, 6)),
    # relays inside domains, and small buckets
    case("low2x2", "S0,R", "high4", "R", (40, 8), domain_size=2),
    case("low2x2", "S0,R", "high4", "R", (40, 8), "bfloat16", domain_size=4),
    case("low2x2", "S1,S0", "mid2x3", "S0,S1", (7, 11), "int64", domain_size=2),
    case("low4", "S0", "mid6", "R", (10, 4), "bfloat16", domain_size=4),
    case("low4", "S0", "high4", "S1", (1000, 64), memory_budget=16384),
    case("low4", "S0", "high4", "S1", (6, 6), "int64", memory_budget=16),
    # source DTensors whose local tensors are non-contiguous (column-major) views
    case("world2x4", "S0,S1", "high4", "S0", (8, 8), noncontiguous=True),
    case("low4", "S1", "mid6", "S0", (8, 9), "bfloat16", noncontiguous=True),
]
# every other dtype layoutlang knows, on one overlapping pair (float8: gloo has no float8
# collectives, so DTensor cuts shards locally there and full_tensor() is not tried)
CROSS_MESH += [
    case("low2x2", "S0,S1", "mid2x3", "S1,S0", (9, 7), dtype)
    for dtype in ("float16", "float64", "int8", "uint8", "int32", "bool")
]
CROSS_MESH += [case("low2x2", "S0,S1", "mid2x3", "S1,S0", (9, 7), "float8_e4m3fn", no_collectives=True)]


# ------------------------------------------------------------------------ checks


def check_rows(c, rows):
    """Every rank's result for one case: None off the destination mesh, DTensor's shard on it."""
    src, dst = set(dtensor_jobs.mesh_ranks(c["src"])), set(dtensor_jobs.mesh_ranks(c["dst"]))
    problems = []
    for row in rows:
        rank = row["rank"]
        if rank not in src | dst:
            assert row["skipped"], row
            continue
        if rank not in dst:
            if not row["is_none"]:
                problems.append(f"rank {rank} is outside the destination mesh but got a DTensor")
            continue
        if row["is_none"]:
            problems.append(f"rank {rank} is in the destination mesh but got None")
            continue
        for key in ("equal_distribute", "equal_coordinate", "placements_ok", "shape_ok", "mesh_ok", "contiguous"):
            if not row[key]:
                detail = {k: row.get(k) for k in ("local", "expected", "placements", "got_values", "expected_values")}
                problems.append(f"rank {rank}: {key} is false: {detail}")
        if row.get("full_tensor_ok") is False:
            problems.append(f"rank {rank}: full_tensor() of the result is not the full tensor")
        if "redistribute_error" in row:
            problems.append(f"rank {rank}: DTensor.redistribute failed: {row['redistribute_error']}")
        elif c.get("redistribute_oracle") and not row.get("equal_redistribute"):
            problems.append(
                f"rank {rank}: differs from DTensor.redistribute ({row['local']} vs {row.get('redistribute_shape')})"
            )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("c", SAME_MESH, ids=case_id)
def test_same_mesh_matches_dtensor_redistribute(pool, c):
    (rows,) = zip(*pool.run(dtensor_jobs.cross_check, [c]))
    check_rows(c, rows)


@pytest.mark.parametrize("c", CROSS_MESH, ids=case_id)
def test_across_meshes_matches_distribute_tensor(pool, c):
    (rows,) = zip(*pool.run(dtensor_jobs.cross_check, [c]))
    check_rows(c, rows)


def test_the_case_lists_cover_the_brief():
    cases = SAME_MESH + CROSS_MESH
    assert {c["dtype"] for c in cases} >= set(DTYPES)
    assert {len(c["shape"]) for c in cases} >= {0, 1, 2, 3}
    assert any("SS0/2" in c["src_p"] + c["dst_p"] for c in SAME_MESH)
    # disjoint, overlapping, and every rank of the source also in the destination
    relations = set()
    for c in CROSS_MESH:
        src, dst = set(dtensor_jobs.mesh_ranks(c["src"])), set(dtensor_jobs.mesh_ranks(c["dst"]))
        relations.add("disjoint" if not src & dst else "subset" if src <= dst or dst <= src else "overlap")
    assert relations == {"disjoint", "subset", "overlap"}


@pytest.mark.parametrize("src, dst", [("world8", "world8"), ("low4", "high4"), ("low4", "mid6")])
def test_a_transposed_dtensor_view(pool, src, dst):
    """``distribute_tensor(...).t()``: placements Shard(1), a non-contiguous local view and a
    transposed global stride; the data must still land where DTensor puts it."""
    rows = [r for r in pool.run(dtensor_jobs.transposed_source, src, dst) if r is not None]
    assert sorted(r["rank"] for r in rows) == dtensor_jobs.mesh_ranks(dst)
    for row in rows:
        assert row["equal"] and row["placements_ok"], row
        assert row["full_tensor_ok"] and row["sum_ok"], row
        if row["oracle_equal"] is not None:
            assert row["oracle_equal"], row
            assert row["stride"] == row["oracle_stride"], row


def test_many_cases_in_one_job_reuse_plans(pool):
    """The same redistribute twice in a row (the plan cache) and different ones interleaved."""
    cases = [CROSS_MESH[0], CROSS_MESH[10], CROSS_MESH[0], SAME_MESH[3], CROSS_MESH[10]]
    results = pool.run(dtensor_jobs.cross_check, cases)
    for i, c in enumerate(cases):
        check_rows(c, [rows[i] for rows in results])


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("partial_source", "Partial"),
        ("partial_destination", "Partial"),
        ("too_few_placements", "placements"),
        ("too_many_placements", "placements"),
        ("not_a_dtensor", "DTensor"),
        ("complex_dtype", "complex64"),
    ],
)
def test_errors_are_layout_value_errors_on_every_rank(pool, kind, needle):
    messages = pool.run(dtensor_jobs.redistribute_error, kind)
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages  # every rank refuses alike, before any byte moves
    assert messages[0].startswith("LayoutValueError: "), messages[0]
    assert needle in messages[0], messages[0]


def test_wrong_placement_counts_name_both_numbers(pool):
    assert pool.run(dtensor_jobs.redistribute_error, "too_few_placements")[0] == (
        "LayoutValueError: 1 placements for a destination mesh of 2 dims"
    )


def test_a_rank_in_neither_mesh_does_not_disturb_the_others(pool):
    """Ranks 0..1 -> 4..7 while ranks 2..3 (in neither mesh) call too: the participants finish
    with the right shards; the bystanders get None or a LayoutError naming their rank."""
    rows = pool.run(dtensor_jobs.outside_both_meshes)
    for row in rows:
        rank = row["rank"]
        if rank in (2, 3):
            assert (row["error"] is None and row["is_none"]) or f"rank {rank}" in (row["error"] or ""), row
        else:
            assert row["error"] is None, row
            assert row["is_none"] == (rank < 4), row
            if rank >= 4:
                assert row["equal"], row


# Keep this test last: it leaves unmatched point-to-point operations behind in the pool.
def test_a_dtensor_on_a_sliced_submesh(pool):
    """A DTensor on ``world2x4["tp"]`` (TP inside each DP replica, a common training setup):
    DeviceMesh slicing gives each rank only its own row, so ranks 0..3 see the source mesh
    [0, 1, 2, 3] and ranks 4..7 see [4, 5, 6, 7]; the ranks describe different
    redistributions (different participants, so different agreement leaders).

    Either layoutlang moves the data (every destination rank gets DTensor's shard), or every
    rank stops with a LayoutError that says the ranks disagree, not one that blames a dead
    or hung peer after the whole timeout.
    """
    rows = pool.run(dtensor_jobs.submesh_source, 8.0, timeout=120)
    assert [row["sub"] for row in rows] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    if all(row["error"] is None for row in rows):
        for row in rows:
            assert row["is_none"] == (row["rank"] < 2), row
            assert row.get("equal", True), row
        return
    for row in rows:
        message = row["error"] or ""
        assert message.startswith(("LayoutValueError", "AgreementError", "ExecutionError")), row
        assert "may have died" not in message and "did not complete" not in message, (
            f"rank {row['rank']} waited {row['seconds']:.1f} s and blamed a peer: {message}"
        )


def test_a_rank_without_a_dtensor_is_told_how_to_make_one():
    """A rank of the destination mesh only has no data, but still passes the source DTensor:
    the error says how to make it (issue 29: the message once said only "takes a DTensor")."""
    import torch

    from layoutlang import LayoutValueError
    from layoutlang.runtime.redistribute import redistribute

    with pytest.raises(LayoutValueError) as caught:
        redistribute(torch.zeros(4), None, [])
    assert "redistribute takes a DTensor on every rank; this rank passed Tensor" in caught.value.message
    assert "src_data_rank=None" in caught.value.hint
