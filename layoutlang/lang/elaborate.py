"""Abstract syntax tree to semantic model.

:func:`load` and :func:`loads` read a ``.layout`` program, follow its includes, evaluate
constants and expressions, expand generated and imported tensors, and build the frozen
:class:`~layoutlang.model.Program`. Names are resolved here; every mistake becomes a
:class:`~layoutlang.errors.LayoutError` pointing at the offending text.

Resolving every tensor of every layout (rule matching, sub-mesh expressions, storage
shapes on every rank) happens lazily on first use, or all at once in
:meth:`~layoutlang.model.Program.check` (what ``layoutlang check`` runs).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from ..errors import (
    LayoutError,
    LayoutIncludeError,
    LayoutNameError,
    LayoutSyntaxError,
    LayoutValueError,
    Span,
    did_you_mean,
)
from ..io import hf, safetensors
from ..model import (
    Layout,
    LogicalTensor,
    Mesh,
    Program,
    Replicate,
    Reshard,
    Rule,
    Shard,
    StorageRule,
    Topology,
)
from ..model.dtypes import DTYPES, canonical_dtype, itemsize
from ..model.topology import TOPOLOGY_PRESETS
from . import syntax as ast

__all__ = ["load", "loads"]

SOURCE_KINDS = ("hf", "safetensors")
SHARD_OPTIONS = ("blocks", "chunks", "pad")

# Limits that keep a mistyped number from exhausting memory or overflowing the C++ core,
# which counts elements, bytes and ranks in 64-bit integers and chunks and blocks in 32-bit.
MAX_MESH_RANKS = 1 << 20
MAX_GENERATED_TENSORS = 1 << 20
_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1

_BANDWIDTH_UNITS = {
    "GB/s": 1e9,
    "Gb/s": 1e9 / 8,
    "GiB/s": float(2**30),
    "MB/s": 1e6,
    "MiB/s": float(2**20),
    "TB/s": 1e12,
    "Tb/s": 1e12 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_TOPOLOGY_KEYS = {
    "domain_size": None,
    "domain_bandwidth": _BANDWIDTH_UNITS,
    "network_bandwidth": _BANDWIDTH_UNITS,
    "domain_latency": _TIME_UNITS,
    "network_latency": _TIME_UNITS,
    "copy_bandwidth": _BANDWIDTH_UNITS,
}
# ``include "preset:NAME"`` reads NAME.layout, or NAME/model.layout, from the packaged presets
_PRESET_PREFIX = "preset:"


# ------------------------------------------------------------------- expressions


def evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    """Integer value of ``expr``; unknown names and division by zero point at their text."""
    if isinstance(expr, ast.Num):
        return expr.value
    if isinstance(expr, ast.Name):
        if expr.name not in env:
            raise LayoutNameError(f"unknown name '{expr.name}'", expr.span, did_you_mean(expr.name, env))
        return env[expr.name]
    if isinstance(expr, ast.Attr):
        key = f"{expr.obj}.{expr.key}"
        if key not in env:
            raise LayoutNameError(f"unknown name '{key}'", expr.span, did_you_mean(key, env))
        return env[key]
    if isinstance(expr, ast.Neg):
        return -evaluate(expr.operand, env)
    left = evaluate(expr.left, env)
    right = evaluate(expr.right, env)
    if expr.op == "+":
        return left + right
    if expr.op == "-":
        return left - right
    if expr.op == "*":
        return left * right
    if right == 0:
        raise LayoutValueError(f"division by zero in '{expr.op}'", expr.span)
    return left // right if expr.op == "//" else left % right


def names_in(expr: ast.Expr) -> list[ast.Name | ast.Attr]:
    if isinstance(expr, (ast.Name, ast.Attr)):
        return [expr]
    if isinstance(expr, ast.Num):
        return []
    if isinstance(expr, ast.Neg):
        return names_in(expr.operand)
    return names_in(expr.left) + names_in(expr.right)


def _closure(expr: ast.Expr, constants: Mapping[str, int], allowed: set[str]) -> Callable[[Mapping[str, int]], int]:
    """A function of the captures; names are checked now, values when it is called.

    The expression is compiled to Python (constants folded in) because rule expressions
    run once per tensor, tens of thousands of times in a large model.
    """
    for name in names_in(expr):
        key = name.name if isinstance(name, ast.Name) else f"{name.obj}.{name.key}"
        if key not in allowed and key not in constants:
            raise LayoutNameError(
                f"unknown name '{key}' (captures of the pattern: {', '.join(sorted(allowed)) or 'none'})",
                name.span,
                did_you_mean(key, list(allowed) + list(constants)),
            )
    divisions: list[ast.BinOp] = []

    def source(node: ast.Expr) -> str:
        if isinstance(node, ast.Num):
            return str(node.value)
        if isinstance(node, ast.Name):
            return f"captures[{node.name!r}]" if node.name in allowed else str(constants[node.name])
        if isinstance(node, ast.Attr):
            return str(constants[f"{node.obj}.{node.key}"])
        if isinstance(node, ast.Neg):
            return f"(-{source(node.operand)})"
        if node.op in ("//", "%"):
            divisions.append(node)
            which = len(divisions) - 1  # before the operands append their own divisions
            return f"divide({source(node.left)}, {source(node.right)}, {which})"
        return f"({source(node.left)} {node.op} {source(node.right)})"

    def divide(left: int, right: int, which: int) -> int:
        node = divisions[which]
        if right == 0:
            raise LayoutValueError(f"division by zero in '{node.op}'", node.span)
        return left // right if node.op == "//" else left % right

    return eval(f"lambda captures: {source(expr)}", {"divide": divide})  # noqa: S307 - built from the AST above


# ----------------------------------------------------------------------- loading


class _Elaborator:
    def __init__(self) -> None:
        self.constants: dict[str, int] = {}
        self.constant_spans: dict[str, Span] = {}
        self.meshes: dict[str, Mesh] = {}
        self.mesh_spans: dict[str, Span] = {}
        self.tensors: dict[str, LogicalTensor] = {}
        self.tensor_spans: dict[str, Span] = {}
        self.layout_decls: list[ast.LayoutDecl] = []
        self.layout_spans: dict[str, Span] = {}
        self.reshard_decls: list[ast.ReshardDecl] = []
        self.topology: Topology | None = None
        self.topology_span: Span | None = None
        self.included: set[str] = set()
        self.stack: list[str] = []

    # -- files
    def file(self, text: str, display: str, real: str | None) -> None:
        tree = ast.parse(text, display)
        if real is not None:
            self.stack.append(real)
            self.included.add(real)
        base = os.path.dirname(display)
        real_base = os.path.dirname(real) if real else os.getcwd()
        try:
            for statement in tree.statements:
                self.statement(statement, base, real_base)
        finally:
            if real is not None:
                self.stack.pop()

    def include(self, node: ast.Include, base: str, real_base: str) -> None:
        if node.path.startswith(_PRESET_PREFIX):
            real = display = _preset_file(node.path[len(_PRESET_PREFIX) :], node.span)
        else:
            real = os.path.realpath(os.path.join(real_base, node.path))
            display = os.path.normpath(os.path.join(base, node.path))
        if real in self.stack:
            chain = [os.path.basename(p) for p in self.stack[self.stack.index(real) :]] + [os.path.basename(real)]
            raise LayoutIncludeError(f"include cycle: {' -> '.join(chain)}", node.span)
        if real in self.included:
            return  # each file is read once, so presets can be included from several places
        if os.path.isdir(real):
            raise LayoutIncludeError(f"cannot include '{node.path}': it is a directory ({display})", node.span)
        if not os.path.isfile(real):
            raise LayoutIncludeError(
                f"cannot include '{node.path}': no such file ({display})",
                node.span,
                did_you_mean(os.path.basename(node.path), _layout_files(os.path.dirname(real))),
            )
        self.file(read_source(real, display), display, real)

    def statement(self, node, base: str, real_base: str) -> None:
        handler = {
            ast.Include: lambda n: self.include(n, base, real_base),
            ast.Let: self.let,
            ast.Topology: self.topology_decl,
            ast.MeshDecl: self.mesh,
            ast.TensorDecl: self.tensor,
            ast.TensorsFrom: lambda n: self.tensors_from(n, real_base),
            ast.LayoutDecl: self.layout_decl,
            ast.ReshardDecl: self.reshard_decls.append,
        }[type(node)]
        handler(node)

    # -- simple statements
    def _unique(self, kind: str, name: str, seen: Mapping[str, Span], span: Span) -> None:
        if name in seen:
            first = seen[name]
            raise LayoutNameError(f"{kind} '{name}' is declared twice (first at {first})", span)

    def let(self, node: ast.Let) -> None:
        self._unique("constant", node.name, self.constant_spans, node.span)
        self.constants[node.name] = evaluate(node.value, self.constants)
        self.constant_spans[node.name] = node.span

    def topology_decl(self, node: ast.Topology) -> None:
        if self.topology is not None:
            raise LayoutNameError(f"a second topology (the first is at {self.topology_span})", node.span)
        values: dict[str, float | int] = {}
        if node.name is not None:
            # A known name starts from that preset, which the block may override; any other
            # name labels a topology of the block's own settings, which must give the domains.
            preset = TOPOLOGY_PRESETS.get(node.name)
            if preset is not None:
                values.update(attrs.asdict(preset))
                del values["name"]
            elif not any(entry.key == "domain_size" for entry in node.entries):
                raise LayoutNameError(
                    f"unknown topology '{node.name}' (presets: {', '.join(TOPOLOGY_PRESETS)}); "
                    "a topology of another name must set domain_size",
                    node.span,
                    did_you_mean(node.name, TOPOLOGY_PRESETS),
                )
        given: set[str] = set()
        for entry in node.entries:
            if entry.key not in _TOPOLOGY_KEYS:
                raise LayoutNameError(
                    f"unknown topology setting '{entry.key}' (settings: {', '.join(_TOPOLOGY_KEYS)})",
                    entry.span,
                    did_you_mean(entry.key, _TOPOLOGY_KEYS),
                )
            if entry.key in given:
                raise LayoutNameError(f"topology setting '{entry.key}' is given twice", entry.span)
            given.add(entry.key)
            units = _TOPOLOGY_KEYS[entry.key]
            if not math.isfinite(entry.value):
                raise LayoutValueError(f"'{entry.key}' = {entry.value} is not a finite number", entry.span)
            if units is None:
                if entry.unit is not None or entry.value != int(entry.value) or entry.value < 1:
                    raise LayoutValueError(f"'{entry.key}' is a whole number of ranks, at least 1", entry.span)
                values[entry.key] = int(entry.value)
            else:
                if entry.unit not in units:
                    raise LayoutValueError(
                        f"'{entry.key}' needs a unit, one of: {', '.join(units)}",
                        entry.span,
                    )
                if entry.value < 0 or (entry.value == 0 and units is _BANDWIDTH_UNITS):
                    least = "more than 0" if units is _BANDWIDTH_UNITS else "at least 0"
                    raise LayoutValueError(f"'{entry.key}' must be {least}", entry.span)
                values[entry.key] = entry.value * units[entry.unit]
        self.topology = Topology(name=node.name, **values)
        self.topology_span = node.span

    def mesh(self, node: ast.MeshDecl) -> None:
        self._unique("mesh", node.name, self.mesh_spans, node.span)
        axes = []
        seen: set[str] = set()
        for axis in node.axes:
            if axis.name in seen:
                raise LayoutNameError(f"mesh '{node.name}' declares axis '{axis.name}' twice", axis.span)
            seen.add(axis.name)
            size = evaluate(axis.size, self.constants)
            if size < 1:
                raise LayoutValueError(
                    f"axis '{axis.name}' of mesh '{node.name}' has size {size}; sizes are at least 1", axis.span
                )
            axes.append((axis.name, size))
        positions = math.prod(size for _, size in axes)
        if positions > MAX_MESH_RANKS:
            largest = max(node.axes, key=lambda a: dict(axes)[a.name])
            raise LayoutValueError(
                f"mesh '{node.name}' has {positions} positions; a mesh has at most {MAX_MESH_RANKS} ranks",
                largest.span,
            )
        ranks = None
        if node.ranks is not None:
            ranks = []
            for item in node.ranks:
                if isinstance(item, ast.Range):
                    start, stop = evaluate(item.start, self.constants), evaluate(item.stop, self.constants)
                    if stop < start:
                        raise LayoutValueError(f"empty rank range {start}..{stop} (both ends are included)", item.span)
                    if len(ranks) + stop - start + 1 > positions:  # before building a huge list
                        shape = " x ".join(f"{a}={s}" for a, s in axes)
                        raise LayoutValueError(
                            f"mesh '{node.name}' ({shape}) has {positions} positions but more ranks "
                            f"(the range {start}..{stop} alone has {stop - start + 1})",
                            item.span,
                        )
                    ranks.extend(range(start, stop + 1))
                else:
                    ranks.append(evaluate(item, self.constants))
            for rank in ranks:
                if rank > _INT64_MAX:
                    raise LayoutValueError(f"mesh '{node.name}' lists rank {rank}, which is too large", node.ranks_span)
        try:
            self.meshes[node.name] = Mesh(node.name, axes, ranks)
        except LayoutError as err:
            raise err.with_span(node.ranks_span or node.span)
        self.mesh_spans[node.name] = node.span

    def _dtype(self, name: str, span: Span) -> str:
        dtype = canonical_dtype(name)
        if dtype is None:
            raise LayoutValueError(
                f"unknown dtype '{name}' (known: {', '.join(DTYPES)})", span, did_you_mean(name, DTYPES)
            )
        return dtype

    def _add_tensor(self, name: str, shape: tuple[int, ...], dtype: str, span: Span) -> None:
        if name in self.tensor_spans:
            raise LayoutNameError(f"tensor '{name}' is declared twice (first at {self.tensor_spans[name]})", span)
        for d, n in enumerate(shape):
            if n < 0:
                raise LayoutValueError(f"tensor '{name}' has negative size {n} in dim {d}", span)
        if any(n > _INT64_MAX for n in shape) or math.prod(shape) * itemsize(dtype) > _INT64_MAX:
            raise LayoutValueError(
                f"tensor '{name}' of shape {list(shape)} is too large (more than 2**63 - 1 bytes)", span
            )
        self.tensors[name] = LogicalTensor(name, shape, dtype)
        self.tensor_spans[name] = span

    def tensor(self, node: ast.TensorDecl) -> None:
        dtype = self._dtype(node.dtype, node.dtype_span)
        names = [b.name for b in node.bindings]
        for b in node.bindings:
            if names.count(b.name) > 1:
                raise LayoutNameError(f"'{b.name}' is bound twice", b.span)
        placeholders = re.findall(r"\{([^}]*)\}", node.name)
        for p in placeholders:
            if p not in names:
                raise LayoutNameError(
                    f"'{{{p}}}' in tensor name '{node.name}' is not bound by a 'for' clause",
                    node.name_span,
                    f"add: for {p} in 0..N" if re.fullmatch(r"[A-Za-z_]\w*", p) else None,
                )
        if not placeholders and node.bindings:
            raise LayoutValueError(
                f"tensor name '{node.name}' does not use its 'for' bindings; every generated tensor would have the same name",
                node.name_span,
            )
        ranges = []
        for b in node.bindings:
            start, stop = evaluate(b.range.start, self.constants), evaluate(b.range.stop, self.constants)
            if stop < start:
                raise LayoutValueError(f"empty range {start}..{stop} (both ends are included)", b.range.span)
            ranges.append(range(start, stop + 1))
        count = math.prod(r.stop - r.start for r in ranges)  # len() overflows on huge ranges
        if count > MAX_GENERATED_TENSORS:
            raise LayoutValueError(
                f"the 'for' clause of tensor '{node.name}' generates {count} tensors; at most "
                f"{MAX_GENERATED_TENSORS} per statement",
                max(zip(ranges, node.bindings), key=lambda rb: rb[0].stop - rb[0].start)[1].span,
            )
        for values in itertools.product(*ranges):
            env = {**self.constants, **dict(zip(names, values))}
            name = re.sub(r"\{([^}]*)\}", lambda m: str(env[m.group(1)]), node.name)
            shape = tuple(evaluate(e, env) for e in node.shape)
            self._add_tensor(name, shape, dtype, node.span)

    def tensors_from(self, node: ast.TensorsFrom, real_base: str) -> None:
        if node.kind not in SOURCE_KINDS:
            raise LayoutNameError(
                f"unknown model description '{node.kind}' (one of: {', '.join(SOURCE_KINDS)})",
                node.kind_span,
                did_you_mean(node.kind, SOURCE_KINDS),
            )
        dtype = self._dtype(node.dtype, node.span) if node.dtype else None
        path = os.path.join(real_base, node.path)
        try:
            if node.kind == "hf":
                found = hf.tensors_from_hf_config(path, dtype=dtype)
                if node.alias:
                    for key, value in hf.hf_config_constants(hf.read_config(path)).items():
                        self.constants[f"{node.alias}.{key}"] = value
            else:
                if node.alias:
                    raise LayoutValueError("'as' names the constants of a Hugging Face config; safetensors has none", node.span)
                found = safetensors.tensors_from_safetensors(path)
                if dtype:
                    found = [(n, s, dtype) for n, s, _ in found]
        except LayoutError as err:
            raise err.with_span(node.path_span)
        for name, shape, tensor_dtype in found:
            self._add_tensor(name, tuple(shape), tensor_dtype, node.span)

    def layout_decl(self, node: ast.LayoutDecl) -> None:
        self._unique("layout", node.name, self.layout_spans, node.span)
        self.layout_spans[node.name] = node.span
        self.layout_decls.append(node)

    # -- layouts (after every tensor is known)
    def build_layout(self, node: ast.LayoutDecl) -> Layout:
        if node.mesh not in self.meshes:
            raise LayoutNameError(
                f"unknown mesh '{node.mesh}' in layout '{node.name}' (meshes: {', '.join(self.meshes) or 'none'})",
                node.mesh_span,
                did_you_mean(node.mesh, self.meshes),
            )
        mesh = self.meshes[node.mesh]
        rules = []
        patterns: dict[str | None, Span] = {}
        for decl in node.rules:
            if decl.pattern in patterns:
                what = "a second default rule" if decl.pattern is None else f"pattern \"{decl.pattern}\" appears twice"
                raise LayoutNameError(f"{what} in layout '{node.name}' (first at {patterns[decl.pattern]})", decl.pattern_span)
            patterns[decl.pattern] = decl.pattern_span
            rules.append(self.rule(decl, mesh, node.name))
        storages = tuple(self.storage(decl) for decl in node.storages)
        return Layout(node.name, mesh, self.tensors, tuple(rules), storages, node.span)

    def rule(self, decl: ast.RuleDecl, mesh: Mesh, layout: str) -> Rule:
        captures = _pattern_captures(decl.pattern, decl.pattern_span) if decl.pattern else []
        placements: dict[str, Shard | Replicate] = {}
        submesh: dict[str, Callable] = {}
        order: dict[int, tuple[str, ...]] = {}
        used: dict[str, Span] = {}

        def claim(axis: str, span: Span) -> None:
            try:
                mesh.axis_index(axis)
            except LayoutError as err:
                raise err.with_span(span)
            if axis in used:
                raise LayoutValueError(
                    f"axis '{axis}' is placed twice in one rule of layout '{layout}' (first at column {used[axis].column})",
                    span,
                )
            used[axis] = span

        for entry in decl.entries:
            if isinstance(entry, ast.SelectEntry):
                claim(entry.axis, entry.axis_span or entry.span)
                submesh[entry.axis] = _closure(entry.index, self.constants, set(captures))
                continue
            for i, axis in enumerate(entry.axes):
                claim(axis, entry.axis_spans[i] if i < len(entry.axis_spans) else entry.span)
            if isinstance(entry.placement, ast.ReplicateExpr):
                if entry.ordered:
                    raise LayoutValueError("an explicit order of axes applies to shard(...), not replicate", entry.span)
                placements[entry.axes[0]] = Replicate()
                continue
            shard = self.shard(entry.placement, ordered=entry.ordered)
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
                    used[axis],
                )
        return Rule(decl.pattern, placements, submesh, order, decl.span)

    def shard(self, node: ast.ShardExpr, ordered: bool) -> Shard:
        dim = evaluate(node.dim, self.constants)
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
            value = evaluate(option.value, self.constants)
            if value < 1:
                raise LayoutValueError(f"shard option '{option.name}' must be at least 1, not {value}", option.span)
            if value > _INT32_MAX:
                raise LayoutValueError(f"shard option '{option.name}' is {value}; at most {_INT32_MAX}", option.span)
            options[option.name] = value
        return Shard(dim, **options)

    def storage(self, decl: ast.StorageDecl) -> StorageRule:
        first_captures = _pattern_captures(decl.parts[0][0], decl.parts[0][1], allow_star=False)
        for part, span in decl.parts[1:]:
            for name in _pattern_captures(part, span, allow_star=False):
                if name not in first_captures:
                    raise LayoutNameError(
                        f"'{{{name}}}' is not captured by the first part \"{decl.parts[0][0]}\"", span
                    )
        name_fn = self._name_template(decl.name, decl.name_span, set(first_captures))
        shape = tuple(evaluate(e, self.constants) for e in decl.shape) if decl.shape is not None else None
        if shape is not None and any(n < 0 or n > _INT64_MAX for n in shape):
            raise LayoutValueError(f"storage '{decl.name}' is declared with an impossible shape {list(shape)}", decl.span)
        dim = evaluate(decl.along, self.constants) if decl.along is not None else 0
        if dim < 0:
            raise LayoutValueError(f"storage '{decl.name}' fuses along dim {dim}; dims start at 0", decl.span)
        blocks = None
        if decl.blocks is not None:
            blocks = tuple(evaluate(e, self.constants) for e in decl.blocks)
            if len(blocks) != len(decl.parts):
                raise LayoutValueError(
                    f"storage '{decl.name}' has {len(decl.parts)} parts but {len(blocks)} block sizes", decl.span
                )
            if any(b < 1 for b in blocks):
                raise LayoutValueError(f"storage '{decl.name}': block sizes must be at least 1", decl.span)
            if any(b > _INT64_MAX for b in blocks):
                raise LayoutValueError(f"storage '{decl.name}': block size {max(blocks)} is too large", decl.span)
        return StorageRule(decl.name, tuple(p for p, _ in decl.parts), dim, blocks, shape, name_fn, decl.span)

    def _name_template(self, template: str, span: Span, captures: set[str]) -> Callable[[Mapping[str, int]], str]:
        """``"decoder.layers.{l % 4}.mlp"``: each ``{...}`` is an expression of the captures."""
        pieces: list[str | Callable[[Mapping[str, int]], int]] = []
        pos = 0
        for m in re.finditer(r"\{([^{}]*)\}", template):
            pieces.append(template[pos : m.start()])
            # +1 for the opening quote, +1 for the brace
            at = Span(span.path, span.line, span.column + m.start() + 2, span.line, span.column + m.end(), span.source_line)
            expr = ast.parse_expression(m.group(1), at)
            pieces.append(_closure(expr, self.constants, captures))
            pos = m.end()
        pieces.append(template[pos:])

        def name(values: Mapping[str, int]) -> str:
            return "".join(p if isinstance(p, str) else str(p(values)) for p in pieces)

        return name

    def reshard(self, decl: ast.ReshardDecl, layouts: Mapping[str, Layout]) -> Reshard:
        for name, span in ((decl.source, decl.source_span), (decl.destination, decl.destination_span)):
            if name not in layouts:
                raise LayoutNameError(
                    f"unknown layout '{name}' (layouts: {', '.join(layouts) or 'none'})",
                    span,
                    did_you_mean(name, layouts),
                )
        seen: dict[str | None, Span] = {}
        policies = []
        for p in decl.policies:
            if p.pattern in seen:
                raise LayoutNameError("a pattern is given two policies", p.pattern_span)
            if p.pattern is not None:
                _pattern_captures(p.pattern, p.pattern_span)
            seen[p.pattern] = p.pattern_span
            policies.append((p.pattern, p.policy))
        name = decl.name or f"{decl.source}->{decl.destination}"
        return Reshard(name, decl.source, decl.destination, tuple(policies), decl.span)

    # -- result
    def program(self, path: str) -> Program:
        layouts = {decl.name: self.build_layout(decl) for decl in self.layout_decls}
        reshards: dict[str, Reshard] = {}
        spans: dict[str, Span] = {}
        for decl in self.reshard_decls:
            r = self.reshard(decl, layouts)
            self._unique("reshard", r.name, spans, decl.span)
            spans[r.name] = decl.span
            reshards[r.name] = r
        return Program(
            dict(self.meshes),
            dict(self.tensors),
            layouts,
            reshards,
            self.topology or Topology(),
            dict(self.constants),
            path,
        )


def _pattern_captures(pattern: str, span: Span, allow_star: bool = True) -> list[str]:
    """Names captured by ``{name}`` in a pattern; malformed braces point at the pattern."""
    names = []
    for m in re.finditer(r"\{([^{}]*)\}", pattern):
        name = m.group(1)
        at = Span(span.path, span.line, span.column + m.start() + 1, span.line, span.column + m.end() + 1, span.source_line)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise LayoutSyntaxError(
                f"'{{{name}}}' in pattern \"{pattern}\": a capture is a plain name such as {{l}}", at
            )
        if name in names:
            raise LayoutNameError(f"capture '{{{name}}}' appears twice in pattern \"{pattern}\"", at)
        names.append(name)
    stripped = re.sub(r"\{[^{}]*\}", "", pattern)
    if "{" in stripped or "}" in stripped:
        raise LayoutSyntaxError(f"unbalanced brace in pattern \"{pattern}\"", span)
    if not allow_star and "*" in pattern:
        raise LayoutValueError(f"storage parts name tensors exactly: '*' is not allowed in \"{pattern}\"", span)
    return names


def _preset_file(name: str, span: Span) -> str:
    """The packaged file of ``include "preset:NAME"``: presets/NAME.layout or presets/NAME/model.layout."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
    if name and ".." not in name.split("/") and not os.path.isabs(name):
        for candidate in (os.path.join(folder, name + ".layout"), os.path.join(folder, name, "model.layout")):
            if os.path.isfile(candidate):
                return os.path.realpath(candidate)
    known = sorted(
        os.path.relpath(os.path.join(d, f), folder)[: -len(".layout")].removesuffix("/model")
        for d, _, files in os.walk(folder)
        for f in files
        if f.endswith(".layout")
    )
    raise LayoutIncludeError(f"unknown preset '{name}' (presets: {', '.join(known)})", span, did_you_mean(name, known))


