"""FP8 refits: the bf16 refit vs the FP8 refit vs "bf16 refit, then quantize on the destination".

Two parts, in one invocation:

**Plan statistics** (``--full``, a few minutes): ``deepseek_v3_fp8_refit.layout``, DeepSeek-V3
671B from training PP16 x EP16 (256 ranks) into vLLM-style TP8 x DP32 serving (256 other
ranks), once into bf16 storages (``refit_bf16``) and once into FP8 (``refit_fp8``: every
projection ``float8_e4m3fn`` with an fp32 ``weight_scale_inv`` per 128 x 128 block). Printed:
network and domain bytes of both plans, their ratio (the acceptance: at most 0.51), where
the regions are quantized, and the simulator's estimate on each topology preset
(``layoutlang.plan.simulate.estimate``) of the bf16 plan and of the same moves carrying the
FP8 plan's wire bytes.

**Executed refits** (always): a DeepSeek-V3-shaped layer set at its real shapes (one MLA
attention block, ``--experts`` routed experts and the shared expert of an MoE layer: 0.76
GiB of bf16 with 4 experts), from expert parallel training (``ep = 2``: experts whole on their
rank, attention sharded by rows but for the 576-row ``kv_a_proj_with_mqa``) into TP2 serving
on two other ranks, on 4 local gloo workers (``LocalWorkers``). Methods, round-robin, best of
``--runs`` after one warm-up:

``bf16``
    the refit into bf16 storages (what an engine loading bf16 receives);
``fp8``
    the refit into FP8 storages: senders quantize whole blocks while packing, fp8 values and
    scales cross the network;
``bf16+quantize``
    the bf16 refit, then every destination rank quantizes what it received (the same C++
    quantizer, ``layoutlang.io.quantize.quantize_into``): what frameworks do today.

``--link-gbps G`` caps each link: the benchmark's transport (``RateLimitedTransport``, a
``TorchTransport``) paces every message between two ranks as a link of G Gbit/s in each
direction would: a message to (from) a peer starts when the previous one on that link has
finished and takes ``bytes * 8 / G`` ns; ``wait`` returns when the real transfer is done
and the simulated link has carried it, on both ends. It stands for a network slower than the
loopback (a link per pair of ranks: the bytes a sender sends to two peers share nothing);
without it, the loopback's own speed is the link's. What a refit does while its messages are
on the wire (packing, quantizing the next bucket) overlaps the simulated time as it would
the real one.

Time of a run: all workers meet at a barrier, each times its own part, the run's time is the
maximum over ranks. Bytes: the executor's RunReport (network, summed over ranks). Checked:
every destination byte of ``fp8`` equals that of ``bf16+quantize`` on every rank, and the
network bytes of ``fp8`` are at most 0.51x those of ``bf16``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's layoutlang

import numpy as np
import torch
import torch.distributed as dist

import layoutlang
from layoutlang.io.quantize import quantize_into
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import fill_synthetic

HERE = Path(__file__).resolve().parent
WORLD = 4
GiB = 2**30


def layer_set(experts: int) -> str:
    """One DeepSeek-V3 MoE layer's attention, routed and shared experts, at their real shapes."""
    per = experts // 2
    return f"""
mesh train [ep = 2]
mesh infer [tp = 2] on ranks 2..3
tensor "self_attn.q_a_proj.weight" [1536, 7168] bf16
tensor "self_attn.q_b_proj.weight" [24576, 1536] bf16
tensor "self_attn.kv_a_proj_with_mqa.weight" [576, 7168] bf16
tensor "self_attn.kv_b_proj.weight" [32768, 512] bf16
tensor "self_attn.o_proj.weight" [7168, 16384] bf16
tensor "mlp.experts.{{e}}.gate_proj.weight" [2048, 7168] bf16 for e in 0..{experts - 1}
tensor "mlp.experts.{{e}}.up_proj.weight" [2048, 7168] bf16 for e in 0..{experts - 1}
tensor "mlp.experts.{{e}}.down_proj.weight" [7168, 2048] bf16 for e in 0..{experts - 1}
tensor "mlp.shared_experts.gate_proj.weight" [2048, 7168] bf16
tensor "mlp.shared_experts.up_proj.weight" [2048, 7168] bf16
tensor "mlp.shared_experts.down_proj.weight" [7168, 2048] bf16
tensor "input_layernorm.weight" [7168] bf16
layout megatron on train {{
  default: ep = shard(0)
  "mlp.experts.{{e}}.*": ep[e // {per}]
  # 576 rows: a 288-row shard would split a block (it would be quantized on the destination)
  "self_attn.kv_a_proj_with_mqa.weight": replicate
  "input_layernorm.weight": replicate
}}
layout vllm_bf16 on infer {{
  default: tp = shard(0)
  "self_attn.q_a_proj.weight": replicate
  "self_attn.kv_a_proj_with_mqa.weight": replicate
  "*.o_proj.weight": tp = shard(1)
  "*.down_proj.weight": tp = shard(1)
  "input_layernorm.weight": replicate
}}
layout vllm_fp8 on infer extends vllm_bf16 {{
  quantize "*_proj.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
  quantize "*.kv_a_proj_with_mqa.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}}
reshard bf16: megatron -> vllm_bf16
reshard fp8: megatron -> vllm_fp8
"""


