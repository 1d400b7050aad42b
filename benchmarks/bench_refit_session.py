"""Steady-state refits: the elastic refit session against a fixed gloo group, same processes.

Run with the project's environment (no vLLM needed)::

    python benchmarks/bench_refit_session.py [--refits 30] [--warmup 3] [--layers 4] [--hidden 512]

The program is bench_vllm_refit's model: a Llama of 4 layers, hidden 512, GQA (8 heads, 2 kv
heads), vocabulary 8192, fp32 (a ``config.json`` written here, ``tensors from hf``), FSDP2 on
training ranks 0..1 (``default: dp = shard(0)``) into vLLM's fused parameters
(``preset:llama/vllm_fused``) on 2 engines of tensor parallel 2, ranks 2..5. Six local gloo
worker processes (:class:`~layoutlang.cli.launch.LocalWorkers`) each hold both, built once:

- **fixed group**: what the vLLM integration did before its refits became elastic steps: one
  ``ProcessGroupGloo`` over the pool's TCPStore, :class:`elastic.groups.GlooTransport` over it
  (rank map identity) and a :class:`~layoutlang.runtime.Resharder`, whose ``run(sources,
  destinations)`` is one refit;
- **elastic session**: :func:`layoutlang.integrations.refit_session.fleet_session` (engine
  axis ``dp``, grow, await-rejoin, heartbeats, signed commit records), whose
  ``refit(step, step_fn)`` is one refit (a committed step; engine ranks return no sources and
  receive into ``session.destinations``).

Sources are synthetic weights made before the timing (``fill_synthetic``), destinations are
kept across refits on both paths. The two paths alternate (ABBA) after a warm-up, each refit
starting at a barrier of the pool's default group; a refit's time is the slowest rank's. The
last refit of each path is verified byte for byte on every engine rank. It prints each
path's median and best, and the ratio session / fixed (the target: at most 1.1x). Nothing is
asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

TRAINERS = 2
ENGINES = 2
TP = 2
WORLD = TRAINERS + ENGINES * TP
TIMEOUT = 120.0
WAYS = ("fixed group", "elastic session")


def write_config(directory: Path, args: argparse.Namespace) -> Path:
    """A Llama config.json, by hand (no transformers needed)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": args.vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    path = directory / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def program_text(config: Path) -> str:
    return (
        f'tensors from hf "{config}" as cfg dtype fp32\n'
        f"mesh train [dp = {TRAINERS}] on ranks 0..{TRAINERS - 1}\n"
        "layout train on train { default: dp = shard(0) }\n"
        f"mesh infer [dp = {ENGINES}, tp = {TP}] on ranks {TRAINERS}..{WORLD - 1}\n"
        'include "preset:llama/vllm_fused"\n'
        "reshard refit: train -> vllm_fused\n"
    )


