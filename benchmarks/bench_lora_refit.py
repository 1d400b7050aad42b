"""A LoRA adapter refitted into live vLLM engines: layoutlang against the framework way.

Run with the vLLM environment's Python (``scripts/setup-vllm`` makes it)::

    .venv-vllm/bin/python benchmarks/bench_lora_refit.py [--layers 4] [--hidden 512] [--rank 16] [--refits 5]

Two gloo trainer processes hold a random Llama (float32, GQA) wrapped by PEFT with a LoRA adapter
on q/k/v/o and gate/up/down, sharded with FSDP2; trainer rank 0 starts two vLLM CPU engines of
tensor parallel 2 with ``enable_lora``. After a real Adam step of the adapter, the same adapter
reaches both engines both ways, alternating (ABBA), each way's first refit untimed:

- **layoutlang**: ``send_weights()`` of the adapter's refit (its own program and session):
  each trainer rank sends its FSDP2 shards' boxes that each worker's LoRA slots take, every
  worker prepares and applies it; then ``llm_engine.add_lora`` of its ``layoutlang://`` request on
  both engines (concurrently), which builds it from the workers' memory into the LoRA slots
  (id 1), as the other way's load does;
- **framework** (what RL frameworks do today): every trainer rank gathers the adapter
  (``full_tensor()``), rank 0 writes it as ``save_pretrained`` does (``adapter_model.safetensors``
  and ``adapter_config.json``), and both engines load it by path with ``load_inplace=True``
  (``llm_engine.add_lora``, concurrently; id 2).

Both end with the adapter in every engine's LoRA slots (checked: both ids generate the same
tokens). Printed: the median and best time of each, their ratio, and the adapter's bytes.
Nothing is asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

TRAINERS = 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine(checkpoint: Path, rank: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(checkpoint), skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
        max_model_len=128, gpu_memory_utilization=0.05, enforce_eager=True, enable_lora=True,
        max_lora_rank=rank, max_loras=2, weight_transfer_config={"backend": "layoutlang"},
    )


def tokens(llm: Any, lora: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 9, 20, 33])], params, use_tqdm=False, lora_request=lora)
    return list(out[0].outputs[0].token_ids)


def trainer(rank: int, args: argparse.Namespace, work: Path, port: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
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

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128, vocab_size=1000,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).float()
    if rank == 0:
        model.save_pretrained(work / "base")
    lora_config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(model, lora_config)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = adapter_state_dict(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engines = [engine(work / "base", args.rank) for _ in range(2)] if rank == 0 else []
    clients = [OfflineLLMClient(e) for e in engines]
    if rank == 0:
        lora_config.save_pretrained(work / "adapter")  # adapter_config.json, which the program reads
    dist.barrier()
    program = adapter_program(
        work / "base" / "config.json", work / "adapter" / "adapter_config.json", layout_from_state_dict(source),
        infer_mesh=f"mesh infer [dp = 2, tp = 2] on ranks {TRAINERS}..5",
    )
    info = LayoutlangTrainerInitInfo(
        rank=rank, master_address="127.0.0.1", program=program, timeout=120.0, namespace="bench-lora",
        lora=AdapterSpec(1, "layoutlang", peft_config_dict(lora_config)),
    )
    refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=source)
    served = LoRARequest("layoutlang", 1, adapter_path("layoutlang"))
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def layoutlang_way() -> float:
        dist.barrier()
        started = time.perf_counter()
        refit.send_weights()
        if rank == 0:  # loaded into the LoRA slots now (from the workers' memory), as add_lora does below
            list(pool.map(lambda e: e.llm_engine.add_lora(served), engines))
        dist.barrier()
        return time.perf_counter() - started

    saved: list[Any] = []  # the framework's last request (vLLM drops every adapter at a weight update's end)

    def framework_way(version: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        whole = {name: tensor.full_tensor() for name, tensor in source.items()}  # every rank gathers
        if rank == 0:
            path = work / f"adapter-{version}"
            path.mkdir()
            save_file({n: t.contiguous() for n, t in whole.items()}, str(path / "adapter_model.safetensors"))
            lora_config.save_pretrained(str(path))
            request = LoRARequest("framework", 2, str(path), load_inplace=True)
            list(pool.map(lambda e: e.llm_engine.add_lora(request), engines))
            saved[:] = [LoRARequest("framework", 2, str(path))]
        dist.barrier()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"layoutlang": [], "framework": []}
    order = ["layoutlang", "framework"]
    for step in range(args.refits + 1):
        torch.manual_seed(step)
        ids = torch.randint(0, 1000, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for way in order if step % 2 == 0 else order[::-1]:
            seconds = layoutlang_way() if way == "layoutlang" else framework_way(step)
            if step:  # the first of each way is a warm-up
                times[way].append(seconds)
        if rank == 0:
            ours, theirs = tokens(engines[0], served), tokens(engines[0], saved[0])
            same = "same tokens" if ours == theirs else f"DIFFERENT tokens {ours} {theirs}"
            print(f"step {step}: {same}", flush=True)
    if rank == 0:
        size = sum(t.numel() * t.element_size() for t in source.values())
        stats = refit.session.plan.stats
        print(f"adapter: rank {args.rank}, {len(source)} tensors, {size / 2**20:.2f} MiB; Llama {args.layers} layers, "
              f"hidden {args.hidden}; 2 engines of TP 2; plan moves {stats.moved / 2**20:.2f} MiB "
              f"(lower bound {stats.lower_bound / 2**20:.2f} MiB)")
        for way, values in times.items():
            print(f"{way:>10}: median {statistics.median(values) * 1e3:8.1f} ms, best {min(values) * 1e3:8.1f} ms "
                  f"({len(values)} refits)")
        ratio = statistics.median(times["framework"]) / statistics.median(times["layoutlang"])
        print(f"framework / layoutlang (median): {ratio:.2f}x", flush=True)
    refit.shutdown()
    for e in engines:
        e.llm_engine.engine_core.shutdown()
    dist.barrier()


def run(rank: int, args: argparse.Namespace, work: Path, port: int) -> None:
    code = 0
    try:
        trainer(rank, args, work, port)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--refits", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as work:
        mp.start_processes(run, args=(args, Path(work), port), nprocs=TRAINERS, start_method="spawn")


if __name__ == "__main__":
    main()
