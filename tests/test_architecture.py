"""The source layout's rules that import-linter does not state (see docs/reference/source-layout.rst).

- no import circle between files anywhere in ``layoutlang`` and ``elastic``, counting every
  import statement (function-local ones too);
- no function-local import between project modules, except where it keeps torch out of
  the import path of the commands that do not need it, and then the line above says so.

import-linter's contracts (pyproject.toml: layers, elastic never imports the CLI,
transports know no plans, the language never imports torch) run in the test command.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("layoutlang", "elastic")

pytestmark = pytest.mark.timeout(120)


def _project_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_files():
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # A package's __init__ importing its own submodules is how it exports them, not a circle:
    # drop edges from a package to its descendants (their imports of the package stay).
    for module, targets in edges.items():
        edges[module] = {t for t in targets if not t.startswith(module + ".")}
    assert _cycles(edges) == []


def _comment_above(lines: list[str], lineno: int) -> str:
    """The line above a block of consecutive import lines that holds line ``lineno``."""
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    return lines[i].strip() if i >= 0 else ""


def _local_project_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """(line, imported module, the line above) for every import inside a function."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    names = [".".join([*base, node.module] if node.module else base)]
                else:
                    names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found.extend(
                (node.lineno, name, _comment_above(lines, node.lineno))
                for name in names
                if name.split(".")[0] in PACKAGES
            )
    return found


def _uncommented(found: list[tuple[int, str, str]]) -> list[tuple[int, str]]:
    # The only reason allowed: keeping torch out of a command's import path, said above it.
    return [(line, name) for line, name, above in found if not (above.startswith("#") and "torch" in above)]


def test_function_local_imports_between_project_modules_are_commented():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: imports {name} inside a function"
        for path in _project_files()
        for line, name in _uncommented(_local_project_imports(path))
    ]
    assert offenders == []


def test_the_local_import_check_finds_an_uncommented_one(tmp_path):
    package = tmp_path / "layoutlang" / "cli"
    package.mkdir(parents=True)
    module = package / "job.py"
    module.write_text(
        "import os\n\n"
        "def bad():\n    from ..model import Mesh\n    return Mesh\n\n"
        "def good():\n    # The runtime imports torch: here, so that other commands start without it.\n"
        "    from ..runtime import Resharder\n    import json\n    return Resharder, json\n"
    )
    found = _local_project_imports(module, tmp_path)
    assert [(line, name) for line, name, _ in found] == [(4, "layoutlang.model"), (9, "layoutlang.runtime")]
    assert _uncommented(found) == [(4, "layoutlang.model")]


def test_the_language_and_the_light_commands_start_without_torch():
    """Why the commented function-local imports exist: ``layoutlang check``, ``show``,
    ``plan`` and ``simulate`` (and ``import layoutlang``) never import torch."""
    script = (
        "import sys\n"
        "import layoutlang, layoutlang.lang, layoutlang.plan, layoutlang.plan.simulate\n"
        "from layoutlang.cli import main\n"
        "for command in (['check', 'examples/refit.layout'], ['show', 'examples/tp_to_dp.layout', '--summary'],\n"
        "                ['plan', 'examples/refit.layout'], ['simulate', 'examples/tp_to_dp.layout']):\n"
        "    assert main(command) == 0, command\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
