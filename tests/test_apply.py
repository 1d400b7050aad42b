"""``layoutlang apply`` end to end, as a user runs it: in a subprocess, launched alone
(local gloo workers) and under torchrun, with synthetic weights and with a safetensors
checkpoint written back per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layoutlang
from layoutlang.io.safetensors import read_safetensors_header
from layoutlang.io.weights import synthetic_box, write_safetensors

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAYOUTLANG, *args], cwd=cwd, capture_output=True, text=True, timeout=280, env=env or os.environ.copy()
    )


def test_apply_alone_runs_local_workers_and_verifies_every_byte():
    result = run("apply", str(EXAMPLES / "tp_to_dp.layout"), "--compare", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["ranks"] == 6
    reshard, broadcast = report["runs"]["reshard"], report["runs"]["broadcast"]
    plan = layoutlang.compile_plan(layoutlang.load(EXAMPLES / "tp_to_dp.layout"))
    assert reshard["bytes"]["network"] == plan.stats.bytes["network"]
    assert reshard["moved_bytes"] == plan.stats.lower_bound
    # every destination byte was compared: 4 replicas of a 1024 x 1024 bf16 tensor
    assert reshard["verified_bytes"] == broadcast["verified_bytes"] == 4 * 1024 * 1024 * 2
    assert len(reshard["fingerprints"]) == 1


def test_apply_reads_a_checkpoint_and_writes_per_rank_files(tmp_path):
    program = layoutlang.load(EXAMPLES / "uneven.layout")
    # A full checkpoint of the logical tensors (what a training job saves).
    full = {}
    for index, (name, tensor) in enumerate(program.tensors.items()):
        values = synthetic_box(index + 7, tensor.shape, tensor.dtype, (0,) * len(tensor.shape), tensor.shape)
        full[name] = values
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_safetensors(checkpoint / "model.safetensors", full)
    out = tmp_path / "out"
    result = run("apply", str(EXAMPLES / "uneven.layout"), "--from", str(checkpoint), "--to", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
    destination = program.layouts["infer_uneven"]
    for rank in destination.mesh.ranks:
        path = out / f"rank{rank:05d}.safetensors"
        header, _ = read_safetensors_header(path)
        assert header["__metadata__"]["layout"] == "infer_uneven"
        from layoutlang.io.weights import SafetensorsCheckpoint

        written = SafetensorsCheckpoint(path)
        for name in program.tensors:
            for box in destination.boxes(name, rank):
                storage_shape = destination.storage_shape(box.storage, rank)
                got = written.read_box(box.storage, program.tensors[name].dtype, storage_shape, box.storage_offsets, box.sizes)
                assert torch.equal(got, full[name][box.slices()]), (rank, name)


def test_apply_reports_a_bad_program_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.layout"
    bad.write_text('mesh m [tp = 2]\ntensor "w" [4] fp32\nlayout a on m { "w": tp = shard(3) }\nreshard a -> a\n')
    result = run("apply", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "bad.layout:3" in result.stderr


def test_apply_under_torchrun_joins_the_job():
    env = os.environ.copy()
    env.pop("RANK", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "layoutlang.cli",
        "apply",
        str(EXAMPLES / "colocated.layout"),
        "--json",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    start = result.stdout.index("{")
    report = json.loads(result.stdout[start:])
    assert report["ok"] and report["ranks"] == 4
    assert report["runs"]["reshard"]["bytes"]["local"] > 0  # colocated: part of the refit is a local copy
