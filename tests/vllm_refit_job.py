"""A trainer refitting live vLLM engines through layoutlang, run with the vLLM environment's
Python (``.venv-vllm``) by tests/test_vllm_engine.py, which asserts on what it records.

``python tests/vllm_refit_job.py SCENARIO WORKDIR`` starts ``TRAINERS`` trainer processes
(gloo), each holding the same tiny random transformers model (float32, made here) as FSDP2
DTensors, and on trainer rank 0 the vLLM CPU engines (tensor parallel 2). After every real
optimizer step the trainer refits the engines with layoutlang and records, per engine, the
greedy tokens and their logprobs for fixed prompts; then it saves the trainer's current
weights as a safetensors checkpoint, starts a fresh, identically configured engine from it
and records its tokens (the oracle of check (a)), and records transformers' own logprobs of
the same tokens with the same weights (the oracle of check (b)). It also records what
happens when a refit cannot be done: a program whose inference layout does not match the
engine (every rank must fail before a byte moves), and a trainer rank that dies in the middle
of a refit (the engines must keep serving the previous weights).

Nothing here asserts: the observations go to WORKDIR/result.json and the test compares them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# the oracle of vLLM's own reload path runs a function on the engine's workers
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import torch
import torch.distributed as dist
from vllm_engine_host import reload_whole_tensors  # the script's folder is on the path

TRAINERS = 2
#: seconds a refit waits for a peer: a dead trainer rank is noticed by then at the latest
TIMEOUT = 20.0
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 3]]
NEW_TOKENS = 8

#: the tiny models, in the arguments transformers' config classes take; head_dim 32 (the
#: CPU attention kernels refuse 16)
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "architecture": "LlamaForCausalLM",
        "config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # GQA: each kv head on one of the 2 tp ranks
            "vocab_size": 250,  # padded to 256 by vLLM: 6 padding rows
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
        "preset": "llama/vllm_fused",
    },
    "qwen3_moe": {
        "architecture": "Qwen3MoeForCausalLM",
        "config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 256,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
        "preset": "qwen3_moe/vllm_fused",
    },
}


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def new_model(scenario: str) -> torch.nn.Module:
    import transformers

    spec = MODELS[scenario]
    config = transformers.AutoConfig.for_model(scenario, **spec["config"])
    return getattr(transformers, spec["architecture"])(config).float()


#: every engine this process started, stopped on the way out whatever happens (vLLM's
#: workers outlive a parent that exits without stopping them)
STARTED: list[Any] = []


def start_engine(checkpoint: Path, *, dummy: bool = False) -> Any:
    from vllm import LLM

    # [engine]
    engine = LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        seed=0,
        load_format="dummy" if dummy else "auto",
        weight_transfer_config={"backend": "layoutlang"},
    )
    # [/engine]
    STARTED.append(engine)
    return engine


def generate(engine: Any) -> dict[str, list]:
    """Greedy tokens for the fixed prompts and the logprob of each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, detokenize=False)
    outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
    ]
    return {"tokens": tokens, "logprobs": logprobs}


def transformers_logprobs(model: torch.nn.Module, tokens: list[list[int]]) -> list[list[float]]:
    """transformers' own log-probabilities of the engine's tokens, teacher-forced."""
    out = []
    with torch.no_grad():
        for prompt, generated in zip(PROMPTS, tokens):
            ids = torch.tensor([prompt + generated])
            logits = model(input_ids=ids).logits[0].double().log_softmax(-1)
            out.append([float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(generated)])
    return out


def worker_pid(worker: Any) -> int:
    return os.getpid()


def stop(engine: Any) -> None:
    import gc

    if engine in STARTED:
        STARTED.remove(engine)
        with contextlib.suppress(Exception):  # an engine whose worker was killed is dead already
            engine.llm_engine.engine_core.shutdown()
    gc.collect()


def program_text(checkpoint: Path, train_layout: str, preset: str | None, engines: int = 2) -> str:
    """The refit's program: the training layout, into ``preset`` on ``engines`` engines of
    tensor parallel 2 (None: every checkpoint tensor whole on every worker, in checkpoint
    names: not what vLLM holds)."""
    if preset is None:
        destination, name = "layout whole on infer { default: replicate }\n", "whole"
    else:
        destination, name = f'include "preset:{preset}"\n', preset.split("/")[1]
    return (
        f'tensors from hf "{checkpoint / "config.json"}" as cfg dtype fp32\n'
        + train_layout
        + f"mesh infer [dp = {engines}, tp = 2] on ranks {TRAINERS}..{TRAINERS + 2 * engines - 1}\n"
        + destination
        + f"reshard refit: train -> {name}\n"
    )


def train_layout_of(scenario: str, model: torch.nn.Module) -> str:
    from layoutlang.integrations.dtensor import layout_from_state_dict

    if scenario == "llama":
        return layout_from_state_dict(model.state_dict())
    # transformers 5 keeps each layer's experts stacked, [gate | up] per expert: the
    # stacked storages of the training layout (FSDP2 cuts dim 0, so 2 experts per rank)
    return (
        f"mesh train [dp = {TRAINERS}] on ranks 0..{TRAINERS - 1}\n"
        "layout train on train {\n"
        '    "model.layers.{l}.mlp.experts.{e}.*": dp[e // 2]\n'
        "    default: dp = shard(0)\n"
        '    storage "model.layers.{l}.mlp.experts.gate_up_proj" =\n'
        '        stack e of "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"'
        ' | "model.layers.{l}.mlp.experts.{e}.up_proj.weight"\n'
        '    storage "model.layers.{l}.mlp.experts.down_proj" =\n'
        '        stack e of "model.layers.{l}.mlp.experts.{e}.down_proj.weight"\n'
        "}\n"
    )


