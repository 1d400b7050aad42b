"""The failure-recovery guide cannot rot.

Pages: ``docs/guides/failure-recovery.rst`` (and ``docs/reference/elastic.rst``; the recovery
plan examples of ``docs/guides/plans.rst`` are doctests, run by ``tests/test_docs.py``).

- Outputs of runs are ``docs/snippets/elastic-*.out``. Each starts with its command line
  (``$ layoutlang ...``, ``$ python ...``, run from the repository root); the tests here run
  the command again and compare everything that does not change from run to run: in the
  recovery timelines, the times and the reason given for each lost rank (an exit
  notification or a heartbeat, whichever a survivor saw first) are left out.
- The times the guide quotes in its step-by-step timeline are those of the example run
  it shows.
- ``docs/snippets/bench-recovery.out`` is the output of ``python benchmarks/bench_recovery.py``;
  it is shown, not re-made (a benchmark takes minutes and its figures are times).

Every run starts 7 to 13 processes, each importing torch: these tests are slow. To re-make
an ``.out`` file after a deliberate change, run its command and paste the output under the
command line, then check the times the guide quotes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
GUIDE = DOCS / "guides" / "failure-recovery.rst"
REFERENCE = DOCS / "reference" / "elastic.rst"


def example(name: str) -> tuple[list[str], str]:
    """(command, expected output) of ``docs/snippets/NAME``."""
    first, _, expected = (SNIPPETS / name).read_text("utf-8").partition("\n")
    assert first.startswith("$ "), f"{name}: the first line must be the command"
    return shlex.split(first[2:]), expected


def run(argv: list[str], timeout: float = 500) -> subprocess.CompletedProcess[str]:
    """Run a documented command from the repository root, as a user would, with this interpreter."""
    program, *rest = argv
    prefix = {"layoutlang": [sys.executable, "-m", "layoutlang.cli"], "python": [sys.executable]}[program]
    # torchrun's variables (a launcher around pytest) would make the command join that job
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return subprocess.run(
        [*prefix, *rest], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


_TIME = re.compile(r"^\s+\d+\.\d+ s  ")
_REASON = re.compile(r"^(\s+rank \d+): .*$")


def steady(report: str) -> list[str]:
    """An ``apply --elastic`` report without what changes from run to run: the times of the
    timelines and the reasons (how the failure was noticed) become ``*``."""
    out = []
    for line in report.rstrip("\n").splitlines():
        line = _TIME.sub("    * s  ", line.rstrip())  # the width follows the time
        if line.startswith("           rank "):  # a reason, under a timeline
            line = _REASON.sub(r"\1: *", line)
        out.append(line)
    return out


_GENERATIONS = ((re.compile(r"\bgeneration \d+"), "generation *"), (re.compile(r"_gen\d+\b"), "_gen*"))
_ROW = re.compile(r"^\s*(\d+)\s+\d+\s+(\S+)\s+\d+\s+(\S+) \(.*\)$")
_RECOVERY = re.compile(r"^generation \d+ \((.*)\), times from the (failure|decision):$")


def unnumbered(text: str) -> str:
    """``text`` without generation numbers, in words and in the layouts named after them."""
    for pattern, mask in _GENERATIONS:
        text = pattern.sub(mask, text)
    return text


def outcome(report: str) -> dict:
    """What an ``apply --elastic`` report promises whatever the machine's timing: the job and
    its faults, every step verified on the layouts it names, the ranks the recoveries lost and
    admitted, what moved to the replacements, and the last line. How many generations the
    failures took, and which step's commit admitted a replacement (the ranks and bytes of each
    step's row), are the timing: left out, with the times and reasons ``steady`` masks."""
    lines, steps, lost, joined, moved = [], [], [], [], []
    in_table = in_recovery = False
    for line in steady(report):
        header = _RECOVERY.match(line)
        row = _ROW.match(line) if in_table else None
        if header:
            what, origin = header.groups()
            ranks = {part.split(" ", 1)[0]: part.split(" ", 1)[1].split(", ") for part in what.split("; ")}
            lost += [int(r) for r in ranks.get("lost", [])]
            joined += [int(r) for r in ranks.get("joined", [])]
            assert origin == ("failure" if "lost" in ranks else "decision"), line
            in_recovery = True
        elif in_recovery and line.startswith(" "):
            if "recovery plan:" in line or " received step " in line:
                moved.append(re.sub(r"step \d+'s", "step *'s", line))
        elif row:
            step, destination, verdict = row.groups()
            steps.append((int(step), unnumbered(destination), verdict))
        else:
            in_recovery = False
            in_table = line.startswith("----") or (in_table and line != "")
            if line:  # one blank line more or less: one recovery block more or less
                lines.append(unnumbered(line))
    return {"lines": lines, "steps": steps, "lost": sorted(lost), "joined": sorted(joined), "moved": sorted(moved)}


