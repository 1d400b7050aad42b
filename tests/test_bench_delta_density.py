"""``benchmarks/bench_delta_density.py`` runs (FSDP2 on 2 gloo ranks) and prints sane figures.

A smoke run with tiny settings, as a user would run it: the table has one row per model and
step, every fraction of changed bf16 elements is in [0, 1], and no delta costs more than
the dense refit plus its per-tensor headers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_delta_density.py"
HEADER_BYTES = 8
STEPS = 2


def test_bench_delta_density_smoke(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    # torchrun's variables (a launcher around pytest) must not leak into the script's own group
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--lrs", "1e-5", "--hidden", "32",
            "--vocab", "128", "--seq", "16", "--batch", "2", "--experts", "4", "--json", str(figures)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=170, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("bench_delta_density: ")

    rows = [line.split() for line in lines if line.split()[:1] in (["llama"], ["qwen3_moe"])]
    per_step = [r for r in rows if len(r) == 12]  # the per-step table, not the summary
    assert [(r[0], r[1], int(r[2])) for r in per_step] == [
        (model, "1e-05", step) for model in ("llama", "qwen3_moe") for step in range(1, STEPS + 1)
    ]
    for model, _lr, _step, _loss, fraction, changed, total, _fp32, dense, delta, ratio, encodings in per_step:
        assert 0.0 <= float(fraction.rstrip("%")) / 100 <= 1.0
        assert 0 <= int(changed) <= int(total)
        assert int(dense) == 2 * int(total)
        tensors = sum(int(n) for n in encodings.split("/"))
        assert tensors > 0, model
        assert int(delta) <= 1.01 * int(dense) + HEADER_BYTES * tensors
        assert float(ratio.rstrip("x")) > 0

    written = json.loads(figures.read_text())["rows"]
    assert len(written) == len(per_step)
    assert all(0.0 <= r["fraction"] <= 1.0 and r["changed"] <= r["total"] for r in written)
