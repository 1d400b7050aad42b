#include "quantize.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <thread>

#include "quantize_kernel.hpp"
#include "shard_math.hpp"

// The baseline kernel, and the helpers of the general path below.
#define LAYOUTLANG_QUANT_KERNEL generic
#define LAYOUTLANG_QUANT_FMA 0
#define LAYOUTLANG_QUANT_AVX2 0
#define LAYOUTLANG_QUANT_AVX512 0
#include "quantize_kernel.inc"
#undef LAYOUTLANG_QUANT_KERNEL
#undef LAYOUTLANG_QUANT_FMA
#undef LAYOUTLANG_QUANT_AVX512
#undef LAYOUTLANG_QUANT_AVX2

namespace layoutlang {

namespace {

using quant_kernel::generic::block_divisor;
using quant_kernel::generic::encode_as;
using quant_kernel::generic::load;
using quant_kernel::generic::kNan8;

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

// The least elements a thread of the fast path is given: below it, starting a thread costs
// more than the share of work it takes (a thread start is some tens of microseconds, a
// million bf16 elements about a millisecond).
constexpr int64_t kElementsPerThread = int64_t{1} << 18;

using StripKernel = void (*)(const StripJob&, int64_t, int64_t);

bool avx2_supported() {
#if LAYOUTLANG_HAVE_AVX2_KERNEL
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
#else
  return false;
#endif
}

bool avx512_supported() {
#if LAYOUTLANG_HAVE_AVX2_KERNEL
  static const bool supported = avx2_supported() && __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return supported;
#else
  return false;
#endif
}

StripKernel strip_kernel(QuantKernel kernel) {
#if LAYOUTLANG_HAVE_AVX2_KERNEL
  if ((kernel == QuantKernel::automatic || kernel == QuantKernel::avx512) && avx512_supported())
    return &quant_kernel::avx512::quantize_strips;
  if ((kernel == QuantKernel::automatic || kernel == QuantKernel::avx2) && avx2_supported())
    return &quant_kernel::avx2::quantize_strips;
#endif
  (void)kernel;
  return &quant_kernel::generic::quantize_strips;
}

template <QuantSource S, QuantFormat format>
void quantize_typed(const QuantView& source, const std::vector<int64_t>& block, ScaleConvention convention,
                    const QuantView& values, const QuantView& scales, int threads, QuantKernel kernel) {
  const size_t n = source.shape.size();
  const float fmax = quant_fmax(format);
  const int64_t src_last = source.strides[n - 1], val_last = values.strides[n - 1];
  uint8_t* out = reinterpret_cast<uint8_t*>(values.data);
  std::vector<int64_t> grid(n), at(n, 0);
  for (size_t d = 0; d < n; ++d) grid[d] = (source.shape[d] + block[d] - 1) / block[d];
  for (size_t d = 0; d < n; ++d)
    if (grid[d] == 0) return;  // an empty tensor has no block
  if (src_last == 1 && val_last == 1 && n <= quant_kernel::generic::kMaxStripDims) {
    const StripJob job{S, format, convention, n, source.shape.data(), block.data(), grid.data(),
                       source.strides.data(), values.strides.data(), scales.strides.data(),
                       source.data, values.data, scales.data};
    const StripKernel quantize_strips = strip_kernel(kernel);
    int64_t strips = 1, elements = 1;
    for (size_t d = 0; d + 1 < n; ++d) strips *= grid[d];
    for (size_t d = 0; d < n; ++d) elements *= source.shape[d];
    // Block row strips are independent (each writes its own values and scales), so threads
    // share them out in contiguous ranges: the bytes are those of one thread.
    const int64_t workers = std::min<int64_t>({static_cast<int64_t>(threads), strips,
                                               std::max<int64_t>(1, elements / kElementsPerThread)});
    if (workers <= 1) return quantize_strips(job, 0, strips);
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
    pool.reserve(static_cast<size_t>(workers));
    for (int64_t t = 0; t < workers; ++t) {
      pool.emplace_back([&, t] {
        try {
          quantize_strips(job, strips * t / workers, strips * (t + 1) / workers);
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
                     ScaleConvention convention, const QuantView& values, const QuantView& scales, int threads,
                     QuantKernel kernel) {
  switch (format) {
    case QuantFormat::fp8_e4m3:
      return quantize_typed<S, QuantFormat::fp8_e4m3>(source, block, convention, values, scales, threads, kernel);
    case QuantFormat::fp8_e5m2:
      return quantize_typed<S, QuantFormat::fp8_e5m2>(source, block, convention, values, scales, threads, kernel);
    case QuantFormat::mxfp8:
      return quantize_typed<S, QuantFormat::mxfp8>(source, block, convention, values, scales, threads, kernel);
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
  return format == QuantFormat::fp8_e5m2 ? quant_kernel::generic::encode<2, 15>(x)
                                         : quant_kernel::generic::encode<3, 7>(x);
}

// Throws where `kernel` names one this CPU (or this build) cannot run, naming those it can.
static void check_kernel_runs(QuantKernel kernel) {
  const bool missing = (kernel == QuantKernel::avx2 && !avx2_supported()) ||
                       (kernel == QuantKernel::avx512 && !avx512_supported());
  if (!missing) return;
  std::string here;
  for (const auto& name : quantize_kernels()) here += (here.empty() ? "" : ", ") + name;
  const std::string why = LAYOUTLANG_HAVE_AVX2_KERNEL ? "this CPU lacks the instructions" : "it is built for x86-64 only";
  throw CoreValueError("argument", "the quantizer's " + std::string(kernel == QuantKernel::avx2 ? "avx2" : "avx512") +
                                       " kernel cannot run here (" + why + "); kernels here: " + here);
}

QuantKernel quant_kernel_named(const std::string& name) {
  if (name == "auto") return QuantKernel::automatic;
  if (name == "generic") return QuantKernel::generic;
  if (name == "avx2") return QuantKernel::avx2;
  if (name == "avx512") return QuantKernel::avx512;
  throw CoreValueError("argument", "unknown quantizer kernel '" + name + "' (auto, avx512, avx2, generic)");
}

std::vector<std::string> quantize_kernels() {
  std::vector<std::string> names;
  if (avx512_supported()) names.push_back("avx512");
  if (avx2_supported()) names.push_back("avx2");
  names.push_back("generic");
  return names;
}

void quantize_blocks(const QuantView& source, QuantSource source_dtype, const std::vector<int64_t>& block,
                     QuantFormat format, ScaleConvention convention, const QuantView& values,
                     const QuantView& scales, int threads, QuantKernel kernel) {
  const size_t n = source.shape.size();
  if (threads < 0) throw CoreValueError("argument", "threads must be 0 (automatic) or more");
  if (threads == 0) threads = default_quantize_threads();
  check_kernel_runs(kernel);
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
      return dispatch_format<QuantSource::bf16>(source, block, format, convention, values, scales, threads, kernel);
    case QuantSource::fp16:
      return dispatch_format<QuantSource::fp16>(source, block, format, convention, values, scales, threads, kernel);
    case QuantSource::fp32:
      return dispatch_format<QuantSource::fp32>(source, block, format, convention, values, scales, threads, kernel);
  }
}

}  // namespace layoutlang
