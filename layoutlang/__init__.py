"""layoutlang: declarative tensor layouts and exact reshard plans.

A ``.layout`` program describes meshes of ranks, logical tensors, layouts that place every
tensor on a mesh, and ``reshard A -> B`` statements. The same objects can be built in
Python (:class:`Mesh`, :class:`Shard`, :class:`Replicate`, :class:`Layout`).

>>> import layoutlang
>>> program = layoutlang.loads('''
... mesh train [tp = 2]
... tensor "w" [4, 6] fp32
... layout tp on train { "w": tp = shard(1) }
... ''')
>>> program.layouts["tp"].boxes("w", rank=1)
[Box(tensor='w', offsets=(0, 3), sizes=(4, 3), storage='w', storage_offsets=(0, 0))]
"""

from .errors import (
    AgreementError,
    DataLossError,
    ExecutionError,
    ExitCode,
    LayoutError,
    LayoutFileError,
    LayoutIncludeError,
    LayoutNameError,
    LayoutSyntaxError,
    LayoutValueError,
    ModelDescriptionError,
    RuntimeFailure,
)
from .lang import load, loads
from .model import (
    Box,
    Layout,
    LogicalTensor,
    Mesh,
    Program,
    Replicate,
    Reshard,
    Rule,
    Shard,
    Storage,
    StorageRule,
    TensorPlacement,
    Topology,
    shard_boxes,
)
from .plan import Plan, compile_plan, plan_layouts

__version__ = "0.1.0"

# Execution needs torch; import it only when it is used, so the language stays light.
_LAZY = {
    "Resharder": ("layoutlang.runtime", "Resharder"),
    "redistribute": ("layoutlang.runtime", "redistribute"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'layoutlang' has no attribute '{name}'")

__all__ = [
    "AgreementError",
    "Box",
    "DataLossError",
    "ExecutionError",
    "ExitCode",
    "Layout",
    "LayoutError",
    "LayoutFileError",
    "LayoutIncludeError",
    "LayoutNameError",
    "LayoutSyntaxError",
    "LayoutValueError",
    "LogicalTensor",
    "Mesh",
    "ModelDescriptionError",
    "Plan",
    "Program",
    "Replicate",
    "Reshard",
    "Resharder",
    "Rule",
    "RuntimeFailure",
    "Shard",
    "Storage",
    "StorageRule",
    "TensorPlacement",
    "Topology",
    "compile_plan",
    "load",
    "loads",
    "plan_layouts",
    "redistribute",
    "shard_boxes",
]
