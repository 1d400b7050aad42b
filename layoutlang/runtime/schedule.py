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
#: a region of at least this many bytes travels as a transfer of its own, which either end
#: may post from (or into) its storage in place; smaller ones share one staged transfer
OWN_TRANSFER_BYTES = 1 << 20
_SOURCE, _DESTINATION, _SCRATCH = (SPACES.index(s) for s in ("source", "destination", "scratch"))


# ----------------------------------------------------------------------- schedule


@attrs.frozen
class Piece:
    """One region in one of this rank's spaces.

    ``index`` selects the region in its storage, one item per storage dim: an integer for
    the leading dim of a stacked storage (the element), slices for the rest, swapped when
    the region sits ``transposed`` (its last two dims swapped) there. ``sizes`` are the
    region's sizes in the logical tensor's order: what travels on the wire.
    """

    space: int
    storage: str
    index: tuple[slice | int, ...]
    tensor: int
    dtype: torch.dtype  # the logical dtype: what travels on the wire
    numel: int
    source: int = 0  # which source layout, for pieces of the source space
    transposed: bool = False
    sizes: tuple[int, ...] = ()

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

    def transfers(self) -> list[Message]:
        """What is posted for this message, in order: its small regions packed together, then
        each large region alone. Both ends derive the same list from the plan (pieces are in
        move order on both), so the transfers match one to one whatever each end stages."""
        small, large = Message(self.peer), []
        for piece in self.pieces:
            if piece.nbytes >= OWN_TRANSFER_BYTES:
                large.append(Message(self.peer))
                large[-1].add(piece)
            else:
                small.add(piece)
        return ([small] if small.pieces else []) + large

    @property
    def wire_bytes(self) -> int:
        """The bytes that travel: the regions at their offsets, without the last one's padding
        (so a message of one region is that region's bytes, whether it is staged or not)."""
        return self.offsets[-1] + self.pieces[-1].nbytes if self.pieces else 0


@attrs.define
class Step:
    bucket: int
    stage: int
    copies: list[tuple[Piece, Piece]] = attrs.field(factory=list)
    sends: dict[int, Message] = attrs.field(factory=dict)
    recvs: dict[int, Message] = attrs.field(factory=dict)
    #: the transfers posted for the messages (Message.transfers), peer by peer
    send_transfers: list[Message] = attrs.field(factory=list)
    recv_transfers: list[Message] = attrs.field(factory=list)

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
    """The steps this rank takes, in plan order (the same order on every rank): by bucket,
    then stage; a pairwise plan's by stage, then bucket, cut to the budget
    (:func:`_pairwise_steps`)."""
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
                (_piece(plan, move, move.src_space, read, tensor, dtypes[tensor]),
                 _piece(plan, move, move.dst_space, write, tensor, dtypes[tensor]))
            )
        elif src == rank:
            piece = _piece(plan, move, move.src_space, read, tensor, dtypes[tensor])
            step.sends.setdefault(dst, Message(dst)).add(piece)
        else:
            piece = _piece(plan, move, move.dst_space, write, tensor, dtypes[tensor])
            step.recvs.setdefault(src, Message(src)).add(piece)
    if plan.mode == "pairwise":
        ordered = _pairwise_steps(steps, rank, plan.bucket_bytes)
    else:
        ordered = [steps[k] for k in sorted(steps)]
    for step in ordered:
        step.send_transfers = [t for m in step.sends.values() for t in m.transfers()]
        step.recv_transfers = [t for m in step.recvs.values() for t in m.transfers()]
    return ordered


def _pairwise_steps(steps: dict[tuple[int, int], Step], rank: int, budget: int) -> list[Step]:
    """A pairwise plan's steps: by (stage, bucket), each cut into consecutive sub-steps whose
    messages stage at most ``budget`` bytes together (a message alone may fill one).

    A pairwise plan's buckets are chunks of one pair of ranks' moves (every message carries
    at most the budget), so a rank's step may hold a message for each of many peers: more
    than it can stage at once. No rank knows another's steps, and the transports match a
    pair's messages by tag in the order they are posted, so every rank posts its messages in
    one global key order, (stage, bucket, sender, receiver), which both ends of a message
    compute alike; a sub-step is a run of that order, posted at once and waited for.

    Why no rank waits forever: take the smallest message, in that order, that has not
    completed. Its sender and its receiver have completed every sub-step before the one
    holding it (those hold only smaller messages), so both have posted it, and it completes,
    and so on for the next. Relays (stage 1) read what stage 0 delivered: ordering by stage
    first puts them after every message that feeds them.
    """
    out: list[Step] = []
    for bucket, stage in sorted(steps, key=lambda key: (key[1], key[0])):
        step = steps[(bucket, stage)]
        keyed = sorted(
            [((rank, peer), "send", m) for peer, m in step.sends.items()]
            + [((peer, rank), "recv", m) for peer, m in step.recvs.items()],
            key=lambda item: item[0],
        )
        part = Step(bucket, stage, copies=step.copies)
        staged = 0
        for _, way, message in keyed:
            if staged and staged + message.nbytes > budget:
                out.append(part)
                part, staged = Step(bucket, stage), 0
            (part.sends if way == "send" else part.recvs)[message.peer] = message
            staged += message.nbytes
        out.append(part)
    return out


def _piece(
    plan: Plan, move: Move, space: str, place: tuple[str, tuple[int, ...]] | None, tensor: int, dtype: torch.dtype
) -> Piece:
    """The region ``move`` reads or writes in ``space`` of this rank, at ``place`` (storage, offsets)."""
    if place is None:
        raise AssertionError(f"move {move} has no place in the {space} space of its rank")  # plans are validated
    storage, offsets = place
    sizes = list(move.sizes)
    transposed = False
    if space != "scratch":  # scratch buffers hold whole tensors as they are
        layout = plan.sources[move.source] if space == "source" else plan.destination
        transposed = layout.storage_of(move.tensor).is_transposed(move.tensor)
    if transposed:
        sizes[-2:] = sizes[:-3:-1]
    stacked = len(offsets) - len(sizes)  # 1: the leading dim of a stacked storage picks the element
    index: tuple[slice | int, ...] = (
        *offsets[:stacked], *(slice(o, o + s) for o, s in zip(offsets[stacked:], sizes))
    )
    numel = math.prod(move.sizes)  # 1 for a scalar
    source = move.source if space == "source" else 0
    return Piece(SPACES.index(space), storage, index, tensor, dtype, numel, source, transposed, tuple(move.sizes))
