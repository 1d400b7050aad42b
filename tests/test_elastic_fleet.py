"""Elastic sessions over a fleet of engines, on 10 local gloo workers.

The destination's ``dp`` axis is the unit axis: each coordinate is one engine of ``tp = 2``
ranks, lost whole (vLLM stops an engine whose worker died), admitted whole and grown past its
first size, and given up on purpose. The training side is FSDP on 2 ranks (no replica): with
the source policy ``await-rejoin`` a lost training rank keeps its position, every refit raises
DataLossError until a new process takes it back under the same rank, and the session goes on.

Every test asserts outcomes, not one timing: every committed step verified byte for byte on
every destination rank, the final layout's ranks, the ranks lost, joined, left and rejoined in
some recovery, the survivors still the processes that started.

Program ranks: training 0..1, engines 2..3, 4..5, 6..7; ranks 8..9 are a joining engine
(an aligned unit: ``8 // 2 == 4``) or idle.
"""

from __future__ import annotations

import os
import time
from itertools import count
from typing import Any

import pytest
import torch.distributed as dist

from elastic.membership import LEFT
from elastic.recovery import UNIT_LOST
from tests.elastic_fleet_jobs import fleet_job

pytestmark = [pytest.mark.timeout(180), pytest.mark.workers(10, scope="module")]

PROGRAM = """
topology { domain_size = 2 }
mesh train [dp = 2] on ranks 0..1
mesh infer [dp = 3, tp = 2] on ranks 2..7
tensor "embed" [96, 32] fp32
tensor "layers.{l}.q" [64, 32] fp32 for l in 0..1
tensor "layers.{l}.norm" [32] fp32 for l in 0..1
layout fsdp on train { default: dp = shard(0) }
layout serve on infer {
    "embed": tp = shard(0)
    "layers.{l}.q": tp = shard(0)
    default: replicate
}
reshard refit: fsdp -> serve
"""
STEPS = 5
FLEET = {"unit_axis": "dp", "destination_axis": "dp", "grow": True}
_namespaces = count()


def _start(pool, text: str = PROGRAM, **job: Any) -> tuple[str, dict[int, int]]:
    pool.respawn()
    pool.run(os.getpid)  # every worker is up
    namespace = f"fleet{next(_namespaces)}"
    pool.submit(fleet_job, text, STEPS, namespace=namespace, **FLEET, **job)
    return namespace, {r: p.pid for r, p in enumerate(pool.processes)}


def _collect(pool, expect: set[int], timeout: float = 120.0, results: dict | None = None) -> dict[int, dict]:
    results = {} if results is None else results
    end = time.monotonic() + timeout
    while not expect <= set(results) and time.monotonic() < end:
        result = pool.next_result(0.2)
        if result is None:
            continue
        rank, ok, value = result
        assert ok, f"rank {rank} failed: {value[1]}"
        results[rank] = value
    assert expect <= set(results), f"ranks {sorted(expect - set(results))} did not finish"
    return results


def _finish(pool) -> None:
    pool.respawn()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # results of idle ranks
        pool.next_result(0.1)


def _restart(pool, namespace: str, rank: int, text: str = PROGRAM, **job: Any) -> None:
    """Start a new process for ``rank`` (the old one is dead) running the job as a joiner."""
    pool.processes[rank].join(timeout=60)
    assert not pool.processes[rank].is_alive()
    pool.respawn([rank])
    pool._tasks[rank].put((fleet_job, (text, STEPS), {"namespace": namespace, "rejoin": True, **FLEET, **job}))
    dist.PrefixStore(f"{namespace}-ctl", pool.store).set("restarted", "1")


def _verified(result: dict, steps: range) -> None:
    """Each step of ``steps`` committed once, in order, and verified where this rank holds destinations."""
    assert "error" not in result, result.get("error")
    assert [c["step"] for c in result["checked"]] == list(steps), (result["rank"], result["checked"])
    for c in result["checked"]:
        assert c.get("ok", True), (result["rank"], c)


