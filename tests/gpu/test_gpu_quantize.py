"""The torch-ops quantizer (layoutlang.io.quantize_torch) on CUDA, against the C++ core on the
CPU, byte for byte. Skipped without CUDA.

What the CPU tests cannot check: that torch's CUDA kernels (the division, the reductions, the
fp8 casts) give the bytes the C++ core gives, so that a GPU machine quantizes where the
weights lie without a custom kernel. Random tensors over many magnitudes, the adversarial rows
of tests/test_quantize_torch.py, every 16-bit pattern, every format, convention and source dtype.
Run with ``pytest -m gpu tests/gpu`` (``tests/gpu/run_gpu_checks.sh`` runs the folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from layoutlang.io.quantize import quantize, quantize_into

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared inputs
from test_quantize_torch import DTYPES, FORMATS, adversarial, bits, spread

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]


def assert_same_on_cuda(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str = "scale_inv") -> None:
    want_values, want_scales = quantize(x, fmt, block, convention)  # the C++ core, on the CPU
    values, scales = quantize(x.cuda(), fmt, block, convention)  # torch ops on the device
    assert values.device.type == "cuda" and scales.device.type == "cuda"
    diff = (bits(values.cpu()) != bits(want_values)).nonzero()
    assert diff.numel() == 0, (fmt, block, convention, x.dtype, diff[:5].tolist())
    assert torch.equal(bits(scales.cpu()), bits(want_scales)), (fmt, block, convention, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("convention", ["scale_inv", "scale"])
def test_cuda_matches_cpp(dtype: torch.dtype, fmt: str, convention: str) -> None:
    blocks = [(128, 128), (1, 32), (7, 5)] if fmt != "mxfp8" else [(1, 32), (4, 32)]
    for seed, shape in enumerate([(1024, 2048), (300, 200), (129, 1), (33, 65)]):
        for block in blocks:
            assert_same_on_cuda(spread(shape, dtype, seed), fmt, block, convention)
    for seed in range(3):
        assert_same_on_cuda(adversarial(dtype, seed), fmt, (1, 32), convention)
        assert_same_on_cuda(adversarial(dtype, seed), fmt, (2, 32), convention)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_every_16_bit_pattern(fmt: str) -> None:
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    order = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16):
        assert_same_on_cuda(every.view(dtype).reshape(-1, 32), fmt, (1, 32))
        assert_same_on_cuda(every[order].view(dtype).reshape(-1, 32), fmt, (1, 32), "scale")


def test_cuda_strided_destination() -> None:
    x = spread((300, 500), torch.bfloat16, 3)[10:270, 100:420]
    want_values, want_scales = quantize(x, "fp8_e4m3", (128, 128))
    values_base = torch.zeros(300, 400, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.zeros(3, 3, dtype=torch.float32, device="cuda")
    quantize_into(x.cuda(), values_base[20:280, 50:370], scales, "fp8_e4m3", (128, 128))
    assert torch.equal(bits(values_base[20:280, 50:370].cpu()), bits(want_values))
    assert torch.equal(bits(scales.cpu()), bits(want_scales))
