// The quantizer's block-strip kernel for CPUs with AVX-512 (F, BW, VL) and FMA (Intel since
// Skylake-SP, AMD since Zen 4): this file alone is compiled for them (CMakeLists.txt), and
// csrc/quantize.cpp calls it only where the CPU reports all of them. The same source as the
// AVX2 kernel, in 16 lanes: on a Sapphire Rapids core 2.7 GB/s of bf16 against 1.9 (AVX2)
// and 1.1 (the baseline), benchmarks/bench_quantize.py.
#include <cstdint>
#include <cstring>

#include "quantize_kernel.hpp"

#define LAYOUTLANG_QUANT_KERNEL avx512
#define LAYOUTLANG_QUANT_FMA 1
#include "quantize_kernel.inc"
