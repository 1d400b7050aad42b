"""Per-rank plans at fleet scale: what one rank pays to compile, validate and fingerprint
its own part of the pairwise plan, beside the whole fleet's plan of the same program.

Program (default): benchmarks/deepseek_v3_refit_4096.layout, DeepSeek-V3 671B from
training DP16 x PP16 x EP16 on ranks 0..4095 to inference DP128 x TP32 on ranks
4096..8191. Target (issue 15): per-rank compile + validate + fingerprint in at most 2 s and
1 GiB on one core for any rank; the whole fleet's compile no slower than before.

Ranks sampled, one subprocess each (so that its peak RSS is its own; pinned to core 0 with
``taskset -c 0`` unless ``--no-pin``):

- training: the first pipeline stage (the embedding), a middle one, the last (norm and
  lm_head), and the last training rank (another data-parallel replica);
- inference: the first, a middle and the last rank;
- the heaviest: the rank that sends and receives the most bytes among one replica of every
  role (the ranks whose ``dp`` coordinate is 0: the others differ from them only by which
  holder the hash picks), found by compiling each of them in one process (``scan``).

Each subprocess prints: loading the program and resolving both layouts (``load``), apart
from the plan; ``compile`` (``compile_plan(..., rank=r)`` end to end), ``validate``,
``fingerprint`` (a digest of both layouts, the policies and the options), their sum
(``plan total``), the rank's moves, messages, bytes sent and received, its peak RSS and its
growth over the RSS after loading. The whole fleet's plan of the same program (the default
``fleet`` mode: what every rank compiled before) runs in one more subprocess: its compile
time, moves and peak RSS (``--skip-fleet`` leaves it out: 15-50 s and 4-6 GiB).

``--baseline DIR`` compiles the whole fleet's plan with an earlier layoutlang too, side by
side: DIR holds that version installed (``benchmarks/install_baseline.sh REV DIR`` builds
it from a git revision), and the two run alternately, ``--fleet-runs`` times each (2 by
default with a baseline), each in a fresh subprocess; the best CPU seconds of each are
compared ("no slower than before": the issue-15 target, where the baseline is the revision
before its first planner change, ff6ebca).

Run:

    python benchmarks/bench_rank_plans.py [FILE] [--no-pin] [--skip-fleet] [--skip-scan] [--json OUT]
    python benchmarks/bench_rank_plans.py --skip-scan --baseline DIR [--fleet-runs N] [--fleet-checks]

``--fleet-checks`` also times what ``plan`` and the tests ask of the whole fleet's plan after
compiling it: its statistics, its fingerprint and ``validate()``, with the peak RSS after
each (an earlier version's validate() of the 4096 + 4096 program takes minutes).

Exit status 1 when a per-rank plan is invalid.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "deepseek_v3_refit_4096.layout"
TARGET_S, TARGET_BYTES = 2.0, 2**30


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


#: Set in a child that measures an earlier layoutlang (``--baseline``): the folder it is installed in.
BASELINE_ENV = "LAYOUTLANG_BENCH_BASELINE"


def _use_baseline() -> None:
    """Import layoutlang from the baseline folder, when this child measures one: ahead of
    sys.path and of the editable install's import hook (which would find this checkout)."""
    folder = os.environ.get(BASELINE_ENV)
    if not folder:
        return
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
    sys.path.insert(0, folder)


def _load(path: str):
    _use_baseline()
    import layoutlang

    program = layoutlang.load(path)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    _ = source.core, destination.core  # resolution: every tensor's spec, the C++ layouts
    return program, source, destination


def child_rank(path: str, rank: int) -> dict:
    """One rank's plan, measured in this (fresh) process."""
    start = time.perf_counter()
    import layoutlang  # noqa: F401  (the import is part of what a rank pays, but not of the plan)

    imported = time.perf_counter()
    program, _, _ = _load(path)
    loaded = time.perf_counter()
    rss_loaded = _rss()
    from layoutlang.errors import LayoutError
    from layoutlang.plan import compile_plan

    cpu = time.process_time()
    plan = compile_plan(program, rank=rank)
    compiled = time.perf_counter()
    problem = None
    try:
        plan.validate()
    except LayoutError as err:
        problem = str(err)
    validated = time.perf_counter()
    fingerprint = plan.fingerprint
    fingerprinted = time.perf_counter()
    cpu = time.process_time() - cpu
    stats = plan.stats.per_rank[rank]
    return {
        "rank": rank,
        "import_s": imported - start,
        "load_s": loaded - imported,
        "compile_s": compiled - loaded,
        "validate_s": validated - compiled,
        "fingerprint_s": fingerprinted - validated,
        "plan_s": fingerprinted - loaded,
        "plan_cpu_s": cpu,
        "moves": plan.num_moves,
        "messages": plan.stats.messages,
        "buckets": plan.num_buckets,
        "sent": sum(stats["sent"][k] for k in ("domain", "network")),
        "received": sum(stats["received"][k] for k in ("domain", "network")),
        "rss_loaded": rss_loaded,
        "peak_rss": _rss(),
        "fingerprint": fingerprint,
        "problem": problem,
    }