def _recoveries(results: dict[int, dict]) -> list[dict]:
    return [r for result in results.values() for r in result.get("recoveries", [])]


def test_an_engine_that_loses_a_worker_is_dropped_whole_and_the_others_keep_refitting(pool):
    _, pids = _start(pool, kill=(4, 1), idle=[8, 9])
    try:
        survivors = {0, 1, 2, 3, 6, 7}
        results = _collect(pool, survivors | {5})
        for rank in survivors:
            _verified(results[rank], range(STEPS))
            assert results[rank]["destination_ranks"] == [2, 3, 6, 7]
            assert pool.processes[rank].pid == pids[rank]  # nothing restarted
        # rank 5 is alive, but its engine lost rank 4: it is left out with it
        assert results[5]["kind"] == "membership" and "excluded" in results[5]["error"]
        lost = [r for r in _recoveries({k: results[k] for k in survivors}) if 4 in r["lost"]]
        assert lost and all(5 in r["lost"] for r in lost)
        # the member that proposed names why rank 5 went; the others read the agreed list
        reasons = [r["reasons"]["5"] for r in lost if "5" in r["reasons"]]
        assert all(why.startswith(UNIT_LOST) for why in reasons)
    finally:
        _finish(pool)


def test_an_engine_joins_past_the_first_size_and_another_leaves_on_purpose(pool):
    _, pids = _start(pool, joiners=[8, 9], await_joiners=(0, [8, 9]), leave=([6, 7], 2))
    try:
        results = _collect(pool, set(range(10)))
        for rank in (0, 1, 2, 3, 4, 5):
            _verified(results[rank], range(STEPS))
            assert results[rank]["destination_ranks"] == [2, 3, 4, 5, 8, 9]  # dp = 4, then 3
            assert results[rank]["destination_shape"] == {"dp": 3, "tp": 2}
            assert pool.processes[rank].pid == pids[rank]
        for rank in (6, 7):  # they refit until they left, then left cleanly
            _verified(results[rank], range(3))
            assert results[rank]["left_after"] == 2
        for rank in (8, 9):  # admitted after a committed step, filled with its weights, verified
            admitted = results[rank]["admitted"]
            assert admitted["ok"] and admitted["bytes"] > 0
            _verified(results[rank], range(admitted["next_step"], STEPS))
        recoveries = _recoveries({r: results[r] for r in (0, 1, 2, 3, 4, 5)})
        grows = [r for r in recoveries if r["joined"] == [8, 9]]
        # the joining engine's bytes came from the other engines, none from the training side
        assert grows and all(r["recovered_from"]["destination"] > 0 and r["recovered_from"]["source"] == 0
                             for r in grows)
        leaves = [r for r in recoveries if r["left"] == [6, 7]]
        assert leaves and all(r["reasons"]["6"] == LEFT and r["reasons"]["7"] == LEFT for r in leaves)
    finally:
        _finish(pool)


def test_a_training_rank_killed_mid_refit_is_data_loss_until_it_comes_back(pool):
    namespace, pids = _start(pool, kill=(1, 2), idle=[8, 9], source_policy="await-rejoin")
    try:
        _restart(pool, namespace, 1, source_policy="await-rejoin")
        survivors = {0, 2, 3, 4, 5, 6, 7}
        results = _collect(pool, survivors | {1})
        for rank in survivors:
            _verified(results[rank], range(STEPS))
            assert results[rank]["source_ranks"] == [0, 1] and pool.processes[rank].pid == pids[rank]
            losses = results[rank]["data_loss"]
            assert losses and all(loss["vacant"] == [1] for loss in losses)
            assert "source rank 1 of layout 'fsdp' is gone" in losses[0]["message"]
        _verified(results[1], range(results[1]["admitted"]["next_step"], STEPS))
        assert results[1]["admitted"]["next_step"] <= 2  # the step it died in is refit again
    finally:
        _finish(pool)