def job(text: str, refits: int, warmup: int, namespace: str) -> dict[str, Any]:
    """One worker's part: build both paths, then alternate refits. Runs on every rank."""
    import torch
    import torch.distributed as dist

    import layoutlang
    from elastic.groups import GlooTransport
    from layoutlang.cli.launch import worker_context
    from layoutlang.integrations.refit_session import SessionAddress, fleet_session, job_secret
    from layoutlang.io.torch_dtypes import torch_dtype
    from layoutlang.io.weights import fill_synthetic, verify
    from layoutlang.runtime import Resharder

    rank, store, port = worker_context["rank"], worker_context["store"], worker_context["port"]
    program = layoutlang.loads(text)
    identity = {r: r for r in range(WORLD)}

    # the fixed group: one gloo group over the store, built once
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{namespace}-fixed", store), rank, WORLD,
                               timedelta(seconds=TIMEOUT))
    transport = GlooTransport(pg, rank, identity)
    resharder = Resharder(program, "refit", rank=rank, rank_map=identity, transport=transport, timeout=TIMEOUT)
    fixed_destinations = resharder.allocate() if rank in resharder.plan.destination.mesh else {}

    # the elastic session: the refit session of live engines, as the trainer and workers build it
    address = SessionAddress("127.0.0.1", port, namespace)
    session = fleet_session(
        program, "refit", rank=rank, store=store, address=address, secret=job_secret(None, rank=rank, group=False),
        engine_axis="dp", timeout=TIMEOUT,
    )

    # this rank's synthetic sources, made once (the same layout on both paths)
    source = session.source
    sources: dict[str, torch.Tensor] = {}
    if rank in source.mesh:
        sources = {
            name: torch.zeros(shape, dtype=torch_dtype(source.tensors[source.storage(name, rank).parts[0]].dtype))
            for name, shape in source.storages_on(rank).items()
        }
        fill_synthetic(source, rank, sources, version=0)

    def fixed(step: int) -> None:
        resharder.run(sources, fixed_destinations)

    def elastic(step: int) -> None:
        session.refit(step, lambda _step, _session: sources)

    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    paths = {"fixed group": fixed, "elastic session": elastic}
    step = 0
    for i in range(warmup + refits):
        order = WAYS if i % 2 == 0 else WAYS[::-1]  # ABBA: neither path always goes first
        for way in order:
            dist.barrier()
            begin = time.perf_counter()
            paths[way](step)
            elapsed = time.perf_counter() - begin
            if way == "elastic session":
                step += 1
            if i >= warmup:
                seconds[way].append(elapsed)
    checks = {}
    if rank in session.destination.mesh:
        for way, layout, storages in (("fixed group", resharder.plan.destination, fixed_destinations),
                                      ("elastic session", session.destination, session.destinations)):
            v = verify(layout, rank, storages, version=0)
            checks[way] = {"ok": v.ok, "bytes": v.bytes}
    out = {
        "rank": rank, "seconds": seconds, "checks": checks, "generation": session.generation,
        "recoveries": len(session.recoveries), "network_bytes": resharder.plan.stats.bytes["network"],
        "session_network_bytes": session.plan.stats.bytes["network"] if session.plan is not None else None,
    }
    dist.barrier()
    session.close()
    transport.abort()
    return out


def main() -> None:
    import layoutlang
    from layoutlang.cli.launch import LocalWorkers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refits", type=int, default=30, help="timed refits of each path")
    parser.add_argument("--warmup", type=int, default=3, help="untimed refits of each path first")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-refit-session-") as tmp:
        text = program_text(write_config(Path(tmp), args))
        params = sum(math.prod(t.shape) for t in layoutlang.loads(text).layout("train").tensors.values())
        started = time.perf_counter()
        with LocalWorkers(WORLD, timeout=TIMEOUT) as pool:
            results = pool.run(job, text, args.refits, args.warmup, "bench-session", timeout=1800)
        wall = time.perf_counter() - started
    per_refit = {
        way: [max(r["seconds"][way][i] for r in results) for i in range(args.refits)] for way in WAYS
    }
    print(f"program: Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32 "
          f"({params / 1e6:.1f} M parameters); FSDP2 on ranks 0..{TRAINERS - 1} -> preset:llama/vllm_fused, "
          f"{ENGINES} engines x TP {TP} on ranks {TRAINERS}..{WORLD - 1}")
    print(f"{WORLD} local gloo workers (LocalWorkers), both paths in the same processes; {args.warmup} warm-up + "
          f"{args.refits} timed refits each, alternating (ABBA); a refit's time is its slowest rank's")
    print(f"network bytes per refit: {results[0]['network_bytes']:,} (fixed), "
          f"{results[0]['session_network_bytes']:,} (session)")
    print(f"{'path':<18}{'median s':>10}{'best s':>10}")
    medians = {}
    for way in WAYS:
        medians[way] = statistics.median(per_refit[way])
        print(f"{way:<18}{medians[way]:>10.4f}{min(per_refit[way]):>10.4f}")
    ratio = medians["elastic session"] / medians["fixed group"]
    best = min(per_refit["elastic session"]) / min(per_refit["fixed group"])
    print(f"ratio session / fixed: median {ratio:.3f}x, best {best:.3f}x "
          f"(target at most 1.1x: {'met' if ratio <= 1.1 else 'NOT met'})")
    checks = [c for r in results for c in r["checks"].items()]
    bad = [f"rank {r['rank']} {way}" for r in results for way, c in r["checks"].items() if not c["ok"]]
    print(f"verified: {len(checks)} destinations (engine ranks x paths), "
          + ("all equal to the synthetic weights" if not bad else "MISMATCH on " + ", ".join(bad)))
    generations = {r["generation"] for r in results}
    recoveries = max(r["recoveries"] for r in results)
    print(f"session generation(s) at the end: {sorted(generations)}; recoveries: {recoveries}; wall {wall:.1f} s")


if __name__ == "__main__":
    main()
