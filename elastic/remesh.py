"""Remeshing during failure recovery: new layouts after ranks are lost, and loss checks.

Planning only (pure, deterministic, no communication): every survivor computes the same
new layout from the same old layout and the same agreed set of lost ranks.

:func:`remesh` turns a layout and the lost ranks into the layout of the next generation,
by a policy:

- ``"drop-replica"``: remove the replica groups that lost a rank along a *data-parallel
  axis* (an axis on which every tensor is replicated and that no rule fixes as a sub-mesh
  coordinate); the axis is found, or given with ``axis=``;
- ``"shrink-axis"``: the same along an axis named with ``axis=`` (any axis: shrinking a
  sharding axis re-cuts the shards, and a sub-mesh index that falls out of range is an error);
- ``"fill-spares"``: each lost rank is replaced by a spare rank at the same mesh position;
- ``"callback"``: ``callback(mesh, lost) -> Mesh`` builds the new mesh.

The new layout keeps the tensors, rules and storages of the old one (they do not depend on
the mesh's ranks) on the new mesh. Where the policy may re-cut shards (``shrink-axis``,
``callback``) it is validated with :meth:`Layout.check`; ``fill-spares`` and
``drop-replica`` leave every remaining mesh position holding what it held, so a valid
layout stays valid.

:func:`generation_layouts` gives an elastic session's layouts of any generation from the
agreed member lists alone: joiners take the destination positions of lost ranks
(:func:`replacements`), then each side drops what is gone by its policy.

:func:`lost_regions` and :func:`check_recoverable` (from :mod:`layoutlang.plan.loss`, the
model's side: the planner's recovery plans use them too) make sure nothing is lost
silently: a region of a logical tensor is lost when every rank holding it, in every given
layout (e.g. the inference layout *and* the training layout), is lost.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence

import attrs

from layoutlang.errors import (
    DataLossError,
    LayoutError,
    LayoutNameError,
    LayoutValueError,
    did_you_mean,
)
from layoutlang.model import Layout, Mesh, Replicate
from layoutlang.plan.loss import check_recoverable, lost_regions, rank_set

__all__ = [
    "POLICIES",
    "SESSION_POLICIES",
    "DataLossError",
    "Positions",
    "SidePolicy",
    "check_recoverable",
    "check_unit_axis",
    "data_parallel_axes",
    "destination_positions",
    "generation_layouts",
    "grown",
    "lost_regions",
    "needs_spares",
    "open_positions",
    "original_ranks",
    "remesh",
    "replacements",
    "unit_size",
    "vacant",
]

POLICIES = ("drop-replica", "shrink-axis", "fill-spares", "callback")
#: what an elastic session's side may do with its lost ranks: a remesh policy, or
#: ``await-rejoin`` (the positions stay, vacant, until the same ranks come back)
SESSION_POLICIES = (*POLICIES, "await-rejoin")

_GEN = re.compile(r"^(.*)_gen([0-9]+)$")


# ---------------------------------------------------------------------- helpers


def _next_name(name: str, generation: int | None) -> str:
    m = _GEN.match(name)
    base, current = (m.group(1), int(m.group(2))) if m else (name, 0)
    return f"{base}_gen{current + 1 if generation is None else int(generation)}"


def _rule_axes(layout: Layout) -> set[str]:
    """Every axis the layout's rules name (placements, sub-mesh coordinates, orders)."""
    axes: set[str] = set()
    for rule in layout.rules:
        axes.update(dict(rule.placements))
        axes.update(dict(rule.submesh))
        for order in dict(rule.order).values():
            axes.update(order)
    return axes


