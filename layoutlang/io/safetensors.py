"""Logical tensors of a checkpoint, read from safetensors headers.

A ``.safetensors`` file starts with an 8-byte little-endian header length, then that many
bytes of UTF-8 JSON mapping each tensor name to its ``dtype``, ``shape`` and
``data_offsets`` (begin and end, relative to the end of the header), plus an optional
``__metadata__`` object of strings. A sharded checkpoint adds an index
(``model.safetensors.index.json``) whose ``weight_map`` names the file of each tensor.

This module reads headers only, with bounded reads: never tensor data, never a header
over 100 MB (the limit the safetensors library sets), never a FIFO or a device. Before any
byte of data is trusted, every header is checked as strictly as the safetensors library
checks it, so no reader of the data can be led astray:

- each entry has a known ``dtype`` string, a ``shape`` of non-negative integers and
  ``data_offsets`` ``[begin, end]`` with ``end - begin == prod(shape) x itemsize``;
- the spans tile the data area exactly: none overlaps another (one tensor would read
  another's bytes), none leaves the file, and no byte of data belongs to no tensor (the
  format forbids holes, so that a file cannot be two formats at once). Empty tensors (a
  zero dim) take no bytes and may sit anywhere inside the data;
- ``__metadata__``, when present, maps strings to strings.

An index's ``weight_map`` must be an object from tensor names to file names, and the files
it names are **confined to the index's folder**: no absolute path, no ``..``, and a symbolic
link is followed only when its target (resolved) lies inside the folder, so an index cannot
make layoutlang open ``/etc/shadow`` or a file beside the checkpoint. One exception keeps the
Hugging Face hub cache working: in a snapshot folder (``.../snapshots/REV``) the links into
the repository's own ``blobs`` folder (``../../blobs/HASH``) are inside. The keyword
``allow_outside_paths=True`` (``apply --from DIR --allow-outside-paths`` on the command
line) lifts the confinement for an index one trusts. The file a model folder is read from
(its ``model.safetensors`` or ``model.safetensors.index.json``) is confined the same way: a
link of that name leaving the folder is refused unless allowed
(:func:`confined_checkpoint_file`).

Every refusal is a :class:`~layoutlang.errors.ModelDescriptionError` naming the file and
the tensor.

Limits: only the dtypes in :data:`SAFETENSORS_DTYPES` are known (no U16, U32,
U64, no sub-byte types); the package's own ``safetensors`` reader is not used, so
no header extension it may add later is understood. A JSON header that repeats a tensor
name keeps the last entry (as Python's ``json`` does); the first one's bytes are then a
hole, refused as such.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ModelDescriptionError
from ..model.dtypes import itemsize
from ._files import TensorEntry, open_regular, parse_json_object, read_json_object

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPE",
    "SAFETENSORS_DTYPES",
    "TensorEntry",
    "checkpoint_file",
    "checkpoint_mismatches",
    "confined_checkpoint_file",
    "index_files",
    "read_safetensors_header",
    "read_weight_map",
    "renamed_prefix",
    "tensors_from_safetensors",
]

#: the safetensors spelling of each short dtype name
SAFETENSORS_DTYPE: dict[str, str] = {
    "bf16": "BF16",
    "fp16": "F16",
    "fp32": "F32",
    "fp64": "F64",
    "fp8_e4m3": "F8_E4M3",
    "fp8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
    # MXFP8's power-of-two scales, as the safetensors package writes torch.float8_e8m0fnu
    "e8m0": "F8_E8M0",
}
#: safetensors dtype spellings this module maps to short names
SAFETENSORS_DTYPES: tuple[str, ...] = tuple(SAFETENSORS_DTYPE.values())
_SHORT_DTYPE = {spelling: short for short, spelling in SAFETENSORS_DTYPE.items()}

#: the largest header accepted, as in the safetensors library: more is a corrupt length
MAX_HEADER_BYTES = 100_000_000

_LENGTH_PREFIX_BYTES = 8
_METADATA_KEY = "__metadata__"
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The header of the ``.safetensors`` file at ``path`` and the byte offset where its data starts.

    The header is returned as stored, ``__metadata__`` included. Every tensor entry has been
    checked as the module docstring says (a known dtype, a shape, data_offsets spanning
    exactly shape x dtype, spans that tile the data without overlap or hole), so
    ``data_start + data_offsets[0]`` is where a tensor's bytes begin and nothing else
    reads them. A FIFO, a device or a folder is refused without blocking.
    """
    file = Path(path)
    with open_regular(file, "safetensors file") as stream:
        try:
            file_size = os.fstat(stream.fileno()).st_size
            prefix = stream.read(_LENGTH_PREFIX_BYTES)
            if len(prefix) < _LENGTH_PREFIX_BYTES:
                raise ModelDescriptionError(
                    f"{file}: truncated safetensors file: {file_size} bytes, too short for the header length"
                )
            header_length = int.from_bytes(prefix, "little")
            if header_length > MAX_HEADER_BYTES:
                raise ModelDescriptionError(
                    f"{file}: safetensors header length {header_length} exceeds {MAX_HEADER_BYTES} bytes;"
                    " not a safetensors file or a corrupt one"
                )
            data_start = _LENGTH_PREFIX_BYTES + header_length
            if data_start > file_size:
                raise ModelDescriptionError(
                    f"{file}: truncated safetensors file: header of {header_length} bytes"
                    f" but only {file_size - _LENGTH_PREFIX_BYTES} bytes follow the length"
                )
            raw_header = stream.read(header_length)
        except OSError as exc:
            raise ModelDescriptionError(f"{file}: cannot read safetensors file: {exc.strerror}") from None
    if len(raw_header) < header_length:  # the file shrank while it was read
        raise ModelDescriptionError(
            f"{file}: truncated safetensors file: the header ends after {len(raw_header)} bytes"
        )
    header = parse_json_object(file, raw_header, "safetensors header")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == _METADATA_KEY:
            _check_metadata(file, entry)
        else:
            spans.append((*_check_entry(file, name, entry), name))
    _check_spans(file, spans, file_size - data_start)
    return header, data_start


