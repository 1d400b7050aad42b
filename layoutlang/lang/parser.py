"""Text to syntax tree.

:func:`parse` turns the text of one ``.layout`` file into an :class:`~layoutlang.lang.ast.File`
of statements; :func:`parse_expression` reads an expression embedded in a string (``{l % 4}``
in a storage name). The grammar is package data (``grammars/layout.lark``), read into an
LALR parser once, on first use. Includes are not followed here (see
:mod:`layoutlang.lang.includes`); names are not resolved here.

Lark's exceptions never leave this module: they become a
:class:`~layoutlang.errors.LayoutSyntaxError` with the file, line, column, the source line
and a caret, and for common mistakes a hint. The hints come from a table of bad examples
(:data:`_MISTAKES`): an error raised in the parser state one of them ends in gets its hint
(lark's ``match_examples``).

A program is read within a :class:`TokenBudget` (:data:`~.limits.MAX_PROGRAM_TOKENS` for
all its files): the lexer's tokens are counted as they are made, and the one past the
budget stops the parse with an error at its place, so no text, however long, keeps the
parser busy for more than a few seconds.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib import resources
from typing import Any

import attrs
import lark
from lark import Token, Transformer, Tree, v_args
from lark.exceptions import (
    LarkError,
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)
from lark.lark import PostLex
from lark.tree import Meta

from .._text import elide
from ..errors import LayoutError, LayoutSyntaxError, Span
from . import ast
from .limits import MAX_EMBEDDED_EXPRESSION, MAX_PROGRAM_TOKENS

__all__ = ["STATEMENT_KEYWORDS", "TokenBudget", "parse", "parse_expression"]

#: the words a statement starts with, in the order the language reference gives them
STATEMENT_KEYWORDS = ("include", "let", "topology", "mesh", "tensor", "tensors", "layout", "reshard")

# Python refuses to read integers of more digits; none is meaningful in a layout
_MAX_DIGITS = 1000
_QUANTITY = re.compile(r"([0-9_.eE+-]+?) ?([A-Za-z/]+)?")


# a token of an error message is shown up to this many characters (a string may be megabytes)
_SHOWN_TOKEN = 60


@attrs.define
class TokenBudget:
    """The tokens a program's files may still hold: one budget is shared by a program and
    all its includes, :data:`~.limits.MAX_PROGRAM_TOKENS` in all."""

    left: int = MAX_PROGRAM_TOKENS


class _TokenCounter(PostLex):
    """Counts the lexer's tokens while a program is parsed, and stops the parse at the one
    past its :class:`TokenBudget` (lark runs this between its lexer and its parser).

    The parser is shared (built once), so the budget of the parse under way is per thread;
    parses without one (the hint table's examples, embedded expressions) are not counted.
    """

    always_accept = ()

    def __init__(self) -> None:
        self._current = threading.local()

    def start(self, budget: TokenBudget | None, path: str, lines: Sequence[str]) -> None:
        self._current.state = (budget, path, lines) if budget is not None else None

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        state = getattr(self._current, "state", None)
        if state is None:
            yield from stream
            return
        budget, path, lines = state
        for token in stream:
            if budget.left <= 0:
                line, column = token.line or 1, token.column or 1
                source = lines[line - 1] if 0 < line <= len(lines) else ""
                raise LayoutSyntaxError(
                    f"the program is too long: its files hold more than {MAX_PROGRAM_TOKENS:,} tokens"
                    " (names, numbers, strings and symbols), the most layoutlang reads",
                    Span(path, line, column, line, column + 1, source),
                    "generate tensors with a 'for' clause, or read them with 'tensors from hf' or"
                    " 'tensors from safetensors', instead of one statement each",
                )
            budget.left -= 1
            yield token


_TOKENS = _TokenCounter()


@functools.cache
def _parser() -> lark.Lark:
    grammar = resources.files("layoutlang.lang").joinpath("grammars/layout.lark").read_text("utf-8")
    return lark.Lark(
        grammar,
        parser="lalr",
        start=["start", "expr"],
        propagate_positions=True,
        maybe_placeholders=True,
        postlex=_TOKENS,
    )


def _parse_program(
    text: str, budget: TokenBudget | None = None, path: str = "", lines: Sequence[str] = ()
) -> Tree[Token]:
    _TOKENS.start(budget, path, lines)
    try:
        return _parser().parse(text, start="start")
    finally:
        _TOKENS.start(None, path, lines)


# ------------------------------------------------------------------ the builder


@attrs.frozen
class _Ranks:
    """``on ranks ...`` of a mesh, before the mesh node is built."""

    items: tuple[ast.Expr | ast.Range, ...]
    span: Span


@attrs.frozen
class _Along:
    dim: ast.Expr


@attrs.frozen
class _Blocks:
    sizes: tuple[ast.Expr, ...]


@attrs.frozen
class _Stack:
    name: str
    span: Span


@attrs.frozen
class _View:
    shape: tuple[ast.Expr, ...]


@attrs.frozen
class _Blocking:
    """``blocks 128 x 128`` or ``per_channel`` of a quantize statement, before its node is built."""

    block: tuple[ast.Expr, ...] | str
    span: Span


@attrs.frozen
class _Into:
    name: str
    span: Span
    shape: tuple[ast.Expr, ...] | None


@attrs.frozen
class _Part:
    name: str
    span: Span
    transposed: bool


def _unquote(token: Token) -> str:
    return str(token)[1:-1]


@v_args(meta=True)
class _Builder(Transformer[Token, Any]):
    """Maps parse-tree rules to syntax-tree classes; only tokens are converted by hand.

    Each method is named after a rule (or an alias) of the grammar and receives the rule's
    position and its children, already built.
    """

    def __init__(
        self,
        path: str,
        lines: list[str],
        line_offset: int = 0,
        column_offset: int = 0,
        included_from: tuple[Span, ...] = (),
    ):
        super().__init__()
        self._path = path
        self._included_from = included_from
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
        return Span(self._path, line, column, end_line, end_column, source, self._included_from)

    def _meta(self, meta: Meta) -> Span:
        return self._span(meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, token: Token) -> Span:
        line, column, end_line, end_column = token.line, token.column, token.end_line, token.end_column
        # the lexer places every token it makes; only hand-made tokens lack a place
        assert line is not None and column is not None and end_line is not None and end_column is not None
        return self._span(line, column, end_line, end_column)

    # -- expressions
    def int(self, meta: Meta, children: list[Token]) -> ast.Num:
        (tok,) = children
        digits = tok.replace("_", "")
        if len(digits) > _MAX_DIGITS:
            raise LayoutSyntaxError(f"an integer of {len(digits)} digits is too long", self._tok(tok))
        return ast.Num(int(digits), self._tok(tok))

    def name(self, meta: Meta, children: list[Token]) -> ast.Name:
        (tok,) = children
        return ast.Name(str(tok), self._tok(tok))

    def attr(self, meta: Meta, children: list[Token]) -> ast.Attr:
        obj, key = children
        return ast.Attr(str(obj), str(key), self._meta(meta))

    def call(self, meta: Meta, children: list[Any]) -> ast.Call:
        function, *args = children
        present = tuple(a for a in args if a is not None)  # the optional trailing comma
        return ast.Call(str(function), present, self._meta(meta), self._tok(function))

    def _binop(self, op: str, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        left, right = children
        return ast.BinOp(op, left, right, self._meta(meta))

    def add(self, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        return self._binop("+", meta, children)

    def sub(self, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        return self._binop("-", meta, children)

    def mul(self, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        return self._binop("*", meta, children)

    def floordiv(self, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        return self._binop("//", meta, children)

    def mod(self, meta: Meta, children: list[ast.Expr]) -> ast.BinOp:
        return self._binop("%", meta, children)

    def neg(self, meta: Meta, children: list[ast.Expr]) -> ast.Neg:
        return ast.Neg(children[0], self._meta(meta))

    # -- statements
    def start(self, meta: Meta, children: list[ast.Statement]) -> tuple[ast.Statement, ...]:
        return tuple(children)

    def include(self, meta: Meta, children: list[Token]) -> ast.Include:
        return ast.Include(_unquote(children[0]), self._meta(meta))

    def let(self, meta: Meta, children: list[Any]) -> ast.Let:
        name, value = children
        return ast.Let(str(name), value, self._meta(meta))

    def require(self, meta: Meta, children: list[Any]) -> ast.Require:
        left, op, right, message = children
        return ast.Require(left, str(op), right, _unquote(message) if message is not None else None, self._meta(meta))

    def topology(self, meta: Meta, children: list[Any]) -> ast.Topology:
        name, *entries = children
        present = tuple(e for e in entries if e is not None)  # the block is optional after a preset name
        return ast.Topology(str(name) if name is not None else None, present, self._meta(meta))

    def topology_entry(self, meta: Meta, children: list[Token]) -> ast.TopologyEntry:
        key, quantity = children
        match = _QUANTITY.fullmatch(str(quantity))
        if match is None:  # the grammar's QUANTITY is narrower than this pattern
            raise LayoutSyntaxError(f"cannot read the quantity '{quantity}'", self._tok(quantity))
        number, unit = match.group(1), match.group(2)
        return ast.TopologyEntry(str(key), float(number.replace("_", "")), unit, self._meta(meta))

    def range(self, meta: Meta, children: list[ast.Expr]) -> ast.Range:
        start, stop = children
        return ast.Range(start, stop, self._meta(meta))

    def axis(self, meta: Meta, children: list[Any]) -> ast.AxisDecl:
        name, size = children
        return ast.AxisDecl(str(name), size, self._meta(meta))

    def mesh_ranks(self, meta: Meta, children: list[Any]) -> _Ranks:
        (ranks,) = children
        items = ranks if isinstance(ranks, tuple) else (ranks,)
        return _Ranks(items, self._meta(meta))

    def rank_list(self, meta: Meta, children: list[Any]) -> tuple[ast.Expr | ast.Range, ...]:
        return tuple(c for c in children if c is not None)

    def mesh(self, meta: Meta, children: list[Any]) -> ast.MeshDecl:
        name, *rest = children
        axes = tuple(a for a in rest if isinstance(a, ast.AxisDecl))
        ranks = next((r for r in rest if isinstance(r, _Ranks)), None)
        items, ranks_span = (ranks.items, ranks.span) if ranks is not None else (None, None)
        return ast.MeshDecl(str(name), axes, items, ranks_span, self._meta(meta))

    def shape(self, meta: Meta, children: list[ast.Expr | None]) -> tuple[ast.Expr, ...]:
        return tuple(c for c in children if c is not None)

    def binding(self, meta: Meta, children: list[Any]) -> ast.Binding:
        name, rng = children
        return ast.Binding(str(name), rng, self._meta(meta))

    def for_clause(self, meta: Meta, children: list[ast.Binding]) -> tuple[ast.Binding, ...]:
        return tuple(children)

    def tensor(self, meta: Meta, children: list[Any]) -> ast.TensorDecl:
        name, shape, dtype, bindings = children
        return ast.TensorDecl(
            _unquote(name),
            self._tok(name),
            shape,
            str(dtype),
            self._tok(dtype),
            bindings or (),
            self._meta(meta),
        )

    def tensors_from(self, meta: Meta, children: list[Any]) -> ast.TensorsFrom:
        kind, path, base, alias, dtype, dtypes = children
        assert kind is not None and path is not None  # required by the grammar
        return ast.TensorsFrom(
            str(kind),
            self._tok(kind),
            _unquote(path),
            self._tok(path),
            str(alias) if alias is not None else None,
            str(dtype) if dtype is not None else None,
            self._meta(meta),
            dtypes or (),
            str(base) if base is not None else None,
            self._tok(base) if base is not None else None,
        )

    def dtype_body(self, meta: Meta, children: list[ast.DtypeDecl]) -> tuple[ast.DtypeDecl, ...]:
        return tuple(children)

    def dtype_rule(self, meta: Meta, children: list[Token]) -> ast.DtypeDecl:
        pattern, dtype = children
        return ast.DtypeDecl(_unquote(pattern), self._tok(pattern), str(dtype), self._tok(dtype), self._meta(meta))

    # -- layouts
    def rule_target(self, meta: Meta, children: list[Token]) -> tuple[str | None, Span]:
        (tok,) = children
        return (None if tok.type == "DEFAULT" else _unquote(tok), self._tok(tok))

    def replicate_all(self, meta: Meta, children: list[Token]) -> tuple[()]:
        return ()

    def rule_body(self, meta: Meta, children: list[ast.SelectEntry | ast.PlacementEntry]) -> tuple[Any, ...]:
        return tuple(children)

    def rule(self, meta: Meta, children: list[Any]) -> ast.RuleDecl:
        (pattern, pattern_span), entries = children
        return ast.RuleDecl(pattern, pattern_span, entries, self._meta(meta))

    def select(self, meta: Meta, children: list[Any]) -> ast.SelectEntry:
        axis, index = children
        return ast.SelectEntry(str(axis), index, self._meta(meta), self._tok(axis))

    def axis_placement(self, meta: Meta, children: list[Any]) -> ast.PlacementEntry:
        axis, placement = children
        return ast.PlacementEntry((str(axis),), placement, False, self._meta(meta), (self._tok(axis),))

    def ordered_placement(self, meta: Meta, children: list[Any]) -> ast.PlacementEntry:
        *axes, placement = children
        spans = tuple(self._tok(a) for a in axes)
        return ast.PlacementEntry(tuple(str(a) for a in axes), placement, True, self._meta(meta), spans)

    def replicate(self, meta: Meta, children: list[Token]) -> ast.ReplicateExpr:
        return ast.ReplicateExpr(self._meta(meta))

    def shard(self, meta: Meta, children: list[Any]) -> ast.ShardExpr:
        dim, *options = children
        return ast.ShardExpr(dim, tuple(options), self._meta(meta))

    def option(self, meta: Meta, children: list[Any]) -> ast.OptionDecl:
        name, value = children
        return ast.OptionDecl(str(name), value, self._meta(meta))

    def along(self, meta: Meta, children: list[ast.Expr]) -> _Along:
        return _Along(children[0])

    def blocks(self, meta: Meta, children: list[Any]) -> _Blocks:
        return _Blocks(tuple(children[1:]))  # after the BLOCKS keyword

    def stack(self, meta: Meta, children: list[Token]) -> _Stack:
        return _Stack(str(children[0]), self._tok(children[0]))

    def storage_part(self, meta: Meta, children: list[Any]) -> _Part:
        transposed, name = children
        return _Part(_unquote(name), self._tok(name), transposed is not None)

    def storage_view(self, meta: Meta, children: list[Any]) -> _View:
        return _View(children[0])

    def storage(self, meta: Meta, children: list[Any]) -> ast.StorageDecl:
        name, shape, view, stack, *rest = children
        along = next((item.dim for item in rest if isinstance(item, _Along)), None)
        blocks = next((item.sizes for item in rest if isinstance(item, _Blocks)), None)
        found = [item for item in rest if isinstance(item, _Part)]
        parts = tuple((p.name, p.span) for p in found)
        transposed = tuple(p.transposed for p in found) if any(p.transposed for p in found) else ()
        return ast.StorageDecl(
            _unquote(name),
            self._tok(name),
            shape,
            parts,
            along,
            blocks,
            self._meta(meta),
            (stack.name, stack.span) if stack is not None else None,
            transposed,
            view.shape if view is not None else None,
        )

    def block_sizes(self, meta: Meta, children: list[Any]) -> _Blocking:
        return _Blocking(tuple(children[1:]), self._meta(meta))  # after the BLOCKS keyword

    def block_name(self, meta: Meta, children: list[Token]) -> _Blocking:
        return _Blocking(str(children[0]), self._tok(children[0]))

    def quant_into(self, meta: Meta, children: list[Any]) -> _Into:
        name, shape = children
        return _Into(_unquote(name), self._tok(name), shape)

    def quantize(self, meta: Meta, children: list[Any]) -> ast.QuantizeDecl:
        pattern, fmt, blocking, convention, dtype, replicate, into = children
        return ast.QuantizeDecl(
            _unquote(pattern),
            self._tok(pattern),
            str(fmt),
            self._tok(fmt),
            blocking.block,
            blocking.span,
            str(convention),
            self._tok(convention),
            str(dtype),
            self._tok(dtype),
            replicate is not None,
            into.name if into is not None else None,
            into.span if into is not None else None,
            into.shape if into is not None else None,
            self._meta(meta),
        )

    def quantize_from(self, meta: Meta, children: list[Any]) -> ast.QuantizeFrom:
        alias, replicate = children
        return ast.QuantizeFrom(str(alias), self._tok(alias), replicate is not None, self._meta(meta))

    def extends(self, meta: Meta, children: list[Token]) -> Token:
        return children[0]

    def layout(self, meta: Meta, children: list[Any]) -> ast.LayoutDecl:
        generic, name, mesh, parent, *items = children
        rules = tuple(
            attrs.evolve(i, generic=True) if generic is not None else i for i in items if isinstance(i, ast.RuleDecl)
        )
        storages = tuple(i for i in items if isinstance(i, ast.StorageDecl))
        quantize = tuple(i for i in items if isinstance(i, ast.QuantizeDecl | ast.QuantizeFrom))
        return ast.LayoutDecl(
            str(name),
            str(mesh),
            self._tok(mesh),
            rules,
            storages,
            self._meta(meta),
            str(parent) if parent is not None else None,
            self._tok(parent) if parent is not None else None,
            quantize,
            generic is not None,
        )

    # -- reshards
    def policy(self, meta: Meta, children: list[Token]) -> str:
        return str(children[0])

    def policy_rule(self, meta: Meta, children: list[Any]) -> ast.PolicyDecl:
        (pattern, pattern_span), policy = children
        return ast.PolicyDecl(pattern, pattern_span, policy, self._meta(meta))

    def reshard_body(self, meta: Meta, children: list[ast.PolicyDecl]) -> tuple[ast.PolicyDecl, ...]:
        return tuple(children)

    def reshard(self, meta: Meta, children: list[Any]) -> ast.ReshardDecl:
        name, source, destination, policies = children
        return ast.ReshardDecl(
            str(name) if name is not None else None,
            str(source),
            self._tok(source),
            str(destination),
            self._tok(destination),
            policies or (),
            self._meta(meta),
        )


# ------------------------------------------------------------------- mistakes

_Hint = Callable[[Token], str | None]
"""What a mistake's hint says, given the unexpected token (None: nothing that helps)."""


def _on(token_types: Iterable[str], text: str) -> _Hint:
    """``text`` when the unexpected token is of one of ``token_types``."""
    types = frozenset(token_types)
    return lambda token: text if token.type in types else None


def _quote_it(token: Token) -> str | None:
    if token.type == "NAME":
        return f'tensor names and patterns are quoted: "{token}"'
    if token.type in ("LBRACE", "RBRACE"):
        return 'tensor names and patterns are quoted: "layers.{l}.mlp.*"'
    return None


def _lower_case(token: Token) -> str | None:
    if token in ("Shard", "Replicate", "shard_", "Shard0"):
        return "placements are written in lower case: shard(0), replicate"
    return None


#: Common mistakes: a hint and bad examples that make it. An error raised in the parser
#: state where one of the examples fails gets that hint (lark's ``match_examples``, which
#: prefers an example failing on the same token, then on a token of the same type); the
#: hint may still decline a token it does not fit.
_MISTAKES: tuple[tuple[_Hint, tuple[str, ...]], ...] = (
    (
        _quote_it,
        (
            "include w",
            "tensor w [4] fp32",
            "tensor {l}",
            'tensors from hf w "config.json"',
            'tensors from hf "config.json" { w: fp32 }',
            'tensors from hf "config.json" { "a": fp32 w: fp32 }',
            "layout l on m { w: replicate }",
            "layout l on m { {l}: replicate }",
            'layout l on m { "a": replicate w: replicate }',
            'layout l on m { "a": tp = shard(0) w: replicate }',
            'layout l on m { "a": tp = shard(0, pad = 2) w: replicate }',
            'layout l on m { "a": tp = replicate w: replicate }',
            'layout l on m { "a": (tp, dp) = shard(0) w: replicate }',
            'layout l on m { "a": pp[0] w: replicate }',
            "layout l on m { storage s = a }",
            'layout l on m { storage "s" = a }',
            'layout l on m { storage "s" [4] = a }',
            'layout l on m { storage "s" = "a" | b }',
            'layout l on m { storage "s" = "a" | "b" | c }',
            'layout l on m { storage "s" = "a" w: replicate }',
            'layout l on m { storage "s" = "a" | "b" w: replicate }',
            'layout l on m { storage "s" = "a" blocks(2) w: replicate }',
            "reshard a -> b { w: broadcast }",
            'reshard a -> b { "a": reshard w: broadcast }',
        ),
    ),
    (
        _on(["EQUAL"], "a rule's pattern is followed by ':'"),
        (
            'layout l on m { "w" = shard(0) }',
            "layout l on m { default = shard(0) }",
        ),
    ),
    (
        _on(["NAME", "LPAR"], 'a rule is written  "pattern": axis = shard(dim), ...'),
        (
            'layout l on m { "w" tp = shard(0) }',
            'layout l on m { "w" (tp, dp) = shard(0) }',
            "layout l on m { default tp = shard(0) }",
            "layout l on m { default (tp, dp) = shard(0) }",
        ),
    ),
    (
        _on(["COLON"], "an axis is placed with '=': tp = shard(0)"),
        (
            'layout l on m { "w": tp : shard(0) }',
            'layout l on m { "w": (tp, dp) : shard(0) }',
            "mesh m [tp : 2]",
        ),
    ),
    (
        _lower_case,
        (
            'layout l on m { "w": tp = Shard(0) }',
            'layout l on m { "w": (tp, dp) = Shard(0) }',
        ),
    ),
)


@attrs.frozen
class _State:
    """A parser state known by its LR state alone.

    Lark compares parser states by the depth of their stack too, which changes with where a
    construct sits (a file's first statement or a later one, a rule's first entry or a
    later one) but not what may follow; examples are compared by what may follow.
    """

    position: Any


def _in_state(err: UnexpectedInput) -> UnexpectedInput:
    err.state = _State(err.state.position)
    return err


def _parse_example(text: str) -> Tree[Token]:
    try:
        return _parse_program(text)
    except UnexpectedInput as err:
        raise _in_state(err) from None


#: Characters that start no token of the language, and what their writer probably meant:
#: (a message replacing "unexpected character", or None; the hint).
_CHARACTER_MISTAKES: dict[str, tuple[str | None, str]] = {
    "/": (None, "integer division is written '//'"),
    "'": (None, "names are quoted with double quotes"),
    # the string token did not match: no closing quote on this line
    '"': ("a quoted name is not closed on this line", "a quoted name ends with '\"' before the end of its line"),
}

_UNCLOSED_BLOCK = "a '{' block is not closed"

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


def _describe_expected(expected: Iterable[str]) -> str:
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


def _hint_for(err: UnexpectedToken) -> str | None:
    """The hint of the mistake that fails where ``err`` does, if it is a common one."""
    if err.token.type == "$END" and "RBRACE" in err.expected:
        # the file may end in any state inside a block; what may follow tells them all
        return _UNCLOSED_BLOCK
    hint = _in_state(err).match_examples(_parse_example, _MISTAKES, token_type_match_fallback=True)
    return hint(err.token) if hint is not None else None


def _error_from_lark(err: LarkError, path: str, lines: list[str]) -> LayoutSyntaxError:
    line = getattr(err, "line", None) or len(lines) or 1
    column = getattr(err, "column", None) or 1
    if isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END"):
        line = max(1, len(lines))
        column = len(lines[-1].rstrip("\n")) + 1 if lines else 1
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    hint: str | None
    if isinstance(err, UnexpectedToken):
        token = err.token
        width = max(1, len(str(token))) if token.type != "$END" else 1
        shown = "end of the file" if token.type == "$END" else f"'{elide(str(token), _SHOWN_TOKEN)}'"
        message = f"unexpected {shown}; expected {_describe_expected(err.expected)}"
        hint = _hint_for(err)
        span = Span(path, line, column, line, column + width, source)
    elif isinstance(err, UnexpectedCharacters):
        char = err.char
        message = f"unexpected character '{char}'"
        if err.allowed:
            message += f"; expected {_describe_expected(err.allowed)}"
        replaced, hint = _CHARACTER_MISTAKES.get(char, (None, None))
        message = replaced or message
        span = Span(path, line, column, line, column + 1, source)
    else:  # UnexpectedEOF and anything else lark may raise
        expected = getattr(err, "expected", None) or ()
        message = "unexpected end of the file"
        if expected:
            message += f"; expected {_describe_expected(expected)}"
        hint = None
        span = Span(path, line, column, line, column + 1, source)
    return LayoutSyntaxError(message, span, hint)


# ----------------------------------------------------------------------- entry


def parse(
    text: str, path: str = "<string>", included_from: tuple[Span, ...] = (), budget: TokenBudget | None = None
) -> ast.File:
    """Parse the text of one ``.layout`` file; raises LayoutSyntaxError with a caret.

    ``included_from``: the ``include`` statements that led to this file, innermost first;
    every span of the result (and of an error) carries them. ``budget``: the tokens the
    file may hold, shared with the other files of its program and decreased by this one's
    (default: a budget of its own, :data:`~.limits.MAX_PROGRAM_TOKENS`).
    """
    try:
        return _parse(text, path, included_from, budget if budget is not None else TokenBudget())
    except LayoutError as err:
        if err.span is not None and not err.span.included_from:
            err.span = attrs.evolve(err.span, included_from=included_from)
        raise


def _parse(text: str, path: str, included_from: tuple[Span, ...], budget: TokenBudget) -> ast.File:
    lines = text.splitlines(keepends=True)
    if all(not ln.strip() or ln.lstrip().startswith("#") for ln in lines):
        raise LayoutSyntaxError(
            "the file holds no statements",
            Span(path, 1, 1, 1, 2, lines[0] if lines else ""),
            "a program declares at least one of: " + ", ".join(STATEMENT_KEYWORDS),
        )
    try:
        tree = _parse_program(text, budget, path, lines)
    except LarkError as err:
        raise _error_from_lark(err, path, lines) from None
    builder = _Builder(path, lines, included_from=included_from)
    statements = []
    for node in tree.children:  # one statement at a time, so that a failure has a place
        assert isinstance(node, Tree)  # every child of the start rule is a statement
        statements.append(_build(builder, node))
    return ast.File(path, text, tuple(statements))


def _build(builder: _Builder, node: Tree[Token]) -> Any:
    return _transform(
        builder,
        node,
        lambda: LayoutSyntaxError(
            "the statement nests too deeply to be read",
            builder._meta(node.meta),
            "split long expressions with 'let' constants",
        ),
    )


def _transform(builder: _Builder, tree: Tree[Token], too_deep: Callable[[], LayoutSyntaxError]) -> Any:
    """``builder.transform(tree)``, raising the user's LayoutError itself (not lark's wrapper)
    and ``too_deep()`` for a tree nested past Python's recursion limit."""
    try:
        return builder.transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, LayoutError):
            raise err.orig_exc from None
        if not isinstance(err.orig_exc, RecursionError):
            raise
    except RecursionError:
        pass
    raise too_deep()


