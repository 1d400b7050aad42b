"""Recovery decisions in the C++ core: lost regions and which ranks' holdings changed.

``lost_regions`` and ``same_holdings`` (layoutlang.plan.loss) decide in the core, replica
group by replica group. Their oracles here are written from the definitions, rank by rank
and element by element, with nothing from the core but each rank's boxes:

- a region is lost when a lost rank held some of its tensor and no surviving rank of any
  layout holds it; the regions are the cells of the tensor cut at every surviving box
  boundary that nobody holds, merged greedily in row-major order (from each free cell, the
  last dim grown first while the cells are free, then earlier dims), which is the answer
  the Python analysis gave before it moved into the core;
- a rank holds the same in two layouts when its storages (names, shapes as held) and its
  boxes of every tensor (offsets, sizes, storage, place, transposition) are equal.

Refill plans (layoutlang.plan.refill: the recovery plan of the ranks whose holdings changed)
run on numpy buffers where the other ranks keep their storages: the whole new destination
must come out exact, and the plan must move into those ranks what the plan of the whole
destination moves into them.

Checked on random programs (hypothesis: uneven, padded, strided, interleaved and fused
layouts, sub-meshes, pipeline stages), on every program of examples/, and on the small
programs of tests/test_recovery_plan.py and tests/test_elastic_remesh.py.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_elastic_remesh import PROGRAM as REMESH_PROGRAM
from test_plan_properties import global_values, load_or_reject, programs, storages
from test_recovery_plan import TEXT as RECOVERY_PROGRAM

import layoutlang
from elastic import DataLossError, remesh
from elastic.recovery import PER_RANK_SESSION_RANKS, RefitSpec, per_rank_plans
from layoutlang.core import _core
from layoutlang.errors import LayoutError, LayoutValueError
from layoutlang.plan import Plan, plan_recovery
from layoutlang.plan.loss import lost_regions, same_holdings
from layoutlang.plan.refill import RefillPlan, plan_refill

pytestmark = pytest.mark.timeout(300)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.layout"))


# ---------------------------------------------------------------------------- oracles


def move_keys(plan: Plan) -> list[tuple]:
    """Every move of ``plan``, as a comparable record."""
    return [
        (m.tensor, m.offsets, m.sizes, m.src, m.dst, m.kind, m.stage, m.bucket, m.src_space, m.dst_space)
        for m in plan.moves()
    ]


def oracle_lost_regions(layouts, lost):
    """The lost regions from the definition (see the module doc), rank by rank."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for name, tensor in layout.tensors.items():
            shapes.setdefault(name, tuple(tensor.shape))
    out = []
    for name, shape in shapes.items():
        if 0 in shape:
            continue
        held, hit = [], False
        for layout in layouts:
            if name not in layout.tensors:
                continue
            for rank in layout.holders(name):
                if rank in lost:
                    hit = True
                else:
                    held += [(b.offsets, b.sizes) for b in layout.boxes(name, rank) if b.numel]
        if not hit:
            continue
        cuts = [sorted({0, n, *(o[d] for o, _ in held), *(o[d] + s[d] for o, s in held)}) for d, n in enumerate(shape)]
        grid = tuple(len(c) - 1 for c in cuts)
        free = np.ones(grid, bool)
        for offsets, sizes in held:
            free[tuple(slice(c.index(o), c.index(o + s)) for c, o, s in zip(cuts, offsets, sizes))] = False
        for start in itertools.product(*(range(g) for g in grid)):
            if not free[start]:
                continue
            end = list(start)
            for d in reversed(range(len(grid))):
                while end[d] + 1 < grid[d]:
                    probe = tuple(
                        slice(end[k] + 1, end[k] + 2) if k == d else slice(start[k], end[k] + 1)
                        for k in range(len(grid))
                    )
                    if not free[probe].all():
                        break
                    end[d] += 1
            free[tuple(slice(s, e + 1) for s, e in zip(start, end))] = False
            out.append(
                (
                    name,
                    tuple(cuts[d][start[d]] for d in range(len(grid))),
                    tuple(cuts[d][end[d] + 1] - cuts[d][start[d]] for d in range(len(grid))),
                )
            )
    return out


