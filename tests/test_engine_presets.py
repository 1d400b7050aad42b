"""The engine presets that are vLLM's real parameters (preset:qwen3_moe/vllm_fused, vllm_fused_ep).

The oracle is written here from vLLM's code, not from layoutlang's model:

- ``vllm/model_executor/models/qwen3_moe.py``: the parameters ``Qwen3MoeForCausalLM`` holds
  (``model.embed_tokens``, per layer ``self_attn.qkv_proj`` / ``o_proj`` / ``q_norm`` /
  ``k_norm``, ``mlp.gate`` (a ``ReplicatedLinear`` router) and ``mlp.experts`` (a
  ``FusedMoE``), the two layer norms; ``model.norm``; ``lm_head`` unless tied), with
  ``load_weights``' ``stacked_params_mapping`` (q/k/v -> ``qkv_proj``) and expert mapping
  (``experts.{e}.gate_proj``/``up_proj`` -> ``w13_weight``, ``down_proj`` -> ``w2_weight``).
- ``vllm/model_executor/layers/linear.py``: ``QKVParallelLinear`` holds ``heads / tp`` query
  heads and ``max(1, kv_heads / tp)`` kv heads; its weight_loader puts q rows
  ``tp_rank * q_size``, and k and v rows of kv head ``tp_rank // (tp / kv_heads)`` (when
  tp exceeds the kv heads), at ``[q | k | v]``. ``RowParallelLinear`` splits the input dim.
- ``vllm/model_executor/layers/vocab_parallel_embedding.py``: the vocabulary padded to a
  multiple of 64, then split evenly.
- ``vllm/model_executor/layers/fused_moe/``: ``FusedMoEParallelConfig.make`` (with expert
  parallelism the experts' TP is 1 and EP spans dp x tp, EP rank ``dp_rank * tp +
  tp_rank``), ``determine_expert_map`` (linear: contiguous, the first ``E % ep`` ranks one
  more; round_robin: ``e % ep``), ``create_weights`` (``w13_weight`` ``[local, 2 * I / tp,
  H]``, ``w2_weight`` ``[local, H, I / tp]``), ``_load_w13`` and ``_load_w2``.
- ``vllm/model_executor/models/mixtral.py`` (preset:mixtral/...): as Qwen3-MoE without
  q_norm / k_norm, the MoE block named ``block_sparse_moe`` and its experts ``w1`` (gate),
  ``w3`` (up), ``w2`` (down) (``make_expert_params_mapping(ckpt_gate_proj_name="w1", ...)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm_rules import expert_map

import layoutlang
from layoutlang.cli.main import main

pytestmark = pytest.mark.timeout(120)

#: a tiny Qwen3-MoE config (transformers 4 spelling, num_experts), 2 layers of 8 experts (so
#: that 4 EP ranks hold different experts under linear and round-robin placement)
CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 100,
    "intermediate_size": 24,
    "moe_intermediate_size": 12,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}


#: a tiny Mixtral config (no head_dim: hidden / heads), 2 layers of 8 experts
MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "intermediate_size": 12,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class Family:
    """What differs between the vLLM models: names of the MoE block, its experts, the norms."""

    preset: str
    moe: str  # the sparse block's module name
    gate: str  # the checkpoint's expert tensors that vLLM loads as w1, w3 and w2
    up: str
    down: str
    qk_norm: bool
    intermediate: str  # the config key of an expert's intermediate size

    def experts(self, cfg: dict) -> int:
        return cfg.get("num_experts", cfg.get("num_local_experts"))

    def head_dim(self, cfg: dict) -> int:
        return cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])


QWEN3_MOE = Family("qwen3_moe", "mlp", "gate_proj", "up_proj", "down_proj", True, "moe_intermediate_size")
MIXTRAL_FAMILY = Family("mixtral", "block_sparse_moe", "w1", "w3", "w2", False, "intermediate_size")


def write_program(
    tmp_path: Path, mesh: str, config: dict | None = None, ep: bool = False, family: Family = QWEN3_MOE
) -> Path:
    """A program with the tiny config and the preset(s), as a user writes it."""
    config = CONFIG if config is None else config
    (tmp_path / "config.json").write_text(json.dumps(config))
    lines = ['tensors from hf "config.json" as cfg dtype bf16', mesh, f'include "preset:{family.preset}/vllm_fused"']
    if ep and family is QWEN3_MOE:
        experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
        lines.append(f"let num_experts = cfg.{experts_key}")
    if ep:
        lines.append(f'include "preset:{family.preset}/vllm_fused_ep"')
    path = tmp_path / "serve.layout"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- vLLM's parameters


def vllm_parameters(
    cfg: dict, dp: int, dp_rank: int, tp: int, tp_rank: int, ep: str | None, family: Family = QWEN3_MOE
) -> dict[str, tuple]:
    """Name and shape of every parameter Qwen3MoeForCausalLM (MixtralForCausalLM) creates on one rank."""
    hidden, heads, head_dim = cfg["hidden_size"], cfg["num_attention_heads"], family.head_dim(cfg)
    kv_heads = cfg["num_key_value_heads"]
    experts = family.experts(cfg)
    inter = cfg[family.intermediate]
    padded = -(-cfg["vocab_size"] // 64) * 64
    # FusedMoEParallelConfig.make: EP over the flattened dp x tp ranks, or TP inside the experts
    if ep is None:
        moe_tp, local = tp, experts
    else:
        moe_tp, local = 1, len(expert_map(dp_rank * tp + tp_rank, dp * tp, experts, ep))
    out = {"model.embed_tokens.weight": (padded // tp, hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        p, moe = f"model.layers.{layer}", f"model.layers.{layer}.{family.moe}"
        out |= {
            f"{p}.self_attn.qkv_proj.weight": ((heads // tp + 2 * max(1, kv_heads // tp)) * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim // tp),
        }
        if family.qk_norm:
            out |= {f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,)}
        out |= {
            f"{moe}.gate.weight": (experts, hidden),
            f"{moe}.experts.routed_experts.w13_weight": (local, 2 * inter // moe_tp, hidden),
            f"{moe}.experts.routed_experts.w2_weight": (local, hidden, inter // moe_tp),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (padded // tp, hidden)
    return out


def vllm_loaded(
    full: dict, cfg: dict, dp: int, dp_rank: int, tp: int, tp_rank: int, ep: str | None, layer: int, family: Family
) -> dict:
    """What vLLM's weight loaders leave in one layer's qkv_proj, w13_weight and w2_weight."""
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], family.head_dim(cfg)
    experts = family.experts(cfg)
    p, moe = f"model.layers.{layer}", f"model.layers.{layer}.{family.moe}"
    # QKVParallelLinear.weight_loader
    q_size, kv_size = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    kv_rank = tp_rank // max(1, tp // kv_heads)
    qkv = torch.cat(
        [
            full[f"{p}.self_attn.q_proj.weight"].narrow(0, tp_rank * q_size, q_size),
            full[f"{p}.self_attn.k_proj.weight"].narrow(0, kv_rank * kv_size, kv_size),
            full[f"{p}.self_attn.v_proj.weight"].narrow(0, kv_rank * kv_size, kv_size),
        ]
    )
    # FusedMoE: _load_w13 narrows gate and up along dim 0, _load_w2 narrows down along dim 1
    if ep is None:
        moe_tp, moe_rank, local = tp, tp_rank, list(range(experts))
    else:
        moe_tp, moe_rank, local = 1, 0, expert_map(dp_rank * tp + tp_rank, dp * tp, experts, ep)
    shard = cfg[family.intermediate] // moe_tp
    w13 = torch.empty(len(local), 2 * shard, cfg["hidden_size"])
    w2 = torch.empty(len(local), cfg["hidden_size"], shard)
    for i, e in enumerate(local):
        x = f"{moe}.experts.{e}"
        w13[i, :shard] = full[f"{x}.{family.gate}.weight"].narrow(0, moe_rank * shard, shard)
        w13[i, shard:] = full[f"{x}.{family.up}.weight"].narrow(0, moe_rank * shard, shard)
        w2[i] = full[f"{x}.{family.down}.weight"].narrow(1, moe_rank * shard, shard)
    return {
        f"{p}.self_attn.qkv_proj.weight": qkv,
        f"{moe}.experts.routed_experts.w13_weight": w13,
        f"{moe}.experts.routed_experts.w2_weight": w2,
    }


# ------------------------------------------------------------------ layoutlang's side


def full_weights(program: layoutlang.Program) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}


def placed(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's storages, each box written where layoutlang places it."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            region = out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()]
            (region.transpose(-1, -2) if box.transposed else region).copy_(full[name][box.slices()])
    return out


def check_against_vllm(
    program, name: str, dp: int, tp: int, ep: str | None, cfg: dict, family: Family = QWEN3_MOE
) -> None:
    layout = program.layout(name)
    layout.check()
    full = full_weights(program)
    for rank in layout.mesh.ranks:
        dp_rank, tp_rank = divmod(rank, tp)
        assert layout.storages_on(rank) == vllm_parameters(cfg, dp, dp_rank, tp, tp_rank, ep, family), rank
        got = placed(layout, rank, full)
        for layer in range(cfg["num_hidden_layers"]):
            for storage, want in vllm_loaded(full, cfg, dp, dp_rank, tp, tp_rank, ep, layer, family).items():
                assert torch.equal(got[storage], want), (rank, storage)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_fused_holds_qwen3_moes_parameters_on_every_rank(tmp_path, tp):
    # tp = 4 exceeds the 2 kv heads: each kv head on 2 ranks
    path = write_program(tmp_path, f"mesh infer [tp = {tp}]")
    assert main(["check", str(path)]) == 0
    check_against_vllm(layoutlang.load(path), "vllm_fused", 1, tp, None, CONFIG)


def test_vllm_fused_reads_a_transformers_5_config(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "num_experts"} | {"num_local_experts": 8}
    path = write_program(tmp_path, "mesh infer [tp = 2]", config)
    check_against_vllm(layoutlang.load(path), "vllm_fused", 1, 2, None, config)


def test_other_axes_of_vllm_fused_are_independent_instances(tmp_path):
    path = write_program(tmp_path, "mesh infer [replica = 2, tp = 2]")
    layout = layoutlang.load(path).layout("vllm_fused")
    assert layout.storages_on(1) == layout.storages_on(3) == vllm_parameters(CONFIG, 1, 0, 2, 1, None)


@pytest.mark.parametrize(
    ("dp", "tp", "strategy"),
    [
        pytest.param(1, 2, "linear", id="ep-over-tp"),
        pytest.param(2, 2, "linear", id="ep-over-dp-x-tp"),
        pytest.param(3, 1, "linear", id="uneven"),
        pytest.param(2, 2, "round_robin", id="round-robin"),
        pytest.param(3, 1, "round_robin", id="round-robin-uneven"),
    ],
)
def test_vllm_fused_ep_places_experts_as_determine_expert_map(tmp_path, dp, tp, strategy):
    path = write_program(tmp_path, f"mesh infer [dp = {dp}, tp = {tp}]", ep=True)
    assert main(["check", str(path)]) == 0
    name = "vllm_fused_ep" if strategy == "linear" else "vllm_fused_ep_round_robin"
    check_against_vllm(layoutlang.load(path), name, dp, tp, strategy, CONFIG)


def test_vllm_fused_ep_needs_the_expert_count(tmp_path):
    path = write_program(tmp_path, "mesh infer [dp = 1, tp = 2]", ep=True)
    path.write_text(path.read_text().replace("let num_experts = cfg.num_experts\n", ""))
    with pytest.raises(layoutlang.LayoutError, match="num_experts") as err:
        layoutlang.load(path)
    assert "vllm_fused_ep.layout" in str(err.value) and "serve.layout:" in str(err.value)


# ----------------------------------------------------------------------- Mixtral


@pytest.mark.parametrize(
    ("dp", "tp", "strategy"),
    [
        pytest.param(1, 1, None, id="single-rank"),
        pytest.param(1, 4, None, id="tp-over-kv-heads"),
        pytest.param(2, 2, "linear", id="ep-linear"),
        pytest.param(3, 1, "linear", id="ep-uneven"),
        pytest.param(2, 2, "round_robin", id="ep-round-robin"),
    ],
)
def test_mixtral_presets_hold_vllms_parameters(tmp_path, dp, tp, strategy):
    mesh = f"mesh infer [tp = {tp}]" if strategy is None else f"mesh infer [dp = {dp}, tp = {tp}]"
    path = write_program(tmp_path, mesh, MIXTRAL, ep=strategy is not None, family=MIXTRAL_FAMILY)
    assert main(["check", str(path)]) == 0
    name = {None: "vllm_fused", "linear": "vllm_fused_ep", "round_robin": "vllm_fused_ep_round_robin"}[strategy]
    check_against_vllm(layoutlang.load(path), name, dp, tp, strategy, MIXTRAL, MIXTRAL_FAMILY)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fewer_experts_than_ep_ranks_leave_the_last_ranks_empty(tmp_path, family):
    # 3 experts on 4 EP ranks: vLLM's determine_expert_map gives ranks 0..2 one expert each
    # and rank 3 none, whose w13_weight / w2_weight it creates with 0 experts
    config, spec = (
        (CONFIG | {"num_experts": 3}, QWEN3_MOE)
        if family == "qwen3_moe"
        else (
            MIXTRAL | {"num_local_experts": 3},
            MIXTRAL_FAMILY,
        )
    )
    path = write_program(tmp_path, "mesh infer [dp = 2, tp = 2]", config, ep=True, family=spec)
    assert main(["check", str(path)]) == 0
    check_against_vllm(layoutlang.load(path), "vllm_fused_ep", 2, 2, "linear", config, spec)
    storages = layoutlang.load(path).layout("vllm_fused_ep").storages_on(3)
    assert [shape[0] for name, shape in storages.items() if name.endswith("w13_weight")] == [0] * config[
        "num_hidden_layers"
    ]