def tensors_from_safetensors(path: str | os.PathLike[str], *, allow_outside_paths: bool = False) -> list[TensorEntry]:
    """(name, shape, dtype short name) of every tensor of a checkpoint, from headers only.

    ``path`` is a ``.safetensors`` file (tensors in the order of their data), a sharded
    checkpoint's index (any ``*.json`` with a ``weight_map``: each file read once, in name
    order), or a model folder holding ``model.safetensors.index.json`` or
    ``model.safetensors``. The files an index names must lie inside its folder unless
    ``allow_outside_paths`` (see :func:`index_files`). Raises
    :class:`ModelDescriptionError` naming the file at fault.
    """
    file = confined_checkpoint_file(path, allow_outside_paths=allow_outside_paths)
    if file.suffix == ".json":
        return _tensors_from_index(file, allow_outside_paths)
    return _tensors_from_file(file)


def checkpoint_mismatches(
    path: str | os.PathLike[str], expected: Iterable[TensorEntry], *, allow_outside_paths: bool = False
) -> tuple[list[str], str | None]:
    """Every way the checkpoint at ``path`` fails to hold the ``expected`` tensors, from headers only.

    Returns one line per tensor that is missing or stored with another dtype or shape (none
    when the checkpoint holds them all; extra tensors are fine), and a hint when the missing
    names are all in the checkpoint under one other prefix (``model.`` added or dropped...).
    A checkpoint that cannot be read (a bad header, an index naming a file outside its
    folder without ``allow_outside_paths``) raises :class:`ModelDescriptionError`.
    """
    stored = {
        name: (shape, dtype)
        for name, shape, dtype in tensors_from_safetensors(path, allow_outside_paths=allow_outside_paths)
    }
    problems: list[str] = []
    missing: list[str] = []
    wanted: set[str] = set()
    for name, shape, dtype in expected:
        wanted.add(name)
        declared = f"{dtype} {list(shape)}"
        if name not in stored:
            missing.append(name)
            problems.append(f"'{name}' is missing (declared {declared})")
        elif stored[name] != (tuple(shape), dtype):
            found_shape, found_dtype = stored[name]
            problems.append(f"'{name}' is {found_dtype} {list(found_shape)}, declared {declared}")
    renamed = renamed_prefix(missing, [name for name in stored if name not in wanted])
    hint = None
    if renamed is not None:
        ours, theirs = renamed
        if not ours:
            how = f"under the prefix '{theirs}'"
        elif not theirs:
            how = f"without the prefix '{ours}'"
        else:
            how = f"with the prefix '{theirs}' for '{ours}'"
        hint = (
            f"did you mean '{theirs}{missing[0][len(ours) :]}'? the checkpoint stores all {len(missing)}"
            f" missing tensors {how}"
        )
    return problems, hint


