"""layoutlang as verl's checkpoint engine, driven through verl's own classes (verl 0.9.1 in
.venv-verl, made by scripts/setup-verl): tests/verl_job.py makes the engines as verl's
workers do (``CheckpointEngineConfig``, ``import_external_libs``,
``CheckpointEngineRegistry.new``) and makes the calls of verl's ``CheckpointEngineManager``
(``prepare``, ``build_topology``, ``init_process_group``, ``send_weights`` beside a
``BaseRollout`` server adapter fed by ``receive_weights``, ``finalize``) for 2 FSDP2 actor
ranks and 2 rollout workers. The workers start once for the module (importing verl and torch
is most of the time) and serve every scenario in one job, each on engines of its own: the
DTensor fast path (2 updates), the whole-tensor fallback, a rollout worker with another
secret, and one that never calls in; the tests read what the job recorded.

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
from environments import VERL_PYTHON, require

from layoutlang import loads, plan_layouts

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Runs tests/verl_job.py once: every scenario in the same worker processes; the job's
    folder and its results.json."""
    require(VERL_PYTHON)
    work = tmp_path_factory.mktemp("verl")
    command = [str(VERL_PYTHON), str(ROOT / "tests" / "verl_job.py"), str(work)]
    # the job and its workers import this checkout's layoutlang (PYTHONPATH first, then the
    # editable install in .venv-verl): test_the_workers_run_this_checkouts_code checks it
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=220)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-6000:]
    return work, json.loads((work / "results.json").read_text())


def scenario(job: tuple[Path, dict[str, Any]], name: str) -> tuple[Path, dict[str, Any]]:
    """A scenario's folder and record; one that should have succeeded must have."""
    work, results = job
    return work / name, results[name]


def test_the_workers_run_this_checkouts_code(job: tuple[Path, dict[str, Any]]) -> None:
    imports = job[1]["imports"]
    assert len(imports) == 4
    for where in imports.values():
        assert Path(where).resolve().is_relative_to(ROOT.resolve()), imports


@pytest.mark.parametrize("path", ["dtensor", "whole"])
def test_every_rollout_worker_receives_the_trainers_full_tensors(job: tuple[Path, dict[str, Any]], path: str) -> None:
    work, record = scenario(job, path)
    assert record["error"] is None, record["error"]
    steps = 2 if path == "dtensor" else 1
    assert len(record["metrics"]) == steps
    for step in range(steps):
        oracle = torch.load(work / f"oracle-{step}.pt")
        assert len(oracle) == 21  # embeddings, 2 layers of 9, norm, lm_head
        for rank in (2, 3):
            received = torch.load(work / f"rollout-{rank}-{step}.pt")
            assert sorted(received) == sorted(oracle)
            for name, tensor in oracle.items():
                assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
                assert torch.equal(received[name], tensor), f"step {step}, rollout rank {rank}: {name}"
    if steps > 1:  # the Adam step between the updates changed the weights, and they arrived
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


def test_the_dtensor_path_moves_fewer_bytes_than_the_whole_tensor_fallback(job: tuple[Path, dict[str, Any]]) -> None:
    (work, dtensor), (_, whole_record) = scenario(job, "dtensor"), scenario(job, "whole")
    assert dtensor["error"] is None and whole_record["error"] is None, (dtensor["error"], whole_record["error"])
    fast, whole = dtensor["metrics"][0], whole_record["metrics"][0]
    oracle = torch.load(work / "oracle-0.pt")
    model_bytes = sum(t.numel() * t.element_size() for t in oracle.values())
    assert [m["layoutlang/path"] for m in fast] == ["dtensor", "dtensor"]
    assert whole[0]["layoutlang/path"] == "whole" and whole[1] == {}  # actor rank 1 only walked the generator
    # both deliver the model to each of the 2 rollout workers; the fast path from both actor
    # ranks' own shards, the fallback from rank 0's gathered copy
    assert fast[0]["layoutlang/moved_bytes"] == whole[0]["layoutlang/moved_bytes"] == 2 * model_bytes
    assert [m["layoutlang/sent_bytes"] for m in fast] == [model_bytes, model_bytes]
    assert whole[0]["layoutlang/sent_bytes"] == 2 * model_bytes
    gather = _gather_bytes(oracle)
    assert gather == model_bytes  # each actor rank receives the half it does not hold
    assert fast[0]["layoutlang/moved_bytes"] < whole[0]["layoutlang/moved_bytes"] + gather


def test_a_rollout_worker_with_another_secret_is_refused(job: tuple[Path, dict[str, Any]]) -> None:
    work, record = scenario(job, "secret")
    expected = "rollout worker 1: init_process_group failed: LayoutValueError: error: rank 3: this worker's job secret"
    assert record["error"] is not None and f"{expected} is not the trainer's" in record["error"], record
    assert list(record["errors"]) == ["rollout worker 1"]  # the others were admitted
    assert not list(work.glob("rollout-*.pt"))


def test_a_missing_rollout_worker_stops_the_update_with_its_rank(job: tuple[Path, dict[str, Any]]) -> None:
    """Rollout worker 1 (rank 3) never calls in: after the engines' timeout (8 s) the update
    fails on every worker that took part, each naming rank 3."""
    work, record = scenario(job, "missing")
    assert record["error"] is not None, record
    assert record["error"].startswith(
        "actor 0: update failed: MemberFailure: error: rank 0: rank 3 never joined generation 0 within 8 s "
        "(no heartbeat: the process did not start its session, or cannot reach the store)"
    ), record["error"]
    assert sorted(record["errors"]) == ["actor 0", "actor 1", "rollout worker 0"]
    for name, rank in (("actor 1", 1), ("rollout worker 0", 2)):
        assert f"update failed: MemberFailure: error: rank {rank}: rank 3 never joined generation 0 within 8 s" \
            in record["errors"][name], record["errors"][name]
    assert 8 <= record["seconds"] < 60  # the timeout, not the default 300 s
    assert not list(work.glob("rollout-*.pt"))
