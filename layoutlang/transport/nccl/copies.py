"""Box copies on the device: many strided copies in one call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...core import _core
from ...errors import core_errors
from .library import load_cuda_runtime

# ------------------------------------------------------------------------- box copies


def copy_pairs(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    cuda: _core.nccl.CudaApi | None = None,
    stream: int | None = None,
) -> tuple[int, int]:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair (same shape and dtype, any strides)
    as pitched CUDA runtime copies: one call per box up to 3-D, adjacent contiguous boxes
    merged. Returns (runtime calls, bytes). ``cuda`` defaults to the CUDA runtime;
    ``CudaMock()`` copies host memory, for tests. ``stream`` defaults to the current one.
    """
    if not pairs:
        return (0, 0)
    width = max(max(dst.dim(), 1) for dst, _ in pairs)
    desc = np.zeros((len(pairs), 3 + 3 * width), dtype=np.int64)
    for i, (dst, src) in enumerate(pairs):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"copy {i}: the destination is {tuple(dst.shape)} {dst.dtype}, the source "
                f"{tuple(src.shape)} {src.dtype} (copies do not convert)"
            )
        pad = width - dst.dim()
        desc[i, 0] = dst.data_ptr()
        desc[i, 1] = src.data_ptr()
        desc[i, 2] = dst.element_size()
        desc[i, 3 : 3 + width] = [1] * pad + list(dst.shape)
        desc[i, 3 + width : 3 + 2 * width] = [0] * pad + list(dst.stride())
        desc[i, 3 + 2 * width :] = [0] * pad + list(src.stride())
    first = pairs[0][0]
    if cuda is None:
        cuda = load_cuda_runtime()
    if stream is None:
        stream = torch.cuda.current_stream(first.device).cuda_stream if first.is_cuda else 0
    with core_errors():
        done = _core.nccl.copy_boxes(cuda, desc, stream)
    return (done.calls, done.bytes)
