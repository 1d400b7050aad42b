"""A trainer refitting LoRA adapters into live vLLM engines through layoutlang, run with the vLLM
environment's Python (``.venv-vllm``) by tests/test_vllm_lora.py, which asserts on what it records.

``python tests/vllm_lora_job.py SCENARIO WORKDIR`` starts ``TRAINERS`` gloo trainer processes,
each holding the same tiny random model (float32) wrapped by PEFT with LoRA adapters (rank 8)
and sharded with FSDP2; on trainer rank 0 it starts the vLLM CPU engines (tensor parallel 2,
``enable_lora``), loaded from the base checkpoint once: their base weights never move.

``llama``: two adapters, ``default`` (q/k/v/o and gate/up/down, id 1) and ``second``
(q/k/v/o, id 2), each refitted by its own trainer engine (its own program and session) into 2
engines. An initial refit of both, then 3 real Adam steps of ``default``, each followed by its
refit, then one of ``second``, then ``second`` removed. ``qwen3_moe``: one adapter on the
attention of a tiny Qwen3-MoE, 2 engines, an initial refit and 3 steps (the first engine is the
oracle there too: it loads each saved adapter by path under another id, beside the refitted one).

After every refit it records each engine's greedy tokens with each adapter and without one,
and the oracle's: one more engine (a fresh one, never refitted) loads ``save_pretrained`` of
the trainer's current adapter by path, vLLM's normal way, under a new id each time.

Nothing here asserts: the observations go to WORKDIR/result.json and the test compares them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the job reads the workers' adapter ids

import torch
import torch.distributed as dist

TRAINERS = 2
TIMEOUT = 60.0
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 3]]
NEW_TOKENS = 8
RANK = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

SCENARIOS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architecture": "LlamaForCausalLM",
        "config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 250,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
        # adapter name -> (vLLM's lora_int_id, target modules, lora_alpha)
        "adapters": {"default": (1, ATTENTION + MLP, 16), "second": (2, ATTENTION, 32)},
        "engines": 2,
        "steps": 3,
        # then the base weights themselves, refitted into the same LoRA engines
        "base_refit": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
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
        "adapters": {"default": (1, ATTENTION, 16)},
        "engines": 2,
        "steps": 3,
        # the first refitted engine is the oracle too: it loads the saved adapters by path under
        # other ids (a fresh load of the file each time; the base weights never change)
        "oracle_engine": False,
        # LoRA slots on the attention only (the engine's lora_target_modules), and the experts
        # built as without LoRA: vLLM 0.32 gives every MoE layer of a LoRA engine a Triton
        # kernel, which vllm-cpu has not (tests/vllm_cpu_moe_lora/sitecustomize.py)
        "engine": {"lora_target_modules": ["qkv_proj", "o_proj"]},
        "cpu_moe_without_expert_lora": True,
    },
}


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


STARTED: list[Any] = []


def start_engine(checkpoint: Path, **options: Any) -> Any:
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
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
        weight_transfer_config={"backend": "layoutlang"},
        **options,
    )
    # [/engine]
    STARTED.append(engine)
    return engine


def stop(engine: Any) -> None:
    if engine in STARTED:
        STARTED.remove(engine)
        with contextlib.suppress(Exception):
            engine.llm_engine.engine_core.shutdown()


def generate(engine: Any, lora: Any = None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, detokenize=False)
    outputs = engine.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False, lora_request=lora
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def adapter_ids(worker: Any) -> list[int]:
    return sorted(worker.model_runner.get_model().lora_manager.list_adapters())


def new_model(scenario: str) -> torch.nn.Module:
    import transformers

    spec = SCENARIOS[scenario]
    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    return getattr(transformers, spec["architecture"])(config).float()


def peft_model(scenario: str, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The base model (a new one unless given) with every adapter of the scenario, all trainable."""
    from peft import LoraConfig, get_peft_model

    model = new_model(scenario) if model is None else model
    adapters = SCENARIOS[scenario]["adapters"]
    wrapped = None
    for name, (_, targets, alpha) in adapters.items():
        config = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        if wrapped is None:
            wrapped = get_peft_model(model, config, adapter_name=name)
        else:
            wrapped.add_adapter(name, config)
    assert wrapped is not None
    wrapped.base_model.set_adapter(list(adapters))  # every adapter trainable (each has its own optimizer)
    return wrapped


# [base-weights]
def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The PEFT model's base weights (its FSDP2 parameters) by their checkpoint names: PEFT's
    ``base_model.model.`` prefix and its LoRA layers' ``base_layer`` taken out."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): param
        for name, param in model.named_parameters()
        if ".lora_" not in name
    }
