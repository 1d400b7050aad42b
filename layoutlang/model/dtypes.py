"""Element types of logical tensors.

A ``.layout`` file names dtypes by their short names (``bf16``, ``fp32``...); safetensors
headers and Hugging Face configs use their own spellings, which :func:`canonical_dtype`
maps to the short name. Each dtype has a size in bytes and a torch counterpart, which
:mod:`layoutlang.io.torch_dtypes` resolves (the language does not import torch).
"""

from __future__ import annotations

__all__ = ["ALIASES", "DTYPES", "canonical_dtype", "itemsize"]

#: short name -> (bytes per element, torch attribute name)
DTYPES: dict[str, tuple[int, str]] = {
    "bf16": (2, "bfloat16"),
    "fp16": (2, "float16"),
    "fp32": (4, "float32"),
    "fp64": (8, "float64"),
    "fp8_e4m3": (1, "float8_e4m3fn"),
    "fp8_e5m2": (1, "float8_e5m2"),
    # MXFP8's scales: a power of two, the byte its exponent + 127 (0xFF: NaN)
    "e8m0": (1, "float8_e8m0fnu"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
    "int16": (2, "int16"),
    "int32": (4, "int32"),
    "int64": (8, "int64"),
    "bool": (1, "bool"),
}

#: other spellings (safetensors, torch, Hugging Face) -> short name
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
    "f16": "fp16",
    "f32": "fp32",
    "f64": "fp64",
    "float8_e4m3fn": "fp8_e4m3",
    "f8_e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "f8_e5m2": "fp8_e5m2",
    "float8_e8m0fnu": "e8m0",
    "f8_e8m0": "e8m0",
    "i8": "int8",
    "u8": "uint8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
}


def canonical_dtype(name: str) -> str | None:
    """The short name for any known spelling (case-insensitive), or None if unknown."""
    key = name.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    if key in DTYPES:
        return key
    return ALIASES.get(key)


def itemsize(dtype: str) -> int:
    """Bytes per element of a short dtype name."""
    return DTYPES[dtype][0]
