"""A refit between Ray actors of your own: two trainer ranks and two engine ranks.

    python docs/snippets/ray-refit.py

Runs on the Ray cluster RAY_ADDRESS names, or on a local one it starts. A rendezvous actor
serves the job's store and holds its secret; each actor mixes in ``LayoutlangRank`` and
joins the job by its name: no address or port is set anywhere. The trainers (ranks 0, 1)
hold ``w`` split in two (``tp = 2``); each engine (ranks 2, 3) receives the whole of it
and checks every byte against the synthetic weights the trainers filled in.
"""

from __future__ import annotations

import ray

import layoutlang
from layoutlang.integrations.ray import LayoutlangRank, start_rendezvous
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder

PROGRAM = """
mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 2] on ranks 2..3
tensor "w" [1024, 256] bf16
layout tp on train { "w": tp = shard(0) }
layout dp on infer { default: replicate }
reshard tp -> dp
"""


@ray.remote
class Rank(LayoutlangRank):
    """A trainer or an engine: which one, its rank in the program says."""

    def refit(self, job: str, rank: int) -> str:
        self.join_layoutlang(job, rank)  # finds the job's rendezvous actor by name
        resharder = Resharder(layoutlang.loads(PROGRAM), rank=rank)
        sources = resharder.allocate("source")  # empty on the engines
        fill_synthetic(resharder.plan.source, rank, sources)  # the trainers' weights
        received = resharder.run(sources)  # empty on the trainers
        self.leave_layoutlang()
        if not received:
            return f"rank {rank} (trainer): sent its shard"
        checked = verify(resharder.plan.destination, rank, received)
        return f"rank {rank} (engine): received {checked.bytes:,} bytes, all verified: {checked.ok}"


ray.init(logging_level="ERROR", log_to_driver=False)  # RAY_ADDRESS, or a local cluster
rendezvous = start_rendezvous("ray-refit-example", 4)  # the job's store and secret
ranks = [Rank.remote() for _ in range(4)]
for line in ray.get([actor.refit.remote("ray-refit-example", rank) for rank, actor in enumerate(ranks)]):
    print(line)
ray.shutdown()
