"""``layoutlang apply`` end to end, as a user runs it: in a subprocess, launched alone
(local gloo workers) and under torchrun, with synthetic weights and with a safetensors
checkpoint written back per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layoutlang
from layoutlang.io.safetensors import read_safetensors_header
from layoutlang.io.weights import SafetensorsCheckpoint, synthetic_box, write_safetensors

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAYOUTLANG, *args], cwd=cwd, capture_output=True, text=True, timeout=280, env=env or os.environ.copy()
    )


def test_apply_alone_runs_local_workers_and_verifies_every_byte():
    result = run("apply", str(EXAMPLES / "tp_to_dp.layout"), "--compare", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["result"]
    assert report["ok"] and report["ranks"] == 6
    reshard, broadcast = report["runs"]["reshard"], report["runs"]["broadcast"]
    plan = layoutlang.compile_plan(layoutlang.load(EXAMPLES / "tp_to_dp.layout"))
    assert reshard["bytes"]["network"] == plan.stats.bytes["network"]
    assert reshard["moved_bytes"] == plan.stats.lower_bound
    # every destination byte was compared: 4 replicas of a 1024 x 1024 bf16 tensor
    assert reshard["verified_bytes"] == broadcast["verified_bytes"] == 4 * 1024 * 1024 * 2
    assert len(reshard["fingerprints"]) == 1


def test_apply_reads_a_checkpoint_and_writes_per_rank_files(tmp_path):
    program = layoutlang.load(EXAMPLES / "uneven.layout")
    # A full checkpoint of the logical tensors (what a training job saves).
    full = {}
    for index, (name, tensor) in enumerate(program.tensors.items()):
        values = synthetic_box(index + 7, tensor.shape, tensor.dtype, (0,) * len(tensor.shape), tensor.shape)
        full[name] = values
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_safetensors(checkpoint / "model.safetensors", full)
    out = tmp_path / "out"
    result = run("apply", str(EXAMPLES / "uneven.layout"), "--from", str(checkpoint), "--to", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
    destination = program.layouts["infer_uneven"]
    for rank in destination.mesh.ranks:
        path = out / f"rank{rank:05d}.safetensors"
        header, _ = read_safetensors_header(path)
        assert header["__metadata__"]["layout"] == "infer_uneven"
        written = SafetensorsCheckpoint(path)
        for name in program.tensors:
            for box in destination.boxes(name, rank):
                storage_shape = destination.storage_shape(box.storage, rank)
                dtype = program.tensors[name].dtype
                got = written.read_box(box.storage, dtype, storage_shape, box.storage_offsets, box.sizes)
                assert torch.equal(got, full[name][box.slices()]), (rank, name)


def test_apply_reports_a_bad_program_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.layout"
    bad.write_text('mesh m [tp = 2]\ntensor "w" [4] fp32\nlayout a on m { "w": tp = shard(3) }\nreshard a -> a\n')
    result = run("apply", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "bad.layout:3" in result.stderr


def test_apply_under_torchrun_joins_the_job():
    env = os.environ.copy()
    env.pop("RANK", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "layoutlang.cli",
        "apply",
        str(EXAMPLES / "colocated.layout"),
        "--json",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    start = result.stdout.index("{")
    report = json.loads(result.stdout[start:])["result"]
    assert report["ok"] and report["ranks"] == 4
    assert report["runs"]["reshard"]["bytes"]["local"] > 0  # colocated: part of the refit is a local copy


# ---------------------------------------------------------------- who must act
#
# A failure found on a worker exits by who must act: a user's mistake (a checkpoint that
# lacks a tensor) with 2, a failure at run time (a peer that died or hung, ranks that
# compiled different plans) with 1; neither prints a traceback. The faults are injected
# into every process of the run (the parent and its spawned workers) by a sitecustomize
# module on PYTHONPATH, so `layoutlang apply` itself runs unchanged.

SMALL = """\
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "w" [64, 64] fp32
tensor "b" [64] fp32
layout a on train {
    "w": tp = shard(0)
    default: replicate
}
layout b on infer {
    "w": tp = shard(1)
    default: replicate
}
reshard a -> b
"""

FAULTS = """\
import os
import time

import torch.distributed as dist

from layoutlang.runtime import resharder
from layoutlang.runtime.agreement import AGREEMENT_TAG
from layoutlang.transport.torch_distributed import TorchTransport

