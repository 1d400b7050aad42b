"""The command line: ``layoutlang check`` and ``layoutlang show``, run in-process.

Besides the expected output for good input, the contract under test is that a user's
mistake is reported on stderr as ``file:line:col: error: ...`` with the source line and a
caret (with ``--json``, in the errors of the one JSON envelope on stdout), the exit status
is 2, and no traceback is ever shown. The fuzz tests hold every example to that contract under truncation and mutation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import layoutlang
from layoutlang.cli import ExitCode, main
from layoutlang.cli import check as check_command
from layoutlang.cli.main import COMMANDS, build_parser

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.layout"))  # including the fragments in subfolders
PROGRAMS = sorted(EXAMPLES.glob("*.layout"))  # complete programs; subfolders hold included parts
ERROR_HEAD = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<column>\d+): error: ")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def envelope(out: str, command: str, code: int) -> dict:
    """The ``--json`` envelope printed on stdout, checked against the exit status ``code``."""
    data = json.loads(out)
    assert (data["command"], data["ok"], data["exit_code"]) == (command, code == 0, code)
    assert bool(data["errors"]) == (code != 0)
    return data


def rows(out: str) -> list[list[str]]:
    """The table rows of ``show`` output, split on runs of two or more spaces."""
    return [
        re.split(r"\s{2,}", line.strip())
        for line in out.splitlines()
        if re.match(r"\s*\d+\s", line)
    ]


# ===================================================================== check


def test_examples_are_found():
    names = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLE_FILES}
    assert {"vllm_tp.layout", "megatron_pp_tp.layout", "models/tiny_llama.layout"} <= names
    assert {"vllm_tp.layout", "megatron_pp_tp.layout"} <= {p.name for p in PROGRAMS}


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.name)
def test_check_every_example_prints_an_ok_line(capsys, path):
    code, out, err = run(capsys, "check", path)
    assert code == ExitCode.OK, err
    assert err == ""
    assert re.fullmatch(
        rf"{re.escape(str(path))}: ok \(\d+ meshe?s?, \d+ tensors?, \d+ layouts?, \d+ reshards?\)\n", out
    ), out


def test_check_several_files_prints_one_line_each(capsys):
    code, out, _ = run(
        capsys, "check", EXAMPLES / "vllm_tp.layout", EXAMPLES / "megatron_pp_tp.layout"
    )
    assert code == ExitCode.OK
    lines = out.splitlines()
    assert lines[0].startswith(
        f"{EXAMPLES / 'vllm_tp.layout'}: ok (1 mesh, 39 tensors, 1 layout, 0 reshards)"
    )
    assert lines[1].startswith(
        f"{EXAMPLES / 'megatron_pp_tp.layout'}: ok (1 mesh, 39 tensors, 1 layout, 0 reshards)"
    )


def test_check_json_on_every_example_parses(capsys):
    code, out, err = run(capsys, "check", "--json", *PROGRAMS)
    assert code == ExitCode.OK, err
    results = envelope(out, "check", code)["result"]["files"]
    assert [r["file"] for r in results] == [str(p) for p in PROGRAMS]
    assert all(r["ok"] for r in results)
    vllm = next(r for r in results if r["file"].endswith("vllm_tp.layout"))
    assert {k: vllm[k] for k in ("meshes", "tensors", "layouts", "reshards")} == {
        "meshes": 1,
        "tensors": 39,
        "layouts": 1,
        "reshards": 0,
    }


# ====================================================================== show

TINY = """\
mesh m [dp = 2, tp = 2] on ranks 4..7
mesh solo [tp = 2] on ranks 0..1

tensor "w" [4, 6] fp32
tensor "b" [6] fp32
tensor "mlp.gate" [4, 2] bf16
tensor "mlp.up" [4, 2] bf16

layout tp on m {
    "w": tp = shard(1)
    "mlp.*": tp = shard(0)
    default: replicate
    storage "mlp.gate_up" = "mlp.gate" | "mlp.up"
}

layout dp on m {
    "w": dp = shard(0), tp = shard(0)
    default: dp = shard(0)
}

layout single on solo {
    default: replicate
}
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.layout"
    path.write_text(TINY)
    return path


