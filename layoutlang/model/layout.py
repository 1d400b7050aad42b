"""Layouts: rules resolved tensor by tensor, boxes by rank, storages by rank."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping

import attrs

from ..core import _core
from ..errors import LayoutError, LayoutNameError, LayoutValueError, Span, core_errors, did_you_mean
from .dtypes import itemsize
from .mesh import Mesh, Placement, Replicate
from .quantization import QUANTIZABLE, Quantization, QuantizeRule, block_cut, scale_box, scale_shape
from .rules import CaptureFn, Rule, Storage, StorageRule, _substitute, compile_pattern
from .tensor import Box, LogicalTensor, TensorPlacement


@attrs.frozen(eq=False)
class CaptureExpression:
    """A sub-mesh coordinate computed from a pattern's captures (``ep[e // 4]``), knowing the
    captures it reads (``reads``).

    What it reads decides which axes a stacked storage spreads its elements over: an axis whose
    coordinate reads the stack's capture. A rank of those axes that none of the elements lands
    on still holds the storage, with no element (vLLM's ``w13_weight`` of ``[0, 2 * I, H]`` on an
    EP rank past the experts). A plain function of the captures reads nothing knowable, so its
    axis never spreads a stack.

    >>> index = CaptureExpression(lambda c: c["e"] // 4, frozenset({"e"}))
    >>> index({"e": 9}), sorted(index.reads)
    (2, ['e'])
    """

    function: CaptureFn
    reads: frozenset[str]

    def __call__(self, captures: Mapping[str, int]) -> int:
        return self.function(captures)


# ------------------------------------------------------------------------ layout


def _compiled(rule: Rule) -> tuple[Rule, re.Pattern[str] | None]:
    """A rule and the regular expression of its pattern (None: the default rule)."""
    if rule.pattern is None:
        return rule, None
    try:
        return rule, compile_pattern(rule.pattern)
    except LayoutError as err:
        err.with_span(rule.span)
        raise


def _captures(regex: re.Pattern[str] | None, name: str, span: Span | None = None) -> dict[str, int]:
    """The digits a rule's pattern (written at ``span``) captures from a tensor name it matches."""
    match = regex.fullmatch(name) if regex is not None else None
    return captured_values(match, name, span) if match is not None else {}


#: digits of the largest capture: 2**63 - 1 has 19
_CAPTURE_DIGITS = len(str((1 << 63) - 1))


def captured_values(match: re.Match[str], name: str, span: Span | None) -> dict[str, int]:
    """The values of a match's captures, 64-bit integers like every value of the language: a
    longer digit run of a tensor name is an error naming the tensor (converting thousands of
    digits is slow, and Python refuses more than 4,300)."""
    values = {}
    for capture, digits in match.groupdict().items():
        if len(digits.lstrip("0")) > _CAPTURE_DIGITS or int(digits) > (1 << 63) - 1:
            shown = digits if len(digits) <= 40 else f"{digits[:20]}... ({len(digits):,} digits)"
            raise LayoutValueError(
                f"tensor '{name[:80]}' holds the number {shown}, which {{{capture}}} captures: it is outside"
                " the 64-bit integers layoutlang computes with",
                span,
            )
        values[capture] = int(digits)
    return values


_PLACEHOLDERS = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}|\*")


def _rule_kinds(
    compiled: list[tuple[Rule, re.Pattern[str] | None]],
) -> tuple[dict[int, dict[str, list[int]]], dict[str, int], list[int]]:
    """The rules (indices into ``compiled``) by how a name finds them: with a literal digit and
    a wildcard (by the length and the text of what precedes their first wildcard), naming one
    tensor exactly (by name), and the rest, which match alike the names that differ only in
    their digits (the default rule among them)."""
    by_digits: dict[int, dict[str, list[int]]] = {}
    exact: dict[str, int] = {}
    plain: list[int] = []
    for i, (rule, _) in enumerate(compiled):
        pattern = rule.pattern
        if pattern is None or not re.search(r"[0-9]", re.sub(r"\{[^}]*\}", "", pattern)):
            plain.append(i)
            continue
        first = _PLACEHOLDERS.search(pattern)
        if first is None and pattern not in exact:
            exact[pattern] = i
        else:
            prefix = pattern[: first.start()] if first is not None else pattern
            by_digits.setdefault(len(prefix), {}).setdefault(prefix, []).append(i)
    return by_digits, exact, plain


