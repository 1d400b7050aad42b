"""Errors by who must act.

Two families, and nothing else crosses the public API:

- **A user's mistake** raises a :class:`LayoutError` (a ``ValueError``): bad syntax, an
  unknown name, a value that cannot be right, in a ``.layout`` file, in the Python API or
  on the command line. The command line exits with :attr:`ExitCode.BAD_INPUT` (2).
- **A failure at run time** raises a :class:`RuntimeFailure` (a ``RuntimeError``): a peer
  that died or hung, ranks that compiled different plans, NCCL or CUDA failing, a
  membership change that cannot complete, data that no surviving rank holds. The input
  was fine; the job was not. The command line exits with :attr:`ExitCode.FAILURE` (1).

Both carry typed fields (``peers``, ``tensor``, ``rank``, ``regions``...) instead of
facts written only into their message. When a user's mistake has a place in a source
file the error carries a :class:`Span`, and ``str(error)`` shows the file, line and
column, the source line, and a caret under the offending text::

    examples/broken.layout:7:41: error: unknown axis 'tpp' in mesh 'train' (axes: pp, tp)
        7 |     "layers.{l}.self_attn.q_proj.weight": tpp = shard(0)
          |                                           ^~~
      hint: did you mean 'tp'?

The command line prints exactly this text (or, with ``--json``, ``error.to_json()``); it
never shows a Python traceback for a user's mistake.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import enum
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from .core import _core

__all__ = [
    "MESSAGE_LIMIT",
    "SOURCE_WINDOW",
    "AgreementError",
    "CudaError",
    "DataLossError",
    "ExecutionError",
    "ExitCode",
    "LayoutError",
    "LayoutFileError",
    "LayoutIncludeError",
    "LayoutNameError",
    "LayoutSyntaxError",
    "LayoutValueError",
    "MembershipError",
    "ModelDescriptionError",
    "NcclError",
    "NcclTimeoutError",
    "NcclUnavailableError",
    "RuntimeFailure",
    "Span",
    "closest_name",
    "core_errors",
    "did_you_mean",
    "from_nccl_core",
]


#: the most characters of a source line an error shows (a window around the offending text)
SOURCE_WINDOW = 120
#: the most characters of a message or hint a user's mistake prints: a message quoting the
#: input (a name, a pattern) could otherwise be megabytes
MESSAGE_LIMIT = 2000


def _bounded(text: str) -> str:
    """``text``, its middle cut to ``...`` past MESSAGE_LIMIT characters (head and tail both
    say something: what is wrong, and what was expected)."""
    if len(text) <= MESSAGE_LIMIT:
        return text
    half = (MESSAGE_LIMIT - 3) // 2
    return f"{text[:half]}...{text[len(text) - half :]}"


class ExitCode(enum.IntEnum):
    """The command line's exit status: who must act."""

    OK = 0  #: success
    FAILURE = 1  #: a failure at run time (:class:`RuntimeFailure`, a verification mismatch): the input was fine
    BAD_INPUT = 2  #: a user's mistake (:class:`LayoutError`): usage, a bad .layout file, an unknown name
    INTERNAL = 3  #: a bug in layoutlang; please report it


