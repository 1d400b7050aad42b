"""The semantic model: meshes, placements, logical tensors, storages, layouts, programs.

Naming rules, used everywhere in layoutlang:

- an **axis** is a mesh axis (``pp``, ``tp``, ``dp``, ``ep``...); a **dim** is a tensor dimension;
- a **placement** is what one axis does to a tensor: :class:`Shard` a dim, or :class:`Replicate`;
- a **box** is a region ``(offsets, sizes)`` of a logical tensor in global coordinates;
- a **storage** is the local buffer a rank holds; a box has a place in its storage.

Every class here is immutable. They can be built from Python without any ``.layout`` text:

>>> mesh = Mesh("train", {"dp": 2, "tp": 4})
>>> mesh
Mesh('train', {'dp': 2, 'tp': 4}, ranks=range(0, 8))
>>> [(b.offsets, b.sizes) for b in shard_boxes((10, 6), mesh, [Shard(0), Shard(0)], rank=2)]
[((4, 0), (1, 6))]

Semantics follow PyTorch DTensor: a mesh
is a row-major array of ranks; ``Shard(d)`` over an axis of size k follows ``torch.chunk``;
several axes sharding one dim nest left to right in mesh-axis order.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

import attrs

from . import _core
from .dtypes import DTYPES, itemsize
from .errors import LayoutError, LayoutNameError, LayoutValueError, Span, did_you_mean

__all__ = [
    "Mesh",
    "Shard",
    "Replicate",
    "Placement",
    "LogicalTensor",
    "Box",
    "TensorPlacement",
    "Rule",
    "StorageRule",
    "Storage",
    "Layout",
    "Topology",
    "Reshard",
    "Program",
    "shard_boxes",
]


# ------------------------------------------------------------------------ meshes


def _axes_tuple(axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(tuple(a) for a in axes)
    return tuple((str(name), int(size)) for name, size in items)


def _ranks_repr(ranks: tuple[int, ...]) -> str:
    if ranks and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return f"range({ranks[0]}, {ranks[0] + len(ranks)})"
    return repr(list(ranks))


@attrs.frozen(repr=False, init=False)
class Mesh:
    """A named N-D array of global ranks, row-major, with named axes.

    >>> Mesh("infer", {"dp": 2, "tp": 2}, ranks=range(8, 12)).coords(10)
    {'dp': 1, 'tp': 0}
    """

    name: str
    axes: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]
    _index: dict[int, int] = attrs.field(eq=False, hash=False)

    def __init__(
        self,
        name: str,
        axes: Mapping[str, int] | Iterable[tuple[str, int]],
        ranks: Iterable[int] | None = None,
    ):
        axes_t = _axes_tuple(axes)
        names = [a for a, _ in axes_t]
        if not axes_t:
            raise LayoutValueError(f"mesh '{name}' has no axes")
        for axis, size in axes_t:
            if names.count(axis) > 1:
                raise LayoutValueError(f"mesh '{name}' declares axis '{axis}' twice")
            if size < 1:
                raise LayoutValueError(f"axis '{axis}' of mesh '{name}' has size {size}; sizes are at least 1")
        size = 1
        for _, s in axes_t:
            size *= s
        ranks_t = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
        if len(ranks_t) != size:
            shape = " x ".join(f"{a}={s}" for a, s in axes_t)
            raise LayoutValueError(
                f"mesh '{name}' ({shape}) has {size} positions but {len(ranks_t)} ranks"
            )
        index: dict[int, int] = {}
        for i, r in enumerate(ranks_t):
            if r < 0:
                raise LayoutValueError(f"mesh '{name}' lists negative rank {r}")
            if r in index:
                raise LayoutValueError(f"mesh '{name}' lists rank {r} twice")
            index[r] = i
        self.__attrs_init__(str(name), axes_t, ranks_t, index)

    def __repr__(self) -> str:
        axes = "{" + ", ".join(f"{a!r}: {s}" for a, s in self.axes) + "}"
        return f"Mesh({self.name!r}, {axes}, ranks={_ranks_repr(self.ranks)})"

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def axis_index(self, axis: str) -> int:
        """Position of ``axis``; raises LayoutNameError naming the mesh's axes."""
        for i, (a, _) in enumerate(self.axes):
            if a == axis:
                return i
        raise LayoutNameError(
            f"unknown axis '{axis}' in mesh '{self.name}' (axes: {', '.join(self.axis_names)})",
            hint=did_you_mean(axis, self.axis_names),
        )

    def axis_size(self, axis: str) -> int:
        return self.axes[self.axis_index(axis)][1]

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis."""
        if rank not in self._index:
            raise LayoutValueError(f"rank {rank} is not in mesh '{self.name}'")
        rest = self._index[rank]
        out: dict[str, int] = {}
        for axis, size in reversed(self.axes):
            out[axis] = rest % size
            rest //= size
        return dict(reversed(list(out.items())))

    def rank_at(self, coords: Mapping[str, int]) -> int:
        index = 0
        for axis, size in self.axes:
            index = index * size + coords[axis]
        return self.ranks[index]


# -------------------------------------------------------------------- placements


@attrs.frozen(repr=False)
class Shard:
    """Shard tensor dim ``dim`` over an axis (torch.chunk semantics).

    Options beyond DTensor's ``Shard``:

    - ``blocks=sf``: DTensor's ``_StridedShard(dim, split_factor=sf)``: cut the local dim into
      ``sf`` blocks, shard each block, keep the i-th piece of every block (vLLM gate_up).
    - ``chunks=n``: cut the dim into ``n`` chunks, ``n`` dividing the axis size; coordinate i
      holds chunk ``i // (size // n)`` (vLLM's kv heads replicated when tp > kv_heads).
    - ``pad=m``: pad the dim up to a multiple of ``m`` before sharding; the padding holds
      no logical data (vLLM's padded vocab-parallel embedding).
    """

    dim: int
    blocks: int = 1
    chunks: int | None = None
    pad: int = 1

    def __repr__(self) -> str:
        extra = ""
        if self.blocks != 1:
            extra += f", blocks={self.blocks}"
        if self.chunks is not None:
            extra += f", chunks={self.chunks}"
        if self.pad != 1:
            extra += f", pad={self.pad}"
        return f"Shard({self.dim}{extra})"


@attrs.frozen(repr=False)
class Replicate:
    """Every rank along the axis holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


Placement = Union[Shard, Replicate]


# ----------------------------------------------------------------------- tensors


@attrs.frozen
class LogicalTensor:
    """A named global tensor.

    >>> LogicalTensor("lm_head.weight", (151936, 4096), "bf16").nbytes
    1244659712
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    dtype: str = "bf16"

    def __attrs_post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LayoutValueError(
                f"tensor '{self.name}' has unknown dtype '{self.dtype}' (known: {', '.join(DTYPES)})",
                hint=did_you_mean(self.dtype, DTYPES),
            )
        for d, n in enumerate(self.shape):
            if n < 0:
                raise LayoutValueError(f"tensor '{self.name}' has negative size {n} in dim {d}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@attrs.frozen
class Box:
    """A region of a logical tensor and its place in a rank's storage.

    ``offsets`` and ``sizes`` are global coordinates in the logical tensor; the box occupies
    ``storage[storage_offsets[d] : storage_offsets[d] + sizes[d]]`` along every dim of the
    storage named ``storage``.
    """

    tensor: str | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: str | None
    storage_offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def slices(self) -> tuple[slice, ...]:
        """Index of the box in the logical tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def storage_slices(self) -> tuple[slice, ...]:
        """Index of the box in its storage."""
        return tuple(slice(o, o + s) for o, s in zip(self.storage_offsets, self.sizes))

    def __str__(self) -> str:
        region = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes))
        place = ", ".join(f"{o}:{o + s}" for o, s in zip(self.storage_offsets, self.sizes))
        return f"{self.tensor}[{region}] at {self.storage}[{place}]"


