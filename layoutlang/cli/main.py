"""The ``layoutlang`` command line.

Exit statuses are :class:`~layoutlang.errors.ExitCode`, by who must act. A user's mistake
(a bad ``.layout`` file, an unknown name on the command line: a
:class:`~layoutlang.errors.LayoutError`) prints the error with its place and caret on
stderr (one JSON object with ``--json``) and exits with ``BAD_INPUT`` (2). A failure at run
time (a peer that died or hung, NCCL failing, data lost: a
:class:`~layoutlang.errors.RuntimeFailure`) prints the same way and exits with
``FAILURE`` (1). Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from .. import __version__
from .._text import parse_size
from ..errors import ExitCode, LayoutError, RuntimeFailure
from ..model.dtypes import DTYPES
from ..plan import DEFAULT_BUCKET_BYTES, POLICIES
from . import apply, check, doctor, plan, show, simulate, viz
from .report import print_error

__all__ = ["ExitCode", "build_parser", "main"]

log = logging.getLogger(__name__)


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

    plan = commands.add_parser(
        "plan",
        help="compile the plan of a reshard statement and print its statistics",
        description="Compile the plan that turns the source layout of a reshard statement into "
        "its destination layout, validate it, and print bytes by kind (local, domain, network), "
        "messages, buckets, the lower bound and the gather-and-broadcast baseline.",
    )
    plan.add_argument("file", metavar="FILE", help="a .layout file")
    plan.add_argument("--reshard", metavar="NAME", help="the reshard statement (default: the only one)")
    plan.add_argument(
        "--explain",
        metavar="PATTERN",
        nargs="?",
        const="*",
        help='print the moves of the tensors matching PATTERN (default "*": all), one line each',
    )
    plan.add_argument("--limit", type=int, default=100, metavar="N", help="print at most N moves (default 100)")
    plan.add_argument(
        "--bucket-size",
        metavar="SIZE",
        type=parse_size,
        default=DEFAULT_BUCKET_BYTES,
        help="staging memory per rank and bucket, e.g. 64MiB (default 256MiB)",
    )
    plan.add_argument(
        "--policy",
        choices=POLICIES,
        help="one policy for every tensor, overriding the statement's rules",
    )
    plan.add_argument("--per-rank", action="store_true", help="also print bytes sent and received per rank")
    plan.add_argument(
        "--no-compare", action="store_true", help="do not compile the gather-and-broadcast baseline"
    )
    plan.add_argument(
        "--out", metavar="PLAN", help="write the plan: JSON when PLAN ends in .json, else the binary form"
    )
    plan.add_argument("--json", action="store_true", help="print the statistics (and explained moves) as JSON")

    apply = commands.add_parser(
        "apply",
        help="run a refit for real and verify every destination byte",
        description="Run the plan of a reshard statement. Launched by torchrun, every process joins the job "
        "as the program rank of its RANK; launched alone, one local worker process per rank of the "
        "reshard's meshes is started and joined over gloo. Sources hold synthetic weights (or the "
        "boxes of a safetensors checkpoint); every destination byte is compared with the source of truth.",
    )
    apply.add_argument("file", metavar="FILE", help="a .layout file")
    apply.add_argument("--reshard", metavar="NAME", help="the reshard statement (default: the only one)")
    apply.add_argument("--policy", choices=POLICIES, help="one policy for every tensor, overriding the statement's")
    apply.add_argument(
        "--compare", action="store_true", help="also run the gather-and-broadcast plan and compare"
    )
    apply.add_argument("--from", dest="from_dir", metavar="DIR", help="read source weights from a safetensors checkpoint")
    apply.add_argument("--to", dest="to_dir", metavar="DIR", help="write each destination rank's storages to DIR/rankNNNNN.safetensors")
    apply.add_argument(
        "--memory-budget",
        metavar="SIZE",
        type=parse_size,
        default=512 * 2**20,
        help="staging memory per rank (default 512MiB; buckets are half of it)",
    )
    apply.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds to wait for a peer (default 300)")
    apply.add_argument("--cast", choices=sorted({DTYPES[d][1] for d in DTYPES}), metavar="DTYPE",
                       help="destination dtype, converted on arrival (e.g. bfloat16)")
    apply.add_argument("--repeat", type=int, default=1, metavar="N", help="run N times and report the fastest")
    apply.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="under torchrun: where storages live")
    apply.add_argument(
        "--transport",
        choices=("torch", "nccl"),
        default="torch",
        help="torch.distributed point-to-point (gloo on CPU, NCCL on GPU), or layoutlang's native NCCL core",
    )
    apply.add_argument("--json", action="store_true", help="print the report as JSON")
    elastic = apply.add_argument_group(
        "elastic refits",
        "With --elastic, the refit runs --steps times in an elastic session: ranks that fail are "
        "excluded, the layouts are remeshed, and the refit goes on without restarting anyone "
        "(docs: guides/failure-recovery).",
    )
    elastic.add_argument("--elastic", action="store_true", help="repeated refits that survive rank loss and replacement")
    elastic.add_argument("--steps", type=int, default=4, metavar="N", help="refits to run (default 4)")
    elastic.add_argument(
        "--kill", action="append", default=[], type=_rank_at_step, metavar="RANK@STEP",
        help="SIGKILL RANK halfway through the transfer of refit STEP (repeatable)",
    )
    elastic.add_argument(
        "--stop", action="append", default=[], type=_rank_at_step, metavar="RANK@STEP",
        help="SIGSTOP RANK halfway through refit STEP: a hung rank, excluded after about two deadlines",
    )
    elastic.add_argument("--replace", action="store_true", help="start a replacement rank for every rank killed or stopped")
    elastic.add_argument("--deadline", type=float, default=1.0, metavar="S",
                         help="seconds of silence after which a rank counts as failed (default 1)")
    elastic.add_argument("--source-policy", default="drop-replica", metavar="POLICY",
                         help="remesh policy of the source layout when it loses ranks (default drop-replica)")
    elastic.add_argument("--destination-policy", default="drop-replica", metavar="POLICY",
                         help="remesh policy of the destination layout (default drop-replica; shrink-axis needs --destination-axis)")
    elastic.add_argument("--source-axis", metavar="AXIS", help="the axis the source policy shrinks")
    elastic.add_argument("--destination-axis", metavar="AXIS", help="the axis the destination policy shrinks")

    for module, name in ((simulate, "simulate"), (viz, "viz")):
        module.add_arguments(commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION))

    doctor_parser = commands.add_parser(
        "doctor",
        help="report the NCCL, CUDA and torch this machine offers",
        description="Find NCCL as the nccl transport would (environment override, the library already in "
        "the process, an nvidia-nccl wheel, the system), report its version and whether it offers "
        "ncclCommShrink, ncclCommRevoke and ncclCommGrow, and the CUDA runtime and torch facts.",
    )
    doctor.add_arguments(doctor_parser)
    return parser



def _rank_at_step(text: str) -> tuple[int, int]:
    rank, at, step = text.partition("@")
    if not at or not rank.strip().isdigit() or not step.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK@STEP (e.g. 5@1), not {text!r}")
    return int(rank), int(step)




# ------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    commands = {
        "check": check.run,
        "show": show.run,
        "plan": plan.run,
        "apply": apply.run,
        "simulate": simulate.run,
        "viz": viz.run,
        "doctor": doctor.run,
    }
    try:
        return int(commands[args.command](args))
    except (LayoutError, RuntimeFailure) as err:
        print_error(err, getattr(args, "json", False))
        return err.exit_code
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

