"""The ``mesh`` statement: named axes and the ranks they span.

``mesh infer [dp = 2, tp = 4] on ranks 8..15`` (both ends included; a list may mix ranks
and ranges; without ``on ranks`` the mesh spans 0, 1, ...). The rules of a mesh itself
(axes unique and at least 1, one rank per position, no rank twice) are the model's
(:class:`~layoutlang.model.Mesh`); here they get the place of the offending text, and
sizes too large to build are refused before anything is built.
"""

from __future__ import annotations

import math

from ..errors import LayoutError, LayoutValueError
from ..model import Mesh
from ..model.mesh import check_axis_name, check_axis_size, shape_text
from . import ast
from .expressions import evaluate
from .limits import INT64_MAX, MAX_MESH_RANKS
from .scope import Scope

__all__ = ["mesh"]


def mesh(scope: Scope, node: ast.MeshDecl) -> Mesh:
    """The mesh a statement declares, with the constants of ``scope``."""
    axes: list[tuple[str, int]] = []
    for axis in node.axes:
        try:
            check_axis_name(node.name, axis.name, [a for a, _ in axes])
            size = evaluate(axis.size, scope.constants)
            check_axis_size(node.name, axis.name, size)
        except LayoutError as err:
            err.with_span(axis.span)
            raise
        axes.append((axis.name, size))
    positions = math.prod(size for _, size in axes)
    if positions > MAX_MESH_RANKS:
        largest = max(node.axes, key=lambda a: dict(axes)[a.name])
        raise LayoutValueError(
            f"mesh '{node.name}' has {positions} positions; a mesh has at most {MAX_MESH_RANKS} ranks",
            largest.span,
        )
    ranks = _ranks(scope, node, node.ranks, axes, positions) if node.ranks is not None else None
    try:
        return Mesh(node.name, axes, ranks)
    except LayoutError as err:
        err.with_span(node.ranks_span or node.span)
        raise


def _ranks(
    scope: Scope,
    node: ast.MeshDecl,
    items: tuple[ast.Expr | ast.Range, ...],
    axes: list[tuple[str, int]],
    positions: int,
) -> list[int]:
    """The ranks ``on ranks`` lists, ranges expanded."""
    ranks: list[int] = []
    for item in items:
        if isinstance(item, ast.Range):
            start, stop = evaluate(item.start, scope.constants), evaluate(item.stop, scope.constants)
            if stop < start:
                raise LayoutValueError(f"empty rank range {start}..{stop} (both ends are included)", item.span)
            if len(ranks) + stop - start + 1 > positions:  # before building a huge list
                raise LayoutValueError(
                    f"mesh '{node.name}' ({shape_text(axes)}) has {positions} positions but more ranks "
                    f"(the range {start}..{stop} alone has {stop - start + 1})",
                    item.span,
                )
            ranks.extend(range(start, stop + 1))
        else:
            ranks.append(evaluate(item, scope.constants))
    for rank in ranks:
        if rank > INT64_MAX:
            raise LayoutValueError(f"mesh '{node.name}' lists rank {rank}, which is too large", node.ranks_span)
    return ranks
