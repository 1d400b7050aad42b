"""The C++ core (``_core``, built by scikit-build-core + nanobind) and its typed face.

Everything here is plain data in and out: offsets, sizes, ranks, raw pointers and streams
as integers. The extension imports no Python package; Python owns tensors and errors.

The boundary is typed: the build generates a stub beside the extension (``_core/__init__.pyi``
and ``_core/nccl.pyi``); move kinds, spaces and policies are enums (``MoveKind``,
``Space``, ``Policy``, the column values of a plan); every result is a named class
(``DimRuns``, ``PlacedBox``, ``PlanTotals``...); ``PlanArrays`` takes its columns by name.
Each core raises one exception type with typed fields, ``_core.CoreError`` (kind, tensor
index, rank, detail) and ``_core.nccl.NcclCoreError`` (kind, call, code, symbol,
introduced); :func:`layoutlang.errors.core_errors` turns them into layoutlang's errors.
"""

from . import _core

__all__ = ["_core"]
