"""The delta-refit guide cannot rot: its runs (``docs/snippets/delta-*.out``) are run
again from the repository root and compared, times and bandwidths left out."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
GUIDE = ROOT / "docs" / "guides" / "delta-refits.rst"

_VARYING = [(re.compile(r"\d+\.\d+ s\b"), "* s"), (re.compile(r"\d+(\.\d+)? [KMG]?i?B/s"), "* B/s")]


def steady(text: str) -> list[str]:
    """The output without what changes from run to run (times, bandwidths), columns squeezed."""
    out = []
    for line in text.rstrip("\n").splitlines():
        for pattern, replacement in _VARYING:
            line = pattern.sub(replacement, line)
        out.append(" ".join(line.split()))
    return out


@pytest.mark.parametrize("name", ["delta-apply.out", "delta-budget.out", "delta-resharder.out"])
def test_the_guides_runs_print_what_it_shows(name):
    command, _, expected = (SNIPPETS / name).read_text("utf-8").partition("\n")
    assert command.startswith("$ ")
    program, *rest = shlex.split(command[2:])
    prefix = {"layoutlang": [sys.executable, "-m", "layoutlang.cli"], "python": [sys.executable]}[program]
    result = subprocess.run([*prefix, *rest], cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert result.returncode == 0, result.stdout + result.stderr
    assert steady(result.stdout) == steady(expected)
    assert name in GUIDE.read_text("utf-8")