def test_a_training_rank_gone_between_refits_is_taken_back_by_its_new_process(pool):
    namespace, pids = _start(pool, vanish_after=(1, 1), idle=[8, 9], source_policy="await-rejoin")
    try:
        _restart(pool, namespace, 1, vanish_after=(1, 1), source_policy="await-rejoin")
        survivors = {0, 2, 3, 4, 5, 6, 7}
        results = _collect(pool, survivors | {1})
        for rank in survivors:
            _verified(results[rank], range(STEPS))
            assert pool.processes[rank].pid == pids[rank]
            assert any(1 in r["rejoined"] or 1 in r["joined"] for r in results[rank]["recoveries"])
        assert results[1]["admitted"]["next_step"] == 2
        _verified(results[1], range(2, STEPS))
    finally:
        _finish(pool)


REPLICATED = PROGRAM.replace("layout fsdp on train { default: dp = shard(0) }",
                              "layout fsdp on train { default: replicate }")


def test_a_training_rank_with_a_replica_is_recovered_from_it_and_comes_back_later(pool):
    namespace, pids = _start(pool, REPLICATED, kill=(1, 1), idle=[8, 9], source_policy="await-rejoin",
                             await_joiners=(3, [1]))
    try:
        _restart(pool, namespace, 1, REPLICATED, source_policy="await-rejoin")
        survivors = {0, 2, 3, 4, 5, 6, 7}
        results = _collect(pool, survivors | {1})
        for rank in survivors:
            _verified(results[rank], range(STEPS))  # no step lost: rank 0's replica sent them
            assert results[rank]["data_loss"] == [] and pool.processes[rank].pid == pids[rank]
            assert results[rank]["source_ranks"] == [0, 1]  # its position back after a step boundary
            recoveries = results[rank]["recoveries"]
            assert any(1 in r["lost"] for r in recoveries) and any(1 in r["joined"] for r in recoveries)
        _verified(results[1], range(results[1]["admitted"]["next_step"], STEPS))
    finally:
        _finish(pool)


def test_an_engine_alive_that_never_begins_a_step_is_dropped_after_the_timeout(pool):
    _, pids = _start(pool, stall=([6, 7], 2, 25.0), idle=[8, 9], timeout=8.0)
    try:
        survivors = {0, 1, 2, 3, 4, 5}
        results = _collect(pool, survivors | {6, 7})
        for rank in survivors:
            _verified(results[rank], range(STEPS))
            assert results[rank]["destination_ranks"] == [2, 3, 4, 5] and pool.processes[rank].pid == pids[rank]
            reasons = [r["reasons"] for r in results[rank]["recoveries"] if 6 in r["lost"]]
            assert reasons and all(set(r["lost"]) >= {6, 7} for r in results[rank]["recoveries"] if 6 in r["lost"])
        named = [why for r in reasons for why in r.values()]
        assert all("never began step 2" in why or why.startswith(UNIT_LOST) for why in named), named
        for rank in (6, 7):  # their heartbeats went on; they were left out for taking no part
            assert results[rank]["kind"] == "membership" and "excluded" in results[rank]["error"]
    finally:
        _finish(pool)


def test_a_unit_axis_that_cannot_grow_is_refused():
    import layoutlang
    from elastic.recovery import RefitSpec
    from layoutlang.errors import LayoutValueError

    program = layoutlang.loads(PROGRAM.replace("[dp = 3, tp = 2]", "[tp = 2, dp = 3]"))
    with pytest.raises(LayoutValueError, match="must be the first axis"):
        RefitSpec("refit", program.layouts["fsdp"], program.layouts["serve"], unit_axis="dp")
    sharded = layoutlang.loads(PROGRAM.replace('"embed": tp = shard(0)', '"embed": dp = shard(0)'))
    with pytest.raises(LayoutValueError, match="not data-parallel"):
        RefitSpec("refit", sharded.layouts["fsdp"], sharded.layouts["serve"], unit_axis="dp")

