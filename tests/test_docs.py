"""The documentation cannot rot: its examples are checked and its printed outputs re-made.

- (a) every ``docs/snippets/*.layout`` passes ``layoutlang check``; every
  ``docs/snippets/errors/*.layout`` (deliberately wrong) fails with exit status 2;
- (b) every ``docs/snippets/outputs/**.txt`` is a console session that a page shows with
  ``literalinclude``: its first line is the command (``$ layoutlang ...``), the rest is what
  the command printed (stdout and stderr, interleaved as on a terminal). The test runs the
  command again, in-process, and compares. Where the command runs depends on the folder:

  ==================================  ===================  =============
  outputs file                        working directory    exit status
  ==================================  ===================  =============
  ``outputs/*.txt``                   ``docs/snippets``    0
  ``outputs/errors/*.txt``            ``docs/snippets``    2
  ``outputs/examples/*.txt``          the repository root  0
  ==================================  ===================  =============

- (c) ``sphinx-build -W --keep-going -b html`` and ``-b doctest`` succeed;
- (d) the ``layout`` Pygments lexer of the docs reads every snippet and example without an
  error token, and every snippet, output file, example run (``.out``) and example script
  (``.py``) in ``docs/snippets`` is shown by some page.

After a deliberate change of the language or of the CLI's output, re-make the outputs with
``python tests/test_docs.py --update`` and read the diff. To add an output, create the
``.txt`` file with just its ``$ layoutlang ...`` line and run the update.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
OUTPUTS = SNIPPETS / "outputs"
PROMPT = "$ layoutlang "


# ----------------------------------------------------------------------- helpers


def run_cli(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``layoutlang ARGV`` in-process in ``cwd``: (exit status, stdout and stderr interleaved)."""
    from layoutlang.cli import main

    buffer = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                status = main(argv)
            except SystemExit as exit_:  # argparse errors, --help, --version
                status = exit_.code if isinstance(exit_.code, int) else 2
    finally:
        os.chdir(previous)
    return int(status), buffer.getvalue()


def output_files() -> list[Path]:
    return sorted(OUTPUTS.rglob("*.txt"))


def session_of(path: Path) -> tuple[list[str], Path, int, str]:
    """(argv, working directory, expected exit status, expected output) of an outputs file."""
    text = path.read_text("utf-8")
    first, _, expected = text.partition("\n")
    if not first.startswith(PROMPT):
        raise ValueError(f"{path}: the first line must be the command, starting with {PROMPT!r}")
    relative = path.relative_to(OUTPUTS).parts
    cwd = ROOT if relative[0] == "examples" else SNIPPETS
    status = 2 if relative[0] == "errors" else 0
    return shlex.split(first[len(PROMPT) :]), cwd, status, expected


def _id(path: Path) -> str:
    return str(path.relative_to(SNIPPETS))


# ------------------------------------------------------------ (a) snippets check


GOOD = sorted(SNIPPETS.glob("*.layout"))
BAD = sorted((SNIPPETS / "errors").glob("*.layout"))


def test_snippets_exist():
    assert len(GOOD) >= 10 and len(BAD) >= 3


@pytest.mark.parametrize("path", GOOD, ids=_id)
def test_snippet_checks(path):
    status, text = run_cli(["check", path.name], SNIPPETS)
    assert status == 0, text
    assert text.startswith(f"{path.name}: ok ("), text


@pytest.mark.parametrize("path", BAD, ids=_id)
def test_error_snippet_fails(path):
    status, text = run_cli(["check", f"errors/{path.name}"], SNIPPETS)
    assert status == 2, text
    assert ": error: " in text and "Traceback" not in text, text


# ------------------------------------------------------------ (b) outputs re-made


@pytest.mark.parametrize("path", output_files(), ids=_id)
def test_output_is_current(path):
    argv, cwd, expected_status, expected = session_of(path)
    status, text = run_cli(argv, cwd)
    assert status == expected_status, text
    assert text == expected, (
        f"the output of `layoutlang {shlex.join(argv)}` changed; if that is intended, run "
        f"`python tests/test_docs.py --update` and review the diff"
    )


def update_outputs() -> None:
    """Re-run every outputs file's command and store what it prints."""
    for path in output_files():
        argv, cwd, expected_status, _ = session_of(path)
        status, text = run_cli(argv, cwd)
        if status != expected_status:
            print(f"{_id(path)}: exit status {status}, expected {expected_status}:\n{text}")
        first = path.read_text("utf-8").partition("\n")[0]
        path.write_text(f"{first}\n{text}", "utf-8")
        print(f"updated {_id(path)}")


# --------------------------------------------------------------- (c) the builds


