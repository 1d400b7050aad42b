"""A plan as one rank's schedule: per bucket and stage, its local copies and one message per peer."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import attrs
import numpy as np
import torch

from ..errors import core_errors
from ..io.torch_dtypes import torch_dtype
from ..plan import SPACES, Move, Plan

_ALIGN = 16  # bytes: every region starts aligned in a message, so typed views are legal
#: a region of at least this many bytes travels as a transfer of its own, which either end
#: may post from (or into) its storage in place; smaller ones share one staged transfer
OWN_TRANSFER_BYTES = 1 << 20
_SOURCE, _DESTINATION, _SCRATCH = (SPACES.index(s) for s in ("source", "destination", "scratch"))
#: a destination box of a quantized tensor assembled in bf16 (regions that split a block land
#: there; the rank quantizes its blocks once they have all arrived): a space of the executor
_ASSEMBLY = len(SPACES)


@attrs.frozen
class Quantized:
    """How a region quantized at its sender travels: fp8 values in the region's shape, then
    (at the next 16-byte boundary) its blocks' scales. ``scale_storage``/``scale_index``: where
    the scales lie on this rank (pieces of the destination space; None at a sender, which
    computes them)."""

    format: str
    block: tuple[int, ...]
    convention: str
    values: torch.dtype
    scale_dtype: torch.dtype
    scale_sizes: tuple[int, ...]
    scale_storage: str | None = None
    scale_index: tuple[slice | int, ...] | None = None

    def nbytes(self, numel: int) -> int:
        values = -(-numel * self.values.itemsize // _ALIGN) * _ALIGN
        return values + math.prod(self.scale_sizes) * self.scale_dtype.itemsize


@attrs.frozen
class Assembly:
    """A destination box of a quantized tensor on this rank, assembled in the logical dtype:
    its place in the destination storage (``index``) and in the scale storage, and how it is
    quantized. ``key`` names it (the pieces' ``storage`` in the assembly space)."""

    key: str
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: str
    storage_offsets: tuple[int, ...]
    scale_storage: str
    scale_storage_offsets: tuple[int, ...]
    format: str
    block: tuple[int, ...]
    convention: str


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
    #: the region travels quantized (its sender quantizes it): values and scales
    quantized: Quantized | None = None
    #: a piece of the assembly space: the destination box it lands in
    assembly: Assembly | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.space, self.source)

    @property
    def nbytes(self) -> int:
        if self.quantized is not None:
            return self.quantized.nbytes(self.numel)
        return self.numel * self.dtype.itemsize


