// The quantizer's block-strip kernel for CPUs with AVX-512 (F, BW, VL) and FMA (Intel since
// Skylake-SP, AMD since Zen 4): this file alone is compiled for them (CMakeLists.txt), and
// csrc/quantize.cpp calls it only where the CPU reports all of them. The same source as the
// AVX2 kernel, in 16 lanes, its bf16 runs written with intrinsics (quantize_kernel.inc): on
// a Sapphire Rapids core about 5 GB/s of bf16 against 2 (AVX2) and 1.2 (the baseline),
// benchmarks/bench_quantize.py.
#include <cstdint>
#include <cstring>

#include <immintrin.h>

// GCC 12 warns of the _mm*_undefined_* values inside its own intrinsics' headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "quantize_kernel.hpp"

#define LAYOUTLANG_QUANT_KERNEL avx512
#define LAYOUTLANG_QUANT_FMA 1
#define LAYOUTLANG_QUANT_AVX2 0
#define LAYOUTLANG_QUANT_AVX512 1
#include "quantize_kernel.inc"
