"""Rules: which placement and which storage each logical tensor gets, by name pattern."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping

import attrs

from ..errors import LayoutNameError, LayoutValueError, Span
from .mesh import Placement

# ------------------------------------------------------------------------- rules

CaptureFn = Callable[[Mapping[str, int]], int]
"""An expression of a pattern's captures (``l // 4``), given their values."""

SubmeshIndex = int | CaptureFn
"""A sub-mesh coordinate: fixed, or computed from a pattern's captures."""


def _placement_items(
    placements: Mapping[str, Placement] | Iterable[tuple[str, Placement]],
) -> tuple[tuple[str, Placement], ...]:
    return tuple(dict(placements).items())


def _submesh_items(
    submesh: Mapping[str, SubmeshIndex] | Iterable[tuple[str, SubmeshIndex]],
) -> tuple[tuple[str, SubmeshIndex], ...]:
    return tuple(dict(submesh).items())


def _order_items(
    order: Mapping[int, Iterable[str]] | Iterable[tuple[int, Iterable[str]]],
) -> tuple[tuple[int, tuple[str, ...]], ...]:
    return tuple((int(dim), tuple(axes)) for dim, axes in dict(order).items())


@attrs.frozen
class Rule:
    """Places the tensors whose names match ``pattern`` (None: the default rule).

    In a pattern, ``*`` matches any text and ``{name}`` captures a whole run of digits as an
    integer. ``placements`` maps axes to placements (axes not named replicate);
    ``submesh`` maps axes to a coordinate, an integer or a function of the captures;
    ``order`` gives an explicit nesting order of the axes sharding one dim. Each is given
    as a mapping and kept as a tuple of its items, so that a rule is hashable.
    """

    pattern: str | None
    placements: tuple[tuple[str, Placement], ...] = attrs.field(default=(), converter=_placement_items)
    submesh: tuple[tuple[str, SubmeshIndex], ...] = attrs.field(default=(), converter=_submesh_items)
    order: tuple[tuple[int, tuple[str, ...]], ...] = attrs.field(default=(), converter=_order_items)
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
        raise LayoutValueError(
            f'pattern "{pattern}": two captures must be separated by text (a capture takes a whole run of digits)'
        )
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


def _parts(parts: Iterable[str]) -> tuple[str, ...]:
    return tuple(parts)


def _flags(flags: Iterable[bool]) -> tuple[bool, ...]:
    return tuple(bool(f) for f in flags)


@attrs.frozen
class StorageRule:
    """Storages holding several logical tensors, fused along ``dim``.

    ``name`` and ``parts`` are templates: ``parts[0]`` is matched against the tensors
    (``{name}`` captures digits); the other parts and the storage name are instantiated
    with the captures (``name`` may compute, e.g. ``{l % 4}``, through ``name_fn``).
    ``blocks``: interleave the parts in blocks of so many elements along ``dim`` (Megatron's
    fused QKV per query group); ``shape``: the local shape every rank must end up with.

    ``stack``: a capture of ``parts[0]`` (``e``). The matches that differ only in it are the
    elements of one storage, ordered by its value; each rank stacks the elements it holds
    along a new leading dim (vLLM's ``w13_weight``). ``transposed``: per part, whether its
    last two dims are swapped in the storage (empty: none is). ``view``: the shape the engine
    holds the storage in, a row-major reshape of the shape its parts make (Megatron's
    ``weight1`` is ``[hidden, experts * 2 * ffn]`` over ``[experts, hidden, 2 * ffn]``).
    """

    name: str
    parts: tuple[str, ...] = attrs.field(converter=_parts)
    dim: int = 0
    blocks: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    name_fn: Callable[[Mapping[str, int]], str] | None = attrs.field(default=None, eq=False)
    span: Span | None = attrs.field(default=None, eq=False)
    stack: str | None = None
    transposed: tuple[bool, ...] = attrs.field(default=(), converter=_flags)
    view: tuple[int, ...] | None = None

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
    """A rank-local buffer: the local shards of ``parts`` fused along ``dim``.

    Stacked (``elements`` not None): part ``p`` belongs to element ``elements[p]``; each
    element is its parts fused along ``dim``, and a rank stacks the elements it holds along
    a new leading dim. ``transposed[p]``: part ``p`` sits with its last two dims swapped.
    ``view``: the shape the engine holds it in (a row-major reshape of what the parts make).
    """

    name: str
    parts: tuple[str, ...]
    dim: int = 0
    blocks: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    span: Span | None = attrs.field(default=None, eq=False, repr=False)
    elements: tuple[int, ...] | None = None
    transposed: tuple[bool, ...] = attrs.field(default=(), converter=_flags)
    view: tuple[int, ...] | None = None

    @property
    def stacked(self) -> bool:
        return self.elements is not None

    def is_transposed(self, part: str) -> bool:
        return bool(self.transposed) and self.transposed[self.parts.index(part)]
