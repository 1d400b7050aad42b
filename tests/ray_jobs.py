"""What tests/test_ray.py runs inside Ray actors (importable by the cluster's workers)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from layoutlang.integrations.ray import LayoutlangRank
from layoutlang.integrations.workers import worker_context


class JoiningRank(LayoutlangRank):
    """An actor of the user's own that joins a layoutlang job as one of its ranks."""

    def join(self, job: str, rank: int, timeout: float) -> int:
        self.join_layoutlang(job, rank, timeout=timeout)
        return rank


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
