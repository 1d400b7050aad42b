"""``Layout.on_mesh``: a layout's rules on another mesh, as a recovery derives them.

Where the rules read the same axes at the same sizes (a spare in a lost rank's place, a
dropped replica), the new layout reuses the old one's resolution and compiles only its
ranks; the oracle is the same layout resolved from scratch on the new mesh: every box of
every tensor on every rank, every rank's storages (empty stacks included) and the layout's
checks agree. A mesh that resizes an axis the rules read is resolved afresh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import layoutlang
from elastic.remesh import data_parallel_axes, remesh
from layoutlang.model import Layout, Mesh

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.layout"))

STACKED = """
mesh serve [dp = 2, ep = 4]
tensor "experts.{e}.w1" [16, 8] fp32 for e in 0..2
layout vllm_ep on serve {
    "experts.{e}.w1": ep[e]
    storage "w13" = stack e of "experts.{e}.w1"
}
"""


def fresh(layout: Layout) -> Layout:
    return Layout(layout.name, layout.mesh, layout.tensors, layout.rules, layout.storages, layout.span)


def assert_same(derived: Layout) -> None:
    oracle = fresh(derived)
    for rank in derived.mesh.ranks:
        assert derived.storages_on(rank) == oracle.storages_on(rank), rank
        for name in derived.tensors:
            assert derived.boxes(name, rank) == oracle.boxes(name, rank), (name, rank)
    assert derived.summary() == oracle.summary()
    derived.check()


def successors(layout: Layout) -> list[tuple[Layout, bool]]:
    """(layout on a new mesh, whether the resolution must carry over)."""
    lost = layout.mesh.ranks[-1]
    out = [(remesh(layout, {lost}, "fill-spares", spares=[max(layout.mesh.ranks) + 7]), True)]
    if data_parallel_axes(layout):
        out.append((remesh(layout, {lost}, "drop-replica"), True))
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_a_derived_layout_equals_the_layout_resolved_afresh(path):
    program = layoutlang.load(path)
    for layout in program.layouts.values():
        layout.check()  # resolved: what a recovery starts from
        for derived, carries in successors(layout):
            assert bool(derived._resolved) == carries
            if carries:  # the rules were matched once, not again
                assert derived.resolved.rule_of is layout.resolved.rule_of
            assert_same(derived)


def test_empty_stacks_follow_the_new_ranks():
    layout = layoutlang.loads(STACKED).layouts["vllm_ep"]
    before = layout.storages_on(3)  # ep 3 holds no expert of 3: an empty stack
    assert before == {"w13": (0, 16, 8)}
    derived = remesh(layout, {3}, "fill-spares", spares=[20])
    assert derived.storages_on(20) == before and 3 not in derived.mesh
    assert_same(derived)
    dropped = remesh(layout, {3}, "drop-replica")
    assert dropped.mesh.ranks == (4, 5, 6, 7)
    assert_same(dropped)


def test_a_mesh_that_resizes_an_axis_the_rules_read_is_resolved_afresh():
    layout = layoutlang.loads(STACKED).layouts["vllm_ep"]
    layout.check()
    wider = layout.on_mesh(Mesh("serve8", {"dp": 2, "ep": 8}, list(range(16))))
    assert not wider._resolved
    assert wider.storages_on(5) == {"w13": (0, 16, 8)} and wider.storages_on(2) == {"w13": (1, 16, 8)}
    renamed = layout.on_mesh(Mesh("flat", {"ep": 4}, [0, 1, 2, 3]), "flat_ep")
    assert renamed.name == "flat_ep" and not renamed._resolved