def oracle_same(before, after, rank) -> bool:
    """Whether ``rank`` holds the same storages and boxes in both layouts, from the boxes."""
    if rank not in before.mesh or rank not in after.mesh:
        return False
    if before.storages_on(rank) != after.storages_on(rank):
        return False
    return all(before.boxes(t, rank) == after.boxes(t, rank) for t in before.tensors)


def element_check(layouts, lost, regions) -> None:
    """The regions are disjoint and are exactly the elements no survivor holds (of tensors
    a lost rank held)."""
    for name in dict.fromkeys(n for layout in layouts for n in layout.tensors):
        shape = next(layout.tensors[name].shape for layout in layouts if name in layout.tensors)
        survivors = np.zeros(shape, bool)
        hit = False
        for layout in layouts:
            if name not in layout.tensors:
                continue
            for rank in layout.holders(name):
                if rank in lost:
                    hit = True
                    continue
                for box in layout.boxes(name, rank):
                    survivors[box.slices()] = True
        counted = np.zeros(shape, np.int64)
        for tensor, offsets, sizes in regions:
            if tensor == name:
                counted[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        assert counted.max(initial=0) <= 1, f"{name}: regions overlap"
        expected = ~survivors if hit else np.zeros(shape, bool)
        assert np.array_equal(counted == 1, expected), f"{name}: regions are not the elements nobody holds"


def check_lost(layouts, lost) -> list:
    regions = lost_regions(layouts, lost)
    assert regions == oracle_lost_regions(layouts, lost)
    element_check(layouts, lost, regions)
    return regions


def check_holdings(before, after) -> list[bool]:
    ranks = sorted(set(before.mesh.ranks) | set(after.mesh.ranks) | {max(before.mesh.ranks) + 100})
    same = same_holdings(before, after, ranks)
    assert same == [oracle_same(before, after, r) for r in ranks], (before.name, after.name)
    return same


def successors(layout, lost):
    """The layouts a session could move to after ``lost``: each policy that applies. Both
    keep what every remaining position holds, so remesh does not check them again: they
    must pass the check (the layouts given here did)."""
    spares = [max(layout.mesh.ranks) + 1 + i for i in range(len(lost))]
    out = []
    for policy in ("drop-replica", "fill-spares"):
        with contextlib.suppress(LayoutError):  # no data-parallel axis, or no spare
            out.append(remesh(layout, lost, policy, spares=spares))
    for after in out:
        after.check()
    return out


# ------------------------------------------------------------------------------ tests


@SETTINGS
@given(programs(), st.data())
def test_random_programs_match_the_oracles(case, data):
    program = load_or_reject(case[0])
    source, destination = program.layouts["S"], program.layouts["D"]
    ranks = sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))
    lost = set(data.draw(st.lists(st.sampled_from(ranks), min_size=1, max_size=3)))
    for layouts in ([source], [destination], [destination, source]):
        check_lost(layouts, lost)
    for layout in (source, destination):
        for after in successors(layout, lost & set(layout.mesh.ranks) or {layout.mesh.ranks[0]}):
            check_holdings(layout, after)
    if set(source.mesh.ranks) & set(destination.mesh.ranks):
        check_holdings(source, destination)  # two unrelated layouts on shared ranks: the exact path


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_the_oracles_for_every_lost_rank(path):
    program = layoutlang.load(path)
    layouts = list(program.layouts.values())
    ranks = sorted(set().union(*(layout.mesh.ranks for layout in layouts)))
    for rank in ranks:
        check_lost(layouts, {rank})
        for layout in layouts:
            check_lost([layout], {rank})
            if rank in layout.mesh:
                for after in successors(layout, {rank}):
                    check_holdings(layout, after)
    for pair in itertools.combinations(ranks, 2):
        for layout in layouts:
            check_lost([layout], set(pair))
    for before, after in itertools.permutations(layouts, 2):
        if set(before.tensors) == set(after.tensors):
            check_holdings(before, after)


