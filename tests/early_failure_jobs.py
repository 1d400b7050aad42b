"""Jobs that tests/test_early_failures.py runs on a LocalWorkers pool: one rank fails before
the run's agreement (building its executor, preparing its output), or a task blocks.

Each job catches what the rank raises and returns it as plain data (its type, message,
traceback and the seconds it took), so a test can say what every rank saw. Whatever a job
patches on its rank is restored before it returns: the pool is shared with other modules.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

import layoutlang
from layoutlang.cli import apply_job
from layoutlang.cli.apply_job import ApplyOptions, apply_on_rank
from layoutlang.cli.launch import worker_context
from layoutlang.errors import LayoutValueError, ModelDescriptionError
from layoutlang.runtime import Resharder, executor, resharder


def _outcome(started: float, err: BaseException | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": extra.pop("rank"), "seconds": time.monotonic() - started, **extra}
    if err is None:
        out.update(error=None, message="", traceback="")
    else:
        out.update(
            error=type(err).__name__,
            message=getattr(err, "message", str(err)),
            traceback="".join(traceback.format_exception(err)),
        )
    return out


def build_resharder(text: str, participants: list[int], victim: int, how: str, timeout: float) -> dict | None:
    """Every participant builds a Resharder of ``text``; on program rank ``victim`` building
    its executor fails ``how``: "wrong-part" (it is handed the per-rank plan of the next rank,
    which the executor refuses), "bug" (its schedule raises RuntimeError)."""
    index = dist.get_rank()
    if index >= len(participants):
        return None
    rank = participants[index]
    program = layoutlang.loads(text)
    compile_plan, schedule = resharder.compile_plan, executor.schedule
    if rank == victim and how == "wrong-part":
        other = participants[(participants.index(victim) + 1) % len(participants)]

        def wrong_part(program, reshard=None, **options):
            return compile_plan(program, reshard, **{**options, "rank": other})

        resharder.compile_plan = wrong_part
    elif rank == victim and how == "bug":

        def broken_schedule(plan, rank):
            raise RuntimeError(f"schedule broke on rank {rank}")

        executor.schedule = broken_schedule
    elif rank == victim:
        raise ValueError(f"unknown failure {how!r}")
    started = time.monotonic()
    error: BaseException | None = None
    try:
        Resharder(program, rank=rank, rank_map={p: i for i, p in enumerate(participants)}, timeout=timeout)
    except Exception as err:
        error = err
    finally:
        resharder.compile_plan, executor.schedule = compile_plan, schedule
    return _outcome(started, error, rank=rank)


def apply_into(options: ApplyOptions, participants: list[int]) -> dict | None:
    """``apply``'s job on this worker (program rank ``participants[i]``), its failure returned."""
    index = dist.get_rank()
    if index >= len(participants):
        return None
    rank = participants[index]
    started = time.monotonic()
    error: BaseException | None = None
    report = None
    try:
        report = apply_on_rank(options, rank, {p: i for i, p in enumerate(participants)})
    except Exception as err:
        error = err
    return _outcome(started, error, rank=rank, ok=report is not None, hint=getattr(error, "hint", None))


def apply_without_the_checkpoint_on(options: ApplyOptions, participants: list[int], victim: int) -> dict | None:
    """``apply_into``, where program rank ``victim`` cannot open the ``--from`` checkpoint (its
    host's copy is missing: the launcher, on another host, checked its own)."""
    index = dist.get_rank()
    if index >= len(participants) or participants[index] != victim:
        return apply_into(options, participants)
    opened = apply_job.SafetensorsCheckpoint

    class Missing(opened):  # type: ignore[misc,valid-type]
        def __init__(self, path: str, **_: Any):
            raise ModelDescriptionError(f"{path}: cannot read safetensors file: No such file or directory")

    apply_job.SafetensorsCheckpoint = Missing  # type: ignore[misc]
    try:
        return apply_into(options, participants)
    finally:
        apply_job.SafetensorsCheckpoint = opened  # type: ignore[misc]


def fail_on_rank_0_block_elsewhere() -> int:
    """Rank 0 raises at once (a user's mistake); every other rank blocks for good, as a rank
    waiting for a peer that never comes would (until its own timeout, much later)."""
    rank = worker_context["rank"]
    if rank == 0:
        time.sleep(0.2)
        raise LayoutValueError("rank 0: the checkpoint has no tensor 'w'")
    threading.Event().wait()  # never set
    return rank


def group_sum() -> int:
    """The sum of every worker's rank, over the pool's process group (it works, whole)."""
    import torch

    value = torch.tensor([worker_context["rank"]])
    dist.all_reduce(value)
    return int(value)
