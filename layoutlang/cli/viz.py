"""Pictures of one tensor's layouts and of the plan's moves between them.

``layoutlang viz FILE --tensor NAME --out FILE.png`` draws, for the ``reshard`` statement
of a program:

- the tensor twice, as its **source** layout holds it and as its **destination** layout
  holds it: every box a rank holds is a rectangle in global coordinates (dim 0 down, dim 1
  across), coloured by the rank (the same colour in every panel, repeating beyond 20 ranks) and labelled
  with the ranks holding it (a box several ranks hold is drawn once, hatched, with all of
  them);
- the **moves** of the tensor in the plan as a matrix: one row per sending rank, one column
  per receiving rank, each cell coloured by the kind of move between the two (local copy,
  NVLink, network, relay) and labelled with the bytes when there is room; the rank labels
  take the ranks' colours.

A program without a ``reshard`` statement gets one panel per layout and no matrix. Tensors
of more than two dims are drawn by their first two dims (the title says so); a tensor of
one dim as a strip.

Those panels are in the tensor's coordinates, so they are the same whether a rank keeps
the tensor alone, fused with others, stacked with other experts or transposed. With
``--rank R`` (repeatable) each layout that holds the tensor on rank ``R`` also gets a
panel of **the storage** there, in the coordinates of the shape its parts make
(``Layout.parts_shape``): every part's box on that rank at its place, the drawn tensor's
in the rank's colour, the other parts grey, a transposed place labelled ``.T`` (drawn
where it sits, with its dims swapped). A storage of more than two dims (a stacked
``w13_weight [local experts, 2 * I / tp, H]``) is drawn by its last two dims at the drawn
tensor's index in the leading ones: its element of the stack.

matplotlib is needed only here; the pictures are drawn with its Agg canvas, without pyplot, so
drawing leaves an interactive session's matplotlib state alone.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from .._text import human_bytes, rank_ranges
from ..errors import LayoutNameError, LayoutValueError, did_you_mean
from ..lang import load
from ..model import Box, Layout, Program
from ..plan import Move, Plan, compile_plan
from . import arguments

if TYPE_CHECKING:  # matplotlib is imported when a picture is drawn (it is slow to import)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DESCRIPTION", "HELP", "StoragePlaces", "add_arguments", "draw", "ownership", "run", "storage_places"]

#: colours of the kinds of moves in the matrix
KIND_COLORS = {
    "local": "#9e9e9e",
    "domain": "#2e7d32",
    "network": "#ef6c00",
    "relay": "#1565c0",
}
KIND_LABELS = {"local": "local copy", "domain": "NVLink (domain)", "network": "network", "relay": "relay (NVLink)"}
MAX_MATRIX = 96  # ranks per matrix axis drawn one by one; beyond, only ranks that move are kept


def _matplotlib() -> tuple[Callable[..., Figure], ModuleType]:
    """matplotlib's Figure (drawn by the Agg canvas, without pyplot's global state) and patches."""
    try:
        from matplotlib import patches
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the viz command
        raise LayoutValueError("layoutlang viz needs matplotlib: pip install matplotlib") from None

    def figure(**kwargs: Any) -> Figure:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    return figure, patches


def ownership(layout: Layout, tensor: str) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Every distinct box of ``tensor`` in ``layout`` with the ranks holding it:
    ``(offsets, sizes, ranks)``, in the order of their first rank."""
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank in layout.holders(tensor):
        for box in layout.boxes(tensor, rank):
            if box.numel:
                found.setdefault((box.offsets, box.sizes), []).append(rank)
    return [(o, s, tuple(r)) for (o, s), r in found.items()]


@attrs.frozen
class StoragePlaces:
    """What a rank's storage of one tensor holds: the storage, the shape its parts make,
    the shape the engine holds (``as [...]``, else the same), ``index`` (the drawn tensor's
    start in every dim but the last two: the element of a stack), and every part's box
    there as ``(part, box)``, the boxes' places being in the parts' shape."""

    storage: str
    parts_shape: tuple[int, ...]
    engine_shape: tuple[int, ...]
    index: tuple[int, ...]
    places: tuple[tuple[str, Box], ...]


