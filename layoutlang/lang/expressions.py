"""Integer expressions: their value now, or a function of a rule's captures for later.

Constants (``let``) and sizes are evaluated once, when their statement is read
(:func:`evaluate`). Expressions in rules (``pp[l // 4]``) and computed storage names
(``{l % 4}``) depend on the digits a pattern captures from each tensor's name; they are
checked when read and compiled (:func:`compile_expression`), because they run once per
tensor, tens of thousands of times in a large model. Unknown names, unknown functions,
wrong numbers of arguments and division by zero point at their text.

Names are constants (``let``), a model description's constants (``cfg.hidden_size``) and
the sizes of mesh axes (``infer.tp``); :class:`~layoutlang.lang.scope.Constants` holds all
three under these names. The functions are :data:`FUNCTIONS`.

Values are 64-bit integers (:data:`~.limits.INT64_MIN` to :data:`~.limits.INT64_MAX`), as
the core counts: every number, name and intermediate result :func:`evaluate` meets is
checked, and the first one past the range is an error at its text. Python's integers have
no bound of their own, so without this a chain of ``let a2 = a1 * a1`` lines squares its
value's size at each line, and 40 of them run for minutes and exhaust memory.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from ..errors import LayoutNameError, LayoutValueError, closest_name, did_you_mean
from ..model.rules import CaptureFn
from . import ast
from .limits import INT64_MAX, INT64_MIN

__all__ = ["FUNCTIONS", "cdiv", "compile_expression", "evaluate", "names_in"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division, ``a / b`` rounded toward plus infinity (vLLM's and Triton's ``cdiv``)."""
    return -(-a // b)


#: name -> (the function, the fewest arguments, the most: None for any number)
FUNCTIONS: dict[str, tuple[Callable[..., int], int, int | None]] = {
    "min": (min, 2, None),
    "max": (max, 2, None),
    "cdiv": (cdiv, 2, 2),
}


def _unknown_name(expr: ast.Name | ast.Attr, known: Collection[str], extra: str = "") -> LayoutNameError:
    message = f"unknown name '{expr.name}'"
    if isinstance(expr, ast.Attr):
        # 'infer.tpp' or 'cfg.hiden_size': list what 'infer.' or 'cfg.' does name
        siblings = sorted(n for n in known if n.startswith(f"{expr.obj}."))
        if siblings:
            shown = ", ".join(siblings[:8]) + (", ..." if len(siblings) > 8 else "")
            message += f" ('{expr.obj}.' names: {shown})"
    near = closest_name(expr.name, known)
    hint = None if near is None else f"did you mean '{near}'?"
    if isinstance(expr, ast.Attr) and expr.span is not None and expr.span.included_from:
        # A preset reads a mesh's axis or a config's key that its includer must provide: a
        # near name of the preset's own is not the fix
        return LayoutNameError(message + extra, expr.span, _included_attr_hint(expr, known, siblings=bool(siblings)))
    included = isinstance(expr, ast.Name) and expr.span is not None and expr.span.included_from
    if included and (near is None or "." in near):
        # An included file (a preset) reads a constant its includer must define: a near
        # name such as a mesh's 'train.pp' is not the fix, a 'let' before the include is.
        assert expr.span is not None
        hint = f"define it before the include at {expr.span.included_from[0]}: let {expr.name} = ..."
    return LayoutNameError(message + extra, expr.span, hint)


def _included_attr_hint(expr: ast.Attr, known: Collection[str], *, siblings: bool) -> str:
    """What the includer of a file that reads ``expr`` (``infer.dp``, ``cfg.num_experts``) must
    declare before the include. ``known`` may know which of its prefixes are meshes
    (:class:`~layoutlang.lang.scope.Constants`)."""
    assert expr.span is not None and expr.span.included_from
    where = expr.span.included_from[0]
    axis = expr.name.partition(".")[2]
    if expr.obj in getattr(known, "mesh_names", ()):
        return (
            f"the included file reads the size of axis '{axis}' of mesh '{expr.obj}': give the mesh that axis "
            f"(of size 1 if it does not split) where it is declared, before the include at {where}"
        )
    if siblings:
        return (
            f"the model description '{expr.obj}' has no '{axis}', which the included file reads: add "
            f"\"{axis}\" to its config.json"
        )
    if expr.obj == "cfg":  # the presets' name for the model description
        return (
            f"the included file reads '{expr.name}': import the model's config before the include at {where}: "
            'tensors from hf "PATH/config.json" as cfg'
        )
    return (
        f"the included file reads '{expr.name}': declare mesh '{expr.obj}' with axis '{axis}' before the include "
        f"at {where}"
    )



def _check_call(node: ast.Call) -> Callable[..., int]:
    """The function a call names, once its name and number of arguments are checked."""
    if node.function not in FUNCTIONS:
        raise LayoutNameError(
            f"unknown function '{node.function}' (functions: {', '.join(FUNCTIONS)})",
            node.function_span,
            did_you_mean(node.function, FUNCTIONS),
        )
    function, fewest, most = FUNCTIONS[node.function]
    count = len(node.args)
    if count < fewest or (most is not None and count > most):
        wanted = f"{fewest}" if most == fewest else f"at least {fewest}"
        raise LayoutValueError(f"'{node.function}' takes {wanted} arguments, not {count}", node.span)
    return function


def _in_range(value: int, expr: ast.Expr) -> int:
    """``value``, the value of ``expr``, refused past the 64-bit integers."""
    if INT64_MIN <= value <= INT64_MAX:
        return value
    digits = len(str(abs(value))) if value.bit_length() < 4096 else None  # str() of a huge int is slow
    shown = str(value) if digits is not None and digits <= 40 else f"a number of {digits or 'thousands of'} digits"
    what = "the integer" if isinstance(expr, ast.Num) else "the value" if isinstance(expr, ast.Name | ast.Attr) else (
        "this expression's value"
    )
    raise LayoutValueError(
        f"{what} {shown} is outside the 64-bit integers layoutlang computes with"
        f" ({INT64_MIN:,} to {INT64_MAX:,})",
        expr.span,
        "no size, rank or count of a layout is that large: look for a mistyped number, or a 'let' chain"
        " that multiplies a value by itself",
    )


def evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    """Integer value of ``expr`` with the names of ``env``; every value on the way is a 64-bit integer."""
    if isinstance(expr, ast.Num):
        return _in_range(expr.value, expr)
    if isinstance(expr, (ast.Name, ast.Attr)):
        if expr.name not in env:
            raise _unknown_name(expr, env)
        return _in_range(env[expr.name], expr)
    if isinstance(expr, ast.Neg):
        return _in_range(-evaluate(expr.operand, env), expr)
    if isinstance(expr, ast.Call):
        function = _check_call(expr)
        args = [evaluate(a, env) for a in expr.args]
        if expr.function == "cdiv" and args[1] == 0:
            raise LayoutValueError("division by zero in 'cdiv'", expr.span)
        return _in_range(function(*args), expr)
    left = evaluate(expr.left, env)
    right = evaluate(expr.right, env)
    if expr.op == "+":
        return _in_range(left + right, expr)
    if expr.op == "-":
        return _in_range(left - right, expr)
    if expr.op == "*":
        return _in_range(left * right, expr)
    if right == 0:
        raise LayoutValueError(f"division by zero in '{expr.op}'", expr.span)
    return _in_range(left // right if expr.op == "//" else left % right, expr)


def names_in(expr: ast.Expr) -> list[ast.Name | ast.Attr]:
    """Every name ``expr`` uses, in reading order."""
    if isinstance(expr, (ast.Name, ast.Attr)):
        return [expr]
    if isinstance(expr, ast.Num):
        return []
    if isinstance(expr, ast.Neg):
        return names_in(expr.operand)
    if isinstance(expr, ast.Call):
        return [name for a in expr.args for name in names_in(a)]
    return names_in(expr.left) + names_in(expr.right)


def compile_expression(expr: ast.Expr, constants: Mapping[str, int], captures: Collection[str]) -> CaptureFn:
    """A function of the captures' values; names and functions are checked now, divisions
    when it is called.

    The expression is compiled to Python with the constants folded in.
    """
    for name in names_in(expr):
        if name.name not in captures and name.name not in constants:
            extra = f" (captures of the pattern: {', '.join(sorted(captures)) or 'none'})"
            raise _unknown_name(name, [*captures, *constants], extra)
    divisions: list[ast.BinOp | ast.Call] = []

    def source(node: ast.Expr) -> str:
        if isinstance(node, ast.Num):
            return str(node.value)
        if isinstance(node, ast.Name) and node.name in captures:
            return f"captures[{node.name!r}]"
        if isinstance(node, (ast.Name, ast.Attr)):
            return str(constants[node.name])
        if isinstance(node, ast.Neg):
            return f"(-{source(node.operand)})"
        if isinstance(node, ast.Call):
            _check_call(node)
            if node.function != "cdiv":
                return f"{node.function}({', '.join(source(a) for a in node.args)})"
            divisions.append(node)
            which = len(divisions) - 1  # before the arguments append their own divisions
            return f"divide({source(node.args[0])}, {source(node.args[1])}, {which})"
        if node.op in ("//", "%"):
            divisions.append(node)
            which = len(divisions) - 1  # before the operands append their own divisions
            return f"divide({source(node.left)}, {source(node.right)}, {which})"
        return f"({source(node.left)} {node.op} {source(node.right)})"

    def divide(left: int, right: int, which: int) -> int:
        node = divisions[which]
        op = "cdiv" if isinstance(node, ast.Call) else node.op
        if right == 0:
            raise LayoutValueError(f"division by zero in '{op}'", node.span)
        if op == "cdiv":
            return cdiv(left, right)
        return left // right if op == "//" else left % right

    # the source is built from the syntax tree above: integers, captures[...], min, max and operators only
    function: CaptureFn = eval(f"lambda captures: {source(expr)}", {"divide": divide, "min": min, "max": max})
    return function
