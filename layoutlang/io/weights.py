"""Weights to move and checks that they arrived: synthetic values, safetensors reading and
writing of boxes, and verification of every destination byte.

Verification compares bits, not values: a NaN that arrived bit for bit is equal to the NaN
it was sent as, and ``-0.0`` differs from ``0.0``.

Destination files are written atomically (:func:`write_safetensors`): each to a temporary
file in the same folder, flushed to disk, then renamed over the final name, so a full disk
or a killed writer leaves the previous file or none, never a partial one.

Synthetic weights are small integers computed from (tensor, global element index): every
rank computes any element without communication, the values are exact in every dtype
(bf16, fp16, fp8 included), and two different elements of one tensor rarely share a value,
so a byte delivered to the wrong place is caught.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from .._text import region
from ..errors import LayoutError, LayoutValueError, ModelDescriptionError, RuntimeFailure
from ..model import Box, Layout
from .output import WrittenFile
from .safetensors import SAFETENSORS_DTYPE, confined_checkpoint_file, index_files, read_safetensors_header
from .torch_dtypes import dtype_name, torch_dtype

__all__ = [
    "SafetensorsCheckpoint",
    "Verification",
    "change_synthetic",
    "changed_truth",
    "fill_synthetic",
    "synthetic_box",
    "verify",
    "write_safetensors",
]


def _in_storage(layout: Layout, rank: int, storages: Mapping[str, torch.Tensor], box: Box) -> torch.Tensor:
    """The elements of ``box`` in its storage, in the logical tensor's order (a view)."""
    # a layout names the storage of every box it hands out (only shard_boxes' boxes have none)
    assert box.storage is not None
    storage = storages[box.storage]
    parts = layout.parts_shape(box.storage, rank)  # what box offsets index (an engine may hold it 'as' another shape)
    if parts is not None and tuple(storage.shape) != parts:
        storage = storage.view(parts)
    region = storage[box.storage_index()]
    return region.transpose(-1, -2) if box.transposed else region


def _modulus(dtype: str) -> int:
    # Integers exact in the dtype: fp8 e4m3/e5m2 hold |x| <= 16 exactly, the rest far more.
    return {"bool": 2, "fp8_e4m3": 17, "fp8_e5m2": 17, "uint8": 251}.get(dtype, 251)


#: elements computed at once (8 MiB of int64 intermediates): a box's values are made in
#: slabs of at most this many, so making them costs about the box in its own dtype
SYNTHETIC_CHUNK = 1 << 20


def synthetic_box(
    tensor_index: int, shape: tuple[int, ...], dtype: str, offsets, sizes, version: int = 0
) -> torch.Tensor:
    """The synthetic values of a box of a logical tensor (same on every rank); each
    ``version`` (a training step) gives other values."""
    out = torch.empty(tuple(sizes), dtype=torch_dtype(dtype))
    _fill_box(out, tensor_index, shape, dtype, offsets, sizes, version)
    return out


def _fill_box(
    out: torch.Tensor, tensor_index: int, shape: tuple[int, ...], dtype: str, offsets, sizes, version: int
) -> None:
    """Write a box's synthetic values into ``out`` (any view of the box's sizes, any dtype),
    one slab of at most SYNTHETIC_CHUNK elements at a time: the int64 element indices of a
    500 MiB embedding box would take 1 GiB, and the arithmetic on them several times that."""
    for where, slab_offsets, slab_sizes in _slabs(offsets, sizes):
        values = _synthetic_values(tensor_index, shape, dtype, slab_offsets, slab_sizes, version)
        out[where] = values.view(out[where].shape).to(out.device)


