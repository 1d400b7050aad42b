"""Logical tensors of a checkpoint, read from safetensors headers.

A ``.safetensors`` file starts with an 8-byte little-endian header length, then that many
bytes of UTF-8 JSON mapping each tensor name to its ``dtype``, ``shape`` and
``data_offsets`` (begin and end, relative to the end of the header), plus an optional
``__metadata__`` object of strings. A sharded checkpoint adds an index
(``model.safetensors.index.json``) whose ``weight_map`` names the shard of each tensor.

This module reads headers only, with bounded reads: never tensor data, never a header
over 100 MB (the limit the safetensors library sets). It checks what a later reader of
the data relies on: offsets inside the file and as long as shape and dtype require.

Limits: only the dtypes in :data:`SAFETENSORS_DTYPES` are known (no F8_E8M0, U16, U32,
U64, no sub-byte types); the package's own ``safetensors`` reader is not used, so
no header extension it may add later is understood.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ModelDescriptionError
from ..model.dtypes import itemsize
from ._files import TensorEntry, parse_json_object, read_json_object

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPE",
    "SAFETENSORS_DTYPES",
    "TensorEntry",
    "checkpoint_file",
    "checkpoint_mismatches",
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

    The header is returned as stored, ``__metadata__`` included. Each tensor entry has been
    checked to hold a ``dtype`` string, a ``shape`` of non-negative integers and
    ``data_offsets`` that lie inside the file, so ``data_start + data_offsets[0]`` is where
    a tensor's bytes begin.
    """
    file = Path(path)
    try:
        with file.open("rb") as stream:
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
    except FileNotFoundError:
        raise ModelDescriptionError(f"{file}: safetensors file not found") from None
    except IsADirectoryError:
        raise ModelDescriptionError(f"{file}: is a folder, not a safetensors file") from None
    except OSError as exc:
        raise ModelDescriptionError(f"{file}: cannot read safetensors file: {exc.strerror}") from None
    header = parse_json_object(file, raw_header, "safetensors header")
    data_size = file_size - data_start
    for name, entry in header.items():
        if name != _METADATA_KEY:
            _check_entry(file, name, entry, data_size)
    return header, data_start


def tensors_from_safetensors(path: str | os.PathLike[str]) -> list[TensorEntry]:
    """(name, shape, dtype short name) of every tensor of a checkpoint, from headers only.

    ``path`` is a ``.safetensors`` file (tensors in the order of their data), a sharded
    checkpoint's index (any ``*.json`` with a ``weight_map``: each shard read once, shards
    in name order), or a model folder holding ``model.safetensors.index.json`` or
    ``model.safetensors``. Raises :class:`ModelDescriptionError` naming the file at fault.
    """
    file = checkpoint_file(path)
    if file.suffix == ".json":
        return _tensors_from_index(file)
    return _tensors_from_file(file)


def checkpoint_mismatches(
    path: str | os.PathLike[str], expected: Iterable[TensorEntry]
) -> tuple[list[str], str | None]:
    """Every way the checkpoint at ``path`` fails to hold the ``expected`` tensors, from headers only.

    Returns one line per tensor that is missing or stored with another dtype or shape (none
    when the checkpoint holds them all; extra tensors are fine), and a hint when the missing
    names are all in the checkpoint under one other prefix (``model.`` added or dropped...).
    """
    stored = {name: (shape, dtype) for name, shape, dtype in tensors_from_safetensors(path)}
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
            f"did you mean '{theirs}{missing[0][len(ours):]}'? the checkpoint stores all {len(missing)}"
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


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: the shard file of each tensor."""
    weight_map = read_json_object(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise ModelDescriptionError(
            f"{index}: not a safetensors index: needs a 'weight_map' object from tensor names to shard files"
        )
    return weight_map


def _tensors_from_file(file: Path) -> list[TensorEntry]:
    header, _ = read_safetensors_header(file)
    entries = [(name, entry) for name, entry in header.items() if name != _METADATA_KEY]
    # header key order is arbitrary (the library sorts names); the data order is the file's own
    entries.sort(key=lambda item: (item[1]["data_offsets"][0], item[1]["data_offsets"][1]))
    tensors: list[TensorEntry] = []
    for name, entry in entries:
        dtype = _short_dtype(file, name, entry["dtype"])
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        expected_bytes = math.prod(shape) * itemsize(dtype)
        if end - begin != expected_bytes:
            raise ModelDescriptionError(
                f"{file}: tensor {name!r} of shape {list(shape)} and dtype {entry['dtype']} needs"
                f" {expected_bytes} bytes but its data_offsets span {end - begin}"
            )
        tensors.append((name, shape, dtype))
    return tensors


def _tensors_from_index(index: Path) -> list[TensorEntry]:
    """All tensors of the shards an index names, checked against its ``weight_map``."""
    weight_map = read_weight_map(index)
    tensors: list[TensorEntry] = []
    shard_of: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        shard_file = index.parent / shard
        if not shard_file.is_file():
            raise ModelDescriptionError(f"{index}: weight_map names shard {shard!r}, which is missing ({shard_file})")
        for tensor in _tensors_from_file(shard_file):
            name = tensor[0]
            if name in shard_of:
                # one logical tensor cannot have two global shapes
                raise ModelDescriptionError(
                    f"{index}: tensor {name!r} is stored in both {shard_of[name]!r} and {shard!r}"
                )
            shard_of[name] = shard
            tensors.append(tensor)
    for name, shard in weight_map.items():
        if shard_of.get(name) != shard:
            found = f"; it is in {shard_of[name]!r}" if name in shard_of else ""
            raise ModelDescriptionError(f"{index}: weight_map puts {name!r} in {shard!r}, whose header lacks it{found}")
    return tensors


def _check_entry(file: Path, name: str, entry: Any, data_size: int) -> None:
    """Reject a header entry whose fields a reader of the data could not trust."""

    def is_count(value: Any) -> bool:
        # bool is an int subclass in Python, but `true` is no size
        return type(value) is int and value >= 0

    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise ModelDescriptionError(f"{file}: header entry {name!r} has no dtype string")
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
    if end > data_size:
        raise ModelDescriptionError(
            f"{file}: truncated safetensors file: tensor {name!r} ends at data byte {end}"
            f" but the file holds {data_size} bytes of data"
        )


def _short_dtype(file: Path, name: str, spelling: str) -> str:
    short = _SHORT_DTYPE.get(spelling)
    if short is None:
        raise ModelDescriptionError(
            f"{file}: tensor {name!r} has unknown dtype {spelling!r} (known: {', '.join(SAFETENSORS_DTYPES)})"
        )
    return short
