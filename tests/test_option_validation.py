"""Options that cannot hurt, and a job of the wrong size refused before anything starts.

Every option of every command is validated by the argument parser: a wait that is not a
finite number of seconds above zero, a count below its least value, a rank below 0, a remesh
policy that does not exist are argparse usage errors (exit 2) naming the option and the value,
before a worker starts. A job whose processes are fewer than the reshard's ranks (torchrun's
WORLD_SIZE, the Python API's process group) is refused with both numbers; ``--device cuda``
and ``--transport nccl`` on a machine without a GPU are refused at once, in the doctor's words.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import launch_jobs
import pytest

from layoutlang.cli import main
from layoutlang.cli.apply import REMESH_POLICIES
from layoutlang.cli.launch import LocalWorkers, WorkerError
from layoutlang.errors import ExitCode

ROOT = Path(__file__).resolve().parent.parent
REFIT = str(ROOT / "examples" / "refit.layout")

FOUR_RANKS = """
mesh train [dp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [64, 32] fp32
layout fsdp on train { default: replicate }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""


def cli(*argv: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "options, refusal",
    [
        (["--timeout", "nan"], "argument --timeout: expected a finite number of seconds above 0, not 'nan'"),
        (["--timeout", "inf"], "argument --timeout: expected a finite number of seconds above 0, not 'inf'"),
        (["--timeout", "0"], "argument --timeout: expected a finite number of seconds above 0, not '0'"),
        (["--timeout", "-1"], "argument --timeout: expected a finite number of seconds above 0, not '-1'"),
        (["--timeout", "1e300"], "argument --timeout: '1e300' seconds is more than a week"),
        (["--elastic", "--deadline", "nan"], "argument --deadline: expected a finite number of seconds above 0"),
        (["--repeat", "-3"], "argument --repeat: expected a whole number of at least 1, not '-3'"),
        (["--repeat", "0"], "argument --repeat: expected a whole number of at least 1, not '0'"),
        (
            ["--elastic", "--destination-policy", "nosuch"],
            (
                "argument --destination-policy: unknown remesh policy 'nosuch' (known: drop-replica, shrink-axis, "
                "fill-spares, await-rejoin)"
            ),
        ),
        (["--elastic", "--source-policy", "drop-replca"], "did you mean 'drop-replica'?"),
    ],
)
def test_apply_refuses_a_bad_option_value_as_a_usage_error_before_any_worker_starts(options, refusal):
    started = time.monotonic()
    result = cli("apply", REFIT, *options)
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr
    assert refusal in result.stderr
    assert result.stderr.startswith("usage: layoutlang apply")
    assert "Traceback" not in result.stdout + result.stderr
    assert time.monotonic() - started < 60  # refused by the parser, not after a worker's timeout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["plan", REFIT, "--limit", "-1"], "argument --limit: expected a whole number of 0 or more, not '-1'"),
        (["plan", REFIT, "--rank", "-4"], "argument --rank: a rank is 0 or more, not '-4'"),
        (["show", REFIT, "--rank", "-1"], "argument --rank: a rank is 0 or more, not '-1'"),
        (["show", REFIT, "--rank", "two"], "argument --rank: expected a rank (a whole number of 0 or more), not 'two'"),
        (["viz", REFIT, "--tensor", "x", "--out", "x.png", "--rank", "-1"], "argument --rank: a rank is 0 or more"),
        (["plan", REFIT, "--bucket-size", "0"], "argument --bucket-size: '0' is not a size"),
        (["simulate", REFIT, "--bucket-size", "nan"], "argument --bucket-size: 'nan' is not a size"),
        (["apply", REFIT, "--memory-budget=-1MiB"], "argument --memory-budget: '-1MiB' is not a size"),
        (["plan", REFIT, "--bucket-size", "99999999999999999999GiB"], "argument --bucket-size: '9999"),
        (["apply", REFIT, "--memory-budget", "2048GiB"], "is more than 1TiB"),
        (["apply", REFIT, "--elastic", "--steps", "-2"], "argument --steps: expected a whole number of at least 1"),
        (["apply", REFIT, "--elastic", "--kill=-1@1"], "argument --kill: expected RANK@STEP"),
    ],
)
def test_every_command_refuses_bad_values_in_its_parser(capsys, argv, refusal):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == ExitCode.BAD_INPUT
    assert refusal in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options, refusal",
    [
        (
            ["--destination-policy", "shrink-axis"],
            (
                "--destination-policy shrink-axis: name the axis it shrinks with --destination-axis (axes of mesh "
                "'infer': dp, tp)"
            ),
        ),
        (["--source-axis", "dp"], "--source-axis dp: the source layout 'megatron' is on mesh 'train', whose axes"),
    ],
)
def test_an_elastic_remesh_axis_is_checked_against_the_program_before_any_process_starts(capsys, options, refusal):
    assert main(["apply", REFIT, "--elastic", *options]) == ExitCode.BAD_INPUT
    assert refusal in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_remesh_policies_the_command_line_offers_are_the_sessions_but_callback():
    from elastic.remesh import SESSION_POLICIES

    assert set(REMESH_POLICIES) == set(SESSION_POLICIES) - {"callback"}


