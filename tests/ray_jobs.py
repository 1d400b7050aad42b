"""What tests/test_ray.py runs inside Ray actors (importable by the cluster's workers)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from layoutlang import lang
from layoutlang.integrations.ray import LayoutlangRank
from layoutlang.integrations.workers import worker_context
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder

#: A colocated refit on two ranks: each holds half of "w" to train, all of it to serve.
COLOCATED = """
mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 2] on ranks 0..1
tensor "w" [256, 64] bf16
layout tp on train { "w": tp = shard(0) }
layout dp on infer { default: replicate }
reshard tp -> dp
"""


class RefitRank(LayoutlangRank):
    """An actor of the user's own (a trainer, an engine) that becomes a layoutlang rank."""

    def refit(self, job: str, rank: int, timeout: float = 60.0) -> dict:
        self.join_layoutlang(job, rank, timeout=timeout)
        program = lang.loads(COLOCATED)
        resharder = Resharder(program, rank=rank, timeout=timeout)
        sources = resharder.allocate("source")
        fill_synthetic(resharder.plan.source, rank, sources)
        destinations = resharder.run(sources)
        checked = verify(resharder.plan.destination, rank, destinations)
        self.leave_layoutlang()
        return {"rank": rank, "ok": checked.ok, "bytes": checked.bytes}


def joined() -> dict:
    """What a pool worker knows of its job: no address of it was set by hand."""
    total = torch.tensor([worker_context["rank"]])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "sum": int(total),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "secret_set": bool(os.environ.get("LAYOUTLANG_JOB_SECRET")),
        "threads": torch.get_num_threads(),
    }


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
