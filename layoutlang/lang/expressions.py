"""Integer expressions: their value now, or a function of a rule's captures for later.

Constants (``let``) and sizes are evaluated once, when their statement is read
(:func:`evaluate`). Expressions in rules (``pp[l // 4]``) and computed storage names
(``{l % 4}``) depend on the digits a pattern captures from each tensor's name; they are
checked when read and compiled (:func:`compile_expression`), because they run once per
tensor, tens of thousands of times in a large model. Unknown names and division by zero
point at their text.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..errors import LayoutNameError, LayoutValueError, did_you_mean
from ..model.rules import CaptureFn
from . import ast

__all__ = ["compile_expression", "evaluate", "names_in"]


def evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    """Integer value of ``expr`` with the names of ``env``."""
    if isinstance(expr, ast.Num):
        return expr.value
    if isinstance(expr, (ast.Name, ast.Attr)):
        if expr.name not in env:
            raise LayoutNameError(f"unknown name '{expr.name}'", expr.span, did_you_mean(expr.name, env))
        return env[expr.name]
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
    """Every name ``expr`` uses, in reading order."""
    if isinstance(expr, (ast.Name, ast.Attr)):
        return [expr]
    if isinstance(expr, ast.Num):
        return []
    if isinstance(expr, ast.Neg):
        return names_in(expr.operand)
    return names_in(expr.left) + names_in(expr.right)


def compile_expression(expr: ast.Expr, constants: Mapping[str, int], captures: Collection[str]) -> CaptureFn:
    """A function of the captures' values; names are checked now, divisions when it is called.

    The expression is compiled to Python with the constants folded in.
    """
    for name in names_in(expr):
        if name.name not in captures and name.name not in constants:
            raise LayoutNameError(
                f"unknown name '{name.name}' (captures of the pattern: {', '.join(sorted(captures)) or 'none'})",
                name.span,
                did_you_mean(name.name, [*captures, *constants]),
            )
    divisions: list[ast.BinOp] = []

    def source(node: ast.Expr) -> str:
        if isinstance(node, ast.Num):
            return str(node.value)
        if isinstance(node, ast.Name) and node.name in captures:
            return f"captures[{node.name!r}]"
        if isinstance(node, (ast.Name, ast.Attr)):
            return str(constants[node.name])
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

    # the source is built from the syntax tree above: integers, captures[...] and operators only
    function: CaptureFn = eval(f"lambda captures: {source(expr)}", {"divide": divide})
    return function
