"""Quantizing torch tensors to FP8 and MXFP8 with the C++ core's quantizer.

:func:`quantize` cuts a bf16, fp16 or fp32 tensor (any strides: a view of a larger
storage will do) into blocks and writes fp8 values and one scale per block, by the rule of
``csrc/quantize.hpp`` (written out in the language reference, "Quantized tensors"): amax per
block; ``scale_inv = amax / fmax`` (1 for a zero block); values ``x / scale_inv``, clamped to
the format's largest value and rounded to nearest even; MXFP8 takes the OCP MX power of two
instead. The result is bit-identical to the same arithmetic done with torch on the whole
tensor (``tests/test_quantize.py`` checks it against such a reference).

Here, in :mod:`layoutlang.io` beside the dtypes and the safetensors writer, because it is
the lowest layer that may import torch: the runtime's executor (which quantizes whole blocks
while packing an FP8 refit's buffers, and a destination's split blocks after their last
write) and the FP8 checkpoint writers of ``layoutlang apply --to`` both sit above it. Tensors on the CPU
go to the C++ core (multi-threaded over block strips for large regions); tensors on any other
device (CUDA included) are quantized there by :mod:`layoutlang.io.quantize_torch`, the same
rule written in torch operations, bit-identical to the C++ core (no custom kernel).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from ..core import _core
from ..errors import LayoutValueError, core_errors
from ..model.quantization import CONVENTIONS, FORMATS, Quantization, scale_shape
from .quantize_torch import quantize_into_torch
from .torch_dtypes import dtype_name, torch_dtype

__all__ = ["quantize", "quantize_into", "quantize_kernels", "quantize_tensors", "quantize_threads"]


def quantize_threads() -> int:
    """The threads the C++ quantizer may use per call: ``LAYOUTLANG_QUANTIZE_THREADS`` when
    set (1: single-threaded), else 0, which the core reads as the hardware's threads, at most
    8. A call shares a region's block row strips out when it holds at least 2^18 elements per
    thread; the bytes never depend on the number."""
    text = os.environ.get("LAYOUTLANG_QUANTIZE_THREADS", "")
    try:
        return max(0, int(text)) if text else 0
    except ValueError:
        raise LayoutValueError(f"LAYOUTLANG_QUANTIZE_THREADS must be a number of threads, not '{text}'") from None


def quantize_kernels() -> list[str]:
    """The C++ quantizer's kernels this build runs on this CPU, fastest first: ``avx512``
    (AVX-512 F/BW/VL and FMA), ``avx2`` (AVX2 and FMA) and ``generic`` (any CPU). Every one
    writes the same bytes; :func:`quantize_into` takes the first unless told otherwise."""
    return list(_core.quantize_kernels())


def _check_view(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise LayoutValueError(f"quantize: {name} is on {tensor.device}, the source on {device}: one device for all")
    if any(s < 0 for s in tensor.stride()):
        raise LayoutValueError(f"quantize: {name} has a negative stride")


def quantize_into(
    source: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    block: Sequence[int],
    convention: str = "scale_inv",
    threads: int | None = None,
    kernel: str = "auto",
) -> None:
    """Quantizes ``source`` into the existing tensors ``values`` (the shape of ``source``,
    ``float8_e4m3fn`` or ``float8_e5m2`` as the format says) and ``scales`` (one per block,
    ``ceil(shape / block)``; float32, or ``float8_e8m0fnu`` for ``mxfp8``). Any strides; all
    three on one device: the C++ core on the CPU, torch operations elsewhere (the same bytes).
    ``threads``: the C++ core's threads (None: :func:`quantize_threads`); ``kernel``: one of
    :func:`quantize_kernels` for regions whose rows are contiguous (``auto``: the fastest).
    Neither changes a byte."""
    if format not in FORMATS:
        raise LayoutValueError(f"quantize: unknown format '{format}' (formats: {', '.join(FORMATS)})")
    if convention not in CONVENTIONS:
        raise LayoutValueError(f"quantize: unknown scale convention '{convention}' ({' or '.join(CONVENTIONS)})")
    source_dtype = dtype_name(source.dtype)
    if source_dtype not in ("bf16", "fp16", "fp32"):
        raise LayoutValueError(f"quantize: cannot read {source.dtype} (bf16, fp16, fp32)")
    wanted = torch_dtype(FORMATS[format].values)
    scale_dtype = torch_dtype(FORMATS[format].scale_dtypes[0])
    if values.dtype != wanted or tuple(values.shape) != tuple(source.shape):
        raise LayoutValueError(f"quantize: values must be {wanted} of shape {list(source.shape)}")
    expected = scale_shape(tuple(source.shape), tuple(block))
    if scales.dtype != scale_dtype or tuple(scales.shape) != expected:
        raise LayoutValueError(f"quantize: scales must be {scale_dtype} of shape {list(expected)}")
    for name, tensor in (("the source", source), ("values", values), ("scales", scales)):
        _check_view(name, tensor, source.device)
    if source.device.type != "cpu":
        quantize_into_torch(source, values, scales, format, block, convention)
        return
    with core_errors():
        _core.quantize_blocks(
            source.data_ptr(),
            source_dtype,
            list(source.shape),
            list(source.stride()),
            list(block),
            format,
            convention,
            values.data_ptr(),
            list(values.stride()),
            scales.data_ptr(),
            list(scales.shape),
            list(scales.stride()),
            quantize_threads() if threads is None else threads,
            kernel,
        )


def quantize(
    source: torch.Tensor, format: str, block: Sequence[int], convention: str = "scale_inv"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: ``source`` quantized block by block into new contiguous tensors
    on its device.

    >>> w = torch.tensor([[1.0, -2.0], [0.5, 448.0]], dtype=torch.bfloat16)
    >>> values, scale_inv = quantize(w, "fp8_e4m3", (2, 2))
    >>> values.float().tolist(), scale_inv.tolist()
    ([[1.0, -2.0], [0.5, 448.0]], [[1.0]])
    """
    if format not in FORMATS:
        raise LayoutValueError(f"quantize: unknown format '{format}' (formats: {', '.join(FORMATS)})")
    values = torch.empty(source.shape, dtype=torch_dtype(FORMATS[format].values), device=source.device)
    scales = torch.empty(
        scale_shape(tuple(source.shape), tuple(block)),
        dtype=torch_dtype(FORMATS[format].scale_dtypes[0]),
        device=source.device,
    )
    quantize_into(source, values, scales, format, block, convention)
    return values, scales


def quantize_tensors(
    tensors: Mapping[str, torch.Tensor], quantized: Mapping[str, Quantization]
) -> dict[str, torch.Tensor]:
    """Whole tensors as a quantized checkpoint stores them, in order: each tensor of ``quantized``
    (:meth:`Layout.quantized <layoutlang.model.Layout.quantized>`) as its fp8 values followed
    by its scale tensor (DeepSeek-V3's ``weight`` then ``weight_scale_inv``), the others as
    they are. What :func:`~layoutlang.io.weights.write_safetensors` writes as an FP8 checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        q = quantized.get(name)
        if q is None:
            out[name] = tensor
            continue
        if tuple(tensor.shape) != q.shape:
            raise LayoutValueError(
                f"tensor '{name}' is {list(tensor.shape)}; it is quantized as {list(q.shape)}", tensor=name
            )
        out[name], out[q.scale.name] = quantize(tensor, q.format, q.block, q.convention)
    return out
