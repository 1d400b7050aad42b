"""The ``layoutlang`` command line.

Exit statuses are :class:`ExitCode`. A user's mistake (a bad ``.layout`` file, an unknown
name on the command line) prints the error with its place and caret on stderr (one JSON
object with ``--json``) and exits with ``ExitCode.BAD_INPUT``; it never prints a traceback.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import sys
from collections.abc import Sequence

from . import __version__
from .elaborate import load
from .errors import LayoutError, LayoutNameError, did_you_mean
from .model import Layout, Program, compile_pattern

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    OK = 0  #: success
    FAILURE = 1  #: the command ran and found a failure (e.g. a verification mismatch)
    BAD_INPUT = 2  #: usage error or invalid input (bad .layout file, unknown name)
    INTERNAL = 3  #: a bug in layoutlang; please report it


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (separate from :func:`main` so the docs can render it)."""
    parser = argparse.ArgumentParser(
        prog="layoutlang",
        description="Describe tensor layouts on device meshes, and check and show them.",
    )
    parser.add_argument("--version", action="version", version=f"layoutlang {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check",
        help="validate .layout files",
        description="Parse every file, resolve every tensor of every layout and validate every "
        "storage on every rank. Exit 0 when all files are valid.",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help=".layout files")
    check.add_argument("--json", action="store_true", help="print results (stdout) and errors (stderr) as JSON")

    show = commands.add_parser(
        "show",
        help="print which boxes each rank holds",
        description="Print, per layout, rank and tensor, the boxes each rank holds (global region) "
        "and where they sit in the rank's storage.",
    )
    show.add_argument("file", metavar="FILE", help="a .layout file")
    show.add_argument("--layout", metavar="L", help="only this layout (default: all)")
    show.add_argument(
        "--tensor", metavar="T", help='only tensors matching this name or pattern ("*" and "{x}" allowed)'
    )
    show.add_argument("--rank", metavar="R", type=int, help="only this rank")
    show.add_argument("--summary", action="store_true", help="per rank totals instead of boxes")
    show.add_argument("--json", action="store_true", help="print JSON")
    return parser


# ------------------------------------------------------------------------ check


def _check(args: argparse.Namespace) -> int:
    results = []
    status = ExitCode.OK
    for path in args.files:
        try:
            program = load(path)
            program.check()
        except LayoutError as err:
            status = ExitCode.BAD_INPUT
            _report(err, args.json)
            results.append({"file": path, "ok": False, **err.to_json()})
            continue
        counts = {
            "meshes": len(program.meshes),
            "tensors": len(program.tensors),
            "layouts": len(program.layouts),
            "reshards": len(program.reshards),
        }
        results.append({"file": path, "ok": True, **counts})
        if not args.json:
            print(f"{path}: ok ({', '.join(f'{v} {k}' for k, v in counts.items())})")
    if args.json:
        print(json.dumps(results, indent=2))
    return status


# ------------------------------------------------------------------------- show


def _region(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _mesh_line(layout: Layout) -> str:
    mesh = layout.mesh
    axes = ", ".join(f"{a}={s}" for a, s in mesh.axes)
    ranks = mesh.ranks
    contiguous = ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
    where = f"ranks {ranks[0]}..{ranks[-1]}" if contiguous else f"ranks {list(ranks)}"
    return f"layout {layout.name} on mesh {mesh.name} [{axes}] ({where})"


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


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


def _show(args: argparse.Namespace) -> int:
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
            table = [[r["rank"], r["tensors"], r["boxes"], r["elements"], r["bytes"]] for r in rows]
            lines += _table(table, ["rank", "tensors", "boxes", "elements", "bytes"], {0, 1, 2, 3, 4})
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
                            _region(box.offsets, box.sizes),
                            box.storage,
                            _region(box.storage_offsets, box.sizes),
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
            lines += _table(rows, ["rank", "tensor", "region", "storage", "place", "storage shape"], {0})
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


# ------------------------------------------------------------------------- main


def _report(err: LayoutError, as_json: bool) -> None:
    if as_json:
        print(json.dumps(err.to_json()), file=sys.stderr)
    else:
        print(err, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    commands = {"check": _check, "show": _show}
    try:
        return int(commands[args.command](args))
    except LayoutError as err:
        _report(err, getattr(args, "json", False))
        return ExitCode.BAD_INPUT
    except BrokenPipeError:  # `layoutlang show ... | head`
        return ExitCode.OK
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except Exception as err:  # a bug in layoutlang, not the user's mistake: still no traceback
        log.debug("internal error", exc_info=True)
        if getattr(args, "json", False):
            print(json.dumps({"error": "internal", "message": f"{type(err).__name__}: {err}"}), file=sys.stderr)
        else:
            print(
                f"layoutlang: internal error: {type(err).__name__}: {err}\n"
                "  please report it; run with -vv to see the traceback",
                file=sys.stderr,
            )
        return ExitCode.INTERNAL


if __name__ == "__main__":
    sys.exit(main())
