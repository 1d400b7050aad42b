"""The C++ quantizer (csrc/quantize.cpp, through layoutlang.io.quantize) against a reference
written here with torch: the whole tensor quantized in one process, block amax by reshaping,
torch's own casts to ``float8_e4m3fn`` / ``float8_e5m2`` (round to nearest even), compared
byte for byte, values and scales, including partial blocks at the edges, zero blocks, tiny
and non-finite blocks, strided sources and destinations.
"""

from __future__ import annotations

import math

import pytest
import torch

from layoutlang.errors import LayoutValueError
from layoutlang.io.quantize import quantize, quantize_into

pytestmark = pytest.mark.timeout(120)

FP8 = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "mxfp8": (torch.float8_e4m3fn, 448.0),
}


def _blocks(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """x padded with zeros to whole blocks, as [g0, b0, g1, b1, ...]."""
    grid = [math.ceil(n / b) for n, b in zip(x.shape, block)]
    padded = torch.zeros([g * b for g, b in zip(grid, block)], dtype=torch.float32)
    padded[tuple(slice(0, n) for n in x.shape)] = x
    return padded.reshape([v for g, b in zip(grid, block) for v in (g, b)])


def _per_element(per_block: torch.Tensor, block: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    out = per_block
    for d, b in enumerate(block):
        out = out.repeat_interleave(b, dim=d)
    return out[tuple(slice(0, n) for n in shape)]


def reference(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented rule, in torch, on the whole tensor."""
    fp8, fmax = FP8[fmt]
    xf = x.float()
    view = _blocks(xf, block)
    reduce = tuple(range(1, 2 * x.dim(), 2))
    amax = view.abs().amax(dim=reduce)
    finite = torch.isfinite(view).all(dim=reduce)
    if fmt == "mxfp8":
        _, exponent = torch.frexp(torch.where(finite, amax, 1.0))
        e = torch.where(amax == 0, -127, (exponent - 1 - 8).clamp(-127, 127)).to(torch.int32)
        divisor = torch.where(e >= -126, ((e + 127) << 23), torch.full_like(e, 0x00400000)).view(torch.float32)
        code = (e + 127) if convention == "scale_inv" else (127 - e)
        scales = torch.where(finite, code, 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale_inv = amax / fmax
        scale_inv = torch.where(scale_inv == 0, 1.0, scale_inv)
        divisor = scale_inv
        stored = scale_inv if convention == "scale_inv" else 1.0 / scale_inv
        scales = torch.where(finite, stored, torch.full_like(stored, float("nan")))
    q = (xf / _per_element(divisor, block, tuple(x.shape))).clamp(-fmax, fmax).to(fp8)
    poisoned = ~_per_element(finite, block, tuple(x.shape))
    bits = torch.where(poisoned, torch.tensor(0x7F, dtype=torch.uint8), q.view(torch.uint8))
    return bits.view(fp8), scales


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check(x: torch.Tensor, fmt: str, block: tuple[int, ...], convention: str = "scale_inv") -> None:
    values, scales = quantize(x, fmt, block, convention)
    want_values, want_scales = reference(x, fmt, block, convention)
    assert same_bytes(values, want_values), (
        fmt,
        block,
        (values.view(torch.uint8) != want_values.view(torch.uint8)).sum(),
    )
    assert same_bytes(scales, want_scales), (fmt, block)


def spread(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values whose magnitude varies by many powers of two across the tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1), (5, 3)])
def test_block_fp8_matches_torch(dtype: torch.dtype, fmt: str, shape: tuple[int, int]) -> None:
    x = spread(shape, dtype, seed=sum(shape))
    check(x, fmt, (128, 128))
    check(x, fmt, (128, 128), "scale")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_per_channel_per_tensor_and_3d(fmt: str) -> None:
    x = spread((96, 200), torch.bfloat16, seed=3)
    check(x, fmt, (1, 200))  # per channel: one scale per row
    check(x, fmt, (96, 200))  # per tensor
    experts = spread((3, 130, 70), torch.bfloat16, seed=4)
    check(experts, fmt, (1, 128, 128))
    check(spread((77,), torch.float32, seed=5), fmt, (32,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 256), (10, 70)])
def test_mxfp8_matches_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = spread(shape, dtype, seed=7)
    check(x, "mxfp8", (1, 32))
    check(x, "mxfp8", (1, 32), "scale")


@pytest.mark.parametrize(
    "fmt, fp8, fmax", [("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)]
)
def test_every_bf16_value_rounds_as_torch_casts(fmt: str, fp8: torch.dtype, fmax: float) -> None:
    """With fmax in the block, scale_inv is 1 and the values are cast as they are: every finite
    bf16 within the format's range, ties to even and subnormals included, rounds as torch's cast."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    inside = every[torch.isfinite(every) & (every.float().abs() <= fmax)]
    x = torch.cat([inside, torch.tensor([fmax], dtype=torch.bfloat16)])
    values, scale_inv = quantize(x, fmt, (x.numel(),))
    assert scale_inv.tolist() == [1.0]
    assert same_bytes(values, x.float().to(fp8))


def test_special_blocks() -> None:
    x = torch.zeros(4, 64, dtype=torch.float32)
    x[1, :32] = torch.linspace(-1e-44, 1e-44, 32)  # amax / 448 underflows to 0: scale 1
    x[2, 0] = float("nan")
    x[3, 5] = float("-inf")
    x[3, 40] = 3.0
    for fmt, block in (("fp8_e4m3", (1, 32)), ("fp8_e5m2", (1, 32)), ("mxfp8", (1, 32))):
        check(x, fmt, block)
        check(x, fmt, block, "scale")
    values, scales = quantize(x, "fp8_e4m3", (1, 32))
    assert scales[0].tolist() == [1.0, 1.0]  # a zero block
    assert scales[1].tolist() == [1.0, 1.0]
    assert math.isnan(scales[2, 0]) and scales[2, 1] == 1.0
    assert values[2, :32].view(torch.uint8).eq(0x7F).all() and values[2, 32:].view(torch.uint8).eq(0).all()
    assert math.isnan(scales[3, 0]) and scales[3, 1] == 3.0 / 448.0
    _, mx_scales = quantize(x, "mxfp8", (1, 32))
    assert mx_scales.view(torch.uint8).tolist() == [[0, 0], [0, 0], [0xFF, 0], [0xFF, 1 + 127 - 8]]


def test_strided_source_and_destinations() -> None:
    """A column slice of a transposed storage in, a slice of larger buffers out."""
    storage = spread((300, 520), torch.bfloat16, seed=11)
    source = storage.t()[8:264, 44:244]  # [256, 200], strides (1, 520)
    values_buffer = torch.zeros(300, 300, dtype=torch.float8_e4m3fn)
    scales_buffer = torch.zeros(4, 5, dtype=torch.float32)
    values = values_buffer[10:266, 50:250]
    scales = scales_buffer.t()[1:3, 0:2].t()  # [2, 2] with strides (1, 5)
    quantize_into(source, values, scales, "fp8_e4m3", (128, 128))
    want_values, want_scales = reference(source, "fp8_e4m3", (128, 128), "scale_inv")
    assert same_bytes(values, want_values) and same_bytes(scales, want_scales)
    untouched = values_buffer.view(torch.uint8).clone()
    untouched[10:266, 50:250] = 0
    assert untouched.eq(0).all()  # nothing written outside the view


def test_dequantized_values_are_close() -> None:
    """A sanity check of the meaning, beside the bit-exact one: value * scale_inv is within one
    fp8 step of the source (e4m3 keeps 3 mantissa bits: relative error at most 2^-4)."""
    x = spread((256, 256), torch.float32, seed=13).clamp(-1e4, 1e4)
    values, scale_inv = quantize(x, "fp8_e4m3", (128, 128))
    back = values.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    block_amax = _per_element(x.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3)), (128, 128), (256, 256))
    tolerance = torch.maximum(x.abs() * 2**-4, block_amax / 448 * 2**-9)
    assert ((back - x).abs() <= tolerance).all()


def test_bad_arguments() -> None:
    x = torch.ones(4, 4, dtype=torch.bfloat16)
    with pytest.raises(LayoutValueError, match="unknown format 'int4'"):
        quantize(x, "int4", (2, 2))
    with pytest.raises(LayoutValueError, match=r"cannot read torch\.int32"):
        quantize(torch.ones(4, 4, dtype=torch.int32), "fp8_e4m3", (2, 2))
    with pytest.raises(LayoutValueError, match=r"scales must be torch\.float32 of shape \[2, 2\]"):
        quantize_into(x, torch.empty(4, 4, dtype=torch.float8_e4m3fn), torch.empty(2, 1), "fp8_e4m3", (2, 2))
    with pytest.raises(LayoutValueError, match="block has 1 dims"):
        quantize(x, "fp8_e4m3", (2,))


@pytest.mark.parametrize("fmt, block", [("fp8_e4m3", (128, 128)), ("mxfp8", (1, 32)), ("fp8_e5m2", (1, 200))])
def test_threads_give_the_same_bytes(fmt: str, block: tuple[int, ...]) -> None:
    """The C++ core shares block row strips out over threads (at least 2^18 elements each):
    1, 2, 3 (strips not a multiple) and 8 threads write the bytes of the reference."""
    x = spread((1000, 2100), torch.bfloat16, seed=12)  # 2.1 M elements: up to 8 threads
    want_values, want_scales = reference(x, fmt, block, "scale_inv")
    for threads in (1, 2, 3, 8, 0):
        values = torch.empty(x.shape, dtype=want_values.dtype)
        scales = torch.empty(want_scales.shape, dtype=want_scales.dtype)
        quantize_into(x, values, scales, fmt, block, threads=threads)
        assert same_bytes(values, want_values), threads
        assert same_bytes(scales, want_scales), threads
    experts = spread((3, 700, 400), torch.float32, seed=13)  # a 3-D view: strips over two dims
    want = reference(experts, "fp8_e4m3", (1, 128, 128), "scale")
    for threads in (1, 4):
        values = torch.empty(experts.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(want[1].shape, dtype=torch.float32)
        quantize_into(experts, values, scales, "fp8_e4m3", (1, 128, 128), "scale", threads=threads)
        assert same_bytes(values, want[0]) and same_bytes(scales, want[1])
    values, scales = quantize(x, fmt, block)
    with pytest.raises(LayoutValueError, match="threads"):
        quantize_into(x, values, scales, fmt, block, threads=-1)