@attrs.frozen
class Span:
    """A region of a source file: 1-based line and column, end exclusive.

    ``included_from``: where the file was included (the ``include`` statements, innermost
    first), when it was read through an include or a preset.
    """

    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    source_line: str = ""
    included_from: tuple[Span, ...] = attrs.field(default=(), eq=False, repr=False)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"

    def caret(self) -> str:
        """The source line and a ``^~~`` marker under the span (first line only).

        A line longer than :data:`SOURCE_WINDOW` characters is shown as a window of that
        many around the span's start, ``...`` marking what is cut on either side, so an
        error in a file of one long line prints a few hundred bytes, not the line.
        """
        line = self.source_line.rstrip("\n")
        start = min(max(0, self.column - 1), len(line))  # where the marker starts, 0-based
        end = (self.end_column - 1) if self.end_line == self.line else len(line)
        width = max(1, end - start)
        before = after = ""
        if len(line) > SOURCE_WINDOW:
            # a third of the window before the span: what leads to the mistake reads first
            low = max(0, min(start - SOURCE_WINDOW // 3, len(line) - SOURCE_WINDOW))
            high = low + SOURCE_WINDOW
            before, after = ("..." if low > 0 else ""), ("..." if high < len(line) else "")
            line = line[low:high]
            start -= low
            width = max(1, min(width, len(line) - start))
        text = before + line.expandtabs(1) + after  # a tab as one column, as lark counts them
        gutter = f"{self.line:>5} | "
        pad = " " * (len(gutter) - 2) + "| "
        return f"{gutter}{text}\n{pad}{' ' * (len(before) + start)}^{'~' * (width - 1)}"


class LayoutError(ValueError):
    """A user's mistake: bad syntax, an unknown name, a value that cannot be right.

    The command line exits with :attr:`ExitCode.BAD_INPUT`.

    ``message`` says what is wrong and names the offending mesh, axis, tensor or rule;
    ``span`` (optional) says where; ``hint`` (optional) says what was probably meant.
    """

    kind = "error"
    exit_code = ExitCode.BAD_INPUT

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

    def reworded(self, message: str) -> LayoutError:
        """The same error (its type, span, hint and fields) saying ``message``: a rank's own
        mistake reported in the words every rank saw when it stopped them all.

        >>> from layoutlang.errors import LayoutValueError
        >>> err = LayoutValueError("storage 'w' is too small", tensor="w", rank=3)
        >>> again = err.reworded("rank 3 is not ready: storage 'w' is too small")
        >>> type(again).__name__, again.message, again.tensor, again.rank
        ('LayoutValueError', "rank 3 is not ready: storage 'w' is too small", 'w', 3)
        """
        out = copy.copy(self)
        out.message = message
        out.args = (message,)
        return out

    def __str__(self) -> str:
        message = _bounded(self.message)
        head = f"{self.span}: error: {message}" if self.span else f"error: {message}"
        parts = [head]
        if self.span is not None and self.span.source_line:
            parts.append(self.span.caret())
        if self.span is not None:
            parts.extend(f"  included from {where}" for where in self.span.included_from)
        if self.hint:
            parts.append(f"  hint: {_bounded(self.hint)}")
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        """One JSON-ready object, as the command line prints with ``--json`` (the message
        and hint bounded as in ``str()``)."""
        out: dict[str, Any] = {"error": self.kind, "message": _bounded(self.message)}
        if self.span is not None:
            out.update(
                file=self.span.path,
                line=self.span.line,
                column=self.span.column,
                end_line=self.span.end_line,
                end_column=self.span.end_column,
            )
            if self.span.included_from:
                out["included_from"] = [
                    {"file": s.path, "line": s.line, "column": s.column} for s in self.span.included_from
                ]
        if self.hint:
            out["hint"] = _bounded(self.hint)
        return out


class LayoutSyntaxError(LayoutError):
    """The text is not a valid ``.layout`` program (or the file is empty or not UTF-8)."""

    kind = "syntax"


class LayoutFileError(LayoutSyntaxError):
    """A ``.layout`` file that cannot be read: missing, unreadable, not a regular file, or over
    the size limit (a :class:`LayoutSyntaxError` too, so existing handlers still catch it)."""

    kind = "file"


class LayoutNameError(LayoutError):
    """A name (mesh, axis, layout, tensor, storage, capture) is unknown or defined twice."""

    kind = "name"


class LayoutValueError(LayoutError):
    """Well-formed text whose meaning cannot be right: sizes, ranks, dims, rules, storages.

    When the C++ core found the mistake (:meth:`from_core`), ``tensor`` names the tensor
    concerned and ``rank`` the rank (each None when none is).
    """

    kind = "value"

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        hint: str | None = None,
        *,
        tensor: str | None = None,
        rank: int | None = None,
    ):
        super().__init__(message, span, hint)
        self.tensor = tensor
        self.rank = rank

    @classmethod
    def from_core(
        cls, err: _core.CoreError, tensors: Sequence[str] = (), span: Span | None = None
    ) -> LayoutValueError:
        """The error a user reads for a mistake the C++ core found. The core knows tensors by
        their index; ``tensors`` (the layout's tensor names, in order) names the tensor."""
        name = tensors[err.tensor] if err.tensor is not None and 0 <= err.tensor < len(tensors) else None
        message = f"tensor '{name}': {err.detail}" if name is not None else str(err)
        return cls(message, span, tensor=name, rank=err.rank)


class LayoutIncludeError(LayoutError):
    """An ``include`` that is missing, unreadable or part of a cycle."""

    kind = "include"


class ModelDescriptionError(LayoutError):
    """A model description (``config.json``, safetensors header or index) that cannot be read."""

    kind = "model"


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (a likely misspelling of it), or None when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest candidate, or None when nothing is close."""
    close = closest_name(name, candidates)
    return f"did you mean '{close}'?" if close is not None else None


# ------------------------------------------------------------- failures at run time


class RuntimeFailure(RuntimeError):
    """A failure at run time: the input was right, the job went wrong.

    ``message`` says what happened; ``rank`` (optional) is the rank that reports it;
    ``peers`` the ranks it was exchanging with when it failed (empty when unknown);
    ``hint`` (optional) says what to do. The command line exits with :attr:`ExitCode.FAILURE`.
    """

    kind = "failure"
    exit_code = ExitCode.FAILURE

    def __init__(
        self, message: str, *, rank: int | None = None, peers: Sequence[int] = (), hint: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.peers: list[int] = sorted(set(peers))
        self.hint = hint

    def __str__(self) -> str:
        head = f"error: {self.message}"
        return f"{head}\n  hint: {self.hint}" if self.hint else head

    def to_json(self) -> dict[str, Any]:
        """One JSON-ready object, as the command line prints with ``--json``."""
        out: dict[str, Any] = {"error": self.kind, "message": self.message}
        if self.rank is not None:
            out["rank"] = self.rank
        if self.peers:
            out["peers"] = self.peers
        if self.hint:
            out["hint"] = self.hint
        return out


class ExecutionError(RuntimeFailure):
    """Running a plan failed: bad storages, a peer that died or hung, a transport error."""

    kind = "execution"


class AgreementError(ExecutionError):
    """Ranks compiled different plans (or some could not compile one); nothing was moved."""

    kind = "agreement"


class NcclError(ExecutionError):
    """An NCCL call failed: ``call`` names it, ``code`` is its ``ncclResult_t``."""

    kind = "nccl"

    def __init__(
        self,
        message: str,
        call: str | None = None,
        code: int | None = None,
        hint: str | None = None,
        *,
        rank: int | None = None,
        peers: Sequence[int] = (),
    ):
        super().__init__(message, rank=rank, peers=peers, hint=hint)
        self.call = call
        self.code = code

    @property
    def result(self) -> str | None:
        """The name of the result (``ncclRemoteError``)."""
        return None if self.code is None else _core.nccl.result_name(self.code)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update(call=self.call, code=self.code)
        return out


class NcclTimeoutError(NcclError):
    """An NCCL operation did not complete before its deadline."""

    kind = "nccl-timeout"


class NcclUnavailableError(NcclError):
    """No NCCL library could be loaded, or it lacks a function (``symbol``, new in ``introduced``)."""

    kind = "nccl-unavailable"

    def __init__(self, message: str, symbol: str | None = None, introduced: str | None = None):
        super().__init__(message, call=symbol)
        self.symbol = symbol
        self.introduced = introduced or None


class CudaError(ExecutionError):
    """A CUDA runtime call failed (``code`` -1: the runtime could not be loaded)."""

    kind = "cuda"

    def __init__(self, message: str, call: str | None = None, code: int | None = None):
        super().__init__(message)
        self.call = call
        self.code = code


class MembershipError(ExecutionError):
    """Membership could not be established: no agreement in time, or an unknown generation."""

    kind = "membership"


class JobEndedError(MembershipError):
    """A joiner asked to be admitted into a session its members ended (its steps are done, or
    it cannot go on): no generation will ever admit it. Nothing of the job is lost."""


class DataLossError(RuntimeFailure):
    """Some regions of logical tensors are held by no surviving rank of any given layout.

    ``regions`` lists every lost region as ``(tensor, offsets, sizes)``.
    """

    kind = "loss"

    def __init__(
        self,
        message: str,
        regions: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
        hint: str | None = None,
    ):
        super().__init__(message, hint=hint)
        self.regions = list(regions)


# ------------------------------------------------------------- errors of the C++ core


def from_nccl_core(err: _core.nccl.NcclCoreError) -> NcclError | CudaError:
    """The error a user reads for a failure of the NCCL core, by its ``kind``; the message
    and fields are the core's."""
    message = str(err)
    if err.kind == "timeout":
        return NcclTimeoutError(message, err.call, err.code)
    if err.kind == "unavailable":
        return NcclUnavailableError(message, err.symbol, err.introduced)
    if err.kind == "cuda":
        return CudaError(message, err.call, err.code)
    return NcclError(message, err.call, err.code)


@contextlib.contextmanager
def core_errors(tensors: Sequence[str] = (), span: Span | None = None) -> Iterator[None]:
    """Calls into the C++ core raise layoutlang's errors: a ``_core.CoreError`` becomes a
    :class:`LayoutValueError` (naming the tensor from ``tensors``, placed at ``span``), a
    ``_core.nccl.NcclCoreError`` the :class:`NcclError` family or :class:`CudaError`.

    The core imports no Python package, so it cannot raise these itself.
    """
    try:
        yield
    except _core.CoreError as err:
        raise LayoutValueError.from_core(err, tensors, span) from None
    except _core.nccl.NcclCoreError as err:
        raise from_nccl_core(err) from None
