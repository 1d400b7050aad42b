"""Jobs that tests/test_launch.py runs on a LocalWorkers pool: ranks that stop, die or fail."""

from __future__ import annotations

import os
import signal
import time

from layoutlang.cli.launch import worker_context
from layoutlang.errors import ExecutionError


def one_rank_stops(stopped: int) -> int:
    """``stopped`` SIGSTOPs itself (a hung host); the others fail, as an exchange with it would."""
    rank = worker_context["rank"]
    if rank == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
        return rank
    time.sleep(0.5)
    raise ExecutionError(f"rank {rank}: receiving from rank {stopped} did not complete", rank=rank, peers=[stopped])


def one_rank_is_killed(killed: int) -> int:
    rank = worker_context["rank"]
    if rank == killed:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)
    return rank


def resharder_on_the_group(path: str, rank_map: dict[int, int] | None = None) -> str:
    """Build a Resharder of ``path`` on the launcher's process group, as a framework would."""
    from layoutlang.runtime import Resharder

    Resharder(path, rank_map=rank_map, timeout=60.0)
    return "built"


def resharder_on_a_subgroup(path: str, members: list[int]) -> str:
    """Build a Resharder of ``path`` on the subgroup of the launcher's processes ``members``."""
    import torch.distributed as dist

    from layoutlang.runtime import Resharder

    group = dist.new_group(members)  # every process takes part in making a group
    if dist.get_rank() not in members:
        return "outside"
    Resharder(path, group=group, timeout=60.0)
    return "built"
