"""Remeshing after lost ranks (drop-replica, shrink-axis, fill-spares, callback) and the
never-silent-loss check (lost_regions, check_recoverable). Pure planning: no processes."""

from __future__ import annotations

import doctest
import importlib
import itertools

import numpy as np
import pytest

import layoutlang
from elastic.remesh import (
    DataLossError,
    check_recoverable,
    data_parallel_axes,
    lost_regions,
    needs_spares,
    open_positions,
    remesh,
)
from layoutlang import LayoutError, LayoutNameError, LayoutValueError, Mesh, RuntimeFailure

# (the package exports the function `remesh`, which hides the submodule's attribute)
remesh_module = importlib.import_module("elastic.remesh")

pytestmark = pytest.mark.timeout(60)

PROGRAM = """
mesh train [dp = 2, tp = 2] on ranks 0..3
mesh infer [dp = 4, tp = 2] on ranks 8..15

tensor "w" [10, 6] fp32
tensor "b" [10] fp32
tensor "gate_up" [8, 4] fp32

layout train_dp on train {
    "w": tp = shard(0)
    "gate_up": tp = shard(0, blocks = 2)
    default: replicate
}

layout serve on infer {
    "w": tp = shard(0)
    "gate_up": tp = shard(0, blocks = 2)
    default: replicate
}

layout serve_rows on infer {
    "w": dp = shard(0), tp = shard(1)
    default: replicate
}
"""


@pytest.fixture(scope="module")
def program():
    return layoutlang.loads(PROGRAM)


def _held(layout, tensor):
    """Per rank: the set of element indices held (exact, for checking boxes)."""
    shape = layout.tensors[tensor].shape
    out = {}
    for rank in layout.mesh.ranks:
        cells = set()
        for box in layout.boxes(tensor, rank):
            cells.update(
                itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes)))
            )
        out[rank] = cells
    assert shape
    return out


def test_doctests():
    result = doctest.testmod(remesh_module)
    assert result.attempted > 0 and result.failed == 0


def test_package_exports():
    import elastic

    assert elastic.remesh is remesh and elastic.DataLossError is DataLossError
    assert {"remesh", "lost_regions", "check_recoverable"} <= set(elastic.__all__)


def test_drop_replica_loses_one_replica(program):
    old = program.layouts["serve"]
    assert data_parallel_axes(old) == ["dp"]
    new = remesh(old, {13}, "drop-replica")  # rank 13 = dp 2, tp 1
    assert new.name == "serve_gen1"
    assert new.mesh.axes == (("dp", 3), ("tp", 2))
    assert new.mesh.ranks == (8, 9, 10, 11, 14, 15)
    assert 12 not in new.mesh and 13 not in new.mesh
    assert new.tensors is old.tensors and new.rules == old.rules and new.storages == old.storages
    # boxes: survivors keep exactly the data they held before (dp is replicate)
    for tensor in ("w", "b", "gate_up"):
        before, after = _held(old, tensor), _held(new, tensor)
        for rank in new.mesh.ranks:
            assert after[rank] == before[rank], (tensor, rank)
    assert [(b.offsets, b.sizes) for b in new.boxes("w", 15)] == [((5, 0), (5, 6))]
    # generations count up
    again = remesh(new, {8}, "drop-replica")
    assert again.name == "serve_gen2" and again.mesh.ranks == (10, 11, 14, 15)
    assert remesh(old, {13}, "drop-replica", name="serve2").name == "serve2"


def test_drop_replica_inference_dp4_tp2_rank5():
    p = layoutlang.loads(
        """
        mesh infer [dp = 4, tp = 2]
        tensor "w" [8, 4] fp32
        layout serve on infer { "w": tp = shard(1) }
        """
    )
    new = remesh(p.layouts["serve"], [5], "drop-replica")
    assert new.mesh.shape == (3, 2)
    assert new.mesh.ranks == (0, 1, 2, 3, 6, 7)
    assert [(b.offsets, b.sizes) for b in new.boxes("w", 6)] == [((0, 0), (8, 2))]
    assert [(b.offsets, b.sizes) for b in new.boxes("w", 7)] == [((0, 2), (8, 2))]


