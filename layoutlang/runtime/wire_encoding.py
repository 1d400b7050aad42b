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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs
import torch

__all__ = [
    "HEADER_BYTES",
    "MIN_DELTA_BYTES",
    "Encoded",
    "Encoding",
    "Header",
    "apply_patch",
    "capacity",
    "changed_units",
    "checksum",
    "encode",
    "read_header",
]

#: the header of an encoded message: encoding, changed units, version, checksum (int64 each)
HEADER_BYTES = 32
#: messages shorter than this travel dense with no header: the header would cost over 1%
MIN_DELTA_BYTES = 100 * HEADER_BYTES
_ALIGN = 16  # every part of an encoded message starts aligned, so typed views are legal
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class Encoding(enum.IntEnum):
    DENSE = 0
    BITMASK = 1
    INDICES = 2


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
    total = 0
    for i, part in enumerate(buffer):
        if part.data_ptr() % 8:
            part = part.clone()  # a typed view needs an aligned start
        whole = part.numel() // 8 * 8
        words = part[:whole].view(torch.int64)
        one = int(words.sum()) + 3 * int(words[::2].sum()) + int(part[whole:].to(torch.int64).sum())
        total += (2 * i + 1) * one
    return (total + 2**63) % 2**64 - 2**63


def _choose(units: int, changed: int, unit: int) -> tuple[Encoding, int]:
    """The cheapest encoding of ``changed`` of ``units`` units, and its bytes after the header."""
    index_bytes = 4 if units < 2**31 else 8
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
    against ``kept`` (the bytes last sent), and make ``kept`` equal ``new``. Dense when there
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
    total = checksum([new[o : o + n] for o, n in spans] if spans is not None else new)
    encoding, changed, payload = Encoding.DENSE, units, nbytes
    where: torch.Tensor | None = None
    if kept is not None and delta:
        where = changed_units(new, kept, unit)
        changed = where.numel()
        encoding, payload = _choose(units, changed, unit)
    if encoding == Encoding.DENSE:
        body[:nbytes].copy_(new)
        if kept is not None:
            kept.copy_(new)
    else:
        assert where is not None
        values = _units(new, unit)[where]
        if encoding == Encoding.BITMASK:
            head = _aligned(math.ceil(units / 8))
            body[:head].zero_()
            mask = torch.zeros(units, dtype=torch.bool)
            mask[where] = True
            _pack_bits(mask, body[: math.ceil(units / 8)])
        else:
            index_dtype = torch.int32 if units < 2**31 else torch.int64
            head = _aligned(changed * index_dtype.itemsize)
            body[: changed * index_dtype.itemsize].view(index_dtype).copy_(where)
        body[head : head + changed * unit].view(values.dtype).copy_(values)
        assert kept is not None
        _units(kept, unit)[where] = values
    header = Header(encoding, changed, version, total)
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([int(encoding), changed, version, total]))
    return Encoded(header, HEADER_BYTES + payload)


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
            found.append((words.unsqueeze(1) * per + torch.arange(per)).masked_select(differ))
    if whole < nbytes:
        tail = (_units(new[whole:], unit) != _units(kept[whole:], unit)).nonzero().squeeze(1)
        found.append(tail + whole // unit)
    return torch.cat(found) if len(found) > 1 else found[0] if found else torch.zeros(0, dtype=torch.int64)


def read_header(message: torch.Tensor) -> Header:
    """The header of an encoded message (its first :data:`HEADER_BYTES` bytes)."""
    encoding, changed, version, total = (int(v) for v in message[:HEADER_BYTES].view(torch.int64).tolist())
    return Header(Encoding(encoding), changed, version, total)


def apply_patch(message: torch.Tensor, base: torch.Tensor, unit: int) -> Header:
    """Write the encoded ``message`` into ``base`` (uint8: the bytes the receiver holds, the
    sender's previous version for a delta) in place; returns its header. The caller checks
    ``checksum(base) == header.checksum`` where a wrong base must be found."""
    header = read_header(message)
    nbytes = base.numel()
    units = nbytes // unit
    body = message[HEADER_BYTES:]
    changed = header.changed
    if header.encoding == Encoding.DENSE:
        base.copy_(body[:nbytes])
        return header
    base_u = _units(base, unit)
    if header.encoding == Encoding.BITMASK:
        head = _aligned(math.ceil(units / 8))
        mask = _unpack_bits(body[: math.ceil(units / 8)], units)
        values = body[head : head + changed * unit].view(base_u.dtype)
        base_u.masked_scatter_(mask, values)
    else:
        index_dtype = torch.int32 if units < 2**31 else torch.int64
        head = _aligned(changed * index_dtype.itemsize)
        where = body[: changed * index_dtype.itemsize].view(index_dtype).to(torch.int64)
        base_u[where] = body[head : head + changed * unit].view(base_u.dtype)
    return header


def _pack_bits(mask: torch.Tensor, out: torch.Tensor) -> None:
    """``mask`` (bool) as bits, least significant first, into ``out`` (uint8)."""
    whole = mask.numel() // 8 * 8
    if whole:
        out[: whole // 8].copy_((mask[:whole].view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS).sum(1, dtype=torch.uint8))
    if whole < mask.numel():
        tail = mask[whole:].to(torch.uint8) * _BIT_WEIGHTS[: mask.numel() - whole]
        out[whole // 8] = int(tail.sum())


def _unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``bits`` (uint8, least significant first) as bools."""
    return (bits.unsqueeze(1) & _BIT_WEIGHTS).ne(0).view(-1)[:count]
