"""Per-rank plans where a user meets plans: plan files read back (``load_plan``), ``layoutlang
apply --plan-mode``, ``layoutlang simulate --mode pairwise``, and the command line's refusals
of combinations that have no per-rank plan.

Oracles: a plan read back must be the plan written (every column, the fingerprint); the moves
of one rank's part are the whole pairwise plan's moves that send or receive on it; apply's
verified bytes are counted from the destination layout's boxes, and every destination byte
is compared with the synthetic source of truth by the workers."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.cli import main
from layoutlang.errors import ExecutionError, LayoutValueError
from layoutlang.plan import compile_plan, load_plan
from layoutlang.plan.data import _COLUMNS, _MAGIC

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def program_of(name: str) -> layoutlang.Program:
    return layoutlang.load(EXAMPLES / f"{name}.layout")


def participants(program: layoutlang.Program) -> list[int]:
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


def with_header(data: bytes, change) -> bytes:
    """The plan file ``data`` with its JSON header passed through ``change`` (a dict -> dict),
    its length prefix rewritten: a file damaged (or forged) in its header alone."""
    at = len(_MAGIC)
    (length,) = struct.unpack_from("<Q", data, at)
    header = json.loads(data[at + 8 : at + 8 + length])
    text = json.dumps(change(header), sort_keys=True, separators=(",", ":")).encode()
    return data[:at] + struct.pack("<Q", len(text)) + text + data[at + 8 + length :]


def columns_equal(a: layoutlang.Plan, b: layoutlang.Plan) -> bool:
    return all(np.array_equal(getattr(a.arrays, name), getattr(b.arrays, name)) for name, _ in _COLUMNS)


# ---------------------------------------------------------------------- plan files


@pytest.mark.parametrize("name, bucket_bytes", [("refit", 1 << 16), ("moe_ep", 256 * 2**20), ("uneven", 4096)])
def test_a_whole_pairwise_plan_and_every_ranks_part_read_back_as_written(name, bucket_bytes):
    program = program_of(name)
    whole = compile_plan(program, bucket_bytes=bucket_bytes, mode="pairwise")
    again = load_plan(whole.to_bytes(), program)
    assert (again.mode, again.rank) == ("pairwise", None)
    assert columns_equal(again, whole) and again.to_bytes() == whole.to_bytes()
    assert again.fingerprint == whole.fingerprint
    assert load_plan(whole.to_bytes(), program, mode="pairwise").mode == "pairwise"
    for rank in participants(program):
        part = compile_plan(program, bucket_bytes=bucket_bytes, rank=rank)
        mine = load_plan(part.to_bytes(), program, rank=rank, mode="per-rank")
        assert (mine.mode, mine.rank) == ("pairwise", rank)
        assert columns_equal(mine, part) and mine.to_bytes() == part.to_bytes()
        # the fingerprint covers the whole program: equal to the whole plan's
        assert mine.fingerprint == whole.fingerprint
        # the part read back is the whole plan's moves on that rank (each end computes alone)
        expected = sorted(str(m) for m in whole.moves() if rank in (m.src, m.dst))
        assert sorted(str(m) for m in mine.moves()) == expected
        assert mine.stats == part.stats


def test_a_fleet_plan_still_reads_back_without_a_mode():
    program = program_of("refit")
    fleet = compile_plan(program, bucket_bytes=1 << 16)
    again = load_plan(fleet.to_bytes(), program, mode="fleet", rank=5)
    assert (again.mode, again.rank) == ("fleet", None)
    assert again.fingerprint == fleet.fingerprint


def test_a_plan_file_is_refused_where_it_does_not_fit():
    program = program_of("refit")
    part = compile_plan(program, rank=7).to_bytes()
    whole = compile_plan(program, mode="pairwise").to_bytes()
    fleet = compile_plan(program).to_bytes()
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part of the pairwise plan of 'refit', not rank 3's"):
        load_plan(part, program, rank=3)
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part .*, not a fleet plan"):
        load_plan(part, program, mode="fleet")
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part .*, not a whole pairwise plan"):
        load_plan(part, program, mode="pairwise")
    with pytest.raises(LayoutValueError, match=r"holds the whole pairwise plan of 'refit', not a per-rank plan"):
        load_plan(whole, program, mode="per-rank")
    with pytest.raises(LayoutValueError, match=r"holds the whole fleet's plan of 'refit', not a whole pairwise"):
        load_plan(fleet, program, mode="pairwise")
    with pytest.raises(LayoutValueError, match=r"rank 99 belongs to neither mesh of plan 'refit' \('megatron': ranks"):
        load_plan(whole, program, rank=99)
    with pytest.raises(LayoutValueError, match="unknown plan mode 'nearest'"):
        load_plan(fleet, program, mode="nearest")


def test_an_executor_refuses_a_loaded_part_of_another_rank():
    """The executor checks whose part it runs before it touches the transport."""
    from layoutlang.runtime.executor import Executor

    program = program_of("refit")
    part = load_plan(compile_plan(program, rank=7).to_bytes(), program)
    with pytest.raises(ExecutionError, match="rank 3 was given the per-rank plan of rank 7"):
        Executor(part, 3, transport=None)  # type: ignore[arg-type]


def test_a_part_relabelled_or_stripped_of_its_mode_is_refused():
    """The header says whose part and which mode: the columns are validated as that kind of
    plan, so a forged header does not pass."""
    program = program_of("refit")
    data = compile_plan(program, rank=7, bucket_bytes=1 << 16).to_bytes()
    # rank 3's header on rank 7's moves: its moves do not all touch rank 3
    with pytest.raises(LayoutValueError, match="invalid"):
        load_plan(with_header(data, lambda h: h | {"rank": 3}), program)
    # no mode: read as a fleet plan, rank 7's moves do not write every destination byte
    with pytest.raises(LayoutValueError):
        load_plan(with_header(data, lambda h: {k: v for k, v in h.items() if k not in ("mode", "rank")}), program)
    with pytest.raises(LayoutValueError, match="unknown plan mode 'nearest'"):
        load_plan(with_header(data, lambda h: h | {"mode": "nearest"}), program)
    with pytest.raises(LayoutValueError, match="a per-rank plan of rank 7 in mode 'fleet'"):
        load_plan(with_header(data, lambda h: h | {"mode": "fleet"}), program)
    with pytest.raises(LayoutValueError, match="the part of rank 40, which belongs to neither mesh"):
        load_plan(with_header(data, lambda h: h | {"rank": 40}), program)
    with pytest.raises(LayoutValueError, match="a per-rank plan of rank '7'"):
        load_plan(with_header(data, lambda h: h | {"rank": "7"}), program)
    # the per-rank totals are recomputed from the rank's part, not trusted
    damaged = with_header(data, lambda h: h | {"lower_bound_bytes": h["lower_bound_bytes"] + 1})
    with pytest.raises(LayoutValueError, match="lower_bound_bytes does not match"):
        load_plan(damaged, program)


# ---------------------------------------------------------------------- layoutlang apply

LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAYOUTLANG, *args], cwd=ROOT, capture_output=True, text=True, timeout=280, env=os.environ.copy()
    )


def destination_bytes(program: layoutlang.Program) -> int:
    """Every byte the destination ranks hold, counted from the destination layout's boxes."""
    destination = program.layout(program.reshard().destination)
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}
    total = 0
    for rank in destination.mesh.ranks:
        for name in destination.resolved.names:
            for box in destination.boxes(name, rank):
                total += int(np.prod(box.sizes)) * itemsize[destination.tensors[name].dtype]
    return total


