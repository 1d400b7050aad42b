"""Arguments several commands share, written once so that their spelling and help agree."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .._text import parse_size, rank_ranges
from ..errors import LayoutNameError, LayoutValueError, did_you_mean
from ..model import Program, compile_pattern
from ..plan import DEFAULT_BUCKET_BYTES, POLICIES

__all__ = [
    "MAX_SECONDS",
    "MAX_SIZE",
    "add_allow_outside_includes",
    "add_bucket_size",
    "add_file",
    "add_reshard",
    "check_per_rank",
    "choice_of",
    "count",
    "memory_size",
    "positive_count",
    "rank_number",
    "seconds",
]

#: The longest wait an option may ask for (a week): beyond it a timeout is a mistake, and
#: datetime.timedelta, which torch's waits take, overflows long before float does.
MAX_SECONDS = 7 * 24 * 3600.0


# ------------------------------------------------------------- argparse types
#
# Each raises argparse.ArgumentTypeError with the value it refuses: argparse then prints
# "argument --timeout: ..." with the usage line and exits 2, before any command runs, so
# no worker ever sees a value that would only fail inside it.


def seconds(text: str) -> float:
    """A wait in seconds: a finite number above zero and at most :data:`MAX_SECONDS`
    (``nan``, ``inf``, 0 and negative waits are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds such as 30 or 0.5, not {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds above 0, not {text!r}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is more than a week ({MAX_SECONDS:g} s)")
    return value


#: The largest staging memory or bucket an option may ask for (1 TiB per rank): far above
#: any device's memory, and within the 64-bit sizes the core computes with.
MAX_SIZE = 1 << 40


def memory_size(text: str) -> int:
    """A size in bytes such as ``64MiB`` (:func:`~layoutlang._text.parse_size`), at least one
    byte and at most :data:`MAX_SIZE`."""
    value = parse_size(text)
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1TiB, the most staging memory a rank may be given")
    return value


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}") from None


def positive_count(text: str) -> int:
    """A count of at least 1 (``--repeat``, ``--steps``)."""
    value = _integer(text, "a whole number of at least 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def fraction(text: str) -> float:
    """A fraction within [0, 1] (``--change-fraction``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.01, not {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a fraction within [0, 1], not {text!r}")
    return value


def count(text: str) -> int:
    """A count of 0 or more (``--limit``)."""
    value = _integer(text, "a whole number of 0 or more")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of 0 or more, not {text!r}")
    return value


def rank_number(text: str) -> int:
    """A rank: a whole number of 0 or more (``--rank``)."""
    value = _integer(text, "a rank (a whole number of 0 or more)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"a rank is 0 or more, not {text!r}")
    return value


def choice_of(names: tuple[str, ...], what: str) -> Callable[[str], str]:
    """An argparse type taking one of ``names``; the refusal lists them all and suggests the
    nearest (argparse's ``choices=`` says the same, but cannot say what the names are of)."""

    def parse(text: str) -> str:
        if text in names:
            return text
        hint = did_you_mean(text, names)
        raise argparse.ArgumentTypeError(
            f"unknown {what} {text!r} (known: {', '.join(names)})" + (f"; {hint}" if hint else "")
        )

    parse.__name__ = what.replace(" ", "_")
    return parse


def add_file(parser: argparse.ArgumentParser) -> None:
    """The program: ``FILE``, a .layout file (and ``--allow-outside-includes`` for its includes)."""
    parser.add_argument("file", metavar="FILE", help="a .layout file")
    add_allow_outside_includes(parser)


def add_allow_outside_includes(parser: argparse.ArgumentParser) -> None:
    """``--allow-outside-includes``: lift the confinement of a program's includes to its folder."""
    parser.add_argument(
        "--allow-outside-includes",
        action="store_true",
        help="let the program include files outside its folder (and its presets): for a program you trust;"
        " kernel and device files (/proc, /sys, /dev) stay refused",
    )


def add_reshard(parser: argparse.ArgumentParser) -> None:
    """``--reshard NAME``: which reshard statement of the program."""
    parser.add_argument("--reshard", metavar="NAME", help="the reshard statement (default: the only one)")


def add_policy(parser: argparse.ArgumentParser) -> None:
    """``--policy``: one plan policy for every tensor."""
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        help="one policy for every tensor (reshard: exact overlaps; broadcast: gather and broadcast), "
        "overriding the reshard statement's per-tensor policies",
    )


def add_bucket_size(parser: argparse.ArgumentParser) -> None:
    """``--bucket-size SIZE``: the staging memory per rank and bucket a plan is cut into."""
    parser.add_argument(
        "--bucket-size",
        metavar="SIZE",
        type=memory_size,
        default=DEFAULT_BUCKET_BYTES,
        help="staging memory per rank and bucket, e.g. 64MiB (default 256MiB)",
    )


def check_per_rank(
    program: Program, reshard: str | None, policy: str | None, flag: str, rank: int | None = None
) -> None:
    """Refuse, in one line naming ``flag``, what has no per-rank (pairwise) plan, before
    anything is compiled or started: gather-and-broadcast (``--policy broadcast``, or the
    statement's broadcast rules), and a ``rank`` in neither mesh of the reshard."""
    statement = program.reshard(reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    if rank is not None and rank not in source.mesh and rank not in destination.mesh:
        raise LayoutValueError(
            f"{flag}: rank {rank} belongs to neither mesh of reshard '{statement.name}' ('{source.name}': ranks "
            f"{rank_ranges(source.mesh.ranks)}, '{destination.name}': ranks {rank_ranges(destination.mesh.ranks)})"
        )
    if policy == "broadcast":
        raise LayoutValueError(
            f"{flag} with --policy broadcast: gather-and-broadcast has no per-rank plan (pairwise plans move "
            "tensors by the reshard policy only)",
            hint="drop --policy broadcast, or use the whole fleet's plan for it",
        )
    if policy is None:
        broadcast = [name for name in source.resolved.names if statement.policy_for(name) == "broadcast"]
        if broadcast:
            shown = ", ".join(repr(n) for n in broadcast[:3]) + (
                f" and {len(broadcast) - 3} more" if len(broadcast) > 3 else ""
            )
            raise LayoutValueError(
                f"{flag}: reshard '{statement.name}' gathers and broadcasts {len(broadcast)} "
                f"tensor{'s' if len(broadcast) != 1 else ''} ({shown}), which has no per-rank plan",
                hint="pass --policy reshard to reshard every tensor, or use the whole fleet's plan",
            )


def tensors_matching(program: Program, pattern: str | None) -> list[str]:
    """The tensors of ``program`` that ``pattern`` (a name, or a pattern such as
    ``"model.layers.{l}.*"``) names, all of them for None; none is a mistake, named at once
    with the nearest tensor (``show --tensor``, ``plan --explain``: before anything compiles)."""
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
