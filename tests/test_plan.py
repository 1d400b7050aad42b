"""Plans compiled by the C++ planner, checked against values worked out by hand.

Covered here (the generated programs of tests/test_plan_properties.py cover the rest):

- the design's TP->DP example: 4 network moves plus 4 relays instead of 8 network
  transfers, moved bytes at the lower bound, and the gather-and-broadcast plan beside it;
- the logical payload of gather plus broadcast (4 bytes per BF16 parameter), up to the
  design's 2.8T-parameter model (11.2 TB);
- routing: local copies first, a source in the destination's domain before the network,
  network sends spread over source replicas and landings spread over receivers, and one
  network crossing per destination domain (never more than plain point-to-point);
- buckets: tensors larger than the bucket are cut into slabs; no rank stages more than the
  bucket in one bucket;
- per-tensor policies of a reshard statement; ties between them;
- the binary and JSON forms, the fingerprint, and ``Move``'s one-line form;
- ``Plan.validate()`` against corrupted plans built with ``layoutlang.core._core.PlanArrays``;
- bad input: layouts of different tensors, conflicting storages on a shared rank,
  unknown reshards;
- determinism, also across processes.

Tests that crash or hang the interpreter on a bug (a segfault in C++, an endless loop with
the GIL released) run their code in a child process.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.core import _core
from layoutlang.plan import Plan, compile_plan, load_plan, plan_layouts
from layoutlang.plan.data import _COLUMNS

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MiB = 2**20


@pytest.fixture(scope="module")
def tp_to_dp() -> layoutlang.Program:
    return layoutlang.load(EXAMPLES / "tp_to_dp.layout")


@pytest.fixture(scope="module")
def refit() -> layoutlang.Program:
    return layoutlang.load(EXAMPLES / "refit.layout")


# ----------------------------------------------------------------------------- helpers


def columns(plan: Plan) -> dict[str, np.ndarray]:
    """Writable copies of every column of a plan."""
    return {name: np.array(getattr(plan.arrays, name), dtype=dtype) for name, dtype in _COLUMNS}


def rebuilt(plan: Plan, *, moves=None, bucket_bytes=None, num_buckets=None, **changes) -> Plan:
    """The plan with some columns replaced and/or only the move rows ``moves`` (in that order,
    repeats allowed), built through ``layoutlang.core._core.PlanArrays``."""
    cols = columns(plan)
    if moves is not None:
        for name, _ in _COLUMNS:
            if name.startswith("move_"):
                cols[name] = cols[name][list(moves)]
    for name, value in changes.items():
        cols[name] = np.asarray(value)
    arrays = _core.PlanArrays(
        **{name: np.ascontiguousarray(cols[name], dtype=dtype) for name, dtype in _COLUMNS},
        num_buckets=plan.num_buckets if num_buckets is None else num_buckets,
        lower_bound_bytes=int(plan.arrays.lower_bound_bytes),
        broadcast_payload_bytes=int(plan.arrays.broadcast_payload_bytes),
    )
    return Plan(
        plan.source,
        plan.destination,
        plan.name,
        plan.policies,
        plan.domain_size,
        plan.bucket_bytes if bucket_bytes is None else bucket_bytes,
        arrays,
    )


def staging(plan: Plan) -> dict[tuple[int, int], int]:
    """Bytes each rank stages per bucket: every non-local move counts on its sender and on
    its receiver."""
    staged: dict[tuple[int, int], int] = defaultdict(int)
    for move in plan.moves():
        if move.kind != "local":
            staged[move.bucket, move.src] += move.nbytes
            staged[move.bucket, move.dst] += move.nbytes
    return staged


def point_to_point_transfers(plan: Plan) -> int:
    """What plain point-to-point would send: one transfer per region a destination rank
    receives from another rank (every non-local write into a destination storage)."""
    return sum(1 for m in plan.moves() if m.kind != "local" and m.dst_space == "destination")


def column_at(data: bytes, column: str) -> int:
    """Where the values of ``column`` start in a plan's binary form (magic, header length,
    header, then per column a 64-bit count and the values)."""
    pos = len(layoutlang.plan.data._MAGIC)
    pos += 8 + int.from_bytes(data[pos : pos + 8], "little")
    for name, dtype in _COLUMNS:
        count = int.from_bytes(data[pos : pos + 8], "little")
        if name == column:
            return pos + 8
        pos += 8 + count * np.dtype(dtype).itemsize
    raise KeyError(column)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (cwd: the repository); a hang fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child process did not finish within {timeout} s (endless loop?)")


def domain(rank: int, plan: Plan) -> int:
    return rank // plan.domain_size


# ------------------------------------------------------------------- the TP->DP example


def test_tp_to_dp_sends_each_shard_once_per_domain_and_relays_it_to_the_peer(tp_to_dp):
    """DESIGN.md's TP->DP example: 2 shards x 2 destination domains = 4 network moves, then
    4 relays (domain moves reading the destination space, stage 1) to the domain peers."""
    plan = compile_plan(tp_to_dp)
    plan.validate()
    moves = list(plan.moves())
    network = [m for m in moves if m.kind == "network"]
    relays = [m for m in moves if m.kind == "domain"]
    assert len(moves) == 8
    assert len(network) == 4 and len(relays) == 4
    assert all(
        m.stage == 0 and m.src_space == "source" and m.dst_space == "destination" for m in network
    )
    assert all(m.is_relay and m.stage == 1 and m.src_space == "destination" for m in relays)
    # every shard crosses into each domain {8, 9} and {10, 11} exactly once
    shards = {((0, 0), (512, 1024)): 0, ((512, 0), (512, 1024)): 1}
    crossings = Counter((shards[m.offsets, m.sizes], m.src, domain(m.dst, plan)) for m in network)
    assert crossings == {(0, 0, 4): 1, (0, 0, 5): 1, (1, 1, 4): 1, (1, 1, 5): 1}
    # each relay forwards what its rank received over the network, to the peer in its domain
    landed = {(m.dst, m.offsets) for m in network}
    for relay in relays:
        assert (relay.src, relay.offsets) in landed
        assert domain(relay.src, plan) == domain(relay.dst, plan) and relay.src != relay.dst
    assert {(m.dst, m.offsets) for m in moves} == {
        (r, o) for r in (8, 9, 10, 11) for o in ((0, 0), (512, 0))
    }


def test_tp_to_dp_halves_network_transfers_and_moves_exactly_the_lower_bound(tp_to_dp):
    """Plain point-to-point needs 4 ranks x 2 shards = 8 network transfers; the plan sends 4.
    Every destination rank needs the whole 2 MiB tensor and holds nothing: lower bound
    4 x 2 MiB, which is exactly what the plan moves (4 MiB network + 4 MiB domain)."""
    plan = compile_plan(tp_to_dp)
    stats = plan.stats
    assert point_to_point_transfers(plan) == 8
    assert stats.moves == {"local": 0, "domain": 4, "network": 4}
    assert stats.bytes == {"local": 0, "domain": 4 * MiB, "network": 4 * MiB}
    assert stats.lower_bound == 8 * MiB == stats.moved
    assert stats.ratio_to_lower_bound == 1.0
    assert stats.broadcast_payload == 0
    assert stats.buckets == 1
    # one message per (pair of ranks, bucket, stage): 4 network and 4 relay pairs
    assert stats.messages == 8
    assert stats.per_rank[0]["sent"] == {"local": 0, "domain": 0, "network": 2 * MiB}
    assert stats.per_rank[8]["received"] == {"local": 0, "domain": MiB, "network": MiB}


def test_tp_to_dp_gather_and_broadcast_plan_for_comparison(tp_to_dp):
    """policy='broadcast': rank 0 gathers the tensor (its own half locally, rank 1's half
    over NVLink) into scratch at stage 0; the whole tensor crosses the network once per
    domain at stage 1 and is relayed at stage 2; each rank keeps its box at stage 3. It moves
    more than the reshard (9 MiB vs 8 MiB), one root sends all 4 MiB of network traffic
    (the reshard spreads it 2 MiB per source), and its payload is 2 x 2 MiB."""
    reshard = compile_plan(tp_to_dp)
    plan = compile_plan(tp_to_dp, policy="broadcast")
    plan.validate()
    assert plan.policies == ("broadcast",)
    by_stage = defaultdict(list)
    for m in plan.moves():
        by_stage[m.stage].append(m)
    assert sorted((m.kind, m.src, m.dst, m.src_space, m.dst_space) for m in by_stage[0]) == [
        ("domain", 1, 0, "source", "scratch"),
        ("local", 0, 0, "source", "scratch"),
    ]
    assert sorted((m.kind, m.src, m.dst) for m in by_stage[1]) == [
        ("network", 0, 8),
        ("network", 0, 10),
    ]
    assert sorted((m.kind, m.src, m.dst) for m in by_stage[2]) == [
        ("domain", 8, 9),
        ("domain", 10, 11),
    ]
    assert sorted((m.kind, m.src, m.dst, m.src_space, m.dst_space) for m in by_stage[3]) == [
        ("local", r, r, "scratch", "destination") for r in (8, 9, 10, 11)
    ]
    assert all(m.sizes == (1024, 1024) for s in (1, 2, 3) for m in by_stage[s])
    stats = plan.stats
    assert stats.broadcast_payload == 4 * MiB
    assert stats.bytes["network"] == 4 * MiB == reshard.stats.bytes["network"]
    assert stats.moved == 9 * MiB > reshard.stats.moved == stats.lower_bound
    assert stats.largest_network_send == (4 * MiB, 0)
    assert reshard.stats.largest_network_send[0] == 2 * MiB


# ------------------------------------------------------------------------ the payload


def test_broadcast_payload_is_four_bytes_per_bf16_parameter_on_small_programs(tp_to_dp, refit):
    """Gather plus broadcast carries every BF16 parameter twice: 4 bytes per parameter."""
    for program in (tp_to_dp, refit):
        params = sum(t.numel for t in program.tensors.values())
        assert all(t.dtype == "bf16" for t in program.tensors.values())
        plan = compile_plan(program, policy="broadcast")
        assert plan.stats.broadcast_payload == 4 * params
        assert compile_plan(program).stats.broadcast_payload == 0


def test_broadcast_payload_of_a_2_8t_parameter_model_is_11_2_terabytes():
    """The design's number: 2.8T BF16 parameters carry 11.2 TB through gather (5.6 TB) plus
    broadcast (5.6 TB). Four 700G-parameter tensors on one-rank meshes, in a bucket that
    holds a whole tensor twice (its scratch and its send: a tensor above half a bucket is
    broadcast in parts), keep the plan to a dozen moves."""
    program = layoutlang.loads(
        """
        mesh train [tp = 1] on ranks 0..0
        mesh infer [tp = 1] on ranks 8..8
        tensor "block.{i}.weight" [700_000, 1_000_000] bf16 for i in 0..3
        layout t on train { default: replicate }
        layout v on infer { default: replicate }
        reshard t -> v
        """
    )
    params = sum(t.numel for t in program.tensors.values())
    assert params == 2_800_000_000_000
    plan = compile_plan(program, policy="broadcast", bucket_bytes=2**42)
    plan.validate()
    assert plan.stats.broadcast_payload == 11_200_000_000_000 == 4 * params
    assert plan.num_moves == 12  # per tensor: local gather, one network send, extraction
    assert plan.stats.bytes["network"] == 5_600_000_000_000
    reshard = compile_plan(program, bucket_bytes=2**41)
    assert reshard.stats.moved == reshard.stats.lower_bound == 5_600_000_000_000
    assert reshard.stats.broadcast_payload == 0


def test_hybrid_plan_counts_only_broadcast_tensors_in_the_payload():
    """A reshard statement's rules give a broadcast policy to 'embed*' only: its moves use
    scratch, the other tensor is resharded exactly, and the payload is 2 x embed's bytes."""
    program = layoutlang.loads(
        """
        topology { domain_size = 2 }
        mesh train [tp = 2] on ranks 0..1
        mesh infer [dp = 2, tp = 2] on ranks 2..5
        tensor "embed.weight" [16, 4] bf16
        tensor "layer.weight" [8, 4] bf16
        layout a on train { default: tp = shard(0) }
        layout b on infer { default: tp = shard(1) }
        reshard hybrid: a -> b { "embed*": broadcast }
        """
    )
    plan = compile_plan(program)
    plan.validate()
    assert plan.policies == ("broadcast", "reshard")
    scratch = {m.tensor for m in plan.moves() if "scratch" in (m.src_space, m.dst_space)}
    assert scratch == {"embed.weight"}
    assert plan.stats.broadcast_payload == 2 * 16 * 4 * 2
    layer = [m for m in plan.moves("layer.weight") if m.kind != "local"]
    # layer.weight: each of the 4 destination ranks needs 8 x 2 elements = 32 bytes
    assert sum(m.nbytes for m in layer) == 4 * 32
    assert all(m.stage <= 1 and m.src_space != "scratch" for m in layer)
    # policy= overrides the statement's rules
    assert compile_plan(program, policy="reshard").policies == ("reshard", "reshard")


