"""The ``layout`` and ``reshard`` statements, once every tensor is known.

A layout's rules become :class:`~layoutlang.model.Rule` objects (placements per axis,
sub-mesh coordinates as functions of a pattern's captures, explicit nesting orders), its
storages :class:`~layoutlang.model.StorageRule` objects. Matching rules to tensors is the
model's, and happens lazily (:meth:`~layoutlang.model.Program.check` does all of it);
what can be checked from the text alone is checked here, pointing at the text.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Collection, Mapping

import attrs

from ..errors import LayoutError, LayoutNameError, LayoutValueError, Span, did_you_mean
from ..model import Layout, LogicalTensor, Mesh, Replicate, Reshard, Rule, Shard, StorageRule
from ..model.dtypes import DTYPES, canonical_dtype
from ..model.layout import CaptureExpression
from ..model.quantization import BLOCKINGS, CONVENTIONS, FORMATS, QuantizeRule
from ..model.rules import CaptureFn, compile_pattern
from . import ast
from .expressions import compile_expression, evaluate, names_in
from .includes import is_preset, preset_declaring
from .limits import INT32_MAX, INT64_MAX
from .patterns import name_template, pattern_captures
from .scope import Scope

__all__ = ["SHARD_OPTIONS", "TensorNames", "extended", "layout", "reshard"]

#: the options of ``shard(dim, ...)``
SHARD_OPTIONS = ("blocks", "chunks", "pad")

FORMAT_NAMES = tuple(FORMATS)
CONVENTION_NAMES = CONVENTIONS


class TensorNames:
    """A program's tensor names, grouped by skeleton (the text between their digit runs).

    A pattern without a literal digit matches either every name of a skeleton or none
    (a capture takes a whole digit run, ``*`` any text), which is also what rule matching
    in :class:`~layoutlang.model.Layout` relies on; so whether a pattern matches some
    tensor is asked of one name per skeleton, not of tens of thousands of expert tensors.
    """

    _DIGITS = re.compile(r"[0-9]+")

    _PLACEHOLDERS = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}|\*")

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.by_skeleton: dict[tuple[str, ...], str] = {}
        for name in names:
            self.by_skeleton.setdefault(tuple(self._DIGITS.split(name)), name)
        self._sorted: list[str] | None = None  # for patterns with a literal digit, made on first use

    def matches_some(self, pattern: str) -> bool:
        regex = compile_pattern(pattern)
        literal = re.sub(r"\{[^}]*\}", "", pattern)
        if not re.search(r"[0-9]", literal):
            return any(regex.fullmatch(name) for name in self.by_skeleton.values())
        # A literal digit tells names of one skeleton apart, so names are searched, but only
        # those starting with the pattern's text before its first placeholder (an exact name:
        # itself), found by bisection: a program of many such rules is checked in time
        # linear in its size, not rules x tensors (only a pattern starting with '*' scans all).
        if self._sorted is None:
            self._sorted = sorted(self.names)
        first = self._PLACEHOLDERS.search(pattern)
        prefix = pattern[: first.start()] if first is not None else pattern
        # by position: islice() would step through every name before the prefix
        for position in range(bisect.bisect_left(self._sorted, prefix), len(self._sorted)):
            name = self._sorted[position]
            if not name.startswith(prefix):
                return False
            if regex.fullmatch(name):
                return True
        return False

    def closest(self, pattern: str, captures: list[str]) -> str | None:
        """A did-you-mean: the names written as patterns with the pattern's own captures."""
        shapes = {self._as_pattern(name, captures) for name in self.by_skeleton.values()}
        hint = did_you_mean(pattern, shapes)
        return hint.replace("did you mean '", 'did you mean "').replace("'?", '"?') if hint else None

    @classmethod
    def _as_pattern(cls, name: str, captures: list[str]) -> str:
        """``layers.3.experts.7.w1`` as ``layers.{l}.experts.{e}.w1`` for captures l and e."""
        runs = iter(captures)
        return cls._DIGITS.sub(lambda m: f"{{{next(runs, m.group(0))}}}", name)


