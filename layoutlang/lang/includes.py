"""Reading sources: files, ``include`` statements and the packaged presets.

A program's text comes from a file (:func:`read_source`: UTF-8, an optional byte order
mark) or a string. ``include "PATH"`` reads another file relative to the including one;
``include "preset:NAME"`` reads ``NAME.layout`` or ``NAME/model.layout`` from the presets
shipped with layoutlang. Each file is read once, so presets can be included from several
places, and a file that includes itself, directly or not, is an error naming the chain.

Every file is read by :func:`layoutlang.io._files.read_limited`: only regular files (a FIFO,
a device or a directory is refused at once, never waited on; so is a kernel file of
``/proc`` or ``/sys``) of at most :data:`~.limits.MAX_PROGRAM_BYTES`.

Includes are confined, as the files of a checkpoint's index are: a program may include the
files of its own folder (the folder of the top-level file, or the current directory for a
program given as text) and below, and the presets. Anything else (an absolute path, ``..``
out of the folder, a symbolic link that resolves outside it) is refused before it is read
or even looked for, so a program from someone else cannot make layoutlang read, and print
in an error, ``/proc/self/environ`` or ``~/.ssh/id_rsa``. A program one trusts may lift the
confinement: ``load(..., allow_outside_includes=True)`` or ``--allow-outside-includes``.
Kernel and device files stay refused either way.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import attrs

from ..errors import (
    LayoutError,
    LayoutFileError,
    LayoutIncludeError,
    LayoutSyntaxError,
    Span,
    closest_name,
    did_you_mean,
)
from ..io._files import read_limited
from . import ast
from .limits import MAX_INCLUDE_DEPTH, MAX_PROGRAM_BYTES

__all__ = ["OUTSIDE_INCLUDES_HINT", "PRESET_PREFIX", "Includes", "Source", "is_preset", "preset_file", "read_source"]

#: ``include "preset:NAME"`` reads NAME.layout, or NAME/model.layout, from the packaged presets
PRESET_PREFIX = "preset:"
_PRESETS = Path(__file__).resolve().parent / "presets"
_BYTE_ORDER_MARK = b"\xef\xbb\xbf"  # as some editors write at the start of UTF-8 text
#: kernel file systems: their entries (``/proc/self/environ``) look like regular files but
#: hold the process's secrets, or never end
_KERNEL_FOLDERS = ("/proc", "/sys", "/dev")
#: how to lift the confinement of includes, for a program one trusts
OUTSIDE_INCLUDES_HINT = (
    "move or copy the file into the program's folder, or include a packaged preset as \"preset:NAME\";"
    " for a program you trust, pass --allow-outside-includes (command line) or"
    " allow_outside_includes=True (layoutlang.load / loads)"
)


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
    directory) or oversized (:data:`~.limits.MAX_PROGRAM_BYTES`) files are LayoutFileErrors,
    non-UTF-8 ones LayoutSyntaxErrors at the first bad byte; both name the file."""
    display = display or str(path)
    if not os.path.lexists(path):
        raise LayoutFileError(f"no such file: {display}")
    data = read_limited(path, MAX_PROGRAM_BYTES, ".layout file", display=display, error=LayoutFileError)
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
    raise LayoutIncludeError(f"unknown preset '{name}' (presets: {', '.join(known)})", span, _preset_hint(name, known))


def _model_family(name: str) -> str:
    """The letters a model's name starts with: 'llama' of 'llama3_8b', 'qwen' of 'qwen3_14b'."""
    return re.match(r"[a-z]*", name.lower()).group(0)  # type: ignore[union-attr]  # matches always


def _preset_hint(name: str, known: list[str]) -> str | None:
    """A near preset, unless it is another model of the same family (a 'llama3_8b' that is
    not 'llama3_70b'): then how to describe the model from its own config instead."""
    near = did_you_mean(name, known)
    closest = closest_name(name, known)
    models = [k for k in known if "/" not in k]
    if "/" in name or not any(_model_family(m) == _model_family(name) for m in models):
        return near
    if closest is not None and re.findall(r"\d+", closest) == re.findall(r"\d+", name):
        return near  # a typo of that very model ('llama3-70b')
    families = sorted({k.split("/")[0] for k in known if "/" in k and k.startswith(_model_family(name))})
    shown = ", ".join(f'"preset:{f}/..."' for f in families) or "a family's layouts"
    return (
        f"there is no preset of the model '{name}': describe it from its own config "
        f'(tensors from hf "PATH/config.json" as cfg) and include its family\'s layouts ({shown})'
    )


def is_preset(path: str) -> bool:
    """Whether ``path`` (as a span names it) is one of the packaged presets."""
    return os.path.realpath(path).startswith(f"{_PRESETS}{os.sep}")


def preset_declaring(layout: str, path: str) -> str | None:
    """The preset (``family/name``) beside the preset file ``path`` that declares layout
    ``layout``: what a preset extending it needs included first (None when none does, or
    ``path`` is no preset)."""
    if not is_preset(path):
        return None
    declares = re.compile(rf"^\s*(generic\s+)?layout\s+{re.escape(layout)}\s+on\b", re.M)
    for sibling in sorted(Path(os.path.realpath(path)).parent.glob("*.layout")):
        if declares.search(sibling.read_text("utf-8")):
            return sibling.relative_to(_PRESETS).with_suffix("").as_posix().removesuffix("/model")
    return None


def _inside(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` is ``folder`` or lies below it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _layout_files(folder: str) -> list[str]:
    try:
        return [f for f in os.listdir(folder) if f.endswith(".layout")]
    except OSError:
        return []


class Includes:
    """The files a program has read, and the chain of includes being read now.

    ``folder``: the folder the program's includes are confined to (resolved here), with the
    presets; ``allow_outside``: include any file but kernel and device files.
    """

    def __init__(self, folder: str, *, allow_outside: bool = False) -> None:
        self._read: set[str] = set()
        self._chain: list[str] = []
        self.folder = os.path.realpath(folder)
        self.allow_outside = allow_outside

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
        if "\0" in node.path:  # no file name holds one; os functions raise ValueError on it
            raise LayoutIncludeError(f"cannot include {node.path!r}: a file name holds no NUL byte", node.span)
        if node.path.startswith(PRESET_PREFIX):
            real = display = preset_file(node.path[len(PRESET_PREFIX) :], node.span)
        else:
            written = os.path.join(including.real_folder, node.path)
            real = os.path.realpath(written)
            display = os.path.normpath(os.path.join(including.folder, node.path))
            self._check_allowed(node, written, real)
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

    def _check_allowed(self, node: ast.Include, written: str, real: str) -> None:
        """Refuse a file outside the program's folder and the presets (unless allowed), and
        kernel and device files always; before the file is looked for, so the error tells
        nothing of what lies outside, and never shows its content."""
        for kernel in _KERNEL_FOLDERS:
            if _inside(real, kernel):
                raise LayoutIncludeError(
                    f"cannot include '{node.path}': it is a special file of {kernel}, not a program", node.span
                )
        if self.allow_outside or _inside(real, self.folder) or _inside(real, str(_PRESETS)):
            return
        if _inside(os.path.abspath(written), self.folder):
            reason = "a symbolic link to a file outside the program's folder"
        else:
            reason = "outside the program's folder"
        raise LayoutIncludeError(
            f"cannot include '{node.path}': it is {reason} ({self.folder})", node.span, OUTSIDE_INCLUDES_HINT
        )
