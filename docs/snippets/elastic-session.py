"""Elastic refits with the Python API: a rank dies, the others shrink, a replacement joins.

    python docs/snippets/elastic-session.py

It starts seven local worker processes (about a minute on a small machine, most of it
importing torch): ranks 0..1 train (``tp = 2``), ranks 2..5 serve two inference replicas
(``dp = 2, tp = 2``), and rank 6 is a replacement that asks to be admitted. Every rank runs
:func:`worker`: one :class:`elastic.ElasticSession` that refits four times. Rank 3 SIGKILLs
itself halfway through the transfer of refit 1. The survivors shrink (its replica leaves
the destination layout), retry refit 1, admit rank 6 in rank 3's place, and go on; no
process restarts. After every committed refit, every inference rank verifies every byte
it holds.
"""

from __future__ import annotations

import os
import signal

import torch

import layoutlang
from elastic import Change, ElasticSession, ExitWatcher
from layoutlang.cli.launch import LocalWorkers, worker_context
from layoutlang.io.weights import fill_synthetic, verify

PROGRAM = """
topology { domain_size = 2 }

mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 2, tp = 2] on ranks 2..5

tensor "w1" [256, 256] fp32
tensor "w2" [256, 256] fp32

layout fsdp on train { default: tp = shard(0) }
layout serve on infer {
    "w1": tp = shard(0)
    "w2": tp = shard(1)
}

reshard refit: fsdp -> serve
"""

STEPS = 4
VICTIM, KILL_STEP = 3, 1  # rank 3 dies during refit 1
JOINER = 6  # the replacement rank


def step_fn(step: int, session: ElasticSession) -> dict[str, torch.Tensor]:
    """This rank's training weights after training step ``step``, as storages of
    ``session.source`` (the source layout of the current generation). Synthetic values:
    any rank can compute any element, so every received byte can be checked."""
    layout, rank = session.source, session.rank
    storages = {name: torch.empty(shape) for name, shape in layout.storages_on(rank).items()}
    fill_synthetic(layout, rank, storages, version=step)
    return storages


def worker(program_text: str) -> dict:
    """What every rank runs (a module-level function, so that workers can import it)."""
    rank = worker_context["rank"]  # LocalWorkers: process i is job rank i
    program = layoutlang.loads(program_text)
    hooks: list[str] = []
    failures: list[str] = []

    def on_shrink(change: Change) -> None:
        ranks = list(change.destination.mesh.ranks)
        hooks.append(f"on_shrink: generation {change.generation}, lost {list(change.lost)}, "
                     f"destination {change.destination.name} on ranks {ranks}")

    def on_grow(change: Change) -> None:
        ranks = list(change.destination.mesh.ranks)
        hooks.append(f"on_grow:   generation {change.generation}, joined {list(change.joined)}, "
                     f"destination {change.destination.name} on ranks {ranks}")

    def progress(step: int, done: int, total: int) -> None:
        if rank == VICTIM and step == KILL_STEP and done == max(1, total // 2):
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the transfer

    def on_step(step: int, session: ElasticSession) -> None:
        if rank in session.destination.mesh:
            check = verify(session.destination, rank, session.destinations, version=step)
            failures.extend(check.mismatches)

    with ElasticSession(
        program, "refit", rank=rank, store=worker_context["store"], port=worker_context["port"],
        join=rank == JOINER, memory_budget=128 * 1024, on_shrink=on_shrink, on_grow=on_grow,
    ) as session:
        joined = None
        if rank == JOINER:  # admitted: a recovery plan gave it the last committed weights
            joined = verify(session.destination, rank, session.destinations, version=session.committed_step).ok
        reports = session.run(step_fn, STEPS, on_step=on_step, progress=progress)
        return {
            "rank": rank, "hooks": hooks, "failures": failures, "joined": joined,
            "steps": [r.step for r in reports], "generation": session.generation,
            "members": session.members, "layouts": f"{session.source.name} -> {session.destination.name}",
        }


def main() -> None:
    print("7 local workers: ranks 0..5 refit fsdp -> serve, rank 6 waits to replace a lost rank")
    # The launcher watches its workers: an exit is noticed at once, not after the
    # heartbeat deadline.
    with LocalWorkers(7) as pool, ExitWatcher(pool.store, dict(enumerate(pool.processes))):
        pool.submit(worker, PROGRAM)
        results = pool.results_by_rank()
    print(f"rank {VICTIM} died during refit {KILL_STEP}" if VICTIM not in results else f"rank {VICTIM} did not die")
    done = {rank: value for rank, (ok, value) in sorted(results.items()) if ok}
    assert sorted(done) == [0, 1, 2, 4, 5, 6], results

    seen: dict[str, list[int]] = {}  # hook line -> the ranks that saw it
    for rank, value in done.items():
        for line in value["hooks"]:
            seen.setdefault(line, []).append(rank)
    print("hooks, and the ranks that ran them:")
    for line, ranks in seen.items():
        print(f"  {line}: ranks {ranks}")
    print(f"rank {JOINER} was admitted with the weights of the last committed refit: "
          f"{'verified' if done[JOINER]['joined'] else 'WRONG'}")
    original = [value for rank, value in done.items() if rank != JOINER]
    committed = all(value["steps"] == list(range(STEPS)) for value in original)
    print(f"refits 0..{STEPS - 1} committed on every survivor: {committed}")
    wrong = [m for value in done.values() for m in value["failures"]]
    print(f"every inference byte verified after every refit: {not wrong}")
    final = {(value["generation"], tuple(value["members"]), value["layouts"]) for value in done.values()}
    for generation, members, layouts in sorted(final):
        print(f"final generation {generation}: {layouts}, members {list(members)}")
    print("ok" if committed and not wrong and done[JOINER]["joined"] and len(final) == 1 else "FAILED")


if __name__ == "__main__":
    main()
