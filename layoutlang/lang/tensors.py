"""The ``tensor`` and ``tensors from`` statements: logical tensors, written out or imported.

``tensor "layers.{l}.w" [4096, 4096] bf16 for l in 0..31`` generates one tensor per value
of its bindings; ``tensors from hf "config.json" as cfg`` imports every weight of a
Hugging Face model (and its integer settings as constants ``cfg.NAME``; the dtypes of the
checkpoint beside the config when there is one), ``tensors from hf_constants "config.json" as
cfg`` only the constants, ``tensors from safetensors "model.safetensors"`` every tensor of a
checkpoint's headers, ``tensors from peft "adapter_config.json" over cfg as lora`` the
``lora_A`` / ``lora_B`` tensors of a PEFT LoRA adapter of the model ``cfg`` names (and its
integer settings as constants ``lora.NAME``; :mod:`layoutlang.io.peft`). A body
``{ "PATTERN": DTYPE ... }`` after an import declares the dtype of the imported tensors each
pattern matches (the most specific pattern wins, as layout rules do), over the ``dtype``
clause, the checkpoint's header and the config.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping

from ..errors import LayoutError, LayoutNameError, LayoutValueError, Span, did_you_mean
from ..io import hf, peft, safetensors
from ..model import LogicalTensor
from ..model.dtypes import DTYPES, canonical_dtype, itemsize
from ..model.layout import NameIndex
from ..model.rules import Rule, compile_pattern
from . import ast
from .expressions import evaluate
from .includes import is_preset
from .layouts import TensorNames
from .limits import INT64_MAX, MAX_GENERATED_TENSORS, MAX_PROGRAM_TENSORS
from .patterns import pattern_captures
from .scope import Scope

__all__ = ["SOURCE_KINDS", "tensor", "tensors_from"]

#: the model descriptions ``tensors from KIND`` reads
SOURCE_KINDS = ("hf", "hf_constants", "safetensors", "peft")

_PLACEHOLDER = re.compile(r"\{([^}]*)\}")


def _dtype(name: str, span: Span) -> str:
    """The short name of a dtype as written, or an error pointing at it."""
    short = canonical_dtype(name)
    if short is None:
        raise LayoutValueError(f"unknown dtype '{name}' (known: {', '.join(DTYPES)})", span, did_you_mean(name, DTYPES))
    return short


def _check_room(scope: Scope, adding: int, span: Span) -> None:
    """Refuse a statement that would take the program past MAX_PROGRAM_TENSORS tensors, before
    it builds any (a few short ``for`` statements could otherwise ask for billions)."""
    if len(scope.tensors) + adding > MAX_PROGRAM_TENSORS:
        raise LayoutValueError(
            f"the program would hold {len(scope.tensors) + adding:,} tensors ({len(scope.tensors):,} declared before"
            f" this statement, {adding:,} by it); a program holds at most {MAX_PROGRAM_TENSORS:,}",
            span,
        )


def _declare(scope: Scope, name: str, shape: tuple[int, ...], dtype: str, span: Span) -> None:
    scope.tensors.check_new(name, span)
    for d, n in enumerate(shape):
        if n < 0:
            raise LayoutValueError(f"tensor '{name}' has negative size {n} in dim {d}", span)
    if any(n > INT64_MAX for n in shape) or math.prod(shape) * itemsize(dtype) > INT64_MAX:
        raise LayoutValueError(f"tensor '{name}' of shape {list(shape)} is too large (more than 2**63 - 1 bytes)", span)
    scope.tensors.declare(name, LogicalTensor(name, shape, dtype), span)


def _instantiate(template: str, values: Mapping[str, int]) -> str:
    """``layers.{l}.w`` with the value of every ``{name}``."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def tensor(scope: Scope, node: ast.TensorDecl) -> None:
    """Declare the tensor (or, with a ``for`` clause, the tensors) of a statement."""
    element = _dtype(node.dtype, node.dtype_span)
    names = [b.name for b in node.bindings]
    for b in node.bindings:
        if names.count(b.name) > 1:
            raise LayoutNameError(f"'{b.name}' is bound twice", b.span)
    placeholders = _PLACEHOLDER.findall(node.name)
    for p in placeholders:
        if p not in names:
            raise LayoutNameError(
                f"'{{{p}}}' in tensor name '{node.name}' is not bound by a 'for' clause",
                node.name_span,
                f"add: for {p} in 0..N" if re.fullmatch(r"[A-Za-z_]\w*", p) else None,
            )
    if not placeholders and node.bindings:
        raise LayoutValueError(
            f"tensor name '{node.name}' does not use its 'for' bindings; "
            "every generated tensor would have the same name",
            node.name_span,
        )
    ranges = []
    for b in node.bindings:
        start, stop = evaluate(b.range.start, scope.constants), evaluate(b.range.stop, scope.constants)
        if stop < start:
            raise LayoutValueError(f"empty range {start}..{stop} (both ends are included)", b.range.span)
        ranges.append(range(start, stop + 1))
    count = math.prod(r.stop - r.start for r in ranges)  # len() overflows on huge ranges
    if count > MAX_GENERATED_TENSORS:
        widest = max(zip(ranges, node.bindings), key=lambda rb: rb[0].stop - rb[0].start)[1]
        raise LayoutValueError(
            f"the 'for' clause of tensor '{node.name}' generates {count} tensors; at most "
            f"{MAX_GENERATED_TENSORS} per statement",
            widest.span,
        )
    _check_room(scope, count, node.span)
    # one copy of the constants, the bindings written over it per tensor: a copy per tensor
    # made a program of C constants and T tensors cost C x T (5,000 lets and 20,000 tensors: 50 s)
    env = dict(scope.constants)
    for values in itertools.product(*ranges):
        env.update(zip(names, values))
        name = _instantiate(node.name, env)
        shape = tuple(evaluate(e, env) for e in node.shape)
        _declare(scope, name, shape, element, node.span)


