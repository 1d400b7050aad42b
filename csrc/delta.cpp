#include "delta.hpp"

#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "shard_math.hpp"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the delta kernels read units out of 8-byte words as a little-endian machine lays them out"
#endif

namespace layoutlang {

namespace {

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, sizeof v); }

template <typename I>
inline I load_index(const uint8_t* indices, int64_t i) {
  I v;
  std::memcpy(&v, indices + i * static_cast<int64_t>(sizeof(I)), sizeof v);
  return v;
}

template <typename I>
inline void store_index(uint8_t* indices, int64_t i, int64_t v) {
  const I w = static_cast<I>(v);
  std::memcpy(indices + i * static_cast<int64_t>(sizeof(I)), &w, sizeof w);
}

// Bit j set when unit j of the word `x` (the xor of two words) is not zero; no branches.
template <int U>
inline uint64_t unit_bits(uint64_t x) {
  if constexpr (U == 8) {
    return x != 0;
  } else if constexpr (U == 4) {
    return static_cast<uint64_t>((x & 0xffffffffu) != 0) | static_cast<uint64_t>((x >> 32) != 0) << 1;
  } else if constexpr (U == 2) {
    // bit 0 of each 16-bit lane: the or of the lane's bits; then the lanes' bits gathered
    // into bits 48..51 by one multiplication (every product lands on a bit of its own)
    uint64_t t = x | (x >> 8);
    t |= t >> 4;
    t |= t >> 2;
    t |= t >> 1;
    return ((t & 0x0001000100010001u) * 0x0001000200040008u) >> 48;
  } else {
    uint64_t t = x | (x >> 4);  // bit 0 of each byte: the or of the byte's bits
    t |= t >> 2;
    t |= t >> 1;
    return ((t & 0x0101010101010101u) * 0x0102040810204080u) >> 56;
  }
}

// The 64 units from `a` and `b` (64 * U bytes each), compared: a group of units is one word
// of a bitmask, and the step of the encoder's scan.
template <int U>
struct Group {
  static constexpr int kPer = 8 / U;     // units per word
  static constexpr int kWords = 8 * U;   // words per group

  // Bit j set when unit j differs.
  static uint64_t bits(const uint8_t* a, const uint8_t* b) {
#if defined(__SSE2__)
    // 16 bytes at a time: the lanes' equality as a mask (what x86-64 always has)
    uint64_t equal = 0;
    for (int v = 0; v < 4 * U; ++v) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * v));
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v));
      uint64_t lanes;
      if constexpr (U == 1) {
        lanes = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)));
      } else if constexpr (U == 2) {
        const __m128i e = _mm_cmpeq_epi16(x, y);
        lanes = static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(e, e))) & 0xffu;
      } else if constexpr (U == 4) {
        lanes = static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, y))));
      } else {
        __m128i e = _mm_cmpeq_epi32(x, y);
        e = _mm_and_si128(e, _mm_shuffle_epi32(e, _MM_SHUFFLE(2, 3, 0, 1)));  // both halves equal
        lanes = static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(e)));
      }
      equal |= lanes << (v * (16 / U));
    }
    return ~equal;
#else
    uint64_t bits = 0;
    for (int k = 0; k < kWords; ++k) bits |= unit_bits<U>(load64(a + 8 * k) ^ load64(b + 8 * k)) << (k * kPer);
    return bits;
#endif
  }
};

void check_message(int64_t nbytes, int unit) {
  if (unit != 1 && unit != 2 && unit != 4 && unit != 8) {
    throw CoreValueError("argument", "a unit is 1, 2, 4 or 8 bytes, not " + std::to_string(unit));
  }
  if (nbytes < 0 || nbytes % unit != 0) {
    throw CoreValueError("argument", "a message of " + std::to_string(nbytes) + " bytes is not a whole number of " +
                                         std::to_string(unit) + "-byte units");
  }
}

void check_index_bytes(int index_bytes) {
  if (index_bytes != 4 && index_bytes != 8) {
    throw CoreValueError("argument", "an index is 4 or 8 bytes, not " + std::to_string(index_bytes));
  }
}

void check_count(const char* what, int64_t n) {
  if (n < 0) throw CoreValueError("argument", std::string(what) + " is negative: " + std::to_string(n));
}

// The checksum of csrc/delta.hpp, summed as a scan reads the words: the words at even and
// at odd word index apart (a part's first word is even).
struct ChecksumSums {
  uint64_t even = 0;
  uint64_t odd = 0;
};

