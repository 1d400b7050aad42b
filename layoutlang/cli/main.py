"""The ``layoutlang`` command line.

Exit statuses are :class:`~layoutlang.errors.ExitCode`, by who must act. A user's mistake
(a bad ``.layout`` file, an unknown name on the command line: a
:class:`~layoutlang.errors.LayoutError`) prints the error with its place and caret on
stderr and exits with ``BAD_INPUT`` (2). A failure at run time (a peer that died or hung,
NCCL failing, data lost: a :class:`~layoutlang.errors.RuntimeFailure`) prints the same way
and exits with ``FAILURE`` (1). Neither prints a traceback. With ``--json`` on the command
line every outcome, usage errors included, is the one envelope of
:mod:`~layoutlang.cli.json_output` on stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import ExitCode, LayoutError, RuntimeFailure
from . import apply, check, doctor, plan, show, simulate, viz
from .json_output import emit, error_json
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


class UsageError(Exception):
    """A usage error the argument parser ``prog`` found while ``--json`` was asked for."""

    def __init__(self, prog: str, message: str, usage: str):
        super().__init__(message)
        self.prog, self.message, self.usage = prog, message, usage


class _Parser(argparse.ArgumentParser):
    """argparse's parser; with ``json_errors`` a usage error raises :class:`UsageError` (main
    prints it in the JSON envelope) instead of printing argparse's text and exiting."""

    def __init__(self, *args: object, json_errors: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.json_errors = json_errors

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            raise UsageError(self.prog, message, self.format_usage().strip())
        super().error(message)


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The argument parser (separate from :func:`main` so the docs can render it); with
    ``json_errors``, a usage error raises :class:`UsageError` instead of exiting."""
    parser = _Parser(
        json_errors=json_errors,
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
        sub = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION, json_errors=json_errors)
        module.add_arguments(sub)
    return parser


# ------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(json_errors="--json" in argv).parse_args(argv)
    except UsageError as err:
        # the subcommand's parser names its command; the top-level one (an unknown option) does not
        named = [word for word in (err.prog.split()[-1], *argv) if word in COMMANDS]
        usage = error_json("usage", err.message, usage=err.usage)
        return emit(named[0] if named else None, None, ExitCode.BAD_INPUT, [usage])
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    as_json = getattr(args, "json", False)
    try:
        return int(COMMANDS[args.command].run(args))
    except (LayoutError, RuntimeFailure) as err:
        if as_json:
            return emit(args.command, None, err.exit_code, [err])
        print_error(err)
        return err.exit_code
    except BrokenPipeError:  # `layoutlang show ... | head`
        return ExitCode.OK
    except KeyboardInterrupt:
        if as_json:
            return emit(args.command, None, ExitCode.FAILURE, [error_json("interrupted", "interrupted (SIGINT)")])
        return ExitCode.FAILURE
    except Exception as err:  # a bug in layoutlang, not the user's mistake: still no traceback
        log.debug("internal error", exc_info=True)
        if as_json:
            internal = error_json("internal", f"{type(err).__name__}: {err}")
            return emit(args.command, None, ExitCode.INTERNAL, [internal])
        print(
            f"layoutlang: internal error: {type(err).__name__}: {err}\n"
            "  please report it; run with -vv to see the traceback",
            file=sys.stderr,
        )
        return ExitCode.INTERNAL