def test_reshard_policies_of_equal_specificity_are_an_error():
    """'embed*' and '*eight' both have 5 literal characters and both match 'embed.weight'."""
    program = layoutlang.loads(
        """
        mesh train [tp = 2] on ranks 0..1
        mesh infer [dp = 2] on ranks 2..3
        tensor "embed.weight" [16, 4] bf16
        layout a on train { default: tp = shard(0) }
        layout b on infer { default: replicate }
        reshard tie: a -> b { "embed*": broadcast  "*eight": reshard }
        """
    )
    with pytest.raises(
        layoutlang.LayoutValueError, match=r"embed\.weight.*equal specificity"
    ) as err:
        compile_plan(program)
    assert "embed*" in str(err.value) and "*eight" in str(err.value)


# --------------------------------------------------------------------------- routing


def test_colocated_example_copies_locally_what_a_rank_already_holds():
    """examples/colocated.layout: both meshes on ranks 0..3 in one domain. Every byte a rank
    holds in both layouts is a local copy; the rest are domain moves; nothing crosses the
    network, and moved bytes are exactly the lower bound."""
    program = layoutlang.load(EXAMPLES / "colocated.layout")
    plan = compile_plan(program)
    plan.validate()
    source, destination = plan.source, plan.destination
    kept = 0
    for name, tensor in program.tensors.items():
        for rank in destination.mesh.ranks:
            need = np.zeros(tensor.shape, bool)
            for box in destination.boxes(name, rank):
                need[box.slices()] = True
            have = np.zeros(tensor.shape, bool)
            for box in source.boxes(name, rank):
                have[box.slices()] = True
            kept += int((need & have).sum()) * 2
    stats = plan.stats
    assert kept > 0
    assert stats.bytes["local"] == kept
    assert stats.bytes["network"] == 0
    assert stats.moved == stats.lower_bound
    for move in plan.moves():
        if move.kind == "local":
            assert (
                move.src == move.dst
                and move.src_space == "source"
                and move.dst_space == "destination"
            )


