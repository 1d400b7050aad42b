"""The cost model (layoutlang.plan.simulate): hand-computed plans, a reference implementation,
the lower bound against brute force, topology presets and the command.

Run ``python tests/test_simulate.py --update`` to re-make the simulated tables the guide
"Choosing an inference layout" shows (docs/snippets/sim/*.txt: DeepSeek-V3, Qwen3-235B and
the 2.4T model); ``test_guide_tables_are_current`` checks that they are, in about 90 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang import _text
from layoutlang.cli import simulate as simulate_command
from layoutlang.errors import LayoutError, LayoutNameError
from layoutlang.model import Topology
from layoutlang.model import topology as T
from layoutlang.plan import compile_plan
from layoutlang.plan import simulate as S

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SIM_DOCS = ROOT / "docs" / "snippets" / "sim"
US = 1e-6
MiB = 2**20

# Round numbers, so that times can be computed by hand.
LINKS = """
topology {
    domain_size = 2
    network_bandwidth = 1 GB/s
    domain_bandwidth = 4 GB/s
    copy_bandwidth = 10 GB/s
    network_latency = 10 us
    domain_latency = 2 us
}
"""

TP_TO_DP = LINKS + """
mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 4] on ranks 8..11
tensor "w" [1024, 1024] bf16
layout tp on train { "w": tp = shard(0) }
layout dp on infer { default: replicate }
reshard tp -> dp
"""


def topology_of(program) -> Topology:
    return program.topology


# ----------------------------------------------------------------- hand-computed plans


def test_one_network_move():
    program = layoutlang.loads(
        LINKS.replace("domain_size = 2", "domain_size = 1")
        + """
        mesh a [x = 1] on ranks 0..0
        mesh b [x = 1] on ranks 1..1
        tensor "w" [1000, 1000] bf16
        layout src on a { default: replicate }
        layout dst on b { default: replicate }
        reshard src -> dst
        """
    )
    plan = compile_plan(program)
    assert [(m.src, m.dst, m.kind, m.nbytes) for m in plan.moves()] == [(0, 1, "network", 2_000_000)]
    e = S.estimate(plan, program.topology, sequential=True)
    # one message: 10 us of latency + 2 MB at 1 GB/s (2 ms)
    assert e.time == pytest.approx(10 * US + 2e-3)
    assert e.sequential_time == pytest.approx(e.time)
    assert e.steps == 1 and e.messages == {"domain": 0, "network": 1}
    assert e.bound_by["network send"] == pytest.approx(e.time)
    assert e.latency == pytest.approx(10 * US)
    bound = S.lower_bound(plan, program.topology)
    # rank 1 has no domain peer: 2 MB through its NIC alone; the same through domain 1's one NIC
    assert bound.time == pytest.approx(2e-3)
    assert bound.terms == pytest.approx(
        {
            "destination rank": 2e-3,
            "destination rank with copies": 2e6 / (1e9 + 10e9),  # its NIC and its copy engine
            "destination domain": 2e-3,
            "source domain": 2e-3,
        }
    )


def test_relay_chain_tp_to_dp():
    program = layoutlang.loads(TP_TO_DP)
    plan = compile_plan(program)
    assert [(m.src, m.dst, m.kind, m.stage) for m in plan.moves()] == [
        (0, 8, "network", 0), (8, 9, "domain", 1), (0, 10, "network", 0), (10, 11, "domain", 1),
        (1, 9, "network", 0), (9, 8, "domain", 1), (1, 11, "network", 0), (11, 10, "domain", 1),
    ]  # fmt: skip
    e = S.estimate(plan, program.topology, sequential=True)
    # step 0, network: ranks 0 and 1 each send two halves of 1 MiB, as two messages
    network = 2 * 10 * US + 2 * MiB / 1e9
    # step 1, relays: every inference rank sends (and receives) one half over NVLink
    relay = 2 * US + MiB / 4e9
    assert e.time == pytest.approx(network + relay)
    assert e.time == pytest.approx(2117.152 * US + 264.144 * US)
    assert e.sequential_time == pytest.approx(e.time)  # one bucket: nothing to overlap
    assert e.steps == 2
    assert e.bound_by["network send"] == pytest.approx(network)
    assert e.bound_by["NVLink send"] == pytest.approx(relay)
    assert e.messages == {"domain": 4, "network": 4}
    assert e.busiest_port == ("network send", 0, pytest.approx(network))
    bound = S.lower_bound(plan, program.topology)
    # domain 4 (ranks 8, 9) needs all 2 MiB and holds none: it enters through 2 NICs
    assert bound.terms["destination domain"] == pytest.approx(2 * MiB / 2e9)
    assert bound.ingress == {4: 2 * MiB, 5: 2 * MiB}
    # w is held only in domain 0: it leaves it once, through 2 NICs
    assert bound.terms["source domain"] == pytest.approx(2 * MiB / 2e9)
    assert bound.egress == {0: 2 * MiB}
    # each inference rank receives 2 MiB through its NIC and NVLink (1 + 4 GB/s)
    assert bound.terms["destination rank"] == pytest.approx(2 * MiB / 5e9)
    assert bound.time == pytest.approx(1048.576 * US)


def test_broadcast_tp_to_dp():
    program = layoutlang.loads(TP_TO_DP)
    plan = compile_plan(program, policy="broadcast")
    moves = [(m.src, m.dst, m.kind, m.stage, m.nbytes) for m in plan.moves()]
    assert sorted(moves, key=lambda m: (m[3], m[0], m[1])) == [
        (0, 0, "local", 0, MiB), (1, 0, "domain", 0, MiB),  # gather on the root, rank 0
        (0, 8, "network", 1, 2 * MiB), (0, 10, "network", 1, 2 * MiB),  # broadcast, once per domain
        (8, 9, "domain", 2, 2 * MiB), (10, 11, "domain", 2, 2 * MiB),  # relays
        (8, 8, "local", 3, 2 * MiB), (9, 9, "local", 3, 2 * MiB),  # extraction
        (10, 10, "local", 3, 2 * MiB), (11, 11, "local", 3, 2 * MiB),
    ]  # fmt: skip
    assert plan.num_buckets == 1
    e = S.estimate(plan, program.topology, sequential=True)
    gather = max(MiB / 10e9, 2 * US + MiB / 4e9)  # a local copy and an NVLink message at once
    broadcast = 2 * 10 * US + 4 * MiB / 1e9  # the root sends two messages of 2 MiB
    relay = 2 * US + 2 * MiB / 4e9
    extract = 2 * MiB / 10e9
    assert e.time == pytest.approx(gather + broadcast + relay + extract)
    assert e.time == pytest.approx(5214.4512 * US)
    assert e.steps == 4
    assert e.bytes == {"local": 9 * MiB, "domain": 5 * MiB, "network": 4 * MiB}
    assert e.bound_by["local copy"] == pytest.approx(extract)
    # the same bound as for the reshard plan: it depends on the layouts, not on the plan
    bound = S.lower_bound(compile_plan(program), program.topology)
    assert e.time > 4.9 * bound.time


def test_buckets_overlap_relays_with_the_next_network_moves():
    """Phase p of bucket k runs in step k + p: with buckets of 512 KiB (8 buckets, per the
    plans guide), relays run beside the next bucket's network moves."""
    program = layoutlang.loads(TP_TO_DP)
    plan = compile_plan(program, bucket_bytes=512 * 1024)
    assert plan.num_buckets == 8
    e = S.estimate(plan, program.topology, sequential=True)
    assert e.steps == 9
    assert e.time == pytest.approx(reference_time(plan, program.topology, pipelined=True))
    assert e.sequential_time == pytest.approx(reference_time(plan, program.topology, pipelined=False))
    assert e.time < e.sequential_time


