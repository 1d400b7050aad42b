"""FP8 serving layouts from a model's own config, and FP8 checkpoints written and read back.

A tiny DeepSeek-V3-shaped config (written here, with the ``quantization_config`` that
transformers' own ``FineGrainedFP8Config`` writes) is imported in bf16 (``tensors from hf ...
as cfg dtype bf16``) and a serving layout follows its FP8 scheme (``quantize from cfg``).
The oracle of what it must quantize is the FP8 checkpoint the same config describes
(``tensors_from_hf_config`` without a dtype: fp8 weights, each beside its fp32
``weight_scale_inv``). Quantized with the C++ quantizer and written with
``write_safetensors``, the checkpoint reads back, through the header reader, through
``tensors from safetensors`` and through the ``safetensors`` package, with those shapes,
dtypes and bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_interop_hf import DEEPSEEK_V3

import layoutlang
from layoutlang.errors import LayoutError
from layoutlang.io.hf import fp8_scheme, tensors_from_hf_config
from layoutlang.io.quantize import quantize_tensors
from layoutlang.io.safetensors import read_safetensors_header, tensors_from_safetensors
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import write_safetensors

pytestmark = pytest.mark.timeout(120)

TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 200,  # not a multiple of 128: partial blocks at the edge
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 512,
}


def fp8_config() -> dict[str, Any]:
    """The quantization_config as transformers writes it (its field names are the oracle), where
    the installed transformers has the class; DeepSeek-V3's own otherwise."""
    transformers = pytest.importorskip("transformers")
    quant = json.loads(
        transformers.FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=["kv_b_proj"])
        .to_json_string()
    )
    return {**DEEPSEEK_V3, **TINY, "quantization_config": quant}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


SERVE = """
tensors from hf "model/config.json" as cfg dtype bf16 { "*.e_score_correction_bias": fp32 }
mesh infer [tp = 2]
layout serve on infer {
  default: replicate
  "*.mlp.gate_proj.weight": tp = shard(0)
  "*.mlp.up_proj.weight": tp = shard(0)
  "*.mlp.experts.*.down_proj.weight": tp = shard(0)
  quantize from cfg
}
"""


def test_the_config_field_names_are_read(tmp_path: Path) -> None:
    config = fp8_config()
    assert {"quant_method", "weight_block_size", "activation_scheme", "modules_to_not_convert"} <= set(
        config["quantization_config"]
    )
    scheme = fp8_scheme(write_config(tmp_path / "model", config))
    assert scheme is not None
    assert (scheme.format, scheme.block, scheme.activation_scheme, scheme.modules_to_not_convert) == (
        "fp8_e4m3",
        (128, 128),
        "dynamic",
        ("kv_b_proj",),
    )
    assert scheme.weights and not any("kv_b_proj" in name for name in scheme.weights)


def test_a_serving_layout_follows_the_models_own_config(tmp_path: Path) -> None:
    config_file = write_config(tmp_path / "model", fp8_config())
    (tmp_path / "serve.layout").write_text(SERVE)
    program = layoutlang.load(tmp_path / "serve.layout")
    program.check()
    layout = program.layout("serve")
    checkpoint = {name: (tuple(shape), dtype) for name, shape, dtype in tensors_from_hf_config(config_file)}
    stored_fp8 = {name for name, (_, dtype) in checkpoint.items() if dtype == "fp8_e4m3"}
    quantized = layout.quantized()
    assert set(quantized) == stored_fp8 and stored_fp8
    for name, q in quantized.items():
        assert (q.format, q.block, q.convention) == ("fp8_e4m3", (128, 128), "scale_inv")
        assert checkpoint[q.scale.name] == (q.scale.shape, "fp32")  # DeepSeek-V3's name, shape, dtype
        assert program.tensors[name].dtype == "bf16"
    # a TP shard of the experts' 256 rows: 128 each, whole blocks; the 200 columns end partial
    down = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert [str(b) for b in layout.scale_boxes(down, 1)] == [
        f"{down}_scale_inv[1:2, 0:2] at {down}_scale_inv[0:1, 0:2]"
    ]


def test_quantize_from_a_config_without_quantization(tmp_path: Path) -> None:
    config = {**fp8_config(), "quantization_config": None}
    write_config(tmp_path / "model", config)
    (tmp_path / "serve.layout").write_text(SERVE)
    with pytest.raises(LayoutError, match="has no quantization_config, so it quantizes nothing") as info:
        layoutlang.load(tmp_path / "serve.layout")
    assert info.value.span is not None and info.value.span.line == 9


def test_quantize_from_the_fp8_checkpoint_itself_says_to_import_bf16(tmp_path: Path) -> None:
    write_config(tmp_path / "model", fp8_config())
    (tmp_path / "serve.layout").write_text(SERVE.replace(" dtype bf16 {", " {"))
    with pytest.raises(LayoutError, match="is fp8_e4m3") as info:
        layoutlang.load(tmp_path / "serve.layout").check()
    assert info.value.hint is not None and "dtype bf16" in info.value.hint


def test_an_fp8_checkpoint_reads_back_with_the_configs_shapes_and_dtypes(tmp_path: Path) -> None:
    config_file = write_config(tmp_path / "model", fp8_config())
    (tmp_path / "serve.layout").write_text(SERVE)
    program = layoutlang.load(tmp_path / "serve.layout")
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(t.shape, generator=generator).to(torch_dtype(t.dtype)) for name, t in program.tensors.items()
    }
    stored = quantize_tensors(weights, program.layout("serve").quantized())
    path = tmp_path / "fp8" / "model.safetensors"
    path.parent.mkdir()
    write_safetensors(path, stored)
    expected = [(name, tuple(shape), dtype) for name, shape, dtype in tensors_from_hf_config(config_file)]
    assert tensors_from_safetensors(path) == expected
    header, _ = read_safetensors_header(path)
    down = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert header[down]["dtype"] == "F8_E4M3" and header[f"{down}_scale_inv"]["dtype"] == "F32"
    # the language reads it as the checkpoint it is
    read = layoutlang.loads(f'tensors from safetensors "{path}"')
    assert [(n, t.shape, t.dtype) for n, t in read.tensors.items()] == expected
    # the safetensors package reads the same bytes back
    loaded = load_file(path)
    assert set(loaded) == set(stored)
    for name, tensor in stored.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_fp8_e5m2_and_mxfp8_checkpoints(tmp_path: Path) -> None:
    program = layoutlang.loads("""
mesh m [tp = 1]
tensor "a.weight" [130, 96] bf16
tensor "b.weight" [64, 100] fp32
layout serve on m {
  default: replicate
  quantize "a.weight" as fp8_e5m2 blocks 128 x 128 scale_inv fp32
  quantize "b.weight" as mxfp8 blocks 1 x 32 scale_inv e8m0
}
""")
    weights = {"a.weight": torch.randn(130, 96).to(torch.bfloat16), "b.weight": torch.randn(64, 100)}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, quantize_tensors(weights, program.layout("serve").quantized()))
    assert tensors_from_safetensors(path) == [
        ("a.weight", (130, 96), "fp8_e5m2"),
        ("a.weight_scale_inv", (2, 1), "fp32"),
        ("b.weight", (64, 100), "fp8_e4m3"),
        ("b.weight_scale_inv", (64, 4), "e8m0"),
    ]
    header, _ = read_safetensors_header(path)
    assert [header[n]["dtype"] for n in ("a.weight", "b.weight_scale_inv")] == ["F8_E5M2", "F8_E8M0"]
    assert load_file(path)["b.weight_scale_inv"].dtype == torch.float8_e8m0fnu