def _layout_files(folder: str) -> list[str]:
    try:
        return [f for f in os.listdir(folder) if f.endswith(".layout")]
    except OSError:
        return []


def read_source(path: str | os.PathLike[str], display: str | None = None) -> str:
    """The text of a ``.layout`` file; unreadable or non-UTF-8 files are LayoutSyntaxErrors."""
    display = display or str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise LayoutSyntaxError(f"no such file: {display}") from None
    except IsADirectoryError:
        raise LayoutSyntaxError(f"{display} is a directory, not a .layout file") from None
    except OSError as err:
        raise LayoutSyntaxError(f"cannot read {display}: {err.strerror}") from None
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark, as some editors write
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        line_start = data.rfind(b"\n", 0, err.start) + 1
        column = len(data[line_start : err.start].decode("utf-8")) + 1  # in characters, as lark counts
        text = data.decode("utf-8", errors="replace").splitlines()
        source = text[line - 1] if line <= len(text) else ""
        raise LayoutSyntaxError(
            f"the file is not UTF-8 text (byte 0x{data[err.start]:02x})",
            Span(display, line, column, line, column + 1, source),
        ) from None


def load(path: str | os.PathLike[str]) -> Program:
    """Read a ``.layout`` file (and its includes) into a :class:`~layoutlang.model.Program`."""
    display = os.fspath(path)
    real = os.path.realpath(display)
    text = read_source(real, display)
    elaborator = _Elaborator()
    elaborator.file(text, display, real)
    return elaborator.program(display)


def loads(text: str, path: str = "<string>") -> Program:
    """Read a program from text; includes are relative to the current directory."""
    elaborator = _Elaborator()
    elaborator.file(text, path, None)
    return elaborator.program(path)
