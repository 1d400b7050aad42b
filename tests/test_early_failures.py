"""A rank that fails before the run's agreement stops every rank at once.

What one rank alone refuses or fails on before a byte moves (building its executor, reading
its weights, allocating its storages, the file it will write) reaches an agreement, so every
rank stops within a second, naming that rank, instead of waiting in the next agreement for
the whole timeout (300 s here: the bounds below are bounds on a hang, not speed targets).
And once one worker of a local job has failed, the launcher waits a few seconds for the
others, not their timeout, then ends the job naming the silent ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import early_failure_jobs as jobs
import pytest

from layoutlang.cli.apply_job import ApplyOptions
from layoutlang.cli.launch import FAILURE_GRACE, WorkerError
from layoutlang.errors import ExitCode

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300.0  # every agreement's and exchange's: a rank left waiting would wait this long
HANG_BOUND = 120.0  # well below TIMEOUT (nobody waited it out), above a loaded first compile

# Ranks 0..1 are pipeline stages: "a" lives on stage 0 (rank 0) only, "b" on stage 1 (rank 1).
STAGES = """\
mesh train [pp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "a" [64, 64] fp32
tensor "b" [64, 64] fp32
layout train on train {
    "a": pp[0]
    "b": pp[1]
}
layout serve on infer {
    "a": tp = shard(0)
    "b": tp = shard(1)
}
reshard train -> serve
"""
PARTICIPANTS = [0, 1, 2, 3]


def without_progress(stderr: str) -> str:
    """stderr without the lines of apply's progress display (tests/test_apply_progress.py)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("layoutlang apply: "))


# ------------------------------------------------------------- the Resharder


@pytest.mark.workers(4)
def test_an_executor_refused_on_one_rank_stops_every_rank_in_the_plan_agreement(pool):
    """Rank 2 is handed rank 3's per-rank plan: its executor refuses it before the plan
    agreement, so every rank raises the same AgreementError naming rank 2 and why."""
    results = pool.run(jobs.build_resharder, STAGES, PARTICIPANTS, 2, "wrong-part", TIMEOUT, timeout=120)
    outcomes = {r["rank"]: r for r in results if r is not None}
    assert sorted(outcomes) == PARTICIPANTS
    for rank, outcome in outcomes.items():
        assert outcome["error"] == "AgreementError", (rank, outcome)
        assert outcome["message"].startswith("rank 2 is not ready: rank 2 was given the per-rank plan of rank 3")
        assert outcome["message"].endswith("each rank runs its own part; nothing was moved")
        assert outcome["seconds"] < HANG_BOUND, (rank, outcome["seconds"])


@pytest.mark.workers(4)
def test_a_bug_building_one_ranks_executor_is_raised_there_and_stops_the_others(pool):
    """An unexpected exception (here: the schedule raising on rank 1) reaches the agreement as
    an internal error; rank 1 raises the exception itself, with the traceback of where it was
    raised, and the others an AgreementError naming rank 1, its type and message."""
    results = pool.run(jobs.build_resharder, STAGES, PARTICIPANTS, 1, "bug", TIMEOUT, timeout=120)
    outcomes = {r["rank"]: r for r in results if r is not None}
    victim = outcomes.pop(1)
    assert victim["error"] == "RuntimeError" and victim["message"] == "schedule broke on rank 1"
    assert "in broken_schedule" in victim["traceback"]  # its own traceback, not the agreement's
    assert "AgreementError" not in victim["traceback"]
    assert victim["seconds"] < HANG_BOUND
    for rank, outcome in outcomes.items():
        assert outcome["error"] == "AgreementError", (rank, outcome)
        assert outcome["message"] == (
            "rank 1 is not ready: internal error building the executor of plan 'train->serve' on rank 1: "
            "RuntimeError: schedule broke on rank 1; nothing was moved"
        )
        assert outcome["seconds"] < HANG_BOUND, (rank, outcome["seconds"])


# ----------------------------------------------------------- apply's preparation


@pytest.mark.workers(4)
def test_an_output_file_one_rank_cannot_write_stops_every_rank_before_a_byte_moves(pool, tmp_path):
    """Rank 3's output name is taken by a folder (the launcher checks the --to folder once
    for every rank, not each rank's file): every rank stops in the run's agreement, rank 3
    with its user's mistake, and no rank writes its file (no partial checkpoint is left)."""
    program = tmp_path / "stages.layout"
    program.write_text(STAGES)
    out = tmp_path / "out"
    (out / "rank00003.safetensors").mkdir(parents=True)
    options = ApplyOptions(path=str(program), to_dir=str(out), timeout=TIMEOUT)
    outcomes = {r["rank"]: r for r in pool.run(jobs.apply_into, options, PARTICIPANTS, timeout=120) if r is not None}
    expected = (
        f"rank 3 is not ready: rank 3: cannot write {out}/rank00003.safetensors: it is a folder; nothing was moved"
    )
    assert outcomes[3]["error"] == "LayoutValueError" and outcomes[3]["message"] == expected
    for rank in (0, 1, 2):
        assert outcomes[rank]["error"] == "AgreementError" and outcomes[rank]["message"] == expected
    assert all(o["seconds"] < HANG_BOUND for o in outcomes.values()), outcomes
    assert sorted(p.name for p in out.iterdir()) == ["rank00003.safetensors"]  # nothing else written


@pytest.mark.workers(4)
def test_a_checkpoint_one_rank_cannot_open_stops_every_rank_in_the_plan_agreement(pool, tmp_path):
    """Rank 1 cannot open the --from checkpoint (its host's copy is missing): every rank
    stops in the plan's agreement, rank 1 with its user's mistake, the others with an
    AgreementError in the same words, and nothing is read or moved."""
    import torch

    from layoutlang.io.weights import write_safetensors

    program = tmp_path / "stages.layout"
    program.write_text(STAGES)
    checkpoint = tmp_path / "model.safetensors"
    write_safetensors(checkpoint, {"a": torch.ones(64, 64), "b": torch.zeros(64, 64)})
    options = ApplyOptions(path=str(program), from_dir=str(checkpoint), timeout=TIMEOUT)
    results = pool.run(jobs.apply_without_the_checkpoint_on, options, PARTICIPANTS, 1, timeout=120)
    outcomes = {r["rank"]: r for r in results if r is not None}
    expected = (
        f"rank 1 is not ready: {checkpoint}: cannot read safetensors file: No such file or directory; nothing was moved"
    )
    assert outcomes[1]["error"] == "ModelDescriptionError" and outcomes[1]["message"] == expected
    for rank in (0, 2, 3):
        assert outcomes[rank]["error"] == "AgreementError" and outcomes[rank]["message"] == expected
    assert all(o["seconds"] < HANG_BOUND for o in outcomes.values()), outcomes


def _apply(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    environment = os.environ.copy()
    environment.pop("RANK", None)
    environment.update(env or {})
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", "apply", *args, "--timeout", f"{TIMEOUT:g}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env=environment,
    )
    return result, time.monotonic() - started


# 3 rows over tp = 2 are 2 rows and 1 (torch.chunk): rank 1's file holds 128 KiB of tensors,
# rank 2's 64 KiB.
UNEVEN = """\
mesh train [tp = 1] on ranks 0..0
mesh infer [tp = 2] on ranks 1..2
tensor "w" [3, 16384] fp32
layout train on train { "w": replicate }
layout serve on infer { "w": tp = shard(0) }
reshard train -> serve
"""
FILE_LIMIT = 96 * 1024  # between the two ranks' files


def _limit_file_size() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_apply_whose_output_one_rank_cannot_write_whole_exits_1_before_a_byte_moves(tmp_path):
    """``ulimit -f`` below rank 1's file but above rank 2's: a mistake of one rank alone (the
    launcher checks the --to folder, not each rank's file). Every rank stops in the run's
    agreement, ``apply`` exits 1 with one message naming rank 1, no traceback, and no rank
    writes its file (no partial checkpoint)."""
    program = tmp_path / "uneven.layout"
    program.write_text(UNEVEN)
    out = tmp_path / "out"
    environment = os.environ.copy()
    environment.pop("RANK", None)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", "apply", str(program), "--to", str(out), "--timeout", f"{TIMEOUT:g}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env=environment,
        preexec_fn=_limit_file_size,  # inherited by the launcher's workers
    )
    seconds = time.monotonic() - started
    assert result.returncode == ExitCode.FAILURE, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert without_progress(result.stderr).strip() == (
        f"error: rank 1 is not ready: rank 1: cannot write {out}/rank00001.safetensors: its {2 * 16384 * 4} bytes "
        f"of tensors exceed the file size limit of {FILE_LIMIT} bytes (ulimit -f); nothing was moved"
    )
    assert list(out.iterdir()) == []
    assert seconds < 60  # the workers' start included: a few seconds each on a busy machine