@attrs.frozen
class TensorPlacement:
    """Where one logical tensor lives in a layout.

    ``placements`` has one entry per mesh axis (DTensor style); ``submesh`` fixes the
    coordinate of some axes (a pipeline stage, an expert-parallel rank), whose entry in
    ``placements`` is then ignored; ``order`` gives, per dim sharded by several axes in an
    explicit order, that order (otherwise they nest in mesh-axis order, as in DTensor).
    """

    mesh: Mesh
    placements: tuple[Placement, ...]
    submesh: tuple[tuple[str, int], ...] = ()
    order: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def spec(self, ndim: int, tensor: str = "?") -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]:
        """The C++ core's form: per dim, (pad multiple, ((axis index, chunks, blocks), ...))."""
        if len(self.placements) != len(self.mesh.axes):
            raise LayoutValueError(
                f"tensor '{tensor}': {len(self.placements)} placements for mesh '{self.mesh.name}' "
                f"of {len(self.mesh.axes)} axes"
            )
        fixed = {a for a, _ in self.submesh}
        per_dim: dict[int, list[tuple[int, Shard]]] = {}
        for axis_index, ((axis, _), placement) in enumerate(zip(self.mesh.axes, self.placements)):
            if axis in fixed or not isinstance(placement, Shard):
                continue
            dim = placement.dim + ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < ndim:
                raise LayoutValueError(
                    f"tensor '{tensor}' has {ndim} dims; axis '{axis}' cannot shard dim {placement.dim}"
                )
            per_dim.setdefault(dim, []).append((axis_index, placement))
        explicit = {d + ndim if d < 0 else d: axes for d, axes in self.order}
        dims = []
        for d in range(ndim):
            entries = per_dim.get(d, [])
            if d in explicit:
                rank_of = {self.mesh.axis_index(a): i for i, a in enumerate(explicit[d])}
                if set(rank_of) != {i for i, _ in entries}:
                    raise LayoutValueError(
                        f"tensor '{tensor}': the order given for dim {d} ({', '.join(explicit[d])}) "
                        "does not list exactly the axes that shard it"
                    )
                entries = sorted(entries, key=lambda e: rank_of[e[0]])
            pads = {p.pad for _, p in entries}
            if len(pads) > 1:
                raise LayoutValueError(f"tensor '{tensor}': dim {d} is padded to different multiples {sorted(pads)}")
            splits = []
            for axis_index, p in entries:
                size = self.mesh.axes[axis_index][1]
                chunks = size if p.chunks is None else p.chunks
                if chunks < 1 or size % chunks != 0:
                    raise LayoutValueError(
                        f"tensor '{tensor}': {chunks} chunks do not divide axis "
                        f"'{self.mesh.axes[axis_index][0]}' of size {size}"
                    )
                if p.blocks < 1:
                    raise LayoutValueError(f"tensor '{tensor}': blocks must be at least 1, not {p.blocks}")
                splits.append((axis_index, chunks, p.blocks))
            dims.append((pads.pop() if pads else 1, tuple(splits)))
        return tuple(dims)

    def fixed_coords(self, tensor: str = "?") -> list[int]:
        fixed = [-1] * len(self.mesh.axes)
        for axis, index in self.submesh:
            i = self.mesh.axis_index(axis)
            size = self.mesh.axes[i][1]
            if not 0 <= index < size:
                raise LayoutValueError(
                    f"tensor '{tensor}': sub-mesh index {index} is out of range for axis "
                    f"'{axis}' of size {size}"
                )
            fixed[i] = index
        return fixed