def _check_matches(node: ast.LayoutDecl, rules: list[Rule], names: TensorNames) -> None:
    """Every pattern of a layout matches some tensor of the program.

    A misspelled pattern would otherwise send its tensors to ``default`` without a word.
    Rules written in the packaged presets, or in a ``generic layout``, are generic (written
    once for every size of a model family, included into programs that may lack some
    tensors), so they are not checked, also when another layout extends theirs.
    """
    for decl, rule in zip(node.rules, rules):
        if decl.pattern is not None and not decl.generic:
            _require_match(decl.pattern, decl.pattern_span, list(rule.captures), names, f"layout '{node.name}'")


def _require_match(pattern: str, span: Span, captures: list[str], names: TensorNames, owner: str) -> None:
    """A pattern of ``owner`` (a layout's rule, a reshard's policy) that matches no tensor is an
    error with a did-you-mean, unless a packaged preset wrote it (presets are generic)."""
    if is_preset(span.path) or names.matches_some(pattern):
        return
    raise LayoutNameError(
        f'pattern "{pattern}" of {owner} matches no tensor of the program', span, names.closest(pattern, captures)
    )


def extended(layouts: Mapping[str, ast.LayoutDecl], name: str, chain: tuple[str, ...] = ()) -> ast.LayoutDecl:
    """Layout ``name`` with what it extends merged in: ``layout b on m extends a { ... }``.

    ``b`` has the rules and storages of ``a`` (itself merged with what it extends), except
    that a rule of ``b`` replaces the rule of ``a`` with exactly the same pattern (``default``
    replaces ``default``), and a storage of ``b`` replaces every storage of ``a`` with the same
    name or a part of the same name; the rest of ``b`` is added. Rules then compete as in any
    layout: the most specific pattern wins. ``b``'s mesh is its own.
    """
    node = layouts[name]
    if node.parent is None:
        return node
    span = node.parent_span or node.span
    if node.parent not in layouts:
        needed = preset_declaring(node.parent, span.path)
        raise LayoutNameError(
            f"layout '{name}' extends an unknown layout '{node.parent}' (layouts: {', '.join(layouts)})",
            span,
            f'include "preset:{needed}" before this preset (it declares \'{node.parent}\')' if needed
            else did_you_mean(node.parent, [n for n in layouts if n != name]),
        )
    if node.parent == name or node.parent in chain:
        cycle = " -> ".join([*chain, name, node.parent][[*chain, name].index(node.parent) :])
        raise LayoutNameError(f"layouts extend each other in a cycle: {cycle}", span)
    parent = extended(layouts, node.parent, (*chain, name))
    own = {r.pattern for r in node.rules}
    rules = [r for r in parent.rules if r.pattern not in own] + list(node.rules)
    names = {s.name for s in node.storages}
    parts = {p for s in node.storages for p, _ in s.parts}
    storages = [s for s in parent.storages if s.name not in names and not parts & {p for p, _ in s.parts}]
    # a quantize statement of b replaces the one of a with exactly the same pattern
    quantized = {q.pattern for q in node.quantize}
    quantize = [q for q in parent.quantize if q.pattern not in quantized] + list(node.quantize)
    return attrs.evolve(node, rules=tuple(rules), storages=(*storages, *node.storages), quantize=tuple(quantize))


