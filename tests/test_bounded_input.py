"""Input that must be refused quickly (issue 14, case 6): files that are not regular files,
files over their size limit, programs of too many tokens, long lines, and plans too large.

Each hostile input goes through the command line in a real process, as an operator would
give it: the command must exit 2 (a user's mistake) within a bound, with a short message
and no traceback. Before these limits, a FIFO blocked ``check`` forever, ``/dev/zero`` was
read until MemoryError, an 8 MB one-line file took 172 s and printed 16 MB, and ``plan``
of two meshes of 2^20 ranks ran for hours without a word.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layoutlang.cli.plan import MAX_PLAN_RANKS, check_plan_size
from layoutlang.cli.progress import Progress
from layoutlang.errors import (
    MESSAGE_LIMIT,
    SOURCE_WINDOW,
    ExitCode,
    LayoutIncludeError,
    LayoutSyntaxError,
    LayoutValueError,
    ModelDescriptionError,
    Span,
)
from layoutlang.io._files import MAX_JSON_BYTES, open_regular, read_json_object, read_limited
from layoutlang.lang import elaborate, load, loads
from layoutlang.lang import layouts as lang_layouts
from layoutlang.lang import tensors as lang_tensors
from layoutlang.lang.limits import (
    MAX_EMBEDDED_EXPRESSION,
    MAX_INCLUDE_DEPTH,
    MAX_LAYOUT_PLACEMENTS,
    MAX_MESH_RANKS,
    MAX_PROGRAM_BYTES,
    MAX_PROGRAM_TENSORS,
    MAX_PROGRAM_TOKENS,
)
from layoutlang.lang.parser import TokenBudget
from layoutlang.lang.scope import Constants
from layoutlang.model import Replicate
from layoutlang.model import layout as model_layout
from layoutlang.model.rules import compile_pattern

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
#: what a refused input may take end to end, the interpreter's start included (~0.3 s alone);
#: generous for 2 loaded cores: the hangs and minutes this guards against are far above it
QUICK_S = 20.0


def cli(*args: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``layoutlang ARGS`` in a fresh process; its result and its wall time."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,  # a command that blocks fails here instead of hanging the suite
        # this checkout first; then the caller's path (a git worktree's fix-ups of the import)
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    return result, time.monotonic() - start


def assert_refused(result: subprocess.CompletedProcess[str], seconds: float, *phrases: str) -> None:
    """Exit 2 within QUICK_S, no traceback, a message of at most a few KB naming ``phrases``."""
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert seconds < QUICK_S, f"took {seconds:.1f} s"
    assert len(result.stderr) < 4096, f"a message of {len(result.stderr)} bytes"
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "program.layout"
    os.mkfifo(path)
    return path


# ------------------------------------------------------------ files that are not regular


@pytest.mark.parametrize("command", ["check", "plan"])
def test_a_fifo_program_is_refused_without_blocking(fifo, command):
    result, seconds = cli(command, str(fifo))
    assert_refused(result, seconds, str(fifo), "FIFO", "not a regular file")


def test_dev_zero_as_a_program_is_refused():
    result, seconds = cli("check", "/dev/zero")
    assert_refused(result, seconds)
    # as docs/reference/cli.rst shows it
    assert result.stderr.strip() == "error: /dev/zero: .layout file is a character device, not a regular file"


def test_a_folder_as_a_program_is_refused(tmp_path):
    result, seconds = cli("check", str(tmp_path))
    assert_refused(result, seconds, str(tmp_path), "a directory")


def test_an_include_of_a_fifo_names_the_include(tmp_path, fifo):
    main = tmp_path / "main.layout"
    main.write_text(f'include "{fifo.name}"\n')
    with pytest.raises(LayoutIncludeError, match=r"cannot include 'program.layout': .*FIFO") as info:
        load(main)
    assert info.value.span is not None and (info.value.span.line, info.value.span.column) == (1, 1)


def test_a_fifo_config_in_a_model_folder_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    program = tmp_path / "import.layout"
    program.write_text('tensors from hf "model"\n')
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, str(model / "config.json"), "Hugging Face config is a FIFO")


@pytest.mark.parametrize("statement", ['tensors from hf "/dev/zero"', 'tensors from hf_constants "/dev/zero" as cfg'])
def test_dev_zero_as_a_config_is_refused(tmp_path, statement):
    program = tmp_path / "import.layout"
    program.write_text(statement + "\n")
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, "/dev/zero: Hugging Face config is a character device")


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_a_fifo_or_a_device_as_a_safetensors_file_is_refused(tmp_path, fifo, target):
    path = str(fifo) if target == "fifo" else target
    program = tmp_path / "import.layout"
    program.write_text(f'tensors from safetensors "{path}"\n')
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, f"{path}: safetensors file is", "not a regular file")


def test_open_regular_refuses_a_fifo_at_once_and_opens_a_file(tmp_path, fifo):
    # no writer ever opens the FIFO: a blocking open would wait here until the timeout
    with pytest.raises(ModelDescriptionError, match="FIFO"):
        open_regular(fifo, "safetensors file")
    file = tmp_path / "data.bin"
    file.write_bytes(b"\x01\x02\x03")
    with open_regular(file, "safetensors file") as stream:
        assert stream.read() == b"\x01\x02\x03"
    with pytest.raises(LayoutSyntaxError) as info:
        open_regular(tmp_path / "missing", "thing", display="shown", error=LayoutSyntaxError)
    assert info.value.message == "shown: thing not found"


# ------------------------------------------------------------------ sizes


def test_read_limited_takes_the_limit_and_refuses_one_byte_more(tmp_path):
    file = tmp_path / "blob"
    file.write_bytes(b"x" * 1000)
    assert read_limited(file, 1000, "blob") == b"x" * 1000
    with pytest.raises(ModelDescriptionError, match=r"blob is larger than the limit of 999 bytes"):
        read_limited(file, 999, "blob")


def test_a_config_over_its_limit_is_refused(tmp_path):
    # the default limit is 64 MiB; the same code with a small limit keeps the test small
    assert MAX_JSON_BYTES == 64 << 20
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "padding": "x" * 5000}))
    assert read_json_object(config, "Hugging Face config", limit=6000)["model_type"] == "llama"
    with pytest.raises(ModelDescriptionError, match=r"config.json: Hugging Face config is larger than the limit"):
        read_json_object(config, "Hugging Face config", limit=4096)


def test_a_program_over_its_size_limit_is_refused(tmp_path):
    program = tmp_path / "big.layout"
    with program.open("w") as f:  # valid text: only its size is wrong
        f.write("let a = 1\n")
        f.write(("#" * 1023 + "\n") * (MAX_PROGRAM_BYTES // 1024))
    assert program.stat().st_size > MAX_PROGRAM_BYTES
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, f"{program}: .layout file is larger than the limit of 16 MiB")


def test_a_million_let_lines_are_refused(tmp_path):
    program = tmp_path / "lets.layout"
    program.write_text("".join(f"let c{i} = {i}\n" for i in range(10**6)))
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, "larger than the limit")


def test_a_program_of_too_many_tokens_is_refused_at_the_first_token_past_the_limit(tmp_path):
    # 4 tokens a line (let, name, =, number): the line holding token MAX_PROGRAM_TOKENS + 1 is refused
    lines = MAX_PROGRAM_TOKENS // 4 + 100
    program = tmp_path / "lets.layout"
    program.write_text("".join(f"let c{i} = {i}\n" for i in range(lines)))
    assert program.stat().st_size < MAX_PROGRAM_BYTES
    result, seconds = cli("check", str(program))
    first_refused_line = MAX_PROGRAM_TOKENS // 4 + 1
    assert_refused(result, seconds, f"{program}:{first_refused_line}:1: error: the program is too long", "262,144")


def test_the_token_limit_counts_every_file_of_a_program(tmp_path, monkeypatch):
    # a program's budget of 1,000 tokens (the real one is MAX_PROGRAM_TOKENS: the same code,
    # slower to fill); two files of 600 tokens each: each alone is fine, together they are not
    monkeypatch.setattr(elaborate, "TokenBudget", lambda: TokenBudget(1000))
    body = "".join(f"let {{p}}{i} = {i}\n" for i in range(150))
    (tmp_path / "part.layout").write_text(body.replace("{p}", "b"))
    (tmp_path / "alone.layout").write_text(body.replace("{p}", "a"))
    main = tmp_path / "main.layout"
    main.write_text(body.replace("{p}", "a") + 'include "part.layout"\n')
    assert len(load(tmp_path / "alone.layout").constants) == 150
    assert len(load(tmp_path / "part.layout").constants) == 150
    with pytest.raises(LayoutSyntaxError, match="the program is too long") as info:
        load(main)
    # main.layout holds 602 tokens (the include's 2 with them), so part.layout's token 399 is the
    # first past: line 100 holds its tokens 397 to 400 (let b99 = 99), and 399 is '=', column 9
    span = info.value.span
    assert span is not None and span.path.endswith("part.layout") and (span.line, span.column) == (100, 9)


def test_an_8_mb_line_with_an_error_at_its_end_fails_quickly_with_a_short_message(tmp_path):
    program = tmp_path / "oneline.layout"
    program.write_text("let a = " + "1 + " * 2_000_000 + "+\n")  # 8 MB, 4M tokens
    assert program.stat().st_size >= 8_000_000
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, "the program is too long")


def test_an_8_mb_string_with_an_error_after_it_shows_a_window_of_the_line(tmp_path):
    program = tmp_path / "longname.layout"
    program.write_text('tensor "' + "a" * 8_000_000 + '" [4] fp32 oops\n')
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, "unexpected 'oops'", '" [4] fp32 oops')
    source_line = next(line for line in result.stderr.splitlines() if line.lstrip().startswith("1 |"))
    assert len(source_line) < SOURCE_WINDOW + 20 and "..." in source_line


# ------------------------------------------------------------------ the window of a long line


@pytest.mark.parametrize("column", [1, 7, 60, 5000, 9990, 10_001])
def test_the_caret_marks_the_spans_first_character_in_a_bounded_window(column):
    line = "".join(chr(ord("a") + i % 26) for i in range(10_000))
    span = Span("f.layout", 3, column, 3, column + 4, line + "\n")
    shown, marker = span.caret().split("\n")
    gutter = shown.index("| ") + 2
    assert len(shown) - gutter <= SOURCE_WINDOW + 6  # the window and its two "..." marks
    position = marker.index("^")
    assert marker[gutter:position] == " " * (position - gutter)
    if column <= len(line):  # the character above the marker is the span's first one
        assert shown[position] == line[column - 1]
        assert len(marker) - position == min(4, len(line) - column + 1)
    else:  # the end of the file: the marker follows the last character
        assert shown[position - 1] == line[-1] and position == len(shown)
    assert shown[gutter:].startswith("...") == (column > SOURCE_WINDOW // 3 + 1)


def test_a_short_line_is_shown_whole():
    span = Span("f.layout", 1, 5, 1, 8, "let abc = 1\n")
    assert span.caret() == "    1 | let abc = 1\n      |     ^~~"


# ------------------------------------------------------------------ plans too large


def _two_meshes(tmp_path: Path, ranks: int) -> Path:
    program = tmp_path / "wide.layout"
    program.write_text(
        f"mesh train [tp = {ranks}] on ranks 0..{ranks - 1}\n"
        f"mesh infer [dp = {ranks}] on ranks {ranks}..{2 * ranks - 1}\n"
        'tensor "w" [1024, 1024] bf16\n'
        'layout tp on train { "w": tp = shard(0) }\n'
        "layout dp on infer { default: replicate }\n"
        "reshard tp -> dp\n"
    )
    return program


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_plan_of_two_meshes_of_the_most_ranks_is_refused_before_compiling(tmp_path, command):
    program = _two_meshes(tmp_path, MAX_MESH_RANKS)
    result, seconds = cli(command, str(program))
    assert_refused(
        result, seconds, "too large to plan", "2,097,152 ranks", f"at most {MAX_PLAN_RANKS:,} ranks", ":6:1:"
    )
    check, seconds = cli("check", str(program))  # the program itself is valid, and checked quickly
    assert check.returncode == ExitCode.OK and seconds < QUICK_S, check.stderr


@pytest.mark.parametrize("elastic", [(), ("--elastic",)], ids=["plain", "elastic"])
def test_apply_refuses_more_local_workers_than_one_machine_runs_before_starting_any(tmp_path, elastic):
    from layoutlang.cli.apply import MAX_LOCAL_WORKERS

    program = _two_meshes(tmp_path, 512)  # 1,024 ranks: 1,024 processes importing torch
    result, seconds = cli("apply", str(program), *elastic)
    assert_refused(result, seconds, "needs 1,024 worker processes", f"at most {MAX_LOCAL_WORKERS} on one machine")


def test_the_rank_limit_counts_the_ranks_both_meshes_share_once():
    ranks = MAX_PLAN_RANKS // 2 + 1  # two meshes of this many ranks: over the limit, unless they share them

    def program(second_first_rank: int) -> str:
        return (
            f"mesh train [tp = {ranks}]\n"
            f"mesh infer [dp = {ranks}] on ranks {second_first_rank}..{second_first_rank + ranks - 1}\n"
            'tensor "w" [8] bf16\nlayout a on train { "w": tp = shard(0) }\n'
            'layout b on infer { "w": dp = shard(0) }\nreshard a -> b\n'
        )

    check_plan_size(loads(program(0)), None)  # colocated: ranks in all, within the limit
    with pytest.raises(LayoutValueError, match=f"holds? {2 * ranks:,} ranks"):
        check_plan_size(loads(program(ranks)), None)


def test_a_long_step_says_what_it_does_and_a_short_one_is_silent(capsys):
    progress = Progress("plan", as_json=False)
    assert progress.after == Progress.AFTER_OTHERWISE  # pytest's stderr is no terminal
    progress.after = progress.every = 0.1
    with progress.step("compiling the plan"):
        time.sleep(0.35)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "layoutlang plan: compiling the plan: running for 0 s"
    assert len(lines) >= 3 and lines[-1].startswith("layoutlang plan: compiling the plan: done in")
    with progress.step("validating the plan"):
        pass
    assert capsys.readouterr().err == ""
    as_json = Progress("check", as_json=True)
    as_json.after = as_json.every = 0.1
    with as_json.step("validating the plan"):
        time.sleep(0.15)
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert records[0]["progress"] == "validating the plan" and records[0]["done"] is False
    assert records[-1]["done"] is True and records[-1]["seconds"] >= 0.1


# ------------------------------------------------------------------ text quoted in messages


def _storage_named(name: str) -> str:
    return (
        f'mesh m [tp = 2]\ntensor "w" [4] fp32\nlayout a on m {{\n  "w": tp = shard(0)\n  storage "{name}" = "w"\n}}\n'
    )


def test_an_expression_in_a_name_longer_than_its_limit_is_refused_at_its_place():
    fits = "5" + " " * (MAX_EMBEDDED_EXPRESSION - 3) + "+2"  # MAX_EMBEDDED_EXPRESSION characters
    program = loads(_storage_named("s{" + fits + "}"), "long.layout")
    assert program.layout("a").resolved.storages[0].name == "s7"
    with pytest.raises(LayoutSyntaxError, match=f"holds at most {MAX_EMBEDDED_EXPRESSION:,}") as info:
        loads(_storage_named("s{ " + fits + "}"), "long.layout").check()
    assert info.value.span is not None and (info.value.span.line, info.value.span.column) == (5, 14)
    assert len(str(info.value)) < 1000


def test_an_expression_in_a_name_that_nests_too_deeply_is_a_syntax_error():
    depth = MAX_EMBEDDED_EXPRESSION // 2 - 1
    nested = "-" * (MAX_EMBEDDED_EXPRESSION - 1) + "1"  # 1,023 unary minuses: a tree that deep
    with pytest.raises(LayoutSyntaxError, match="nests too deeply"):
        loads(_storage_named("s{" + nested + "}")).check()
    program = loads(_storage_named("s{" + "(" * depth + "7" + ")" * depth + "}"))
    assert program.layout("a").resolved.storages[0].name == "s7"


def test_a_message_quoting_megabytes_of_input_is_bounded(tmp_path):
    program = tmp_path / "longname.layout"
    program.write_text(
        'mesh m [tp = 2]\ntensor "w" [4] fp32\nlayout a on ' + "m" * 8_000_000 + ' { "w": tp = shard(0) }\n'
    )
    result, seconds = cli("check", str(program))
    assert_refused(result, seconds, "unknown mesh 'mmmm", "...")
    as_json, _ = cli("check", "--json", str(program))
    (error,) = json.loads(as_json.stdout)["errors"]
    assert error["error"] == "name" and len(error["message"]) <= MESSAGE_LIMIT and error["line"] == 3


def test_a_program_holds_at_most_max_program_tensors(monkeypatch):
    # the real limit, 2^18, is the same code and takes seconds to fill
    assert MAX_PROGRAM_TENSORS == 1 << 18
    monkeypatch.setattr(lang_tensors, "MAX_PROGRAM_TENSORS", 100)
    assert len(loads('tensor "a{l}" [4] fp32 for l in 0..59\ntensor "b{l}" [4] fp32 for l in 0..39\n').tensors) == 100
    with pytest.raises(
        LayoutValueError, match=r"would hold 110 tensors \(60 declared before this statement, 50 by it\)"
    ):
        loads('tensor "a{l}" [4] fp32 for l in 0..59\ntensor "b{l}" [4] fp32 for l in 0..49\n')
    with pytest.raises(LayoutValueError, match="at most 100") as info:
        loads('tensor "a{l}" [4] fp32 for l in 0..99\ntensor "b" [4] fp32\n')
    assert info.value.span is not None and info.value.span.line == 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "Hugging Face config nests too deeply to be read"),
        ('{"num_hidden_layers": ' + "9" * 5000 + "}", "Hugging Face config cannot be read: Exceeds the limit"),
    ],
)
def test_json_python_cannot_hold_is_a_model_description_error(tmp_path, text, reason):
    config = tmp_path / "config.json"
    config.write_text(text)
    with pytest.raises(ModelDescriptionError) as info:
        read_json_object(config, "Hugging Face config")
    assert info.value.message.startswith(f"{config}: {reason}")
    assert "set_int_max_str_digits" not in info.value.message


def test_includes_nest_at_most_max_include_depth_files_deep(tmp_path):
    def chain(files: int) -> Path:
        folder = tmp_path / f"chain{files}"
        folder.mkdir()
        for i in range(files):
            last = i == files - 1
            (folder / f"f{i}.layout").write_text("let a = 1\n" if last else f'include "f{i + 1}.layout"\n')
        return folder / "f0.layout"

    assert load(chain(MAX_INCLUDE_DEPTH)).constants["a"] == 1
    with pytest.raises(LayoutIncludeError, match=f"nest more than {MAX_INCLUDE_DEPTH} files deep") as info:
        load(chain(MAX_INCLUDE_DEPTH + 1))
    span = info.value.span
    assert span is not None and span.path.endswith(f"f{MAX_INCLUDE_DEPTH - 1}.layout")
    assert len(span.included_from) == MAX_INCLUDE_DEPTH - 1


# ------------------------------------------------- values past the 64-bit integers


@pytest.mark.timeout(60)
def test_a_let_chain_that_squares_its_value_is_refused_at_the_first_value_past_64_bits(tmp_path):
    # 40 lines, under 800 bytes: before the bound, 3 ** (2 ** 40) grew for minutes and GBs
    lines = ["let a0 = 3", *(f"let a{i + 1} = a{i} * a{i}" for i in range(40))]
    program = tmp_path / "chain.layout"
    program.write_text("\n".join(lines) + "\n")
    result, seconds = cli("check", str(program))
    # 3 ** 32 fits; a6 = 3 ** 64 is the first value past 2 ** 63 - 1
    assert_refused(result, seconds, f"{program}:7:10", "outside the 64-bit integers", "let a6 = a5 * a5")
    assert "internal error" not in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "line", "column", "value"),
    [
        ("let big = 9223372036854775807 + 1\n", 1, 11, "9223372036854775808"),  # a sum
        ("let x = -9223372036854775807 - 1\nlet y = -x\n", 2, 9, "9223372036854775808"),  # a negation
        ("let x = -9223372036854775807 - 1\nlet y = x // -1\n", 2, 9, "9223372036854775808"),  # a division
        ("let x = 3037000500\nlet y = max(x * x, 1)\n", 2, 13, "9223372037000250000"),  # inside a call
        ('tensor "w" [99999999999999999999999] fp32\n', 1, 13, "99999999999999999999999"),  # a number
        ('tensor "w{i}" [4] fp32 for i in 99999999999999999999990..99999999999999999999999\n', 1, 33, None),
    ],
)
def test_every_value_past_64_bits_is_refused_at_its_place(text, line, column, value):
    with pytest.raises(LayoutValueError, match="outside the 64-bit integers") as info:
        loads(text, "p.layout")
    span = info.value.span
    assert span is not None and (span.path, span.line, span.column) == ("p.layout", line, column)
    if value is not None:
        assert value in info.value.message
    # the edges themselves are values
    assert loads("let a = 9223372036854775807\nlet b = -9223372036854775807 - 1\n").constants["b"] == -(1 << 63)


@pytest.mark.timeout(60)
def test_a_domain_size_past_its_limit_is_refused_at_check_not_an_internal_error_at_plan(tmp_path):
    program = tmp_path / "p.layout"
    program.write_text(
        "topology { domain_size = 99999999999999999999999 }\nmesh m [tp = 2]\ntensor \"w\" [4] fp32\n"
        "layout a on m { default: replicate }\nreshard a -> a\n"
    )
    for command in ("check", "plan"):
        result, seconds = cli(command, str(program))
        assert_refused(result, seconds, f"{program}:1:12", "'domain_size' = 1e+23 is too large", "2,147,483,647")
    program.write_text(program.read_text().replace("99999999999999999999999", "2147483647"))
    result, _ = cli("plan", str(program))
    assert result.returncode == ExitCode.OK, result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", ["network_bandwidth = 1e300 TB/s", "copy_bandwidth = 1e306 GiB/s"])
def test_a_topology_quantity_that_overflows_its_unit_is_refused(entry):
    with pytest.raises(LayoutValueError, match="that layoutlang can compute with") as info:
        loads(f"topology {{ {entry} }}\n")
    assert info.value.span is not None and (info.value.span.line, info.value.span.column) == (1, 12)


# ------------------------------------------- checking in time linear in the program


class _CountingPattern:
    """A compiled pattern that counts the names it is tried on (the unit of rule matching)."""

    tried = 0

    def __init__(self, regex: re.Pattern[str]) -> None:
        self._regex = regex

    def fullmatch(self, name: str) -> re.Match[str] | None:
        _CountingPattern.tried += 1
        return self._regex.fullmatch(name)

    def __getattr__(self, attribute: str) -> object:
        return getattr(self._regex, attribute)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule", ['"layers.{i}.w"', '"layers.{i}.*w"', '"layers.{i}.w*"'])
def test_rules_naming_single_tensors_are_tried_on_few_names_not_every_name(monkeypatch, rule):
    # R rules with a literal digit over T tensors: every rule was tried on every name, twice
    # (resolution, and whether the rule matches some tensor): 2 x T x R pattern tests
    tensors, rules = 3000, 300

    def counting(pattern: str) -> _CountingPattern:
        return _CountingPattern(compile_pattern(pattern))

    monkeypatch.setattr(model_layout, "compile_pattern", counting)
    monkeypatch.setattr(lang_layouts, "compile_pattern", counting)
    specific = "\n".join(f"  {rule.replace('{i}', str(i))}: tp = shard(1)" for i in range(rules))
    program = loads(
        f'mesh m [tp = 2]\ntensor "layers.{{l}}.w" [4, 4] fp32 for l in 0..{tensors - 1}\n'
        f'layout a on m {{\n  "layers.{{l}}.w": tp = shard(0)\n{specific}\n}}\n'
    )
    _CountingPattern.tried = 0
    program.check()
    layout = program.layouts["a"]
    assert layout.placement("layers.7.w") != layout.placement(f"layers.{rules}.w")  # the specific rule won
    # each name is tried on its own rule and the skeleton's: a few per tensor, not one per rule
    assert _CountingPattern.tried < 4 * (tensors + rules), _CountingPattern.tried


@pytest.mark.timeout(120)
def test_two_rules_naming_the_same_tensor_at_equal_specificity_are_still_a_tie():
    text = 'mesh m [tp = 2]\ntensor "layers.{l}.w" [4, 4] fp32 for l in 0..9\nlayout a on m {\n'
    with pytest.raises(LayoutValueError, match="two rules of equal specificity"):
        loads(text + '  "layers.3.*": tp = shard(0)\n  "layers.*.w": tp = shard(1)\n}\n').check()
    # a more specific rule with a digit wins over a tie of less specific ones, for its tensor only
    rules = '  "*s.{l}.w": tp = shard(0)\n  "l*.{l}.w": tp = shard(1)\n  "layers.3.w": replicate\n}\n'
    program = loads(text.replace("0..9", "3..3") + rules)
    assert program.layouts["a"].placement("layers.3.w").placements == (Replicate(),)
    with pytest.raises(LayoutValueError, match=r"tensor 'layers\.4\.w' is matched by two rules of equal specificity"):
        loads(text.replace("0..9", "3..4") + rules).check()


@pytest.mark.timeout(120)
def test_generated_tensors_do_not_copy_the_constants_each(monkeypatch):
    # C constants and T generated tensors: the constants were copied for every tensor (C x T;
    # 5,000 constants and 20,000 tensors took 50 s)
    copies = 0
    iterate = Constants.__iter__

    def counting(self: Constants) -> Iterator[str]:
        nonlocal copies
        copies += 1
        return iterate(self)

    monkeypatch.setattr(Constants, "__iter__", counting)
    lets = "".join(f"let c{i} = {i}\n" for i in range(100))
    program = loads(f'{lets}tensor "w{{i}}" [c7, i + 1] fp32 for i in 0..999\n')
    assert program.tensors["w999"].shape == (7, 1000)
    assert copies < 10, copies


@pytest.mark.timeout(120)
def test_no_full_garbage_collection_runs_while_a_program_is_read_and_checked():
    # each full collection visits every object alive: run every so many allocations, they made
    # reading and checking quadratic in the tensors (300,000 tensors: 51 s; paused: 30 s). In a
    # process of its own: a thread another test left in this one may collect explicitly.
    script = (
        "import gc\n"
        "from layoutlang import loads\n"
        "text = ('mesh m [tp = 2]\\ntensor \"w{l}\" [4, 4] fp32 for l in 0..49999\\n'\n"
        "        'layout a on m { default: replicate }\\n')\n"
        "before = gc.get_stats()[2]['collections']\n"
        "loads(text).check()\n"
        "print(gc.get_stats()[2]['collections'] - before, gc.isenabled())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["0", "True"], done.stdout + done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("written", ["one storage rule per layer", "one storage rule for all layers"])
def test_storage_rules_are_tried_on_the_names_they_could_match_not_every_name(monkeypatch, written):
    # S storage rules over T tensors: each rule was tried on every name (S x T pattern tests)
    layers = 2000

    def counting(pattern: str) -> _CountingPattern:
        return _CountingPattern(compile_pattern(pattern))

    monkeypatch.setattr(model_layout, "compile_pattern", counting)
    if written == "one storage rule per layer":
        storages = "".join(f'  storage "l{i}.fused" = "l.{i}.a" | "l.{i}.b"\n' for i in range(layers // 10))
    else:
        storages = '  storage "l{n}.fused" = "l.{n}.a" | "l.{n}.b"\n'
    program = loads(
        f'mesh m [tp = 2]\ntensor "l.{{n}}.a" [4, 4] fp32 for n in 0..{layers - 1}\n'
        f'tensor "l.{{n}}.b" [4, 4] fp32 for n in 0..{layers - 1}\n'
        f'layout a on m {{\n  default: tp = shard(0)\n{storages}}}\n'
    )
    _CountingPattern.tried = 0
    program.check()
    assert program.layouts["a"].storage_of("l.7.b").name == "l7.fused"
    assert _CountingPattern.tried < 6 * layers, _CountingPattern.tried


@pytest.mark.timeout(120)
def test_quantize_statements_are_tried_on_the_names_they_could_match_not_every_name(monkeypatch):
    # Q quantize statements over T tensors: each statement was tried on every name (Q x T)
    layers = 2000

    def counting(pattern: str) -> _CountingPattern:
        return _CountingPattern(compile_pattern(pattern))

    monkeypatch.setattr(model_layout, "compile_pattern", counting)
    per_layer = "".join(
        f'  quantize "l.{i}.w*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32\n' for i in range(layers // 10)
    )
    program = loads(
        f'mesh m [tp = 2]\ntensor "l.{{n}}.w" [256, 256] bf16 for n in 0..{layers - 1}\n'
        f'tensor "norm" [256] bf16\nlayout a on m {{\n  default: replicate\n{per_layer}'
        '  quantize "l.{n}.w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32\n}\n'
    )
    _CountingPattern.tried = 0
    quantized = program.layouts["a"].quantized()
    assert len(quantized) == layers and quantized["l.7.w"].rule.pattern == "l.7.w*"
    assert quantized[f"l.{layers - 1}.w"].rule.pattern == "l.{n}.w"
    assert _CountingPattern.tried < 6 * layers, _CountingPattern.tried


@pytest.mark.timeout(120)
def test_layouts_times_tensors_are_bounded_at_the_first_layout_past_the_limit(monkeypatch):
    # checking resolves every tensor in every layout: a thousand one-line layouts of 2^18
    # tensors are a small program and hours of work, so layouts x tensors is a limit of its own
    assert MAX_LAYOUT_PLACEMENTS == 1 << 21
    monkeypatch.setattr(elaborate, "MAX_LAYOUT_PLACEMENTS", 100)
    text = 'mesh m [tp = 2]\ntensor "w{l}" [4] fp32 for l in 0..29\n'
    three = "".join(f"layout l{i} on m {{ default: replicate }}\n" for i in range(3))
    loads(text + three).check()  # 90 placements
    with pytest.raises(LayoutValueError, match="declares 5 layouts of 30 tensors: 150 tensor placements") as info:
        loads(text + three + "layout l3 on m { default: replicate }\nlayout l4 on m { default: replicate }\n")
    assert info.value.span is not None and info.value.span.line == 6  # l3, the first past the limit


@pytest.mark.timeout(120)
def test_dtype_patterns_of_an_import_are_tried_on_the_names_they_could_match(tmp_path, monkeypatch):
    # P patterns of a 'tensors from' body over T imported tensors: each pattern was tried on every name
    import torch
    from safetensors.torch import save_file

    tensors = 2000
    save_file({f"l.{i}.w": torch.zeros(1) for i in range(tensors)}, str(tmp_path / "model.safetensors"))

    def counting(pattern: str) -> _CountingPattern:
        return _CountingPattern(compile_pattern(pattern))

    monkeypatch.setattr(lang_tensors, "compile_pattern", counting)
    body = "".join(f'  "l.{i}.w*": bf16\n' for i in range(tensors // 10))
    text = f'tensors from safetensors "model.safetensors" {{\n{body}  "l.{{n}}.w": fp16\n}}\n'
    (tmp_path / "p.layout").write_text(text)
    _CountingPattern.tried = 0
    dtypes = {name: t.dtype for name, t in load(tmp_path / "p.layout").tensors.items()}
    assert dtypes["l.7.w"] == "bf16" and dtypes[f"l.{tensors - 1}.w"] == "fp16"
    assert _CountingPattern.tried < 6 * tensors, _CountingPattern.tried


@pytest.mark.timeout(60)
def test_a_capture_past_64_bits_in_a_tensor_name_is_an_error_at_the_rule_not_an_internal_error(tmp_path):
    # Python refuses to convert more than 4,300 digits: a ValueError and exit 3 before
    def program(number: str) -> str:
        return f'mesh m [tp = 2]\ntensor "l.{number}.w" [4] fp32\nlayout a on m {{ "l.{{n}}.w": replicate }}\n'

    path = tmp_path / "digits.layout"
    path.write_text(program("9" * 5000))
    result, seconds = cli("check", str(path))
    assert_refused(result, seconds, f"{path}:3:17", "which {n} captures", "outside the 64-bit integers")
    with pytest.raises(LayoutValueError, match=r"the number 9223372036854775808, which \{n\} captures"):
        loads(program(str(1 << 63))).check()
    loads(program(str((1 << 63) - 1))).check()  # the largest 64-bit value is a capture like any other