FAULT = os.environ["LAYOUTLANG_TEST_FAULT"]
VICTIM = 0  # program rank 0 (worker 0): a source rank that sends to both destination ranks
_exchange = TorchTransport.exchange
_compile_plan = resharder.compile_plan
_hung = []


def exchange(self, sends, recvs, tag):
    if self.rank == VICTIM and tag != AGREEMENT_TAG:  # after the agreement: mid-transfer
        if FAULT == "die":
            os._exit(7)
        if FAULT == "hang" and not _hung:
            _hung.append(True)
            time.sleep(float(os.environ["LAYOUTLANG_TEST_HANG"]))
    return _exchange(self, sends, recvs, tag)


def compile_plan(program, reshard=None, **options):
    if FAULT == "disagree" and dist.is_initialized() and dist.get_rank() == VICTIM:
        options["policy"] = "broadcast"  # this rank alone compiles another plan
    return _compile_plan(program, reshard, **options)


TorchTransport.exchange = exchange
resharder.compile_plan = compile_plan
"""


def run_with_fault(tmp_path: Path, fault: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    program = tmp_path / "small.layout"
    program.write_text(SMALL)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAULTS)
    environment = os.environ.copy()
    environment.pop("RANK", None)
    path = os.pathsep.join(p for p in (str(hooks), environment.get("PYTHONPATH", "")) if p)
    environment.update(PYTHONPATH=path, LAYOUTLANG_TEST_FAULT=fault, **env)
    return run("apply", str(program), *args, env=environment)


def without_progress(stderr: str) -> str:
    """stderr without the lines of apply's progress display (tests/test_apply_progress.py)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("layoutlang apply: "))


def assert_clean_failure(result: subprocess.CompletedProcess, status: int) -> None:
    assert result.returncode == status, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert without_progress(result.stderr).startswith("error: "), result.stderr


def test_apply_exits_1_when_a_worker_dies_mid_transfer(tmp_path):
    result = run_with_fault(tmp_path, "die", "--timeout", "10")
    assert_clean_failure(result, 1)
    assert without_progress(result.stderr).strip() == "error: worker rank 0 died (exit code 7)"


def test_apply_exits_1_when_a_peer_hangs_past_the_timeout(tmp_path):
    result = run_with_fault(tmp_path, "hang", "--timeout", "2", LAYOUTLANG_TEST_HANG="4")
    assert_clean_failure(result, 1)
    # the ranks waiting for rank 0 gave up after --timeout, and rank 0 found them gone when it woke
    assert without_progress(result.stderr).startswith("error: rank "), result.stderr
    assert "may have died" in result.stderr, result.stderr