#: how many leading name components a renamed prefix may differ in ("module.model." is 2)
_MAX_PREFIX_PARTS = 3


def renamed_prefix(missing: list[str], spare: Iterable[str]) -> tuple[str, str] | None:
    """``(ours, theirs)`` such that every name in ``missing`` with ``ours`` replaced by ``theirs`` at
    its start is a name in ``spare``; None when no one prefix explains them all.

    Candidates come from the first missing name, whose last components must match a spare
    name's; each is then tried on every missing name."""
    spare_names = set(spare)
    if not missing or not spare_names:
        return None
    by_rest: dict[str, list[str]] = {}
    for name in spare_names:
        parts = name.split(".")
        for dropped in range(min(_MAX_PREFIX_PARTS, len(parts) - 1) + 1):
            by_rest.setdefault(".".join(parts[dropped:]), []).append(name)
    first = missing[0]
    parts = first.split(".")
    for dropped in range(min(_MAX_PREFIX_PARTS, len(parts) - 1) + 1):
        rest = ".".join(parts[dropped:])
        ours = first[: len(first) - len(rest)]
        for candidate in sorted(by_rest.get(rest, ())):
            theirs = candidate[: len(candidate) - len(rest)]
            if theirs != ours and all(
                name.startswith(ours) and theirs + name[len(ours) :] in spare_names for name in missing
            ):
                return ours, theirs
    return None


def checkpoint_file(path: str | os.PathLike[str]) -> Path:
    """The file to read a checkpoint from: ``path`` itself, or in a model folder its
    ``model.safetensors.index.json`` if it has one, else its ``model.safetensors``."""
    file = Path(path)
    if file.is_dir():
        index = file / _INDEX_FILE
        file = index if index.exists() else file / _SINGLE_FILE
    return file


def confined_checkpoint_file(path: str | os.PathLike[str], *, allow_outside_paths: bool = False) -> Path:
    """:func:`checkpoint_file`, with the file a model folder names confined to the folder as an
    index's files are (:func:`index_files`): a ``model.safetensors`` or index that is a symbolic
    link leaving the folder (but for the hub cache's ``blobs``) is refused unless
    ``allow_outside_paths``. A file named directly is the caller's own choice and is followed."""
    file = checkpoint_file(path)
    folder = Path(path)
    if allow_outside_paths or not folder.is_dir():
        return file
    root = folder.resolve()
    reason = _leaves_folder(file.name, file, root, _hub_blobs(root))
    if reason is not None:
        raise ModelDescriptionError(
            f"{file}: the checkpoint's {file.name} {reason}; the files of a checkpoint folder must lie inside it",
            hint="copy the file into the checkpoint folder; or, for a folder you trust, pass allow_outside_paths=True"
            " (Python) or --allow-outside-paths (layoutlang apply --from)",
        )
    return file


