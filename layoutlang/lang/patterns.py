"""Names with holes: tensor-name patterns that capture digits, and computed storage names.

In a pattern, ``{l}`` captures a whole run of digits as the integer ``l`` and ``*`` matches
any text (matching itself is :func:`layoutlang.model.compile_pattern`). A storage name may
compute from the captures: ``"decoder.layers.{l % 4}.mlp"``. Malformed braces and unknown
names point into the quoted text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

import attrs

from ..errors import LayoutNameError, LayoutSyntaxError, LayoutValueError, Span
from ..model.rules import CaptureFn
from .expressions import compile_expression
from .parser import parse_expression

__all__ = ["name_template", "pattern_captures"]

_HOLE = re.compile(r"\{([^{}]*)\}")
_CAPTURE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _inside(span: Span, start: int, end: int) -> Span:
    """The place of ``text[start:end]`` of the quoted string at ``span`` (+1: the opening quote)."""
    return attrs.evolve(span, column=span.column + start + 1, end_line=span.line, end_column=span.column + end + 1)


def pattern_captures(pattern: str, span: Span, allow_star: bool = True) -> list[str]:
    """Names captured by ``{name}`` in a pattern, in order; malformed braces point at the pattern."""
    names: list[str] = []
    for m in _HOLE.finditer(pattern):
        name = m.group(1)
        at = _inside(span, m.start(), m.end())
        if not _CAPTURE_NAME.fullmatch(name):
            raise LayoutSyntaxError(
                f"'{{{name}}}' in pattern \"{pattern}\": a capture is a plain name such as {{l}}", at
            )
        if name in names:
            raise LayoutNameError(f"capture '{{{name}}}' appears twice in pattern \"{pattern}\"", at)
        names.append(name)
    stripped = _HOLE.sub("", pattern)
    if "{" in stripped or "}" in stripped:
        raise LayoutSyntaxError(f'unbalanced brace in pattern "{pattern}"', span)
    if not allow_star and "*" in pattern:
        raise LayoutValueError(f"storage parts name tensors exactly: '*' is not allowed in \"{pattern}\"", span)
    return names


def name_template(
    template: str, span: Span, constants: Mapping[str, int], captures: Collection[str]
) -> Callable[[Mapping[str, int]], str]:
    """``"decoder.layers.{l % 4}.mlp"``: each ``{...}`` is an expression of the captures."""
    pieces: list[str | CaptureFn] = []
    pos = 0
    for m in _HOLE.finditer(template):
        pieces.append(template[pos : m.start()])
        # the expression starts after the opening quote and the brace
        expr = parse_expression(m.group(1), _inside(span, m.start() + 1, m.end() - 1))
        pieces.append(compile_expression(expr, constants, captures))
        pos = m.end()
    pieces.append(template[pos:])

    def name(values: Mapping[str, int]) -> str:
        return "".join(p if isinstance(p, str) else str(p(values)) for p in pieces)

    return name