def test_apply_runs_per_rank_plans_on_local_workers_and_verifies_every_byte():
    path = EXAMPLES / "tp_to_dp.layout"
    program = layoutlang.load(path)
    result = run_cli("apply", str(path), "--plan-mode", "per-rank", "--compare", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["result"]
    assert report["ok"] and report["ranks"] == len(participants(program))
    reshard, broadcast = report["runs"]["reshard"], report["runs"]["broadcast"]
    whole = compile_plan(program, mode="pairwise")
    assert reshard["plan_mode"] == "per-rank"
    # every rank compiled only its own moves: the most on one rank, counted in the whole plan
    assert reshard["plan_moves"] == max(
        sum(1 for m in whole.moves() if rank in (m.src, m.dst)) for rank in participants(program)
    )
    assert reshard["plan_moves"] < whole.num_moves
    # one fingerprint on every rank, the whole program's
    assert reshard["fingerprints"] == [whole.fingerprint]
    assert reshard["bytes"] == whole.stats.bytes
    assert reshard["verified_bytes"] == broadcast["verified_bytes"] == destination_bytes(program)
    assert reshard["mismatches"] == [] == broadcast["mismatches"]
    # gather-and-broadcast has the whole fleet's plan only
    assert broadcast["plan_mode"] == "fleet"
    assert broadcast["plan_moves"] == compile_plan(program, policy="broadcast").num_moves
    # the text report of the same run says which plans ran, in a column and a line each
    from layoutlang.cli.apply import _apply_report

    args = layoutlang.cli.build_parser().parse_args(["apply", str(path), "--plan-mode", "per-rank", "--compare"])
    lines = _apply_report(args, report, "local gloo workers")
    assert lines[1] == (
        f"  reshard: per-rank plans, each rank its own part of the pairwise plan (at most {reshard['plan_moves']} "
        "moves on one rank)"
    )
    assert lines[2] == f"  broadcast: the whole fleet's plan on every rank ({broadcast['plan_moves']} moves)"
    header = next(line for line in lines if line.startswith("policy"))
    assert header.split()[:3] == ["policy", "plan", "time"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("reshard ", "broadcast "))}
    assert rows["reshard"][1] == "per-rank" and rows["broadcast"][1] == "fleet"
    assert "ok" in rows["reshard"] and "ok" in rows["broadcast"]
    # a default run of fleet plans (this run's gather-and-broadcast alone) reports as before modes
    from layoutlang.cli.apply import plan_modes_shown

    default = layoutlang.cli.build_parser().parse_args(["apply", str(path)])
    fleet_only = report | {"runs": {"broadcast": broadcast}}
    plain = plan_modes_shown(default, fleet_only)
    assert set(broadcast) - set(plain["runs"]["broadcast"]) == {"plan_mode", "plan_moves"}
    lines = _apply_report(default, plain, "local gloo workers")
    assert lines[1] == "" and lines[2].split()[:2] == ["policy", "time"]
    assert plan_modes_shown(args, fleet_only) == fleet_only  # asked for: always reported


