"""Arguments several commands share, written once so that their spelling and help agree."""

from __future__ import annotations

import argparse

from .._text import parse_size
from ..plan import DEFAULT_BUCKET_BYTES

__all__ = ["add_bucket_size", "add_file", "add_reshard"]


def add_file(parser: argparse.ArgumentParser) -> None:
    """The program: ``FILE``, a .layout file."""
    parser.add_argument("file", metavar="FILE", help="a .layout file")


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