def test_drop_replica_two_replicas_hit(program):
    new = remesh(program.layouts["serve"], {8, 9, 15}, "drop-replica")  # dp 0 (both) and dp 3
    assert new.mesh.axes == (("dp", 2), ("tp", 2))
    assert new.mesh.ranks == (10, 11, 12, 13)
    # lost ranks outside the mesh are ignored
    same = remesh(program.layouts["serve"], {0, 1}, "drop-replica")
    assert same.mesh.ranks == program.layouts["serve"].mesh.ranks


def test_drop_replica_all_replicas_hit(program):
    with pytest.raises(LayoutValueError, match="no intact replica remains"):
        remesh(program.layouts["serve"], {8, 11, 12, 15}, "drop-replica")


def test_spares_are_needed_only_when_the_policy_cannot_give_up_a_position(program):
    serve = program.layouts["serve"]  # dp = 4 replicas of tp = 2 on ranks 8..15
    assert not needs_spares(serve, {8, 11}, ("drop-replica", None))  # dp 2 and 3 remain
    assert needs_spares(serve, {8, 11, 12, 15}, ("drop-replica", None))  # every replica hit
    assert not needs_spares(serve, {0, 1}, ("drop-replica", None))  # not in the mesh
    assert needs_spares(serve, {9}, ("fill-spares", None))
    assert not needs_spares(serve, set(), ("fill-spares", None))


def test_open_positions_follow_joiners_through_the_generations(program):
    mesh = program.layouts["serve"].mesh
    everyone = [*range(4), *range(8, 16)]
    # generation 1 loses 9 and 12; generation 2 admits joiner 16 (into 9's place); generation 3
    # loses the joiner again
    history = [everyone, [r for r in everyone if r not in (9, 12)]]
    assert open_positions(history, mesh) == [9, 12]
    history.append([*history[1], 16])
    assert open_positions(history, mesh) == [12]
    history.append([r for r in history[2] if r != 16])
    assert open_positions(history, mesh) == [9, 12]


def test_drop_replica_without_data_parallel_axis(program):
    layout = program.layouts["serve_rows"]
    assert data_parallel_axes(layout) == []
    with pytest.raises(LayoutValueError, match="has no data-parallel axis") as info:
        remesh(layout, {9}, "drop-replica")
    assert "serve_rows" in str(info.value) and "shrink-axis" in str(info.value)
    with pytest.raises(LayoutValueError, match="axis 'tp' of mesh 'infer' is not data-parallel"):
        remesh(program.layouts["serve"], {9}, "drop-replica", axis="tp")


def test_shrink_axis_by_name(program):
    layout = program.layouts["serve_rows"]
    new = remesh(layout, {9}, "shrink-axis", axis="dp")  # shards re-cut: w rows over 3
    assert new.mesh.axes == (("dp", 3), ("tp", 2)) and new.mesh.ranks == (10, 11, 12, 13, 14, 15)
    assert [(b.offsets, b.sizes) for b in new.boxes("w", 10)] == [((0, 0), (4, 3))]
    assert [(b.offsets, b.sizes) for b in new.boxes("w", 15)] == [((8, 3), (2, 3))]
    with pytest.raises(LayoutValueError, match="axis="):
        remesh(layout, {9}, "shrink-axis")
    with pytest.raises(LayoutNameError) as info:
        remesh(layout, {9}, "shrink-axis", axis="dpp")
    assert "did you mean 'dp'" in str(info.value)


