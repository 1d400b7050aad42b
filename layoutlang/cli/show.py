"""``layoutlang show``: every rank's boxes and storages, per layout."""

from __future__ import annotations

import argparse
from typing import Any

from .._text import rank_span, region, table
from ..errors import ExitCode, LayoutNameError
from ..lang import load
from ..model import Box, Layout
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
    """Per-rank totals: the JSON record and the table."""
    totals = [r for r in layout.summary() if r["rank"] in ranks]
    cells = [[r["rank"], r["tensors"], r["boxes"], r["elements"], r["bytes"]] for r in totals]
    lines = table(cells, ["rank", "tensors", "boxes", "elements", "bytes"], {0, 1, 2, 3, 4})
    return {"layout": layout.name, "mesh": layout.mesh.name, "summary": totals}, lines


def _place(box: Box) -> str:
    """``[2, 6:12, 0:16]``: the box's index in its storage (an element of a stacked storage as
    one integer), with ``.T`` when the box sits transposed there."""
    items = [i if isinstance(i, int) else f"{i.start}:{i.stop}" for i in box.storage_index()]
    return "[" + ", ".join(map(str, items)) + "]" + (".T" if box.transposed else "")


def _boxes(layout: Layout, ranks: list[int], tensors: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Every box of ``tensors`` on ``ranks``, with its place in its storage: the JSON record and the table."""
    cells: list[list[object]] = []
    records: list[dict[str, Any]] = []
    for rank in ranks:
        for tensor in tensors:
            for box in layout.boxes(tensor, rank):
                shape = layout.storage_shape(box.storage, rank) if box.storage is not None else None
                cells.append(
                    [
                        rank,
                        tensor,
                        region(box.offsets, box.sizes),
                        box.storage,
                        _place(box),
                        "x".join(map(str, shape or ())),
                    ]
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
                records.append(record)
    if cells:
        lines = table(cells, ["rank", "tensor", "region", "storage", "place", "storage shape"], {0})
    else:
        lines = ["(no boxes)"]
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