def test_show_one_tensor_on_one_rank_of_one_layout(capsys, tiny):
    code, out, err = run(capsys, "show", tiny, "--layout", "tp", "--tensor", "w", "--rank", "5")
    assert code == ExitCode.OK, err
    lines = out.splitlines()
    assert lines[0] == "layout tp on mesh m [dp=2, tp=2] (ranks 4..7)"
    assert lines[1].split() == ["rank", "tensor", "region", "storage", "place", "storage", "shape"]
    # rank 5 is tp coordinate 1: columns 3..6 of w, at the start of its own storage of 4x3
    assert rows(out) == [["5", "w", "[0:4, 3:6]", "w", "[0:4, 0:3]", "4x3"]]


def test_show_fused_storage_places_the_second_part_after_the_first(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "tp", "--tensor", "mlp.*", "--rank", "6")
    assert code == ExitCode.OK
    assert rows(out) == [
        ["6", "mlp.gate", "[0:2, 0:2]", "mlp.gate_up", "[0:2, 0:2]", "4x2"],
        ["6", "mlp.up", "[0:2, 0:2]", "mlp.gate_up", "[2:4, 0:2]", "4x2"],
    ]


def test_show_nested_sharding_over_both_axes(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "dp", "--tensor", "w")
    assert code == ExitCode.OK
    # dp then tp split dim 0 left to right: ranks 4..7 hold one row each, in mesh order
    assert [(r[0], r[2]) for r in rows(out)] == [
        ("4", "[0:1, 0:6]"),
        ("5", "[1:2, 0:6]"),
        ("6", "[2:3, 0:6]"),
        ("7", "[3:4, 0:6]"),
    ]


def test_show_capture_pattern_selects_tensors(capsys, tmp_path):
    path = tmp_path / "layers.layout"
    path.write_text(
        'mesh m [tp = 2]\ntensor "l.{i}.w" [2] fp32 for i in 0..2\ntensor "head" [2] fp32\n'
        "layout r on m { default: replicate }\n"
    )
    code, out, _ = run(capsys, "show", path, "--tensor", "l.{x}.w", "--rank", "0")
    assert code == ExitCode.OK
    assert [r[1] for r in rows(out)] == ["l.0.w", "l.1.w", "l.2.w"]


def test_show_all_layouts_prints_one_table_each(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny)
    assert code == ExitCode.OK
    headers = [line for line in out.splitlines() if line.startswith("layout ")]
    assert headers == [
        "layout tp on mesh m [dp=2, tp=2] (ranks 4..7)",
        "layout dp on mesh m [dp=2, tp=2] (ranks 4..7)",
        "layout single on mesh solo [tp=2] (ranks 0..1)",
    ]
    assert len(rows(out)) == (4 + 4 + 2) * 4  # ranks of each layout x 4 tensors, a box of each


