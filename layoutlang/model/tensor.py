"""Logical tensors, their boxes, and how a placement cuts a tensor into boxes."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import attrs

from ..core import _core
from ..errors import LayoutValueError, did_you_mean
from .dtypes import DTYPES, itemsize
from .mesh import Mesh, Placement, Shard

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
    ``storage[storage_offsets[d] : storage_offsets[d] + storage_sizes[d]]`` along every dim
    of the storage named ``storage``. ``storage_sizes`` are the ``sizes`` unless the box is
    ``transposed`` in its storage (its last two dims swapped) or its storage is stacked (one
    more, leading, dim of size 1: the element's index in the stack); None means the same
    as ``sizes``.
    """

    tensor: str | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: str | None
    storage_offsets: tuple[int, ...]
    storage_sizes: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    transposed: bool = attrs.field(default=False, repr=False)

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
        """Index of the box in its storage (one slice per storage dim)."""
        sizes = self.storage_sizes if self.storage_sizes is not None else self.sizes
        return tuple(slice(o, o + s) for o, s in zip(self.storage_offsets, sizes))

    def storage_index(self) -> tuple[slice | int, ...]:
        """Index of the box in its storage, the element of a stacked storage as an integer, so
        that indexing drops that dim (a transposed box still needs its last two dims swapped)."""
        slices = self.storage_slices()
        stacked = len(slices) - len(self.sizes)
        return (*(s.start for s in slices[:stacked]), *slices[stacked:])

    def __str__(self) -> str:
        region = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes))
        place = ", ".join(f"{s.start}:{s.stop}" for s in self.storage_slices())
        return f"{self.tensor}[{region}] at {self.storage}[{place}]{'.T' if self.transposed else ''}"


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

    def check_order(self, shape: Sequence[int], tensor: str = "?") -> None:
        """Refuse an explicit right-to-left order on a size where DTensor's form of it differs.

        ``(tp, dp) = shard(d)`` on ``[dp, tp]`` nests truly: tp cuts the dim with
        ``torch.chunk``, then dp cuts each tp piece (what FSDP2 holds: ``fully_shard``
        chunks each TP shard). DTensor writes the same layout as
        ``[_StridedShard(d, split_factor=|tp|), Shard(d)]``, applied in mesh order, and on
        some uneven sizes (7 over dp = 3, tp = 2) that computation gives other rows. Rather
        than silently side with one of them, such a size is a LayoutValueError naming the
        first rank where they differ; on every other size the two are the same boxes.
        """
        explicit = {d + len(shape) if d < 0 else d: axes for d, axes in self.order}
        if not explicit:
            return
        spec = self.spec(len(shape), tensor)
        sizes = tuple(self.mesh.shape)
        for d, axes in sorted(explicit.items()):
            pad, splits = spec[d]
            found = _strided_disagreement(int(shape[d]), pad, tuple(s[0] for s in splits), sizes)
            if found is None:
                continue
            coords, nested, dtensor = found
            names = self.mesh.axis_names
            rank = self.mesh.rank_at({names[i]: c for i, c in enumerate(coords)})
            where = ", ".join(f"{names[i]}={c}" for i, c in enumerate(coords))
            in_mesh_order = sorted(self.mesh.axis_index(a) for a in axes)
            factors = _split_factors(tuple(s[0] for s in splits), sizes)
            dtensor_form = ", ".join(
                f"{names[i]}: _StridedShard({d}, split_factor={sf})" if sf > 1 else f"{names[i]}: Shard({d})"
                for i, sf in zip(in_mesh_order, factors)
            )
            spelled = ", ".join(
                f"{names[i]} = shard({d}, blocks = {sf})" if sf > 1 else f"{names[i]} = shard({d})"
                for i, sf in zip(in_mesh_order, factors)
            )
            raise LayoutValueError(
                f"tensor '{tensor}': ({', '.join(axes)}) = shard({d}) is ambiguous for size {shape[d]} of "
                f"dim {d}: cutting {' then '.join(axes)} gives rank {rank} ({where}) {_indices_text(nested)}, "
                f"DTensor's form of it ({dtensor_form}) gives {_indices_text(dtensor)}",
                hint=(
                    f"the two agree whenever dim {d} divides by the product of the axis sizes; to hold "
                    f"DTensor's shards write {spelled} (no explicit order)"
                ),
            )

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
        held = _core.dim_runs(int(n), dim, coords, list(mesh.shape))
        runs = [(r.global_start, r.length, r.local_start) for r in held.runs]
        runs_per_dim.append(runs)
    return [
        Box(None, tuple(r[0] for r in pick), tuple(r[1] for r in pick), None, tuple(r[2] for r in pick))
        for pick in itertools.product(*runs_per_dim)
    ]


def _split_factors(order: tuple[int, ...], sizes: tuple[int, ...]) -> list[int]:
    """DTensor's split factor of each axis of ``order``, in mesh order: the product of the
    sizes of the axes that cut before it although they come after it in the mesh (FSDP2's rule)."""
    factors = []
    for axis in sorted(order):
        before = order[: order.index(axis)]
        factor = 1
        for other in before:
            if other > axis:
                factor *= sizes[other]
        factors.append(factor)
    return factors


@functools.cache
def _strided_disagreement(
    n: int, pad: int, order: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[tuple[int, ...], list[tuple[int, int]], list[tuple[int, int]]] | None:
    """The first mesh coordinates where the nesting in ``order`` and DTensor's strided form of
    it hold different indices of a dim of ``n``, with both (as (start, length) runs in local
    order); None where they agree on every rank. Cached: models repeat a few sizes."""
    if list(order) == sorted(order):
        return None
    nested = (pad, tuple((axis, sizes[axis], 1) for axis in order))
    strided = (pad, tuple((axis, sizes[axis], sf) for axis, sf in zip(sorted(order), _split_factors(order, sizes))))
    coords = [0] * len(sizes)
    for picked in itertools.product(*(range(sizes[axis]) for axis in sorted(order))):
        for axis, c in zip(sorted(order), picked):
            coords[axis] = c
        a = [(r.global_start, r.length) for r in _core.dim_runs(n, nested, coords, list(sizes)).runs]
        b = [(r.global_start, r.length) for r in _core.dim_runs(n, strided, coords, list(sizes)).runs]
        if a != b:
            return tuple(coords), a, b
    return None


def _indices_text(runs: list[tuple[int, int]]) -> str:
    if not runs:
        return "no index"
    shown = ", ".join(f"{s}" if n == 1 else f"{s}:{s + n}" for s, n in runs)
    return ("index " if runs == [(runs[0][0], 1)] else "indices ") + shown