// Visits the changes of `fresh` against `kept` (`units` units each) and sums `fresh` for its
// checksum in the same pass: on_group(g, bits) for every group of 64 units that differs
// (bits: the units that differ), then on_unit(u) for each differing unit after the last whole
// group. A visitor returns false to stop the scan: scan_changes then returns false (and the
// sums are of the groups read so far).
template <int U, typename OnGroup, typename OnUnit>
bool scan_changes(const uint8_t* fresh, const uint8_t* kept, int64_t units, ChecksumSums& sums, OnGroup on_group,
                  OnUnit on_unit) {
  const int64_t groups = units / 64;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* a = fresh + g * 64 * U;
    const uint8_t* b = kept + g * 64 * U;
    uint64_t any = 0;
    for (int k = 0; k < Group<U>::kWords; k += 2) {  // a group is an even number of words
      const uint64_t even = load64(a + 8 * k);
      const uint64_t odd = load64(a + 8 * k + 8);
      sums.even += even;
      sums.odd += odd;
      any |= (even ^ load64(b + 8 * k)) | (odd ^ load64(b + 8 * k + 8));
    }
    if (any != 0 && !on_group(g, Group<U>::bits(a, b))) return false;
  }
  for (int64_t u = groups * 64; u < units; ++u) {  // the last units, fewer than 64
    if (std::memcmp(fresh + u * U, kept + u * U, U) != 0 && !on_unit(u)) return false;
  }
  return true;
}

constexpr int64_t kAlign = 16;  // every section of an encoded message starts on 16 bytes

inline int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Adds `words` whole words at `p` to `sums`, the first at an even word index.
void sum_words(const uint8_t* p, int64_t words, ChecksumSums& sums) {
  int64_t w = 0;
  for (; w + 1 < words; w += 2) {
    sums.even += load64(p + 8 * w);
    sums.odd += load64(p + 8 * w + 8);
  }
  if (w < words) sums.even += load64(p + 8 * w);
}

// delta_encode for one unit size (delta.hpp): INDICES while the changes fit `index_room`,
// then the indices found so far turned into a bitmask and BITMASK while they fit
// `mask_room`, then DENSE. The message is `rows` rows of `nbytes / rows` bytes, `row_stride`
// bytes apart in `fresh` and one after the other everywhere else.
template <int U>
DeltaEncoded encode(const uint8_t* fresh, int64_t rows, int64_t row_stride, uint8_t* kept, int64_t nbytes,
                    uint8_t* body, int index_bytes, int64_t index_room, int64_t mask_room) {
  const int64_t units = nbytes / U;
  const int64_t row_bytes = nbytes / rows;
  const int64_t row_units = row_bytes / U;
  const int64_t mask_bytes = (units + 7) / 8;
  const int64_t mask_head = aligned(mask_bytes);
  const int64_t spare = aligned(index_room * index_bytes);  // INDICES' values wait after room for every index
  bool as_mask = index_room < 0;
  uint8_t* values = body + (as_mask ? mask_head : spare);
  if (as_mask) std::memset(body, 0, static_cast<std::size_t>(mask_head));
  int64_t count = 0;
  auto set_bit = [&](int64_t u) { body[u / 8] |= static_cast<uint8_t>(1u << (u % 8)); };
  auto to_mask = [&] {  // the indices so far become bits; their values move after the mask
    std::vector<int64_t> found(static_cast<std::size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      found[static_cast<std::size_t>(i)] =
          index_bytes == 4 ? load_index<int32_t>(body, i) : load_index<int64_t>(body, i);
    }
    std::memmove(body + mask_head, body + spare, static_cast<std::size_t>(count * U));
    std::memset(body, 0, static_cast<std::size_t>(mask_head));
    for (const int64_t u : found) set_bit(u);
    values = body + mask_head;
    as_mask = true;
  };
  // unit `u` of the message, whose bytes are at `at` in `fresh`
  auto add = [&](int64_t u, const uint8_t* at) {
    if (!as_mask && count == index_room) {
      if (mask_room < 0) return false;
      to_mask();
    }
    if (as_mask) {
      if (count == mask_room) return false;
      set_bit(u);
    } else if (index_bytes == 4) {
      store_index<int32_t>(body, count, u);
    } else {
      store_index<int64_t>(body, count, u);
    }
    std::memcpy(values + count * U, at, U);
    std::memcpy(kept + u * U, at, U);  // the kept copy becomes what is sent, as the base does
    ++count;
    return true;
  };
  uint64_t total = 0;  // the checksum, wrapping
  bool fits = true;
  for (int64_t r = 0; r < rows && fits; ++r) {
    const uint8_t* row = fresh + r * row_stride;
    const int64_t first = r * row_units;
    ChecksumSums row_sums;
    fits = scan_changes<U>(
        row, kept + first * U, row_units, row_sums,
        [&](int64_t g, uint64_t bits) {
          for (uint64_t rest = bits; rest != 0; rest &= rest - 1) {
            const int64_t u = g * 64 + __builtin_ctzll(rest);
            if (!add(first + u, row + u * U)) return false;
          }
          return true;
        },
        [&](int64_t u) { return add(first + u, row + u * U); });
    const int64_t whole = row_units / 64 * 64 * U;  // the groups' bytes: an even number of words
    if (rows == 1) {  // one row of any length: its tail's bytes as delta_checksum sums them
      total += 4 * row_sums.even + row_sums.odd + static_cast<uint64_t>(delta_checksum(row + whole, row_bytes - whole));
    } else {  // rows of whole words (delta_encode checks): a row that starts at an odd word swaps the sums
      sum_words(row + whole, (row_bytes - whole) / 8, row_sums);
      const bool odd_start = (r * (row_bytes / 8)) % 2 == 1;
      total += odd_start ? 4 * row_sums.odd + row_sums.even : 4 * row_sums.even + row_sums.odd;
    }
  }
  if (!fits) {  // DENSE: every byte, to the wire and to the kept copy
    for (int64_t r = 0; r < rows; ++r) std::memcpy(body + r * row_bytes, fresh + r * row_stride, row_bytes);
    std::memcpy(kept, body, static_cast<std::size_t>(nbytes));
    return {0, units, delta_checksum(body, nbytes)};
  }
  int64_t checksum;
  std::memcpy(&checksum, &total, sizeof checksum);
  if (as_mask) return {1, count, checksum};  // the mask's padding was zeroed with it
  const int64_t head = aligned(count * index_bytes);
  std::memmove(body + head, body + spare, static_cast<std::size_t>(count * U));
  std::memset(body + count * index_bytes, 0, static_cast<std::size_t>(head - count * index_bytes));
  return {2, count, checksum};
}