def tensors_from(scope: Scope, node: ast.TensorsFrom, folder: str) -> None:
    """Declare every tensor of a model description read from ``folder``."""
    if node.kind not in SOURCE_KINDS:
        raise LayoutNameError(
            f"unknown model description '{node.kind}' (one of: {', '.join(SOURCE_KINDS)})",
            node.kind_span,
            did_you_mean(node.kind, SOURCE_KINDS),
        )
    element = _dtype(node.dtype, node.span) if node.dtype else None
    path = os.path.join(folder, node.path)
    if node.base is not None and node.kind != "peft":
        raise LayoutValueError(
            f"'over' names the model a PEFT adapter adapts; 'tensors from {node.kind}' takes none",
            node.base_span or node.span,
        )
    if node.kind == "peft":
        found = _peft(scope, node, path, element)
    elif node.kind == "hf_constants":
        _constants_only(scope, node, path)
        return
    else:
        found = _hf_or_safetensors(scope, node, path, element)
    _check_room(scope, len(found), node.span)
    if node.dtypes:
        found = _declared_dtypes(node, found)
    for name, shape, tensor_dtype in found:
        _declare(scope, name, tuple(shape), tensor_dtype, node.span)


def _hf_or_safetensors(
    scope: Scope, node: ast.TensorsFrom, path: str, element: str | None
) -> list[tuple[str, tuple[int, ...], str]]:
    try:
        if node.kind == "hf":
            # a checkpoint beside the config gives each tensor its stored dtype (fp32 routers)
            found = hf.tensors_from_hf_config(path, dtype=element, checkpoint=hf.checkpoint_beside(path))
            if node.alias:
                for key, value in hf.hf_config_constants(hf.read_config(path)).items():
                    scope.constants.define(f"{node.alias}.{key}", value)
                # what `quantize from ALIAS` in a layout follows
                scope.fp8_schemes[node.alias] = hf.fp8_scheme(path)
                scope.model_configs[node.alias] = path
        else:
            if node.alias:
                raise LayoutValueError(
                    "'as' names the constants of a Hugging Face config; safetensors has none", node.span
                )
            found = safetensors.tensors_from_safetensors(path)
            if element:
                found = [(n, s, element) for n, s, _ in found]
    except LayoutError as err:
        err.with_span(node.path_span)
        raise
    return found


