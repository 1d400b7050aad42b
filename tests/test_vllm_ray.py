"""vLLM engines as Ray actors, refitted from a trainer of Ray actors (as RL frameworks run them),
and an engine actor that Ray restarts mid-refit rejoining by itself.

tests/vllm_ray_job.py runs once for the module (with ``.venv-vllm``'s Python, which has Ray):
a local Ray cluster of two nodes, the trainer's 2 FSDP2 ranks (gloo) as actors on one, 2 vLLM
engines of tensor parallel 2 as ``ray.remote(LLM)`` actors on the other, driven through vLLM's
``RayVLLMWeightSyncClient``; no address or port is set by hand. The oracle is outside
layoutlang: a fresh vLLM engine loaded from the trainer's checkpoint of step 1
(``save_pretrained``), then vLLM's own reload of each later step's checkpoint, must generate
the greedy tokens every refitted engine generated after that step, and the tokens must
change from step to step (so the check can fail).
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
from environments import VLLM_PYTHON, require

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

A, B = 0, 1


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require(VLLM_PYTHON, "ray")
    work = tmp_path_factory.mktemp("vllm-ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT")}
    # its own session: the Ray cluster and every engine it starts stop with it
    process = subprocess.Popen(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_ray_job.py"), str(work)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=1400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = work / "result.json"
    assert result.exists(), output[-6000:]
    data = json.loads(result.read_text())
    assert "error" not in data, data["error"] + "\n" + output[-4000:]
    return data


def report(job: dict[str, Any], step: int) -> dict[str, Any]:
    return job["steps"][str(step)]["report"]


def steps(job: dict[str, Any]) -> range:
    """The refits the job ran: until B rejoined (how many depends on the machine's load), and one more."""
    return range(1, job["last_step"] + 1)


def test_two_nodes_and_no_address_set_by_hand(job: dict[str, Any]) -> None:
    assert job["nodes"] == 2
    # both trainer ranks joined through the rendezvous actor; the store took a free port
    assert sorted(job["membership"]) == ["0", "1"]
    host, port = job["start"]["store"]
    assert port > 0 and host


def test_every_engine_generates_the_fresh_engines_tokens_after_every_refit(job: dict[str, Any]) -> None:
    for step in steps(job):
        expected = job["oracle"][str(step)]
        for name, tokens in job["tokens"][str(step)].items():
            assert tokens == expected, f"engine {name} after step {step}"
    # both engines served after the first refit and the last (B was restarting in between)
    assert [sorted(job["tokens"][str(s)]) for s in (1, job["last_step"])] == [["A", "B"]] * 2
    # the checks can fail: each step's tokens differ from the previous step's
    assert all(job["oracle"][str(s)] != job["oracle"][str(s - 1)] for s in steps(job)[1:])


def test_refits_commit_on_both_engines(job: dict[str, Any]) -> None:
    assert report(job, 1)["refitted"] == [A, B]
    assert report(job, job["last_step"])["refitted"] == [A, B]
    last = report(job, job["last_step"])["step"]  # the session's step of the last refit
    assert job["steps"][str(job["last_step"])]["versions"] == {"0": last, "1": last}


def test_an_engine_actor_killed_mid_refit_is_lost_and_the_others_commit(job: dict[str, Any]) -> None:
    killed = job["steps"]["2"]["killed"]
    assert 0 < killed["done"] < killed["total"]  # in the middle of the trainer's sends
    assert killed["processes_gone"]  # the actor and its engine's processes, before the sends went on
    second = report(job, 2)
    assert second["lost"] == [B]
    assert second["refitted"] == [A]
    assert list(job["tokens"]["2"]) == ["A"]


def test_the_restarted_actor_rejoins_by_itself_and_nothing_else_restarts(job: dict[str, Any]) -> None:
    # Ray started B's actor again: a new process; A and the trainer's actors are the same
    assert job["engine_pids_after"][A] == job["engine_pids_before"][A]
    assert job["engine_pids_after"][B] != job["engine_pids_before"][B]
    assert job["trainer_pids_after"] == job["trainer_pids_before"]
    # nobody called add_engine: the trainer admitted it under its own index at a step boundary
    # after Ray had it up again (which one depends on the machine's load), once
    rejoined = [n for n in steps(job)[2:] if report(job, n)["joined"] == [B]]
    assert len(rejoined) == 1
    assert sorted(report(job, rejoined[0])["refitted"]) == [A, B]
    assert job["steps"][str(job["last_step"])]["states"] == {"0": "serving", "1": "serving"}
    # it caught up from an engine that holds the same boxes (A), not from the trainer
    assert report(job, rejoined[0])["recovered_from"].get("destination", 0) > 0
