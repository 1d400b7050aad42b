"""Reading sources: files, ``include`` statements and the packaged presets.

A program's text comes from a file (:func:`read_source`: UTF-8, an optional byte order
mark) or a string. ``include "PATH"`` reads another file relative to the including one;
``include "preset:NAME"`` reads ``NAME.layout`` or ``NAME/model.layout`` from the presets
shipped with layoutlang. Each file is read once, so presets can be included from several
places, and a file that includes itself, directly or not, is an error naming the chain.

Every file is read by :func:`layoutlang.io._files.read_limited`: only regular files (a FIFO,
a device or a directory is refused at once, never waited on) of at most
:data:`~.limits.MAX_PROGRAM_BYTES`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from ..errors import LayoutError, LayoutIncludeError, LayoutSyntaxError, Span, did_you_mean
from ..io._files import read_limited
from . import ast
from .limits import MAX_INCLUDE_DEPTH, MAX_PROGRAM_BYTES

__all__ = ["PRESET_PREFIX", "Includes", "Source", "is_preset", "preset_file", "read_source"]

#: ``include "preset:NAME"`` reads NAME.layout, or NAME/model.layout, from the packaged presets
PRESET_PREFIX = "preset:"
_PRESETS = Path(__file__).resolve().parent / "presets"
_BYTE_ORDER_MARK = b"\xef\xbb\xbf"  # as some editors write at the start of UTF-8 text


@attrs.frozen
class Source:
    """The text of one file and where it is: ``display`` in messages, ``real`` (the resolved
    path, None for text given as a string) to find its includes and notice cycles."""

    text: str
    display: str
    real: str | None
    #: the includes that led here, innermost first (what errors in this file also name)
    included_from: tuple[Span, ...] = ()

    @property
    def folder(self) -> str:
        """The folder its includes are shown relative to."""
        return os.path.dirname(self.display)

    @property
    def real_folder(self) -> str:
        """The folder its includes and model descriptions are read from."""
        return os.path.dirname(self.real) if self.real is not None else os.getcwd()


def read_source(path: str | os.PathLike[str], display: str | None = None) -> str:
    """The text of a ``.layout`` file; missing, unreadable, non-regular (a FIFO, a device, a
    directory), oversized (:data:`~.limits.MAX_PROGRAM_BYTES`) or non-UTF-8 files are
    LayoutSyntaxErrors naming the file."""
    display = display or str(path)
    if not os.path.lexists(path):
        raise LayoutSyntaxError(f"no such file: {display}")
    data = read_limited(path, MAX_PROGRAM_BYTES, ".layout file", display=display, error=LayoutSyntaxError)
    data = data.removeprefix(_BYTE_ORDER_MARK)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        line_start = data.rfind(b"\n", 0, err.start) + 1
        column = len(data[line_start : err.start].decode("utf-8")) + 1  # in characters, as lark counts
        text = data.decode("utf-8", errors="replace").splitlines()
        source = text[line - 1] if line <= len(text) else ""
        raise LayoutSyntaxError(
            f"the file is not UTF-8 text (byte 0x{data[err.start]:02x})",
            Span(display, line, column, line, column + 1, source),
        ) from None


def preset_file(name: str, span: Span) -> str:
    """The packaged file of ``include "preset:NAME"``: presets/NAME.layout or presets/NAME/model.layout."""
    if name and ".." not in name.split("/") and not os.path.isabs(name):
        for candidate in (_PRESETS / f"{name}.layout", _PRESETS / name / "model.layout"):
            if candidate.is_file():
                return os.path.realpath(candidate)
    known = sorted(
        str(file.relative_to(_PRESETS).with_suffix("").as_posix()).removesuffix("/model")
        for file in _PRESETS.rglob("*.layout")
    )
    raise LayoutIncludeError(f"unknown preset '{name}' (presets: {', '.join(known)})", span, did_you_mean(name, known))


def is_preset(path: str) -> bool:
    """Whether ``path`` (as a span names it) is one of the packaged presets."""
    return os.path.realpath(path).startswith(f"{_PRESETS}{os.sep}")


def _layout_files(folder: str) -> list[str]:
    try:
        return [f for f in os.listdir(folder) if f.endswith(".layout")]
    except OSError:
        return []


class Includes:
    """The files a program has read, and the chain of includes being read now."""

    def __init__(self) -> None:
        self._read: set[str] = set()
        self._chain: list[str] = []

    @contextlib.contextmanager
    def reading(self, source: Source) -> Iterator[None]:
        """While ``source``'s statements are elaborated: it is part of the include chain."""
        if source.real is None:
            yield
            return
        self._chain.append(source.real)
        self._read.add(source.real)
        try:
            yield
        finally:
            self._chain.pop()

    def source(self, node: ast.Include, including: Source) -> Source | None:
        """The file ``node`` includes from ``including``; None if it was read already."""
        if node.path.startswith(PRESET_PREFIX):
            real = display = preset_file(node.path[len(PRESET_PREFIX) :], node.span)
        else:
            real = os.path.realpath(os.path.join(including.real_folder, node.path))
            display = os.path.normpath(os.path.join(including.folder, node.path))
        if real in self._chain:
            chain = [os.path.basename(p) for p in self._chain[self._chain.index(real) :]] + [os.path.basename(real)]
            raise LayoutIncludeError(f"include cycle: {' -> '.join(chain)}", node.span)
        if real in self._read:
            return None
        if len(self._chain) >= MAX_INCLUDE_DEPTH:  # the reader recurses once per file of the chain
            raise LayoutIncludeError(
                f"cannot include '{node.path}': includes nest more than {MAX_INCLUDE_DEPTH} files deep"
                f" (from {os.path.basename(self._chain[0])})",
                node.span,
            )
        if os.path.isdir(real):
            raise LayoutIncludeError(f"cannot include '{node.path}': it is a directory ({display})", node.span)
        if not os.path.exists(real):
            raise LayoutIncludeError(
                f"cannot include '{node.path}': no such file ({display})",
                node.span,
                did_you_mean(os.path.basename(node.path), _layout_files(os.path.dirname(real))),
            )
        led_here = (attrs.evolve(node.span, included_from=()), *node.span.included_from)
        try:
            text = read_source(real, display)
        except LayoutError as err:
            if err.span is None:  # the file as a whole: not a regular file, too large, unreadable
                raise LayoutIncludeError(f"cannot include '{node.path}': {err.message}", node.span) from None
            err.span = attrs.evolve(err.span, included_from=led_here)  # a place in it: not UTF-8
            raise
        return Source(text, display, real, led_here)
