"""The ``layoutlang`` command line.

Exit statuses are :class:`ExitCode`. A user's mistake (a bad ``.layout`` file, an unknown
name on the command line) prints the error with its place and caret on stderr (one JSON
object with ``--json``) and exits with ``ExitCode.BAD_INPUT``; it never prints a traceback.
"""

from __future__ import annotations

import argparse
import enum
import itertools
import json
import logging
import os
import re
import sys
from collections.abc import Sequence

from . import __version__
from .elaborate import load
from .errors import LayoutError, LayoutNameError, LayoutValueError, did_you_mean
from .model import Layout, Program, compile_pattern
from .plan import DEFAULT_BUCKET_BYTES, POLICIES, compile_plan
from .dtypes import DTYPES
from .report import human_bytes, plan_report, table

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    OK = 0  #: success
    FAILURE = 1  #: the command ran and found a failure (e.g. a verification mismatch)
    BAD_INPUT = 2  #: usage error or invalid input (bad .layout file, unknown name)
    INTERNAL = 3  #: a bug in layoutlang; please report it


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (separate from :func:`main` so the docs can render it)."""
    parser = argparse.ArgumentParser(
        prog="layoutlang",
        description="Describe tensor layouts on device meshes, and check and show them.",
    )
    parser.add_argument("--version", action="version", version=f"layoutlang {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check",
        help="validate .layout files",
        description="Parse every file, resolve every tensor of every layout and validate every "
        "storage on every rank. Exit 0 when all files are valid.",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help=".layout files")
    check.add_argument("--json", action="store_true", help="print results (stdout) and errors (stderr) as JSON")

    show = commands.add_parser(
        "show",
        help="print which boxes each rank holds",
        description="Print, per layout, rank and tensor, the boxes each rank holds (global region) "
        "and where they sit in the rank's storage.",
    )
    show.add_argument("file", metavar="FILE", help="a .layout file")
    show.add_argument("--layout", metavar="L", help="only this layout (default: all)")
    show.add_argument(
        "--tensor", metavar="T", help='only tensors matching this name or pattern ("*" and "{x}" allowed)'
    )
    show.add_argument("--rank", metavar="R", type=int, help="only this rank")
    show.add_argument("--summary", action="store_true", help="per rank totals instead of boxes")
    show.add_argument("--json", action="store_true", help="print JSON")

    plan = commands.add_parser(
        "plan",
        help="compile the plan of a reshard statement and print its statistics",
        description="Compile the plan that turns the source layout of a reshard statement into "
        "its destination layout, validate it, and print bytes by kind (local, domain, network), "
        "messages, buckets, the lower bound and the gather-and-broadcast baseline.",
    )
    plan.add_argument("file", metavar="FILE", help="a .layout file")
    plan.add_argument("--reshard", metavar="NAME", help="the reshard statement (default: the only one)")
    plan.add_argument(
        "--explain",
        metavar="PATTERN",
        nargs="?",
        const="*",
        help='print the moves of the tensors matching PATTERN (default "*": all), one line each',
    )
    plan.add_argument("--limit", type=int, default=100, metavar="N", help="print at most N moves (default 100)")
    plan.add_argument(
        "--bucket-size",
        metavar="SIZE",
        type=parse_size,
        default=DEFAULT_BUCKET_BYTES,
        help="staging memory per rank and bucket, e.g. 64MiB (default 256MiB)",
    )
    plan.add_argument(
        "--policy",
        choices=POLICIES,
        help="one policy for every tensor, overriding the statement's rules",
    )
    plan.add_argument("--per-rank", action="store_true", help="also print bytes sent and received per rank")
    plan.add_argument(
        "--no-compare", action="store_true", help="do not compile the gather-and-broadcast baseline"
    )
    plan.add_argument(
        "--out", metavar="PLAN", help="write the plan: JSON when PLAN ends in .json, else the binary form"
    )
    plan.add_argument("--json", action="store_true", help="print the statistics (and explained moves) as JSON")

    apply = commands.add_parser(
        "apply",
        help="run a refit for real and verify every destination byte",
        description="Run the plan of a reshard statement. Launched by torchrun, every process joins the job "
        "as the program rank of its RANK; launched alone, one local worker process per rank of the "
        "reshard's meshes is started and joined over gloo. Sources hold synthetic weights (or the "
        "boxes of a safetensors checkpoint); every destination byte is compared with the source of truth.",
    )
    apply.add_argument("file", metavar="FILE", help="a .layout file")
    apply.add_argument("--reshard", metavar="NAME", help="the reshard statement (default: the only one)")
    apply.add_argument("--policy", choices=POLICIES, help="one policy for every tensor, overriding the statement's")
    apply.add_argument(
        "--compare", action="store_true", help="also run the gather-and-broadcast plan and compare"
    )
    apply.add_argument("--from", dest="from_dir", metavar="DIR", help="read source weights from a safetensors checkpoint")
    apply.add_argument("--to", dest="to_dir", metavar="DIR", help="write each destination rank's storages to DIR/rankNNNNN.safetensors")
    apply.add_argument(
        "--memory-budget",
        metavar="SIZE",
        type=parse_size,
        default=512 * 2**20,
        help="staging memory per rank (default 512MiB; buckets are half of it)",
    )
    apply.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds to wait for a peer (default 300)")
    apply.add_argument("--cast", choices=sorted({DTYPES[d][1] for d in DTYPES}), metavar="DTYPE",
                       help="destination dtype, converted on arrival (e.g. bfloat16)")
    apply.add_argument("--repeat", type=int, default=1, metavar="N", help="run N times and report the fastest")
    apply.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="under torchrun: where storages live")
    apply.add_argument(
        "--transport",
        choices=("torch", "nccl"),
        default="torch",
        help="torch.distributed point-to-point (gloo on CPU, NCCL on GPU), or layoutlang's native NCCL core",
    )
    apply.add_argument("--json", action="store_true", help="print the report as JSON")
    elastic = apply.add_argument_group(
        "elastic refits",
        "With --elastic, the refit runs --steps times in an elastic session: ranks that fail are "
        "excluded, the layouts are remeshed, and the refit goes on without restarting anyone "
        "(docs: guides/failure-recovery).",
    )
    elastic.add_argument("--elastic", action="store_true", help="repeated refits that survive rank loss and replacement")
    elastic.add_argument("--steps", type=int, default=4, metavar="N", help="refits to run (default 4)")
    elastic.add_argument(
        "--kill", action="append", default=[], type=_rank_at_step, metavar="RANK@STEP",
        help="SIGKILL RANK halfway through the transfer of refit STEP (repeatable)",
    )
    elastic.add_argument(
        "--stop", action="append", default=[], type=_rank_at_step, metavar="RANK@STEP",
        help="SIGSTOP RANK halfway through refit STEP: a hung rank, excluded after about two deadlines",
    )
    elastic.add_argument("--replace", action="store_true", help="start a replacement rank for every rank killed or stopped")
    elastic.add_argument("--deadline", type=float, default=1.0, metavar="S",
                         help="seconds of silence after which a rank counts as failed (default 1)")
    elastic.add_argument("--source-policy", default="drop-replica", metavar="POLICY",
                         help="remesh policy of the source layout when it loses ranks (default drop-replica)")
    elastic.add_argument("--destination-policy", default="drop-replica", metavar="POLICY",
                         help="remesh policy of the destination layout (default drop-replica; shrink-axis needs --destination-axis)")
    elastic.add_argument("--source-axis", metavar="AXIS", help="the axis the source policy shrinks")
    elastic.add_argument("--destination-axis", metavar="AXIS", help="the axis the destination policy shrinks")

    from . import doctor, simulate, viz

    for module, name in ((simulate, "simulate"), (viz, "viz")):
        module.add_arguments(commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION))

    doctor_parser = commands.add_parser(
        "doctor",
        help="report the NCCL, CUDA and torch this machine offers",
        description="Find NCCL as the nccl transport would (environment override, the library already in "
        "the process, an nvidia-nccl wheel, the system), report its version and whether it offers "
        "ncclCommShrink, ncclCommRevoke and ncclCommGrow, and the CUDA runtime and torch facts.",
    )
    doctor.add_arguments(doctor_parser)
    return parser


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _rank_at_step(text: str) -> tuple[int, int]:
    rank, at, step = text.partition("@")
    if not at or not rank.strip().isdigit() or not step.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK@STEP (e.g. 5@1), not {text!r}")
    return int(rank), int(step)


def parse_size(text: str) -> int:
    """``64MiB`` -> 67108864; plain numbers are bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 65536, 64MiB or 1GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