# -------------------------------------------------------------- reference implementation


def reference_time(plan, topology: Topology, pipelined: bool = True, stage_major: bool = False) -> float:
    """The cost model written out move by move (slow, obviously right). ``stage_major``: every
    bucket of a phase before any move of the next (how a rank runs a pairwise plan)."""
    index = plan.source.resolved.index

    def phase(m) -> int:  # a resharded tensor's stages 0 and 1 are phases 1 and 2
        return m.stage + (plan.policies[index[m.tensor]] == "reshard")

    phases = max((phase(m) for m in plan.moves()), default=0) + 1
    load: dict[tuple[int, int, str], list[float]] = defaultdict(lambda: [0.0, 0])
    messages = set()
    for m in plan.moves():
        if stage_major:
            step = phase(m) * plan.num_buckets + m.bucket
        else:
            step = m.bucket + phase(m) if pipelined else m.bucket * phases + phase(m)
        if m.kind == "local":
            load[(step, m.src, "copy")][0] += m.nbytes
            continue
        link = "net" if m.kind == "network" else "nvl"
        load[(step, m.src, link + " send")][0] += m.nbytes
        load[(step, m.dst, link + " recv")][0] += m.nbytes
        key = (m.bucket, phase(m), m.src, m.dst)
        if key not in messages:
            messages.add(key)
            load[(step, m.src, link + " send")][1] += 1
            load[(step, m.dst, link + " recv")][1] += 1
    step_time: dict[int, float] = defaultdict(float)
    for (step, _, port), (nbytes, count) in load.items():
        if port == "copy":
            t = nbytes / topology.copy_bandwidth
        elif port.startswith("net"):
            t = count * topology.network_latency + nbytes / topology.network_bandwidth
        else:
            t = count * topology.domain_latency + nbytes / topology.domain_bandwidth
        step_time[step] = max(step_time[step], t)
    return sum(step_time.values())