def test_show_rank_without_layout_skips_layouts_whose_mesh_lacks_it(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--rank", "1", "--tensor", "b")
    assert code == ExitCode.OK
    assert [line for line in out.splitlines() if line.startswith("layout ")] == [
        "layout single on mesh solo [tp=2] (ranks 0..1)"
    ]
    assert rows(out) == [["1", "b", "[0:6]", "b", "[0:6]", "6"]]


def test_show_json_boxes(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "dp", "--rank", "7", "--json")
    assert code == ExitCode.OK
    assert envelope(out, "show", code)["result"]["layouts"] == [
        {
            "layout": "dp",
            "mesh": "m",
            "boxes": [
                {
                    "rank": 7,
                    "tensor": "w",
                    "offsets": [3, 0],
                    "sizes": [1, 6],
                    "storage": "w",
                    "storage_offsets": [0, 0],
                },
                {
                    "rank": 7,
                    "tensor": "b",
                    "offsets": [3],
                    "sizes": [3],
                    "storage": "b",
                    "storage_offsets": [0],
                },
                {
                    "rank": 7,
                    "tensor": "mlp.gate",
                    "offsets": [2, 0],
                    "sizes": [2, 2],
                    "storage": "mlp.gate",
                    "storage_offsets": [0, 0],
                },
                {
                    "rank": 7,
                    "tensor": "mlp.up",
                    "offsets": [2, 0],
                    "sizes": [2, 2],
                    "storage": "mlp.up",
                    "storage_offsets": [0, 0],
                },
            ],
        }
    ]


def test_show_summary_totals_per_rank(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "tp", "--summary")
    assert code == ExitCode.OK
    assert out.splitlines()[1].split() == ["rank", "tensors", "boxes", "elements", "bytes"]
    # per rank: w 4x3 fp32 (48 B) + b 6 fp32 (24 B) + gate 2x2 bf16 (8 B) + up 2x2 bf16 (8 B)
    assert rows(out) == [[str(rank), "4", "4", "26", "88"] for rank in (4, 5, 6, 7)]


def test_show_summary_json_for_one_rank(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "dp", "--summary", "--rank", "4", "--json")
    assert code == ExitCode.OK
    # w: 1 row of 6 fp32 (24 B), b: 3 fp32 (12 B), gate and up: 2x2 bf16 each (8 B)
    assert envelope(out, "show", code)["result"]["layouts"] == [
        {
            "layout": "dp",
            "mesh": "m",
            "summary": [{"rank": 4, "tensors": 4, "boxes": 4, "elements": 17, "bytes": 52}],
        }
    ]


# ==================================================================== errors

BROKEN = """\
mesh train [pp = 2, tp = 2]
tensor "w" [4] fp32
layout l on train {
    "w": tpp = shard(0)
}
"""


@pytest.fixture
def broken(tmp_path) -> Path:
    path = tmp_path / "broken.layout"
    path.write_text(BROKEN)
    return path


@pytest.mark.parametrize("command", ["check", "show"])
def test_bad_file_prints_place_caret_and_hint_without_traceback(capsys, broken, command):
    code, out, err = run(capsys, command, broken)
    assert code == ExitCode.BAD_INPUT
    assert out == ""
    assert err.splitlines() == [
        f"{broken}:4:10: error: unknown axis 'tpp' in mesh 'train' (axes: pp, tp)",
        '    4 |     "w": tpp = shard(0)',
        "      |          ^~~",
        "  hint: did you mean 'tp'?",
    ]
    assert "Traceback" not in err


def test_check_goes_on_after_a_bad_file_and_fails_overall(capsys, broken):
    good = EXAMPLES / "vllm_tp.layout"
    code, out, err = run(capsys, "check", broken, good)
    assert code == ExitCode.BAD_INPUT
    assert err.startswith(f"{broken}:4:10: error: ")
    assert out.startswith(f"{good}: ok (")


def test_check_json_error_is_in_the_envelope_on_stdout(capsys, broken):
    code, out, err = run(capsys, "check", "--json", broken)
    assert code == ExitCode.BAD_INPUT
    assert err == ""
    data = envelope(out, "check", code)
    (error,) = data["errors"]
    assert {k: error[k] for k in ("error", "file", "line", "column", "end_column", "hint")} == {
        "error": "name",
        "file": str(broken),
        "line": 4,
        "column": 10,
        "end_column": 13,
        "hint": "did you mean 'tp'?",
    }
    assert "unknown axis 'tpp'" in error["message"]
    (result,) = data["result"]["files"]
    assert result["ok"] is False and result["file"] == str(broken) and result["line"] == 4


def test_show_json_error_is_in_the_envelope_on_stdout(capsys, tmp_path):
    path = tmp_path / "syntax.layout"
    path.write_text("let a = 1\nlet b = a / 2\n")
    code, out, err = run(capsys, "show", path, "--json")
    assert code == ExitCode.BAD_INPUT
    assert err == ""
    data = envelope(out, "show", code)
    assert data["result"] is None
    (error,) = data["errors"]
    assert (error["error"], error["file"], error["line"], error["column"]) == (
        "syntax",
        str(path),
        2,
        11,
    )
    assert error["hint"] == "integer division is written '//'"


def test_error_found_while_resolving_is_reported_by_check(capsys, tmp_path):
    path = tmp_path / "stages.layout"
    path.write_text(
        'mesh m [pp = 2]\ntensor "l.{l}" [4] fp32 for l in 0..9\nlayout x on m {\n  "l.{l}": pp[l // 2]\n}\n'
    )
    code, _, err = run(capsys, "check", path)
    assert code == ExitCode.BAD_INPUT
    assert err.startswith(
        f"{path}:4:3: error: sub-mesh index 2 is out of range for axis 'pp' of size 2"
    )
    assert "^" in err.splitlines()[2]


def test_show_unknown_layout(capsys, tiny):
    code, out, err = run(capsys, "show", tiny, "--layout", "tpp")
    assert code == ExitCode.BAD_INPUT
    assert out == ""
    assert err.splitlines() == [
        "error: unknown layout 'tpp' (layouts: tp, dp, single)",
        "  hint: did you mean 'tp'?",
    ]


def test_show_unknown_layout_as_json(capsys, tiny):
    code, out, _ = run(capsys, "show", tiny, "--layout", "nope", "--json")
    assert code == ExitCode.BAD_INPUT
    assert envelope(out, "show", code)["errors"] == [{
        "error": "name",
        "message": "unknown layout 'nope' (layouts: tp, dp, single)",
    }]


def test_show_rank_in_no_mesh(capsys, tiny):
    code, out, err = run(capsys, "show", tiny, "--rank", "99")
    assert code == ExitCode.BAD_INPUT
    assert out == ""
    assert err.strip() == f"error: rank 99 belongs to no mesh of any layout in {tiny}"


def test_show_rank_outside_the_chosen_layouts_mesh(capsys, tiny):
    code, _, err = run(capsys, "show", tiny, "--layout", "single", "--rank", "5")
    assert code == ExitCode.BAD_INPUT
    assert err.strip() == "error: rank 5 is not in mesh 'solo' of layout 'single' (ranks 0..1)"


def test_show_tensor_matching_nothing_suggests_a_name(capsys, tiny):
    code, out, err = run(capsys, "show", tiny, "--tensor", "mlp.gtae")
    assert code == ExitCode.BAD_INPUT
    assert out == ""
    assert err.splitlines() == [
        f"error: no tensor matches 'mlp.gtae' in {tiny}",
        "  hint: did you mean 'mlp.gate'?",
    ]


def test_show_tensor_pattern_matching_nothing(capsys, tiny):
    code, _, err = run(capsys, "show", tiny, "--tensor", "layers.*")
    assert code == ExitCode.BAD_INPUT
    assert "no tensor matches 'layers.*'" in err


def test_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "check", tmp_path / "nope.layout")
    assert code == ExitCode.BAD_INPUT
    assert err.strip() == f"error: no such file: {tmp_path / 'nope.layout'}"


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_a_file_that_cannot_be_read_is_a_file_error_in_json(capsys, tmp_path, make):
    path = tmp_path / "program.layout"
    if make == "directory":
        path.mkdir()
    code, out, _ = run(capsys, "check", path, "--json")
    assert code == ExitCode.BAD_INPUT
    (entry,) = envelope(out, "check", code)["result"]["files"]
    assert (entry["ok"], entry["error"]) == (False, "file")  # not a syntax error: there is no text