def test_destination_that_already_holds_everything_gets_only_local_copies():
    """Replicated on ranks 0-1 before, sharded on the same ranks after: each rank copies its
    half from its own source storage; nothing moves between ranks."""
    program = layoutlang.loads(
        """
        mesh before [dp = 2] on ranks 0..1
        mesh after [tp = 2] on ranks 0..1
        tensor "w" [6, 4] fp32
        layout full on before { default: replicate }
        layout half on after { "w": tp = shard(0) }
        reshard full -> half
        """
    )
    plan = compile_plan(program)
    plan.validate()
    moves = [(m.src, m.dst, m.kind, m.offsets, m.sizes) for m in plan.moves()]
    assert sorted(moves) == [(0, 0, "local", (0, 0), (3, 4)), (1, 1, "local", (3, 0), (3, 4))]
    assert plan.stats.moved == 0 == plan.stats.lower_bound
    assert plan.stats.ratio_to_lower_bound == 1.0
    assert plan.stats.bytes["local"] == 6 * 4 * 4


def test_source_in_the_destination_domain_is_preferred_over_the_network():
    """Replicas on rank 0 (domain 0) and rank 4 (domain 1); destination ranks 1 and 5 each
    take their half from the replica in their own domain: two domain moves, no network."""
    program = layoutlang.loads(
        """
        topology { domain_size = 4 }
        mesh train [dp = 2] on ranks [0, 4]
        mesh infer [tp = 2] on ranks [1, 5]
        tensor "w" [8, 4] fp32
        layout full on train { default: replicate }
        layout half on infer { "w": tp = shard(0) }
        reshard full -> half
        """
    )
    plan = compile_plan(program)
    plan.validate()
    moves = sorted((m.src, m.dst, m.kind, m.offsets) for m in plan.moves())
    assert moves == [(0, 1, "domain", (0, 0)), (4, 5, "domain", (4, 0))]
    assert plan.stats.bytes["network"] == 0


def test_network_sends_are_spread_over_source_replicas_and_landings_over_receivers(tp_to_dp):
    """Two replicas (ranks 0, 1) of a 128-byte tensor, four destination ranks in two domains
    each needing a different 32-byte quarter: each replica sends two quarters (64 bytes, the
    smallest possible maximum). In the TP->DP example, each of the 4 destination ranks
    receives exactly one of the 4 network moves."""
    program = layoutlang.loads(
        """
        topology { domain_size = 2 }
        mesh train [dp = 2] on ranks 0..1
        mesh infer [tp = 4] on ranks 2..5
        tensor "w" [8, 4] fp32
        layout full on train { default: replicate }
        layout quarter on infer { "w": tp = shard(0) }
        reshard full -> quarter
        """
    )
    plan = compile_plan(program)
    plan.validate()
    stats = plan.stats
    assert stats.bytes["network"] == 128
    assert stats.largest_network_send[0] == 64
    assert {r: stats.per_rank[r]["sent"]["network"] for r in (0, 1)} == {0: 64, 1: 64}
    assert all(stats.per_rank[r]["received"]["network"] == 32 for r in range(2, 6))

    example = compile_plan(tp_to_dp)
    receivers = Counter(m.dst for m in example.moves() if m.kind == "network")
    assert receivers == {8: 1, 9: 1, 10: 1, 11: 1}
    assert example.stats.largest_network_receive[0] == MiB


