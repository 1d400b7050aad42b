"""Wire encodings of delta refits (layoutlang/runtime/wire_encoding.py): every encoding
restores the sender's bytes exactly, bit for bit (NaN payloads and signed zeros included),
the cheapest one is chosen, and no message is encoded past its dense bytes plus the header.

Host tensors go through the C++ kernels (csrc/delta.hpp), others through torch: the tests
run on both paths (``path``: the torch one forced on host tensors), and the two write the
same bytes and checksums for every unit, odd lengths and unaligned starts. A corrupt
message is refused before the base is touched."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layoutlang.core import _core
from layoutlang.runtime import wire_encoding
from layoutlang.runtime.wire_encoding import (
    HEADER_BYTES,
    Encoding,
    apply_patch,
    capacity,
    changed_units,
    checksum,
    encode,
    read_header,
)

pytestmark = pytest.mark.timeout(60)

DENSITIES = (0.0, 1e-4, 1e-2, 0.1, 0.5, 1.0)


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    """Host tensors through the C++ kernels, or through torch as CUDA tensors go."""
    monkeypatch.setattr(wire_encoding, "_KERNELS", request.param == "kernels")
    return request.param


def changed_copy(old: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """``old`` (a float tensor) with a ``density`` fraction of its elements changed, a third of
    them into NaNs with another payload or zeros of the other sign: bits, not values."""
    generator = torch.Generator().manual_seed(seed)
    new = old.clone()
    count = round(density * old.numel())
    where = torch.randperm(old.numel(), generator=generator)[:count]
    flat = new.view(-1)
    flat[where] = flat[where] + 1.0 + torch.rand(count, generator=generator).to(old.dtype)
    bits = flat.view({2: torch.int16, 4: torch.int32}[old.element_size()])
    third = where[: count // 3]
    sign = torch.tensor(-(2 ** (8 * old.element_size() - 1)), dtype=bits.dtype)
    bits[third] = bits[third] ^ sign  # a flipped sign bit: -0.0 for +0.0, another NaN's sign
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("density", DENSITIES)
def test_every_density_is_restored_bit_for_bit_at_no_more_than_dense_bytes(dtype, density, path):
    generator = torch.Generator().manual_seed(7)
    old = torch.randn(40_000, generator=generator).to(dtype)
    old[:100] = float("nan")
    old[100:200] = 0.0
    old[200:300] = -0.0
    new = changed_copy(old, density, seed=11)
    unit = old.element_size()
    kept = old.view(torch.uint8).clone()  # the sender's copy of what it sent last
    base = old.view(torch.uint8).clone()  # what the receiver holds
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encoded = encode(new.view(torch.uint8), kept, unit, version=5, out=out)
    assert torch.equal(kept, new.view(torch.uint8))  # the kept copy is the new version now
    header = apply_patch(out[: encoded.nbytes], base, unit)
    assert torch.equal(base, new.view(torch.uint8))
    assert header == encoded.header and header.version == 5
    assert checksum(base) == header.checksum
    bits = {2: torch.int16, 4: torch.int32}[unit]
    changed = int((new.view(bits) != old.view(bits)).sum())
    dense = old.numel() * unit
    assert encoded.nbytes <= dense + HEADER_BYTES
    if header.encoding != Encoding.DENSE:
        assert header.changed == changed
    # the choice is the cheapest of the three
    costs = {
        Encoding.DENSE: dense,
        Encoding.BITMASK: -(-math.ceil(old.numel() / 8) // 16) * 16 + changed * unit,
        Encoding.INDICES: -(-changed * 4 // 16) * 16 + changed * unit,
    }
    assert encoded.nbytes - HEADER_BYTES == min(costs.values())
    if density == 0.0:
        assert header.encoding == Encoding.INDICES and encoded.nbytes == HEADER_BYTES
    if density >= 0.99:
        assert header.encoding == Encoding.DENSE


def test_a_sign_flip_of_zero_and_a_nan_payload_are_changes(path):
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 1000, dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int32)[1] = new.view(torch.int32)[1] ^ 1  # another NaN
    assert new[0] == old[0] and new[1].isnan() and old[1].isnan()  # equal values, other bits
    kept = old.view(torch.uint8).clone()
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encoded = encode(new.view(torch.uint8), kept, 4, 1, out)
    assert encoded.header.changed == 2 and encoded.header.encoding == Encoding.INDICES
    base = old.view(torch.uint8).clone()
    apply_patch(out, base, 4)
    assert torch.equal(base, new.view(torch.uint8))


def test_without_a_base_or_a_kept_copy_the_message_is_dense_and_the_copy_is_refreshed(path):
    old = torch.arange(4096, dtype=torch.int16)
    new = old.flip(0).contiguous()
    kept = old.view(torch.uint8).clone()
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encoded = encode(new.view(torch.uint8), kept, 2, 3, out, delta=False)  # the receiver has no base
    assert encoded.header.encoding == Encoding.DENSE and encoded.nbytes == HEADER_BYTES + 8192
    assert torch.equal(kept, new.view(torch.uint8))
    encoded = encode(new.view(torch.uint8), None, 2, 4, out)
    assert read_header(out).encoding == Encoding.DENSE and read_header(out).version == 4
    fresh = torch.zeros(8192, dtype=torch.uint8)  # a receiver with nothing: dense fills it whole
    apply_patch(out, fresh, 2)
    assert torch.equal(fresh, new.view(torch.uint8))


def test_a_wrong_base_is_found_by_the_checksum(path):
    old = torch.randn(10_000)
    new = changed_copy(old, 1e-3, seed=3)
    kept = old.view(torch.uint8).clone()
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encode(new.view(torch.uint8), kept, 4, 2, out)
    base = old.view(torch.uint8).clone()
    base[4000] ^= 0x10  # someone else wrote the receiver's storage
    header = apply_patch(out, base, 4)
    assert checksum(base) != header.checksum


def test_odd_sizes_and_units(path):
    for n in (1, 7, 8, 9, 63, 65, 1001):
        old = torch.randint(0, 255, (n,), dtype=torch.uint8)
        new = old.clone()
        new[n // 2] ^= 1
        kept = old.clone()
        out = torch.empty(capacity(n), dtype=torch.uint8)
        encode(new, kept, 1, 1, out)
        base = old.clone()
        header = apply_patch(out, base, 1)
        assert torch.equal(base, new) and header.checksum == checksum(new)
    with pytest.raises(ValueError, match="whole number of 4-byte units"):
        encode(torch.zeros(6, dtype=torch.uint8), None, 4, 1, torch.empty(64, dtype=torch.uint8))


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("offset", [0, 8])
def test_changes_found_by_words_are_the_changes_found_unit_by_unit(unit, offset):
    generator = torch.Generator().manual_seed(unit)
    storage = torch.randint(0, 255, (offset + 8 * 1001 + unit * 3,), dtype=torch.uint8, generator=generator)
    kept_storage = storage.clone()
    flips = torch.randint(0, storage.numel(), (500,), generator=generator)
    storage[flips] ^= 0x40
    start = offset + (unit if offset else 0)  # an unaligned start (by whole units) when offset is 8
    new, kept = storage[start:], kept_storage[start:]
    length = new.numel() // unit * unit
    new, kept = new[:length], kept[:length]
    by_units = (new.view(torch.uint8).view(-1, unit) != kept.view(-1, unit)).any(1).nonzero().squeeze(1)
    assert torch.equal(changed_units(new, kept, unit), by_units)
    # the C++ encoder finds the same units (int32 or int64 indices, or a bitmask: room for
    # fewer indices turns those found into one), writes their new values, checksums `new`
    # as checksum() does, and leaves the kept copy equal to `new`
    count, units = by_units.numel(), length // unit
    expected = np.zeros(units, dtype=bool)
    expected[by_units.numpy()] = True
    mask_head = -(-math.ceil(units / 8) // 16) * 16
    fewer = min(count - 1, mask_head // 4)  # indices that fit where the bitmask goes
    for index_dtype, index_room, mask_room in (
        (torch.int32, count, -1), (torch.int64, count, -1), (torch.int32, fewer, length)
    ):
        old = kept.clone()
        body = torch.full((length,), 0xAB, dtype=torch.uint8)
        encoding, changed, total = _core.delta_encode(
            new.data_ptr(), 1, length, old.data_ptr(), length, unit, body.data_ptr(), index_dtype.itemsize,
            index_room, mask_room,
        )
        assert (changed, total) == (count, checksum(new))
        assert torch.equal(old, new)
        if index_room == count:
            head = -(-count * index_dtype.itemsize // 16) * 16
            assert encoding == 2
            assert torch.equal(body[: count * index_dtype.itemsize].view(index_dtype).to(torch.int64), by_units)
            assert not body[count * index_dtype.itemsize : head].any()
        else:
            head = mask_head
            assert encoding == 1
            assert body[: math.ceil(units / 8)].numpy().tobytes() == np.packbits(expected, bitorder="little").tobytes()
            assert not body[math.ceil(units / 8) : head].any()
        assert torch.equal(body[head : head + count * unit].view(-1, unit), new.view(-1, unit)[by_units])
    # past both rooms: every byte, to the body and the kept copy
    old = kept.clone()
    body = torch.zeros(length, dtype=torch.uint8)
    encoding, changed, total = _core.delta_encode(
        new.data_ptr(), 1, length, old.data_ptr(), length, unit, body.data_ptr(), 4, fewer, count - 1
    )
    assert (encoding, changed, total) == (0, units, checksum(new))
    assert torch.equal(body, new) and torch.equal(old, new)


def random_pair(unit: int, units: int, start: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new, kept)``: ``units`` random units from ``start`` bytes into their storages, a
    ``density`` fraction of them changed (in one byte each, any bit of it)."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randint(0, 256, (start + units * unit,), dtype=torch.uint8, generator=generator)
    new = kept.clone()
    count = round(density * units)
    where = torch.randperm(units, generator=generator)[:count]
    byte = start + where * unit + torch.randint(0, unit, (count,), generator=generator)
    new[byte] ^= torch.randint(1, 256, (count,), dtype=torch.uint8, generator=generator)
    return new[start:], kept[start:]


def unaligned_clone(tensor: torch.Tensor, start: int) -> torch.Tensor:
    """A copy of a byte tensor that starts ``start`` bytes into a fresh storage."""
    storage = torch.empty(start + tensor.numel(), dtype=torch.uint8)
    storage[start:].copy_(tensor)
    return storage[start:]


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("units", [1, 7, 63, 64, 65, 1000, 4099, 40_001])
def test_the_kernels_and_torch_write_the_same_messages(unit, units, monkeypatch):
    seed = 0
    for start in sorted({0, 1, unit, 3 * unit + 8}):  # starts off 8 and 16 bytes, and one off the unit
        for density in (0.0, 1e-3, 0.02, 0.1, 0.5, 1.0):
            seed += 1
            new, kept = random_pair(unit, units, start, density, seed)
            messages = {}
            for path in ("kernels", "torch"):
                monkeypatch.setattr(wire_encoding, "_KERNELS", path == "kernels")
                # torch views a buffer as units only from a start on a whole unit
                at = start if path == "kernels" or start % unit == 0 else 0
                fresh, copy = unaligned_clone(new, at), unaligned_clone(kept, at)
                out = torch.full((capacity(new.numel()),), 0xA5 if path == "torch" else 0x5A, dtype=torch.uint8)
                encoded = encode(fresh, copy, unit, 9, out, spans=[(0, unit), (unit, new.numel() - unit)])
                assert torch.equal(copy, new)  # the kept copy is the new version now
                assert torch.equal(fresh, new)  # and the message was only read
                base = unaligned_clone(kept, at)
                assert apply_patch(out[: encoded.nbytes], base, unit) == encoded.header
                assert torch.equal(base, new)
                messages[path] = (encoded, out[: encoded.nbytes].clone())
            assert messages["kernels"][0] == messages["torch"][0], (start, density)
            assert torch.equal(messages["kernels"][1], messages["torch"][1]), (start, density)


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("row_bytes", [8, 24, 256, 264, 1032])  # rows of an odd and an even count of words
def test_a_region_read_where_it_lies_is_encoded_as_its_packed_copy(unit, row_bytes, monkeypatch):
    """The C++ encoder reads a strided region (rows of a larger tensor) in place: the same
    message, header and checksum as the region packed first, by the kernels and by torch."""
    generator = torch.Generator().manual_seed(unit * row_bytes)
    seed = 0
    for rows in (2, 5, 70):
        for density in (0.0, 1e-3, 0.02, 0.5, 1.0):
            seed += 1
            storage = torch.randint(0, 256, (rows, row_bytes + 3 * unit + 16), dtype=torch.uint8, generator=generator)
            region = storage[:, 2 * unit : 2 * unit + row_bytes]
            packed = region.reshape(-1).clone()
            kept = packed.clone()
            count = round(density * packed.numel() // unit)
            where = torch.randperm(packed.numel() // unit, generator=generator)[:count]
            kept.view(-1, unit)[where, 0] ^= 0x10
            results = []
            for path, message in (("kernels", region), ("kernels", packed), ("torch", region)):
                monkeypatch.setattr(wire_encoding, "_KERNELS", path == "kernels")
                copy = kept.clone()
                out = torch.zeros(capacity(packed.numel()), dtype=torch.uint8)
                encoded = encode(message, copy, unit, 5, out, spans=[(0, packed.numel())])
                assert torch.equal(copy, packed), (path, rows, density)
                results.append((encoded, out[: encoded.nbytes]))
                base = kept.clone()
                apply_patch(out[: encoded.nbytes], base, unit)
                assert torch.equal(base, packed)
            for encoded, message in results[1:]:
                assert encoded == results[0][0], (rows, density)
                assert torch.equal(message, results[0][1]), (rows, density)
            assert results[0][0].header.checksum == checksum(packed)


def reference_checksum(data: bytes) -> int:
    """The checksum of one part by its definition, in Python integers."""
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data) // 8 * 8, 8)]
    total = sum(words) + 3 * sum(words[::2]) + sum(data[len(data) // 8 * 8 :])
    return (total + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 1000, 4097, 100_003])
def test_the_kernels_and_torch_checksum_alike(length, monkeypatch):
    generator = torch.Generator().manual_seed(length)
    storage = torch.randint(0, 256, (length + 8,), dtype=torch.uint8, generator=generator)
    if length == 1000:
        storage.fill_(0xFF)  # every sum wraps; tail bytes count as unsigned
    for start in range(8):
        part = storage[start : start + length]
        sums = {}
        for path in ("kernels", "torch"):
            monkeypatch.setattr(wire_encoding, "_KERNELS", path == "kernels")
            sums[path] = (checksum(part), checksum([storage[:start], part, storage[start + length :]]))
        assert sums["kernels"] == sums["torch"], start
        if length <= 4097:
            assert sums["kernels"][0] == reference_checksum(part.numpy().tobytes())


def corrupt(message: torch.Tensor, units: int, how: str) -> None:
    """Spoil an encoded message (float32 units) in place, as ``how`` says."""
    header = read_header(message)
    body = message[HEADER_BYTES:]
    if how == "index past the base":
        body[:8].view(torch.int32)[1] = units
    elif how == "negative index":
        body[:4].view(torch.int32)[0] = -1
    elif how == "bit past the last unit":
        body[math.ceil(units / 8) - 1] |= 0x80
    elif how == "a bit more than its count":
        bits = body[: math.ceil(units / 8)]
        free = int((bits[:-1] != 0xFF).nonzero()[0])
        bits[free] |= ~bits[free]  # every unit of that byte marked
    elif how == "more changes than units":
        message[8:16].view(torch.int64)[0] = units + 1
    elif how == "sections past the message":
        message[8:16].view(torch.int64)[0] = header.changed + 100
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    ("density", "how"),
    [
        (1e-3, "index past the base"),
        (1e-3, "negative index"),
        (1e-3, "more changes than units"),
        (1e-3, "sections past the message"),
        (0.1, "bit past the last unit"),
        (0.1, "a bit more than its count"),
        (0.1, "sections past the message"),
    ],
)
def test_a_corrupt_message_is_refused_and_the_base_untouched(density, how, path):
    old = torch.randn(4099)  # the last byte of a bitmask holds 3 units
    new = changed_copy(old, density, seed=5)
    kept = old.view(torch.uint8).clone()
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encoded = encode(new.view(torch.uint8), kept, 4, 1, out)
    assert encoded.header.encoding == (Encoding.INDICES if density < 0.01 else Encoding.BITMASK)
    corrupt(out, 4099, how)
    base = old.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="corrupt delta message"):
        apply_patch(out[: encoded.nbytes], base, 4)
    assert torch.equal(base, old.view(torch.uint8))


def test_the_kernels_refuse_bad_arguments():
    buffer = torch.zeros(64, dtype=torch.uint8)
    at = buffer.data_ptr()
    with pytest.raises(_core.CoreError, match="1, 2, 4 or 8 bytes"):
        _core.delta_encode(at, 1, 12, at, 12, 3, at, 4, 0, 4)
    with pytest.raises(_core.CoreError, match="does not fit where the bitmask goes"):
        _core.delta_encode(at, 1, 64, at, 64, 4, at, 4, 5, 4)
    with pytest.raises(_core.CoreError, match="not 3 rows of whole 8-byte words"):
        _core.delta_encode(at, 3, 64, at, 60, 4, at, 4, 0, 4)
    with pytest.raises(_core.CoreError, match="whole number of 4-byte units"):
        _core.delta_apply_bitmask(at, 6, 4, at, at, 0)
    with pytest.raises(_core.CoreError, match="an index is 4 or 8 bytes"):
        _core.delta_apply_indices(at, 64, 4, at, 2, at, 0)
    with pytest.raises(_core.CoreError, match="index 16, not a unit of a base of 16 units"):
        indices = torch.tensor([3, 16], dtype=torch.int64)
        _core.delta_apply_indices(at, 64, 4, indices.data_ptr(), 8, at, 2)
    assert not buffer.any()


# ----------------------------------------------------------------- digest-only senders


def test_a_digest_only_sender_sends_the_changed_blocks_whole_and_the_receiver_is_exact():
    from layoutlang.runtime.wire_encoding import DIGEST_BLOCK_BYTES, block_digests, encode_blocks

    generator = torch.Generator().manual_seed(5)
    old = torch.randint(0, 255, (10 * DIGEST_BLOCK_BYTES + 1001,), dtype=torch.uint8, generator=generator)
    new = old.clone()
    new[5] ^= 1  # block 0
    new[3 * DIGEST_BLOCK_BYTES + 17] ^= 0x80  # block 3
    new[-1] ^= 4  # the last, shorter block
    out = torch.empty(capacity(new.numel()), dtype=torch.uint8)
    encoded, digests = encode_blocks(new, block_digests(old), 9, out)
    assert encoded.header.encoding == Encoding.BLOCKS and encoded.header.changed == 3
    assert encoded.nbytes == HEADER_BYTES + 16 + 2 * DIGEST_BLOCK_BYTES + 1001
    assert torch.equal(digests, block_digests(new))
    base = old.clone()
    header = apply_patch(out[: encoded.nbytes], base, 1)
    assert torch.equal(base, new) and header.version == 9 and checksum(base) == header.checksum
    # no digests kept (or the receiver holds no base): dense, every byte
    encoded, _ = encode_blocks(new, None, 10, out)
    assert encoded.header.encoding == Encoding.DENSE and encoded.nbytes == HEADER_BYTES + new.numel()
    fresh = torch.zeros_like(new)
    apply_patch(out, fresh, 1)
    assert torch.equal(fresh, new)
    # every block changed: dense is cheaper than the bitmask and all the blocks
    encoded, _ = encode_blocks(torch.bitwise_not(new), digests, 11, out)
    assert encoded.header.encoding == Encoding.DENSE


def test_changes_that_cancel_in_a_sum_still_move_the_digest():
    from layoutlang.runtime.wire_encoding import block_digests

    old = torch.zeros(8192, dtype=torch.uint8)
    new = old.clone()
    words = new.view(torch.int64)
    words[3] += 1000
    words[70] -= 1000  # the block's sum of words is unchanged
    assert not torch.equal(block_digests(old), block_digests(new))


def test_a_blocks_message_that_does_not_fit_its_base_is_refused_and_the_base_untouched():
    from layoutlang.runtime.wire_encoding import DIGEST_BLOCK_BYTES, block_digests, encode_blocks

    old = torch.arange(3 * DIGEST_BLOCK_BYTES, dtype=torch.int64).to(torch.uint8)
    new = old.clone()
    new[DIGEST_BLOCK_BYTES] ^= 1
    out = torch.empty(capacity(new.numel()), dtype=torch.uint8)
    encoded, _ = encode_blocks(new, block_digests(old), 1, out)
    message = out[: encoded.nbytes].clone()
    message[8:16].view(torch.int64)[0] = 2  # the header claims two blocks, its bitmask one
    base = old.clone()
    with pytest.raises(ValueError, match="corrupt delta message: its bitmask marks 1 blocks, its header 2"):
        apply_patch(message, base, 1)
    assert torch.equal(base, old)
    with pytest.raises(ValueError, match="corrupt delta message"):
        apply_patch(out[: encoded.nbytes], torch.zeros(DIGEST_BLOCK_BYTES // 2, dtype=torch.uint8), 1)
