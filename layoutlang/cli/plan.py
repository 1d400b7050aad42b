"""``layoutlang plan``: a reshard's plan, its statistics and (``--explain``) its moves."""

from __future__ import annotations

import argparse
import itertools
import json

from ..errors import ExitCode
from ..lang import load
from ..plan import compile_plan
from .report import plan_report


def run(args: argparse.Namespace) -> int:
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

