"""``layoutlang.runtime.redistribute`` reuses its Executor across calls: the same plan on the
same rank gets the same Executor back, another plan another one; the cache is bounded in
entries and in the arena bytes it keeps, and an Executor is never shared by two calls at once
(it is taken out while it runs) nor reused after a failed run."""

from __future__ import annotations

import pytest
import redistribute_jobs

from layoutlang.runtime.redistribute import _Executors

pytestmark = [pytest.mark.timeout(120), pytest.mark.workers(4, scope="module")]


def test_the_same_plan_reuses_its_executor_and_another_plan_gets_its_own(pool):
    for row in pool.run(redistribute_jobs.reuse):
        assert row == {"one_after_first": True, "same_executor": True, "another_for_another_plan": True,
                       "values": True}


def test_at_most_eight_executors_stay_the_most_recent_ones(pool):
    for row in pool.run(redistribute_jobs.bounded):
        assert row["right"]
        assert row["kept"] == [(4 * (k + 1), 8) for k in range(4, 12)]


def test_an_executor_whose_run_failed_is_not_reused(pool):
    for row in pool.run(redistribute_jobs.not_reused_after_a_failure):
        assert row == {"raised": True, "left": 0, "fresh": True, "values": True}


class _Arena:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _FakeExecutor:
    """What the cache reads of an Executor: its two staging arenas."""

    def __init__(self, *nbytes: int):
        self._arenas = tuple(_Arena(n) for n in nbytes)


def test_an_executor_is_taken_out_while_it_runs():
    cache = _Executors()
    executor = _FakeExecutor(0, 0)
    cache.give_back(("f", 0, "gloo"), executor, 100)
    assert cache.take(("f", 0, "gloo")) is executor
    assert cache.take(("f", 0, "gloo")) is None  # a second call at the same time builds its own
    assert cache.take(("g", 0, "gloo")) is None and len(cache) == 0


def test_the_arenas_kept_stay_within_the_memory_budget():
    """The least recently used go first until the kept arenas fit the budget; the one just
    given back stays (its own arenas fit the budget of the call that built it)."""
    cache = _Executors()
    a, b, c = _FakeExecutor(30, 30), _FakeExecutor(20, 20), _FakeExecutor(50, 40)
    cache.give_back(("a", 0, "gloo"), a, 100)
    cache.give_back(("b", 0, "gloo"), b, 100)
    assert len(cache) == 2  # 60 + 40 bytes
    cache.give_back(("c", 0, "gloo"), c, 100)
    assert len(cache) == 1 and cache.take(("c", 0, "gloo")) is c
    cache.give_back(("a", 0, "gloo"), a, 100)
    cache.give_back(("b", 0, "gloo"), b, 100)
    cache.give_back(("a", 0, "gloo"), cache.take(("a", 0, "gloo")), 100)  # a is now the most recent
    cache.give_back(("d", 0, "gloo"), _FakeExecutor(0, 40), 100)  # 60 + 40 + 40 > 100: b goes
    assert cache.take(("b", 0, "gloo")) is None and cache.take(("a", 0, "gloo")) is a