class NameIndex:
    """Tensor names indexed so that a pattern is tried on the names it could match only, not on
    every name (a layout of S storage rules and T tensors: S x T pattern tests before).

    A pattern without a literal digit matches every name of a skeleton (the text between
    digit runs) or none, so it is tried on one name per skeleton; one with a literal digit, on
    the names that start with its text before its first wildcard. Names come in the order
    the program declares them.
    """

    def __init__(self, names: list[str]) -> None:
        self._names = names
        digits = re.compile(r"[0-9]+")
        self._by_skeleton: dict[tuple[str, ...], list[int]] = {}
        for i, name in enumerate(names):
            self._by_skeleton.setdefault(tuple(digits.split(name)), []).append(i)
        self._sorted: list[tuple[str, int]] | None = None

    def could_match(self, pattern: str, regex: re.Pattern[str]) -> list[str]:
        if not re.search(r"[0-9]", re.sub(r"\{[^}]*\}", "", pattern)):
            found = [i for group in self._by_skeleton.values() if regex.fullmatch(self._names[group[0]]) for i in group]
        else:
            if self._sorted is None:
                self._sorted = sorted((name, i) for i, name in enumerate(self._names))
            first = _PLACEHOLDERS.search(pattern)
            prefix = pattern[: first.start()] if first is not None else pattern
            found = []
            # by position: islice() would step through every name before the prefix
            for position in range(bisect.bisect_left(self._sorted, (prefix, -1)), len(self._sorted)):
                name, i = self._sorted[position]
                if not name.startswith(prefix):
                    break
                found.append(i)
        return [self._names[i] for i in sorted(found)]


def _top_matches(name: str, compiled: list[tuple[Rule, re.Pattern[str] | None]], among: list[int]) -> tuple[int, ...]:
    """The first rules of ``among`` (most specific first) that match ``name``: the most specific
    one, and a second of the same specificity if there is one (a tie, unless a rule matched
    elsewhere is more specific still)."""
    found: list[int] = []
    for i in among:
        rule, regex = compiled[i]
        if found and rule.specificity < compiled[found[0]][0].specificity:
            break
        if regex is None or regex.fullmatch(name):
            found.append(i)
            if len(found) == 2:
                break
    return tuple(found)


def _compiled_quantize(rule: QuantizeRule) -> tuple[QuantizeRule, re.Pattern[str] | None]:
    """A quantize rule and the regular expression of its pattern (None: it names its tensors)."""
    if rule.tensors is not None:
        return rule, None
    try:
        return rule, compile_pattern(rule.pattern)
    except LayoutError as err:
        err.with_span(rule.span)
        raise


def _rules(rules: Iterable[Rule]) -> tuple[Rule, ...]:
    return tuple(rules)


def _quantize_rules(rules: Iterable[QuantizeRule]) -> tuple[QuantizeRule, ...]:
    return tuple(rules)


def _storage_rules(storages: Iterable[StorageRule]) -> tuple[StorageRule, ...]:
    return tuple(storages)


