"""Pairwise plans and per-rank plans (``plan_layouts(..., mode="pairwise")`` / ``rank=r``).

Checked here, on every example pair and on programs that stress the corners (interleaved
storages, shared ranks, several domains, regions larger than a bucket):

- the whole pairwise plan is the union of the per-rank plans, and each rank's plan is the
  whole plan's moves that rank sends or receives, in the same order (so both ends of a
  pair agree on every bucket);
- an independent count, from the layouts' own boxes, that every destination element is
  written exactly once, and that every relay reads a region its rank received in stage 0;
- ``validate()`` of a per-rank plan accepts it, and names what a corrupted one breaks;
- the fingerprint covers the program: equal on every rank and for the whole pairwise plan,
  different for another layout, option or mode;
- the per-rank schedule: steps by (stage, bucket), cut to the budget, and the messages of a
  pair posted in the same order at both of its ends;
- refusals: broadcast tensors, a rank in neither mesh, ``mode="fleet"`` with a rank.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.core import _core
from layoutlang.errors import LayoutValueError
from layoutlang.plan import Plan, compile_plan, plan_layouts, plan_recovery
from layoutlang.plan.data import _COLUMNS
from layoutlang.runtime.schedule import schedule

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PAIRS = ["tp_to_dp", "refit", "moe_ep", "colocated", "uneven"]

# Interleaved (fused QKV) storages on both sides, a rank in both meshes, two domains on
# each side, and a tensor of 2 MiB: with small buckets it is cut into slabs.
CORNERS = """
topology { domain_size = 2 }
mesh train [dp = 2, tp = 2] on ranks 0..3
mesh infer [dp = 3, tp = 2] on ranks 2..7
tensor "q" [16, 8] fp32
tensor "k" [8, 8] fp32
tensor "v" [8, 8] fp32
tensor "big" [512, 1024] fp32
tensor "norm" [8] bf16
layout a on train {
    "q": tp = shard(0)
    "k": tp = shard(0)
    "v": tp = shard(0)
    "big": tp = shard(1), dp = shard(0)
    default: replicate
    storage "qkv" = "q" | "k" | "v" along 0 blocks(4, 2, 2)
}
layout b on infer {
    "q": tp = shard(0)
    "k": tp = shard(0)
    "v": tp = shard(0)
    "big": tp = shard(0)
    default: replicate
    storage "qkv" = "q" | "k" | "v" along 0 blocks(2, 1, 1)
}
reshard a -> b
"""


# DeepSeek-V3's refit in miniature: pipeline stages and expert parallelism over data-parallel
# replicas, into tensor parallelism over many replicas, in domains of 8 ranks (64 ranks).
MEDIUM = """
topology { domain_size = 8 }
mesh train [dp = 2, pp = 4, ep = 4] on ranks 0..31
mesh infer [dp = 4, tp = 8] on ranks 32..63
tensor "embed" [512, 64] bf16
tensor "layers.{l}.attn.q" [128, 64] bf16 for l in 0..3
tensor "layers.{l}.attn.o" [64, 128] bf16 for l in 0..3
tensor "layers.{l}.norm" [64] bf16 for l in 0..3
tensor "layers.{l}.experts.{e}.up" [96, 64] bf16 for l in 0..3, e in 0..7
tensor "layers.{l}.experts.{e}.down" [64, 96] bf16 for l in 0..3, e in 0..7
layout megatron on train {
    "layers.{l}.*": pp[l]
    "layers.{l}.experts.{e}.*": pp[l], ep[e // 2]
    "embed": pp[0]
}
layout vllm on infer {
    "embed": tp = shard(0)
    "layers.{l}.attn.q": tp = shard(0)
    "layers.{l}.attn.o": tp = shard(1)
    "layers.{l}.experts.{e}.up": tp = shard(0)
    "layers.{l}.experts.{e}.down": tp = shard(1)
    default: replicate
}
reshard megatron -> vllm
"""


def program_of(name: str) -> layoutlang.Program:
    texts = {"corners": CORNERS, "medium": MEDIUM}
    return layoutlang.loads(texts[name]) if name in texts else layoutlang.load(EXAMPLES / f"{name}.layout")


def layouts_of(program: layoutlang.Program) -> tuple[layoutlang.Layout, layoutlang.Layout]:
    statement = program.reshard()
    return program.layout(statement.source), program.layout(statement.destination)


def participants(program: layoutlang.Program) -> list[int]:
    source, destination = layouts_of(program)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


def move_keys(plan: Plan) -> list[tuple]:
    return [
        (m.tensor, m.offsets, m.sizes, m.src, m.dst, m.kind, m.stage, m.bucket, m.src_space, m.dst_space)
        for m in plan.moves()
    ]


def inside(offsets, sizes, box_offsets, box_sizes) -> bool:
    return all(b <= o and o + s <= b + n for o, s, b, n in zip(offsets, sizes, box_offsets, box_sizes))


def compile_both(name: str, bucket_bytes: int, domain_size: int | None = None) -> tuple[Plan, dict[int, Plan]]:
    program = program_of(name)
    source, destination = layouts_of(program)
    domain = program.topology.domain_size if domain_size is None else domain_size
    options = {"domain_size": domain, "bucket_bytes": bucket_bytes}
    whole = plan_layouts(source, destination, mode="pairwise", **options)
    per_rank = {r: plan_layouts(source, destination, rank=r, **options) for r in participants(program)}
    return whole, per_rank


CASES = [(name, 256 * 2**20, None) for name in PAIRS] + [
    ("refit", 4096, None),
    ("moe_ep", 512, 2),
    ("corners", 64 * 1024, None),
    ("corners", 1024, 1),
    ("corners", 4096, 4),
    ("medium", 256 * 2**20, None),
    ("medium", 8192, 4),
]


@pytest.mark.parametrize("name, bucket_bytes, domain_size", CASES)
def test_the_whole_pairwise_plan_is_the_union_of_the_per_rank_plans(name, bucket_bytes, domain_size):
    whole, per_rank = compile_both(name, bucket_bytes, domain_size)
    whole.validate()
    keys = move_keys(whole)
    assert len(set(keys)) == len(keys)  # no move twice
    union: set[tuple] = set()
    for rank, plan in per_rank.items():
        plan.validate()
        assert plan.rank == rank and plan.mode == "pairwise"
        mine = move_keys(plan)
        # the whole plan's moves this rank sends or receives, in the whole plan's order
        assert mine == [k for k in keys if rank in (k[3], k[4])]
        union.update(mine)
    assert union == set(keys)
    # what each rank must receive at least, summed over ranks, is the whole plan's bound
    assert sum(int(p.arrays.lower_bound_bytes) for p in per_rank.values()) == int(whole.arrays.lower_bound_bytes)


@pytest.mark.parametrize("name, bucket_bytes, domain_size", CASES)
def test_every_destination_element_is_written_once_counted_from_the_layouts(name, bucket_bytes, domain_size):
    """An oracle apart from the validator: per rank and tensor, a count array of the
    tensor's shape, one added per move that writes there; it must be 1 on the layout's
    boxes of that rank and 0 elsewhere. A relay must read a box its rank received in stage 0."""
    whole, _ = compile_both(name, bucket_bytes, domain_size)
    destination = whole.destination
    counts: dict[tuple[str, int], np.ndarray] = {}
    received: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    moves = list(whole.moves())
    for m in moves:
        shape = destination.tensors[m.tensor].shape
        count = counts.setdefault((m.tensor, m.dst), np.zeros(shape, dtype=np.int64))
        count[tuple(slice(o, o + s) for o, s in zip(m.offsets, m.sizes))] += 1
        assert m.dst_space == "destination"
        if m.stage == 0:
            received[(m.tensor, m.dst)].append((m.offsets, m.sizes))
    for m in moves:
        if m.src_space == "destination":
            assert m.stage == 1 and m.kind == "domain"
            assert (m.offsets, m.sizes) in received[(m.tensor, m.src)], m
        else:
            assert m.stage == 0
            held = whole.source.boxes(m.tensor, m.src)
            assert any(inside(m.offsets, m.sizes, b.offsets, b.sizes) for b in held), m
    for rank in destination.mesh.ranks:
        for tensor, t in destination.tensors.items():
            expected = np.zeros(t.shape, dtype=np.int64)
            for box in destination.boxes(tensor, rank):
                expected[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = 1
            got = counts.get((tensor, rank), np.zeros(t.shape, dtype=np.int64))
            assert np.array_equal(got, expected), (tensor, rank)


def test_messages_stay_within_the_budget_and_buckets_are_chunks_of_a_pair():
    whole, _ = compile_both("corners", 64 * 1024)
    per_message: dict[tuple, int] = defaultdict(int)
    for m in whole.moves():
        if m.kind != "local":
            per_message[(m.src, m.dst, m.stage, m.bucket)] += m.nbytes
        else:
            assert m.bucket == 0
    assert max(per_message.values()) <= 64 * 1024
    # the 2 MiB tensor is cut: some pair needs several chunks, numbered from 0 without gaps
    by_pair: dict[tuple, set[int]] = defaultdict(set)
    for src, dst, stage, bucket in per_message:
        by_pair[(src, dst, stage)].add(bucket)
    assert max(len(b) for b in by_pair.values()) > 1
    assert all(b == set(range(len(b))) for b in by_pair.values())


def test_choices_do_not_follow_loads_but_still_spread_over_holders():
    """Holders are chosen by hash: a tensor replicated on 4 training ranks and needed by
    every inference rank is read from more than one of them."""
    whole, _ = compile_both("refit", 256 * 2**20)
    senders = defaultdict(set)
    for m in whole.moves():
        if m.kind == "network":
            senders[m.tensor].add(m.src)
    assert max(len(s) for s in senders.values()) > 1


def test_per_rank_stats_are_that_ranks():
    whole, per_rank = compile_both("refit", 4096)
    for rank, plan in per_rank.items():
        assert set(plan.stats.per_rank) == {rank}
        assert plan.stats.per_rank[rank] == whole.stats.per_rank[rank]
        mine = [m for m in whole.moves() if rank in (m.src, m.dst)]
        assert plan.stats.moved == sum(m.nbytes for m in mine if m.kind != "local")
    assert "of rank" in repr(per_rank[min(per_rank)])


def test_the_fingerprint_covers_the_whole_program():
    program = program_of("corners")
    source, destination = layouts_of(program)
    plans = [plan_layouts(source, destination, rank=r, domain_size=2) for r in participants(program)]
    whole = plan_layouts(source, destination, mode="pairwise", domain_size=2)
    assert len({p.fingerprint for p in plans} | {whole.fingerprint}) == 1
    other_layout = layoutlang.loads(CORNERS.replace('"big": tp = shard(0)\n', '"big": tp = shard(1)\n'))
    changed = [
        plan_layouts(source, destination, rank=2, domain_size=1),
        plan_layouts(source, destination, rank=2, domain_size=2, bucket_bytes=2**20),
        plan_layouts(*layouts_of(other_layout), rank=2, domain_size=2),
        plan_layouts(source, destination, domain_size=2),  # the fleet mode: another plan
    ]
    prints = {p.fingerprint for p in changed} | {whole.fingerprint}
    assert len(prints) == len(changed) + 1


def test_validate_names_what_a_corrupted_per_rank_plan_breaks():
    program = program_of("corners")
    source, destination = layouts_of(program)
    plan = plan_layouts(source, destination, rank=4, domain_size=2, bucket_bytes=64 * 1024)
    cols = {name: np.array(getattr(plan.arrays, name), dtype=dtype) for name, dtype in _COLUMNS}

    def rebuilt(**changes):
        c = dict(cols, **changes)
        arrays = _core.PlanArrays(
            **{name: np.ascontiguousarray(c[name], dtype=dtype) for name, dtype in _COLUMNS},
            num_buckets=plan.num_buckets,
            lower_bound_bytes=int(plan.arrays.lower_bound_bytes),
            broadcast_payload_bytes=0,
        )
        return Plan(
            source,
            destination,
            plan.name,
            plan.policies,
            plan.domain_size,
            plan.bucket_bytes,
            arrays,
            mode="pairwise",
            rank=4,
        )

    receives = np.flatnonzero(cols["move_dst"] == 4)
    keep = np.array([i for i in range(plan.num_moves) if i != receives[0]])
    dropped = rebuilt(**{n: cols[n][keep] for n, _ in _COLUMNS if n.startswith("move_")})
    with pytest.raises(LayoutValueError, match="destination elements are written"):
        dropped.validate()
    foreign = cols["move_src"].copy(), cols["move_dst"].copy()
    foreign[0][receives[0]], foreign[1][receives[0]] = 6, 7
    with pytest.raises(LayoutValueError, match="neither sends to nor receives on rank 4"):
        rebuilt(move_src=foreign[0], move_dst=foreign[1]).validate()
    merged = cols["move_bucket"].copy()
    merged[:] = 0
    with pytest.raises(LayoutValueError, match="more than the budget"):
        rebuilt(move_bucket=merged).validate()


def test_a_rank_posts_a_pairs_messages_in_the_order_its_peer_does():
    program = program_of("corners")
    source, destination = layouts_of(program)
    budget = 4096
    orders: dict[int, list[tuple]] = {}
    for rank in participants(program):
        plan = plan_layouts(source, destination, rank=rank, domain_size=2, bucket_bytes=budget)
        steps = schedule(plan, rank)
        keys = [(s.stage, s.bucket) for s in steps]
        assert keys == sorted(keys)  # stage first, then bucket
        posted = []
        for step in steps:
            assert sum(m.nbytes for m in [*step.sends.values(), *step.recvs.values()]) <= budget or (
                len(step.sends) + len(step.recvs) == 1
            )
            posted += [(rank, p, step.stage, step.bucket) for p in step.sends]
            posted += [(p, rank, step.stage, step.bucket) for p in step.recvs]
        orders[rank] = posted
    assert any(len(plan_steps) > 1 for plan_steps in orders.values())
    for rank, posted in orders.items():
        for peer in orders:
            mine = [k for k in posted if peer in k[:2] and k[0] != k[1]]
            theirs = [k for k in orders[peer] if rank in k[:2] and k[0] != k[1]]
            assert mine == theirs, (rank, peer)


def test_refusals_name_the_problem():
    program = program_of("refit")
    source, destination = layouts_of(program)
    with pytest.raises(LayoutValueError, match=r"reshard policy only.*broadcast"):
        plan_layouts(source, destination, rank=0, policies="broadcast")
    with pytest.raises(LayoutValueError, match="rank 999 belongs to neither mesh"):
        plan_layouts(source, destination, rank=999)
    with pytest.raises(LayoutValueError, match="is a pairwise plan"):
        plan_layouts(source, destination, rank=0, mode="fleet")
    with pytest.raises(LayoutValueError, match="unknown plan mode"):
        compile_plan(program, mode="nearest")


def test_the_fleet_plan_is_unchanged_by_the_new_mode():
    """``mode`` defaults to the fleet plan: the same columns as a plan compiled without it."""
    program = program_of("refit")
    a = compile_plan(program)
    b = compile_plan(program, mode="fleet")
    assert a.mode == "fleet" and a.rank is None
    assert a.fingerprint == b.fingerprint
    assert "mode" not in a.to_json(moves=False)


def test_the_cli_prints_one_ranks_part(capsys):
    from layoutlang.cli import main

    path = EXAMPLES / "refit.layout"
    assert main(["plan", str(path), "--rank", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["result"]
    whole = compile_plan(program_of("refit"), mode="pairwise")
    mine = [m for m in whole.moves() if 2 in (m.src, m.dst)]
    assert out["mode"] == "pairwise" and out["rank"] == 2
    assert out["fingerprint"] == whole.fingerprint
    assert out["stats"]["moves"]["network"] == sum(m.kind == "network" for m in mine)
    assert "gather_and_broadcast" not in out  # no per-rank baseline
    assert main(["plan", str(path), "--rank", "2", "--explain", "--limit", "3"]) == 0
    text = capsys.readouterr().out
    assert "rank 2's part of the pairwise plan" in text
    assert f"({len(mine)} in all)" in text


def test_the_simulator_estimates_a_whole_pairwise_plan():
    """``simulate`` still sees the whole fleet: the pairwise plan moves the fleet plan's
    bytes (both at the lower bound), and the estimate reads it like any plan."""
    from layoutlang.plan.simulate import estimate

    program = program_of("refit")
    fleet = compile_plan(program, bucket_bytes=1 << 16)
    pairwise = compile_plan(program, bucket_bytes=1 << 16, mode="pairwise")
    a, b = estimate(fleet, program.topology), estimate(pairwise, program.topology)
    assert a.bytes == b.bytes == fleet.stats.bytes == pairwise.stats.bytes
    assert b.time > 0 and b.buckets == pairwise.num_buckets


@pytest.mark.parametrize(
    "train, infer, rule, expected",
    [
        (512, 512, "", True),  # 1024 ranks together: per-rank plans
        (512, 511, "", False),  # one fewer: the whole fleet's plan
        (512, 512, '    "norm": broadcast\n', False),  # a broadcast tensor has no per-rank plan
        (4, 8, "", False),
    ],
)
def test_the_resharder_chooses_per_rank_plans_for_large_fleets(train, infer, rule, expected):
    from layoutlang.runtime.resharder import PER_RANK_PLAN_RANKS, _per_rank

    assert PER_RANK_PLAN_RANKS == 1024
    program = layoutlang.loads(
        f"mesh a [dp = {train}] on ranks 0..{train - 1}\nmesh b [tp = {infer}] on ranks {train}..{train + infer - 1}\n"
        'tensor "w" [4096] fp32\ntensor "norm" [8] fp32\n'
        'layout x on a { default: replicate }\nlayout y on b { "w": tp = shard(0)\n default: replicate }\n'
        f"reshard x -> y {{\n{rule}}}\n"
    )
    assert _per_rank(program, None, None) is expected
    if expected:
        assert _per_rank(program, None, "broadcast") is False  # policy= overrides the rules


FP8_TEXT = """
mesh train [tp = 1]
mesh infer [tp = 2] on ranks 1..2
tensor "w" [256, 256] bf16
tensor "n" [64] bf16
layout train on train { default: replicate }
layout serve on infer {
  default: replicate
  "w": tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: train -> serve
"""


@pytest.mark.parametrize("name", PAIRS)
def test_moves_at_reads_what_move_reads_one_by_one(name):
    """``Plan.moves_at`` (a rank's schedule reads its moves through it) gives every move as
    ``Plan.move`` does, for the whole fleet's plan, a per-rank one, a recovery plan and a plan
    into a quantized destination."""
    program = program_of(name)
    fleet = compile_plan(program)
    rank = participants(program)[-1]
    plans = [fleet, compile_plan(program, rank=rank)]
    source, destination = layouts_of(program)
    plans.append(plan_recovery([source], destination, lost=()))
    plans.append(compile_plan(layoutlang.loads(FP8_TEXT)))
    for plan in plans:
        everything = list(range(plan.num_moves))
        assert plan.moves_at(everything) == [plan.move(i) for i in everything]
        some = plan.moves_of_rank(rank)
        assert plan.moves_at(some) == [plan.move(int(i)) for i in some]
    assert plans[-1].quantization is not None
