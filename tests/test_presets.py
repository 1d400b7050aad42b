"""The packaged presets (layoutlang/presets): model sizes equal the published ones, the
training and inference layouts place tensors as Megatron and vLLM do, and
``include "preset:NAME"`` finds them."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

import layoutlang
from layoutlang.errors import LayoutIncludeError
from layoutlang.plan import compile_plan

pytestmark = pytest.mark.timeout(120)

PRESETS = Path(layoutlang.__file__).parent / "lang" / "presets"

#: name: (logical tensors, parameters, the published size it rounds to, in billions, and its precision)
MODELS = {
    "llama3_70b": (723, 70_553_706_496, 70.6, 0.1),  # Hugging Face model card: 70.6B
    "qwen3_30b_a3b": (18_867, 30_532_122_624, 30.5, 0.1),  # Qwen3 model card: 30.5B in total
    "qwen3_235b_a22b": (36_945, 235_093_634_560, 235, 1),  # Qwen3 model card: 235B in total
    "deepseek_v3": (45_395, 671_026_419_200, 671, 1),  # DeepSeek-V3 report: 671B total (685B with MTP)
    "large_2_4t": (144_189, 2_427_551_783_424, 2430, 10),  # 2.43T, documented in its model.layout
}


def parameters(program) -> int:
    return sum(t.numel for t in program.tensors.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_model_sizes_match_the_published_ones(name):
    tensors, params, published, precision = MODELS[name]
    program = layoutlang.loads(f'include "preset:{name}"')
    assert len(program.tensors) == tensors
    assert parameters(program) == params
    assert abs(params / 1e9 - published) <= precision / 2
    assert {t.dtype for t in program.tensors.values()} == {"bf16"}
    assert sum(t.nbytes for t in program.tensors.values()) == 2 * params


def test_preset_names_resolve():
    a = layoutlang.loads('include "preset:llama3_70b"')
    b = layoutlang.loads('include "preset:llama3_70b/model"')
    assert list(a.tensors) == list(b.tensors)
    with pytest.raises(LayoutIncludeError) as err:
        layoutlang.loads('include "preset:llama3-70b"')
    message = str(err.value)
    assert "unknown preset 'llama3-70b'" in message and "llama3_70b" in message and "deepseek/megatron" in message
    with pytest.raises(LayoutIncludeError, match="unknown preset"):
        layoutlang.loads('include "preset:../elaborate"')


def test_every_preset_file_is_package_data():
    files = sorted(p.relative_to(PRESETS).as_posix() for p in PRESETS.rglob("*") if p.is_file())
    assert "deepseek_v3/config.json" in files and "qwen3_moe/vllm_ep.layout" in files
    assert not [f for f in files if not f.endswith((".layout", ".json"))]


# ----------------------------------------------------------------------- Llama


LLAMA = """
include "preset:llama3_70b"
let train_pp = 4
let train_tp = 8
let infer_tp = {infer_tp}
include "preset:llama/megatron"
include "preset:llama/vllm"
topology dgx_h100 {{}}
mesh train [pp = train_pp, tp = train_tp] on ranks 0..31
mesh infer [dp = {dp}, tp = infer_tp] on ranks 32..63
reshard megatron -> vllm
"""


def test_llama_megatron_and_vllm():
    program = layoutlang.loads(LLAMA.format(infer_tp=8, dp=4))
    program.check()
    train, infer = program.layout("megatron"), program.layout("vllm")
    # layer 25 on stage 25 // 20 = 1 (ranks 8..15), local name decoder.layers.5
    assert train.placement("model.layers.25.mlp.up_proj.weight").submesh == (("pp", 1),)
    assert train.storage_of("model.layers.25.mlp.up_proj.weight").name == "decoder.layers.5.mlp.linear_fc1.weight"
    # linear_qkv interleaves per query group: per tp rank, 1 group of 8 q heads, 1 k, 1 v head
    assert train.storage_shape("decoder.layers.5.self_attention.linear_qkv.weight", 8) == (1280, 8192)
    q = train.boxes("model.layers.25.self_attn.q_proj.weight", 8)
    k = train.boxes("model.layers.25.self_attn.k_proj.weight", 8)
    assert [b.storage_offsets[0] for b in q] == [0] and [b.storage_offsets[0] for b in k] == [1024]
    # vocabulary 128,256 padded to a multiple of 128 x 8 = 1024 (129,024), 16,128 rows per rank
    assert train.local_shape("model.embed_tokens.weight", 0) == (16128, 8192)
    assert infer.storage_shape("model.layers.0.self_attn.qkv_proj.weight", 32) == (1280, 8192)
    assert infer.storage_shape("model.layers.0.mlp.gate_up_proj.weight", 32) == (7168, 8192)
    plan = compile_plan(program)
    plan.validate()
    assert plan.stats.moved == plan.stats.lower_bound


def test_llama_vllm_replicates_kv_heads_beyond_tp_8():
    program = layoutlang.loads(LLAMA.format(infer_tp=16, dp=2))
    infer = program.layout("vllm")
    assert program.constants["infer_kv_chunks"] == 8
    heads = [infer.boxes("model.layers.0.self_attn.k_proj.weight", r)[0].offsets[0] // 128 for r in range(32, 48)]
    assert heads == [h for h in range(8) for _ in range(2)]
    assert layoutlang.loads(LLAMA.format(infer_tp=4, dp=8)).constants["infer_kv_chunks"] == 4


# ----------------------------------------------------------------------- Qwen3 MoE


QWEN = """
include "preset:qwen3_30b_a3b"
let train_pp = 2
let train_ep = 8
let train_tp = 2
let infer_ep = 2
let infer_tp = 8
include "preset:qwen3_moe/{train}"
include "preset:qwen3_moe/{infer}"
topology dgx_h100 {{}}
mesh train [pp = train_pp, ep = train_ep, tp = train_tp] on ranks 0..31
mesh infer [dp = 2, ep = infer_ep, tp = infer_tp] on ranks 32..63
reshard {train_layout} -> {infer_layout}
"""


def test_qwen3_moe_megatron_and_vllm_ep():
    program = layoutlang.loads(
        QWEN.format(train="megatron", infer="vllm_ep", train_layout="megatron", infer_layout="vllm_ep")
    )
    train, infer = program.layout("megatron"), program.layout("vllm_ep")
    # expert 37 of layer 30: stage 30 // 24 = 1, ep rank 37 // 16 = 2, whole, replicated over tp
    expert = "model.layers.30.mlp.experts.37.gate_proj.weight"
    assert train.placement(expert).submesh == (("pp", 1), ("ep", 2))
    assert train.holders(expert) == [20, 21]
    assert train.storage_of(expert).name == "decoder.layers.6.mlp.experts.local_experts.5.linear_fc1.weight"
    # attention: tp over 2 ranks, replicated over ep (8 data-parallel copies)
    assert len(train.holders("model.layers.0.self_attn.o_proj.weight")) == 16
    # inference: 128 experts over ep x tp = 16 ranks, 8 each; expert 37 on position 4: ep 0, tp 4
    assert infer.placement(expert).submesh == (("ep", 0), ("tp", 4))
    assert infer.holders(expert) == [36, 52]  # both replicas
    assert infer.placement("model.layers.0.mlp.experts.127.up_proj.weight").submesh == (("ep", 1), ("tp", 7))
    # 4 kv heads on tp 8: each head on 2 consecutive ranks
    assert program.constants["infer_kv_chunks"] == 4
    plan = compile_plan(program)
    assert plan.stats.moved == plan.stats.lower_bound


def test_qwen3_moe_expert_tensor_parallel_and_vllm_tp():
    program = layoutlang.loads(
        QWEN.format(train="megatron_etp", infer="vllm", train_layout="megatron", infer_layout="vllm")
    )
    train, infer = program.layout("megatron"), program.layout("vllm")
    expert = "model.layers.30.mlp.experts.37.down_proj.weight"
    assert [b.sizes for b in train.boxes(expert, 20)] == [(2048, 384)]  # row-parallel over tp = 2
    assert [b.sizes for b in infer.boxes(expert, 32)] == [(2048, 96)]  # over tp = 8
    fc1 = infer.storage_shape("model.layers.30.mlp.experts.37.gate_up_proj.weight", 32)
    assert fc1 == (192, 2048)  # [gate_r | up_r], 96 rows each


# ----------------------------------------------------------------------- DeepSeek-V3


def test_deepseek_megatron_and_vllm_layouts_nemo_rl():
    program = layoutlang.loads(
        """
        include "preset:deepseek_v3"
        let train_pp = 16
        let train_ep = 16
        let train_tp = 1
        include "preset:deepseek/megatron"
        include "preset:deepseek/vllm"
        topology dgx_h100 {}
        mesh train [pp = train_pp, ep = train_ep, tp = train_tp] on ranks 0..255
        mesh infer [dp = 8, tp = 32] on ranks 256..511
        reshard megatron -> vllm
        """
    )
    train, infer = program.layout("megatron"), program.layout("vllm")
    expert = "model.layers.60.mlp.experts.255.up_proj.weight"
    # layer 60 on stage 60 // 4 = 15; expert 255 on ep rank 15: rank 15 * 16 + 15 = 255, alone
    assert train.holders(expert) == [255]
    assert train.storage_shape("model.layers.60.mlp.experts.255.linear_fc1.weight", 255) == (4096, 7168)
    # TP32: each expert cut 32 ways, in every one of the 8 replicas
    assert len(infer.holders(expert)) == 256 and infer.local_shape(expert, 256) == (64, 7168)
    assert infer.storage_shape("model.layers.3.self_attn.fused_qkv_a_proj.weight", 256) == (2112, 7168)
    # 129,280 rows padded to a multiple of 64 over 32 ranks: 4,040 each
    assert infer.local_shape("lm_head.weight", 300) == (4040, 7168)


def test_deepseek_vllm_ep_places_whole_experts():
    program = layoutlang.loads(
        """
        include "preset:deepseek_v3"
        let infer_ep = 4
        let infer_tp = 8
        include "preset:deepseek/vllm_ep"
        mesh infer [dp = 2, ep = infer_ep, tp = infer_tp]
        """
    )
    infer = program.layout("vllm_ep")
    # 256 experts over 32 ranks of an instance: 8 each; expert 100 on position 12: ep 1, tp 4
    assert infer.placement("model.layers.3.mlp.experts.100.down_proj.weight").submesh == (("ep", 1), ("tp", 4))
    assert infer.holders("model.layers.3.mlp.experts.100.down_proj.weight") == [12, 44]
    assert infer.local_shape("model.layers.3.self_attn.o_proj.weight", 0) == (7168, 2048)


def test_large_model_architecture():
    program = layoutlang.loads('include "preset:large_2_4t"')
    experts = [t for t in program.tensors.values() if ".mlp.experts." in t.name]
    assert len(experts) == 93 * 512 * 3
    assert sum(t.numel for t in experts) == pytest.approx(2396.6e9, rel=1e-4)
    assert program.constants["cfg.num_hidden_layers"] == 96 and program.constants["cfg.hidden_size"] == 8192


# ------------------------------------------------------------- model presets' headers

TRAINING = ("megatron", "torchtitan")  # a layout file whose name starts so is a training layout
HEADER_WIDTH = 96


def layouts_header(model: Path) -> str:
    """The ``# Layouts`` lines a model preset's header must carry: every layout file of the
    families it names (``preset:FAMILY/...``), training then inference, as the folder has them."""
    text = model.read_text("utf-8")
    families = sorted(set(re.findall(r'"preset:(\w+)/\w+"', _layouts_block(text))))
    lines = []
    for role, chosen in (("training", True), ("inference", False)):
        names = [f'"preset:{family}/{path.stem}"' for family in families
                 for path in sorted((PRESETS / family).glob("*.layout")) if path.stem.startswith(TRAINING) == chosen]
        if names:
            lines += textwrap.wrap(f"Layouts ({role}): " + ", ".join(names) + ".", HEADER_WIDTH - 2,
                                   break_on_hyphens=False)
    return "\n".join(f"# {line}" for line in lines)


def _layouts_block(text: str) -> str:
    """The header's ``# Layouts`` lines (up to the first line that is not a comment)."""
    match = re.search(r"^# Layouts.*?(?=^[^#]|^#\s*$)", text, re.M | re.S)
    return match.group(0).rstrip("\n") if match else ""


MODEL_PRESETS = sorted(p for p in PRESETS.glob("*/model.layout") if _layouts_block(p.read_text("utf-8")))


@pytest.mark.parametrize("model", MODEL_PRESETS, ids=lambda p: p.parent.name)
def test_model_preset_headers_list_every_layout_of_their_families(model):
    """A new layout in a family folder must appear in each model's header (they once listed
    megatron, vllm and vllm_ep but not megatron_core and vllm_fused). After adding one:
    ``python tests/test_presets.py --update``."""
    assert _layouts_block(model.read_text("utf-8")) == layouts_header(model)


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    for model in MODEL_PRESETS:
        text = model.read_text("utf-8")
        model.write_text(text.replace(_layouts_block(text), layouts_header(model), 1), "utf-8")
        print(f"updated {model.relative_to(PRESETS)}")