# [/base-weights]


def refit_base(rank: int, model: torch.nn.Module, clients: list[Any], engines: list[Any], oracle: Any,
               base: Path, infer: str, work: Path, serving: dict[str, Any], adapter: Any) -> dict[str, Any] | None:
    """The base weights changed (every MLP's down_proj negated, a stand-in for a full
    fine-tuning step), refitted by a session of their own into the LoRA engines; the oracle
    reloads the same weights by vLLM's own ``reload_weights`` from a checkpoint, then loads
    ``adapter`` (the trainer's current "default", saved) by path over them."""
    from safetensors.torch import save_file

    from layoutlang.integrations.dtensor import layout_from_state_dict
    from layoutlang.integrations.vllm.trainer import LayoutlangTrainerInitInfo, LayoutlangTrainerWeightTransferEngine

    weights = base_weights(model)
    with torch.no_grad():
        for name, param in weights.items():
            if name.endswith("mlp.down_proj.weight"):
                param.neg_()
    program = (
        f'tensors from hf "{base / "config.json"}" as cfg dtype fp32\n' + layout_from_state_dict(weights)
        + f'{infer}\ninclude "preset:llama/vllm_fused"\nreshard refit: train -> vllm_fused\n'
    )
    info = LayoutlangTrainerInitInfo(rank=rank, master_address="127.0.0.1", program=program, timeout=TIMEOUT,
                                     namespace="base")
    refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=weights)
    report = refit.send_weights()
    whole = {name: param.full_tensor() for name, param in weights.items()}  # every rank
    refit.shutdown()
    if rank != 0:
        return None
    checkpoint = work / "base-changed"
    checkpoint.mkdir()
    save_file({name: t.contiguous() for name, t in whole.items()}, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text((base / "config.json").read_text())
    out: dict[str, Any] = {"report": report.to_json(), "refitted": list(report.refitted)}
    out["engines"] = [{"base": generate(e), "default": generate(e, serving["default"])} for e in engines]
    oracle.llm_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint)})
    oracle.reset_prefix_cache()
    out["oracle"] = {"base": generate(oracle), "default": generate(oracle, adapter)}
    return out