def _sphinx(builder: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", *extra, "-b", builder, "-q", "-E",
         "-d", str(out / "doctrees"), str(DOCS), str(out / builder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip


def test_html_build(tmp_path):
    result = _sphinx("html", tmp_path, "--keep-going")
    assert result.returncode == 0, result.stdout + result.stderr
    built = tmp_path / "html"
    for page in ("index", "tutorials/first-layout", "guides/engine-layouts", "reference/language",
                 "reference/cli", "reference/api"):  # fmt: skip
        assert (built / f"{page}.html").is_file(), page
    cli = (built / "reference" / "cli.html").read_text("utf-8")
    assert "--summary" in cli and "BAD_INPUT" in cli  # generated from build_parser() and ExitCode


_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+:.])\1+$")


def _source_headings(text: str) -> list[str]:
    """The section titles of a reStructuredText page: an unindented line whose next line is an
    underline at least as long (inline markup reduced to its text)."""
    lines = text.splitlines()
    titles = []
    for title, under in itertools.pairwise(lines):
        heading = title.strip() and not title[0].isspace() and not _UNDERLINE.match(title)
        if heading and _UNDERLINE.match(under) and len(under) >= len(title.rstrip()):
            titles.append(re.sub(r":\w+:`~?([^`<]*?)\s*(<[^>]*>)?`|``?([^`]*)``?", r"\1\3", title.strip()))
    return titles


def _html_headings(page: str) -> set[str]:
    import html

    found = re.findall(r"<h[1-6][^>]*>(.*?)</h[1-6]>", page, re.S)
    texts = (html.unescape(re.sub(r"<[^>]+>", "", h)).replace("\u00b6", "") for h in found)
    # Sphinx curls the quotes of a title
    return {" ".join(t.translate(_PLAIN_QUOTES).split()) for t in texts}


_PLAIN_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def test_every_section_heading_renders(tmp_path):
    """A title that reStructuredText reads as a paragraph (no blank line before it) builds
    without a warning: compare every page's source titles with its built headings."""
    result = _sphinx("html", tmp_path, "--keep-going")
    assert result.returncode == 0, result.stdout + result.stderr
    missing = []
    for source in sorted(DOCS.rglob("*.rst")):
        relative = source.relative_to(DOCS)
        if relative.parts[0].startswith("_"):
            continue
        built = tmp_path / "html" / relative.with_suffix(".html")
        headings = _html_headings(built.read_text("utf-8"))
        missing += [f"{relative}: {t}" for t in _source_headings(source.read_text("utf-8"))
                    if " ".join(t.split()) not in headings]
    assert missing == []


def test_the_heading_check_finds_a_title_glued_to_its_paragraph():
    text = "Intro\n=====\n\nSome text.\nLimits\n------\n\n- one\n"
    assert _source_headings(text) == ["Intro", "Limits"]
    assert _html_headings("<h1>Intro<a class='headerlink'>\u00b6</a></h1><p>Some text.\nLimits</p>") == {"Intro"}


def test_doctest_build(tmp_path):
    result = _sphinx("doctest", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "doctest" / "output.txt").read_text("utf-8")
    assert "0 failures in tests" in report, report
    tests = [int(n) for n in re.findall(r"^\s*(\d+) tests?\b", report, re.M)]
    assert sum(tests) >= 5, report


# -------------------------------------------------------- (d) lexer and coverage


def _lexer():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from layout_lexer import LayoutLexer
    finally:
        sys.path.pop(0)
    return LayoutLexer()


LEXED = sorted(SNIPPETS.rglob("*.layout")) + sorted((ROOT / "examples").rglob("*.layout"))


@pytest.mark.parametrize("path", LEXED, ids=lambda p: str(p.relative_to(ROOT)))
def test_lexer_reads_every_layout_file(path):
    from pygments.token import Error

    text = path.read_text("utf-8")
    tokens = list(_lexer().get_tokens(text))
    errors = [value for token, value in tokens if token in Error]
    assert not errors, f"{path}: the layout lexer cannot read {errors[:5]}"
    assert "".join(value for _, value in tokens).rstrip("\n") == text.rstrip("\n")


def test_lexer_token_kinds():
    from pygments.token import Comment, Keyword, Number, Operator, String

    text = 'mesh m [tp = 1_024] on ranks 0..3  # c\nlayout l on m { "a.{l}.*": tp = shard(0, pad = 64) }\n'
    tokens = [(t, v) for t, v in _lexer().get_tokens(text) if v.strip()]
    kinds = {v: t for t, v in tokens}
    assert kinds["mesh"] in Keyword and kinds["on"] in Keyword
    assert kinds["1_024"] in Number and kinds["0"] in Number and kinds[".."] in Operator
    assert kinds["# c"] in Comment
    assert kinds["{l}"] in String.Interpol and kinds["*"] in String


def test_every_snippet_and_output_is_shown():
    pages = "\n".join(p.read_text("utf-8") for p in DOCS.rglob("*.rst"))
    shown = {Path(m).name for m in re.findall(r"literalinclude:: (\S+)", pages)}
    files = [p for p in SNIPPETS.rglob("*") if p.suffix in {".layout", ".txt", ".out", ".py"}]
    missing = sorted(_id(p) for p in files if p.name not in shown and "models" not in p.parts)
    assert not missing, f"snippets no page shows: {missing}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update_outputs()
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))
