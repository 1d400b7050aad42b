"""Syntax tree to semantic model.

:func:`load` and :func:`loads` read a ``.layout`` program, follow its includes, evaluate
constants and expressions, expand generated and imported tensors, and build the frozen
:class:`~layoutlang.model.Program`. Names are resolved here; every mistake becomes a
:class:`~layoutlang.errors.LayoutError` pointing at the offending text.

Statements are read in order, each by the module of its kind (:mod:`~.meshes`,
:mod:`~.tensors`, :mod:`~.topology`, :mod:`~.layouts`) into one :class:`~.scope.Scope`;
layouts and reshards are built after the last statement, when every tensor is known.
Resolving every tensor of every layout (rule matching, sub-mesh expressions, storage
shapes on every rank) happens lazily on first use, or all at once in
:meth:`~layoutlang.model.Program.check` (what ``layoutlang check`` runs).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Mapping

from ..errors import LayoutNameError, LayoutValueError
from ..model import Program, Reshard, Topology
from ..model.program import cyclic_gc_paused
from . import ast, layouts, meshes, tensors
from .expressions import evaluate, names_in
from .includes import Includes, Source, read_source
from .limits import MAX_LAYOUT_PLACEMENTS
from .parser import TokenBudget, parse
from .scope import Declarations, Scope
from .topology import topology

__all__ = ["load", "loads", "read_source"]


class _Elaborator:
    """Reads the statements of a program's files, in order, into one scope."""

    def __init__(self, folder: str, allow_outside_includes: bool) -> None:
        self.scope = Scope()
        self.includes = Includes(folder, allow_outside=allow_outside_includes)
        self.tokens = TokenBudget()  # of every file together: includes cannot multiply the limit

    def file(self, source: Source) -> None:
        tree = parse(source.text, source.display, source.included_from, self.tokens)
        with self.includes.reading(source):
            for statement in tree.statements:
                self.statement(statement, source)

    def statement(self, node: ast.Statement, source: Source) -> None:
        scope = self.scope
        match node:
            case ast.Include():
                included = self.includes.source(node, source)
                if included is not None:
                    self.file(included)
            case ast.Let():
                # a second declaration is named as such before its value is computed
                scope.constants.check_new(node.name, node.span)
                scope.constants.declare(node.name, evaluate(node.value, scope.constants), node.span)
            case ast.Require():
                _require(node, scope.constants)
            case ast.Topology():
                if scope.topology is not None:
                    raise LayoutNameError(f"a second topology (the first is at {scope.topology_span})", node.span)
                scope.topology, scope.topology_span = topology(node), node.span
            case ast.MeshDecl():
                scope.meshes.check_new(node.name, node.span)
                built = meshes.mesh(scope, node)
                scope.constants.define_mesh(built, node.span)
                scope.meshes.declare(node.name, built, node.span)
            case ast.TensorDecl():
                tensors.tensor(scope, node)
            case ast.TensorsFrom():
                tensors.tensors_from(scope, node, source.real_folder)
            case ast.LayoutDecl():
                scope.layouts.declare(node.name, node, node.span)
            case ast.ReshardDecl():
                scope.reshards.append(node)

    def _check_placements(self, tensors: int) -> None:
        """Refuse, at the first layout past it, a program whose layouts x tensors pass
        MAX_LAYOUT_PLACEMENTS: checking resolves every tensor in every layout."""
        declared = list(self.scope.layouts.values())
        if len(declared) * tensors <= MAX_LAYOUT_PLACEMENTS:
            return
        first_past = declared[MAX_LAYOUT_PLACEMENTS // tensors]
        raise LayoutValueError(
            f"the program declares {len(declared)} layouts of {tensors:,} tensors: {len(declared) * tensors:,} tensor"
            f" placements to resolve and check; a program holds at most {MAX_LAYOUT_PLACEMENTS:,}"
            f" ({MAX_LAYOUT_PLACEMENTS // tensors} layouts of this many tensors)",
            first_past.span,
            "declare only the layouts the program's reshards use, and put the others in programs of their own",
        )

    def program(self, path: str) -> Program:
        scope = self.scope
        every_tensor = dict(scope.tensors)
        self._check_placements(len(every_tensor))
        names = layouts.TensorNames(list(every_tensor))
        built = {
            name: layouts.layout(scope, layouts.extended(scope.layouts, name), every_tensor, names)
            for name in scope.layouts
        }
        reshards: Declarations[Reshard] = Declarations("reshard")
        for decl in scope.reshards:
            r = layouts.reshard(decl, built)
            reshards.declare(r.name, r, decl.span)
        return Program(
            dict(scope.meshes),
            every_tensor,
            built,
            dict(reshards),
            scope.topology or Topology(),
            dict(scope.constants),
            path,
        )


def load(path: str | os.PathLike[str], *, allow_outside_includes: bool = False) -> Program:
    """Read a ``.layout`` file (and its includes) into a :class:`~layoutlang.model.Program`.

    Its includes are confined to its folder (symbolic links resolved) and the presets;
    ``allow_outside_includes`` lifts that, for a program one trusts (see
    :mod:`~layoutlang.lang.includes`).
    """
    display = os.fspath(path)
    real = os.path.realpath(display)
    elaborator = _Elaborator(os.path.dirname(real), allow_outside_includes)
    with cyclic_gc_paused():  # time linear in the tensors built (see cyclic_gc_paused)
        elaborator.file(Source(read_source(real, display), display, real))
        return elaborator.program(display)


def loads(text: str, path: str = "<string>", *, allow_outside_includes: bool = False) -> Program:
    """Read a program from text; includes are relative to, and confined to, the current
    directory (``allow_outside_includes`` as for :func:`load`)."""
    elaborator = _Elaborator(os.getcwd(), allow_outside_includes)
    with cyclic_gc_paused():
        elaborator.file(Source(text, path, None))
        return elaborator.program(path)


#: the comparisons of ``require``
_COMPARISONS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
}


def _require(node: ast.Require, constants: Mapping[str, int]) -> None:
    """A ``require`` statement whose condition does not hold is an error at the statement,
    in its own words, with the values it compared (a preset states what its engine refuses:
    ``require cfg.num_attention_heads % infer.tp == 0: "..."``)."""
    left, right = evaluate(node.left, constants), evaluate(node.right, constants)
    if _COMPARISONS[node.op](left, right):
        return
    said = node.message or "a requirement of the program does not hold"
    names = list(dict.fromkeys(n.name for n in [*names_in(node.left), *names_in(node.right)]))
    values = ", ".join(f"{name} = {constants[name]}" for name in names)
    raise LayoutValueError(
        f"{said} (required {_text(node.left)} {node.op} {_text(node.right)}"
        + (f", with {values}" if values else "") + ")",
        node.span,
    )


def _text(expr: ast.Expr) -> str:
    """An expression as written (on one line), or 'the expression' where that is not known."""
    span = expr.span
    if span is None or span.line != span.end_line or not span.source_line:
        return "the expression"
    return span.source_line[span.column - 1 : span.end_column - 1]
