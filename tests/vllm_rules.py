"""vLLM's loading rules that several tests re-derive, written once (from vLLM's source, not
from layoutlang).

- ``expert_map`` is ``determine_expert_map`` of vllm/model_executor/layers/fused_moe/layer.py:
  linear placement gives each EP rank a contiguous range, the first ``experts % ep_size`` ranks
  one expert more (with more EP ranks than experts, ranks ``experts..`` hold none: their
  ``local_num_experts`` is 0 and ``create_weights`` makes ``[0, ...]`` parameters);
  ``round_robin`` gives rank r the experts r, r + ep_size, ...
- ``vocab_parallel`` is ``VocabParallelEmbedding.weight_loader``
  (vllm/model_executor/layers/vocab_parallel_embedding.py): the vocabulary padded to a multiple
  of 64 and split evenly; the rank's real rows, then zeros.
- ``merged_column`` is ``MergedColumnParallelLinear.weight_loader``
  (vllm/model_executor/layers/linear.py): each part narrowed to the rank's rows, concatenated.
- ``fused_moe`` is ``FusedMoE._load_w13`` / ``_load_w2``: per local expert, gate and up narrowed
  along dim 0 into the two halves of ``w13_weight[local]``, down narrowed along dim 1 into
  ``w2_weight[local]``; with expert parallelism the experts' TP is 1 (whole experts).
- ``deepseek_parameters`` / ``deepseek_loaded``: vllm/model_executor/models/deepseek_v2.py (one
  file for V2 and V3). ``DeepseekV2MLAAttention`` holds, with ``q_lora_rank``,
  ``fused_qkv_a_proj`` (``[q_a_proj | kv_a_proj_with_mqa]``, ``disable_tp``: whole on every
  rank), ``q_a_layernorm`` and ``q_b_proj`` (column-parallel); without it ``q_proj``
  (column-parallel) and ``kv_a_proj_with_mqa`` (replicated); then ``kv_a_layernorm``,
  ``kv_b_proj`` (column-parallel) and ``o_proj`` (row-parallel). ``DeepseekV2DecoderLayer``
  makes layer ``l`` a ``DeepseekV2MoE`` when ``l >= first_k_dense_replace`` and ``l %
  moe_layer_freq == 0``, else a dense ``DeepseekV2MLP`` (``gate_up_proj``, ``down_proj``).
  ``DeepseekV2MoE`` holds ``gate`` (replicated), ``gate.e_score_correction_bias`` only when
  ``topk_method == "noaux_tc"``, ``shared_experts`` (a tensor-parallel ``DeepseekV2MLP`` of
  ``moe_intermediate_size * n_shared_experts``) and ``experts`` (a ``FusedMoE``).
"""

from __future__ import annotations

from typing import Any

import torch

