"""Arguments several commands share, written once so that their spelling and help agree."""

from __future__ import annotations

import argparse

from .._text import parse_size, rank_ranges
from ..errors import LayoutValueError
from ..model import Program
from ..plan import DEFAULT_BUCKET_BYTES

__all__ = ["add_allow_outside_includes", "add_bucket_size", "add_file", "add_reshard", "check_per_rank"]


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


def add_bucket_size(parser: argparse.ArgumentParser) -> None:
    """``--bucket-size SIZE``: the staging memory per rank and bucket a plan is cut into."""
    parser.add_argument(
        "--bucket-size",
        metavar="SIZE",
        type=parse_size,
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
