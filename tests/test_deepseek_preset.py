"""preset:deepseek/vllm_fused holds vLLM's real DeepSeek-V2/V3 parameters.

The oracle is written here from vLLM's code, not from layoutlang's model:

- ``vllm/model_executor/models/deepseek_v2.py`` (one file for V2 and V3):
  ``DeepseekV2MLAAttention`` holds, with ``q_lora_rank``, ``fused_qkv_a_proj`` (a
  ``MergedColumnParallelLinear`` with ``disable_tp``: ``[q_a_proj | kv_a_proj_with_mqa]``,
  whole on every rank), ``q_a_layernorm`` and ``q_b_proj`` (``ColumnParallelLinear``);
  without it ``q_proj`` (column-parallel) and ``kv_a_proj_with_mqa`` (``ReplicatedLinear``);
  then ``kv_a_layernorm``, ``kv_b_proj`` (column-parallel) and ``o_proj`` (row-parallel).
  ``DeepseekV2DecoderLayer`` makes layer ``l`` a ``DeepseekV2MoE`` when ``l >=
  first_k_dense_replace`` and ``l % moe_layer_freq == 0``, else a dense ``DeepseekV2MLP``
  (``gate_up_proj`` = ``[gate_r | up_r]``, ``down_proj`` row-parallel). ``DeepseekV2MoE``
  holds ``gate`` (replicated router), ``gate.e_score_correction_bias`` (``noaux_tc``),
  ``shared_experts`` (a ``DeepseekV2MLP`` of ``moe_intermediate_size * n_shared_experts``)
  and ``experts`` (a ``FusedMoE``).
- ``vllm/model_executor/layers/fused_moe/layer.py``: without expert parallelism
  ``create_weights`` makes ``w13_weight`` ``[E, 2 * I / tp, H]`` and ``w2_weight`` ``[E, H, I /
  tp]``; ``_load_w13`` narrows gate and up along dim 0 (``tp_rank * shard``) into the two
  halves, ``_load_w2`` narrows down along dim 1.
- ``vllm/model_executor/layers/vocab_parallel_embedding.py``: vocabulary padded to 64, split
  evenly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import layoutlang
from layoutlang.cli.main import main

pytestmark = pytest.mark.timeout(120)

#: a tiny DeepSeek-V3: 3 layers, the first dense, 8 routed experts and 2 shared experts
#: (so that the shared MLP is twice an expert's width)
CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 12,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": 12,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "vocab_size": 100,
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
}

#: DeepSeek-V2-Lite's shape of attention: no query low-rank projection
NO_Q_LORA = CONFIG | {"q_lora_rank": None}


def write_program(tmp_path: Path, mesh: str, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    preset = "deepseek/vllm_fused" if config["q_lora_rank"] else "deepseek/vllm_fused_no_q_lora"
    path = tmp_path / "serve.layout"
    path.write_text(f'tensors from hf "config.json" as cfg dtype bf16\n{mesh}\ninclude "preset:{preset}"\n')
    return path


# ---------------------------------------------------------------- vLLM's parameters


def is_moe(cfg: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer's choice between DeepseekV2MoE and a dense DeepseekV2MLP."""
    return layer >= cfg["first_k_dense_replace"] and layer % cfg["moe_layer_freq"] == 0


