"""Checkpoints as transformers writes them: ``tensors from hf`` against ``save_pretrained``.

Each family is built here from a tiny config with random weights (nothing downloaded) and
saved with ``save_pretrained``; the oracle is the checkpoint itself, read with the
``safetensors`` library's own ``safe_open`` (not layoutlang's header reader): every name,
shape and dtype the import declares must be the one stored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from layoutlang.errors import LayoutError
from layoutlang.lang import load, loads

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open

pytestmark = pytest.mark.timeout(120)

_COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}

#: tiny configs of each family, in the arguments transformers' config classes take
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON),
    "qwen2": dict(_COMMON),
    "qwen3_moe": {**_COMMON, "num_experts": 4, "moe_intermediate_size": 16, "num_experts_per_tok": 2, "head_dim": 8},
    "mixtral": {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        **_COMMON,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
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
    },
    # DeepSeek-V2-Lite's shape: no query low-rank projection, a softmax router without bias
    "deepseek_v2": {
        **_COMMON,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
    },
}

#: safetensors' dtype spellings, written out here rather than taken from layoutlang
_STORED_DTYPE = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One bf16 checkpoint per family, written by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model_type, arguments in FAMILIES.items():
        config = transformers.AutoConfig.for_model(model_type, **arguments)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(root / model_type)
        out[model_type] = root / model_type
    return out


def stored(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every tensor of a checkpoint, read by the safetensors library."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {
            name: (tuple(f.get_slice(name).get_shape()), _STORED_DTYPE[f.get_slice(name).get_dtype()])
            for name in f.keys()  # noqa: SIM118 (safe_open is no mapping)
        }


def imported(layout: str, folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    path = folder / "import.layout"
    path.write_text(layout, encoding="utf-8")
    program = load(path)
    return {name: (tuple(t.shape), t.dtype) for name, t in program.tensors.items()}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_import_is_the_checkpoint_tensor_by_tensor(checkpoints: dict[str, Path], model_type: str) -> None:
    folder = checkpoints[model_type]
    assert imported('tensors from hf "config.json" as cfg\n', folder) == stored(folder)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_config_alone_differs_only_where_transformers_keeps_fp32(
    checkpoints: dict[str, Path], model_type: str, tmp_path: Path
) -> None:
    # the config without its checkpoint: names and shapes from the config only
    shutil.copy(checkpoints[model_type] / "config.json", tmp_path / "config.json")
    from_config = imported('tensors from hf "config.json"\n', tmp_path)
    truth = stored(checkpoints[model_type])
    assert {name: shape for name, (shape, _) in from_config.items()} == {
        name: shape for name, (shape, _) in truth.items()
    }
    differ = {name: (from_config[name][1], truth[name][1]) for name in truth if from_config[name] != truth[name]}
    if model_type == "deepseek_v3":
        # transformers keeps DeepSeek-V3's router weight in fp32; the published checkpoint, which a
        # config alone describes, keeps it in bf16 (its e_score_correction_bias is fp32 in both)
        assert differ == {"model.layers.1.mlp.gate.weight": ("bf16", "fp32")}
        assert truth["model.layers.1.mlp.gate.e_score_correction_bias"] == ((4,), "fp32")
    elif model_type == "deepseek_v2":
        # the same fp32 router weight; V2's group_limited_greedy router has no correction bias
        assert differ == {"model.layers.1.mlp.gate.weight": ("bf16", "fp32")}
        assert not [name for name in truth if "e_score_correction_bias" in name]
    else:
        assert differ == {}


@pytest.mark.parametrize(
    ("topk_method", "biased"), [(None, False), ("greedy", False), ("group_limited_greedy", False), ("noaux_tc", True)]
)
def test_deepseek_v2_router_has_a_correction_bias_only_for_noaux_tc(
    checkpoints: dict[str, Path], tmp_path: Path, topk_method: str | None, biased: bool
) -> None:
    # vLLM's DeepseekV2MoE creates gate.e_score_correction_bias iff topk_method == "noaux_tc";
    # transformers' DeepseekV2Config defaults topk_method to "greedy"
    config = json.loads((checkpoints["deepseek_v2"] / "config.json").read_text())
    config.pop("topk_method")
    if topk_method is not None:
        config["topk_method"] = topk_method
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    names = imported('tensors from hf "config.json"\n', tmp_path)
    bias = {name: value for name, value in names.items() if name.endswith("e_score_correction_bias")}
    assert bias == ({"model.layers.1.mlp.gate.e_score_correction_bias": ((4,), "fp32")} if biased else {})


def test_qwen3_moe_config_of_transformers_5_says_num_local_experts(checkpoints: dict[str, Path]) -> None:
    config = json.loads((checkpoints["qwen3_moe"] / "config.json").read_text())
    assert config["num_local_experts"] == 4 and "num_experts" not in config
    names = imported('tensors from hf "config.json"\n', checkpoints["qwen3_moe"])
    assert sorted(n for n in names if n.startswith("model.layers.0.mlp.experts.") and n.endswith("up_proj.weight")) == [
        f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)
    ]


def test_qwen2_biases_are_stored_and_imported(checkpoints: dict[str, Path]) -> None:
    names = imported('tensors from hf "config.json"\n', checkpoints["qwen2"])
    truth = stored(checkpoints["qwen2"])
    for projection, rows in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        name = f"model.layers.1.self_attn.{projection}.bias"
        assert names[name] == truth[name] == ((rows,), "bf16")
    assert "model.layers.1.self_attn.o_proj.bias" not in truth


def test_dtype_clause_overrides_the_checkpoint(checkpoints: dict[str, Path]) -> None:
    names = imported('tensors from hf "config.json" dtype fp16\n', checkpoints["deepseek_v3"])
    assert {dtype for _, dtype in names.values()} == {"fp16"}
    assert {name: shape for name, (shape, _) in names.items()} == {
        name: shape for name, (shape, _) in stored(checkpoints["deepseek_v3"]).items()
    }


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_a_config_alone_with_the_routers_declared_fp32_is_what_save_pretrained_writes(
    checkpoints: dict[str, Path], model_type: str, tmp_path: Path
) -> None:
    # without the checkpoint, the body declares what transformers keeps in fp32: the router's
    # weight and (V3) its correction bias, over the dtype clause that gives bf16 to the rest
    shutil.copy(checkpoints[model_type] / "config.json", tmp_path / "config.json")
    text = 'tensors from hf "config.json" as cfg dtype bf16 {\n  "model.layers.{l}.mlp.gate.*": fp32\n}\n'
    assert imported(text, tmp_path) == stored(checkpoints[model_type])


def test_checkpoint_that_is_not_the_configs_model_is_an_error_at_the_path(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    # the Llama config beside the Mixtral checkpoint: same attention, but Mixtral's MLPs are experts
    shutil.copy(checkpoints["llama"] / "config.json", tmp_path / "config.json")
    shutil.copy(checkpoints["mixtral"] / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "bad.layout").write_text('\n  tensors from hf "config.json"\n', encoding="utf-8")
    with pytest.raises(LayoutError) as caught:
        load(tmp_path / "bad.layout")
    text = str(caught.value)
    assert "the config describes 6 tensors that the checkpoint" in text
    assert "'model.layers.0.mlp.gate_proj.weight'" in text
    assert caught.value.span is not None and (caught.value.span.line, caught.value.span.column) == (2, 19)


def test_shape_the_checkpoint_contradicts_is_an_error(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    shutil.copy(checkpoints["llama"] / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(LayoutError, match=r"gate_proj.weight' shape \[48, 32\], the checkpoint .* stores \[64, 32\]"):
        loads(f'tensors from hf "{tmp_path / "config.json"}"\n')


def test_constants_only_import(checkpoints: dict[str, Path]) -> None:
    folder = checkpoints["mixtral"]
    path = folder / "constants.layout"
    path.write_text(
        'tensors from hf_constants "config.json" as cfg\n'
        'tensor "experts.w13" [cfg.num_local_experts, 2 * cfg.intermediate_size, cfg.hidden_size] bf16\n',
        encoding="utf-8",
    )
    program = load(path)
    assert {name: tuple(t.shape) for name, t in program.tensors.items()} == {"experts.w13": (4, 128, 32)}


@pytest.mark.parametrize(
    ("statement", "fragment"),
    [
        ('tensors from hf_constants "config.json"', "needs 'as NAME'"),
        ('tensors from hf_constants "config.json" as cfg dtype bf16', "'dtype' has nothing to apply to"),
        ('tensors from hf_constants "missing.json" as cfg', "Hugging Face config not found"),
    ],
)
def test_constants_only_import_errors(checkpoints: dict[str, Path], statement: str, fragment: str) -> None:
    path = checkpoints["llama"] / "bad_constants.layout"
    path.write_text(statement + "\n", encoding="utf-8")
    with pytest.raises(LayoutError, match=fragment) as caught:
        load(path)
    assert caught.value.span is not None and caught.value.span.line == 1


def hub_snapshot(checkpoint: Path, root: Path, link: str | None = None) -> Path:
    """``checkpoint`` laid out as the Hugging Face hub cache keeps a download: the files in
    ``blobs/`` under their hashes, a snapshot folder of relative links to them, and an index
    naming the one shard (``link``: where the shard's link points instead, when given)."""
    repo = root / "models--tiny--llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "5f1a2b3c"
    snapshot.mkdir(parents=True)
    shard = "model-00001-of-00001.safetensors"
    index = {"metadata": {}, "weight_map": dict.fromkeys(stored(checkpoint), shard)}
    contents = {"config.json": (checkpoint / "config.json").read_bytes(), shard: b""}
    contents["model.safetensors.index.json"] = json.dumps(index).encode()
    for number, (name, data) in enumerate(contents.items()):
        blob = repo / "blobs" / f"{number:040x}"
        if name == shard:
            shutil.copy(checkpoint / "model.safetensors", blob)
        else:
            blob.write_bytes(data)
        (snapshot / name).symlink_to(link if name == shard and link else f"../../blobs/{blob.name}")
    return snapshot


def test_a_hub_cache_snapshot_reads_through_its_links(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    snapshot = hub_snapshot(checkpoints["llama"], tmp_path)
    assert imported('tensors from hf "config.json"\n', snapshot) == stored(checkpoints["llama"])


def test_an_index_whose_shard_links_out_of_the_folder_is_refused_unless_allowed(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from layoutlang.io.hf import tensors_from_hf_config

    # the shard's link leads to another folder's file: not the hub's blobs, not the folder
    snapshot = hub_snapshot(checkpoints["llama"], tmp_path, link=str(checkpoints["llama"] / "model.safetensors"))
    with pytest.raises(LayoutError) as caught:
        imported('tensors from hf "config.json"\n', snapshot)
    assert "model-00001-of-00001.safetensors" in str(caught.value) and "outside the folder" in str(caught.value)
    allowed = tensors_from_hf_config(snapshot, checkpoint=snapshot, allow_outside_paths=True)
    assert {name: (shape, dtype) for name, shape, dtype in allowed} == stored(checkpoints["llama"])
