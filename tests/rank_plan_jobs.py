"""Jobs of tests/test_rank_plans_execute.py: refits with per-rank plans on every rank.

Each job takes the program per program rank (``programs``: a path or a text; "default" for the rest)
and the program ranks the pool's workers play (``participants[i]`` is worker i's); workers
beyond them return None. Jobs return plain data.
"""

from __future__ import annotations

import torch.distributed as dist

import layoutlang
from layoutlang.errors import LayoutError, RuntimeFailure
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder


def _program_rank(participants):
    index = dist.get_rank()
    return participants[index] if index < len(participants) else None


def refit_per_rank(programs, participants, per_rank_by_rank=None, memory_budget=None, timeout=30.0):
    """Reshard once with a Resharder whose plan mode is ``per_rank_by_rank[rank]`` (default:
    True); verify every destination byte against the synthetic truth, or return the error."""
    rank = _program_rank(participants)
    if rank is None:
        return None
    program_of = programs.get(rank, programs["default"])
    per_rank = (per_rank_by_rank or {}).get(rank, True)
    kwargs = {"memory_budget": memory_budget} if memory_budget else {}
    # a path (an example that includes others), or the text of a program
    program = layoutlang.load(program_of) if program_of.endswith(".layout") else layoutlang.loads(program_of)
    try:
        resharder = Resharder(
            program,
            rank=rank,
            rank_map={p: i for i, p in enumerate(participants)},
            timeout=timeout,
            per_rank=per_rank,
            **kwargs,
        )
    except (LayoutError, RuntimeFailure) as err:
        return {"rank": rank, "error": type(err).__name__ + ": " + err.message}
    plan = resharder.plan
    sources = resharder.allocate("source")
    fill_synthetic(plan.source, rank, sources)
    destinations = resharder.run(sources)
    check = verify(plan.destination, rank, destinations) if rank in plan.destination.mesh else None
    report = resharder.last_report
    assert report is not None
    return {
        "rank": rank,
        "error": None,
        "plan_rank": plan.rank,
        "mode": plan.mode,
        "moves": plan.num_moves,
        "verified": None if check is None else check.ok,
        "mismatches": [] if check is None else list(check.mismatches)[:5],
        "verified_bytes": 0 if check is None else check.bytes,
        "steps": report.steps,
        "peak_staging": report.peak_staging_bytes,
        "fingerprint": plan.fingerprint,
    }
