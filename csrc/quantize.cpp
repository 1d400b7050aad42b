#include "quantize.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <thread>

#include "shard_math.hpp"

namespace layoutlang {

namespace {

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// fp16 -> fp32, exact (every half is a float).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in fp32
  const float magnitude = static_cast<float>(mant) * float_of(0x33800000u);  // 2^-24
  return float_of(sign | bits_of(magnitude));
}

template <QuantSource S>
inline float load(uintptr_t base, int64_t index) {
  if constexpr (S == QuantSource::fp32) {
    return reinterpret_cast<const float*>(base)[index];
  } else if constexpr (S == QuantSource::bf16) {
    return float_of(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(base)[index]) << 16);
  } else {
    return half_to_float(reinterpret_cast<const uint16_t*>(base)[index]);
  }
}

constexpr uint8_t kNan8 = 0x7f;          // e4m3fn's NaN; one of e5m2's (torch writes it too)
constexpr uint32_t kNan32 = 0x7fc00000u;  // fp32's canonical quiet NaN
constexpr uint8_t kNanE8m0 = 0xff;

// The byte of one fp8 element with M mantissa bits and exponent bias B (e4m3fn: 3, 7; e5m2:
// 2, 15): x rounded to nearest, ties to even; |x| must not exceed the format's largest value.
template <int M, int B>
inline uint8_t encode(float x) {
  uint32_t bits = bits_of(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return kNan8 | sign;
  constexpr int kMinExponent = 1 - B;                                   // of the format's normal numbers
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + kMinExponent) << 23;  // its fp32 bits
  if (bits < kMinNormal) {
    // zero or subnormal: a multiple of 2^(kMinExponent - M), rounded to the nearest even
    // multiple; the product by a power of two is exact, nearbyint rounds ties to even (the
    // default rounding mode), and a carry into 2^M is the least normal code.
    constexpr float kSteps = static_cast<float>(1u << (M - kMinExponent));  // 2^(M - kMinExponent)
    const float steps = std::nearbyint(float_of(bits) * kSteps);
    return static_cast<uint8_t>(static_cast<uint32_t>(steps)) | sign;
  }
  constexpr int kShift = 23 - M;
  bits += ((1u << (kShift - 1)) - 1) + ((bits >> kShift) & 1u);  // round to nearest, ties to even
  const uint32_t exponent = (bits >> 23) - 127 + B;
  const uint32_t mantissa = (bits >> kShift) & ((1u << M) - 1);
  return static_cast<uint8_t>((exponent << M) | mantissa) | sign;
}

template <QuantFormat F>
inline uint8_t encode_as(float x) {
  if constexpr (F == QuantFormat::fp8_e5m2) {
    return encode<2, 15>(x);
  } else {
    return encode<3, 7>(x);
  }
}

// What the blocks are iterated with: the extents of one block along each dim.
struct BlockExtent {
  std::vector<int64_t> begin, end;
};

// Calls row(offset_source, offset_values, length) for every row (run along the last dim)
// of the block, in row-major order; offsets in elements.
template <typename Row>
void for_each_row(const BlockExtent& e, const QuantView& src, const QuantView& dst, Row&& row) {
  const size_t n = e.begin.size();
  const size_t outer = n - 1;
  std::vector<int64_t> index(e.begin.begin(), e.begin.end() - 1);
  for (size_t d = 0; d < outer; ++d)
    if (e.begin[d] >= e.end[d]) return;
  const int64_t length = e.end[outer] - e.begin[outer];
  if (length <= 0) return;
  while (true) {
    int64_t s = e.begin[outer] * src.strides[outer], v = e.begin[outer] * dst.strides[outer];
    for (size_t d = 0; d < outer; ++d) {
      s += index[d] * src.strides[d];
      v += index[d] * dst.strides[d];
    }
    row(s, v, length);
    size_t d = outer;
    while (d > 0) {
      --d;
      if (++index[d] < e.end[d]) break;
      index[d] = e.begin[d];
      if (d == 0) return;
    }
    if (outer == 0) return;
  }
}

// The fast path, taken where the last dim is contiguous in the source and the values (every
// region a sender packs from a row-major storage): one block row strip at a time, the amax of
// each block of the strip kept in a small array while its rows stream by, then the strip's
// values encoded. Every step is integer arithmetic or one IEEE operation the compiler
// vectorizes (no per-element library call, no branch), and gives the bytes of the general
// path: for non-negative floats the order of their bits is the order of their values, so the
// amax is an integer max of |x|'s bits, and a block is finite when that max is below
// infinity's bits.