def example_programs():
    """Every example with a reshard statement, and the plans guide's hybrid plan."""
    for path in [*sorted(EXAMPLES.glob("*.layout")), ROOT / "docs" / "snippets" / "plan-hybrid.layout"]:
        program = layoutlang.load(path)
        if program.reshards:
            yield path.name, program


@pytest.mark.parametrize("policy", ["reshard", "broadcast", None])
def test_estimate_matches_reference_on_examples(policy):
    for name, program in example_programs():
        topology, _ = T.complete_topology(program.topology)
        for bucket in (layoutlang.plan.DEFAULT_BUCKET_BYTES, 4096):
            plan = compile_plan(program, bucket_bytes=bucket, policy=policy)
            e = S.estimate(plan, topology, sequential=True)
            assert e.time == pytest.approx(reference_time(plan, topology, True)), (name, bucket)
            assert e.sequential_time == pytest.approx(reference_time(plan, topology, False)), (name, bucket)
            assert e.time <= e.sequential_time * (1 + 1e-9)
            assert sum(e.bound_by.values()) == pytest.approx(e.time)


def test_a_pairwise_plan_is_estimated_stage_major_as_the_executor_runs_it():
    """The executor runs a pairwise plan's network moves of every bucket before its first relay
    (runtime/schedule.py), so the estimate must not overlap a bucket's relays with the next
    bucket's network moves as it does for a fleet plan."""
    relayed = 0
    for name, program in example_programs():
        topology, _ = T.complete_topology(program.topology)
        for bucket in (layoutlang.plan.DEFAULT_BUCKET_BYTES, 4096):
            plan = compile_plan(program, bucket_bytes=bucket, policy="reshard", mode="pairwise")
            e = S.estimate(plan, topology, sequential=True)
            assert e.time == pytest.approx(reference_time(plan, topology, stage_major=True)), (name, bucket)
            assert e.sequential_time == pytest.approx(reference_time(plan, topology, False)), (name, bucket)
            assert sum(e.bound_by.values()) == pytest.approx(e.time)
            if any(m.stage > 0 for m in plan.moves()) and plan.num_buckets > 1:
                relayed += 1
                assert e.time >= reference_time(plan, topology, True) * (1 - 1e-9), (name, bucket)
    assert relayed, "no example gives a pairwise plan with relays in several buckets"


def reference_port_seconds(plan, topology: Topology) -> dict[tuple[str, int], float]:
    """Every port's seconds over the whole refit, move by move: bytes over bandwidth plus a
    latency per message (every non-local move between one pair of ranks in one bucket and
    phase)."""
    index = plan.source.resolved.index
    seconds: dict[tuple[str, int], float] = defaultdict(float)
    messages = set()
    for m in plan.moves():
        if m.kind == "local":
            seconds[("local copy", m.src)] += m.nbytes / topology.copy_bandwidth
            continue
        net = m.kind == "network"
        bw = topology.network_bandwidth if net else topology.domain_bandwidth
        link = "network" if net else "NVLink"
        seconds[(f"{link} send", m.src)] += m.nbytes / bw
        seconds[(f"{link} receive", m.dst)] += m.nbytes / bw
        phase = m.stage + (plan.policies[index[m.tensor]] == "reshard")
        if (m.bucket, phase, m.src, m.dst) not in messages:
            messages.add((m.bucket, phase, m.src, m.dst))
            latency = topology.network_latency if net else topology.domain_latency
            seconds[(f"{link} send", m.src)] += latency
            seconds[(f"{link} receive", m.dst)] += latency
    return seconds


