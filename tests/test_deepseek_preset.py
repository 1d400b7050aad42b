"""preset:deepseek/vllm_fused and vllm_fused_ep hold vLLM's real DeepSeek-V2/V3 parameters.

The oracle is vLLM's loading rules written out from vLLM's code in tests/vllm_rules.py (not
from layoutlang's model): ``vllm/model_executor/models/deepseek_v2.py`` (one file for V2 and
V3: MLA attention with ``fused_qkv_a_proj``, dense first layers, ``DeepseekV2MoE`` with its
router, ``e_score_correction_bias`` for ``noaux_tc``, tensor-parallel shared experts and a
``FusedMoE``), ``vllm/model_executor/layers/fused_moe/`` (``create_weights``, ``_load_w13``,
``_load_w2``; with expert parallelism ``FusedMoEParallelConfig.make``, experts' TP 1 and EP
over dp x tp, and ``determine_expert_map``) and
``vllm/model_executor/layers/vocab_parallel_embedding.py`` (vocabulary padded to 64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm_rules import TINY_DEEPSEEK_V3, deepseek_loaded, deepseek_parameters, expert_map

import layoutlang
from layoutlang.cli.main import main

pytestmark = pytest.mark.timeout(120)

CONFIG = TINY_DEEPSEEK_V3

#: DeepSeek-V2-Lite's shape of attention: no query low-rank projection
NO_Q_LORA = CONFIG | {"q_lora_rank": None}

#: DeepSeek-V2-Lite itself: model type deepseek_v2, a softmax router without correction bias
V2_LITE = NO_Q_LORA | {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy"}


def write_program(tmp_path: Path, mesh: str, config: dict, ep: bool = False) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    preset = "deepseek/vllm_fused" if config["q_lora_rank"] else "deepseek/vllm_fused_no_q_lora"
    ep_include = '\ninclude "preset:deepseek/vllm_fused_ep"' if ep else ""
    path = tmp_path / "serve.layout"
    path.write_text(f'tensors from hf "config.json" as cfg dtype bf16\n{mesh}\ninclude "preset:{preset}"{ep_include}\n')
    return path


# ------------------------------------------------------------------ layoutlang's side


def placed(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's storages, each box written where layoutlang places it."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            region = out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()]
            (region.transpose(-1, -2) if box.transposed else region).copy_(full[name][box.slices()])
    # what no box writes is the padding of the padded vocabulary, which the executor zeroes (a
    # real element left unwritten stays 0 and differs from its random value in the oracle)
    return {name: storage.nan_to_num(0.0) for name, storage in out.items()}


def check_against_vllm(
    path: Path, cfg: dict, tp: int, replicas: int = 1, name: str = "vllm_fused", strategy: str | None = None
) -> None:
    """Every rank's storages: vLLM's names and shapes, and the bytes its loaders write.

    ``strategy`` (expert parallelism): the experts placed by determine_expert_map over the
    dp x tp ranks, EP rank dp_rank * tp + tp_rank; ``replicas`` is then the dp size."""
    program = layoutlang.load(path)
    layout = program.layout(name)
    layout.check()
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}
    assert list(layout.mesh.ranks) == list(range(tp * replicas))
    for rank in layout.mesh.ranks:
        tp_rank = rank % tp
        experts = expert_map(rank, tp * replicas, cfg["n_routed_experts"], strategy) if strategy else None
        assert layout.storages_on(rank) == deepseek_parameters(cfg, tp, None if experts is None else len(experts)), rank
        got = placed(layout, rank, full)
        want = deepseek_loaded(full, cfg, tp, tp_rank, experts)
        assert got.keys() == want.keys(), rank
        for storage, tensor in want.items():
            assert torch.equal(got[storage], tensor), (rank, storage)


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
    stacked = [layer for layer in range(4) if f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight" in storages]
    assert stacked == [2]
    check_against_vllm(path, config, 2)


@pytest.mark.parametrize(
    ("dp", "tp", "experts", "strategy"),
    [
        pytest.param(2, 2, 8, "linear", id="ep4-linear"),
        # 7 experts on 3 EP ranks: 3, 2, 2; on 4 (tp 4): 0 4 / 1 5 / 2 6 / 3
        pytest.param(3, 1, 7, "linear", id="ep3-uneven"),
        pytest.param(1, 4, 7, "round_robin", id="ep4-tp4-round-robin-uneven"),
        pytest.param(2, 2, 8, "round_robin", id="ep4-round-robin"),
        # more EP ranks than experts: EP rank 3 holds none, vLLM's [0, 2 * I, H] and [0, H, I]
        pytest.param(2, 2, 3, "linear", id="ep4-three-experts"),
        pytest.param(2, 2, 3, "round_robin", id="ep4-three-experts-round-robin"),
    ],
)
def test_vllm_fused_ep_places_whole_experts_as_determine_expert_map(tmp_path, dp, tp, experts, strategy):
    config = CONFIG | {"n_routed_experts": experts}
    path = write_program(tmp_path, f"mesh infer [dp = {dp}, tp = {tp}]", config, ep=True)
    name = "vllm_fused_ep" if strategy == "linear" else "vllm_fused_ep_round_robin"
    assert main(["check", str(path)]) == 0
    check_against_vllm(path, config, tp, replicas=dp, name=name, strategy=strategy)


@pytest.mark.parametrize("ep", [False, True])
def test_the_presets_hold_deepseek_v2_lites_parameters_without_a_correction_bias(tmp_path, ep):
    path = write_program(tmp_path, "mesh infer [dp = 2, tp = 2]", V2_LITE, ep=ep)
    storages = layoutlang.load(path).layout("vllm_fused").storages_on(0)
    assert "model.layers.1.mlp.gate.weight" in storages
    assert not [name for name in storages if "e_score_correction_bias" in name]
    name, strategy = ("vllm_fused_ep", "linear") if ep else ("vllm_fused", None)
    check_against_vllm(path, V2_LITE, 2, replicas=2, name=name, strategy=strategy)


def test_vllm_fused_ep_without_q_lora_keeps_attention_as_vllm_fused_no_q_lora(tmp_path):
    path = write_program(tmp_path, "mesh infer [dp = 2, tp = 2]", NO_Q_LORA, ep=True)
    check_against_vllm(path, NO_Q_LORA, 2, replicas=2, name="vllm_fused_ep", strategy="linear")