// |x|'s fp32 bits.
template <QuantSource S>
inline uint32_t abs_bits(uintptr_t base, int64_t index) {
  if constexpr (S == QuantSource::fp32) {
    return reinterpret_cast<const uint32_t*>(base)[index] & 0x7fffffffu;
  } else if constexpr (S == QuantSource::bf16) {
    return (static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(base)[index]) & 0x7fffu) << 16;
  } else {
    // fp16: only compared with each other and with infinity's bits, so the half's own bits,
    // ordered alike, moved to where fp32's infinity test below reads them
    const uint32_t h = reinterpret_cast<const uint16_t*>(base)[index] & 0x7fffu;
    return h >= 0x7c00u ? 0x7f800000u | h : h;
  }
}

// x, finite, as fp32 (fp16 by the exact product with 2^112 that also makes subnormals normal).
template <QuantSource S>
inline float finite_value(uintptr_t base, int64_t index) {
  if constexpr (S == QuantSource::fp16) {
    const uint32_t h = reinterpret_cast<const uint16_t*>(base)[index];
    const float magnitude = float_of((h & 0x7fffu) << 13) * float_of(0x77800000u);  // 2^112
    return float_of(bits_of(magnitude) | ((h & 0x8000u) << 16));
  } else {
    return load<S>(base, index);
  }
}

// The amax of the bits `abs_bits` returned, as the general path's float amax.
template <QuantSource S>
inline float amax_of(uint32_t bits) {
  if constexpr (S == QuantSource::fp16) {
    return half_to_float(static_cast<uint16_t>(bits));
  } else {
    return float_of(bits);
  }
}

// encode<M, B> of a finite x with |x| <= the format's largest value, without branches: a
// subnormal result is the fp32 sum of |x| and the power of two whose ulp is the format's
// least subnormal, rounded to nearest even by the addition itself (so the general path's
// nearbyint of the product), its bits less the power's; a normal one is the fp32 bits
// rounded at the format's mantissa, re-biased.
// x may be infinite or beyond the largest value: |x| is clamped to it on its bits (the order
// of non-negative floats' bits is theirs), as the general path's clamp does.
template <int M, int B>
inline uint8_t encode_finite(float x) {
  constexpr uint32_t kMaxBits = M == 2 ? 0x47600000u : 0x43e00000u;  // 57344, 448
  const uint32_t bits = bits_of(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t a = bits & 0x7fffffffu;
  a = a < kMaxBits ? a : kMaxBits;
  constexpr int kShift = 23 - M;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - B) << 23;
  constexpr uint32_t kMagic = static_cast<uint32_t>((127 - B) + kShift + 1) << 23;
  const uint32_t sub = bits_of(float_of(a) + float_of(kMagic)) - kMagic;
  const uint32_t rounded = a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1u);
  const uint32_t normal = (rounded >> kShift) - (static_cast<uint32_t>(127 - B) << M);
  const uint32_t small = 0u - static_cast<uint32_t>(a < kMinNormal);  // a mask, not a branch
  return static_cast<uint8_t>(((sub & small) | (normal & ~small)) | sign);
}

template <QuantFormat F>
inline uint8_t encode_finite_as(float x) {
  if constexpr (F == QuantFormat::fp8_e5m2) {
    return encode_finite<2, 15>(x);
  } else {
    return encode_finite<3, 7>(x);
  }
}

// What a block's values are divided by, writing its scale: the rule of the general path.
template <QuantFormat format>
inline float block_divisor(float amax, bool finite, ScaleConvention convention, uintptr_t scales, int64_t at) {
  if constexpr (format == QuantFormat::mxfp8) {
    uint8_t code = kNanE8m0;
    float divisor = float_of(kNan32);
    if (finite) {
      int e = -127;
      if (amax > 0.0f) {
        int exponent;
        std::frexp(amax, &exponent);  // amax = m * 2^exponent, m in [0.5, 1)
        e = std::clamp(exponent - 1 - 8, -127, 127);
      }
      divisor = e >= -126 ? float_of(static_cast<uint32_t>(e + 127) << 23) : float_of(0x00400000u);  // 2^e
      code = static_cast<uint8_t>(convention == ScaleConvention::scale_inv ? e + 127 : 127 - e);
    }
    reinterpret_cast<uint8_t*>(scales)[at] = code;
    return divisor;
  } else {
    const float fmax = quant_fmax(format);
    float scale_inv = float_of(kNan32);
    if (finite) {
      scale_inv = amax / fmax;
      if (scale_inv == 0.0f) scale_inv = 1.0f;  // zero block: values are zeros, scale 1
    }
    reinterpret_cast<float*>(scales)[at] =
        convention == ScaleConvention::scale_inv || !finite ? scale_inv : 1.0f / scale_inv;
    return scale_inv;
  }
}

