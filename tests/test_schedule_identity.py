"""The bucket schedule of whole-fleet plans, pinned move for move.

The port-balanced schedule (``assign_buckets`` in ``csrc/planner.cpp``) was reworked to hold
less memory (issue 27: the moves grouped by pair of ranks a batch of sending ranks at a
time, each move's chunk kept in its bucket column until the chunks are placed). Such work
must not change a plan: the digests below are those of the plans the schedule made before
it (main at 094bf88: every column of the moves, and the regions' bytes), on programs of a
few dozen moves to 4.7 million (several batches of sending ranks), under both policies,
with domains of 4 ranks (every network move relayed: the relays wait for its bucket) and
of 72 (landings in scratch), and buckets down to 64 KiB (thousands of them). A change of
the schedule on purpose changes them: recompute them with ``digest`` and say why in the
commit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.plan import plan_layouts

ROOT = Path(__file__).resolve().parent.parent

COLUMNS = (
    "move_region",
    "move_src",
    "move_dst",
    "move_bucket",
    "move_kind",
    "move_stage",
    "move_src_space",
    "move_dst_space",
    "region_bytes",
)

#: name: (domain size, or None for the program's; policies, or None for the statement's; bucket bytes)
CONFIGS = {
    "default": (None, None, None),
    "broadcast": (None, "broadcast", None),
    "dom72": (72, None, None),
    "dom4-b4M": (4, None, 4 << 20),
    "b64K": (None, None, 64 << 10),
    "dom4-b64K": (4, None, 64 << 10),
}


def digest(plan) -> str:
    h = hashlib.sha256()
    for name in COLUMNS:
        h.update(np.ascontiguousarray(getattr(plan.arrays, name)).tobytes())
    return f"{plan.num_moves} {plan.num_buckets} {h.hexdigest()[:16]}"


def compile_config(path: str, config: str):
    program = layoutlang.load(ROOT / path)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    domain, policies, bucket = CONFIGS[config]
    options = {} if bucket is None else {"bucket_bytes": bucket}
    return plan_layouts(
        source,
        destination,
        domain_size=program.topology.domain_size if domain is None else domain,
        policies=[statement.policy_for(n) for n in source.resolved.names] if policies is None else policies,
        **options,
    )


#: (program, configuration): the digest of the plan the schedule made before issue 27's rework
EXPECTED = {
    ("examples/refit.layout", "default"): "312 1 702c84339856b7df",
    ("examples/refit.layout", "broadcast"): "693 1 584e93bafbe34b96",
    ("examples/refit.layout", "dom72"): "312 1 a968ea7f262fdff5",
    ("examples/refit.layout", "dom4-b4M"): "312 1 19c046f255db1157",
    ("examples/refit.layout", "b64K"): "328 46 7750721e2e56a730",
    ("examples/refit.layout", "dom4-b64K"): "328 46 7363d222f67059f6",
    ("examples/colocated.layout", "default"): "276 1 59a91f5cca6f2421",
    ("examples/colocated.layout", "broadcast"): "402 1 e1664d915008df48",
    ("examples/colocated.layout", "dom72"): "276 1 59a91f5cca6f2421",
    ("examples/colocated.layout", "dom4-b4M"): "276 2 9f1bf262a1199425",
    ("examples/colocated.layout", "b64K"): "292 90 ee9a549d67b755ab",
    ("examples/colocated.layout", "dom4-b64K"): "292 90 ee9a549d67b755ab",
    ("examples/moe_ep.layout", "default"): "440 1 83a71f46c195c7df",
    ("examples/moe_ep.layout", "broadcast"): "929 1 64246f230d07081c",
    ("examples/moe_ep.layout", "dom72"): "440 1 64008c080a49bcd5",
    ("examples/moe_ep.layout", "dom4-b4M"): "440 1 83a71f46c195c7df",
    ("examples/moe_ep.layout", "b64K"): "440 8 9a94531c079f256a",
    ("examples/moe_ep.layout", "dom4-b64K"): "440 8 9a94531c079f256a",
    ("examples/tp_to_dp.layout", "default"): "8 1 5b668a7dcace0e59",
    ("examples/tp_to_dp.layout", "broadcast"): "10 1 1deee53b418a3e39",
    ("examples/tp_to_dp.layout", "dom72"): "8 1 55e06a2df6d13e82",
    ("examples/tp_to_dp.layout", "dom4-b4M"): "8 2 d5f64540f2360fba",
    ("examples/tp_to_dp.layout", "b64K"): "128 64 383914ef68d4d1cf",
    ("examples/tp_to_dp.layout", "dom4-b64K"): "128 64 7126efeb1d17670d",
    ("examples/uneven.layout", "default"): "48 1 316c70d630d951c7",
    ("examples/uneven.layout", "broadcast"): "43 1 ccd6a7eb90c15e46",
    ("examples/uneven.layout", "dom72"): "48 1 a68b702485cf29e7",
    ("examples/uneven.layout", "dom4-b4M"): "48 1 316c70d630d951c7",
    ("examples/uneven.layout", "b64K"): "48 1 316c70d630d951c7",
    ("examples/uneven.layout", "dom4-b64K"): "48 1 316c70d630d951c7",
    ("benchmarks/refit_1g.layout", "default"): "44 2 a0b3dcb9f9eabf83",
    ("benchmarks/refit_1g.layout", "broadcast"): "147 9 a083383252683119",
    ("benchmarks/refit_1g.layout", "dom72"): "44 2 444558b72a0fd622",
    ("benchmarks/refit_1g.layout", "dom4-b4M"): "312 78 505ecea33bd71394",
    ("benchmarks/refit_1g.layout", "b64K"): "19359 4839 0a4dda7b79d235aa",
    ("benchmarks/refit_1g.layout", "dom4-b64K"): "19359 4838 c255b8b366fed02c",
    ("benchmarks/qwen3_235b_refit.layout", "default"): "4729056 236 1bbf5bdff09c7344",
    ("benchmarks/qwen3_235b_refit.layout", "dom72"): "4745337 449 a6b85a023b7512ff",
}


@pytest.mark.parametrize(("path", "config"), sorted(EXPECTED))
def test_schedule_is_unchanged(path, config):
    assert digest(compile_config(path, config)) == EXPECTED[path, config]
