"""layoutlang as verl's checkpoint engine, driven through verl's own classes (verl 0.9.1 in
.venv-verl, made by scripts/setup-verl): tests/verl_job.py makes the engines as verl's
workers do (``CheckpointEngineConfig``, ``import_external_libs``,
``CheckpointEngineRegistry.new``) and makes the calls of verl's ``CheckpointEngineManager``
(``prepare``, ``build_topology``, ``init_process_group``, ``send_weights`` beside a
``BaseRollout`` server adapter fed by ``receive_weights``, ``finalize``) for 2 FSDP2 actor
ranks and 2 rollout workers.

The oracle is the trainer's own: after each Adam step actor rank 0 saves every parameter's
``full_tensor()`` with torch, and every rollout worker must have received exactly those
values, for every parameter. The plan statistics show what the DTensor fast path saves
over verl's whole-tensor generator.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from layoutlang import loads, plan_layouts

ROOT = Path(__file__).resolve().parents[1]
VERL_PYTHON = Path(os.environ.get("LAYOUTLANG_VERL_PYTHON", ROOT / ".venv-verl" / "bin" / "python"))

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def run_job(work: Path, *args: str, timeout: float = 200) -> tuple[int, str]:
    if not VERL_PYTHON.exists():
        message = f"the verl environment is missing ({VERL_PYTHON}): run scripts/setup-verl"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must prove the real framework, never skip it
        pytest.skip(message)
    command = [str(VERL_PYTHON), str(ROOT / "tests" / "verl_job.py"), str(work), *args]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output


@pytest.fixture(scope="module", params=["dtensor", "whole"])
def refit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp(f"verl-{request.param}")
    steps = 2 if request.param == "dtensor" else 1
    code, output = run_job(work, "--path", request.param, "--steps", str(steps))
    assert code == 0, output[-6000:]
    return {"work": work, "steps": steps, "path": request.param,
            "metrics": json.loads((work / "metrics.json").read_text())}


def test_every_rollout_worker_receives_the_trainers_full_tensors(refit: dict[str, Any]) -> None:
    work = refit["work"]
    for step in range(refit["steps"]):
        oracle = torch.load(work / f"oracle-{step}.pt")
        assert len(oracle) == 21  # embeddings, 2 layers of 9, norm, lm_head
        for rank in (2, 3):
            received = torch.load(work / f"rollout-{rank}-{step}.pt")
            assert sorted(received) == sorted(oracle)
            for name, tensor in oracle.items():
                assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
                assert torch.equal(received[name], tensor), f"step {step}, rollout rank {rank}: {name}"
    if refit["steps"] > 1:  # the Adam step between the updates changed the weights, and they arrived
        assert not torch.equal(torch.load(work / "oracle-0.pt")["lm_head.weight"],
                               torch.load(work / "oracle-1.pt")["lm_head.weight"])


def _gather_bytes(oracle: dict[str, torch.Tensor]) -> int:
    """What verl's ``full_tensor()`` generator moves among the actor ranks before the
    fallback sends a byte: the plan from the FSDP2 layout to every tensor whole on both
    actor ranks (layoutlang's statistics of that all-gather)."""
    tensors = "\n".join(f'tensor "{n}" [{", ".join(map(str, t.shape))}] fp32' for n, t in oracle.items())
    program = loads(
        f"{tensors}\nmesh train [fsdp = 2] on ranks 0..1\n"
        "layout fsdp on train { default: fsdp = shard(0) }\nlayout whole on train { default: replicate }\n"
    )
    return plan_layouts(program.layouts["fsdp"], program.layouts["whole"]).stats.moved


def test_the_dtensor_path_moves_fewer_bytes_than_the_whole_tensor_fallback(tmp_path_factory) -> None:
    results = {}
    for path in ("dtensor", "whole"):
        work = tmp_path_factory.getbasetemp() / f"verl-{path}0"
        if not (work / "metrics.json").exists():
            pytest.skip("the refits of both paths run first (test_every_rollout_worker_receives...)")
        results[path] = json.loads((work / "metrics.json").read_text())[0]
    fast, whole = results["dtensor"], results["whole"]
    model_bytes = sum(t.numel() * t.element_size()
                      for t in torch.load(tmp_path_factory.getbasetemp() / "verl-dtensor0" / "oracle-0.pt").values())
    assert [m["layoutlang/path"] for m in fast] == ["dtensor", "dtensor"]
    assert whole[0]["layoutlang/path"] == "whole" and whole[1] == {}  # actor rank 1 only walked the generator
    # both deliver the model to each of the 2 rollout workers; the fast path from both actor
    # ranks' own shards, the fallback from rank 0's gathered copy
    assert fast[0]["layoutlang/moved_bytes"] == whole[0]["layoutlang/moved_bytes"] == 2 * model_bytes
    assert [m["layoutlang/sent_bytes"] for m in fast] == [model_bytes, model_bytes]
    assert whole[0]["layoutlang/sent_bytes"] == 2 * model_bytes
    oracle = torch.load(tmp_path_factory.getbasetemp() / "verl-dtensor0" / "oracle-0.pt")
    gather = _gather_bytes(oracle)
    assert gather == model_bytes  # each actor rank receives the half it does not hold
    assert fast[0]["layoutlang/moved_bytes"] < whole[0]["layoutlang/moved_bytes"] + gather


def test_a_rollout_worker_with_another_secret_is_refused(tmp_path: Path) -> None:
    code, output = run_job(tmp_path, "--bad-secret-rank", "3")
    assert code == 1, output[-4000:]
    error = (tmp_path / "error.txt").read_text()
    expected = "rollout worker 1: init_process_group failed: LayoutValueError: error: rank 3: this worker's job secret"
    assert f"{expected} is not the trainer's" in error
    assert not list(tmp_path.glob("rollout-*.pt"))


def test_a_missing_rollout_worker_stops_the_update_with_its_rank(tmp_path: Path) -> None:
    code, output = run_job(tmp_path, "--absent-rank", "3", "--timeout", "8")
    assert code == 1, output[-4000:]
    error = (tmp_path / "error.txt").read_text()
    assert "update failed" in error and "3" in error, error
    assert not list(tmp_path.glob("rollout-*.pt"))