# ------------------------------------------------------------------------ check


def _check(args: argparse.Namespace) -> int:
    results = []
    status = ExitCode.OK
    for path in args.files:
        try:
            program = load(path)
            program.check()
        except LayoutError as err:
            status = ExitCode.BAD_INPUT
            _report(err, args.json)
            results.append({"file": path, "ok": False, **err.to_json()})
            continue
        counts = {
            "meshes": len(program.meshes),
            "tensors": len(program.tensors),
            "layouts": len(program.layouts),
            "reshards": len(program.reshards),
        }
        results.append({"file": path, "ok": True, **counts})
        if not args.json:
            singular = {"meshes": "mesh", "tensors": "tensor", "layouts": "layout", "reshards": "reshard"}
            described = ", ".join(f"{v} {k if v != 1 else singular[k]}" for k, v in counts.items())
            print(f"{path}: ok ({described})")
    if args.json:
        print(json.dumps(results, indent=2))
    return status


# ------------------------------------------------------------------------- show


def _region(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _mesh_line(layout: Layout) -> str:
    mesh = layout.mesh
    axes = ", ".join(f"{a}={s}" for a, s in mesh.axes)
    ranks = mesh.ranks
    contiguous = ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
    where = f"ranks {ranks[0]}..{ranks[-1]}" if contiguous else f"ranks {list(ranks)}"
    return f"layout {layout.name} on mesh {mesh.name} [{axes}] ({where})"


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _selected_tensors(program: Program, pattern: str | None) -> list[str]:
    if pattern is None:
        return list(program.tensors)
    if pattern in program.tensors:
        return [pattern]
    regex = compile_pattern(pattern)
    found = [t for t in program.tensors if regex.fullmatch(t)]
    if not found:
        raise LayoutNameError(
            f"no tensor matches '{pattern}' in {program.path}", hint=did_you_mean(pattern, program.tensors)
        )
    return found


def _show(args: argparse.Namespace) -> int:
    program = load(args.file)
    layouts = [program.layout(args.layout)] if args.layout else list(program.layouts.values())
    tensors = _selected_tensors(program, args.tensor)
    out: list[dict] = []
    lines: list[str] = []
    for layout in layouts:
        layout.check()
        ranks = list(layout.mesh.ranks)
        if args.rank is not None:
            if args.rank not in layout.mesh:
                if args.layout:
                    raise LayoutNameError(
                        f"rank {args.rank} is not in mesh '{layout.mesh.name}' of layout '{layout.name}' "
                        f"(ranks {layout.mesh.ranks[0]}..{layout.mesh.ranks[-1]})"
                    )
                continue
            ranks = [args.rank]
        lines.append(_mesh_line(layout))
        if args.summary:
            rows = [r for r in layout.summary() if r["rank"] in ranks]
            out.append({"layout": layout.name, "mesh": layout.mesh.name, "summary": rows})
            table = [[r["rank"], r["tensors"], r["boxes"], r["elements"], r["bytes"]] for r in rows]
            lines += _table(table, ["rank", "tensors", "boxes", "elements", "bytes"], {0, 1, 2, 3, 4})
            lines.append("")
            continue
        rows = []
        records = []
        for rank in ranks:
            for tensor in tensors:
                for box in layout.boxes(tensor, rank):
                    rows.append(
                        [
                            rank,
                            tensor,
                            _region(box.offsets, box.sizes),
                            box.storage,
                            _region(box.storage_offsets, box.sizes),
                            "x".join(map(str, layout.storage_shape(box.storage, rank) or ())),
                        ]
                    )
                    records.append(
                        {
                            "rank": rank,
                            "tensor": tensor,
                            "offsets": list(box.offsets),
                            "sizes": list(box.sizes),
                            "storage": box.storage,
                            "storage_offsets": list(box.storage_offsets),
                        }
                    )
        out.append({"layout": layout.name, "mesh": layout.mesh.name, "boxes": records})
        if rows:
            lines += _table(rows, ["rank", "tensor", "region", "storage", "place", "storage shape"], {0})
        else:
            lines.append("(no boxes)")
        lines.append("")
    if args.rank is not None and not out:
        raise LayoutNameError(f"rank {args.rank} belongs to no mesh of any layout in {program.path}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(lines).rstrip())
    return ExitCode.OK


# ------------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    program = load(args.file)
    program.check()
    plan = compile_plan(program, args.reshard, bucket_bytes=args.bucket_size, policy=args.policy)
    plan.validate()
    baseline = None
    if not args.no_compare and args.policy != "broadcast":
        baseline = compile_plan(program, args.reshard, bucket_bytes=args.bucket_size, policy="broadcast")
    if args.out:
        if args.out.endswith(".json"):
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(plan.to_json(), f, indent=1)
        else:
            with open(args.out, "wb") as f:
                f.write(plan.to_bytes())
    explained = list(itertools.islice(plan.moves(args.explain), args.limit)) if args.explain else []
    if args.json:
        out = plan.to_json(moves=False)
        if baseline is not None:
            out["gather_and_broadcast"] = baseline.stats.to_json()
            out["gather_and_broadcast"].pop("per_rank")
        if args.explain:
            out["moves"] = [str(m) for m in explained]
        print(json.dumps(out, indent=2))
        return ExitCode.OK
    lines = plan_report(plan, baseline, per_rank=args.per_rank)
    if args.explain:
        total = sum(1 for _ in plan.moves(args.explain)) if len(explained) == args.limit else len(explained)
        lines += ["", f"moves of {args.explain!r} ({total:,} in all):"]
        lines += [f"  {m}" for m in explained]
        if total > len(explained):
            lines.append(f"  ... {total - len(explained):,} more (raise --limit to see them)")
    if args.out:
        lines += ["", f"plan written to {args.out}"]
    print("\n".join(lines))
    return ExitCode.OK


# ------------------------------------------------------------------------ apply


def _apply(args: argparse.Namespace) -> int:
    from . import apply as job

    if args.elastic:
        return _apply_elastic(args)
    if args.kill or args.stop or args.replace:
        raise LayoutValueError("--kill, --stop and --replace need --elastic")

    options = job.ApplyOptions(
        path=args.file,
        reshard=args.reshard,
        policy=args.policy,
        compare=args.compare,
        memory_budget=args.memory_budget,
        timeout=args.timeout,
        from_dir=args.from_dir,
        to_dir=args.to_dir,
        cast=args.cast,
        repeat=args.repeat,
        transport=args.transport,
    )
    if job.environment_is_torchrun():
        reports = job.run_torchrun(options, args.device)
        if reports is None:
            return ExitCode.OK
        launcher = "torchrun"
    else:
        from .launch import WorkerError

        job.participants_of(args.file, args.reshard)  # a bad program fails here, before any process starts
        try:
            reports = job.run_local(options, show_progress=sys.stdout.isatty() and not args.json)
        except WorkerError as err:
            if err.kind in ("internal", "died"):
                raise
            # A user's mistake found on a worker: its message already has its place and caret.
            if args.json:
                print(json.dumps({"error": err.kind, "message": err.message}), file=sys.stderr)
            else:
                print(err.message, file=sys.stderr)
            return ExitCode.BAD_INPUT
        launcher = "local gloo workers"
    summary = job.summarize(reports)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join(_apply_report(args, summary, launcher)))
    return ExitCode.OK if summary["ok"] else ExitCode.FAILURE


def _apply_elastic(args: argparse.Namespace) -> int:
    from elastic import job

    from .apply import environment_is_torchrun, participants_of

    refused = [
        flag
        for flag, given in (
            ("--compare", args.compare), ("--from", args.from_dir), ("--to", args.to_dir), ("--cast", args.cast),
            ("--policy", args.policy), ("--repeat", args.repeat != 1), ("--transport nccl", args.transport == "nccl"),
        )
        if given
    ]
    if refused:
        raise LayoutValueError(f"--elastic runs repeated verified refits; it does not take {', '.join(refused)}")
    if args.steps < 1:
        raise LayoutValueError(f"--steps must be at least 1, not {args.steps}")
    participants = participants_of(args.file, args.reshard)  # a bad program fails here, before any process starts
    faults = [(r, s, "kill") for r, s in args.kill] + [(r, s, "stop") for r, s in args.stop]
    for rank, step, how in faults:
        if rank not in participants:
            raise LayoutValueError(
                f"--{how} {rank}@{step}: rank {rank} is in no mesh of the reshard (its ranks: "
                f"{participants[0]}..{participants[-1]})" if participants == list(range(participants[0], participants[-1] + 1))
                else f"--{how} {rank}@{step}: rank {rank} is in no mesh of the reshard (its ranks: {participants})"
            )
        if step >= args.steps:
            raise LayoutValueError(f"--{how} {rank}@{step}: there are only {args.steps} steps (0..{args.steps - 1})")
    options = job.ElasticOptions(
        path=args.file, steps=args.steps, reshard=args.reshard, faults=tuple(faults), replace=args.replace,
        memory_budget=args.memory_budget, timeout=min(args.timeout, 120.0), deadline=args.deadline,
        source_policy=args.source_policy, destination_policy=args.destination_policy,
        source_axis=args.source_axis, destination_axis=args.destination_axis,
    )
    if environment_is_torchrun():
        summary = job.run_torchrun(options, namespace=f"apply-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}")
        if summary is None:
            return ExitCode.OK
        launcher = "torchrun"
    else:
        summary = job.run_local(options)
        launcher = "local gloo workers"
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join(_elastic_report(args, summary, launcher)))
    if any(e["kind"] == "internal" for e in summary["errors"].values()):
        return ExitCode.INTERNAL
    return ExitCode.OK if summary["ok"] else ExitCode.FAILURE