def trainer(rank: int, scenario: str, work: Path, ports: list[int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layoutlang.integrations.vllm.trainer import (
        LayoutlangTrainerInitInfo,
        LayoutlangTrainerWeightTransferEngine,
        OfflineLLMClient,
    )

    record: dict[str, Any] = {"rank": rank, "steps": []}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)
    model = new_model(scenario)
    initial = work / "step0"
    if rank == 0:
        model.save_pretrained(initial)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train_layout = train_layout_of(scenario, model)
    preset = MODELS[scenario]["preset"]
    program = program_text(initial, train_layout, preset)
    record["program"] = program
    engines: list[Any] = []
    if rank == 0:
        started = time.perf_counter()
        # one engine loaded from the checkpoint, one with random ("dummy") weights: a refit
        # must write every parameter of both
        engines = [start_engine(initial), start_engine(initial, dummy=True)]
        record["engines_start_seconds"] = time.perf_counter() - started
        record["before"] = [generate(e) for e in engines]
    clients = [OfflineLLMClient(e) for e in engines]
    dist.barrier()

    # [trainer]
    def init(text: str, port: int, name: str) -> Any:
        info = LayoutlangTrainerInitInfo(
            rank=rank, master_address="127.0.0.1", master_port=port, program=text, timeout=TIMEOUT, namespace=name
        )
        return LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=model)

    # [/trainer]

    # 1. a layout the engine does not hold: checkpoint tensors, where vLLM holds fused and
    # tensor-parallel parameters
    mismatched = program_text(initial, train_layout, None)
    try:
        init(mismatched, ports[1], "mismatch")
        record["mismatch_error"] = None
    except Exception as err:
        record["mismatch_error"] = f"{type(err).__name__}: {err}"
    if rank == 0:
        record["after_mismatch"] = [generate(e) for e in engines]
    dist.barrier()

    refit = init(program, ports[2], "refit")
    record["plan"] = refit.session.plan.stats.to_json() if rank == 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for step in range(1, 4):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, MODELS[scenario]["config"]["vocab_size"], (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        started = time.perf_counter()
        refit.send_weights()  # on every trainer rank
        seconds = time.perf_counter() - started
        whole = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
        if rank != 0:
            continue
        observed = {"refit_seconds": seconds, "engines": [generate(e) for e in engines]}
        reference = new_model(scenario)
        reference.load_state_dict(whole)
        checkpoint = work / f"step{step}"
        reference.save_pretrained(checkpoint)
        fresh = start_engine(checkpoint)
        observed["fresh"] = generate(fresh)
        # the same weights again, through vLLM's own reload path
        fresh.llm_engine.collective_rpc(reload_whole_tensors, args=(str(checkpoint),))
        observed["fresh_reloaded"] = generate(fresh)
        stop(fresh)
        observed["transformers"] = [transformers_logprobs(reference, e["tokens"]) for e in observed["engines"]]
        record["steps"].append(observed)
        log(f"step {step}: refit {seconds:.3f} s, tokens {observed['engines'][0]['tokens'][0]}")

    # 2. a worker of the second engine dies just before a refit (vLLM then stops that engine):
    # the refit still commits on the first engine, which generates the new weights' tokens
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if rank == 0:
        pids = engines[1].llm_engine.collective_rpc(worker_pid)
        os.kill(pids[-1], signal.SIGKILL)
        record["killed"] = "engine 1's tensor-parallel rank 1 (program rank 5)"
    dist.barrier()
    started = time.perf_counter()
    report = refit.send_weights()
    record["engine_death"] = {"seconds": time.perf_counter() - started, "report": report.to_json()}
    whole = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if rank == 0:
        reference = new_model(scenario)
        reference.load_state_dict(whole)
        survivor = generate(engines[0])
        survivor["transformers"] = transformers_logprobs(reference, survivor["tokens"])
        record["engine_death"]["survivor"] = survivor

    # 3. a trainer rank dies (FSDP: nothing else holds its shards): the refit stops with
    # DataLossError, and the engine keeps serving the last committed weights
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if rank == TRAINERS - 1:
        (work / f"rank{rank}.json").write_text(json.dumps(record))
        os._exit(0)
    started = time.perf_counter()
    try:
        refit.send_weights()
        record["death_error"] = None
    except Exception as err:
        record["death_error"] = f"{type(err).__name__}: {err}"
    record["death_seconds"] = time.perf_counter() - started
    record["after_death"] = generate(engines[0])
    (work / f"rank{rank}.json").write_text(json.dumps(record))


def run(rank: int, scenario: str, work: Path, ports: list[int]) -> None:
    code = 0
    try:
        trainer(rank, scenario, work, ports)
    except BaseException:
        (work / f"rank{rank}.error").write_text(traceback.format_exc())
        code = 1
    finally:
        while STARTED:
            stop(STARTED[-1])
    os._exit(code)  # the trainer world lost a rank: skip its teardown


if __name__ == "__main__":
    import torch.multiprocessing as mp

    scenario, work = sys.argv[1], Path(sys.argv[2])
    ports = [int(p) for p in sys.argv[3].split(",")]
    work.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(run, args=(scenario, work, ports), nprocs=TRAINERS, join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=1500)
    records = {}
    for rank in range(TRAINERS):
        path = work / f"rank{rank}.json"
        error = work / f"rank{rank}.error"
        records[rank] = (
            json.loads(path.read_text())
            if path.exists()
            else {"error": error.read_text() if error.exists() else "no record"}
        )
    (work / "result.json").write_text(json.dumps(records))
