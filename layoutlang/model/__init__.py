"""The semantic model: meshes, placements, logical tensors, storages, layouts, programs.

Naming rules, used everywhere in layoutlang:

- an **axis** is a mesh axis (``pp``, ``tp``, ``dp``, ``ep``...); a **dim** is a tensor dimension;
- a **placement** is what one axis does to a tensor: :class:`Shard` a dim, or :class:`Replicate`;
- a **box** is a region ``(offsets, sizes)`` of a logical tensor in global coordinates;
- a **storage** is the local buffer a rank holds; a box has a place in its storage.

Every class here is immutable. They can be built from Python without any ``.layout`` text:

>>> mesh = Mesh("train", {"dp": 2, "tp": 4})
>>> mesh
Mesh('train', {'dp': 2, 'tp': 4}, ranks=range(0, 8))
>>> [(b.offsets, b.sizes) for b in shard_boxes((10, 6), mesh, [Shard(0), Shard(0)], rank=2)]
[((4, 0), (1, 6))]

Semantics follow PyTorch DTensor: a mesh
is a row-major array of ranks; ``Shard(d)`` over an axis of size k follows ``torch.chunk``;
several axes sharding one dim nest left to right in mesh-axis order.
"""

from .layout import Layout
from .mesh import Mesh, Placement, Replicate, Shard
from .program import Program, Reshard
from .quantization import Quantization, QuantizeRule
from .rules import Rule, Storage, StorageRule, compile_pattern
from .tensor import Box, LogicalTensor, TensorPlacement, shard_boxes
from .topology import Topology

__all__ = [
    "Box",
    "Layout",
    "LogicalTensor",
    "Mesh",
    "Placement",
    "Program",
    "Quantization",
    "QuantizeRule",
    "Replicate",
    "Reshard",
    "Rule",
    "Shard",
    "Storage",
    "StorageRule",
    "TensorPlacement",
    "Topology",
    "compile_pattern",
    "shard_boxes",
]
