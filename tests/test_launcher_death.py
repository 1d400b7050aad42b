"""No worker outlives its launcher: issue 14's case 3.

``layoutlang apply`` (plain and ``--elastic``) runs in a subprocess with many refits to do;
once every worker is busy, the test SIGKILLs the launcher (which hosts the store) and
asserts that every worker it started is gone a few seconds later, each having said so on
stderr. The workers are found by pid, as the launcher's children (``/proc``) recorded
before the kill: spawned by multiprocessing, so their command line names its spawn module.
Before the fix every worker stayed alive, idle in the result queue or blocked in an
exchange (13 workers alive 150 s after the kill).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent

SMALL = """
mesh train [dp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [256, 256] fp32
layout fsdp on train { default: replicate }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""

GONE_WITHIN = 10.0  # seconds; each worker looks for its launcher every 0.25 s


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from every one of its threads."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def kill_launcher_when_busy(args: list[str], workers: int, tmp_path: Path) -> tuple[dict[int, float], str, int]:
    """Start ``layoutlang apply ARGS``; once its ``workers`` workers have each run for a while
    (torch imported, refits under way), SIGKILL it. Returns (seconds from the kill until each
    worker was gone, the job's stderr, the launcher's pid)."""
    log = open(tmp_path / "stderr.log", "w+")  # noqa: SIM115 (read after the job ends)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "layoutlang.cli", "apply", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 150
        spawned: list[int] = []
        while time.monotonic() < end:
            spawned = [p for p in children(launcher.pid) if "multiprocessing.spawn" in cmdline(p)]
            # 2 s of CPU each: torch imported (about 1.7 s) and the job's work begun
            if len(spawned) == workers and all(cpu_seconds(p) > 2.0 for p in spawned):
                break
            assert launcher.poll() is None, f"the job ended before it was killed: {log.seek(0) or log.read()}"
            time.sleep(0.2)
        else:
            pytest.fail(f"the workers of {args} did not get busy within 150 s")
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=10)
        gone: dict[int, float] = {}
        while len(gone) < len(spawned) and time.monotonic() - killed < 30:
            for p in spawned:
                if p not in gone and not alive(p):
                    gone[p] = time.monotonic() - killed
            time.sleep(0.02)
        for p in spawned:  # never leave one behind, whatever the test says
            if p not in gone and alive(p):
                os.kill(p, signal.SIGKILL)
        log.seek(0)
        return {p: gone.get(p, float("inf")) for p in spawned}, log.read(), launcher.pid
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
        log.close()


def check_every_worker_left(gone: dict[int, float], stderr: str, launcher: int, ranks: list[int]) -> None:
    late = {p: s for p, s in gone.items() if s > GONE_WITHIN}
    assert not late, f"workers still alive {GONE_WITHIN:g} s after the launcher was killed: {late}\n{stderr[-3000:]}"
    said = re.findall(rf"layoutlang worker rank (\d+): the launcher \(pid {launcher}\) is gone; exiting", stderr)
    assert sorted(int(r) for r in said) == ranks, stderr[-3000:]
    print(f"workers gone {min(gone.values()):.2f}-{max(gone.values()):.2f} s after the launcher's SIGKILL")


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "small.layout"
    path.write_text(SMALL)
    return path


def test_plain_apply_workers_end_when_the_launcher_is_killed(program, tmp_path):
    gone, stderr, pid = kill_launcher_when_busy([str(program), "--repeat", "100000"], 4, tmp_path)
    check_every_worker_left(gone, stderr, pid, [0, 1, 2, 3])


def test_elastic_workers_end_when_the_launcher_is_killed(program, tmp_path):
    gone, stderr, pid = kill_launcher_when_busy([str(program), "--elastic", "--steps", "100000"], 4, tmp_path)
    check_every_worker_left(gone, stderr, pid, [0, 1, 2, 3])


STORE = """
import sys, time
from elastic.store import serve_store
store = serve_store(timeout=30)
print(store.port, flush=True)
time.sleep(120)
"""

RANK = """
import sys, time
from layoutlang.cli.elastic_job import watch_store
watch_store("127.0.0.1", int(sys.argv[1]), 3)
print("watching", flush=True)
time.sleep(120)
"""


def test_a_torchrun_rank_ends_when_the_store_is_gone():
    """Under torchrun the store is the agent's: a rank of ``apply --elastic`` ends once it is
    unreachable for 2 s (``watch_store``), instead of waiting out every timeout."""
    store = subprocess.Popen([sys.executable, "-c", STORE], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    rank = None
    try:
        port = int(store.stdout.readline())
        rank = subprocess.Popen(
            [sys.executable, "-c", RANK, str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert rank.stdout.readline().strip() == "watching"
        store.kill()
        killed = time.monotonic()
        code = rank.wait(timeout=30)
        seconds = time.monotonic() - killed
        assert code == 75, rank.stderr.read()
        assert f"layoutlang rank 3: the job's store at 127.0.0.1:{port} is gone; exiting" in rank.stderr.read()
        assert seconds < 2.0 + 0.5 + GONE_WITHIN  # the grace, one period, the machine's load
        print(f"rank gone {seconds:.2f} s after its store")
    finally:
        for process in (store, rank):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)