# ----------------------------------------------------------------------- workers

_STATE: dict = {}


def rate_limited_transport(rank: int, link_gbps: float):
    """A TorchTransport whose messages between two ranks are paced as on links of
    ``link_gbps`` Gbit/s, one per direction per pair of ranks (see the module docstring)."""
    from layoutlang.transport import TorchTransport
    from layoutlang.transport.base import Pending

    class _Paced(Pending):
        def __init__(self, inner: Pending, until: float):
            super().__init__(inner.transport, inner.labels, inner.peers)
            self.inner, self.until = inner, until

        def _wait(self, timeout: float) -> None:
            self.inner._wait(timeout)
            delay = self.until - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    class RateLimitedTransport(TorchTransport):
        def __init__(self, rank: int, rank_map: dict[int, int]):
            super().__init__(rank, rank_map)
            self.seconds_per_byte = 8.0 / (link_gbps * 1e9)
            self.free_at: dict[tuple[str, int], float] = {}  # (way, peer) -> when the link is free

        def exchange(self, sends, recvs, tag):  # type: ignore[no-untyped-def]
            pending = super().exchange(sends, recvs, tag)
            now, until = time.perf_counter(), 0.0
            for way, buffers in (("send", sends), ("recv", recvs)):
                for peer, buf in buffers:
                    if peer == self.rank:
                        continue
                    start = max(now, self.free_at.get((way, peer), 0.0))
                    end = self.free_at[(way, peer)] = start + buf.numel() * buf.element_size() * self.seconds_per_byte
                    until = max(until, end)
            return _Paced(pending, until) if until > now else pending

    return RateLimitedTransport(rank, {r: r for r in range(WORLD)})


def setup(text: str, timeout: float, link_gbps: float | None = None) -> dict:
    """Plans, executors and storages of both refits on this worker (kept between runs)."""
    from layoutlang.plan import compile_plan
    from layoutlang.runtime.executor import Executor
    from layoutlang.transport import TorchTransport

    rank = dist.get_rank()
    program = layoutlang.loads(text)
    if link_gbps:
        transport = rate_limited_transport(rank, link_gbps)
    else:
        transport = TorchTransport(rank, {r: r for r in range(WORLD)})
    state = {"rank": rank}
    for name in ("bf16", "fp8"):
        plan = compile_plan(program, name)
        state[name] = Executor(plan, rank, transport, timeout=timeout)
    plan = state["bf16"].plan
    sources = {
        name: torch.empty(shape, dtype=torch_dtype(plan.source.tensors[plan.source.storage(name, rank).parts[0]].dtype))
        for name, shape in (plan.source.storages_on(rank).items() if rank in plan.source.mesh else ())
    }
    fill_synthetic(plan.source, rank, sources)
    state["sources"] = sources
    fp8 = state["fp8"].plan.destination
    if rank in plan.destination.mesh:
        state["bf16_out"] = {
            n: torch.empty(s, dtype=torch.bfloat16) for n, s in plan.destination.storages_on(rank).items()
        }
        quantized = fp8.quantized()
        out, boxes = {}, []
        for n, s in fp8.storages_on(rank).items():
            q = quantized.get(fp8.storage(n, rank).parts[0])
            out[n] = torch.empty(s, dtype=torch.float8_e4m3fn if q is not None else torch.bfloat16)
        for n, s in fp8.scale_storages_on(rank).items():
            out[n] = torch.empty(s, dtype=torch.float32)
        for name, q in quantized.items():
            for box, scale_box in zip(fp8.boxes(name, rank), fp8.scale_boxes(name, rank)):
                boxes.append((box, scale_box, q))
        state["fp8_out"] = out
        state["quantize_out"] = {n: torch.empty_like(t) for n, t in out.items()}
        state["boxes"] = boxes
    _STATE.clear()
    _STATE.update(state)
    return {"rank": rank, "moves": {n: state[n].plan.num_moves for n in ("bf16", "fp8")}}


