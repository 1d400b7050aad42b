"""Plans on disk: reading back the binary form :meth:`Plan.to_bytes` writes.

A plan file is only trusted for the program it was compiled from: the layouts' digests are
compared, the moves validated, and the header's derived totals recomputed. A pairwise plan's
header says so (``mode``), and a per-rank plan's whose part it holds (``rank``): it is read
back as that kind of plan and validated as one, and refused where it does not fit (another
rank's part, another mode than the caller asks for).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from .._text import rank_ranges
from ..errors import LayoutValueError
from ..model import Program
from .compile import plan_layouts
from .data import _COLUMNS, _MAGIC, PLAN_MODES, Plan, layout_digest, plan_arrays

__all__ = ["load_plan"]


def load_plan(data: bytes, program: Program, *, rank: int | None = None, mode: str | None = None) -> Plan:
    """Reads a plan written by :meth:`Plan.to_bytes` for ``program``; it must describe the
    same layouts (their digests are compared), and it is validated.

    A pairwise or per-rank plan comes back as one (:attr:`Plan.mode`, :attr:`Plan.rank`
    from its header), validated as that kind of plan. ``rank`` is the rank that will run
    the plan: a per-rank plan of another rank is refused, and so is a plan whose meshes do
    not hold ``rank``. ``mode`` (:data:`~layoutlang.plan.data.PLAN_MODES`, or
    ``"per-rank"``: a pairwise plan of one rank) refuses a plan of another kind."""
    if mode is not None and mode not in (*PLAN_MODES, "per-rank"):
        raise LayoutValueError(f"unknown plan mode '{mode}' (one of: {', '.join((*PLAN_MODES, 'per-rank'))})")
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
        plan = _from_header(header, columns, program)
    except (KeyError, TypeError, IndexError) as err:
        raise LayoutValueError(f"the plan file is damaged (its header lacks or garbles {err})") from None
    _check_fit(plan, rank, mode)
    return plan


def _kind(plan: Plan) -> str:
    """How a refusal names a plan: whose part, or which mode."""
    if plan.rank is not None:
        return f"rank {plan.rank}'s part of the pairwise plan"
    return "the whole fleet's plan" if plan.mode == "fleet" else "the whole pairwise plan"


def _check_fit(plan: Plan, rank: int | None, mode: str | None) -> None:
    """Refuse a plan that is not the kind the caller runs: another rank's part, a rank in
    neither mesh, another mode."""
    if mode is not None:
        kind = "per-rank" if plan.rank is not None else plan.mode
        if kind != mode:
            wanted = {"fleet": "a fleet plan", "pairwise": "a whole pairwise plan", "per-rank": "a per-rank plan"}
            raise LayoutValueError(f"the plan file holds {_kind(plan)} of '{plan.name}', not {wanted[mode]}")
    if rank is None:
        return
    if plan.rank is not None and plan.rank != rank:
        raise LayoutValueError(
            f"the plan file holds {_kind(plan)} of '{plan.name}', not rank {rank}'s: each rank runs its own part"
        )
    if rank not in plan.source.mesh and rank not in plan.destination.mesh:
        raise LayoutValueError(
            f"rank {rank} belongs to neither mesh of plan '{plan.name}' ('{plan.source.name}': ranks "
            f"{rank_ranges(plan.source.mesh.ranks)}, '{plan.destination.name}': ranks "
            f"{rank_ranges(plan.destination.mesh.ranks)})"
        )


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
    mode = header.get("mode", "fleet")  # a fleet plan's header has no mode (as before modes existed)
    if mode not in PLAN_MODES:
        raise LayoutValueError(f"the plan file is damaged: unknown plan mode {mode!r}")
    part = header.get("rank")
    if part is not None and (mode != "pairwise" or not isinstance(part, int) or isinstance(part, bool)):
        raise LayoutValueError(f"the plan file is damaged: a per-rank plan of rank {part!r} in mode {mode!r}")
    if part is not None and part not in source.mesh and part not in destination.mesh:
        raise LayoutValueError(
            f"the plan file holds the part of rank {part}, which belongs to neither mesh of "
            f"'{source.name}' -> '{destination.name}'"
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
        mode=mode,
        rank=part,
        quantize_at=_quantize_at(header),
    )
    plan.validate()  # a pairwise plan as one; a per-rank plan as its rank's part
    # The header's totals are derived data: recompute them rather than trust them (a per-rank
    # plan's are its rank's, recomputed from that rank's part alone).
    check = plan_layouts(
        source,
        destination,
        name=plan.name,
        domain_size=plan.domain_size,
        bucket_bytes=plan.bucket_bytes,
        policies=policies,
        mode=mode,
        rank=part,
    )
    for field in ("lower_bound_bytes", "broadcast_payload_bytes"):
        if header[field] != int(getattr(check.arrays, field)):
            raise LayoutValueError(f"the plan file is damaged: its {field} does not match the program")
    # The bucket count follows from the moves (a plan may be cut into buckets of its own).
    if header["num_buckets"] != (int(np.max(columns["move_bucket"])) + 1 if columns["move_bucket"].size else 0):
        raise LayoutValueError("the plan file is damaged: its num_buckets does not match its moves")
    return plan


def _quantize_at(header: dict[str, Any]) -> str:
    """Where the plan quantizes (a header without the key: the senders, as before the choice)."""
    at = header.get("quantize_at", "source")
    if at not in ("source", "destination"):  # a plan holds the side chosen, never "auto"
        raise LayoutValueError(f"the plan file is damaged: unknown quantize_at {at!r}")
    return at
