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

import contextlib
import os
import resource
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..errors import AgreementError, ExecutionError, LayoutError, LayoutValueError, RuntimeFailure
from ..io.quantize import quantize
from ..io.safetensors import tensors_from_safetensors
from ..io.torch_dtypes import torch_dtype
from ..io.weights import (
    SafetensorsCheckpoint,
    change_synthetic,
    changed_truth,
    fill_synthetic,
    synthetic_box,
    verify,
    write_safetensors,
)
from ..lang import load
from ..model import Box, Layout, Program
from ..plan import KINDS
from ..runtime import Resharder, RunReport
from ..runtime.agreement import raise_stopped
from ..runtime.delta import DeltaOptions
from ..transport.nccl import NcclTransport
from .apply_progress import STEP_KEY, ApplyWatch, Display, publisher
from .launch import LocalWorkers, worker_context

__all__ = ["ApplyOptions", "apply_on_rank", "participants_of", "run_local", "run_on", "run_torchrun", "summarize"]

#: ``events(kind, **fields)``: what rank 0 says of each phase, for the launcher's display
Events = Callable[..., None]

#: ``truth(tensor, index, box)``: the values a destination box must hold
Truth = Callable[[str, int, Box], torch.Tensor]


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
    cast_sources: bool = False
    allow_outside_paths: bool = False
    #: ``--allow-outside-includes``: the program may include files outside its folder
    allow_outside_includes: bool = False
    repeat: int = 1
    transport: str = "torch"
    #: ``--plan-mode``: auto (the Resharder's default), fleet or per-rank
    plan_mode: str = "auto"
    #: ``--delta``: ``steps`` refits, each after a synthetic training step that changes
    #: ``change_fraction`` of the source elements, sent as deltas (the first one dense)
    delta: bool | str | DeltaOptions = False
    steps: int = 1
    change_fraction: float = 0.01
    #: the domain size placement gave (``--ray``: a Ray node is a domain), in place of the
    #: program's topology's; None: the program's
    domain_size: int | None = None


#: ``--plan-mode`` as the Resharder's ``per_rank``
_PER_RANK = {"auto": None, "fleet": False, "per-rank": True}


