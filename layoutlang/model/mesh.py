"""Meshes of ranks and the placements of their axes (:class:`Shard`, :class:`Replicate`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

import attrs

from ..errors import LayoutNameError, LayoutValueError, did_you_mean

# ------------------------------------------------------------------------ meshes


def _axes_tuple(axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
    return tuple((str(name), int(size)) for name, size in items)


def check_axis_name(mesh: str, axis: str, earlier: Collection[str]) -> None:
    """Raise if ``axis`` is one of the ``earlier`` axes of ``mesh``."""
    if axis in earlier:
        raise LayoutNameError(f"mesh '{mesh}' declares axis '{axis}' twice")


def check_axis_size(mesh: str, axis: str, size: int) -> None:
    """Raise if ``axis`` of ``mesh`` cannot have ``size`` positions."""
    if size < 1:
        raise LayoutValueError(f"axis '{axis}' of mesh '{mesh}' has size {size}; sizes are at least 1")


def shape_text(axes: Iterable[tuple[str, int]]) -> str:
    """``dp=2 x tp=4``: a mesh's axes as messages show them."""
    return " x ".join(f"{axis}={size}" for axis, size in axes)


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
        if not axes_t:
            raise LayoutValueError(f"mesh '{name}' has no axes")
        for i, (axis, size) in enumerate(axes_t):
            check_axis_name(name, axis, [a for a, _ in axes_t[:i]])
            check_axis_size(name, axis, size)
        size = math.prod(s for _, s in axes_t)
        ranks_t = tuple(range(size)) if ranks is None else tuple(map(int, ranks))
        if len(ranks_t) != size:
            raise LayoutValueError(
                f"mesh '{name}' ({shape_text(axes_t)}) has {size} positions but {len(ranks_t)} ranks"
            )
        # built in C (dict, zip, min) rather than rank by rank: a mesh may hold 2^20 ranks
        index = dict(zip(ranks_t, range(size)))
        if len(index) != size or (size and min(ranks_t) < 0):
            seen: set[int] = set()
            for r in ranks_t:  # the first mistake in the order written
                if r < 0:
                    raise LayoutValueError(f"mesh '{name}' lists negative rank {r}")
                if r in seen:
                    raise LayoutValueError(f"mesh '{name}' lists rank {r} twice")
                seen.add(r)
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


Placement = Shard | Replicate
