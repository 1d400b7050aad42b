"""Recovery from a rank failure during a refit: elastic shrink against torchrun's restart-all.

The same refit job (``examples/refit.layout`` by default: Megatron PP2 x TP2 on ranks 0..3
-> vLLM DP2 x TP4 on ranks 4..11, 12 gloo processes on this machine) runs ``--steps`` (3)
refits of synthetic weights (version = step), and one inference rank (``--victim``, 6)
SIGKILLs itself halfway through the executor's steps of refit ``--kill-step`` (1), in the
middle of a transfer, after writing ``time.time()`` where the benchmark can read it. Both
paths run in ONE invocation, alternately (shrink, restart, shrink, restart, ...), so that
load from other processes on the machine does not fall on one path only:

``shrink`` (layoutlang elastic)
    a pool of worker processes (:class:`layoutlang.cli.launch.LocalWorkers`) runs
    :class:`elastic.ElasticSession` refits (:func:`layoutlang.cli.elastic_job.refit_job`, the job of
    ``layoutlang apply --elastic`` and of the elastic session tests; the parent runs an
    :class:`elastic.ExitWatcher`).
    The survivors notice the failure, agree on the next generation without the victim,
    derive the new layouts (``drop-replica``: the victim's inference replica leaves the
    destination), build the new generation's gloo group, compile the new plan and retry the
    aborted refit; no process restarts. Figure: from the victim's kill to the first exchange
    completed on the new group (``Recovery.first_byte_at``), the least over survivors (the
    largest is printed too; survivors that exchange nothing in the new plan have none).
``torchrun`` (restart-all)
    ``python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N
    --max-restarts 1 benchmarks/recovery_torchrun_job.py`` with ``OMP_NUM_THREADS=1`` and
    torchrun's defaults otherwise (``--monitor-interval`` 0.1 s, the agent's shared
    TCPStore). Each worker joins the default gloo group on torchrun's store, its keys under
    a prefix of the attempt (``TORCHELASTIC_RESTART_COUNT``): with plain ``env://``
    (``--torchrun-env-init``) the restarted workers of torch 2.13 can read their peers'
    gloo addresses of the failed attempt from the shared store and time out connecting to
    them (pytorch/pytorch#135712). It then loads the program, builds a
    ``layoutlang.Resharder`` (plan compile and agreement over the group) and refits. When
    the victim dies, torchrun's agent tears down every worker and starts them all again;
    the restarted job re-initialises the process group, loads the program, compiles the
    plan and agrees on it (its first exchange), then resumes at the refit that failed.
    Figure: from the victim's kill to the first restarted worker whose Resharder returned,
    i.e. whose plan agreement (an exchange over the new group) completed (the last such
    worker is printed too).

``stall`` (a slow rank is forgiven)
    the same pool runs ``--stall-steps`` (10) elastic refits (:mod:`recovery_stall_job`), and
    a training rank (``--stall-rank``, 1) SIGSTOPs itself halfway through refit
    ``--stall-step`` (4); the parent SIGCONTs it 1.5 s later (longer than the 1 s deadline:
    the others suspect it, look again, and forgive it when its heartbeat resumes). Figures:
    each refit's time (the slowest rank's), before the stall and after it; the target is
    that the refits after it take at most 1.5x those before (the median over every run's
    refits after the stall against the median of those before it), with
    the rank still a member, every byte verified and no suspect left on any rank.

``auth`` (what the authenticated data plane costs a recovery)
    the group a shrink builds (the survivors: every rank but the victim) is built on the same
    pool ``--auth-rounds`` (10) times with the data plane's authentication (signed
    rendezvous, the challenge over every pair of members, signed verdicts: what every
    recovery now does) and, alternately, without it (a signer without the secret, for this
    comparison only), each build starting at a barrier of the members. Figure: the median
    build time each way (the slowest member per build) and their difference; the target is
    at most 50 ms.

All paths verify every destination byte of every committed refit against the synthetic
truth (exit status 1 if any differs, a path fails, or torchrun does not finish within
``--timeout``). The targets (shrink >= 5x faster than restart-all, best of repeats; shrink
< 1 s) are printed as ``met`` or ``MISSED``; a missed target is not an error, since times
depend on the machine and its load.

The figures: per path the best and the median of ``--repeats`` runs (3); their ratio; and
each path's breakdown for its best run, as seconds after the kill. Shrink: noticed (the
survivor's wait saw the failure), agreed (the new members and layouts), group built, first
byte (from ``elastic.Recovery``). Restart: process started (torchrun noticed the failure,
tore down the survivors, re-ran its rendezvous and started new workers), torch imported,
process group up, program loaded, first byte (plan compiled and agreed).

    python benchmarks/bench_recovery.py              # --repeats 3: about 2 minutes here
    python benchmarks/bench_recovery.py --repeats 1  # a smoke test
    # --layout FILE --victim R --kill-step S --steps N --memory-budget BYTES --only shrink,torchrun
    # --torchrun-env-init --timeout S --tmp DIR --json FILE --stall-rank R --stall-step S --stall-steps N
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's layoutlang

import torch
import torch.distributed as dist

import layoutlang

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SHRINK_TARGET_RATIO = 5.0  # shrink must be at least this many times faster than restart-all
SHRINK_TARGET_SECONDS = 1.0
STALL_SECONDS = 1.5  # how long the stalled rank stays stopped
STALL_TARGET_RATIO = 1.5  # the refits after a stall take at most this many times those before
KiB = 1024
AUTH_TARGET_SECONDS = 0.05  # what the data plane's authentication may add to a recovery


# ------------------------------------------------------------------------ shrink path


def run_shrink(pool, layout: Path, *, world: int, steps: int, victim: int, kill_step: int,
               memory_budget: int, namespace: str, timeout: float) -> dict[str, Any]:
    """One elastic run: every worker runs the refit job; the victim kills itself mid-transfer."""
    from elastic import ExitWatcher
    from layoutlang.cli.elastic_job import refit_job

    pool.respawn()
    pool.run(os.getpid)  # every worker is up (a respawned one imports torch first)
    pids = {r: p.pid for r, p in enumerate(pool.processes)}
    expect = [r for r in range(world) if r != victim]
    results: dict[int, dict] = {}
    errors: list[str] = []
    started = time.perf_counter()
    try:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=namespace):
            pool.submit(refit_job, str(layout), steps, namespace=namespace, faults=((victim, kill_step, "kill"),),
                        memory_budget=memory_budget)
            end = time.monotonic() + timeout
            while not set(expect) <= set(results) and time.monotonic() < end and not errors:
                result = pool.next_result(0.2)
                if result is None:
                    continue
                rank, ok, value = result
                if not ok:
                    errors.append(f"rank {rank}: {value[0]}: {value[1]}")
                elif rank in expect:
                    results[rank] = value
            if not set(expect) <= set(results) and not errors:
                errors.append(f"ranks {sorted(set(expect) - set(results))} did not finish within {timeout:g} s")
        ctl = dist.PrefixStore(f"{namespace}-ctl", pool.store)
        # the victim's own time.time() right before its SIGKILL ("<time> kill")
        failed = bytes(ctl.get(f"failed/{victim}")).decode() if ctl.check([f"failed/{victim}"]) else None
        killed = float(failed.split()[0]) if failed else None
    finally:
        wall = time.perf_counter() - started
        pool.respawn()  # the victim (and any worker that failed), replaced for the next run
    out: dict[str, Any] = {"wall": wall, "errors": errors, "killed": killed}
    if errors or killed is None:
        if killed is None and not errors:
            errors.append(f"rank {victim} never recorded its kill")
        return out
    restarted = [r for r in expect if pool.processes[r].pid != pids[r]]
    if restarted:
        errors.append(f"survivors {restarted} did not keep their processes")
    mismatches, verified_bytes = [], 0
    stamps: dict[str, list[float]] = {k: [] for k in ("noticed_at", "agreed_at", "group_at", "first_byte_at")}
    for rank, result in sorted(results.items()):
        if "error" in result:
            errors.append(f"rank {rank}: {result['error']}")
            continue
        if [c["step"] for c in result["checked"]] != list(range(steps)):
            errors.append(f"rank {rank}: committed steps {[c['step'] for c in result['checked']]}")
        for check in result["checked"]:
            if check.get("ok") is False:
                mismatches += [f"rank {rank} step {check['step']}: {m}" for m in check["mismatches"][:2]]
            verified_bytes += check.get("bytes", 0)
        recovery = result["recoveries"][0] if result["recoveries"] else None
        if recovery is None or recovery["lost"] != [victim]:
            errors.append(f"rank {rank}: recoveries {result['recoveries']}")
            continue
        for key, values in stamps.items():
            if recovery[key] is not None:
                values.append(recovery[key] - killed)
    first = stamps["first_byte_at"]
    if not first:
        errors.append("no survivor completed an exchange on the new group")
    out.update(
        seconds=min(first) if first else None,
        slowest=max(first) if first else None,
        stamps=stamps,
        ranks_with_first_byte=len(first),
        survivors=len(results),
        generation=sorted({r.get("generation") for r in results.values()}),
        destination=sorted({r.get("destination") for r in results.values() if r.get("destination")}),
        mismatches=mismatches,
        verified_bytes=verified_bytes,
    )
    return out


# ------------------------------------------------------------------------- stall path


def run_auth(pool, members: list[int], rounds: int) -> dict[str, Any]:
    """The auth path: the survivors' group built each way on the pool (recovery_auth_job)."""
    from recovery_auth_job import build_groups

    pool.respawn()
    results = pool.run(build_groups, f"bench-auth-{os.getpid()}", members, rounds)
    per_build = {way: [max(r["times"][way][i] for r in results if "times" in r) for i in range(rounds)]
                 for way in ("on", "off")}
    on, off = statistics.median(per_build["on"]), statistics.median(per_build["off"])
    return {"on": on, "off": off, "cost": on - off, "builds": per_build}


