"""Per-rank plans on real processes: gloo over loopback, one worker per program rank.

Every rank compiles only its own part of the pairwise plan (``Resharder(per_rank=True)``),
and every destination byte is compared with the synthetic source of truth
(``layoutlang.io.weights.verify``, the oracle of tests/test_execute.py), on every example
pair, on a program with interleaved storages and a rank in both meshes, and with a budget
small enough that steps are cut into sub-steps. Programs that differ between ranks, and a
rank that compiled the whole fleet's plan, are refused by the fingerprint agreement before
any byte moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_plan_jobs as jobs
from test_rank_plans import CORNERS

import layoutlang

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PAIRS = ["tp_to_dp", "refit", "moe_ep", "colocated", "uneven"]


def load(text_or_path: str) -> layoutlang.Program:
    return layoutlang.load(text_or_path) if text_or_path.endswith(".layout") else layoutlang.loads(text_or_path)


def participants_of(text: str) -> list[int]:
    program = load(text)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


TEXTS = {name: str(EXAMPLES / f"{name}.layout") for name in PAIRS} | {"corners": CORNERS}

pytestmark = [pytest.mark.timeout(300), pytest.mark.workers(max(len(participants_of(t)) for t in TEXTS.values()))]


def check_all_verified(text: str, results: list) -> None:
    participants = participants_of(text)
    results = [r for r in results if r]
    assert len(results) == len(participants)
    program = load(text)
    destination_ranks = set(program.layout(program.reshard().destination).mesh.ranks)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["plan_rank"] == r["rank"] and r["mode"] == "pairwise"
        if r["rank"] in destination_ranks:
            assert r["verified"], r["mismatches"]
            assert r["verified_bytes"] > 0
    assert len({r["fingerprint"] for r in results}) == 1


@pytest.mark.parametrize("name", [*PAIRS, "corners"])
def test_per_rank_plans_move_every_byte_right(pool, name):
    text = TEXTS[name]
    check_all_verified(text, pool.run(jobs.refit_per_rank, {"default": text}, participants_of(text)))


def test_sub_steps_under_a_small_budget_move_every_byte_right(pool):
    """A 16 KiB budget: messages of at most 8 KiB, steps cut into many sub-steps; staging stays
    within the budget."""
    text = TEXTS["corners"]
    results = pool.run(jobs.refit_per_rank, {"default": text}, participants_of(text), None, 16 * 1024)
    check_all_verified(text, results)
    assert max(r["steps"] for r in results if r) > 10
    assert max(r["peak_staging"] for r in results if r) <= 16 * 1024


def test_different_programs_on_two_ranks_are_refused_before_any_byte_moves(pool):
    text = TEXTS["corners"]
    changed = text.replace('"big": tp = shard(0)\n', '"big": tp = shard(1)\n')
    assert changed != text
    participants = participants_of(text)
    results = [
        r for r in pool.run(jobs.refit_per_rank, {"default": text, participants[-1]: changed}, participants) if r
    ]
    assert len(results) == len(participants)
    for r in results:
        assert r["error"] and r["error"].startswith("AgreementError"), r
    # a comment changes nothing: the same program, the same fingerprint
    commented = "# the same program\n" + text
    check_all_verified(text, pool.run(jobs.refit_per_rank, {"default": text, participants[0]: commented}, participants))


def test_a_rank_with_the_whole_fleets_plan_is_refused(pool):
    text = TEXTS["tp_to_dp"]
    participants = participants_of(text)
    results = [r for r in pool.run(jobs.refit_per_rank, {"default": text}, participants, {participants[0]: False}) if r]
    assert all(r["error"] and r["error"].startswith("AgreementError") for r in results), results