def layout(
    scope: Scope, node: ast.LayoutDecl, tensors: Mapping[str, LogicalTensor], names: TensorNames | None = None
) -> Layout:
    """The layout a statement declares, over ``tensors`` (``names``: their names, grouped once
    for every layout of the program)."""
    if node.mesh not in scope.meshes:
        raise LayoutNameError(
            f"unknown mesh '{node.mesh}' in layout '{node.name}' (meshes: {', '.join(scope.meshes) or 'none'})",
            node.mesh_span,
            did_you_mean(node.mesh, scope.meshes),
        )
    mesh = scope.meshes[node.mesh]
    rules = []
    patterns: dict[str | None, Span] = {}
    for decl in node.rules:
        if decl.pattern in patterns:
            what = "a second default rule" if decl.pattern is None else f'pattern "{decl.pattern}" appears twice'
            raise LayoutNameError(
                f"{what} in layout '{node.name}' (first at {patterns[decl.pattern]})", decl.pattern_span
            )
        patterns[decl.pattern] = decl.pattern_span
        rules.append(_rule(scope, decl, mesh, node.name))
    _check_matches(node, rules, names or TensorNames(list(tensors)))
    storages = [_storage(scope, decl) for decl in node.storages]
    quantize = _quantize_rules(scope, node, names or TensorNames(list(tensors)))
    return Layout(node.name, mesh, tensors, rules, storages, node.span, quantize=quantize)


def _quantize_rules(scope: Scope, node: ast.LayoutDecl, names: TensorNames) -> list[QuantizeRule]:
    """The layout's ``quantize`` statements, each pattern once and matching some tensor."""
    out = []
    seen: dict[str, Span] = {}
    for decl in node.quantize:
        if isinstance(decl, ast.QuantizeFrom):
            if decl.pattern in seen:
                raise LayoutNameError(
                    f"'quantize from {decl.alias}' appears twice in layout '{node.name}' "
                    f"(first at {seen[decl.pattern]})",
                    decl.span,
                )
            seen[decl.pattern] = decl.span
            out.append(_quantize_from(scope, decl))
            continue
        if decl.pattern in seen:
            raise LayoutNameError(
                f"pattern \"{decl.pattern}\" is quantized twice in layout '{node.name}' "
                f"(first at {seen[decl.pattern]})",
                decl.pattern_span,
            )
        seen[decl.pattern] = decl.pattern_span
        captures = pattern_captures(decl.pattern, decl.pattern_span)
        if not node.generic:
            _require_match(decl.pattern, decl.pattern_span, captures, names, f"quantize in layout '{node.name}'")
        try:
            out.append(_quantize(scope, decl, captures))
        except LayoutValueError as err:
            # a mistake of the statement is one of every tensor it matches: name the first
            matched = _first_matches(decl.pattern, names)
            if err.tensor is None and matched:
                err.tensor = matched[0]
                more = ", ..." if len(matched) > 1 else ""
                err.message = f"{err.message} (the statement quantizes '{matched[0]}'{more})"
                err.args = (err.message,)
            raise
    return out


def _first_matches(pattern: str, names: TensorNames, count: int = 2) -> list[str]:
    """Up to ``count`` tensor names the pattern matches, in the program's order."""
    regex = compile_pattern(pattern)
    found: list[str] = []
    for name in names.names:
        if regex.fullmatch(name):
            found.append(name)
            if len(found) == count:
                break
    return found


def _quantize_from(scope: Scope, decl: ast.QuantizeFrom) -> QuantizeRule:
    """``quantize from cfg``: the weights the checkpoint of config ``cfg`` stores in FP8, in its
    format and blocks, with fp32 ``weight_scale_inv`` scales, as DeepSeek-V3's checkpoints."""
    if decl.alias not in scope.fp8_schemes:
        known = list(scope.fp8_schemes)
        raise LayoutNameError(
            f"'{decl.alias}' names no Hugging Face config (imported with tensors from hf \"...\" as "
            f"{decl.alias}); configs: {', '.join(known) or 'none'}",
            decl.alias_span,
            did_you_mean(decl.alias, known),
        )
    scheme = scope.fp8_schemes[decl.alias]
    if scheme is None:
        raise LayoutValueError(
            f"the config imported as '{decl.alias}' has no quantization_config, so it quantizes nothing",
            decl.alias_span,
            "write the scheme out: quantize \"PATTERN\" as fp8_e4m3 blocks 128 x 128 scale_inv fp32",
        )
    return QuantizeRule(
        f"from {decl.alias}",
        scheme.format,
        scheme.block,
        "scale_inv",
        "fp32",
        decl.replicated,
        span=decl.span,
        tensors=frozenset(scheme.weights),
    )