class _Resolved:
    """A layout resolved tensor by tensor, and compiled for the C++ core."""

    #: what the core was compiled from, besides the mesh (specs, tensors, storages)
    _core_arguments: tuple[list, list, list]

    def __init__(self, layout: Layout, like: _Resolved | None = None):
        self.layout = layout
        if like is not None:
            self._reuse(like)
            return
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
        # stacked storage id -> the storage rule that made it (where its stack capture is)
        self._stack_rule_of: dict[int, StorageRule] = {}
        self._empty_stacks: dict[int, dict[int, tuple[int, ...]]] | None = None
        self._axis_sizes = dict(layout.mesh.axes)
        self._resolve_rules()
        self._resolve_storages()
        self.core = self._compile()

    def _reuse(self, like: _Resolved) -> None:
        """Take ``like``'s resolution (the same tensors, rules and storages on a mesh whose
        placed axes are the same: :func:`_resolution_carries`), compiling only the core anew
        for this mesh's ranks: at DeepSeek-V3 scale a recovery's new layouts cost
        milliseconds instead of resolving 45k tensors again."""
        self.names, self.index = like.names, like.index
        self.rule_of, self.submesh_of = like.rule_of, like.submesh_of
        self.spec_of, self.specs = like.spec_of, like.specs
        self.storages, self.storage_of, self.storage_index = like.storages, like.storage_of, like.storage_index
        self._sid_of, self._stack_rule_of = like._sid_of, like._stack_rule_of
        self._empty_stacks = None  # which ranks hold an empty stack depends on the ranks
        self._axis_sizes = dict(self.layout.mesh.axes)
        self._core_arguments = like._core_arguments
        mesh = self.layout.mesh
        with core_errors(self.names):
            self.core = _core.LayoutCore(list(mesh.shape), list(mesh.ranks), *self._core_arguments)

    def placement(self, index: int) -> TensorPlacement:
        rule = self.rule_of[index]
        return TensorPlacement(self.layout.mesh, self._placements(rule), self.submesh_of[index], tuple(rule.order))

    # -- rules
    def _resolve_rules(self) -> None:
        layout = self.layout
        rules = sorted(enumerate(layout.rules), key=lambda ir: (-ir[1].specificity, ir[0]))
        compiled = [_compiled(rule) for _, rule in rules]
        # Each tensor tests only the rules that can tell its name from others, so a layout is
        # resolved in time linear in its tensors and rules together (not their product):
        # - rules without a literal digit match the same for names that differ only in their
        #   digits (captures match whole digit runs): searched once per skeleton, then cached;
        # - a rule naming one tensor exactly ("layers.7.mlp.weight") is a dictionary lookup;
        # - the rest (a literal digit and a wildcard: "layers.7.*") is tried on the names that
        #   start with its text before the first wildcard, found by that text.
        by_digits, exact, plain = _rule_kinds(compiled)
        by_skeleton: dict[tuple[str, ...], tuple[int, ...]] = {}
        # A spec depends only on the rule and the number of dims; sub-mesh coordinates vary.
        spec_of_rule: dict[tuple[int, int], int] = {}
        spec_ids: dict[tuple, int] = {}
        digits = re.compile(r"[0-9]+")
        for name in self.names:
            tensor = layout.tensors[name]
            key = tuple(digits.split(name))
            matches = by_skeleton.get(key)
            if matches is None:
                matches = by_skeleton[key] = _top_matches(name, compiled, plain)
            if by_digits or exact:
                found = [
                    i
                    for length, rules_of_prefix in by_digits.items()
                    for i in rules_of_prefix.get(name[:length], ())
                    if compiled[i][1].fullmatch(name)  # type: ignore[union-attr]
                ]
                if name in exact:
                    found.append(exact[name])
                if found:
                    matches = tuple(sorted((*matches, *found)))
            chosen = self._choose_rule(name, compiled, matches)
            rule, regex = compiled[chosen]
            captures = _captures(regex, name, rule.span)
            ndim = len(tensor.shape)
            sid = spec_of_rule.get((chosen, ndim))
            if sid is None:
                spec = self._spec(rule, name, ndim)
                sid = spec_of_rule[(chosen, ndim)] = spec_ids.setdefault(spec, len(spec_ids))
                if sid == len(self.specs):
                    self.specs.append(spec)
            if rule.order:
                self._check_order(rule, name, tensor.shape)
            self.rule_of.append(rule)
            self.spec_of.append(sid)
            self.submesh_of.append(self._submesh(name, rule, captures))

    def _choose_rule(
        self, name: str, compiled: list[tuple[Rule, re.Pattern[str] | None]], matches: tuple[int, ...]
    ) -> int:
        """The most specific of the rules ``matches`` (indices into ``compiled``, most specific
        first); two of equal specificity, or none, are an error."""
        if not matches:
            raise LayoutValueError(
                f"tensor '{name}' is matched by no rule of layout '{self.layout.name}' and the layout has no default",
                self.layout.span,
                "add a rule for it, or 'default: replicate'",
            )
        found = matches[0]
        if len(matches) > 1 and compiled[matches[1]][0].specificity == compiled[found][0].specificity:
            first, rule = compiled[found][0], compiled[matches[1]][0]
            where = f" (line {first.span.line})" if first.span else ""
            raise LayoutValueError(
                f"tensor '{name}' is matched by two rules of equal specificity in layout "
                f"'{self.layout.name}': \"{first.pattern}\"{where} and \"{rule.pattern}\"",
                rule.span,
                "make one pattern more specific (more literal characters wins)",
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
            err.with_span(rule.span)
            raise

    def _check_order(self, rule: Rule, tensor: str, shape: tuple[int, ...]) -> None:
        placement = TensorPlacement(self.layout.mesh, self._placements(rule), (), tuple(rule.order))
        try:
            placement.check_order(shape, tensor)
        except LayoutError as err:
            err.with_span(rule.span)
            raise

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
        candidates = NameIndex(self.names) if layout.storages else None
        for rule in layout.storages:
            first = compile_pattern(rule.parts[0])
            matched = False
            # A stack's elements by storage name: (stack capture, parts), ordered at the end.
            stacks: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
            assert candidates is not None
            for name in candidates.could_match(rule.parts[0], first):
                m = first.fullmatch(name)
                if m is None:
                    continue
                matched = True
                captures = captured_values(m, name, rule.span)
                try:
                    parts = tuple(_substitute(p, captures) for p in rule.parts)
                    storage_name = rule.storage_name(captures)
                except LayoutError as err:
                    err.with_span(rule.span)
                    raise
                if len(set(parts)) != len(parts):
                    raise LayoutValueError(
                        f"storage '{storage_name}' of layout '{layout.name}' names a tensor twice", rule.span
                    )
                for part in parts:
                    if part not in layout.tensors:
                        raise LayoutNameError(
                            f"storage '{storage_name}' of layout '{layout.name}' names tensor '{part}', "
                            "which is not declared",
                            rule.span,
                            did_you_mean(part, layout.tensors),
                        )
                    if part in assigned:
                        raise LayoutValueError(
                            f"tensor '{part}' is a part of two storages: '{assigned[part].name}' and '{storage_name}'",
                            rule.span,
                        )
                    ndim = len(layout.tensors[part].shape)
                    if rule.transposed and rule.transposed[parts.index(part)] and ndim < 2:
                        raise LayoutValueError(
                            f"storage '{storage_name}' transposes tensor '{part}', which has {ndim} dims "
                            "(a transposed part swaps its last two dims)",
                            rule.span,
                        )
                    if not 0 <= rule.dim < ndim:
                        raise LayoutValueError(
                            f"storage '{storage_name}' fuses along dim {rule.dim}, but tensor '{part}' has {ndim} dims",
                            rule.span,
                        )
                if rule.stack is None:
                    storage = Storage(storage_name, parts, rule.dim, rule.blocks, rule.shape, rule.span,
                                      transposed=rule.transposed, view=rule.view)
                    for part in parts:
                        assigned[part] = storage
                    self._add_storage(storage)
                else:
                    stacks.setdefault(storage_name, []).append((captures[rule.stack], parts))
                    for part in parts:
                        assigned[part] = Storage(storage_name, parts)  # named here for the error above
            for storage_name, elements in stacks.items():
                elements.sort()
                parts = tuple(p for _, element in elements for p in element)
                storage = Storage(
                    storage_name, parts, rule.dim, None, rule.shape, rule.span,
                    elements=tuple(i for i, (_, element) in enumerate(elements) for _ in element),
                    transposed=rule.transposed * len(elements), view=rule.view,
                )
                for part in parts:
                    assigned[part] = storage
                self._stack_rule_of[len(self.storages)] = rule
                self._add_storage(storage)
            if not matched:
                raise LayoutNameError(
                    f"storage '{rule.name}' of layout '{layout.name}': "
                    f"no tensor matches its first part '{rule.parts[0]}'",
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

    # -- empty stacks
    def empty_stacks(self) -> dict[int, dict[int, tuple[int, ...]]]:
        """Stacked storage id -> {rank: shape} of the ranks that hold it with no element."""
        if self._empty_stacks is None:
            self._empty_stacks = {}
            for sid, rule in self._stack_rule_of.items():
                empty = self._empty_stack(sid, rule)
                if empty:
                    self._empty_stacks[sid] = empty
        return self._empty_stacks

    def _empty_stack(self, sid: int, rule: StorageRule) -> dict[int, tuple[int, ...]]:
        """The ranks of the axes a stack spreads over (those whose sub-mesh coordinate reads the
        stack capture) that none of its elements lands on, with the storage's shape there: no
        element, each element's trailing shape (the parts' local shapes do not depend on those
        axes, which select and so cannot also shard)."""
        storage = self.storages[sid]
        assert rule.stack is not None and storage.elements is not None
        first_element = [p for p, e in zip(storage.parts, storage.elements) if e == 0]
        spread: set[str] = set()
        for template, part in zip(rule.parts, first_element):
            found = compile_pattern(template).fullmatch(part)
            if found is None or rule.stack not in found.groupdict():
                continue  # a part without the capture (refused elsewhere, as in every element)
            where = found.span(rule.stack)
            index = self.index[part]
            chosen = self.rule_of[index]
            matched = compile_pattern(chosen.pattern).fullmatch(part) if chosen.pattern else None
            if matched is None:
                continue  # the default rule captures nothing, so no coordinate of it reads the stack
            # the rule's own name for the digits the stack captures: the group at the same place
            names = {n for n in matched.groupdict() if matched.span(n) == where}
            for axis, coordinate in chosen.submesh:
                if isinstance(coordinate, CaptureExpression) and coordinate.reads & names:
                    spread.add(axis)
        if not spread:
            return {}
        mesh = self.layout.mesh
        placed = dict(self.submesh_of[self.index[first_element[0]]])
        fixed = {axis: value for axis, value in placed.items() if axis not in spread}
        others = [other for other in self.storage_index[storage.name] if other != sid]
        out = {}
        for rank in mesh.ranks:
            if self.core.storage_shape(sid, rank) is not None:
                continue
            coords = mesh.coords(rank)
            if any(coords[axis] != value for axis, value in fixed.items()):
                continue
            if any(self.core.storage_shape(other, rank) is not None for other in others):
                continue  # a storage of that name on disjoint ranks holds this one
            # the same rank with the first element's coordinates on the spread axes holds it
            holder = mesh.rank_at({**coords, **{axis: placed[axis] for axis in spread}})
            shape = self.core.storage_shape(sid, holder)
            if shape is not None:
                out[rank] = (0, *shape[1:])
        return out

    def shape(self, sid: int, rank: int) -> tuple[int, ...] | None:
        """The shape storage ``sid``'s parts make on ``rank`` (an empty stack included), None
        when the rank holds no such storage."""
        shape = self.core.storage_shape(sid, rank)
        if shape is not None:
            return tuple(shape)
        empty = self.empty_stacks().get(sid)
        return empty.get(rank) if empty else None

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
            (
                s.dim,
                [self.index[p] for p in s.parts],
                list(s.blocks or ()),
                list(s.shape or ()),
                list(s.elements or ()),
                [int(t) for t in s.transposed] if any(s.transposed) else [],
            )
            for s in self.storages
        ]
        specs = [[(pad, list(splits)) for pad, splits in spec] for spec in self.specs]
        # kept for layouts of the same rules on other ranks (_reuse): they differ only in the mesh
        self._core_arguments = (specs, tensors, storages)
        with core_errors(self.names):
            return _core.LayoutCore(list(mesh.shape), list(mesh.ranks), specs, tensors, storages)


def _resolution_carries(layout: Layout, mesh: Mesh) -> bool:
    """Whether ``layout``'s resolution holds on ``mesh`` as it is: the same axes in the same
    order, and every axis whose size differs named by no rule (no placement, sub-mesh
    coordinate or order reads it), so every rule, spec, sub-mesh index and storage is the
    same; only the ranks differ (``fill-spares``, ``drop-replica``)."""
    old = layout.mesh
    if old.axis_names != mesh.axis_names:
        return False
    resized = {a for (a, before), (_, after) in zip(old.axes, mesh.axes) if before != after}
    if not resized:
        return True
    for rule in layout.rules:
        named = set(dict(rule.placements)) | set(dict(rule.submesh))
        for order in dict(rule.order).values():
            named.update(order)
        if named & resized:
            return False
    return True


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
    rules: tuple[Rule, ...] = attrs.field(converter=_rules)
    storages: tuple[StorageRule, ...] = attrs.field(default=(), converter=_storage_rules)
    span: Span | None = attrs.field(default=None, repr=False)
    #: the ``quantize`` statements: tensors stored quantized, with their scales (:meth:`quantized`)
    quantize: tuple[QuantizeRule, ...] = attrs.field(default=(), converter=_quantize_rules, repr=False)
    _resolved: list[_Resolved] = attrs.field(factory=list, init=False, repr=False)
    # the quantized tensors and the ranks holding each, once resolved
    _quantized: list[tuple[dict[str, Quantization], dict[str, frozenset[int]]]] = attrs.field(
        factory=list, init=False, repr=False
    )

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, mesh={self.mesh.name!r}, rules={len(self.rules)}, tensors={len(self.tensors)})"

    def on_mesh(self, mesh: Mesh, name: str | None = None) -> Layout:
        """This layout's tensors, rules and storages on ``mesh`` (named ``name``, else this
        layout's name). Where the rules read the same axes at the same sizes (a spare in a
        lost rank's place, a dropped replica) the new layout takes this one's resolution and
        compiles only its ranks anew; otherwise it is resolved afresh when first used."""
        new = attrs.evolve(self, name=self.name if name is None else name, mesh=mesh)
        if self._resolved and _resolution_carries(self, mesh):
            new._resolved.append(_Resolved(new, like=self._resolved[0]))
        return new

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
        storage = self.resolved.storages[self.resolved.storage_of[index]]
        transposed = storage.is_transposed(tensor)
        return [
            Box(
                tensor, tuple(b.offsets), tuple(b.sizes), storage.name, tuple(b.storage_offsets),
                tuple(b.storage_sizes), transposed,
            )
            for b in self.core.boxes(index, rank)
        ]

    def storages_on(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Every storage ``rank`` holds, with its local shape: the engine's own, N-D
        (``[local experts, 2 * I / tp, H]`` for a stacked ``w13_weight``; its ``as [...]``
        view when it declares one). A stack none of whose elements lands on the rank, on an
        axis its elements spread over, is held empty: ``[0, 2 * I / tp, H]``."""
        out = {}
        resolved = self.resolved
        empty = resolved.empty_stacks()
        for sid, storage in enumerate(resolved.storages):
            shape = self.core.storage_shape(sid, rank)
            if shape is not None:
                out[storage.name] = storage.view if storage.view is not None else tuple(shape)
            elif sid in empty and rank in empty[sid]:
                out[storage.name] = empty[sid][rank]
        return out

    def parts_shape(self, name: str, rank: int) -> tuple[int, ...] | None:
        """The shape the parts of storage ``name`` make on ``rank``, which boxes' storage
        offsets index; it differs from :meth:`storage_shape` only for a storage viewed
        ``as [...]`` another shape. None when the rank holds no such storage."""
        for sid in self._storage_indices(name):
            shape = self.resolved.shape(sid, rank)
            if shape is not None:
                return shape
        return None

    def storage(self, name: str, rank: int) -> Storage:
        """The storage of that name on ``rank`` (names may repeat on disjoint ranks)."""
        for sid in self._storage_indices(name):
            if self.resolved.shape(sid, rank) is not None:
                return self.resolved.storages[sid]
        raise LayoutValueError(f"rank {rank} holds no storage '{name}' in layout '{self.name}'")

    def storage_shape(self, name: str, rank: int) -> tuple[int, ...] | None:
        """The local shape of storage ``name`` on ``rank`` as the engine holds it (None: not held)."""
        for sid in self._storage_indices(name):
            shape = self.resolved.shape(sid, rank)
            if shape is not None:
                view = self.resolved.storages[sid].view
                return view if view is not None else shape
        return None

    def summary(self) -> list[dict[str, int]]:
        """Per rank: tensors, boxes, elements and bytes held (computed from every box)."""
        return [
            {"rank": r.rank, "tensors": r.tensors, "boxes": r.boxes, "elements": r.elements, "bytes": r.bytes}
            for r in self.core.summarize()
        ]

    def check(self) -> None:
        """Resolves every tensor and validates every storage on every rank; raises LayoutError."""
        resolved = self.resolved
        problems = self.core.validate(1)
        if problems:
            problem = problems[0]
            storage = resolved.storages[problem.storage]
            hint = None
            if problem.kind == "storage-blocks" and "not a multiple of its block size" in problem.message:
                # a fused storage cut in blocks (heads, query groups): the axis that shards it
                # splits a block between ranks
                hint = (
                    "the ranks that shard this storage split one of its blocks (a head or a query group): use "
                    "fewer ranks on that axis, so that it divides the parts' number of blocks (e.g. tp dividing "
                    "the number of key-value heads)"
                )
            raise LayoutValueError(
                f"storage '{storage.name}' of layout '{self.name}' on rank {problem.rank}: {problem.message}",
                storage.span,
                hint,
            )
        self._check_views()
        self._check_empty_stacks()
        self.quantized()  # resolves and checks the quantize statements, if any
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

    def _check_views(self) -> None:
        """A storage viewed ``as [...]`` has, on every rank holding it, as many elements as its parts."""
        for sid, storage in enumerate(self.resolved.storages):
            if storage.view is None:
                continue
            for rank in self.mesh.ranks:
                shape = self.resolved.shape(sid, rank)
                if shape is not None and math.prod(shape) != math.prod(storage.view):
                    raise LayoutValueError(
                        f"storage '{storage.name}' of layout '{self.name}' on rank {rank}: its parts make "
                        f"{list(shape)} ({math.prod(shape)} elements){self._no_element(sid, rank)}, which "
                        f"cannot be viewed as {list(storage.view)} ({math.prod(storage.view)} elements)",
                        storage.span,
                    )

    def _no_element(self, sid: int, rank: int) -> str:
        """Why a stack is empty on ``rank``, for an error message ("" when it is not)."""
        if rank not in self.resolved.empty_stacks().get(sid, {}):
            return ""
        return ": the rank holds no element of the stack, whose elements all land on other ranks"

    def _check_empty_stacks(self) -> None:
        """A stack held empty on a rank still has the shape its statement declares, if any."""
        for sid, empty in self.resolved.empty_stacks().items():
            storage = self.resolved.storages[sid]
            for rank, shape in empty.items():
                if storage.shape is not None and tuple(storage.shape) != shape:
                    raise LayoutValueError(
                        f"storage '{storage.name}' of layout '{self.name}' on rank {rank} is {list(shape)}"
                        f"{self._no_element(sid, rank)}; it is declared {list(storage.shape)}",
                        storage.span,
                        "declare no shape, or place the elements so that every rank holds as many",
                    )

    # -- quantized tensors (issue 16: FP8 and MXFP8 destinations)

    def quantized(self) -> dict[str, Quantization]:
        """Every tensor this layout stores quantized, by name, with its format, blocks and scale
        tensor (empty without ``quantize`` statements).

        Resolving checks every rank: where the scales are placed like the weight, each box of a
        quantized tensor starts and ends on block boundaries (the dim's end counts as one), so
        that every block lies whole on each rank holding it and its scale is that rank's alone
        (replicated scales may belong to blocks that span ranks: per-tensor FP8 beside a TP
        shard); the parts fused in one storage are
        quantized alike and lie on block boundaries in it; a scale storage declared with a
        shape has that shape on every rank. A mistake is a :class:`~layoutlang.errors.LayoutValueError`
        naming the tensor and the rank, pointing at the ``quantize`` statement, raised before
        any plan is made (the planner resolves this first).
        """
        if not self._quantized:
            found = self._resolve_quantized()
            holders = self._quantized_holders(found)
            self._check_quantized(found, holders)
            self._quantized.append((found, holders))
        return self._quantized[0][0]

    def quantization(self, tensor: str) -> Quantization | None:
        """How ``tensor`` is stored quantized, or None when it is stored as its dtype."""
        self._tensor_index(tensor)
        return self.quantized().get(tensor)

    def scale_tensors(self) -> dict[str, LogicalTensor]:
        """The scale tensors the quantized tensors derive, by name (``..._scale_inv``)."""
        return {q.scale.name: q.scale for q in self.quantized().values()}

    def scale_boxes(self, tensor: str, rank: int) -> list[Box]:
        """The boxes of the scale tensor of ``tensor`` (the quantized weight) that ``rank`` holds,
        each with its place in the rank's scale storage: the scales of the rank's own blocks
        (placed like the weight), or the whole scale tensor (replicated) on every rank
        holding some of the weight."""
        q = self.quantization(tensor)
        if q is None:
            raise LayoutValueError(f"tensor '{tensor}' is not quantized in layout '{self.name}'", tensor=tensor)
        boxes = self.boxes(tensor, rank)
        if q.replicated:
            if rank not in self._quantized[0][1][tensor]:
                return []
            storage = q.scale_storage_of(tensor)
            zero = (0,) * len(q.scale.shape)
            return [Box(q.scale.name, zero, q.scale.shape, storage, zero)]
        return [scale_box(b, q.block, q.scale.name, q.scale_storage_of(b.storage)) for b in boxes]

    def scale_storages_on(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Every scale storage ``rank`` holds, with its local shape: the weight storage's shape
        with ``ceil(size / block)`` along the tensor's dims (placed like the weight), or the
        scale tensor's shape (replicated)."""
        out: dict[str, tuple[int, ...]] = {}
        found = self.quantized()
        for name, (shape, _) in self._scale_storages(rank, found, self._quantized[0][1]).items():
            out[name] = shape
        return out

    def _scale_storages(
        self, rank: int, found: Mapping[str, Quantization], holders: Mapping[str, frozenset[int]]
    ) -> dict[str, tuple[tuple[int, ...], Quantization]]:
        out: dict[str, tuple[tuple[int, ...], Quantization]] = {}
        resolved = self.resolved
        parts_of: dict[int, tuple[int, ...] | None] = {}  # a stack's shape, once for all its elements
        for tensor, q in found.items():
            if rank not in holders[tensor]:
                continue
            if q.replicated:
                name, shape = q.scale_storage_of(tensor), q.scale.shape
            else:
                sid = resolved.storage_of[resolved.index[tensor]]
                storage = resolved.storages[sid]
                if sid not in parts_of:
                    parts_of[sid] = resolved.shape(sid, rank)
                parts = parts_of[sid]
                if parts is None:
                    continue
                lead = len(parts) - len(q.block)
                name = q.scale_storage_of(storage.name)
                shape = (*parts[:lead], *scale_shape(parts[lead:], q.block))
            if name in out and (out[name][0] != shape or q.replicated):
                other = out[name][1]
                raise LayoutValueError(
                    f"rank {rank} would hold two scale storages named '{name}' in layout '{self.name}' "
                    f"(of tensors '{other.tensor}' and '{tensor}')",
                    q.rule.span,
                    tensor=tensor,
                    rank=rank,
                )
            out[name] = (shape, q)
        return out

    def _resolve_quantized(self) -> dict[str, Quantization]:
        if not self.quantize:
            return {}
        ordered = sorted(self.quantize, key=lambda r: -r.specificity)
        compiled = [_compiled_quantize(rule) for rule in ordered]
        out: dict[str, Quantization] = {}
        # each statement is tried on the names it could match (not every statement on every
        # name): the statements matching a name, most specific first
        candidates = NameIndex(list(self.tensors))
        matching: dict[str, list[tuple[QuantizeRule, dict[str, int]]]] = {}
        for rule, regex in compiled:
            if regex is None:
                assert rule.tensors is not None
                for name in rule.tensors:
                    if name in self.tensors:
                        matching.setdefault(name, []).append((rule, {}))
                continue
            for name in candidates.could_match(rule.pattern, regex):
                match = regex.fullmatch(name)
                if match is not None:
                    matching.setdefault(name, []).append((rule, captured_values(match, name, rule.span)))
        for name, tensor in self.tensors.items():
            found = matching.get(name)
            if not found:
                continue
            if len(found) > 1 and found[1][0].specificity == found[0][0].specificity:
                raise LayoutValueError(
                    f"tensor '{name}' is matched by two quantize statements of equal specificity in layout "
                    f"'{self.name}': \"{found[0][0].pattern}\" and \"{found[1][0].pattern}\"",
                    found[1][0].span,
                    "make one pattern more specific (more literal characters wins)",
                    tensor=name,
                )
            rule, captures = found[0]
            if tensor.dtype not in QUANTIZABLE:
                raise LayoutValueError(
                    f"tensor '{name}' is {tensor.dtype}; quantize \"{rule.pattern}\" reads "
                    f"{', '.join(QUANTIZABLE)} tensors",
                    rule.span,
                    "import the model in the dtype training holds it in, e.g. tensors from hf \"...\" as cfg dtype bf16"
                    if rule.tensors is not None
                    else None,
                    tensor=name,
                )
            block = rule.block_for(tensor)
            scale = LogicalTensor(f"{name}_{rule.convention}", scale_shape(tensor.shape, block), rule.scale_dtype)
            if scale.name in self.tensors:
                raise LayoutValueError(
                    f"the scale tensor of '{name}' would be named '{scale.name}', a tensor the program declares",
                    rule.span,
                    "leave the scales out of the model's tensors: the quantize statement derives them",
                    tensor=name,
                )
            out[name] = Quantization(
                name, tensor.shape, rule.format, block, rule.convention, scale, rule.replicated, rule,
                rule.storage_name(captures),
            )
        return out

    def _check_quantized(self, found: dict[str, Quantization], holders: Mapping[str, frozenset[int]]) -> None:
        if not found:
            return
        resolved = self.resolved
        # The elements of a stack (256 experts in one w13_weight) have the same boxes on the same
        # ranks when they have the same placement, shape and sub-mesh and the same parts before
        # them in their element: their blocks are checked once.
        stacked: dict[str, tuple] = {}
        for sid, storage in enumerate(resolved.storages):
            if storage.elements is None or not any(p in found for p in storage.parts):
                continue
            before: dict[int, tuple] = {}
            for part, element in zip(storage.parts, storage.elements):
                index = resolved.index[part]
                stacked[part] = (sid, before.get(element, ()))
                before[element] = (*before.get(element, ()), (resolved.spec_of[index], self.tensors[part].shape))
        aligned: set[tuple] = set()
        for tensor, q in found.items():
            storage = self.storage_of(tensor)
            if storage.is_transposed(tensor):
                raise LayoutValueError(
                    f"tensor '{tensor}' is quantized and stored transposed in '{storage.name}' of layout "
                    f"'{self.name}': quantized storages hold the tensor's own orientation",
                    q.rule.span,
                    tensor=tensor,
                )
            if q.replicated:
                # every holder keeps every scale (vLLM's per-tensor scale beside a TP shard): a
                # block may span ranks, and is quantized where it can be assembled whole
                continue
            key = self._alignment_key(tensor, q, stacked)
            if key in aligned:
                continue
            for rank in sorted(holders[tensor]):
                for box in self.boxes(tensor, rank):
                    self._check_blocks(q, box, rank)
            aligned.add(key)
        # the parts of one storage are quantized alike, or none is
        for storage in resolved.storages:
            quantized = [found.get(p) for p in storage.parts]
            first = next((q for q in quantized if q is not None), None)
            if first is None:
                continue
            alike = (first.format, first.block, first.convention, first.replicated)
            for part, other in zip(storage.parts, quantized):
                if other is None or (other.format, other.block, other.convention, other.replicated) != alike:
                    raise LayoutValueError(
                        f"storage '{storage.name}' of layout '{self.name}' fuses '{first.tensor}' and '{part}', "
                        "which are not quantized alike (format, block, convention and placement of the scales)",
                        (other or first).rule.span,
                        tensor=part,
                    )
        # declared scale storage shapes, and scale storages named alike on one rank
        if not any(rule.storage is not None or rule.storage_shape is not None for rule in self.quantize):
            return  # the derived names follow the weights' storages, which are checked already
        for rank in self.mesh.ranks:
            for name, (shape, q) in self._scale_storages(rank, found, holders).items():
                declared = q.rule.storage_shape
                if declared is not None and tuple(declared) != shape:
                    raise LayoutValueError(
                        f"scale storage '{name}' of tensor '{q.tensor}' in layout '{self.name}' on rank {rank}: "
                        f"the blocks make it {list(shape)} ({' x '.join(map(str, q.block))} blocks), "
                        f"it is declared {list(declared)}",
                        q.rule.span,
                        tensor=q.tensor,
                        rank=rank,
                    )

    def _alignment_key(self, tensor: str, q: Quantization, stacked: Mapping[str, tuple]) -> tuple:
        """What decides a tensor's boxes on every rank and their places in its storage: tensors
        with one key pass or fail the block check alike, so it runs once per key (DeepSeek-V3's
        44,544 unstacked experts on 256 ranks are a few dozen keys, not 11 million boxes). The
        first tensor of a key is checked whole, so a mistake names the same tensor and rank."""
        resolved = self.resolved
        index = resolved.index[tensor]
        if tensor in stacked:
            sid, before = stacked[tensor]
            return (sid, before, resolved.spec_of[index], q.shape, q.block, resolved.submesh_of[index])
        # not stacked: the storage's fusion (dim, interleaving blocks) and every part's
        # placement, shape and sub-mesh decide where the tensor's boxes sit in it
        storage = resolved.storages[resolved.storage_of[index]]
        parts = tuple(
            (resolved.spec_of[i], self.tensors[p].shape, resolved.submesh_of[i])
            for p, i in ((p, resolved.index[p]) for p in storage.parts)
        )
        return (None, storage.dim, storage.blocks, parts, storage.parts.index(tensor), q.block)

    def _quantized_holders(self, found: Mapping[str, Quantization]) -> dict[str, frozenset[int]]:
        """The holders of every quantized tensor, asked of the core once per placement, shape and
        sub-mesh (they decide them)."""
        resolved = self.resolved
        cache: dict[tuple, frozenset[int]] = {}
        out: dict[str, frozenset[int]] = {}
        for tensor in found:
            index = resolved.index[tensor]
            key = (resolved.spec_of[index], self.tensors[tensor].shape, resolved.submesh_of[index])
            if key not in cache:
                cache[key] = frozenset(self.holders(tensor))
            out[tensor] = cache[key]
        return out

    def _check_blocks(self, q: Quantization, box: Box, rank: int) -> None:
        """A rank's box of a quantized tensor holds whole blocks, at block boundaries of its storage."""
        lead = len(box.storage_offsets) - len(box.sizes)
        block = " x ".join(map(str, q.block))
        for d, (offset, size, length, b) in enumerate(zip(box.offsets, box.sizes, q.shape, q.block)):
            cut = block_cut(offset, size, length, b)
            if cut is not None:
                raise LayoutValueError(
                    f"tensor '{q.tensor}' in layout '{self.name}': rank {rank} holds {box.slices()[d].start}:"
                    f"{box.slices()[d].stop} of dim {d}, which cuts its {block} blocks at {cut} (blocks start at "
                    f"multiples of {b}); no rank holds that block whole to compute its scale",
                    q.rule.span,
                    f"shard dim {d} into pieces that are multiples of {b}, or quantize with a block that divides them",
                    tensor=q.tensor,
                    rank=rank,
                )
            if size and box.storage_offsets[lead + d] % b:
                raise LayoutValueError(
                    f"tensor '{q.tensor}' in layout '{self.name}': on rank {rank} its box starts at "
                    f"{box.storage_offsets[lead + d]} of dim {d} of storage '{box.storage}', not on a "
                    f"{block} block boundary, so its scales have no place of their own in the scale storage",
                    q.rule.span,
                    "fuse parts whose sizes along the fused dim are multiples of the block",
                    tensor=q.tensor,
                    rank=rank,
                )