def _hub_blobs(root: Path) -> Path | None:
    """The hub cache's ``blobs`` folder of a snapshot folder, where its files link to:
    models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH; None for any other folder."""
    return root.parent.parent / "blobs" if root.parent.name == "snapshots" else None


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: the file of each tensor, as written.

    Only its form is checked here (an object from tensor names to non-empty file names);
    :func:`index_files` checks where the names lead."""
    weight_map = read_json_object(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict):
        found = "none" if weight_map is None else f"a JSON {_json_kind(weight_map)}"
        raise ModelDescriptionError(
            f"{index}: not a safetensors index: needs a 'weight_map' object from tensor names to files, found {found}"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise ModelDescriptionError(
                f"{index}: weight_map gives tensor {name!r} the file {file!r}; expected a file name (a string)"
            )
    return weight_map


def index_files(index: Path, *, allow_outside_paths: bool = False) -> list[tuple[str, Path]]:
    """``(name as written, path)`` of every file the index's ``weight_map`` names, in name order.

    Each name must stay inside the index's folder: relative, without a ``..`` component,
    and, symbolic links resolved, still inside the folder (or, in a Hugging Face hub
    snapshot, inside the repository's ``blobs`` folder, where the hub cache links its
    files). ``allow_outside_paths`` follows any name, for an index one trusts. A file that
    does not exist is refused too, naming the index and the file."""
    folder = index.parent
    root = folder.resolve()
    blobs = _hub_blobs(root)
    files: list[tuple[str, Path]] = []
    for name in sorted(set(read_weight_map(index).values())):
        if "\0" in name:
            raise ModelDescriptionError(f"{index}: weight_map names the file {name!r}, which holds a NUL byte")
        path = folder / name
        if not allow_outside_paths:
            reason = _leaves_folder(name, path, root, blobs)
            if reason is not None:
                raise ModelDescriptionError(
                    f"{index}: weight_map names the file {name!r}, which {reason}; the files of an index"
                    f" must lie inside its folder {folder}",
                    hint="move or copy the file into the checkpoint folder; or, for an index you trust, pass"
                    " allow_outside_paths=True (Python) or --allow-outside-paths (layoutlang apply --from)",
                )
        if not path.is_file():
            raise ModelDescriptionError(f"{index}: weight_map names the file {name!r}, which is missing ({path})")
        files.append((name, path))
    return files


def _leaves_folder(name: str, path: Path, root: Path, blobs: Path | None) -> str | None:
    """Why the file ``name`` (at ``path``) of an index leaves the index's folder ``root``; None when it does not."""
    if os.path.isabs(name):
        return "is an absolute path"
    if ".." in Path(name).parts:
        return "climbs out of the folder with '..'"
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # Python < 3.13 raises RuntimeError for a loop of links
        return "is a loop of symbolic links"
    if target.is_relative_to(root) or (blobs is not None and target.parent == blobs):
        return None
    return f"is a symbolic link to {target}, outside the folder"


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


def _tensors_from_file(file: Path) -> list[TensorEntry]:
    header, _ = read_safetensors_header(file)
    entries = [(name, entry) for name, entry in header.items() if name != _METADATA_KEY]
    # header key order is arbitrary (the library sorts names); the data order is the file's own
    entries.sort(key=lambda item: (item[1]["data_offsets"][0], item[1]["data_offsets"][1]))
    return [(name, tuple(entry["shape"]), _SHORT_DTYPE[entry["dtype"]]) for name, entry in entries]


