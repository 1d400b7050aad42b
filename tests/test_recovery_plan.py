"""Recovery plans: several source layouts in order of preference, never a lost rank.

Properties over random programs (hypothesis), checked by an independent numpy executor:
after the lost ranks of the old destination are replaced by spares (``fill-spares``),
the plan from ``[old destination, source]`` (the surviving inference replicas first,
then the training side) rebuilds the new destination exactly; no move touches a lost
rank; a region comes from the second source only where no surviving rank of the first
holds it; and when some region survives nowhere, planning stops with a DataLossError
that lists exactly the lost boxes.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan_properties import global_values, holdings, load_or_reject, programs, storages

import layoutlang
from elastic import DataLossError, lost_regions, remesh
from layoutlang.core import _core
from layoutlang.errors import LayoutValueError, core_errors
from layoutlang.plan import Plan, load_plan, plan_recovery

pytestmark = pytest.mark.timeout(300)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEXT = """
mesh train [dp = 2, tp = 2]
mesh infer [dp = 2, tp = 2] on ranks 4..7
mesh regrown [dp = 2, tp = 2] on ranks [4, 8, 6, 7]
tensor "w" [8, 6] fp32
tensor "b" [6] fp32
layout fsdp on train {
    "w": tp = shard(0)
    "b": tp = shard(0)
}
layout serve on infer {
    "w": tp = shard(1)
    "b": replicate
}
layout serve_regrown on regrown {
    "w": tp = shard(1)
    "b": replicate
}
reshard refit: fsdp -> serve
"""


def execute_recovery(plan: Plan) -> None:
    """Runs a recovery plan on numpy buffers; checks every destination element."""
    values = global_values(plan.destination)
    sources = [storages(layout, values, filled=True)[0] for layout in plan.sources]
    destination, _ = storages(plan.destination, values, filled=False)
    expected, masks = storages(plan.destination, values, filled=True)
    order = sorted(plan.moves(), key=lambda m: (m.bucket, m.stage, m.index))
    for _, step in itertools.groupby(order, key=lambda m: (m.bucket, m.stage)):
        staged = []
        for move in step:
            assert move.src not in plan.lost and move.dst not in plan.lost, f"{move} touches a lost rank"
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


def surviving(layout: layoutlang.Layout, tensor: str, lost: set[int]) -> np.ndarray:
    """Mask of the elements some surviving rank of ``layout`` holds."""
    shape = layout.tensors[tensor].shape
    mask = np.zeros(shape, bool)
    for rank, held in holdings(layout, tensor).items():
        if rank not in lost:
            mask |= held
    return mask


@st.composite
def recoveries(draw):
    text, bucket = draw(programs())
    lost_dst = draw(st.integers(1, 3))
    lost_src = draw(st.integers(0, 2))
    return text, bucket, lost_dst, lost_src, draw(st.randoms(use_true_random=False))


@SETTINGS
@given(recoveries())
def test_recovery_plans_rebuild_the_destination_from_survivors_in_order(case):
    text, bucket, lost_dst, lost_src, rng = case
    program = load_or_reject(text)
    source, old = program.layout("S"), program.layout("D")
    lost = set(rng.sample(sorted(old.mesh.ranks), min(lost_dst, old.mesh.size)))
    only_source = sorted(set(source.mesh.ranks) - set(old.mesh.ranks))
    lost |= set(rng.sample(only_source, min(lost_src, len(only_source))))
    fresh = max(set(source.mesh.ranks) | set(old.mesh.ranks)) + 1
    spares = list(range(fresh, fresh + len(lost & set(old.mesh.ranks))))
    new = remesh(old, lost, "fill-spares", spares=spares)
    expected_lost = []
    for tensor in old.tensors:
        if not any(rank in lost for layout in (old, source) for rank in layout.holders(tensor)):
            continue
        gone = ~(surviving(old, tensor, lost) | surviving(source, tensor, lost))
        if 0 not in old.tensors[tensor].shape and gone.any():
            expected_lost.append((tensor, int(gone.sum())))
    try:
        plan = plan_recovery([old, source], new, lost, domain_size=program.topology.domain_size, bucket_bytes=bucket)
    except DataLossError as err:
        found = defaultdict(int)
        for tensor, _, sizes in err.regions:
            found[tensor] += int(np.prod(sizes))
        assert sorted(found.items()) == sorted(expected_lost)
        return
    assert not expected_lost
    plan.validate()
    execute_recovery(plan)
    # the first source is preferred: a move reads the second only where the first lost the region
    first_alive = {t: surviving(old, t, lost) for t in old.tensors}
    for move in plan.moves():
        box = tuple(slice(o, o + s) for o, s in zip(move.offsets, move.sizes))
        if move.src_space == "source" and move.source == 1:
            assert not first_alive[move.tensor][box].any(), f"{move} reads the training side needlessly"
        if move.src_space == "source" and move.source == 0:
            assert first_alive[move.tensor][box].all()
    assert plan.stats.moved >= plan.stats.lower_bound


def test_recovery_prefers_inference_replicas_and_falls_back_to_training():
    program = layoutlang.loads(TEXT)
    serve, fsdp = program.layout("serve"), program.layout("fsdp")
    regrown = program.layout("serve_regrown")
    # rank 5 (serve dp 0, tp 1) is replaced by rank 8: its half of w comes from rank 7
    plan = plan_recovery([serve, fsdp], regrown, {5})
    plan.validate()
    to_joiner = sorted((m.tensor, m.src, m.source, m.kind) for m in plan.moves() if m.dst == 8)
    assert to_joiner == [("b", 4, 0, "network"), ("w", 7, 0, "network")]
    assert plan.is_recovery and plan.lost == {5}
    # rank 7 lost too: w's second half has no inference copy left, so it comes from training
    plan = plan_recovery([serve, fsdp], remesh(serve, {5, 7}, "fill-spares", spares=[8, 9]), {5, 7})
    execute_recovery(plan)
    from_training = {(m.tensor, m.offsets, m.sizes, m.src) for m in plan.moves() if m.source == 1}
    assert from_training and all(t == "w" and o[1] == 3 for t, o, _, _ in from_training)
    assert all(m.src in fsdp.mesh.ranks for m in plan.moves() if m.source == 1)
    assert "source 1" in str(next(m for m in plan.moves() if m.source == 1))


def test_no_surviving_copy_names_every_lost_box():
    program = layoutlang.loads(TEXT)
    serve, fsdp = program.layout("serve"), program.layout("fsdp")
    new = remesh(serve, {5, 7}, "fill-spares", spares=[8, 9])
    with pytest.raises(DataLossError) as info:
        plan_recovery([serve, fsdp], new, {5, 7, 0, 2})
    assert info.value.regions == [("w", (0, 3), (4, 3))]
    assert "w[0:4, 3:6]" in str(info.value)
    assert lost_regions([serve, fsdp], {5, 7, 0, 2}) == info.value.regions


def test_the_core_refuses_a_region_without_survivor_on_its_own():
    program = layoutlang.loads(TEXT)
    serve, fsdp = program.layout("serve"), program.layout("fsdp")
    new = remesh(serve, {5, 7}, "fill-spares", spares=[8, 9])
    with pytest.raises(layoutlang.LayoutError, match=r"tensor 0: the region \[0:4, 3:6\] has no copy"), core_errors():
        _core.build_recovery_plan([serve.core, fsdp.core], [0, 2, 5, 7], new.core, 1, 1 << 20)


def test_recovery_plan_errors_are_clear():
    program = layoutlang.loads(TEXT)
    serve, fsdp = program.layout("serve"), program.layout("fsdp")
    with pytest.raises(LayoutValueError, match="lost rank 5 still belongs to the destination layout 'serve'"):
        plan_recovery([fsdp], serve, {5})
    with pytest.raises(LayoutValueError, match="at least one source layout"):
        plan_recovery([], serve, {})


def test_recovery_plans_validate_their_reads_and_are_not_read_back():
    program = layoutlang.loads(TEXT)
    serve, fsdp = program.layout("serve"), program.layout("fsdp")
    plan = plan_recovery([serve, fsdp], remesh(serve, {5, 7}, "fill-spares", spares=[8, 9]), {5, 7})
    # reading from a lost rank, or from a source index that does not exist, is caught
    columns = {name: np.array(getattr(plan.arrays, name)) for name in ("move_src", "move_source")}
    remote = int(np.flatnonzero(columns["move_src"] != np.array(plan.arrays.move_dst))[0])
    for column, value, message in (("move_src", 5, "which is lost"), ("move_source", 7, "source out of range")):
        broken = {n: np.array(getattr(plan.arrays, n)) for n, _ in layoutlang.plan.data._COLUMNS}
        broken[column][remote] = value
        arrays = _core.PlanArrays(
            **{n: np.ascontiguousarray(broken[n], dtype=d) for n, d in layoutlang.plan.data._COLUMNS},
            num_buckets=plan.num_buckets,
            lower_bound_bytes=int(plan.arrays.lower_bound_bytes),
            broadcast_payload_bytes=0,
        )
        bad = Plan(plan.source, plan.destination, "bad", plan.policies, 1, plan.bucket_bytes, arrays,
                   sources=plan.sources, lost=plan.lost)
        with pytest.raises(LayoutValueError, match=message):
            bad.validate()
    with pytest.raises(LayoutValueError, match="recovery plan"):
        load_plan(plan.to_bytes(), program)
    assert plan.to_json()["lost"] == [5, 7]
    assert {m["source"] for m in plan.to_json()["moves"]} == {"serve", "fsdp"}
