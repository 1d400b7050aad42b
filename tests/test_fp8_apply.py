"""``layoutlang apply --to DIR`` into an FP8 layout writes DeepSeek-V3's checkpoint conventions.

A bf16 training layout (uneven tensor parallel) is refit into a serving layout that stores
every projection in ``float8_e4m3fn`` with its ``weight_scale_inv`` (fp32, one per 128 x 128
block, dims that are and are not multiples of 128) and the norm in bf16. The rank file is
read back by ``tensors from safetensors`` with the same shapes and dtypes as the layout's
quantized tensors, and its bytes equal tests/test_quantize.py's torch reference of the
whole synthetic tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_quantize import reference

import layoutlang
from layoutlang.io.weights import SafetensorsCheckpoint, synthetic_box

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
mesh train [tp = 3]
mesh serve [tp = 1] on ranks 3..3
tensor "model.layers.0.self_attn.o_proj.weight" [300, 256] bf16
tensor "model.layers.0.mlp.down_proj.weight" [256, 200] bf16
tensor "model.layers.0.input_layernorm.weight" [256] bf16
layout megatron on train {
  default: replicate
  "*.o_proj.weight": tp = shard(1)
  "*.down_proj.weight": tp = shard(0)
}
layout fp8 on serve {
  default: replicate
  quantize "*_proj.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: megatron -> fp8
"""


def test_apply_to_writes_a_deepseek_v3_fp8_checkpoint(tmp_path: Path) -> None:
    program_file = tmp_path / "fp8.layout"
    program_file.write_text(PROGRAM)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", "apply", str(program_file), "--to", str(out), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"]
    path = out / "rank00003.safetensors"
    program = layoutlang.loads(PROGRAM)
    layout = program.layouts["fp8"]
    expected = {}
    for name, tensor in program.tensors.items():
        q = layout.quantization(name)
        if q is None:
            expected[name] = (tensor.shape, tensor.dtype)
        else:
            expected[name] = (tensor.shape, "fp8_e4m3")
            expected[f"{name}_scale_inv"] = (q.scale.shape, "fp32")
    assert expected["model.layers.0.self_attn.o_proj.weight_scale_inv"] == ((3, 2), "fp32")
    read = layoutlang.loads(f'tensors from safetensors "{path}"')
    assert {n: (t.shape, t.dtype) for n, t in read.tensors.items()} == expected
    written = SafetensorsCheckpoint(path)
    for index, (name, tensor) in enumerate(program.tensors.items()):
        whole = synthetic_box(index, tensor.shape, tensor.dtype, (0,) * len(tensor.shape), tensor.shape)
        q = layout.quantization(name)
        stored = {name: whole}
        if q is not None:
            stored[name], stored[f"{name}_scale_inv"] = reference(whole, q.format, q.block, q.convention)
        for key, want in stored.items():
            shape, dtype = expected[key]
            got = written.read_box(key, dtype, shape, (0,) * len(shape), shape)
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), key
