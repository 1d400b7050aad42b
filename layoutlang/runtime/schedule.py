"""A plan as one rank's schedule: per bucket and stage, its local copies and one message per peer."""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import numpy as np
import torch

from ..io.torch_dtypes import torch_dtype
from ..plan import SPACES, Move, Plan

_ALIGN = 16  # bytes: every region starts aligned in a message, so typed views are legal
_SOURCE, _DESTINATION, _SCRATCH = (SPACES.index(s) for s in ("source", "destination", "scratch"))


# ----------------------------------------------------------------------- schedule


@attrs.frozen
class Piece:
    """One region in one of this rank's spaces."""

    space: int
    storage: str
    index: tuple[slice, ...]
    tensor: int
    dtype: torch.dtype  # the logical dtype: what travels on the wire
    numel: int
    source: int = 0  # which source layout, for pieces of the source space

    @property
    def key(self) -> tuple[int, int]:
        return (self.space, self.source)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@attrs.define
class Message:
    peer: int
    pieces: list[Piece] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    nbytes: int = 0

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.offsets.append(self.nbytes)
        self.nbytes += -(-piece.nbytes // _ALIGN) * _ALIGN


@attrs.define
class Step:
    bucket: int
    stage: int
    copies: list[tuple[Piece, Piece]] = attrs.field(factory=list)
    sends: dict[int, Message] = attrs.field(factory=dict)
    recvs: dict[int, Message] = attrs.field(factory=dict)

    def pieces(self) -> Iterable[Piece]:
        """Every piece this step reads or writes."""
        for pair in self.copies:
            yield from pair
        for message in list(self.sends.values()) + list(self.recvs.values()):
            yield from message.pieces

    @property
    def sends_read_only_sources(self) -> bool:
        return all(p.space == _SOURCE for m in self.sends.values() for p in m.pieces)


def schedule(plan: Plan, rank: int) -> list[Step]:
    """The steps this rank takes, in plan order (the same order on every rank)."""
    a = plan.arrays
    dtypes = [torch_dtype(plan.source.tensors[n].dtype) for n in plan.tensors]
    steps: dict[tuple[int, int], Step] = {}
    src_cols = np.asarray(a.move_src)
    dst_cols = np.asarray(a.move_dst)
    for i in plan.moves_of_rank(rank):
        move = plan.move(int(i))
        key = (move.bucket, move.stage)
        step = steps.get(key)
        if step is None:
            step = steps[key] = Step(move.bucket, move.stage)
        read, write = plan.place(move)
        tensor = plan.source.resolved.index[move.tensor]
        src, dst = int(src_cols[i]), int(dst_cols[i])
        if src == dst:
            step.copies.append(
                (_piece(move, move.src_space, read, tensor, dtypes[tensor]),
                 _piece(move, move.dst_space, write, tensor, dtypes[tensor]))
            )
        elif src == rank:
            step.sends.setdefault(dst, Message(dst)).add(_piece(move, move.src_space, read, tensor, dtypes[tensor]))
        else:
            step.recvs.setdefault(src, Message(src)).add(_piece(move, move.dst_space, write, tensor, dtypes[tensor]))
    return [steps[k] for k in sorted(steps)]


def _piece(move: Move, space: str, place: tuple[str, tuple[int, ...]] | None, tensor: int, dtype: torch.dtype) -> Piece:
    """The region ``move`` reads or writes in ``space`` of this rank, at ``place`` (storage, offsets)."""
    if place is None:
        raise AssertionError(f"move {move} has no place in the {space} space of its rank")  # plans are validated
    storage, offsets = place
    index = tuple(slice(o, o + s) for o, s in zip(offsets, move.sizes))
    numel = math.prod(move.sizes)  # 1 for a scalar
    source = move.source if space == "source" else 0
    return Piece(SPACES.index(space), storage, index, tensor, dtype, numel, source)