#: What ``--fleet-checks`` asks of the whole fleet's plan after compiling it, in this order.
FLEET_CHECKS = ("stats", "fingerprint", "validate")


def child_fleet(path: str, checks: bool = False) -> dict:
    """The whole fleet's plan (fleet mode), measured in this (fresh) process; with ``checks``,
    then its statistics, fingerprint and validation, each with its CPU seconds and the peak
    RSS after it."""
    program, _, _ = _load(path)
    rss_loaded = _rss()
    from layoutlang.plan import compile_plan

    start, cpu = time.perf_counter(), time.process_time()
    plan = compile_plan(program)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    import layoutlang

    result = {
        "layoutlang": str(Path(layoutlang.__file__).parent),
        "compile_s": seconds,
        "compile_cpu_s": cpu,
        "moves": plan.num_moves,
        "buckets": plan.num_buckets,
        "rss_loaded": rss_loaded,
        "peak_rss": _rss(),
    }
    if checks:
        steps = {"stats": lambda: plan.stats, "fingerprint": lambda: plan.fingerprint, "validate": plan.validate}
        for name in FLEET_CHECKS:
            cpu = time.process_time()
            steps[name]()
            result[f"{name}_cpu_s"] = time.process_time() - cpu
            result[f"{name}_peak_rss"] = _rss()
    return result


def child_scan(path: str) -> dict:
    """Every rank of one replica of each role, compiled one after the other: the heaviest."""
    program, source, destination = _load(path)
    from layoutlang.plan import compile_plan

    def first_replica(layout) -> list[int]:
        mesh = layout.mesh
        if "dp" not in mesh.axis_names:
            return list(mesh.ranks)
        return [r for r in mesh.ranks if mesh.coords(r)["dp"] == 0]

    candidates = first_replica(source) + first_replica(destination)
    start = time.perf_counter()
    loads = {}
    for rank in candidates:
        per = compile_plan(program, rank=rank).stats.per_rank[rank]
        loads[rank] = sum(per["sent"].values()) + sum(per["received"].values()) - per["sent"]["local"]
    heaviest = max(loads, key=lambda r: (loads[r], -r))
    return {
        "ranks": len(candidates),
        "seconds": time.perf_counter() - start,
        "heaviest": heaviest,
        "heaviest_bytes": loads[heaviest],
    }