template <int U, typename I>
void apply_indices(uint8_t* base, int64_t nbytes, const uint8_t* indices, const uint8_t* values, int64_t count) {
  const int64_t units = nbytes / U;
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t v = load_index<I>(indices, i);
    bad |= v < 0 || v >= units;
  }
  if (bad) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t v = load_index<I>(indices, i);
      if (v < 0 || v >= units) {
        throw CoreValueError("argument", "change " + std::to_string(i) + " of a delta is at index " +
                                             std::to_string(v) + ", not a unit of a base of " +
                                             std::to_string(units) + " units");
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(base + load_index<I>(indices, i) * U, values + i * U, U);
  }
}

template <int U>
int64_t apply_bitmask(uint8_t* base, int64_t nbytes, const uint8_t* mask, const uint8_t* values, int64_t count) {
  const int64_t units = nbytes / U;
  const int64_t mask_bytes = (units + 7) / 8;
  const int64_t words = mask_bytes / 8;
  if (units % 8 != 0 && (mask[mask_bytes - 1] >> (units % 8)) != 0) {
    throw CoreValueError("argument", "a delta's bitmask marks a change past the last of a base's " +
                                         std::to_string(units) + " units");
  }
  int64_t marked = 0;
  for (int64_t w = 0; w < words; ++w) marked += __builtin_popcountll(load64(mask + 8 * w));
  for (int64_t i = words * 8; i < mask_bytes; ++i) marked += __builtin_popcount(mask[i]);
  if (marked != count) {
    throw CoreValueError("argument", "a delta's bitmask marks " + std::to_string(marked) +
                                         " changes, its message holds " + std::to_string(count));
  }
  int64_t k = 0;
  for (int64_t w = 0; w < words; ++w) {
    for (uint64_t rest = load64(mask + 8 * w); rest != 0; rest &= rest - 1) {
      std::memcpy(base + (w * 64 + __builtin_ctzll(rest)) * U, values + k * U, U);
      ++k;
    }
  }
  for (int64_t i = words * 8; i < mask_bytes; ++i) {
    for (unsigned rest = mask[i]; rest != 0; rest &= rest - 1) {
      std::memcpy(base + (i * 8 + __builtin_ctz(rest)) * U, values + k * U, U);
      ++k;
    }
  }
  return count;
}