def run_stall(pool, layout: Path, *, steps: int, stalled: int, stall_step: int, memory_budget: int,
              namespace: str, timeout: float) -> dict[str, Any]:
    """One elastic run in which ``stalled`` stops for STALL_SECONDS mid-transfer of ``stall_step``."""
    from recovery_stall_job import stall_job

    from elastic import ExitWatcher

    pool.respawn()
    pool.run(os.getpid)
    world = pool.size
    results: dict[int, dict] = {}
    errors: list[str] = []
    key = f"{namespace}-ctl/stalled"
    continued = False
    started = time.perf_counter()
    try:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=namespace):
            pool.submit(stall_job, str(layout), steps, namespace=namespace, stalled=stalled, stall_step=stall_step,
                        memory_budget=memory_budget)
            end = time.monotonic() + timeout
            while len(results) < world and time.monotonic() < end and not errors:
                if not continued and pool.store.check([key]):
                    stopped_at = float(bytes(pool.store.get(key)).decode())
                    time.sleep(max(0.0, stopped_at + STALL_SECONDS - time.time()))
                    os.kill(pool.processes[stalled].pid, signal.SIGCONT)
                    continued = True
                result = pool.next_result(0.05)
                if result is None:
                    continue
                rank, ok, value = result
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}: {value[0]}: {value[1]}")
            if len(results) < world and not errors:
                errors.append(f"ranks {sorted(set(range(world)) - set(results))} did not finish within {timeout:g} s")
    finally:
        if not continued:  # never leave a stopped worker behind
            os.kill(pool.processes[stalled].pid, signal.SIGCONT)
        wall = time.perf_counter() - started
        pool.respawn()
    out: dict[str, Any] = {"wall": wall, "errors": errors}
    if errors:
        return out
    if not continued:
        errors.append(f"rank {stalled} never stalled")
    for rank, result in sorted(results.items()):
        if result["generation"] != 0 or result["members"] != list(range(world)):
            errors.append(f"rank {rank}: generation {result['generation']}, members {result['members']}")
        if result["suspected"]:
            errors.append(f"rank {rank} still suspects {result['suspected']}")
    # a refit takes as long as its slowest rank
    per_step = [max(r["seconds"][s] for r in results.values()) for s in range(steps)]
    before, after = per_step[1:stall_step], per_step[stall_step + 1 :]  # refit 0 also builds the first plan
    ratio = statistics.median(after) / statistics.median(before) if before and after else None
    out.update(per_step=per_step, before=before, stalled_refit=per_step[stall_step], after=after, ratio=ratio,
               rechecks=max(r["rechecks"] for r in results.values()),
               mismatches=[] if all(r["verified"] for r in results.values()) else ["a destination byte differs"])
    return out