def test_each_region_crosses_once_per_destination_domain_lacking_it(refit):
    """examples/refit.layout (training on ranks 0-3 = domains 0, 1; inference on 4-11 =
    domains 2-5, no source among them): every region crosses the network once into each
    destination domain that receives it, and never more often than plain point-to-point
    would send it."""
    plan = compile_plan(refit)
    plan.validate()
    crossings = Counter((m.tensor, m.offsets, m.sizes) for m in plan.moves() if m.kind == "network")
    receivers = defaultdict(set)  # region -> destination domains it is written into
    for m in plan.moves():
        if m.dst_space == "destination" and m.kind != "local":
            receivers[m.tensor, m.offsets, m.sizes].add(domain(m.dst, plan))
    assert crossings and set(crossings) == set(receivers)
    for region, count in crossings.items():
        assert count == len(receivers[region]), region
    assert sum(crossings.values()) < point_to_point_transfers(plan)
    p2p_per_region = Counter(
        (m.tensor, m.offsets, m.sizes)
        for m in plan.moves()
        if m.dst_space == "destination" and m.kind != "local"
    )
    assert all(crossings[r] <= p2p_per_region[r] for r in crossings)
    assert plan.stats.moved == plan.stats.lower_bound


# --------------------------------------------------------------------------- buckets


def test_tensor_larger_than_the_bucket_is_cut_into_slabs_across_buckets():
    """64 x 64 fp32 (16 KiB) with a 1000-byte bucket: rows of 256 bytes, 3 per slab (768
    bytes), so 22 slabs; two slabs never fit one bucket of one rank, so 22 buckets."""
    program = layoutlang.loads(
        """
        mesh a [x = 1] on ranks 0..0
        mesh b [x = 1] on ranks 1..1
        tensor "w" [64, 64] fp32
        layout s on a { default: replicate }
        layout d on b { default: replicate }
        reshard s -> d
        """
    )
    plan = compile_plan(program, bucket_bytes=1000)
    plan.validate()
    moves = list(plan.moves())
    assert len(moves) == 22
    assert [m.offsets for m in moves] == [(3 * i, 0) for i in range(22)]
    assert [m.sizes[0] for m in moves] == [3] * 21 + [1]
    assert all(m.nbytes <= 1000 for m in moves)
    assert sorted(m.bucket for m in moves) == list(range(22)) and plan.num_buckets == 22
    assert plan.stats.moved == 64 * 64 * 4


@pytest.mark.parametrize("bucket", [4096, 100_000, 600_000])
def test_no_rank_stages_more_than_the_bucket_in_one_bucket(tp_to_dp, refit, bucket):
    """Summing non-local move bytes per (bucket, rank) on the sending and the receiving side
    never exceeds the budget, for reshard and broadcast plans; relays never run in an
    earlier bucket than the network move that feeds them."""
    for program in (tp_to_dp, refit):
        for policy in ("reshard", "broadcast"):
            plan = compile_plan(program, bucket_bytes=bucket, policy=policy)
            plan.validate()
            staged = staging(plan)
            assert max(staged.values()) <= bucket
            assert plan.num_buckets > 1
            assert all(m.nbytes <= bucket for m in plan.moves())
            fed = {}
            for m in plan.moves():
                if m.kind == "network":
                    fed[m.tensor, m.offsets, m.dst] = m.bucket
            for m in plan.moves():
                if m.is_relay:
                    assert m.bucket >= fed[m.tensor, m.offsets, m.src]


def test_bucket_smaller_than_one_element_terminates():
    """A bucket smaller than one element (bucket_bytes=2, fp32) is planned or refused with
    LayoutValueError, never an endless first-fit search in assign_buckets (which once spun
    forever with the GIL released: hence the child process)."""
    code = """
import layoutlang
from layoutlang.plan import compile_plan
program = layoutlang.loads('''
mesh a [x = 1] on ranks 0..0
mesh b [x = 1] on ranks 1..1
tensor "w" [4] fp32
layout s on a { default: replicate }
layout d on b { default: replicate }
reshard s -> d
''')
try:
    compile_plan(program, bucket_bytes=2).validate()
    print("planned")
except layoutlang.LayoutValueError as err:
    print("refused:", err)
"""
    result = run_python(code, timeout=10)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("planned", "refused"))


# ---------------------------------------------------------------------- serialization


def test_fingerprint_is_the_sha256_of_the_binary_form_without_making_it(refit):
    """The fingerprint digests the binary form piece by piece (a whole fleet's plan is
    gigabytes): the same hex digest as hashlib over to_bytes(), asked before or after it, for
    a fleet plan and its gather-and-broadcast baseline."""
    for policy in (None, "broadcast"):
        fresh = compile_plan(refit, bucket_bytes=50_000, policy=policy)
        fingerprint = fresh.fingerprint
        assert fresh._derived.binary is None  # not made for the fingerprint
        assert fingerprint == hashlib.sha256(fresh.to_bytes()).hexdigest()
        other = compile_plan(refit, bucket_bytes=50_000, policy=policy)
        assert hashlib.sha256(other.to_bytes()).hexdigest() == other.fingerprint == fingerprint


def test_binary_form_round_trips_with_the_same_fingerprint(refit):
    """to_bytes -> from_bytes gives the same bytes, fingerprint (SHA-256 hex), statistics, moves
    and header fields, for a plan of several buckets."""
    plan = compile_plan(refit, bucket_bytes=50_000)
    data = plan.to_bytes()
    again = load_plan(data, refit)
    assert again.to_bytes() == data
    assert again.fingerprint == plan.fingerprint
    assert len(plan.fingerprint) == 64 and re.fullmatch(r"[0-9a-f]+", plan.fingerprint)
    assert again.stats == plan.stats
    assert [str(m) for m in again.moves()] == [str(m) for m in plan.moves()]
    assert (again.name, again.policies, again.bucket_bytes, again.domain_size) == (
        plan.name,
        plan.policies,
        plan.bucket_bytes,
        plan.domain_size,
    )


def test_binary_form_is_refused_for_a_program_with_a_changed_layout(tp_to_dp):
    """The same names, but the destination shards 'w' instead of replicating it."""
    data = compile_plan(tp_to_dp).to_bytes()
    changed = layoutlang.loads(
        (EXAMPLES / "tp_to_dp.layout")
        .read_text()
        .replace("{ default: replicate }", '{ "w": dp = shard(1) }')
    )
    with pytest.raises(layoutlang.LayoutValueError, match="different destination layout 'dp'"):
        load_plan(data, changed)


