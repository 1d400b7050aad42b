"""The torch counterparts of the short dtype names (``bf16`` <-> ``torch.bfloat16``).

Here rather than in :mod:`layoutlang.model.dtypes` because the language and the model
never import torch; weights, the runtime and elastic sessions resolve dtypes through this.
"""

from __future__ import annotations

import torch

from ..model.dtypes import DTYPES

__all__ = ["dtype_name", "torch_dtype"]


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a short dtype name (``bf16`` -> ``torch.bfloat16``)."""
    return getattr(torch, DTYPES[dtype][1])


def dtype_name(dtype: torch.dtype) -> str | None:
    """The short name of a torch dtype (``torch.bfloat16`` -> ``bf16``), or None."""
    for name, (_, attr) in DTYPES.items():
        if getattr(torch, attr) == dtype:
            return name
    return None
