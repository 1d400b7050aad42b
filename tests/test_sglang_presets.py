"""preset:deepseek/sglang_fused holds SGLang's real DeepSeek-V2/V3 parameters.

The oracle is written here from SGLang's code, not from layoutlang's model (nor from the vLLM
oracle of tests/test_deepseek_preset.py, although most rules are the same):

- ``python/sglang/srt/models/deepseek_v2.py``: ``DeepseekV2AttentionMLA`` holds, with
  ``q_lora_rank``, ``fused_qkv_a_proj_with_mqa`` (a ``ReplicatedLinear`` of
  ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` rows, whole on every rank, which
  ``load_weights`` fills with ``torch.cat([q_a_proj, kv_a_proj_with_mqa], dim=0)`` once both
  are read), ``q_a_layernorm``, ``q_b_proj`` (``ColumnParallelLinear``), ``kv_a_layernorm``,
  ``kv_b_proj`` (column-parallel), ``o_proj`` (``RowParallelLinear``). A layer is sparse when
  ``layer_id >= first_k_dense_replace`` and ``layer_id % moe_layer_freq == 0``; a sparse
  layer's ``DeepseekV2MoE`` holds ``gate`` (``MoEGate``: ``weight`` ``[E, H]``, and
  ``e_score_correction_bias`` ``[E]`` with ``noaux_tc``), ``shared_experts`` (a
  ``DeepseekV2MLP`` of ``moe_intermediate_size * n_shared_experts``: ``gate_up_proj``
  ``[gate_r | up_r]``, ``down_proj`` row-parallel) when the shared experts are not fused, and
  ``experts`` (a ``FusedMoE``); a dense layer a ``DeepseekV2MLP`` of ``intermediate_size``.
- ``python/sglang/srt/layers/moe/fused_moe_triton/layer.py``: ``FusedMoE`` without expert
  parallelism creates ``w13_weight`` ``[E, 2 * I / tp, H]`` and ``w2_weight`` ``[E, H, I /
  tp]``; ``_load_w13`` takes ``shard_size = expert_data.shape[0] // 2``, narrows the loaded
  ``w1`` / ``w3`` to rows ``[shard_size * tp_rank, + shard_size)`` and copies ``w1`` to
  rows ``[0, shard_size)`` and ``w3`` to ``[shard_size, 2 * shard_size)``; ``_load_w2``
  takes ``shard_size = expert_data.shape[1]`` and narrows the loaded ``w2`` along dim 1.
- ``python/sglang/srt/layers/vocab_parallel_embedding.py``: ``pad_vocab_size`` rounds the
  vocabulary up to a multiple of ``DEFAULT_VOCAB_PADDING_SIZE = 64``, and each tp rank holds
  an equal slice of the padded rows, the real ones first.

preset:qwen3_moe/sglang_fused_ep holds SGLang's Qwen3-MoE with ``--tp T --ep-size P``:

- ``python/sglang/srt/distributed/parallel_state.py``: ``moe_tp_size = T // P``; a MoE-TP
  group is ``T / P`` consecutive tp ranks, a MoE-EP group every ``(T / P)``-th one, so
  ``ep_rank = tp_rank // (T / P)`` and ``moe_tp_rank = tp_rank % (T / P)``.
- ``FusedMoE`` (layer.py above): ``num_local_experts = E // P``, ``expert_map_cpu`` maps experts
  ``ep_rank * E / P ..`` to local ids ``0 ..``, and ``_weight_loader_impl`` narrows at
  ``tp_rank = self.moe_tp_rank`` (``w1`` / ``w3`` along dim 0, ``w2`` along dim 1).
- ``python/sglang/srt/models/qwen3_moe.py``: ``qkv_proj`` (``QKVParallelLinear`` over the T
  ranks: ``num_kv_heads = max(1, kv_heads // T)``, rank r holding kv head ``r // (T /
  kv_heads)`` when T exceeds them), ``o_proj`` (row-parallel), ``q_norm``, ``k_norm``, the
  router ``mlp.gate`` (``ReplicatedLinear``) and the norms whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm_rules import TINY_DEEPSEEK_V3

import layoutlang
from layoutlang.cli.main import main

pytestmark = pytest.mark.timeout(120)

CONFIG = TINY_DEEPSEEK_V3


def write_program(tmp_path: Path, mesh: str, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "serve.layout"
    path.write_text(
        f'tensors from hf "config.json" as cfg dtype bf16\n{mesh}\n'
        'include "preset:deepseek/vllm_fused"\ninclude "preset:deepseek/sglang_fused"\n'
    )
    return path


# -------------------------------------------------------------- SGLang's parameters


def is_sparse(cfg: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer: a DeepseekV2MoE layer, or a dense DeepseekV2MLP."""
    return layer >= cfg["first_k_dense_replace"] and layer % cfg["moe_layer_freq"] == 0