def parse_expression(text: str, span: Span) -> ast.Expr:
    """Parse an expression embedded in a string (``{l % 4}`` in a storage name) at ``span``.

    Positions in the result point into the enclosing file: ``span`` is where ``text`` starts.
    """
    if len(text) > MAX_EMBEDDED_EXPRESSION:
        raise LayoutSyntaxError(
            f"the expression '{elide(text, _SHOWN_TOKEN)}' is {len(text):,} characters long; an expression in a"
            f" name holds at most {MAX_EMBEDDED_EXPRESSION:,}",
            attrs.evolve(span, end_line=span.line, end_column=span.column + 1),
            "compute it in a 'let' constant and name the constant",
        )
    try:
        tree = _parser().parse(text, start="expr")
    except LarkError as err:
        column = span.column + max(0, (getattr(err, "column", 1) or 1) - 1)
        raise LayoutSyntaxError(
            f"cannot read the expression '{elide(text, _SHOWN_TOKEN)}'",
            attrs.evolve(span, column=column, end_line=span.line, end_column=column + 1),
            "expressions use integers, names, + - * // %, min, max, cdiv and parentheses",
        ) from None
    lines = [""] * (span.line - 1) + [span.source_line]
    builder = _Builder(span.path, lines, span.line - 1, span.column - 1, span.included_from)
    return _transform(
        builder,
        tree,
        lambda: LayoutSyntaxError(
            "the expression nests too deeply to be read",
            attrs.evolve(span, end_line=span.line, end_column=span.column + 1),
            "split it with 'let' constants",
        ),
    )
