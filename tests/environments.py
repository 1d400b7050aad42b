"""The Python environments the live tests run their jobs in, and what a test does without one.

vLLM (``.venv-vllm``, made by ``scripts/setup-vllm``) and verl (``.venv-verl``,
``scripts/setup-verl``) pin their own torch and transformers, so their jobs run in
environments of their own, named here (``LAYOUTLANG_VLLM_PYTHON`` / ``LAYOUTLANG_VERL_PYTHON``
override them). ``scripts/test`` makes both before the suite runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("LAYOUTLANG_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
VERL_PYTHON = Path(os.environ.get("LAYOUTLANG_VERL_PYTHON", ROOT / ".venv-verl" / "bin" / "python"))

_SETUP = {VLLM_PYTHON: ("vLLM", "scripts/setup-vllm"), VERL_PYTHON: ("verl", "scripts/setup-verl")}


def require(python: Path, *modules: str) -> None:
    """Skip the calling test when ``python`` (or one of ``modules`` in it) is missing; under
    CI, fail it instead: CI must prove the real engines and frameworks, never skip them."""
    what, setup = _SETUP.get(python, (str(python), "its setup script"))
    message = None
    if not python.exists():
        message = f"the {what} environment is missing ({python}): run {setup}"
    else:
        for module in modules:
            if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode != 0:
                message = f"{module} is missing from the {what} environment ({python}): run {setup}"
                break
    if message is None:
        return
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