@pytest.mark.parametrize("text", [REMESH_PROGRAM, RECOVERY_PROGRAM], ids=["remesh", "recovery"])
def test_the_recovery_tests_programs_match_the_oracles(text):
    program = layoutlang.loads(text)
    layouts = list(program.layouts.values())
    ranks = sorted(set().union(*(layout.mesh.ranks for layout in layouts)))
    for k in (1, 2, 3):
        for lost in itertools.combinations(ranks, k):
            for chosen in ([layout] for layout in layouts):
                check_lost(chosen, set(lost))
            check_lost(layouts, set(lost))
    for layout in layouts:
        for rank in layout.mesh.ranks:
            for after in successors(layout, {rank}):
                check_holdings(layout, after)


def test_drop_replica_keeps_every_survivor_and_fill_spares_changes_only_the_spare():
    program = layoutlang.loads(RECOVERY_PROGRAM)
    serve = program.layouts["serve"]
    dropped = remesh(serve, {5}, "drop-replica")  # dp replica 1 (ranks 6, 7) stays whole
    assert same_holdings(serve, dropped, [4, 5, 6, 7]) == [False, False, True, True]
    filled = remesh(serve, {5}, "fill-spares", spares=[9])
    assert same_holdings(serve, filled, [4, 5, 6, 7, 9]) == [True, False, True, True, False]


def test_errors_name_what_is_wrong():
    program = layoutlang.loads(RECOVERY_PROGRAM)
    other = layoutlang.loads('mesh m [tp = 2]\ntensor "w" [4, 6] fp32\nlayout x on m { "w": tp = shard(0) }')
    with pytest.raises(LayoutValueError, match="tensor 'w' has shape"):
        lost_regions([program.layouts["fsdp"], other.layouts["x"]], {0})
    with pytest.raises(LayoutValueError, match="place different logical tensors"):
        same_holdings(program.layouts["fsdp"], other.layouts["x"], [0])
    with pytest.raises(LayoutValueError, match="lost ranks must be an iterable of integers"):
        lost_regions(program.layouts["fsdp"], 3)


# ------------------------------------------------------------------ refill plans


def execute_refill(plan: RefillPlan, old) -> None:
    """Runs a refill plan on numpy buffers: the ranks it does not fill start with what they
    held in ``old`` (they keep their storages), the filled ones with nothing; afterwards every
    destination element of every rank must be right."""
    values = global_values(plan.destination)
    sources = [storages(layout, values, filled=True)[0] for layout in plan.sources]
    expected, masks = storages(plan.destination, values, filled=True)
    destination, _ = storages(plan.destination, values, filled=False)
    kept, _ = storages(old, values, filled=True)
    for rank in plan.destination.mesh.ranks:
        if rank not in plan.filled:
            destination[rank] = {name: buffer.copy() for name, buffer in kept[rank].items()}
    order = sorted(plan.moves(), key=lambda m: (m.bucket, m.stage, m.index))
    for _, step in itertools.groupby(order, key=lambda m: (m.bucket, m.stage)):
        staged = []
        for move in step:
            assert move.src not in plan.lost and move.dst not in plan.lost, f"{move} touches a lost rank"
            assert move.dst_space != "destination" or move.dst in plan.filled, f"{move} writes a kept rank"
            (src_name, src_at), (dst_name, dst_at) = plan.place(move)
            side = sources[move.source] if move.src_space == "source" else destination
            data = side[move.src][src_name][tuple(slice(o, o + s) for o, s in zip(src_at, move.sizes))].copy()
            assert (data >= 0).all(), f"{move} reads bytes nobody delivered"
            staged.append((move, dst_name, dst_at, data))
        for move, dst_name, dst_at, data in staged:
            destination[move.dst][dst_name][tuple(slice(o, o + s) for o, s in zip(dst_at, move.sizes))] = data
    for rank, buffers in destination.items():
        for name, buffer in buffers.items():
            mask = masks[rank][name]
            assert np.array_equal(buffer[mask], expected[rank][name][mask]), f"rank {rank} storage {name}"


