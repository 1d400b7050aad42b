"""How many of a bf16 inference engine's weights change per RL training step (issue 25's delta refits).

An RL trainer keeps fp32 master weights; the engine serves their bf16 cast. At RL learning
rates most updates fall below bf16's precision, so most of the engine's elements keep their
bits from one step to the next, and a refit only needs to move the elements that changed.
This script measures how many do on real training:

- two tiny models, random init with a fixed seed, nothing downloaded: a Llama
  (``LlamaConfig``: hidden 64, 2 layers, vocabulary 512) and a Qwen3-MoE (``Qwen3MoeConfig``:
  hidden 128, 2 layers, 8 experts, top-k 2, fused expert tensors as transformers 5 holds them);
- trained with FSDP2 (``torch.distributed.fsdp.fully_shard`` on each decoder layer, then the
  root) on 2 gloo ranks on the CPU (two processes spawned by ``torch.multiprocessing``
  on a TCPStore on 127.0.0.1 that the parent serves on a free port), fp32 master weights
  (the sharded parameters; ``--compute-dtype bf16``, the default, computes forward and
  backward in bf16 and reduces gradients in fp32 through FSDP2's ``MixedPrecisionPolicy``,
  as RL trainers do), AdamW (betas 0.9/0.999, ``--weight-decay`` 0.01), at each learning
  rate of ``--lrs`` (1e-6 and 1e-5) for ``--steps`` (10) steps, on random token batches
  (``--batch`` sequences of ``--seq`` tokens per rank, different on each rank) with the
  causal LM loss (labels = input ids), all seeded;
- after the initial weights and after each step, every parameter's full value
  (``DTensor.full_tensor()``, an all-gather) is cast to bf16 as an engine would serve it, and
  its bits (``.view(torch.int16)``) are compared with the previous cast's: NaN, -0.0 and
  +0.0 count as changed when their bits differ.

Per model, learning rate and step it prints: the fraction of bf16 elements changed (all
parameters together), the changed and total element counts, the fraction of fp32 master
elements that changed (they almost all do: the update is below bf16's precision, not
zero), and the bytes a delta refit would put on the wire against a dense one. Dense is 2
bytes per element. The delta encodes each tensor with the cheapest of three encodings,
plus an 8-byte header per tensor: dense (2 bytes per element), bitmask (ceil(n / 8) bytes
+ 2 bytes per changed element) or indices (a 4-byte index + 2 bytes per changed element);
the table shows how many tensors took each, and dense / delta. Only rank 0 prints.

Exit status 1 if a worker fails or a figure is out of range (a fraction outside [0, 1], a
delta larger than dense plus its headers).

    python benchmarks/bench_delta_density.py                 # about 10 s on 2 quiet cores
    python benchmarks/bench_delta_density.py --steps 2 --lrs 1e-5 --models llama   # a smoke test
    # --models llama,qwen3_moe --lrs 1e-6,1e-5 --steps N --batch B --seq S --hidden H --layers L
    # --vocab V --experts E --compute-dtype fp32|bf16 --weight-decay WD --seed N --json FILE
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import timedelta
from typing import Any

WORLD_SIZE = 2
HEADER_BYTES = 8  # per tensor: which encoding, and its length
BF16_BYTES = 2
INDEX_BYTES = 4
MODELS = ("llama", "qwen3_moe")


def encoded_bytes(numel: int, changed: int) -> tuple[str, int]:
    """The cheapest encoding of one tensor's delta (header included) and its size in bytes."""
    sizes = {
        "dense": BF16_BYTES * numel,
        "bitmask": math.ceil(numel / 8) + BF16_BYTES * changed,
        "indices": (INDEX_BYTES + BF16_BYTES) * changed,
    }
    encoding = min(sizes, key=lambda name: sizes[name])
    return encoding, sizes[encoding] + HEADER_BYTES


def build_model(name: str, args: argparse.Namespace) -> Any:
    """A tiny model with random fp32 weights, the same on every rank (seeded)."""
    import torch
    import transformers

    common = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 16,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(128, args.seq),
        "tie_word_embeddings": False,
    }
    torch.manual_seed(args.seed)
    if name == "llama":
        config = transformers.LlamaConfig(intermediate_size=4 * args.hidden, **common)
        return transformers.LlamaForCausalLM(config).float()
    config = transformers.Qwen3MoeConfig(
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_experts=args.experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **common,
    )
    return transformers.Qwen3MoeForCausalLM(config).float()


def full_bf16(model: Any) -> dict[str, tuple[Any, Any]]:
    """Every parameter's full value: its fp32 master and the bf16 cast's bits (int16)."""
    import torch

    out = {}
    for name, param in model.named_parameters():
        full = param.detach().full_tensor()  # an all-gather: every rank takes part
        out[name] = (full.clone(), full.to(torch.bfloat16).view(torch.int16))
    return out


