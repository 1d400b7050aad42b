"""How long the C++ plan compiler takes on the scale targets, and what its plans move.

Cases (each runs in a fresh subprocess, so that its peak memory is its own):

``deepseek_v3``
    benchmarks/deepseek_v3_refit.layout: DeepSeek-V3 671B, training PP16 x EP16 on 256
    ranks -> inference TP32 x DP8 on 256 other ranks. Target: the plan compiles in at
    most 2 s on one core.
``qwen3_235b``
    benchmarks/qwen3_235b_refit.layout: Qwen3-235B-A22B, Megatron TP4 x PP8 x EP16 on 512
    ranks -> vLLM TP8 x DP16 on 128 other ranks.
``large_2_4t``
    benchmarks/large_2_4t_refit.layout: a 2.43T-parameter DeepSeek-V3-like MoE, training
    PP16 x EP64 on 1024 ranks -> wide-EP inference (EP64 x TP8 attention x 16 replicas) on
    1024 other ranks. Target: at most 10 s.
``deepseek_v3_stacked``
    benchmarks/deepseek_v3_refit_stacked.layout: the same refit into
    ``preset:deepseek/vllm_fused`` (vLLM's real parameters: per MoE layer one stacked
    ``experts.w13_weight`` and ``experts.w2_weight`` instead of 256 per-expert storages each,
    ``fused_qkv_a_proj``). Target: at most 2 s on one core, as for ``deepseek_v3``.
``large_2_4t_stacked``
    benchmarks/large_2_4t_refit_stacked.layout: the same refit into
    ``preset:deepseek/vllm_fused_ep`` (vLLM's wide expert parallelism, each EP rank's experts
    in one stacked ``w13_weight`` / ``w2_weight`` per layer). Target: at most 10 s.
``qwen3_235b_stacked``
    benchmarks/qwen3_235b_refit_stacked.layout: the same refit into
    ``preset:qwen3_moe/vllm_fused`` (vLLM's stacked w13/w2 FusedMoE parameters).
``qwen3_235b_torchtitan``
    benchmarks/qwen3_235b_refit_torchtitan.layout: stacked on both sides, from torchtitan's
    parameters (``preset:qwen3_moe/torchtitan``: FSDP2 dp 128 x TP4, EP16, stacked
    ``moe.experts.w1/w2/w3``) on 512 ranks into ``preset:qwen3_moe/vllm_fused`` TP8 x DP16
    on 128 other ranks.
``dcp``
    The same layout change planned by torch.distributed.checkpoint's load planner, side by
    side with layoutlang: DCP ``Metadata`` holds one chunk per source replica group (what a
    checkpoint saved from the source layout holds), and each destination rank plans its
    reads with ``DefaultLoadPlanner.create_local_plan`` over a state dict whose values
    report the rank's boxes through DCP's ``__create_chunk_list__`` protocol (the one
    DTensor implements). The bytes DCP reads on every destination rank must equal the bytes
    layoutlang delivers to it (exit status 1 otherwise). DCP plans one rank per call, in
    Python; by default the destination ranks of one inference replica are timed (see
    ``--dcp-ranks``).

For each plan case it prints: logical tensors, parameters, ranks, load and resolve time,
plan compile time (``compile_plan`` end to end, and the C++ ``build_plan`` call alone, best
of ``--repeat``), moves, regions, buckets, bytes by kind, moved bytes, the lower bound and
the ratio to it, messages, the largest per-rank network send and receive, the fingerprint,
validation time, the gather-and-broadcast plan (``policy="broadcast"``) with its moved and
network bytes and their ratios to the reshard plan, and the peak memory (max RSS of the
subprocess, and its growth over the RSS after imports). Run:

    python benchmarks/bench_plan_scale.py [--only NAME[,NAME]] [--skip-dcp] [--skip-broadcast]
    taskset -c 0 python benchmarks/bench_plan_scale.py     # one core

A stacked case is the same refit as its ``base`` case with other destination storages, so
it must move the same regions: when both run, the summary prints them side by side
(``stacked vs unstacked``) and a stacked plan whose moves or bytes by kind differ from its
base's is a failure.

Exit status 1 when a plan is invalid, moves more than the lower bound, is not
deterministic, or DCP and layoutlang disagree on a destination rank's bytes. A missed time
target is printed (``MISSED``) but is not an error: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

PLAN_CASES: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "file": "deepseek_v3_refit.layout",
        "title": "DeepSeek-V3 671B: PP16 x EP16 (256 ranks) -> TP32 x DP8 (256 ranks)",
        "target_s": 2.0,
    },
    "qwen3_235b": {
        "file": "qwen3_235b_refit.layout",
        "title": "Qwen3-235B-A22B: TP4 x PP8 x EP16 (512 ranks) -> TP8 x DP16 (128 ranks)",
        "target_s": None,
    },
    "large_2_4t": {
        "file": "large_2_4t_refit.layout",
        "title": "2.43T MoE: PP16 x EP64 (1024 ranks) -> EP64 x TP8 x DP16 (1024 ranks)",
        "target_s": 10.0,
    },
    "deepseek_v3_stacked": {
        "file": "deepseek_v3_refit_stacked.layout",
        "title": "DeepSeek-V3 671B into preset:deepseek/vllm_fused: PP16 x EP16 (256) -> TP32 x DP8 (256)",
        "target_s": 2.0,
        "base": "deepseek_v3",
    },
    "large_2_4t_stacked": {
        "file": "large_2_4t_refit_stacked.layout",
        "title": "2.43T MoE into preset:deepseek/vllm_fused_ep: PP16 x EP64 (1024) -> 16 x DP8 x TP8 (1024)",
        "target_s": 10.0,
        "base": "large_2_4t",
    },
    "qwen3_235b_stacked": {
        "file": "qwen3_235b_refit_stacked.layout",
        "title": "Qwen3-235B-A22B into preset:qwen3_moe/vllm_fused: TP4 x PP8 x EP16 (512) -> TP8 x DP16 (128)",
        "target_s": None,
        "base": "qwen3_235b",
    },
    "qwen3_235b_torchtitan": {
        "file": "qwen3_235b_refit_torchtitan.layout",
        "title": "Qwen3-235B-A22B, torchtitan FSDP2 x TP4 x EP16 (512) -> vLLM stacked TP8 x DP16 (128)",
        "target_s": None,
    },
}
ALL_CASES = (*PLAN_CASES, "dcp")


# ------------------------------------------------------------------------- helpers


def max_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[Any, list[float]]:
    """Runs ``fn`` ``repeat`` times (dropping each result before the next run, so that two
    never coexist in memory); returns the last result and every time."""
    times = []
    result = None
    for _ in range(repeat):
        result = None
        result, seconds = timed(fn)
        times.append(seconds)
    return result, times


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def tib(n: float) -> str:
    return f"{n / 2**40:,.2f} TiB"


def bytes_str(n: int) -> str:
    return f"{n:,} B ({tib(n)})" if n >= 2**40 else f"{n:,} B ({gib(n)})"


def times_str(times: list[float]) -> str:
    return f"{min(times):.3f} s (best of {len(times)}: {', '.join(f'{t:.3f}' for t in times)})"


class Report:
    """Aligned 'label  value' lines."""

    def __init__(self, title: str):
        print(f"\n== {title}", flush=True)

    def line(self, label: str, value: str) -> None:
        print(f"  {label:<44} {value}", flush=True)


def core_build() -> str:
    """Which build of the C++ core this process runs: its file's SHA-256 prefix and time."""
    import hashlib

    from layoutlang.core import _core

    data = Path(_core.__file__).read_bytes()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(_core.__file__)))
    return f"{hashlib.sha256(data).hexdigest()[:12]} (built {stamp})"