@attrs.define
class Message:
    peer: int
    pieces: list[Piece] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    nbytes: int = 0
    #: a message of one quantized region's ``"values"`` alone, or of its ``"scales"``; ``""``:
    #: every region whole (a quantized one's values, then its scales)
    part: str = ""

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.offsets.append(self.nbytes)
        self.nbytes += -(-piece.nbytes // _ALIGN) * _ALIGN

    @classmethod
    def of_part(cls, peer: int, piece: Piece, part: str) -> Message:
        nbytes = part_bytes(piece, part)
        return cls(peer, [piece], [0], -(-nbytes // _ALIGN) * _ALIGN, part)

    def transfers(self) -> list[Message]:
        """What is posted for this message, in order: its small regions packed together, then
        each large region alone; a large quantized region as its values, then its scales (so
        that the values land in place where their region is one run of the storage). Both ends
        derive the same list from the plan (pieces are in move order on both), so the
        transfers match one to one whatever each end stages."""
        small, large = Message(self.peer), []
        for piece in self.pieces:
            if piece.nbytes < OWN_TRANSFER_BYTES:
                small.add(piece)
            elif piece.quantized is not None:
                large += [Message.of_part(self.peer, piece, "values"), Message.of_part(self.peer, piece, "scales")]
            else:
                large.append(Message(self.peer))
                large[-1].add(piece)
        return ([small] if small.pieces else []) + large

    @property
    def wire_bytes(self) -> int:
        """The bytes that travel: the regions at their offsets, without the last one's padding
        (so a message of one region is that region's bytes, whether it is staged or not)."""
        if self.part:
            return part_bytes(self.pieces[0], self.part)
        return self.offsets[-1] + self.pieces[-1].nbytes if self.pieces else 0

    def spans(self) -> list[tuple[int, int]]:
        """(offset, bytes) of what holds the regions in the message (not the padding between
        them): a quantized region's values, then its scales."""
        if self.part:
            return [(0, self.wire_bytes)]
        spans = []
        for piece, offset in zip(self.pieces, self.offsets):
            q = piece.quantized
            if q is None:
                spans.append((offset, piece.nbytes))
                continue
            spans += [(offset + at, nbytes) for at, nbytes in quantized_spans(piece)]
        return spans


def quantized_spans(piece: Piece) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, bytes) of a quantized region's fp8 values and of its scales where the region
    travels whole: the scales start at the next 16-byte boundary after the values."""
    values = part_bytes(piece, "values")
    return (0, values), (-(-values // _ALIGN) * _ALIGN, part_bytes(piece, "scales"))


def part_bytes(piece: Piece, part: str) -> int:
    """The bytes of a quantized region's fp8 ``"values"`` or of its ``"scales"``."""
    q = piece.quantized
    assert q is not None
    if part == "values":
        return piece.numel * q.values.itemsize
    return math.prod(q.scale_sizes) * q.scale_dtype.itemsize


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
    regions = np.asarray(a.move_region)
    q = plan.quantization
    quantizing = _Quantizing(plan, rank) if q is not None else None
    indices = plan.moves_of_rank(rank)
    place = _Places(plan)
    index = plan.source.resolved.index
    ats = np.asarray(q.at)[regions[indices]].tolist() if q is not None else [0] * len(indices)
    for move, at in zip(plan.moves_at(indices), ats):
        key = (move.bucket, move.stage)
        step = steps.get(key)
        if step is None:
            step = steps[key] = Step(move.bucket, move.stage)
        read, write = place(move)
        tensor = index[move.tensor]
        src, dst = move.src, move.dst
        ends: tuple[tuple[str, tuple[str, tuple[int, ...]] | None], ...]
        if src == dst:
            ends = ((move.src_space, read), (move.dst_space, write))
        else:
            ends = ((move.src_space, read),) if src == rank else ((move.dst_space, write),)
        pieces = []
        for space, where in ends:  # the ends of the move on this rank
            piece = _piece(plan, move, space, where, tensor, dtypes[tensor], place.transposed)
            pieces.append(quantizing.piece(piece, move, space, at) if quantizing is not None and at else piece)
        if src == dst:
            step.copies.append((pieces[0], pieces[1]))
        elif src == rank:
            step.sends.setdefault(dst, Message(dst)).add(pieces[0])
        else:
            step.recvs.setdefault(src, Message(src)).add(pieces[0])
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


class _Places:
    """Where a plan's moves read and write (:meth:`Plan.place <layoutlang.plan.Plan.place>`),
    with each layout's compiled core and storages looked up once instead of per move."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._layouts = [(layout, layout.core, layout.resolved) for layout in (*plan.sources, plan.destination)]
        self._transposed: dict[tuple[int, str], bool] = {}

    def __call__(self, move: Move) -> tuple[tuple[str, tuple[int, ...]] | None, tuple[str, tuple[int, ...]] | None]:
        with core_errors(self.plan.tensors):
            return self._locate(move, move.src, move.src_space), self._locate(move, move.dst, move.dst_space)

    def _layout(self, move: Move, space: str) -> int:
        return move.source if space == "source" else len(self._layouts) - 1

    def _locate(self, move: Move, rank: int, space: str) -> tuple[str, tuple[int, ...]] | None:
        if space == "scratch":
            return (move.tensor, move.offsets)
        _, core, resolved = self._layouts[self._layout(move, space)]
        index = resolved.index[move.tensor]
        offsets = core.locate(index, rank, list(move.offsets))
        storage = resolved.storages[resolved.storage_of[index]].name
        return (storage, tuple(offsets)) if offsets is not None else None

    def transposed(self, move: Move, space: str) -> bool:
        """Whether the storage ``move`` reads or writes in ``space`` holds its tensor transposed."""
        key = (self._layout(move, space), move.tensor)
        found = self._transposed.get(key)
        if found is None:
            layout = self._layouts[key[0]][0]
            found = self._transposed[key] = layout.storage_of(move.tensor).is_transposed(move.tensor)
        return found


def _piece(
    plan: Plan,
    move: Move,
    space: str,
    place: tuple[str, tuple[int, ...]] | None,
    tensor: int,
    dtype: torch.dtype,
    transposed_in: Callable[[Move, str], bool] | None = None,
) -> Piece:
    """The region ``move`` reads or writes in ``space`` of this rank, at ``place`` (storage, offsets)."""
    if place is None:
        raise AssertionError(f"move {move} has no place in the {space} space of its rank")  # plans are validated
    storage, offsets = place
    sizes = list(move.sizes)
    transposed = False
    if space != "scratch" and transposed_in is not None:  # scratch buffers hold whole tensors as they are
        transposed = transposed_in(move, space)
    elif space != "scratch":
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


class _Quantizing:
    """The pieces of one rank's moves of quantized tensors (``Plan.quantization``): a region
    quantized at its sender travels as values and scales (:class:`Quantized`); one quantized
    on its destination lands in (and is relayed from) the assembly of its destination box."""

    def __init__(self, plan: Plan, rank: int):
        self.plan = plan
        self.rank = rank
        self.found = plan.destination.quantized()
        self._boxes: dict[str, list] = {}
        self._scales: dict[str, list] = {}

    def piece(self, piece: Piece, move: Move, space: str, at: int) -> Piece:
        q = self.found[move.tensor]
        if space == "source":  # quantized by the sender (no scale storage here), or sent as it is
            return attrs.evolve(piece, quantized=self._quantized(q, move, None, None)) if at == 1 else piece
        if space != "destination":
            raise AssertionError(f"move {move}: a quantized tensor moves between source and destination only")
        box_index, box = self._box(move)
        scale_box = self._scale_boxes(move.tensor)[box_index if not q.replicated else 0]
        if at == 1:
            offsets = tuple(o // b for o, b in zip(move.offsets, q.block))
            sizes = tuple(-(-(o + s) // b) - o // b for o, s, b in zip(move.offsets, move.sizes, q.block))
            lead = len(scale_box.storage_offsets) - len(sizes)
            index = (
                *scale_box.storage_offsets[:lead],
                *(slice(so + o - bo, so + o - bo + s)
                  for so, o, bo, s in zip(scale_box.storage_offsets[lead:], offsets, scale_box.offsets, sizes)),
            )
            return attrs.evolve(piece, quantized=self._quantized(q, move, scale_box.storage, index))
        key = f"{move.tensor}#{box_index}"
        assembly = Assembly(
            key, move.tensor, box.offsets, box.sizes, box.storage, box.storage_offsets, scale_box.storage,
            scale_box.storage_offsets, q.format, q.block, q.convention,
        )
        index = tuple(slice(o - bo, o - bo + s) for o, bo, s in zip(move.offsets, box.offsets, move.sizes))
        return attrs.evolve(piece, space=_ASSEMBLY, storage=key, index=index, transposed=False, assembly=assembly)

    def _quantized(self, q, move: Move, storage: str | None, index: tuple[slice | int, ...] | None) -> Quantized:
        sizes = tuple(-(-(o + s) // b) - o // b for o, s, b in zip(move.offsets, move.sizes, q.block))
        return Quantized(
            q.format, q.block, q.convention, torch_dtype(q.values), torch_dtype(q.scale.dtype), sizes, storage, index
        )

    def _box(self, move: Move):
        boxes = self._boxes.get(move.tensor)
        if boxes is None:
            boxes = self._boxes[move.tensor] = self.plan.destination.boxes(move.tensor, self.rank)
        for k, box in enumerate(boxes):
            inside = zip(move.offsets, move.sizes, box.offsets, box.sizes)
            if all(bo <= o and o + s <= bo + bs for o, s, bo, bs in inside):
                return k, box
        raise AssertionError(f"move {move} lands in no box of rank {self.rank}")  # plans are validated

    def _scale_boxes(self, tensor: str) -> list:
        boxes = self._scales.get(tensor)
        if boxes is None:
            boxes = self._scales[tensor] = self.plan.destination.scale_boxes(tensor, self.rank)
        return boxes
