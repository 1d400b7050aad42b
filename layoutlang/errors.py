"""The one error family users see.

Every mistake a user can make (in a ``.layout`` file, in the Python API, on the command
line) raises a :class:`LayoutError`. When the mistake has a place in a source file the
error carries a :class:`Span`, and ``str(error)`` shows the file, line and column, the
source line, and a caret under the offending text::

    examples/broken.layout:7:41: error: unknown axis 'tpp' in mesh 'train' (axes: pp, tp)
        7 |     "layers.{l}.self_attn.q_proj.weight": tpp = shard(0)
          |                                           ^~~
      hint: did you mean 'tp'?

The command line prints exactly this text (or, with ``--json``, :meth:`LayoutError.to_json`)
and exits with status 2; it never shows a Python traceback for a user's mistake.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = [
    "Span",
    "LayoutError",
    "LayoutSyntaxError",
    "LayoutNameError",
    "LayoutValueError",
    "LayoutIncludeError",
    "ModelDescriptionError",
    "did_you_mean",
]


@attrs.frozen
class Span:
    """A region of a source file: 1-based line and column, end exclusive."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    source_line: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"

    def caret(self) -> str:
        """The source line and a ``^~~`` marker under the span (first line only)."""
        text = self.source_line.rstrip("\n").expandtabs(1)
        width = (self.end_column - self.column) if self.end_line == self.line else len(text) - self.column + 1
        width = max(1, width)
        gutter = f"{self.line:>5} | "
        pad = " " * (len(gutter) - 2) + "| "
        return f"{gutter}{text}\n{pad}{' ' * (self.column - 1)}^{'~' * (width - 1)}"


class LayoutError(ValueError):
    """A user's mistake: bad syntax, an unknown name, a value that cannot be right.

    ``message`` says what is wrong and names the offending mesh, axis, tensor or rule;
    ``span`` (optional) says where; ``hint`` (optional) says what was probably meant.
    """

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint

    def with_span(self, span: Span | None) -> LayoutError:
        """Attach ``span`` if the error has none yet (errors found deep down get their place late)."""
        if self.span is None and span is not None:
            self.span = span
        return self

    def __str__(self) -> str:
        head = f"{self.span}: error: {self.message}" if self.span else f"error: {self.message}"
        parts = [head]
        if self.span is not None and self.span.source_line:
            parts.append(self.span.caret())
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        """One JSON-ready object, as the command line prints with ``--json``."""
        out: dict[str, Any] = {"error": self.kind, "message": self.message}
        if self.span is not None:
            out.update(
                file=self.span.path,
                line=self.span.line,
                column=self.span.column,
                end_line=self.span.end_line,
                end_column=self.span.end_column,
            )
        if self.hint:
            out["hint"] = self.hint
        return out


class LayoutSyntaxError(LayoutError):
    """The text is not a valid ``.layout`` program (or the file is empty or not UTF-8)."""

    kind = "syntax"


class LayoutNameError(LayoutError):
    """A name (mesh, axis, layout, tensor, storage, capture) is unknown or defined twice."""

    kind = "name"


class LayoutValueError(LayoutError):
    """Well-formed text whose meaning cannot be right: sizes, ranks, dims, rules, storages."""

    kind = "value"


class LayoutIncludeError(LayoutError):
    """An ``include`` that is missing, unreadable or part of a cycle."""

    kind = "include"


class ModelDescriptionError(LayoutError):
    """A model description (``config.json``, safetensors header or index) that cannot be read."""

    kind = "model"


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest candidate, or None when nothing is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
