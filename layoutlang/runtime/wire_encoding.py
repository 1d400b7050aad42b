"""Wire encodings of a delta refit: a message as the changes since the last version its
receiver holds.

A sender keeps, per message, the bytes it last sent (its *kept copy*). At the next run it
compares the message with them bit by bit, in *units* (the message's element size: NaN,
-0.0 and +0.0 are different values when their bits differ) and sends the cheapest of:

- ``DENSE``: every byte, as a refit without deltas sends them;
- ``BITMASK``: one bit per unit (1: changed), then the changed units' new values;
- ``INDICES``: the changed units' indices (int32, or int64 past 2^31 units), then their values.

Every encoded message starts with a :data:`HEADER_BYTES` header: the encoding, how many
units changed, the sender's version of the message (what its receiver holds afterwards)
and a checksum of the whole new message, which the receiver checks on the bytes it holds
once patched (a base that was not what the sender thinks is found there). The receiver
posts a buffer of :func:`capacity` bytes and learns from the header what arrived: gloo
delivers a shorter message into a longer buffer. A message is never encoded larger than
its dense bytes plus the header, and messages under :data:`MIN_DELTA_BYTES` travel dense
without a header, so a delta refit's wire bytes stay within 1.01x of a dense refit's.

Each section after the header starts on 16 bytes (``_ALIGN``), the padding before it zero.
Messages in host memory are compared, encoded, applied and checksummed by the C++ kernels
of ``csrc/delta.hpp`` (one pass each, near memory bandwidth); others (CUDA tensors) by
torch. Both write the same bytes: a message, its header and its checksum do not depend on
which encoded it. A receiver checks a message against its base before writing anything: a
section past the message, an index past the base or a bitmask that does not match its count
raises ValueError ("corrupt delta message") and leaves the base untouched.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs
import torch

from ..core import _core

__all__ = [
    "DIGEST_BLOCK_BYTES",
    "HEADER_BYTES",
    "MIN_DELTA_BYTES",
    "Encoded",
    "Encoding",
    "Header",
    "apply_patch",
    "block_digests",
    "capacity",
    "changed_units",
    "checksum",
    "encode",
    "encode_blocks",
    "read_header",
]

#: the header of an encoded message: encoding, changed units, version, checksum (int64 each)
HEADER_BYTES = 32
#: messages shorter than this travel dense with no header: the header would cost over 1%
MIN_DELTA_BYTES = 100 * HEADER_BYTES
_ALIGN = 16  # every part of an encoded message starts aligned, so typed views are legal
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
#: whether host tensors go through the C++ kernels (tests turn it off to check the torch path)
_KERNELS = True


class Encoding(enum.IntEnum):
    DENSE = 0
    BITMASK = 1
    INDICES = 2
    BLOCKS = 3  # digest-only senders: the blocks whose digest changed, whole


#: the block a digest-only sender digests and sends whole when its digest changed
DIGEST_BLOCK_BYTES = 4096


@attrs.frozen
class Header:
    encoding: Encoding
    changed: int  # units whose bits changed (every unit for DENSE)
    version: int  # the sender's version of the message: what its receiver holds afterwards
    checksum: int  # of the whole new message (:func:`checksum`)


@attrs.frozen
class Encoded:
    """What :func:`encode` wrote: ``nbytes`` of the output buffer travel."""

    header: Header
    nbytes: int


def capacity(nbytes: int) -> int:
    """The receive buffer an encoded message of ``nbytes`` dense bytes needs."""
    return nbytes + HEADER_BYTES


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _units(buffer: torch.Tensor, unit: int) -> torch.Tensor:
    return buffer.view(_UNIT_DTYPES[unit])


def checksum(buffer: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """A 64-bit checksum of a byte buffer (or of several, in order): the wrapping sums of its
    8-byte words and of every other word (so a corruption that keeps one sum is caught by the
    other), the tail past the last whole word summed as bytes; parts weighted by position."""
    if isinstance(buffer, torch.Tensor):
        buffer = [buffer]
    total = sum((2 * i + 1) * _part_checksum(part) for i, part in enumerate(buffer))
    return (total + 2**63) % 2**64 - 2**63


def _part_checksum(part: torch.Tensor) -> int:
    """One part's checksum: sum of words + 3 * sum of words at even index + sum of tail bytes."""
    if _kernels(part):
        return _core.delta_checksum(part.data_ptr(), part.numel())
    if part.data_ptr() % 8 or part.storage_offset() % 8 or not part.is_contiguous():
        part = part.clone(memory_format=torch.contiguous_format)  # a typed view needs an aligned start
    whole = part.numel() // 8 * 8
    words = part[:whole].view(torch.int64)
    return int(words.sum()) + 3 * int(words[::2].sum()) + int(part[whole:].to(torch.int64).sum())


