"""Checkpoints that transformers writes, refit into vLLM's own parameters (preset:llama/vllm_fused,
preset:qwen2/vllm_fused, preset:qwen3_moe/vllm_fused_ep, preset:mixtral/vllm_fused and
vllm_fused_ep, preset:deepseek/vllm_fused and vllm_fused_ep).

Each model is built here from a tiny config with random weights (nothing downloaded) and
saved with ``save_pretrained``; the program imports it with ``tensors from hf``, and
``layoutlang apply PROGRAM --from CKPT --to OUT`` (local gloo workers, a subprocess) writes
every destination rank's storages. The oracle reads the checkpoint with the ``safetensors``
library and applies vLLM's loading rules, written out here from vLLM's code, not from
layoutlang's model:

- ``vllm/model_executor/models/llama.py``, ``qwen2.py``, ``qwen3_moe.py``, ``mixtral.py``: the
  parameters each ``*ForCausalLM`` holds (``named_parameters()``), with ``load_weights``'
  ``stacked_params_mapping`` (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``; Qwen2's
  q/k/v biases -> ``qkv_proj.bias``) and, with ``tie_word_embeddings``, no ``lm_head``.
  Mixtral has no q/k norms and no dense MLP: its MoE block is ``block_sparse_moe`` (router
  ``gate``), its experts ``w1`` (gate), ``w3`` (up), ``w2`` (down) loaded into the FusedMoE.
- ``vllm/model_executor/models/deepseek_v2.py`` (DeepSeek-V3): written out once in
  tests/vllm_rules.py (``deepseek_parameters``, ``deepseek_loaded``), shared with
  tests/test_deepseek_preset.py.
- ``vllm/model_executor/layers/linear.py``: ``QKVParallelLinear`` creates
  ``(heads / tp + 2 * max(1, kv_heads / tp)) * head_dim`` rows; its ``weight_loader`` puts
  q rows ``tp_rank * q_size`` and the k and v rows of kv head ``tp_rank // (tp / kv_heads)``
  (each kv head replicated on ``tp / kv_heads`` ranks when tp exceeds them), for the
  weight and the bias alike. ``MergedColumnParallelLinear`` loads each part's rows
  ``tp_rank * shard`` at its offset; ``RowParallelLinear`` narrows the input dim.
- ``vllm/model_executor/layers/vocab_parallel_embedding.py``: the vocabulary padded to a
  multiple of 64 and split evenly; ``weight_loader`` copies the rank's real rows and fills
  the padding with zeros.
- ``vllm/model_executor/layers/fused_moe/``: with expert parallelism the experts' TP is 1
  and EP spans dp x tp (EP rank ``dp_rank * tp + tp_rank``); ``determine_expert_map``
  (linear: contiguous, the first ``E % ep`` ranks one more); ``w13_weight``
  ``[local, 2 * I, H]`` (each expert ``[gate | up]``), ``w2_weight`` ``[local, H, I]``;
  without expert parallelism every expert, each cut by TP (``_load_w13``, ``_load_w2``).

Every written storage has the dtype the checkpoint stores its tensors in (transformers keeps
DeepSeek's router in fp32 in a bf16 checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_rules import deepseek_loaded, deepseek_parameters, expert_map, fused_moe, vocab_parallel

import layoutlang
from layoutlang.io.output import MANIFEST, read_manifest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]

_COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,  # padded to 128: 28 zero rows at the end
}

#: tiny configs in the arguments transformers' config classes take; Qwen2 ties its embeddings
#: as the small Qwen2.5 models do, and the MoE models have 6 experts so that 4 EP ranks hold
#: 2, 2, 1, 1; DeepSeek-V3 is tests/test_hf_checkpoints.py's, with 6 experts and vLLM's
#: topk_method (which transformers' config class does not keep unless given)
MODELS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "tie_word_embeddings": True},
    "qwen3_moe": {
        **_COMMON,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "tie_word_embeddings": False,
    },
    "mixtral": {**_COMMON, "num_local_experts": 6, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "deepseek_v3": {
        **_COMMON,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 6,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
    },
}

#: where each MoE family keeps its experts: the block, the expert count's key, the gate, up
#: and down projections' names, the expert intermediate size's key
MOE = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One bf16 checkpoint per model, written by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model_type, arguments in MODELS.items():
        config = transformers.AutoConfig.for_model(model_type, **arguments)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():  # Qwen2's biases start at zero: make them tell ranks apart
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_()
        model.save_pretrained(root / model_type)
        out[model_type] = root / model_type
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


# ---------------------------------------------------------------- vLLM's parameters


def head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def vllm_shapes(cfg: dict[str, Any], tp: int, local_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter vLLM's model creates on one rank (create_weights);
    ``local_experts``: the EP rank's expert count under expert parallelism."""
    if cfg["model_type"] == "deepseek_v3":
        return deepseek_parameters(cfg, tp, local_experts)
    hidden, heads, kv_heads, d = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        head_dim(cfg),
    )
    padded = -(-cfg["vocab_size"] // 64) * 64
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (padded // tp, hidden)}
    qkv_rows = (heads // tp + 2 * max(1, kv_heads // tp)) * d
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out[f"{p}.self_attn.qkv_proj.weight"] = (qkv_rows, hidden)
        if cfg["model_type"] == "qwen2":
            out[f"{p}.self_attn.qkv_proj.bias"] = (qkv_rows,)
        out[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * d // tp)
        if cfg["model_type"] == "qwen3_moe":
            out |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
        if cfg["model_type"] in MOE:
            # with expert parallelism the experts have no TP, the rank holds its local experts whole
            block, _, inter_key = MOE[cfg["model_type"]]
            inter, experts = cfg[inter_key], cfg["num_local_experts"]
            local, moe_tp = (experts, tp) if local_experts is None else (local_experts, 1)
            out |= {
                f"{p}.{block}.gate.weight": (experts, hidden),
                f"{p}.{block}.experts.routed_experts.w13_weight": (local, 2 * inter // moe_tp, hidden),
                f"{p}.{block}.experts.routed_experts.w2_weight": (local, hidden, inter // moe_tp),
            }
        else:
            inter = cfg["intermediate_size"]
            out[f"{p}.mlp.gate_up_proj.weight"] = (2 * inter // tp, hidden)
            out[f"{p}.mlp.down_proj.weight"] = (hidden, inter // tp)
        out[f"{p}.input_layernorm.weight"] = (hidden,)
        out[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (padded // tp, hidden)
    return out


def vllm_loaded(
    full: dict[str, torch.Tensor], cfg: dict[str, Any], tp: int, tp_rank: int, ep: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """What vLLM's weight loaders leave in every parameter of one rank; ep is (EP rank, EP size)."""
    experts = expert_map(ep[0], ep[1], num_experts(cfg)) if ep is not None else None
    if cfg["model_type"] == "deepseek_v3":
        return deepseek_loaded(full, cfg, tp, tp_rank, experts)
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    q_size, kv_size = heads // tp * d, max(1, kv_heads // tp) * d
    kv_rank = tp_rank // max(1, tp // kv_heads)
    out = {"model.embed_tokens.weight": vocab_parallel(full["model.embed_tokens.weight"], tp, tp_rank)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        kinds = ("weight", "bias") if f"{p}.self_attn.q_proj.bias" in full else ("weight",)
        for kind in kinds:  # QKVParallelLinear.weight_loader, the bias as the weight's rows
            out[f"{p}.self_attn.qkv_proj.{kind}"] = torch.cat(
                [
                    full[f"{p}.self_attn.q_proj.{kind}"].narrow(0, tp_rank * q_size, q_size),
                    full[f"{p}.self_attn.k_proj.{kind}"].narrow(0, kv_rank * kv_size, kv_size),
                    full[f"{p}.self_attn.v_proj.{kind}"].narrow(0, kv_rank * kv_size, kv_size),
                ]
            )
        o_proj = full[f"{p}.self_attn.o_proj.weight"]
        out[f"{p}.self_attn.o_proj.weight"] = o_proj.narrow(1, tp_rank * (o_proj.shape[1] // tp), o_proj.shape[1] // tp)
        if cfg["model_type"] in MOE:
            # FusedMoE: whole experts with expert parallelism, else every expert cut by TP
            block, projections, _ = MOE[cfg["model_type"]]
            x = f"{p}.{block}.experts"
            local, moe_tp, moe_rank = (experts, 1, 0) if experts is not None else (range(num_experts(cfg)), tp, tp_rank)
            names = [tuple(f"{x}.{e}.{w}.weight" for w in projections) for e in local]
            # vLLM 0.32: the stacked weights live in FusedMoE's routed_experts submodule
            out[f"{x}.routed_experts.w13_weight"], out[f"{x}.routed_experts.w2_weight"] = fused_moe(
                full, names, moe_tp, moe_rank, full[f"{x}.0.{projections[0]}.weight"]
            )
        else:  # MergedColumnParallelLinear and RowParallelLinear
            shard = cfg["intermediate_size"] // tp
            out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat(
                [
                    full[f"{p}.mlp.gate_proj.weight"].narrow(0, tp_rank * shard, shard),
                    full[f"{p}.mlp.up_proj.weight"].narrow(0, tp_rank * shard, shard),
                ]
            )
            out[f"{p}.mlp.down_proj.weight"] = full[f"{p}.mlp.down_proj.weight"].narrow(1, tp_rank * shard, shard)
    # everything else vLLM holds is replicated: the norms, q_norm, k_norm and the router
    out |= {name: t for name, t in full.items() if "norm" in name or name.endswith(".gate.weight")}
    if "lm_head.weight" in full:
        out["lm_head.weight"] = vocab_parallel(full["lm_head.weight"], tp, tp_rank)
    return out


def num_experts(cfg: dict[str, Any]) -> int:
    return cfg["n_routed_experts"] if cfg["model_type"] == "deepseek_v3" else cfg["num_local_experts"]


# ------------------------------------------------------------------ the programs

#: the presets the tests use: the lines that include vllm_fused, then those that add vllm_fused_ep
PRESETS = {
    "llama": (['include "preset:llama/vllm_fused"'], []),
    "qwen2": (['include "preset:qwen2/vllm_fused"'], []),
    # transformers 5 writes the expert count as num_local_experts
    "qwen3_moe": (
        ['include "preset:qwen3_moe/vllm_fused"'],
        ["let num_experts = cfg.num_local_experts", 'include "preset:qwen3_moe/vllm_fused_ep"'],
    ),
    "mixtral": (['include "preset:mixtral/vllm_fused"'], ['include "preset:mixtral/vllm_fused_ep"']),
    "deepseek_v3": (['include "preset:deepseek/vllm_fused"'], ['include "preset:deepseek/vllm_fused_ep"']),
}


def write_program(
    folder: Path, checkpoint: Path, model_type: str, lines: list[str], name: str, ep: bool = False
) -> Path:
    """The import, the first of ``lines`` (the destination mesh), the presets, the other lines."""
    fused, expert_parallel = PRESETS[model_type]
    presets = [*fused, *expert_parallel] if ep else fused
    path = folder / f"{name}.layout"
    path.write_text(
        "\n".join([f'tensors from hf "{checkpoint / "config.json"}" as cfg', *lines[:1], *presets, *lines[1:]]) + "\n"
    )
    return path


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_presets_hold_vllms_dense_parameters_on_every_rank(
    checkpoints: dict[str, Path], tmp_path: Path, model_type: str, tp: int
) -> None:
    # tp = 4 exceeds the 2 kv heads: each kv head on 2 ranks
    path = write_program(tmp_path, checkpoints[model_type], model_type, [f"mesh infer [dp = 2, tp = {tp}]"], "serve")
    layout = layoutlang.load(path).layout("vllm_fused")
    layout.check()
    cfg = config_of(checkpoints[model_type])
    for rank in layout.mesh.ranks:
        assert layout.storages_on(rank) == vllm_shapes(cfg, tp), rank


def apply(program: Path, checkpoint: Path, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", "apply", str(program), "--from", str(checkpoint), "--to", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("model_type", "source", "destination", "ep"),
    [
        # FSDP-style training (every tensor cut on dim 0) into TP 4, more ranks than kv heads
        pytest.param(
            "llama",
            ["mesh train [dp = 2] on ranks 0..1", "layout train on train { default: dp = shard(0) }"],
            "mesh infer [tp = 4] on ranks 2..5",
            False,
            id="llama-fsdp-to-tp4",
        ),
        # the checkpoint whole on one rank into two TP 2 instances; tied embeddings, q/k/v biases
        pytest.param(
            "qwen2",
            ["mesh train [r = 1] on ranks 0..0", "layout train on train { default: replicate }"],
            "mesh infer [dp = 2, tp = 2] on ranks 1..4",
            False,
            id="qwen2-replicated-to-dp2-tp2",
        ),
        # Megatron-style TP 2 into EP over dp x tp: 6 experts on 4 EP ranks (2, 2, 1, 1)
        pytest.param(
            "qwen3_moe",
            [
                "mesh train [tp = 2] on ranks 0..1",
                (
                    'layout train on train { "model.layers.{l}.mlp.experts.{e}.down_proj.weight": tp = shard(1) '
                    '"model.layers.{l}.self_attn.o_proj.weight": tp = shard(1) default: tp = shard(0) }'
                ),
            ],
            "mesh infer [dp = 2, tp = 2] on ranks 2..5",
            True,
            id="qwen3-moe-tp2-to-ep4",
        ),
        # Mixtral, FSDP-style into TP 2: every expert in w13_weight / w2_weight, cut by TP
        pytest.param(
            "mixtral",
            ["mesh train [dp = 2] on ranks 0..1", "layout train on train { default: dp = shard(0) }"],
            "mesh infer [tp = 2] on ranks 2..3",
            False,
            id="mixtral-fsdp-to-tp2",
        ),
        # Mixtral whole on one rank into EP over dp x tp: w1 | w3 and w2 of 2, 2, 1, 1 experts
        pytest.param(
            "mixtral",
            ["mesh train [r = 1] on ranks 0..0", "layout train on train { default: replicate }"],
            "mesh infer [dp = 2, tp = 2] on ranks 1..4",
            True,
            id="mixtral-replicated-to-ep4",
        ),
        # DeepSeek-V3 (fp32 router and bias in a bf16 checkpoint), FSDP-style into TP 2: the
        # fused_qkv_a_proj, the dense first layer, shared and routed experts cut by TP
        pytest.param(
            "deepseek_v3",
            ["mesh train [dp = 2] on ranks 0..1", "layout train on train { default: dp = shard(0) }"],
            "mesh infer [tp = 2] on ranks 2..3",
            False,
            id="deepseek-v3-fsdp-to-tp2",
        ),
        # DeepSeek-V3 cut on dim 1 over two ranks into EP 4 (dp 2 x tp 2): whole experts
        pytest.param(
            "deepseek_v3",
            [
                "mesh train [tp = 2] on ranks 0..1",
                (
                    'layout train on train { "model.layers.{l}.mlp.experts.{e}.*": tp = shard(1) '
                    "default: tp = shard(0) }"
                ),
            ],
            "mesh infer [dp = 2, tp = 2] on ranks 2..5",
            True,
            id="deepseek-v3-tp2-to-ep4",
        ),
    ],
)
def test_apply_refits_a_transformers_checkpoint_into_vllms_parameters(
    checkpoints: dict[str, Path], tmp_path: Path, model_type: str, source: list[str], destination: str, ep: bool
) -> None:
    checkpoint = checkpoints[model_type]
    name = "vllm_fused_ep" if ep else "vllm_fused"
    program = write_program(
        tmp_path, checkpoint, model_type, [destination, *source, f"reshard train -> {name}"], "refit", ep=ep
    )
    out = tmp_path / "out"
    apply(program, checkpoint, out)
    full = read_all(checkpoint / "model.safetensors")
    cfg = config_of(checkpoint)
    mesh = layoutlang.load(program).layout(name).mesh
    tp = mesh.shape[-1]
    written = sorted(p.name for p in out.iterdir())
    # the rank files, and the manifest naming them (what a later --overwrite may remove)
    assert written == [MANIFEST] + [f"rank{rank:05d}.safetensors" for rank in mesh.ranks]
    assert sorted(read_manifest(out)) == written[1:]
    for index, rank in enumerate(mesh.ranks):
        dp_rank, tp_rank = divmod(index, tp)
        ep_rank = (dp_rank * tp + tp_rank, len(mesh.ranks)) if ep else None
        want = vllm_loaded(full, cfg, tp, tp_rank, ep_rank)
        local = len(expert_map(*ep_rank, num_experts(cfg))) if ep_rank else None
        got = read_all(out / f"rank{rank:05d}.safetensors")
        assert {n: tuple(t.shape) for n, t in got.items()} == vllm_shapes(cfg, tp, local), rank
        assert got.keys() == want.keys(), rank
        for parameter, tensor in want.items():
            # the dtype the checkpoint stores (bf16, DeepSeek's router fp32), and its values
            assert got[parameter].dtype == tensor.dtype and torch.equal(got[parameter], tensor), (rank, parameter)