def test_shrink_axis_submesh_out_of_range():
    p = layoutlang.loads(
        """
        mesh train [pp = 2, tp = 2]
        tensor "layers.{l}.w" [4, 4] fp32 for l in 0..1
        layout megatron on train { "layers.{l}.w": pp[l], tp = shard(0) }
        """
    )
    layout = p.layouts["megatron"]
    assert data_parallel_axes(layout) == []
    with pytest.raises(
        LayoutError, match="sub-mesh index 1 is out of range for axis 'pp' of size 1"
    ) as info:
        remesh(layout, {3}, "shrink-axis", axis="pp")
    message = str(info.value)
    assert "remesh of layout 'megatron' (shrink-axis)" in message and "[pp = 1, tp = 2]" in message


def test_fill_spares(program):
    old = program.layouts["serve"]
    new = remesh(old, {13, 9}, "fill-spares", spares=[20, 21, 22])
    assert new.mesh.axes == old.mesh.axes
    assert new.mesh.ranks == (8, 20, 10, 11, 12, 21, 14, 15)  # in mesh order
    assert new.boxes("w", 21) == old.boxes("w", 13)
    with pytest.raises(
        LayoutValueError, match=r"lost 2 ranks .9, 13. but only 1 spare is given: 1 spare missing"
    ):
        remesh(old, {13, 9}, "fill-spares", spares=[20])
    with pytest.raises(LayoutValueError, match="2 spares missing"):
        remesh(old, {13, 9}, "fill-spares")
    with pytest.raises(LayoutValueError, match="already in mesh"):
        remesh(old, {13}, "fill-spares", spares=[8])


def test_callback(program):
    old = program.layouts["serve"]
    seen = {}

    def halve(mesh, lost):
        seen["lost"] = lost
        survivors = [r for r in mesh.ranks if r not in lost][:4]
        return Mesh("half", {"dp": 2, "tp": 2}, survivors)

    new = remesh(old, [13], "callback", callback=halve)
    assert seen["lost"] == frozenset({13})
    assert new.mesh.name == "half" and new.mesh.ranks == (8, 9, 10, 11)
    assert new.boxes("w", 9) == old.boxes("w", 9)
    with pytest.raises(LayoutValueError, match="still holds lost rank"):
        remesh(old, [13], "callback", callback=lambda m, lost: m)
    with pytest.raises(LayoutNameError, match="lacks axis 'tp'"):
        remesh(
            old, [13], "callback", callback=lambda m, lost: Mesh("flat", {"dp": 4}, [8, 9, 10, 11])
        )
    with pytest.raises(LayoutValueError, match="needs callback"):
        remesh(old, [13], "callback")
    with pytest.raises(LayoutValueError, match="unknown remesh policy 'drop-replicas'") as info:
        remesh(old, [13], "drop-replicas")
    assert "did you mean 'drop-replica'" in str(info.value)


# ------------------------------------------------------------------ data loss


def test_lost_rank_with_replica_elsewhere(program):
    train = program.layouts["train_dp"]
    assert lost_regions(train, {1}) == []  # dp replica (rank 3) still holds tp 1
    check_recoverable([train], {1})
    assert lost_regions([train, program.layouts["serve"]], {0, 1, 8, 9}) == []


def test_tp_shard_lost_exactly(program):
    train = program.layouts["train_dp"]
    regions = lost_regions(train, {1, 3})  # both holders of tp 1 died
    assert regions == [
        ("w", (5, 0), (5, 6)),
        ("gate_up", (2, 0), (2, 4)),  # strided: rows 2:4 and 6:8
        ("gate_up", (6, 0), (2, 4)),
    ]
    # the inference layout still holds them
    assert lost_regions([train, program.layouts["serve"]], {1, 3}) == []
    # and it lost everything too: then the regions are lost again
    assert lost_regions([train, program.layouts["serve"]], {1, 3, 9, 11, 13, 15})[0] == (
        "w",
        (5, 0),
        (5, 6),
    )


