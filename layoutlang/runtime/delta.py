"""Delta refits: an executor's messages as the changes since the version their receiver holds.

A refit after a training step moves the same boxes as the one before; most of their bytes
did not change. With ``delta=True`` (:meth:`Executor.run <layoutlang.runtime.executor.Executor.run>`):

- every sender keeps, per message, the bytes it last sent (*kept copies*, in host memory or
  in memory-mapped files of a directory, up to a budget past which it keeps digests:
  :class:`DeltaOptions`; ``kept_bytes`` in the run's :class:`DeltaReport`);
- before the first step, every receiver tells each of its senders which version it holds of
  each message it gets from it (the *offers*: 0 for none). A receiver holds a version when it
  received it whole into the destination storages it is handed again now, and the checksum
  of those bytes is still the one that version had: a storage written by someone else since,
  or handed as another tensor, holds none (and :attr:`DeltaReport.stale` names it);
- a sender encodes a message as a delta (:mod:`.wire_encoding`) when its receiver holds the
  version it kept, and dense otherwise; the receiver patches the bytes it holds in place.

Only messages whose every region lands in a destination storage as it travels can be
patched (fp8 values and their scales included, and the bf16 boxes a rank assembles for a
quantized tensor, which it keeps between delta runs; not regions gathered into scratch or
cast on arrival): the others, and messages under
:data:`~.wire_encoding.MIN_DELTA_BYTES`, travel dense as without deltas.
Receives are posted :data:`~.wire_encoding.HEADER_BYTES` longer than the dense message and
learn from the header what arrived, so the transport must deliver a message into a longer
buffer (gloo does; :attr:`Transport.variable_length <layoutlang.transport.Transport.variable_length>`).
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import LayoutValueError
from .agreement import AGREEMENT_TAG
from .schedule import _ASSEMBLY, _DESTINATION, Message, Piece, Step
from .wire_encoding import (
    MIN_DELTA_BYTES,
    Encoding,
    apply_patch,
    capacity,
    checksum,
    encode,
    encode_blocks,
    read_header,
)

__all__ = ["KEEPS", "DeltaOptions", "DeltaRefits", "DeltaReport", "delta_options"]

#: what a sender keeps of what it sent: a copy of every byte (the changed elements travel),
#: or only a digest per 4 KiB block (the changed blocks travel whole: 8 bytes kept per block)
KEEPS = ("copies", "digests")

Key = tuple[int, int]  # (step, index of the transfer among the step's sends or receives)


@attrs.frozen
class DeltaOptions:
    """How a delta run's senders keep what they sent (``delta=DeltaOptions(...)`` wherever
    ``delta=True`` is taken; ranks may differ: only receivers' versions are agreed on).

    ``keep``: ``"copies"`` (every byte; the changed elements travel) or ``"digests"`` (a
    digest per 4 KiB block; the changed blocks travel whole). ``budget``: the bytes of copies
    this rank keeps at most (None: no bound); a message whose copy would go past it keeps
    digests instead, so its changed blocks travel whole. ``place``: ``"host"`` (the process's
    memory) or a directory: each copy is a memory-mapped file there, deleted at once (its pages
    live while the executor does), for senders whose memory is short and whose disk is not.
    """

    keep: str = "copies"
    budget: int | None = None
    place: str = "host"

    def __attrs_post_init__(self) -> None:
        if self.keep not in KEEPS:
            raise LayoutValueError(f"delta refits keep copies or digests of what they send, not {self.keep!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise LayoutValueError(f"a delta budget is a number of bytes (0 or more), not {self.budget!r}")
        if self.place != "host" and not os.path.isdir(self.place):
            raise LayoutValueError(f"delta copies are kept in 'host' memory or in an existing directory, "
                                   f"not {self.place!r}")


def delta_options(delta: bool | str | DeltaOptions) -> DeltaOptions | None:
    """``run(delta=...)`` as options: None for a dense run (False)."""
    if delta is False:
        return None
    if delta is True:
        return DeltaOptions()
    if isinstance(delta, DeltaOptions):
        return delta
    if isinstance(delta, str) and delta in KEEPS:
        return DeltaOptions(keep=delta)
    raise LayoutValueError(f"delta={delta!r}: a run is dense (False) or a delta run keeping copies (True, "
                           "'copies') or digests ('digests') of what it sends, or DeltaOptions")


@attrs.frozen
class DeltaReport:
    """What deltas did in one run on one rank.

    ``dense_bytes``: what this rank's messages would have sent without deltas (those that
    could travel as deltas); ``wire_bytes``: what they sent (headers included);
    ``messages``: how many were sent by each encoding; ``kept_bytes``: the copies this rank
    keeps of what it sent (host memory, the base of its next deltas) and the bf16 boxes it
    assembles for quantized tensors (kept between delta runs); ``stale``: destination
    storages whose bytes were not the version this rank received last (written since, or
    handed as other tensors), received dense in this run.
    """

    dense_bytes: int
    wire_bytes: int
    messages: dict[str, int]
    kept_bytes: int
    stale: list[str]

    @property
    def ratio(self) -> float:
        """Wire bytes against dense (1.0 when nothing was sent)."""
        return self.wire_bytes / self.dense_bytes if self.dense_bytes else 1.0


@attrs.define
class _Base:
    """The version of one received message this rank holds, and where."""

    version: int
    checksum: int
    places: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]  # each region's address, strides, dtype


class DeltaRefits:
    """One executor's delta state across its runs (module doc). ``region`` gives the view of a
    destination piece in the run's storages."""

    def __init__(self, steps: Sequence[Step], rank: int, options: DeltaOptions | None = None):
        self.steps = steps
        self.rank = rank
        self.options = options or DeltaOptions()
        self._kept: dict[Key, torch.Tensor] = {}  # copies, or digests (int64 per block)
        self._digested: set[Key] = set()  # the messages whose sender keeps digests, not a copy
        self._copy_bytes = 0  # kept in copies (what the budget bounds)
        self._kept_versions: dict[Key, int] = {}
        self._bases: dict[Key, _Base] = {}
        # transfers by peer, in the order both ends post them: what an offer lists
        self._sends_to: dict[int, list[Key]] = defaultdict(list)
        self._recvs_from: dict[int, list[Key]] = defaultdict(list)
        for n, step in enumerate(steps):
            for k, transfer in enumerate(step.send_transfers):
                self._sends_to[transfer.peer].append((n, k))
            for k, transfer in enumerate(step.recv_transfers):
                self._recvs_from[transfer.peer].append((n, k))
        self._version = 0
        self._delta_sends: set[Key] = set()
        self._arena = torch.empty(0, dtype=torch.uint8)

    # ------------------------------------------------------------------ before the steps

    def start(
        self,
        transport: Any,
        timeout: float,
        held: Callable[[Message], list[torch.Tensor]],
        destination_dtypes: dict[str, torch.dtype],
    ) -> None:
        """Exchange the offers with every peer and decide which sends travel as deltas.
        ``held(transfer)``: the destination tensors a received transfer lands in (its regions,
        and a quantized one's scales)."""
        self._version = secrets.randbits(62) or 1  # this run's version of what it sends
        self._held = held
        self._stale: set[str] = set()
        self._counts = dict.fromkeys((e.name.lower() for e in Encoding), 0)
        self._dense = self._wire = 0
        self._patchable = {
            (n, k)
            for n, step in enumerate(self.steps)
            for k, transfer in enumerate(step.recv_transfers)
            if _patchable(transfer, destination_dtypes)
        }
        offers = [
            (peer, torch.tensor([self._offer(key) for key in keys], dtype=torch.int64).view(torch.uint8))
            for peer, keys in self._recvs_from.items()
        ]
        asked = {peer: torch.zeros(len(keys), dtype=torch.int64) for peer, keys in self._sends_to.items()}
        transport.exchange(offers, [(p, t.view(torch.uint8)) for p, t in asked.items()], tag=AGREEMENT_TAG).wait(
            timeout
        )
        self._delta_sends = {
            key
            for peer, keys in self._sends_to.items()
            for key, offer in zip(keys, asked[peer].tolist())
            if offer and offer == self._kept_versions.get(key)
        }
        largest = max((self._step_bytes(step) for step in self.steps), default=0)
        if self._arena.numel() < largest:
            self._arena = torch.empty(largest, dtype=torch.uint8)

    def _offer(self, key: Key) -> int:
        """The version of message ``key`` this rank holds whole where it lands now, or 0."""
        base = self._bases.pop(key, None)
        if base is None or key not in self._patchable:
            return 0
        transfer = self.steps[key[0]].recv_transfers[key[1]]
        regions = self._held(transfer)
        if base.places != _places(regions) or _regions_checksum(regions) != base.checksum:
            self._stale.update(p.storage for p in transfer.pieces)
            return 0
        self._bases[key] = base
        return base.version

    def _step_bytes(self, step: Step) -> int:
        return sum(_size(t) for t in step.send_transfers) + sum(_size(t) for t in step.recv_transfers)

    # ------------------------------------------------------------------ each step

    def encode_sends(self, n: int, sends: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Step ``n``'s messages encoded for the wire: as the executor packed them (dense), or
        a source region's rows where they lie (2-D uint8, read without a packed copy)."""
        out, offset = [], 0
        for k, ((peer, message), transfer) in enumerate(zip(sends, self.steps[n].send_transfers)):
            if transfer.wire_bytes < MIN_DELTA_BYTES:
                out.append((peer, message))
                continue
            key = (n, k)
            buffer = self._arena[offset : offset + capacity(message.numel())]
            offset += _size(transfer)
            kept = self._kept.get(key)
            if kept is None and not self._reserve_copy(message.numel()):
                self._digested.add(key)
            if key in self._digested:
                encoded, self._kept[key] = encode_blocks(
                    message.reshape(-1), kept, self._version, buffer, delta=key in self._delta_sends,
                    spans=transfer.spans(),
                )
            elif kept is None:
                kept = self._kept[key] = self._new_copy(message.numel())
                kept.view(message.shape).copy_(message)
                encoded = encode(message, None, _unit(transfer), self._version, buffer, spans=transfer.spans())
            else:
                encoded = encode(message, kept, _unit(transfer), self._version, buffer,
                                 delta=key in self._delta_sends, spans=transfer.spans())
            self._kept_versions[key] = self._version
            self._counts[encoded.header.encoding.name.lower()] += 1
            self._dense += message.numel()
            self._wire += encoded.nbytes
            out.append((peer, buffer[: encoded.nbytes]))
        self._recv_offset = offset
        return out

    def _reserve_copy(self, nbytes: int) -> bool:
        """Whether a message seen for the first time gets a copy (its bytes then count against the
        budget), else digests."""
        options = self.options
        if options.keep == "digests" or (options.budget is not None and self._copy_bytes + nbytes > options.budget):
            return False
        self._copy_bytes += nbytes
        return True

    def _new_copy(self, nbytes: int) -> torch.Tensor:
        """Room for a kept copy, where the options place it."""
        if self.options.place == "host":
            return torch.empty(nbytes, dtype=torch.uint8)
        with tempfile.NamedTemporaryFile(dir=self.options.place, prefix=f"layoutlang-kept-{self.rank}-") as file:
            file.truncate(nbytes)
            # mapped, then the name goes with the file object: the pages live as long as the copy
            return torch.from_file(file.name, shared=True, size=nbytes, dtype=torch.uint8)

    def receive_buffers(self, n: int, landing: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Where step ``n``'s messages arrive (after :meth:`encode_sends` of the same step):
        room for the header besides the dense bytes; small ones where they land."""
        out, offset = [], self._recv_offset
        for (peer, buffer), transfer in zip(landing, self.steps[n].recv_transfers):
            if transfer.wire_bytes < MIN_DELTA_BYTES:
                out.append((peer, buffer))
                continue
            out.append((peer, self._arena[offset : offset + capacity(transfer.wire_bytes)]))
            offset += _size(transfer)
        return out

    def decode(
        self,
        n: int,
        received: Sequence[tuple[int, torch.Tensor]],
        landing: Sequence[tuple[int, torch.Tensor]],
        staged: set[int],
        gather: Callable[[Message, torch.Tensor], None],
    ) -> None:
        """Write step ``n``'s messages where the executor expects them (``landing``: the region
        itself, or the staging its unpack copies from: the messages in ``staged``, whose base
        ``gather(transfer, place)`` writes where the message is patched first)."""
        for k, ((_, message), (_, place), transfer) in enumerate(
            zip(received, landing, self.steps[n].recv_transfers)
        ):
            if transfer.wire_bytes < MIN_DELTA_BYTES:
                continue
            header = read_header(message)
            key = (n, k)
            if header.encoding != Encoding.DENSE and key not in self._bases:
                raise RuntimeError(  # the offers say otherwise: a bug, never a wrong byte
                    f"rank {self.rank}: a delta arrived for message {k} of step {n}, whose base this rank does not hold"
                )
            if header.encoding != Encoding.DENSE and k in staged:
                gather(transfer, place)  # the base, where it is patched
            apply_patch(message, place, _unit(transfer))
            if key in self._patchable:
                regions = self._held(transfer)
                self._bases[key] = _Base(header.version, header.checksum, _places(regions))

    def report(self, kept_besides: int = 0) -> DeltaReport:
        """This run's report; ``kept_besides``: bytes the executor keeps as bases besides the
        sent copies (the boxes it assembles for quantized tensors)."""
        kept = sum(t.numel() * t.element_size() for t in self._kept.values()) + kept_besides
        return DeltaReport(self._dense, self._wire, dict(self._counts), kept, sorted(self._stale))


def _patchable(transfer: Message, destination_dtypes: dict[str, torch.dtype]) -> bool:
    """Whether a received message can be patched where it lands: every region in a destination
    storage in the wire's dtype (a quantized one: its fp8 values and its scales, as they
    travel), or in a box the executor assembles for a quantized tensor and keeps between delta
    runs."""
    return transfer.wire_bytes >= MIN_DELTA_BYTES and all(
        _lands_as_sent(p, destination_dtypes) for p in transfer.pieces
    )


def _lands_as_sent(piece: Piece, destination_dtypes: dict[str, torch.dtype]) -> bool:
    if piece.space == _ASSEMBLY:  # a box the executor assembles in the wire's dtype and keeps
        return True
    if piece.space != _DESTINATION or piece.assembly is not None:
        return False
    q = piece.quantized
    if q is None:
        return destination_dtypes.get(piece.storage) == piece.dtype
    return (
        q.scale_storage is not None
        and destination_dtypes.get(piece.storage) == q.values
        and destination_dtypes.get(q.scale_storage) == q.scale_dtype
    )


def _unit(transfer: Message) -> int:
    """The element size of a message: the bytes its changes are found in."""
    return math.gcd(*(1 if p.quantized is not None else p.dtype.itemsize for p in transfer.pieces))


def _size(transfer: Message) -> int:
    """Arena bytes a transfer takes, aligned so every buffer starts on 16 bytes."""
    return -(-capacity(transfer.wire_bytes) // 16) * 16 if transfer.wire_bytes >= MIN_DELTA_BYTES else 0



def _places(regions: Sequence[torch.Tensor]) -> tuple[tuple[int, tuple[int, ...], torch.dtype], ...]:
    return tuple((r.data_ptr(), tuple(r.stride()), r.dtype) for r in regions)


def _regions_checksum(regions: Sequence[torch.Tensor]) -> int:
    """The checksum of the regions' bytes, as :func:`~.wire_encoding.checksum` with spans
    computes it of the message that brought them."""
    return checksum([r.contiguous().view(-1).view(torch.uint8) for r in regions])