def participants_of(program: str | Program, reshard: str | None, *, allow_outside_includes: bool = False) -> list[int]:
    """The ranks of the reshard's two meshes (raises LayoutError for a bad program)."""
    if not isinstance(program, Program):
        program = load(program, allow_outside_includes=allow_outside_includes)
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
    events: Events | None = None,
) -> dict[str, Any]:
    """One rank's part of ``apply``: every requested policy, timed, verified. ``progress``
    hears of each executor step, ``events`` of each phase (the plan agreed, each run done)."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    program = load(options.path, allow_outside_includes=options.allow_outside_includes)
    if options.domain_size is not None:
        program = attrs.evolve(program, topology=attrs.evolve(program.topology, domain_size=options.domain_size))
    checkpoint = None
    opening: Exception | None = None
    if options.from_dir:
        opened = _AsStored if options.cast_sources else SafetensorsCheckpoint
        try:
            checkpoint = opened(options.from_dir, allow_outside_paths=options.allow_outside_paths)
        except Exception as err:  # a checkpoint this rank alone cannot open (another host's copy)
            opening = err  # reported in the plan's agreement, so that no rank waits for this one
    policies = [options.policy or "reshard"]
    if options.compare and policies[0] != "broadcast":
        policies.append("broadcast")
    report: dict[str, Any] = {"rank": rank, "runs": {}}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    transport = _transport(options, program, rank) if options.transport == "nccl" else None
    for index, policy in enumerate(policies):
        try:
            resharder = Resharder(
                program,
                options.reshard,
                rank=rank,
                rank_map=rank_map,
                transport=transport,
                memory_budget=options.memory_budget,
                policy=None if policy == "reshard" and options.policy is None else policy,
                timeout=options.timeout,
                # gather-and-broadcast has the whole fleet's plan only (the comparison run)
                per_rank=False if policy == "broadcast" else _PER_RANK[options.plan_mode],
                problem=_not_ready_text(opening, rank) if opening is not None else None,
            )
        except AgreementError as stopped:
            raise_stopped(stopped, opening)
        plan = resharder.plan
        if events is not None:
            mode = "per-rank" if plan.rank is not None else plan.mode
            events("plan", policy=policy, mode=mode, moves=plan.num_moves, fingerprint=plan.fingerprint)
        notify = (lambda n, total, p=policy: progress(p, n, total)) if progress else None
        said = (lambda kind, p=policy, **fields: events(kind, policy=p, **fields)) if events else None
        report["runs"][policy] = _run_policy(options, resharder, checkpoint, device, notify, write=index == 0,
                                             events=said)
    report["peak_rss_growth_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    return report


def _run_policy(
    options: ApplyOptions,
    resharder: Resharder,
    checkpoint: SafetensorsCheckpoint | None,
    device: str,
    progress: Callable[[int, int], None] | None,
    write: bool,
    events: Events | None = None,
) -> dict[str, Any]:
    """Fill the sources, run the plan ``options.repeat`` times (``options.steps`` delta refits,
    each after a synthetic training step), verify (and write) the destinations; ``events``
    hears of each run done."""
    plan, rank = resharder.plan, resharder.rank
    dtype = getattr(torch, options.cast) if options.cast else None
    sources: dict[str, torch.Tensor] = {}
    destinations: dict[str, torch.Tensor] = {}
    output = Path(options.to_dir) / f"rank{rank:05d}.safetensors" if options.to_dir and write else None
    problem: Exception | None = None
    # Whatever this rank finds before the run (its weights, its storages, the file it will
    # write) goes into the run's agreement, so every rank stops with it at once; raised here,
    # it would leave the others waiting in that agreement for the whole timeout.
    try:
        if isinstance(checkpoint, _AsStored):
            sources = _allocate_as_stored(resharder, checkpoint.stored, device)
        else:
            sources = resharder.allocate("source", device=device)
        if rank in plan.source.mesh:
            (checkpoint.fill if checkpoint else fill_synthetic)(plan.source, rank, sources)
        # a quantized destination gets its fp8 value storages and its scale storages here too
        destinations = resharder.allocate("destination", dtype=dtype, device=device)
        if output is not None and rank in plan.destination.mesh:
            _check_output(output, rank, sum(t.numel() * t.element_size() for t in destinations.values()))
    except Exception as err:  # a mistake or a bug: _run_once reports it in the agreement
        problem = err
    reports: list[RunReport] = []
    steps: list[dict[str, Any]] = []
    result: dict[str, Any] = {"verified_bytes": 0, "mismatches": []}
    steps_run = options.steps if options.delta else 1
    runs = steps_run if options.delta else _runs(options)
    for step in range(steps_run):
        changed = 0
        if step and problem is None and rank in plan.source.mesh:  # a synthetic training step
            changed = change_synthetic(plan.source, rank, sources, options.change_fraction, step)
        for _ in range(1 if options.delta else runs):
            reports.append(
                _run_once(resharder, sources, destinations, dtype is not None, options.cast_sources, progress,
                          problem, delta=options.delta)
            )
            if events is not None:
                events("run", run=len(reports), runs=runs, seconds=reports[-1].seconds, delta=bool(options.delta))
        # every step's destinations are verified: a delta is right only if all of them are
        verified, mismatches = _verify(plan, rank, destinations, checkpoint, options.change_fraction, step)
        result["verified_bytes"] += verified
        result["mismatches"] += [f"step {step}: {m}" for m in mismatches] if options.delta else mismatches
        if options.delta:
            delta = reports[-1].delta
            assert delta is not None
            elements = sum(t.numel() for t in sources.values()) if rank in plan.source.mesh else 0
            steps.append({"step": step, "seconds": reports[-1].seconds, "changed_elements": changed,
                          "source_elements": elements, "verified_bytes": verified, "mismatches": len(mismatches)}
                         | attrs.asdict(delta))
    run = reports[-1]
    timed = reports[1:] if options.delta and len(reports) > 1 else reports  # a delta run's first step is dense
    result |= {
        "fingerprint": plan.fingerprint,
        "plan_mode": "per-rank" if plan.rank is not None else plan.mode,
        "plan_moves": plan.num_moves,
        "seconds": min(r.seconds for r in timed),
        "sent": run.sent,
        "received": run.received,
        "messages": run.messages_sent,
        "peak_staging_bytes": max(r.peak_staging_bytes for r in reports),
        "memory_budget": options.memory_budget,
    }
    if options.delta:
        result["delta_steps"] = steps
    if output is not None and rank in plan.destination.mesh:
        # checked before the run; write_safetensors names any failure since (a folder
        # removed meanwhile: exit 2; a full disk: exit 1) and leaves no partial file
        written = write_safetensors(
            output,
            destinations,
            {"layout": plan.destination.name, "rank": str(rank), "plan": plan.fingerprint},
        )
        result["written"] = attrs.asdict(written)  # for the folder's manifest (layoutlang.io.output)
    return result


def _verify(
    plan: Any,
    rank: int,
    destinations: dict[str, torch.Tensor],
    checkpoint: SafetensorsCheckpoint | None,
    change_fraction: float,
    steps: int,
) -> tuple[int, list[str]]:
    """Compare every destination byte of ``rank`` with the truth after ``steps`` synthetic
    training steps (0: the weights as filled); returns the bytes verified and the mismatches."""
    if rank not in plan.destination.mesh:
        return 0, []
    truth = _truth(plan.destination, checkpoint)
    if steps:
        truth = changed_truth(plan.destination, truth, change_fraction, steps)
    scales_checked = None
    if plan.quantization is not None:
        truth, scales_checked = _quantized_truth(plan.destination, rank, destinations, truth)
    check = verify(plan.destination, rank, destinations, truth=truth)
    verified, mismatches = check.bytes, list(check.mismatches)
    if scales_checked is not None:
        verified += scales_checked.bytes
        mismatches += scales_checked.mismatches
    return verified, mismatches


def _run_once(
    resharder: Resharder,
    sources: dict[str, torch.Tensor],
    destinations: dict[str, torch.Tensor],
    cast: bool,
    cast_sources: bool,
    progress: Callable[[int, int], None] | None,
    problem: Exception | None,
    *,
    delta: bool | str | DeltaOptions = False,
) -> RunReport:
    """One run of the plan; a rank that could not prepare it (its sources, its storages, its
    output) stops every rank in the run's agreement."""
    try:
        resharder.run(
            sources,
            destinations,
            cast=cast,
            cast_sources=cast_sources,
            progress=progress,
            not_ready=_not_ready_text(problem, resharder.rank) if problem is not None else None,
            delta=delta,
        )
    except AgreementError as stopped:
        raise_stopped(stopped, problem)
    if resharder.last_report is None:
        raise AssertionError("Resharder.run returned without a report")
    return resharder.last_report