def _tensors_from_index(index: Path, allow_outside_paths: bool) -> list[TensorEntry]:
    """All tensors of the files an index names, checked against its ``weight_map``."""
    weight_map = read_weight_map(index)
    tensors: list[TensorEntry] = []
    file_of: dict[str, str] = {}
    for shard, shard_file in index_files(index, allow_outside_paths=allow_outside_paths):
        for tensor in _tensors_from_file(shard_file):
            name = tensor[0]
            if name in file_of:
                # one logical tensor cannot have two global shapes
                raise ModelDescriptionError(
                    f"{index}: tensor {name!r} is stored in both {file_of[name]!r} and {shard!r}"
                )
            file_of[name] = shard
            tensors.append(tensor)
    for name, shard in weight_map.items():
        if file_of.get(name) != shard:
            found = f"; it is in {file_of[name]!r}" if name in file_of else ""
            raise ModelDescriptionError(f"{index}: weight_map puts {name!r} in {shard!r}, whose header lacks it{found}")
    return tensors


def _check_metadata(file: Path, metadata: Any) -> None:
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ModelDescriptionError(f"{file}: the header's __metadata__ must be an object of strings, not {metadata!r}")


def _check_entry(file: Path, name: str, entry: Any) -> tuple[int, int]:
    """The data span ``(begin, end)`` of one header entry, refused unless a reader of the data can trust it."""

    def is_count(value: Any) -> bool:
        # bool is an int subclass in Python, but `true` is no size
        return type(value) is int and value >= 0

    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise ModelDescriptionError(f"{file}: header entry {name!r} has no dtype string")
    dtype = _short_dtype(file, name, entry["dtype"])
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(is_count(dim) for dim in shape):
        raise ModelDescriptionError(f"{file}: tensor {name!r} has shape {shape!r}, not a list of dim sizes")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(offset) for offset in offsets)):
        raise ModelDescriptionError(f"{file}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if begin > end:
        raise ModelDescriptionError(
            f"{file}: tensor {name!r} has data_offsets [{begin}, {end}] that end before they begin"
        )
    expected_bytes = math.prod(shape) * itemsize(dtype)
    if end - begin != expected_bytes:
        raise ModelDescriptionError(
            f"{file}: tensor {name!r} of shape {list(shape)} and dtype {entry['dtype']} needs"
            f" {expected_bytes} bytes but its data_offsets [{begin}, {end}] span {end - begin}"
        )
    return begin, end


def _check_spans(file: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Refuse spans that leave the data, overlap, or leave a byte of data to no tensor."""
    for _, end, name in spans:
        if end > data_size:
            raise ModelDescriptionError(
                f"{file}: truncated safetensors file: tensor {name!r} ends at data byte {end}"
                f" but the file holds {data_size} bytes of data"
            )
    cursor, previous = 0, None
    # empty tensors read no byte: they overlap nothing and fill no hole
    for begin, end, name in sorted(span for span in spans if span[1] > span[0]):
        if begin < cursor:
            raise ModelDescriptionError(
                f"{file}: tensors {previous!r} and {name!r} overlap: data bytes [{begin}, {min(end, cursor)}) are in"
                " both, so one would read the other's bytes"
            )
        if begin > cursor:
            after = f" after tensor {previous!r}" if previous is not None else ", at the start of the data"
            raise ModelDescriptionError(
                f"{file}: data bytes [{cursor}, {begin}){after} belong to no tensor; the safetensors format"
                f" requires the data_offsets to cover the data exactly (tensor {name!r} begins at {begin})"
            )
        cursor, previous = end, name
    if cursor != data_size:
        after = f" after tensor {previous!r}" if previous is not None else ""
        raise ModelDescriptionError(
            f"{file}: the last {data_size - cursor} bytes of data{after} belong to no tensor; the safetensors"
            " format requires the data_offsets to cover the data exactly"
        )


def _short_dtype(file: Path, name: str, spelling: str) -> str:
    short = _SHORT_DTYPE.get(spelling)
    if short is None:
        raise ModelDescriptionError(
            f"{file}: tensor {name!r} has unknown dtype {spelling!r} (known: {', '.join(SAFETENSORS_DTYPES)})"
        )
    return short