def run_method(method: str) -> dict:
    s = _STATE
    rank = s["rank"]
    dist.barrier()
    start = time.perf_counter()
    if method == "fp8":
        report = s["fp8"].run(s["sources"], s.get("fp8_out", {}))
    else:
        report = s["bf16"].run(s["sources"], s.get("bf16_out", {}))
        if method == "bf16+quantize" and "boxes" in s:
            received, out = s["bf16_out"], s["quantize_out"]
            for name, t in received.items():  # the unquantized storages are kept as received
                if out[name].dtype == t.dtype:
                    out[name].copy_(t)
            for box, scale_box, q in s["boxes"]:
                quantize_into(
                    received[box.storage][box.storage_index()],
                    out[box.storage][box.storage_index()],
                    out[scale_box.storage][scale_box.storage_index()],
                    q.format, q.block, q.convention,
                )
    seconds = time.perf_counter() - start
    return {"rank": rank, "seconds": seconds, "network": report.sent["network"], "domain": report.sent["domain"]}


def compare() -> dict:
    """Whether every destination byte of the FP8 refit equals bf16 refit + quantize."""
    s = _STATE
    if "fp8_out" not in s:
        return {"rank": s["rank"], "equal": None, "bytes": 0}
    equal, nbytes = True, 0
    for name, t in s["fp8_out"].items():
        other = s["quantize_out"][name]
        equal &= torch.equal(t.view(torch.uint8), other.view(torch.uint8))
        nbytes += t.numel() * t.element_size()
    return {"rank": s["rank"], "equal": equal, "bytes": nbytes}


# ----------------------------------------------------------------------- plan statistics


def plan_statistics(path: Path) -> bool:
    from layoutlang.model.topology import TOPOLOGY_PRESETS
    from layoutlang.plan import Plan, compile_plan
    from layoutlang.plan.data import plan_arrays
    from layoutlang.plan.simulate import estimate

    start = time.perf_counter()
    program = layoutlang.load(path)
    print(f"{path.name}: {len(program.tensors):,} logical tensors, loaded in {time.perf_counter() - start:.1f} s")
    plans = {}
    for name in ("refit_bf16", "refit_fp8"):
        start = time.perf_counter()
        plans[name] = compile_plan(program, name)
        _ = plans[name].stats  # computed inside the timing, as a report would
        print(f"  {name}: compiled in {time.perf_counter() - start:.1f} s, {plans[name].num_moves:,} moves")
    fp8 = plans["refit_fp8"]
    assert fp8.quantization is not None
    totals = fp8.quantization.totals(fp8.arrays)
    bf16 = plans["refit_bf16"].stats.bytes
    rows = [
        ("network", bf16["network"], totals["wire_bytes"]["network"]),
        ("domain", bf16["domain"], totals["wire_bytes"]["domain"]),
    ]
    print(f"  {'bytes':8} {'bf16 refit':>18} {'FP8 refit':>18} {'ratio':>7}")
    for kind, a, b in rows:
        print(f"  {kind:8} {a:>18,} {b:>18,} {b / a if a else 1.0:>7.4f}")
    print(
        f"  regions quantized by their sender: {totals['moves_quantized_at']['source']:,} moves, "
        f"{totals['blocks_quantized_by_senders']:,} blocks; on the destination: "
        f"{totals['moves_quantized_at']['destination']:,} moves"
    )
    # The simulator prices a plan's region bytes: the FP8 plan's moves carrying its wire bytes.
    columns = {name: np.asarray(getattr(fp8.arrays, name)) for name, _ in _columns()}
    columns["region_bytes"] = fp8.quantization.wire_bytes
    wire = plan_arrays(
        columns,
        num_buckets=fp8.num_buckets,
        lower_bound_bytes=int(fp8.arrays.lower_bound_bytes),
        broadcast_payload_bytes=int(fp8.arrays.broadcast_payload_bytes),
    )
    wire_plan = Plan(fp8.source, fp8.destination, "refit_fp8 (wire bytes)", fp8.policies, fp8.domain_size,
                     fp8.bucket_bytes, wire)
    for preset, topology in TOPOLOGY_PRESETS.items():
        if topology.domain_size != fp8.domain_size:  # the plan's domains are the program's
            print(f"  simulated on {preset}: skipped (domains of {topology.domain_size} ranks, the plan's of "
                  f"{fp8.domain_size})")
            continue
        a = estimate(plans["refit_bf16"], topology).time
        b = estimate(wire_plan, topology).time
        print(f"  simulated on {preset}: bf16 refit {a:.2f} s, FP8 refit {b:.2f} s ({b / a:.3f}x)")
    ratio = totals["wire_bytes"]["network"] / bf16["network"]
    ok = ratio <= 0.51
    print(f"  FP8 / bf16 network bytes {ratio:.4f} {'<=' if ok else '>'} 0.51: {'ok' if ok else 'FAILED'}")
    return ok


