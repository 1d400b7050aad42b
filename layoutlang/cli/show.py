"""``layoutlang show``: every rank's boxes and storages, per layout."""

from __future__ import annotations

import argparse
import json

from .._text import region, table
from ..errors import ExitCode, LayoutNameError, did_you_mean
from ..lang import load
from ..model import Layout, Program, compile_pattern


def _mesh_line(layout: Layout) -> str:
    mesh = layout.mesh
    axes = ", ".join(f"{a}={s}" for a, s in mesh.axes)
    ranks = mesh.ranks
    contiguous = ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
    where = f"ranks {ranks[0]}..{ranks[-1]}" if contiguous else f"ranks {list(ranks)}"
    return f"layout {layout.name} on mesh {mesh.name} [{axes}] ({where})"




def _selected_tensors(program: Program, pattern: str | None) -> list[str]:
    if pattern is None:
        return list(program.tensors)
    if pattern in program.tensors:
        return [pattern]
    regex = compile_pattern(pattern)
    found = [t for t in program.tensors if regex.fullmatch(t)]
    if not found:
        raise LayoutNameError(
            f"no tensor matches '{pattern}' in {program.path}", hint=did_you_mean(pattern, program.tensors)
        )
    return found


def run(args: argparse.Namespace) -> int:
    program = load(args.file)
    layouts = [program.layout(args.layout)] if args.layout else list(program.layouts.values())
    tensors = _selected_tensors(program, args.tensor)
    out: list[dict] = []
    lines: list[str] = []
    for layout in layouts:
        layout.check()
        ranks = list(layout.mesh.ranks)
        if args.rank is not None:
            if args.rank not in layout.mesh:
                if args.layout:
                    raise LayoutNameError(
                        f"rank {args.rank} is not in mesh '{layout.mesh.name}' of layout '{layout.name}' "
                        f"(ranks {layout.mesh.ranks[0]}..{layout.mesh.ranks[-1]})"
                    )
                continue
            ranks = [args.rank]
        lines.append(_mesh_line(layout))
        if args.summary:
            rows = [r for r in layout.summary() if r["rank"] in ranks]
            out.append({"layout": layout.name, "mesh": layout.mesh.name, "summary": rows})
            cells = [[r["rank"], r["tensors"], r["boxes"], r["elements"], r["bytes"]] for r in rows]
            lines += table(cells, ["rank", "tensors", "boxes", "elements", "bytes"], {0, 1, 2, 3, 4})
            lines.append("")
            continue
        rows = []
        records = []
        for rank in ranks:
            for tensor in tensors:
                for box in layout.boxes(tensor, rank):
                    rows.append(
                        [
                            rank,
                            tensor,
                            region(box.offsets, box.sizes),
                            box.storage,
                            region(box.storage_offsets, box.sizes),
                            "x".join(map(str, layout.storage_shape(box.storage, rank) or ())),
                        ]
                    )
                    records.append(
                        {
                            "rank": rank,
                            "tensor": tensor,
                            "offsets": list(box.offsets),
                            "sizes": list(box.sizes),
                            "storage": box.storage,
                            "storage_offsets": list(box.storage_offsets),
                        }
                    )
        out.append({"layout": layout.name, "mesh": layout.mesh.name, "boxes": records})
        if rows:
            lines += table(rows, ["rank", "tensor", "region", "storage", "place", "storage shape"], {0})
        else:
            lines.append("(no boxes)")
        lines.append("")
    if args.rank is not None and not out:
        raise LayoutNameError(f"rank {args.rank} belongs to no mesh of any layout in {program.path}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(lines).rstrip())
    return ExitCode.OK

