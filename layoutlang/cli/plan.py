"""``layoutlang plan``: a reshard's plan, its statistics and (``--explain``) its moves.

A plan whose two meshes hold more than :data:`MAX_PLAN_RANKS` ranks is refused before
anything is compiled, and a step that runs longer than a couple of seconds says so on
stderr (:class:`~.progress.Progress`), so a large plan is never minutes of silence.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from ..errors import ExitCode, LayoutValueError
from ..lang import load
from ..model import Program
from ..plan import Move, Plan, compile_plan
from ..plan.data import PLAN_MODES
from ..plan.quantized import QUANTIZE_AT
from . import arguments
from .json_output import emit
from .progress import Progress
from .report import plan_report

#: ranks the two meshes of a plan may hold together (65,536). The planner compares every
#: replica group of a tensor in one layout with every one in the other, so its time grows
#: with the product of the two sides: one tensor sharded over 16,384 + 16,384 ranks takes
#: 2.6 s to compile, four times as long at each doubling (10 s at this limit, hours at two
#: meshes of MAX_MESH_RANKS). The largest scale target (a 2.4T model) has 1,024 + 1,024.
MAX_PLAN_RANKS = 1 << 16

__all__ = ["MAX_PLAN_RANKS", "add_arguments", "check_plan_size", "run"]

HELP = "compile the plan of a reshard statement and print its statistics"
DESCRIPTION = (
    "Compile the plan that turns the source layout of a reshard statement into "
    "its destination layout, validate it, and print bytes by kind (local, domain, network), "
    "messages, buckets, the lower bound and the gather-and-broadcast baseline."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang plan``."""
    arguments.add_file(parser)
    arguments.add_reshard(parser)
    parser.add_argument(
        "--explain",
        metavar="PATTERN",
        nargs="?",
        const="*",
        help='print the moves of the tensors matching PATTERN (default "*": all), one line each',
    )
    parser.add_argument(
        "--limit", type=arguments.count, default=100, metavar="N", help="print at most N moves (default 100)"
    )
    arguments.add_bucket_size(parser)
    arguments.add_policy(parser)
    parser.add_argument("--per-rank", action="store_true", help="also print bytes sent and received per rank")
    parser.add_argument(
        "--mode",
        choices=PLAN_MODES,
        help="fleet (the default: choices balanced over the whole fleet) or pairwise (choices both ends "
        "of a move compute alone, as per-rank plans make them)",
    )
    parser.add_argument(
        "--quantize-at",
        choices=QUANTIZE_AT,
        default="auto",
        help="into a layout that stores tensors quantized: who quantizes the regions that keep whole blocks, "
        "their senders (source) or their destinations; auto (the default) weighs the topology's links "
        "against its quantize_bandwidth, and the report says why",
    )
    parser.add_argument(
        "--rank",
        type=arguments.rank_number,
        metavar="R",
        help="compile, validate and print only rank R's part of the pairwise plan (what a rank compiles "
        "in a large fleet); its fingerprint covers the whole program",
    )
    parser.add_argument("--no-compare", action="store_true", help="do not compile the gather-and-broadcast baseline")
    parser.add_argument(
        "--out", metavar="PLAN", help="write the plan: JSON when PLAN ends in .json, else the binary form"
    )
    parser.add_argument("--json", action="store_true", help="print the statistics (and explained moves) as JSON")
    parser.add_argument(
        "--tensors",
        action="store_true",
        help="with --json: also list every tensor (name, shape, dtype) and the broadcast ones (large for big models)",
    )


def check_plan_size(program: Program, reshard: str | None) -> None:
    """Refuse a reshard whose meshes hold more than MAX_PLAN_RANKS ranks, before compiling it
    (any command that compiles a program's plan may call it first)."""
    statement = program.reshard(reshard)
    source, destination = program.layout(statement.source).mesh, program.layout(statement.destination).mesh
    ranks = len(set(source.ranks).union(destination.ranks))
    if ranks > MAX_PLAN_RANKS:
        raise LayoutValueError(
            f"reshard '{statement.name}' is too large to plan: its meshes hold {ranks:,} ranks "
            f"('{source.name}' {len(source.ranks):,}, '{destination.name}' {len(destination.ranks):,}); "
            f"layoutlang compiles whole-fleet plans of at most {MAX_PLAN_RANKS:,} ranks",
            statement.span,
            "the planner's time grows with the product of the two meshes' ranks; plan the job at the scale it runs",
        )


def _check_out(out: str) -> None:
    """Refuse, before anything is compiled, a ``--out`` the plan cannot be written to: a folder,
    or a file in a folder that does not exist (a path mistake, exit 2, not an internal error
    after minutes of compiling)."""
    path = Path(out)
    if path.is_dir():
        raise LayoutValueError(f"--out {out}: is a folder; give the plan file's name (PLAN.json or PLAN)")
    if not path.parent.is_dir():
        raise LayoutValueError(f"--out {out}: its folder {path.parent} does not exist")


def _write_plan(plan: Plan, out: str) -> None:
    """The plan into ``out``: JSON when it ends in .json, else the binary form."""
    data = json.dumps(plan.to_json(), indent=1).encode("utf-8") if out.endswith(".json") else plan.to_bytes()
    try:
        with open(out, "wb") as f:
            f.write(data)
    except OSError as err:
        raise LayoutValueError(f"--out {out}: cannot write the plan: {err.strerror or err}") from None