// The block row strips [first, last) of the outer block grid (every dim but the last, in
// row-major order of block indices).
template <QuantSource S, QuantFormat format>
void quantize_strips(const QuantView& source, const std::vector<int64_t>& block, ScaleConvention convention,
                     const QuantView& values, const QuantView& scales, const std::vector<int64_t>& grid,
                     int64_t first, int64_t last) {
  const size_t n = source.shape.size();
  const size_t outer = n - 1;
  const int64_t length = source.shape[outer], b = block[outer], columns = grid[outer];
  // held in locals, the byte stores could alias `source` (a uint8_t may alias anything) and
  // the loops would not vectorize
  uint8_t* __restrict out = reinterpret_cast<uint8_t*>(values.data);
  const uintptr_t src = source.data;
  std::vector<uint32_t> amax(static_cast<size_t>(columns));
  std::vector<float> divisor(static_cast<size_t>(columns));
  std::vector<int64_t> at(outer), begin(outer), end(outer), index(outer);
  for (int64_t strip = first; strip < last; ++strip) {
    int64_t rest = strip, scale_base = 0;
    for (size_t d = outer; d-- > 0;) {
      at[d] = rest % grid[d];
      rest /= grid[d];
      begin[d] = at[d] * block[d];
      end[d] = std::min(source.shape[d], begin[d] + block[d]);
      scale_base += at[d] * scales.strides[d];
    }
    // calls row(offset in the source, offset in the values) for every row of the strip
    auto for_rows = [&](auto&& row) {
      index = begin;
      while (true) {
        int64_t s = 0, v = 0;
        for (size_t d = 0; d < outer; ++d) {
          s += index[d] * source.strides[d];
          v += index[d] * values.strides[d];
        }
        row(s, v);
        size_t d = outer;
        while (d > 0) {
          --d;
          if (++index[d] < end[d]) break;
          index[d] = begin[d];
          if (d == 0) return;
        }
        if (outer == 0) return;
      }
    };
    std::fill(amax.begin(), amax.end(), 0u);
    for_rows([&](int64_t s, int64_t) {
      for (int64_t c = 0; c < columns; ++c) {
        const int64_t lo = c * b, hi = std::min(length, lo + b);
        uint32_t m = amax[c];
        for (int64_t i = lo; i < hi; ++i) {
          const uint32_t x = abs_bits<S>(src, s + i);
          m = x > m ? x : m;
        }
        amax[c] = m;
      }
    });
    bool all_finite = true;
    for (int64_t c = 0; c < columns; ++c) {
      const bool finite = amax[c] < 0x7f800000u;
      all_finite &= finite;
      divisor[c] = block_divisor<format>(amax_of<S>(amax[c]), finite, convention, scales.data,
                                         scale_base + c * scales.strides[outer]);
    }
    for_rows([&](int64_t s, int64_t v) {
      for (int64_t c = 0; c < columns; ++c) {
        const int64_t lo = c * b, hi = std::min(length, lo + b);
        if (!all_finite && !(amax[c] < 0x7f800000u)) {
          std::memset(out + v + lo, kNan8, static_cast<size_t>(hi - lo));
          continue;
        }
        const float dv = divisor[c];
        for (int64_t i = lo; i < hi; ++i) {
          out[v + i] = encode_finite_as<format>(finite_value<S>(src, s + i) / dv);
        }
      }
    });
  }
}

// The least elements a thread of the fast path is given: below it, starting a thread costs
// more than the share of work it takes (a thread start is some tens of microseconds, a
// million bf16 elements about a millisecond).
constexpr int64_t kElementsPerThread = int64_t{1} << 18;

