"""The C++ quantizer's kernels (``generic``, and ``avx2``/``avx512`` where the CPU runs them)
against the torch-ops quantizer (``layoutlang.io.quantize_torch``, written apart from the C++
core with torch's own casts), byte for byte.

The AVX kernels multiply by a block's reciprocal with Markstein's correction where the
generic one divides (``csrc/quantize_kernel.inc``). For a 16-bit source the quotient's
rounding depends on the value's bits and on the divisor ``amax / fmax``, whose mantissa is
fixed by amax's mantissa alone (bf16: 128 of them, fp16: 1,024) and whose exponent moves
only where the fp8 encoding rounds (its subnormals). So every value of the source dtype
against every amax mantissa, at the exponents where the kernels switch between reciprocal
and division, is every case there is: ``test_every_value_against_every_amax_mantissa``.
"""

from __future__ import annotations

import math
import platform
import re
from pathlib import Path

import pytest
import torch

from layoutlang.errors import LayoutValueError
from layoutlang.io.quantize import quantize_into, quantize_kernels
from layoutlang.io.quantize_torch import quantize_into_torch

pytestmark = pytest.mark.timeout(300)

KERNELS = quantize_kernels()
FORMATS = {
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float32, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, torch.float32, 57344.0),
    "mxfp8": (torch.float8_e4m3fn, torch.float8_e8m0fnu, 448.0),
}


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def run(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str, kernel: str | None):
    """(values, scales) of ``x``: the C++ kernel named, or the torch-ops quantizer for None."""
    values_dtype, scale_dtype, _ = FORMATS[fmt]
    values = torch.empty(x.shape, dtype=values_dtype)
    scales = torch.empty([-(-n // b) for n, b in zip(x.shape, block)], dtype=scale_dtype)
    if kernel is None:
        quantize_into_torch(x, values, scales, fmt, block, convention)
    else:
        quantize_into(x, values, scales, fmt, block, convention, threads=1, kernel=kernel)
    return values.view(torch.uint8), scales.contiguous().view(torch.uint8)


def assert_kernels_agree(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str = "scale_inv") -> None:
    want_values, want_scales = run(x, fmt, block, convention, None)
    for kernel in KERNELS:
        values, scales = run(x, fmt, block, convention, kernel)
        differ = (values != want_values).nonzero()
        assert differ.numel() == 0, (
            f"kernel {kernel}, {fmt} {x.dtype} block {block}: {differ.shape[0]} bytes differ from torch's, "
            f"first at {differ[0].tolist()}: value {x[tuple(differ[0])].item()!r}"
        )
        assert torch.equal(scales, want_scales), f"kernel {kernel}, {fmt} {x.dtype}: scales differ"


def test_kernels_listed_match_the_cpu() -> None:
    assert KERNELS[-1] == "generic"
    flags = cpu_flags()
    if not flags or not re.match(r"x86_64|amd64", platform.machine(), re.IGNORECASE):
        pytest.skip("not an x86-64 Linux machine: only the generic kernel is built")
    assert ("avx2" in KERNELS) == ({"avx2", "fma"} <= flags)
    assert ("avx512" in KERNELS) == ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"} <= flags)


def every_value_rows(dtype: torch.dtype, amaxes: torch.Tensor) -> torch.Tensor:
    """One row per amax: every finite value of ``dtype`` with ``|x| <= amax`` (larger ones
    clamped to ``±amax``; negative zero included), and amax itself, so that the row's block
    has exactly that amax."""
    # (torch.minimum and maximum keep a zero's sign: -0.0 stays in every row)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    every = every[torch.isfinite(every)]
    rows = torch.maximum(torch.minimum(every[None, :], amaxes[:, None]), -amaxes[:, None])
    return torch.cat([rows, amaxes[:, None]], dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_every_value_against_every_amax_mantissa(dtype: torch.dtype, fmt: str) -> None:
    mantissa_bits = 7 if dtype == torch.bfloat16 else 10
    mantissas = 1.0 + torch.arange(2**mantissa_bits, dtype=torch.float64) / 2**mantissa_bits
    # amax in [1, 2) and [16, 32) (divisors of ordinary size), and for bf16 the binades on
    # either side of where the divisor amax / fmax crosses the AVX kernels' bounds for the
    # reciprocal, 2^-60 and 2^60 (fp16 stops at 65504)
    log2_fmax = math.log2(FORMATS[fmt][2])
    exponents = [0, 4]
    if dtype == torch.bfloat16:
        for bound in (-60, 60):
            edge = math.floor(bound + log2_fmax)
            exponents += [edge, edge + 1]
    for e in exponents:
        amaxes = (mantissas * 2.0**e).to(dtype).float()
        amaxes = amaxes[torch.isfinite(amaxes) & (amaxes > 0)].unique()
        x = every_value_rows(dtype, amaxes)
        assert_kernels_agree(x, fmt, (1, x.shape[1]))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blocks_strips_and_groups(fmt: str, dtype: torch.dtype) -> None:
    """Shapes that cut the kernels' block groups (a row longer than a group, partial blocks at
    every edge, 3-D strips), random magnitudes, poisoned and zero blocks."""
    g = torch.Generator().manual_seed(3)
    shape = (300, 9000)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    x[5, 100] = float("nan")
    x[200, 8999] = float("inf")
    x[256:, :128] = 0.0
    x = x.to(dtype)
    for block in [(128, 128), (1, 128), (7, 33)] if fmt != "mxfp8" else [(1, 32), (3, 32)]:
        assert_kernels_agree(x, fmt, block)
        assert_kernels_agree(x, fmt, block, "scale")
    y = x[:240].reshape(3, 80, 9000)
    assert_kernels_agree(y, fmt, (1, 64, 128) if fmt != "mxfp8" else (1, 1, 32))


def test_a_kernel_this_cpu_cannot_run_is_refused() -> None:
    x = torch.ones(4, 32, dtype=torch.bfloat16)
    values, scales = torch.empty(4, 32, dtype=torch.float8_e4m3fn), torch.empty(4, 1)
    with pytest.raises(LayoutValueError, match="unknown quantizer kernel 'sse9'"):
        quantize_into(x, values, scales, "fp8_e4m3", (1, 32), kernel="sse9")
    missing = [k for k in ("avx512", "avx2") if k not in KERNELS]
    if not missing:
        pytest.skip("this CPU runs every kernel: none to refuse here")
    with pytest.raises(LayoutValueError, match=f"the quantizer's {missing[0]} kernel cannot run here"):
        quantize_into(x, values, scales, "fp8_e4m3", (1, 32), kernel=missing[0])
