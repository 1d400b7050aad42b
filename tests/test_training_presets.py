"""The training presets that are Megatron-core's and torchtitan's real parameters.

preset:llama/megatron_core, preset:qwen3_moe/megatron_core (TEGroupedMLP) and
megatron_core_grouped_mlp (legacy GroupedMLP), preset:qwen3_moe/torchtitan. The oracles are
written here from the frameworks' own rules, not from layoutlang's model:

- Megatron-core (``megatron/core/models/gpt/gpt_model.py``, ``transformer/transformer_block.py``,
  ``transformer/attention.py``, ``transformer/mlp.py``, ``transformer/moe/experts.py``,
  ``models/gpt/gpt_layer_specs.py``): a stage holds layers ``pp_rank * L / pp ...`` named from
  0; the full ``linear_qkv`` is the query groups one after the other, each ``[its q heads | k
  | v]``, and a TP rank holds its ``torch.chunk`` of that along dim 0; ``linear_fc1`` on a TP
  rank is ``[gate_r | up_r]``; row-parallel layers are chunked along dim 1; the vocabulary is
  padded to a multiple of ``128 * tp``; TE fuses the layer norms into ``linear_qkv`` /
  ``linear_fc1`` (``layer_norm_weight``), MoE layers keep ``pre_mlp_layernorm``;
  TEGroupedMLP holds ``linear_fc1.weight{i}`` per local expert, GroupedMLP ``weight1``
  ``[H, local * 2F / tp]`` used as ``view(local, H, -1)`` (each expert ``fc1.T``) and
  ``weight2`` ``[local * F / tp, H]`` used as ``view(local, -1, H)``.
- torchtitan (``models/qwen3/model/model.py``, ``models/moe/moe.py``,
  ``models/qwen3/infra/parallelize.py``, ``distributed/expert_parallel.py``,
  ``distributed/parallel_dims.py``) with FSDP2 (``fully_shard`` chunks dim 0 of the local
  tensor with ``torch.chunk``): TP chunks first, then FSDP2 chunks the TP-local tensor over
  dp_shard; the experts' stacks ``[E, ...]`` are chunked over ep on dim 0 (EP rank
  ``dp_rank % ep``), over tp on dim 1 (w1, w3) or 2 (w2), then over ``dp_shard / ep`` on dim 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import stacked_jobs
import torch
from test_engine_presets import CONFIG, QWEN3_MOE, placed, vllm_loaded, vllm_parameters

import layoutlang
from layoutlang.cli.main import main

pytestmark = pytest.mark.timeout(120)

#: a tiny Llama (4 layers, so that two stages hold two layers each)
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "intermediate_size": 24,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}


def write_program(tmp_path: Path, config: dict, mesh: str, *lines: str) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "train.layout"
    path.write_text("\n".join(['tensors from hf "config.json" as cfg dtype fp32', mesh, *lines]) + "\n")
    return path


def full_weights(program: layoutlang.Program) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, padding (NaN in both: neither writes it) included."""
    return got.shape == want.shape and torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))


def check(layout: layoutlang.Layout, full: dict, expected_by_rank: dict[int, dict[str, torch.Tensor]]) -> None:
    layout.check()
    assert sorted(expected_by_rank) == list(layout.mesh.ranks)
    for rank, expected in expected_by_rank.items():
        assert layout.storages_on(rank) == {n: tuple(t.shape) for n, t in expected.items()}, rank
        got = placed(layout, rank, full)
        for name, want in expected.items():
            assert same(got[name], want), (rank, name)


# ------------------------------------------------------------------ Megatron-core