def _not_ready_text(problem: Exception, rank: int) -> str:
    """What the run's agreement says of what ``rank`` found before the run: a mistake's or a
    failure's own message; for anything else (a bug) its type and message, named internal."""
    if isinstance(problem, (LayoutError, RuntimeFailure)):
        return problem.message
    return f"internal error on rank {rank} before the run: {type(problem).__name__}: {problem}"


def _check_output(path: Path, rank: int, nbytes: int) -> None:
    """Refuse, before any byte moves, a rank's output file that cannot be written: its name
    taken by a folder or another non-file, its folder gone or read-only (the launcher checked
    the folder once for every rank; a file of one rank, or a folder on one host, differs), or
    its ``nbytes`` of tensors more than the process may write into one file (``ulimit -f``)
    or than its disk has free: each rank's file has its own size, so one rank alone may fail."""
    if path.is_dir() or (path.exists() and not path.is_file()):
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise LayoutValueError(f"rank {rank}: cannot write {path}: it is {kind}", rank=rank)
    try:
        # the one sure test (root ignores permission bits; a mount may be read-only), named as
        # write_safetensors names its temporary files, which --overwrite removes if one is left
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = f"{exc.strerror or exc} (its folder is missing, read-only or not a folder)"
        raise LayoutValueError(f"rank {rank}: cannot write {path}: {why}", rank=rank) from None
    # the header comes on top: these are sure failures, found now rather than after the run
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and nbytes > limit:
        raise ExecutionError(
            f"rank {rank}: cannot write {path}: its {nbytes} bytes of tensors exceed the file size limit of "
            f"{limit} bytes (ulimit -f)",
            rank=rank,
            hint="raise the limit (ulimit -f unlimited) before running apply",
        )
    free = shutil.disk_usage(path.parent).free
    if nbytes > free:
        raise ExecutionError(
            f"rank {rank}: cannot write {path}: its {nbytes} bytes of tensors exceed the {free} bytes free on its disk",
            rank=rank,
            hint="free space on that disk or write to another folder",
        )


@attrs.frozen
class _ScalesChecked:
    bytes: int
    mismatches: list[str]