def _quantize(scope: Scope, decl: ast.QuantizeDecl, captures: list[str]) -> QuantizeRule:
    if isinstance(decl.block, str):
        if decl.block not in BLOCKINGS:
            raise LayoutNameError(
                f"unknown block shape '{decl.block}' (write blocks A x B, or {' or '.join(BLOCKINGS)})",
                decl.block_span,
                did_you_mean(decl.block, BLOCKINGS),
            )
        block: tuple[int, ...] | str = decl.block
    else:
        block = tuple(evaluate(e, scope.constants) for e in decl.block)
        if any(b < 1 or b > INT32_MAX for b in block):
            raise LayoutValueError(
                f"quantize \"{decl.pattern}\": block sizes must be between 1 and {INT32_MAX}, not "
                f"{' x '.join(map(str, block))}",
                decl.block_span,
            )
    storage_fn = None
    if decl.storage is not None:
        assert decl.storage_span is not None  # the parser gives every storage name its place
        storage_fn = name_template(decl.storage, decl.storage_span, scope.constants, captures)
    shape = None
    if decl.storage_shape is not None:
        shape = tuple(evaluate(e, scope.constants) for e in decl.storage_shape)
        if any(n < 0 or n > INT64_MAX for n in shape):
            raise LayoutValueError(
                f"scale storage '{decl.storage}' is declared with an impossible shape {list(shape)}",
                decl.storage_span,
            )
    # the words are checked here, each pointing at itself, before the rule checks them together
    for word, span, known, what in (
        (decl.format, decl.format_span, FORMAT_NAMES, "format"),
        (decl.convention, decl.convention_span, CONVENTION_NAMES, "scale convention"),
    ):
        if word not in known:
            raise LayoutValueError(
                f"quantize \"{decl.pattern}\": unsupported {what} '{word}' ({what}s: {', '.join(known)})",
                span,
                did_you_mean(word, known),
            )
    dtype = canonical_dtype(decl.scale_dtype)
    if dtype is None:
        raise LayoutValueError(
            f"quantize \"{decl.pattern}\": unknown scale dtype '{decl.scale_dtype}'",
            decl.scale_dtype_span,
            did_you_mean(decl.scale_dtype, DTYPES),
        )
    try:
        return QuantizeRule(
            decl.pattern, decl.format, block, decl.convention, dtype, decl.replicated, decl.storage, shape,
            storage_fn, decl.span,
        )
    except LayoutError as err:
        raise err.with_span(decl.span) from None


class _Axes:
    """The axes one rule has placed so far: each once, and each an axis of the mesh."""

    def __init__(self, mesh: Mesh, layout: str) -> None:
        self._mesh = mesh
        self._layout = layout
        self.spans: dict[str, Span] = {}

    def claim(self, axis: str, span: Span) -> None:
        try:
            self._mesh.axis_index(axis)
        except LayoutError as err:
            err.with_span(span)
            raise
        if axis in self.spans:
            raise LayoutValueError(
                f"axis '{axis}' is placed twice in one rule of layout '{self._layout}' "
                f"(first at column {self.spans[axis].column})",
                span,
            )
        self.spans[axis] = span