# A bug reaches one rank alone too: here one injected into the spawned workers by a
# sitecustomize module on PYTHONPATH, so that rank 3's destination storages cannot be allocated
# (486eed0 fixed such a bug: apply --to an FP8 layout hung until the timeout).
ALLOCATE_FAILS = """\
from layoutlang.runtime.resharder import Resharder

_allocate = Resharder.allocate


def allocate(self, side="destination", **options):
    if side == "destination" and self.rank == 3:
        raise KeyError("the scale storage of 'b'")
    return _allocate(self, side, **options)


Resharder.allocate = allocate
"""


def test_apply_with_a_bug_allocating_one_ranks_storages_exits_1_at_once(tmp_path):
    """Rank 3's preparation raises KeyError: the run's agreement stops every rank with it, and
    ``apply`` exits 1 with one message naming rank 3 and the error, no traceback, long before
    the 300 s timeout (the workers' start included: a few seconds each on a busy machine)."""
    program = tmp_path / "stages.layout"
    program.write_text(STAGES)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(ALLOCATE_FAILS)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    result, seconds = _apply(str(program), env={"PYTHONPATH": path})
    assert result.returncode == ExitCode.FAILURE, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert without_progress(result.stderr).strip() == (
        "error: rank 3 is not ready: internal error on rank 3 before the run: "
        "KeyError: \"the scale storage of 'b'\"; nothing was moved"
    )
    assert seconds < 60