def data_parallel_axes(layout: Layout) -> list[str]:
    """Axes on which every tensor of ``layout`` is replicated and that no rule fixes as a
    sub-mesh coordinate: dropping a coordinate of such an axis drops whole replicas."""
    submesh_axes = {a for rule in layout.rules for a in dict(rule.submesh)}
    names = layout.mesh.axis_names
    candidates = [a for a in names if a not in submesh_axes]
    # A tensor's placements are its rule's: look at each rule that places some tensor once
    # (a few dozen rules, not 45k tensors).
    used = {id(rule): rule for rule in layout.resolved.rule_of}
    for rule in used.values():
        placed = dict(rule.placements)
        candidates = [a for a in candidates if isinstance(placed.get(a, Replicate()), Replicate)]
        if not candidates:
            break
    return candidates


def _shrink(mesh: Mesh, axis: str, lost: set[int], name: str) -> tuple[Mesh, list[int]]:
    """``mesh`` without the coordinates of ``axis`` that hold a lost rank; also those coordinates."""
    index = mesh.axis_index(axis)
    size = mesh.shape[index]
    dropped = sorted({mesh.coords(r)[axis] for r in lost if r in mesh})
    kept = [c for c in range(size) if c not in dropped]
    if not kept:
        where = ", ".join(f"{r} at {axis} {mesh.coords(r)[axis]}" for r in sorted(lost) if r in mesh)
        raise LayoutValueError(
            f"every coordinate of axis '{axis}' (size {size}) of mesh '{mesh.name}' holds a lost rank "
            f"({where}); no intact replica remains",
            hint="start spare ranks that join (apply --elastic --replace, or ElasticSession(join=True)): "
            "they take the lost positions, filled from any surviving holder, the other side's layout "
            "included; with no holder left, restore from a checkpoint",
        )
    shape = list(mesh.shape)
    shape[index] = len(kept)
    ranks = []
    for position in itertools.product(*(range(s) for s in shape)):
        coords = dict(zip(mesh.axis_names, position))
        coords[axis] = kept[position[index]]
        ranks.append(mesh.rank_at(coords))
    axes = [(a, len(kept) if a == axis else s) for a, s in mesh.axes]
    return Mesh(name, axes, ranks), dropped


def _fill(mesh: Mesh, lost: set[int], spares: Sequence[int], name: str) -> Mesh:
    hit = [r for r in mesh.ranks if r in lost]
    spares = [int(s) for s in spares]
    if len(set(spares)) != len(spares):
        raise LayoutValueError(f"spare ranks {spares} list a rank twice")
    for s in spares:
        if s in lost:
            raise LayoutValueError(f"spare rank {s} is itself lost")
        if s in mesh:
            raise LayoutValueError(f"spare rank {s} is already in mesh '{mesh.name}'")
    if len(spares) < len(hit):
        missing = len(hit) - len(spares)
        raise LayoutValueError(
            f"fill-spares: mesh '{mesh.name}' lost {len(hit)} rank{'s' if len(hit) != 1 else ''} "
            f"({', '.join(map(str, hit))}) but only {len(spares)} spare{'s are' if len(spares) != 1 else ' is'} "
            f"given: {missing} spare{'s' if missing != 1 else ''} missing",
            hint="add spare ranks, or use 'drop-replica' / 'shrink-axis'",
        )
    replace = dict(zip(hit, spares))
    return Mesh(name, mesh.axes, [replace.get(r, r) for r in mesh.ranks])


# ----------------------------------------------------------------------- remesh