def _rule(scope: Scope, decl: ast.RuleDecl, mesh: Mesh, layout: str) -> Rule:
    captures = pattern_captures(decl.pattern, decl.pattern_span) if decl.pattern else []
    placements: dict[str, Shard | Replicate] = {}
    submesh: dict[str, CaptureFn] = {}
    order: dict[int, tuple[str, ...]] = {}
    axes = _Axes(mesh, layout)
    for entry in decl.entries:
        if isinstance(entry, ast.SelectEntry):
            axes.claim(entry.axis, entry.axis_span or entry.span)
            # the captures it reads tell a stacked storage which axes its elements spread over
            reads = frozenset(n.name for n in names_in(entry.index) if n.name in captures)
            submesh[entry.axis] = CaptureExpression(compile_expression(entry.index, scope.constants, captures), reads)
            continue
        for i, axis in enumerate(entry.axes):
            axes.claim(axis, entry.axis_spans[i] if i < len(entry.axis_spans) else entry.span)
        if isinstance(entry.placement, ast.ReplicateExpr):
            if entry.ordered:
                raise LayoutValueError("an explicit order of axes applies to shard(...), not replicate", entry.span)
            placements[entry.axes[0]] = Replicate()
            continue
        shard = _shard(scope, entry.placement, ordered=entry.ordered)
        for axis in entry.axes:
            placements[axis] = shard
        if entry.ordered:
            if shard.dim in order:
                raise LayoutValueError(f"dim {shard.dim} is given two explicit orders", entry.span)
            order[shard.dim] = entry.axes
    # Axes sharding a dim that also has an explicit order must be in that order.
    for axis, p in placements.items():
        if isinstance(p, Shard) and p.dim in order and axis not in order[p.dim]:
            raise LayoutValueError(
                f"axis '{axis}' shards dim {p.dim}, which has the explicit order ({', '.join(order[p.dim])}); "
                "list every axis of that dim in the order",
                axes.spans[axis],
            )
    return Rule(decl.pattern, placements, submesh, order, decl.span)


def _shard(scope: Scope, node: ast.ShardExpr, ordered: bool) -> Shard:
    dim = evaluate(node.dim, scope.constants)
    options: dict[str, int] = {}
    for option in node.options:
        if option.name not in SHARD_OPTIONS:
            raise LayoutNameError(
                f"unknown shard option '{option.name}' (options: {', '.join(SHARD_OPTIONS)})",
                option.span,
                did_you_mean(option.name, SHARD_OPTIONS),
            )
        if option.name in options:
            raise LayoutNameError(f"shard option '{option.name}' is given twice", option.span)
        if ordered and option.name != "pad":
            raise LayoutValueError(
                f"'{option.name}' applies to one axis; with an explicit order of axes only 'pad' is allowed",
                option.span,
            )
        value = evaluate(option.value, scope.constants)
        if value < 1:
            raise LayoutValueError(f"shard option '{option.name}' must be at least 1, not {value}", option.span)
        if value > INT32_MAX:
            raise LayoutValueError(f"shard option '{option.name}' is {value}; at most {INT32_MAX}", option.span)
        options[option.name] = value
    return Shard(dim, **options)


