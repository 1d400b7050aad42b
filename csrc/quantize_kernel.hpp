// The quantizer's block-strip kernels, one per instruction set (csrc/quantize_kernel.inc),
// and what they are given. Internal to csrc/quantize*.cpp.
#pragma once

#include <cstdint>
#include <cstring>

#include "quantize.hpp"

namespace layoutlang {

// One view to quantize by block row strips: its last dim contiguous in the source and the
// values; shapes and strides in elements (the caller's arrays, alive for the call).
struct StripJob {
  QuantSource source_dtype;
  QuantFormat format;
  ScaleConvention convention;
  size_t ndim;  // at most quant_kernel::kMaxStripDims
  const int64_t* shape;
  const int64_t* block;
  const int64_t* grid;  // ceil(shape / block)
  const int64_t* source_strides;
  const int64_t* value_strides;
  const int64_t* scale_strides;
  uintptr_t source, values, scales;
};

namespace quant_kernel {

// Quantizes the block row strips [first, last) of the job (every dim but the last, in
// row-major order of block indices). Every kernel writes the same bytes.
namespace generic {
void quantize_strips(const StripJob& job, int64_t first, int64_t last);
}
#if LAYOUTLANG_HAVE_AVX2_KERNEL
namespace avx2 {
void quantize_strips(const StripJob& job, int64_t first, int64_t last);
}
namespace avx512 {
void quantize_strips(const StripJob& job, int64_t first, int64_t last);
}
#endif

}  // namespace quant_kernel
}  // namespace layoutlang