def _slabs(offsets, sizes) -> Iterable[tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...]]]:
    """A box cut into slabs of at most SYNTHETIC_CHUNK elements: per slab, where it lies in
    the box (an index), and its offsets and sizes in the logical tensor."""
    sizes, offsets = tuple(sizes), tuple(offsets)
    # the leading dims of the box that a slab spans one index of (the rest it spans whole)
    inner = 1
    split = len(sizes)
    while split > 0 and inner * sizes[split - 1] <= SYNTHETIC_CHUNK:
        split -= 1
        inner *= sizes[split]
    if split == 0:
        yield (...,), offsets, sizes
        return
    # dim ``split - 1`` is cut into runs of ``rows`` indices, every dim before it one by one
    rows = max(1, SYNTHETIC_CHUNK // inner)
    for head in np.ndindex(*sizes[: split - 1]):
        for start in range(0, sizes[split - 1], rows):
            n = min(rows, sizes[split - 1] - start)
            sub_offsets = (*(o + h for o, h in zip(offsets, head)), offsets[split - 1] + start, *offsets[split:])
            sub_sizes = (*(1,) * len(head), n, *sizes[split:])
            yield (*head, slice(start, start + n)), sub_offsets, sub_sizes


def _element_index(shape: tuple[int, ...], offsets, sizes) -> torch.Tensor:
    """The row-major index in the logical tensor of every element of a (small) box."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64) * stride
        index = index + axis.view([-1] + [1] * (len(shape) - 1 - d))
        stride *= shape[d]
    return index


#: the modulus of the hash that picks a training step's changed elements
_CHANGE_MODULUS = 1_000_003


def _changed(index: torch.Tensor, tensor_index: int, fraction: float, step: int) -> torch.Tensor:
    """Whether each element (by its logical index) changes at training ``step``: about
    ``fraction`` of them, the same on every rank, other ones at every step."""
    seed = (tensor_index + 1) * 7_777_777 + step * 104_729
    hashed = (index * 2_654_435_761 + seed) % _CHANGE_MODULUS
    return hashed < round(fraction * _CHANGE_MODULUS)


def change_synthetic(
    layout: Layout, rank: int, storages: Mapping[str, torch.Tensor], fraction: float, step: int
) -> int:
    """A synthetic training ``step`` (1, 2, ...): about ``fraction`` of every tensor's elements
    (picked by their place in the logical tensor, so every replica changes alike) take their
    synthetic values of version ``step``; returns how many elements of ``rank``'s boxes changed.

    :func:`changed_truth` gives the values every box holds after such steps."""
    changed = 0
    for name in layout.resolved.names:
        tensor = layout.tensors[name]
        index = layout.resolved.index[name]
        for box in layout.boxes(name, rank):
            held = _in_storage(layout, rank, storages, box)
            for where, offsets, sizes in _slabs(box.offsets, box.sizes):
                chosen = _changed(_element_index(tensor.shape, offsets, sizes), index, fraction, step)
                count = int(chosen.sum())
                if count:
                    values = _synthetic_values(index, tensor.shape, tensor.dtype, offsets, sizes, step)
                    slab = held[where]
                    chosen, values = chosen.view(slab.shape), values.view(slab.shape)
                    slab[chosen] = values[chosen].to(device=slab.device, dtype=slab.dtype)
                    changed += count
    return changed


def changed_truth(layout: Layout, truth, fraction: float, steps: int):
    """The truth after ``steps`` training steps of :func:`change_synthetic`, over ``truth``
    (the values before them: ``truth(name, index, box)``, None for the synthetic ones)."""

    def after(name: str, index: int, box: Box) -> torch.Tensor:
        tensor = layout.tensors[name]
        if truth is None:
            values = synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes)
        else:
            values = truth(name, index, box).clone()
        for where, offsets, sizes in _slabs(box.offsets, box.sizes):
            element = _element_index(tensor.shape, offsets, sizes)
            slab = values[where]
            for step in range(1, steps + 1):
                chosen = _changed(element, index, fraction, step).view(slab.shape)
                if bool(chosen.any()):
                    new = _synthetic_values(index, tensor.shape, tensor.dtype, offsets, sizes, step).view(slab.shape)
                    slab[chosen] = new[chosen].to(slab.dtype)
        return values

    return after


def _synthetic_values(
    tensor_index: int, shape: tuple[int, ...], dtype: str, offsets, sizes, version: int
) -> torch.Tensor:
    """A (small) box's synthetic values: the formula, on int64 element indices."""
    index = _element_index(shape, offsets, sizes)
    # every dim added an axis: ``index`` is a fresh tensor of the box's shape, so the
    # arithmetic runs in place on it (one slab of int64, not one per operation)
    m = _modulus(dtype)
    values = index.mul_(40503).add_((tensor_index + 1) * 12345 + version * 7919).remainder_(m)
    if dtype not in ("uint8", "bool"):
        values = values.sub_(m // 2)
    return values.to(torch_dtype(dtype))


def fill_synthetic(
    layout: Layout,
    rank: int,
    storages: Mapping[str, torch.Tensor],
    tensors: Iterable[str] | None = None,
    version: int = 0,
) -> int:
    """Write the synthetic values (of ``version``) of every box ``rank`` holds into its storages; returns bytes.

    The values are made in slabs of at most :data:`SYNTHETIC_CHUNK` elements and written
    straight into the storages (through a slab-sized copy when a storage is on another
    device), so the memory it takes beyond the storages is a few slabs, whatever the box.
    """
    names = layout.resolved.names
    written = 0
    for name in tensors or names:
        tensor = layout.tensors[name]
        index = layout.resolved.index[name]
        for box in layout.boxes(name, rank):
            held = _in_storage(layout, rank, storages, box)
            _fill_box(held, index, tensor.shape, tensor.dtype, box.offsets, box.sizes, version)
            written += held.numel() * torch_dtype(tensor.dtype).itemsize
    return written


@attrs.frozen
class Verification:
    """Result of comparing a rank's destination storages with the source of truth."""

    rank: int
    boxes: int
    bytes: int
    mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify(
    layout: Layout, rank: int, storages: Mapping[str, torch.Tensor], truth=None, limit: int = 10, version: int = 0
) -> Verification:
    """Compare every box ``rank`` holds with the truth, bit for bit (a NaN equals a NaN of the
    same bits; ``-0.0`` and ``0.0`` differ).

    ``truth(name, index, box)`` gives a box's expected values (default: the synthetic ones
    of ``version``).
    When a destination storage has another dtype than the logical tensor (a cast on arrival),
    the expected values are cast the same way.
    """
    mismatches: list[str] = []
    boxes = nbytes = 0
    for name in layout.resolved.names:
        tensor = layout.tensors[name]
        index = layout.resolved.index[name]
        for box in layout.boxes(name, rank):
            got = _in_storage(layout, rank, storages, box)
            if truth:
                expected = truth(name, index, box)
            else:
                expected = synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes, version)
            expected = expected.to(device=got.device, dtype=got.dtype)
            boxes += 1
            nbytes += got.numel() * got.element_size()
            got_bits, expected_bits = _bits(got), _bits(expected)
            if not torch.equal(got_bits, expected_bits) and len(mismatches) < limit:
                wrong = (got_bits != expected_bits).nonzero()
                first = tuple(int(o) + int(i) for o, i in zip(box.offsets, wrong[0])) if len(wrong) else ()
                mismatches.append(
                    f"rank {rank}: {name}{region(box.offsets, box.sizes)} in storage '{box.storage}': "
                    f"{len(wrong)} wrong elements, the first at {list(first)}"
                )
    return Verification(rank, boxes, nbytes, tuple(mismatches))


#: the integer dtype of each element size: what a tensor's bits are compared as
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(values: torch.Tensor) -> torch.Tensor:
    """``values`` as integers of the same width: equal exactly when the bits are (NaN == NaN)."""
    # a dtype view of the same element size keeps the shape and strides, so works on any view
    return values.view(_BITS_DTYPE[values.element_size()])


# ------------------------------------------------------------------- safetensors


class SafetensorsCheckpoint:
    """A checkpoint of whole logical tensors (a .safetensors file, an index, or a folder),
    from which each rank reads only its own boxes: files are memory-mapped and a box
    touches only the pages of its rows.

    Every header is validated when the checkpoint is opened (spans of exactly shape x dtype
    that tile the data), and an index's files must lie inside its folder unless
    ``allow_outside_paths`` (:mod:`layoutlang.io.safetensors`)."""

    def __init__(self, path: str | os.PathLike[str], *, allow_outside_paths: bool = False):
        start = confined_checkpoint_file(path, allow_outside_paths=allow_outside_paths)
        self.files: dict[str, tuple[Path, dict, int]] = {}
        if start.suffix == ".json":
            # an index's files are confined to its folder (see layoutlang.io.safetensors)
            shards = [file for _, file in index_files(start, allow_outside_paths=allow_outside_paths)]
        else:
            shards = [start]
        self._maps: dict[Path, np.memmap] = {}
        for file in shards:
            header, data_start = read_safetensors_header(file)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.files[name] = (file, entry, data_start)

    def read_box(self, name: str, dtype: str, shape: tuple[int, ...], offsets, sizes) -> torch.Tensor:
        """The values of one box of tensor ``name``, checked against the expected dtype and shape."""
        if name not in self.files:
            raise ModelDescriptionError(f"the checkpoint has no tensor '{name}'")
        file, entry, data_start = self.files[name]
        if tuple(entry["shape"]) != tuple(shape) or entry["dtype"] != SAFETENSORS_DTYPE[dtype]:
            raise ModelDescriptionError(
                f"{file}: tensor '{name}' is {entry['dtype']} {entry['shape']}, "
                f"the program declares {dtype} {list(shape)}"
            )
        if file not in self._maps:
            # copy-on-write: torch wants writable memory; the file is never changed
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="c")
        begin, end = entry["data_offsets"]
        raw = torch.from_numpy(np.asarray(self._maps[file][data_start + begin : data_start + end]))
        whole = raw.view(torch_dtype(dtype)).view(tuple(shape))  # shape () views the one element as a scalar
        return whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    def fill(self, layout: Layout, rank: int, storages: Mapping[str, torch.Tensor]) -> int:
        """Read every box ``rank`` holds into its storages; returns the bytes read."""
        written = 0
        for name in layout.resolved.names:
            tensor = layout.tensors[name]
            for box in layout.boxes(name, rank):
                values = self.read_box(name, tensor.dtype, tensor.shape, box.offsets, box.sizes)
                _in_storage(layout, rank, storages, box)[...] = values
                written += values.numel() * values.element_size()
        return written


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> WrittenFile:
    """Write tensors to a .safetensors file (header, then the raw bytes in order), atomically;
    returns the file's name, size and SHA-256, hashed while writing (what an output folder's
    manifest records: :mod:`layoutlang.io.output`).

    The bytes go to a temporary file in the same folder (``.NAME.XXXX.tmp``), which is
    flushed to disk (``fsync``) and then renamed over ``path``: a reader sees the previous
    file or the whole new one, and a failure leaves no partial file. A folder that is
    missing, read-only or not a folder raises :class:`~layoutlang.errors.LayoutValueError`
    (a path mistake); a full disk or another I/O failure while writing raises
    :class:`~layoutlang.errors.RuntimeFailure`; both name the file.
    """
    target = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs: list[np.ndarray] = []
    for name, tensor in tensors.items():
        dtype = dtype_name(tensor.dtype)
        if dtype is None:
            raise ModelDescriptionError(f"cannot write tensor '{name}' of dtype {tensor.dtype} to safetensors")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        blobs.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    try:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise _write_error(target, exc) from None
    try:
        digest = hashlib.sha256()
        try:
            os.fchmod(fd, _new_file_mode())  # mkstemp's 0600, made what open() would have given
            chunks: list[bytes | memoryview] = [struct.pack("<Q", len(encoded)) + encoded]
            chunks += [memoryview(blob.data) for blob in blobs]
            for chunk in chunks:
                digest.update(chunk)
                _write_all(fd, chunk)
            os.fsync(fd)  # the bytes are on disk before the name points at them
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise _write_error(target, exc, offset + 8 + len(encoded)) from None
        raise
    _sync_folder(target.parent)
    return WrittenFile(target.name, 8 + len(encoded) + offset, digest.hexdigest())


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _new_file_mode() -> int:
    """The permissions ``open(path, "w")`` gives a new file: 0666 less the process's umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:  # Linux: read it without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it
    os.umask(mask)
    return 0o666 & ~mask


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entries, so the rename survives a crash (best effort: not every
    file system lets a folder be opened or synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: errors of a path the user gave (exit 2); any other OSError is a failure at run time (exit 1)
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}


def _write_error(target: Path, exc: OSError, size: int | None = None) -> LayoutError | RuntimeFailure:
    """The error for ``exc`` raised while writing ``target``."""
    what = f"cannot write {target}: {exc.strerror or exc}"
    if exc.errno in _PATH_ERRNOS:
        return LayoutValueError(f"{what} (the folder {target.parent} is missing, read-only or not a folder)")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        needed = f" ({size} bytes)" if size is not None else ""
        return RuntimeFailure(
            f"{what}{needed}; no partial file is left", hint="free space on that disk or write to another folder"
        )
    return RuntimeFailure(f"{what}; no partial file is left")