def _storage(scope: Scope, decl: ast.StorageDecl) -> StorageRule:
    (first, first_span), *others = decl.parts
    first_captures = pattern_captures(first, first_span, allow_star=False)
    for part, span in others:
        for name in pattern_captures(part, span, allow_star=False):
            if name not in first_captures:
                raise LayoutNameError(f"'{{{name}}}' is not captured by the first part \"{first}\"", span)
    stack = None
    if decl.stack is not None:
        stack, stack_span = decl.stack
        if stack not in first_captures:
            raise LayoutNameError(
                f"storage '{decl.name}' stacks by '{stack}', which the first part \"{first}\" does not capture",
                stack_span,
                f"capture it in the part names, e.g. \"...experts.{{{stack}}}.gate_proj.weight\"",
            )
        if re.search(rf"\{{[^}}]*\b{re.escape(stack)}\b[^}}]*\}}", decl.name):
            raise LayoutValueError(
                f"the name of stacked storage '{decl.name}' uses its stack capture '{stack}'; "
                "every element of the stack lives in the one storage",
                decl.name_span,
            )
        first_captures = [c for c in first_captures if c != stack]
    name_fn = name_template(decl.name, decl.name_span, scope.constants, first_captures)
    shape = tuple(evaluate(e, scope.constants) for e in decl.shape) if decl.shape is not None else None
    if shape is not None and any(n < 0 or n > INT64_MAX for n in shape):
        raise LayoutValueError(f"storage '{decl.name}' is declared with an impossible shape {list(shape)}", decl.span)
    dim = evaluate(decl.along, scope.constants) if decl.along is not None else 0
    if dim < 0:
        raise LayoutValueError(f"storage '{decl.name}' fuses along dim {dim}; dims start at 0", decl.span)
    blocks = None
    if decl.blocks is not None:
        blocks = tuple(evaluate(e, scope.constants) for e in decl.blocks)
        if len(blocks) != len(decl.parts):
            raise LayoutValueError(
                f"storage '{decl.name}' has {len(decl.parts)} parts but {len(blocks)} block sizes", decl.span
            )
        if any(b < 1 for b in blocks):
            raise LayoutValueError(f"storage '{decl.name}': block sizes must be at least 1", decl.span)
        if any(b > INT64_MAX for b in blocks):
            raise LayoutValueError(f"storage '{decl.name}': block size {max(blocks)} is too large", decl.span)
    if blocks is not None and (stack is not None or any(decl.transposed)):
        raise LayoutValueError(
            f"storage '{decl.name}': interleaved parts (blocks) can be neither stacked nor transposed", decl.span
        )
    view = tuple(evaluate(e, scope.constants) for e in decl.view) if decl.view is not None else None
    if view is not None and any(n < 0 or n > INT64_MAX for n in view):
        raise LayoutValueError(f"storage '{decl.name}' is viewed as an impossible shape {list(view)}", decl.span)
    parts = [part for part, _ in decl.parts]
    return StorageRule(decl.name, parts, dim, blocks, shape, name_fn, decl.span, stack, decl.transposed, view)


def reshard(decl: ast.ReshardDecl, layouts: Mapping[str, Layout], names: TensorNames | None = None) -> Reshard:
    """The reshard a statement declares between two of ``layouts`` (``names``: the program's
    tensor names, grouped once; by default those of the source layout).

    A policy's pattern that matches no tensor is an error, as a rule's is: a misspelled
    pattern would otherwise leave its tensors on the statement's other policy without a word.
    """
    for name, span in ((decl.source, decl.source_span), (decl.destination, decl.destination_span)):
        if name not in layouts:
            raise LayoutNameError(
                f"unknown layout '{name}' (layouts: {', '.join(layouts) or 'none'})",
                span,
                did_you_mean(name, layouts),
            )
    name = decl.name or f"{decl.source}->{decl.destination}"
    quantized = layouts[decl.source].quantize
    if quantized:  # a quantized destination is planned (plan/quantized.py); a source is not
        where = f" (line {quantized[0].span.line})" if quantized[0].span is not None else ""
        raise LayoutValueError(
            f"reshard '{name}': its source layout '{decl.source}' stores tensors quantized{where}; refits read "
            "sources in their logical dtype and dequantize nothing",
            decl.source_span,
            "refit from the bf16 (training) layout into the quantized one",
        )
    tensor_names = names if names is not None else TensorNames(list(layouts[decl.source].tensors))
    seen: dict[str | None, Span] = {}
    policies = []
    for p in decl.policies:
        if p.pattern in seen:
            raise LayoutNameError("a pattern is given two policies", p.pattern_span)
        if p.pattern is not None:
            captures = pattern_captures(p.pattern, p.pattern_span)
            _require_match(p.pattern, p.pattern_span, captures, tensor_names, f"reshard '{name}'")
        seen[p.pattern] = p.pattern_span
        policies.append((p.pattern, p.policy))
    return Reshard(name, decl.source, decl.destination, tuple(policies), decl.span)
