"""Output folders: what a run wrote into one, and what a later run may remove from it.

A run that writes files into a folder (``layoutlang apply --to DIR``) records them in the
folder's manifest, :data:`MANIFEST` (``.layoutlang-manifest.json``): each file's name, size
and SHA-256, hashed while it was written (:func:`~layoutlang.io.weights.write_safetensors`).
A later run removes an earlier run's file only when the manifest lists it and the file still
matches it: a regular file (not a link), of the recorded size and digest. A file layoutlang
did not write (a ``model.safetensors`` the user put there) or one changed since is refused
by name, and then nothing is removed. Neither is the room on the disk taken on trust: the
bytes the run will write are compared with the free room (counting what the removal frees)
before anything is removed, so a full disk never costs the earlier good output.

Without torch: the launching process checks the folder before it imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import attrs

from .._text import human_bytes
from ..errors import LayoutValueError, ModelDescriptionError, RuntimeFailure
from ._files import read_json_object

__all__ = ["MANIFEST", "WrittenFile", "check_room", "read_manifest", "why_not_removable", "write_manifest"]

#: The manifest's name in an output folder (hidden: it is the folder's bookkeeping, not output).
MANIFEST = ".layoutlang-manifest.json"
#: the largest manifest read (a file's entry is about 120 bytes: 100k files fit in 16 MiB)
MAX_MANIFEST_BYTES = 16 << 20
_FORMAT = "layoutlang-output-manifest/1"


@attrs.frozen
class WrittenFile:
    """One file a run wrote: its name in the folder, its size in bytes, its SHA-256 (hex)."""

    name: str
    size: int
    sha256: str


def write_manifest(folder: str | os.PathLike[str], files: Iterable[WrittenFile]) -> Path:
    """Record ``files`` as the folder's manifest, replacing an earlier one, atomically (a
    temporary file renamed over it: a reader sees the old manifest or the new one)."""
    target = Path(folder) / MANIFEST
    entries = {f.name: {"bytes": f.size, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)}
    text = json.dumps({"format": _FORMAT, "files": entries}, indent=1) + "\n"
    try:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f"{MANIFEST}.", suffix=".tmp")
    except OSError as exc:
        raise _unrecorded(target, exc) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise _unrecorded(target, exc) from None
        raise
    return target


def _unrecorded(target: Path, exc: OSError) -> RuntimeFailure:
    """A manifest that could not be written (a full disk): the run's files are whole, but no
    later run may remove them, which the message says."""
    return RuntimeFailure(
        f"cannot write {target}: {exc.strerror or exc}; the run's files are written and whole, but unrecorded: "
        "a later --overwrite refuses them",
        hint="free space on that disk; remove the unrecorded files yourself before writing there again",
    )


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, WrittenFile]:
    """The files the folder's manifest lists, by name; empty when it has none. A manifest that
    is not one (not JSON, wrong fields, a link, a FIFO) raises
    :class:`~layoutlang.errors.LayoutValueError` naming it: then no file is taken as written."""
    path = Path(folder) / MANIFEST
    if not os.path.lexists(path):
        return {}
    if path.is_symlink():
        raise LayoutValueError(f"{path}: the manifest is a symbolic link; layoutlang writes it as a regular file")
    try:
        raw = read_json_object(path, "layoutlang manifest", MAX_MANIFEST_BYTES)
    except ModelDescriptionError as err:
        raise LayoutValueError(err.message) from None
    files = raw.get("files")
    out: dict[str, WrittenFile] = {}
    if raw.get("format") == _FORMAT and isinstance(files, dict):
        for name, entry in files.items():
            if not isinstance(entry, dict):
                break
            size, digest = entry.get("bytes"), entry.get("sha256")
            if type(size) is not int or not isinstance(digest, str) or os.path.basename(name) != name:
                break
            out[name] = WrittenFile(name, size, digest)
        else:
            return out
    raise LayoutValueError(
        f"{path}: not a layoutlang manifest (expected {{'format': '{_FORMAT}', 'files': {{NAME: {{'bytes', "
        "'sha256'}}}}}}); no file of the folder is taken as written by layoutlang"
    )


def why_not_removable(folder: str | os.PathLike[str], name: str, recorded: WrittenFile | None) -> str | None:
    """Why the file ``name`` of ``folder`` is not the one a run recorded (None when it is):
    not listed, not a regular file (a link, a folder), another size, other bytes."""
    if recorded is None:
        return f"is not in the folder's {MANIFEST}: layoutlang did not write it"
    path = Path(folder) / name
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None  # gone already (another process of the job removed it): nothing to remove
    if not stat.S_ISREG(status.st_mode):
        return "is not the regular file layoutlang wrote (a symbolic link or another kind of file now)"
    if status.st_size != recorded.size:
        return f"has changed since layoutlang wrote it ({status.st_size} bytes, written {recorded.size})"
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != recorded.sha256:
        return "has changed since layoutlang wrote it (its bytes differ from the SHA-256 in the manifest)"
    return None


def check_room(folder: str | os.PathLike[str], will_write: int, freed: int = 0, flag: str = "--to") -> None:
    """Refuse a run whose ``will_write`` bytes do not fit in the free room of the folder's
    disk, counting the ``freed`` bytes of the files it would remove first; nothing is
    removed or written when it is refused."""
    free = shutil.disk_usage(folder).free
    if will_write <= free + freed:
        return
    after = f" ({human_bytes(free + freed)} once the earlier run's files are removed)" if freed else ""
    raise LayoutValueError(
        f"{flag} {folder}: this run writes {human_bytes(will_write)} ({will_write:,} bytes) but the disk has "
        f"{human_bytes(free)} free{after}; nothing was removed or written",
        hint="free space on that disk, or write to a folder on another disk",
    )
