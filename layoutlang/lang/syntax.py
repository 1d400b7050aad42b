"""Text to abstract syntax tree.

:func:`parse` turns the text of one ``.layout`` file into a :class:`File` of statements.
Every node is a frozen attrs class carrying the :class:`~layoutlang.errors.Span` it came
from, so that later stages can point at the exact text when something is wrong. Includes
are not followed here (see :mod:`layoutlang.lang.elaborate`); names are not resolved here.

Lark's exceptions never leave this module: they become a
:class:`~layoutlang.errors.LayoutSyntaxError` with the file, line, column, the source line
and a caret, and for common mistakes a hint.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Union

import attrs
import lark
from lark import Token, Transformer, v_args

from ..errors import LayoutError, LayoutSyntaxError, Span

__all__ = [
    "parse",
    "parse_expression",
    "File",
    "Include",
    "Let",
    "Topology",
    "TopologyEntry",
    "MeshDecl",
    "AxisDecl",
    "Range",
    "TensorDecl",
    "Binding",
    "TensorsFrom",
    "LayoutDecl",
    "RuleDecl",
    "SelectEntry",
    "PlacementEntry",
    "ShardExpr",
    "ReplicateExpr",
    "OptionDecl",
    "StorageDecl",
    "ReshardDecl",
    "PolicyDecl",
    "Num",
    "Name",
    "Attr",
    "BinOp",
    "Neg",
    "Expr",
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
    """``cfg.num_hidden_layers``: a constant of an imported model description."""

    obj: str
    key: str
    span: Span


@attrs.frozen
class BinOp:
    op: str  # one of + - * // %
    left: "Expr"
    right: "Expr"
    span: Span


@attrs.frozen
class Neg:
    operand: "Expr"
    span: Span


Expr = Union[Num, Name, Attr, BinOp, Neg]

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
class TensorsFrom:
    kind: str
    kind_span: Span
    path: str
    path_span: Span
    alias: str | None
    dtype: str | None
    span: Span


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


@attrs.frozen
class StorageDecl:
    name: str
    name_span: Span
    shape: tuple[Expr, ...] | None
    parts: tuple[tuple[str, Span], ...]
    along: Expr | None
    blocks: tuple[Expr, ...] | None
    span: Span


@attrs.frozen
class LayoutDecl:
    name: str
    mesh: str
    mesh_span: Span
    rules: tuple[RuleDecl, ...]
    storages: tuple[StorageDecl, ...]
    span: Span


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


Statement = Union[Include, Let, Topology, MeshDecl, TensorDecl, TensorsFrom, LayoutDecl, ReshardDecl]


@attrs.frozen
class File:
    path: str
    text: str
    statements: tuple[Statement, ...]


# ---------------------------------------------------------------------- parsing


@functools.cache
def _parser() -> lark.Lark:
    grammar = resources.files("layoutlang.lang").joinpath("grammars/layout.lark").read_text("utf-8")
    return lark.Lark(
        grammar,
        parser="lalr",
        start=["start", "expr"],
        propagate_positions=True,
        maybe_placeholders=True,
    )


class _Builder(Transformer):
    """Maps parse-tree rules to AST classes; only tokens are converted by hand."""

    def __init__(self, path: str, lines: list[str], line_offset: int = 0, column_offset: int = 0):
        super().__init__()
        self._path = path
        self._lines = lines
        self._line_offset = line_offset
        self._column_offset = column_offset

    # -- spans
    def _span(self, line: int, column: int, end_line: int, end_column: int) -> Span:
        if line == 1:
            column += self._column_offset
        if end_line == 1:
            end_column += self._column_offset
        line += self._line_offset
        end_line += self._line_offset
        source = self._lines[line - 1] if 0 < line <= len(self._lines) else ""
        return Span(self._path, line, column, end_line, end_column, source)

    def _meta(self, meta) -> Span:
        return self._span(meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, token: Token) -> Span:
        return self._span(token.line, token.column, token.end_line, token.end_column)

    # -- expressions
    @v_args(meta=True)
    def int(self, meta, children):
        (tok,) = children
        digits = tok.replace("_", "")
        if len(digits) > 1000:  # Python refuses to read very long numbers; none is meaningful here
            raise LayoutSyntaxError(f"an integer of {len(digits)} digits is too long", self._tok(tok))
        return Num(int(digits), self._tok(tok))

    @v_args(meta=True)
    def name(self, meta, children):
        (tok,) = children
        return Name(str(tok), self._tok(tok))

    @v_args(meta=True)
    def attr(self, meta, children):
        obj, key = children
        return Attr(str(obj), str(key), self._meta(meta))

    def _binop(op):  # noqa: N805 - a factory used in the class body
        @v_args(meta=True)
        def method(self, meta, children):
            left, right = children
            return BinOp(op, left, right, self._meta(meta))

        return method

    add = _binop("+")
    sub = _binop("-")
    mul = _binop("*")
    floordiv = _binop("//")
    mod = _binop("%")
    del _binop

    @v_args(meta=True)
    def neg(self, meta, children):
        return Neg(children[0], self._meta(meta))

    # -- statements
    def start(self, children):
        return tuple(children)

    @v_args(meta=True)
    def include(self, meta, children):
        return Include(_unquote(children[0]), self._meta(meta))

    @v_args(meta=True)
    def let(self, meta, children):
        name, value = children
        return Let(str(name), value, self._meta(meta))

    @v_args(meta=True)
    def topology(self, meta, children):
        name, *entries = children
        entries = [e for e in entries if e is not None]  # the block is optional after a preset name
        return Topology(str(name) if name is not None else None, tuple(entries), self._meta(meta))

    @v_args(meta=True)
    def topology_entry(self, meta, children):
        key, quantity = children
        match = re.fullmatch(r"([0-9_.eE+-]+?) ?([A-Za-z/]+)?", str(quantity))
        number, unit = match.group(1), match.group(2)
        return TopologyEntry(str(key), float(number.replace("_", "")), unit, self._meta(meta))

    @v_args(meta=True)
    def range(self, meta, children):
        start, stop = children
        return Range(start, stop, self._meta(meta))

    @v_args(meta=True)
    def axis(self, meta, children):
        name, size = children
        return AxisDecl(str(name), size, self._meta(meta))

    @v_args(meta=True)
    def mesh_ranks(self, meta, children):
        (ranks,) = children
        items = ranks if isinstance(ranks, tuple) else (ranks,)
        return ("ranks", items, self._meta(meta))

    def rank_list(self, children):
        return tuple(c for c in children if c is not None)

    @v_args(meta=True)
    def mesh(self, meta, children):
        name, *rest = children
        ranks = rest.pop() if rest and (rest[-1] is None or isinstance(rest[-1], tuple)) else None
        axes = tuple(a for a in rest if isinstance(a, AxisDecl))
        items, ranks_span = (ranks[1], ranks[2]) if ranks is not None else (None, None)
        return MeshDecl(str(name), axes, items, ranks_span, self._meta(meta))

    def shape(self, children):
        return tuple(c for c in children if c is not None)

    @v_args(meta=True)
    def binding(self, meta, children):
        name, rng = children
        return Binding(str(name), rng, self._meta(meta))

    def for_clause(self, children):
        return tuple(children)

    @v_args(meta=True)
    def tensor(self, meta, children):
        name, shape, dtype, bindings = children
        return TensorDecl(
            _unquote(name),
            self._tok(name),
            shape,
            str(dtype),
            self._tok(dtype),
            bindings or (),
            self._meta(meta),
        )

    @v_args(meta=True)
    def tensors_from(self, meta, children):
        kind, path, alias, dtype = children
        return TensorsFrom(
            str(kind),
            self._tok(kind),
            _unquote(path),
            self._tok(path),
            str(alias) if alias is not None else None,
            str(dtype) if dtype is not None else None,
            self._meta(meta),
        )

    # -- layouts
    def rule_target(self, children):
        (tok,) = children
        return (None if tok.type == "DEFAULT" else _unquote(tok), self._tok(tok))

    def replicate_all(self, children):
        return ()

    def rule_body(self, children):
        return tuple(children)

    @v_args(meta=True)
    def rule(self, meta, children):
        (pattern, pattern_span), entries = children
        return RuleDecl(pattern, pattern_span, entries, self._meta(meta))

    @v_args(meta=True)
    def select(self, meta, children):
        axis, index = children
        return SelectEntry(str(axis), index, self._meta(meta), self._tok(axis))

    @v_args(meta=True)
    def axis_placement(self, meta, children):
        axis, placement = children
        return PlacementEntry((str(axis),), placement, False, self._meta(meta), (self._tok(axis),))

    @v_args(meta=True)
    def ordered_placement(self, meta, children):
        *axes, placement = children
        spans = tuple(self._tok(a) for a in axes)
        return PlacementEntry(tuple(str(a) for a in axes), placement, True, self._meta(meta), spans)

    @v_args(meta=True)
    def replicate(self, meta, children):
        return ReplicateExpr(self._meta(meta))

    @v_args(meta=True)
    def shard(self, meta, children):
        dim, *options = children
        return ShardExpr(dim, tuple(options), self._meta(meta))

    @v_args(meta=True)
    def option(self, meta, children):
        name, value = children
        return OptionDecl(str(name), value, self._meta(meta))

    def along(self, children):
        return ("along", children[0])

    def blocks(self, children):
        return ("blocks", tuple(children[1:]))

    @v_args(meta=True)
    def storage(self, meta, children):
        name, shape, *rest = children
        along = blocks = None
        parts = []
        for item in rest:
            if item is None:
                continue
            if isinstance(item, tuple) and item[0] == "along":
                along = item[1]
            elif isinstance(item, tuple) and item[0] == "blocks":
                blocks = item[1]
            else:
                parts.append((_unquote(item), self._tok(item)))
        return StorageDecl(
            _unquote(name), self._tok(name), shape, tuple(parts), along, blocks, self._meta(meta)
        )

    @v_args(meta=True)
    def layout(self, meta, children):
        name, mesh, *items = children
        rules = tuple(i for i in items if isinstance(i, RuleDecl))
        storages = tuple(i for i in items if isinstance(i, StorageDecl))
        return LayoutDecl(str(name), str(mesh), self._tok(mesh), rules, storages, self._meta(meta))

    # -- reshards
    def policy(self, children):
        return str(children[0])

    @v_args(meta=True)
    def policy_rule(self, meta, children):
        (pattern, pattern_span), policy = children
        return PolicyDecl(pattern, pattern_span, policy, self._meta(meta))

    def reshard_body(self, children):
        return tuple(children)

    @v_args(meta=True)
    def reshard(self, meta, children):
        name, source, destination, policies = children
        return ReshardDecl(
            str(name) if name is not None else None,
            str(source),
            self._tok(source),
            str(destination),
            self._tok(destination),
            policies or (),
            self._meta(meta),
        )


def _unquote(token: Token) -> str:
    return str(token)[1:-1]


# ---------------------------------------------------------------------- errors

# Readable names for the grammar's terminals, used in "expected ..." messages.
_TERMINAL_NAMES = {
    "STRING": 'a quoted name ("...")',
    "NAME": "a name",
    "INT": "an integer",
    "QUANTITY": "a number (with an optional unit such as GB/s or us)",
    "DEFAULT": "'default'",
    "REPLICATE": "'replicate'",
    "BLOCKS": "'blocks'",
    "$END": "the end of the file",
}

_STATEMENT_KEYWORDS = ("include", "let", "topology", "mesh", "tensor", "tensors", "layout", "reshard")


def _describe_expected(expected: set[str]) -> str:
    names = []
    for term in sorted(expected):
        if term in _TERMINAL_NAMES:
            names.append(_TERMINAL_NAMES[term])
        else:
            pattern = _parser().get_terminal(term).pattern
            names.append(f"'{pattern.value}'" if pattern.type == "str" else term.lower())
    names = sorted(set(names))
    if len(names) > 8:
        return ", ".join(names[:8]) + ", ..."
    return ", ".join(names)


def _hint_for(token_value: str, token_type: str, expected: set[str], line: str) -> str | None:
    """Labels for the mistakes people make most often."""
    if token_value == "/" or (token_type == "SLASH"):
        return "integer division is written '//'"
    if token_value in {"{", "}"} and "STRING" in expected:
        return "tensor names and patterns are quoted: \"layers.{l}.mlp.*\""
    if token_type == "NAME" and "STRING" in expected:
        return f'tensor names and patterns are quoted: "{token_value}"'
    if "COLON" in expected and token_type in {"NAME", "LPAR"}:
        return 'a rule is written  "pattern": axis = shard(dim), ...'
    if token_value == ":" and "EQUAL" in expected:
        return "an axis is placed with '=': tp = shard(0)"
    if token_value == "=" and "COLON" in expected:
        return "a rule's pattern is followed by ':'"
    if token_type == "NAME" and token_value in {"Shard", "Replicate", "shard_", "Shard0"}:
        return "placements are written in lower case: shard(0), replicate"
    if "RBRACE" in expected and token_type == "$END":
        return "a '{' block is not closed"
    return None


def _error_from_lark(err: lark.exceptions.LarkError, path: str, lines: list[str]) -> LayoutSyntaxError:
    line = getattr(err, "line", None) or len(lines) or 1
    column = getattr(err, "column", None) or 1
    if isinstance(err, lark.exceptions.UnexpectedEOF) or (
        isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type == "$END"
    ):
        line = max(1, len(lines))
        column = len(lines[-1].rstrip("\n")) + 1 if lines else 1
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    if isinstance(err, lark.exceptions.UnexpectedToken):
        token = err.token
        expected = set(err.expected)
        width = max(1, len(str(token))) if token.type != "$END" else 1
        shown = "end of the file" if token.type == "$END" else f"'{token}'"
        message = f"unexpected {shown}; expected {_describe_expected(expected)}"
        hint = _hint_for(str(token), token.type, expected, source)
        span = Span(path, line, column, line, column + width, source)
    elif isinstance(err, lark.exceptions.UnexpectedCharacters):
        char = err.char
        expected = set(err.allowed or ())
        message = f"unexpected character '{char}'"
        if expected:
            message += f"; expected {_describe_expected(expected)}"
        hint = _hint_for(char, "", expected, source)
        if char == "'":
            hint = "names are quoted with double quotes"
        if char == '"':  # the string token did not match: no closing quote on this line
            message = "a quoted name is not closed on this line"
            hint = 'a quoted name ends with \'"\' before the end of its line'
        span = Span(path, line, column, line, column + 1, source)
    else:  # UnexpectedEOF and anything else lark may raise
        expected = set(getattr(err, "expected", ()) or ())
        message = "unexpected end of the file"
        if expected:
            message += f"; expected {_describe_expected(expected)}"
        hint = None
        span = Span(path, line, column, line, column + 1, source)
    return LayoutSyntaxError(message, span, hint)


# ----------------------------------------------------------------------- entry


def parse(text: str, path: str = "<string>") -> File:
    """Parse the text of one ``.layout`` file; raises LayoutSyntaxError with a caret."""
    lines = text.splitlines(keepends=True)
    if not text.strip() or all(
        not ln.strip() or ln.lstrip().startswith("#") for ln in lines
    ):
        raise LayoutSyntaxError(
            "the file holds no statements",
            Span(path, 1, 1, 1, 2, lines[0] if lines else ""),
            "a program declares at least one of: " + ", ".join(_STATEMENT_KEYWORDS),
        )
    try:
        tree = _parser().parse(text, start="start")
    except lark.exceptions.LarkError as err:
        raise _error_from_lark(err, path, lines) from None
    builder = _Builder(path, lines)
    statements = []
    for node in tree.children:  # one statement at a time, so that a failure has a place
        try:
            statements.append(builder.transform(node))
        except (RecursionError, lark.exceptions.VisitError) as err:
            if isinstance(err, lark.exceptions.VisitError) and isinstance(err.orig_exc, LayoutError):
                raise err.orig_exc from None
            if isinstance(err, lark.exceptions.VisitError) and not isinstance(err.orig_exc, RecursionError):
                raise
            raise LayoutSyntaxError(
                "the statement nests too deeply to be read",
                builder._meta(node.meta),
                "split long expressions with 'let' constants",
            ) from None
    return File(path, text, tuple(statements))


def parse_expression(text: str, span: Span) -> Expr:
    """Parse an expression embedded in a string (``{l % 4}`` in a storage name) at ``span``.

    Positions in the result point into the enclosing file: ``span`` is where ``text`` starts.
    """
    try:
        tree = _parser().parse(text, start="expr")
    except lark.exceptions.LarkError as err:
        column = span.column + max(0, (getattr(err, "column", 1) or 1) - 1)
        raise LayoutSyntaxError(
            f"cannot read the expression '{text}'",
            Span(span.path, span.line, column, span.line, column + 1, span.source_line),
            "expressions use integers, names, + - * // % and parentheses",
        ) from None
    lines = [""] * (span.line - 1) + [span.source_line]
    return _Builder(span.path, lines, span.line - 1, span.column - 1).transform(tree)