@SETTINGS
@given(programs(), st.data())
def test_refill_plans_fill_exactly_the_ranks_that_changed(case, data):
    """After lost destination ranks are replaced by spares, the plan of the ranks whose
    holdings changed validates, writes nothing elsewhere, and with the other ranks' kept
    storages rebuilds the whole new destination; it has the moves into those ranks that the
    plan of the whole destination has, and it fails with the same DataLossError."""
    program = load_or_reject(case[0])
    source, old = program.layouts["S"], program.layouts["D"]
    lost = set(data.draw(st.lists(st.sampled_from(old.mesh.ranks), min_size=1, max_size=2)))
    fresh = max(set(source.mesh.ranks) | set(old.mesh.ranks)) + 1
    new = remesh(old, lost, "fill-spares", spares=list(range(fresh, fresh + len(lost))))
    ranks = list(new.mesh.ranks)
    changed = [r for r, same in zip(ranks, same_holdings(old, new, ranks)) if not same]
    assert set(changed) >= set(range(fresh, fresh + len(lost)))  # every spare is new
    domain = program.topology.domain_size
    try:
        full = plan_recovery([old, source], new, lost, domain_size=domain, bucket_bytes=case[1])
    except DataLossError as err:
        with pytest.raises(DataLossError) as again:
            plan_refill([old, source], new, lost, changed, domain_size=domain, bucket_bytes=case[1])
        assert again.value.regions == err.regions
        return
    plan = plan_refill([old, source], new, lost, changed, domain_size=domain, bucket_bytes=case[1])
    plan.validate()
    assert plan.filled == frozenset(changed) and plan.lost == frozenset(lost)
    execute_refill(plan, old)
    # the whole destination's plan moves the same into those ranks, and copies the rest locally
    assert all(m.dst in plan.filled for m in plan.moves())
    assert plan.num_moves == sum(1 for m in full.moves() if m.dst in plan.filled)


def test_a_refill_plan_is_checked_against_its_ranks():
    program = layoutlang.loads(RECOVERY_PROGRAM)
    serve, fsdp, regrown = program.layouts["serve"], program.layouts["fsdp"], program.layouts["serve_regrown"]
    plan = plan_refill([serve, fsdp], regrown, {5}, [8])
    plan.validate()
    assert sorted((m.tensor, m.src, m.dst, m.source) for m in plan.moves()) == [("b", 4, 8, 0), ("w", 7, 8, 0)]
    # the same moves said to fill another rank as well: that rank's bytes are not written
    claimed = RefillPlan(
        plan.source,
        plan.destination,
        "claimed",
        plan.policies,
        plan.domain_size,
        plan.bucket_bytes,
        plan.arrays,
        sources=plan.sources,
        lost=plan.lost,
        filled={8, 6},
    )
    with pytest.raises(LayoutValueError, match="on rank 6: 0 of its"):
        claimed.validate()
    # ... and said to fill none: the moves write a rank the plan does not fill
    silent = RefillPlan(
        plan.source,
        plan.destination,
        "silent",
        plan.policies,
        plan.domain_size,
        plan.bucket_bytes,
        plan.arrays,
        sources=plan.sources,
        lost=plan.lost,
        filled=set(),
    )
    with pytest.raises(LayoutValueError, match="writes to rank 8, which the plan does not fill"):
        silent.validate()
    with pytest.raises(LayoutValueError, match="rank 5 to be filled is not in the destination layout"):
        plan_refill([serve, fsdp], regrown, set(), [5])
    with pytest.raises(LayoutValueError, match="lost rank 4 still belongs"):
        plan_refill([serve, fsdp], regrown, {4}, [8])