def compare(previous: dict[str, tuple[Any, Any]], current: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The figures of one step: changed bf16 elements and the delta's wire bytes."""
    import torch

    changed = total = fp32_changed = delta = 0
    encodings = dict.fromkeys(("dense", "bitmask", "indices"), 0)
    for name, (master, bits) in current.items():
        old_master, old_bits = previous[name]
        n = bits.numel()
        k = int((bits != old_bits).sum())
        encoding, size = encoded_bytes(n, k)
        encodings[encoding] += 1
        changed += k
        total += n
        delta += size
        fp32_changed += int((master.view(torch.int32) != old_master.view(torch.int32)).sum())
    dense = BF16_BYTES * total
    return {
        "changed": changed,
        "total": total,
        "fraction": changed / total,
        "fp32_fraction": fp32_changed / total,
        "dense_bytes": dense,
        "delta_bytes": delta,
        "ratio": dense / delta,
        "tensors": len(current),
        "encodings": encodings,
    }


def train(rank: int, name: str, lr: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train one model at one learning rate; rank 0 returns (and prints) each step's figures."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(name, args)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32,
        reduce_dtype=torch.float32,
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay, foreach=False)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches

    rows = []
    previous = full_bf16(model)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        current = full_bf16(model)
        if rank == 0:
            row = {"model": name, "lr": lr, "step": step, "loss": float(loss.detach()), **compare(previous, current)}
            rows.append(row)
            print_row(row)
        previous = current
    return rows


TABLE_HEADER = (
    f"{'model':<10} {'lr':>7} {'step':>4} {'loss':>7} {'bf16 changed':>12} {'changed':>9} {'total':>9} "
    f"{'fp32 changed':>12} {'dense B':>9} {'delta B':>9} {'dense/delta':>11}  encodings d/b/i"
)


def print_row(row: dict[str, Any]) -> None:
    e = row["encodings"]
    print(
        f"{row['model']:<10} {row['lr']:>7.0e} {row['step']:>4} {row['loss']:>7.3f} {row['fraction']:>12.4%} "
        f"{row['changed']:>9} {row['total']:>9} {row['fp32_fraction']:>12.2%} {row['dense_bytes']:>9} "
        f"{row['delta_bytes']:>9} {row['ratio']:>10.2f}x  {e['dense']}/{e['bitmask']}/{e['indices']}",
        flush=True,
    )


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=args.timeout))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=args.timeout)
    )
    try:
        rows: list[dict[str, Any]] = []
        if rank == 0:
            print(TABLE_HEADER, flush=True)
        for name in args.models:
            for lr in args.lrs:
                begin = time.perf_counter()
                rows += train(rank, name, lr, args)
                if rank == 0:
                    print(f"  ({name}, lr {lr:.0e}: {args.steps} steps in {time.perf_counter() - begin:.1f} s)",
                          flush=True)
        if rank == 0:
            summarize(rows, args)
    finally:
        dist.destroy_process_group()


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The mean over steps per model and learning rate; the range checks; the JSON file."""
    print()
    print(f"{'model':<10} {'lr':>7} {'mean bf16 changed':>18} {'min .. max':>20} {'dense/delta (mean)':>19}")
    bad = []
    for name in args.models:
        for lr in args.lrs:
            mine = [r for r in rows if r["model"] == name and r["lr"] == lr]
            fractions = [r["fraction"] for r in mine]
            ratio = sum(r["dense_bytes"] for r in mine) / sum(r["delta_bytes"] for r in mine)
            print(f"{name:<10} {lr:>7.0e} {sum(fractions) / len(fractions):>18.4%} "
                  f"{f'{min(fractions):.4%} .. {max(fractions):.4%}':>20} {ratio:>18.2f}x")
    for r in rows:
        if not 0.0 <= r["fraction"] <= 1.0:
            bad.append(f"{r['model']} lr {r['lr']} step {r['step']}: fraction {r['fraction']}")
        if r["delta_bytes"] > 1.01 * r["dense_bytes"] + HEADER_BYTES * r["tensors"]:
            bad.append(f"{r['model']} lr {r['lr']} step {r['step']}: delta {r['delta_bytes']} > dense + headers")
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"args": meta, "world_size": WORLD_SIZE, "rows": rows}, f, indent=1)
        print(f"figures written to {args.json}")
    if bad:
        raise RuntimeError("out of range: " + "; ".join(bad))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: llama, qwen3_moe")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated AdamW learning rates")
    parser.add_argument("--steps", type=int, default=10, help="training steps per model and learning rate")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8, help="Qwen3-MoE experts (top-k 2)")
    parser.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="FSDP2's param_dtype for forward/backward; masters and reductions stay fp32")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the store and gloo")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    args.lrs = [float(lr) for lr in args.lrs.split(",") if lr]
    if args.steps < 1 or not args.lrs or not args.models:
        parser.error("need at least one model, one learning rate and one step")
    if args.hidden % 16:
        parser.error("--hidden must be a multiple of 16 (head_dim 16)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import transformers

    print(f"bench_delta_density: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Python {sys.version.split()[0]}; FSDP2 on {WORLD_SIZE} gloo ranks (CPU), 1 thread each", flush=True)
    print(f"  models {', '.join(args.models)}; AdamW lr {', '.join(f'{lr:g}' for lr in args.lrs)}, "
          f"weight decay {args.weight_decay:g}; {args.steps} steps of {args.batch} x {args.seq} random tokens "
          f"per rank; compute {args.compute_dtype}, fp32 masters; seed {args.seed}", flush=True)
    begin = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=args.timeout))  # a free port
    try:
        mp.spawn(worker, args=(store.port, args), nprocs=WORLD_SIZE, join=True)
    except mp.ProcessRaisedException as error:
        print(f"a worker failed: {error}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as error:
        print(f"a worker exited: {error}", file=sys.stderr)
        return 1
    print(f"total {time.perf_counter() - begin:.1f} s; load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
