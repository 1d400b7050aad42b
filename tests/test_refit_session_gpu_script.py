"""tests/gpu/refit_session_gpu.py (the refit session over NCCL on a machine with three or more
GPUs) keeps working: its ``--cpu`` mode runs the same steps on CPU processes over gloo (an
engine lost and shrunk away, a new engine process admitted and filled, every byte verified)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def test_the_gpu_scripts_steps_pass_on_cpu_processes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "refit_session_gpu.py"), "--cpu", "--timeout", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for step in ("start", "lose", "join"):
        assert any(line.split()[:2] == [step, "PASS"] for line in lines), done.stdout
    assert "bytes verified" in done.stdout and "all steps passed" in done.stdout
