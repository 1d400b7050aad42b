"""Live vLLM engines that die, restart, join and leave while the trainer keeps refitting them.

tests/vllm_elastic_job.py runs once for the module (with ``.venv-vllm``'s Python): a 2-rank
FSDP2 trainer taking real Adam steps on a tiny random Llama (float32) refits vLLM CPU engines of
tensor parallel 2, each a process of its own, through layoutlang's weight-transfer engine, over
one elastic refit session whose store outlives the trainer. The oracles are outside
layoutlang:

(a) a fresh vLLM engine, configured identically and loaded from a safetensors checkpoint of the
    trainer's weights (``save_pretrained``) of the first and of the last step, and the steps
    between through vLLM's own reload of their checkpoint into that engine (``load_weights``,
    which gives a fresh engine's very tokens at the first and last step: checked), must
    generate the same greedy tokens (same kernels, so exactly), and the tokens must change
    from step to step (so the check can fail); the reloaded checkpoint gives the very
    logprobs of the refitted engines;
(b) transformers' forward pass with the trainer's weights gives the log-probability of every
    generated token: the engines' must match within 1e-4.

Every assertion is about an outcome the design promises (the engines that hold a committed
step generate its tokens, nothing restarted, the clean error), never about one timing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from environments import VLLM_PYTHON, require

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0  # the session's timeout in the job

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

# engines by their index in the trainer: A, B, C at the start, B2 (B again) and D added
A, B, C, B2, D = 0, 1, 2, 3, 4


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require(VLLM_PYTHON)
    work = tmp_path_factory.mktemp("vllm-elastic")
    command = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_elastic_job.py"), "driver", str(work)]
    # its own session: every process it starts (engines, trainers) is stopped with it
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=1700)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = work / "result.json"
    assert result.exists(), output[-6000:]
    data = json.loads(result.read_text())
    assert "error" not in data, data["error"] + "\n" + _logs(work)
    return data | {"work": work}


def _logs(work: Path) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(work.glob("trainer*.log")))


def sender(job: dict[str, Any], incarnation: int = 1) -> dict[str, Any]:
    return job[f"trainer{incarnation}"]["0"]


def step(job: dict[str, Any], n: int) -> dict[str, Any]:
    return sender(job, 2 if n >= 6 else 1)["steps"][str(n)]


def fresh(job: dict[str, Any], n: int) -> list[list[int]]:
    return job["oracle"][str(n)]["fresh"]["tokens"]


def test_every_refitted_engine_generates_the_tokens_of_a_fresh_engine(job):
    expected = {1: {"A", "B", "C"}, 2: {"A", "C"}, 3: {"A", "B2", "C"}, 4: {"A", "B2", "C", "D"},
                5: {"A", "B2", "D"}, 6: {"A", "B2", "D"}, 8: {"A", "B2", "D"}}  # 7 applied nowhere (below)
    for n, engines in expected.items():
        observed = step(job, n)["engines"]
        assert set(observed) == engines, n
        for name in engines:
            assert observed[name]["tokens"] == fresh(job, n), (n, name)


def test_refits_are_deltas_dense_where_a_generation_starts(job):
    """Every refit is a delta refit: the first of a generation (a new group: step 1, the step
    that lost B, each step after an engine joined or left, the restarted trainer's first) moves
    dense; a refit in the same generation as the one before moves only what changed (attention
    and norms train here: well under half the dense bytes). Their tokens are checked above:
    B2, restarted with dummy weights, got dense and then deltas."""
    deltas = 0
    for n in range(1, 9):
        report = step(job, n)["report"]
        delta = report["delta"]
        previous = step(job, n - 1)["report"] if n > 1 else None
        if previous is None or previous["generation"] != report["generation"] or n == 6:
            assert delta["messages"]["indices"] == delta["messages"]["bitmask"] == 0, (n, delta)
        elif delta["dense_bytes"]:
            assert delta["wire_bytes"] * 2 < delta["dense_bytes"], (n, delta)
            assert not delta["stale"], (n, delta)
            deltas += 1
    # steps 3, 7 and 8 follow a step of their generation unless a recovery came between
    assert deltas >= 1, [(n, step(job, n)["report"]["generation"]) for n in range(1, 9)]


def test_vllms_own_reload_gives_a_fresh_engines_tokens(job):
    """What makes the reload an oracle for the steps between: at the first and the last step
    a fresh engine and the same checkpoint reloaded into an engine agree."""
    fresh_steps = [n for n, record in job["oracle"].items() if record["loaded"] == "fresh"]
    assert sorted(fresh_steps, key=int) == ["1", "8"]
    for n in fresh_steps:
        record = job["oracle"][n]
        assert record["fresh"]["tokens"] == record["fresh_reloaded"]["tokens"], n
        assert record["fresh"]["logprobs"] == record["fresh_reloaded"]["logprobs"], n


def test_every_refit_changes_the_tokens(job):
    previous = job["before"]["A"]["tokens"]  # the engine loaded from the first checkpoint
    for n in range(1, 9):
        assert fresh(job, n) != previous, n
        previous = fresh(job, n)


def test_logprobs_match_transformers_and_vllms_own_reload(job):
    for n in (1, 2, 3, 4, 5, 6, 8):
        reloaded = job["oracle"][str(n)]["fresh_reloaded"]
        for name, generated in step(job, n)["engines"].items():
            for prompt, (got, want) in enumerate(zip(generated["logprobs"], generated["transformers"])):
                worst = max(abs(g - w) for g, w in zip(got, want))
                assert worst < 1e-4, (n, name, prompt, worst)
            if reloaded["tokens"] == generated["tokens"]:
                assert generated["logprobs"] == reloaded["logprobs"], (n, name)


def test_a_layout_the_engines_do_not_hold_fails_every_rank_before_a_byte_moves(job):
    first, other = sender(job), job["trainer1"]["1"]
    assert first["mismatch_error"] is not None and "does not match the destination layout" in first["mismatch_error"]
    assert "has no parameter 'model.layers.0.self_attn.q_proj.weight'" in first["mismatch_error"]
    assert "did you mean 'model.layers.0.self_attn.qkv_proj.weight'" in first["mismatch_error"]
    assert "not delivered" in first["mismatch_error"]
    assert other["mismatch_error"] is not None and "AgreementError" in other["mismatch_error"]
    assert "is not ready" in other["mismatch_error"] and "nothing was moved" in other["mismatch_error"]
    assert first["after_mismatch"] == job["before"]  # the engines are unchanged


def test_an_engine_whose_worker_dies_mid_refit_is_dropped_and_the_others_commit(job):
    trainer = sender(job)
    assert trainer["killed_at"]["done"] < trainer["killed_at"]["total"]  # in the middle of the transfer
    report = step(job, 2)["report"]
    assert report["lost"] == [B] and sorted(report["refitted"]) == [A, C]
    assert trainer["lost_callbacks"] == [[B]]  # on_engines_lost, once
    assert step(job, 2)["seconds"] < TIMEOUT  # within the same send_weights(), before its deadline
    lost = [r for r in report["recoveries"] if r["lost"]]
    assert lost and {4, 5} <= {rank for r in lost for rank in r["lost"]}  # the whole engine
    # the trainer and engines A and C kept their processes; one trainer_init (after the mismatch)
    assert trainer["pid"] == trainer["pid_at_end"] and trainer["trainer_inits"] == 2
    for name in ("A", "C"):
        assert job["pids_after"][name] == job["pids"][name]


def test_a_restarted_engine_is_filled_from_another_engine_not_from_the_trainer(job):
    report = step(job, 3)["report"]
    assert report["joined"] == [B2] and sorted(report["refitted"]) == sorted([A, B2, C])
    grew = [r for r in report["recoveries"] if r["joined"]]
    assert grew and all(r["recovered_from"]["destination"] > 0 and r["recovered_from"]["source"] == 0 for r in grew)
    assert job["pids"]["B2"]["host"] != job["pids"]["B"]["host"]  # a new process
    engines = step(job, 3)["engines"]
    assert engines["B2"]["tokens"] == engines["A"]["tokens"] == engines["C"]["tokens"]


def test_an_engine_added_grows_the_fleet_and_one_removed_shrinks_it(job):
    grow = step(job, 4)["report"]
    assert grow["joined"] == [D] and sorted(grow["refitted"]) == sorted([A, B2, C, D])
    shrink = step(job, 5)["report"]
    assert shrink["left"] == [C] and shrink["lost"] == [] and sorted(shrink["refitted"]) == sorted([A, B2, D])
    assert sender(job)["removed_engine"]["tokens"] == fresh(job, 4)  # C keeps serving what it had
    # nothing else was rebuilt: every engine kept its processes
    for name in ("A", "B2", "C", "D"):
        assert job["pids_after"][name] == job["pids"][name], name


def test_a_restarted_trainer_reattaches_to_the_live_engines(job):
    assert job["outage"] == {name: job["outage"][name] for name in ("A", "B2", "D")}
    for name, generated in job["outage"].items():  # served the last committed weights meanwhile
        assert generated["tokens"] == fresh(job, 5), name
    second = sender(job, 2)
    assert second["trainer_inits"] == 1 and second["pid"] != sender(job)["pid"]
    assert {tuple(r) for r in second["engine_ranks"].values()} == {(2, 3), (8, 9), (10, 11)}
    report = step(job, 6)["report"]
    assert sorted(report["refitted"]) == [0, 1, 2] and report["lost"] == []
    for name in ("A", "B2", "D"):
        assert job["pids_after"][name] == job["pids"][name], name


def test_an_engine_that_cannot_prepare_a_refit_holds_every_engine_back(job):
    failed = step(job, 7)
    report = failed["report"]
    assert report["refitted"] == [] and report["lost"] == [] and report["joined"] == []
    assert sorted(report["held_back"]) == [0, 1] and list(report["failed"]) == ["2"]  # A, B2 held back by D
    reason = report["failed"]["2"]
    assert f"could not receive or prepare step {report['step']}" in reason  # the session's step
    assert "'model.norm.weight' changed" in reason and "torch.float64" in reason
    before = step(job, 6)["report"]["step"]
    assert failed["versions"] == {"0": before, "1": before, "2": before}
    assert failed["states"] == {"0": "serving", "1": "serving", "2": "serving"}
    assert fresh(job, 7) != fresh(job, 6)  # had any engine applied step 7, its tokens would show it
    for name, generated in failed["engines"].items():  # every engine serves step 6's weights, bit for bit
        assert generated["tokens"] == fresh(job, 6), name
        assert generated["logprobs"] == step(job, 6)["engines"][name]["logprobs"], name
    repaired = step(job, 8)["report"]  # the parameter put back: the next refit applies everywhere
    assert sorted(repaired["refitted"]) == [0, 1, 2] and repaired["failed"] == {} and repaired["held_back"] == []
    assert set(step(job, 8)["versions"].values()) == {repaired["step"]}


def test_an_attacker_without_the_secret_gets_nothing_and_is_logged(job):
    attacker = job["attacker"]
    assert attacker["join_requests"] and attacker["forged"]
    assert all(attacker["rank"] not in members for members in job["members"])  # never admitted
    logs = "".join(path.read_text() for path in job["work"].glob("trainer1-rank*.log"))
    refused = set(re.findall(r"ignoring the store record 'refit/(gen\d+/[a-z]+(?:/\d+)?)'", logs))
    assert set(attacker["forged"]) <= refused
    assert any(key.startswith(f"gen{g}/join/") for g in attacker["join_requests"] for key in refused)
    # the job went on unharmed: the steps after the attack refit every engine (checked above)
    assert step(job, 4)["report"]["failed"] == {} and step(job, 5)["report"]["failed"] == {}


def test_the_job_secret_appears_in_no_log_output_title_or_record(job):
    assert job["secret_in_titles"] == []
    assert job["secret_in_files"] == []
    assert job["secret_in_store"] is False


#: the weights vLLM keeps whole on every tensor-parallel rank (RMSNorm), by checkpoint names
REPLICATED_IN_VLLM = ("layernorm.weight", "model.norm.weight")


def test_the_plan_moves_exactly_what_the_engines_hold(job):
    from safetensors import safe_open

    with safe_open(str(job["work"] / "step0" / "model.safetensors"), framework="pt") as f:
        numels = {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    total = sum(numels.values())
    replicated = sum(n for name, n in numels.items() if name.endswith(REPLICATED_IN_VLLM))
    engines, tp = 3, 2
    # each engine receives the model once, and each of its workers the replicated weights
    exact = engines * (total + (tp - 1) * replicated) * 4  # float32
    plan = sender(job)["plan"]
    assert plan["bytes"]["network"] == exact == plan["lower_bound_bytes"]
    assert engines * tp * total * 4 / exact > 1.9  # whole model to every worker: about 2x the bytes
