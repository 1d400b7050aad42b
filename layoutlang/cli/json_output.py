"""The one JSON envelope every command prints with ``--json``.

With ``--json`` a command prints exactly one JSON object on standard output, whether it
succeeded or failed, and nothing else there::

    {
      "schema_version": 1,
      "command": "plan",
      "ok": true,
      "exit_code": 0,
      "errors": [],
      "result": {...}
    }

``ok`` is true exactly when ``exit_code`` (the process's exit status, an
:class:`~layoutlang.errors.ExitCode`) is 0; then ``errors`` is empty. Otherwise ``errors``
holds at least one error object (``error``: its kind, ``message``, and the error's typed
fields: ``file``, ``line``, ``column``... as :meth:`LayoutError.to_json
<layoutlang.errors.LayoutError.to_json>` and :meth:`RuntimeFailure.to_json
<layoutlang.errors.RuntimeFailure.to_json>` give them), and ``result`` is what the command
had found (``check``: every file's verdict; ``apply``: the report of a run whose
verification failed) or null. Standard error carries only progress lines (one JSON object
a line, :class:`~.progress.Progress`) and, with ``-v``, log lines.

The JSON Schema of the envelope is package data beside this module
(``output.schema.json``, :func:`schema`); every command builds its output with
:func:`emit`, so the shape is written once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from importlib import resources
from typing import Any

from ..errors import ExitCode, LayoutError, RuntimeFailure

__all__ = ["SCHEMA_VERSION", "emit", "envelope", "error_json", "schema"]

#: the envelope's version (``schema_version``): a change that breaks a reader raises it
SCHEMA_VERSION = 1


@functools.cache
def _schema_text() -> str:
    return resources.files(__package__).joinpath("output.schema.json").read_text("utf-8")


def schema() -> dict[str, Any]:
    """The envelope's JSON Schema (draft 2020-12), as shipped in the package."""
    return json.loads(_schema_text())


def error_json(kind: str, message: str, **fields: Any) -> dict[str, Any]:
    """An error object of the envelope that no exception carries (a usage error, a
    verification's mismatches, what ``doctor --strict`` found missing)."""
    return {"error": kind, "message": message, **{k: v for k, v in fields.items() if v is not None}}


def envelope(
    command: str | None,
    exit_code: int = ExitCode.OK,
    result: dict[str, Any] | None = None,
    errors: Iterable[dict[str, Any] | LayoutError | RuntimeFailure] = (),
) -> dict[str, Any]:
    """The envelope of ``command``'s output: ``ok`` follows ``exit_code``; ``errors`` (error
    objects, or the errors themselves) must be empty exactly when the command succeeded."""
    code = ExitCode(exit_code)
    listed = [e.to_json() if isinstance(e, (LayoutError, RuntimeFailure)) else e for e in errors]
    if (code == ExitCode.OK) == bool(listed):
        raise ValueError(f"exit code {code.name} with {len(listed)} errors: a failure has errors, a success none")
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "ok": code == ExitCode.OK,
        "exit_code": int(code),
        "errors": listed,
        "result": result,
    }


def emit(
    command: str | None,
    result: dict[str, Any] | None = None,
    exit_code: int = ExitCode.OK,
    errors: Iterable[dict[str, Any] | LayoutError | RuntimeFailure] = (),
) -> int:
    """Print the envelope on standard output (the command's only output there); returns
    ``exit_code``, for ``return emit(...)``."""
    print(json.dumps(envelope(command, exit_code, result, errors), indent=2), flush=True)
    return int(exit_code)
