"""layoutlang's refit of live vLLM engines against vLLM's own path for whole tensors.

Run with the vLLM environment's Python (``scripts/setup-vllm`` makes it)::

    .venv-vllm/bin/python benchmarks/bench_vllm_refit.py [--layers 4] [--hidden 512] [--refits 5] [--rounds 2]

Two gloo trainer processes hold a random Llama (float32, GQA) as FSDP2 DTensors; trainer
rank 0 starts two vLLM CPU engines of tensor parallel 2 (data-parallel replicas). The same
refit is then run both ways, side by side, each as the committed steps of an elastic refit
session of its own (its own namespace and store port; the trainer leaves one before the
engines re-initialize into the next), in rounds that alternate the order (ABBA), each
session's first refit untimed:

- **layoutlang**: ``preset:llama/vllm_fused``; each worker receives exactly its shards of
  vLLM's fused parameters, from the trainer ranks that hold them;
- **whole tensors into load_weights** (what vLLM's NCCL engine does after a trainer gathers
  and broadcasts): the destination replicates every checkpoint tensor on every worker
  (``default: replicate``, ``checkpoint_format``), and vLLM's loaders narrow them.

It prints, for each, the bytes the plan moves over the network (the plan statistics) and
the median and best refit time, and the ratios; then where a refit's time goes (the median
seconds of each phase: on the sender, trainer rank 0, and on the engines' workers, the median
over workers); and **raw gloo**: layoutlang's messages replayed as plain gloo sends and
receives between the same processes on the session's own group (the same sizes, peers and
order, from buffers allocated once: :meth:`~elastic.ElasticSession.raw_exchange`), timed in
the same run, so that the refit's time is compared with what its bytes cost on this wire.
Nothing is asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

TRAINERS = 2
RAW_REPEATS = 5


def engine(checkpoint: Path) -> Any:
    from vllm import LLM

    return LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        weight_transfer_config={"backend": "layoutlang"},
        worker_extension_cls="layoutlang.integrations.vllm.worker.LayoutlangWorkerExtension",  # the phases
    )


def program(checkpoint: Path, train: str, destination: str) -> str:
    head = f'tensors from hf "{checkpoint / "config.json"}" as cfg dtype fp32\n' + train
    head += f"mesh infer [dp = 2, tp = 2] on ranks {TRAINERS}..{TRAINERS + 3}\n"
    if destination == "layoutlang":
        return head + 'include "preset:llama/vllm_fused"\nreshard refit: train -> vllm_fused\n'
    return head + "layout whole on infer { default: replicate }\nreshard refit: train -> whole\n"


def trainer(rank: int, args: argparse.Namespace, work: Path, ports: list[int]) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layoutlang.integrations.dtensor import layout_from_state_dict
    from layoutlang.integrations.vllm.trainer import (
        LayoutlangTrainerInitInfo,
        LayoutlangTrainerWeightTransferEngine,
        OfflineLLMClient,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    checkpoint = work / "checkpoint"
    if rank == 0:
        model.save_pretrained(checkpoint)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train = layout_from_state_dict(model.state_dict())
    engines = [engine(checkpoint), engine(checkpoint)] if rank == 0 else []
    clients = [OfflineLLMClient(e) for e in engines]
    dist.barrier()
    ways = ["layoutlang", "whole tensors into load_weights"]
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    moved: dict[str, int] = {}
    sender: dict[str, list[dict[str, float]]] = {way: [] for way in ways}  # rank 0's phases per timed refit
    workers: dict[str, list[dict[str, float]]] = {way: [] for way in ways}  # each worker's, per timed refit
    raw: list[float] = []  # each replay's time: the slowest process's
    sessions: list[Any] = []
    try:
        for round_ in range(args.rounds):
            for index, way in enumerate(ways if round_ % 2 == 0 else ways[::-1]):  # ABBA
                layoutlang_way = way == "layoutlang"
                info = LayoutlangTrainerInitInfo(
                    rank=rank,
                    master_address="127.0.0.1",
                    master_port=ports[1 + 2 * round_ + index],  # rank 0 serves each session's store
                    program=program(checkpoint, train, "layoutlang" if layoutlang_way else "whole"),
                    namespace=f"bench{round_}-{index}",
                    checkpoint_format=not layoutlang_way,
                    timeout=120,
                )
                refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=model)
                for i in range(1 + args.refits):  # the first: a warm-up
                    dist.barrier()
                    start = time.perf_counter()
                    report = refit.send_weights()
                    if i > 0:
                        seconds[way].append(time.perf_counter() - start)
                        sender[way].append(report.phases)
                    if rank == 0 and report.refitted != (0, 1):
                        print(f"{way}: step {report.step} refitted engines {report.refitted}: {report.to_json()}")
                moved[way] = refit.session.plan.stats.bytes["network"]
                for e in engines:  # each worker's phases of this session's timed refits
                    workers[way] += [p for w in e.collective_rpc("layoutlang_phases") for p in w[-args.refits:]]
                if layoutlang_way and round_ == 0:
                    raw += raw_gloo(refit, engines)
                refit.shutdown()  # the trainer leaves; the engines re-init into the next session
                sessions.append(refit)  # keep rank 0's store served while the engines are members
    finally:
        for e in engines:
            e.llm_engine.engine_core.shutdown()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f} M parameters (fp32)")
        print(f"trainer: FSDP2 on {TRAINERS} ranks; inference: 2 vLLM engines x TP 2 (CPU); {args.rounds} rounds "
              f"(ABBA) of 1 warm-up + {args.refits} timed refits each way")
        print(f"{'refit':<34}{'network bytes':>16}{'median s':>12}{'best s':>10}")
        medians = {way: statistics.median(seconds[way]) for way in ways}
        for way in ways:
            print(f"{way:<34}{moved[way]:>16,}{medians[way]:>12.3f}{min(seconds[way]):>10.3f}")
        exact, whole = (moved[way] for way in ways)
        fast, slow = (medians[way] for way in ways)
        print(f"ratio (whole / layoutlang): bytes {whole / exact:.2f}x, time {slow / fast:.2f}x")
        for way in ways:
            print(f"  {way}: " + ", ".join(f"{t:.3f}" for t in seconds[way]))
        gloo = statistics.median(raw)
        print(f"raw gloo, layoutlang's {exact:,} bytes as plain sends/receives between the same processes: median "
              f"{gloo:.3f} s, best {min(raw):.3f} s ({RAW_REPEATS} replays)")
        print(f"ratio (layoutlang refit / raw gloo): {fast / gloo:.2f}x")
        print("where a refit's time goes (median s of each phase; worker: the median over the 4 workers)")
        for way in ways:
            print(f"  {way}")
            print("    sender (trainer rank 0): " + _phases(sender[way]))
            print("    worker: " + _phases(workers[way]))
        sys.stdout.flush()
    dist.barrier()


def raw_gloo(refit: Any, engines: list[Any]) -> list[float]:
    """Each replay's seconds, the slowest process's (every trainer rank calls it)."""
    import threading

    import torch.distributed as dist

    replies: list[Any] = []
    calls = [
        threading.Thread(
            target=lambda e=e: replies.append(e.collective_rpc("layoutlang_raw_exchange", args=(RAW_REPEATS,)))
        )
        for e in engines
    ]
    for call in calls:
        call.start()
    mine = refit.session.raw_exchange(RAW_REPEATS)
    for call in calls:
        call.join()
    everyone: list[Any] = [None] * TRAINERS
    dist.all_gather_object(everyone, [mine, *(w for reply in replies for w in reply)])
    per_process = [times for rank_times in everyone for times in rank_times]
    return [max(times[i] for times in per_process) for i in range(RAW_REPEATS)]


def _phases(records: list[dict[str, float]]) -> str:
    names = list(dict.fromkeys(name for record in records for name in record))
    return ", ".join(f"{name} {statistics.median(r.get(name, 0.0) for r in records):.3f}" for name in names)


def run(rank: int, args: argparse.Namespace, work: Path, ports: list[int]) -> None:
    trainer(rank, args, work, ports)
    os._exit(0)  # the engines' threads need no teardown here


def main() -> None:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--refits", type=int, default=5, help="timed refits each way per round")
    parser.add_argument("--rounds", type=int, default=2, help="each way's session built afresh per round")
    args = parser.parse_args()
    sockets = [socket.socket() for _ in range(1 + 2 * args.rounds)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as work:
        mp.start_processes(run, args=(args, Path(work), ports), nprocs=TRAINERS, start_method="spawn")


if __name__ == "__main__":
    main()