def test_no_option_help_stops_mid_sentence():
    """Every option's help is a whole phrase (``--policy``'s once ended "overriding the statement's")."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    dangling = re.compile(r"(\b(the|a|an|of|to|for|and|or|with|in)|'s)$")
    cut = [
        (name, action.option_strings, action.help)
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.help and action.help != argparse.SUPPRESS and dangling.search(action.help.strip())
    ]
    assert cut == []


def test_top_level_help_names_what_the_commands_do(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for command in COMMANDS:
        assert command in text
    for verb in ("check", "show", "plan", "simulate", "apply", "draw"):
        assert verb in text.split("positional arguments")[0], verb


def test_unexpected_exception_is_an_internal_error_without_traceback(capsys, tiny, monkeypatch):
    def broken_load(path, *, allow_outside_includes=False):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(check_command, "load", broken_load)
    code, _, err = run(capsys, "check", tiny)
    assert code == ExitCode.INTERNAL
    assert err.startswith("layoutlang: internal error: RuntimeError: simulated bug")
    assert "Traceback" not in err

    code, out, err = run(capsys, "check", "--json", tiny)
    assert code == ExitCode.INTERNAL and err == ""
    assert envelope(out, "check", code)["errors"] == [{"error": "internal", "message": "RuntimeError: simulated bug"}]


def test_a_runtime_failure_exits_1_without_traceback(capsys, tiny, monkeypatch):
    def failing_load(path, *, allow_outside_includes=False):
        raise layoutlang.ExecutionError("rank 3: receiving 64 bytes from rank 1 did not complete", rank=3, peers=[1])

    monkeypatch.setattr(check_command, "load", failing_load)
    code, out, err = run(capsys, "check", tiny)
    assert code == ExitCode.FAILURE == 1  # the input was fine: the operator must act, not the user
    assert out == ""
    assert err == "error: rank 3: receiving 64 bytes from rank 1 did not complete\n"

    code, out, _ = run(capsys, "check", "--json", tiny)
    assert code == ExitCode.FAILURE
    assert envelope(out, "check", code)["errors"] == [
        {
            "error": "execution",
            "message": "rank 3: receiving 64 bytes from rank 1 did not complete",
            "rank": 3,
            "peers": [1],
        }
    ]


# ====================================================================== fuzz
#
# Every example, truncated at many places and mutated in many ways, must give exit 0, or
# exit 2 with an error whose first line is "path:line:col: error: " (the path is the fuzzed
# file, or a file it includes), never an exception and never a traceback.

TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9_]*|//|\.\.|->|\S')
NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
NUMBER = re.compile(r"\b[0-9]+\b")
NUMBERS = ("0", "-1", "99999999999", "9" * 30)
CUTS = 30
MUTATIONS = 70


def mutants(text: str, rng: random.Random) -> list[tuple[str, str]]:
    """(description, text) pairs: truncations, then token/character/number/name mutations."""
    out = [
        (f"cut at {p}", text[:p])
        for p in sorted(rng.sample(range(len(text)), min(CUTS, len(text))))
    ]
    tokens = [m.span() for m in TOKEN.finditer(text)]
    names = sorted({m.group() for m in NAME.finditer(text)})
    name_spans = [m.span() for m in NAME.finditer(text)]
    numbers = [m.span() for m in NUMBER.finditer(text)]
    kinds = [
        "delete token",
        "duplicate token",
        "swap tokens",
        "delete char",
        "duplicate char",
        "swap chars",
        "replace name",
    ] + ["replace number"] * 2 * bool(numbers)
    for _ in range(MUTATIONS):
        kind = rng.choice(kinds)
        if kind.endswith("token") or kind == "swap tokens":
            i = rng.randrange(len(tokens))
            s, e = tokens[i]
            if kind == "delete token":
                mutated = text[:s] + text[e:]
            elif kind == "duplicate token":
                mutated = text[:e] + " " + text[s:e] + text[e:]
            else:
                s2, e2 = tokens[min(i + 1, len(tokens) - 1)]
                mutated = (
                    text[:s] + text[s2:e2] + text[e:s2] + text[s:e] + text[e2:] if s2 > s else text
                )
            where = s
        elif kind.endswith("char") or kind == "swap chars":
            p = rng.randrange(len(text) - 1)
            if kind == "delete char":
                mutated = text[:p] + text[p + 1 :]
            elif kind == "duplicate char":
                mutated = text[:p] + text[p] + text[p:]
            else:
                mutated = text[:p] + text[p + 1] + text[p] + text[p + 2 :]
            where = p
        elif kind == "replace number":
            (s, e), new = rng.choice(numbers), rng.choice(NUMBERS)
            mutated, where, kind = text[:s] + new + text[e:], s, f"number -> {new}"
        else:
            (s, e), new = rng.choice(name_spans), rng.choice(names)
            mutated, where, kind = text[:s] + new + text[e:], s, f"name -> {new}"
        out.append((f"{kind} at {where}", mutated))
    return out


@pytest.fixture(scope="module")
def examples_copy(tmp_path_factory) -> Path:
    """The examples tree (includes, configs and all) copied so that relative paths hold."""
    root = tmp_path_factory.mktemp("fuzz") / "examples"
    shutil.copytree(EXAMPLES, root)
    return root


def assert_clean_outcome(code: int, out: str, err: str, path: Path, root: Path, what: str) -> None:
    assert "Traceback" not in out + err, what
    if code == ExitCode.OK:
        return
    assert code == ExitCode.BAD_INPUT, f"{what}: exit {code}\n{err}"
    assert err.strip(), f"{what}: exit 2 without a message"
    head = ERROR_HEAD.match(err)
    assert head is not None, f"{what}: error without file:line:col\n{err}"
    reported = Path(head["path"])
    assert reported == path or (reported.is_file() and root in reported.resolve().parents), (
        f"{what}\n{err}"
    )


def entry_point(source: Path, root: Path) -> Path:
    """The file to check when ``source`` is mutated: itself when it is a complete program,
    else the first top-level example that includes it (a fragment such as layouts/*.layout
    uses constants and meshes of the file that includes it)."""
    try:
        layoutlang.load(source).check()
        return source
    except layoutlang.LayoutError:
        pass
    relative = source.relative_to(root).as_posix()
    for program in sorted(root.glob("*.layout")):
        if f'include "{relative}"' in program.read_text():
            return program
    raise AssertionError(
        f"{relative} is neither a complete program nor included by a top-level example"
    )


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_fuzz_truncated_and_mutated_examples_never_crash(capsys, examples_copy, example):
    relative = example.relative_to(EXAMPLES)
    source = examples_copy / relative
    text = source.read_text()
    entry = entry_point(source, examples_copy)
    seed = int(hashlib.sha256(relative.as_posix().encode()).hexdigest()[:8], 16)  # fixed per file
    # A complete program is mutated into a new file beside it (its includes still resolve);
    # a fragment is mutated in place and checked through the program that includes it.
    path = source.with_name(f"fuzzed_{source.name}") if entry == source else source
    checked = path if entry == source else entry
    outcomes = {0: 0, 2: 0}
    try:
        for what, mutated in mutants(text, random.Random(seed)):
            path.write_text(mutated)
            code, out, err = run(capsys, "check", checked)
            assert_clean_outcome(code, out, err, checked, examples_copy, f"{relative}, {what}")
            outcomes[code] += 1
            if code == ExitCode.OK:  # a program that checks must also show
                code, out, err = run(capsys, "show", checked, "--summary")
                assert_clean_outcome(
                    code, out, err, checked, examples_copy, f"{relative}, {what}, show"
                )
                assert code == ExitCode.OK, err
    finally:
        if path == source:
            source.write_text(text)
        else:
            path.unlink(missing_ok=True)
    assert outcomes[2] > 0  # the mutations do find mistakes
    assert sum(outcomes.values()) == min(CUTS, len(text)) + MUTATIONS


SUBPROCESS_CASES = {
    "truncated": lambda text: text[: len(text) // 2],
    "huge number": lambda text: re.sub(r"tp = \d+", "tp = " + "9" * 30, text, count=1),
    "not utf-8": lambda text: text.replace("#", "# caf\udce9", 1),
}


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_fuzz_case_in_a_real_process_shows_no_traceback(examples_copy, case):
    source = examples_copy / "vllm_tp.layout"
    path = source.with_name(f"process_{case.replace(' ', '_')}.layout")
    path.write_bytes(SUBPROCESS_CASES[case](source.read_text()).encode("utf-8", "surrogateescape"))
    script = Path(sys.executable).with_name("layoutlang")  # the console script, where installed
    use_script = case == "truncated" and script.exists()
    command = [str(script)] if use_script else [sys.executable, "-m", "layoutlang.cli"]
    result = subprocess.run(
        [*command, "check", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.startswith(f"{path}:"), result.stderr
    assert ERROR_HEAD.match(result.stderr)
    assert "^" in result.stderr


def test_plan_json_gives_statistics_and_the_tensors_on_request(capsys):
    """``plan --json`` is statistics (a 30B MoE's tensor list was 2.3 MB); ``--tensors`` and
    ``--per-rank`` add the lists."""
    path = str(EXAMPLES / "refit.layout")
    program = layoutlang.load(path)
    code, out, _ = run(capsys, "plan", path, "--json")
    short = envelope(out, "plan", code)["result"]
    assert code == 0 and "tensors" not in short and "per_rank" not in short["stats"]
    assert short["tensor_count"] == len(program.tensors) and short["broadcast_tensor_count"] == 0
    code, out, _ = run(capsys, "plan", path, "--json", "--tensors", "--per-rank")
    full = envelope(out, "plan", code)["result"]
    assert [t[0] for t in full["tensors"]] == list(program.tensors)
    layouts = (program.layout("megatron"), program.layout("vllm"))
    assert set(full["stats"]["per_rank"]) == {str(r) for layout in layouts for r in layout.mesh.ranks}
    assert {k: v for k, v in full.items() if k not in ("tensors", "broadcast_tensors")} | {"stats": None} == (
        short | {"stats": None}
    )
    code, _, err = run(capsys, "plan", path, "--tensors")
    assert code == ExitCode.BAD_INPUT and "--tensors lists the tensors in the JSON output: add --json" in err


def test_a_mistyped_explain_pattern_is_named_before_the_plan_compiles(capsys, monkeypatch):
    """As show --tensor does: at once, with the nearest tensor, and nothing compiled."""
    import layoutlang.cli.plan as plan_command

    def never(*args, **kwargs):
        raise AssertionError("the plan was compiled for a pattern that matches no tensor")

    monkeypatch.setattr(plan_command, "compile_plan", never)
    typo = "model.layers.{l}.self_attn.q_prj.weight"
    code, _, err = run(capsys, "plan", EXAMPLES / "refit.layout", "--explain", typo)
    assert code == ExitCode.BAD_INPUT
    assert err.splitlines()[0] == (
        f"error: no tensor matches 'model.layers.{{l}}.self_attn.q_prj.weight' in {EXAMPLES / 'refit.layout'}"
    )
    assert "hint: did you mean 'model.layers." in err and "self_attn.q_proj.weight'?" in err


FP8 = """
mesh infer [tp = 2] on ranks 0..1
tensor "w" [256, 256] bf16
tensor "norm" [256] bf16
layout serve on infer {
    "w": tp = shard(0)
    default: replicate
    quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
"""


def test_show_says_what_a_quantized_layout_stores(capsys, tmp_path):
    """The stored dtype of each box, the scale boxes beside their weight's, and the bytes as
    stored: rank 1 holds rows 128:256 of w as fp8 (128 x 256 x 1 byte) and its 1 x 2 blocks'
    fp32 scales, and the bf16 norm whole."""
    path = tmp_path / "fp8.layout"
    path.write_text(FP8)
    code, out, _ = run(capsys, "show", path, "--rank", "1")
    assert code == 0
    table_rows = {row[1]: row for row in rows(out) if row[0] == "1"}
    assert table_rows["w"][2:] == ["[128:256, 0:256]", "w", "[0:128, 0:256]", "128x256", "fp8_e4m3"]
    assert table_rows["w_scale_inv"][2:] == ["[1:2, 0:2]", "w_scale_inv", "[0:1, 0:2]", "1x2", "fp32"]
    assert table_rows["norm"][-1] == "bf16"
    code, out, _ = run(capsys, "show", path, "--summary")
    summary = {row[0]: row for row in rows(out) if row[0].isdigit()}
    assert summary["1"][-2:] == [str(128 * 256 * 2 + 256 * 2), str(128 * 256 * 1 + 2 * 4 + 256 * 2)]
    code, out, _ = run(capsys, "show", path, "--rank", "1", "--json")
    boxes = json.loads(out)["result"]["layouts"][0]["boxes"]
    scale = next(b for b in boxes if b.get("scale_of") == "w")
    assert scale["stored_dtype"] == "fp32" and scale["offsets"] == [1, 0] and scale["sizes"] == [1, 2]


def test_plan_explain_gives_the_places_in_fused_storages(capsys):
    """examples/refit.layout: k of layer 0 lies at rows 128:160 of Megatron's linear_qkv on
    rank 0 (after its 4 query heads of 32 rows) and at rows 64:96 of vLLM's qkv_proj (after
    the 2 query heads a tp rank keeps)."""
    code, out, _ = run(capsys, "plan", EXAMPLES / "refit.layout", "--no-compare", "--explain",
                       "model.layers.0.self_attn.k_proj.weight", "--limit", "100")
    assert code == 0
    first = next(line.strip() for line in out.splitlines() if " r0 -> r4 " in line)
    assert first == (
        "model.layers.0.self_attn.k_proj.weight[0:32, 0:256] r0 -> r4 network (bucket 0, stage 0) "
        "from decoder.layers.0.self_attention.linear_qkv.weight[128:160, 0:256] "
        "into model.layers.0.self_attn.qkv_proj.weight[64:96, 0:256]"
    )


def test_check_refuses_a_reshard_that_plan_would_refuse(capsys, tmp_path):
    """Replicated per-channel scales of a TP-sharded weight: not planned, and check says so
    (it used to pass the program that plan then refused)."""
    path = tmp_path / "fp8.layout"
    path.write_text(
        "mesh train [dp = 2]\nmesh infer [tp = 2] on ranks 2..3\ntensor \"o\" [512, 512] bf16\n"
        "layout fsdp on train { default: dp = shard(0) }\n"
        'layout serve on infer {\n    "o": tp = shard(1)\n'
        '    quantize "o" as fp8_e4m3 blocks 1 x 512 scale_inv fp32 replicate\n}\n'
        "reshard refit: fsdp -> serve\n"
    )
    code, _, err = run(capsys, "check", path)
    assert code == ExitCode.BAD_INPUT
    assert f"{path}:7:5: error: tensor 'o': its scales are replicated in 'serve' but rank 2 holds 131,072" in err
    # without the reshard statement the layout itself is fine
    path.write_text(path.read_text().replace("reshard refit: fsdp -> serve\n", ""))
    assert run(capsys, "check", path)[0] == ExitCode.OK
