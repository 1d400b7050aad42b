"""Every command's ``--json`` is the one envelope of ``layoutlang/cli/output.schema.json``.

Each command runs in a process of its own (``python -m layoutlang.cli``) on real inputs,
succeeding and failing (a malformed program, a missing file, a bad option, a machine
without NCCL under ``doctor --strict``); its standard output must be exactly one JSON
object that the schema accepts, whose ``ok`` and ``exit_code`` are the process's exit
status, and its standard error nothing but progress lines. The schema is checked by a
small validator of the keywords it uses (no dependency), and also by ``jsonschema`` where
that happens to be installed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from layoutlang.cli import ExitCode, main
from layoutlang.cli import check as check_command
from layoutlang.cli.json_output import SCHEMA_VERSION, envelope, schema
from layoutlang.cli.main import COMMANDS, build_parser
from layoutlang.errors import ExecutionError

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TP_TO_DP = str(EXAMPLES / "tp_to_dp.layout")
SCHEMA = schema()


# ---------------------------------------------------------------- a small validator


def problems(instance: Any, node: dict[str, Any], where: str = "$") -> list[str]:
    """Where ``instance`` breaks ``node``, for the keywords of JSON Schema (2020-12) the
    envelope's schema uses; an unknown keyword is a failure, so the schema cannot grow past
    what this checks."""
    found: list[str] = []
    for key, want in node.items():
        if key in ("$schema", "$defs", "title", "description"):
            continue
        if key == "$ref":
            assert want.startswith("#/$defs/"), want
            found += problems(instance, SCHEMA["$defs"][want.removeprefix("#/$defs/")], where)
        elif key == "type":
            kinds = want if isinstance(want, list) else [want]
            if not any(_is(instance, k) for k in kinds):
                found.append(f"{where}: {instance!r} is not of type {want}")
        elif key == "const":
            if not _same(instance, want):
                found.append(f"{where}: {instance!r} is not {want!r}")
        elif key == "enum":
            if not any(_same(instance, v) for v in want):
                found.append(f"{where}: {instance!r} is not one of {want}")
        elif key == "pattern":
            if isinstance(instance, str) and not re.search(want, instance):
                found.append(f"{where}: {instance!r} does not match {want}")
        elif key == "minimum":
            if _is(instance, "number") and instance < want:
                found.append(f"{where}: {instance} < {want}")
        elif key in ("minItems", "maxItems"):
            if isinstance(instance, list) and (len(instance) < want if key == "minItems" else len(instance) > want):
                found.append(f"{where}: {len(instance)} items breaks {key} {want}")
        elif key == "items":
            if isinstance(instance, list):
                for i, item in enumerate(instance):
                    found += problems(item, want, f"{where}[{i}]")
        elif key == "required":
            if isinstance(instance, dict):
                found += [f"{where}: no {name!r}" for name in want if name not in instance]
        elif key == "properties":
            if isinstance(instance, dict):
                for name, sub in want.items():
                    if name in instance:
                        found += problems(instance[name], sub, f"{where}.{name}")
        elif key == "additionalProperties":
            if isinstance(instance, dict):
                extra = [k for k in instance if k not in node.get("properties", {})]
                if want is False:
                    found += [f"{where}: unexpected {k!r}" for k in extra]
                elif isinstance(want, dict):
                    for k in extra:
                        found += problems(instance[k], want, f"{where}.{k}")
        elif key == "oneOf":
            matching = [i for i, sub in enumerate(want) if not problems(instance, sub, where)]
            if len(matching) != 1:
                found.append(f"{where}: matches {len(matching)} of the oneOf schemas, not exactly one")
        else:
            raise AssertionError(f"the validator does not know the keyword {key!r}: teach it, or drop the keyword")
    return found


def _is(value: Any, kind: str) -> bool:
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
    }[kind]


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def validate(data: Any) -> None:
    found = problems(data, SCHEMA)
    assert not found, "\n".join(found)
    try:
        import jsonschema
    except ImportError:  # not a dependency: the validator above is the check
        return
    jsonschema.Draft202012Validator(SCHEMA).validate(data)


# ------------------------------------------------------------------------ running


def layoutlang(*argv: str, timeout: float = 100) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """``layoutlang ARGV`` in a process of its own: its envelope, checked, and the process."""
    done = subprocess.run(
        [sys.executable, "-m", "layoutlang.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    try:
        data = json.loads(done.stdout)  # the whole of stdout: one object, nothing beside it
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    validate(data)
    assert data["exit_code"] == done.returncode and data["ok"] is (done.returncode == 0)
    for line in done.stderr.splitlines():  # only progress lines
        assert "progress" in json.loads(line), line
    return data, done


@pytest.fixture(scope="module")
def applied() -> dict[str, Any]:
    """One ``apply --json`` that succeeds (local worker processes: the slow one)."""
    data, _ = layoutlang("apply", TP_TO_DP, "--compare", "--json", timeout=280)
    return data


@pytest.fixture
def malformed(tmp_path: Path) -> str:
    path = tmp_path / "malformed.layout"
    path.write_text("mesh train [tp = 2] on ranks 0..1\nlayout a on train {\n")
    return str(path)


# -------------------------------------------------------------------- the schema


def test_the_schema_is_draft_2020_12_and_names_every_command():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert SCHEMA["properties"]["command"]["enum"] == [*COMMANDS, None]
    assert SCHEMA["properties"]["exit_code"]["enum"] == [int(code) for code in ExitCode]
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_every_command_with_json_is_tested_here():
    """A new command (or a new --json) must add its runs below."""
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    with_json = {name for name, sub in commands.choices.items() if "--json" in sub._option_string_actions}
    assert with_json == set(SUCCEEDS) | {"apply"}


def test_the_validator_refuses_what_the_schema_refuses():
    good = envelope("plan", ExitCode.OK, {"stats": {}})
    assert problems(good, SCHEMA) == []
    bad = [
        good | {"ok": False},  # ok without a failure
        good | {"exit_code": 4},
        good | {"command": "nope"},
        good | {"extra": 1},
        {k: v for k, v in good.items() if k != "errors"},
        good | {"errors": [{"error": "name", "message": "x"}]},  # ok with errors
        good | {"ok": False, "exit_code": 2},  # a failure without errors
        good | {"ok": False, "exit_code": 2, "errors": [{"error": "Name!", "message": "x"}]},
        good | {"ok": False, "exit_code": 2, "errors": [{"error": "name"}]},
        good | {"ok": False, "exit_code": 2, "errors": [{"error": "name", "message": "x", "line": 0}]},
        good | {"ok": 1},
        good | {"result": []},
    ]
    for data in bad:
        assert problems(data, SCHEMA), data
    with pytest.raises(ValueError, match="a failure has errors"):
        envelope("plan", ExitCode.BAD_INPUT)
    with pytest.raises(ValueError, match="a success none"):
        envelope("plan", ExitCode.OK, {}, [{"error": "name", "message": "x"}])


# -------------------------------------------------------------------- successes

SUCCEEDS = {
    "check": [["check", *sorted(str(p) for p in EXAMPLES.glob("*.layout")), "--json"]],
    "show": [["show", TP_TO_DP, "--json"], ["show", TP_TO_DP, "--summary", "--rank", "0", "--json"]],
    "plan": [["plan", TP_TO_DP, "--json", "--explain", "--per-rank"], ["plan", TP_TO_DP, "--rank", "8", "--json"]],
    "simulate": [["simulate", TP_TO_DP, "--json"]],
    "doctor": [["doctor", "--json"]],
}


@pytest.mark.parametrize(
    "argv", [argv for runs in SUCCEEDS.values() for argv in runs], ids=lambda argv: " ".join(argv[:1] + argv[2:])
)
def test_a_success_is_the_envelope_with_its_result(argv):
    data, done = layoutlang(*argv)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert (data["command"], data["ok"], data["errors"]) == (argv[0], True, [])
    assert isinstance(data["result"], dict) and data["result"]


def test_check_result_lists_every_file():
    argv = SUCCEEDS["check"][0]
    data, _ = layoutlang(*argv)
    assert [f["file"] for f in data["result"]["files"]] == argv[1:-1]


@pytest.mark.timeout(300)
def test_apply_success_is_the_envelope_with_the_report(applied):
    assert (applied["command"], applied["ok"], applied["exit_code"], applied["errors"]) == ("apply", True, 0, [])
    report = applied["result"]
    assert report["ok"] and report["ranks"] == 6
    assert set(report["runs"]) == {"reshard", "broadcast"}
    assert all(run["mismatches"] == [] and run["verified_bytes"] > 0 for run in report["runs"].values())


# --------------------------------------------------------------------- failures

FAILS = [
    # (argv with {malformed} and {missing}, exit code, error kind)
    (["check", "{malformed}", TP_TO_DP, "--json"], ExitCode.BAD_INPUT, "syntax"),
    (["check", "{missing}", "--json"], ExitCode.BAD_INPUT, "file"),
    (["show", "{malformed}", "--json"], ExitCode.BAD_INPUT, "syntax"),
    (["show", TP_TO_DP, "--layout", "nope", "--json"], ExitCode.BAD_INPUT, "name"),
    (["plan", "{missing}", "--json"], ExitCode.BAD_INPUT, "file"),
    (["plan", TP_TO_DP, "--json", "--bucket-size", "nan"], ExitCode.BAD_INPUT, "usage"),
    (["simulate", "{malformed}", "--json"], ExitCode.BAD_INPUT, "syntax"),
    (["simulate", TP_TO_DP, "--json", "--topology", "nope"], ExitCode.BAD_INPUT, "name"),
    (["simulate", TP_TO_DP, "--json", "--mode", "nope"], ExitCode.BAD_INPUT, "usage"),
    (["apply", "{missing}", "--json"], ExitCode.BAD_INPUT, "file"),
    (["apply", "{malformed}", "--json"], ExitCode.BAD_INPUT, "syntax"),
    (["apply", TP_TO_DP, "--json", "--timeout", "nan"], ExitCode.BAD_INPUT, "usage"),
    (["doctor", "--json", "--strict", "--nccl-library", "{missing}"], ExitCode.FAILURE, "missing"),
    (["viz", TP_TO_DP, "--json"], ExitCode.BAD_INPUT, "usage"),  # viz takes no --json: said in JSON
    (["--json"], ExitCode.BAD_INPUT, "usage"),  # no command
]


@pytest.mark.parametrize(("argv", "code", "kind"), FAILS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_failure_is_the_envelope_with_its_errors(argv, code, kind, malformed, tmp_path):
    missing = str(tmp_path / "missing.layout")
    argv = [a.format(malformed=malformed, missing=missing) for a in argv]
    data, done = layoutlang(*argv)
    assert done.returncode == code, done.stdout + done.stderr
    assert data["ok"] is False and data["exit_code"] == code
    assert data["command"] == (argv[0] if argv[0] in COMMANDS else None)
    assert kind in [e["error"] for e in data["errors"]], data["errors"]
    if argv[0] != "check" and kind != "missing":  # what check and doctor found stays their result
        assert data["result"] is None


def test_a_syntax_error_has_its_place(malformed):
    data, _ = layoutlang("check", malformed, "--json")
    (error,) = data["errors"]
    assert (error["file"], error["line"]) == (malformed, 2) and error["column"] >= 1
    (entry,) = data["result"]["files"]
    assert (entry["file"], entry["ok"]) == (malformed, False)


def test_a_usage_error_names_the_option_and_the_usage():
    data, _ = layoutlang("apply", TP_TO_DP, "--json", "--timeout", "nan")
    (error,) = data["errors"]
    assert error["message"].startswith("argument --timeout") and error["usage"].startswith("usage: layoutlang apply")


def test_without_json_a_usage_error_is_argparse_text(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", TP_TO_DP, "--bucket-size", "nan"])
    assert exit_.value.code == ExitCode.BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: layoutlang plan") and "layoutlang plan: error: argument" in err


@pytest.mark.parametrize(
    ("raised", "code", "kind"),
    [
        (ExecutionError("rank 3: a peer died", rank=3, peers=[1]), ExitCode.FAILURE, "execution"),
        (RuntimeError("simulated bug"), ExitCode.INTERNAL, "internal"),
        (KeyboardInterrupt(), ExitCode.FAILURE, "interrupted"),
    ],
)
def test_a_failure_at_run_time_and_a_bug_are_the_envelope_too(capsys, monkeypatch, raised, code, kind):
    def load(path, *, allow_outside_includes=False):
        raise raised

    monkeypatch.setattr(check_command, "load", load)
    assert main(["check", TP_TO_DP, "--json"]) == code
    out, err = capsys.readouterr()
    data = json.loads(out)
    validate(data)
    assert err == "" and data["exit_code"] == code and data["result"] is None
    (error,) = data["errors"]
    assert error["error"] == kind


def test_an_apply_whose_verification_fails_reports_mismatches_as_errors():
    """The errors ``apply`` derives from a report that is not ok (run in-process from a
    summary: a real mismatch needs a corrupted transfer)."""
    from layoutlang.cli import apply_job, elastic_job

    run = {"mismatches": ["w[0:4]: 3 elements differ"], "verified_bytes": 48}
    summary = {"ranks": 2, "runs": {"reshard": run}, "ok": False}
    data = envelope("apply", ExitCode.FAILURE, summary, apply_job.failures(summary))
    validate(data)
    assert data["errors"][0]["error"] == "mismatch" and "w[0:4]" in data["errors"][0]["message"]
    elastic = {"ok": False, "steps": [{"step": 0, "mismatches": []}], "joined": {}, "errors": {}}
    (error,) = elastic_job.failures(elastic, steps=3)
    assert error == {"error": "failure", "message": "1 of 3 refits were committed"}
    elastic["errors"] = {"5": {"kind": "loss", "message": "error: region lost"}}
    (error,) = elastic_job.failures(elastic, steps=3)
    assert error == {"error": "loss", "message": "error: region lost", "rank": 5}
