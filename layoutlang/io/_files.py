"""What the readers of model descriptions share: the entries they list, and JSON files.

A Hugging Face ``config.json``, a safetensors index and a safetensors header are each one
JSON object in UTF-8; every failure to read one names the file, and ``what`` it was meant
to be ("Hugging Face config").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelDescriptionError

__all__ = ["TensorEntry", "parse_json_object", "read_json_object"]

#: a logical tensor as (name, global shape, dtype short name): the fields of layoutlang.model.LogicalTensor
TensorEntry = tuple[str, tuple[int, ...], str]


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """The JSON object stored in ``file``."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise ModelDescriptionError(f"{file}: {what} not found") from None
    except OSError as exc:
        raise ModelDescriptionError(f"{file}: cannot read {what}: {exc.strerror}") from None
    return parse_json_object(file, raw, what)


def parse_json_object(file: Path, raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object ``raw`` (read from ``file``) holds."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDescriptionError(f"{file}: {what} is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelDescriptionError(
            f"{file}: {what} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(value, dict):
        raise ModelDescriptionError(f"{file}: {what} must be a JSON object, not {type(value).__name__}")
    return value