def megatron_vocab(full: dict, name: str, vocab: int, tp: int, tp_rank: int) -> torch.Tensor:
    """VocabParallelEmbedding / the output layer: padded to a multiple of 128 x tp, chunked."""
    multiple = 128 * tp
    padded = torch.full((-(-vocab // multiple) * multiple, full[name].shape[1]), float("nan"))
    padded[:vocab] = full[name]
    return padded.chunk(tp)[tp_rank]


def megatron_qkv(full: dict, p: str, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """SelfAttention's full linear_qkv: per query group [its q heads | k | v]."""
    q, k, v = (full[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
    rows = heads // groups * head_dim
    return torch.cat(
        [
            torch.cat(
                [
                    q[g * rows : (g + 1) * rows],
                    k[g * head_dim : (g + 1) * head_dim],
                    v[g * head_dim : (g + 1) * head_dim],
                ]
            )
            for g in range(groups)
        ]
    )


def megatron_state(
    full: dict, cfg: dict, pp: int, ep: int, tp: int, pp_rank: int, ep_rank: int, tp_rank: int, experts: str | None
) -> dict[str, torch.Tensor]:
    """GPTModel.state_dict() on one rank: experts None (dense SwiGLU), "te" (TEGroupedMLP) or
    "grouped" (legacy GroupedMLP)."""
    hidden, heads, groups = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    per_stage = cfg["num_hidden_layers"] // pp
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = megatron_vocab(
            full, "model.embed_tokens.weight", cfg["vocab_size"], tp, tp_rank
        )
    for i in range(per_stage):
        p, d = f"model.layers.{pp_rank * per_stage + i}", f"decoder.layers.{i}"
        out[f"{d}.self_attention.linear_qkv.layer_norm_weight"] = full[f"{p}.input_layernorm.weight"]
        out[f"{d}.self_attention.linear_qkv.weight"] = megatron_qkv(full, p, heads, groups, head_dim).chunk(tp)[tp_rank]
        out[f"{d}.self_attention.linear_proj.weight"] = full[f"{p}.self_attn.o_proj.weight"].chunk(tp, 1)[tp_rank]
        if experts is None:
            out[f"{d}.mlp.linear_fc1.layer_norm_weight"] = full[f"{p}.post_attention_layernorm.weight"]
            gate, up = full[f"{p}.mlp.gate_proj.weight"], full[f"{p}.mlp.up_proj.weight"]
            out[f"{d}.mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
            out[f"{d}.mlp.linear_fc2.weight"] = full[f"{p}.mlp.down_proj.weight"].chunk(tp, 1)[tp_rank]
            continue
        out[f"{d}.self_attention.q_layernorm.weight"] = full[f"{p}.self_attn.q_norm.weight"]
        out[f"{d}.self_attention.k_layernorm.weight"] = full[f"{p}.self_attn.k_norm.weight"]
        out[f"{d}.pre_mlp_layernorm.weight"] = full[f"{p}.post_attention_layernorm.weight"]
        out[f"{d}.mlp.router.weight"] = full[f"{p}.mlp.gate.weight"]
        local = cfg["num_experts"] // ep
        fc1s, fc2s = [], []
        for j in range(local):
            x = f"{p}.mlp.experts.{ep_rank * local + j}"
            gate, up = full[f"{x}.gate_proj.weight"], full[f"{x}.up_proj.weight"]
            fc1s.append(torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]]))
            fc2s.append(full[f"{x}.down_proj.weight"].chunk(tp, 1)[tp_rank])
        if experts == "te":
            out |= {f"{d}.mlp.experts.linear_fc1.weight{j}": w for j, w in enumerate(fc1s)}
            out |= {f"{d}.mlp.experts.linear_fc2.weight{j}": w for j, w in enumerate(fc2s)}
        else:
            weight1 = torch.empty(hidden, local * fc1s[0].shape[0])
            weight2 = torch.empty(local * fc2s[0].shape[1], hidden)
            for j in range(local):
                weight1.view(local, hidden, -1)[j] = fc1s[j].T
                weight2.view(local, -1, hidden)[j] = fc2s[j].T
            out[f"{d}.mlp.experts.weight1"], out[f"{d}.mlp.experts.weight2"] = weight1, weight2
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
        out["output_layer.weight"] = megatron_vocab(full, "lm_head.weight", cfg["vocab_size"], tp, tp_rank)
    return out


def megatron_ranks(full, cfg, pp: int, ep: int, tp: int, experts: str | None) -> dict[int, dict]:
    """Every rank of mesh [pp, ep, tp] (row-major: tp fastest, Megatron's tp-ep-pp order)."""
    return {
        (a * ep + b) * tp + c: megatron_state(full, cfg, pp, ep, tp, a, b, c, experts)
        for a in range(pp)
        for b in range(ep)
        for c in range(tp)
    }


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 2), (4, 1), (1, 2)])
def test_llama_megatron_core_holds_gptmodels_state_dict(tmp_path, pp, tp):
    path = write_program(tmp_path, LLAMA, f"mesh train [pp = {pp}, tp = {tp}]", 'include "preset:llama/megatron_core"')
    assert main(["check", str(path)]) == 0
    program = layoutlang.load(path)
    full = full_weights(program)
    expected = {a * tp + c: megatron_state(full, LLAMA, pp, 1, tp, a, 0, c, None) for a in range(pp) for c in range(tp)}
    check(program.layout("megatron_core"), full, expected)


QWEN = "let num_experts = cfg.num_experts"


@pytest.mark.parametrize("experts", ["te", "grouped"])
@pytest.mark.parametrize(("pp", "ep", "tp"), [(1, 1, 1), (2, 2, 2), (1, 4, 1), (2, 1, 2)])
def test_qwen3_moe_megatron_core_holds_gptmodels_state_dict(tmp_path, pp, ep, tp, experts):
    mesh = f"mesh train [pp = {pp}, ep = {ep}, tp = {tp}]"
    path = write_program(tmp_path, CONFIG, mesh, QWEN, 'include "preset:qwen3_moe/megatron_core"')
    assert main(["check", str(path)]) == 0
    program = layoutlang.load(path)
    full = full_weights(program)
    name = "megatron_core" if experts == "te" else "megatron_core_grouped_mlp"
    check(program.layout(name), full, megatron_ranks(full, CONFIG, pp, ep, tp, experts))


def test_other_axes_of_megatron_core_replicate(tmp_path):
    mesh = "mesh train [dp = 2, pp = 2, ep = 2, tp = 1]"
    path = write_program(tmp_path, CONFIG, mesh, QWEN, 'include "preset:qwen3_moe/megatron_core"')
    layout = layoutlang.load(path).layout("megatron_core")
    assert all(layout.storages_on(r) == layout.storages_on(r + 4) for r in range(4))


# ---------------------------------------------------------------------- torchtitan


def titan_state(
    full: dict, cfg: dict, dp: int, ep: int, tp: int, dp_rank: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """named_parameters() of torchtitan's Qwen3 MoE on one rank, local tensors."""

    def fsdp(t: torch.Tensor, over: int, index: int) -> torch.Tensor:
        # fully_shard: FSDP2's _chunk_with_empty, torch.chunk of dim 0 padded with empty chunks
        chunks = list(t.chunk(over)) + [t.new_empty((0, *t.shape[1:]))] * over
        return chunks[index]

    def tp_then_fsdp(t: torch.Tensor, dim: int) -> torch.Tensor:
        return fsdp(t.chunk(tp, dim)[tp_rank], dp, dp_rank)

    ep_rank, edp_rank = dp_rank % ep, dp_rank // ep
    out = {
        "tok_embeddings.weight": tp_then_fsdp(full["model.embed_tokens.weight"], 0),
        "norm.weight": fsdp(full["model.norm.weight"], dp, dp_rank),
        "output.weight": tp_then_fsdp(full["lm_head.weight"], 0),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p, t = f"model.layers.{layer}", f"layers.{layer}"
        for ours, theirs in zip("qkvo", ["wq", "wk", "wv", "wo"], strict=True):
            out[f"{t}.attention.{theirs}.weight"] = tp_then_fsdp(
                full[f"{p}.self_attn.{ours}_proj.weight"], 1 if ours == "o" else 0
            )
        out[f"{t}.attention.q_norm.weight"] = fsdp(full[f"{p}.self_attn.q_norm.weight"], dp, dp_rank)
        out[f"{t}.attention.k_norm.weight"] = fsdp(full[f"{p}.self_attn.k_norm.weight"], dp, dp_rank)
        out[f"{t}.attention_norm.weight"] = fsdp(full[f"{p}.input_layernorm.weight"], dp, dp_rank)
        out[f"{t}.ffn_norm.weight"] = fsdp(full[f"{p}.post_attention_layernorm.weight"], dp, dp_rank)
        out[f"{t}.moe.router.gate.weight"] = fsdp(full[f"{p}.mlp.gate.weight"], dp, dp_rank)
        for name, hf, tp_dim in [("w1", "gate_proj", 1), ("w3", "up_proj", 1), ("w2", "down_proj", 2)]:
            stacked = torch.stack([full[f"{p}.mlp.experts.{e}.{hf}.weight"] for e in range(cfg["num_experts"])])
            local = stacked.chunk(ep)[ep_rank].chunk(tp, tp_dim)[tp_rank]  # ExpertTensorParallel
            out[f"{t}.moe.experts.{name}"] = fsdp(local, dp // ep, edp_rank)
    return out


def titan_program(tmp_path: Path, dp: int, tp: int, ep: int) -> Path:
    return write_program(
        tmp_path,
        CONFIG,
        f"mesh train [dp = {dp}, tp = {tp}]",
        QWEN,
        f"let titan_ep = {ep}",
        'include "preset:qwen3_moe/torchtitan"',
    )


@pytest.mark.parametrize(
    ("dp", "tp", "ep"),
    [(1, 1, 1), (4, 1, 1), (4, 2, 2), (2, 2, 2), (8, 1, 4), (8, 1, 8), (6, 1, 2)],
)
def test_qwen3_moe_torchtitan_holds_its_fsdp2_tp_ep_parameters(tmp_path, dp, tp, ep):
    # (6, 1, 2): the 4 experts of an EP rank over 3 FSDP2 ranks, torch.chunk's uneven 2, 2, 0
    path = titan_program(tmp_path, dp, tp, ep)
    assert main(["check", str(path)]) == 0
    program = layoutlang.load(path)
    full = full_weights(program)
    expected = {d * tp + c: titan_state(full, CONFIG, dp, ep, tp, d, c) for d in range(dp) for c in range(tp)}
    # FSDP2 gives a rank with no expert an empty [0, ...] stack, and so does layoutlang
    empty = {(r, n) for r, ts in expected.items() for n, t in ts.items() if ".moe.experts." in n and t.shape[0] == 0}
    assert bool(empty) == ((dp, ep) == (6, 2))
    check(program.layout("torchtitan"), full, expected)


# ------------------------------------------------------------------------- refit


@pytest.mark.timeout(120)
@pytest.mark.workers(6)
def test_a_refit_from_megatron_core_into_vllm_fused_is_bit_exact(tmp_path, pool):
    """Megatron-core's GPTModel (pp = 2 x ep = 2, ranks 0-3, TEGroupedMLP) into vLLM's
    Qwen3-MoE (tp = 2, ranks 4-5): the sources are Megatron's state dicts computed by its rules,
    the destinations are checked against vLLM's weight loaders."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    text = f"""tensors from hf "{tmp_path / "config.json"}" as cfg dtype fp32
mesh train [pp = 2, ep = 2, tp = 1] on ranks 0..3
mesh infer [tp = 2] on ranks 4..5
{QWEN}
include "preset:qwen3_moe/megatron_core"
include "preset:qwen3_moe/vllm_fused"
reshard megatron_core -> vllm_fused
"""
    program = layoutlang.loads(text, path=str(tmp_path / "refit.layout"))
    full = full_weights(program)
    # the padding rows of the vocabulary are zero in Megatron's buffers
    sources = {
        rank: {name: t.nan_to_num(0.0) for name, t in state.items()}
        for rank, state in megatron_ranks(full, CONFIG, 2, 2, 1, "te").items()
    }
    results = [r for r in pool.run(stacked_jobs.refit_given, text, list(range(6)), sources) if r]
    assert [r["rank"] for r in results] == list(range(6))
    for result in results[4:]:
        tp_rank = result["rank"] - 4
        got = result["destinations"]
        assert {n: tuple(t.shape) for n, t in got.items()} == vllm_parameters(CONFIG, 1, 0, 2, tp_rank, None)
        assert result["completed"] == sorted(got)
        for layer in range(CONFIG["num_hidden_layers"]):
            for name, want in vllm_loaded(full, CONFIG, 1, 0, 2, tp_rank, None, layer, QWEN3_MOE).items():
                assert torch.equal(got[name], want), (result["rank"], name)
            o_proj = f"model.layers.{layer}.self_attn.o_proj.weight"
            assert torch.equal(got[o_proj], full[o_proj].chunk(2, 1)[tp_rank])
        embed = got["model.embed_tokens.weight"]  # [128 / 2, H]: vLLM pads the 100 rows to 128
        rows = full["model.embed_tokens.weight"][tp_rank * 64 : (tp_rank + 1) * 64]
        assert torch.equal(embed[: len(rows)], rows) and not embed[len(rows) :].any()
