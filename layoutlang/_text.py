"""Text that several layers print: rank ranges, regions, sizes, times and tables (one copy each)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "counted",
    "elide",
    "human_bytes",
    "human_time",
    "parse_size",
    "rank_ranges",
    "rank_span",
    "ranks_phrase",
    "rate",
    "region",
    "table",
    "tensor_region",
]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, singular for one.

    >>> counted(1, "problem"), counted(3, "problem"), counted(0, "box", "boxes")
    ('1 problem', '3 problems', '0 boxes')
    """
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def elide(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters, ``...`` in the middle marking what is left out
    (a name or a string quoted in a message can be megabytes long).

    >>> elide("layers.0.self_attn.q_proj.weight", 21)
    'layers.0....oj.weight'
    >>> elide("short", 20)
    'short'
    """
    if len(text) <= width:
        return text
    keep = max(0, width - 3)
    head = (keep + 1) // 2
    return text[:head] + "..." + text[len(text) - (keep - head) :]


def rank_ranges(ranks: Iterable[int], *, through: str = "..", separator: str = ", ", min_run: int = 3) -> str:
    """Sorted ranks with runs of at least ``min_run`` consecutive ranks written ``a..b``.

    >>> rank_ranges([4, 0, 1, 2])
    '0..2, 4'
    >>> rank_ranges([0, 1, 2, 3, 8], through="-", separator=",", min_run=2)
    '0-3,8'
    """
    ordered = sorted(set(ranks))
    out: list[str] = []
    start = 0
    for i, r in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != r + 1:
            run = ordered[start : i + 1]
            if len(run) >= min_run:
                out.append(f"{run[0]}{through}{run[-1]}")
            else:
                out.extend(map(str, run))
            start = i + 1
    return separator.join(out)


def rank_span(ranks: Sequence[int]) -> str:
    """``4..7`` for consecutive ranks in order, else the list as written.

    >>> rank_span((4, 5, 6, 7)), rank_span([0, 2, 5])
    ('4..7', '[0, 2, 5]')
    """
    ordered = list(ranks)
    if ordered and ordered == list(range(ordered[0], ordered[0] + len(ordered))):
        return f"{ordered[0]}..{ordered[-1]}"
    return str(ordered)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3``, or ``ranks 0..2, 4``."""
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_ranges(ordered)}"


def region(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """``[0:512, 0:1024]``: a box as slices of its logical tensor."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def tensor_region(tensor: str, offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """``w[0:512, 0:1024]``."""
    return tensor + region(offsets, sizes)


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def human_time(seconds: float) -> str:
    """``2.6134`` -> ``'2.61 s'``; three significant digits, down to nanoseconds."""
    if seconds == 0:
        return "0 s"
    if math.isinf(seconds):
        return "inf"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def rate(bytes_per_second: float) -> str:
    """``4.5e11`` -> ``'450 GB/s'``."""
    bps = bytes_per_second
    return f"{bps / 1e12:.3g} TB/s" if bps >= 1e12 else f"{bps / 1e9:.3g} GB/s"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``64MiB`` -> 67108864; plain numbers are bytes (an ``argparse`` type)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 65536, 64MiB or 1GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def table(rows: Sequence[Sequence[object]], header: Sequence[str], right: set[int] | None = None) -> list[str]:
    """Rows aligned under a header; columns in ``right`` (default: all but the first) are
    right-aligned."""
    right = right if right is not None else set(range(1, len(header)))
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in [*cells, list(header)]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(out).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in cells)]