def _quantized_truth(
    layout: Layout, rank: int, destinations: Mapping[str, torch.Tensor], truth: Truth | None
) -> tuple[Truth, _ScalesChecked]:
    """What a quantized destination must hold: each box's truth quantized (a box holds whole
    blocks, so its values and scales are those of the whole tensor quantized), and the scale
    storages checked against the same quantization."""
    quantized = layout.quantized()

    def logical(name: str, index: int, box: Box) -> torch.Tensor:
        if truth is not None:
            return truth(name, index, box)
        tensor = layout.tensors[name]
        return synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes)

    def quantized_truth(name: str, index: int, box: Box) -> torch.Tensor:
        q = quantized.get(name)
        if q is None:
            return logical(name, index, box)
        return quantize(logical(name, index, box), q.format, q.block, q.convention)[0]

    nbytes, mismatches = 0, []
    for name, q in quantized.items():
        index = layout.resolved.index[name]
        boxes = layout.boxes(name, rank)
        if q.replicated:  # every holder holds the whole tensor (the planner checks it)
            zero = (0,) * len(q.shape)
            boxes = [Box(name, zero, q.shape, None, zero)] if boxes else []
        for box, scale_box in zip(boxes, layout.scale_boxes(name, rank)):
            expected = quantize(logical(name, index, box), q.format, q.block, q.convention)[1]
            got = destinations[scale_box.storage][scale_box.storage_index()] if scale_box.storage else None
            nbytes += expected.numel() * expected.element_size()
            if got is None or not torch.equal(got.contiguous().view(torch.uint8), expected.view(torch.uint8)):
                mismatches.append(f"rank {rank}: the scales of {name} in storage '{scale_box.storage}' differ")
    return quantized_truth, _ScalesChecked(nbytes, mismatches)


def _truth(layout: Layout, checkpoint: SafetensorsCheckpoint | None) -> Truth | None:
    """What the destination boxes must hold: the checkpoint's boxes (None: the synthetic weights)."""
    if checkpoint is None:
        return None

    def truth(name: str, _index: int, box: Box) -> torch.Tensor:
        tensor = layout.tensors[name]
        # a tensor stored in another dtype (--cast-sources) travels in the layout's: torch's .to()
        values = checkpoint.read_box(name, tensor.dtype, tensor.shape, box.offsets, box.sizes)
        return values.to(torch_dtype(tensor.dtype))

    return truth


class _AsStored(SafetensorsCheckpoint):
    """A checkpoint read in the dtypes it stores, not the layout's (``--cast-sources``): the
    source storages hold them as a trainer does (fp32 master weights), and the executor
    converts while it packs."""

    def __init__(self, path: str, *, allow_outside_paths: bool = False):
        super().__init__(path, allow_outside_paths=allow_outside_paths)
        self.stored = {
            name: dtype for name, _, dtype in tensors_from_safetensors(path, allow_outside_paths=allow_outside_paths)
        }

    def read_box(self, name: str, dtype: str, shape: tuple[int, ...], offsets, sizes) -> torch.Tensor:
        return super().read_box(name, self.stored.get(name, dtype), shape, offsets, sizes)


def _allocate_as_stored(resharder: Resharder, stored: Mapping[str, str], device: str) -> dict[str, torch.Tensor]:
    """Zeroed source storages, each in the dtype the checkpoint stores its parts in; a storage
    whose parts are stored in several dtypes keeps the layout's (filling it converts them)."""
    layout, rank = resharder.plan.source, resharder.rank
    out = {}
    for name, shape in resharder.source_storages.items():
        parts = layout.storage(name, rank).parts
        dtypes = {stored.get(part, layout.tensors[part].dtype) for part in parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else layout.tensors[parts[0]].dtype
        out[name] = torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
    return out


def _transport(options: ApplyOptions, program: Program, rank: int) -> NcclTransport:
    """layoutlang's native NCCL communicator over the reshard's ranks, made through the job's store."""
    store = worker_context.get("store") or dist.distributed_c10d._get_default_store()
    return NcclTransport.from_store(rank, participants_of(program, options.reshard), store, timeout=options.timeout)


# ----------------------------------------------------------------- launching


def _local_job(options: ApplyOptions, participants: list[int]) -> dict[str, Any]:
    """What each local worker runs (worker i plays program rank participants[i]); rank 0
    tells the launcher's display of its executor steps and phases through the store."""
    index = dist.get_rank()
    rank = participants[index]
    store = worker_context.get("store")
    progress = events = None
    if store is not None and index == 0:
        events = publisher(store)

        def progress(policy: str, n: int, total: int) -> None:
            with contextlib.suppress(Exception):  # only the display reads it
                store.set(STEP_KEY, f"{policy} {n} {total}")

    return apply_on_rank(options, rank, {p: i for i, p in enumerate(participants)}, progress, events=events)


def run_local(options: ApplyOptions, display: Display | None = None) -> list[dict[str, Any]]:
    """Start one local worker per rank of the reshard, run, and return every rank's report."""
    participants = participants_of(options.path, options.reshard, allow_outside_includes=options.allow_outside_includes)
    with LocalWorkers(len(participants), timeout=options.timeout) as workers:
        return run_on(workers, options, participants, display)


def run_on(
    workers: Any, options: ApplyOptions, participants: list[int], display: Display | None = None
) -> list[dict[str, Any]]:
    """Run the job on a started pool (worker i plays program rank ``participants[i]``): a
    :class:`LocalWorkers`, or any pool with its interface; every rank's report. An active
    ``display`` follows the workers' start and rank 0's phases meanwhile."""
    workers.submit(_local_job, options, participants)
    timeout = options.timeout * (2 + options.repeat) + 120
    if display is None or not display.active:
        return workers.collect(timeout)
    watch = ApplyWatch(display, (workers.store.host, workers.store.port), workers.size)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def collect() -> None:
        try:
            results.extend(workers.collect(timeout))
        except BaseException as err:  # raised again on the main thread
            errors.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=collect, name="layoutlang-apply-collect", daemon=True)
    thread.start()
    while not done.wait(POLL):
        watch.poll()
    thread.join()
    if errors:
        raise errors[0]
    watch.finished()
    return results


