"""The example layouts against hand-computed boxes.

Each expectation below was worked out by hand from the engine's convention (vLLM's
QKVParallelLinear / MergedColumnParallelLinear / VocabParallelEmbedding, Megatron's fused
QKV per query group, SwiGLU fc1 and stage-local names) and is written as
(global region, storage, place in the storage).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import layoutlang

pytestmark = pytest.mark.timeout(60)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def regions(layout: layoutlang.Layout, tensor: str, rank: int) -> list[tuple[str, str, str]]:
    """Boxes as readable strings: ('rows:cols' region, storage, place)."""

    def fmt(offsets, sizes):
        return ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes))

    return [(fmt(b.offsets, b.sizes), b.storage, fmt(b.storage_offsets, b.sizes)) for b in layout.boxes(tensor, rank)]


@pytest.fixture(scope="module")
def vllm() -> layoutlang.Layout:
    return layoutlang.load(EXAMPLES / "vllm_tp.layout").layouts["vllm"]


@pytest.fixture(scope="module")
def megatron() -> layoutlang.Layout:
    return layoutlang.load(EXAMPLES / "megatron_pp_tp.layout").layouts["megatron"]


@pytest.fixture(scope="module")
def moe() -> layoutlang.Program:
    return layoutlang.load(EXAMPLES / "moe_ep.layout")


def test_every_example_checks():
    files = sorted(EXAMPLES.glob("*.layout"))
    assert len(files) >= 8
    for path in files:
        layoutlang.load(path).check()


# --------------------------------------------------------------------------- vLLM

QKV = "model.layers.{l}.self_attn.qkv_proj.weight"


def test_vllm_qkv_fuses_local_q_k_v_with_kv_heads_replicated(vllm):
    # 8 query heads of 32 over tp=4: 64 rows each; 2 kv heads over tp=4: rank r holds kv head r // 2.
    qkv = QKV.format(l=1)
    assert regions(vllm, "model.layers.1.self_attn.q_proj.weight", 1) == [("64:128, 0:256", qkv, "0:64, 0:256")]
    assert regions(vllm, "model.layers.1.self_attn.k_proj.weight", 1) == [("0:32, 0:256", qkv, "64:96, 0:256")]
    assert regions(vllm, "model.layers.1.self_attn.v_proj.weight", 1) == [("0:32, 0:256", qkv, "96:128, 0:256")]
    assert regions(vllm, "model.layers.1.self_attn.k_proj.weight", 2) == [("32:64, 0:256", qkv, "64:96, 0:256")]
    assert vllm.storage_shape(qkv, 1) == (128, 256)


def test_vllm_data_parallel_replicas_hold_the_same_boxes(vllm):
    # rank 5 is (dp=1, tp=1): the same boxes as rank 1 (dp=0, tp=1)
    for tensor in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert regions(vllm, tensor, 5) == regions(vllm, tensor, 1)
    assert vllm.placement("model.norm.weight").placements == (layoutlang.Replicate(), layoutlang.Replicate())


def test_vllm_gate_up_is_gate_then_up_of_the_rank(vllm):
    gate_up = "model.layers.2.mlp.gate_up_proj.weight"
    assert regions(vllm, "model.layers.2.mlp.gate_proj.weight", 3) == [("384:512, 0:256", gate_up, "0:128, 0:256")]
    assert regions(vllm, "model.layers.2.mlp.up_proj.weight", 3) == [("384:512, 0:256", gate_up, "128:256, 0:256")]
    assert regions(vllm, "model.layers.2.mlp.down_proj.weight", 3) == [
        ("0:256, 384:512", "model.layers.2.mlp.down_proj.weight", "0:256, 0:128")
    ]


def test_vllm_vocab_parallel_embedding_is_padded_to_64_then_split(vllm):
    # 1000 rows padded to 1024, 256 per tp rank; the last rank holds 232 real rows of 256.
    embed = "model.embed_tokens.weight"
    assert regions(vllm, embed, 2) == [("512:768, 0:256", embed, "0:256, 0:256")]
    assert regions(vllm, embed, 3) == [("768:1000, 0:256", embed, "0:232, 0:256")]
    assert vllm.storage_shape(embed, 3) == (256, 256)


# ------------------------------------------------------------------------- Megatron


def test_megatron_stage_from_layer_and_stage_local_names(megatron):
    # layers 0, 1 on stage 0 (ranks 0, 1); layers 2, 3 on stage 1 (ranks 2, 3)
    assert megatron.holders("model.layers.1.mlp.up_proj.weight") == [0, 1]
    assert megatron.holders("model.layers.2.mlp.up_proj.weight") == [2, 3]
    assert megatron.storage_of("model.layers.2.mlp.down_proj.weight").name == "decoder.layers.0.mlp.linear_fc2.weight"
    assert megatron.storage_of("model.layers.3.mlp.down_proj.weight").name == "decoder.layers.1.mlp.linear_fc2.weight"
    assert megatron.boxes("model.layers.3.mlp.down_proj.weight", 0) == []


def test_megatron_fused_qkv_is_interleaved_per_query_group(megatron):
    # tp=2: each rank holds 4 query heads and 1 kv head = one query group [q(128) | k(32) | v(32)]
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert regions(megatron, "model.layers.3.self_attn.q_proj.weight", 3) == [("128:256, 0:256", qkv, "0:128, 0:256")]
    assert regions(megatron, "model.layers.3.self_attn.k_proj.weight", 3) == [("32:64, 0:256", qkv, "128:160, 0:256")]
    assert regions(megatron, "model.layers.3.self_attn.v_proj.weight", 3) == [("32:64, 0:256", qkv, "160:192, 0:256")]


def test_megatron_fused_qkv_with_two_groups_per_rank(tmp_path):
    # Without tensor parallelism a rank holds both query groups: q0 k0 v0 q1 k1 v1.
    program = tmp_path / "tp1.layout"
    program.write_text(
        f'include "{EXAMPLES}/models/tiny_llama.layout"\n'
        "let stages = 2\n"
        f'include "{EXAMPLES}/layouts/megatron_llama.layout"\n'
        "mesh train [pp = stages, tp = 1]\n"
    )
    # the examples lie outside tmp_path: a trusted program's includes, allowed explicitly
    layout = layoutlang.load(program, allow_outside_includes=True).layouts["megatron"]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert regions(layout, "model.layers.0.self_attn.q_proj.weight", 0) == [
        ("0:128, 0:256", qkv, "0:128, 0:256"),
        ("128:256, 0:256", qkv, "192:320, 0:256"),
    ]
    assert regions(layout, "model.layers.0.self_attn.k_proj.weight", 0) == [
        ("0:32, 0:256", qkv, "128:160, 0:256"),
        ("32:64, 0:256", qkv, "320:352, 0:256"),
    ]
    assert regions(layout, "model.layers.0.self_attn.v_proj.weight", 0) == [
        ("0:32, 0:256", qkv, "160:192, 0:256"),
        ("32:64, 0:256", qkv, "352:384, 0:256"),
    ]
    layout.check()


def test_megatron_swiglu_fc1_and_padded_vocab(megatron):
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert regions(megatron, "model.layers.0.mlp.gate_proj.weight", 1) == [("256:512, 0:256", fc1, "0:256, 0:256")]
    assert regions(megatron, "model.layers.0.mlp.up_proj.weight", 1) == [("256:512, 0:256", fc1, "256:512, 0:256")]
    # 1000 rows padded to a multiple of 256 (= 128 * tp): 512 per rank, only on stage 0
    embed = "embedding.word_embeddings.weight"
    assert regions(megatron, "model.embed_tokens.weight", 1) == [("512:1000, 0:256", embed, "0:488, 0:256")]
    assert megatron.storage_shape(embed, 1) == (512, 256)
    assert megatron.holders("lm_head.weight") == [2, 3]


# ------------------------------------------------------------------------------ MoE


def test_moe_training_places_experts_by_stage_and_expert_index(moe):
    train = moe.layouts["megatron_moe"]
    # expert 5 of layer 3: stage 1, ep rank 1 -> ranks 6 and 7, gate and up cut by expert TP
    assert train.holders("model.layers.3.mlp.experts.5.gate_proj.weight") == [6, 7]
    fc1 = "model.layers.3.mlp.experts.5.linear_fc1.weight"
    assert regions(train, "model.layers.3.mlp.experts.5.gate_proj.weight", 6) == [("0:32, 0:128", fc1, "0:32, 0:128")]
    assert regions(train, "model.layers.3.mlp.experts.5.up_proj.weight", 7) == [("32:64, 0:128", fc1, "32:64, 0:128")]
    assert regions(train, "model.layers.3.mlp.experts.5.down_proj.weight", 7)[0][0] == "0:128, 32:64"
    # dense attention: replicated over ep within the stage
    assert train.holders("model.layers.0.self_attn.q_proj.weight") == [0, 1, 2, 3]
    assert regions(train, "model.layers.0.self_attn.q_proj.weight", 2)[0][0] == "0:64, 0:128"


def test_moe_inference_puts_each_expert_on_one_rank(moe):
    infer = moe.layouts["vllm_ep"]
    for expert in range(8):
        assert infer.holders(f"model.layers.1.mlp.experts.{expert}.down_proj.weight") == [8 + expert]
    gate_up = "model.layers.1.mlp.experts.5.gate_up_proj.weight"
    up = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert regions(infer, up, 13) == [("0:64, 0:128", gate_up, "64:128, 0:128")]
    assert moe.reshard("refit").source == "megatron_moe"


# ------------------------------------------------------------------ other examples


def test_fsdp_over_tp_nests_right_to_left_when_ordered():
    layout = layoutlang.load(EXAMPLES / "fsdp_tp.layout").layouts["fsdp_tp"]
    qkv = "layers.0.attn.qkv.weight"
    # tp cuts first (192 rows each), dp cuts each tp piece: rank = (dp, tp)
    assert [regions(layout, qkv, r)[0][0] for r in range(4)] == [
        "0:96, 0:128",
        "192:288, 0:128",
        "96:192, 0:128",
        "288:384, 0:128",
    ]
    # mesh-axis order (dp then tp), uneven 1000 rows: 250 each
    assert [regions(layout, "embed.weight", r)[0][0] for r in range(4)] == [
        "0:250, 0:128",
        "250:500, 0:128",
        "500:750, 0:128",
        "750:1000, 0:128",
    ]
    assert regions(layout, "layers.1.attn.out.weight", 1)[0][0] == "0:64, 64:128"


def test_colocated_meshes_share_ranks():
    program = layoutlang.load(EXAMPLES / "colocated.layout")
    train, infer = program.layouts["train_tp"], program.layouts["infer_tp"]
    assert set(train.mesh.ranks) == set(infer.mesh.ranks) == {0, 1, 2, 3}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert regions(train, q, 1)[0][0] == "64:128, 0:256"
    assert regions(infer, q, 1)[0][0] == "128:256, 0:256"


def test_hf_import_uses_config_constants():
    program = layoutlang.load(EXAMPLES / "hf_import.layout")
    assert program.constants["cfg.num_key_value_heads"] == 2
    layout = program.layouts["vllm"]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert regions(layout, "model.layers.0.self_attn.k_proj.weight", 3) == [("64:128, 0:256", qkv, "128:192, 0:256")]
    assert layout.storage_shape(qkv, 3) == (256, 256)
    assert regions(layout, "model.embed_tokens.weight", 3)[0][0] == "3072:4096, 0:256"


def test_tp_to_dp_domains():
    program = layoutlang.load(EXAMPLES / "tp_to_dp.layout")
    source, destination = program.layouts["tp"], program.layouts["dp"]
    assert [program.topology.domain_of(r) for r in destination.mesh.ranks] == [4, 4, 5, 5]
    assert regions(source, "w", 1) == [("512:1024, 0:1024", "w", "0:512, 0:1024")]
    assert all(regions(destination, "w", r) == [("0:1024, 0:1024", "w", "0:1024, 0:1024")] for r in range(8, 12))


def test_refit_has_disjoint_fleets():
    program = layoutlang.load(EXAMPLES / "refit.layout")
    refit = program.reshard("refit")
    source, destination = program.layout(refit.source), program.layout(refit.destination)
    assert not set(source.mesh.ranks) & set(destination.mesh.ranks)
    assert program.topology.domain_size == 2


def _project_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of layoutlang or elastic in a script (name None
    for ``import module``)."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return [(line, module, name) for line, module, name in found if module.split(".")[0] in ("layoutlang", "elastic")]


def _private_use(module: str, name: str | None) -> str | None:
    """Why importing ``name`` from ``module`` is not public API, or None when it is."""
    if any(part.startswith("_") for part in module.split(".")):
        return f"module {module} is private"
    if name is None:
        return None
    if name.startswith("_"):
        return f"{name} is private"
    exported = getattr(importlib.import_module(module), "__all__", None)
    if exported is not None and name not in exported and not _is_submodule(module, name):
        return f"{name} is not in {module}.__all__"
    return None


def _is_submodule(module: str, name: str) -> bool:
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.py")), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_examples_use_only_the_public_api(path):
    """What users copy must not lean on private names (``layoutlang._text`` once was)."""
    private = [f"line {line}: {why}" for line, module, name in _project_imports(path)
               if (why := _private_use(module, name)) is not None]
    assert private == []


def test_the_public_api_check_finds_a_private_import(tmp_path):
    script = tmp_path / "example.py"
    script.write_text("import os\nfrom layoutlang._text import human_bytes\nfrom layoutlang.runtime import Resharder\n")
    found = [(line, _private_use(module, name)) for line, module, name in _project_imports(script)]
    assert found == [(2, "module layoutlang._text is private"), (3, None)]
