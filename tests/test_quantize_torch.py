"""The torch-ops quantizer (layoutlang.io.quantize_torch) against the C++ core on CPU, byte for
byte, values and scales: random tensors over many magnitudes and adversarial ones (NaN,
infinities, subnormals of every source dtype, exact ties of the fp8 rounding, all-zero and
tiny blocks, the largest finite values, negative zeros), every format, convention and source
dtype, partial blocks, 1-D to 3-D, strided sources and destinations. tests/gpu/ runs the same
comparison with the torch path on CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from layoutlang.errors import LayoutValueError
from layoutlang.io.quantize import quantize, quantize_into
from layoutlang.io.quantize_torch import quantize_into_torch

pytestmark = pytest.mark.timeout(180)

FORMATS = {
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float32),
    "fp8_e5m2": (torch.float8_e5m2, torch.float32),
    "mxfp8": (torch.float8_e4m3fn, torch.float8_e8m0fnu),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def torch_quantize(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str):
    values_dtype, scale_dtype = FORMATS[fmt]
    values = torch.empty(x.shape, dtype=values_dtype, device=x.device)
    grid = [-(-n // b) for n, b in zip(x.shape, block)]
    scales = torch.empty(grid, dtype=scale_dtype, device=x.device)
    quantize_into_torch(x, values, scales, fmt, block, convention)
    return values, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str = "scale_inv") -> None:
    want_values, want_scales = quantize(x, fmt, block, convention)  # the C++ core
    values, scales = torch_quantize(x, fmt, block, convention)
    diff = (bits(values) != bits(want_values)).nonzero()
    assert diff.numel() == 0, (fmt, block, convention, x.dtype, diff[:5].tolist())
    assert torch.equal(bits(scales), bits(want_scales)), (fmt, block, convention, x.dtype)


def spread(shape: tuple[int, ...], dtype: torch.dtype, seed: int, span: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-span, span, shape, generator=g).float())
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("convention", ["scale_inv", "scale"])
def test_random_tensors(dtype: torch.dtype, fmt: str, convention: str) -> None:
    blocks = [(128, 128), (1, 32), (7, 5)] if fmt != "mxfp8" else [(1, 32), (4, 32)]
    for seed, shape in enumerate([(256, 384), (300, 200), (129, 1), (5, 3), (33, 65)]):
        x = spread(shape, dtype, seed)
        for block in blocks:
            assert_same(x, fmt, block, convention)
    assert_same(spread((3, 130, 70), dtype, 9), fmt, (1, 128, 32) if fmt != "mxfp8" else (1, 1, 32), convention)
    assert_same(spread((77,), dtype, 10), fmt, (32,), convention)


def adversarial(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of 64 values, each row a case: blocks of 32 along the last dim."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(seed)
    rows = []
    base = spread((64,), dtype, seed, span=4).float()

    def row(values: torch.Tensor) -> None:
        rows.append(values.to(dtype))

    row(torch.zeros(64))  # all-zero blocks
    row(-torch.zeros(64))  # negative zeros
    row(torch.full((64,), info.tiny))  # the least normal
    sub = torch.arange(64, dtype=torch.float32) * info.smallest_normal / 64  # subnormals (fp32: some flush
    row(sub)  # to zero in bf16/fp16 conversion, which is fine: it is the same input to both)
    row(torch.full((64,), float(info.max)))  # the largest finite
    row(torch.where(torch.arange(64) % 2 == 0, float(info.max), -float(info.max)))
    row(torch.cat([torch.full((32,), float("nan")), base[32:]]))  # one poisoned block, one fine
    row(torch.cat([base[:31], torch.tensor([float("inf")]), base[32:]]))
    row(torch.cat([base[:32], torch.tensor([float("-inf")]), base[33:]]))
    # exact ties: with 448 (e4m3's largest) in the block scale_inv is 1 and the values are cast
    # as they are; midpoints between e4m3 codes (e.g. 1 + 1/16) must round to even
    ties = torch.tensor([1 + k / 16 for k in range(-8, 24)], dtype=torch.float32)
    row(torch.cat([torch.tensor([448.0]), ties[1:], torch.tensor([57344.0]), ties[1:]]))
    row(torch.cat([torch.tensor([448.0]), -ties[1:], torch.tensor([448.0]), ties[1:] * 2.0**-7]))
    row(torch.linspace(-1e-44, 1e-44, 64))  # amax / 448 underflows: scale 1
    row(torch.randn(64, generator=g) * 2.0**-130)  # tiny amax
    row(torch.randn(64, generator=g) * 2.0**100)  # huge (inf in bf16 -> fp16: a poisoned block there)
    row(base)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("convention", ["scale_inv", "scale"])
def test_adversarial_inputs(dtype: torch.dtype, fmt: str, convention: str) -> None:
    for seed in range(3):
        x = adversarial(dtype, seed)
        assert_same(x, fmt, (1, 32), convention)
        assert_same(x, fmt, (1, 64) if fmt != "mxfp8" else (2, 32), convention)
        if fmt != "mxfp8":
            assert_same(x, fmt, (4, 16), convention)
            assert_same(x, fmt, (x.shape[0], 64), convention)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_bf16_and_fp16_bit_pattern(fmt: str) -> None:
    """Every 16-bit pattern (NaNs, infinities, subnormals included) in blocks of 32, as bf16 and
    as fp16, shuffled so that blocks mix magnitudes."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    order = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16):
        sorted_ = every.view(dtype).reshape(-1, 32)  # neighbours: many finite blocks, a few poisoned
        assert_same(sorted_, fmt, (1, 32))
        shuffled = every[order].view(dtype).reshape(-1, 32)
        assert_same(shuffled, fmt, (1, 32), "scale")


