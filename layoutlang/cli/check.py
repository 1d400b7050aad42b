"""``layoutlang check``: parse, elaborate and resolve programs; report every mistake.

Reading or checking a file that takes more than a couple of seconds (a program of a
hundred thousand tensors, meshes of a million ranks) is named on stderr while it runs
(:class:`~.progress.Progress`).
"""

from __future__ import annotations

import argparse

from ..errors import ExitCode, LayoutError
from ..lang import load
from ..plan.quantized import check_quantized_plan
from .arguments import add_allow_outside_includes
from .json_output import emit
from .progress import Progress
from .report import print_error

HELP = "validate .layout files"
DESCRIPTION = (
    "Parse every file, resolve every tensor of every layout and validate every "
    "storage on every rank. Exit 0 when all files are valid."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang check``."""
    parser.add_argument("files", nargs="+", metavar="FILE", help=".layout files")
    parser.add_argument("--json", action="store_true", help="print the verdicts and errors as one JSON object")
    add_allow_outside_includes(parser)


def run(args: argparse.Namespace) -> int:
    results = []
    errors: list[LayoutError] = []
    status = ExitCode.OK
    progress = Progress("check", args.json)
    for path in args.files:
        try:
            with progress.step(f"reading {path}"):
                program = load(path, allow_outside_includes=args.allow_outside_includes)
            with progress.step(f"checking {path}"):
                program.check()
                for statement in program.reshards.values():
                    # what plan would refuse of a quantized destination, named now
                    check_quantized_plan([program.layout(statement.source)], program.layout(statement.destination))
        except LayoutError as err:
            status = ExitCode.BAD_INPUT
            errors.append(err)
            if not args.json:
                print_error(err)
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
            singular = {"meshes": "mesh", "tensors": "tensor", "layouts": "layout", "reshards": "reshard"}
            described = ", ".join(f"{v:,} {k if v != 1 else singular[k]}" for k, v in counts.items())
            print(f"{path}: ok ({described})")
    if args.json:
        return emit("check", {"files": results}, status, errors)
    return status