def storage_places(layout: Layout, tensor: str, rank: int) -> StoragePlaces | None:
    """The storage that holds ``tensor`` on ``rank`` in ``layout`` and its parts' places at
    the drawn tensor's index (None when the rank holds no element of the tensor)."""
    held = [box for box in layout.boxes(tensor, rank) if box.numel]
    if not held:
        return None
    storage = layout.storage_of(tensor)
    shape = layout.parts_shape(storage.name, rank)
    engine = layout.storage_shape(storage.name, rank)
    assert shape is not None and engine is not None  # the rank holds a box of it
    index = tuple(s.start for s in held[0].storage_slices()[:-2])
    places = []
    for part in storage.parts:
        for box in layout.boxes(part, rank):
            lead = box.storage_slices()[:-2]
            if box.numel and all(s.start <= i < s.stop for s, i in zip(lead, index)):
                places.append((part, box))
    return StoragePlaces(storage.name, tuple(shape), tuple(engine), index, tuple(places))


def _part_label(part: str, parts: Sequence[str]) -> str:
    """A part's name without the dotted prefix every part of the storage shares."""
    if len(parts) < 2:
        return part
    common = part.split(".")
    for other in parts:
        names = other.split(".")
        n = 0
        while n < min(len(common), len(names) - 1) and common[n] == names[n]:
            n += 1
        common = common[:n]
    return ".".join(part.split(".")[len(common):])


def _draw_storage(ax: Axes, patches: ModuleType, places: StoragePlaces, tensor: str, rank: int,
                  colors: _Colors, title: str) -> None:
    shape = places.parts_shape
    drawn = shape[-2:]  # the last two dims (a stack's element); one dim as a strip
    height = float(drawn[0]) if len(drawn) == 2 else 1.0
    width = float(drawn[-1]) if drawn else 1.0
    height, width = max(height, 1.0), max(width, 1.0)
    ax.add_patch(patches.Rectangle((0, 0), width, height, facecolor="#f5f5f5", edgecolor="#616161", lw=1.0))
    parts = [part for part, _ in places.places]
    for part, box in places.places:
        slices = box.storage_slices()[-2:]
        offsets = tuple(s.start for s in slices)
        sizes = tuple(s.stop - s.start for s in slices)
        x, y, w, h = _box2d(drawn, offsets, sizes)
        mine = part == tensor
        ax.add_patch(
            patches.Rectangle(
                (x, y), w, h, facecolor=colors(rank) if mine else "#cfd8dc", edgecolor="black", lw=0.6,
                alpha=0.85,
            )
        )
        if w / width > 0.04 and h / height > 0.04:
            region = ", ".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.sizes))
            label = f"{_part_label(part, parts)}{'.T' if box.transposed else ''}\n[{region}]"
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=6 if mine else 5,
                    rotation=90 if h > 2 * w and w / width < 0.3 else 0,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_title(title, fontsize=9)
    first = len(shape) - len(drawn)
    if len(drawn) == 2:
        ax.set_xlabel(f"storage dim {first + 1} ({drawn[1]:,})", fontsize=8)
        ax.set_ylabel(f"storage dim {first} ({drawn[0]:,})", fontsize=8)
    else:
        ax.set_xlabel(f"storage dim {first} ({drawn[0]:,})" if drawn else "scalar", fontsize=8)
        ax.set_yticks([])
    ax.tick_params(labelsize=7)


def _storage_title(title: str, places: StoragePlaces, rank: int) -> str:
    shape = "x".join(map(str, places.parts_shape))
    engine = "" if places.engine_shape == places.parts_shape else f", held as {'x'.join(map(str, places.engine_shape))}"
    at = f", at [{', '.join(map(str, places.index))}, :, :]" if places.index else ""
    return f"{title} storage on rank {rank}: {places.storage}\n{shape}{engine}{at}"


