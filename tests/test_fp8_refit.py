"""Refits into FP8 destinations on real processes (gloo over loopback, one worker per rank).

The sources are bf16 training layouts (tensor parallel with uneven shards, pipeline and
expert parallel); the destinations store 128 x 128 block FP8, per-channel FP8 and MXFP8,
with shapes whose dims are and are not multiples of the block (partial edge blocks), and
source shards that keep whole blocks (quantized by the sender) and that split them
(assembled and quantized on the destination). Every destination byte, values and scales,
is compared with the independent reference of tests/test_quantize.py: torch's own casts
of the whole tensor in one process. Bad input is refused with a LayoutError naming the
tensor before any plan is made.
"""

from __future__ import annotations

import json
import re

import fp8_refit_jobs as jobs
import numpy as np
import pytest
import torch
from test_quantize import reference

import layoutlang
from layoutlang.errors import LayoutError
from layoutlang.io.weights import synthetic_box
from layoutlang.plan import compile_plan
from layoutlang.plan.quantized import quantized_regions
from layoutlang.runtime.schedule import OWN_TRANSFER_BYTES, schedule

TP = """
topology { domain_size = 2 }
mesh train [tp = 3]
mesh infer [tp = 2, dp = 2] on ranks 4..7
tensor "w" [511, 200] bf16
tensor "v" [256, 384] bf16
tensor "o" [300, 96] bf16
tensor "m" [130, 100] bf16
tensor "n" [10] bf16
layout train on train {
  default: replicate
  "w": tp = shard(0)
  "v": tp = shard(1)
  "o": tp = shard(1)
  "m": tp = shard(0)
}
layout serve on infer {
  default: replicate
  "w": tp = shard(0)
  "v": tp = shard(0)
  "o": tp = shard(0)
  "m": tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
  quantize "v" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
  quantize "o" as fp8_e4m3 per_channel scale_inv fp32
  quantize "m" as mxfp8 blocks 1 x 32 scale_inv e8m0
}
reshard refit: train -> serve
"""

PP_EP = """
mesh train [pp = 2, ep = 2]
mesh infer [tp = 2] on ranks 4..5
tensor "layers.{l}.experts.{e}.w" [200, 256] bf16 for l in 0..1, e in 0..3
tensor "layers.{l}.dense" [511, 130] bf16 for l in 0..1
layout train on train {
  "layers.{l}.experts.{e}.w": pp[l], ep[e // 2]
  "layers.{l}.dense": pp[l], ep = shard(0)
}
layout serve on infer {
  "layers.{l}.experts.{e}.w": tp[e % 2]
  "layers.{l}.dense": tp = shard(0)
  quantize "*.experts.*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
  quantize "*.dense" as fp8_e5m2 blocks 128 x 128 scale fp32
}
reshard refit: train -> serve
"""

# vLLM's FusedMoE parameter: every expert's gate | up stacked in one w13 storage per rank, its
# scales stacked alike (w13_scale_inv [experts, 2, 2]); from EP training where gate is split
# by columns, 100 of 200 (its blocks assembled on the destination), up whole on its rank
STACKED = """
mesh train [ep = 2]
mesh infer [tp = 2] on ranks 2..3
tensor "experts.{e}.gate" [256, 200] bf16 for e in 0..3
tensor "experts.{e}.up" [256, 200] bf16 for e in 0..3
layout train on train {
  "experts.{e}.gate": ep = shard(1)
  "experts.{e}.up": ep[e // 2]
}
layout serve on infer {
  default: tp = shard(0)
  storage "w13" = stack e of "experts.{e}.gate" | "experts.{e}.up"
  quantize "experts.*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: train -> serve
"""

# Regions of at least 1 MiB travel as two transfers each, the values and then their scales
# (schedule.Message.transfers): "rows" lands its values in place (whole rows of the
# destination storage), "cols" stages them (half of each row); domains of 2 relay the
# replicas' values and scales part by part.
LARGE = """
topology { domain_size = 2 }
mesh train [tp = 2]
mesh infer [tp = 2, dp = 2] on ranks 4..7
tensor "cols" [4096, 1024] bf16
tensor "rows" [1024, 4096] bf16
tensor "small" [256, 256] bf16
layout train on train {
  "cols": tp = shard(1)
  "rows": tp = shard(0)
  "small": tp = shard(0)
}
layout serve on infer {
  "cols": tp = shard(0)
  "rows": tp = shard(1)
  "small": tp = shard(1)
  quantize "*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: train -> serve
"""

