// Kernels of delta refits (layoutlang/runtime/wire_encoding.py): a message compared with the
// copy of it its sender kept, the changes written as indices or as a bitmask and applied to
// a receiver's base, and the checksum a receiver verifies the patched bytes with.
//
//   units      a message is compared in units of its element size (1, 2, 4 or 8 bytes),
//              bit by bit: NaN payloads and the signs of zeros are changes;
//   indices    the changed units' indices, ascending (int32, or int64 past 2^31 units),
//              and their new values, in the same order;
//   bitmask    bit i (least significant first within each byte) set when unit i changed,
//              then the changed units' new values, in order;
//   checksum   of one part: the wrapping int64 sum of its 8-byte words, plus 3 times the
//              sum of the words at even word index, plus the sum of the bytes past the last
//              whole word (as unsigned bytes). Words are read from the part's start (memcpy
//              loads: any address), little-endian.
//
// Every kernel is one pass over its inputs, single-threaded, and writes only the buffers it
// is handed; the caller sizes them (the encoder allocates only when INDICES turns into
// BITMASK). Receivers validate what they read
// before writing anything: a bad message throws CoreValueError (kind "argument") and
// leaves the base untouched. Plain C++: no Python, no torch.
#pragma once

#include <cstdint>

namespace layoutlang {

// The checksum of `nbytes` bytes at `data` (header comment).
int64_t delta_checksum(const uint8_t* data, int64_t nbytes);

// What delta_encode wrote: `encoding` 0 DENSE, 1 BITMASK, 2 INDICES (as the Python
// `Encoding`), the units that changed (every unit for DENSE), the checksum of `fresh`.
struct DeltaEncoded {
  int encoding;
  int64_t changed;
  int64_t checksum;
};

// Compares `fresh` with `kept` (`nbytes` each, a whole number of `unit`-byte units), in one
// pass that also checksums `fresh`, and writes the message's body (what follows the header)
// to `body` (`nbytes` bytes):
//   INDICES  when at most `index_room` units changed: their indices (`index_bytes` 4 or 8
//            each), zeros to the next 16 bytes, their values;
//   BITMASK  when more did but at most `mask_room` (< 0: none): the bitmask, zeros to the
//            next 16 bytes, the values;
//   DENSE    otherwise: every byte of `fresh`.
// The caller picks the rooms so that each encoding is the cheapest where it is written (room
// for `index_room` indices must fit where the bitmask goes). `kept` is made equal to `fresh`
// (the changed units written, or every byte): the base of the next message.
// `fresh` may lie in `rows` rows of nbytes / rows bytes, `row_stride` bytes apart (a region
// of a larger tensor, read where it lies instead of packed first); the message is the rows
// one after the other. More than one row must be whole 8-byte words.
DeltaEncoded delta_encode(const uint8_t* fresh, int64_t rows, int64_t row_stride, uint8_t* kept, int64_t nbytes,
                          int unit, uint8_t* body, int index_bytes, int64_t index_room, int64_t mask_room);

// Writes `count` values to the units of `base` (`nbytes`) at `indices` (`index_bytes` 4 or
// 8 each). Throws, writing nothing, when an index is not a unit of the base.
void delta_apply_indices(uint8_t* base, int64_t nbytes, int unit, const void* indices, int index_bytes,
                         const uint8_t* values, int64_t count);

// Writes `values` to the units of `base` whose bits are set in `mask` (ceil(units / 8)
// bytes); returns how many (`count`). Throws, writing nothing, when a bit past the last unit
// is set or the mask's bits are not `count` (the values the message holds).
int64_t delta_apply_bitmask(uint8_t* base, int64_t nbytes, int unit, const uint8_t* mask, const uint8_t* values,
                            int64_t count);

}  // namespace layoutlang
