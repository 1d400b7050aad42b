"""Elastic sessions on 9 local gloo workers: refits that survive failures without restarts.

One pool serves every test: workers that a test killed (or stopped) are replaced by fresh
processes before the next test, which uses a namespace of its own in the shared store. In
every test the refit completes on the new layout with every destination byte of every
committed step verified (:func:`layoutlang.cli.elastic_job.refit_job`), and the survivors are the same
processes that started (their pids do not change: nothing restarted).

The program: training on ranks 0..3 (``dp = 2`` replicas of ``tp = 2``), inference on ranks
4..7 (``dp = 2`` replicas of ``tp = 2``, a fused ``qk`` storage), domains of 2 ranks; rank 8
is a spare or a joiner, or idle.
"""

from __future__ import annotations

import os
import re
import signal
import time
from itertools import count, pairwise

import elastic_jobs
import pytest

from elastic import ExitWatcher
from layoutlang.cli.elastic_job import refit_job

# The `pool` of every test (tests/conftest.py): 9 ranks, the module's own, since its tests
# kill workers and replace them (pool.respawn) with workers that have no default group.
pytestmark = [pytest.mark.timeout(180), pytest.mark.workers(9, scope="module")]

PROGRAM = """
topology { domain_size = 2 }
mesh train [dp = 2, tp = 2]
mesh infer [dp = 2, tp = 2] on ranks 4..7
tensor "embed" [96, 32] fp32
tensor "layers.{l}.q" [64, 32] fp32 for l in 0..1
tensor "layers.{l}.k" [32, 32] fp32 for l in 0..1
tensor "layers.{l}.norm" [32] fp32 for l in 0..1
layout fsdp on train {
    "embed": tp = shard(0)
    "layers.{l}.q": tp = shard(0)
    "layers.{l}.k": tp = shard(1)
    default: replicate
}
layout serve on infer {
    "embed": tp = shard(0)
    "layers.{l}.q": tp = shard(0)
    "layers.{l}.k": tp = shard(0)
    default: replicate
    storage "layers.{l}.qk" = "layers.{l}.q" | "layers.{l}.k"
}
reshard refit: fsdp -> serve
"""
# the same without training replicas: a training rank holds the only copy of its shards
NO_REPLICA = PROGRAM.replace("mesh train [dp = 2, tp = 2]", "mesh train [tp = 4]")

STEPS = 4
_namespaces = count()