@pytest.mark.parametrize("policy", ["reshard", "broadcast"])
def test_busiest_port_and_its_ratio_match_reference(policy):
    """The busiest port is the port with the most seconds, summed move by move; no estimate is
    shorter than it (a step lasts at least as long as each of its ports is busy), and the
    simulation's ``port_ratio`` is the estimate over it."""
    for name, program in example_programs():
        topology, _ = T.complete_topology(program.topology)
        for bucket in (layoutlang.plan.DEFAULT_BUCKET_BYTES, 4096):
            plan = compile_plan(program, bucket_bytes=bucket, policy=policy)
            e = S.estimate(plan, topology)
            seconds = reference_port_seconds(plan, topology)
            if not seconds:
                continue
            assert e.busiest_port[2] == pytest.approx(max(seconds.values())), (name, bucket)
            assert seconds[e.busiest_port[:2]] == pytest.approx(e.busiest_port[2]), (name, bucket)
            assert e.time >= e.busiest_port[2] * (1 - 1e-12), (name, bucket)
    sim = S.simulate(layoutlang.loads(TP_TO_DP))
    for e in sim.estimates:
        assert sim.port_ratio(e) == pytest.approx(e.time / e.busiest_port[2])


# Four 1 MiB tensors, each from one of two training ranks (domain 0) to one of two
# inference ranks (domain 2), with a budget of 1 MiB: each rank takes part in two moves,
# so two buckets suffice if each holds one move per rank (0 -> 4 beside 1 -> 5, then
# 0 -> 5 beside 1 -> 4), and then no port waits: every step is one 1 MiB message on each
# of the four ranks.
CROSSED = LINKS + """
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 4..5
tensor "a" [512, 1024] bf16
tensor "b" [512, 1024] bf16
tensor "c" [512, 1024] bf16
tensor "d" [512, 1024] bf16
layout src on train { "a": tp[0]  "b": tp[0]  "c": tp[1]  "d": tp[1] }
layout dst on infer { "a": tp[0]  "b": tp[1]  "c": tp[0]  "d": tp[1] }
reshard src -> dst
"""


def test_schedule_lets_no_port_wait_behind_another():
    program = layoutlang.loads(CROSSED)
    plan = compile_plan(program, bucket_bytes=1 * MiB)
    assert [(m.tensor, m.src, m.dst, m.kind) for m in plan.moves()] == [
        ("a", 0, 4, "network"), ("b", 0, 5, "network"), ("c", 1, 4, "network"), ("d", 1, 5, "network"),
    ]  # fmt: skip
    assert plan.num_buckets == 2
    by_bucket = defaultdict(set)
    for m in plan.moves():
        by_bucket[m.bucket] |= {m.src, m.dst}
    assert all(ranks == {0, 1, 4, 5} for ranks in by_bucket.values())  # every rank busy in every bucket
    e = S.estimate(plan, program.topology)
    step = MiB / 1e9 + 10 * US  # one 1 MiB message through a NIC at 1 GB/s
    assert e.time == pytest.approx(2 * step) == pytest.approx(reference_time(plan, program.topology))
    assert e.busiest_port[2] == pytest.approx(2 * step)  # the time is the busiest port's: nothing waits


def test_relays_do_not_make_the_network_wait():
    """Llama-3-70B on GB200 NVL72 (the guide's example): every inference rank relays three
    times what it receives from the network, and the relays fill the bucket budget. Filling
    buckets first come, first served made the refit 5.5 times as long as its busiest port
    (510 ms against 92 ms: most steps waited for a few NICs); spreading every port's work
    over the buckets keeps it within 1.2 times, and within 1.2 times the lower bound."""
    program = layoutlang.load(ROOT / "docs" / "snippets" / "sim-llama3-70b.layout")
    sim = S.simulate(program, topology="gb200_nvl72")
    reshard = sim.estimates[0]
    assert reshard.policy == "reshard"
    assert sim.port_ratio(reshard) <= 1.2 and sim.ratio(reshard) <= 1.2


# ------------------------------------------------------------------------ lower bound