# ------------------------------------------------------------------- cheap checks


def test_the_guide_is_in_the_toctree_and_shows_every_file():
    index = (DOCS / "index.rst").read_text("utf-8")
    assert "   guides/failure-recovery\n" in index and "   reference/elastic\n" in index
    pages = GUIDE.read_text("utf-8") + REFERENCE.read_text("utf-8")
    shown = {Path(m).name for m in re.findall(r"literalinclude:: (\S+)", pages)}
    files = [p.name for p in SNIPPETS.glob("elastic-*")] + ["bench-recovery.out"]
    assert sorted(set(files) - shown) == []


def test_the_timeline_the_guide_quotes_is_the_example_run():
    _, output = example("elastic-apply-replace.out")
    guide = GUIDE.read_text("utf-8")
    quoted = re.findall(r"\*\*(\d+\.\d{3}) s: ", guide)
    assert len(quoted) >= 4, quoted
    generation_1 = output.split("generation 1 ")[1].split("generation 2 ")[0]
    times = re.findall(r"^\s+(\d+\.\d{3}) s  ", generation_1, re.M)
    assert quoted == ["0.000", *times], (quoted, times)
    grow_first_byte = re.findall(r"^ +(\d+\.\d{3}) s  first byte", output, re.M)[-1]
    assert f"{grow_first_byte} s to its first byte" in guide
    recovered = re.search(r"recovery plan: (\S+ \S+) from surviving replicas", output).group(1)
    assert f"recovery plan moved {recovered} to them" in guide


def test_every_reason_a_survivor_gives_is_masked_and_nothing_else():
    _, output = example("elastic-apply-replace.out")
    lines = steady(output)
    assert "           rank 6: *" in lines
    assert "    * s  noticed by the first survivor" in lines
    assert sum("*" in line for line in lines) == 9  # 8 times and 1 reason


# ------------------------------------------------------------------- the runs


@pytest.mark.slow
def test_a_killed_rank_is_replaced_as_the_guide_shows():
    argv, expected = example("elastic-apply-replace.out")
    assert argv[:3] == ["layoutlang", "apply", "examples/refit.layout"] and "--replace" in argv
    result = run(argv)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert outcome(result.stdout) == outcome(expected)
    assert outcome(result.stdout)["lost"] == [6] and outcome(result.stdout)["joined"] == [12]


@pytest.mark.slow
def test_every_replica_losing_a_rank_is_refilled_by_spares_as_the_guide_shows():
    argv, expected = example("elastic-apply-two-replicas.out")
    assert "--replace" in argv and argv.count("--kill") == 2
    result = run(argv)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    # the two kills may be noticed in one generation or in two: the same ranks lost and admitted
    assert outcome(result.stdout) == outcome(expected)
    assert outcome(result.stdout)["lost"] == [5, 9] and outcome(result.stdout)["joined"] == [12, 13]


@pytest.mark.slow
def test_a_lost_training_rank_stops_every_survivor_as_the_guide_shows():
    argv, expected = example("elastic-apply-loss.out")
    result = run(argv)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert result.stdout == expected
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_the_python_example_runs_as_the_guide_shows():
    argv, expected = example("elastic-session.out")
    assert argv == ["python", "docs/snippets/elastic-session.py"]
    result = run(argv)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert unnumbered(result.stdout) == unnumbered(expected)  # the hooks' generations are the timing's
    assert result.stdout.splitlines()[-1] == "ok"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
