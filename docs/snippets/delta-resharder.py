"""Delta refits with the Python API: after each training step, only what changed moves.

    python docs/snippets/delta-resharder.py

It starts six local worker processes: ranks 0..1 train (``tp = 2``), ranks 8..11 serve four
replicas of the whole tensor (``examples/tp_to_dp.layout``). Each rank builds one Resharder
and refits four times into the same destination storages with ``delta=True``: the first
refit moves everything (no receiver holds a version yet); before each later one, the
training ranks change 0.5% of their elements. Every inference rank checks its storages
against a dense refit of the same weights, bit for bit.
"""

from __future__ import annotations

import torch

import layoutlang
from layoutlang.cli.launch import LocalWorkers, worker_context
from layoutlang.io.weights import fill_synthetic
from layoutlang.runtime import Resharder

PROGRAM = "examples/tp_to_dp.layout"
PARTICIPANTS = [0, 1, 8, 9, 10, 11]  # the program's ranks; worker i plays PARTICIPANTS[i]


def worker() -> list[dict]:
    rank = PARTICIPANTS[worker_context["rank"]]
    program = layoutlang.load(PROGRAM)
    group = {r: i for i, r in enumerate(PARTICIPANTS)}  # program rank -> process
    resharder = Resharder(program, rank=rank, rank_map=group)
    oracle = Resharder(program, rank=rank, rank_map=group)  # dense, into fresh storages
    sources = resharder.allocate("source")
    fill_synthetic(resharder.plan.source, rank, sources)
    held = resharder.allocate("destination")  # the engine's weights: handed at every refit
    steps = []
    generator = torch.Generator().manual_seed(7)  # the same on both training ranks
    for step in range(4):
        if step:  # a training step: 0.5% of the elements change
            for tensor in sources.values():
                where = torch.randperm(tensor.numel(), generator=generator)[: tensor.numel() // 200]
                tensor.view(-1)[where] += 1
        resharder.run(sources, held, delta=True)
        report = resharder.last_report.delta
        dense = oracle.run(sources)  # every rank takes part in every run
        same = all(torch.equal(held[n], dense[n]) for n in held)
        steps.append({"rank": rank, "wire": report.wire_bytes, "dense": report.dense_bytes,
                      "messages": report.messages, "same": same})
    return steps


def main() -> None:
    with LocalWorkers(len(PARTICIPANTS)) as pool:
        results = pool.run(worker)
    for step, by_rank in enumerate(zip(*results)):
        wire = sum(r["wire"] for r in by_rank)
        dense = sum(r["dense"] for r in by_rank)
        encodings = {k: sum(r["messages"][k] for r in by_rank) for k in by_rank[0]["messages"]}
        shown = ", ".join(f"{k} {v}" for k, v in encodings.items() if v)
        same = "identical to a dense refit" if all(r["same"] for r in by_rank) else "DIFFERENT"
        print(f"refit {step}: {wire:>9,} bytes on the wire of {dense:,} dense ({shown}); {same}")


if __name__ == "__main__":
    main()