# ------------------------------------------------------------- the launcher


@pytest.mark.workers(3, scope="function", timeout=TIMEOUT)
def test_after_a_first_failure_silent_workers_get_a_short_grace_and_the_pool_goes_on(pool):
    """Rank 0 fails, ranks 1 and 2 block for good: the job ends a grace after the failure,
    not a 300 s timeout later, with rank 0's error naming the silent workers, which are
    killed; the pool then starts its workers afresh and runs the next task, group and all."""
    assert pool.grace == FAILURE_GRACE
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        pool.run(jobs.fail_on_rank_0_block_elsewhere, timeout=3600)
    seconds = time.monotonic() - started
    assert FAILURE_GRACE <= seconds < FAILURE_GRACE + 10
    assert str(err.value) == (
        "rank 0: LayoutValueError: error: rank 0: the checkpoint has no tensor 'w'; "
        f"workers 1, 2 did not answer within {FAILURE_GRACE:g} s of it (stopped or hung) and were killed"
    )
    assert err.value.exit_code == ExitCode.BAD_INPUT
    assert [p.is_alive() for p in pool.processes] == [True, False, False]
    # the next task runs on fresh workers, in a fresh process group
    assert pool.run(jobs.group_sum, timeout=TIMEOUT) == [0 + 1 + 2] * 3
    assert all(p.is_alive() for p in pool.processes)