def _kernels(*tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels handle these byte buffers: contiguous, in host memory."""
    return _KERNELS and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _index_bytes(units: int) -> int:
    return 4 if units < 2**31 else 8


def _choose(units: int, changed: int, unit: int) -> tuple[Encoding, int]:
    """The cheapest encoding of ``changed`` of ``units`` units, and its bytes after the header."""
    index_bytes = _index_bytes(units)
    costs = {
        Encoding.DENSE: units * unit,
        Encoding.BITMASK: _aligned(math.ceil(units / 8)) + changed * unit,
        Encoding.INDICES: _aligned(changed * index_bytes) + changed * unit,
    }
    encoding = min(costs, key=lambda e: (costs[e], e))
    return encoding, costs[encoding]


def encode(
    new: torch.Tensor,
    kept: torch.Tensor | None,
    unit: int,
    version: int,
    out: torch.Tensor,
    *,
    delta: bool = True,
    spans: Sequence[tuple[int, int]] | None = None,
) -> Encoded:
    """Encode the message ``new`` (uint8) into ``out`` (uint8, at least :func:`capacity` bytes)
    against ``kept`` (the bytes last sent), and make ``kept`` equal ``new``. ``new`` is
    contiguous, or 2-D rows of contiguous bytes (a region read where it lies; the message is
    its rows one after the other). Dense when there
    is no kept copy or ``delta`` is False (the receiver holds no base to patch).

    ``unit``: the bytes of one element (1, 2, 4 or 8); ``new`` is a whole number of them.
    ``spans``: the (offset, length) byte ranges the header's checksum covers (default: all):
    a message's regions, without the padding between them, which its receiver does not hold.
    """
    nbytes = new.numel()
    if unit not in _UNIT_DTYPES or nbytes % unit:
        raise ValueError(f"a message of {nbytes} bytes is not a whole number of {unit}-byte units")
    units = nbytes // unit
    body = out[HEADER_BYTES:]
    encoding, changed, total = Encoding.DENSE, units, None
    if kept is not None and delta and _kernels(kept, out) and _rows(new) is not None:
        # one pass: compared, checksummed, the body written (dense too) and `kept` updated
        encoding, changed, total = _encode_kernels(new, kept, unit, body)
    else:
        new = new.reshape(-1)  # rows of a region: packed here (the kernels read them where they lie)
        if kept is not None and delta:
            encoding, changed = _encode_torch(new, kept, unit, body)
        if encoding == Encoding.DENSE:
            changed = units
            body[:nbytes].copy_(new)
            if kept is not None:
                kept.copy_(new)
    if total is None or (spans is not None and list(spans) != [(0, nbytes)]):
        flat = new.reshape(-1)
        total = checksum([flat[o : o + n] for o, n in spans] if spans is not None else flat)
    payload = nbytes
    if encoding != Encoding.DENSE:
        chosen, payload = _choose(units, changed, unit)
        assert chosen == encoding, (chosen, encoding)
    header = Header(encoding, changed, version, total)
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([int(encoding), changed, version, total]))
    return Encoded(header, HEADER_BYTES + payload)


def _encode_torch(new: torch.Tensor, kept: torch.Tensor, unit: int, body: torch.Tensor) -> tuple[Encoding, int]:
    """:func:`encode`'s delta with torch: the encoding chosen and the changed units. Writes
    the body and updates ``kept`` unless the encoding is DENSE (the caller copies then)."""
    units = new.numel() // unit
    where = changed_units(new, kept, unit)
    changed = where.numel()
    encoding, _ = _choose(units, changed, unit)
    if encoding == Encoding.DENSE:
        return encoding, changed
    values = _units(new, unit)[where]
    if encoding == Encoding.BITMASK:
        head = _aligned(math.ceil(units / 8))
        body[:head].zero_()
        mask = torch.zeros(units, dtype=torch.bool, device=new.device)
        mask[where] = True
        _pack_bits(mask, body[: math.ceil(units / 8)])
    else:
        index_dtype = torch.int32 if _index_bytes(units) == 4 else torch.int64
        head = _aligned(changed * index_dtype.itemsize)
        body[: changed * index_dtype.itemsize].view(index_dtype).copy_(where)
        body[changed * index_dtype.itemsize : head].zero_()
    body[head : head + changed * unit].view(values.dtype).copy_(values)
    _units(kept, unit)[where] = values
    return encoding, changed


def _indices_capacity(nbytes: int, unit: int) -> int:
    """The most changed units for which INDICES is the cheapest encoding (:func:`_choose`):
    cheaper than BITMASK (ties go to BITMASK) and than DENSE (ties go to DENSE)."""
    units = nbytes // unit
    index_bytes = _index_bytes(units)
    by_mask = (_aligned(math.ceil(units / 8)) - _ALIGN) // index_bytes
    by_dense = (nbytes - 1) // (index_bytes + unit)
    while by_dense > 0 and _aligned(by_dense * index_bytes) + by_dense * unit >= nbytes:
        by_dense -= 1
    return max(0, min(by_mask, by_dense))


def _encode_kernels(new: torch.Tensor, kept: torch.Tensor, unit: int, body: torch.Tensor) -> tuple[Encoding, int, int]:
    """:func:`_encode_torch` with the C++ kernel (``csrc/delta.hpp``), the same bytes, in one
    pass: INDICES with room for as many changes as it is the cheapest for, turning into
    BITMASK (as many as it beats DENSE for), then DENSE; ``kept`` patched as its receiver
    patches its base (every byte for DENSE, the body written too). Also returns the checksum
    of ``new``."""
    nbytes = new.numel()
    units = nbytes // unit
    if units == 0:
        return Encoding.DENSE, 0, checksum(new)
    rows, row_stride = _rows(new) or (1, 0)
    index_room = _indices_capacity(nbytes, unit)
    mask_room = (nbytes - _aligned(math.ceil(units / 8)) - 1) // unit  # BITMASK beats DENSE up to this many
    encoding, changed, total = _core.delta_encode(
        new.data_ptr(), rows, row_stride, kept.data_ptr(), nbytes, unit, body.data_ptr(), _index_bytes(units),
        index_room, mask_room if mask_room >= 0 else -1,
    )
    return Encoding(encoding), changed, total


def _rows(new: torch.Tensor) -> tuple[int, int] | None:
    """``(rows, row stride in bytes)`` of a message the C++ encoder reads where it lies: host
    memory, contiguous (one row) or 2-D rows of whole 8-byte words; None otherwise."""
    if not _KERNELS or new.device.type != "cpu":
        return None
    if new.is_contiguous():
        return 1, new.numel()
    if new.dim() == 2 and new.stride(1) == 1 and new.shape[1] % 8 == 0:
        return new.shape[0], new.stride(0)
    return None


def changed_units(new: torch.Tensor, kept: torch.Tensor, unit: int) -> torch.Tensor:
    """The indices (int64, ascending) of the ``unit``-byte units whose bits differ between
    the byte buffers ``new`` and ``kept``. Compared 8 bytes at a time where both are 8-byte
    aligned (several times faster than unit by unit), then unit by unit within the words that
    changed only."""
    nbytes = new.numel()
    aligned = new.data_ptr() % 8 == 0 and kept.data_ptr() % 8 == 0
    whole = nbytes // 8 * 8 if aligned else 0
    found = []
    if whole:
        new_words, kept_words = new[:whole].view(torch.int64), kept[:whole].view(torch.int64)
        words = (new_words != kept_words).nonzero().squeeze(1)
        if unit == 8:
            found.append(words)
        elif words.numel():
            per = 8 // unit
            differ = _units(new_words[words], unit).view(-1, per) != _units(kept_words[words], unit).view(-1, per)
            found.append((words.unsqueeze(1) * per + torch.arange(per, device=new.device)).masked_select(differ))
    if whole < nbytes:
        tail = (_units(new[whole:], unit) != _units(kept[whole:], unit)).nonzero().squeeze(1)
        found.append(tail + whole // unit)
    return (
        torch.cat(found)
        if len(found) > 1
        else found[0]
        if found
        else torch.zeros(0, dtype=torch.int64, device=new.device)
    )


_DIGEST_CHUNK = 1024  # blocks digested at once: the int64 products of 4 MiB, not of the message


def block_digests(new: torch.Tensor) -> torch.Tensor:
    """One 64-bit digest per :data:`DIGEST_BLOCK_BYTES` block of the byte buffer ``new`` (the
    last block may be shorter): the wrapping sum of its 8-byte words plus the sum of each
    word times its odd position weight (so a change, or two changes that cancel in the
    sum, moves the digest; a digest, not a hash against an adversary)."""
    if new.data_ptr() % 8 or new.storage_offset() % 8 or not new.is_contiguous():
        new = new.clone(memory_format=torch.contiguous_format)
    nbytes = new.numel()
    blocks = -(-nbytes // DIGEST_BLOCK_BYTES)
    out = torch.empty(blocks, dtype=torch.int64, device=new.device)
    per = DIGEST_BLOCK_BYTES // 8
    weights = torch.arange(1, 2 * per, 2, dtype=torch.int64, device=new.device)
    whole = nbytes // DIGEST_BLOCK_BYTES
    for start in range(0, whole, _DIGEST_CHUNK):
        stop = min(whole, start + _DIGEST_CHUNK)
        words = new[start * DIGEST_BLOCK_BYTES : stop * DIGEST_BLOCK_BYTES].view(torch.int64).view(-1, per)
        out[start:stop] = words.sum(1) + (words * weights).sum(1)
    if whole < blocks:  # the last, shorter block: its bytes zero-padded to whole words
        tail = torch.zeros(DIGEST_BLOCK_BYTES, dtype=torch.uint8, device=new.device)
        tail[: nbytes - whole * DIGEST_BLOCK_BYTES] = new[whole * DIGEST_BLOCK_BYTES :]
        words = tail.view(torch.int64)
        out[whole] = words.sum() + (words * weights).sum()
    return out


def encode_blocks(
    new: torch.Tensor,
    digests: torch.Tensor | None,
    version: int,
    out: torch.Tensor,
    *,
    delta: bool = True,
    spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[Encoded, torch.Tensor]:
    """A digest-only sender's :func:`encode`: the message ``new`` as the
    :data:`DIGEST_BLOCK_BYTES` blocks whose digest differs from ``digests`` (those of the
    version last sent; None: dense), each sent whole after a bitmask of the blocks, or dense
    when that is not cheaper. Returns what was written and the new version's digests (what the
    sender keeps instead of a copy: 8 bytes per block)."""
    nbytes = new.numel()
    body = out[HEADER_BYTES:]
    total = checksum([new[o : o + n] for o, n in spans] if spans is not None else new)
    fresh = block_digests(new)
    blocks = fresh.numel()
    encoding, changed, payload = Encoding.DENSE, blocks, nbytes
    if digests is not None and delta and digests.numel() == blocks:
        moved = (fresh != digests).nonzero().squeeze(1)
        changed = moved.numel()
        head = _aligned(math.ceil(blocks / 8))
        sent = sum(min(DIGEST_BLOCK_BYTES, nbytes - int(b) * DIGEST_BLOCK_BYTES) for b in moved[-1:].tolist())
        size = head + max(0, changed - 1) * DIGEST_BLOCK_BYTES + sent
        if size < nbytes:
            encoding, payload = Encoding.BLOCKS, size
            body[:head].zero_()
            mask = torch.zeros(blocks, dtype=torch.bool, device=new.device)
            mask[moved] = True
            _pack_bits(mask, body[: math.ceil(blocks / 8)])
            _move_blocks(new, moved, body[head : head + size - head], to_message=True)
    if encoding == Encoding.DENSE:
        changed = blocks
        body[:nbytes].copy_(new)
    header = Header(encoding, changed, version, total)
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([int(encoding), changed, version, total]))
    return Encoded(header, HEADER_BYTES + payload), fresh


def _apply_blocks(header: Header, body: torch.Tensor, base: torch.Tensor) -> None:
    """Write a BLOCKS message's blocks into ``base``, after checking it fits: a bitmask whose
    bits are its count of blocks, every block within the base and the message."""
    nbytes = base.numel()
    blocks = -(-nbytes // DIGEST_BLOCK_BYTES)
    head = _aligned(math.ceil(blocks / 8))
    if not 0 <= header.changed <= blocks or head > body.numel():
        raise ValueError(f"corrupt delta message: {header.changed} blocks of a base of {blocks} blocks")
    bits = body[: math.ceil(blocks / 8)]
    if blocks % 8 and int(bits[-1]) >> (blocks % 8):
        raise ValueError(f"corrupt delta message: its bitmask marks a block past the last of a base's {blocks}")
    moved = _unpack_bits(bits, blocks).nonzero().squeeze(1).tolist()
    if len(moved) != header.changed:
        raise ValueError(f"corrupt delta message: its bitmask marks {len(moved)} blocks, its header {header.changed}")
    need = head + sum(min(DIGEST_BLOCK_BYTES, nbytes - b * DIGEST_BLOCK_BYTES) for b in moved)
    if need > body.numel():
        raise ValueError(f"corrupt delta message: its {len(moved)} blocks need {need} bytes, it has {body.numel()}")
    _move_blocks(base, torch.tensor(moved, dtype=torch.int64), body[head:need], to_message=False)


def _move_blocks(storage: torch.Tensor, moved: torch.Tensor, packed: torch.Tensor, *, to_message: bool) -> None:
    """Copy the blocks ``moved`` (ascending) of ``storage`` into ``packed`` one after the
    other (``to_message``), or back: the whole blocks in one gather or scatter, the last,
    shorter block of the storage (if moved) after them."""
    nbytes = storage.numel()
    whole = nbytes // DIGEST_BLOCK_BYTES
    full = moved[moved < whole].to(storage.device)
    blocks = storage[: whole * DIGEST_BLOCK_BYTES].view(whole, DIGEST_BLOCK_BYTES)
    slots = packed[: full.numel() * DIGEST_BLOCK_BYTES].view(-1, DIGEST_BLOCK_BYTES)
    if to_message:
        torch.index_select(blocks, 0, full, out=slots)
    else:
        blocks.index_copy_(0, full, slots)
    if full.numel() < moved.numel():  # the shorter last block
        tail = storage[whole * DIGEST_BLOCK_BYTES :]
        at = full.numel() * DIGEST_BLOCK_BYTES
        if to_message:
            packed[at : at + tail.numel()].copy_(tail)
        else:
            tail.copy_(packed[at : at + tail.numel()])


def read_header(message: torch.Tensor) -> Header:
    """The header of an encoded message (its first :data:`HEADER_BYTES` bytes)."""
    encoding, changed, version, total = (int(v) for v in message[:HEADER_BYTES].view(torch.int64).tolist())
    return Header(Encoding(encoding), changed, version, total)


def apply_patch(message: torch.Tensor, base: torch.Tensor, unit: int) -> Header:
    """Write the encoded ``message`` into ``base`` (uint8: the bytes the receiver holds, the
    sender's previous version for a delta) in place; returns its header. The caller checks
    ``checksum(base) == header.checksum`` where a wrong base must be found. A message that
    does not fit the base (a section past its end, an index past the base, a bitmask whose
    bits are not its count of changes) raises ValueError and leaves ``base`` untouched."""
    header = read_header(message)
    nbytes = base.numel()
    units = nbytes // unit
    body = message[HEADER_BYTES:]
    changed = header.changed
    if header.encoding == Encoding.BLOCKS:
        _apply_blocks(header, body, base)
        return header
    _check_sections(header, nbytes, unit, body.numel())
    if header.encoding == Encoding.DENSE:
        base.copy_(body[:nbytes])
        return header
    if header.encoding == Encoding.BITMASK:
        head = _aligned(math.ceil(units / 8))
    else:
        index_bytes = _index_bytes(units)
        head = _aligned(changed * index_bytes)
    if _kernels(message, base):
        try:
            if header.encoding == Encoding.BITMASK:
                _core.delta_apply_bitmask(
                    base.data_ptr(), nbytes, unit, body.data_ptr(), body.data_ptr() + head, changed
                )
            else:
                _core.delta_apply_indices(
                    base.data_ptr(), nbytes, unit, body.data_ptr(), index_bytes, body.data_ptr() + head, changed
                )
        except _core.CoreError as err:
            raise ValueError(f"corrupt delta message: {err.detail}") from None
        return header
    base_u = _units(base, unit)
    values = body[head : head + changed * unit].view(base_u.dtype)
    if header.encoding == Encoding.BITMASK:
        bits = body[: math.ceil(units / 8)]
        if units % 8 and int(bits[-1]) >> (units % 8):
            raise ValueError(
                f"corrupt delta message: its bitmask marks a change past the last of a base's {units} units"
            )
        mask = _unpack_bits(bits, units)
        marked = int(mask.sum())
        if marked != changed:
            raise ValueError(f"corrupt delta message: its bitmask marks {marked} changes, its message holds {changed}")
        base_u.masked_scatter_(mask, values)
    else:
        index_dtype = torch.int32 if index_bytes == 4 else torch.int64
        where = body[: changed * index_bytes].view(index_dtype).to(torch.int64)
        if changed and not (int(where.min()) >= 0 and int(where.max()) < units):
            bad = int(((where < 0) | (where >= units)).nonzero()[0])
            raise ValueError(
                f"corrupt delta message: change {bad} of a delta is at index {int(where[bad])}, "
                f"not a unit of a base of {units} units"
            )
        base_u[where] = values
    return header


def _check_sections(header: Header, nbytes: int, unit: int, room: int) -> None:
    """Refuse a message whose sections do not fit the ``room`` bytes after its header, or
    whose count of changes is not a count of the base's units."""
    units = nbytes // unit
    if nbytes % unit:
        raise ValueError(f"a base of {nbytes} bytes is not a whole number of {unit}-byte units")
    changed = header.changed
    if header.encoding == Encoding.DENSE:
        need = nbytes
    elif not 0 <= changed <= units:
        raise ValueError(f"corrupt delta message: {changed} changes of a base of {units} units")
    elif header.encoding == Encoding.BITMASK:
        need = _aligned(math.ceil(units / 8)) + changed * unit
    else:
        need = _aligned(changed * _index_bytes(units)) + changed * unit
    if need > room:
        raise ValueError(
            f"corrupt delta message: a {header.encoding.name} message of {changed} changes needs "
            f"{need} bytes after its header, it has {room}"
        )


def _pack_bits(mask: torch.Tensor, out: torch.Tensor) -> None:
    """``mask`` (bool) as bits, least significant first, into ``out`` (uint8)."""
    whole = mask.numel() // 8 * 8
    if whole:
        weights = _BIT_WEIGHTS.to(mask.device)
        out[: whole // 8].copy_((mask[:whole].view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8))
    if whole < mask.numel():
        tail = mask[whole:].to(torch.uint8) * _BIT_WEIGHTS[: mask.numel() - whole].to(mask.device)
        out[whole // 8] = int(tail.sum())


def _unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``bits`` (uint8, least significant first) as bools."""
    return (bits.unsqueeze(1) & _BIT_WEIGHTS.to(bits.device)).ne(0).view(-1)[:count]