# ---------------------------------------------------------------------- torchrun path


def run_torchrun(layout: Path, *, world: int, steps: int, victim: int, kill_step: int, memory_budget: int,
                 timeout: float, tmp: str | None, env_init: bool = False) -> dict[str, Any]:
    """One torchrun run with --max-restarts 1; the victim kills itself on the first attempt."""
    folder = Path(tempfile.mkdtemp(prefix="bench_recovery_torchrun_", dir=tmp))  # fresh: no stale files
    out_dir = folder / "times"
    out_dir.mkdir()
    log_path = folder / "torchrun.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(world), "--max-restarts", "1",
        str(HERE / "recovery_torchrun_job.py"), "--layout", str(layout), "--out", str(out_dir),
        "--steps", str(steps), "--victim", str(victim), "--kill-step", str(kill_step),
        "--memory-budget", str(memory_budget),
    ] + (["--env-init"] if env_init else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    errors: list[str] = []
    started = time.perf_counter()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the group we started
                proc.wait()
                rc = None
                errors.append(f"torchrun did not finish within {timeout:g} s (killed)")
        wall = time.perf_counter() - started
        if rc not in (0, None):
            errors.append(f"torchrun exited with status {rc}")
        killed_file = out_dir / "killed"
        killed = float(killed_file.read_text()) if killed_file.exists() else None
        restarts = [json.loads(p.read_text()) for p in sorted(out_dir.glob("restart.*"))]
        checks = {int(p.suffix[1:]): json.loads(p.read_text()) for p in out_dir.glob("checked.*")}
        if killed is None:
            errors.append(f"rank {victim} never recorded its kill")
        if len(restarts) != world:
            errors.append(f"{len(restarts)} of {world} workers wrote their restart times")
        if errors:
            lines = log_path.read_text(errors="replace").splitlines()
            # the workers' errors (first of each kind), then torchrun's summary
            causes = list(dict.fromkeys(line.strip() for line in lines if re.search(r"\w(Error|Exception): ", line)))
            tail = [*causes[:6], "...", *lines[-12:]]
            return {"wall": wall, "errors": errors, "log_tail": tail, "killed": killed}
        phases = ("started", "imported", "group", "loaded", "first_byte")
        stamps = {k: [r[k] - killed for r in restarts] for k in phases}
        mismatches, verified_bytes = [], 0
        for rank, checked in sorted(checks.items()):
            for check in checked:
                if not check["ok"]:
                    mismatches += [f"rank {rank} step {check['step']}: {m}" for m in check["mismatches"][:2]]
                verified_bytes += check["bytes"]
        resumed = sorted({r["resume_step"] for r in restarts})
        checked_steps = sorted({c["step"] for checked in checks.values() for c in checked})
        if checked_steps != list(range(resumed[0], steps)):
            errors.append(f"the restarted job verified steps {checked_steps}")
        return {
            "wall": wall, "errors": errors, "killed": killed,
            "seconds": min(stamps["first_byte"]), "slowest": max(stamps["first_byte"]),
            "stamps": stamps, "resume_step": resumed, "mismatches": mismatches, "verified_bytes": verified_bytes,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------ parent


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _times(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values) + " s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default=str(ROOT / "examples" / "refit.layout"),
                        help="the program (its ranks must be 0..N-1; default examples/refit.layout)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="refits per run (default 3)")
    parser.add_argument("--victim", type=int, default=6, help="the rank that is killed (default 6, inference)")
    parser.add_argument("--kill-step", type=int, default=1, help="the refit it dies in (default 1)")
    parser.add_argument("--memory-budget", type=int, default=512 * KiB,
                        help="memory_budget of both paths, in bytes (default 512 KiB: buckets of 256 KiB, "
                             "so a refit has several executor steps and the kill falls mid-transfer)")
    parser.add_argument("--only", default=None, help="comma-separated paths: shrink,torchrun,stall,auth")
    parser.add_argument("--auth-rounds", type=int, default=10, help="group builds each way of the auth path")
    parser.add_argument("--stall-rank", type=int, default=1, help="the rank that stalls (default 1, training)")
    parser.add_argument("--stall-step", type=int, default=4, help="the refit it stalls in (default 4)")
    parser.add_argument("--stall-steps", type=int, default=10, help="refits of a stall run (default 10)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run of a path may take")
    parser.add_argument("--torchrun-env-init", action="store_true",
                        help="torchrun workers call plain init_process_group('gloo') (env://) without a "
                             "per-attempt store prefix: on torch 2.13 their restart then fails "
                             "(pytorch/pytorch#135712)")
    parser.add_argument("--tmp", default=None, help="folder for torchrun's time files (default: the temp dir)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)

    paths = [p for p in ("shrink", "torchrun", "stall", "auth") if args.only is None or p in args.only.split(",")]
    layout_path = Path(args.layout).resolve()
    program = layoutlang.load(layout_path)
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    ranks = sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))
    world = len(ranks)
    if ranks != list(range(world)):
        print(f"{layout_path}: the program must use ranks 0..N-1, not {ranks}", file=sys.stderr)
        return 2
    if args.victim not in destination.mesh.ranks:
        print(f"rank {args.victim} is not an inference (destination) rank", file=sys.stderr)
        return 2
    logical = sum(t.nbytes for t in source.tensors.values())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by the pool's workers at their start

    try:
        shown = layout_path.relative_to(ROOT)
    except ValueError:
        shown = layout_path
    print(f"bench_recovery: {os.cpu_count()} cores, torch {torch.__version__}, Python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  program {shown}: {len(source.tensors)} tensors, {logical / 2**20:.2f} MiB; "
          f"{source.name} on {source.mesh.name} {dict(source.mesh.axes)} "
          f"ranks {source.mesh.ranks[0]}..{source.mesh.ranks[-1]}"
          f" -> {destination.name} on {destination.mesh.name} {dict(destination.mesh.axes)} ranks "
          f"{destination.mesh.ranks[0]}..{destination.mesh.ranks[-1]}; {world} processes (gloo, CPU)")
    if "shrink" in paths or "torchrun" in paths:
        print(f"  {args.steps} refits per run; rank {args.victim} SIGKILLs itself halfway through refit "
              f"{args.kill_step}'s transfer; memory_budget {args.memory_budget // KiB} KiB; {args.repeats} runs of "
              "each path, alternately")
        print(f"  shrink: ElasticSession (deadline 1 s, drop-replica) on a pool of {world} workers; "
              f"torchrun: --standalone --nproc-per-node {world} --max-restarts 1, OMP_NUM_THREADS=1, "
              f"{'env:// as is' if args.torchrun_env_init else 'group keys scoped by attempt'}", flush=True)
    if "stall" in paths:
        print(f"  stall: {args.stall_steps} refits per run on a pool of {world} workers (ElasticSession, deadline "
              f"1 s); rank {args.stall_rank} SIGSTOPped halfway through refit {args.stall_step}'s transfer, "
              f"SIGCONT {STALL_SECONDS:g} s later; {args.repeats} runs", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    failed = False
    begin = time.perf_counter()
    pool = None
    try:
        if "shrink" in paths or "stall" in paths or "auth" in paths:
            from layoutlang.cli.launch import LocalWorkers

            pool = LocalWorkers(world, timeout=120.0)
            pool.run(os.getpid)
            print(f"  pool of {world} workers started in {time.perf_counter() - begin:.1f} s", flush=True)
        if "auth" in paths:
            assert pool is not None
            result = run_auth(pool, [r for r in range(world) if r != args.victim], args.auth_rounds)
            runs["auth"].append(result)
            print(f"  auth: the survivors' group ({world - 1} members), {args.auth_rounds} builds each way: "
                  f"authenticated {result['on'] * 1000:.1f} ms, not {result['off'] * 1000:.1f} ms (medians of the "
                  f"slowest member); authentication {result['cost'] * 1000:+.1f} ms per recovery "
                  f"(target at most {AUTH_TARGET_SECONDS * 1000:.0f} ms: "
                  f"{'met' if result['cost'] <= AUTH_TARGET_SECONDS else 'MISSED'})", flush=True)
            paths.remove("auth")
        for n in range(args.repeats):
            for path in paths:
                if path == "stall":
                    result = run_stall(pool, layout_path, steps=args.stall_steps, stalled=args.stall_rank,
                                       stall_step=args.stall_step, memory_budget=args.memory_budget,
                                       namespace=f"bench-stall-{os.getpid()}-{n}", timeout=args.timeout)
                    runs[path].append(result)
                    failed |= bool(result["errors"] or result.get("mismatches"))
                    status = "FAILED" if result["errors"] else "verified"
                    if result.get("ratio") is not None:
                        print(f"  stall    run {n + 1}: refits before {_times(result['before'])}, stalled "
                              f"{result['stalled_refit']:.2f} s, after {_times(result['after'])}: "
                              f"{result['ratio']:.2f}x; {status}", flush=True)
                    else:
                        print(f"  stall    run {n + 1}: {status}", flush=True)
                    for error in result["errors"][:5]:
                        print(f"      {error.splitlines()[0] if error else error}")
                    continue
                if path == "shrink":
                    result = run_shrink(pool, layout_path, world=world, steps=args.steps, victim=args.victim,
                                        kill_step=args.kill_step, memory_budget=args.memory_budget,
                                        namespace=f"bench-recovery-{os.getpid()}-{n}", timeout=args.timeout)
                else:
                    result = run_torchrun(layout_path, world=world, steps=args.steps, victim=args.victim,
                                          kill_step=args.kill_step, memory_budget=args.memory_budget,
                                          timeout=args.timeout, tmp=args.tmp, env_init=args.torchrun_env_init)
                runs[path].append(result)
                bad = result["errors"] or result.get("mismatches")
                failed |= bool(bad)
                verified = "VERIFICATION FAILED" if result.get("mismatches") else "verified"
                status = "FAILED" if result["errors"] else verified
                print(f"  {path:<8} run {n + 1}: failure -> first byte {_fmt(result.get('seconds'))} "
                      f"(slowest rank {_fmt(result.get('slowest'))}); run took {result['wall']:.1f} s; {status} "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
                for error in result["errors"][:5]:
                    print(f"      {error.splitlines()[0] if error else error}")
                for line in result.get("log_tail", []):
                    print(f"      | {line}")
                for m in (result.get("mismatches") or [])[:3]:
                    print(f"      {m}")
    finally:
        if pool is not None:
            pool.close()

    summary = _print_results(runs, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "cpus": os.cpu_count(),
                                               "torch": torch.__version__, "program": str(shown),
                                               "processes": world}, indent=2))
    print(f"total {time.perf_counter() - begin:.1f} s; load average at the end {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


def _print_results(runs: dict[str, list[dict[str, Any]]], args) -> dict[str, Any]:
    labels = {"shrink": "shrink (elastic)", "torchrun": "torchrun restart-all"}
    summary: dict[str, Any] = {}
    if "shrink" in runs or "torchrun" in runs:
        print()
        print(
            "failure (SIGKILL of the victim) -> first byte moved on the new group: least over ranks; "
            "best and median of runs"
        )
        print(f"{'path':<24} {'best':>8} {'median':>8}   (repeats)")
    for path, results in runs.items():
        if path == "auth":
            summary["auth"] = results[0] if results else None  # printed as it was measured
            continue
        if path == "stall":
            continue  # printed apart below
        times = [r["seconds"] for r in results if r.get("seconds") is not None and not r["errors"]]
        if not times:
            print(f"{labels[path]:<24} {'-':>8} {'-':>8}   0 of {len(results)} runs succeeded")
            continue
        best = min(times)
        summary[path] = {"best": best, "median": statistics.median(times), "all": times,
                         "best_run": results[[r.get("seconds") for r in results].index(best)]}
        note = "" if len(times) == len(results) else f" of {len(results)}"
        print(f"{labels[path]:<24} {best:6.2f} s {summary[path]['median']:6.2f} s   {len(times)}{note}")
    if "shrink" in summary and "torchrun" in summary:
        ratio = summary["torchrun"]["best"] / summary["shrink"]["best"]
        median_ratio = summary["torchrun"]["median"] / summary["shrink"]["median"]
        fast = summary["shrink"]["best"] < SHRINK_TARGET_SECONDS
        print(f"restart / shrink         {ratio:.1f}x (target >= {SHRINK_TARGET_RATIO:g}x: "
              f"{'met' if ratio >= SHRINK_TARGET_RATIO else 'MISSED'}); "
              f"shrink < {SHRINK_TARGET_SECONDS:g} s: {'met' if fast else 'MISSED'}   [medians: {median_ratio:.1f}x]")
        summary["ratio"], summary["median_ratio"] = ratio, median_ratio
    elif "shrink" in summary:
        fast = summary["shrink"]["best"] < SHRINK_TARGET_SECONDS
        print(f"shrink < {SHRINK_TARGET_SECONDS:g} s: {'met' if fast else 'MISSED'}")

    if "shrink" in summary:
        run = summary["shrink"]["best_run"]
        print()
        print(f"shrink, best run: seconds after the kill, least .. largest over the {run['survivors']} survivors "
              f"(first byte: the {run['ranks_with_first_byte']} that exchange in the new plan)")
        for key, label in (("noticed_at", "noticed the failure"), ("agreed_at", "agreed members + layouts"),
                           ("group_at", "new gloo group built"), ("first_byte_at", "first byte (retried refit)")):
            values = run["stamps"][key]
            print(f"  {label:<28} {min(values):6.3f} .. {max(values):6.3f}")
        print(f"  no process restarted; generation {run['generation']}, destination layout {run['destination']}; "
              f"{run['verified_bytes'] / 2**20:.1f} MiB verified")
    if "torchrun" in summary:
        run = summary["torchrun"]["best_run"]
        print()
        print(f"torchrun, best run: seconds after the kill, least .. largest over the {len(run['stamps']['started'])} "
              "restarted workers")
        for key, label in (("started", "worker process started"), ("imported", "torch imported"),
                           ("group", "process group up"), ("loaded", "program loaded"),
                           ("first_byte", "first byte (plan agreed)")):
            values = run["stamps"][key]
            print(f"  {label:<28} {min(values):6.3f} .. {max(values):6.3f}")
        print(f"  resumed at refit {run['resume_step']}; {run['verified_bytes'] / 2**20:.1f} MiB verified")
    stalls = [r for r in runs.get("stall", []) if not r["errors"] and r.get("ratio") is not None]
    if "stall" in runs:
        print()
        print(f"stall: rank {args.stall_rank} stopped {STALL_SECONDS:g} s (deadline 1 s) halfway through refit "
              f"{args.stall_step} of {args.stall_steps}; each refit's time is its slowest rank's")
        if stalls:
            ratios = [r["ratio"] for r in stalls]
            before = statistics.median(t for r in stalls for t in r["before"])
            after = statistics.median(t for r in stalls for t in r["after"])
            ratio = after / before  # the medians over every run's refits
            print(f"  refits before the stall: median {before:.3f} s; after it: median {after:.3f} s: {ratio:.2f}x "
                  f"(target <= {STALL_TARGET_RATIO:g}x: {'met' if ratio <= STALL_TARGET_RATIO else 'MISSED'}; "
                  f"runs: {', '.join(f'{x:.2f}x' for x in ratios)})")
            stalled_refits = ", ".join(f"{r['stalled_refit']:.2f} s" for r in stalls)
            print(f"  the stalled refit: {stalled_refits}; rechecks per "
                  f"rank at most {max(r['rechecks'] for r in stalls)}; still a member, nothing suspected, verified")
            summary["stall"] = {"before": before, "after": after, "ratio": ratio, "ratios": ratios}
        else:
            print(f"  0 of {len(runs['stall'])} runs succeeded")
    for path in runs:
        summary.get(path, {}).pop("best_run", None)
    return summary


if __name__ == "__main__":
    sys.exit(main())
