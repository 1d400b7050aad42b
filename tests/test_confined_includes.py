"""Includes confined to the program's folder (issue 24, case 5: programs that cannot hurt).

An attacker who hands someone a ``.layout`` file tried ``include "/proc/self/environ"``:
the parse error showed the first line of the file, ``LAYOUTLANG_JOB_SECRET=...``. A program
now includes only the files of its own folder (and below) and the packaged presets, unless
the caller trusts it (``--allow-outside-includes``, ``allow_outside_includes=True``);
kernel and device files are refused even then, and no error shows their content. Each case
goes through the command line in a real process with a secret in its environment: exit 2,
a message naming the include's place, no traceback, no secret.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import layoutlang
from layoutlang.errors import ExitCode, LayoutIncludeError

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-of-the-job-7f1c"
#: this checkout first, then what the caller's path holds (a worktree's import fix-ups)
PYTHONPATH = os.environ.get("PYTHONPATH", "")
MODEL = 'mesh m [tp = 2]\ntensor "w" [4, 4] fp32\n'


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``layoutlang ARGS`` in a fresh process whose environment holds SECRET."""
    return subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), PYTHONPATH]), "LAYOUTLANG_JOB_SECRET": SECRET},
    )


def assert_refused(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """Exit 2, no traceback, no secret, and a message naming ``phrases``."""
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.BAD_INPUT, output
    assert "Traceback" not in output
    assert SECRET not in output
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def program(folder: Path, text: str, name: str = "main.layout") -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.mark.timeout(60)
def test_proc_self_environ_is_refused_without_showing_it(tmp_path):
    main = program(tmp_path, 'let x = 1\ninclude "/proc/self/environ"\n')
    result = cli("check", str(main))
    assert_refused(result, f"{main}:2:1", "cannot include '/proc/self/environ'", "special file of /proc")
    # trusting the program lifts the folder's confinement, never the refusal of kernel files
    result = cli("check", "--allow-outside-includes", str(main))
    assert_refused(result, f"{main}:2:1", "special file of /proc")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["check", "plan", "simulate"])
def test_an_include_outside_the_programs_folder_is_refused_before_it_is_read(tmp_path, command):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret_file = program(outside, f"{SECRET} is no statement\n", "secret.layout")
    folder = tmp_path / "program"
    folder.mkdir()
    main = program(folder, f'{MODEL}include "../outside/secret.layout"\n')
    result = cli(command, str(main))
    assert_refused(result, f"{main}:3:1", "outside the program's folder", "--allow-outside-includes")
    # an absolute path, the same
    main = program(folder, f'{MODEL}include "{secret_file}"\n')
    assert_refused(cli(command, str(main)), f"{main}:3:1", "outside the program's folder")


@pytest.mark.timeout(60)
def test_a_missing_file_outside_is_refused_as_outside_not_as_missing(tmp_path):
    # whether a file exists outside the folder is not the program's business either
    main = program(tmp_path, 'include "/nonexistent/x.layout"\n')
    assert_refused(cli("check", str(main)), "outside the program's folder")


@pytest.mark.timeout(60)
def test_a_symlink_inside_the_folder_to_a_file_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = program(outside, f"{SECRET}\n", "model.layout")
    folder = tmp_path / "program"
    folder.mkdir()
    (folder / "model.layout").symlink_to(target)
    main = program(folder, 'include "model.layout"\n')
    assert_refused(cli("check", str(main)), f"{main}:1:1", "symbolic link to a file outside")
    # a symlink to a folder outside is the same
    (folder / "models").symlink_to(outside)
    main = program(folder, 'include "models/model.layout"\n')
    assert_refused(cli("check", str(main)), "symbolic link to a file outside")


@pytest.mark.timeout(60)
def test_files_of_the_folder_and_below_and_presets_are_included(tmp_path):
    (tmp_path / "models").mkdir()
    program(tmp_path / "models", MODEL, "model.layout")
    (tmp_path / "layouts").mkdir()
    # an include inside a subfolder may go up again, as long as it stays in the program's folder
    layouts = 'include "../models/model.layout"\nlayout a on m { default: replicate }\n'
    program(tmp_path / "layouts", layouts, "a.layout")
    main = program(tmp_path, 'include "layouts/a.layout"\ninclude "./models/model.layout"\nreshard a -> a\n')
    result = cli("check", str(main))
    assert result.returncode == ExitCode.OK, result.stderr
    # presets lie outside every program's folder, and are always allowed
    assert layoutlang.loads('include "preset:llama3_70b"').tensors


@pytest.mark.timeout(60)
def test_a_symlinked_program_is_confined_to_the_folder_it_lies_in(tmp_path):
    # the program's folder is where the file really is, as its includes are read from there
    real = tmp_path / "real"
    real.mkdir()
    program(real, MODEL, "model.layout")
    main = program(real, 'include "model.layout"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "main.layout").symlink_to(main)
    assert "w" in layoutlang.load(elsewhere / "main.layout").tensors


@pytest.mark.timeout(60)
def test_allow_outside_includes_reads_a_trusted_file_outside(tmp_path):
    outside = tmp_path / "shared"
    outside.mkdir()
    program(outside, MODEL, "model.layout")
    folder = tmp_path / "program"
    folder.mkdir()
    main = program(folder, 'include "../shared/model.layout"\nlayout a on m { default: replicate }\nreshard a -> a\n')
    with pytest.raises(LayoutIncludeError, match="outside the program's folder") as caught:
        layoutlang.load(main)
    assert (caught.value.span.line, caught.value.span.column) == (1, 1)
    assert "w" in layoutlang.load(main, allow_outside_includes=True).tensors
    for command in ("check", "plan", "show"):
        result = cli(command, "--allow-outside-includes", str(main))
        assert result.returncode == ExitCode.OK, (command, result.stderr)


@pytest.mark.timeout(60)
def test_text_programs_are_confined_to_the_current_directory(tmp_path, monkeypatch):
    program(tmp_path, MODEL, "model.layout")
    monkeypatch.chdir(tmp_path)
    assert "w" in layoutlang.loads('include "model.layout"').tensors
    with pytest.raises(LayoutIncludeError, match="outside the program's folder"):
        layoutlang.loads('include "../x.layout"')


@pytest.mark.timeout(60)
def test_an_include_path_with_a_nul_byte_is_an_include_error_at_its_place(tmp_path):
    main = tmp_path / "main.layout"
    main.write_bytes(b'let x = 1\ninclude "a\x00b.layout"\n')
    result = cli("check", str(main))
    assert_refused(result, f"{main}:2:1", "NUL byte")
    assert "internal error" not in result.stderr
    with pytest.raises(LayoutIncludeError, match="NUL byte") as caught:
        layoutlang.load(main)
    assert (caught.value.span.line, caught.value.span.column) == (2, 1)


@pytest.mark.timeout(60)
def test_a_kernel_file_given_as_the_program_is_refused_without_showing_it():
    # /proc files pass for regular files of size 0; what they hold is never shown
    result = cli("check", "/proc/self/environ")
    assert_refused(result, "/proc/self/environ", "kernel file")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("special", ["/dev/zero", "/sys/kernel/mm/transparent_hugepage/enabled", "/proc/self/status"])
def test_kernel_and_device_files_are_refused_even_when_outside_includes_are_allowed(tmp_path, special):
    main = program(tmp_path, f'include "{special}"\n')
    with pytest.raises(LayoutIncludeError, match="special file"):
        layoutlang.load(main, allow_outside_includes=True)
