"""Gather-and-broadcast's scratch, bounded by the bucket budget (issue 15, item 4).

The broadcast policy gathers each tensor (a part of it, when it exceeds half a bucket) in one
root's scratch, sends it to one landing rank per domain, relays it there and lets every
receiver extract its boxes. These tests walk a plan's moves on their own (per rank, every
region written into scratch, live from the bucket of its write to the bucket of its last
read) and check that no rank's staging plus live scratch in a bucket exceeds the budget; then
they run such plans on gloo workers with a small ``memory_budget`` and check every byte and
each rank's ``RunReport.peak_staging_bytes``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import workers

import layoutlang
from layoutlang.plan import compile_plan
from layoutlang.plan.data import KINDS, SPACES
from layoutlang.runtime.schedule import OWN_TRANSFER_BYTES

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.layout"))
KiB, MiB = 1024, 1024 * 1024
LOCAL, SCRATCH = KINDS.index("local"), SPACES.index("scratch")

# A tensor of 8 MiB (larger than the budgets below), uneven shards on both sides (1001 rows
# over 3 training ranks, 8 inference ranks over 2 domains of 4: the root's sends land on one
# rank per domain and are relayed to 3 peers), a quantization-free mix of small tensors.
BIG = """
topology { domain_size = 4 }
mesh train [tp = 3] on ranks 0..2
mesh infer [dp = 2, tp = 4] on ranks 4..11
tensor "embed" [2048, 1024] fp32
tensor "uneven" [1001, 384] fp32
tensor "proj" [512, 300] bf16
tensor "norm" [300] fp32
layout train on train { "embed": tp = shard(0)  "uneven": tp = shard(0)  "proj": tp = shard(1)  default: replicate }
layout infer on infer { "embed": tp = shard(0)  "uneven": tp = shard(1)  "proj": tp = shard(0)  default: replicate }
reshard train -> infer
"""

# What the executed case runs on 4 gloo workers: a training domain and an inference domain of
# 2 ranks each (network sends to a landing rank, relayed to its peer), 2 MiB and uneven
# tensors above a 1 MiB memory budget's 512 KiB buckets.
SMALL = """
topology { domain_size = 2 }
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "embed" [1024, 512] fp32
tensor "uneven" [777, 300] fp32
tensor "w" [256, 256] bf16
tensor "norm" [512] fp32
layout train on train { "embed": tp = shard(0)  "uneven": tp = shard(1)  "w": tp = shard(0)  default: replicate }
layout infer on infer { "embed": tp = shard(1)  "uneven": tp = shard(0)  "w": tp = shard(1)  default: replicate }
reshard train -> infer
"""


def _boxes(plan) -> tuple[np.ndarray, list[tuple[tuple[int, int], ...]]]:
    a = plan.arrays
    ndims = np.diff(np.append(a.region_dims_start, len(a.region_offsets)))
    boxes = []
    for region, start in enumerate(a.region_dims_start):
        n = int(ndims[region])
        offsets = a.region_offsets[start : start + n]
        sizes = a.region_sizes[start : start + n]
        boxes.append(tuple((int(o), int(o + s)) for o, s in zip(offsets, sizes)))
    return ndims, boxes


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def peak_staging_and_scratch(plan) -> dict[int, int]:
    """Per rank, the most it holds in one bucket: what its moves stage there (both sides of
    every move between two ranks, except what the executor moves in place: a region of
    OWN_TRANSFER_BYTES or more received into scratch, into its own scratch buffer, or sent
    from scratch as the very box one earlier move received there) plus every region of
    scratch written there or before and read there or after (a region lives from its write
    to its last read; one never read, in its write's bucket)."""
    a = plan.arrays
    _, boxes = _boxes(plan)
    held: dict[tuple[int, int], int] = defaultdict(int)  # (rank, bucket) -> bytes
    written: dict[tuple[int, int], list[list[int]]] = defaultdict(list)  # (rank, tensor) -> [region, write, last]
    received: set[tuple[int, tuple[tuple[int, int], ...]]] = set()  # (rank, box) received into scratch
    order = np.lexsort((a.move_stage, a.move_bucket))  # as the executor runs them
    for i in order:
        region, bucket = int(a.move_region[i]), int(a.move_bucket[i])
        nbytes = int(a.region_bytes[region])
        if a.move_kind[i] != LOCAL:
            in_place = a.move_src_space[i] == SCRATCH and nbytes >= OWN_TRANSFER_BYTES
            if not (in_place and (int(a.move_src[i]), boxes[region]) in received):
                held[int(a.move_src[i]), bucket] += nbytes
            if a.move_dst_space[i] == SCRATCH:
                received.add((int(a.move_dst[i]), boxes[region]))
            if not (a.move_dst_space[i] == SCRATCH and nbytes >= OWN_TRANSFER_BYTES):
                held[int(a.move_dst[i]), bucket] += nbytes
        if a.move_dst_space[i] == SCRATCH:
            written[int(a.move_dst[i]), int(a.region_tensor[region])].append([region, bucket, bucket])
    for i in range(len(a.move_region)):
        if a.move_src_space[i] != SCRATCH:
            continue
        region, bucket = int(a.move_region[i]), int(a.move_bucket[i])
        for entry in written[int(a.move_src[i]), int(a.region_tensor[region])]:
            if _overlap(boxes[entry[0]], boxes[region]):
                entry[2] = max(entry[2], bucket)
    for (rank, _), entries in written.items():
        for region, first, last in entries:
            for bucket in range(first, last + 1):
                held[rank, bucket] += int(a.region_bytes[region])
    peak: dict[int, int] = defaultdict(int)
    for (rank, _), nbytes in held.items():
        peak[rank] = max(peak[rank], nbytes)
    return dict(peak)


def _largest_scratch_write(plan) -> int:
    a = plan.arrays
    into = a.move_dst_space == SCRATCH
    return int(a.region_bytes[a.move_region[into]].max()) if into.any() else 0


def _check_within_budget(plan, bucket_bytes: int) -> dict[int, int]:
    plan.validate()
    peak = peak_staging_and_scratch(plan)
    over = {r: p for r, p in peak.items() if p > bucket_bytes}
    assert not over, f"staging + live scratch over the {bucket_bytes} byte bucket on ranks {over}"
    return peak


@pytest.mark.parametrize("bucket_bytes", [64 * KiB, 1 * MiB])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_broadcast_plans_keep_staging_and_scratch_within_the_bucket(path, bucket_bytes):
    program = layoutlang.load(path)
    for name in program.reshards:
        plan = compile_plan(program, name, bucket_bytes=bucket_bytes, policy="broadcast")
        _check_within_budget(plan, bucket_bytes)


@pytest.mark.parametrize("bucket_bytes", [256 * KiB, 1 * MiB, 3 * MiB])
def test_tensors_larger_than_the_budget_are_broadcast_in_parts(bucket_bytes):
    program = layoutlang.loads(BIG)
    plan = compile_plan(program, bucket_bytes=bucket_bytes, policy="broadcast")
    peak = _check_within_budget(plan, bucket_bytes)
    assert max(peak.values()) > bucket_bytes // 4  # the buckets are used, not left nearly empty
    a = plan.arrays
    embed = program.layout("train").resolved.names.index("embed")
    # the 8 MiB embedding is cut into parts of at most half a bucket, gathered on several roots
    parts = a.move_dst_space == SCRATCH
    parts &= a.region_tensor[a.move_region] == embed
    parts &= a.move_stage == 1
    assert int(a.region_bytes[a.move_region[parts]].max()) <= bucket_bytes // 2
    roots = set(a.move_src[parts].tolist())
    assert len(roots) == 3  # every training rank roots some of its parts
    # every part reaches every inference rank: one landing per domain, relayed to the 3 others
    relays = (a.move_stage == 2) & (a.region_tensor[a.move_region] == embed)
    assert set(a.move_dst[relays].tolist()) | set(a.move_dst[parts].tolist()) == set(range(4, 12))
    # the parts move what the whole tensors did: each byte gathered once and broadcast once
    assert plan.stats.broadcast_payload == 2 * (2048 * 1024 * 4 + 1001 * 384 * 4 + 512 * 300 * 2 + 300 * 4)


def test_small_tensors_keep_one_gather_on_one_root():
    # below half a bucket a tensor is one part: gathered whole on one root, as before
    program = layoutlang.loads(BIG)
    plan = compile_plan(program, bucket_bytes=64 * MiB, policy="broadcast")
    _check_within_budget(plan, 64 * MiB)
    a = plan.arrays
    gather = (a.move_stage == 0) & (a.move_dst_space == SCRATCH)
    for tensor in np.unique(a.region_tensor):
        dst = set(a.move_dst[gather & (a.region_tensor[a.move_region] == tensor)].tolist())
        assert len(dst) == 1, (tensor, dst)


def test_the_refit_benchmark_plan_keeps_within_its_buckets():
    # bench_refit's plan: a 500 MiB embedding in buckets of 128 MiB (memory_budget 256 MiB)
    program = layoutlang.load(ROOT / "benchmarks" / "refit_1g.layout")
    plan = compile_plan(program, bucket_bytes=128 * MiB, policy="broadcast")
    _check_within_budget(plan, 128 * MiB)
    assert _largest_scratch_write(plan) <= 64 * MiB


@pytest.mark.workers(4)
@pytest.mark.parametrize("memory_budget", [1 * MiB, 3 * MiB])
def test_executed_broadcast_is_exact_and_peak_staging_within_the_memory_budget(pool, tmp_path, memory_budget):
    path = tmp_path / "small.layout"
    path.write_text(SMALL)
    plan = compile_plan(layoutlang.loads(SMALL), bucket_bytes=memory_budget // 2, policy="broadcast")
    _check_within_budget(plan, memory_budget // 2)
    results = [r for r in pool.run(workers.refit, str(path), [0, 1, 2, 3], "broadcast", 2, None, memory_budget) if r]
    assert len(results) == 4
    for per_step in results:
        for step in per_step:
            assert step["verified"] in (True, None), step["mismatches"]
            assert step["peak_staging"] <= memory_budget, (step["rank"], step["peak_staging"])
    verified = [step for per_step in results for step in per_step if step["verified"]]
    assert {step["rank"] for step in verified} == {2, 3}