def shard_boxes(
    shape: Sequence[int],
    mesh: Mesh,
    placements: Sequence[Placement],
    rank: int,
) -> list[Box]:
    """The boxes ``rank`` holds of a tensor of ``shape`` placed on ``mesh`` (DTensor style).

    ``placements`` has one entry per mesh axis; the boxes' ``storage_offsets`` are their
    places in the rank's local tensor (what DTensor calls ``_local_tensor``).

    >>> mesh = Mesh("m", {"tp": 4})
    >>> [(b.offsets, b.sizes) for b in shard_boxes((9, 2), mesh, [Shard(0)], rank=2)]
    [((6, 0), (3, 2))]
    >>> shard_boxes((9, 2), mesh, [Shard(0)], rank=3)  # torch.chunk leaves the last rank empty
    []
    >>> [(b.offsets, b.storage_offsets) for b in shard_boxes((8,), mesh, [Shard(0, blocks=2)], rank=1)]
    [((1,), (0,)), ((5,), (1,))]
    """
    if rank not in mesh:
        raise LayoutValueError(f"rank {rank} is not in mesh '{mesh.name}'")
    placement = TensorPlacement(mesh, tuple(placements))
    spec = placement.spec(len(shape))
    coords = list(mesh.coords(rank).values())
    runs_per_dim = []
    for n, dim in zip(shape, spec):
        _, runs = _core.dim_runs(int(n), dim, coords, list(mesh.shape))
        runs_per_dim.append(runs)
    boxes = []
    for pick in itertools.product(*runs_per_dim):
        boxes.append(
            Box(
                None,
                tuple(r[0] for r in pick),
                tuple(r[1] for r in pick),
                None,
                tuple(r[2] for r in pick),
            )
        )
    return boxes