@pytest.mark.timeout(300)
def test_torchrun_with_fewer_processes_than_the_reshard_is_refused_with_both_numbers_and_no_crash():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "-m",
            "layoutlang.cli",
            "apply",
            REFIT,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        "reshard 'refit' needs 12 processes (its meshes hold ranks 0..11, one process per rank), but torchrun "
        "started 2 (WORLD_SIZE); nothing was started"
    ) in output
    assert "exitcode  : 2" in output  # the error's usage status, from the process that printed it
    assert "SIGSEGV" not in output and "Connection reset" not in output


@pytest.mark.timeout(120)
def test_torchrun_world_size_is_checked_for_elastic_refits_too(tmp_path):
    # as torchrun sets the environment of one of its processes
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    result = cli("apply", REFIT, "--elastic", env=env)
    assert result.returncode == ExitCode.BAD_INPUT
    assert "needs 12 processes" in result.stderr and "torchrun started 8 (WORLD_SIZE)" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_map", [None, {0: 0, 1: 1, 2: 2, 3: 3}])
def test_a_resharder_on_a_process_group_smaller_than_the_reshard_is_refused_at_once(tmp_path, rank_map):
    path = tmp_path / "four.layout"
    path.write_text(FOUR_RANKS)
    started = time.monotonic()
    with LocalWorkers(2, timeout=60.0) as workers:
        workers.submit(launch_jobs.resharder_on_the_group, str(path), rank_map)
        with pytest.raises(WorkerError) as err:
            workers.collect(timeout=90)
    assert time.monotonic() - started < 45  # not the 60 s timeout, then a blamed peer
    assert err.value.kind == "value" and err.value.exit_code == ExitCode.BAD_INPUT
    assert "reshard 'refit' needs a process group of at least 4 processes" in err.value.message
    assert "(its meshes hold ranks 0..3), but the process group has 2; nothing was started" in err.value.message


@pytest.mark.timeout(120)
def test_a_resharder_on_a_subgroup_is_checked_against_the_groups_members(tmp_path):
    # program ranks are global ranks: a subgroup holding them all is accepted, one lacking some is refused
    held = tmp_path / "held.layout"
    held.write_text(
        FOUR_RANKS.replace("[dp = 2]\n", "[dp = 1] on ranks 2..2\n", 1).replace(
            "[dp = 2] on ranks 2..3", "[dp = 1] on ranks 3..3"
        )
    )
    four = tmp_path / "four.layout"
    four.write_text(FOUR_RANKS)
    with LocalWorkers(4, timeout=60.0) as workers:
        assert workers.run(launch_jobs.resharder_on_a_subgroup, str(held), [2, 3]) == ["outside"] * 2 + ["built"] * 2
        workers.submit(launch_jobs.resharder_on_a_subgroup, str(four), [2, 3])
        with pytest.raises(WorkerError) as err:
            workers.collect(timeout=90)
    assert err.value.kind == "value"
    assert (
        "reshard 'refit' needs processes 0, 1, which the process group (global ranks 2, 3) lacks" in err.value.message
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", [["--device", "cuda"], ["--transport", "nccl"]])
def test_a_gpu_option_without_a_gpu_is_refused_at_once_in_the_doctors_words(option):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is of a machine without a GPU, and this one has one")
    result = cli("apply", REFIT, *option)
    assert result.returncode == ExitCode.BAD_INPUT
    assert f"error: {' '.join(option)}: this machine has " in result.stderr
    assert "no CUDA device (as `layoutlang doctor` reports)" in result.stderr
    assert "Traceback" not in result.stderr and "rank " not in result.stderr  # no worker ran


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["a-folder", "missing-folder"])
def test_plan_out_that_cannot_be_written_is_a_path_mistake_before_compiling(capsys, tmp_path, where):
    out = tmp_path if where == "a-folder" else tmp_path / "missing" / "plan.json"
    assert main(["plan", REFIT, "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert f"error: --out {out}: " in err and "internal error" not in err
    assert ("is a folder" if where == "a-folder" else "does not exist") in err


QUANTIZED = """
mesh train [dp = 2]
mesh infer [tp = 2] on ranks 2..3
tensor "w" [256, 256] bf16
layout fsdp on train { default: dp = shard(0) }
layout serve on infer {
    "w": tp = shard(0)
    quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: fsdp -> serve
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", [["--compare"], ["--policy", "broadcast"]])
def test_gather_and_broadcast_into_a_quantized_destination_is_refused_before_any_worker(tmp_path, option):
    """It would gather and broadcast bf16 that nothing quantizes: refused in the program's
    words, before a worker starts (no 'rank 0 is not ready' after the start-up)."""
    path = tmp_path / "fp8.layout"
    path.write_text(QUANTIZED)
    result = cli("apply", str(path), *option)
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr
    flag = " ".join(option)
    assert result.stderr.splitlines()[0] == (
        f"error: {flag} runs gather-and-broadcast, which cannot refit layout 'serve': it stores 1 tensor "
        "quantized ('w', ...), which only the reshard policy refits"
    )
    assert f"hint: run without {flag}" in result.stderr
    assert "ready" not in result.stderr and "workers" not in result.stderr
