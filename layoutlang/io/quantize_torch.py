"""The quantization rule of ``csrc/quantize.hpp`` in torch operations, on any device.

:func:`quantize_into_torch` writes the bytes the C++ quantizer writes (values and scales, bit
for bit: ``tests/test_quantize_torch.py`` compares them on CPU over random and adversarial
inputs, ``tests/gpu/test_gpu_quantize.py`` on CUDA against the C++ result of the same input),
with nothing but elementwise torch operations, reductions and casts. A GPU machine therefore
quantizes where the tensors lie, without a custom kernel; :func:`layoutlang.io.quantize.quantize_into`
takes this path for every tensor that is not on the CPU.

Why it is exact, step by step (the rule itself is written out in the language reference,
"Quantized tensors"):

* **amax**: the maximum of ``|x|`` per block, taken in the source dtype (an exact operation
  in any dtype), then widened to fp32 (exact for bf16 and fp16). The padding of partial
  blocks is zeros, which do not change a maximum of absolute values. A block holding a NaN
  or an infinity is found with ``isfinite`` and poisoned afterwards, whatever its amax is.
* **fp8 scales**: ``amax / fmax`` is one correctly rounded fp32 division, on every device
  (torch does not compile with fast math); a zero quotient becomes 1; the ``scale``
  convention stores ``1 / scale_inv``, again one division.
* **MXFP8 scales**: ``floor(log2 amax)`` is read from amax's fp32 bits (a subnormal amax is
  first multiplied by 2^64, exactly), so no ``log2``/``frexp`` rounding enters; the power of
  two is built from its bits (2^-127 is the subnormal 0x00400000, as in C++).
* **values**: ``x / divisor`` in fp32, clamped to ``[-fmax, fmax]`` and cast with torch's cast
  to ``float8_e4m3fn``/``float8_e5m2`` (round to nearest, ties to even: the same code on CPU
  and CUDA), which is what the C++ encoder computes; poisoned blocks are ``0x7F`` bytes and a
  NaN scale (fp32 ``0x7FC00000``, e8m0 ``0xFF``).

Memory: the source is read once in blocks of its own dtype; the values pass through one fp32
temporary the size of the source (the division is done in fp32). Blocks at the edges are
padded with zeros in a copy of the source only when the shape is not a multiple of the block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["quantize_into_torch"]

_FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "mxfp8": 448.0}
_NAN32 = 0x7FC00000  # fp32's canonical quiet NaN, the C++ core's poisoned scale
_NAN8 = 0x7F  # e4m3fn's NaN, one of e5m2's (what the C++ core writes)
_NAN_E8M0 = 0xFF


def _blocked(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """``x`` as ``[g0, b0, g1, b1, ...]``, padded with zeros to whole blocks where needed."""
    grid = [math.ceil(n / b) for n, b in zip(x.shape, block)]
    padded_shape = [g * b for g, b in zip(grid, block)]
    if list(x.shape) != padded_shape:
        padded = torch.zeros(padded_shape, dtype=x.dtype, device=x.device)
        padded[tuple(slice(0, n) for n in x.shape)] = x
        x = padded
    return x.reshape([v for g, b in zip(grid, block) for v in (g, b)])


def _per_block(per_block: torch.Tensor) -> torch.Tensor:
    """A ``[g0, g1, ...]`` tensor as ``[g0, 1, g1, 1, ...]``, broadcasting over a blocked view."""
    return per_block.reshape([v for g in per_block.shape for v in (g, 1)])


def _unblocked(blocked: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`_blocked`: ``[g0 * b0, g1 * b1, ...]`` cut to ``shape``."""
    dims = blocked.shape
    whole = blocked.reshape([dims[2 * d] * dims[2 * d + 1] for d in range(len(shape))])
    return whole[tuple(slice(0, n) for n in shape)]


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e in fp32 for integer ``e`` in [-127, 127], built from its bits (2^-127 subnormal)."""
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 0x00400000))
    return bits.to(torch.int32).view(torch.float32)


def _floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2 amax) of a positive finite fp32 tensor, exactly (int32), from its bits."""
    small = amax < 2.0**-126  # a subnormal: 2^64 times it is normal, and exact
    scaled = torch.where(small, amax * 2.0**64, amax)
    exponent = (scaled.view(torch.int32) >> 23) - 127
    return torch.where(small, exponent - 64, exponent)


def quantize_into_torch(
    source: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    block: Sequence[int],
    convention: str = "scale_inv",
) -> None:
    """Quantizes ``source`` into ``values`` and ``scales`` with torch operations, on the
    tensors' own device, bit for bit as the C++ core does. The arguments are those of
    :func:`layoutlang.io.quantize.quantize_into`, which checks them (call that)."""
    fmax = _FMAX[format]
    shape = tuple(source.shape)
    if source.numel() == 0:
        return
    blocked = _blocked(source, block)
    reduce = tuple(range(1, 2 * source.dim(), 2))
    amax = blocked.abs().amax(dim=reduce).float()  # exact in the source dtype, widened exactly
    finite = torch.isfinite(blocked).all(dim=reduce)
    amax = torch.where(finite, amax, torch.zeros_like(amax))  # poisoned blocks: any divisor will do
    if format == "mxfp8":
        e = torch.where(amax > 0, _floor_log2(torch.where(amax > 0, amax, 1.0)) - 8, -127).clamp(-127, 127)
        divisor = _pow2(e)
        code = (e + 127) if convention == "scale_inv" else (127 - e)
        stored = torch.where(finite, code, _NAN_E8M0).to(torch.uint8)
    else:
        scale_inv = amax / fmax
        scale_inv = torch.where(scale_inv == 0, torch.ones_like(scale_inv), scale_inv)
        divisor = scale_inv
        kept = scale_inv if convention == "scale_inv" else 1.0 / scale_inv
        nan = torch.tensor(_NAN32, dtype=torch.int32, device=kept.device)
        stored = torch.where(finite, kept.view(torch.int32), nan)
    scales.view(stored.dtype).copy_(stored)
    quotient = blocked.float() / _per_block(divisor)
    cast = quotient.clamp_(-fmax, fmax).to(values.dtype).view(torch.uint8)
    poison = torch.tensor(_NAN8, dtype=torch.uint8, device=cast.device)
    bits = torch.where(_per_block(finite), cast, poison)
    values.view(torch.uint8).copy_(_unblocked(bits, shape))
