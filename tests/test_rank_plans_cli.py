"""Per-rank plans where a user meets plans: plan files read back (``load_plan``), ``layoutlang
apply --plan-mode``, ``layoutlang simulate --mode pairwise``, and the command line's refusals
of combinations that have no per-rank plan.

Oracles: a plan read back must be the plan written (every column, the fingerprint); the moves
of one rank's part are the whole pairwise plan's moves that send or receive on it; apply's
verified bytes are counted from the destination layout's boxes, and every destination byte
is compared with the synthetic source of truth by the workers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.errors import ExecutionError, LayoutValueError
from layoutlang.plan import compile_plan, load_plan
from layoutlang.plan.data import _COLUMNS, _MAGIC

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def program_of(name: str) -> layoutlang.Program:
    return layoutlang.load(EXAMPLES / f"{name}.layout")


def participants(program: layoutlang.Program) -> list[int]:
    statement = program.reshard()
    source, destination = program.layout(statement.source), program.layout(statement.destination)
    return sorted(set(source.mesh.ranks) | set(destination.mesh.ranks))


def with_header(data: bytes, change) -> bytes:
    """The plan file ``data`` with its JSON header passed through ``change`` (a dict -> dict),
    its length prefix rewritten: a file damaged (or forged) in its header alone."""
    at = len(_MAGIC)
    (length,) = struct.unpack_from("<Q", data, at)
    header = json.loads(data[at + 8 : at + 8 + length])
    text = json.dumps(change(header), sort_keys=True, separators=(",", ":")).encode()
    return data[:at] + struct.pack("<Q", len(text)) + text + data[at + 8 + length :]


def columns_equal(a: layoutlang.Plan, b: layoutlang.Plan) -> bool:
    return all(np.array_equal(getattr(a.arrays, name), getattr(b.arrays, name)) for name, _ in _COLUMNS)


# ---------------------------------------------------------------------- plan files


@pytest.mark.parametrize("name, bucket_bytes", [("refit", 1 << 16), ("moe_ep", 256 * 2**20), ("uneven", 4096)])
def test_a_whole_pairwise_plan_and_every_ranks_part_read_back_as_written(name, bucket_bytes):
    program = program_of(name)
    whole = compile_plan(program, bucket_bytes=bucket_bytes, mode="pairwise")
    again = load_plan(whole.to_bytes(), program)
    assert (again.mode, again.rank) == ("pairwise", None)
    assert columns_equal(again, whole) and again.to_bytes() == whole.to_bytes()
    assert again.fingerprint == whole.fingerprint
    assert load_plan(whole.to_bytes(), program, mode="pairwise").mode == "pairwise"
    for rank in participants(program):
        part = compile_plan(program, bucket_bytes=bucket_bytes, rank=rank)
        mine = load_plan(part.to_bytes(), program, rank=rank, mode="per-rank")
        assert (mine.mode, mine.rank) == ("pairwise", rank)
        assert columns_equal(mine, part) and mine.to_bytes() == part.to_bytes()
        # the fingerprint covers the whole program: equal to the whole plan's
        assert mine.fingerprint == whole.fingerprint
        # the part read back is the whole plan's moves on that rank (each end computes alone)
        expected = sorted(str(m) for m in whole.moves() if rank in (m.src, m.dst))
        assert sorted(str(m) for m in mine.moves()) == expected
        assert mine.stats == part.stats


def test_a_fleet_plan_still_reads_back_without_a_mode():
    program = program_of("refit")
    fleet = compile_plan(program, bucket_bytes=1 << 16)
    again = load_plan(fleet.to_bytes(), program, mode="fleet", rank=5)
    assert (again.mode, again.rank) == ("fleet", None)
    assert again.fingerprint == fleet.fingerprint


def test_a_plan_file_is_refused_where_it_does_not_fit():
    program = program_of("refit")
    part = compile_plan(program, rank=7).to_bytes()
    whole = compile_plan(program, mode="pairwise").to_bytes()
    fleet = compile_plan(program).to_bytes()
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part of the pairwise plan of 'refit', not rank 3's"):
        load_plan(part, program, rank=3)
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part .*, not a fleet plan"):
        load_plan(part, program, mode="fleet")
    with pytest.raises(LayoutValueError, match=r"holds rank 7's part .*, not a whole pairwise plan"):
        load_plan(part, program, mode="pairwise")
    with pytest.raises(LayoutValueError, match=r"holds the whole pairwise plan of 'refit', not a per-rank plan"):
        load_plan(whole, program, mode="per-rank")
    with pytest.raises(LayoutValueError, match=r"holds the whole fleet's plan of 'refit', not a whole pairwise"):
        load_plan(fleet, program, mode="pairwise")
    with pytest.raises(LayoutValueError, match=r"rank 99 belongs to neither mesh of plan 'refit' \('megatron': ranks"):
        load_plan(whole, program, rank=99)
    with pytest.raises(LayoutValueError, match="unknown plan mode 'nearest'"):
        load_plan(fleet, program, mode="nearest")


def test_an_executor_refuses_a_loaded_part_of_another_rank():
    """The executor checks whose part it runs before it touches the transport."""
    from layoutlang.runtime.executor import Executor

    program = program_of("refit")
    part = load_plan(compile_plan(program, rank=7).to_bytes(), program)
    with pytest.raises(ExecutionError, match="rank 3 was given the per-rank plan of rank 7"):
        Executor(part, 3, transport=None)  # type: ignore[arg-type]


def test_a_part_relabelled_or_stripped_of_its_mode_is_refused():
    """The header says whose part and which mode: the columns are validated as that kind of
    plan, so a forged header does not pass."""
    program = program_of("refit")
    data = compile_plan(program, rank=7, bucket_bytes=1 << 16).to_bytes()
    # rank 3's header on rank 7's moves: its moves do not all touch rank 3
    with pytest.raises(LayoutValueError, match="invalid"):
        load_plan(with_header(data, lambda h: h | {"rank": 3}), program)
    # no mode: read as a fleet plan, rank 7's moves do not write every destination byte
    with pytest.raises(LayoutValueError):
        load_plan(with_header(data, lambda h: {k: v for k, v in h.items() if k not in ("mode", "rank")}), program)
    with pytest.raises(LayoutValueError, match="unknown plan mode 'nearest'"):
        load_plan(with_header(data, lambda h: h | {"mode": "nearest"}), program)
    with pytest.raises(LayoutValueError, match="a per-rank plan of rank 7 in mode 'fleet'"):
        load_plan(with_header(data, lambda h: h | {"mode": "fleet"}), program)
    with pytest.raises(LayoutValueError, match="the part of rank 40, which belongs to neither mesh"):
        load_plan(with_header(data, lambda h: h | {"rank": 40}), program)
    with pytest.raises(LayoutValueError, match="a per-rank plan of rank '7'"):
        load_plan(with_header(data, lambda h: h | {"rank": "7"}), program)
    # the per-rank totals are recomputed from the rank's part, not trusted
    damaged = with_header(data, lambda h: h | {"lower_bound_bytes": h["lower_bound_bytes"] + 1})
    with pytest.raises(LayoutValueError, match="lower_bound_bytes does not match"):
        load_plan(damaged, program)
