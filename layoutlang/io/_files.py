"""What the readers of model descriptions share: the entries they list, and bounded reads of files.

A Hugging Face ``config.json``, a safetensors index and a safetensors header are each one
JSON object in UTF-8; every failure to read one names the file, and ``what`` it was meant
to be ("Hugging Face config").

Every file layoutlang reads as input (``.layout`` programs and their includes, configs,
indexes, safetensors headers) is opened by :func:`open_regular`: a FIFO, a device, a socket
or a directory is refused at once, without blocking (and :func:`read_limited` refuses the
kernel's files of ``/proc`` and ``/sys``, which pass for regular files), and :func:`read_limited` reads at most
a stated number of bytes, so ``/dev/zero`` or a FIFO given by mistake (or by an attacker)
fails with a clear error instead of hanging or exhausting memory.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

from ..errors import LayoutError, ModelDescriptionError

__all__ = [
    "MAX_JSON_BYTES",
    "TensorEntry",
    "open_regular",
    "parse_json_object",
    "read_json_object",
    "read_limited",
]

#: a logical tensor as (name, global shape, dtype short name): the fields of layoutlang.model.LogicalTensor
TensorEntry = tuple[str, tuple[int, ...], str]

#: the largest ``config.json`` or safetensors index read (64 MiB). DeepSeek-V3's index, 91k
#: tensors, is 8.9 MB; a config is a few KB. More is not a model description.
MAX_JSON_BYTES = 64 << 20

# the kinds of file that are not regular, as their messages name them
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _limit_text(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and limit % (1 << 20) == 0 else f"{limit} bytes"


def open_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    display: str | None = None,
    error: type[LayoutError] = ModelDescriptionError,
) -> BinaryIO:
    """``path`` opened for reading in binary mode, refused unless it is a regular file.

    The file is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open
    descriptor, so a FIFO (or a FIFO swapped in after any earlier ``stat``) is refused at
    once instead of blocking until a writer comes. Every failure raises ``error`` (a
    :class:`~layoutlang.errors.LayoutError`) whose message starts with ``display`` (default:
    ``path``) and names ``what`` the file was meant to be: ``"... not found"``, ``"... is a
    FIFO (named pipe), not a regular file"``, ``"cannot read ...: Permission denied"``.

    The caller closes the returned file (use it in a ``with`` statement).
    """
    shown = display if display is not None else os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{shown}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{shown}: {what} is a directory, not a regular file") from None
    except OSError as exc:
        raise error(f"{shown}: cannot read {what}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise error(f"{shown}: {what} is {kind}, not a regular file")
        # reads of a regular file never block; clear the flag so the file behaves as opened plainly
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(
    path: str | os.PathLike[str],
    limit: int,
    what: str,
    *,
    display: str | None = None,
    error: type[LayoutError] = ModelDescriptionError,
) -> bytes:
    """The bytes of the regular file ``path``, refused if it holds more than ``limit`` bytes.

    Opens the file as :func:`open_regular` does (same errors) and reads at most
    ``limit + 1`` bytes, whatever its size claims, so a file that grows while it is read
    cannot exhaust memory either; a larger file raises ``error``: ``"<display>: <what> is
    larger than the limit of 16 MiB"``.
    """
    shown = display if display is not None else os.fspath(path)
    with open_regular(path, what, display=shown, error=error) as stream:
        try:
            size = os.fstat(stream.fileno()).st_size
            data = stream.read(limit + 1)
        except OSError as exc:
            raise error(f"{shown}: cannot read {what}: {exc.strerror}") from None
    if size == 0 and data:
        # /proc and /sys files pass for regular files of size 0 and are made as they are read
        # (/proc/self/environ holds the process's secrets): refused, their bytes never shown
        raise error(f"{shown}: {what} is a kernel file (as in /proc or /sys), not a regular file")
    if len(data) > limit:
        raise error(f"{shown}: {what} is larger than the limit of {_limit_text(limit)}")
    return data


def read_json_object(file: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object stored in ``file`` (at most ``limit`` bytes; see :func:`read_limited`)."""
    return parse_json_object(file, read_limited(file, limit, what), what)


def parse_json_object(file: str | os.PathLike[str], raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object ``raw`` (read from ``file``) holds."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDescriptionError(f"{file}: {what} is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelDescriptionError(
            f"{file}: {what} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:  # arrays or objects nested thousands deep: no config or index is
        raise ModelDescriptionError(f"{file}: {what} nests too deeply to be read") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        reason = str(exc).split(";")[0]  # not Python's advice on raising its limit
        raise ModelDescriptionError(f"{file}: {what} cannot be read: {reason}") from None
    if not isinstance(value, dict):
        raise ModelDescriptionError(f"{file}: {what} must be a JSON object, not {type(value).__name__}")
    return value