def remesh(
    layout: Layout,
    lost: Iterable[int],
    policy: str,
    *,
    spares: Sequence[int] = (),
    axis: str | None = None,
    callback: Callable[[Mesh, frozenset[int]], Mesh] | None = None,
    name: str | None = None,
    mesh_name: str | None = None,
    generation: int | None = None,
) -> Layout:
    """The layout of the next generation after ``lost`` ranks are gone (see the module doc).

    The new layout is named ``name``, else the old name with a generation suffix
    (``infer`` -> ``infer_gen1`` -> ``infer_gen2``, or ``_gen{generation}``); its mesh
    likewise (``mesh_name``). Raises a LayoutError (with the policy and layout in its message)
    when the policy cannot apply or the new layout is not valid.

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh infer [dp = 4, tp = 2]
    ... tensor "w" [8, 4] fp32
    ... layout serve on infer { "w": tp = shard(0) }
    ... ''')
    >>> new = remesh(p.layouts["serve"], {5}, "drop-replica")
    >>> new.name, new.mesh
    ('serve_gen1', Mesh('infer_gen1', {'dp': 3, 'tp': 2}, ranks=[0, 1, 2, 3, 6, 7]))
    """
    lost_ranks = rank_set(lost)
    new_name = name if name is not None else _next_name(layout.name, generation)
    new_mesh_name = mesh_name if mesh_name is not None else _next_name(layout.mesh.name, generation)
    where = f"remesh of layout '{layout.name}' ({policy})"
    new_mesh = _new_mesh(layout, lost_ranks, policy, where, new_mesh_name, spares=spares, axis=axis, callback=callback)

    still = sorted(r for r in new_mesh.ranks if r in lost_ranks)
    if still:
        raise LayoutValueError(
            f"{where}: the new mesh '{new_mesh.name}' still holds lost rank(s) {still}"
        )

    new = layout.on_mesh(new_mesh, new_name)  # the same tensors, rules and storages
    if policy in ("fill-spares", "drop-replica"):
        # Every position left holds what it held: fill-spares keeps the positions (a spare
        # takes a lost rank's), drop-replica removes coordinates of an axis that replicates
        # every tensor and selects no sub-mesh. A valid layout stays valid; checking its
        # storages again on every rank would cost half a second at DeepSeek-V3 scale.
        return new
    try:
        new.check()
    except LayoutError as err:
        raise type(err)(
            f"{where}, new mesh {_mesh_text(new_mesh)}: {err.message}", err.span, err.hint
        ) from None
    return new


def _new_mesh(
    layout: Layout,
    lost: set[int],
    policy: str,
    where: str,
    name: str,
    *,
    spares: Sequence[int],
    axis: str | None,
    callback: Callable[[Mesh, frozenset[int]], Mesh] | None,
) -> Mesh:
    """The mesh ``policy`` makes of ``layout``'s mesh without the ``lost`` ranks, named ``name``."""
    if policy == "callback":
        return _callback_mesh(layout, lost, callback, where)
    if policy not in ("drop-replica", "shrink-axis", "fill-spares"):
        raise LayoutValueError(
            f"unknown remesh policy '{policy}' (policies: {', '.join(POLICIES)})",
            hint=did_you_mean(policy, POLICIES),
        )
    chosen = None if policy == "fill-spares" else _axis_to_shrink(layout, lost, policy, axis, where)
    try:
        if chosen is None:
            return _fill(layout.mesh, lost, spares, name)
        return _shrink(layout.mesh, chosen, lost, name)[0]
    except LayoutError as err:
        raise type(err)(f"{where}: {err.message}", err.span, err.hint) from None