def vllm_parameters(cfg: dict, tp: int) -> dict[str, tuple]:
    """Name and shape of every parameter DeepseekV3ForCausalLM creates on one tp rank."""
    hidden, heads, experts = cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    q_rank, kv_rank, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk_head = cfg["qk_nope_head_dim"] + rope
    moe_inter, shared_inter = cfg["moe_intermediate_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    padded = -(-cfg["vocab_size"] // 64) * 64
    out = {"model.embed_tokens.weight": (padded // tp, hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        if q_rank:
            out |= {
                f"{attn}.fused_qkv_a_proj.weight": (q_rank + kv_rank + rope, hidden),
                f"{attn}.q_a_layernorm.weight": (q_rank,),
                f"{attn}.q_b_proj.weight": (heads * qk_head // tp, q_rank),
            }
        else:
            out |= {
                f"{attn}.q_proj.weight": (heads * qk_head // tp, hidden),
                f"{attn}.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
            }
        out |= {
            f"{attn}.kv_a_layernorm.weight": (kv_rank,),
            f"{attn}.kv_b_proj.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) // tp, kv_rank),
            f"{attn}.o_proj.weight": (hidden, heads * cfg["v_head_dim"] // tp),
        }
        if is_moe(cfg, layer):
            out |= {
                f"{mlp}.gate.weight": (experts, hidden),
                f"{mlp}.gate.e_score_correction_bias": (experts,),
                f"{mlp}.shared_experts.gate_up_proj.weight": (2 * shared_inter // tp, hidden),
                f"{mlp}.shared_experts.down_proj.weight": (hidden, shared_inter // tp),
                f"{mlp}.experts.w13_weight": (experts, 2 * moe_inter // tp, hidden),
                f"{mlp}.experts.w2_weight": (experts, hidden, moe_inter // tp),
            }
        else:
            out |= {
                f"{mlp}.gate_up_proj.weight": (2 * cfg["intermediate_size"] // tp, hidden),
                f"{mlp}.down_proj.weight": (hidden, cfg["intermediate_size"] // tp),
            }
        out |= {f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)}
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (padded // tp, hidden)
    return out


def merged_column(gate: torch.Tensor, up: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """MergedColumnParallelLinear.weight_loader: each part narrowed along dim 0, then [gate_r | up_r]."""
    shard = gate.shape[0] // tp
    return torch.cat([gate.narrow(0, tp_rank * shard, shard), up.narrow(0, tp_rank * shard, shard)])


def vllm_loaded(full: dict, cfg: dict, tp: int, tp_rank: int, layer: int) -> dict[str, torch.Tensor]:
    """What vLLM's weight loaders leave in one layer's fused and stacked parameters."""
    attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
    out = {}
    if cfg["q_lora_rank"]:
        # disable_tp: the loader copies both parts whole, q_a at rows [0, q_lora_rank)
        out[f"{attn}.fused_qkv_a_proj.weight"] = torch.cat(
            [full[f"{attn}.q_a_proj.weight"], full[f"{attn}.kv_a_proj_with_mqa.weight"]]
        )
        q_b = full[f"{attn}.q_b_proj.weight"]
        out[f"{attn}.q_b_proj.weight"] = q_b.chunk(tp)[tp_rank]
    o_proj = full[f"{attn}.o_proj.weight"]
    out[f"{attn}.o_proj.weight"] = o_proj.chunk(tp, dim=1)[tp_rank]
    if not is_moe(cfg, layer):
        out[f"{mlp}.gate_up_proj.weight"] = merged_column(
            full[f"{mlp}.gate_proj.weight"], full[f"{mlp}.up_proj.weight"], tp, tp_rank
        )
        return out
    out[f"{mlp}.shared_experts.gate_up_proj.weight"] = merged_column(
        full[f"{mlp}.shared_experts.gate_proj.weight"], full[f"{mlp}.shared_experts.up_proj.weight"], tp, tp_rank
    )
    # FusedMoE._load_w13 / _load_w2 (no expert parallelism: every expert, TP inside it)
    shard, hidden = cfg["moe_intermediate_size"] // tp, cfg["hidden_size"]
    w13 = torch.empty(cfg["n_routed_experts"], 2 * shard, hidden)
    w2 = torch.empty(cfg["n_routed_experts"], hidden, shard)
    for e in range(cfg["n_routed_experts"]):
        x = f"{mlp}.experts.{e}"
        w13[e, :shard] = full[f"{x}.gate_proj.weight"].narrow(0, tp_rank * shard, shard)
        w13[e, shard:] = full[f"{x}.up_proj.weight"].narrow(0, tp_rank * shard, shard)
        w2[e] = full[f"{x}.down_proj.weight"].narrow(1, tp_rank * shard, shard)
    out[f"{mlp}.experts.w13_weight"] = w13
    out[f"{mlp}.experts.w2_weight"] = w2
    return out


# ------------------------------------------------------------------ layoutlang's side


def placed(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's storages, each box written where layoutlang places it."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            region = out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()]
            (region.transpose(-1, -2) if box.transposed else region).copy_(full[name][box.slices()])
    return out


def check_against_vllm(path: Path, cfg: dict, tp: int, replicas: int = 1) -> None:
    program = layoutlang.load(path)
    layout = program.layout("vllm_fused")
    layout.check()
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}
    want_shapes = vllm_parameters(cfg, tp)
    assert len(layout.mesh.ranks) == tp * replicas
    for rank in layout.mesh.ranks:
        tp_rank = rank % tp
        assert layout.storages_on(rank) == want_shapes, rank
        got = placed(layout, rank, full)
        for layer in range(cfg["num_hidden_layers"]):
            for storage, want in vllm_loaded(full, cfg, tp, tp_rank, layer).items():
                assert torch.equal(got[storage], want), (rank, storage)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_fused_holds_deepseek_v3s_parameters_on_every_rank(tmp_path, tp):
    path = write_program(tmp_path, f"mesh infer [tp = {tp}]", CONFIG)
    assert main(["check", str(path)]) == 0
    check_against_vllm(path, CONFIG, tp)


@pytest.mark.parametrize("tp", [1, 4])
def test_vllm_fused_no_q_lora_keeps_q_proj_and_kv_a_proj_apart(tmp_path, tp):
    path = write_program(tmp_path, f"mesh infer [tp = {tp}]", NO_Q_LORA)
    assert main(["check", str(path)]) == 0
    check_against_vllm(path, NO_Q_LORA, tp)


def test_vllm_fused_names_the_missing_q_a_proj_without_q_lora_rank(tmp_path):
    path = write_program(tmp_path, "mesh infer [tp = 2]", NO_Q_LORA)
    path.write_text(path.read_text().replace("vllm_fused_no_q_lora", "vllm_fused"))
    assert main(["check", str(path)]) == 2
    with pytest.raises(layoutlang.LayoutError, match="q_a_proj") as err:
        layoutlang.load(path).layout("vllm_fused").storages_on(0)
    assert "vllm_fused.layout:" in str(err.value) and "serve.layout:3" in str(err.value)


def test_other_axes_of_vllm_fused_are_independent_instances(tmp_path):
    path = write_program(tmp_path, "mesh infer [dp = 2, tp = 2]", CONFIG)
    check_against_vllm(path, CONFIG, 2, replicas=2)


def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq(tmp_path):
    config = CONFIG | {"num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    path = write_program(tmp_path, "mesh infer [tp = 2]", config)
    storages = layoutlang.load(path).layout("vllm_fused").storages_on(0)
    assert [layer for layer in range(4) if f"model.layers.{layer}.mlp.experts.w13_weight" in storages] == [2]
    check_against_vllm(path, config, 2)