def sglang_parameters(cfg: dict, tp: int) -> dict[str, tuple]:
    """Name and shape of every parameter SGLang's DeepseekV3ForCausalLM has on one tp rank
    (shared experts not fused, no data-parallel attention)."""
    hidden, heads, experts = cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    q_rank, kv_rank, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk_head = cfg["qk_nope_head_dim"] + rope
    moe_inter = cfg["moe_intermediate_size"]
    shared_inter = moe_inter * cfg["n_shared_experts"]
    padded = -(-cfg["vocab_size"] // 64) * 64  # pad_vocab_size
    out = {"model.embed_tokens.weight": (padded // tp, hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        out |= {
            f"{attn}.fused_qkv_a_proj_with_mqa.weight": (q_rank + kv_rank + rope, hidden),
            f"{attn}.q_a_layernorm.weight": (q_rank,),
            f"{attn}.q_b_proj.weight": (heads * qk_head // tp, q_rank),
            f"{attn}.kv_a_layernorm.weight": (kv_rank,),
            f"{attn}.kv_b_proj.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) // tp, kv_rank),
            f"{attn}.o_proj.weight": (hidden, heads * cfg["v_head_dim"] // tp),
        }
        if is_sparse(cfg, layer):
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
        out |= {
            f"model.layers.{layer}.input_layernorm.weight": (hidden,),
            f"model.layers.{layer}.post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (padded // tp, hidden)
    return out


def column(weight: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """ColumnParallelLinear.weight_loader: rows [tp_rank * shard, + shard)."""
    shard = weight.shape[0] // tp
    return weight.narrow(0, tp_rank * shard, shard)


def sglang_loaded(full: dict, cfg: dict, tp: int, tp_rank: int, layer: int) -> dict[str, torch.Tensor]:
    """What SGLang's load_weights leaves in one layer's fused, sharded and stacked parameters."""
    attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
    out = {
        # cached_a_proj: both parts read, then one copy of their concatenation, whole
        f"{attn}.fused_qkv_a_proj_with_mqa.weight": torch.cat(
            [full[f"{attn}.q_a_proj.weight"], full[f"{attn}.kv_a_proj_with_mqa.weight"]], dim=0
        ),
        f"{attn}.q_b_proj.weight": column(full[f"{attn}.q_b_proj.weight"], tp, tp_rank),
        f"{attn}.kv_b_proj.weight": column(full[f"{attn}.kv_b_proj.weight"], tp, tp_rank),
        f"{attn}.o_proj.weight": column(full[f"{attn}.o_proj.weight"].T, tp, tp_rank).T,  # RowParallelLinear
    }
    mlps = [f"{mlp}.shared_experts"] if is_sparse(cfg, layer) else [mlp]
    for m in mlps:
        # MergedColumnParallelLinear: gate (shard 0) then up (shard 1), each its tp slice
        gate, up = full[f"{m}.gate_proj.weight"], full[f"{m}.up_proj.weight"]
        out[f"{m}.gate_up_proj.weight"] = torch.cat([column(gate, tp, tp_rank), column(up, tp, tp_rank)])
        out[f"{m}.down_proj.weight"] = column(full[f"{m}.down_proj.weight"].T, tp, tp_rank).T
    if not is_sparse(cfg, layer):
        return out
    experts, hidden, inter = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    w13 = torch.full((experts, 2 * inter // tp, hidden), float("nan"))
    w2 = torch.full((experts, hidden, inter // tp), float("nan"))
    for e in range(experts):
        x = f"{mlp}.experts.{e}"
        # FusedMoE._load_w13, shard_dim 0: w1 (gate_proj) at 0, w3 (up_proj) at shard_size
        shard_size = w13[e].shape[0] // 2
        for start, name in ((0, "gate_proj"), (shard_size, "up_proj")):
            loaded = full[f"{x}.{name}.weight"].narrow(0, shard_size * tp_rank, shard_size)
            w13[e].narrow(0, start, shard_size).copy_(loaded)
        # FusedMoE._load_w2, shard_dim 1
        shard_size = w2[e].shape[1]
        w2[e].copy_(full[f"{x}.down_proj.weight"].narrow(1, shard_size * tp_rank, shard_size))
    out[f"{mlp}.experts.w13_weight"] = w13
    out[f"{mlp}.experts.w2_weight"] = w2
    return out


def vocab_rows(vocab: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """VocabParallelEmbedding._get_indices without added (LoRA) rows: the rank's real rows."""
    per_rank = -(-vocab // 64) * 64 // tp
    return min(tp_rank * per_rank, vocab), min((tp_rank + 1) * per_rank, vocab)


# ------------------------------------------------------------------ layoutlang's side


def placed(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's storages, each box written where layoutlang places it (NaN elsewhere)."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            region = out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()]
            (region.transpose(-1, -2) if box.transposed else region).copy_(full[name][box.slices()])
    return out


def check_against_sglang(path: Path, cfg: dict, tp: int, replicas: int = 1) -> None:
    program = layoutlang.load(path)
    layout = program.layout("sglang_fused")
    layout.check()
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}
    want_shapes = sglang_parameters(cfg, tp)
    assert len(layout.mesh.ranks) == tp * replicas
    for rank in layout.mesh.ranks:
        tp_rank = rank % tp
        assert layout.storages_on(rank) == want_shapes, rank
        got = placed(layout, rank, full)
        for layer in range(cfg["num_hidden_layers"]):
            for storage, want in sglang_loaded(full, cfg, tp, tp_rank, layer).items():
                assert torch.equal(got[storage], want), (rank, storage)
        start, end = vocab_rows(cfg["vocab_size"], tp, tp_rank)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[name][: end - start], full[name][start:end]), (rank, name)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sglang_fused_holds_sglangs_deepseek_parameters_on_every_rank(tmp_path, tp):
    path = write_program(tmp_path, f"mesh infer [tp = {tp}]", CONFIG)
    assert main(["check", str(path)]) == 0
    check_against_sglang(path, CONFIG, tp)


def test_other_axes_of_sglang_fused_are_independent_instances(tmp_path):
    path = write_program(tmp_path, "mesh infer [dp = 2, tp = 2]", CONFIG)
    check_against_sglang(path, CONFIG, 2, replicas=2)


#: SGLang's name -> vLLM 0.32's, where they differ: the fused a-projection, and the stacked
#: expert weights, which vLLM keeps in FusedMoE's routed_experts submodule
SGLANG_TO_VLLM = {
    "fused_qkv_a_proj_with_mqa": "fused_qkv_a_proj",
    "experts.w13_weight": "experts.routed_experts.w13_weight",
    "experts.w2_weight": "experts.routed_experts.w2_weight",
}


def vllm_name(name: str) -> str:
    for sglang, vllm in SGLANG_TO_VLLM.items():
        name = name.replace(sglang, vllm)
    return name


def test_sglang_differs_from_vllm_only_in_the_fused_a_projection_and_the_experts_module(tmp_path):
    """The names SGLang and vLLM spell differently, and the same shapes under them."""
    program = layoutlang.load(write_program(tmp_path, "mesh infer [tp = 2]", CONFIG))
    sglang, vllm = program.layout("sglang_fused"), program.layout("vllm_fused")
    for rank in sglang.mesh.ranks:
        mine, theirs = sglang.storages_on(rank), vllm.storages_on(rank)
        assert {vllm_name(n): s for n, s in mine.items()} == theirs
        moe_layers = [layer for layer in range(3) if f"model.layers.{layer}.mlp.experts.w13_weight" in mine]
        assert moe_layers == [1, 2]  # first_k_dense_replace = 1
        assert sorted(set(mine) - set(theirs)) == sorted(
            [f"model.layers.{layer}.self_attn.fused_qkv_a_proj_with_mqa.weight" for layer in range(3)]
            + [f"model.layers.{layer}.mlp.experts.{w}_weight" for layer in moe_layers for w in ("w13", "w2")]
        )


def test_a_refit_from_vllm_into_sglang_moves_nothing_but_local_copies(tmp_path):
    """Colocated on the same ranks, vLLM's and SGLang's layouts hold the same boxes: a plan
    between them copies every byte locally (into other storage names) and sends nothing."""
    path = write_program(tmp_path, "mesh infer [tp = 2]", CONFIG)
    path.write_text(path.read_text() + "reshard vllm_fused -> sglang_fused\n")
    plan = layoutlang.compile_plan(layoutlang.load(path))
    plan.validate()
    assert plan.stats.bytes["network"] == plan.stats.bytes["domain"] == 0
    assert plan.stats.bytes["local"] > 0


# ------------------------------------------------------- Qwen3-MoE with --ep-size

#: a tiny Qwen3-MoE: 2 layers of 8 experts, 4 query heads and 2 kv heads of dim 8
QWEN3_MOE = {
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


def write_qwen3_program(tmp_path: Path, mesh: str, *includes: str) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    path = tmp_path / "serve.layout"
    lines = ['tensors from hf "config.json" as cfg dtype bf16', mesh, "let num_experts = cfg.num_experts"]
    path.write_text("\n".join([*lines, *(f'include "preset:{name}"' for name in includes)]) + "\n")
    return path


def sglang_ep_parameters(cfg: dict, tp: int, ep: int) -> dict[str, tuple]:
    """Name and shape of every parameter SGLang's Qwen3MoeForCausalLM has on one tp rank."""
    hidden, heads, kv_heads, d = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    experts, inter, moe_tp = cfg["num_experts"], cfg["moe_intermediate_size"], tp // ep
    padded = -(-cfg["vocab_size"] // 64) * 64
    qkv_rows = (heads // tp + 2 * max(1, kv_heads // tp)) * d
    out = {"model.embed_tokens.weight": (padded // tp, hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out |= {
            f"{p}.self_attn.qkv_proj.weight": (qkv_rows, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * d // tp),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.mlp.gate.weight": (experts, hidden),
            f"{p}.mlp.experts.w13_weight": (experts // ep, 2 * inter // moe_tp, hidden),
            f"{p}.mlp.experts.w2_weight": (experts // ep, hidden, inter // moe_tp),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (padded // tp, hidden)
    return out


def sglang_ep_loaded(full: dict, cfg: dict, tp: int, ep: int, tp_rank: int, layer: int) -> dict[str, torch.Tensor]:
    """What SGLang's loaders leave in one layer's qkv_proj, o_proj, w13_weight and w2_weight."""
    p = f"model.layers.{layer}"
    kv_heads, d = cfg["num_key_value_heads"], cfg["head_dim"]
    # QKVParallelLinear: q by tp rank; k and v by kv shard, tp_rank // replicas past the kv heads
    kv_shard = tp_rank // max(1, tp // kv_heads)
    kv_rows = max(1, kv_heads // tp) * d
    q = column(full[f"{p}.self_attn.q_proj.weight"], tp, tp_rank)
    k, v = (full[f"{p}.self_attn.{x}_proj.weight"].narrow(0, kv_shard * kv_rows, kv_rows) for x in "kv")
    out = {
        f"{p}.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
        f"{p}.self_attn.o_proj.weight": column(full[f"{p}.self_attn.o_proj.weight"].T, tp, tp_rank).T,
    }
    moe_tp = tp // ep
    ep_rank, moe_tp_rank = tp_rank // moe_tp, tp_rank % moe_tp  # parallel_state's groups
    local = cfg["num_experts"] // ep
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    w13 = torch.full((local, 2 * inter // moe_tp, hidden), float("nan"))
    w2 = torch.full((local, hidden, inter // moe_tp), float("nan"))
    for e in range(cfg["num_experts"]):
        if not ep_rank * local <= e < (ep_rank + 1) * local:
            continue  # expert_map_cpu[e] == -1: not loaded here
        j, x = e - ep_rank * local, f"{p}.mlp.experts.{e}"
        shard_size = w13[j].shape[0] // 2
        for start, name in ((0, "gate_proj"), (shard_size, "up_proj")):
            w13[j].narrow(0, start, shard_size).copy_(
                full[f"{x}.{name}.weight"].narrow(0, shard_size * moe_tp_rank, shard_size)
            )
        shard_size = w2[j].shape[1]
        w2[j].copy_(full[f"{x}.down_proj.weight"].narrow(1, shard_size * moe_tp_rank, shard_size))
    out[f"{p}.mlp.experts.w13_weight"] = w13
    out[f"{p}.mlp.experts.w2_weight"] = w2
    return out


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_sglang_fused_ep_holds_sglangs_qwen3_moe_parameters_on_every_rank(tmp_path, tp, ep):
    """EP groups of tp / ep expert-tensor-parallel ranks; kv heads cut (tp 2) and replicated
    (tp 4, over ep 1, 2 and 4 groups)."""
    path = write_qwen3_program(tmp_path, f"mesh infer [ep = {ep}, moe_tp = {tp // ep}]", "qwen3_moe/sglang_fused_ep")
    assert main(["check", str(path)]) == 0
    program = layoutlang.load(path)
    layout = program.layout("sglang_fused_ep")
    layout.check()
    gen = torch.Generator().manual_seed(1)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}
    want_shapes = sglang_ep_parameters(QWEN3_MOE, tp, ep)
    for tp_rank in layout.mesh.ranks:  # the mesh is row-major [ep, moe_tp]: rank == tp_rank
        assert layout.storages_on(tp_rank) == want_shapes, tp_rank
        got = placed(layout, tp_rank, full)
        for layer in range(QWEN3_MOE["num_hidden_layers"]):
            for storage, want in sglang_ep_loaded(full, QWEN3_MOE, tp, ep, tp_rank, layer).items():
                assert torch.equal(got[storage], want), (tp_rank, storage)
        start, end = vocab_rows(QWEN3_MOE["vocab_size"], tp, tp_rank)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[name][: end - start], full[name][start:end]), (tp_rank, name)


def test_sglang_fused_ep_with_ep_equal_to_tp_is_vllms_linear_expert_parallelism(tmp_path):
    """--ep-size T (experts whole, contiguous, dividing evenly) holds what vLLM holds with
    --enable-expert-parallel on one data-parallel rank: the same storages, every box at the
    same place."""
    program = layoutlang.load(
        write_qwen3_program(tmp_path, "mesh infer [ep = 4, moe_tp = 1]", "qwen3_moe/sglang_fused_ep")
    )
    (tmp_path / "vllm").mkdir()
    vllm_path = write_qwen3_program(
        tmp_path / "vllm", "mesh infer [dp = 1, tp = 4]", "qwen3_moe/vllm_fused", "qwen3_moe/vllm_fused_ep"
    )
    sglang, vllm = program.layout("sglang_fused_ep"), layoutlang.load(vllm_path).layout("vllm_fused_ep")
    for rank in range(4):
        assert {vllm_name(n): s for n, s in sglang.storages_on(rank).items()} == vllm.storages_on(rank)
        for name in sglang.tensors:
            places = [
                [(b.offsets, b.sizes, rename(b.storage), b.storage_offsets) for b in layout.boxes(name, rank)]
                for layout, rename in ((sglang, vllm_name), (vllm, str))
            ]
            assert places[0] == places[1], (rank, name)


def test_sglang_fused_ep_needs_experts_that_divide_the_ep_ranks(tmp_path, monkeypatch):
    """FusedMoE asserts num_experts % moe_ep_size == 0; 6 experts over 4 EP ranks are refused
    here too: the last experts fall past the last EP rank."""
    monkeypatch.setitem(QWEN3_MOE, "num_experts", 6)
    path = write_qwen3_program(tmp_path, "mesh infer [ep = 4, moe_tp = 1]", "qwen3_moe/sglang_fused_ep")
    with pytest.raises(layoutlang.LayoutError, match="sub-mesh index 4 is out of range for axis 'ep'") as err:
        layoutlang.load(path).layout("sglang_fused_ep").check()
    assert "experts.4.gate_proj" in str(err.value) and "serve.layout:4" in str(err.value)
