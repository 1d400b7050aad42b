"""The C++ core (``_core``, built by scikit-build-core + nanobind) and its typed face.

Everything here is plain data in and out: offsets, sizes, ranks, raw pointers and streams
as integers. The extension imports no Python package; Python owns tensors and errors.
"""

from . import _core

__all__ = ["_core"]
