"""Limits that keep a mistyped number from exhausting memory or overflowing the C++ core.

The core counts elements, bytes and ranks in 64-bit integers and chunks and blocks in
32-bit ones; a mesh or a ``for`` clause is built in memory before anything checks it.
"""

from __future__ import annotations

__all__ = ["INT32_MAX", "INT64_MAX", "MAX_GENERATED_TENSORS", "MAX_MESH_RANKS"]

#: positions of one mesh
MAX_MESH_RANKS = 1 << 20
#: tensors one ``tensor ... for`` statement may generate
MAX_GENERATED_TENSORS = 1 << 20
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