def load_program(path: Path, report: Report, result: dict[str, Any]):
    """Loads the program and resolves (and compiles for the C++ core) the reshard's two layouts.

    A program that includes presets may declare more layouts than its reshard pairs
    (preset:deepseek/vllm_fused_ep brings vllm_fused and vllm_fused_ep_round_robin too); a
    job resolves only the two it plans, so only those are timed (resolution is lazy)."""
    import layoutlang

    program, load_s = timed(lambda: layoutlang.load(path))
    statement = program.reshard()
    source = program.layout(statement.source)
    destination = program.layout(statement.destination)
    resolve_s = {}
    for layout in (source, destination):
        # rules, sub-meshes, storages, then the C++ core's own form
        _, resolve_s[layout.name] = timed(lambda layout=layout: layout.core)
    params = sum(t.numel for t in program.tensors.values())
    nbytes = sum(t.nbytes for t in program.tensors.values())
    report.line("program", f"{path.name}: reshard {statement.name}: {source.name} -> {destination.name}")
    report.line("logical tensors", f"{len(program.tensors):,}")
    report.line("parameters", f"{params:,} ({params / 1e9:,.1f}B, {nbytes / 1e12:.2f} TB)")
    for side, layout in (("source", source), ("destination", destination)):
        ranks = layout.mesh.ranks
        report.line(
            f"{side} mesh",
            f"{layout.mesh.name} {dict(layout.mesh.axes)}: {len(ranks)} ranks ({ranks[0]}..{ranks[-1]})",
        )
    first = destination.mesh.ranks[0]
    shapes = destination.storages_on(first)
    stacked = sum(1 for shape in shapes.values() if len(shape) == 3)
    report.line(
        f"storages on destination rank {first}",
        f"{len(shapes):,} ({stacked:,} of them 3-D)",
    )
    report.line("domain size", str(program.topology.domain_size))
    report.line("C++ core", core_build())
    report.line("load (parse, import, names)", f"{load_s:.3f} s")
    for name, seconds in resolve_s.items():
        report.line(f"resolve layout {name}", f"{seconds:.3f} s")
    total = load_s + sum(resolve_s.values())
    report.line("load + resolve", f"{total:.3f} s")
    result.update(
        core=core_build(),
        file=path.name,
        tensors=len(program.tensors),
        parameters=params,
        source_ranks=len(source.mesh.ranks),
        destination_ranks=len(destination.mesh.ranks),
        load_s=load_s,
        resolve_s=resolve_s,
        load_resolve_s=total,
        destination_storages=len(shapes),
    )
    return program, statement, source, destination