def test_the_core_refuses_inconsistent_arguments():
    program = layoutlang.loads(RECOVERY_PROGRAM)
    fsdp = program.layouts["fsdp"]
    n = len(fsdp.tensors)
    shapes = [list(t.shape) for t in fsdp.tensors.values()]
    with pytest.raises(_core.CoreError, match=f"layout 0 has {n} tensors, but 1 numbers are given"):
        _core.lost_regions([fsdp.core], [[0]], shapes, [0])
    with pytest.raises(_core.CoreError, match="tensor number 7 is out of range"):
        _core.lost_regions([fsdp.core], [[7] * n], shapes, [0])
    with pytest.raises(_core.CoreError, match="its shape differs between the layouts"):
        _core.lost_regions([fsdp.core], [list(range(n))], shapes[::-1], [0])
    storages = len(fsdp.resolved.storages)
    names, views = list(range(storages)), [None] * storages
    with pytest.raises(_core.CoreError, match=f"a name and a view per storage \\({storages} storages\\)"):
        _core.same_holdings(fsdp.core, names[:-1], views, fsdp.core, names, views, [0])
    assert _core.same_holdings(fsdp.core, names, views, fsdp.core, names, views, [0, 1, 99]) == [True, True, False]


def test_empty_stacks_count_among_a_ranks_storages():
    """vLLM's w13_weight with 3 experts on 4 EP ranks: EP rank 3 holds it empty ([0, ...]), a
    storage the model knows and the core does not. A layout keeping every expert on EP rank 0
    leaves rank 3 with no storage at all: the same boxes (none), not the same storages."""
    text = """
mesh infer [ep = 4]
tensor "experts.{e}.gate_proj.weight" [4, 6] fp32 for e in 0..2
tensor "experts.{e}.up_proj.weight" [4, 6] fp32 for e in 0..2
layout spread on infer {
  "experts.{e}.*": ep[e % 4]
  storage "experts.w13_weight" = stack e of "experts.{e}.gate_proj.weight" | "experts.{e}.up_proj.weight"
}
layout first on infer {
  "experts.{e}.*": ep[0]
  storage "experts.w13_weight" = stack e of "experts.{e}.gate_proj.weight" | "experts.{e}.up_proj.weight"
}
"""
    program = layoutlang.loads(text)
    spread, first = program.layouts["spread"], program.layouts["first"]
    assert spread.storages_on(3) == {"experts.w13_weight": (0, 8, 6)} and first.storages_on(3) == {}
    assert same_holdings(spread, first, [3]) == [False] == [oracle_same(spread, first, 3)]
    check_holdings(spread, first)
    check_holdings(first, spread)
    for after in successors(spread, {3}) + successors(spread, {1}):
        check_holdings(spread, after)


