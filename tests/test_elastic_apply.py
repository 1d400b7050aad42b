"""``layoutlang apply --elastic`` as a user runs it: local workers, and torchrun agents.

Local: a rank is SIGKILLed in the middle of a transfer, a replacement joins, and every
refit commits with every destination byte verified; a training rank without a replica
stops every survivor with the data-loss error (exit status 1, the lost boxes named);
wrong options are refused before any process starts (exit status 2, no traceback).

torchrun: one agent per rank (``--nnodes 4 --nproc-per-node 1``, ``--max-restarts 0``,
c10d rendezvous on a store this test hosts, so the store outlives every agent). The
killed rank's agent gives up; the other agents never restart anything, and the survivors
finish the refits on the smaller layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]

PROGRAM = """
topology { domain_size = 2 }
mesh train [dp = 2, tp = 2]
mesh infer [dp = 2, tp = 2] on ranks 4..7
tensor "embed" [96, 32] fp32
tensor "layers.{l}.q" [64, 32] fp32 for l in 0..1
tensor "layers.{l}.k" [32, 32] fp32 for l in 0..1
layout fsdp on train {
    "embed": tp = shard(0)
    "layers.{l}.q": tp = shard(0)
    "layers.{l}.k": tp = shard(1)
}
layout serve on infer {
    "embed": tp = shard(0)
    "layers.{l}.q": tp = shard(0)
    "layers.{l}.k": tp = shard(0)
    storage "layers.{l}.qk" = "layers.{l}.q" | "layers.{l}.k"
}
reshard refit: fsdp -> serve
"""

SMALL = """
mesh train [dp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [64, 32] fp32
tensor "b" [32] fp32
layout fsdp on train { default: replicate }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""


def run(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYOUTLANG, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "elastic.layout"
    path.write_text(PROGRAM)
    return path


def test_a_killed_rank_is_replaced_and_every_refit_is_verified(program):
    result = run("apply", str(program), "--elastic", "--steps", "3", "--kill", "5@1", "--replace", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)["result"]
    assert summary["ok"] and not summary["errors"]
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
    assert all(not s["mismatches"] and s["verified_bytes"] > 0 for s in summary["steps"])
    assert summary["failed"]["5"]["how"] == "kill"
    # how many generations the loss and the admission take is the machine's timing: their outcome is not
    (shrink,) = [r for r in summary["recoveries"] if 5 in r["lost"]]
    (grow,) = [r for r in summary["recoveries"] if 8 in r["joined"]]
    assert shrink["from"] == "failure" and shrink["generation"] < grow["generation"]  # the place opens first
    assert 0 <= shrink["noticed_s"] <= shrink["agreed_s"] <= shrink["group_s"] <= shrink["first_byte_s"] < 10
    assert grow["recovered_bytes"] > 0
    assert re.fullmatch(r"serve_gen\d+", summary["destination"]), summary["destination"]
    assert sorted(summary["members"]) == [0, 1, 2, 3, 4, 6, 7, 8]  # the survivors and the replacement
    # the text report tells the same story
    text = run("apply", str(program), "--elastic", "--steps", "2", "--kill", "6@1")
    assert text.returncode == 0, text.stderr[-3000:]
    assert "rank 6: SIGKILL (injected)" in text.stdout
    assert re.search(r"^generation \d+ \(lost 6\), times from the failure:$", text.stdout, re.M), text.stdout
    assert "first byte moved on the new group" in text.stdout
    assert "all 2 refits committed and verified" in text.stdout


def test_every_replica_losing_a_rank_is_refilled_by_spares_from_the_training_side(program):
    # Ranks 5 and 7 hold the same tensor-parallel shard in both inference replicas: no replica
    # can be dropped and no survivor holds that shard; only the training side does (issue 14
    # case 2: this ended the job with "no intact replica remains").
    result = run("apply", str(program), "--elastic", "--steps", "3", "--kill", "5@1", "--kill", "7@1",
                 "--replace", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)["result"]
    assert summary["ok"] and not summary["errors"]
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
    assert all(not s["mismatches"] and s["verified_bytes"] > 0 for s in summary["steps"])
    # The two kills may be noticed in one generation or in two (legitimately): every lost rank
    # is in some recovery, the spares took their positions, and the last one moved bytes soon.
    recoveries = summary["recoveries"]
    assert sorted(r for rec in recoveries for r in rec["lost"]) == [5, 7], recoveries
    assert sorted(r for rec in recoveries for r in rec["joined"]) == [8, 9], recoveries
    assert all(rec["from"] == "failure" for rec in recoveries if rec["lost"])
    assert recoveries[-1]["first_byte_s"] is not None and recoveries[-1]["first_byte_s"] < 10
    assert re.fullmatch(r"serve_gen\d+", summary["destination"]), summary["destination"]
    assert sorted(summary["members"]) == [0, 1, 2, 3, 4, 6, 8, 9]  # the survivors and the spares
    # both replicas are whole again: the last step was verified on four inference ranks
    assert summary["steps"][-1]["ranks"] == 4


def test_every_replica_losing_a_rank_without_spares_ends_with_the_positions_named(program):
    begin = time.monotonic()
    result = run("apply", str(program), "--elastic", "--steps", "2", "--kill", "5@1", "--kill", "7@1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "holds a lost rank (5 at dp 0, 7 at dp 1); no intact replica remains" in result.stdout
    assert "start spare ranks that join (apply --elastic --replace" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert time.monotonic() - begin < 120  # no wait for spares that were never started


def test_a_lost_region_stops_every_survivor_with_the_lost_boxes(tmp_path):
    path = tmp_path / "no_replica.layout"
    path.write_text(PROGRAM.replace("mesh train [dp = 2, tp = 2]", "mesh train [tp = 4]"))
    # A replacement waits to be admitted: the survivors' end record stops it at once, instead
    # of after its whole admission timeout (120 s).
    begin = time.monotonic()
    result = run("apply", str(path), "--elastic", "--steps", "3", "--kill", "1@1", "--replace")
    # waiting out the admission would add its whole 120 s to the run's start-up and refits
    assert time.monotonic() - begin < 120
    assert result.returncode == 1, result.stdout + result.stderr
    assert "data lost: rank 1 held the only copies of" in result.stdout
    assert "embed[24:48, 0:32]" in result.stdout
    assert "all 3 refits committed" not in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kill", "5@1"], "--kill, --stop and --replace need --elastic"),
        (["--elastic", "--kill", "12@1"], "rank 12 is in no mesh of the reshard (its ranks: 0..7)"),
        (["--elastic", "--steps", "2", "--kill", "5@2"], "there are only 2 steps (0..1)"),
        (["--elastic", "--compare"], "it does not take --compare"),
        (["--elastic", "--steps", "0"], "argument --steps: expected a whole number of at least 1, not '0'"),
        (["--elastic", "--kill", "five@1"], "expected RANK@STEP (e.g. 5@1), not 'five@1'"),
    ],
)
def test_wrong_elastic_options_are_refused_before_anything_starts(program, capsys, args, message):
    from layoutlang.cli import main

    try:
        status = main(["apply", str(program), *args])
    except SystemExit as exit:  # argparse's own usage errors
        status = exit.code
    out = capsys.readouterr()
    assert status == 2
    assert message in out.out + out.err
    assert "Traceback" not in out.out + out.err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_agents_the_survivors_recover_without_a_restart(tmp_path):
    path = tmp_path / "small.layout"
    path.write_text(SMALL)
    port = _free_port()
    # the store outlives every agent: the agents' c10d rendezvous connects to it as clients
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = os.environ.copy()
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
             "--max-restarts", "0", "--monitor-interval", "0.2",
             "-m", "layoutlang.cli", "apply", str(path), "--elastic", "--steps", "3", "--kill", "3@1", "--json"]
    with contextlib.ExitStack() as open_logs:
        logs = [open_logs.enter_context(open(tmp_path / f"agent{i}.log", "w+")) for i in range(4)]
        agents = [
            subprocess.Popen(agent, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for log in logs
        ]
        try:
            summary = None
            end = time.monotonic() + 180
            while summary is None and time.monotonic() < end:
                time.sleep(0.5)
                for log in logs:
                    log.seek(0)
                    text = log.read()
                    if '"ok"' in text and text.rstrip().endswith("}"):
                        summary = json.loads(text[text.index("{\n") :])["result"]
            assert summary is not None, "\n".join(Path(log.name).read_text()[-2000:] for log in logs)
            assert summary["ok"], summary
            assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
            assert summary["members"] == [0, 1, 2]  # the survivors
            assert re.fullmatch(r"serve_gen\d+", summary["destination"]), summary["destination"]
            assert sorted(r for rec in summary["recoveries"] for r in rec["lost"]) == [3]
            # no agent restarted its worker: every log shows a single worker start
            for log in logs:
                log.seek(0)
                assert "restart" not in log.read().lower().replace("--max-restarts", "")
        finally:
            for process in agents:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            del store