def _run_child(args: list[str], pin: bool, baseline: str | None = None) -> dict:
    command = [sys.executable, __file__, "--child", *args]
    if pin and shutil.which("taskset"):
        command = ["taskset", "-c", "0", *command]
    env = {k: v for k, v in os.environ.items() if k != BASELINE_ENV}
    if baseline:
        env[BASELINE_ENV] = baseline
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sample(path: str) -> list[tuple[str, int]]:
    _, source, destination = _load(path)
    src, dst = source.mesh, destination.mesh
    roles: list[tuple[str, int]] = []
    if "pp" in src.axis_names:
        stages = dict(src.axes)["pp"]

        def at_stage(stage: int) -> int:
            return min(r for r in src.ranks if src.coords(r)["pp"] == stage)

        roles += [
            ("training, first stage", at_stage(0)),
            ("training, middle stage", at_stage(stages // 2)),
            ("training, last stage", at_stage(stages - 1)),
        ]
    else:
        roles.append(("training, first rank", min(src.ranks)))
    roles.append(("training, last rank", max(src.ranks)))
    ranks = sorted(dst.ranks)
    roles += [
        ("inference, first rank", ranks[0]),
        ("inference, middle rank", ranks[len(ranks) // 2]),
        ("inference, last rank", ranks[-1]),
    ]
    return roles


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _fleet(args: argparse.Namespace, pin: bool, results: list[dict]) -> tuple[dict, dict | None]:
    """The whole fleet's plan, best of ``--fleet-runs`` compiles; with ``--baseline``, the
    baseline's too, the two versions alternating. Returns the best run of each."""
    runs = args.fleet_runs or (2 if args.baseline else 1)
    versions = [None, args.baseline] if args.baseline else [None]
    measured: dict[str | None, list[dict]] = {v: [] for v in versions}
    child = ["fleet", args.file, *(["checks"] if args.fleet_checks else [])]
    for _ in range(runs):
        for version in versions:
            measured[version].append(_run_child(child, pin, version))
    best = {v: min(m, key=lambda r: r["compile_cpu_s"]) for v, m in measured.items()}
    fleet = best[None]
    per_rank = max(r["compile_s"] for r in results) if results else None
    for version, label in ((None, "this checkout"), (args.baseline, "baseline")):
        if version not in best:
            continue
        r = best[version]
        each = ", ".join(f"{m['compile_cpu_s']:.1f}" for m in measured[version])
        print(
            f"whole fleet's plan (fleet mode), {label} ({r['layoutlang']}): compile {r['compile_s']:.1f} s "
            f"({r['compile_cpu_s']:.1f} s CPU; best of {runs}: {each}), {r['moves']:,} moves, "
            f"{r['buckets']} buckets, peak RSS {_gib(r['peak_rss'])} (growth {_gib(r['peak_rss'] - r['rss_loaded'])})"
        )
        if args.fleet_checks:
            checks = [f"{n} {r[n + '_cpu_s']:.1f} s CPU (peak RSS {_gib(r[n + '_peak_rss'])})" for n in FLEET_CHECKS]
            print("  then " + ", ".join(checks))
    if per_rank:
        print(f"per-rank plan of the worst rank: {fleet['compile_s'] / per_rank:.0f}x faster to compile than this")
    if not args.baseline:
        return fleet, None
    baseline = best[args.baseline]
    ratio = fleet["compile_cpu_s"] / baseline["compile_cpu_s"]
    print(
        f"whole fleet's compile against the baseline: {ratio:.2f}x its CPU seconds "
        f"(target: no slower, <= 1.00x: {'met' if ratio <= 1.0 else 'MISSED'}); "
        f"peak RSS {fleet['peak_rss'] / baseline['peak_rss']:.2f}x"
    )
    return fleet, baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=str(DEFAULT))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--no-pin", action="store_true", help="do not pin each subprocess to core 0")
    parser.add_argument("--skip-fleet", action="store_true", help="do not compile the whole fleet's plan")
    parser.add_argument("--skip-scan", action="store_true", help="do not look for the heaviest rank")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    parser.add_argument(
        "--baseline", metavar="DIR", help="also compile the whole fleet's plan with the layoutlang installed in DIR"
    )
    parser.add_argument(
        "--fleet-runs", type=int, help="whole-fleet compiles per version, alternating (default 1; 2 with --baseline)"
    )
    parser.add_argument(
        "--fleet-checks",
        action="store_true",
        help="after each whole-fleet compile, time its stats, fingerprint and validate() too",
    )
    args = parser.parse_args()
    if args.child:
        kind, path, *rest = args.child
        result = {
            "rank": lambda: child_rank(path, int(rest[0])),
            "fleet": lambda: child_fleet(path, checks=rest == ["checks"]),
            "scan": lambda: child_scan(path),
        }[kind]()
        print(json.dumps(result))
        return 0

    pin = not args.no_pin
    print(f"program: {args.file}")
    roles = _sample(args.file)
    scan = None
    if not args.skip_scan:
        scan = _run_child(["scan", args.file], pin)
        print(
            f"scan: {scan['ranks']} ranks (one replica of every role) compiled in {scan['seconds']:.1f} s; "
            f"heaviest: rank {scan['heaviest']} ({scan['heaviest_bytes'] / 2**30:.1f} GiB sent + received)"
        )
        if scan["heaviest"] not in {r for _, r in roles}:
            roles.append(("heaviest", scan["heaviest"]))
        else:
            roles = [(f"{name} (heaviest)" if r == scan["heaviest"] else name, r) for name, r in roles]
    results = []
    for name, rank in roles:
        result = _run_child(["rank", args.file, str(rank)], pin) | {"role": name}
        results.append(result)
    header = (
        f"{'role':<32} {'rank':>5} {'moves':>8} {'msgs':>6} {'sent':>10} {'received':>10} "
        f"{'load':>6} {'compile':>8} {'validate':>8} {'fprint':>7} {'plan':>6} {'peak RSS':>9} {'growth':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['role']:<32} {r['rank']:>5} {r['moves']:>8,} {r['messages']:>6,} {_gib(r['sent']):>10} "
            f"{_gib(r['received']):>10} {r['load_s']:>5.2f}s {r['compile_s']:>7.3f}s {r['validate_s']:>7.3f}s "
            f"{r['fingerprint_s']:>6.3f}s {r['plan_s']:>5.2f}s {_gib(r['peak_rss']):>9} "
            f"{_gib(r['peak_rss'] - r['rss_loaded']):>9}"
        )
    worst_s = max(r["plan_s"] for r in results)
    worst_cpu = max(r["plan_cpu_s"] for r in results)
    worst_rss = max(r["peak_rss"] for r in results)
    print()
    print(
        f"per rank, worst: compile + validate + fingerprint {worst_s:.2f} s ({worst_cpu:.2f} s CPU; "
        f"target <= {TARGET_S:.0f} s: "
        f"{'met' if worst_s <= TARGET_S else 'missed'}), peak RSS {_gib(worst_rss)} (target <= 1 GiB: "
        f"{'met' if worst_rss <= TARGET_BYTES else 'missed'}); load + resolve apart: "
        f"{max(r['load_s'] for r in results):.2f} s"
    )
    if len({r["fingerprint"] for r in results}) != 1:
        print("FAILED: the sampled ranks' fingerprints differ")
        return 1
    print(f"fingerprint on every sampled rank: {results[0]['fingerprint'][:16]}")
    fleet = baseline = None
    if not args.skip_fleet:
        fleet, baseline = _fleet(args, pin, results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"file": args.file, "scan": scan, "ranks": results, "fleet": fleet, "baseline": baseline}, f, indent=1
            )
    bad = [r for r in results if r["problem"]]
    for r in bad:
        print(f"FAILED: rank {r['rank']}'s plan is invalid: {r['problem']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