template <QuantSource S, QuantFormat format>
void quantize_typed(const QuantView& source, const std::vector<int64_t>& block, ScaleConvention convention,
                    const QuantView& values, const QuantView& scales, int threads) {
  const size_t n = source.shape.size();
  const float fmax = quant_fmax(format);
  const int64_t src_last = source.strides[n - 1], val_last = values.strides[n - 1];
  uint8_t* out = reinterpret_cast<uint8_t*>(values.data);
  std::vector<int64_t> grid(n), at(n, 0);
  for (size_t d = 0; d < n; ++d) grid[d] = (source.shape[d] + block[d] - 1) / block[d];
  for (size_t d = 0; d < n; ++d)
    if (grid[d] == 0) return;  // an empty tensor has no block
  if (src_last == 1 && val_last == 1) {
    int64_t strips = 1, elements = 1;
    for (size_t d = 0; d + 1 < n; ++d) strips *= grid[d];
    for (size_t d = 0; d < n; ++d) elements *= source.shape[d];
    // Block row strips are independent (each writes its own values and scales), so threads
    // share them out in contiguous ranges: the bytes are those of one thread.
    const int64_t workers = std::min<int64_t>({static_cast<int64_t>(threads), strips,
                                               std::max<int64_t>(1, elements / kElementsPerThread)});
    if (workers <= 1) return quantize_strips<S, format>(source, block, convention, values, scales, grid, 0, strips);
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
    pool.reserve(static_cast<size_t>(workers));
    for (int64_t t = 0; t < workers; ++t) {
      pool.emplace_back([&, t] {
        try {
          quantize_strips<S, format>(source, block, convention, values, scales, grid, strips * t / workers,
                                     strips * (t + 1) / workers);
        } catch (...) {
          errors[static_cast<size_t>(t)] = std::current_exception();
        }
      });
    }
    for (auto& thread : pool) thread.join();
    for (auto& error : errors)
      if (error) std::rethrow_exception(error);
    return;
  }
  BlockExtent extent{std::vector<int64_t>(n), std::vector<int64_t>(n)};
  while (true) {
    int64_t scale_at = 0;
    for (size_t d = 0; d < n; ++d) {
      extent.begin[d] = at[d] * block[d];
      extent.end[d] = std::min(source.shape[d], extent.begin[d] + block[d]);
      scale_at += at[d] * scales.strides[d];
    }
    // amax, and whether the block holds a NaN or an infinity
    float amax = 0.0f;
    bool finite = true;
    for_each_row(extent, source, values, [&](int64_t s, int64_t, int64_t length) {
      // written so that the compiler vectorizes it: `x > m ? x : m` is maxps exactly (a NaN
      // leaves m), and a NaN or an infinity is counted apart
      float m = amax;
      uint32_t bad = 0;
      if (src_last == 1) {
        for (int64_t i = 0; i < length; ++i) {
          const float x = std::fabs(load<S>(source.data, s + i));
          bad |= static_cast<uint32_t>(!(x <= std::numeric_limits<float>::max()));
          m = x > m ? x : m;
        }
      } else {
        for (int64_t i = 0; i < length; ++i) {
          const float x = std::fabs(load<S>(source.data, s + i * src_last));
          bad |= static_cast<uint32_t>(!(x <= std::numeric_limits<float>::max()));
          m = x > m ? x : m;
        }
      }
      amax = m;
      if (bad) finite = false;
    });
    // what every value of the block is divided by (its scale written on the way)
    const float divisor = block_divisor<format>(amax, finite, convention, scales.data, scale_at);
    for_each_row(extent, source, values, [&](int64_t s, int64_t v, int64_t length) {
      if (!finite) {
        for (int64_t i = 0; i < length; ++i) out[v + i * val_last] = kNan8;
        return;
      }
      if (src_last == 1 && val_last == 1) {
        for (int64_t i = 0; i < length; ++i) {
          const float q = std::clamp(load<S>(source.data, s + i) / divisor, -fmax, fmax);
          out[v + i] = encode_as<format>(q);
        }
        return;
      }
      for (int64_t i = 0; i < length; ++i) {
        const float q = std::clamp(load<S>(source.data, s + i * src_last) / divisor, -fmax, fmax);
        out[v + i * val_last] = encode_as<format>(q);
      }
    });
    size_t d = n;
    while (d > 0) {
      --d;
      if (++at[d] < grid[d]) break;
      at[d] = 0;
      if (d == 0) return;
    }
  }
}

