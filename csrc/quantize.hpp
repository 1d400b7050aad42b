// Block quantization to FP8 (e4m3, e5m2) and MXFP8, the rule of issue 16 (documented in
// docs/reference/language.rst, "Quantized tensors"):
//
//   per block:   amax = max |x| in fp32 (bf16 and fp16 widen exactly);
//   fp8:         scale_inv = amax / fmax in fp32 (fmax 448 for e4m3, 57344 for e5m2);
//                where that is 0 (a zero block, or amax under fmax times fp32's least
//                subnormal) scale_inv = 1; value = fp8(clamp(x / scale_inv, -fmax, fmax)),
//                the cast rounding to nearest, ties to even (what torch's casts do);
//   mxfp8:       the OCP MX v1.0 rule: one power of two X = 2^e per block (32 elements along
//                the reduction dim), e = floor(log2 amax) - 8 (8: e4m3's largest exponent),
//                clamped to [-127, 127], e = -127 for a zero block; value =
//                e4m3(clamp(x / X, -448, 448)); X is stored as e8m0 (the byte e + 127);
//   conventions: `scale_inv` stores the multiplier that dequantizes (scale_inv, X), as
//                DeepSeek-V3 and vLLM keep it; `scale` its inverse (1 / scale_inv in fp32,
//                2^-e in e8m0);
//   non-finite:  a block holding a NaN or an infinity has a NaN scale (fp32 0x7FC00000,
//                e8m0 0xFF) and every value NaN (0x7F): the poison is visible, never
//                silently scaled away.
//
// Views are strided, in elements (not bytes); strides may be any non-negative values, so a
// source view can be a column slice of a larger storage. Plain C++: no Python, no torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace layoutlang {

enum class QuantSource : uint8_t { bf16, fp16, fp32 };
enum class QuantFormat : uint8_t { fp8_e4m3, fp8_e5m2, mxfp8 };
enum class ScaleConvention : uint8_t { scale_inv, scale };
// Which of the block-strip kernels quantizes (csrc/quantize_kernel.inc); every one writes the
// same bytes. `automatic`: the fastest this CPU runs (avx512 where it has AVX-512 F/BW/VL and
// FMA, else avx2 where it has AVX2 and FMA, else generic).
enum class QuantKernel : uint8_t { automatic, generic, avx2, avx512 };

// One strided N-D view of raw memory: its address, its shape and its strides in elements.
struct QuantView {
  uintptr_t data = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

QuantSource quant_source(const std::string& dtype);        // "bf16", "fp16", "fp32"
QuantFormat quant_format(const std::string& format);       // "fp8_e4m3", "fp8_e5m2", "mxfp8"
ScaleConvention scale_convention(const std::string& name);  // "scale_inv", "scale"
QuantKernel quant_kernel_named(const std::string& name);    // "auto", "avx512", "avx2", "generic"

// The kernels this build runs on this CPU, fastest first ("avx512", "avx2", "generic").
std::vector<std::string> quantize_kernels();

// The largest finite value of a format's elements (448 for e4m3 and mxfp8, 57344 for e5m2).
float quant_fmax(QuantFormat format);

// Quantizes `source` (shape S) block by block (block: one size per dim, each >= 1) into
// `values` (shape S, one byte per element) and `scales` (shape ceil(S / block); fp32 for
// fp8, one e8m0 byte for mxfp8). Blocks at the edges are partial: they hold what is left of
// the dim. Throws CoreValueError (kind "argument") on inconsistent shapes.
// `threads`: at most that many threads share the block row strips of a view whose last dim is
// contiguous in the source and the values (0: default_quantize_threads()); each is given at
// least 2^18 elements, so small views take one. The bytes do not depend on it.
// `kernel`: which kernel quantizes such views (others take the general strided path); the
// bytes do not depend on it either. Asking for one this CPU cannot run throws.
void quantize_blocks(const QuantView& source, QuantSource source_dtype, const std::vector<int64_t>& block,
                     QuantFormat format, ScaleConvention convention, const QuantView& values,
                     const QuantView& scales, int threads = 1, QuantKernel kernel = QuantKernel::automatic);

// The threads quantize_blocks uses for `threads = 0`: the hardware's, at most 8.
int default_quantize_threads();

// The byte of one fp8 element: `x` rounded to nearest, ties to even; |x| must not exceed
// the format's fmax (callers clamp), NaN gives 0x7F with x's sign.
uint8_t fp8_encode(float x, QuantFormat format);

}  // namespace layoutlang
