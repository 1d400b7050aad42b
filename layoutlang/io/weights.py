"""Weights to move and checks that they arrived: synthetic values, safetensors reading and
writing of boxes, and verification of every destination byte.

Synthetic weights are small integers computed from (tensor, global element index): every
rank computes any element without communication, the values are exact in every dtype
(bf16, fp16, fp8 included), and two different elements of one tensor rarely share a value,
so a byte delivered to the wrong place is caught.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import numpy as np
import torch

from .._text import region
from ..errors import ModelDescriptionError
from ..model import Box, Layout
from .safetensors import SAFETENSORS_DTYPE, checkpoint_file, read_safetensors_header, read_weight_map
from .torch_dtypes import dtype_name, torch_dtype

__all__ = [
    "SafetensorsCheckpoint",
    "Verification",
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


def synthetic_box(
    tensor_index: int, shape: tuple[int, ...], dtype: str, offsets, sizes, version: int = 0
) -> torch.Tensor:
    """The synthetic values of a box of a logical tensor (same on every rank); each
    ``version`` (a training step) gives other values."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64) * stride
        index = index + axis.view([-1] + [1] * (len(shape) - 1 - d))
        stride *= shape[d]
    index = index.expand(tuple(sizes)) if sizes else index
    m = _modulus(dtype)
    values = (index * 40503 + (tensor_index + 1) * 12345 + version * 7919) % m
    if dtype not in ("uint8", "bool"):
        values = values - m // 2
    return values.to(torch_dtype(dtype))


def fill_synthetic(
    layout: Layout,
    rank: int,
    storages: Mapping[str, torch.Tensor],
    tensors: Iterable[str] | None = None,
    version: int = 0,
) -> int:
    """Write the synthetic values (of ``version``) of every box ``rank`` holds into its storages; returns bytes."""
    names = layout.resolved.names
    written = 0
    for name in tensors or names:
        tensor = layout.tensors[name]
        index = layout.resolved.index[name]
        for box in layout.boxes(name, rank):
            values = synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes, version)
            held = _in_storage(layout, rank, storages, box)
            held[...] = values.to(held.device)
            written += values.numel() * values.element_size()
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
    """Compare every box ``rank`` holds with the truth, bit for bit.

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
            if not torch.equal(_bits(got), _bits(expected)) and len(mismatches) < limit:
                wrong = (got != expected).nonzero()
                first = tuple(int(o) + int(i) for o, i in zip(box.offsets, wrong[0])) if len(wrong) else ()
                mismatches.append(
                    f"rank {rank}: {name}{region(box.offsets, box.sizes)} in storage '{box.storage}': "
                    f"{len(wrong)} wrong elements, the first at {list(first)}"
                )
    return Verification(rank, boxes, nbytes, tuple(mismatches))


def _bits(values: torch.Tensor) -> torch.Tensor:
    # bool tensors are compared by their bytes, as the other dtypes are by their values
    return values.view(torch.uint8) if values.dtype == torch.bool else values


# ------------------------------------------------------------------- safetensors


class SafetensorsCheckpoint:
    """A checkpoint of whole logical tensors (a .safetensors file, an index, or a folder),
    from which each rank reads only its own boxes: files are memory-mapped and a box
    touches only the pages of its rows."""

    def __init__(self, path: str | os.PathLike[str]):
        start = checkpoint_file(path)
        self.files: dict[str, tuple[Path, dict, int]] = {}
        shards = sorted(set(read_weight_map(start).values())) if start.suffix == ".json" else [start.name]
        self._maps: dict[Path, np.memmap] = {}
        for shard in shards:
            file = start.parent / shard
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
        whole = raw.view(torch_dtype(dtype)).view(tuple(shape)) if shape else raw.view(torch_dtype(dtype))
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
) -> None:
    """Write tensors to a .safetensors file (header, then the raw bytes in order)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name, tensor in tensors.items():
        dtype = dtype_name(tensor.dtype)
        if dtype is None:
            raise ModelDescriptionError(f"cannot write tensor '{name}' of dtype {tensor.dtype} to safetensors")
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