def test_a_new_generations_per_rank_refit_plans_are_the_parts_of_one_plan():
    """After a loss, a session of per-rank plans (``RefitSpec(per_rank=True)``) gives each
    member its own part of the new generation's pairwise refit plan: the parts together are
    the whole pairwise plan, move for move, which writes every destination byte once; every
    part, a member in neither layout's empty one included, bears the whole program's
    fingerprint; and the whole fleet's plan of the same layouts moves the same bytes."""
    program = layoutlang.loads(RECOVERY_PROGRAM)
    spec = RefitSpec(
        "refit", program.layouts["fsdp"], program.layouts["serve"],
        destination_policy=("fill-spares", None), domain_size=2, bucket_bytes=64, per_rank=True,
    )
    members = [0, 1, 2, 3, 4, 6, 7, 9, 10]  # rank 5 lost, 9 its spare, 10 in no layout
    source, destination = spec.layouts([list(range(8)), members])
    assert destination.mesh.ranks == (4, 9, 6, 7)
    whole = spec.plan(source, destination)
    whole.validate()  # every destination byte written exactly once, from what its sender holds
    parts = {rank: spec.plan(source, destination, rank) for rank in members}
    for rank, part in parts.items():
        assert (part.mode, part.rank) == ("pairwise", rank)
        assert part.fingerprint == whole.fingerprint
        if rank != 10:
            part.validate()
    assert parts[10].num_moves == 0
    keys = {rank: set(move_keys(part)) for rank, part in parts.items()}
    assert set().union(*keys.values()) == set(move_keys(whole))
    for rank, own in keys.items():  # each part: the whole plan's moves it sends or receives
        assert own == {k for k in move_keys(whole) if rank in (k[3], k[4])}
    fleet = attrs.evolve(spec, per_rank=False).plan(source, destination)
    assert fleet.mode == "fleet" and fleet.fingerprint != whole.fingerprint
    received = [p.stats.per_rank for p in (fleet, whole)]
    for rank in destination.mesh.ranks:  # the lower bound: what each rank lacks, on both
        assert sum(received[0][rank]["received"].values()) == sum(received[1][rank]["received"].values())


def test_sessions_of_large_fleets_choose_per_rank_plans():
    def program(ranks: int) -> layoutlang.Program:
        return layoutlang.loads(f"""
mesh train [tp = {ranks // 2}]
mesh infer [tp = {ranks - ranks // 2}] on ranks {ranks // 2}..{ranks - 1}
tensor "w" [{ranks}, 4] fp32
layout fsdp on train {{ "w": tp = shard(0) }}
layout serve on infer {{ "w": tp = shard(0) }}
reshard refit: fsdp -> serve
""")

    for ranks, expected in ((PER_RANK_SESSION_RANKS - 1, False), (PER_RANK_SESSION_RANKS, True)):
        p = program(ranks)
        assert per_rank_plans(p.layouts["fsdp"], p.layouts["serve"]) is expected


WIDE = """
topology { domain_size = 4 }
mesh train [tp = 4]
mesh infer [dp = 2, tp = 8] on ranks 4..19
tensor "w" [24, 10] fp32
tensor "v" [7, 9] fp32
tensor "b" [10] fp32
layout fsdp on train {
    "w": tp = shard(0)
    "v": tp = shard(1)
    "b": tp = shard(0)
}
layout serve on infer {
    "w": tp = shard(1)
    "v": tp = shard(0)
    "b": replicate
}
reshard refit: fsdp -> serve
"""


@pytest.mark.parametrize("lost", [[9], [4, 12], [5, 13], [19]], ids=str)
def test_a_few_spares_of_a_wide_destination_are_filled_exactly(lost):
    """A few ranks to fill among many (at most one in eight: the core then looks each of
    them up in the replica groups instead of scanning every group's ranks): the plan
    validates, rebuilds the new destination with the kept storages, and has the moves into
    the spares that the plan of the whole destination has, from the surviving replica or,
    where both replicas of a shard are lost, the training side."""
    program = layoutlang.loads(WIDE)
    source, old = program.layouts["fsdp"], program.layouts["serve"]
    spares = list(range(20, 20 + len(lost)))
    new = remesh(old, set(lost), "fill-spares", spares=spares)
    ranks = list(new.mesh.ranks)
    changed = [r for r, same in zip(ranks, same_holdings(old, new, ranks)) if not same]
    assert changed == spares
    plan = plan_refill([old, source], new, lost, changed, domain_size=4, bucket_bytes=64)
    plan.validate()
    execute_refill(plan, old)
    full = plan_recovery([old, source], new, lost, domain_size=4, bucket_bytes=64)
    assert plan.num_moves == sum(1 for m in full.moves() if m.dst in plan.filled)
    from_training = {m.source for m in plan.moves() if m.src_space == "source"}
    assert from_training == ({0, 1} if lost in ([4, 12], [5, 13]) else {0})
    assert int(plan.arrays.lower_bound_bytes) > 0