def _peft(
    scope: Scope, node: ast.TensorsFrom, path: str, element: str | None
) -> list[tuple[str, tuple[int, ...], str]]:
    """``tensors from peft "adapter_config.json" over cfg as lora``: a LoRA adapter's tensors, for
    the model ``cfg`` names (see :mod:`layoutlang.io.peft`)."""
    models = list(scope.model_configs)
    if node.base is None:
        example = models[0] if models else "cfg"
        raise LayoutValueError(
            "'tensors from peft' needs the model the adapter adapts: 'over NAME', NAME being the 'as' name of"
            " its 'tensors from hf'",
            node.span,
            f'write: tensors from peft "{node.path}" over {example}'
            + ("" if models else ' (after: tensors from hf "config.json" as cfg)'),
        )
    if node.base not in scope.model_configs:
        raise LayoutNameError(
            f"'{node.base}' names no model: 'over' takes the 'as' name of a 'tensors from hf' (or hf_constants)"
            " above the statement" + (f" ({', '.join(models)})" if models else ", and there is none"),
            node.base_span or node.span,
            did_you_mean(node.base, models),
        )
    if node.alias == node.base:
        raise LayoutNameError(
            f"'as {node.alias}' would give the adapter's constants the model's names ({node.base}.r...)",
            node.span,
            f'write: tensors from peft "{node.path}" over {node.base} as lora',
        )
    try:
        adapter = peft.read_lora_adapter(
            path, scope.model_configs[node.base], element, checkpoint=peft.adapter_checkpoint_beside(path)
        )
    except LayoutError as err:
        err.with_span(node.path_span)
        raise
    if node.alias:
        for key, value in adapter.constants.items():
            scope.constants.define(f"{node.alias}.{key}", value)
    return adapter.tensors


def _declared_dtypes(
    node: ast.TensorsFrom, found: list[tuple[str, tuple[int, ...], str]]
) -> list[tuple[str, tuple[int, ...], str]]:
    """The imported tensors with the dtype of the most specific pattern of the statement's body
    that matches each (the others keep theirs); every pattern must match some tensor."""
    entries = []
    seen: dict[str, Span] = {}
    for decl in node.dtypes:
        pattern_captures(decl.pattern, decl.pattern_span)
        if decl.pattern in seen:
            raise LayoutNameError(
                f'pattern "{decl.pattern}" is given a dtype twice (first at line {seen[decl.pattern].line})',
                decl.pattern_span,
            )
        seen[decl.pattern] = decl.pattern_span
        # a Rule only for its specificity: the one layout rules compete by
        specificity = Rule(decl.pattern).specificity
        entries.append((decl, compile_pattern(decl.pattern), specificity, _dtype(decl.dtype, decl.dtype_span)))
    # most specific first, so that the first match wins and a second of equal specificity is a tie
    entries.sort(key=lambda entry: -entry[2])
    used: set[int] = set()  # id() of the declarations that matched a tensor
    # each pattern is tried on the names it could match, not on every imported name
    candidates = NameIndex([name for name, _, _ in found])
    matching: dict[str, list[int]] = {}  # name -> the entries matching it, most specific first
    for index, (decl, regex, _, _) in enumerate(entries):
        for name in candidates.could_match(decl.pattern, regex):
            if regex.fullmatch(name):
                matching.setdefault(name, []).append(index)
    out = []
    for name, shape, dtype in found:
        chosen = None
        matches = matching.get(name)
        if matches:
            chosen = matches[0]
            if len(matches) > 1 and entries[matches[1]][2] == entries[chosen][2]:
                first, decl = entries[chosen][0], entries[matches[1]][0]
                raise LayoutValueError(
                    f"tensor '{name}' is matched by two dtype patterns of equal specificity: "
                    f'"{first.pattern}" (line {first.pattern_span.line}) and "{decl.pattern}"',
                    decl.pattern_span,
                    "make one pattern more specific (more literal characters wins)",
                )
        if chosen is not None:
            used.add(id(entries[chosen][0]))
            dtype = entries[chosen][3]
        out.append((name, shape, dtype))
    names: TensorNames | None = None
    for decl in node.dtypes:  # the first unmatched one as written
        if id(decl) in used or is_preset(decl.pattern_span.path):
            continue
        names = names or TensorNames([name for name, _, _ in found])
        raise LayoutNameError(
            f"dtype pattern \"{decl.pattern}\" matches no tensor that 'tensors from {node.kind}' imports",
            decl.pattern_span,
            names.closest(decl.pattern, pattern_captures(decl.pattern, decl.pattern_span)),
        )
    return out


def _constants_only(scope: Scope, node: ast.TensorsFrom, path: str) -> None:
    """``tensors from hf_constants "config.json" as cfg``: the config's constants, no tensor."""
    if not node.alias:
        raise LayoutValueError(
            "'hf_constants' imports only a config's constants, so it needs 'as NAME' to name them",
            node.span,
            f'write: tensors from hf_constants "{node.path}" as cfg',
        )
    if node.dtype or node.dtypes:
        raise LayoutValueError("'hf_constants' declares no tensor, so 'dtype' has nothing to apply to", node.span)
    try:
        config = hf.read_config(path)
    except LayoutError as err:
        err.with_span(node.path_span)
        raise
    for key, value in hf.hf_config_constants(config).items():
        scope.constants.define(f"{node.alias}.{key}", value)
    scope.model_configs[node.alias] = path
