"""``layoutlang apply``'s progress display (:mod:`layoutlang.cli.apply_progress`), as a user
sees it: on a terminal (a pseudo-terminal here), the header and a status line from the
first second, before the workers are ready; in a pipe, plain lines in the order of the
phases (workers ready, plan agreed, each run; each committed step, fault and recovery of an
elastic run); with ``--json``, nothing on stderr and only the report on stdout.

Orders of events are asserted, never times. Each run is shared by the tests that read it
(module-scoped fixtures): a run starts a worker process per rank, each importing torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from layoutlang.cli.apply_progress import Display

ROOT = Path(__file__).resolve().parents[1]
LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]
#: 4 ranks (each worker process imports torch: the fewer, the quicker the test)
PROGRAM = """
mesh train [tp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [64, 32] fp32
layout fsdp on train { "w": tp = shard(0) }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""
PREFIX = "layoutlang apply: "


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("progress") / "small.layout"
    path.write_text(PROGRAM)
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYOUTLANG, "apply", *args], cwd=ROOT, capture_output=True, text=True, timeout=200)


def progress_lines(stderr: str) -> list[str]:
    return [line.removeprefix(PREFIX) for line in stderr.splitlines() if line.startswith(PREFIX)]


def index_of(lines: list[str], pattern: str) -> int:
    """The index of the first line that matches ``pattern`` (a regular expression)."""
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r}:\n" + "\n".join(lines)
    return found[0]