# ---------------------------------------------------------------------- plan cases


def run_plan_case(name: str, args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """One plan case; returns the failures (empty when every check passed)."""
    from layoutlang.core import _core
    from layoutlang.errors import LayoutError
    from layoutlang.plan import DEFAULT_BUCKET_BYTES, compile_plan

    case = PLAN_CASES[name]
    failures: list[str] = []
    rss_start = max_rss_mib()
    report = Report(f"{name}: {case['title']}")
    report.line("cores available to this process", str(len(os.sched_getaffinity(0))))
    program, statement, source, destination = load_program(HERE / case["file"], report, result)
    rss_loaded = max_rss_mib()

    # the whole compile_plan call: per-tensor policies, checks, C++ build, Plan wrapper
    fingerprints: list[str] = []
    plan, compile_times = None, []
    for _ in range(args.repeat):
        plan = None  # never two plans in memory at once
        plan, seconds = timed(lambda: compile_plan(program))
        compile_times.append(seconds)
        if not fingerprints:
            fingerprints.append(plan.fingerprint)  # outside the timed call
    compile_s = min(compile_times)
    report.line("compile_plan (end to end)", times_str(compile_times))

    # the C++ core call alone, on the cores already built
    policies = [_core.Policy[statement.policy_for(t)] for t in source.resolved.names]
    domain = program.topology.domain_size
    _, core_times = best_of(
        args.repeat,
        lambda: _core.build_plan(source.core, destination.core, policies, domain, DEFAULT_BUCKET_BYTES),
    )
    report.line("  of which C++ build_plan", times_str(core_times))
    end_to_end = result["load_resolve_s"] + compile_s
    report.line("load + resolve + compile_plan", f"{end_to_end:.3f} s")
    target = case["target_s"]
    if target is not None:
        for label, seconds in (
            ("plan compile", compile_s),
            ("load + resolve + compile", end_to_end),
        ):
            verdict = "met" if seconds <= target else "MISSED"
            report.line(f"target <= {target:.0f} s ({label})", f"{verdict} ({seconds:.3f} s)")

    stats, stats_s = timed(lambda: plan.stats)
    fingerprint, fingerprint_s = timed(lambda: plan.fingerprint)
    regions = len(plan.arrays.region_tensor)
    report.line("moves", f"{plan.num_moves:,} ({', '.join(f'{k} {v:,}' for k, v in stats.moves.items())})")
    report.line("regions", f"{regions:,}")
    report.line(
        "buckets",
        f"{plan.num_buckets:,} (budget {plan.bucket_bytes / 2**20:,.0f} MiB per rank and bucket)",
    )
    for kind, n in stats.bytes.items():
        report.line(f"bytes {kind}", bytes_str(n))
    report.line("moved (domain + network)", bytes_str(stats.moved))
    report.line("lower bound", bytes_str(stats.lower_bound))
    report.line("ratio to lower bound", f"{stats.ratio_to_lower_bound:.6f}")
    report.line("messages", f"{stats.messages:,}")
    send, send_rank = stats.largest_network_send
    receive, receive_rank = stats.largest_network_receive
    report.line("largest network send", f"{gib(send)} (rank {send_rank})")
    report.line("largest network receive", f"{gib(receive)} (rank {receive_rank})")
    report.line("statistics (plan_totals)", f"{stats_s:.3f} s")
    report.line("fingerprint", f"{fingerprint[:16]} ({fingerprint_s:.3f} s)")
    if fingerprint != fingerprints[0]:
        failures.append(f"{name}: two compiles of the same program gave different plans")
    if stats.moved != stats.lower_bound:
        failures.append(f"{name}: moved {stats.moved:,} B != lower bound {stats.lower_bound:,} B")

    try:
        _, validate_s = timed(plan.validate)
        report.line("validate (every byte once, reads held)", f"{validate_s:.3f} s: ok")
    except LayoutError as err:
        validate_s = None
        report.line("validate", f"FAILED: {str(err)[:300]}")
        failures.append(f"{name}: validate() failed: {str(err)[:300]}")
    rss_plan = max_rss_mib()

    result.update(
        compile_s=compile_s,
        compile_times=compile_times,
        end_to_end_s=end_to_end,
        core_s=min(core_times),
        core_times=core_times,
        target_s=target,
        moves=plan.num_moves,
        regions=regions,
        buckets=plan.num_buckets,
        bytes=stats.bytes,
        moved=stats.moved,
        lower_bound=stats.lower_bound,
        ratio=stats.ratio_to_lower_bound,
        messages=stats.messages,
        largest_network_send=[send, send_rank],
        largest_network_receive=[receive, receive_rank],
        stats_s=stats_s,
        fingerprint=fingerprint,
        validate_s=validate_s,
    )
    plan = None

    if not args.skip_broadcast:
        baseline, broadcast_s = timed(lambda: compile_plan(program, policy="broadcast"))
        b = baseline.stats
        report.line("gather-and-broadcast plan", f"{broadcast_s:.3f} s to compile")
        report.line("  moves, buckets", f"{baseline.num_moves:,}, {baseline.num_buckets:,}")
        report.line(
            "  moved (domain + network)",
            f"{bytes_str(b.moved)}: {b.moved / stats.moved:,.1f}x the reshard plan",
        )
        report.line(
            "  network",
            f"{bytes_str(b.bytes['network'])}: {b.bytes['network'] / stats.bytes['network']:,.1f}x the reshard plan",
        )
        report.line("  local (extraction)", bytes_str(b.bytes["local"]))
        report.line(
            "  largest network receive",
            f"{gib(b.largest_network_receive[0])} (rank {b.largest_network_receive[1]})",
        )
        result.update(
            broadcast_s=broadcast_s,
            broadcast_moves=baseline.num_moves,
            broadcast_bytes=b.bytes,
            broadcast_moved=b.moved,
            broadcast_moved_ratio=b.moved / stats.moved,
            broadcast_network_ratio=b.bytes["network"] / stats.bytes["network"],
        )
        baseline = None
    rss_end = max_rss_mib()

    report.line("max RSS after imports", f"{rss_start:,.0f} MiB")
    report.line("max RSS after load + resolve", f"{rss_loaded:,.0f} MiB (+{rss_loaded - rss_start:,.0f})")
    report.line(
        "max RSS after reshard plan + validate",
        f"{rss_plan:,.0f} MiB (+{rss_plan - rss_start:,.0f})",
    )
    if not args.skip_broadcast:
        report.line("max RSS after broadcast plan", f"{rss_end:,.0f} MiB (+{rss_end - rss_start:,.0f})")
    result.update(
        rss_start_mib=rss_start,
        rss_loaded_mib=rss_loaded,
        rss_plan_mib=rss_plan,
        rss_end_mib=rss_end,
    )
    return failures


# ----------------------------------------------------------------------------- DCP


class _ChunkedValue:
    """A state-dict value for DCP's load planner: the global size and this rank's chunks,
    through ``__create_chunk_list__``, the protocol DTensor implements for DCP."""

    __slots__ = ("_chunks", "_size")

    def __init__(self, size, chunks):
        self._size = size
        self._chunks = chunks

    def size(self):
        return self._size

    def __create_chunk_list__(self):
        return self._chunks


def run_dcp(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from layoutlang.model.dtypes import DTYPES
    from layoutlang.plan import compile_plan

    failures: list[str] = []
    rss_start = max_rss_mib()
    case = PLAN_CASES[args.dcp_case]
    report = Report(f"dcp: torch.distributed.checkpoint's load planner vs layoutlang on {args.dcp_case}")
    report.line("cores available to this process", str(len(os.sched_getaffinity(0))))
    program, _, source, destination = load_program(HERE / case["file"], report, result)
    names = source.resolved.names

    plan, compile_times = best_of(args.repeat, lambda: compile_plan(program))
    compile_s = min(compile_times)
    report.line("layoutlang compile_plan (all ranks)", times_str(compile_times))
    stats = plan.stats

    # the destination ranks DCP plans for
    dest_mesh = destination.mesh
    if args.dcp_ranks == "all":
        ranks = list(dest_mesh.ranks)
        what = f"all {len(ranks)} destination ranks"
    elif args.dcp_ranks is None:
        per_replica = dest_mesh.size // dest_mesh.shape[0]
        ranks = list(dest_mesh.ranks[:per_replica])
        what = (
            f"the {per_replica} destination ranks of one replica ({dest_mesh.axis_names[0]} = 0: "
            f"ranks {ranks[0]}..{ranks[-1]}) of {dest_mesh.size}"
        )
    else:
        ranks = list(dest_mesh.ranks[: int(args.dcp_ranks)])
        what = f"the first {len(ranks)} destination ranks ({ranks[0]}..{ranks[-1]}) of {dest_mesh.size}"
    report.line("DCP plans for", what)

    # the checkpoint: one chunk per source replica group of every tensor
    def checkpoint_metadata() -> Metadata:
        entries = {}
        core = source.core
        for index, fqn in enumerate(names):
            tensor = program.tensors[fqn]
            chunks = {}
            for rank in core.holders(index):
                for box in core.boxes(index, rank):
                    chunks.setdefault((tuple(box.offsets), tuple(box.sizes)), None)
            entries[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, DTYPES[tensor.dtype][1])),
                torch.Size(tensor.shape),
                [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
            )
        return Metadata(entries)

    metadata, metadata_s = timed(checkpoint_metadata)
    saved_chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
    report.line(
        "checkpoint metadata (setup, not timed)",
        f"{saved_chunks:,} chunks, built in {metadata_s:.3f} s",
    )

    itemsize = {fqn: DTYPES[program.tensors[fqn].dtype][0] for fqn in names}
    dest_index = destination.resolved.index

    def state_dict_of(rank: int) -> dict[str, _ChunkedValue]:
        core = destination.core
        out = {}
        for fqn in names:
            index = dest_index[fqn]
            boxes = core.boxes(index, rank)
            if boxes:
                out[fqn] = _ChunkedValue(
                    torch.Size(program.tensors[fqn].shape),
                    [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes],
                )
        return out

    build_s = 0.0
    plan_times: list[float] = []
    read_items = 0
    mismatches = []
    dcp_total = 0
    ll_total = 0
    for rank in ranks:
        state_dict, seconds = timed(lambda rank=rank: state_dict_of(rank))
        build_s += seconds
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        # set_up_planner would first run _init_state_dict, which materializes meta tensors and
        # maps any value that is not a Tensor, DTensor or ShardedTensor to None; these values
        # are already materialized chunk lists, so set the planner's inputs directly.
        planner.state_dict = state_dict
        planner.original_state_dict = state_dict
        planner.metadata = metadata
        planner.is_coordinator = False
        local_plan, seconds = timed(planner.create_local_plan)
        plan_times.append(seconds)
        read_items += len(local_plan.items)
        dcp_bytes = sum(math.prod(item.lengths) * itemsize[item.dest_index.fqn] for item in local_plan.items)
        received = stats.per_rank[rank]["received"]
        ll_bytes = sum(received.values())
        dcp_total += dcp_bytes
        ll_total += ll_bytes
        if dcp_bytes != ll_bytes:
            mismatches.append((rank, dcp_bytes, ll_bytes))
        state_dict = planner = local_plan = None

    import statistics

    dcp_sum = sum(plan_times)
    dcp_min = min(plan_times)
    dcp_median = statistics.median(plan_times)
    dcp_mean = dcp_sum / len(ranks)
    extrapolated = len(ranks) < dest_mesh.size
    # every rank does the same kind of work, so the median rank stands for one rank (and is
    # robust to other processes taking the core for a while)
    dcp_all = dcp_median * dest_mesh.size if extrapolated else dcp_sum
    report.line("state dicts of those ranks (setup)", f"{build_s:.3f} s")
    report.line(
        "DCP create_local_plan, per rank",
        f"min {dcp_min:.3f} s, median {dcp_median:.3f} s, mean {dcp_mean:.3f} s, max {max(plan_times):.3f} s",
    )
    report.line(
        f"DCP create_local_plan, {len(ranks)} ranks",
        f"{dcp_sum:.3f} s in all, {read_items:,} read items",
    )
    if extrapolated:
        report.line(
            f"DCP, all {dest_mesh.size} ranks (median x ranks)",
            f"{dcp_all:.1f} s (extrapolated)",
        )
    report.line(
        "ratio DCP one rank / layoutlang all ranks",
        f"{dcp_median / compile_s:.2f}x (median rank; fastest rank {dcp_min / compile_s:.2f}x)",
    )
    report.line(
        f"ratio DCP {dest_mesh.size} ranks / layoutlang",
        f"{dcp_all / compile_s:.1f}x" + (" (extrapolated)" if extrapolated else ""),
    )
    import numpy as np

    moves_in = int(np.isin(np.asarray(plan.arrays.move_dst), ranks).sum())
    report.line("layoutlang moves into those ranks", f"{moves_in:,}")
    report.line("bytes DCP reads on those ranks", bytes_str(dcp_total))
    report.line("bytes layoutlang delivers to them", bytes_str(ll_total))
    all_received = sum(sum(stats.per_rank[r]["received"].values()) for r in dest_mesh.ranks)
    report.line(
        "layoutlang, every destination rank",
        f"{bytes_str(all_received)} = lower bound {stats.lower_bound:,} + local {stats.bytes['local']:,}",
    )
    if all_received != stats.lower_bound + stats.bytes["local"]:
        failures.append("dcp: layoutlang's received bytes are not lower bound + local bytes")
    if mismatches:
        rank, a, b = mismatches[0]
        report.line(
            "per-rank agreement",
            f"FAILED on {len(mismatches)} ranks, e.g. rank {rank}: DCP {a:,} B, layoutlang {b:,} B",
        )
        failures.append(
            f"dcp: {len(mismatches)} destination ranks disagree, e.g. rank {rank}: DCP {a:,} B vs layoutlang {b:,} B"
        )
    else:
        report.line("per-rank agreement", f"ok: equal on all {len(ranks)} ranks")
    rss_end = max_rss_mib()
    report.line("max RSS", f"{rss_end:,.0f} MiB (+{rss_end - rss_start:,.0f} over imports, torch included)")
    result.update(
        dcp_case=args.dcp_case,
        dcp_ranks=len(ranks),
        dcp_what=what,
        compile_s=compile_s,
        compile_times=compile_times,
        dcp_min_s=dcp_min,
        dcp_median_s=dcp_median,
        dcp_mean_s=dcp_mean,
        dcp_sum_s=dcp_sum,
        dcp_all_s=dcp_all,
        dcp_extrapolated=extrapolated,
        dcp_read_items=read_items,
        layoutlang_moves=moves_in,
        dcp_bytes=dcp_total,
        layoutlang_bytes=ll_total,
        mismatched_ranks=len(mismatches),
        rss_start_mib=rss_start,
        rss_end_mib=rss_end,
    )
    return failures


# ---------------------------------------------------------------------- the driver


def worker(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"case": args.worker}
    if args.worker == "dcp":
        failures = run_dcp(args, result)
    else:
        failures = run_plan_case(args.worker, args, result)
    result["failures"] = failures
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result))
    return 1 if failures else 0