template <QuantSource S>
void dispatch_format(const QuantView& source, const std::vector<int64_t>& block, QuantFormat format,
                     ScaleConvention convention, const QuantView& values, const QuantView& scales, int threads) {
  switch (format) {
    case QuantFormat::fp8_e4m3:
      return quantize_typed<S, QuantFormat::fp8_e4m3>(source, block, convention, values, scales, threads);
    case QuantFormat::fp8_e5m2:
      return quantize_typed<S, QuantFormat::fp8_e5m2>(source, block, convention, values, scales, threads);
    case QuantFormat::mxfp8:
      return quantize_typed<S, QuantFormat::mxfp8>(source, block, convention, values, scales, threads);
  }
}

void check_view(const QuantView& view, const char* what, size_t ndim) {
  if (view.shape.size() != ndim || view.strides.size() != ndim)
    throw CoreValueError("argument", std::string(what) + " must have " + std::to_string(ndim) + " dims");
  for (size_t d = 0; d < ndim; ++d)
    if (view.shape[d] < 0 || view.strides[d] < 0)
      throw CoreValueError("argument", std::string(what) + ": negative size or stride in dim " + std::to_string(d));
  if (view.data == 0) {
    for (int64_t s : view.shape)
      if (s == 0) return;
    throw CoreValueError("argument", std::string(what) + " has no memory");
  }
}

}  // namespace

QuantSource quant_source(const std::string& dtype) {
  if (dtype == "bf16") return QuantSource::bf16;
  if (dtype == "fp16") return QuantSource::fp16;
  if (dtype == "fp32") return QuantSource::fp32;
  throw CoreValueError("argument", "cannot quantize from dtype '" + dtype + "' (bf16, fp16, fp32)");
}

QuantFormat quant_format(const std::string& format) {
  if (format == "fp8_e4m3") return QuantFormat::fp8_e4m3;
  if (format == "fp8_e5m2") return QuantFormat::fp8_e5m2;
  if (format == "mxfp8") return QuantFormat::mxfp8;
  throw CoreValueError("argument", "unknown quantization format '" + format + "' (fp8_e4m3, fp8_e5m2, mxfp8)");
}

ScaleConvention scale_convention(const std::string& name) {
  if (name == "scale_inv") return ScaleConvention::scale_inv;
  if (name == "scale") return ScaleConvention::scale;
  throw CoreValueError("argument", "unknown scale convention '" + name + "' (scale_inv, scale)");
}

int default_quantize_threads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(cores, 1u, 8u));
}

float quant_fmax(QuantFormat format) { return format == QuantFormat::fp8_e5m2 ? 57344.0f : 448.0f; }

uint8_t fp8_encode(float x, QuantFormat format) {
  return format == QuantFormat::fp8_e5m2 ? encode<2, 15>(x) : encode<3, 7>(x);
}

void quantize_blocks(const QuantView& source, QuantSource source_dtype, const std::vector<int64_t>& block,
                     QuantFormat format, ScaleConvention convention, const QuantView& values,
                     const QuantView& scales, int threads) {
  const size_t n = source.shape.size();
  if (threads < 0) throw CoreValueError("argument", "threads must be 0 (automatic) or more");
  if (threads == 0) threads = default_quantize_threads();
  if (n == 0) throw CoreValueError("argument", "a scalar has no blocks: quantize it as a [1] view");
  if (block.size() != n)
    throw CoreValueError("argument", "the block has " + std::to_string(block.size()) + " dims, the source " +
                                         std::to_string(n));
  for (int64_t b : block)
    if (b < 1) throw CoreValueError("argument", "block sizes must be at least 1");
  check_view(source, "the source", n);
  check_view(values, "the values", n);
  check_view(scales, "the scales", n);
  for (size_t d = 0; d < n; ++d) {
    if (values.shape[d] != source.shape[d])
      throw CoreValueError("argument", "the values' shape differs from the source's in dim " + std::to_string(d));
    if (scales.shape[d] != (source.shape[d] + block[d] - 1) / block[d])
      throw CoreValueError("argument", "the scales must have ceil(size / block) entries in dim " +
                                           std::to_string(d) + ": " +
                                           std::to_string((source.shape[d] + block[d] - 1) / block[d]) + ", not " +
                                           std::to_string(scales.shape[d]));
  }
  switch (source_dtype) {
    case QuantSource::bf16:
      return dispatch_format<QuantSource::bf16>(source, block, format, convention, values, scales, threads);
    case QuantSource::fp16:
      return dispatch_format<QuantSource::fp16>(source, block, format, convention, values, scales, threads);
    case QuantSource::fp32:
      return dispatch_format<QuantSource::fp32>(source, block, format, convention, values, scales, threads);
  }
}

}  // namespace layoutlang