CASES = {"tp_uneven": TP, "pp_ep": PP_EP, "stacked": STACKED, "large_regions": LARGE}


def participants_of(text: str) -> list[int]:
    program = layoutlang.loads(text)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))

pytestmark = [pytest.mark.timeout(300), pytest.mark.workers(8)]


def expected(program: layoutlang.Program, rank: int) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """Per destination storage of ``rank``: (index in the storage, expected bytes) of every
    box and scale box, from the whole tensor quantized by the torch reference."""
    plan_destination = program.layout(program.reshard().destination)
    source = program.layout(program.reshard().source)
    quantized = plan_destination.quantized()
    out: dict[str, list] = {}
    for index, (name, tensor) in enumerate(source.tensors.items()):
        whole = synthetic_box(index, tensor.shape, tensor.dtype, (0,) * len(tensor.shape), tensor.shape)
        q = quantized.get(name)
        if q is not None:
            values, scales = reference(whole, q.format, q.block, q.convention)
        else:
            values, scales = whole, None
        for box in plan_destination.boxes(name, rank):
            region = values[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            out.setdefault(box.storage, []).append((box.storage_index(), region))
        if q is not None:
            for box in plan_destination.scale_boxes(name, rank):
                region = scales[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                out.setdefault(box.storage, []).append((box.storage_index(), region))
    return out


def check(text: str, results: list) -> int:
    """Every destination byte equals the reference; returns the bytes compared."""
    program = layoutlang.loads(text)
    destination = program.layout(program.reshard().destination)
    compared = 0
    by_rank = {r["rank"]: r for r in results if r}
    for rank in destination.mesh.ranks:
        result = by_rank[rank]
        assert result["error"] is None, result["error"]
        for storage, places in expected(program, rank).items():
            dtype_name, raw = result["storages"][storage]
            for index, want in places:
                got = raw.view(getattr(torch, dtype_name.removeprefix("torch.")))[index]
                assert got.dtype == want.dtype, (storage, got.dtype, want.dtype)
                same = torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
                assert same, f"rank {rank}: {storage}{index} differs from the reference"
                compared += want.numel() * want.element_size()
    return compared


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["fleet", "pairwise"])
def test_every_destination_byte_equals_the_reference(pool, name, mode):
    text = CASES[name]
    results = pool.run(jobs.refit_fp8, text, participants_of(text), mode)
    assert check(text, results) > 0


def test_large_regions_travel_as_values_then_scales_and_land_in_place(pool):
    """Both ends cut a region of at least 1 MiB into its values, then its scales, alike; a
    receiver whose region is whole rows of its fp8 storage receives the values there."""
    plan = compile_plan(layoutlang.loads(LARGE))
    names = list(plan.tensors)
    for rank in plan.destination.mesh.ranks:
        receiving = [t for step in schedule(plan, rank) for t in step.recv_transfers]
        for t in receiving:
            large = t.pieces[0].quantized is not None and t.pieces[0].nbytes >= OWN_TRANSFER_BYTES
            assert (t.part != "") == (len(t.pieces) == 1 and large), (rank, t)
        parts = [(names[t.pieces[0].tensor], t.part) for t in receiving if t.part]
        assert parts[0::2] == [(n, "values") for n, _ in parts[1::2]]  # each region's values, then its scales
        assert {n for n, _ in parts} == {"cols", "rows"}
    results = pool.run(jobs.refit_fp8, LARGE, participants_of(LARGE))
    assert check(LARGE, results) > 0
    in_place = {r["rank"]: r["received_in_place"] for r in results if r and r["rank"] in plan.destination.mesh}
    # every destination rank holds [1024, 2048] of "rows": its fp8 values arrive where they lie
    assert in_place == dict.fromkeys(plan.destination.mesh.ranks, 1024 * 2048), in_place


def test_small_buckets_cut_slabs_on_block_rows(pool):
    """A budget of a few block rows: slabs end on multiples of 128 rows, so the sender still
    quantizes them, and the bytes still equal the reference."""
    text = CASES["tp_uneven"]
    results = pool.run(jobs.refit_fp8, text, participants_of(text), None, 128 * 200 * 2 * 2 + 1000)
    assert check(text, results) > 0


def test_the_sender_quantizes_whole_blocks_and_the_network_carries_fp8():
    plan = compile_plan(layoutlang.loads(TP))
    moves = {m.tensor: m for m in plan.moves() if m.kind == "network"}
    assert moves["v"].quantized == "source"  # 128-column shards: whole blocks at the source
    assert moves["w"].quantized == "destination"  # 171-row shards split 128-row blocks
    assert moves["o"].quantized == "destination"  # column shards split the per-channel rows
    assert moves["m"].quantized == "source"  # row shards keep MX blocks (1 x 32) whole
    assert moves["n"].quantized == "none"
    v = moves["v"]
    assert v.wire_bytes == -(-(v.nbytes // 2) // 16) * 16 + 4 * (v.sizes[0] // 128) * (v.sizes[1] // 128)
    totals = plan.to_json(moves=False)["stats"]["quantization"]
    assert totals["logical_bytes"]["network"] == plan.stats.bytes["network"]
    assert totals["wire_bytes"]["network"] < totals["logical_bytes"]["network"]


SERVE_W = 'layout serve on infer {\n  default: replicate\n  "w": tp = shard(0)'


@pytest.mark.parametrize(
    "old, new, policy, message",
    [
        # the destination shards w's columns, 100 of 200 each: no rank holds a 128-column block
        (SERVE_W, SERVE_W.replace("shard(0)", "shard(1)"), None, r"tensor 'w' in layout 'serve': rank 4 .* cuts"),
        (
            'quantize "v" as fp8_e4m3 blocks 128 x 128 scale_inv fp32',
            'quantize "v" as fp8_e4m3 blocks 128 x 128 scale_inv fp32 into "v_scales" [2, 2]',
            None,
            r"scale storage 'v_scales' of tensor 'v' .* the blocks make it \[1, 3\]",
        ),
        ('quantize "o" as fp8_e4m3', 'quantize "o" as fp8_e4m4', None, r"unsupported format 'fp8_e4m4'.*'o'"),
        ("reshard refit: train -> serve", "reshard back: serve -> train", None, "dequantize nothing"),
    ],
)
def test_bad_input_is_refused_naming_the_tensor(old, new, policy, message):
    """Refused by compile_plan, before any executor exists (so before any byte moves)."""
    text = TP.replace(old, new, 1) if old else TP
    assert text != TP or policy
    with pytest.raises(LayoutError, match=message):
        compile_plan(layoutlang.loads(text), policy=policy)


def test_fp8_network_bytes_are_at_most_051_of_bf16_on_a_deepseek_v3_layer_set():
    """The benchmark's layer set (DeepSeek-V3's MLA attention, routed and shared experts at
    their real shapes): the plan statistics of the FP8 refit against the bf16 refit's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_fp8_refit import layer_set

    program = layoutlang.loads(layer_set(4))
    bf16, fp8 = compile_plan(program, "bf16"), compile_plan(program, "fp8")
    assert fp8.quantization is not None
    totals = fp8.quantization.totals(fp8.arrays)
    assert totals["logical_bytes"]["network"] == bf16.stats.bytes["network"] > 0
    assert totals["wire_bytes"]["network"] <= 0.51 * bf16.stats.bytes["network"]
    assert totals["moves_quantized_at"]["destination"] == 0  # every block whole on its sender


def test_the_broadcast_baseline_is_planned_in_bf16_and_refused_by_the_executor():
    """``layoutlang plan`` compares with gather-and-broadcast: its plan is the bf16 one (no
    region quantized); running it into fp8 storages is refused before any byte moves."""
    from layoutlang.runtime.executor import Executor

    plan = compile_plan(layoutlang.loads(TP), policy="broadcast")
    assert plan.quantization is not None and not plan.quantization.at.any()
    with pytest.raises(LayoutError, match=r"tensor 'w' is stored quantized .* broadcast policy"):
        Executor(plan, 0, transport=None)  # type: ignore[arg-type]


SLABS = """
mesh train [tp = 1]
mesh infer [dp = 2] on ranks 1..2
tensor "w" [1000, 256] bf16
layout train on train { default: replicate }
layout serve on infer {
  default: replicate
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: train -> serve
"""
SLAB_BUDGET = 300 * 256 * 2  # 300 rows a slab: cut where blocks end, at 256, 512, 768


@pytest.mark.parametrize("mode", ["fleet", "pairwise"])
def test_slabs_are_cut_where_blocks_end(mode):
    plan = compile_plan(layoutlang.loads(SLABS), bucket_bytes=SLAB_BUDGET, mode=mode)
    rows = sorted({(m.offsets[0], m.sizes[0]) for m in plan.moves()})
    assert rows == [(0, 256), (256, 256), (512, 256), (768, 232)]
    assert {m.quantized for m in plan.moves()} == {"source"}
    # the same budget into bf16 cuts every 300 rows, through blocks
    bf16 = SLABS.replace('  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32\n', "")
    plain = compile_plan(layoutlang.loads(bf16), bucket_bytes=SLAB_BUDGET, mode=mode)
    assert sorted({(m.offsets[0], m.sizes[0]) for m in plain.moves()}) == [(0, 300), (300, 300), (600, 300), (900, 100)]


def test_block_aligned_slabs_move_every_byte_right(pool):
    results = pool.run(jobs.refit_fp8, SLABS, participants_of(SLABS), None, SLAB_BUDGET)
    assert check(SLABS, results) > 0


def test_a_quantized_plan_reads_back_from_its_binary_form():
    from layoutlang.plan import load_plan

    program = layoutlang.loads(TP)
    plan = compile_plan(program)
    back = load_plan(plan.to_bytes(), program)
    assert back.fingerprint == plan.fingerprint
    assert back.quantization is not None and plan.quantization is not None
    assert (back.quantization.wire_bytes == plan.quantization.wire_bytes).all()
    bf16 = TP.split("  quantize")[0] + "}\nreshard refit: train -> serve\n"
    assert compile_plan(layoutlang.loads(bf16)).fingerprint != plan.fingerprint


@pytest.mark.parametrize(
    "mutate, message",
    [
        (("w", "bf16"), r"storage 'w' is torch.bfloat16, layout 'serve' holds torch.float8_e4m3fn \(it stores"),
        (("w_scale_inv", "drop"), r"scale storage 'w_scale_inv' \(layout 'serve', \[2, 2\] torch.float32\) is missing"),
    ],
)
def test_bad_fp8_storages_stop_every_rank_before_any_byte_moves(pool, mutate, message):
    results = [r for r in pool.run(jobs.refit_fp8, TP, participants_of(TP), None, None, 10.0, mutate) if r]
    assert results and all(r["error"] is not None for r in results)
    assert any(re.search(message, r["error"]) for r in results), [r["error"] for r in results]


# One sender feeding four replicas over fast links: quantizing everything it sends would make
# the sender the slowest rank, so the cost model quantizes on the destinations.
FAN = """
topology fan {{
  domain_size = 1
  network_bandwidth = {network} GB/s
  quantize_bandwidth = 3 GB/s
}}
mesh train [tp = 1]
mesh infer [dp = 4] on ranks 1..4
tensor "w" [1024, 1024] bf16
tensor "v" [512, 256] bf16
layout train on train {{ default: replicate }}
layout serve on infer {{
  default: replicate
  quantize "*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}}
reshard refit: train -> serve
"""


@pytest.mark.parametrize("network, expected", [(50, "destination"), (1, "source")])
def test_the_cost_model_weighs_links_against_quantizing(network, expected):
    program = layoutlang.loads(FAN.format(network=network))
    plan = compile_plan(program)
    assert plan.quantize_at == expected, plan.quantize_reason
    # the model re-derived: the sender sends both tensors to 4 replicas; over the link they
    # cross as fp8 values and scales (quantized by the sender) or as bf16
    logical = 4 * (1024 * 1024 + 512 * 256) * 2
    fp8 = 4 * (1024 * 1024 + 8 * 8 * 4 + 512 * 256 + 4 * 2 * 4)
    at_source = max(logical / 3e9, fp8 / (network * 1e9))
    at_destination = max(logical / (network * 1e9), logical / 4 / 3e9)
    assert (at_destination < at_source) == (expected == "destination")
    assert f"{at_source:.3g} s quantizing at the senders" in plan.quantize_reason
    assert f"{at_destination:.3g} s at the destinations" in plan.quantize_reason
    at = plan.quantization.totals(plan.arrays)["moves_quantized_at"]
    assert at == ({"source": 0, "destination": 8} if expected == "destination" else {"source": 8, "destination": 0})
    for move in plan.moves():  # what crosses: bf16 to be quantized there, or fp8 from the sender
        assert move.quantized == expected and (move.wire_bytes == move.nbytes) == (expected == "destination")
    # the regions the plan keeps (the cost model's, where it chose the senders) are its own
    fresh = quantized_regions(plan.source, plan.destination, plan.arrays, plan.policies, expected == "destination")
    assert np.array_equal(fresh.at, plan.quantization.at)
    assert np.array_equal(fresh.wire_bytes, plan.quantization.wire_bytes)


def test_asked_for_pairwise_and_undeclared_quantizing_keep_or_set_the_side():
    program = layoutlang.loads(FAN.format(network=50))
    assert compile_plan(program, quantize_at="source").quantize_at == "source"
    assert compile_plan(program, quantize_at="destination").quantize_reason.endswith("(quantize_at='destination')")
    pairwise = compile_plan(program, mode="pairwise")
    assert pairwise.quantize_at == "source" and "pairwise" in pairwise.quantize_reason
    undeclared = layoutlang.loads(FAN.format(network=50).replace("  quantize_bandwidth = 3 GB/s\n", ""))
    plan = compile_plan(undeclared)
    assert plan.quantize_at == "source" and "no quantize_bandwidth" in plan.quantize_reason
    with pytest.raises(LayoutError, match="unknown quantize_at 'middle'"):
        compile_plan(program, quantize_at="middle")


def test_a_plan_quantized_on_the_destinations_reads_back_and_differs_from_the_senders():
    from layoutlang.plan.serialize import load_plan

    program = layoutlang.loads(FAN.format(network=50))
    plan = compile_plan(program)
    back = load_plan(plan.to_bytes(), program)
    assert back.quantize_at == "destination" and back.fingerprint == plan.fingerprint
    assert compile_plan(program, quantize_at="source").fingerprint != plan.fingerprint


def test_the_plan_command_says_where_and_why(tmp_path, capsys):
    from layoutlang.cli.main import main

    path = tmp_path / "fan.layout"
    path.write_text(FAN.format(network=50))
    assert main(["plan", str(path), "--no-compare", "--explain", "w", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "where: the destinations quantize (cost model): the slowest rank takes" in out
    assert "(bucket 0, stage 0, quantized on the destination)" in out
    assert main(["plan", str(path), "--no-compare", "--quantize-at", "source"]) == 0
    assert "where: the senders quantize: asked for (quantize_at='source')" in capsys.readouterr().out
    assert main(["plan", str(path), "--no-compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert result["quantize_at"] == "destination" and result["quantize_reason"].startswith("the destinations quantize")


def test_regions_quantized_on_the_destinations_equal_the_reference(pool):
    text = FAN.format(network=50)
    assert compile_plan(layoutlang.loads(text)).quantize_at == "destination"
    results = pool.run(jobs.refit_fp8, text, participants_of(text))
    assert check(text, results) > 0
    sent = next(r for r in results if r and r["rank"] == 0)["sent"]["network"]
    assert sent == 4 * (1024 * 1024 + 512 * 256) * 2  # bf16 crossed, to be quantized there


def test_the_cost_model_counts_a_relays_forwarding_as_no_quantizing():
    """With domains, relays forward what their domain's first receiver got: under the senders'
    choice only moves read from the source are quantized (by their sender), under the
    destinations' only moves written into a destination storage (by their receiver)."""
    text = LARGE.replace(
        "topology { domain_size = 2 }",
        "topology { domain_size = 2  network_bandwidth = 10 GB/s  domain_bandwidth = 100 GB/s  "
        "quantize_bandwidth = 3 GB/s }",
    )
    plan = compile_plan(layoutlang.loads(text), quantize_at="source")
    moves = list(plan.moves())
    assert any(m.is_relay and m.quantized == "source" for m in moves)  # the case is there
    bandwidth = {"network": 10e9, "domain": 100e9}

    def slowest(quantizer: str) -> float:
        busiest: dict[int, float] = {}
        for m in moves:
            rank = m.src if quantizer == "sender" else m.dst
            reads = m.src_space == "source" if quantizer == "sender" else m.dst_space == "destination"
            if m.quantized == "source" and reads:
                busiest[rank] = busiest.get(rank, 0.0) + m.nbytes / 3e9
        links: dict[tuple[int, str, str], float] = {}
        for m in moves:
            carried = m.wire_bytes if quantizer == "sender" and m.wire_bytes is not None else m.nbytes
            if m.kind in bandwidth:
                for end, way in ((m.src, "out"), (m.dst, "in")):
                    links[(end, m.kind, way)] = links.get((end, m.kind, way), 0.0) + carried / bandwidth[m.kind]
        for (rank, _, _), seconds in links.items():
            busiest[rank] = max(busiest.get(rank, 0.0), seconds)
        return max(busiest.values())

    reason = compile_plan(layoutlang.loads(text)).quantize_reason
    assert f"{slowest('sender'):.3g} s quantizing at the senders" in reason, reason
    assert f"{slowest('receiver'):.3g} s at the destinations" in reason, reason