def _elastic_report(args: argparse.Namespace, summary: dict, launcher: str) -> list[str]:
    program = load(args.file)
    statement = program.reshard(args.reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    lines = [
        f"elastic refit {statement.name}: {source.name} ({source.mesh.size} ranks) -> {destination.name} "
        f"({destination.mesh.size} ranks), {args.steps} steps, "
        f"{len(summary['participants']) + len(summary['joiners'])} processes ({launcher})",
    ]
    for rank, fault in sorted(summary["failed"].items(), key=lambda kv: kv[1]["at"]):
        lines.append(f"  rank {rank}: {'SIGSTOP' if fault['how'] == 'stop' else 'SIGKILL'} (injected)")
    lines.append("")
    rows = []
    for step in summary["steps"]:
        verified = "ok" if not step["mismatches"] else f"{len(step['mismatches'])} MISMATCHES"
        rows.append([step["step"], step["generation"], step["destination"], step["ranks"],
                     f"{verified} ({human_bytes(step['verified_bytes'])})"])
    if rows:
        lines += table(rows, ["step", "generation", "destination layout", "ranks", "verified"], right={0, 1, 3})
    for rec in summary["recoveries"]:
        what = []
        if rec["lost"]:
            what.append(f"lost {', '.join(map(str, rec['lost']))}")
        if rec["joined"]:
            what.append(f"joined {', '.join(map(str, rec['joined']))}")
        lines += ["", f"generation {rec['generation']} ({'; '.join(what)}), times from the {rec['from']}:"]
        for key, label in (("noticed_s", "noticed by the first survivor"), ("agreed_s", "members agreed"),
                           ("group_s", "new group built"), ("first_byte_s", "first byte moved on the new group")):
            if rec[key] is not None:
                lines.append(f"  {rec[key]:7.3f} s  {label}")
        for rank, why in sorted(rec["reasons"].items()):
            lines.append(f"           rank {rank}: {why}")
        if rec["recovered_bytes"]:
            lines.append(f"  recovery plan: {human_bytes(rec['recovered_bytes'])} from surviving replicas")
        for rank in rec["joined"]:
            got = summary["joined"].get(str(rank))
            if got:
                verdict = "ok" if got["ok"] else f"{len(got['mismatches'])} MISMATCHES"
                lines.append(f"  rank {rank} received step {got['step']}'s weights: {verdict} ({human_bytes(got['bytes'])})")
    for rank, error in sorted(summary["errors"].items()):
        lines += ["", f"rank {rank}: {error['message']}"]
        break  # every survivor reports the same error
    if summary["ok"]:
        lines += ["", f"all {args.steps} refits committed and verified; final generation {summary['generation']}: "
                      f"{summary['source']} -> {summary['destination']}, members {_compact(summary['members'])}"]
    return lines


def _compact(ranks: list[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``0..2, 4``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}..{r}" if r - start > 1 else ", ".join(map(str, range(start, r + 1))))
            start = None
    return ", ".join(out)


def _apply_report(args: argparse.Namespace, summary: dict, launcher: str) -> list[str]:
    program = load(args.file)
    statement = program.reshard(args.reshard)
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    lines = [
        f"refit {statement.name}: {source.name} ({source.mesh.size} ranks) -> {destination.name} "
        f"({destination.mesh.size} ranks), {summary['ranks']} processes ({launcher})",
        "",
    ]
    rows = []
    for policy, run in summary["runs"].items():
        verified = "ok" if not run["mismatches"] else f"{len(run['mismatches'])} MISMATCHES"
        rows.append(
            [
                policy,
                f"{run['seconds']:.3f} s",
                human_bytes(run["bytes"]["local"]),
                human_bytes(run["bytes"]["domain"]),
                human_bytes(run["bytes"]["network"]),
                human_bytes(run["moved_bytes"]),
                f"{run['messages']:,}",
                f"{human_bytes(run['bandwidth_bytes_per_second'])}/s",
                f"{human_bytes(run['peak_staging_bytes'])}",
                f"{verified} ({human_bytes(run['verified_bytes'])})",
            ]
        )
    lines += table(
        rows,
        ["policy", "time", "local", "domain", "network", "moved", "messages", "bandwidth", "peak staging", "verified"],
        right={1, 2, 3, 4, 5, 6, 7, 8},
    )
    runs = summary["runs"]
    if "reshard" in runs and "broadcast" in runs:
        r, b = runs["reshard"], runs["broadcast"]
        lines.append("")
        lines.append(
            f"gather-and-broadcast took {b['seconds'] / max(r['seconds'], 1e-9):.1f}x the time of reshard and moved "
            f"{b['moved_bytes'] / max(r['moved_bytes'], 1):.1f}x its bytes "
            f"({b['bytes']['network'] / max(r['bytes']['network'], 1):.1f}x over the network)"
        )
    for run in runs.values():
        for mismatch in run["mismatches"][:10]:
            lines.append(f"MISMATCH {mismatch}")
    if args.to_dir:
        lines.append(f"destination storages written to {args.to_dir}/rankNNNNN.safetensors")
    return lines


# ------------------------------------------------------------------------- main


def _report(err: LayoutError, as_json: bool) -> None:
    if as_json:
        print(json.dumps(err.to_json()), file=sys.stderr)
    else:
        print(err, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    from . import doctor, simulate, viz

    commands = {
        "check": _check,
        "show": _show,
        "plan": _plan,
        "apply": _apply,
        "simulate": simulate.run,
        "viz": viz.run,
        "doctor": doctor.run,
    }
    try:
        return int(commands[args.command](args))
    except LayoutError as err:
        _report(err, getattr(args, "json", False))
        return ExitCode.BAD_INPUT
    except BrokenPipeError:  # `layoutlang show ... | head`
        return ExitCode.OK
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except Exception as err:  # a bug in layoutlang, not the user's mistake: still no traceback
        log.debug("internal error", exc_info=True)
        if getattr(args, "json", False):
            print(json.dumps({"error": "internal", "message": f"{type(err).__name__}: {err}"}), file=sys.stderr)
        else:
            print(
                f"layoutlang: internal error: {type(err).__name__}: {err}\n"
                "  please report it; run with -vv to see the traceback",
                file=sys.stderr,
            )
        return ExitCode.INTERNAL


if __name__ == "__main__":
    sys.exit(main())
