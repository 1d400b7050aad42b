"""What the multi-process GPU checks share: collecting each rank's step reports from its
queue, and printing one verdict per step (tests/gpu/multi_gpu.py, tests/gpu/refit_session_gpu.py).

A rank reports ``(rank, step, status, detail, seconds)``: status ``PASS``, ``FAIL``, ``SKIP``
or ``EXIT`` (the rank left on purpose, not counted); step ``error`` is a failure with its
traceback, and step ``shrunk`` tells the parent that the rank is ready for a joiner.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: step -> the reports of the ranks: (rank, status, detail, seconds)
Outcome = dict[str, list[tuple[int, str, str, float]]]


def collect(
    results: Any, procs: list[Any], steps: Sequence[str], timeout: float,
    on_shrunk: Callable[[set[int]], Any | None],
) -> tuple[Outcome, list[str]]:
    """Read reports until every process has ended or ``timeout`` passed; ``on_shrunk(ranks)``
    is called with the ranks that reported ``shrunk`` so far and may return a new process
    (a joiner), which is watched too. Returns the reports by step and the failures."""
    outcome: Outcome = {s: [] for s in steps}
    failures: list[str] = []
    shrunk: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rank, step, status, detail, elapsed = results.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        if step == "error":
            failures.append(f"rank {rank}: {detail}")
        elif step == "shrunk":
            shrunk.add(rank)
            joiner = on_shrunk(set(shrunk))
            if joiner is not None:
                procs.append(joiner)
        else:
            outcome[step].append((rank, status, detail, elapsed))
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            failures.append(f"a process (pid {p.pid}) did not finish")
    return outcome, failures


def verdicts(outcome: Outcome, expected: Mapping[str, int], failures: Sequence[str], detail_of: int = 0) -> bool:
    """Print one line per step (PASS when every expected rank passed, SKIP when all skipped)
    and the failures; returns whether everything passed or was skipped. ``detail_of``: which
    rank's detail to show, in rank order (0: the first, -1: the last)."""
    ok = not failures
    for step, count in expected.items():
        rows = sorted(outcome[step])
        counted = [r for r in rows if r[1] != "EXIT"]
        statuses = {s for _, s, _, _ in counted}
        if statuses == {"SKIP"}:
            verdict = "SKIP"
        elif statuses == {"PASS"} and len(counted) == count:
            verdict = "PASS"
        else:
            verdict, ok = "FAIL", False
        slowest = max((e for _, _, _, e in rows), default=0.0)
        detail = counted[detail_of][2] if counted else "no report"
        print(f"  {step:<8} {verdict:<4} {slowest:7.2f} s  {detail}")
    for f in failures:
        print("  " + f.replace("\n", "\n    "))
    return ok