# ------------------------------------------------------------------------- rules

CaptureFn = Callable[[Mapping[str, int]], int]


@attrs.frozen
class Rule:
    """Places the tensors whose names match ``pattern`` (None: the default rule).

    In a pattern, ``*`` matches any text and ``{name}`` captures a whole run of digits as an
    integer. ``placements`` maps axes to placements (axes not named replicate);
    ``submesh`` maps axes to a coordinate, an integer or a function of the captures;
    ``order`` gives an explicit nesting order of the axes sharding one dim.
    """

    pattern: str | None
    placements: Mapping[str, Placement] = attrs.field(factory=dict, converter=lambda m: tuple(dict(m).items()))
    submesh: Mapping[str, int | CaptureFn] = attrs.field(factory=dict, converter=lambda m: tuple(dict(m).items()))
    order: Mapping[int, tuple[str, ...]] = attrs.field(factory=dict, converter=lambda m: tuple((int(d), tuple(a)) for d, a in dict(m).items()))
    span: Span | None = attrs.field(default=None, eq=False)

    @property
    def captures(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", self.pattern or ""))

    @property
    def specificity(self) -> int:
        """Number of literal characters; the most specific matching rule wins."""
        if self.pattern is None:
            return -1
        return len(re.sub(r"\{[^}]*\}|\*", "", self.pattern))


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``*`` matches any text, ``{name}`` a whole run of digits (captured as ``name``)."""
    if re.search(r"\}\{", pattern):
        raise LayoutValueError(f"pattern \"{pattern}\": two captures must be separated by text (a capture takes a whole run of digits)")
    out = []
    pos = 0
    for m in re.finditer(r"\{([A-Za-z_][A-Za-z0-9_]*)\}|\*", pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        if m.group(0) == "*":
            out.append(".*")
        else:
            out.append(f"(?<![0-9])(?P<{m.group(1)}>[0-9]+)(?![0-9])")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


@attrs.frozen
class StorageRule:
    """Storages holding several logical tensors, fused along ``dim``.

    ``name`` and ``parts`` are templates: ``parts[0]`` is matched against the tensors
    (``{name}`` captures digits); the other parts and the storage name are instantiated
    with the captures (``name`` may compute, e.g. ``{l % 4}``, through ``name_fn``).
    ``blocks``: interleave the parts in blocks of so many elements along ``dim`` (Megatron's
    fused QKV per query group); ``shape``: the local shape every rank must end up with.
    """

    name: str
    parts: tuple[str, ...] = attrs.field(converter=tuple)
    dim: int = 0
    blocks: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    name_fn: Callable[[Mapping[str, int]], str] | None = attrs.field(default=None, eq=False)
    span: Span | None = attrs.field(default=None, eq=False)

    def storage_name(self, captures: Mapping[str, int]) -> str:
        if self.name_fn is not None:
            return self.name_fn(captures)
        return _substitute(self.name, captures)


def _substitute(template: str, captures: Mapping[str, int]) -> str:
    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in captures:
            raise LayoutNameError(f"'{{{key}}}' is not a capture of the first part")
        return str(captures[key])

    return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", repl, template)


@attrs.frozen
class Storage:
    """A rank-local buffer: the local shards of ``parts`` fused along ``dim``."""

    name: str
    parts: tuple[str, ...]
    dim: int = 0
    blocks: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    span: Span | None = attrs.field(default=None, eq=False, repr=False)


# ------------------------------------------------------------------------ layout


class _Resolved:
    """A layout resolved tensor by tensor, and compiled for the C++ core."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.names = list(layout.tensors)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.rule_of: list[Rule] = []
        self.submesh_of: list[tuple[tuple[str, int], ...]] = []
        self.spec_of: list[int] = []
        self.specs: list[tuple] = []
        self.storages: list[Storage] = []
        self.storage_of: list[int] = []
        self.storage_index: dict[str, list[int]] = {}
        self._sid_of: dict[str, int] = {}
        self._axis_sizes = dict(layout.mesh.axes)
        self._resolve_rules()
        self._resolve_storages()
        self.core = self._compile()

    def placement(self, index: int) -> TensorPlacement:
        rule = self.rule_of[index]
        return TensorPlacement(self.layout.mesh, self._placements(rule), self.submesh_of[index], tuple(rule.order))

    # -- rules
    def _resolve_rules(self) -> None:
        layout = self.layout
        rules = sorted(enumerate(layout.rules), key=lambda ir: (-ir[1].specificity, ir[0]))
        compiled = []
        for _, rule in rules:
            try:
                compiled.append((rule, compile_pattern(rule.pattern) if rule.pattern is not None else None))
            except LayoutError as err:
                raise err.with_span(rule.span)
        # Names that differ only in their digits match the same rules when no pattern has a
        # literal digit (captures match whole digit runs), so the search is cached by skeleton.
        cacheable = not any(r.pattern and re.search(r"[0-9]", re.sub(r"\{[^}]*\}", "", r.pattern)) for r, _ in compiled)
        by_skeleton: dict[tuple[str, ...], int] = {}
        # A spec depends only on the rule and the number of dims; sub-mesh coordinates vary.
        spec_of_rule: dict[tuple[int, int], int] = {}
        spec_ids: dict[tuple, int] = {}
        digits = re.compile(r"[0-9]+")
        for name in self.names:
            tensor = layout.tensors[name]
            key = tuple(digits.split(name)) if cacheable else None
            chosen = by_skeleton.get(key) if key is not None else None
            if chosen is None:
                chosen = self._choose_rule(name, compiled)
                if key is not None:
                    by_skeleton[key] = chosen
            rule, regex = compiled[chosen]
            captures: dict[str, int] = {}
            if regex is not None:
                captures = {k: int(v) for k, v in regex.fullmatch(name).groupdict().items()}
            ndim = len(tensor.shape)
            sid = spec_of_rule.get((chosen, ndim))
            if sid is None:
                spec = self._spec(rule, name, ndim)
                sid = spec_of_rule[(chosen, ndim)] = spec_ids.setdefault(spec, len(spec_ids))
                if sid == len(self.specs):
                    self.specs.append(spec)
            self.rule_of.append(rule)
            self.spec_of.append(sid)
            self.submesh_of.append(self._submesh(name, rule, captures))

    def _choose_rule(self, name: str, compiled: list[tuple[Rule, re.Pattern[str] | None]]) -> int:
        found: int | None = None
        for i, (rule, regex) in enumerate(compiled):
            if found is not None and rule.specificity < compiled[found][0].specificity:
                break
            if regex is None or regex.fullmatch(name):
                if found is not None:
                    first = compiled[found][0]
                    where = f" (line {first.span.line})" if first.span else ""
                    raise LayoutValueError(
                        f"tensor '{name}' is matched by two rules of equal specificity in layout "
                        f"'{self.layout.name}': \"{first.pattern}\"{where} and \"{rule.pattern}\"",
                        rule.span,
                        "make one pattern more specific (more literal characters wins)",
                    )
                found = i
        if found is None:
            raise LayoutValueError(
                f"tensor '{name}' is matched by no rule of layout '{self.layout.name}' and the layout has no default",
                self.layout.span,
                "add a rule for it, or 'default: replicate'",
            )
        return found

    def _placements(self, rule: Rule) -> tuple[Placement, ...]:
        placed = dict(rule.placements)
        return tuple(placed.get(axis, Replicate()) for axis in self.layout.mesh.axis_names)

    def _spec(self, rule: Rule, tensor: str, ndim: int) -> tuple:
        # Only the names of the sub-mesh axes matter to the spec (their placements are ignored).
        axes_only = tuple((axis, 0) for axis, _ in rule.submesh)
        placement = TensorPlacement(self.layout.mesh, self._placements(rule), axes_only, tuple(rule.order))
        try:
            return placement.spec(ndim, tensor)
        except LayoutError as err:
            raise err.with_span(rule.span)

    def _submesh(self, tensor: str, rule: Rule, captures: dict[str, int]) -> tuple[tuple[str, int], ...]:
        sizes = self._axis_sizes
        submesh = []
        for axis, index in rule.submesh:
            value = index(captures) if callable(index) else int(index)
            size = sizes[axis]
            if not 0 <= value < size:
                shown = ", ".join(f"{k}={v}" for k, v in captures.items())
                raise LayoutValueError(
                    f"sub-mesh index {value} is out of range for axis '{axis}' of size {size} "
                    f"(tensor '{tensor}'{', ' + shown if shown else ''})",
                    rule.span,
                )
            submesh.append((axis, value))
        return tuple(submesh)

    # -- storages
    def _resolve_storages(self) -> None:
        layout = self.layout
        assigned: dict[str, Storage] = {}
        for rule in layout.storages:
            first = compile_pattern(rule.parts[0])
            matched = False
            for name in self.names:
                m = first.fullmatch(name)
                if m is None:
                    continue
                matched = True
                captures = {k: int(v) for k, v in m.groupdict().items()}
                try:
                    parts = tuple(_substitute(p, captures) for p in rule.parts)
                    storage_name = rule.storage_name(captures)
                except LayoutError as err:
                    raise err.with_span(rule.span)
                if len(set(parts)) != len(parts):
                    raise LayoutValueError(
                        f"storage '{storage_name}' of layout '{layout.name}' names a tensor twice", rule.span
                    )
                for part in parts:
                    if part not in layout.tensors:
                        raise LayoutNameError(
                            f"storage '{storage_name}' of layout '{layout.name}' names tensor '{part}', which is not declared",
                            rule.span,
                            did_you_mean(part, layout.tensors),
                        )
                    if part in assigned:
                        raise LayoutValueError(
                            f"tensor '{part}' is a part of two storages: '{assigned[part].name}' and '{storage_name}'",
                            rule.span,
                        )
                    ndim = len(layout.tensors[part].shape)
                    if not 0 <= rule.dim < ndim:
                        raise LayoutValueError(
                            f"storage '{storage_name}' fuses along dim {rule.dim}, but tensor '{part}' has {ndim} dims",
                            rule.span,
                        )
                storage = Storage(storage_name, parts, rule.dim, rule.blocks, rule.shape, rule.span)
                for part in parts:
                    assigned[part] = storage
                self._add_storage(storage)
            if not matched:
                raise LayoutNameError(
                    f"storage '{rule.name}' of layout '{layout.name}': no tensor matches its first part '{rule.parts[0]}'",
                    rule.span,
                    did_you_mean(rule.parts[0], layout.tensors),
                )
        for name in self.names:
            if name not in assigned:
                storage = Storage(name, (name,))
                assigned[name] = storage
                self._add_storage(storage)
        self.storage_of = [self._sid_of[n] for n in self.names]

    def _add_storage(self, storage: Storage) -> None:
        sid = len(self.storages)
        self.storage_index.setdefault(storage.name, []).append(sid)
        self.storages.append(storage)
        for part in storage.parts:
            self._sid_of[part] = sid

    # -- core
    def _compile(self):
        layout = self.layout
        mesh = layout.mesh
        axis_of = {a: i for i, a in enumerate(mesh.axis_names)}
        tensors = []
        for i, name in enumerate(self.names):
            tensor = layout.tensors[name]
            fixed = [-1] * len(axis_of)
            for axis, value in self.submesh_of[i]:
                fixed[axis_of[axis]] = value
            tensors.append((list(tensor.shape), self.spec_of[i], fixed, self.storage_of[i], itemsize(tensor.dtype)))
        storages = [
            (s.dim, [self.index[p] for p in s.parts], list(s.blocks or ()), list(s.shape or ()))
            for s in self.storages
        ]
        specs = [[(pad, list(splits)) for pad, splits in spec] for spec in self.specs]
        return _core.LayoutCore(list(mesh.shape), list(mesh.ranks), specs, tensors, storages)


@attrs.frozen(eq=False)
class Layout:
    """Rules that give every logical tensor of a program a placement on ``mesh`` and a storage.

    A tensor takes the most specific matching rule (the one with the most literal
    characters in its pattern); two matching rules of equal specificity are an error; the
    default rule (pattern None) matches what nothing else does.
    """

    name: str
    mesh: Mesh
    tensors: Mapping[str, LogicalTensor]
    rules: tuple[Rule, ...] = attrs.field(converter=tuple)
    storages: tuple[StorageRule, ...] = attrs.field(default=(), converter=tuple)
    span: Span | None = attrs.field(default=None, repr=False)
    _resolved: list = attrs.field(factory=list, init=False, repr=False)

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, mesh={self.mesh.name!r}, rules={len(self.rules)}, tensors={len(self.tensors)})"

    @property
    def resolved(self) -> _Resolved:
        if not self._resolved:
            self._resolved.append(_Resolved(self))
        return self._resolved[0]

    @property
    def core(self):
        """The layout compiled for the C++ core (``layoutlang._core.LayoutCore``)."""
        return self.resolved.core

    def _tensor_index(self, tensor: str) -> int:
        index = self.resolved.index.get(tensor)
        if index is None:
            raise LayoutNameError(
                f"unknown tensor '{tensor}' in layout '{self.name}'", hint=did_you_mean(tensor, self.tensors)
            )
        return index

    def _storage_indices(self, storage: str) -> list[int]:
        found = self.resolved.storage_index.get(storage)
        if not found:
            raise LayoutNameError(
                f"unknown storage '{storage}' in layout '{self.name}'",
                hint=did_you_mean(storage, self.resolved.storage_index),
            )
        return found

    def placement(self, tensor: str) -> TensorPlacement:
        """Where ``tensor`` lives: its placements per axis and its sub-mesh coordinates."""
        return self.resolved.placement(self._tensor_index(tensor))

    def rule_for(self, tensor: str) -> Rule:
        return self.resolved.rule_of[self._tensor_index(tensor)]

    def storage_of(self, tensor: str) -> Storage:
        return self.resolved.storages[self.resolved.storage_of[self._tensor_index(tensor)]]

    def holders(self, tensor: str) -> list[int]:
        """Ranks holding a shard (possibly empty) of the tensor."""
        return list(self.core.holders(self._tensor_index(tensor)))

    def local_shape(self, tensor: str, rank: int) -> tuple[int, ...] | None:
        shape = self.core.local_shape(self._tensor_index(tensor), rank)
        return tuple(shape) if shape is not None else None

    def boxes(self, tensor: str, rank: int) -> list[Box]:
        """The boxes of ``tensor`` that ``rank`` holds, each with its place in the rank's storage."""
        index = self._tensor_index(tensor)
        storage = self.resolved.storages[self.resolved.storage_of[index]].name
        return [
            Box(tensor, tuple(o), tuple(s), storage, tuple(so))
            for o, s, so in self.core.boxes(index, rank)
        ]

    def storages_on(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Every storage ``rank`` holds, with its local shape."""
        out = {}
        for sid, storage in enumerate(self.resolved.storages):
            shape = self.core.storage_shape(sid, rank)
            if shape is not None:
                out[storage.name] = tuple(shape)
        return out

    def storage(self, name: str, rank: int) -> Storage:
        """The storage of that name on ``rank`` (names may repeat on disjoint ranks)."""
        for sid in self._storage_indices(name):
            if self.core.storage_shape(sid, rank) is not None:
                return self.resolved.storages[sid]
        raise LayoutValueError(f"rank {rank} holds no storage '{name}' in layout '{self.name}'")

    def storage_shape(self, name: str, rank: int) -> tuple[int, ...] | None:
        for sid in self._storage_indices(name):
            shape = self.core.storage_shape(sid, rank)
            if shape is not None:
                return tuple(shape)
        return None

    def summary(self) -> list[dict[str, int]]:
        """Per rank: tensors, boxes, elements and bytes held (computed from every box)."""
        keys = ("rank", "tensors", "boxes", "elements", "bytes")
        return [dict(zip(keys, row)) for row in self.core.summarize()]

    def check(self) -> None:
        """Resolves every tensor and validates every storage on every rank; raises LayoutError."""
        resolved = self.resolved
        problems = self.core.validate(1)
        if problems:
            kind, sid, rank, message = problems[0]
            storage = resolved.storages[sid]
            raise LayoutValueError(
                f"storage '{storage.name}' of layout '{self.name}' on rank {rank}: {message}", storage.span
            )
        # Storage names may repeat only on disjoint ranks (Megatron's per-stage local names).
        for name, sids in resolved.storage_index.items():
            if len(sids) < 2:
                continue
            seen: dict[int, int] = {}
            for sid in sids:
                for rank in self.core.holders(self.resolved.index[resolved.storages[sid].parts[0]]):
                    if rank in seen:
                        other = resolved.storages[seen[rank]]
                        raise LayoutValueError(
                            f"rank {rank} would hold two storages named '{name}' in layout '{self.name}' "
                            f"(parts {', '.join(other.parts)} and {', '.join(resolved.storages[sid].parts)})",
                            resolved.storages[sid].span or other.span,
                        )
                    seen[rank] = sid


# ---------------------------------------------------------------------- program


@attrs.frozen
class Topology:
    """How ranks share fast links: ``domain_size`` consecutive ranks form one domain.

    Bandwidths are per rank and per direction (what one rank can send, and separately
    receive, per second); ``copy_bandwidth`` is the rate of a copy inside one rank's memory.
    A named topology starts from the preset of that name (:data:`layoutlang.simulate.TOPOLOGY_PRESETS`).
    """

    domain_size: int = 1
    domain_bandwidth: float | None = None  # bytes per second
    network_bandwidth: float | None = None  # bytes per second per rank
    domain_latency: float | None = None  # seconds
    network_latency: float | None = None  # seconds
    name: str | None = None
    copy_bandwidth: float | None = None  # bytes copied per second inside one rank (local moves)

    def domain_of(self, rank: int) -> int:
        return rank // self.domain_size


@attrs.frozen
class Reshard:
    """``reshard NAME: SOURCE -> DESTINATION``, with per-pattern policies."""

    name: str
    source: str
    destination: str
    policies: tuple[tuple[str | None, str], ...] = ()
    span: Span | None = attrs.field(default=None, eq=False, repr=False)

    def policy_for(self, tensor: str) -> str:
        """``reshard`` or ``broadcast``: the most specific matching policy (more literal
        characters wins, as for layout rules), else the default policy, else ``reshard``.
        Two matching patterns of equal specificity are an error."""
        best: tuple[int, str, str | None] | None = None
        for pattern, policy in self.policies:
            if pattern is None:
                score = -1
            elif compile_pattern(pattern).fullmatch(tensor):
                score = Rule(pattern).specificity
            else:
                continue
            if best is not None and score == best[0]:
                raise LayoutValueError(
                    f"tensor '{tensor}' is matched by two policies of equal specificity in reshard "
                    f"'{self.name}': \"{best[2]}\" and \"{pattern}\"",
                    self.span,
                    "make one pattern more specific (more literal characters wins)",
                )
            if best is None or score > best[0]:
                best = (score, policy, pattern)
        return best[1] if best else "reshard"


@attrs.frozen(eq=False)
class Program:
    """Everything one ``.layout`` file (and its includes) declares, by name."""

    meshes: Mapping[str, Mesh]
    tensors: Mapping[str, LogicalTensor]
    layouts: Mapping[str, Layout]
    reshards: Mapping[str, Reshard]
    topology: Topology = Topology()
    constants: Mapping[str, int] = attrs.field(factory=dict)
    path: str = "<string>"

    def __repr__(self) -> str:
        return (
            f"Program({self.path!r}: {len(self.meshes)} meshes, {len(self.tensors)} tensors, "
            f"{len(self.layouts)} layouts, {len(self.reshards)} reshards)"
        )

    def layout(self, name: str) -> Layout:
        if name not in self.layouts:
            raise LayoutNameError(
                f"unknown layout '{name}' (layouts: {', '.join(self.layouts) or 'none'})",
                hint=did_you_mean(name, self.layouts),
            )
        return self.layouts[name]

    def reshard(self, name: str | None = None) -> Reshard:
        """The named reshard, or the only one when ``name`` is None."""
        if name is None:
            if not self.reshards:
                raise LayoutNameError(
                    f"{self.path} declares no reshard statement",
                    hint="add one, e.g. 'reshard training -> inference'",
                )
            if len(self.reshards) > 1:
                raise LayoutNameError(
                    f"{self.path} declares {len(self.reshards)} reshard statements; name one "
                    f"({', '.join(self.reshards)})"
                )
            return next(iter(self.reshards.values()))
        if name not in self.reshards:
            raise LayoutNameError(
                f"unknown reshard '{name}' (reshards: {', '.join(self.reshards) or 'none'})",
                hint=did_you_mean(name, self.reshards),
            )
        return self.reshards[name]

    def check(self) -> None:
        """Resolves every layout for every tensor and validates every storage on every rank."""
        for layout in self.layouts.values():
            layout.check()
