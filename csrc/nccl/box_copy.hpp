// Packing and unpacking strided boxes with the fewest CUDA runtime calls.
//
// A box copy moves an N-D region between two strided buffers (a source storage and a
// staging message, or a staging message and a destination storage). Each copy is reduced
// to pitched copies: dims of size 1 are dropped, dims contiguous in both buffers are
// merged, the innermost contiguous run becomes the row width, and what remains is
//   0 dims  -> one cudaMemcpyAsync,
//   1 dim   -> one cudaMemcpy2DAsync (rows with a pitch on each side),
//   2 dims  -> one cudaMemcpy3DAsync when each side's outer stride is a whole number of
//              its rows (the slice pitch of cudaPitchedPtr), else one 2-D copy per slice,
//   more    -> the outer dims are looped, each iteration a 2-D or 3-D copy.
// Consecutive copies that are contiguous on both sides and adjacent merge into one.
// So a box of a row-major tensor costs one call whatever its shape up to 3-D, and a
// bucket costs one call per box (fewer when boxes are adjacent).
//
// Pointers are integers (Python owns the tensors); `stream` is a cudaStream_t as integer.
// With CudaMock the same plan runs as host memcpy, which is how CPU tests check it.
#pragma once

#include <cstdint>
#include <vector>

#include "nccl_api.hpp"

namespace layoutlang::nccl {

struct BoxCopy {
  uint64_t dst = 0;
  uint64_t src = 0;
  int64_t itemsize = 1;
  std::vector<int64_t> sizes;        // elements per dim
  std::vector<int64_t> dst_strides;  // elements
  std::vector<int64_t> src_strides;  // elements
};

// One runtime call: depth slices of height rows of width bytes.
struct PitchedCopy {
  uint64_t dst = 0, src = 0;
  uint64_t width = 0, height = 1, depth = 1;
  uint64_t dpitch = 0, spitch = 0;    // bytes between rows
  uint64_t dheight = 1, sheight = 1;  // rows between slices (slice pitch = pitch * height)
};

// The pitched copies that perform `copies`, in order. Throws CoreValueError-like
// std::invalid_argument for negative sizes or strides, or mismatched dims.
std::vector<PitchedCopy> plan_box_copies(const std::vector<BoxCopy>& copies);

struct CopyStats {
  int64_t calls = 0;  // CUDA runtime calls issued
  int64_t bytes = 0;  // payload bytes
};

// Issues the planned copies on `stream`; throws CudaFailure naming the call that failed.
CopyStats run_box_copies(CudaApi& cuda, const std::vector<PitchedCopy>& plan, uint64_t stream);

}  // namespace layoutlang::nccl
