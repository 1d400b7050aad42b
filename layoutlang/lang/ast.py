"""The syntax tree of a ``.layout`` file: frozen attrs classes, one per construct.

Every node carries the :class:`~layoutlang.errors.Span` of its text, so that later stages
point at the exact place when something is wrong; some nodes also keep the spans of their
parts (a tensor's name, an axis name alone). :mod:`layoutlang.lang.parser` builds these
nodes; nothing here knows the grammar or resolves a name.
"""

from __future__ import annotations

import attrs

from ..errors import Span

__all__ = [
    "Attr",
    "AxisDecl",
    "BinOp",
    "Binding",
    "Call",
    "DtypeDecl",
    "Expr",
    "File",
    "Include",
    "LayoutDecl",
    "Let",
    "MeshDecl",
    "Name",
    "Neg",
    "Num",
    "OptionDecl",
    "PlacementEntry",
    "PolicyDecl",
    "QuantizeDecl",
    "QuantizeFrom",
    "Range",
    "ReplicateExpr",
    "Require",
    "ReshardDecl",
    "RuleDecl",
    "SelectEntry",
    "ShardExpr",
    "Statement",
    "StorageDecl",
    "TensorDecl",
    "TensorsFrom",
    "Topology",
    "TopologyEntry",
]

# ------------------------------------------------------------------ expressions


@attrs.frozen
class Num:
    value: int
    span: Span


@attrs.frozen
class Name:
    name: str
    span: Span


@attrs.frozen
class Attr:
    """``cfg.num_hidden_layers`` (a constant of an imported model description) or ``infer.tp``
    (the size of axis ``tp`` of mesh ``infer``)."""

    obj: str
    key: str
    span: Span

    @property
    def name(self) -> str:
        """The constant's name as the elaborator stores it: ``cfg.num_hidden_layers``."""
        return f"{self.obj}.{self.key}"


@attrs.frozen
class BinOp:
    op: str  # one of + - * // %
    left: Expr
    right: Expr
    span: Span


@attrs.frozen
class Neg:
    operand: Expr
    span: Span


@attrs.frozen
class Call:
    """``min(a, b)``, ``max(a, b)``, ``cdiv(a, b)``: a function of the language applied to integers."""

    function: str
    args: tuple[Expr, ...]
    span: Span
    function_span: Span = attrs.field(eq=False)  # the function's name alone


Expr = Num | Name | Attr | BinOp | Neg | Call

# ------------------------------------------------------------------- statements


@attrs.frozen
class Include:
    path: str
    span: Span


@attrs.frozen
class Let:
    name: str
    value: Expr
    span: Span


@attrs.frozen
class Require:
    """``require LEFT OP RIGHT: "what it means"``: checked when read."""

    left: Expr
    op: str
    right: Expr
    message: str | None
    span: Span


@attrs.frozen
class TopologyEntry:
    key: str
    value: float
    unit: str | None
    span: Span


@attrs.frozen
class Topology:
    name: str | None
    entries: tuple[TopologyEntry, ...]
    span: Span


@attrs.frozen
class Range:
    """``start..stop``, both ends included."""

    start: Expr
    stop: Expr
    span: Span


@attrs.frozen
class AxisDecl:
    name: str
    size: Expr
    span: Span


@attrs.frozen
class MeshDecl:
    name: str
    axes: tuple[AxisDecl, ...]
    ranks: tuple[Expr | Range, ...] | None  # None: contiguous from 0
    ranks_span: Span | None
    span: Span


@attrs.frozen
class Binding:
    name: str
    range: Range
    span: Span


@attrs.frozen
class TensorDecl:
    name: str
    name_span: Span
    shape: tuple[Expr, ...]
    dtype: str
    dtype_span: Span
    bindings: tuple[Binding, ...]
    span: Span


@attrs.frozen
class DtypeDecl:
    """``"PATTERN": DTYPE`` in the body of ``tensors from``: the dtype of the tensors it matches."""

    pattern: str
    pattern_span: Span
    dtype: str
    dtype_span: Span
    span: Span