def test_damaged_binary_forms_are_refused(tp_to_dp):
    """Bad magic, truncation, and a changed destination rank or move kind in the columns."""
    plan = compile_plan(tp_to_dp)
    data = plan.to_bytes()
    with pytest.raises(layoutlang.LayoutValueError, match="magic"):
        load_plan(b"X" + data[1:], tp_to_dp)
    for cut in (len(data) - 1, len(data) // 2, 30):
        with pytest.raises(layoutlang.LayoutValueError):
            load_plan(data[:cut], tp_to_dp)
    # move_dst of the first move: 8 -> 12 (a rank in no mesh)
    assert data[column_at(data, "move_dst")] == 8
    damaged = bytearray(data)
    damaged[column_at(data, "move_dst")] = 12
    with pytest.raises(layoutlang.LayoutValueError, match="invalid"):
        load_plan(bytes(damaged), tp_to_dp)
    assert data[column_at(data, "move_kind")] == 2
    damaged = bytearray(data)
    damaged[column_at(data, "move_kind")] = 1  # a network move labelled domain
    with pytest.raises(layoutlang.LayoutValueError, match="kind does not match"):
        load_plan(bytes(damaged), tp_to_dp)


def test_damaged_header_key_is_refused_as_a_layout_value_error(tp_to_dp):
    """BUG: a damaged byte inside a header key (valid JSON, unknown key) escapes as a bare
    KeyError from Plan.from_bytes instead of LayoutValueError."""
    data = compile_plan(tp_to_dp).to_bytes()
    damaged = data.replace(b'"num_buckets"', b'"num_buckeTs"', 1)
    assert len(damaged) == len(data) and damaged != data
    with pytest.raises(layoutlang.LayoutValueError):
        load_plan(damaged, tp_to_dp)


def test_damaged_region_coordinates_are_refused_without_crashing():
    """BUG: a damaged region_dims_start (the index of a region's first coordinate) makes
    validate_plan read far outside region_offsets: the interpreter segfaults instead of
    raising LayoutValueError."""
    code = """
import layoutlang
from layoutlang.plan import compile_plan, load_plan
program = layoutlang.load('examples/tp_to_dp.layout')
data = compile_plan(program).to_bytes()
damaged = bytearray(data)
damaged[{at}] ^= 0x40  # a high byte of the second region's start: 2 -> 2 + 2**54
try:
    load_plan(bytes(damaged), program)
    print("accepted")
except layoutlang.LayoutValueError:
    print("refused")
"""
    program = layoutlang.load(EXAMPLES / "tp_to_dp.layout")
    data = compile_plan(program).to_bytes()
    at = column_at(data, "region_dims_start") + 8 + 6
    assert data[at - 6 : at + 2] == (2).to_bytes(8, "little")
    result = run_python(code.replace("{at}", str(at)))
    assert result.returncode == 0, f"child died with {result.returncode}: {result.stderr[-500:]}"
    assert result.stdout.strip() == "refused"


@pytest.mark.parametrize(
    ("field", "value"),
    [("lower_bound_bytes", 8388608), ("broadcast_payload_bytes", 0), ("num_buckets", 1)],
)
def test_damaged_header_statistics_are_refused(tp_to_dp, field, value):
    """BUG: from_bytes trusts the header's statistics: one changed digit in the lower bound,
    the payload or the bucket count gives a plan whose stats lie (and whose fingerprint
    differs), accepted without error. Nothing checks them against the columns or layouts."""
    data = compile_plan(tp_to_dp).to_bytes()
    before = f'"{field}":{value}'.encode()
    after = f'"{field}":{value + 1 if value % 10 != 9 else value - 1}'.encode()
    assert data.count(before) == 1 and len(before) == len(after)
    damaged = data.replace(before, after)
    with pytest.raises(layoutlang.LayoutValueError):
        load_plan(damaged, tp_to_dp)


def test_json_form_lists_every_move_and_the_statistics(refit):
    """to_json() is JSON-serializable, holds one record per move equal to the Move fields,
    the header and the statistics; moves=False leaves the moves out."""
    plan = compile_plan(refit, bucket_bytes=100_000)
    out = json.loads(json.dumps(plan.to_json()))
    assert out["fingerprint"] == plan.fingerprint
    assert (
        out["reshard"] == "refit" and out["source"] == "megatron" and out["destination"] == "vllm"
    )
    assert len(out["moves"]) == plan.num_moves
    for record, move in zip(out["moves"], plan.moves()):
        assert record == {
            "tensor": move.tensor,
            "offsets": list(move.offsets),
            "sizes": list(move.sizes),
            "src": move.src,
            "dst": move.dst,
            "kind": move.kind,
            "stage": move.stage,
            "bucket": move.bucket,
            "src_space": move.src_space,
            "dst_space": move.dst_space,
            "bytes": move.nbytes,
        }
    assert out["stats"]["moved_bytes"] == plan.stats.moved == out["stats"]["lower_bound_bytes"]
    assert "moves" not in plan.to_json(moves=False)


def test_move_reads_as_one_line(tp_to_dp):
    """str(move) is 'tensor[box] rSRC -> rDST kind (bucket, stage, notes)', noting relays and
    scratch spaces."""
    plan = compile_plan(tp_to_dp)
    lines = [str(m) for m in plan.moves()]
    assert lines[0] == "w[0:512, 0:1024] r0 -> r8 network (bucket 0, stage 0)"
    assert lines[1] == "w[0:512, 0:1024] r8 -> r9 domain (bucket 0, stage 1, relay)"
    broadcast = [str(m) for m in compile_plan(tp_to_dp, policy="broadcast").moves()]
    assert "w[512:1024, 0:1024] r1 -> r0 domain (bucket 0, stage 0, source -> scratch)" in broadcast
    assert (
        "w[0:1024, 0:1024] r8 -> r8 local (bucket 0, stage 3, scratch -> destination)" in broadcast
    )


def test_place_gives_storage_and_offsets_on_both_sides(refit):
    """Places of a move inside the fused destination storages of vLLM: q_proj of layer 0
    on inference rank 4 (tp 0) sits at the top of its qkv_proj, k_proj right below q."""
    plan = compile_plan(refit)
    for move in plan.moves("model.layers.0.self_attn.k_proj.weight"):
        if move.dst == 4:
            src, dst = plan.place(move)
            assert dst[0] == "model.layers.0.self_attn.qkv_proj.weight"
            assert dst[1][0] == 256 // 4 + move.offsets[0]  # below the 64 q rows of rank 4
            assert src[0] == "decoder.layers.0.self_attention.linear_qkv.weight"
            break
    else:
        pytest.fail("no k_proj move reaches rank 4")


def test_ratio_to_lower_bound_is_not_one_when_bytes_move_against_a_zero_bound():
    """BUG: the destination already holds everything (lower bound 0), yet the broadcast plan
    moves 96 bytes (the whole tensor to rank 1); ratio_to_lower_bound reports 1.0, i.e.
    optimal, instead of something above 1 (infinity)."""
    program = layoutlang.loads(
        """
        mesh before [dp = 2] on ranks 0..1
        mesh after [tp = 2] on ranks 0..1
        tensor "w" [6, 4] fp32
        layout full on before { default: replicate }
        layout half on after { "w": tp = shard(0) }
        reshard full -> half
        """
    )
    assert compile_plan(program).stats.ratio_to_lower_bound == 1.0  # 0 moved of 0
    stats = compile_plan(program, policy="broadcast").stats
    assert stats.lower_bound == 0 and stats.moved == 96
    assert stats.ratio_to_lower_bound > 1


def test_messages_in_buckets_far_apart_are_counted_separately(tp_to_dp):
    """BUG: plan_totals packs (bucket << 42 | stage << 40 | src << 20 | dst) into 64 bits, so
    bucket 2**22 wraps onto bucket 0: the same pair of ranks in those two buckets counts as
    one message. (A 2.8T-parameter refit in 1 MB buckets has millions of buckets.)"""
    plan = compile_plan(tp_to_dp)
    twice = rebuilt(plan, moves=[0, 0], move_bucket=[0, 2**22], num_buckets=2**22 + 1)
    assert rebuilt(plan, moves=[0, 0], move_bucket=[0, 5], num_buckets=6).stats.messages == 2
    assert twice.stats.messages == 2


def test_messages_are_counted_alike_however_the_keys_are_packed(refit):
    """plan_totals counts a message per distinct (bucket, stage, src, dst) of the staged moves:
    packed into 64 bits where they fit, kept as tuples where they do not (buckets spread over
    2**31 and stages up to 200 beside 8192 ranks need 65 bits). Both equal a count made here."""
    plan = compile_plan(refit, bucket_bytes=50_000)
    cols = columns(plan)

    def distinct(cols) -> int:
        staged = cols["move_kind"] != int(_core.MoveKind.local)
        keys = zip(*(cols[c][staged].tolist() for c in ("move_bucket", "move_stage", "move_src", "move_dst")))
        return len(set(keys))

    assert plan.stats.messages == distinct(cols) > plan.num_buckets
    wide = dict(cols)
    wide["move_bucket"] = (cols["move_bucket"].astype(np.int64) * (2**31 - 1) // plan.num_buckets).astype(np.int32)
    wide["move_stage"] = (cols["move_stage"] * 200).astype(np.uint8)
    arrays = rebuilt(plan, move_bucket=wide["move_bucket"], move_stage=wide["move_stage"], num_buckets=2**31 - 1).arrays
    assert _core.plan_totals(arrays, 8192).messages == distinct(wide) == distinct(cols)


# -------------------------------------------------------------------- the validator


def test_validate_catches_a_dropped_move(tp_to_dp):
    """Without the last relay, rank 10 gets half of its elements: validate() names the rank."""
    plan = compile_plan(tp_to_dp)
    broken = rebuilt(plan, moves=[0, 1, 2, 3, 4, 5, 6])  # rank 10 never gets rows 512:1024
    with pytest.raises(
        layoutlang.LayoutValueError, match=r"rank 10: 524288 of its 1048576 destination elements"
    ):
        broken.validate()


def test_validate_catches_a_duplicated_move(tp_to_dp):
    """The first network move twice: its bytes are written twice on rank 8."""
    plan = compile_plan(tp_to_dp)
    broken = rebuilt(plan, moves=[0, 0, 1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(layoutlang.LayoutValueError, match="writes bytes that move 0 also writes"):
        broken.validate()


def test_validate_catches_a_read_outside_the_source_holding(tp_to_dp):
    """Rows 0:512 read from rank 1, which holds rows 512:1024."""
    plan = compile_plan(tp_to_dp)
    src = columns(plan)["move_src"]
    src[0] = 1
    with pytest.raises(layoutlang.LayoutValueError, match="reads what rank 1 does not hold"):
        rebuilt(plan, move_src=src).validate()


def test_validate_catches_a_wrong_kind(tp_to_dp):
    """A network move labelled domain, and a relay labelled network."""
    plan = compile_plan(tp_to_dp)
    kinds = columns(plan)["move_kind"]
    kinds[0] = 1  # r0 -> r8 labelled domain
    with pytest.raises(layoutlang.LayoutValueError, match="kind does not match"):
        rebuilt(plan, move_kind=kinds).validate()
    kinds = columns(plan)["move_kind"]
    kinds[1] = 2  # the relay r8 -> r9 labelled network
    with pytest.raises(layoutlang.LayoutValueError, match="move 1: kind does not match"):
        rebuilt(plan, move_kind=kinds).validate()


def test_validate_catches_a_relay_before_its_feed(tp_to_dp):
    """Network moves in bucket 1, the relays they feed in bucket 0; then the relays in the
    same bucket and stage as their feeds."""
    plan = compile_plan(tp_to_dp)
    cols = columns(plan)
    buckets = np.where(cols["move_kind"] == 2, 1, 0).astype(np.int32)
    with pytest.raises(
        layoutlang.LayoutValueError, match="reads data that no earlier move delivered"
    ):
        rebuilt(plan, move_bucket=buckets, num_buckets=2).validate()
    stages = np.zeros_like(cols["move_stage"])
    with pytest.raises(
        layoutlang.LayoutValueError, match="reads data that no earlier move delivered"
    ):
        rebuilt(plan, move_stage=stages).validate()
    # the untouched plan, rebuilt the same way, is valid
    rebuilt(plan).validate()


def test_validate_catches_a_rank_staging_over_the_budget(tp_to_dp):
    """tp_to_dp's moves (1 MiB regions, all in bucket 0) checked against buckets of 2.5 MiB:
    the ranks that stage more than that there (counted by this file's own walk: the four
    destination ranks, each receiving two regions and relaying one) are refused,
    naming one of them and the bucket. The same plan with its buckets moved to 2**30, where a
    table of ranks x buckets would be too large (the validator counts them in a hash map
    instead), is refused alike; under the plan's own budget both are valid."""
    plan = compile_plan(tp_to_dp)
    budget = 5 << 19
    over = {rank for (bucket, rank), nbytes in staging(plan).items() if nbytes > budget}
    assert over == {8, 9, 10, 11} and plan.num_buckets == 1
    for first in (0, 2**30):
        buckets = columns(plan)["move_bucket"] + first
        tight = rebuilt(plan, move_bucket=buckets, num_buckets=first + 1, bucket_bytes=budget)
        refused = f"stages more than the bucket budget in bucket {first}"
        with pytest.raises(layoutlang.LayoutValueError, match=refused) as err:
            tight.validate()
        named = re.search(r"rank (\d+) stages more", str(err.value))
        assert named and int(named.group(1)) in over
        rebuilt(plan, move_bucket=buckets, num_buckets=first + 1).validate()


def test_validate_reads_and_writes_are_checked_per_rank_and_space(refit):
    """The refit plan's relays read what their network moves wrote on the same rank, into the
    same space: a relay whose network move is sent to another rank, or written into scratch
    instead of the destination storage, leaves the relay reading what nothing delivered."""
    plan = compile_plan(refit)
    cols = columns(plan)
    relays = [m for m in plan.moves() if m.is_relay]
    assert relays
    relay = relays[0]
    feeds = [
        m.index
        for m in plan.moves()
        if m.kind == "network"
        and m.dst == relay.src
        and (m.tensor, m.offsets, m.sizes) == (relay.tensor, relay.offsets, relay.sizes)
    ]
    assert len(feeds) == 1
    elsewhere = cols["move_dst"].copy()
    elsewhere[feeds[0]] = relay.dst  # the holder's copy lands on the relay's receiver
    with pytest.raises(layoutlang.LayoutValueError, match="reads data that no earlier move delivered"):
        rebuilt(plan, move_dst=elsewhere).validate()
    scratch = cols["move_dst_space"].copy()
    scratch[feeds[0]] = int(_core.Space.scratch)
    with pytest.raises(layoutlang.LayoutValueError, match="reads data that no earlier move delivered"):
        rebuilt(plan, move_dst_space=scratch).validate()


def interleaved_program() -> layoutlang.Program:
    """q (4 rows) and k (2 rows) interleaved in blocks of 2 and 1 rows: qk = [q0 q1 k0 q2 q3 k1]."""
    return layoutlang.loads(
        """
        mesh a [x = 1] on ranks 0..0
        mesh b [x = 1] on ranks 1..1
        tensor "q" [4, 2] fp32
        tensor "k" [2, 2] fp32
        layout s on a { default: replicate }
        layout d on b {
            default: replicate
            storage "qk" = "q" | "k" blocks(2, 1)
        }
        reshard s -> d
        """
    )


def test_planner_cuts_regions_at_interleaved_blocks():
    """Regions end where a block of the interleaved destination storage ends, so every move
    lands contiguously: q's rows 0:2 at qk rows 0:2, rows 2:4 at qk rows 3:5."""
    plan = compile_plan(interleaved_program())
    plan.validate()
    places = [(str(m), plan.place(m)[1]) for m in plan.moves()]
    assert places == [
        ("q[0:2, 0:2] r0 -> r1 network (bucket 0, stage 0)", ("qk", (0, 0))),
        ("q[2:4, 0:2] r0 -> r1 network (bucket 0, stage 0)", ("qk", (3, 0))),
        ("k[0:1, 0:2] r0 -> r1 network (bucket 0, stage 0)", ("qk", (2, 0))),
        ("k[1:2, 0:2] r0 -> r1 network (bucket 0, stage 0)", ("qk", (5, 0))),
    ]


def test_validate_catches_a_region_straddling_interleaved_blocks():
    """BUG: q[0:4] as one region would be written contiguously at qk[0:4], over k's first
    block at row 2; the planner never makes such a region, but validate() accepts it."""
    plan = compile_plan(interleaved_program())
    broken = rebuilt(
        plan,
        moves=[0, 2, 3],
        region_tensor=[0, 1, 1],
        region_dims_start=[0, 2, 4],
        region_offsets=[0, 0, 0, 0, 1, 0],
        region_sizes=[4, 2, 1, 2, 1, 2],
        region_bytes=[32, 8, 8],
        move_region=[0, 1, 2],
    )
    with pytest.raises(layoutlang.LayoutValueError):
        broken.validate()


def test_validate_catches_region_bytes_that_disagree_with_the_sizes(tp_to_dp):
    """BUG: region_bytes is not checked against sizes x itemsize; a plan claiming 2 MiB
    per 1 MiB region validates (and its statistics double), also through from_bytes."""
    plan = compile_plan(tp_to_dp)
    broken = rebuilt(plan, region_bytes=columns(plan)["region_bytes"] * 2)
    assert broken.stats.moved == 2 * plan.stats.moved
    with pytest.raises(layoutlang.LayoutValueError):
        broken.validate()


def test_validate_catches_a_bucket_over_the_budget(tp_to_dp):
    """The 8-move TP->DP plan, all in bucket 0, is invalid for a 1 MiB budget: rank 8
    stages 3 MiB (receives 1 MiB, relays 1 MiB, receives a relayed 1 MiB)."""
    plan = compile_plan(tp_to_dp)
    broken = rebuilt(plan, bucket_bytes=MiB)
    assert max(staging(broken).values()) == 3 * MiB
    with pytest.raises(layoutlang.LayoutValueError):
        broken.validate()


def test_validate_catches_a_space_out_of_range(tp_to_dp):
    """BUG: an extra move writing space 7 (there are 3 spaces) passes validate(); reading
    it afterwards fails with IndexError."""
    plan = compile_plan(tp_to_dp)
    order = [0, 0, 1, 2, 3, 4, 5, 6, 7]
    spaces = columns(plan)["move_dst_space"][order]
    spaces[1] = 7
    broken = rebuilt(plan, moves=order, move_dst_space=spaces)
    with pytest.raises(layoutlang.LayoutValueError):
        broken.validate()


def test_plan_of_a_scalar_tensor_can_be_placed():
    """BUG: shape [] is a scalar per the language, and its plan compiles and validates, but
    Plan.place on its move calls LayoutCore::locate, which adds the fused-storage base to
    storage_offsets[0] of a 0-length vector: a heap write out of bounds (segfault).
    Layout.boxes('s', 0) has the same fault, and Program.check() rejects the scalar."""
    code = """
import layoutlang
from layoutlang.plan import compile_plan
program = layoutlang.loads('''
mesh a [x = 1] on ranks 0..0
mesh b [x = 1] on ranks 1..1
tensor "s" [] fp32
layout s on a { default: replicate }
layout d on b { default: replicate }
reshard s -> d
''')
plan = compile_plan(program)
plan.validate()
assert [str(m) for m in plan.moves()] == ["s[] r0 -> r1 network (bucket 0, stage 0)"]
print(plan.place(0))
"""
    result = run_python(code)
    assert result.returncode == 0, f"child died with {result.returncode}: {result.stderr[-500:]}"
    assert result.stdout.strip() == "(('s', ()), ('s', ()))"


# ------------------------------------------------------------------------- bad input


def two_programs(second_tensors: str):
    first = layoutlang.loads(
        """
        mesh train [tp = 2] on ranks 0..1
        tensor "w" [4, 4] bf16
        tensor "v" [4] bf16
        layout s on train { "w": tp = shard(0) default: replicate }
        """
    )
    second = layoutlang.loads(
        f"""
        mesh infer [dp = 2] on ranks 2..3
        {second_tensors}
        layout d on infer {{ default: replicate }}
        """
    )
    return first.layouts["s"], second.layouts["d"]


def test_layouts_of_programs_with_different_shapes_are_refused_naming_the_tensor():
    """Layouts of two programs where 'w' has another shape, then another dtype."""
    source, destination = two_programs('tensor "w" [4, 8] bf16  tensor "v" [4] bf16')
    with pytest.raises(
        layoutlang.LayoutValueError,
        match=r"tensor 'w' is \[4, 4\] bf16 in layout 's' but \[4, 8\] bf16",
    ):
        plan_layouts(source, destination)
    source, destination = two_programs('tensor "w" [4, 4] fp32  tensor "v" [4] bf16')
    with pytest.raises(
        layoutlang.LayoutValueError, match=r"tensor 'w' is \[4, 4\] bf16 .* \[4, 4\] fp32"
    ):
        plan_layouts(source, destination)


def test_layouts_of_programs_with_different_tensors_are_refused_naming_them():
    """The second program has 'u' instead of 'v': the error names both."""
    source, destination = two_programs('tensor "w" [4, 4] bf16  tensor "u" [4] bf16')
    with pytest.raises(layoutlang.LayoutValueError, match="different logical tensors") as err:
        plan_layouts(source, destination)
    assert "only in 's': v" in str(err.value) and "only in 'd': u" in str(err.value)


def test_layouts_of_the_same_tensors_declared_in_another_order_can_be_planned():
    """BUG: the second program declares v before w. Both layouts place the same logical
    tensors, yet plan_layouts refuses them as 'place different logical tensors' and names
    none (the check compares name lists, order included)."""
    source, destination = two_programs('tensor "v" [4] bf16  tensor "w" [4, 4] bf16')
    plan = plan_layouts(source, destination)
    plan.validate()
    assert plan.stats.moved == plan.stats.lower_bound == 2 * (4 * 4 + 4) * 2


def test_conflicting_storages_on_a_shared_rank_are_refused_naming_rank_and_storage():
    """Rank 1 is in both meshes; 'fused' holds a then b before, b then a after."""
    program = layoutlang.loads(
        """
        mesh train [tp = 2] on ranks 0..1
        mesh infer [dp = 2] on ranks 1..2
        tensor "a" [4, 4] bf16
        tensor "b" [4, 4] bf16
        layout s on train {
            default: tp = shard(0)
            storage "fused" = "a" | "b"
        }
        layout d on infer {
            default: replicate
            storage "fused" = "b" | "a"
        }
        reshard s -> d
        """
    )
    with pytest.raises(
        layoutlang.LayoutValueError, match=r"rank 1 is in both meshes .* storages named 'fused'"
    ):
        compile_plan(program)


def test_same_storage_name_with_same_parts_on_a_shared_rank_is_fine():
    """Default storages are named like their tensor: colocated layouts share those names with
    other shapes, and that is no conflict (source and destination buffers are distinct)."""
    program = layoutlang.loads(
        """
        mesh train [tp = 2] on ranks 0..1
        mesh infer [dp = 2] on ranks 1..2
        tensor "a" [4, 4] bf16
        layout s on train { default: tp = shard(0) }
        layout d on infer { default: replicate }
        reshard s -> d
        """
    )
    plan = compile_plan(program)
    plan.validate()
    assert plan.stats.bytes["local"] == 2 * 4 * 2  # rank 1 keeps its two rows


def test_unknown_reshard_name_is_a_name_error(refit):
    """A misspelt reshard name is a LayoutNameError; an unknown policy a LayoutValueError."""
    with pytest.raises(layoutlang.LayoutNameError, match="unknown reshard 'refitt'"):
        compile_plan(refit, "refitt")
    with pytest.raises(layoutlang.LayoutValueError, match="unknown policy"):
        compile_plan(refit, policy="scatter")


# ----------------------------------------------------------------------- determinism


def test_compiling_twice_gives_byte_identical_plans(refit):
    """The same program, loaded and compiled twice, gives byte-identical binary forms."""
    first = compile_plan(refit, bucket_bytes=64 * 1024)
    second = compile_plan(layoutlang.load(EXAMPLES / "refit.layout"), bucket_bytes=64 * 1024)
    assert first.to_bytes() == second.to_bytes()
    assert first.fingerprint == second.fingerprint


def test_fingerprint_is_the_same_in_another_process(refit):
    """A fresh interpreter (other hash seed, other allocation) computes the same fingerprint."""
    fingerprint = compile_plan(refit, bucket_bytes=64 * 1024).fingerprint
    code = (
        "import layoutlang; from layoutlang.plan import compile_plan; "
        "print(compile_plan(layoutlang.load('examples/refit.layout'), bucket_bytes=64 * 1024).fingerprint)"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == fingerprint
