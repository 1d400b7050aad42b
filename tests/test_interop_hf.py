"""Logical tensors from Hugging Face configs: published models, family variants, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from layoutlang.errors import ModelDescriptionError
from layoutlang.io.hf import (
    SUPPORTED_MODEL_TYPES,
    hf_config_constants,
    read_config,
    tensors_from_hf_config,
)

pytestmark = pytest.mark.timeout(60)

# The config.json files of the public Hugging Face repositories, as published.

LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

LLAMA_3_70B: dict[str, Any] = {
    **LLAMA_3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
}

QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_235B_A22B: dict[str, Any] = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
    "num_key_value_heads": 4,
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

# Qwen3-30B-A3B's config as transformers 5 writes it: `dtype`, and `num_local_experts` for
# the expert count that 4.x wrote as `num_experts`
QWEN3_30B_A3B_TRANSFORMERS_5: dict[str, Any] = {
    **{key: value for key, value in QWEN3_30B_A3B.items() if key not in ("num_experts", "torch_dtype")},
    "num_local_experts": QWEN3_30B_A3B["num_experts"],
    "dtype": "bfloat16",
    "transformers_version": "5.24.0",
}


def write_config(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def by_name(tensors: list[tuple[str, tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (shape, dtype) for name, shape, dtype in tensors}


def parameter_count(tensors: list[tuple[str, tuple[int, ...], str]]) -> int:
    """Model parameters, leaving out FP8 dequantization scales (published sizes do too)."""
    return sum(math.prod(shape) for name, shape, _ in tensors if not name.endswith(".weight_scale_inv"))


# --- published models ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "published_billions"),
    [
        pytest.param(LLAMA_3_8B, 8.03, id="Llama-3-8B"),
        pytest.param(LLAMA_3_70B, 70.55, id="Llama-3-70B"),
        pytest.param(QWEN3_8B, 8.19, id="Qwen3-8B"),
        pytest.param(QWEN3_30B_A3B, 30.5, id="Qwen3-30B-A3B"),
        pytest.param(QWEN3_235B_A22B, 235.1, id="Qwen3-235B-A22B"),
        pytest.param(DEEPSEEK_V3, 671.0, id="DeepSeek-V3"),
        pytest.param(MIXTRAL_8X7B, 46.7, id="Mixtral-8x7B"),
        pytest.param(QWEN3_30B_A3B_TRANSFORMERS_5, 30.5, id="Qwen3-30B-A3B-transformers-5"),
    ],
)
def test_parameter_totals_match_published_sizes(
    tmp_path: Path, config: dict[str, Any], published_billions: float
) -> None:
    total = parameter_count(tensors_from_hf_config(write_config(tmp_path, config)))
    assert total == pytest.approx(published_billions * 1e9, rel=0.005)


def test_llama_3_8b_tensors_in_checkpoint_order(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, LLAMA_3_8B))
    # embedding, 32 layers of 4 attention + 3 MLP projections + 2 norms, final norm, head
    assert len(tensors) == 1 + 32 * 9 + 1 + 1
    assert tensors[0] == ("model.embed_tokens.weight", (128256, 4096), "bf16")
    assert [name for name, _, _ in tensors[1:10]] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ]
    assert tensors[-2] == ("model.norm.weight", (4096,), "bf16")
    assert tensors[-1] == ("lm_head.weight", (128256, 4096), "bf16")
    shapes = by_name(tensors)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == ((1024, 4096), "bf16")
    assert shapes["model.layers.31.mlp.down_proj.weight"] == ((4096, 14336), "bf16")
    assert {dtype for _, _, dtype in tensors} == {"bf16"}


def test_llama_3_70b_shapes(tmp_path: Path) -> None:
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, LLAMA_3_70B)))
    assert shapes["model.layers.79.self_attn.q_proj.weight"] == ((8192, 8192), "bf16")
    assert shapes["model.layers.79.self_attn.v_proj.weight"] == ((1024, 8192), "bf16")
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == ((28672, 8192), "bf16")
    assert "model.layers.80.input_layernorm.weight" not in shapes


def test_qwen3_8b_has_qk_norms_and_explicit_head_dim(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, QWEN3_8B))
    assert len(tensors) == 1 + 36 * 11 + 1 + 1
    shapes = by_name(tensors)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == ((128,), "bf16")
    assert shapes["model.layers.35.self_attn.k_norm.weight"] == ((128,), "bf16")
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == ((1024, 4096), "bf16")
    assert not any(name.endswith(".bias") for name in shapes)


def test_qwen3_30b_a3b_experts_and_router(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, QWEN3_30B_A3B))
    shapes = by_name(tensors)
    experts = [name for name in shapes if ".mlp.experts." in name]
    assert len(experts) == 48 * 128 * 3
    assert shapes["model.layers.0.mlp.gate.weight"] == ((128, 2048), "bf16")
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == ((2048, 768), "bf16")
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((4096, 2048), "bf16")
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == ((2048, 4096), "bf16")
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    # the router precedes the experts, which come in order, each gate, up, down
    layer0 = [name for name, _, _ in tensors if name.startswith("model.layers.0.mlp.")]
    assert layer0[:4] == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight",
    ]


def test_qwen3_moe_reads_either_spelling_of_the_expert_count(tmp_path: Path) -> None:
    written_by_4 = tensors_from_hf_config(write_config(tmp_path, QWEN3_30B_A3B, "4.json"))
    written_by_5 = tensors_from_hf_config(write_config(tmp_path, QWEN3_30B_A3B_TRANSFORMERS_5, "5.json"))
    assert written_by_5 == written_by_4
    no_count = {key: value for key, value in QWEN3_30B_A3B.items() if key != "num_experts"}
    with pytest.raises(ModelDescriptionError, match="needs key 'num_experts' or 'num_local_experts'"):
        tensors_from_hf_config(write_config(tmp_path, no_count))


def test_mixtral_experts_w1_w2_w3_and_router(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, MIXTRAL_8X7B))
    shapes = by_name(tensors)
    moe = "model.layers.31.block_sparse_moe"
    assert shapes[f"{moe}.gate.weight"] == ((8, 4096), "bf16")
    assert shapes[f"{moe}.experts.7.w1.weight"] == ((14336, 4096), "bf16")  # gate
    assert shapes[f"{moe}.experts.7.w2.weight"] == ((4096, 14336), "bf16")  # down
    assert shapes[f"{moe}.experts.7.w3.weight"] == ((14336, 4096), "bf16")  # up
    assert not any(".mlp." in name or name.endswith(".bias") for name in shapes)
    # embedding, 32 layers of 4 attention + router + 8 * 3 expert weights + 2 norms, norm, head
    assert len(tensors) == 1 + 32 * (4 + 1 + 24 + 2) + 1 + 1


def test_qwen3_235b_a22b_shapes(tmp_path: Path) -> None:
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, QWEN3_235B_A22B)))
    assert shapes["model.layers.0.mlp.experts.0.gate_proj.weight"] == ((1536, 4096), "bf16")
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == ((512, 4096), "bf16")
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((8192, 4096), "bf16")
    assert shapes["model.layers.93.mlp.gate.weight"] == ((128, 4096), "bf16")
    assert len([name for name in shapes if ".mlp.experts." in name]) == 94 * 128 * 3


def test_deepseek_v3_as_published_in_fp8(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, DEEPSEEK_V3))
    shapes = by_name(tensors)
    routed = [name for name in shapes if ".mlp.experts." in name and name.endswith("_proj.weight")]
    assert len(routed) == 58 * 256 * 3
    attn = "model.layers.0.self_attn"
    assert shapes[f"{attn}.kv_a_proj_with_mqa.weight"] == ((576, 7168), "fp8_e4m3")
    assert shapes[f"{attn}.kv_a_proj_with_mqa.weight_scale_inv"] == ((5, 56), "fp32")
    assert shapes[f"{attn}.q_a_proj.weight"] == ((1536, 7168), "fp8_e4m3")
    assert shapes[f"{attn}.q_a_layernorm.weight"] == ((1536,), "bf16")
    assert shapes[f"{attn}.q_b_proj.weight"] == ((128 * 192, 1536), "fp8_e4m3")
    assert shapes[f"{attn}.kv_a_layernorm.weight"] == ((512,), "bf16")
    assert shapes[f"{attn}.kv_b_proj.weight"] == ((128 * 256, 512), "fp8_e4m3")
    assert shapes[f"{attn}.kv_b_proj.weight_scale_inv"] == ((256, 4), "fp32")
    assert shapes[f"{attn}.o_proj.weight"] == ((7168, 16384), "fp8_e4m3")
    assert f"{attn}.q_proj.weight" not in shapes
    # the first three layers are dense, the rest MoE
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == ((18432, 7168), "fp8_e4m3")
    assert shapes["model.layers.2.mlp.gate_proj.weight_scale_inv"] == ((144, 56), "fp32")
    assert "model.layers.2.mlp.gate.weight" not in shapes
    assert "model.layers.3.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.3.mlp.gate.weight"] == ((256, 7168), "bf16")
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == ((256,), "fp32")
    assert shapes["model.layers.3.mlp.experts.255.down_proj.weight"] == ((7168, 2048), "fp8_e4m3")
    assert shapes["model.layers.3.mlp.shared_experts.gate_proj.weight"] == ((2048, 7168), "fp8_e4m3")
    assert shapes["model.layers.60.mlp.shared_experts.down_proj.weight"] == ((7168, 2048), "fp8_e4m3")
    # no multi-token-prediction layer by default
    assert not any(name.startswith("model.layers.61.") for name in shapes)
    assert tensors[0] == ("model.embed_tokens.weight", (129280, 7168), "bf16")
    assert tensors[-2] == ("model.norm.weight", (7168,), "bf16")
    assert tensors[-1] == ("lm_head.weight", (129280, 7168), "bf16")
    # every quantized weight has its scale, and only quantized weights do
    fp8 = {name for name, (_, dtype) in shapes.items() if dtype == "fp8_e4m3"}
    scales = {name for name in shapes if name.endswith(".weight_scale_inv")}
    assert {name.removesuffix("_scale_inv") for name in scales} == fp8


def test_deepseek_v3_with_explicit_dtype_is_unquantized(tmp_path: Path) -> None:
    tensors = tensors_from_hf_config(write_config(tmp_path, DEEPSEEK_V3), dtype="bfloat16")
    assert {dtype for _, _, dtype in tensors} == {"bf16"}
    assert not any(name.endswith("_scale_inv") for name, _, _ in tensors)
    assert parameter_count(tensors) == pytest.approx(671.0e9, rel=0.005)


def test_deepseek_v3_mtp_layer_on_request(tmp_path: Path) -> None:
    path = write_config(tmp_path, DEEPSEEK_V3)
    main = tensors_from_hf_config(path)
    with_mtp = tensors_from_hf_config(path, include_mtp=True)
    shapes = by_name(with_mtp)
    mtp = "model.layers.61"
    assert shapes[f"{mtp}.embed_tokens.weight"] == ((129280, 7168), "bf16")
    assert shapes[f"{mtp}.enorm.weight"] == ((7168,), "bf16")
    assert shapes[f"{mtp}.hnorm.weight"] == ((7168,), "bf16")
    assert shapes[f"{mtp}.eh_proj.weight"] == ((7168, 14336), "bf16")
    assert shapes[f"{mtp}.shared_head.norm.weight"] == ((7168,), "bf16")
    assert shapes[f"{mtp}.shared_head.head.weight"] == ((129280, 7168), "bf16")
    assert shapes[f"{mtp}.self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), "fp8_e4m3")
    assert shapes[f"{mtp}.mlp.experts.0.gate_proj.weight"] == ((2048, 7168), "fp8_e4m3")
    # the MTP module adds about 14B parameters: 685B in all
    assert parameter_count(with_mtp) - parameter_count(main) == pytest.approx(13.46e9, rel=0.005)
    assert with_mtp[-1] == ("lm_head.weight", (129280, 7168), "bf16")


# --- family variants -----------------------------------------------------------------


def test_deepseek_without_q_lora_uses_q_proj(tmp_path: Path) -> None:
    config = {**DEEPSEEK_V3, "q_lora_rank": None, "quantization_config": None}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((128 * 192, 7168), "bf16")
    assert not any("q_a_proj" in name or "q_b_proj" in name for name in shapes)
    # without quantization the router bias still follows the published checkpoint: fp32
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == ((256,), "fp32")


def test_deepseek_shared_experts_scale_with_their_count(tmp_path: Path) -> None:
    config = {**DEEPSEEK_V3, "n_shared_experts": 2, "first_k_dense_replace": 1}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config), dtype="bf16"))
    assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == ((4096, 7168), "bf16")
    assert shapes["model.layers.1.mlp.gate.weight"] == ((256, 7168), "bf16")
    assert shapes["model.layers.0.mlp.up_proj.weight"] == ((18432, 7168), "bf16")


def test_deepseek_without_shared_experts(tmp_path: Path) -> None:
    config = {**DEEPSEEK_V3, "n_shared_experts": None}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert not any(".shared_experts." in name for name in shapes)


def test_fp8_modules_to_not_convert_stay_unquantized(tmp_path: Path) -> None:
    quantization = {**DEEPSEEK_V3["quantization_config"], "modules_to_not_convert": ["kv_b_proj"]}
    config = {**DEEPSEEK_V3, "quantization_config": quantization}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == ((32768, 512), "bf16")
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" not in shapes
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == ((7168, 16384), "fp8_e4m3")


def test_qwen3_fp8_blocks_round_up(tmp_path: Path) -> None:
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = {**QWEN3_30B_A3B, "quantization_config": quantization}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == ((2048, 768), "fp8_e4m3")
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"] == ((16, 6), "fp32")
    assert shapes["model.layers.0.mlp.gate.weight"] == ((128, 2048), "bf16")
    assert shapes["model.embed_tokens.weight"] == ((151936, 2048), "bf16")


def test_qwen3_moe_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    moe_layers = {int(name.split(".")[2]) for name in shapes if name.endswith(".mlp.gate.weight")}
    dense_layers = {int(name.split(".")[2]) for name in shapes if name.endswith(".mlp.gate_proj.weight")}
    assert moe_layers == {1, 5}
    assert dense_layers == {0, 2, 3, 4}
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == ((6144, 2048), "bf16")


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    config = {**QWEN3_8B, "tie_word_embeddings": True}
    tensors = tensors_from_hf_config(write_config(tmp_path, config))
    assert tensors[-1] == ("model.norm.weight", (4096,), "bf16")
    assert "lm_head.weight" not in by_name(tensors)


def test_llama_attention_and_mlp_biases(tmp_path: Path) -> None:
    config = {**LLAMA_3_8B, "num_hidden_layers": 1, "attention_bias": True, "mlp_bias": True}
    tensors = tensors_from_hf_config(write_config(tmp_path, config))
    names = [name for name, _, _ in tensors]
    assert len([name for name in names if name.endswith(".bias")]) == 7
    # each bias follows its weight
    q_weight = names.index("model.layers.0.self_attn.q_proj.weight")
    assert names[q_weight + 1] == "model.layers.0.self_attn.q_proj.bias"
    assert by_name(tensors)["model.layers.0.self_attn.k_proj.bias"] == ((1024,), "bf16")
    assert by_name(tensors)["model.layers.0.mlp.down_proj.bias"] == ((4096,), "bf16")


def test_qwen2_always_has_qkv_biases_and_no_o_bias(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    tensors = tensors_from_hf_config(write_config(tmp_path, config))
    shapes = by_name(tensors)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == ((896,), "bf16")
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == ((128,), "bf16")
    assert shapes["model.layers.0.self_attn.v_proj.bias"] == ((128,), "bf16")
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert "lm_head.weight" not in shapes
    # Qwen2.5-0.5B: 0.49B parameters
    assert parameter_count(tensors) == pytest.approx(0.494e9, rel=0.005)


def test_mistral_uses_llama_layout_and_head_dim(tmp_path: Path) -> None:
    config = {
        "model_type": "mistral",
        "hidden_size": 5120,
        "head_dim": 128,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 40,
        "vocab_size": 131072,
        "torch_dtype": "bfloat16",
    }
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((4096, 5120), "bf16")
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == ((5120, 4096), "bf16")
    assert shapes["lm_head.weight"] == ((131072, 5120), "bf16")


def test_missing_kv_heads_means_full_attention(tmp_path: Path) -> None:
    config = {key: value for key, value in LLAMA_3_8B.items() if key != "num_key_value_heads"}
    shapes = by_name(tensors_from_hf_config(write_config(tmp_path, config)))
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == ((4096, 4096), "bf16")


@pytest.mark.parametrize(
    ("argument", "config_entries", "expected"),
    [
        pytest.param("float16", {"torch_dtype": "bfloat16"}, "fp16", id="argument-wins"),
        pytest.param(None, {"torch_dtype": "float32"}, "fp32", id="torch_dtype"),
        pytest.param(None, {"torch_dtype": None, "dtype": "float16"}, "fp16", id="newer-dtype-key"),
        pytest.param(None, {"torch_dtype": None}, "bf16", id="default"),
    ],
)
def test_dtype_precedence(tmp_path: Path, argument: str | None, config_entries: dict[str, Any], expected: str) -> None:
    config = {**LLAMA_3_8B, "num_hidden_layers": 1, **config_entries}
    tensors = tensors_from_hf_config(write_config(tmp_path, config), dtype=argument)
    assert {dtype for _, _, dtype in tensors} == {expected}


def test_model_folder_reads_its_config(tmp_path: Path) -> None:
    write_config(tmp_path, QWEN3_8B)
    assert tensors_from_hf_config(tmp_path) == tensors_from_hf_config(tmp_path / "config.json")
    assert read_config(tmp_path)["model_type"] == "qwen3"


def test_config_constants_are_the_integer_entries() -> None:
    constants = hf_config_constants(DEEPSEEK_V3)
    assert constants["num_hidden_layers"] == 61
    assert constants["num_key_value_heads"] == 128
    assert constants["n_routed_experts"] == 256
    assert constants["rope_theta"] == 10000
    # floats, booleans, strings, lists and objects are not constants
    for key in ("rms_norm_eps", "norm_topk_prob", "seq_aux", "model_type", "architectures", "quantization_config"):
        assert key not in constants
    assert all(type(value) is int for value in constants.values())


# --- errors ----------------------------------------------------------------------------


def assert_names_file(error: pytest.ExceptionInfo[ModelDescriptionError], path: Path, *fragments: str) -> None:
    assert str(path) in error.value.message
    for fragment in fragments:
        assert fragment in error.value.message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "config.json"
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "not found")


def test_not_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",', encoding="utf-8")
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "not JSON")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama\xff"}')
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "not UTF-8")


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "JSON object")


def test_unknown_model_type_lists_supported_ones(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**LLAMA_3_8B, "model_type": "gpt2"})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "'gpt2'", *SUPPORTED_MODEL_TYPES)


def test_missing_model_type(tmp_path: Path) -> None:
    config = {key: value for key, value in LLAMA_3_8B.items() if key != "model_type"}
    path = write_config(tmp_path, config)
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "model_type", "deepseek_v3")


@pytest.mark.parametrize(
    ("config", "key"),
    [
        pytest.param(LLAMA_3_8B, "hidden_size", id="llama-hidden_size"),
        pytest.param(QWEN3_30B_A3B, "num_experts", id="qwen3_moe-num_experts"),
        pytest.param(DEEPSEEK_V3, "kv_lora_rank", id="deepseek_v3-kv_lora_rank"),
        pytest.param(DEEPSEEK_V3, "first_k_dense_replace", id="deepseek_v3-first_k_dense_replace"),
    ],
)
def test_missing_required_key_names_key_and_model_type(tmp_path: Path, config: dict[str, Any], key: str) -> None:
    path = write_config(tmp_path, {name: value for name, value in config.items() if name != key})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, repr(key), repr(config["model_type"]))


@pytest.mark.parametrize("bad_size", [4096.5, "4096", True, -1, 0])
def test_non_integer_or_non_positive_size(tmp_path: Path, bad_size: Any) -> None:
    path = write_config(tmp_path, {**LLAMA_3_8B, "hidden_size": bad_size})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "'hidden_size'")


def test_non_integer_layer_list(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**QWEN3_30B_A3B, "mlp_only_layers": ["3"]})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "'mlp_only_layers'")


def test_non_boolean_flag(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**LLAMA_3_8B, "tie_word_embeddings": "yes"})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "'tie_word_embeddings'")


def test_hidden_size_not_divisible_by_heads(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**LLAMA_3_8B, "num_attention_heads": 30})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "head_dim")


def test_unknown_config_dtype(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**LLAMA_3_8B, "torch_dtype": "float13"})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, "'float13'", "bf16")


def test_unknown_dtype_argument(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA_3_8B)
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path, dtype="int3")
    assert_names_file(error, path, "'int3'")


@pytest.mark.parametrize(
    ("quantization", "fragment"),
    [
        pytest.param({"quant_method": "gptq", "bits": 4}, "'gptq'", id="other-method"),
        pytest.param({"quant_method": "fp8"}, "weight_block_size", id="per-tensor-fp8"),
        pytest.param(
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "'static'",
            id="static-activations",
        ),
        pytest.param({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e3m4"}, "'e3m4'", id="fmt"),
    ],
)
def test_unsupported_quantization(tmp_path: Path, quantization: dict[str, Any], fragment: str) -> None:
    path = write_config(tmp_path, {**QWEN3_8B, "quantization_config": quantization})
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_hf_config(path)
    assert_names_file(error, path, fragment)
    # describing the unquantized checkpoint instead works
    assert tensors_from_hf_config(path, dtype="bf16")
