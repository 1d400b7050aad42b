"""``layoutlang apply --delta``: synthetic training steps, each refit sent as deltas and every
destination byte verified against the truth after that step; options that do not combine are
refused before any worker starts, in the parser's or the command's words (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layoutlang.cli import main
from layoutlang.errors import ExitCode

ROOT = Path(__file__).resolve().parent.parent
REFIT = str(ROOT / "examples" / "refit.layout")


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layoutlang.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_delta_steps_move_a_fraction_of_the_dense_bytes_and_verify_every_byte():
    result = cli("apply", REFIT, "--delta", "--steps", "3", "--change-fraction", "0.001", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)["result"]
    assert summary["ok"]
    steps = summary["runs"]["reshard"]["delta_steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["mismatches"] == 0 and s["verified_bytes"] > 0 for s in steps)
    first, *later = steps
    assert first["messages"]["dense"] > 0 and first["wire_bytes"] >= first["dense_bytes"]  # no base yet
    for step in later:
        assert 0.0005 < step["changed_fraction"] < 0.002, step
        assert step["wire_bytes"] * 20 < step["dense_bytes"], step  # 0.1% changed: far below dense
        assert step["messages"]["dense"] == 0 and not step["stale"]
    assert steps[-1]["kept_bytes_per_rank"] > 0


@pytest.mark.timeout(300)
def test_elastic_delta_refits_are_dense_after_a_recovery_then_deltas_again():
    """``--elastic --delta``: an inference rank killed in step 1; every committed step verified
    against the trained weights; the first step of each generation moves dense."""
    result = cli("apply", REFIT, "--elastic", "--delta", "--steps", "4", "--kill", "6@1", "--change-fraction", "0.001",
                 "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)["result"]
    assert summary["ok"] and [s["step"] for s in summary["steps"]] == [0, 1, 2, 3]
    by_generation: dict[int, list[dict]] = {}
    for step in summary["steps"]:
        assert not step["mismatches"] and step["verified_bytes"] > 0
        by_generation.setdefault(step["generation"], []).append(step)
    assert len(by_generation) >= 2  # the kill made a new generation
    for steps in by_generation.values():
        first, *later = steps
        assert first["wire_bytes"] >= first["dense_bytes"]  # a new generation starts without versions
        assert all(step["wire_bytes"] * 20 < step["dense_bytes"] for step in later), later


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["--delta", "--change-fraction", "1.5"], "argument --change-fraction: expected a fraction within [0, 1]"),
        (["--delta", "--change-fraction", "nan"], "argument --change-fraction: expected a fraction within [0, 1]"),
        (["--delta", "--change-fraction", "lots"], "argument --change-fraction: expected a fraction such as 0.01"),
        (["--delta", "--steps", "0"], "argument --steps: expected a whole number of at least 1"),
        (["--delta", "--delta-budget", "lots"], "argument --delta-budget"),
    ],
)
def test_bad_delta_values_are_usage_errors(capsys, argv, refusal):
    with pytest.raises(SystemExit) as exit:
        main(["apply", REFIT, *argv])
    assert exit.value.code == ExitCode.BAD_INPUT
    assert refusal in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["--steps", "3"], "--steps counts the refits of --elastic or --delta; give one of them"),
        (["--change-fraction", "0.1"], "--change-fraction is the share of elements a --delta step changes"),
        (["--delta-digests"], "--delta-digests says what --delta senders keep; give --delta"),
        (["--delta-budget", "1MiB"], "--delta-budget says what --delta senders keep; give --delta"),
        (["--delta-place", "."], "--delta-place says what --delta senders keep; give --delta"),
        (["--delta", "--delta-place", "no/such/dir"], "--delta-place no/such/dir: not a directory"),
        (["--delta", "--repeat", "2"], "--delta does not take --repeat"),
        (["--delta", "--transport", "nccl"], "--delta does not take --transport nccl"),
    ],
)
def test_options_delta_does_not_combine_with_are_refused_before_any_worker_starts(capsys, argv, refusal):
    assert main(["apply", REFIT, *argv]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert refusal in err and "Traceback" not in err
