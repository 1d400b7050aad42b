// The quantizer's block-strip kernel for CPUs with AVX2 and FMA (x86-64 since Haswell and
// Zen): this file alone is compiled with -mavx2 -mfma (CMakeLists.txt), and
// csrc/quantize.cpp calls it only where the CPU reports both.
#include <cstdint>
#include <cstring>

#include "quantize_kernel.hpp"

#define LAYOUTLANG_QUANT_KERNEL avx2
#define LAYOUTLANG_QUANT_FMA 1
#define LAYOUTLANG_QUANT_AVX512 0
#include "quantize_kernel.inc"
