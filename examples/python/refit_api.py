"""Refit with the Python API, as an RL framework does it at every training step.

Run it from anywhere (it takes about half a minute on a laptop, most of it starting
processes)::

    python examples/python/refit_api.py

It starts four local worker processes, ranks 0..3 of one gloo group, as ``layoutlang
apply`` does. Ranks 0 and 1 play the trainer (FSDP: every weight split by rows), ranks 2
and 3 the inference engine (vLLM: column-parallel ``gate_up_proj`` fused, row-parallel
``down_proj``). Every rank builds one :class:`~layoutlang.runtime.Resharder`, then:

1. refit 1: the trainer's initial weights reach the engine; ``on_complete`` reports each
   engine parameter as soon as all its bytes have arrived; every byte is verified;
2. a training step changes the weights; refit 2 reuses the same Resharder (and plan) and
   writes into the same engine parameters, in place;
3. rank 3 hands a parameter of the wrong shape: every rank refuses the refit, before any
   byte moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.cli.launch import LocalWorkers
from layoutlang.errors import AgreementError
from layoutlang.io.weights import fill_synthetic, synthetic_box, verify
from layoutlang.runtime import Resharder

PROGRAM = """
topology { domain_size = 2 }

mesh train [dp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3

tensor "mlp.gate_proj.weight" [512, 256] bf16
tensor "mlp.up_proj.weight" [512, 256] bf16
tensor "mlp.down_proj.weight" [256, 512] bf16

layout fsdp on train { default: dp = shard(0) }

layout vllm on infer {
    "mlp.*_proj.weight": tp = shard(0)
    "mlp.down_proj.weight": tp = shard(1)
    storage "mlp.gate_up_proj.weight" = "mlp.gate_proj.weight" | "mlp.up_proj.weight"
}

reshard refit: fsdp -> vllm
"""

#: staging memory per rank: buckets of 128 KiB, so the refit takes several steps and the
#: engine's parameters complete one after the other
MEMORY_BUDGET = 256 * 1024


def size(nbytes: int) -> str:
    """Bytes as this example prints them (its tensors are whole KiB)."""
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def expected(layout, step):
    """The truth of refit ``step``: the synthetic weights, plus 1 per training step."""

    def truth(name, index, box):
        tensor = layout.tensors[name]
        return synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes) + (step - 1)

    return truth


def refit_worker(program_text: str) -> dict:
    """What every rank runs (a module-level function, so that workers can import it)."""
    rank = dist.get_rank()  # LocalWorkers: process rank i plays program rank i
    program = layoutlang.loads(program_text)

    # Once, at start-up: every rank compiles the same plan, and the ranks compare the
    # plans' fingerprints before going on.
    resharder = Resharder(program, "refit", memory_budget=MEMORY_BUDGET, timeout=60.0)
    plan = resharder.plan

    # The trainer's parameters (ranks 0, 1) and the engine's (ranks 2, 3), by storage name.
    # A real trainer passes its own tensors; here they hold synthetic weights.
    sources = resharder.allocate("source")
    fill_synthetic(plan.source, rank, sources)
    engine = resharder.allocate("destination")

    steps = []
    transfers = [0, 0]  # (done, total) of the refit in progress, kept up to date by `progress`

    def progress(done, total):
        transfers[:] = [done, total]

    completions: list[str] = []
    for step in (1, 2):
        if step == 2:
            for weight in sources.values():  # a training step changes every weight
                weight.add_(1)
        transfers[:] = [0, len(resharder.executor.steps)]

        def on_complete(name, tensor, step=step):
            # The engine may load (or post-process) this parameter now: no later transfer
            # of this refit writes or reads it. (Workers share one terminal: the messages go
            # back to the parent, which prints them in order.)
            completions.append(
                f"  rank {rank}, refit {step}: {name} complete ({size(tensor.nbytes)}), "
                f"during transfer step {transfers[0] + 1} of {transfers[1]}"
            )

        resharder.run(sources, engine, on_complete=on_complete, progress=progress)
        report = resharder.last_report
        check = (
            verify(plan.destination, rank, engine, truth=expected(plan.destination, step))
            if engine
            else None
        )
        steps.append(
            {
                "sent": sum(report.sent.values()),
                "received": sum(report.received.values()),
                "messages": report.messages_sent,
                "steps": report.steps,
                "peak_staging": report.peak_staging_bytes,
                "verified": None if check is None else (check.ok, check.bytes),
            }
        )

    # A mistake on one rank: rank 3 hands a parameter of the wrong shape. Every rank checks
    # its own storages, then all agree; one bad rank stops all of them before a byte moves.
    wrong = dict(engine)
    if rank == 3:
        wrong["mlp.down_proj.weight"] = torch.zeros(512, 256, dtype=torch.bfloat16)
    try:
        resharder.run(sources, wrong)
        refused = None
    except AgreementError as err:
        refused = err.message
    return {
        "rank": rank,
        "fingerprint": plan.fingerprint,
        "buckets": plan.num_buckets,
        "steps": steps,
        "refused": refused,
        "completions": completions,
    }


def main() -> None:
    print("starting 4 local workers (ranks 0..3, gloo)", flush=True)
    with LocalWorkers(4, timeout=120.0) as workers:
        results = workers.run(refit_worker, PROGRAM)

    fingerprints = {r["fingerprint"] for r in results}
    fingerprint = results[0]["fingerprint"][:16]
    print(f"\nplan fingerprint {fingerprint} on all {len(results)} ranks: {len(fingerprints) == 1}")
    print(f"buckets of {size(MEMORY_BUDGET // 2)}: {results[0]['buckets']} buckets")
    for line in sorted(c for r in results for c in r["completions"]):
        print(line)
    for step in (1, 2):
        print(f"refit {step}:")
        for r in results:
            s = r["steps"][step - 1]
            line = (
                f"  rank {r['rank']}: sent {size(s['sent'])} ({s['messages']} messages), "
                f"received {size(s['received'])}, {s['steps']} transfer steps, "
                f"peak staging {size(s['peak_staging'])}"
            )
            if s["verified"] is not None:
                ok, nbytes = s["verified"]
                line += f", verified {size(nbytes)}: {'ok' if ok else 'MISMATCH'}"
            print(line)
    refusals = {r["refused"] for r in results}
    print(
        f"refit 3, rank 3 hands a wrong shape: {len(results)} ranks raised "
        f"the same AgreementError: {len(refusals) == 1}"
    )
    print(f"  {results[0]['refused']}")
    ok = all(s["verified"] is None or s["verified"][0] for r in results for s in r["steps"])
    ok = ok and len(fingerprints) == 1 and len(refusals) == 1 and None not in refusals
    print("ok" if ok else "FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
