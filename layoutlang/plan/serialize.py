"""Plans on disk: reading back the binary form :meth:`Plan.to_bytes` writes.

A plan file is only trusted for the program it was compiled from: the layouts' digests are
compared, the moves validated, and the header's derived totals recomputed.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LayoutValueError
from ..model import Program
from .compile import plan_layouts
from .data import _COLUMNS, _MAGIC, Plan, layout_digest, plan_arrays

__all__ = ["load_plan"]


def load_plan(data: bytes, program: Program) -> Plan:
    """Reads a plan written by :meth:`Plan.to_bytes` for ``program``; it must describe the
    same layouts (their digests are compared), and it is validated."""
    if not data.startswith(_MAGIC):
        raise LayoutValueError("not a layoutlang plan (bad magic bytes)")
    try:
        pos = len(_MAGIC)
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        header = json.loads(data[pos : pos + length])
        pos += length
        columns: dict[str, npt.NDArray[Any]] = {}
        for name, dtype in _COLUMNS:
            (count,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            size = count * np.dtype(dtype).itemsize
            if pos + size > len(data):
                raise ValueError("truncated")
            little = np.dtype(dtype).newbyteorder("<")
            columns[name] = np.frombuffer(data, dtype=little, count=count, offset=pos).astype(dtype)
            pos += size
    except (struct.error, ValueError, json.JSONDecodeError) as err:
        raise LayoutValueError(f"the plan file is damaged ({err})") from None
    try:
        return _from_header(header, columns, program)
    except (KeyError, TypeError, IndexError) as err:
        raise LayoutValueError(f"the plan file is damaged (its header lacks or garbles {err})") from None


def _from_header(header: dict[str, Any], columns: dict[str, npt.NDArray[Any]], program: Program) -> Plan:
    if "recovery_sources" in header:
        raise LayoutValueError(
            "this is a recovery plan (sources "
            + ", ".join(repr(n) for n in header["recovery_sources"])
            + f", lost ranks {header['lost']}): survivors compile recovery plans themselves "
            "from the agreed layouts; they are not read back from files"
        )
    source = program.layout(header["source"])
    destination = program.layout(header["destination"])
    for side, layout in (("source", source), ("destination", destination)):
        if header[f"{side}_digest"] != layout_digest(layout):
            raise LayoutValueError(
                f"the plan was compiled for a different {side} layout '{layout.name}' than {program.path} declares"
            )
    arrays = plan_arrays(
        columns,
        num_buckets=header["num_buckets"],
        lower_bound_bytes=header["lower_bound_bytes"],
        broadcast_payload_bytes=header["broadcast_payload_bytes"],
    )
    broadcast = set(header["broadcast_tensors"])
    policies = tuple("broadcast" if i in broadcast else "reshard" for i in range(len(header["tensors"])))
    plan = Plan(
        source,
        destination,
        header["reshard"],
        policies,
        header["domain_size"],
        header["bucket_bytes"],
        arrays,
    )
    plan.validate()
    # The header's totals are derived data: recompute them rather than trust them.
    check = plan_layouts(
        source,
        destination,
        name=plan.name,
        domain_size=plan.domain_size,
        bucket_bytes=plan.bucket_bytes,
        policies=policies,
    )
    for field in ("lower_bound_bytes", "broadcast_payload_bytes"):
        if header[field] != int(getattr(check.arrays, field)):
            raise LayoutValueError(f"the plan file is damaged: its {field} does not match the program")
    # The bucket count follows from the moves (a plan may be cut into buckets of its own).
    if header["num_buckets"] != (int(np.max(columns["move_bucket"])) + 1 if columns["move_bucket"].size else 0):
        raise LayoutValueError("the plan file is damaged: its num_buckets does not match its moves")
    return plan