def test_strided_views_and_empty() -> None:
    big = spread((300, 500), torch.bfloat16, 3)
    x = big[10:270, 100:420]  # a column slice of a larger storage
    for fmt in FORMATS:
        block = (128, 128) if fmt != "mxfp8" else (1, 32)
        values_dtype, scale_dtype = FORMATS[fmt]
        want_values, want_scales = quantize(x, fmt, block)
        # strided destinations: views into larger tensors, filled by the torch path
        values_base = torch.zeros(300, 400, dtype=values_dtype)
        values = values_base[20:280, 50:370]
        grid = [-(-n // b) for n, b in zip(x.shape, block)]
        scales_base = torch.zeros(grid[1] + 3, grid[0], dtype=scale_dtype)
        scales = scales_base.t()[:, 1 : 1 + grid[1]]
        quantize_into_torch(x, values, scales, fmt, block)
        assert torch.equal(bits(values), bits(want_values))
        assert torch.equal(bits(scales), bits(want_scales))
        assert bits(values_base[:20]).eq(0).all()  # nothing outside the view written
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    values, scales = torch_quantize(empty, "fp8_e4m3", (128, 128), "scale_inv")
    assert values.numel() == 0 and scales.numel() == 0


def test_quantize_into_wants_one_device() -> None:
    """quantize_into sends CPU tensors to the C++ core and others to the torch path; tensors
    on different devices are refused with their names."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    values = torch.empty(4, 64, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(1, 1, dtype=torch.float32)
    with pytest.raises(LayoutValueError, match="values is on meta, the source on cpu"):
        quantize_into(x, values, scales, "fp8_e4m3", (128, 128))


@pytest.mark.parametrize("fmt, block", list(itertools.product(["fp8_e4m3", "mxfp8"], [(1, 32)])))
def test_dequantized_error_is_bounded(fmt: str, block: tuple[int, int]) -> None:
    """A sanity check of the rule itself: dequantized values are within e4m3's half ulp."""
    x = spread((64, 256), torch.float32, 11, span=6)
    values, scales = torch_quantize(x, fmt, block, "scale_inv")
    multiplier = scales.float()  # e8m0 widens to its power of two
    back = values.float() * multiplier.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.allclose(back, x, rtol=2.0**-3, atol=float(multiplier.max()) * 2.0**-9)