def _columns():
    from layoutlang.plan.data import _COLUMNS

    return _COLUMNS


# ----------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=4, help="routed experts of the layer set (even)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--full", action="store_true", help="also the plan statistics of DeepSeek-V3 671B")
    parser.add_argument(
        "--link-gbps", type=float, action="append", default=None, metavar="G",
        help="also run with each link capped at G Gbit/s per direction (repeatable); 0: the loopback uncapped",
    )
    args = parser.parse_args(argv)

    ok = True
    if args.full:
        ok &= plan_statistics(HERE / "deepseek_v3_fp8_refit.layout")
    text = layer_set(args.experts)
    program = layoutlang.loads(text)
    total = sum(t.nbytes for t in program.tensors.values())
    print(f"layer set: {len(program.tensors)} tensors, {total / GiB:.2f} GiB bf16; ep = 2 -> tp = 2, 4 gloo workers")
    links = args.link_gbps if args.link_gbps else [0.0]
    summary = []
    for link in links:
        good, ratios = refits(text, link, args)
        ok &= good
        summary.append((link, ratios))
    print(f"\n{'link':>16} {'fp8 / bf16 time':>16} {'fp8 / (bf16+quantize)':>22}")
    for link, (to_bf16, to_quantize) in summary:
        name = f"{link:g} Gbit/s" if link else "loopback"
        print(f"{name:>16} {to_bf16:>15.3f}x {to_quantize:>21.3f}x")
    return 0 if ok else 1


def refits(text: str, link: float, args: argparse.Namespace) -> tuple[bool, tuple[float, float]]:
    """The three methods, round-robin, on links capped at ``link`` Gbit/s (0: uncapped)."""
    from layoutlang.cli.launch import LocalWorkers

    methods = ["bf16", "fp8", "bf16+quantize"]
    best: dict[str, float] = {}
    times: dict[str, list[float]] = {m: [] for m in methods}
    network: dict[str, int] = {}
    print(f"\nlinks: {f'{link:g} Gbit/s each way per pair of ranks' if link else 'the loopback, uncapped'}")
    with LocalWorkers(WORLD, timeout=args.timeout) as pool:
        pool.run(setup, text, args.timeout, link or None)
        for n in range(args.runs + 1):  # the first round warms up
            for method in methods:
                results = pool.run(run_method, method)
                seconds = max(r["seconds"] for r in results)
                network[method] = sum(r["network"] for r in results)
                if n:
                    best[method] = min(best.get(method, seconds), seconds)
                    times[method].append(seconds)
            load = os.getloadavg()[0]
            print(f"  round {n}{' (warm-up)' if n == 0 else ''}: load average {load:.1f}")
        checks = pool.run(compare)
    equal = all(c["equal"] is not False for c in checks)
    print(f"\n{'method':15} {'best time':>10} {'median':>8} {'network bytes':>16} {'vs bf16':>8}")
    for method in methods:
        median = float(np.median(times[method]))
        print(
            f"{method:15} {best[method]:>9.3f}s {median:>7.3f}s {network[method]:>16,} "
            f"{network[method] / network['bf16']:>8.4f}"
        )
    ratio = network["fp8"] / network["bf16"]
    # per round, side by side: the ratio of the same round's fp8 and bf16 times, then their median
    per_round = float(np.median([f / b for f, b in zip(times["fp8"], times["bf16"])]))
    per_round_q = float(np.median([f / b for f, b in zip(times["fp8"], times["bf16+quantize"])]))
    print(f"\nfp8 refit / bf16 refit: {per_round:.3f}x the time (median over rounds of the same round's ratio)")
    print(f"fp8 refit / bf16 refit + quantize: {per_round_q:.3f}x the time")
    print(f"FP8 destinations equal bf16 refit + quantize byte for byte on every rank: {equal}")
    print(f"FP8 / bf16 network bytes {ratio:.4f} (at most 0.51: {'ok' if ratio <= 0.51 else 'FAILED'})")
    return equal and ratio <= 0.51, (per_round, per_round_q)


if __name__ == "__main__":
    sys.exit(main())