# ------------------------------------------------------------------ the display alone


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(10)
def test_the_modes_are_chosen_by_stderr_and_json(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert Display.for_command(as_json=False).mode == "live"
    assert Display.for_command(as_json=True).mode == "off"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert Display.for_command(as_json=False).mode == "lines"


@pytest.mark.timeout(10)
def test_plain_lines_have_no_status_and_off_says_nothing():
    lines, off = io.StringIO(), io.StringIO()
    for display in (Display("lines", lines), Display("off", off)):
        with display:
            display.start("refit r: a (2 ranks) -> b (2 ranks); starting 4 local gloo workers", "starting workers")
            display.status("starting workers: 1/4 connected, 0/4 ready")
            display.say("workers ready (4/4) in 3 s")
    assert lines.getvalue() == (
        "layoutlang apply: refit r: a (2 ranks) -> b (2 ranks); starting 4 local gloo workers\n"
        "layoutlang apply: workers ready (4/4) in 3 s\n"
    )
    assert off.getvalue() == ""


@pytest.mark.timeout(10)
def test_a_live_display_rewrites_its_status_line_and_clears_it_at_the_end():
    stream = _Terminal()
    with Display("live", stream) as display:
        display.start("refit r: a (2 ranks) -> b (2 ranks); starting 4 local gloo workers", "starting workers")
        display.status("starting workers: 1/4 connected, 0/4 ready")
        display.say("workers ready (4/4) in 3 s")
    text = stream.getvalue()
    # every lasting line and every redraw starts by clearing the line the cursor is on
    assert text.startswith("\r\x1b[2Klayoutlang apply: refit r: a (2 ranks) -> b (2 ranks)")
    assert "\r\x1b[2Kstarting workers: 1/4 connected, 0/4 ready, 0 s" in text
    assert "\r\x1b[2Klayoutlang apply: workers ready (4/4) in 3 s\n" in text
    assert text.endswith("\r\x1b[2K")  # the status line is gone before the report


# --------------------------------------------------------------------- on a terminal


@pytest.fixture(scope="module")
def on_a_terminal(program) -> tuple[str, str, int]:
    """``apply`` with stderr on a pseudo-terminal (120 columns) and stdout a pipe: (what the
    terminal received, stdout, exit status)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen([*LAYOUTLANG, "apply", program], cwd=ROOT, stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    received = b""
    with contextlib.suppress(OSError):  # EIO: every holder of the terminal's end has closed it
        while chunk := os.read(controller, 65536):
            received += chunk
    os.close(controller)
    stdout = process.stdout.read().decode() if process.stdout else ""
    return received.decode(), stdout, process.wait(timeout=200)


@pytest.mark.timeout(240)
def test_on_a_terminal_the_header_and_a_status_line_come_before_the_workers_are_ready(on_a_terminal):
    received, stdout, status = on_a_terminal
    assert status == 0, received[-3000:]
    # the screen's states, in order: what each clearing of the line leaves
    states = [s.replace("\r\n", "\n").strip() for s in received.split("\r\x1b[2K") if s.strip()]
    header = index_of(states, r"^layoutlang apply: refit refit: .*; starting 4 local gloo workers$")
    starting = index_of(states, r"^starting workers")
    ready = index_of(states, r"^layoutlang apply: workers ready \(4/4\) in \d+ s$")
    agreed = index_of(states, r"^layoutlang apply: reshard: fleet plan compiled and agreed by every rank")
    assert header == 0 and header < starting < ready < agreed
    assert index_of(states, r"^layoutlang apply: reshard: run 1/1 done") > agreed
    assert received.endswith("\r\x1b[2K")  # the status line cleared before the report
    # stdout is the report, as it always was
    assert stdout.startswith("refit refit: ") and "ok (" in stdout and "\x1b" not in stdout


# -------------------------------------------------------------------------- in a pipe


@pytest.fixture(scope="module")
def in_a_pipe(program) -> subprocess.CompletedProcess:
    return run(program)


@pytest.mark.timeout(240)
def test_in_a_pipe_one_plain_line_per_phase_in_order(in_a_pipe):
    result = in_a_pipe
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    lines = progress_lines(result.stderr)
    assert len(lines) == len(result.stderr.splitlines())  # nothing else on stderr
    assert lines[0].startswith("refit refit: ") and lines[0].endswith("; starting 4 local gloo workers")
    assert re.fullmatch(r"workers ready \(4/4\) in \d+ s", lines[1]), lines
    assert re.fullmatch(
        r"reshard: fleet plan compiled and agreed by every rank \([\d,]+ moves, fingerprint [0-9a-f]{12}\) in \d+ s",
        lines[2],
    ), lines
    assert re.fullmatch(r"reshard: run 1/1 done \(rank 0 in \d+\.\d{3} s\)", lines[3]), lines
    assert re.fullmatch(r"every rank reported \(4/4\) in \d+ s", lines[4]), lines
    assert len(lines) == 5
    assert result.stdout.startswith("refit refit: ")  # the report, on stdout as before


@pytest.fixture(scope="module")
def elastic_in_a_pipe(program) -> subprocess.CompletedProcess:
    return run(program, "--elastic", "--steps", "3", "--kill", "3@1", "--replace")


@pytest.mark.timeout(240)
def test_an_elastic_run_says_each_step_fault_and_recovery_in_order(elastic_in_a_pipe):
    result = elastic_in_a_pipe
    assert result.returncode == 0, result.stderr[-3000:]
    lines = progress_lines(result.stderr)
    assert lines[0] == "elastic refit refit: fsdp (2 ranks) -> serve (2 ranks), 3 steps; starting 5 local gloo workers"
    ready = index_of(lines, r"^workers ready \(5/5\) in \d+ s$")
    steps = [index_of(lines, rf"^step {s} committed \({s + 1}/3\) in generation \d+$") for s in range(3)]
    killed = index_of(lines, r"^rank 3: SIGKILL injected in step 1$")
    lost = index_of(lines, r"^recovery: generation \d+ \(lost 3(; joined 4)?\), \d+ members, \d+\.\d s after the fault")
    assert 0 < ready < steps[0] < steps[1] < steps[2]
    # the fault comes in step 1, and step 1 commits after the recovery that lost rank 3
    assert steps[0] < killed <= lost < steps[1]
    # The replacement is admitted at a step boundary after it asks: on a loaded machine the
    # last one may pass first, and then the job says so and still succeeds (nothing is lost).
    if any(re.search(r"joined 4\)", line) for line in lines):
        assert lost <= index_of(lines, r"^recovery: generation \d+ \((lost 3; )?joined 4\), \d+ members")
    else:
        too_late = "replacement rank 4 was not admitted: the job's last step committed before it could join"
        assert too_late in result.stdout
    assert re.fullmatch(r"\d+ ranks reported in \d+ s", lines[-1]), lines
    assert "rank 3: SIGKILL (injected)" in result.stdout  # the report, on stdout as before


# -------------------------------------------------------------------------- --json


@pytest.mark.timeout(240)
def test_with_json_stderr_is_quiet_and_stdout_is_only_the_report(program):
    result = run(program, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
    assert isinstance(json.loads(result.stdout), dict)  # one JSON document, nothing around it
