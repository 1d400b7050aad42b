"""The fault matrix: each fault an operator meets, run as a user runs it, on the program the
failure-recovery guide uses (``examples/refit.layout``: training on ranks 0..3 without
replicas, two inference replicas on ranks 4..11).

Each row ends in one of two ways, within a bound far below any timeout: every refit
committed with every destination byte verified, or the documented clean error (its exit
status and its words, no traceback). The guide's "Every fault tried" table lists these rows
beside the faults tested elsewhere (the module named there): a stopped or killed worker of a
plain ``apply`` (tests/test_launch.py), a lost launcher (tests/test_launcher_death.py), a
slow rank (tests/test_elastic_slow_rank.py), forged store records
(tests/test_security.py), bad programs, configs and checkpoints
(tests/test_bounded_input.py, tests/test_safe_checkpoints.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen
class Fault:
    name: str
    options: tuple[str, ...]  # after `layoutlang apply examples/refit.layout --elastic`
    exit_status: int
    says: tuple[str, ...]  # regular expressions the report must match (which generation a
    # recovery ends in and which step's commit admits a replacement are the machine's timing)
    bound_s: float  # the whole run, 12 to 16 processes starting on a 2-core machine included


FAULTS = [
    Fault(
        "a run of failures (a kill, a hang, a kill after the first replacement joined), each replaced",
        ("--steps", "6", "--kill", "5@1", "--stop", "10@2", "--kill", "6@4", "--replace"),
        0,
        ("all 6 refits committed and verified", "heartbeat stuck", r"received step \d+'s weights: ok"),
        200,
    ),
    Fault(
        "a hung inference rank, not replaced: its replica is dropped",
        ("--steps", "3", "--stop", "6@1"),
        0,
        ("all 3 refits committed and verified", r"generation \d+ \(lost 6\)"),
        150,
    ),
    Fault(
        "every inference replica loses a rank and no spare is started",
        ("--steps", "2", "--kill", "5@1", "--kill", "9@1"),
        1,
        (r"holds a lost rank \(5 at dp 0, 9 at dp 1\); no intact replica remains", "start spare ranks that join"),
        120,
    ),
    Fault(
        "a training rank holding the only copy dies while replacements wait to join",
        ("--steps", "3", "--kill", "1@1", "--replace"),
        1,
        ("data lost: rank 1 held the only copies of 15 regions",),
        120,
    ),
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_each_fault_recovers_verified_or_ends_with_its_documented_error(fault):
    argv = [sys.executable, "-m", "layoutlang.cli", "apply", "examples/refit.layout", "--elastic", *fault.options]
    begin = time.monotonic()
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=fault.bound_s + 60)
    took = time.monotonic() - begin
    report = result.stdout + result.stderr
    assert result.returncode == fault.exit_status, report[-4000:]
    for words in fault.says:
        assert re.search(words, result.stdout), (words, result.stdout[-4000:])
    assert "MISMATCH" not in report and "Traceback" not in report
    assert took < fault.bound_s, f"{fault.name}: {took:.0f} s"