#: a tiny DeepSeek-V3: 3 layers, the first dense, 8 routed experts and 2 shared experts (so
#: that the shared MLP is twice an expert's width); the vLLM and SGLang preset tests share it
TINY_DEEPSEEK_V3 = {
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


def expert_map(ep_rank: int, ep_size: int, experts: int, strategy: str = "linear") -> list[int]:
    """The global experts of an EP rank, in local order."""
    if strategy == "round_robin":
        return list(range(ep_rank, experts, ep_size))
    base, remainder = divmod(experts, ep_size)
    count = base + (1 if ep_rank < remainder else 0)
    start = ep_rank * base + min(ep_rank, remainder)
    return list(range(start, start + count))


def padded_vocab(vocab: int) -> int:
    return -(-vocab // 64) * 64


def vocab_parallel(weight: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """VocabParallelEmbedding.weight_loader: the rank's real rows, then zeros up to its shard."""
    per = padded_vocab(weight.shape[0]) // tp
    start, end = tp_rank * per, min(weight.shape[0], (tp_rank + 1) * per)
    out = weight.new_zeros((per, *weight.shape[1:]))
    if end > start:
        out[: end - start] = weight[start:end]
    return out


def merged_column(parts: list[torch.Tensor], tp: int, tp_rank: int) -> torch.Tensor:
    """MergedColumnParallelLinear.weight_loader: each part narrowed along dim 0, concatenated."""
    return torch.cat([p.narrow(0, tp_rank * (p.shape[0] // tp), p.shape[0] // tp) for p in parts])


def row_parallel(weight: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """RowParallelLinear.weight_loader: the input dim narrowed."""
    shard = weight.shape[1] // tp
    return weight.narrow(1, tp_rank * shard, shard)


def fused_moe(
    full: dict[str, torch.Tensor], names: list[tuple[str, str, str]], tp: int, tp_rank: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13_weight and w2_weight after _load_w13 / _load_w2 of the local experts, given as
    (gate, up, down) checkpoint names in local order; ``like`` gives the trailing shapes and
    dtype when the rank holds no expert (an EP rank past the experts)."""
    inter, hidden = like.shape[0] // tp, like.shape[1]
    w13 = torch.empty((len(names), 2 * inter, hidden), dtype=like.dtype)
    w2 = torch.empty((len(names), hidden, inter), dtype=like.dtype)
    for local, (gate, up, down) in enumerate(names):
        w13[local, :inter] = full[gate].narrow(0, tp_rank * inter, inter)
        w13[local, inter:] = full[up].narrow(0, tp_rank * inter, inter)
        w2[local] = full[down].narrow(1, tp_rank * inter, inter)
    return w13, w2


# ------------------------------------------------------------------------------ DeepSeek


def deepseek_is_moe(cfg: dict[str, Any], layer: int) -> bool:
    """DeepseekV2DecoderLayer's choice between DeepseekV2MoE and a dense DeepseekV2MLP."""
    return layer >= cfg["first_k_dense_replace"] and layer % cfg.get("moe_layer_freq", 1) == 0


def deepseek_parameters(cfg: dict[str, Any], tp: int, local_experts: int | None = None) -> dict[str, tuple]:
    """Name and shape of every parameter DeepseekV2/V3ForCausalLM creates on one tp rank;
    ``local_experts`` (expert parallelism) the EP rank's expert count, the experts then whole."""
    hidden, heads, experts = cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    q_rank, kv_rank, rope = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk_head = cfg["qk_nope_head_dim"] + rope
    moe_inter, shared_inter = cfg["moe_intermediate_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    padded = padded_vocab(cfg["vocab_size"])
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
        if deepseek_is_moe(cfg, layer):
            local, moe_tp = (experts, tp) if local_experts is None else (local_experts, 1)
            out[f"{mlp}.gate.weight"] = (experts, hidden)
            if cfg.get("topk_method") == "noaux_tc":
                out[f"{mlp}.gate.e_score_correction_bias"] = (experts,)
            out |= {
                f"{mlp}.shared_experts.gate_up_proj.weight": (2 * shared_inter // tp, hidden),
                f"{mlp}.shared_experts.down_proj.weight": (hidden, shared_inter // tp),
                f"{mlp}.experts.routed_experts.w13_weight": (local, 2 * moe_inter // moe_tp, hidden),
                f"{mlp}.experts.routed_experts.w2_weight": (local, hidden, moe_inter // moe_tp),
            }
        else:
            out |= {
                f"{mlp}.gate_up_proj.weight": (2 * cfg["intermediate_size"] // tp, hidden),
                f"{mlp}.down_proj.weight": (hidden, cfg["intermediate_size"] // tp),
            }
        out |= {f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)}
    out["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (padded // tp, hidden)
    return out


def deepseek_loaded(
    full: dict[str, torch.Tensor], cfg: dict[str, Any], tp: int, tp_rank: int, experts: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """What vLLM's weight loaders leave in every parameter of one rank; ``experts`` (expert
    parallelism) the EP rank's global experts in local order, each then whole."""
    out = {"model.embed_tokens.weight": vocab_parallel(full["model.embed_tokens.weight"], tp, tp_rank)}
    for layer in range(cfg["num_hidden_layers"]):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        if cfg.get("q_lora_rank"):
            # disable_tp: the loader copies both parts whole, q_a at rows [0, q_lora_rank)
            out[f"{attn}.fused_qkv_a_proj.weight"] = torch.cat(
                [full[f"{attn}.q_a_proj.weight"], full[f"{attn}.kv_a_proj_with_mqa.weight"]]
            )
            out[f"{attn}.q_b_proj.weight"] = merged_column([full[f"{attn}.q_b_proj.weight"]], tp, tp_rank)
        else:
            out[f"{attn}.q_proj.weight"] = merged_column([full[f"{attn}.q_proj.weight"]], tp, tp_rank)
        out[f"{attn}.kv_b_proj.weight"] = merged_column([full[f"{attn}.kv_b_proj.weight"]], tp, tp_rank)
        out[f"{attn}.o_proj.weight"] = row_parallel(full[f"{attn}.o_proj.weight"], tp, tp_rank)
        if not deepseek_is_moe(cfg, layer):
            out[f"{mlp}.gate_up_proj.weight"] = merged_column(
                [full[f"{mlp}.gate_proj.weight"], full[f"{mlp}.up_proj.weight"]], tp, tp_rank
            )
            out[f"{mlp}.down_proj.weight"] = row_parallel(full[f"{mlp}.down_proj.weight"], tp, tp_rank)
            continue
        shared = f"{mlp}.shared_experts"
        out[f"{shared}.gate_up_proj.weight"] = merged_column(
            [full[f"{shared}.gate_proj.weight"], full[f"{shared}.up_proj.weight"]], tp, tp_rank
        )
        out[f"{shared}.down_proj.weight"] = row_parallel(full[f"{shared}.down_proj.weight"], tp, tp_rank)
        # without expert parallelism every expert, TP inside it; with it whole experts
        if experts is None:
            local, moe_tp, moe_rank = list(range(cfg["n_routed_experts"])), tp, tp_rank
        else:
            local, moe_tp, moe_rank = experts, 1, 0
        names = [tuple(f"{mlp}.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")) for e in local]
        out[f"{mlp}.experts.routed_experts.w13_weight"], out[f"{mlp}.experts.routed_experts.w2_weight"] = fused_moe(
            full, names, moe_tp, moe_rank, full[f"{mlp}.experts.0.gate_proj.weight"]
        )
    # the rest is whole on every rank: the norms, the router and (noaux_tc) its bias, and
    # kv_a_proj_with_mqa without q_lora_rank
    whole = ["norm", ".mlp.gate.weight"]
    whole += [".mlp.gate.e_score_correction_bias"] if cfg.get("topk_method") == "noaux_tc" else []
    whole += [] if cfg.get("q_lora_rank") else ["kv_a_proj_with_mqa"]
    out |= {name: t for name, t in full.items() if any(w in name for w in whole)}
    if "lm_head.weight" in full:
        out["lm_head.weight"] = vocab_parallel(full["lm_head.weight"], tp, tp_rank)
    return out