def trainer(rank: int, scenario: str, work: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.lora.request import LoRARequest

    from layoutlang.integrations.dtensor import layout_from_state_dict
    from layoutlang.integrations.vllm.lora import (
        AdapterSpec,
        adapter_path,
        adapter_program,
        adapter_state_dict,
        peft_config_dict,
    )
    from layoutlang.integrations.vllm.trainer import (
        LayoutlangTrainerInitInfo,
        LayoutlangTrainerWeightTransferEngine,
        OfflineLLMClient,
    )

    spec = SCENARIOS[scenario]
    record: dict[str, Any] = {"rank": rank, "checks": []}
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)
    plain = new_model(scenario)
    base = work / "base"
    if rank == 0:
        plain.save_pretrained(base)  # the base weights, before PEFT wraps their modules
    model = peft_model(scenario, plain)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adapters = spec["adapters"]
    sources = {name: adapter_state_dict(model, name) for name in adapters}
    optimizers = {
        name: torch.optim.Adam([p for n, p in model.named_parameters() if f".{name}." in n], lr=2e-2)
        for name in adapters
    }
    engines: list[Any] = []
    oracle = None
    count = spec["engines"]
    if rank == 0 and spec.get("cpu_moe_without_expert_lora"):  # inherited by the engines' processes
        here = str(Path(__file__).resolve().parent / "vllm_cpu_moe_lora")
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
        os.environ["LAYOUTLANG_TEST_CPU_MOE_WITHOUT_EXPERT_LORA"] = "1"
    if rank == 0:
        started = time.perf_counter()
        engines = [start_engine(base, **spec.get("engine", {})) for _ in range(count)]
        # loads every adapter by path, never refitted
        oracle = start_engine(base, **spec.get("engine", {})) if spec.get("oracle_engine", True) else engines[0]
        record["engines_start_seconds"] = time.perf_counter() - started
        record["base_before"] = [generate(e) for e in engines]
    clients = [OfflineLLMClient(e) for e in engines]
    infer = f"mesh infer [dp = {count}, tp = 2] on ranks {TRAINERS}..{TRAINERS + 2 * count - 1}"
    if rank == 0:  # each adapter's adapter_config.json: what the program declares its tensors from
        for name in adapters:
            model.peft_config[name].save_pretrained(work / "adapter-configs" / name)
    dist.barrier()  # the model's config.json and the adapters' configs are written
    refits = {}
    programs = {}
    for name, (lora_id, _, _) in adapters.items():
        program = adapter_program(
            base / "config.json", work / "adapter-configs" / name / "adapter_config.json",
            layout_from_state_dict(sources[name]), infer_mesh=infer,
        )
        programs[name] = program
        # [trainer]
        info = LayoutlangTrainerInitInfo(
            rank=rank,
            master_address="127.0.0.1",
            program=program,
            timeout=TIMEOUT,
            namespace=f"lora-{name}",
            lora=AdapterSpec(lora_id, name, peft_config_dict(model.peft_config[name])),
        )
        refits[name] = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=sources[name])
        # [/trainer]
    record["programs"] = programs if rank == 0 else None
    record["plans"] = {n: r.session.plan.stats.to_json() for n, r in refits.items()} if rank == 0 else None
    record["adapter_bytes"] = {
        n: sum(t.numel() * t.element_size() for t in s.values()) for n, s in sources.items()
    }
    # [serve]
    serving = {name: LoRARequest(name, lora_id, adapter_path(name)) for name, (lora_id, _, _) in adapters.items()}
    # [/serve]
    oracle_ids = iter(range(100, 1000))
    live: list[str] = []  # the adapters refitted at least once: the engines hold them

    def observe(label: str, refitted: str, seconds: float) -> None:
        """Every engine's tokens with each adapter and without; the oracle's for the adapter
        just refitted, loaded by path from save_pretrained of the trainer's current weights."""
        whole = {n: t.full_tensor() for n, t in model.state_dict().items() if ".lora_" in n}  # every rank
        if rank != 0:
            return
        reference = peft_model(scenario)
        missing = reference.load_state_dict(whole, strict=False).unexpected_keys
        assert not missing, missing
        saved = work / label
        reference.save_pretrained(saved)
        check: dict[str, Any] = {"label": label, "refitted": refitted, "refit_seconds": seconds}
        if refitted not in live:
            live.append(refitted)
        check["engines"] = [{n: generate(e, serving[n]) for n in live} | {"base": generate(e)} for e in engines]
        path = saved if refitted == "default" else saved / refitted  # PEFT saves other adapters in a subfolder
        check["oracle"] = generate(oracle, LoRARequest(f"oracle-{label}", next(oracle_ids), str(path)))
        check["adapter_ids"] = [e.llm_engine.collective_rpc(adapter_ids) for e in engines]
        record["checks"].append(check)
        log(label, refitted, f"{seconds:.3f} s", check["engines"][0][refitted][0], check["oracle"][0])

    def refit(name: str, label: str) -> None:
        started = time.perf_counter()
        report = refits[name].send_weights()
        seconds = time.perf_counter() - started
        if rank == 0 and (report.failed or len(report.refitted) != count):
            raise RuntimeError(f"{label}: {report.to_json()}")
        observe(label, name, seconds)

    for name in adapters:
        refit(name, f"{name}-0")
    vocab = spec["config"]["vocab_size"]
    for step in range(1, spec["steps"] + 1):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, vocab, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers["default"].step()
        for optimizer in optimizers.values():
            optimizer.zero_grad()
        refit("default", f"default-{step}")
    if "second" in adapters:
        torch.manual_seed(200)
        ids = torch.randint(0, vocab, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers["second"].step()
        for optimizer in optimizers.values():
            optimizer.zero_grad()
        refit("second", "second-1")
        # [remove]
        failed = refits["second"].remove_adapter()
        # [/remove]
        if rank == 0:
            removed: dict[str, Any] = {"failed": {str(k): v for k, v in failed.items()}}
            removed["default"] = [generate(e, serving["default"]) for e in engines]
            removed["base"] = [generate(e) for e in engines]
            removed["adapter_ids"] = [e.llm_engine.collective_rpc(adapter_ids) for e in engines]
            record["removed"] = removed
    if spec.get("base_refit"):
        # "default" last changed at its last step: the oracle loads that save over the new base
        adapter = LoRARequest("oracle-after-base", next(oracle_ids), str(work / f"default-{spec['steps']}"))
        record["base_refit"] = refit_base(rank, model, clients, engines, oracle, base, infer, work, serving, adapter)
    for name, engine in refits.items():
        if name != "second":
            engine.shutdown()
    (work / f"rank{rank}.json").write_text(json.dumps(record))


def run(rank: int, scenario: str, work: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        trainer(rank, scenario, work)
    except BaseException:
        (work / f"rank{rank}.error").write_text(traceback.format_exc())
        code = 1
    finally:
        while STARTED:
            stop(STARTED[-1])
    os._exit(code)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    scenario, work, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    work.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(run, args=(scenario, work, port), nprocs=TRAINERS, join=False, start_method="spawn")
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