def run(args: argparse.Namespace) -> int:
    if args.tensors and not args.json:
        raise LayoutValueError("--tensors lists the tensors in the JSON output: add --json")
    if args.out:
        _check_out(args.out)
    progress = Progress("plan", args.json)
    with progress.step(f"reading {args.file}"):
        program = load(args.file, allow_outside_includes=args.allow_outside_includes)
    if args.rank is None:  # one rank's part grows with what the rank moves, not with the fleet
        check_plan_size(program, args.reshard)
    else:
        if args.mode == "fleet":
            raise LayoutValueError(
                f"--rank {args.rank} with --mode fleet: a fleet plan's choices need the whole fleet, so it has "
                "no part one rank compiles alone",
                hint="drop --mode fleet (per-rank plans are pairwise), or drop --rank for the whole fleet's plan",
            )
        arguments.check_per_rank(program, args.reshard, args.policy, f"--rank {args.rank}", rank=args.rank)
    if args.explain:  # a mistyped pattern is named now, not after minutes of compiling
        arguments.tensors_matching(program, args.explain)
    with progress.step("checking the layouts"):
        program.check()
    with progress.step("compiling the plan" if args.rank is None else f"compiling rank {args.rank}'s plan"):
        plan = compile_plan(
            program,
            args.reshard,
            bucket_bytes=args.bucket_size,
            policy=args.policy,
            mode=args.mode,
            rank=args.rank,
            quantize_at=args.quantize_at,
        )
    with progress.step("validating the plan"):
        plan.validate()
    baseline = None
    # gather-and-broadcast has no per-rank plan: its baseline is the whole fleet's
    if not args.no_compare and args.policy != "broadcast" and args.rank is None:
        with progress.step("compiling the gather-and-broadcast baseline"):
            baseline = compile_plan(program, args.reshard, bucket_bytes=args.bucket_size, policy="broadcast")
    if args.out:
        _write_plan(plan, args.out)
    explained = list(itertools.islice(plan.moves(args.explain), args.limit)) if args.explain else []
    if args.json:
        with progress.step("computing the statistics"):
            out = plan.to_json(moves=False)
            # statistics by default: the tensor list is megabytes for a 30B MoE model
            out["tensor_count"] = len(out["tensors"])
            out["broadcast_tensor_count"] = len(out["broadcast_tensors"])
            if not args.tensors:
                del out["tensors"], out["broadcast_tensors"]
            if not args.per_rank:
                del out["stats"]["per_rank"]
            if plan.quantization is not None:  # who quantizes, and why
                out["quantize_at"], out["quantize_reason"] = plan.quantize_at, plan.quantize_reason
            if baseline is not None:
                out["gather_and_broadcast"] = baseline.stats.to_json()
                out["gather_and_broadcast"].pop("per_rank")
        if args.explain:
            out["moves"] = [_explained(plan, m) for m in explained]
        return emit("plan", out)
    with progress.step("computing the statistics"):
        lines = plan_report(plan, baseline, per_rank=args.per_rank)
    if plan.rank is not None:
        part = f"  rank {plan.rank}'s part of the pairwise plan: the moves it sends or receives, its bytes and"
        lines[2:2] = [part + " messages; its lower bound is what it must receive"]
    elif plan.mode != "fleet":
        lines[2:2] = [f"  {plan.mode} plan: every choice computed by both ends of its move"]
    if args.explain:
        total = sum(1 for _ in plan.moves(args.explain)) if len(explained) == args.limit else len(explained)
        lines += ["", f"moves of {args.explain!r} ({total:,} in all):"]
        lines += [f"  {_explained(plan, m)}" for m in explained]
        if total > len(explained):
            lines.append(f"  ... {total - len(explained):,} more (raise --limit to see them)")
    if args.out:
        lines += ["", f"plan written to {args.out}"]
    print("\n".join(lines))
    return ExitCode.OK


def _explained(plan: Plan, move: Move) -> str:
    """A move's line; where it reads from or writes into a fused, stacked or transposed
    storage, with its places there (``qkv_proj.weight[64:96, 0:256]``,
    ``w13_weight[2, 6:12, 0:16]``; ``.T``: the region transposed), since those differ from
    the region's own coordinates."""
    places = []
    # a relay reads from a destination storage: the side, not the space, says from or into
    for side, space, place in zip(("from", "into"), (move.src_space, move.dst_space), plan.place(move)):
        if space == "scratch" or place is None:
            continue
        layout = plan.sources[move.source] if space == "source" else plan.destination
        storage = layout.storage_of(move.tensor)
        if not storage.stacked and not storage.is_transposed(move.tensor) and len(storage.parts) < 2:
            continue
        sizes = list(move.sizes)
        if storage.is_transposed(move.tensor):
            sizes[-2:] = sizes[:-3:-1]
        name, offsets = place
        lead = len(offsets) - len(sizes)  # the element of a stacked storage: an index
        items = [str(o) for o in offsets[:lead]] + [f"{o}:{o + n}" for o, n in zip(offsets[lead:], sizes)]
        transposed = ".T" if storage.is_transposed(move.tensor) else ""
        places.append(f"{side} {name}[{', '.join(items)}]{transposed}")
    return f"{move} {' '.join(places)}" if places else str(move)
