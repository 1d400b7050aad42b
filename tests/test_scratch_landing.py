"""Scratch landings: where a domain holds its replicas unevenly, the planner lands some
regions on a rank of the domain that does not hold them, into scratch, and relays them from
there to the holders (csrc/planner.cpp, ``deliver``). The plans validate, the lower bound
counts only what ranks keep, and the executor moves the data bit exact.

The program: domains of 10 ranks; three inference replicas of TP4 on ranks 15..26, so
domain 1 (ranks 10..19, of which the job has 15..19) holds replica 0 whole and a quarter of
replica 1: ranks 16, 17 and 18 are the domain's only holders of their quarters, ranks 15 and
19 both hold the first. Domain 2 (20..29) holds three quarters of replica 1 and replica 2.
"""

from __future__ import annotations

import pytest
import workers

import layoutlang
from layoutlang.model.topology import complete_topology
from layoutlang.plan import compile_plan
from layoutlang.plan import simulate as S

UNEVEN = """
topology { domain_size = 10 }
mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 3, tp = 4] on ranks 15..26
tensor "w{i}" [64, 32] bf16 for i in 0..15
layout a on train { default: tp = shard(0) }
layout b on infer { default: tp = shard(0) }
reshard refit: a -> b
"""

#: every inference rank holds a quarter of each of the 16 tensors (16 of 64 rows of 32 bf16)
QUARTER = 16 * 16 * 32 * 2
INFER = range(15, 27)

pytestmark = [pytest.mark.timeout(120), pytest.mark.workers(14)]


def _holds(plan, rank: int, move) -> bool:
    """Whether ``rank`` holds ``move``'s region in the destination layout (from the layout's
    own boxes: rows [16 tp, 16 tp + 16) of every tensor on the rank with that tp index)."""
    if rank not in INFER:
        return False
    tp = (rank - 15) % 4
    return 16 * tp <= move.offsets[0] < 16 * tp + 16


def test_an_uneven_domain_lands_regions_in_scratch_and_relays_them():
    plan = compile_plan(layoutlang.loads(UNEVEN))
    plan.validate()
    moves = list(plan.moves())
    landed = [m for m in moves if m.kind == "network" and m.dst_space == "scratch"]
    assert landed, "no region landed in scratch"
    for m in landed:
        assert not _holds(plan, m.dst, m)  # a bystander of the region
        domain = [r for r in INFER if r // 10 == m.dst // 10]
        relays = [
            r
            for r in moves
            if r.src_space == "scratch" and r.src == m.dst and r.tensor == m.tensor and r.offsets == m.offsets
        ]
        # relayed to every holder of the region in the domain, over NVLink, no earlier
        assert sorted(r.dst for r in relays) == [d for d in domain if _holds(plan, d, m)]
        assert all(r.kind == "domain" and r.dst_space == "destination" and r.bucket >= m.bucket for r in relays)
        assert all(r.is_relay and "relay" in str(r) for r in relays)  # printed and drawn as relays
    # Ranks 16, 17 and 18, the only holders of their quarters in domain 1, would each receive
    # all of it through their NICs if regions landed on holders only; now the domain's five
    # NICs share the whole tensor set, and it still enters the domain once.
    received = {r: sum(m.nbytes for m in moves if m.kind == "network" and m.dst == r) for r in INFER}
    assert max(received[r] for r in (16, 17, 18)) < QUARTER
    assert sum(received[r] for r in range(15, 20)) == 4 * QUARTER
    # what the scratch adds: each landed region moves once more, over NVLink
    assert plan.stats.moved == plan.stats.lower_bound + sum(m.nbytes for m in landed)


def test_domains_of_a_node_keep_byte_minimal_plans():
    """The same replicas cut unevenly by domains of 4 ranks (at most a node's 8): every region
    lands on a holder, and the plan moves every destination byte once."""
    plan = compile_plan(layoutlang.loads(UNEVEN.replace("domain_size = 10", "domain_size = 4")))
    plan.validate()
    assert not [m for m in plan.moves() if "scratch" in (m.src_space, m.dst_space)]
    assert plan.stats.moved == plan.stats.lower_bound


def test_a_domain_of_whole_replicas_lands_on_holders_only():
    """Domains of 10 ranks, one holding two whole TP4 replicas: every quarter has two holders
    there and every rank needs as much as the others, so no region goes through scratch."""
    even = UNEVEN.replace("dp = 3, tp = 4] on ranks 15..26", "dp = 2, tp = 4] on ranks 10..17")
    plan = compile_plan(layoutlang.loads(even))
    plan.validate()
    assert not [m for m in plan.moves() if "scratch" in (m.src_space, m.dst_space)]


def test_the_lower_bound_counts_what_ranks_keep_not_what_they_relay():
    """need(d) is what rank d keeps (QUARTER for every inference rank: none of it is in the
    source layout), whatever passes through its scratch."""
    program = layoutlang.loads(UNEVEN)
    plan = compile_plan(program)
    links, _ = complete_topology(program.topology)
    bound = S.lower_bound(plan, program.topology)
    assert any(m.dst_space == "scratch" for m in plan.moves())
    rank_term = QUARTER / (links.network_bandwidth + links.domain_bandwidth)
    assert bound.terms["destination rank"] == pytest.approx(rank_term)
    # and the estimate of the plan stays above its bound
    assert S.estimate(plan, program.topology).time >= bound.time


def test_scratch_landings_move_bit_exact_data(pool, tmp_path):
    path = tmp_path / "uneven.layout"
    path.write_text(UNEVEN, "utf-8")
    participants = [0, 1, *INFER]
    results = [r for r in pool.run(workers.refit, str(path), participants) if r]
    assert len(results) == len(participants)
    for (step,) in results:
        if step["rank"] in INFER:
            assert step["verified"], step["mismatches"]
            assert step["verified_bytes"] == QUARTER