def _axis_to_shrink(layout: Layout, lost: set[int], policy: str, axis: str | None, where: str) -> str:
    """The axis ``drop-replica`` or ``shrink-axis`` removes coordinates of."""
    mesh = layout.mesh
    if policy == "shrink-axis" and axis is None:
        raise LayoutValueError(
            f"{where}: name the axis to shrink with axis=",
            hint=f"axes of mesh '{mesh.name}': {', '.join(mesh.axis_names)}",
        )
    if axis is not None:
        mesh.axis_index(axis)  # unknown axis -> LayoutNameError with a hint
        if policy == "shrink-axis":
            return axis
    candidates = data_parallel_axes(layout)
    if axis is None:
        if not candidates:
            raise LayoutValueError(
                f"{where}: mesh '{mesh.name}' (axes {', '.join(mesh.axis_names)}) has no data-parallel "
                "axis: every axis shards some tensor or selects a sub-mesh, so dropping a "
                "replica would lose data",
                hint="use 'shrink-axis' with axis= to re-cut the shards, or 'fill-spares'",
            )

        # Several replicated axes: the one dropping fewest ranks, first on ties.
        def cost(a: str) -> int:
            hit = {mesh.coords(r)[a] for r in lost if r in mesh}
            return len(hit) * (mesh.size // mesh.axis_size(a))

        return min(candidates, key=cost) if len(candidates) > 1 else candidates[0]
    if axis not in candidates:
        raise LayoutValueError(
            f"{where}: axis '{axis}' of mesh '{mesh.name}' is not data-parallel (some tensor is "
            "sharded over it or placed on one of its coordinates)"
            + (f"; data-parallel axes: {', '.join(candidates)}" if candidates else ""),
            hint="use 'shrink-axis' to shrink it anyway (the shards are re-cut)",
        )
    return axis


def _callback_mesh(
    layout: Layout, lost: set[int], callback: Callable[[Mesh, frozenset[int]], Mesh] | None, where: str
) -> Mesh:
    if callback is None:
        raise LayoutValueError(
            f"{where}: policy 'callback' needs callback=(mesh, lost) -> Mesh"
        )
    new_mesh = callback(layout.mesh, frozenset(lost))
    if not isinstance(new_mesh, Mesh):
        raise LayoutValueError(
            f"{where}: the callback returned {type(new_mesh).__name__}, not a Mesh"
        )
    missing = sorted(_rule_axes(layout) - set(new_mesh.axis_names))
    if missing:
        raise LayoutNameError(
            f"{where}: the callback's mesh '{new_mesh.name}' (axes {', '.join(new_mesh.axis_names)}) "
            f"lacks axis {', '.join(repr(a) for a in missing)} named by the layout's rules"
        )
    return new_mesh


#: A side's remesh policy and its axis (None: the policy finds one), as ``remesh`` takes them.
SidePolicy = tuple[str, str | None]


def needs_spares(layout: Layout, lost: Iterable[int], policy: SidePolicy) -> bool:
    """Whether ``policy`` cannot take the ``lost`` ranks out of ``layout`` by itself, so that
    spare ranks must take their positions: ``fill-spares`` whenever a rank of the mesh is
    lost, ``drop-replica`` and ``shrink-axis`` when every coordinate of the axis they would
    shrink holds a lost rank (no intact replica remains). Mesh arithmetic only: no layout is
    built, so it costs microseconds at any scale."""
    how, axis = policy
    hit = [r for r in rank_set(lost) if r in layout.mesh]
    if not hit or how == "callback":
        return False
    if how == "fill-spares":
        return True
    try:
        chosen = _axis_to_shrink(layout, set(hit), how, axis, f"remesh of layout '{layout.name}' ({how})")
    except LayoutError:
        return False  # remesh reports why this policy cannot apply at all
    mesh = layout.mesh
    return len({mesh.coords(r)[chosen] for r in hit}) == mesh.axis_size(chosen)


# ------------------------------------------------------------------ generations


@attrs.frozen
class Positions:
    """Who holds the destination's positions after some generations (see
    :func:`destination_positions`).

    ``replaced`` maps a position of the first generation's mesh (named by the rank that first
    held it) to the joiner that holds it now; ``grown`` lists the joiners that extend the
    mesh's unit axis, a whole unit after another, in the order they were admitted.
    """

    replaced: dict[int, int]
    grown: tuple[int, ...] = ()


def destination_positions(
    history: Sequence[Sequence[int]],
    destination: Mesh,
    *,
    unit: int = 1,
    grow: bool = False,
    returning: Iterable[int] = (),
) -> Positions:
    """Who holds the positions of ``destination`` (the first generation's mesh) after the
    generations whose agreed members ``history`` lists (generation 0 first).

    In each generation the new joiners (sorted; ranks of ``returning``, which hold positions
    of their own in the first generation's layouts, never count as joiners) first fill the
    open positions in mesh order; with ``grow``, the rest extend the mesh's unit axis, ``unit``
    ranks at a time (a new coordinate of that axis each). A joiner lost again leaves its
    position open; a grown unit that loses a rank is gone (its coordinate is not refilled).
    """
    replaced: dict[int, int] = {}
    grown: list[int] = []
    skip = rank_set(returning)
    before = set(history[0]) if history else set()
    for members in history[1:]:
        after = set(members)
        lost = before - after
        for position, joiner in list(replaced.items()):
            if joiner in lost:
                del replaced[position]
        units = [grown[i : i + unit] for i in range(0, len(grown), unit)]
        grown = [r for u in units if not lost & set(u) for r in u]
        joined = sorted(after - before - skip)
        open_positions = [r for r in destination.ranks if r not in after and r not in replaced]
        replaced.update(zip(open_positions, joined))
        if grow:
            rest = joined[len(open_positions) :]
            grown += rest[: len(rest) - len(rest) % unit]
        before = after
    return Positions(replaced, tuple(grown))


def replacements(history: Sequence[Sequence[int]], destination: Mesh) -> dict[int, int]:
    """Lost destination rank -> the joiner in its place, after the generations whose agreed
    members ``history`` lists (generation 0 first).

    Joiners fill the open positions of ``destination`` (the first generation's mesh) in
    mesh order; a joiner that is lost again leaves its position open
    (:func:`destination_positions` without units or growth).
    """
    return destination_positions(history, destination).replaced


def open_positions(
    history: Sequence[Sequence[int]], destination: Mesh, positions: Positions | None = None
) -> list[int]:
    """The positions of ``destination`` (the first generation's mesh, named by the ranks that
    first held them) whose holder is no member of the last generation ``history`` lists: lost
    ranks whose position no joiner took, and joiners lost in turn. ``positions``: the
    holders, when not those of plain replacement (:func:`destination_positions`)."""
    replaced = (positions or destination_positions(history, destination)).replaced
    members = set(history[-1]) if history else set()
    return [r for r in destination.ranks if replaced.get(r, r) not in members]


def unit_size(layout: Layout, axis: str | None) -> int:
    """The ranks of one coordinate of ``axis`` (a unit: an engine), or 1 without an axis."""
    if axis is None:
        return 1
    mesh = layout.mesh
    return mesh.size // mesh.axis_size(axis)


def check_unit_axis(layout: Layout, axis: str) -> None:
    """Refuse a unit axis that cannot grow and shrink: it must be the mesh's first axis (so a
    new coordinate is a run of ranks at the end) and data-parallel (every tensor replicated
    along it, no sub-mesh on it), so that any coordinate holds what any other holds."""
    mesh = layout.mesh
    mesh.axis_index(axis)  # unknown axis -> LayoutNameError naming the mesh's axes
    if mesh.axis_names[0] != axis:
        raise LayoutValueError(
            f"the unit axis '{axis}' of layout '{layout.name}' must be the first axis of mesh "
            f"'{mesh.name}' (axes {', '.join(mesh.axis_names)}): each of its coordinates is one engine",
            layout.span,
        )
    if axis not in data_parallel_axes(layout):
        raise LayoutValueError(
            f"the unit axis '{axis}' of layout '{layout.name}' is not data-parallel: some tensor is "
            "sharded over it or placed on one of its coordinates, so its engines do not hold the same boxes",
            layout.span,
        )


def grown(layout: Layout, axis: str, ranks: Sequence[int], name: str, mesh_name: str) -> Layout:
    """``layout`` with ``ranks`` appended to its mesh as new coordinates of ``axis`` (its first,
    data-parallel axis: :func:`check_unit_axis`), a unit of ranks per coordinate, in order."""
    mesh = layout.mesh
    unit = unit_size(layout, axis)
    if len(ranks) % unit:
        raise LayoutValueError(
            f"{len(ranks)} ranks cannot grow axis '{axis}' of mesh '{mesh.name}' by whole coordinates "
            f"of {unit} ranks"
        )
    axes = [(a, s + len(ranks) // unit if a == axis else s) for a, s in mesh.axes]
    return layout.on_mesh(Mesh(mesh_name, axes, [*mesh.ranks, *ranks]), name)


def generation_layouts(
    source: Layout,
    destination: Layout,
    history: Sequence[Sequence[int]],
    *,
    source_policy: SidePolicy = ("drop-replica", None),
    destination_policy: SidePolicy = ("drop-replica", None),
    unit_axis: str | None = None,
    grow: bool = False,
) -> tuple[Layout, Layout]:
    """The source and destination layouts of the last generation ``history`` lists, from the
    first generation's ``source`` and ``destination``.

    Joiners take the destination positions of lost ranks (``fill-spares``) and, with
    ``grow``, extend the destination's ``unit_axis`` by whole units
    (:func:`destination_positions`); then the ranks that are no members leave each side by
    its policy. Ranks of the first generation's layouts that come back hold their own
    positions again. The layouts of generation ``g`` are named ``{name}_gen{g}`` (meshes
    likewise). A pure function of the agreed member lists: every member computes the same
    layouts.
    """
    generation = len(history) - 1
    members = set(history[-1]) if history else set()
    positions = destination_positions(
        history, destination.mesh, unit=unit_size(destination, unit_axis), grow=grow,
        returning=original_ranks(source, destination),
    )
    name, mesh_name = f"{destination.name}_gen{generation}", f"{destination.mesh.name}_gen{generation}"
    current = destination
    if positions.replaced:
        hit = [r for r in destination.mesh.ranks if r in positions.replaced]
        current = remesh(
            destination, hit, "fill-spares", spares=[positions.replaced[r] for r in hit],
            name=name, mesh_name=mesh_name,
        )
    if positions.grown:
        assert unit_axis is not None  # growth needs a unit axis
        current = grown(current, unit_axis, positions.grown, name, mesh_name)
    return (
        _without_lost(source, source, members, source_policy, generation),
        _without_lost(current, destination, members, destination_policy, generation),
    )


def original_ranks(source: Layout, destination: Layout) -> frozenset[int]:
    """The ranks of the first generation's layouts: each holds a position of its own, which it
    takes back when it comes back (a restarted training rank)."""
    return frozenset(source.mesh.ranks) | frozenset(destination.mesh.ranks)


def vacant(layout: Layout, members: Iterable[int], policy: SidePolicy) -> list[int]:
    """The ranks of ``layout`` (the first generation's) that are no ``members`` but keep their
    positions (``await-rejoin`` where no intact replica is left to drop theirs): nothing can
    be read from them until they come back."""
    if policy[0] != "await-rejoin":
        return []
    present = rank_set(members)
    return [r for r in _without_lost(layout, layout, present, policy, 0).mesh.ranks if r not in present]


def _without_lost(layout: Layout, base: Layout, members: set[int], policy: SidePolicy, generation: int) -> Layout:
    """``layout`` without the ranks that are no ``members``, named after the first generation's
    ``base``. ``await-rejoin`` drops whole replicas where the layout has them (HSDP: another
    replica holds what the lost ranks held) and otherwise keeps their positions, vacant."""
    gone = [r for r in layout.mesh.ranks if r not in members]
    how, axis = policy
    if not gone:
        return layout
    if how == "await-rejoin":
        how = "drop-replica"
        if not data_parallel_axes(layout) or needs_spares(layout, gone, (how, axis)):
            return layout  # no intact replica: the positions wait for their ranks
    return remesh(
        layout, gone, how, axis=axis,
        name=f"{base.name}_gen{generation}", mesh_name=f"{base.mesh.name}_gen{generation}",
    )


def _mesh_text(mesh: Mesh) -> str:
    return f"'{mesh.name}' [" + ", ".join(f"{a} = {s}" for a, s in mesh.axes) + "]"
