"""A trainer refitting a ``vllm serve`` server over HTTP, and the oracle engine that checks it;
run with the vLLM environment's Python (``.venv-vllm``) by tests/test_vllm_serve.py, which
starts the server and asserts on what this records.

``python tests/vllm_serve_job.py train URL WORK CHECKPOINT FIRST LAST [--die-at STEP |
--die-before-finish STEP]``: one
trainer process holds the tiny Llama of CHECKPOINT as plain float32 tensors, takes a real Adam
step for each step FIRST..LAST, and after each refits the server through vLLM's
``HTTPVLLMWeightSyncClient`` (the job secret in ``LAYOUTLANG_JOB_SECRET``, the same as the
server's; the store on a free port). It saves each step's weights as a safetensors checkpoint
(WORK/stepN) and records the server's greedy tokens, read from its OpenAI completions route,
right after the refit (WORK/trainer-FIRST.json, rewritten after each step). With
``--die-at STEP`` the process kills itself (SIGKILL) in the middle of that step's refit: after
the first batch of its sends, before the server applied anything; with
``--die-before-finish STEP`` it kills itself when it would call the server's
``finish_weight_update`` for that step: the server prepared the step, and vLLM's update stays
open on it.

``python tests/vllm_serve_job.py oracle WORK STEP...``: a fresh vLLM engine configured as the
server, loaded from the first step's checkpoint, gives that step's greedy tokens; the later
steps' are its own, each after vLLM's own reload of that step's checkpoint (whole tensors
through ``load_weights``, as vLLM's NCCL engine loads them). Written to WORK/oracle.json.

Nothing here asserts: the test compares the records.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 3]]
NEW_TOKENS = 8
VOCAB = 250
#: seconds a refit waits for a peer
TIMEOUT = 30.0
#: the name the test's server serves the model under (``--served-model-name``)
MODEL_NAME = "tiny-llama"


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def server_tokens(url: str) -> list[list[int]]:
    """The server's greedy tokens for the fixed prompts, from its OpenAI completions route."""
    body = {
        "model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = json.loads(response.read())["choices"]
    return [list(c["token_ids"]) for c in sorted(choices, key=lambda c: c["index"])]


def program_text(checkpoint: Path) -> str:
    """The refit's program: the trainer's plain tensors (one rank, whole) into what a vLLM
    engine of tensor parallel 1 holds (fused qkv_proj and gate_up_proj, padded vocabulary)."""
    return (
        f'tensors from hf "{checkpoint / "config.json"}" as cfg dtype fp32\n'
        "mesh train [dp = 1] on ranks 0..0\n"
        "layout train on train { default: replicate }\n"
        "mesh infer [dp = 1, tp = 1] on ranks 1..1\n"
        'include "preset:llama/vllm_fused"\n'
        "reshard refit: train -> vllm_fused\n"
    )


def train(url: str, work: Path, checkpoint: Path, first: int, last: int, die: tuple[str, int] | None) -> None:
    import torch
    import transformers
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from layoutlang.integrations.vllm.trainer import LayoutlangTrainerInitInfo, LayoutlangTrainerWeightTransferEngine

    record: dict[str, Any] = {"first": first, "steps": {}}
    out = work / f"trainer-{first}.json"
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)

    # [trainer]
    # LAYOUTLANG_JOB_SECRET holds the job's secret here and where the server runs: only its
    # fingerprint travels in the init info. The store takes a free port (master_port=0) and
    # the server learns it from the init info.
    info = LayoutlangTrainerInitInfo(
        rank=0, master_address="127.0.0.1", program=program_text(checkpoint), send_secret=False, timeout=TIMEOUT
    )
    client = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT * 4)
    # [/trainer]
    if die is not None and die[0] == "--die-before-finish":
        client = dying_client(url, TIMEOUT * 4)
    # [init]
    refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=client, source=model)
    # [/init]
    record["store_port"] = refit.info.master_port
    for step in range(first, last + 1):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.save_pretrained(work / f"step{step}")
        progress = None
        if die is not None and step == die[1]:
            record["dying_at"], record["dying"] = step, die[0]
            out.write_text(json.dumps(record))
            if hasattr(client, "dying"):
                client.dying = True
        if die == ("--die-at", step):

            def progress(done: int, total: int, step: int = step) -> None:
                log(f"step {step}: killed after {done} of {total} executor steps")
                os.kill(os.getpid(), signal.SIGKILL)

        started = time.perf_counter()
        # [refit]
        report = refit.send_weights(progress=progress)
        # [/refit]
        seconds = time.perf_counter() - started
        tokens = server_tokens(url)
        record["steps"][str(step)] = {"report": report.to_json(), "seconds": seconds, "tokens": tokens}
        out.write_text(json.dumps(record))
        log(f"step {step}: refit {seconds:.3f} s, tokens {tokens[0]}")
    refit.shutdown()


def dying_client(url: str, timeout: float) -> Any:
    """vLLM's HTTP client, but the trainer process is SIGKILLed when it would call
    ``finish_weight_update`` once ``dying`` is set: the server prepared the step, nobody
    applies it, and vLLM's update stays open on the server."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class Dying(HTTPVLLMWeightSyncClient):
        dying = False

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            if self.dying:
                log(f"killed before finish_weight_update({weight_version})")
                os.kill(os.getpid(), signal.SIGKILL)
            super().finish_weight_update(weight_version)

    return Dying(url, timeout=timeout)


def oracle(work: Path, steps: list[int]) -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the reload runs a function on the worker
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_engine_host import reload_whole_tensors  # the script's folder is on the path

    engine = LLM(
        model=str(work / f"step{steps[0]}"), skip_tokenizer_init=True, tensor_parallel_size=1, dtype="float32",
        max_model_len=128, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, detokenize=False)
    result: dict[str, Any] = {}
    for i, step in enumerate(steps):
        if i:
            engine.llm_engine.collective_rpc(reload_whole_tensors, args=(str(work / f"step{step}"),))
        outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        result[str(step)] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "fresh": i == 0}
    (work / "oracle.json").write_text(json.dumps(result))
    engine.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "train":
        url, work, checkpoint, first, last = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), *sys.argv[5:7]
        die = (sys.argv[7], int(sys.argv[8])) if len(sys.argv) > 8 else None
        train(url, work, checkpoint, int(first), int(last), die)
    else:
        oracle(Path(sys.argv[2]), [int(s) for s in sys.argv[3:]])
    os._exit(0)  # skip vLLM's and torch's teardown of threads that are done