#: seconds between two looks of the launcher's display at the store
POLL = 0.25


def run_torchrun(options: ApplyOptions, device: str = "cpu") -> list[dict[str, Any]] | None:
    """Join the job torchrun started; rank 0 returns every rank's report, the others None."""
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        participants = participants_of(
            options.path, options.reshard, allow_outside_includes=options.allow_outside_includes
        )
    except LayoutError:
        participants = []
    if rank in participants:
        report: dict[str, Any] = apply_on_rank(options, rank, None, device=device)
    else:
        report = {"rank": rank, "idle": True, "runs": {}}
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    dist.destroy_process_group()
    return gathered


# ------------------------------------------------------------------ summary


def _delta_steps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A delta run's steps, totalled over ranks: the fraction of source elements changed, the
    bytes on the wire against dense, the encodings, what the senders keep."""
    out = []
    for by_rank in zip(*(run["delta_steps"] for run in runs)):
        elements = sum(r["source_elements"] for r in by_rank)
        out.append({
            "step": by_rank[0]["step"],
            "seconds": max(r["seconds"] for r in by_rank),
            "changed_fraction": sum(r["changed_elements"] for r in by_rank) / elements if elements else 0.0,
            "wire_bytes": sum(r["wire_bytes"] for r in by_rank),
            "dense_bytes": sum(r["dense_bytes"] for r in by_rank),
            "messages": {k: sum(r["messages"][k] for r in by_rank) for k in by_rank[0]["messages"]},
            "kept_bytes_per_rank": max(r["kept_bytes"] for r in by_rank),
            "stale": sorted({name for r in by_rank for name in r["stale"]}),
            "verified_bytes": sum(r["verified_bytes"] for r in by_rank),
            "mismatches": sum(r["mismatches"] for r in by_rank),
        })
    return out


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
            # one mode on every rank: ranks that compiled another are refused by the agreement
            "plan_mode": ", ".join(sorted({run["plan_mode"] for run in runs})),
            "plan_moves": max(run["plan_moves"] for run in runs),
        }
        if "delta_steps" in runs[0]:
            out["runs"][policy]["delta_steps"] = _delta_steps(runs)
    out["peak_rss_growth_bytes"] = max((r.get("peak_rss_growth_bytes", 0) for r in active), default=0)
    out["ok"] = all(not v["mismatches"] for v in out["runs"].values())
    return out


def failures(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Why a summary is not ok, as errors of the ``--json`` envelope: a ``mismatch`` per run
    whose verification found wrong bytes (its first mismatches quoted)."""
    out = []
    for policy, run in summary["runs"].items():
        if run["mismatches"]:
            n = len(run["mismatches"])
            shown = "; ".join(run["mismatches"][:3]) + ("; ..." if n > 3 else "")
            out.append({"error": "mismatch", "message": f"{policy}: {n} mismatches: {shown}", "run": policy})
    if not summary["ok"] and not out:
        out.append({"error": "failure", "message": "the refit did not complete"})
    return out


def _runs(options: ApplyOptions) -> int:
    """How many times a policy runs (its fastest is reported): ``--repeat``, and at least twice
    with ``--compare``, whose ratio of times would otherwise set the first policy's cold run
    (its connections set up, its arenas touched) against the second's warm one."""
    return max(1, options.repeat, 2 if options.compare else 1)