def test_the_help_names_the_resharders_threshold():
    from layoutlang.cli.apply import PER_RANK_PLAN_RANKS as written
    from layoutlang.runtime.resharder import PER_RANK_PLAN_RANKS

    assert written == PER_RANK_PLAN_RANKS
    parser = layoutlang.cli.build_parser()
    apply = parser._subparsers._group_actions[0].choices["apply"]  # type: ignore[union-attr]
    text = " ".join(apply.format_help().split())
    assert f"at least {PER_RANK_PLAN_RANKS:,} ranks together" in text


BROADCAST_RULE = """
mesh a [tp = 2] on ranks 0..1
mesh b [dp = 2] on ranks 2..3
tensor "w" [64, 64] fp32
tensor "norm" [64] fp32
tensor "bias" [64] fp32
layout x on a { "w": tp = shard(0)
 default: replicate }
layout y on b { default: replicate }
reshard x -> y {
    "norm": broadcast
    "bias": broadcast
}
"""


def test_apply_refuses_per_rank_plans_of_what_is_gathered_and_broadcast(tmp_path, capsys):
    """One line and a hint, exit 2, before any worker starts."""
    path = tmp_path / "rules.layout"
    path.write_text(BROADCAST_RULE)
    assert main(["apply", str(path), "--plan-mode", "per-rank"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --plan-mode per-rank: reshard '")
    assert err[0].endswith("gathers and broadcasts 2 tensors ('norm', 'bias'), which has no per-rank plan")
    assert err[1].strip().startswith("hint: pass --policy reshard") and len(err) == 2
    assert main(["apply", str(EXAMPLES / "tp_to_dp.layout"), "--plan-mode", "per-rank", "--policy", "broadcast"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        "error: --plan-mode per-rank with --policy broadcast: gather-and-broadcast has no per-rank"
    )
    assert len(err) == 2
    assert main(["apply", str(EXAMPLES / "tp_to_dp.layout"), "--elastic", "--plan-mode", "fleet"]) == 2
    assert "does not take --plan-mode fleet" in capsys.readouterr().err
    assert main(["apply", str(path), "--plan-mode", "per-rank", "--json"]) == 2
    (record,) = json.loads(capsys.readouterr().out)["errors"]
    assert record["error"] == "value" and "no per-rank plan" in record["message"]


# ---------------------------------------------------------------------- layoutlang simulate


def test_simulate_estimates_the_whole_pairwise_plan(capsys):
    path = EXAMPLES / "refit.layout"
    program = layoutlang.load(path)
    assert main(["simulate", str(path), "--mode", "pairwise", "--bucket-size", "64KiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["result"]
    rows = {row["policy"]: row for row in out["policies"]}
    assert list(rows) == ["reshard", "pairwise reshard", "gather-and-broadcast"]
    pairwise = rows["pairwise reshard"]
    whole = compile_plan(program, bucket_bytes=64 * 1024, mode="pairwise")
    # the bytes a pairwise plan moves are the fleet plan's (both deliver once per domain)
    assert pairwise["bytes"] == rows["reshard"]["bytes"] == whole.stats.bytes
    assert pairwise["buckets"] == whole.num_buckets
    # a message is every move between one pair of ranks in one bucket and stage
    network = {(m.bucket, m.stage, m.src, m.dst) for m in whole.moves() if m.kind == "network"}
    assert pairwise["messages"]["network"] == len(network)
    assert pairwise["ratio_to_lower_bound"] >= 1.0
    assert main(["simulate", str(path), "--mode", "pairwise"]) == 0
    text = capsys.readouterr().out
    assert any(line.startswith("pairwise reshard ") for line in text.splitlines())
    assert "pairwise reshard: stage-major, as the executor runs it" in text
    assert "  pairwise reshard: " in text  # its busiest port


def test_simulate_compiles_the_pairwise_plan_for_the_topologys_domains(capsys):
    """--topology replaces the program's domains: the pairwise row's plan is compiled for them."""
    path = EXAMPLES / "refit.layout"
    program = layoutlang.load(path)
    assert main(["simulate", str(path), "--mode", "pairwise", "--topology", "gb200_nvl72", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["result"]
    row = next(r for r in out["policies"] if r["policy"] == "pairwise reshard")
    statement = program.reshard()
    from layoutlang.plan import plan_layouts

    wide = plan_layouts(
        program.layout(statement.source),
        program.layout(statement.destination),
        domain_size=out["topology"]["domain_size"],
        mode="pairwise",
    )
    assert out["topology"]["domain_size"] == 72
    assert row["bytes"] == wide.stats.bytes and row["bytes"]["network"] == 0  # one domain holds every rank


def test_simulate_without_mode_is_unchanged(capsys):
    path = str(EXAMPLES / "refit.layout")
    assert main(["simulate", path, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["result"]
    assert main(["simulate", path, "--mode", "fleet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"] == plain
    assert [r["policy"] for r in plain["policies"]] == ["reshard", "gather-and-broadcast"]


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "refit", "--rank", "999"],
            "--rank 999: rank 999 belongs to neither mesh of reshard 'refit' ('megatron': ranks 0..3",
        ),
        (
            ["plan", "refit", "--rank", "0", "--policy", "broadcast"],
            "--rank 0 with --policy broadcast: gather-and-broadcast has no per-rank plan",
        ),
        (["plan", "refit", "--mode", "pairwise", "--policy", "broadcast"], "per-rank (pairwise) plans move tensors"),
        (
            ["plan", "refit", "--rank", "0", "--mode", "fleet"],
            "--rank 0 with --mode fleet: a fleet plan's choices need the whole fleet",
        ),
        (["show", "refit", "--rank", "999"], "rank 999 belongs to no mesh of any layout in"),
        (["show", "refit", "--layout", "vllm", "--rank", "0"], "rank 0 is not in mesh 'infer' of layout 'vllm'"),
        (["simulate", "refit", "--mode", "nearest"], "argument --mode: invalid choice: 'nearest'"),
        (["apply", "refit", "--plan-mode", "pairwise"], "argument --plan-mode: invalid choice: 'pairwise'"),
    ],
)
def test_bad_combinations_exit_2_with_the_error_and_no_traceback(argv, message):
    argv = [a if a != "refit" else str(EXAMPLES / "refit.layout") for a in argv]
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    if argv[0] == "plan" and "--rank" in argv:  # refused before compiling: the error line and its hint
        assert result.stderr.startswith("error: --rank") and len(result.stderr.splitlines()) <= 2