@attrs.frozen
class TensorsFrom:
    kind: str
    kind_span: Span
    path: str
    path_span: Span
    alias: str | None
    dtype: str | None
    span: Span
    dtypes: tuple[DtypeDecl, ...] = ()
    #: ``over NAME`` (``tensors from peft``): the ``as`` name of the model the adapter adapts
    base: str | None = None
    base_span: Span | None = None


@attrs.frozen
class OptionDecl:
    name: str
    value: Expr
    span: Span


@attrs.frozen
class ShardExpr:
    dim: Expr
    options: tuple[OptionDecl, ...]
    span: Span


@attrs.frozen
class ReplicateExpr:
    span: Span


@attrs.frozen
class SelectEntry:
    """``pp[l // 4]``: the rule's tensors live on the sub-mesh at this coordinate of the axis."""

    axis: str
    index: Expr
    span: Span
    axis_span: Span | None = attrs.field(default=None, eq=False)  # the axis name alone


@attrs.frozen
class PlacementEntry:
    """``tp = shard(0)``, or ``(tp, dp) = shard(0)`` when ``ordered`` (explicit nesting order)."""

    axes: tuple[str, ...]
    placement: ShardExpr | ReplicateExpr
    ordered: bool
    span: Span
    axis_spans: tuple[Span, ...] = attrs.field(default=(), eq=False)  # each axis name alone


@attrs.frozen
class RuleDecl:
    pattern: str | None  # None: the default rule
    pattern_span: Span
    entries: tuple[SelectEntry | PlacementEntry, ...]
    span: Span
    generic: bool = False  # written in a ``generic layout``: its pattern may match no tensor


@attrs.frozen
class StorageDecl:
    name: str
    name_span: Span
    shape: tuple[Expr, ...] | None
    parts: tuple[tuple[str, Span], ...]
    along: Expr | None
    blocks: tuple[Expr, ...] | None
    span: Span
    stack: tuple[str, Span] | None = None  # ``stack e of``: the capture the elements are stacked by
    transposed: tuple[bool, ...] = ()  # per part: ``transposed "..."``
    view: tuple[Expr, ...] | None = None  # ``as [DIM, ...]``: the shape the engine holds it in


@attrs.frozen
class QuantizeDecl:
    """``quantize "PATTERN" as FORMAT BLOCKS CONVENTION DTYPE [replicate] [into "STORAGE" [SHAPE]]``."""

    pattern: str
    pattern_span: Span
    format: str
    format_span: Span
    block: tuple[Expr, ...] | str  # ``blocks 128 x 128``, or a named block shape (``per_channel``)
    block_span: Span
    convention: str
    convention_span: Span
    scale_dtype: str
    scale_dtype_span: Span
    replicated: bool
    storage: str | None
    storage_span: Span | None
    storage_shape: tuple[Expr, ...] | None
    span: Span


@attrs.frozen
class QuantizeFrom:
    """``quantize from CFG [replicate]``: what the ``quantization_config`` of the Hugging Face
    config imported ``as CFG`` quantizes, as it says."""

    alias: str
    alias_span: Span
    replicated: bool
    span: Span

    @property
    def pattern(self) -> str:
        """What an ``extends`` replaces it by: the same statement."""
        return f"from {self.alias}"


@attrs.frozen
class LayoutDecl:
    name: str
    mesh: str
    mesh_span: Span
    rules: tuple[RuleDecl, ...]
    storages: tuple[StorageDecl, ...]
    span: Span
    parent: str | None = None  # ``extends PARENT``
    parent_span: Span | None = attrs.field(default=None, eq=False)
    quantize: tuple[QuantizeDecl | QuantizeFrom, ...] = ()
    generic: bool = False  # ``generic layout``: its own patterns may match no tensor


@attrs.frozen
class PolicyDecl:
    pattern: str | None
    pattern_span: Span
    policy: str  # "reshard" | "broadcast"
    span: Span


@attrs.frozen
class ReshardDecl:
    name: str | None
    source: str
    source_span: Span
    destination: str
    destination_span: Span
    policies: tuple[PolicyDecl, ...]
    span: Span


Statement = Include | Let | Require | Topology | MeshDecl | TensorDecl | TensorsFrom | LayoutDecl | ReshardDecl


@attrs.frozen
class File:
    path: str
    text: str
    statements: tuple[Statement, ...]
