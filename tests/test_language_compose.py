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
