"""``layoutlang show``: every rank's boxes and storages, per layout."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .._text import rank_span, region, table
from ..errors import ExitCode, LayoutNameError
from ..lang import load
from ..model import Box, Layout
from ..model.dtypes import itemsize
from . import arguments
from .json_output import emit

HELP = "print which boxes each rank holds"
DESCRIPTION = (
    "Print, per layout, rank and tensor, the boxes each rank holds (global region) "
    "and where they sit in the rank's storage."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang show``."""
    arguments.add_file(parser)
    parser.add_argument("--layout", metavar="L", help="only this layout (default: all)")
    parser.add_argument(
        "--tensor", metavar="T", help='only tensors matching this name or pattern ("*" and "{x}" allowed)'
    )
    parser.add_argument("--rank", metavar="R", type=arguments.rank_number, help="only this rank")
    parser.add_argument("--summary", action="store_true", help="per rank totals instead of boxes")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _mesh_line(layout: Layout) -> str:
    mesh = layout.mesh
    axes = ", ".join(f"{a}={s}" for a, s in mesh.axes)
    return f"layout {layout.name} on mesh {mesh.name} [{axes}] (ranks {rank_span(mesh.ranks)})"


def _selected_ranks(layout: Layout, rank: int | None, named: bool) -> list[int]:
    """The ranks of ``layout`` to show: all, or ``rank`` (none when its mesh lacks it,
    unless the layout was ``named`` on the command line: then that is a mistake)."""
    if rank is None:
        return list(layout.mesh.ranks)
    if rank in layout.mesh:
        return [rank]
    if named:
        raise LayoutNameError(
            f"rank {rank} is not in mesh '{layout.mesh.name}' of layout '{layout.name}' "
            f"(ranks {rank_span(layout.mesh.ranks)})"
        )
    return []


def _summary(layout: Layout, ranks: list[int]) -> tuple[dict[str, Any], list[str]]:
    """Per-rank totals: the JSON record and the table. Where the layout stores tensors
    quantized, ``stored bytes`` counts what the rank holds: quantized values at their dtype,
    their scales, the other tensors at theirs (``bytes`` counts every tensor at its own dtype)."""
    totals = [r for r in layout.summary() if r["rank"] in ranks]
    header = ["rank", "tensors", "boxes", "elements", "bytes"]
    if layout.quantized():
        for total in totals:
            total["stored_bytes"] = _stored_bytes(layout, total["rank"])
        header.append("stored bytes")
    cells = [[r["rank"], r["tensors"], r["boxes"], r["elements"], r["bytes"], *([r["stored_bytes"]] if
             "stored_bytes" in r else [])] for r in totals]
    lines = table(cells, header, set(range(len(header))))
    return {"layout": layout.name, "mesh": layout.mesh.name, "summary": totals}, lines


def _stored_bytes(layout: Layout, rank: int) -> int:
    """What ``rank`` holds of ``layout`` as stored: quantized values and their scales included."""
    total = 0
    for name, tensor in layout.tensors.items():
        q = layout.quantization(name)
        size = itemsize(q.values if q is not None else tensor.dtype)
        boxes = layout.boxes(name, rank)
        total += sum(math.prod(box.sizes) for box in boxes) * size
        if q is not None and boxes:
            total += sum(math.prod(box.sizes) for box in layout.scale_boxes(name, rank)) * itemsize(q.scale.dtype)
    return total


def _place(box: Box) -> str:
    """``[2, 6:12, 0:16]``: the box's index in its storage (an element of a stacked storage as
    one integer), with ``.T`` when the box sits transposed there."""
    items = [i if isinstance(i, int) else f"{i.start}:{i.stop}" for i in box.storage_index()]
    return "[" + ", ".join(map(str, items)) + "]" + (".T" if box.transposed else "")


def _boxes(layout: Layout, ranks: list[int], tensors: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Every box of ``tensors`` on ``ranks``, with its place in its storage: the JSON record and
    the table. Where the layout stores tensors quantized, a ``stored as`` column gives each
    box's stored dtype, and each quantized tensor's scale boxes follow it (``scale of``)."""
    quantized = layout.quantized()
    cells: list[list[object]] = []
    records: list[dict[str, Any]] = []

    def add(rank: int, tensor: str, box: Box, stored: str, scale_of: str | None = None) -> None:
        shape = layout.storage_shape(box.storage, rank) if box.storage is not None and scale_of is None else None
        if scale_of is not None:
            shape = layout.scale_storages_on(rank).get(box.storage or "")
        cells.append(
            [rank, tensor, region(box.offsets, box.sizes), box.storage, _place(box), "x".join(map(str, shape or ())),
             *([stored] if quantized else [])]
        )
        record = {
            "rank": rank,
            "tensor": tensor,
            "offsets": list(box.offsets),
            "sizes": list(box.sizes),
            "storage": box.storage,
            "storage_offsets": list(box.storage_offsets),
        }
        storage_sizes = [s.stop - s.start for s in box.storage_slices()]
        if box.transposed or storage_sizes != list(box.sizes):  # a stacked or transposed place
            record |= {"storage_sizes": storage_sizes, "transposed": box.transposed}
        if quantized:
            record["stored_dtype"] = stored
        if scale_of is not None:
            record["scale_of"] = scale_of
        records.append(record)

    for rank in ranks:
        for tensor in tensors:
            q = quantized.get(tensor)
            boxes = layout.boxes(tensor, rank)
            for box in boxes:
                add(rank, tensor, box, q.values if q is not None else layout.tensors[tensor].dtype)
            if q is not None and boxes:
                for box in layout.scale_boxes(tensor, rank):
                    add(rank, q.scale.name, box, q.scale.dtype, scale_of=tensor)
    header = ["rank", "tensor", "region", "storage", "place", "storage shape", *(["stored as"] if quantized else [])]
    lines = table(cells, header, {0}) if cells else ["(no boxes)"]
    return {"layout": layout.name, "mesh": layout.mesh.name, "boxes": records}, lines


def run(args: argparse.Namespace) -> int:
    program = load(args.file, allow_outside_includes=args.allow_outside_includes)
    layouts = [program.layout(args.layout)] if args.layout else list(program.layouts.values())
    tensors = arguments.tensors_matching(program, args.tensor)
    out: list[dict[str, Any]] = []
    lines: list[str] = []
    for layout in layouts:
        layout.check()
        ranks = _selected_ranks(layout, args.rank, named=bool(args.layout))
        if args.rank is not None and not ranks:
            continue
        lines.append(_mesh_line(layout))
        record, shown = _summary(layout, ranks) if args.summary else _boxes(layout, ranks, tensors)
        out.append(record)
        lines += [*shown, ""]
    if args.rank is not None and not out:
        raise LayoutNameError(f"rank {args.rank} belongs to no mesh of any layout in {program.path}")
    if args.json:
        return emit("show", {"layouts": out})
    else:
        print("\n".join(lines).rstrip())
    return ExitCode.OK
