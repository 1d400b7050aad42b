"""``layoutlang apply``: run a refit for real and verify every byte.

Launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment) every process
joins the job as the program rank of the same number. Launched alone, it starts one local
worker process per rank of the reshard's meshes, joined over gloo (the embedded default).

Each rank fills its source storages with synthetic weights (or reads its own boxes from a
safetensors checkpoint), runs the plan, and compares every destination byte with the
source of truth; destinations can be written as per-rank safetensors files, so the same
command reshards checkpoints offline.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ..errors import LayoutError
from ..io.weights import SafetensorsCheckpoint, fill_synthetic, verify, write_safetensors
from ..lang import load
from ..plan import KINDS
from ..runtime import Resharder
from ..transport.nccl import NcclTransport
from .launch import LocalWorkers, worker_context

__all__ = ["ApplyOptions", "apply_on_rank", "participants_of", "run_local", "run_torchrun", "summarize"]

PROGRESS_KEY = "layoutlang/apply/progress"


@attrs.frozen
class ApplyOptions:
    path: str
    reshard: str | None = None
    policy: str | None = None
    compare: bool = False
    memory_budget: int = 512 * 2**20
    timeout: float = 300.0
    from_dir: str | None = None
    to_dir: str | None = None
    cast: str | None = None
    repeat: int = 1
    transport: str = "torch"


def participants_of(path: str, reshard: str | None) -> list[int]:
    """The ranks of the reshard's two meshes (raises LayoutError for a bad program)."""
    program = load(path)
    program.check()
    statement = program.reshard(reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


def apply_on_rank(
    options: ApplyOptions,
    rank: int,
    rank_map: dict[int, int] | None,
    progress: Callable[[str, int, int], None] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """One rank's part of ``apply``: every requested policy, timed, verified."""
    import torch

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    program = load(options.path)
    checkpoint = SafetensorsCheckpoint(options.from_dir) if options.from_dir else None
    policies = [options.policy or "reshard"]
    if options.compare and policies[0] != "broadcast":
        policies.append("broadcast")
    report: dict[str, Any] = {"rank": rank, "runs": {}}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    transport = _transport(options, program, rank, rank_map) if options.transport == "nccl" else None
    for index, policy in enumerate(policies):
        resharder = Resharder(
            program,
            options.reshard,
            rank=rank,
            rank_map=rank_map,
            transport=transport,
            memory_budget=options.memory_budget,
            policy=None if policy == "reshard" and options.policy is None else policy,
            timeout=options.timeout,
        )
        plan = resharder.plan
        sources = resharder.allocate("source", device=device)
        problem = None
        if rank in plan.source.mesh:
            try:
                (checkpoint.fill if checkpoint else fill_synthetic)(plan.source, rank, sources)
            except LayoutError as err:  # every rank learns of it in the run's agreement
                problem = err.message
        dtype = getattr(torch, options.cast) if options.cast else None
        destinations = resharder.allocate("destination", dtype=dtype, device=device)
        seconds = []
        for _ in range(max(1, options.repeat)):
            notify = (lambda n, total, p=policy: progress(p, n, total)) if progress else None
            resharder.run(sources, destinations, cast=dtype is not None, progress=notify, not_ready=problem)
            seconds.append(resharder.last_report.seconds)
        run = resharder.last_report
        result: dict[str, Any] = {
            "fingerprint": plan.fingerprint,
            "seconds": min(seconds),
            "sent": run.sent,
            "received": run.received,
            "messages": run.messages_sent,
            "peak_staging_bytes": run.peak_staging_bytes,
            "memory_budget": options.memory_budget,
            "verified_bytes": 0,
            "mismatches": [],
        }
        if rank in plan.destination.mesh:
            truth = None
            if checkpoint is not None:

                def truth(name, _index, box, layout=plan.destination):
                    tensor = layout.tensors[name]
                    return checkpoint.read_box(name, tensor.dtype, tensor.shape, box.offsets, box.sizes)

            check = verify(plan.destination, rank, destinations, truth=truth)
            result["verified_bytes"] = check.bytes
            result["mismatches"] = list(check.mismatches)
            if options.to_dir and index == 0:
                Path(options.to_dir).mkdir(parents=True, exist_ok=True)
                write_safetensors(
                    Path(options.to_dir) / f"rank{rank:05d}.safetensors",
                    destinations,
                    {"layout": plan.destination.name, "rank": str(rank), "plan": plan.fingerprint},
                )
        report["runs"][policy] = result
    report["peak_rss_growth_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    return report


def _transport(options: ApplyOptions, program, rank: int, rank_map):
    """layoutlang's native NCCL communicator over the reshard's ranks, made through the job's store."""
    import torch.distributed as dist

    statement = program.reshard(options.reshard)
    ranks = set(program.layout(statement.source).mesh.ranks) | set(program.layout(statement.destination).mesh.ranks)
    store = worker_context.get("store") or dist.distributed_c10d._get_default_store()
    return NcclTransport.from_store(rank, sorted(ranks), store, timeout=options.timeout)


# ----------------------------------------------------------------- launching


def _local_job(options: ApplyOptions, participants: list[int]) -> dict[str, Any]:
    """What each local worker runs (worker i plays program rank participants[i])."""
    import torch.distributed as dist

    index = dist.get_rank()
    rank = participants[index]
    store = worker_context.get("store")
    progress = None
    if store is not None and index == 0:

        def progress(policy: str, n: int, total: int) -> None:
            store.set(PROGRESS_KEY, f"{policy} {n} {total}")

    return apply_on_rank(options, rank, {p: i for i, p in enumerate(participants)}, progress)


def run_local(options: ApplyOptions, show_progress: bool) -> list[dict[str, Any]]:
    """Start one local worker per rank of the reshard, run, and return every rank's report."""
    participants = participants_of(options.path, options.reshard)
    with LocalWorkers(len(participants), timeout=options.timeout) as workers:
        workers.submit(_local_job, options, participants)
        if show_progress:
            return _with_progress(workers, options.timeout)
        return workers.collect(options.timeout * (2 + options.repeat) + 120)


def _with_progress(workers, timeout: float) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        tasks: dict[str, Any] = {}
        import threading

        done = threading.Event()

        def collect() -> None:
            try:
                results.extend(workers.collect(timeout * 4 + 120))
            finally:
                done.set()

        error: list[BaseException] = []

        def guarded() -> None:
            try:
                collect()
            except BaseException as err:  # reported on the main thread
                error.append(err)

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        while not done.wait(0.1):
            try:
                if not workers.store.check([PROGRESS_KEY]):
                    continue
                policy, n, total = workers.store.get(PROGRESS_KEY).decode().split()
            except Exception:  # the store is only a progress channel here
                continue
            if policy not in tasks:
                tasks[policy] = bar.add_task(f"{policy}: steps", total=int(total))
            bar.update(tasks[policy], completed=int(n))
        thread.join()
        if error:
            raise error[0]
    return results


def run_torchrun(options: ApplyOptions, device: str = "cpu") -> list[dict[str, Any]] | None:
    """Join the job torchrun started; rank 0 returns every rank's report, the others None."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        if device == "cuda":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        participants = participants_of(options.path, options.reshard)
    except LayoutError:
        participants = []
    if rank in participants:
        report: dict[str, Any] = apply_on_rank(options, rank, None, device=device)
    else:
        report = {"rank": rank, "idle": True, "runs": {}}
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(report, gathered, dst=0)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


# ------------------------------------------------------------------ summary


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over ranks: time (the slowest rank), bytes by kind, messages, bandwidth."""
    active = [r for r in reports if not r.get("idle")]
    out: dict[str, Any] = {"ranks": len(active), "runs": {}}
    policies = list(active[0]["runs"]) if active else []
    for policy in policies:
        runs = [r["runs"][policy] for r in active]
        sent = {k: sum(run["sent"][k] for run in runs) for k in KINDS}
        seconds = max(run["seconds"] for run in runs)
        moved = sent["domain"] + sent["network"]
        out["runs"][policy] = {
            "seconds": seconds,
            "bytes": sent,
            "moved_bytes": moved,
            "messages": sum(run["messages"] for run in runs),
            "bandwidth_bytes_per_second": moved / seconds if seconds > 0 else 0.0,
            "peak_staging_bytes": max(run["peak_staging_bytes"] for run in runs),
            "memory_budget": runs[0]["memory_budget"],
            "verified_bytes": sum(run["verified_bytes"] for run in runs),
            "mismatches": [m for run in runs for m in run["mismatches"]],
            "fingerprints": sorted({run["fingerprint"] for run in runs}),
        }
    out["peak_rss_growth_bytes"] = max((r.get("peak_rss_growth_bytes", 0) for r in active), default=0)
    out["ok"] = all(not v["mismatches"] for v in out["runs"].values())
    return out


def environment_is_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))

