"""Wire encodings of delta refits (layoutlang/runtime/wire_encoding.py): every encoding
restores the sender's bytes exactly, bit for bit (NaN payloads and signed zeros included),
the cheapest one is chosen, and no message is encoded past its dense bytes plus the header."""

from __future__ import annotations

import math

import pytest
import torch

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
def test_every_density_is_restored_bit_for_bit_at_no_more_than_dense_bytes(dtype, density):
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


def test_a_sign_flip_of_zero_and_a_nan_payload_are_changes():
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


def test_without_a_base_or_a_kept_copy_the_message_is_dense_and_the_copy_is_refreshed():
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


def test_a_wrong_base_is_found_by_the_checksum():
    old = torch.randn(10_000)
    new = changed_copy(old, 1e-3, seed=3)
    kept = old.view(torch.uint8).clone()
    out = torch.empty(capacity(kept.numel()), dtype=torch.uint8)
    encode(new.view(torch.uint8), kept, 4, 2, out)
    base = old.view(torch.uint8).clone()
    base[4000] ^= 0x10  # someone else wrote the receiver's storage
    header = apply_patch(out, base, 4)
    assert checksum(base) != header.checksum


def test_odd_sizes_and_units():
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
