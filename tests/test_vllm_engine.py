"""layoutlang refits live vLLM engines of a MoE model: greedy tokens and logprobs checked after
every step. (The Llama engines that die, restart, join and leave are tests/test_vllm_elastic.py.)

tests/vllm_refit_job.py runs once (module fixture) with the vLLM environment's Python
(``.venv-vllm``, made by ``scripts/setup-vllm``, which ``scripts/test`` runs): 2 gloo trainer
processes hold a tiny random Qwen3-MoE (float32) as FSDP2 DTensors and take real Adam steps;
after each, layoutlang refits two vLLM CPU engines of tensor parallel 2 in the first trainer's
process (data-parallel replicas of each other; one started from the checkpoint, one with random
"dummy" weights). The oracles are outside layoutlang:

(a) a fresh vLLM engine, configured identically and loaded from a safetensors checkpoint of
    the trainer's current weights (``save_pretrained``), must generate the same greedy tokens
    (same kernels, so exactly), and each step's tokens must differ from the previous step's
    (so the check can fail);
(b) transformers' forward pass with the trainer's current weights gives the log-probability
    of every generated token: the engines' must match within 1e-4 (float32 models).

And the failures: an inference layout that does not match what vLLM holds (per-tensor q/k/v
where vLLM fuses ``qkv_proj``) fails every rank before a byte moves, the engines unchanged;
an engine whose worker dies is dropped and the refit commits on the other; a trainer rank
that dies (FSDP: nothing else holds its shards) stops the refit with DataLossError, and the
engine keeps serving the last committed weights.

The bytes: the plan moves exactly what the engines hold, computed here from the model's
config (each tensor-parallel group receives the model once, and every worker the
parameters vLLM replicates), 2x less than sending every worker the whole model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from environments import VLLM_PYTHON, require

ROOT = Path(__file__).resolve().parents[1]

# each scenario's job starts 3 engines at once and 3 fresh ones, on 2 cores
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module", params=["qwen3_moe"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require(VLLM_PYTHON)
    scenario = request.param
    work = tmp_path_factory.mktemp(f"vllm-{scenario}")
    ports = ",".join(map(str, free_ports(4)))
    command = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_refit_job.py"), scenario, str(work), ports]
    # its own session: every process it starts (engine cores, workers) is stopped with it
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=1400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = work / "result.json"
    assert result.exists(), output[-6000:]
    records = {int(k): v for k, v in json.loads(result.read_text()).items()}
    for rank, record in records.items():
        assert "error" not in record, f"trainer rank {rank}:\n{record['error']}\n{output[-3000:]}"
    return {"scenario": scenario, "records": records, "work": work}


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    out = job["records"][0]["steps"]
    assert len(out) == 3
    return out


def test_every_refit_generates_the_tokens_of_a_fresh_engine(job):
    for step, observed in enumerate(steps(job), 1):
        for engine, generated in enumerate(observed["engines"]):
            assert generated["tokens"] == observed["fresh"]["tokens"], (step, engine)


def test_a_refit_equals_vllms_own_reload_where_that_reload_is_right(job):
    """vLLM's own path for whole tensors (the fresh engine reloaded with the same weights
    through load_weights under layerwise reload, as its NCCL engine does) gives, where it
    agrees with the fresh load, the very logprobs of the refitted engines. vLLM 0.32 on the CPU
    skips the MoE experts' prepack on a reload, so for Qwen3-MoE its own reload is wrong and the
    refit (which repacks them) is compared with the fresh engine above instead."""
    agreeing = [s for s in steps(job) if s["fresh_reloaded"]["tokens"] == s["fresh"]["tokens"]]
    for observed in agreeing:
        for generated in observed["engines"]:
            assert generated["logprobs"] == observed["fresh_reloaded"]["logprobs"]


def test_every_refit_changes_the_tokens(job):
    before = job["records"][0]["before"][0]["tokens"]  # the engine loaded from the checkpoint
    previous = [before] + [s["fresh"]["tokens"] for s in steps(job)]
    for step in range(1, 4):
        assert previous[step] != previous[step - 1], step


def test_logprobs_match_transformers_forward_pass(job):
    for step, observed in enumerate(steps(job), 1):
        for engine, (generated, reference) in enumerate(zip(observed["engines"], observed["transformers"])):
            for prompt, (got, want) in enumerate(zip(generated["logprobs"], reference)):
                worst = max(abs(g - w) for g, w in zip(got, want))
                assert worst < 1e-4, (step, engine, prompt, worst)


def test_a_layout_the_engine_does_not_hold_fails_every_rank_before_a_byte_moves(job):
    records = job["records"]
    # the sender reports the engine's whole list; the other trainer rank the agreement's verdict
    sender = records[0]["mismatch_error"]
    assert sender is not None and "does not match the destination layout" in sender
    assert "has no parameter 'model.layers.0.self_attn.q_proj.weight'" in sender
    assert "did you mean 'model.layers.0.self_attn.qkv_proj.weight'" in sender
    assert "parameter 'model.layers.0.self_attn.qkv_proj.weight'" in sender and "not delivered" in sender
    assert "parameter 'model.embed_tokens.weight' on rank" in sender  # vLLM's padded vocabulary shard
    other = records[1]["mismatch_error"]
    assert other is not None and "AgreementError" in other and "is not ready" in other and "nothing was moved" in other
    assert records[0]["after_mismatch"] == records[0]["before"]


def test_an_engine_that_loses_a_worker_is_dropped_and_the_refit_commits_on_the_other(job):
    death = job["records"][0]["engine_death"]
    report = death["report"]
    assert report["lost"] == [1] and report["refitted"] == [0] and death["seconds"] < 60  # the timeout is 20 s
    survivor = death["survivor"]
    for got, want in zip(survivor["logprobs"], survivor["transformers"]):
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4


def test_a_trainer_rank_dying_is_data_loss_and_the_engine_keeps_the_last_committed_weights(job):
    sender = job["records"][0]
    assert sender["death_error"] is not None and sender["death_error"].startswith("DataLossError")
    assert "source rank 1 of layout 'train' is gone" in sender["death_error"]
    assert sender["death_seconds"] < 60
    assert sender["after_death"]["tokens"] == sender["engine_death"]["survivor"]["tokens"]


#: the weights vLLM keeps whole on every tensor-parallel rank (RMSNorm, Qwen3's q/k norms,
#: the MoE router, a ReplicatedLinear), by the checkpoint's names
REPLICATED_IN_VLLM = ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight", "mlp.gate.weight")


def test_the_plan_moves_exactly_what_the_engines_hold(job):
    from safetensors import safe_open

    with safe_open(str(job["work"] / "step0" / "model.safetensors"), framework="pt") as f:
        numels = {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    total = sum(numels.values())
    replicated = sum(n for name, n in numels.items() if name.endswith(REPLICATED_IN_VLLM))
    engines, tp = 2, 2
    # each engine receives the model once, and each of its workers the replicated weights
    exact = engines * (total + (tp - 1) * replicated) * 4  # float32
    plan = job["records"][0]["plan"]
    assert plan["bytes"]["network"] == exact == plan["lower_bound_bytes"]
    whole_model_to_every_worker = engines * tp * total * 4
    assert whole_model_to_every_worker / exact > 1.9