def stacked_pairs(plans: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(base, stacked) results of every stacked case whose base case ran too."""
    by_case = {r["case"]: r for r in plans}
    return [(by_case[PLAN_CASES[r["case"]]["base"]], r) for r in plans if PLAN_CASES[r["case"]].get("base") in by_case]


def stacked_failures(plans: list[dict[str, Any]]) -> list[str]:
    """A stacked case moves the same regions as its base (only the places in the destination
    storages differ): the same moves and the same bytes of every kind."""
    keys = ("moves", "regions", "bytes", "moved", "lower_bound", "messages")
    return [
        f"{after['case']}: {key} {after[key]} != {before[key]} of {before['case']}"
        for before, after in stacked_pairs(plans)
        for key in keys
        if before[key] != after[key]
    ]


def summary(results: list[dict[str, Any]]) -> None:
    plans = [r for r in results if r["case"] in PLAN_CASES and "compile_s" in r]
    if results:
        print("\n== summary")
    width = max([12, *(len(r["case"]) for r in plans)])
    if plans:
        header = (
            f"  {'case':<{width}} {'tensors':>8} {'params':>8} {'ranks':>10} {'load+res':>9} {'compile':>8} "
            f"{'C++':>7} {'total':>7} {'moves':>11} {'moved':>10} {'ratio':>6} {'bcast x':>8} {'validate':>9} "
            f"{'max RSS':>9}"
        )
        print(header)
        for r in plans:
            ranks = f"{r['source_ranks']}+{r['destination_ranks']}"
            bcast = f"{r['broadcast_moved_ratio']:.1f}" if "broadcast_moved_ratio" in r else "-"
            validate = f"{r['validate_s']:.3f}" if r.get("validate_s") is not None else "FAILED"
            print(
                f"  {r['case']:<{width}} {r['tensors']:>8,} {r['parameters'] / 1e9:>7.0f}B {ranks:>10} "
                f"{r['load_resolve_s']:>8.2f}s {r['compile_s']:>7.3f}s {r['core_s']:>6.3f}s "
                f"{r['end_to_end_s']:>6.2f}s {r['moves']:>11,} "
                f"{tib(r['moved']):>10} {r['ratio']:>6.3f} {bcast:>8} {validate:>8}s {r['rss_end_mib']:>6,.0f}MiB"
            )
    for before, after in stacked_pairs(plans):
        print(f"\n== stacked vs unstacked: {before['case']} -> {after['case']}")
        rows = [
            ("destination storages per rank", "destination_storages", "{:,}"),
            ("load (parse, import, names)", "load_s", "{:.3f} s"),
            ("load + resolve", "load_resolve_s", "{:.3f} s"),
            ("compile_plan", "compile_s", "{:.3f} s"),
            ("of which C++ build_plan", "core_s", "{:.3f} s"),
            ("validate", "validate_s", "{:.3f} s"),
            ("moves", "moves", "{:,}"),
            ("regions", "regions", "{:,}"),
            ("buckets", "buckets", "{:,}"),
            ("moved (domain + network)", "moved", "{:,} B"),
            ("max RSS", "rss_end_mib", "{:,.0f} MiB"),
        ]
        print(f"  {'':<32} {'unstacked':>24} {'stacked':>24} {'stacked / unstacked':>20}")
        for label, key, fmt in rows:
            a, b = before.get(key), after.get(key)
            if a is None or b is None:
                continue
            ratio = f"{b / a:.3f}" if a else "-"
            print(f"  {label:<32} {fmt.format(a):>24} {fmt.format(b):>24} {ratio:>20}")
    for r in results:
        if r["case"] == "dcp" and "dcp_mean_s" in r:
            print(
                f"  dcp on {r['dcp_case']}: {r['dcp_ranks']} ranks, DCP {r['dcp_median_s']:.3f} s per rank "
                f"({r['dcp_all_s']:.1f} s for every rank{', extrapolated' if r['dcp_extrapolated'] else ''}) "
                f"vs layoutlang {r['compile_s']:.3f} s for every rank; bytes "
                f"{'agree' if not r['mismatched_ranks'] else 'DISAGREE'}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated cases to run ({', '.join(ALL_CASES)})")
    parser.add_argument("--skip-dcp", action="store_true", help="do not run the DCP comparison")
    parser.add_argument(
        "--skip-broadcast",
        action="store_true",
        help="do not compile the gather-and-broadcast plans",
    )
    parser.add_argument("--repeat", type=int, default=3, help="compile each plan this many times, report the best")
    parser.add_argument(
        "--dcp-case",
        default="deepseek_v3",
        choices=list(PLAN_CASES),
        help="program the DCP case plans",
    )
    parser.add_argument(
        "--dcp-ranks",
        help="destination ranks DCP plans for: N (the first N) or 'all'; default: one replica (the first "
        "destination mesh axis at 0)",
    )
    parser.add_argument("--json", metavar="FILE", help="write every case's figures to FILE")
    parser.add_argument("--worker", choices=ALL_CASES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.worker:
        return worker(args)

    cases = list(ALL_CASES)
    if args.only:
        cases = [c.strip() for c in args.only.split(",") if c.strip()]
        unknown = [c for c in cases if c not in ALL_CASES]
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)} (cases: {', '.join(ALL_CASES)})")
    if args.skip_dcp:
        cases = [c for c in cases if c != "dcp"]

    print(
        f"bench_plan_scale: python {sys.version.split()[0]}, {len(os.sched_getaffinity(0))} core(s) available "
        f"of {os.cpu_count()}, each case in a fresh subprocess"
    )
    results: list[dict[str, Any]] = []
    status = 0
    passthrough = ["--repeat", str(args.repeat), "--dcp-case", args.dcp_case]
    if args.dcp_ranks:
        passthrough += ["--dcp-ranks", args.dcp_ranks]
    if args.skip_broadcast:
        passthrough.append("--skip-broadcast")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            result_file = Path(tmp) / f"{case}.json"
            command = [
                sys.executable,
                __file__,
                "--worker",
                case,
                "--result-file",
                str(result_file),
                *passthrough,
            ]
            code = subprocess.call(command)
            if result_file.exists():
                results.append(json.loads(result_file.read_text()))
            if code:
                status = 1
                failures = results[-1]["failures"] if result_file.exists() else [f"{case}: exit status {code}"]
                for failure in failures:
                    print(f"FAILED: {failure}")
    summary(results)
    plans = [r for r in results if r["case"] in PLAN_CASES and "compile_s" in r]
    for failure in stacked_failures(plans):
        status = 1
        print(f"FAILED: {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
