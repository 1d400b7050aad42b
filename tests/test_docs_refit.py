"""The refit tutorial and the execution reference cannot rot.

Pages: ``docs/tutorials/refit.rst`` and ``docs/reference/execution.rst``.

- Outputs without timings (``check``, ``show``, ``plan``) are ``docs/snippets/outputs/refit-*.txt``
  and ``outputs/examples/refit-plan-spanning.txt``: ``tests/test_docs.py`` re-makes them.
- Outputs of runs are ``docs/snippets/refit-*.out``. Each starts with its command line
  (``$ layoutlang ...``, ``$ torchrun ...``, ``$ python ...``); the tests here run the
  command again and compare everything that does not change from run to run: the
  ``time`` and ``bandwidth`` columns, the speed-up, ``seconds``,
  ``bandwidth_bytes_per_second`` and ``peak_rss_growth_bytes`` are left out; the
  completion lines of ``refit_api.py`` are compared in any order. The checkpoint
  commands use ``/tmp/refit``; the tests replace it with a temporary folder.
- The numbers the tutorial works out by hand are checked against the compiled plan.

Every run starts processes (four to six, each importing torch): these tests are slow.
To re-make an ``.out`` file after a deliberate change, run its command and paste the
output under the command line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import layoutlang
from layoutlang.io.output import MANIFEST, read_manifest
from layoutlang.plan import compile_plan

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
PROGRAM = SNIPPETS / "refit-attn.layout"
TUTORIAL = DOCS / "tutorials" / "refit.rst"
REFERENCE = DOCS / "reference" / "execution.rst"
CHECKPOINT_FOLDER = "/tmp/refit"  # as the tutorial writes it

MiB, KiB = 2**20, 2**10

# ----------------------------------------------------------------------- helpers


def example(name: str) -> tuple[list[str], str]:
    """(command, expected output) of ``docs/snippets/NAME``."""
    first, _, expected = (SNIPPETS / name).read_text("utf-8").partition("\n")
    assert first.startswith("$ "), f"{name}: the first line must be the command"
    return shlex.split(first[2:]), expected


def run(argv: list[str], cwd: Path, timeout: float = 500) -> subprocess.CompletedProcess[str]:
    """Run a documented command as a user would, with this interpreter."""
    program, *rest = argv
    prefix = {
        "layoutlang": [sys.executable, "-m", "layoutlang.cli"],
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }[program]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")
    }
    return subprocess.run(
        [*prefix, *rest],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def steady(report: str) -> list[str]:
    """An ``apply`` text report without what changes from run to run.

    Table rows become their cells (column widths follow the times); the ``time`` and
    ``bandwidth`` cells and the speed-up become ``*``.
    """
    out: list[str] = []
    header: list[str] | None = None
    for line in report.rstrip("\n").splitlines():
        text = line.strip()
        cells = re.split(r"\s{2,}", text)
        if cells[0] == "policy":
            header = cells
        if header and text and set(text) <= {"-", " "}:
            continue  # the rule under the header: its widths follow the cells
        if header and len(cells) == len(header):
            cells = [
                "*" if h in ("time", "bandwidth") and c != h else c for h, c in zip(header, cells)
            ]
            out.append(" | ".join(cells))
        else:
            out.append(re.sub(r"took \d+(\.\d+)?x the time", "took *x the time", line.rstrip()))
    return out


VOLATILE = ("seconds", "bandwidth_bytes_per_second", "peak_rss_growth_bytes")


def steady_json(value):
    if isinstance(value, dict):
        return {k: steady_json(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [steady_json(v) for v in value]
    return value


# ------------------------------------------------------------------- cheap checks


def test_pages_are_in_the_toctree_and_show_every_file():
    index = (DOCS / "index.rst").read_text("utf-8")
    assert "   tutorials/refit\n" in index and "   reference/execution\n" in index
    pages = TUTORIAL.read_text("utf-8") + REFERENCE.read_text("utf-8")
    shown = {Path(m).name for m in re.findall(r"literalinclude:: (\S+)", pages)}
    files = [p.name for p in SNIPPETS.glob("refit-*") if p.suffix in {".layout", ".out", ".py"}]
    files += ["refit_api.py", "redistribute_dtensor.py"]
    assert sorted(set(files) - shown) == []


def test_the_numbers_worked_out_by_hand():
    """Step 3 and step 5 of the tutorial, against the compiled plans."""
    program = layoutlang.load(PROGRAM)
    plan = compile_plan(program)
    stats = plan.stats
    assert stats.lower_bound == 4 * (5 * MiB + 4 * KiB)
    assert stats.bytes == {"local": 0, "domain": 4 * 2 * KiB, "network": 20 * MiB + 8 * KiB}
    assert stats.moved == stats.lower_bound
    assert sum(stats.moves.values()) == 40 and stats.messages == 10 and stats.buckets == 1
    assert stats.largest_network_send == (10 * MiB + 4 * KiB, 0)
    baseline = compile_plan(program, policy="broadcast").stats
    # gather: the roots' own halves of the projections and the (replicated) norms locally,
    # the other halves from the training peer; broadcast once per domain; relays to the
    # domain peer; extraction of every inference rank's 5 MiB + 4 KiB
    model = 10 * MiB + 4 * KiB
    gather_local, gather_domain = 5 * MiB + 4 * KiB, 5 * MiB
    extraction = 4 * (5 * MiB + 4 * KiB)
    assert baseline.bytes == {
        "local": gather_local + extraction,
        "domain": gather_domain + 2 * model,
        "network": 2 * model,
    }
    assert f"{baseline.moved / stats.moved:.3f}" == "2.249"

    small = compile_plan(program, bucket_bytes=2 * MiB)
    assert small.stats.buckets == 6 and small.stats.messages == 30
    assert small.fingerprint.startswith("ddfb52e6afead898")
    buckets = {}
    for move in small.moves():
        buckets.setdefault(move.bucket, set()).add(move.tensor.split(".", 2)[2])
    # every rank's sends and receives spread over the 6 buckets the 10 MiB rank 0 sends need:
    # each 1 MiB q_proj and o_proj shard in a bucket of its own on its pair of ranks, the
    # small k, v and norm shards in the room left
    assert buckets == {
        0: {"attn.q_proj.weight", "attn.o_proj.weight"},
        1: {"attn.q_proj.weight", "attn.o_proj.weight"},
        2: {"attn.o_proj.weight", "attn.k_proj.weight", "norm.weight"},
        3: {"attn.o_proj.weight", "attn.k_proj.weight", "norm.weight"},
        4: {"attn.q_proj.weight", "attn.v_proj.weight"},
        5: {"attn.q_proj.weight", "attn.v_proj.weight"},
    }
    staged = Counter()
    for move in small.moves():
        staged[(move.bucket, move.src)] += move.nbytes
        staged[(move.bucket, move.dst)] += move.nbytes
    assert max(staged.values()) <= 2 * MiB


# ------------------------------------------------------------------- the runs


@pytest.mark.slow
def test_apply_compare_report_matches_the_example_run():
    argv, expected = example("refit-apply-compare.out")
    result = run(argv, SNIPPETS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert steady(result.stdout) == steady(expected)
    assert "reshard" in result.stdout and "broadcast" in result.stdout


@pytest.mark.slow
def test_apply_json_report_matches_the_example_run():
    argv, expected = example("refit-apply-json.out")
    assert "--memory-budget" in argv and "4MiB" in argv
    result = run(argv, SNIPPETS)
    assert result.returncode == 0, result.stdout + result.stderr
    output = json.loads(result.stdout)  # the --json envelope, the report its result
    assert steady_json(output) == steady_json(json.loads(expected))
    report = output["result"]
    reshard = report["runs"]["reshard"]
    # the numbers step 5 quotes
    assert reshard["bytes"] == {"local": 0, "domain": 8192, "network": 20_979_712}
    assert reshard["moved_bytes"] == reshard["verified_bytes"] == 20_987_904
    assert reshard["messages"] == 30
    # only regions under 1 MiB are staged, and the plan spreads them over the buckets: at
    # most a k shard (256 KiB) and a norm (2 KiB) in one bucket
    assert reshard["peak_staging_bytes"] == 256 * KiB + 2 * KiB
    assert reshard["mismatches"] == [] and report["ok"] is True
    assert [f[:16] for f in reshard["fingerprints"]] == ["ddfb52e6afead898"]


@pytest.mark.slow
def test_checkpoint_round_trip(tmp_path):
    folder = str(tmp_path / "refit")

    def here(argv: list[str]) -> list[str]:
        return [a.replace(CHECKPOINT_FOLDER, folder) for a in argv]

    def there(text: str) -> str:
        return text.replace(folder, CHECKPOINT_FOLDER)

    argv, expected = example("refit-checkpoint.out")
    result = run(here(argv), SNIPPETS)
    assert result.returncode == 0, result.stderr
    assert there(result.stdout) == expected

    argv, expected = example("refit-apply-checkpoint.out")
    result = run(here(argv), SNIPPETS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert steady(there(result.stdout)) == steady(expected)
    written = sorted(p.name for p in (tmp_path / "refit" / "vllm").iterdir())
    # the rank files, and the manifest of what this run wrote (what --overwrite may remove)
    assert written == [MANIFEST] + [f"rank{r:05d}.safetensors" for r in range(2, 6)]
    assert sorted(read_manifest(tmp_path / "refit" / "vllm")) == written[1:]

    argv, expected = example("refit-inspect.out")
    result = run(here(argv), SNIPPETS)
    assert result.returncode == 0, result.stderr
    assert there(result.stdout) == expected


@pytest.mark.slow
def test_torchrun_report_matches_the_example_run():
    argv, expected = example("refit-torchrun.out")
    assert argv[:4] == ["torchrun", "--standalone", "--nproc-per-node", "6"]
    result = run(argv, SNIPPETS)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert steady(result.stdout) == steady(expected)


@pytest.mark.slow
def test_refit_api_example():
    argv, expected = example("refit-api.out")
    result = run(argv, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # the completion lines come from four processes, in any order; nothing else varies
    assert sorted(lines) == sorted(expected.splitlines())
    completions = [line for line in lines if "complete (" in line]
    assert len(completions) == 2 * 2 * 2  # 2 refits x 2 inference ranks x 2 storages
    assert lines[-1] == "ok"


@pytest.mark.slow
def test_redistribute_dtensor_example():
    argv, expected = example("refit-redistribute.out")
    result = run(argv, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout == expected


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
