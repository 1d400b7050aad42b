"""A language that composes: expressions over mesh axis sizes with min, max and cdiv.

The values are checked against Python's own arithmetic (``math.ceil`` of an exact
``Fraction``), and the spellings a program used before (``let infer_tp = 8`` beside the
mesh, the preset's min without a min function) against the new ones.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

import layoutlang

pytestmark = pytest.mark.timeout(120)


# ================================================================== expressions


@pytest.mark.parametrize(("a", "b"), list(itertools.product([-9, -7, -1, 0, 1, 5, 7, 64, 129], [-4, -1, 1, 2, 3, 128])))
def test_functions_equal_pythons_arithmetic(a, b):
    program = layoutlang.loads(
        f"let a = {a}\nlet b = {b}\nlet lo = min(a, b)\nlet hi = max(a, b, 0)\nlet up = cdiv(a, b)\n"
        "mesh m [tp = 1]\n"
    )
    assert program.constants["lo"] == (a if a < b else b)
    assert program.constants["hi"] == sorted([a, b, 0])[-1]
    assert program.constants["up"] == math.ceil(Fraction(a, b))


def test_functions_nest_and_bind_like_atoms():
    program = layoutlang.loads("let x = 2 * min(3, 4) + cdiv(max(5, 1), 2) * -1\nmesh m [tp = 1]\n")
    assert program.constants["x"] == 2 * 3 + math.ceil(Fraction(5, 2)) * -1


def test_axis_sizes_of_meshes_are_names_in_expressions():
    program = layoutlang.loads(
        "mesh train [pp = 2, tp = 2]\n"
        "mesh infer [dp = 2, tp = 4] on ranks 4..11\n"
        "let rows = 128 * infer.tp\n"
        'tensor "w" [rows, train.pp * 3] fp32\n'
        "mesh wide [tp = infer.tp * infer.dp]\n"
    )
    assert program.constants["infer.tp"] == 4 and program.constants["train.pp"] == 2
    assert program.tensors["w"].shape == (512, 6)
    assert program.meshes["wide"].shape == (8,)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
def test_min_replaces_the_presets_arithmetic_for_kv_chunks(tp):
    """vLLM cuts k and v into min(tp, kv_heads) chunks; the preset wrote min without one."""
    kv_heads = 4
    program = layoutlang.loads(
        f"mesh infer [tp = {tp}]\nlet kv_heads = {kv_heads}\n"
        "let old_fits = 1 - 1 // (kv_heads // infer.tp + 1)\n"
        "let old = infer.tp * old_fits + kv_heads * (1 - old_fits)\n"
        "let new = min(infer.tp, kv_heads)\n"
    )
    assert program.constants["new"] == program.constants["old"] == min(tp, kv_heads)


def test_axis_sizes_and_functions_in_rules_and_storage_names():
    """Sub-mesh indexes and storage names compile the functions; every tensor is checked."""
    program = layoutlang.loads(
        "mesh train [pp = 3, tp = 2]\nlet layers = 7\n"
        'tensor "layers.{l}.w" [8, 4] fp32 for l in 0..6\n'
        "layout a on train {\n"
        '  "layers.{l}.w": pp[min(l // cdiv(layers, train.pp), train.pp - 1)], tp = shard(0)\n'
        '  storage "stage.{l % cdiv(layers, train.pp)}.w" = "layers.{l}.w"\n'
        "}\n"
    )
    layout = program.layouts["a"]
    per_stage = -(-7 // 3)
    for layer in range(7):
        name = f"layers.{layer}.w"
        assert dict(layout.placement(name).submesh) == {"pp": min(layer // per_stage, 2)}
        assert layout.storage_of(name).name == f"stage.{layer % per_stage}.w"


# ======================================================================= extends

MODEL = """
mesh infer [ep = 2, tp = 2]
tensor "layers.{l}.q.weight" [8, 4] bf16 for l in 0..1
tensor "layers.{l}.k.weight" [4, 4] bf16 for l in 0..1
tensor "layers.{l}.experts.{e}.gate.weight" [8, 4] bf16 for l in 0..1, e in 0..3
tensor "layers.{l}.experts.{e}.up.weight" [8, 4] bf16 for l in 0..1, e in 0..3
tensor "norm.weight" [4] bf16
"""

BASE = """
layout vllm on infer {
    "layers.{l}.q.weight": tp = shard(0)
    "layers.{l}.k.weight": tp = shard(0)
    "layers.{l}.experts.{e}.*": tp = shard(0)
    default: replicate
    storage "layers.{l}.qk.weight" = "layers.{l}.q.weight" | "layers.{l}.k.weight"
    storage "layers.{l}.experts.{e}.gate_up.weight" =
        "layers.{l}.experts.{e}.gate.weight" | "layers.{l}.experts.{e}.up.weight"
}
"""

EXTENDED = """
layout vllm_ep on infer extends vllm {
    "layers.{l}.experts.{e}.*": ep[e // 2], tp = shard(1)
    "norm.weight": tp = shard(0)
    storage "layers.{l}.experts.{e}.w13" =
        "layers.{l}.experts.{e}.gate.weight" | "layers.{l}.experts.{e}.up.weight" along 1
}
"""

# what vllm_ep means, written out in full: the oracle
FULL = """
layout full on infer {
    "layers.{l}.q.weight": tp = shard(0)
    "layers.{l}.k.weight": tp = shard(0)
    "layers.{l}.experts.{e}.*": ep[e // 2], tp = shard(1)
    "norm.weight": tp = shard(0)
    default: replicate
    storage "layers.{l}.qk.weight" = "layers.{l}.q.weight" | "layers.{l}.k.weight"
    storage "layers.{l}.experts.{e}.w13" =
        "layers.{l}.experts.{e}.gate.weight" | "layers.{l}.experts.{e}.up.weight" along 1
}
"""


def test_an_extended_layout_equals_the_layout_written_in_full():
    program = layoutlang.loads(MODEL + BASE + EXTENDED + FULL)
    program.check()
    extended, full, base = program.layouts["vllm_ep"], program.layouts["full"], program.layouts["vllm"]
    for name in program.tensors:
        assert extended.placement(name) == full.placement(name), name
        assert extended.storage_of(name).name == full.storage_of(name).name, name
        for rank in range(4):
            assert extended.boxes(name, rank) == full.boxes(name, rank), (name, rank)
    for rank in range(4):
        assert extended.storages_on(rank) == full.storages_on(rank)
    # the layout extended is unchanged
    assert base.storage_of("layers.0.experts.3.up.weight").name == "layers.0.experts.3.gate_up.weight"
    assert base.placement("norm.weight").placements == (layoutlang.Replicate(), layoutlang.Replicate())


def test_layouts_extend_in_chains_and_in_any_order():
    chained = (
        "layout top on infer extends vllm_ep {\n    default: tp = shard(0)\n}\n"
    )
    program = layoutlang.loads(MODEL + chained + EXTENDED + BASE)
    top = program.layouts["top"]
    assert dict(top.placement("layers.1.experts.2.up.weight").submesh) == {"ep": 1}
    assert top.placement("norm.weight").placements[1] == layoutlang.Shard(0)


def test_an_extended_layout_may_live_on_another_mesh():
    other = "mesh small [tp = 2] on ranks 4..5\nlayout small_vllm on small extends vllm {}\n"
    program = layoutlang.loads(MODEL + BASE + other)
    assert program.layouts["small_vllm"].holders("layers.0.q.weight") == [4, 5]
