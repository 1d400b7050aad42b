"""The numbers that docs/guides/plans.rst works out by hand, checked with the planner.

The page's command outputs are re-made by tests/test_docs.py like every other output; this
file checks the arithmetic of the text: bytes by kind, moves, messages, buckets, lower
bounds, network crossings, per-rank extremes and the gather-and-broadcast baseline, for
the TP->DP example (examples/tp_to_dp.layout) and the page's own snippets
(docs/snippets/plan-*.layout).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest

import layoutlang
from layoutlang.plan import Plan, compile_plan, load_plan, plan_layouts

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
TP_TO_DP = ROOT / "examples" / "tp_to_dp.layout"

KiB = 2**10
MiB = 2**20


def load(path: Path) -> layoutlang.Program:
    return layoutlang.load(str(path))


def by_kind(plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    return plan.stats.bytes, plan.stats.moves


def network_crossings(plan: Plan) -> dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]]:
    """(tensor, region offsets) -> [(src, dst)] of its network moves."""
    out: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = defaultdict(list)
    for m in plan.moves():
        if m.kind == "network":
            out[(m.tensor, m.offsets)].append((m.src, m.dst))
    return dict(out)


def compiled(program: layoutlang.Program, **options) -> Plan:
    """Every plan of the page is valid, deterministic and survives its binary form."""
    plan = compile_plan(program, **options)
    plan.validate()
    assert compile_plan(program, **options).fingerprint == plan.fingerprint
    assert load_plan(plan.to_bytes(), program).fingerprint == plan.fingerprint
    return plan


# ------------------------------------------------------------- TP -> DP (the design's)


@pytest.fixture(scope="module")
def tp_to_dp() -> layoutlang.Program:
    return load(TP_TO_DP)


def test_tp_to_dp_reshard(tp_to_dp):
    plan = compiled(tp_to_dp)
    s = plan.stats
    w = 1024 * 1024 * 2
    assert w == 2 * MiB
    assert by_kind(plan) == (
        {"local": 0, "domain": 4 * MiB, "network": 4 * MiB},
        {"local": 0, "domain": 4, "network": 4},
    )
    assert s.lower_bound == 4 * w == 8 * MiB  # 4 ranks need all of w and hold none of it
    assert s.moved == s.lower_bound and s.ratio_to_lower_bound == 1.0
    assert s.messages == 8 and s.buckets == 1
    # Each half crosses the network once per destination domain (2 halves x 2 domains)...
    crossings = network_crossings(plan)
    assert sorted(crossings) == [("w", (0, 0)), ("w", (512, 0))]
    for pairs in crossings.values():
        assert sorted(dst // plan.domain_size for _, dst in pairs) == [4, 5]
    # ...lands on the rank that has received least (8 then 9, 10 then 11)...
    assert crossings[("w", (0, 0))] == [(0, 8), (0, 10)]
    assert crossings[("w", (512, 0))] == [(1, 9), (1, 11)]
    # ...and is relayed to the domain peer in stage 1.
    relays = [(m.src, m.dst, m.offsets[0]) for m in plan.moves() if m.is_relay]
    assert relays == [(8, 9, 0), (10, 11, 0), (9, 8, 512), (11, 10, 512)]
    assert all(m.stage == (1 if m.is_relay else 0) for m in plan.moves())
    assert s.largest_network_send == (2 * MiB, 0)  # rank 0 is the only holder of rows 0:512
    assert s.largest_network_receive == (1 * MiB, 8)
    for rank in range(8, 12):
        assert s.per_rank[rank]["received"] == {"local": 0, "domain": 1 * MiB, "network": 1 * MiB}


def test_tp_to_dp_point_to_point_has_twice_the_network_moves(tp_to_dp):
    plan = plan_layouts(tp_to_dp.layout("tp"), tp_to_dp.layout("dp"), domain_size=1)
    plan.validate()
    assert by_kind(plan) == (
        {"local": 0, "domain": 0, "network": 8 * MiB},
        {"local": 0, "domain": 0, "network": 8},
    )


def test_tp_to_dp_gather_and_broadcast(tp_to_dp):
    plan = compiled(tp_to_dp)
    base = compiled(tp_to_dp, policy="broadcast")
    b = base.stats
    # gather: 1 MiB local + 1 MiB domain; broadcast: 2 x 2 MiB network + 2 x 2 MiB relays;
    # extraction: 4 x 2 MiB local.
    assert by_kind(base) == (
        {"local": 1 * MiB + 4 * 2 * MiB, "domain": 1 * MiB + 2 * 2 * MiB, "network": 2 * 2 * MiB},
        {"local": 1 + 4, "domain": 1 + 2, "network": 2},
    )
    assert b.moved == 9 * MiB and b.moved / plan.stats.moved == 1.125
    assert b.bytes["network"] == plan.stats.bytes["network"]
    assert b.messages == 5
    assert b.broadcast_payload == 2 * 2 * MiB and plan.stats.broadcast_payload == 0
    assert b.largest_network_receive[0] == 2 * MiB  # one landing rank per domain gets it all
    stages = Counter((m.stage, m.kind) for m in base.moves())
    assert stages == {
        (0, "local"): 1,
        (0, "domain"): 1,
        (1, "network"): 2,
        (2, "domain"): 2,
        (3, "local"): 4,
    }


def test_tp_to_dp_with_training_replicas_spreads_network_sends():
    text = TP_TO_DP.read_text().replace(
        "mesh train [tp = 2] on ranks 0..1", "mesh train [dp = 2, tp = 2] on ranks 0..3"
    )
    program = layoutlang.loads(text)
    plan = compiled(program)
    for pairs in network_crossings(plan).values():
        # the two crossings leave from different replicas
        assert len({src for src, _ in pairs}) == 2
    assert plan.stats.largest_network_send == (1 * MiB, 0)
    assert plan.stats.bytes["network"] == 4 * MiB


def test_tp_to_dp_small_buckets(tp_to_dp):
    plan = compiled(tp_to_dp, bucket_bytes=512 * KiB)
    s = plan.stats
    assert plan.bucket_bytes == 512 * KiB
    regions = {(m.tensor, m.offsets, m.sizes) for m in plan.moves()}
    # slabs of 256 rows
    assert len(regions) == 4 and all(sizes == (256, 1024) for _, _, sizes in regions)
    assert all(m.nbytes == 512 * KiB for m in plan.moves())
    assert s.bytes == {"local": 0, "domain": 4 * MiB, "network": 4 * MiB}
    assert sum(s.moves.values()) == 16 and s.messages == 16 and s.buckets == 8
    # one 512 KiB move per rank and bucket; each inference rank takes part in six moves
    taking_part = Counter()
    for m in plan.moves():
        taking_part[m.src] += 1
        taking_part[m.dst] += 1
    assert {r: taking_part[r] for r in range(8, 12)} == {8: 6, 9: 6, 10: 6, 11: 6}
    per_bucket = Counter()
    for m in plan.moves():
        per_bucket[(m.src, m.bucket)] += 1
        per_bucket[(m.dst, m.bucket)] += 1
    assert max(per_bucket.values()) == 1


# ------------------------------------------------------------------ the colocated one


@pytest.fixture(scope="module")
def colocated() -> layoutlang.Program:
    return load(SNIPPETS / "plan-colocated.layout")


def test_colocated_reshard(colocated):
    plan = compiled(colocated)
    s = plan.stats
    shard = 256 * 1024 * 2  # a training shard
    assert shard == 512 * KiB
    assert by_kind(plan) == (
        {"local": 2 * shard, "domain": 2 * shard, "network": 4 * shard},
        {"local": 2, "domain": 2, "network": 4},
    )
    assert s.bytes == {"local": 1 * MiB, "domain": 1 * MiB, "network": 2 * MiB}
    assert s.lower_bound == 512 * KiB + 1 * MiB + 1 * MiB + 512 * KiB == 3 * MiB
    assert s.moved == s.lower_bound
    assert s.messages == 6 and s.buckets == 1
    # the table of the page: how each rank gets what it does not hold
    got = sorted((m.dst, m.offsets[0], m.src, m.kind) for m in plan.moves())
    assert got == [
        (0, 0, 0, "local"), (0, 256, 1, "domain"),
        (1, 512, 2, "network"), (1, 768, 3, "network"),
        (2, 0, 0, "network"), (2, 256, 1, "network"),
        (3, 512, 2, "domain"), (3, 768, 3, "local"),
    ]  # fmt: skip
    # every training shard crosses the network exactly once, with no relay
    crossings = network_crossings(plan)
    assert len(crossings) == 4 and all(len(p) == 1 for p in crossings.values())
    assert not any(m.is_relay for m in plan.moves())
    assert all(s.per_rank[r]["sent"]["network"] == shard for r in range(4))
    assert s.largest_network_send == (512 * KiB, 0)
    assert s.largest_network_receive == (1 * MiB, 1)
    assert s.per_rank[2]["received"]["network"] == 1 * MiB


def test_colocated_gather_and_broadcast(colocated):
    plan = compiled(colocated)
    base = compiled(colocated, policy="broadcast")
    b = base.stats
    half, whole = 512 * KiB, 2 * MiB
    assert b.bytes == {
        "local": half + 4 * 1 * MiB,  # gather on the root, four extractions
        "domain": half + whole + whole,  # gather from rank 1, broadcast to rank 1, relay 2 -> 3
        "network": 2 * half + whole,  # gather from ranks 2 and 3, one copy to domain 1
    }
    assert b.bytes == {"local": 4608 * KiB, "domain": 4608 * KiB, "network": 3 * MiB}
    assert b.moved == 7.5 * MiB
    assert b.moved / plan.stats.moved == 2.5
    assert b.bytes["network"] / plan.stats.bytes["network"] == 1.5
    assert sum(b.moves.values()) == 4 + 3 + 4 and b.messages == 6
    assert b.largest_network_send == (2 * MiB, 0) and b.largest_network_receive == (2 * MiB, 2)
    # logical payload: 4 bytes per BF16 parameter (gathered once, broadcast once)
    params = 1024 * 1024
    assert b.broadcast_payload == 4 * params == 4 * MiB
    assert b.lower_bound == plan.stats.lower_bound


def test_colocated_with_swapped_axes_stays_off_the_network():
    text = (SNIPPETS / "plan-colocated.layout").read_text()
    text = text.replace("mesh infer [dp = 2, tp = 2]", "mesh infer [tp = 2, dp = 2]")
    program = layoutlang.loads(text)
    plan = compiled(program)
    assert plan.stats.bytes == {"local": 2 * MiB, "domain": 2 * MiB, "network": 0}
    assert plan.stats.moved == plan.stats.lower_bound == 2 * MiB


# ------------------------------------------------------------------ hybrid and blocks


def test_hybrid_plan():
    program = load(SNIPPETS / "plan-hybrid.layout")
    plan = compiled(program)
    assert plan.policies == ("broadcast", "reshard")
    s = plan.stats
    embed, up = 1024 * 256 * 2, 512 * 256 * 2
    assert (embed, up) == (512 * KiB, 256 * KiB)
    assert s.bytes == {
        "local": embed // 2 + 4 * (embed // 2),  # gather on rank 0, four extractions
        "domain": embed // 2 + 2 * embed,  # gather from rank 1, two relays
        "network": 2 * embed + 4 * (up // 2),  # embed once per domain, up_proj halves
    }
    assert s.bytes == {"local": 1280 * KiB, "domain": 1280 * KiB, "network": 1536 * KiB}
    assert s.lower_bound == 4 * (embed // 2) + 4 * (up // 2) == 1536 * KiB
    assert s.moved == 2816 * KiB and round(s.ratio_to_lower_bound, 3) == 1.833
    assert sum(s.moves.values()) == 14 and s.messages == 9
    assert s.broadcast_payload == 2 * embed  # only the broadcast tensor
    # rank 0 is the embedding's root and holds the first half of up_proj
    assert s.largest_network_send == (2 * embed + 2 * (up // 2), 0) == (1280 * KiB, 0)
    assert s.largest_network_receive == (640 * KiB, 2)
    base = compiled(program, policy="broadcast")
    params = 1024 * 256 + 512 * 256
    assert base.stats.broadcast_payload == 4 * params == 1536 * KiB


def test_blocks_cut_regions_at_interleaved_blocks():
    program = load(SNIPPETS / "plan-blocks.layout")
    plan = compiled(program)
    regions = [(m.tensor, m.offsets[0], m.sizes[0]) for m in plan.moves()]
    assert regions == [
        ("q_proj.weight", 0, 4), ("q_proj.weight", 4, 4),
        ("k_proj.weight", 0, 2), ("k_proj.weight", 2, 2),
        ("v_proj.weight", 0, 2), ("v_proj.weight", 2, 2),
    ]  # fmt: skip
    s = plan.stats
    assert s.bytes == {"local": 0, "domain": 0, "network": (8 + 4 + 4) * 8 * 2}
    assert s.moves["network"] == 6 and s.messages == 1
    # each region lands in one block of linear_qkv: q rows 4:8 at rows 8:12
    assert plan.place(1)[1] == ("linear_qkv.weight", (8, 0))