def test_uneven_exact_against_element_sets():
    p = layoutlang.loads(
        """
        mesh m [a = 2, b = 3]
        tensor "x" [7, 5] fp32
        tensor "y" [9] fp32
        layout one on m { "x": a = shard(1), b = shard(0) "y": (b, a) = shard(0) }
        layout two on m { "x": b = shard(1, blocks = 2) "y": a = shard(0, pad = 4) }
        """
    )
    layouts = [p.layouts["one"], p.layouts["two"]]
    ranks = list(range(6))
    nonempty = 0
    for k in (1, 2, 3):
        for lost in itertools.combinations(ranks, k):
            for chosen in ([layouts[0]], [layouts[1]], layouts):
                regions = lost_regions(chosen, lost)
                nonempty += bool(regions)
                for tensor in ("x", "y"):
                    shape = p.tensors[tensor].shape
                    held = np.zeros(shape, dtype=bool)
                    for layout in chosen:
                        for rank in ranks:
                            if rank in lost:
                                continue
                            for box in layout.boxes(tensor, rank):
                                held[box.slices()] = True
                    got = np.zeros(shape, dtype=int)
                    for t, o, s in regions:
                        if t == tensor:
                            got[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
                    assert got.max(initial=0) <= 1  # disjoint
                    assert np.array_equal(got.astype(bool), ~held), (lost, tensor)
    assert nonempty > 20  # the check is not vacuous


def test_check_recoverable_message(program):
    train = program.layouts["train_dp"]
    with pytest.raises(DataLossError) as info:
        check_recoverable(train, {1, 3})
    err = info.value
    assert isinstance(err, RuntimeFailure) and err.kind == "loss"  # a failure at run time, not bad input
    assert err.to_json()["error"] == "loss"
    assert err.regions == lost_regions(train, {1, 3})
    assert err.message == (
        "data lost: ranks 1, 3 held the only copies of 3 regions of 2 tensors (46 elements) in "
        "layout 'train_dp': w[5:10, 0:6], gate_up[2:4, 0:4], gate_up[6:8, 0:4]"
    )
    assert "hint:" in str(err)
    with pytest.raises(DataLossError, match=r"w\[5:10, 0:6\], gate_up\[2:4, 0:4\] and 1 more\n"):
        check_recoverable(train, {1, 3}, limit=2)


def test_lost_regions_many_tensors_capped():
    p = layoutlang.loads(
        """
        mesh m [tp = 2]
        tensor "layers.{l}.w" [4, 2] fp32 for l in 0..29
        layout tp on m { "layers.{l}.w": tp = shard(0) }
        """
    )
    with pytest.raises(DataLossError) as info:
        check_recoverable(p.layouts["tp"], [0])
    assert len(info.value.regions) == 30
    assert info.value.message.endswith("layers.9.w[0:2, 0:2] and 20 more")
    assert "rank 0 held the only copies of 30 regions of 30 tensors" in info.value.message


def test_drop_replica_picks_the_cheapest_replicated_axis():
    p = layoutlang.loads(
        """
        mesh m [dp = 2, tp = 2]
        tensor "w" [4, 4] fp32
        layout all on m { default: replicate }
        """
    )
    layout = p.layouts["all"]
    assert data_parallel_axes(layout) == ["dp", "tp"]
    assert remesh(layout, {1}, "drop-replica").mesh.axes == (("dp", 1), ("tp", 2))  # tie: first
    new = remesh(layout, {0, 2}, "drop-replica")  # both dp rows hit, one tp column
    assert new.mesh.axes == (("dp", 2), ("tp", 1)) and new.mesh.ranks == (1, 3)


def test_drop_replica_keeps_fused_storages():
    p = layoutlang.loads(
        """
        mesh infer [dp = 2, tp = 2] on ranks 4..7
        tensor "gate" [4, 2] fp32
        tensor "up" [4, 2] fp32
        layout vllm on infer {
            default: tp = shard(0)
            storage "gate_up" = "gate" | "up"
        }
        """
    )
    old = p.layouts["vllm"]
    new = remesh(old, {4}, "drop-replica")
    assert new.mesh.ranks == (6, 7)
    assert new.storages_on(7) == old.storages_on(7) == {"gate_up": (4, 2)}
    assert new.boxes("up", 7) == old.boxes("up", 7)
