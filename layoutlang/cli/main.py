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
from ..errors import ExitCode, LayoutError, RuntimeFailure
from . import apply, check, doctor, plan, show, simulate, viz
from .report import print_error

__all__ = ["ExitCode", "build_parser", "main"]

log = logging.getLogger(__name__)

#: Every command, in the order ``--help`` lists them: a module with ``HELP``,
#: ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> exit status``.
COMMANDS = {
    "check": check,
    "show": show,
    "plan": plan,
    "apply": apply,
    "simulate": simulate,
    "viz": viz,
    "doctor": doctor,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (separate from :func:`main` so the docs can render it)."""
    parser = argparse.ArgumentParser(
        prog="layoutlang",
        description=(
            "Describe tensor layouts on device meshes in .layout files: check and show them; plan, "
            "simulate, apply and draw the reshards between them; and report what this machine offers."
        ),
    )
    parser.add_argument("--version", action="version", version=f"layoutlang {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    return parser


# ------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(COMMANDS[args.command].run(args))
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