template <typename I>
void apply_indices_as(uint8_t* base, int64_t nbytes, int unit, const uint8_t* indices, const uint8_t* values,
                      int64_t count) {
  switch (unit) {
    case 1: return apply_indices<1, I>(base, nbytes, indices, values, count);
    case 2: return apply_indices<2, I>(base, nbytes, indices, values, count);
    case 4: return apply_indices<4, I>(base, nbytes, indices, values, count);
    default: return apply_indices<8, I>(base, nbytes, indices, values, count);
  }
}

}  // namespace

int64_t delta_checksum(const uint8_t* data, int64_t nbytes) {
  check_count("a checksum's length", nbytes);
  const int64_t words = nbytes / 8;
  // one part's checksum is 4 * (sum of even words) + (sum of odd words) + (sum of tail bytes)
  uint64_t even[4] = {0, 0, 0, 0};
  uint64_t odd[4] = {0, 0, 0, 0};
  int64_t w = 0;
  for (; w + 8 <= words; w += 8) {
    const uint8_t* p = data + 8 * w;
    for (int k = 0; k < 4; ++k) {
      even[k] += load64(p + 16 * k);
      odd[k] += load64(p + 16 * k + 8);
    }
  }
  uint64_t sum_even = even[0] + even[1] + even[2] + even[3];
  uint64_t sum_odd = odd[0] + odd[1] + odd[2] + odd[3];
  for (; w < words; ++w) (w % 2 == 0 ? sum_even : sum_odd) += load64(data + 8 * w);
  uint64_t tail = 0;
  for (int64_t i = words * 8; i < nbytes; ++i) tail += data[i];
  const uint64_t total = 4 * sum_even + sum_odd + tail;  // wrapping, as int64 sums wrap
  int64_t result;
  std::memcpy(&result, &total, sizeof result);
  return result;
}

DeltaEncoded delta_encode(const uint8_t* fresh, int64_t rows, int64_t row_stride, uint8_t* kept, int64_t nbytes,
                          int unit, uint8_t* body, int index_bytes, int64_t index_room, int64_t mask_room) {
  check_message(nbytes, unit);
  check_index_bytes(index_bytes);
  if (rows < 1 || nbytes % rows != 0 || (rows > 1 && (nbytes / rows) % 8 != 0)) {
    throw CoreValueError("argument", "a message of " + std::to_string(nbytes) + " bytes is not " +
                                         std::to_string(rows) + " rows of whole 8-byte words");
  }
  if (index_bytes == 4 && nbytes / unit > (int64_t{1} << 31)) {
    throw CoreValueError("argument", "int32 indices cannot number " + std::to_string(nbytes / unit) + " units");
  }
  if (index_room >= 0 && mask_room >= 0 && aligned(index_room * index_bytes) > aligned((nbytes / unit + 7) / 8)) {
    throw CoreValueError("argument", "room for " + std::to_string(index_room) +
                                         " indices does not fit where the bitmask goes: INDICES would not be "
                                         "the cheaper encoding");
  }
  switch (unit) {
    case 1: return encode<1>(fresh, rows, row_stride, kept, nbytes, body, index_bytes, index_room, mask_room);
    case 2: return encode<2>(fresh, rows, row_stride, kept, nbytes, body, index_bytes, index_room, mask_room);
    case 4: return encode<4>(fresh, rows, row_stride, kept, nbytes, body, index_bytes, index_room, mask_room);
    default: return encode<8>(fresh, rows, row_stride, kept, nbytes, body, index_bytes, index_room, mask_room);
  }
}

void delta_apply_indices(uint8_t* base, int64_t nbytes, int unit, const void* indices, int index_bytes,
                         const uint8_t* values, int64_t count) {
  check_message(nbytes, unit);
  check_index_bytes(index_bytes);
  check_count("a delta's count of changes", count);
  const uint8_t* in = static_cast<const uint8_t*>(indices);
  if (index_bytes == 4) {
    apply_indices_as<int32_t>(base, nbytes, unit, in, values, count);
  } else {
    apply_indices_as<int64_t>(base, nbytes, unit, in, values, count);
  }
}

int64_t delta_apply_bitmask(uint8_t* base, int64_t nbytes, int unit, const uint8_t* mask, const uint8_t* values,
                            int64_t count) {
  check_message(nbytes, unit);
  check_count("a delta's count of changes", count);
  switch (unit) {
    case 1: return apply_bitmask<1>(base, nbytes, mask, values, count);
    case 2: return apply_bitmask<2>(base, nbytes, mask, values, count);
    case 4: return apply_bitmask<4>(base, nbytes, mask, values, count);
    default: return apply_bitmask<8>(base, nbytes, mask, values, count);
  }
}

}  // namespace layoutlang