def test_apply_exits_1_when_ranks_compile_different_plans(tmp_path):
    result = run_with_fault(tmp_path, "disagree", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (error,) = json.loads(result.stdout)["errors"]
    assert error["error"] == "agreement"
    assert "rank 0 compiled a different plan from the others (rank 0 compiled plan " in error["message"]
    assert "; ranks 1..3 compiled plan " in error["message"]
    assert error["message"].endswith("nothing was moved")


def test_apply_exits_2_for_a_checkpoint_that_lacks_a_tensor(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_safetensors(checkpoint / "model.safetensors", {"w": torch.zeros(64, 64)})  # no "b"
    result = run_with_fault(tmp_path, "none", "--from", str(checkpoint))
    assert_clean_failure(result, 2)
    # the launching process read the header and refused, before any worker started
    assert result.stderr.strip() == (
        f"error: {checkpoint / 'model.safetensors'}: the checkpoint does not hold the source layout 'a' as the"
        " program declares it (1 of its 2 tensors):\n  'b' is missing (declared fp32 [64])"
    )


# ------------------------------------------------------- --from, before workers start

# Records, when the launching process exits, whether it imported torch: the workers and the
# jobs that start them need it, so a launcher that never imported torch started no worker.
TORCH_PROBE = """\
import atexit
import os
import sys

atexit.register(
    lambda: open(os.environ["LAYOUTLANG_TEST_PROBE"], "a").write(f"{os.getpid()} {'torch' in sys.modules}\\n")
)
"""


def run_probed(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``layoutlang apply SMALL ARGS`` with every process reporting whether it imported torch."""
    program = tmp_path / "small.layout"
    program.write_text(SMALL)
    hooks = tmp_path / "probe"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(TORCH_PROBE)
    probe = tmp_path / "probe.txt"
    environment = os.environ.copy()
    environment.pop("RANK", None)
    path = os.pathsep.join(p for p in (str(hooks), environment.get("PYTHONPATH", "")) if p)
    environment.update(PYTHONPATH=path, LAYOUTLANG_TEST_PROBE=str(probe))
    result = run("apply", str(program), *args, env=environment)
    return result, probe.read_text().splitlines() if probe.exists() else []


def test_apply_from_reports_every_mismatch_at_once_before_any_worker_starts(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    # "w" has another shape, "b" another dtype, and "c" of the checkpoint is not the program's
    write_safetensors(
        checkpoint / "model.safetensors",
        {"w": torch.zeros(64, 32), "b": torch.zeros(64, dtype=torch.bfloat16), "c": torch.zeros(3)},
    )
    result, processes = run_probed(tmp_path, "--from", str(checkpoint), "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    (error,) = json.loads(result.stdout)["errors"]
    assert error["error"] == "model"
    assert error["message"].splitlines()[1:] == [
        "  'w' is fp32 [64, 32], declared fp32 [64, 64]",
        "  'b' is bf16 [64], declared fp32 [64]",
    ]
    # one process, the launcher, and it never imported torch: no worker was started
    assert [line.split()[1] for line in processes] == ["False"], processes


def test_apply_from_suggests_the_checkpoints_consistent_prefix(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_safetensors(
        checkpoint / "model.safetensors", {"model.w": torch.zeros(64, 64), "model.b": torch.zeros(64)}
    )
    result, processes = run_probed(tmp_path, "--from", str(checkpoint))
    assert_clean_failure(result, 2)
    assert "  'w' is missing (declared fp32 [64, 64])\n  'b' is missing (declared fp32 [64])\n" in result.stderr
    assert result.stderr.rstrip().endswith(
        "hint: did you mean 'model.w'? the checkpoint stores all 2 missing tensors under the prefix 'model.'"
    )
    assert len(processes) == 1


def test_apply_from_a_matching_checkpoint_casts_with_the_languages_dtype_name(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    weights = {"w": torch.arange(64 * 64, dtype=torch.float32).view(64, 64), "b": torch.arange(64.0)}
    write_safetensors(checkpoint / "model.safetensors", weights)
    out = tmp_path / "out"
    result, _ = run_probed(tmp_path, "--from", str(checkpoint), "--to", str(out), "--cast", "bf16", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"]
    # destination rank 3 holds columns 32:64 of w (tp = shard(1)) and all of b, cast to bf16
    written = SafetensorsCheckpoint(out / "rank00003.safetensors")
    assert torch.equal(written.read_box("w", "bf16", (64, 32), (0, 0), (64, 32)), weights["w"][:, 32:].bfloat16())
    assert torch.equal(written.read_box("b", "bf16", (64,), (0,), (64,)), weights["b"].bfloat16())


def test_apply_cast_refuses_an_unknown_dtype_naming_both_spellings(tmp_path):
    result = run("apply", str(EXAMPLES / "tp_to_dp.layout"), "--cast", "bf17")
    assert result.returncode == 2
    assert "argument --cast: unknown dtype 'bf17' (known: bf16 (bfloat16), fp16 (float16)," in result.stderr


# ------------------------------------------------------- reshard policies

POLICIES = """\
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "layers.0.mlp.down_proj.weight" [8, 8] fp32
tensor "layers.1.mlp.down_proj.weight" [8, 8] fp32
tensor "embed.weight" [8, 8] fp32
layout a on train { default: tp = shard(0) }
layout b on infer { default: tp = shard(1) }
reshard refit: a -> b {
    "layers.{l}.mlp.down_prj.weight": broadcast
}
"""


def test_a_reshard_policy_whose_pattern_matches_no_tensor_is_an_error_with_did_you_mean(tmp_path):
    path = tmp_path / "policies.layout"
    path.write_text(POLICIES)
    with pytest.raises(layoutlang.LayoutError) as caught:
        layoutlang.load(path)
    err = caught.value
    assert type(err).__name__ == "LayoutNameError"
    assert err.message == (
        "pattern \"layers.{l}.mlp.down_prj.weight\" of reshard 'refit' matches no tensor of the program"
    )
    # the pattern's place in the file: line 9, column 5 (its opening quote)
    assert (err.span.path, err.span.line, err.span.column) == (str(path), 9, 5)
    assert err.hint == 'did you mean "layers.{l}.mlp.down_proj.weight"?'
    # spelled right, the same statement loads, and the policy reaches the tensors it names
    path.write_text(POLICIES.replace("down_prj", "down_proj"))
    reshard = layoutlang.load(path).reshard("refit")
    assert [reshard.policy_for(name) for name in ("layers.1.mlp.down_proj.weight", "embed.weight")] == [
        "broadcast",
        "reshard",
    ]


# ------------------------------------------------------- --cast-sources

BF16 = SMALL.replace("fp32", "bf16")


def fp32_master_weights(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The program (w and b declared bf16) and a checkpoint that stores w in fp32, as a trainer
    keeps master weights, and b already in bf16."""
    program = tmp_path / "bf16.layout"
    program.write_text(BF16)
    generator = torch.Generator().manual_seed(12)
    weights = {
        "w": torch.randn(64, 64, generator=generator, dtype=torch.float32),
        "b": torch.randn(64, generator=generator, dtype=torch.float32).to(torch.bfloat16),
    }
    # the cast is not a no-op: most fp32 values are not bf16 values
    assert (weights["w"].to(torch.bfloat16).float() != weights["w"]).float().mean() > 0.9
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_safetensors(checkpoint / "model.safetensors", weights)
    return program, checkpoint, weights


def test_apply_from_refuses_another_dtype_and_says_how_to_cast_it(tmp_path):
    program, checkpoint, _ = fp32_master_weights(tmp_path)
    result = run("apply", str(program), "--from", str(checkpoint), "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    (error,) = json.loads(result.stdout)["errors"]
    assert error["message"].splitlines()[1:] == ["  'w' is fp32 [64, 64], declared bf16 [64, 64]"]
    assert error["hint"] == (
        "pass --cast-sources to convert the 1 tensor stored in another dtype to the layout's while packing"
        " them (as torch's .to() does)"
    )


def test_apply_cast_sources_converts_fp32_master_weights_as_torch_does(tmp_path):
    program, checkpoint, weights = fp32_master_weights(tmp_path)
    out = tmp_path / "out"
    result = run("apply", str(program), "--from", str(checkpoint), "--cast-sources", "--to", str(out), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"]
    # destination rank r holds columns 32 * (r - 2) of w (tp = shard(1)) and all of b, in bf16,
    # bit for bit what torch's .to(torch.bfloat16) makes of the stored values
    for rank in (2, 3):
        written = SafetensorsCheckpoint(out / f"rank{rank:05d}.safetensors")
        columns = slice(32 * (rank - 2), 32 * (rank - 1))
        got = written.read_box("w", "bf16", (64, 32), (0, 0), (64, 32))
        assert torch.equal(got.view(torch.int16), weights["w"][:, columns].to(torch.bfloat16).view(torch.int16))
        assert torch.equal(written.read_box("b", "bf16", (64,), (0,), (64,)), weights["b"])


def test_apply_cast_sources_shape_mismatches_are_still_refused(tmp_path):
    program, checkpoint, weights = fp32_master_weights(tmp_path)
    write_safetensors(checkpoint / "model.safetensors", {"w": weights["w"][:32], "b": weights["b"]})
    result = run("apply", str(program), "--from", str(checkpoint), "--cast-sources")
    assert_clean_failure(result, 2)
    assert "  'w' is fp32 [32, 64], declared bf16 [64, 64]" in result.stderr
    assert "--cast-sources to convert" not in result.stderr


def test_apply_cast_sources_needs_a_checkpoint():
    result = run("apply", str(EXAMPLES / "tp_to_dp.layout"), "--cast-sources")
    assert_clean_failure(result, 2)
    assert "--cast-sources converts the tensors of a --from checkpoint; give --from DIR" in result.stderr


def test_compare_runs_each_policy_twice_and_zero_network_bytes_read_as_plan_says():
    """``--compare`` set a cold first reshard against a warm broadcast (it once read "0.1x
    the time" on a tiny model): each policy now runs at least twice and reports its fastest.
    No network bytes on either side is 1.0x, as ``plan`` prints it (``apply`` said 0.0x)."""
    from layoutlang.cli.apply import _times
    from layoutlang.cli.apply_job import ApplyOptions, _runs

    cases = ((False, 1), (True, 1), (True, 3), (False, 3))
    assert [_runs(ApplyOptions("x.layout", compare=c, repeat=n)) for c, n in cases] == [1, 2, 3, 3]
    assert [_times(0, 0), _times(4, 0), _times(6, 3)] == ["1.0x", "infx", "2.0x"]
