"""A step committed while a member was still waiting for its outcome is reported in the
generation it committed in.

When a step's commit admits a joiner, every member grows right after it: the members that
read the outcome propose the next generation at once. A member still in its commit wait may
see that generation agreed before it reads the outcome (its wait watches for a newer
generation); it then recovers, finds the step committed, and enters the grown generation.
Its report of the step must still name the generation, members and layouts the step
committed in: before, it named the grown ones (the flake of
``test_elastic_session_nccl.py::test_a_joiner_takes_the_place_of_a_dead_rank...``: step
generations [0, 2, 2, 2] where the others saw [0, 1, 2, 2]).

Here the race is forced: in the commit of a step while a joiner waits to be admitted, rank
SLOW counts itself done first, and its wait looks at nothing until the next generation is
agreed.
"""

from __future__ import annotations

import os
import signal
import time
from itertools import count

import pytest
from test_elastic_session import PROGRAM

from elastic import ExitWatcher

pytestmark = [pytest.mark.timeout(150), pytest.mark.workers(9, scope="module")]

STEPS = 4
VICTIM, SLOW, JOINER = 5, 2, 8
_namespaces = count()


class _LateWatch:
    """The session's watch, except that in the commit wait of a step while a joiner waits
    to be admitted (``late``), it first waits (bounded) for the next generation to be
    agreed: this rank reads the outcome of the step that admits the joiner only after the
    others have grown."""

    def __init__(self, watch, membership):
        self._watch, self._membership = watch, membership
        self.late = False

    def __getattr__(self, name):
        return getattr(self._watch, name)

    def __call__(self) -> None:
        if self.late:
            g = self._membership.current()
            end = time.monotonic() + 10
            while self._membership.members_of(g + 1) is None and time.monotonic() < end:
                time.sleep(0.01)
        self._watch()


def race_job(text, steps, *, namespace):
    """Refits with a kill (VICTIM, mid-transfer of step 1), a joiner (JOINER) and the late
    watch on SLOW; returns every committed step's report."""
    import layoutlang
    from elastic import ElasticSession
    from layoutlang.cli.elastic_job import synthetic_sources
    from layoutlang.cli.launch import worker_context

    rank, store, port = worker_context["rank"], worker_context["store"], worker_context["port"]

    def progress(step, done, total):
        if rank == VICTIM and step == 1 and done == max(1, total // 2):
            os.kill(os.getpid(), signal.SIGKILL)

    program = layoutlang.loads(text)
    with ElasticSession(
        program,
        rank=rank,
        store=store,
        port=port,
        namespace=namespace,
        deadline=1.0,
        timeout=40.0,
        join=rank == JOINER,
    ) as session:
        # The test's hooks, on this rank's own recoverer: in the commit of a step that can
        # admit the joiner, SLOW counts itself done first and reads the outcome last.
        recoverer, membership = session._recoverer, session.membership
        late = recoverer.watch = _LateWatch(recoverer.watch, membership)
        commit = recoverer.commits.commit

        def hooked_commit(name, **options):
            admitting = name.startswith("commit/") and bool(membership.join_requests(membership.current() + 1))
            if admitting and rank != SLOW:
                time.sleep(0.5)
            late.late = admitting and rank == SLOW
            try:
                return commit(name, **options)
            finally:
                late.late = False

        recoverer.commits.commit = hooked_commit
        reports = [
            session.refit(step, synthetic_sources, progress=progress).to_json()
            for step in range(session.next_step, steps)
        ]
        return {"rank": rank, "reports": reports, "generation": session.generation}


def test_a_member_that_reads_the_outcome_after_the_grow_reports_the_step_where_it_committed(pool):
    namespace = f"race{next(_namespaces)}"
    pool.respawn()
    pool.run(os.getpid)
    expect = [r for r in range(pool.size) if r != VICTIM]
    results: dict[int, dict] = {}
    try:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=namespace):
            pool.submit(race_job, PROGRAM, STEPS, namespace=namespace)
            end = time.monotonic() + 100
            while not set(expect) <= set(results) and time.monotonic() < end:
                result = pool.next_result(0.1)
                if result is None:
                    continue
                rank, ok, value = result
                assert ok, f"rank {rank} failed: {value[1]}"
                results[rank] = value
    finally:
        pool.respawn()
    assert set(expect) <= set(results), f"ranks {sorted(set(expect) - set(results))} did not finish"
    by_step: dict[int, set[tuple]] = {}
    finals = set()
    for rank in expect:
        finals.add(results[rank]["generation"])
        for report in results[rank]["reports"]:
            seen = (report["generation"], tuple(report["members"]), report["destination"])
            by_step.setdefault(report["step"], set()).add(seen)
    assert len(finals) == 1, finals  # every member ends in the same generation
    # every member reports each step with the same generation, members and layout
    assert all(len(seen) == 1 for seen in by_step.values()), by_step
    steps = [next(iter(by_step[s])) for s in range(STEPS)]
    generations = [g for g, _, _ in steps]
    # step 0 before the kill; generations only go up; each step names the layout of its generation
    assert generations[0] == 0 and generations == sorted(generations), generations
    assert all(d == ("serve" if g == 0 else f"serve_gen{g}") for g, _, d in steps), steps
    # How many steps commit before the joiner is admitted is the machine's timing. The step
    # whose commit admitted it is the last one reported without it; it names the generation
    # it committed in (the survivors without VICTIM), which the grow then left.
    admitting = max(s for s, (_, members, _) in enumerate(steps) if JOINER not in members)
    generation, members, _ = steps[admitting]
    assert admitting >= 1 and generation >= 1 and VICTIM not in members, steps  # after the shrink
    assert finals.pop() > generation
    assert all(JOINER in m and VICTIM not in m for _, m, _ in steps[admitting + 1 :]), steps
    assert results[JOINER]["reports"] == [] or results[JOINER]["reports"][0]["step"] == admitting + 1