def brute_force_volumes(plan) -> tuple[dict[int, int], dict[int, int]]:
    """Per domain, the bytes that must enter it (needed there, held nowhere in it) and leave
    it (of tensors held only there, needed elsewhere), from every rank's boxes."""
    ds = plan.domain_size
    src, dst = plan.source, plan.destination
    ranks = sorted(set(src.mesh.ranks) | set(dst.mesh.ranks))
    ingress: dict[int, int] = defaultdict(int)
    egress: dict[int, int] = defaultdict(int)

    def mask(layout, tensor, members):
        m = np.zeros(tensor.shape, dtype=bool)
        for r in members:
            if r in layout.mesh:
                for box in layout.boxes(tensor.name, r):
                    m[box.slices()] = True
        return m

    for name, tensor in src.tensors.items():
        item = tensor.nbytes // max(tensor.numel, 1)

        holder_domains = {r // ds for r in src.holders(name)}
        for domain, members in itertools.groupby(ranks, key=lambda r: r // ds):
            members = list(members)
            needed = mask(dst, tensor, members) & ~mask(src, tensor, members)
            ingress[domain] += int(needed.sum()) * item
        if len(holder_domains) == 1:
            (home,) = holder_domains
            outside = [r for r in ranks if r // ds != home]
            egress[home] += int((mask(dst, tensor, outside) & ~mask(src, tensor, outside)).sum()) * item
    return {d: v for d, v in ingress.items() if v}, {d: v for d, v in egress.items() if v}


def test_lower_bound_volumes_match_brute_force():
    for name, program in example_programs():
        plan = compile_plan(program, policy="reshard")
        bound = S.lower_bound(plan, program.topology)
        ingress, egress = brute_force_volumes(plan)
        assert bound.ingress == ingress, name
        assert bound.egress == egress, name


def test_no_plan_beats_the_lower_bound():
    for name, program in example_programs():
        topology, _ = T.complete_topology(program.topology)
        bound = S.lower_bound(compile_plan(program, policy="reshard"), topology)
        assert bound.bytes == compile_plan(program).stats.lower_bound
        buckets = (layoutlang.plan.DEFAULT_BUCKET_BYTES, 4096)
        for policy, bucket in itertools.product(("reshard", "broadcast", None), buckets):
            e = S.estimate(compile_plan(program, policy=policy, bucket_bytes=bucket), topology)
            assert e.time >= bound.time * (1 - 1e-12), (name, policy, bucket)


def test_lower_bound_needs_a_reshard_plan():
    program = layoutlang.loads(TP_TO_DP)
    with pytest.raises(ValueError, match="reshards every tensor"):
        S.lower_bound(compile_plan(program, policy="broadcast"), program.topology)
    with pytest.raises(ValueError, match="domains of 2 ranks"):
        S.estimate(compile_plan(program), T.TOPOLOGY_PRESETS["dgx_h100"])


def test_colocated_bound_counts_local_copies():
    program = layoutlang.load(EXAMPLES / "colocated.layout")
    topology, _ = T.complete_topology(program.topology)
    bound = S.lower_bound(compile_plan(program), topology)
    plan = compile_plan(program)
    per_rank = plan.stats.per_rank
    inbound = topology.network_bandwidth + topology.domain_bandwidth
    need = max((v["received"]["domain"] + v["received"]["network"]) / inbound for v in per_rank.values())
    hold = max(sum(v["received"].values()) / (inbound + topology.copy_bandwidth) for v in per_rank.values())
    assert bound.terms["destination rank"] == pytest.approx(need)
    assert bound.terms["destination rank with copies"] == pytest.approx(hold)


# ---------------------------------------------------------------------- topologies


def test_presets_are_documented():
    for name, topology in T.TOPOLOGY_PRESETS.items():
        assert topology.name == name
        sources = T.PRESET_SOURCES[name]
        for setting in ("domain_size", *T._LINK_SETTINGS):
            assert getattr(topology, setting) is not None
            assert sources.get(setting)
        for setting in ("domain_size", "domain_bandwidth", "network_bandwidth", "copy_bandwidth"):
            assert "https://" in sources[setting], (name, setting)


def test_preset_constants():
    h100, gb200 = T.TOPOLOGY_PRESETS["dgx_h100"], T.TOPOLOGY_PRESETS["gb200_nvl72"]
    assert (h100.domain_size, h100.domain_bandwidth, h100.network_bandwidth) == (8, 450e9, 50e9)
    assert (gb200.domain_size, gb200.domain_bandwidth, gb200.network_bandwidth) == (72, 900e9, 50e9)
    assert h100.copy_bandwidth == 3.35e12 / 2 and gb200.copy_bandwidth == 8e12 / 2


def test_named_topology_selects_a_preset_and_the_block_overrides_it():
    program = layoutlang.loads("topology gb200_nvl72 { network_bandwidth = 25 GB/s }")
    t = program.topology
    assert t.name == "gb200_nvl72" and t.domain_size == 72
    assert t.network_bandwidth == 25e9 and t.domain_bandwidth == 900e9
    assert layoutlang.loads("topology dgx_h100 {}").topology == T.TOPOLOGY_PRESETS["dgx_h100"]
    custom = layoutlang.loads("topology lab { domain_size = 4  copy_bandwidth = 1 TB/s }").topology
    assert (custom.name, custom.domain_size, custom.copy_bandwidth, custom.network_bandwidth) == ("lab", 4, 1e12, None)
    assert layoutlang.loads("topology { domain_size = 8 }").topology.network_bandwidth is None


def test_unknown_topology_name_is_an_error():
    with pytest.raises(LayoutNameError) as err:
        layoutlang.loads("topology dgx_h10 { network_bandwidth = 25 GB/s }")
    text = str(err.value)
    assert "unknown topology 'dgx_h10'" in text and "dgx_h100" in text and "did you mean" in text
    with pytest.raises(LayoutNameError, match="given twice"):
        layoutlang.loads("topology dgx_h100 { domain_size = 4  domain_size = 8 }")


def test_link_settings_must_be_positive():
    with pytest.raises(LayoutError, match="'network_bandwidth' must be more than 0"):
        layoutlang.loads("topology { domain_size = 2  network_bandwidth = 0 GB/s }")
    assert layoutlang.loads("topology { network_latency = 0 us }").topology.network_latency == 0
    with pytest.raises(LayoutError, match="bandwidths are more than 0"):
        T.complete_topology(Topology(domain_size=2, domain_bandwidth=-1.0))


def test_missing_settings_come_from_the_fallback_preset():
    t, missing = T.complete_topology(Topology(domain_size=4, network_bandwidth=1e9))
    assert t.network_bandwidth == 1e9 and t.domain_size == 4
    assert t.domain_bandwidth == T.TOPOLOGY_PRESETS["dgx_h100"].domain_bandwidth
    assert missing == ["domain_bandwidth", "domain_latency", "network_latency", "copy_bandwidth"]


# ------------------------------------------------------------------------- simulate


def test_simulate_rows_and_policies():
    program = layoutlang.load(ROOT / "docs" / "snippets" / "plan-hybrid.layout")
    sim = S.simulate(program)
    assert [e.policy for e in sim.estimates] == ["reshard", "gather-and-broadcast", "hybrid"]
    assert all(sim.ratio(e) >= 1 for e in sim.estimates)
    assert sim.assumed  # the snippet gives only the domain size
    sim_h100 = S.simulate(program, topology="gb200_nvl72")
    assert sim_h100.topology.domain_size == 72 and not sim_h100.assumed
    with pytest.raises(LayoutNameError, match="unknown topology 'gb300'"):
        S.simulate(program, topology="gb300")


def run_command(argv: list[str], module=simulate_command) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = module.run(parser.parse_args(argv))
    return status, out.getvalue()


def test_command_table_and_json():
    status, text = run_command([str(EXAMPLES / "tp_to_dp.layout")])
    assert status == 0
    assert "reshard" in text and "gather-and-broadcast" in text and "lower bound" in text
    assert "reshard is 1.8x faster than gather-and-broadcast" in text
    status, text = run_command([str(EXAMPLES / "tp_to_dp.layout"), "--json", "--sequential", "--topology", "dgx_h100"])
    data = json.loads(text)["result"]
    assert data["topology"]["domain_size"] == 8
    assert [p["policy"] for p in data["policies"]] == ["reshard", "gather-and-broadcast"]
    for p in data["policies"]:
        assert p["time_s"] >= data["lower_bound"]["time_s"] and p["sequential_time_s"] >= p["time_s"]
        assert p["ratio_to_lower_bound"] == pytest.approx(p["time_s"] / data["lower_bound"]["time_s"])
        assert p["ratio_to_busiest_port"] == pytest.approx(p["time_s"] / p["busiest_port"]["time_s"])


def test_human_time():
    assert [_text.human_time(t) for t in (0, 14.94, 2.6134, 0.8123, 4.5e-5, 1234.0, 2.5e-9)] == [
        "0 s", "14.9 s", "2.61 s", "812 ms", "45 us", "1234 s", "2.5 ns",
    ]  # fmt: skip


# ------------------------------------------------------------------- the guide's tables

#: the tables the guide "Choosing an inference layout" shows: file, arguments, output
SIM_TABLES = [
    ("deepseek-v3.layout", []),
    ("deepseek-v3.layout", ["--topology", "gb200_nvl72"]),
    ("qwen3-235b.layout", []),
    ("qwen3-235b.layout", ["--topology", "gb200_nvl72"]),
    ("deepseek-v3-ep.layout", []),
    ("deepseek-v3-ep.layout", ["--topology", "gb200_nvl72"]),
    ("qwen3-235b-ep.layout", []),
    ("large-2-4t.layout", []),
    ("m2n-deepseek-v3.layout", []),
]


# ------------------------------------------ stacked and transposed storages cost nothing

_ENGINE_STORAGES = {
    # Megatron's legacy GroupedMLP: weight1 = [gate^T | up^T] per local expert, viewed 2-D
    "megatron": """
    storage "mlp.experts.weight1" as [6, 16] =
        stack e of transposed "experts.{e}.gate_proj.weight" | transposed "experts.{e}.up_proj.weight" along 1
    storage "mlp.experts.weight2" as [8, 6] = stack e of transposed "experts.{e}.down_proj.weight"
""",
    # vLLM's FusedMoE w13_weight / w2_weight
    "vllm": """
    storage "experts.w13_weight" = stack e of "experts.{e}.gate_proj.weight" | "experts.{e}.up_proj.weight"
    storage "experts.w2_weight" = stack e of "experts.{e}.down_proj.weight"
""",
}


def _expert_refit(stacked: set[str]) -> str:
    """Legacy GroupedMLP experts (ep = 2, ranks 0..1) into vLLM's FusedMoE (tp = 2, ranks
    2..3), with the engines' stacked and transposed storages on the sides named in
    ``stacked`` and one storage per tensor on the others."""
    return f"""
    topology {{ domain_size = 2 }}
    mesh train [ep = 2] on ranks 0..1
    mesh infer [tp = 2] on ranks 2..3
    tensor "experts.{{e}}.gate_proj.weight" [4, 6] bf16 for e in 0..3
    tensor "experts.{{e}}.up_proj.weight" [4, 6] bf16 for e in 0..3
    tensor "experts.{{e}}.down_proj.weight" [6, 4] bf16 for e in 0..3
    layout megatron on train {{
        "experts.{{e}}.*": ep[e // 2]
        {_ENGINE_STORAGES["megatron"] if "megatron" in stacked else ""}
    }}
    layout vllm on infer {{
        "experts.{{e}}.gate_proj.weight": tp = shard(0)
        "experts.{{e}}.up_proj.weight": tp = shard(0)
        "experts.{{e}}.down_proj.weight": tp = shard(1)
        {_ENGINE_STORAGES["vllm"] if "vllm" in stacked else ""}
    }}
    reshard megatron -> vllm
    """


def test_stacked_and_transposed_storages_do_not_change_the_estimate():
    """The model counts the bytes and messages of moves, and a move carries a region of a
    logical tensor whatever storage it sits in (packing is outside the model): so the
    engines' stacked and transposed storages give the same estimate as one storage per
    tensor. Every byte crosses the network once (the meshes are in two domains): the
    12 tensors' 24 bf16 elements each."""
    total = 12 * 24 * 2
    results = {}
    for sides in ((), ("megatron",), ("vllm",), ("megatron", "vllm")):
        program = layoutlang.loads(_expert_refit(set(sides)))
        layouts = [program.layout("megatron"), program.layout("vllm")]
        shapes = [layout.storages_on(layout.mesh.ranks[0]) for layout in layouts]
        assert [any(len(shape) == 3 for shape in s.values()) for s in shapes] == [False, "vllm" in sides]
        assert ("mlp.experts.weight1" in shapes[0]) == ("megatron" in sides)
        simulation = S.simulate(program)
        reshard = simulation.estimates[0]
        assert reshard.policy == "reshard" and reshard.bytes["network"] == total
        results[sides] = [(e.policy, e.time, e.bytes, e.messages, e.steps) for e in simulation.estimates]
    first = results[()]
    assert all(r == first for r in results.values())


def _table_file(name: str, args: list[str]) -> Path:
    suffix = "-gb200" if "gb200_nvl72" in args else ""
    return SIM_DOCS / (name.replace(".layout", "") + suffix + ".txt")


def _render(name: str, args: list[str]) -> str:
    previous = os.getcwd()
    os.chdir(SIM_DOCS)
    try:
        status, text = run_command([name, "--sequential", *args])
    finally:
        os.chdir(previous)
    assert status == 0
    return f"$ layoutlang simulate {' '.join([name, '--sequential', *args])}\n{text}"


@pytest.mark.timeout(600)  # the guide's big tables: about 90 s together on 2 cores
@pytest.mark.parametrize("name,args", SIM_TABLES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_guide_tables_are_current(name, args):
    assert _render(name, args) == _table_file(name, args).read_text("utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        for name, args in SIM_TABLES:
            path = _table_file(name, args)
            path.write_text(_render(name, args), "utf-8")
            print(f"updated {path.relative_to(ROOT)}", flush=True)
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))


FP8 = """
topology { domain_size = 1 }
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


def test_a_quantized_destination_is_priced_at_its_wire_bytes(capsys):
    """Each TP rank receives 128 rows of "w" as two 128 x 128 fp8 blocks and their two fp32
    scales (32,768 + 8 bytes), and "n" whole in bf16 (128 bytes); unquantized, "w"'s rows are
    65,536 bf16 bytes. The plan's own statistics count the same wire bytes."""
    program = layoutlang.loads(FP8)
    sim = S.simulate(program)
    reshard = sim.estimates[0]
    assert reshard.bytes["network"] == 2 * (128 * 256 + 2 * 4) + 2 * 64 * 2
    assert sim.unquantized is not None and sim.unquantized.bytes["network"] == 2 * 128 * 256 * 2 + 2 * 64 * 2
    plan = compile_plan(program)
    assert reshard.bytes["network"] == plan.quantization.totals(plan.arrays)["wire_bytes"]["network"]
    assert 0 < sim.quantized_ratio() < 1
    # no plan beats the bound, priced in the same wire bytes (it once read the logical bytes)
    assert sim.bound.time <= reshard.time and sim.bound.volume <= reshard.bytes["network"]
    assert sim.to_json()["quantized_ratio"] == sim.quantized_ratio()
    # a program that quantizes nothing has no comparison
    plain = S.simulate(layoutlang.loads(FP8.replace('quantize "w"', '# quantize "w"')))
    assert plain.unquantized is None and "quantized_ratio" not in plain.to_json()
    assert plain.estimates[0].bytes["network"] == sim.unquantized.bytes["network"]
    from layoutlang.cli.simulate import simulation_report

    (line,) = [line for line in simulation_report(sim) if line.startswith("quantized destination")]
    assert f"({sim.quantized_ratio():.2f}x)" in line


def test_the_comparison_reads_right_both_ways():
    """'0.5x faster' meant twice as slow: a slower reshard says so, and a quantized
    destination's baseline says it moves bf16."""
    from layoutlang.cli.simulate import _comparison

    assert _comparison(1.8, quantized=False) == "reshard is 1.8x faster than gather-and-broadcast"
    assert _comparison(0.5, quantized=False) == "reshard is 2.0x slower than gather-and-broadcast"
    assert _comparison(1.0, quantized=False) == "reshard takes about as long as gather-and-broadcast"
    assert _comparison(2.5, quantized=True) == (
        "reshard is 2.5x faster than gather-and-broadcast of bf16 (it cannot refit the quantized tensors)"
    )


def test_a_refit_into_a_quantized_destination_names_its_bf16_baseline(tmp_path):
    path = tmp_path / "fp8.layout"
    path.write_text(
        "mesh train [dp = 2]\nmesh infer [tp = 2] on ranks 2..3\ntensor \"w\" [4096, 4096] bf16\n"
        "layout fsdp on train { default: dp = shard(0) }\n"
        'layout serve on infer {\n    "w": tp = shard(0)\n'
        '    quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32\n}\n'
        "reshard refit: fsdp -> serve\n"
    )
    status, text = run_command([str(path)])
    assert status == 0
    assert "gather-and-broadcast of bf16 (it cannot refit the quantized tensors)" in text
    assert "quantized destination:" in text
