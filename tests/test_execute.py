"""The executor on real processes: gloo over loopback, one worker per program rank.

Every example layout pair is resharded and every destination byte is compared with the
synthetic source of truth, for the reshard and the gather-and-broadcast policy. Failures:
bad storages, a rank in no mesh, different programs on different ranks, a peer dying in
the middle of a transfer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import workers

import layoutlang
from layoutlang.cli.launch import WorkerError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PAIRS = ["tp_to_dp", "refit", "moe_ep", "colocated", "uneven"]


def participants_of(path: Path) -> list[int]:
    program = layoutlang.load(path)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


# The `pool` of every test: workers started once (tests/conftest.py), as many as the largest
# example has ranks; in each test, worker i plays program rank participants[i].
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.workers(max(len(participants_of(EXAMPLES / f"{name}.layout")) for name in PAIRS)),
]


@pytest.mark.parametrize("policy", ["reshard", "broadcast"])
@pytest.mark.parametrize("name", PAIRS)
def test_every_example_pair_moves_bit_exact_data(pool, name, policy):
    path = EXAMPLES / f"{name}.layout"
    participants = participants_of(path)
    results = [r for r in pool.run(workers.refit, str(path), participants, policy) if r]
    assert len(results) == len(participants)
    destination_ranks = set(layoutlang.load(path).layout(layoutlang.load(path).reshard().destination).mesh.ranks)
    for (step,) in results:
        if step["rank"] in destination_ranks:
            assert step["verified"], step["mismatches"]
            assert step["verified_bytes"] > 0
        # each destination storage reported complete exactly once
        assert step["completed"] == step["destinations"]
    assert len({step["fingerprint"] for (step,) in results}) == 1


def test_bytes_by_kind_match_the_plan(pool):
    path = EXAMPLES / "tp_to_dp.layout"
    participants = participants_of(path)
    results = [r[0] for r in pool.run(workers.refit, str(path), participants) if r]
    plan = layoutlang.compile_plan(layoutlang.load(path))
    sent = {k: sum(r["sent"][k] for r in results) for k in ("domain", "network")}
    assert sent == {"domain": plan.stats.bytes["domain"], "network": plan.stats.bytes["network"]}


def test_a_resharder_is_reused_across_steps_and_small_buckets(pool):
    path = EXAMPLES / "refit.layout"
    participants = participants_of(path)
    budget = 64 * 1024
    results = [r for r in pool.run(workers.refit, str(path), participants, None, 3, None, budget) if r]
    for steps in results:
        assert len(steps) == 3
        for step in steps:
            assert step["verified"] in (True, None), step["mismatches"]
            # at most two buckets of messages in flight: within the memory budget
            assert step["peak_staging"] <= budget


def test_cast_on_arrival(pool, tmp_path):
    program = tmp_path / "cast.layout"
    program.write_text(
        'mesh train [tp = 2] on ranks 0..1\nmesh infer [tp = 2] on ranks 2..3\n'
        'tensor "w" [6, 4] fp32\n'
        'layout a on train { "w": tp = shard(0) }\nlayout b on infer { "w": tp = shard(1) }\nreshard a -> b\n'
    )
    results = [r for r in pool.run(workers.refit, str(program), [0, 1, 2, 3], None, 1, "bfloat16") if r]
    for (step,) in results:
        assert step["verified"] in (True, None), step["mismatches"]


TINY = """
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "w" [4, 4] fp32
layout a on train { "w": tp = shard(0) }
layout b on infer { "w": tp = shard(1) }
reshard a -> b
"""


@pytest.mark.parametrize(
    "mutation, message",
    [
        ("source missing", "the source storage 'w' (layout 'a', shape [2, 4]) is missing"),
        ("source shape", "the source storage 'w' has shape [3, 5], layout 'a' needs [2, 4]"),
        ("source dtype", "the source storage 'w' is torch.float64, layout 'a' holds torch.float32"),
        ("destination shape", "the destination storage 'w' has shape [5, 3], layout 'b' needs [4, 2]"),
        ("destination missing", "the destination storage 'w' (layout 'b', shape [4, 2]) is missing"),
        ("source misspelled", ("the source storage 'w' (layout 'a', shape [2, 4]) is missing; the source "
                               "storages given hold 'w_', which the plan does not know")),
    ],
)
def test_bad_storages_are_named(pool, mutation, message):
    results = pool.run(workers.run_with_storages, TINY, [0, 1, 2, 3], mutation, 5.0)
    errors = results[:4]
    # every rank learns which rank is not ready, and nothing moved
    assert all(e and e.startswith("AgreementError") and message in e for e in errors), errors


def test_different_programs_on_different_ranks_are_refused(pool):
    other = TINY.replace('"w": tp = shard(1)', '"w": tp = shard(0)')
    results = pool.run(workers.build_resharder_error, {"default": TINY, 3: other}, [0, 1, 2, 3])
    errors = list(results[:4])
    assert all(e and e.startswith("AgreementError") for e in errors), errors
    expected = "rank 3 compiled a different plan from the others (ranks 0..2 compiled plan"
    assert all(expected in e for e in errors), errors


def test_a_rank_that_cannot_compile_stops_everyone(pool):
    broken = TINY.replace("layout b on infer", "layout b on infre")
    results = pool.run(workers.build_resharder_error, {"default": TINY, 2: broken}, [0, 1, 2, 3])
    errors = results[:4]
    assert all(e and "rank 2 could not compile the plan" in e for e in errors), errors
    assert all("unknown mesh 'infre'" in e for e in errors), errors


def test_a_rank_in_no_mesh_is_refused(pool):
    results = pool.run(workers.build_resharder_error, {"default": TINY}, [0, 1, 2, 7])
    assert results[3] == "ExecutionError: rank 7 belongs to no mesh of the reshard (its ranks: 0..3)"
    # the others learn at once that rank 3 has no process, instead of waiting for it
    assert results[:3] == ["ExecutionError: rank 3 of the reshard has no process in this job (rank_map)"] * 3


# its worker 0 dies: a pool of its own, one worker per rank of the example
@pytest.mark.workers(len(participants_of(EXAMPLES / "tp_to_dp.layout")), scope="function", timeout=30)
def test_a_peer_dying_mid_transfer_is_an_error_within_the_timeout(pool):
    path = EXAMPLES / "tp_to_dp.layout"
    participants = participants_of(path)
    timeout = 5.0
    pool.submit(workers.refit_with_a_dying_peer, str(path), participants, 0, timeout)
    results = pool.results_by_rank(timeout=60)
    survivors = {r: v for r, v in results.items() if r != 0}
    assert survivors, "no survivor reported"
    for ok, value in survivors.values():
        assert ok, value
    waiting = [v for _, v in survivors.values() if v["error"]]
    # every rank that expected data from the dead rank 0 fails, naming a peer, in time
    assert waiting, survivors
    for v in waiting:
        assert "rank" in v["error"]
        assert v["seconds"] < timeout + 10


# a pool of its own: the test aborts a process group and builds new ones
@pytest.mark.workers(2, scope="function", timeout=30)
def test_the_torch_transport_follows_the_transport_lifecycle(pool):
    zero, one = pool.run(workers.transport_lifecycle)
    assert zero["errored_at_start"] is None and one["errored_at_start"] is None
    # a wait that fails raises an ExecutionError naming this rank and its peer, and the
    # transport remembers it
    assert zero["failure"] == {"rank": 0, "peers": [1], "remembered": True}
    for result in (zero, one):
        assert result["after_abort"] == (
            f"rank {result['rank']}: the transport was aborted; configure it with a new group first"
        )
        assert result["errored_after_abort"]
        # configured with a new group, the transport is healthy and moves bytes again
        assert result["errored_after_configure"] is None
    assert zero["received"] == [1] * 4 and one["received"] == [0] * 4


def test_worker_errors_name_the_rank(pool):
    with pytest.raises(WorkerError, match="rank 0"):
        pool.run(workers.refit, "/nonexistent.layout", [0, 1])