def _ranks_label(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``'r0-3,8'``."""
    text = "r" + rank_ranges(ranks, through="-", separator=",", min_run=2)
    return text if len(text) <= 18 else f"r{min(ranks)}..{max(ranks)} ({len(ranks)})"


_RGBA = tuple[float, float, float, float]


def _palette(name: str) -> list[_RGBA]:
    """The colours of one of matplotlib's qualitative colormaps, in order."""
    import matplotlib

    colormap = matplotlib.colormaps[name]
    return [colormap(i) for i in range(colormap.N)]


class _Colors:
    """One colour per rank, the same in every panel (repeating beyond 20 ranks)."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = sorted(set(ranks))
        if len(self.ranks) <= 10:
            palette = _palette("tab10")
        else:
            # tab20's dark shades, then its light ones: neighbouring ranks differ in hue;
            # beyond 20 ranks the colours repeat
            tab20 = _palette("tab20")
            palette = tab20[0::2] + tab20[1::2]
        self._of = {r: palette[i % len(palette)] for i, r in enumerate(self.ranks)}

    def __call__(self, rank: int) -> _RGBA:
        return self._of[rank]


def _box2d(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[float, float, float, float]:
    """(x, y, width, height) of a box in the drawing's coordinates: dim 1 across, dim 0 down."""
    if len(shape) == 0:
        return 0.0, 0.0, 1.0, 1.0
    if len(shape) == 1:
        return float(offsets[0]), 0.0, float(sizes[0]), 1.0
    return float(offsets[1]), float(offsets[0]), float(sizes[1]), float(sizes[0])


def _draw_tensor(
    ax: Axes,
    patches: ModuleType,
    shape: Sequence[int],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
    colors: _Colors,
    title: str,
) -> None:
    height = float(shape[0]) if len(shape) >= 2 else 1.0
    width = float(shape[1]) if len(shape) >= 2 else float(shape[0]) if shape else 1.0
    height, width = max(height, 1.0), max(width, 1.0)
    ax.add_patch(patches.Rectangle((0, 0), width, height, facecolor="#f5f5f5", edgecolor="#616161", lw=1.0))
    for offsets, sizes, ranks in boxes:
        x, y, w, h = _box2d(shape, offsets, sizes)
        replicated = len(ranks) > 1
        ax.add_patch(
            patches.Rectangle(
                (x, y), w, h, facecolor=colors(ranks[0]), edgecolor="black", lw=0.6, alpha=0.85,
                hatch="//" if replicated else None,
            )
        )
        label: dict[str, Any] = {
            "ha": "center",
            "va": "center",
            "bbox": {"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8, "lw": 0},
        }
        if w / width > 0.06 and h / height > 0.05:
            size = 8 if (w / width > 0.2 and h / height > 0.12) else 6
            ax.text(x + w / 2, y + h / 2, _ranks_label(ranks), fontsize=size, **label)
        elif w / width > 0.02 and h / height > 0.3:  # tall and narrow: the label turned upright
            ax.text(x + w / 2, y + h / 2, _ranks_label(ranks), fontsize=5, rotation=90, **label)
        elif h / height > 0.02 and w / width > 0.3:  # wide and flat
            ax.text(x + w / 2, y + h / 2, _ranks_label(ranks), fontsize=5, **label)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_title(title, fontsize=10)
    if len(shape) >= 2:
        ax.set_xlabel(f"dim 1 ({shape[1]:,})", fontsize=8)
        ax.set_ylabel(f"dim 0 ({shape[0]:,})", fontsize=8)
    else:
        ax.set_xlabel(f"dim 0 ({shape[0]:,})" if shape else "scalar", fontsize=8)
        ax.set_yticks([])
    ax.tick_params(labelsize=7)


def _kind(move: Move) -> str:
    return "relay" if move.is_relay else move.kind


def _draw_matrix(ax: Axes, moves: list[Move], colors: _Colors, domain_size: int) -> None:
    import matplotlib.colors as mcolors

    senders = sorted({m.src for m in moves})
    receivers = sorted({m.dst for m in moves})
    cell_bytes: dict[tuple[int, int], int] = {}
    cell_kinds: dict[tuple[int, int], set[str]] = {}
    for m in moves:
        cell_bytes[(m.src, m.dst)] = cell_bytes.get((m.src, m.dst), 0) + m.nbytes
        cell_kinds.setdefault((m.src, m.dst), set()).add(_kind(m))
    row = {r: i for i, r in enumerate(senders)}
    col = {r: i for i, r in enumerate(receivers)}
    order = ["network", "relay", "domain", "local"]

    image = np.ones((len(senders), len(receivers), 3))
    for (s, d), kinds in cell_kinds.items():
        kind = next(k for k in order if k in kinds)
        image[row[s], col[d]] = mcolors.to_rgb(KIND_COLORS[kind])
    ax.imshow(image, aspect="auto", interpolation="nearest")
    small = len(senders) <= 16 and len(receivers) <= 16
    if small:
        for (s, d), nbytes in cell_bytes.items():
            ax.text(col[d], row[s], human_bytes(nbytes), ha="center", va="center", fontsize=6, color="white")
    ax.set_xticks(np.arange(-0.5, len(receivers), 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(senders), 1), minor=True)
    if len(receivers) <= 48 and len(senders) <= 48:
        ax.grid(which="minor", color="#e0e0e0", lw=0.5)
    ax.tick_params(which="minor", length=0)

    def ticks(ranks: list[int]) -> list[int]:
        step = max(1, math.ceil(len(ranks) / 32))
        return list(range(0, len(ranks), step))

    xt, yt = ticks(receivers), ticks(senders)
    size = 8 if max(len(xt), len(yt)) <= 16 else 6
    ax.set_xticks(xt)
    ax.set_xticklabels([f"r{receivers[i]}" for i in xt], rotation=90, fontsize=size)
    ax.set_yticks(yt)
    ax.set_yticklabels([f"r{senders[i]}" for i in yt], fontsize=size)
    for labels, ranks, at in ((ax.get_xticklabels(), receivers, xt), (ax.get_yticklabels(), senders, yt)):
        for label, i in zip(labels, at):
            label.set_bbox({"boxstyle": "round,pad=0.2", "facecolor": colors(ranks[i]), "alpha": 0.55, "lw": 0})
    # domain boundaries: moves that cross one of these lines are network moves
    if domain_size > 1:
        for ranks, line in ((senders, ax.axhline), (receivers, ax.axvline)):
            for i in range(1, len(ranks)):
                if ranks[i] // domain_size != ranks[i - 1] // domain_size:
                    line(i - 0.5, color="#424242", lw=0.8)
    ax.set_xlabel(f"receiving rank (lines: domain boundaries, {domain_size} ranks per domain)"
                  if domain_size > 1 else "receiving rank", fontsize=8)
    ax.set_ylabel("sending rank", fontsize=8)


def _summary(moves: list[Move]) -> str:
    parts = []
    for kind in ("network", "relay", "domain", "local"):
        chosen = [m for m in moves if _kind(m) == kind]
        if chosen:
            parts.append(f"{KIND_LABELS[kind]}: {len(chosen):,} moves, {human_bytes(sum(m.nbytes for m in chosen))}")
    return "; ".join(parts) if parts else "no moves: every destination rank already holds its boxes"


def _fit(title: str, width_inches: float, fontsize: float) -> str:
    """``title`` with each line wrapped to a figure ``width_inches`` wide: a long tensor name
    (an MoE expert's, a fused storage's) would otherwise run off both edges of the figure. A
    glyph of DejaVu Sans averages about 0.6 em; a word longer than a line is cut."""
    columns = max(20, int(width_inches * 72 / (0.62 * fontsize)))
    return "\n".join(
        textwrap.fill(line, columns, break_on_hyphens=False) if len(line) > columns else line
        for line in title.split("\n")
    )


def draw(
    program: Program,
    tensor: str,
    out: str,
    reshard: str | None = None,
    *,
    policy: str | None = None,
    plan: Plan | None = None,
    ranks: Sequence[int] = (),
) -> str:
    """Draw ``tensor`` in the source and destination layouts of ``reshard`` (the only one
    when None) and the plan's moves of it, into the PNG file ``out``; returns ``out``.

    ``policy`` overrides the statement's policies (as ``compile_plan``); ``plan`` reuses a
    compiled plan. A program without a reshard statement gets one panel per layout.
    ``ranks``: for each, a panel of the storage that holds the tensor on that rank in each
    layout that has it there (a rank that holds the tensor in no layout is an error).
    """
    figure, patches = _matplotlib()
    if tensor not in program.tensors:
        raise LayoutNameError(
            f"unknown tensor '{tensor}' in {program.path}", hint=did_you_mean(tensor, program.tensors)
        )
    logical = program.tensors[tensor]
    shape = logical.shape
    if program.reshards or reshard is not None:
        if plan is None:
            plan = compile_plan(program, reshard, policy=policy)
        layouts = [plan.source, plan.destination]
        titles = ["source", "destination"]
        moves = list(plan.moves(tensor))
    else:
        if not program.layouts:
            raise LayoutValueError(f"{program.path} declares no layout to draw")
        layouts = list(program.layouts.values())
        titles = ["layout"] * len(layouts)
        moves = []
    boxes = [ownership(layout, tensor) for layout in layouts]
    storages: list[tuple[str, int, StoragePlaces]] = []
    for rank in ranks:
        found = [
            (title, rank, places)
            for layout, title in zip(layouts, titles)
            if rank in layout.mesh.ranks and (places := storage_places(layout, tensor, rank)) is not None
        ]
        if not found:
            names = ", ".join(f"'{layout.name}'" for layout in layouts)
            raise LayoutValueError(f"rank {rank} holds no element of tensor '{tensor}' in layout {names}")
        storages += found
    coloured = {r for b in boxes for _, _, rs in b for r in rs} | {m.src for m in moves} | {m.dst for m in moves}
    colors = _Colors(sorted(coloured) or [0])

    n = len(layouts)
    columns = min(max(n, len(storages)), 3)
    rows = math.ceil(n / columns)
    storage_rows = math.ceil(len(storages) / columns)
    matrix = bool(moves)
    # the matrix gets about a quarter inch per sending rank, within 1.6 and 4.6 inches
    senders = len({m.src for m in moves})
    matrix_height = min(4.6, max(1.6, 0.25 * senders + 1.0))
    figure_height = 3.6 * (rows + storage_rows) + (matrix_height if matrix else 0) + 0.8
    width = max(columns, 2) if matrix else columns
    fig = figure(figsize=(5.2 * width, figure_height), dpi=110)
    grid = fig.add_gridspec(
        rows + storage_rows + (1 if matrix else 0),
        width,
        height_ratios=[3.6] * (rows + storage_rows) + ([matrix_height] if matrix else []),
    )
    for i, (layout, held, title) in enumerate(zip(layouts, boxes, titles)):
        ax = fig.add_subplot(grid[i // columns, i % columns])
        mesh = layout.mesh
        axes = ", ".join(f"{a}={s}" for a, s in mesh.axes)
        placement = layout.placement(tensor)
        where = ", ".join(f"{a}[{v}]" for a, v in placement.submesh)
        label = f"{title}: {layout.name} on {mesh.name} [{axes}]"
        holders = len({r for _, _, rs in held for r in rs})
        detail = f"{len(held)} box{'es' if len(held) != 1 else ''} on {holders} rank{'s' if holders != 1 else ''}"
        _draw_tensor(ax, patches, shape, held, colors, f"{label}\n{detail}" + (f", {where}" if where else ""))
    for i, (title, rank, places) in enumerate(storages):
        ax = fig.add_subplot(grid[rows + i // columns, i % columns])
        _draw_storage(ax, patches, places, tensor, rank, colors, _storage_title(title, places, rank))
    if plan is not None and matrix:  # moves come from a plan
        ax = fig.add_subplot(grid[rows + storage_rows, :])
        _draw_matrix(ax, moves, colors, plan.domain_size)
        handles = [
            patches.Patch(color=KIND_COLORS[k], label=KIND_LABELS[k])
            for k in ("network", "relay", "domain", "local")
            if any(_kind(m) == k for m in moves)
        ]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
        policy_name = plan.policies[plan.source.resolved.index[tensor]]
        ax.set_title(
            f"moves of the plan ({policy_name}): {_summary(moves)}", fontsize=8
        )
    dims = f" (drawn by dims 0 and 1 of {len(shape)})" if len(shape) > 2 else ""
    title = f"{tensor}  {list(shape)} {logical.dtype}, {human_bytes(logical.nbytes)}{dims}"
    if plan is not None:
        title += f"\nthe plan of reshard statement '{plan.name}' ({plan.source.name} -> {plan.destination.name})"
        if not moves:
            title += ": no moves, every destination rank already holds its boxes"
    fig.suptitle(_fit(title, fig.get_size_inches()[0], 11), fontsize=11)
    fig.tight_layout()
    try:
        # tight: the canvas grows to every title and label rather than cutting one at its edge
        fig.savefig(out, format="png", bbox_inches="tight", pad_inches=0.1)
    except OSError as err:
        raise LayoutValueError(f"cannot write {out}: {err.strerror or err}") from None
    return out


# ------------------------------------------------------------------------------ CLI

HELP = "draw one tensor's source and destination boxes and the plan's moves (PNG)"
DESCRIPTION = (
    "Draw, for the reshard statement of a program, one logical tensor as the source layout holds it "
    "and as the destination layout holds it (boxes coloured by rank), and the plan's moves of it as a "
    "matrix of sending and receiving ranks coloured by kind (local, NVLink, network, relay)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang viz``."""
    arguments.add_file(parser)
    parser.add_argument("--tensor", metavar="NAME", required=True, help="the logical tensor to draw")
    parser.add_argument("--out", metavar="FILE.png", required=True, help="the PNG file to write")
    arguments.add_reshard(parser)
    arguments.add_policy(parser)
    parser.add_argument(
        "--rank",
        metavar="R",
        type=arguments.rank_number,
        action="append",
        default=[],
        help="also draw the storage that holds the tensor on rank R, in each layout that has it there, with every "
        "part's place (stacked, fused, transposed); repeatable",
    )


def run(args: argparse.Namespace) -> int:
    """``layoutlang viz``: 0 on success; a LayoutError propagates to the CLI."""
    program = load(args.file, allow_outside_includes=args.allow_outside_includes)
    draw(program, args.tensor, args.out, args.reshard, policy=args.policy, ranks=args.rank)
    print(f"wrote {args.out}")
    return 0