def drain(pool, wait: float = 1.0) -> None:
    """Take the results of ranks outside ``expect`` (idle ones) off the queue."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        pool.next_result(0.1)


def run(pool, *, expect, kills=(), stopped=(), text=PROGRAM, timeout=90.0, session_timeout=None, **options):
    """Run the refit job on every worker; returns the results of the ranks in ``expect``
    (which must all report), and checks that they are the processes that started.
    ``session_timeout``: the sessions' own (default: the job's)."""
    if session_timeout is not None:
        options["timeout"] = session_timeout
    pool.respawn()
    pool.run(os.getpid)  # every worker is up (a respawned one imports torch first)
    pids = {r: p.pid for r, p in enumerate(pool.processes)}
    namespace = f"session{next(_namespaces)}"
    try:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=namespace):
            pool.submit(refit_job, text, STEPS, namespace=namespace, faults=kills, **options)
            results: dict[int, dict] = {}
            end = time.monotonic() + timeout
            while not set(expect) <= set(results) and time.monotonic() < end:
                result = pool.next_result(0.2)
                if result is None:
                    continue
                rank, ok, value = result
                assert ok, f"rank {rank} failed: {value[1]}"
                if rank in expect:
                    results[rank] = value
            assert set(expect) <= set(results), f"ranks {sorted(set(expect) - set(results))} did not finish"
        for rank in expect:  # no survivor restarted: the same process reported
            assert pool.processes[rank].pid == pids[rank] and pool.processes[rank].is_alive()
        for rank, _, how in kills:
            if how in ("kill", "on-shrink", "signal"):
                pool.processes[rank].join(timeout=10)
                assert pool.processes[rank].exitcode == -signal.SIGKILL
        return results
    finally:
        pool.respawn(stopped)  # killed, then replaced
        pool.respawn()
        drain(pool)


def check_refits(results, *, destination_ranks, members, destination, source=r"fsdp(_gen\d+)?", joiners=()):
    """Every step committed once, in order, on every survivor; the survivors end in one
    generation with ``members`` and the layouts named ``destination`` and ``source`` (regular
    expressions: how many generations a recovery took is the machine's timing); exactly
    ``destination_ranks`` hold that destination layout, and every destination byte of every
    committed step a rank held was verified."""
    finals = set()
    for rank, result in results.items():
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        steps = [c["step"] for c in result["checked"]]
        assert steps == list(range(STEPS - len(steps), STEPS)), (rank, steps)  # joiners start later
        assert rank in joiners or steps == list(range(STEPS)), (rank, steps)
        assert all(c.get("ok", True) for c in result["checked"]), (rank, result["checked"])
        finals.add((result["generation"], tuple(result["members"]), result["source"], result["destination"]))
    assert len(finals) == 1, finals  # every survivor ends in the same generation
    ((_, final_members, source_name, destination_name),) = finals
    assert sorted(final_members) == sorted(members), final_members
    assert re.fullmatch(destination, destination_name), destination_name
    assert re.fullmatch(source, source_name), source_name
    # who holds the final destination layout: the ranks that verified the last step (a joiner
    # admitted by the last step's commit holds it from the recovery plan, verified too)
    holders = {}
    for rank, result in results.items():
        checked = [c for c in result["checked"] if c["step"] == STEPS - 1]
        if checked and "ok" in checked[0]:
            holders[rank] = checked[0]
        elif not checked and result.get("joined", {}).get("step") == STEPS - 1:
            holders[rank] = result["joined"]
    assert sorted(holders) == sorted(destination_ranks), holders
    assert all(c["ok"] and c["bytes"] > 0 for c in holders.values()), holders


def recovered(result) -> list[int]:
    """The ranks that ``result``'s recoveries lost, over every generation."""
    return sorted(r for recovery in result["recoveries"] for r in recovery["lost"])


def test_a_refit_without_failures_commits_every_step(pool):
    results = run(pool, expect=range(8), idle=(8,))
    check_refits(results, destination_ranks=range(4, 8), members=range(8), destination="serve", source="fsdp")
    # no failure, no recovery: nothing but the first generation
    assert all(r["recoveries"] == [] and r["generation"] == 0 for r in results.values())


def test_a_joiner_still_asking_when_the_last_step_commits_ends_at_once_not_after_its_timeout(pool):
    """Rank 8 asks to join, but no position is ever open (nothing fails): once the members
    have committed their last step they end the session, and the joiner's wait ends with
    JobEndedError naming why. Its session timeout is far longer than this test's own wait
    for its result, so that result arriving at all is the promise kept."""
    results = run(pool, expect=range(9), joiners=(8,), timeout=90.0, session_timeout=600.0)
    members = {r: v for r, v in results.items() if r != 8}
    check_refits(members, destination_ranks=range(4, 8), members=range(8), destination="serve", source="fsdp")
    joiner = results[8]
    assert "error" not in joiner and joiner["checked"] == [], joiner
    assert joiner["not_admitted"] == (
        f"error: rank 8: the job ended before admitting this rank (all {STEPS} steps were committed)"
    ), joiner


def test_a_member_that_never_starts_its_session_is_named_by_every_other_member(pool):
    """Rank 7 (an inference rank) never starts its session: the first generation's group
    cannot form without it, and after the timeout every other member stops naming it."""
    results = run(pool, expect=range(7), idle=(7, 8), session_timeout=5.0)
    for rank, result in results.items():
        assert result["kind"] == "member-failure", result
        assert result["error"].startswith(
            f"error: rank {rank}: rank 7 never joined generation 0 within 5 s (no heartbeat: "
        ), result
        assert result["checked"] == []  # nothing was refit


def test_sigkill_of_an_inference_rank_mid_transfer(pool):
    results = run(pool, expect=[0, 1, 2, 3, 4, 6, 7], kills=((5, 1, "kill"),), idle=(8,))
    # drop-replica: the replica of rank 5 (ranks 4, 5) leaves the inference layout
    check_refits(
        results, destination_ranks=[6, 7], members=[0, 1, 2, 3, 4, 6, 7], destination=r"serve_gen\d+", source="fsdp"
    )
    for result in results.values():
        assert recovered(result) == [5]
        (recovery,) = [r for r in result["recoveries"] if 5 in r["lost"]]
        assert recovery["agreed_at"] - recovery["noticed_at"] < 5
        # the shrink hook ran in the generation that lost it, and no grow happened
        assert recovery["generation"] in result["shrinks"] and result["grows"] == []
    assert results[4]["checked"][-1].get("ok") is None  # rank 4 holds nothing any more


def test_sigkill_of_a_training_rank_whose_shards_have_a_replica(pool):
    results = run(pool, expect=[0, 2, 3, 4, 5, 6, 7], kills=((1, 1, "kill"),), idle=(8,))
    # the destination is untouched; the source is the dp = 1 replica only
    check_refits(
        results, destination_ranks=range(4, 8), members=[0, 2, 3, 4, 5, 6, 7], destination="serve",
        source=r"fsdp_gen\d+",
    )
    assert all(recovered(r) == [1] for r in results.values())


@pytest.mark.parametrize("per_rank", [False, True], ids=["whole-fleet-plans", "per-rank-plans"])
def test_delta_refits_go_on_past_a_training_rank_killed_mid_transfer(pool, per_rank):
    """The same kill in a delta session whose training steps change 2% of the elements:
    every committed step verified byte for byte against the trained weights; the first refit
    of each generation moves dense (nothing is kept yet), the later ones a fraction of it.
    With per-rank plans, rank 0 (its training replica dropped: in no layout) holds an empty
    part of the new generation's plan."""
    results = run(pool, expect=[0, 2, 3, 4, 5, 6, 7], kills=((1, 1, "kill"),), idle=(8,), delta=True,
                  change_fraction=0.02, per_rank=per_rank)
    if per_rank:
        assert results[0]["plan"]["moves"] == 0 and results[0]["plan"]["rank"] == 0
        assert len({result["plan"]["fingerprint"] for result in results.values()}) == 1
    check_refits(
        results, destination_ranks=range(4, 8), members=[0, 2, 3, 4, 5, 6, 7], destination="serve",
        source=r"fsdp_gen\d+",
    )
    compared = 0
    for rank, result in results.items():
        # (no report of a step's transfers: the rank takes no part in its generation's plan,
        # like rank 0 once its training replica is dropped, or the step stood unrun)
        reports = [r for r in result["reports"] if r.get("delta")]
        first = reports[0]["delta"]
        assert first["messages"]["indices"] == first["messages"]["bitmask"] == 0, (rank, first)
        for before, after in pairwise(reports):
            delta = after["delta"]
            if after["generation"] == before["generation"] and delta["dense_bytes"] > 0:
                assert delta["wire_bytes"] * 5 < delta["dense_bytes"], (rank, after["step"], delta)
                compared += 1
    assert compared, "some refits were deltas"


def test_sigstop_a_hung_rank_is_excluded_after_the_deadline(pool):
    results = run(pool, expect=[0, 1, 2, 3, 4, 5, 7], kills=((6, 1, "stop"),), stopped=[6], idle=(8,))
    check_refits(
        results, destination_ranks=[4, 5], members=[0, 1, 2, 3, 4, 5, 7], destination=r"serve_gen\d+", source="fsdp"
    )
    assert all(recovered(r) == [6] for r in results.values())
    reasons = [rec["reasons"] for rec in results[4]["recoveries"] if 6 in rec["lost"]]
    assert any("heartbeat" in why.get("6", "") for why in reasons), reasons


def test_sigkill_of_a_rank_that_is_no_peer_of_any_transfer(pool):
    # rank 8 is a member in no layout: it exchanges nothing with anyone
    results = run(
        pool, expect=range(8), kills=((8, 1, "signal"),), trigger=4, members=list(range(9))
    )
    check_refits(results, destination_ranks=range(4, 8), members=range(8), destination="serve", source="fsdp")
    assert all(recovered(r) == [8] for r in results.values())


def test_a_second_failure_during_recovery(pool):
    # rank 5 dies mid-transfer; rank 2 dies in the shrink hook of generation 1
    results = run(pool, expect=[0, 1, 3, 4, 6, 7], kills=((5, 1, "kill"), (2, 0, "on-shrink")), idle=(8,))
    check_refits(
        results, destination_ranks=[6, 7], members=[0, 1, 3, 4, 6, 7], destination=r"serve_gen\d+",
        source=r"fsdp_gen\d+",
    )
    for result in results.values():
        assert recovered(result) == [2, 5]
        # rank 2 was a member of the generation that lost rank 5 (it died in that one's shrink
        # hook): a later generation lost it
        assert result["generation"] >= 2


def test_a_replacement_rank_joins_and_receives_its_shards_from_replicas(pool):
    results = run(pool, expect=[0, 1, 2, 3, 4, 6, 7, 8], kills=((5, 1, "kill"),), joiners=(8,))
    check_refits(
        results, destination_ranks=[4, 6, 7, 8], members=[0, 1, 2, 3, 4, 6, 7, 8], destination=r"serve_gen\d+",
        source="fsdp", joiners=(8,),
    )
    joiner = results[8]
    # The recovery plan gave it the weights of the last step committed before its admission
    # (which step's commit admitted it is the machine's timing), from inference replicas; it
    # refit every later step.
    joined = joiner["joined"]
    checked = [c["step"] for c in joiner["checked"]]
    assert joined["ok"] and joined["bytes"] > 0 and joined["step"] >= 1, joined  # rank 5 died in step 1
    assert checked == list(range(joined["step"] + 1, STEPS)), (joined, checked)
    (grow,) = [r for r in joiner["recoveries"] if 8 in r["joined"]]
    assert grow["joined"] == [8] and grow["lost"] == [] and grow["recovered_bytes"] > 0
    for result in results.values():
        assert recovered(result) == ([] if result is joiner else [5])
        assert result["grows"] == [grow["generation"]]  # every member grew once, into the same generation
    for rank in (0, 1, 2, 3):  # the training side sent nothing in the recovery
        assert all(rec["recovered_bytes"] == 0 for rec in results[rank]["recoveries"])


def test_a_recovery_with_per_rank_plans_moves_what_the_whole_fleets_plans_move(pool):
    """The replacement above, once with the whole fleet's plans and once with per-rank ones
    (each member compiles its own part of every generation's refit plan): every destination
    byte of every step verified in both, the same bytes recovered from the same sides, and
    every member's part bears the fingerprint of one whole program."""
    runs = {}
    for per_rank in (False, True):
        results = run(
            pool, expect=[0, 1, 2, 3, 4, 6, 7, 8], kills=((5, 1, "kill"),), joiners=(8,), per_rank=per_rank
        )
        check_refits(
            results, destination_ranks=[4, 6, 7, 8], members=[0, 1, 2, 3, 4, 6, 7, 8],
            destination=r"serve_gen\d+", source="fsdp", joiners=(8,),
        )
        runs[per_rank] = results
    for per_rank, results in runs.items():
        plans = {rank: result["plan"] for rank, result in results.items()}
        assert len({p["fingerprint"] for p in plans.values()}) == 1, plans  # one program on every member
        if per_rank:
            assert all(p["mode"] == "pairwise" and p["rank"] == rank for rank, p in plans.items()), plans
        else:
            assert all(p["mode"] == "fleet" and p["rank"] is None for p in plans.values()), plans
    whole, own = runs[False], runs[True]
    assert sum(own[r]["plan"]["moves"] for r in own) >= own[8]["plan"]["moves"] > 0
    assert all(own[r]["plan"]["moves"] < whole[r]["plan"]["moves"] for r in own)
    # the joiner's recovery: the same bytes, from the same side, verified
    for results in (whole, own):
        assert results[8]["joined"]["ok"] and results[8]["joined"]["bytes"] > 0
    assert own[8]["joined"]["bytes"] == whole[8]["joined"]["bytes"]

    def grown(results, rank):
        (grow,) = [r for r in results[rank]["recoveries"] if 8 in r["joined"]]
        return grow["recovered_from"], grow["recovered_bytes"]

    for rank in own:
        assert grown(own, rank) == grown(whole, rank), rank


def test_a_failure_that_leaves_no_copy_is_a_clear_error(pool):
    results = run(pool, expect=[0, 2, 3, 4, 5, 6, 7], kills=((1, 1, "kill"),), text=NO_REPLICA, idle=(8,))
    for result in results.values():
        assert result["kind"] == "loss", result
        assert "data lost: rank 1 held the only copies" in result["error"]
        assert ["embed", [24, 0], [24, 32]] in result["regions"]
        assert {t for t, _, _ in result["regions"]} == {"embed", "layers.0.q", "layers.1.q", "layers.0.k", "layers.1.k"}
        assert [c["step"] for c in result["checked"]] == [0]  # step 1 never reported as done


CAST = """
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "embed" [64, 32] bf16
tensor "head" [32, 64] bf16
layout fsdp on train { "embed": tp = shard(0)
                       "head": tp = shard(1) }
layout serve on infer { default: tp = shard(1) }
reshard refit: fsdp -> serve
"""


@pytest.mark.parametrize("cast_sources", [True, False])
def test_a_session_casts_fp32_master_weights_when_asked(pool, cast_sources):
    """``ElasticSession(cast_sources=True)`` (what the vLLM trainer's ``cast_sources`` asks):
    fp32 masters of a bf16 program arrive as their bf16 cast; without it, every rank stops."""
    pool.respawn()
    results = pool.run(elastic_jobs.cast_sources_job, CAST, namespace=f"cast{next(_namespaces)}",
                       cast_sources=cast_sources)
    errors = [r["error"] for r in results[:4]]
    if cast_sources:
        assert errors == [None] * 4
        assert [r["exact"] for r in results[2:4]] == [True, True]
    else:
        assert all(e and "is torch.float32, layout 'fsdp' holds torch.bfloat16" in e for e in errors), errors
    assert all(r.get("idle") for r in results[4:])
