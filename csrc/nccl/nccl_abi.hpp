// The few NCCL and CUDA runtime types and constants the core needs, declared here so that
// the build needs neither nccl.h nor a CUDA toolkit: NCCL and the CUDA runtime are loaded
// with dlopen when first used. Every declaration matches the C ABI of nccl.h (checked
// against NCCL 2.32.3) and of cuda_runtime_api.h / driver_types.h (CUDA 12 and 13).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

namespace layoutlang::nccl {

// ncclResult_t: an enum in nccl.h whose values all fit an int, so it passes as an int.
using Result = int;
enum : Result {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
  kTimeout = 8,
  kNumResults = 9,
};

// Opaque communicator handle (ncclComm_t is `struct ncclComm*`).
struct ncclComm;
using Comm = ncclComm*;

constexpr std::size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct UniqueId {
  char internal[kUniqueIdBytes];
};

constexpr int kUint8 = 1;  // ncclUint8: the executor moves bytes

constexpr int kShrinkDefault = 0x00;  // NCCL_SHRINK_DEFAULT: shrink a quiescent communicator
constexpr int kShrinkAbort = 0x01;    // NCCL_SHRINK_ABORT: terminate the parent's operations first
constexpr int kRevokeDefault = 0x00;  // NCCL_REVOKE_DEFAULT (must be 0)

constexpr unsigned kApiMagic = 0xcafebeef;  // NCCL_API_MAGIC
constexpr int kConfigUndefInt = INT_MIN;    // NCCL_CONFIG_UNDEF_INT

// NCCL_VERSION(X, Y, Z) for X >= 2, Y > 8: the encoding of ncclGetVersion since 2.9.
constexpr int version_code(int major, int minor, int patch = 0) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch : major * 10000 + minor * 100 + patch;
}

// The leading fields of ncclConfig_t, up to shrinkShare (NCCL 2.27). NCCL copies only
// `size` bytes of a caller's config and resets fields newer than `version` to defaults,
// so a prefix is ABI-compatible with every NCCL from 2.14 on, older or newer than 2.27:
// fields we do not declare keep NCCL's defaults.
struct Config {
  std::size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
};
static_assert(offsetof(Config, blocking) == 16, "ncclConfig_t.blocking offset");
static_assert(offsetof(Config, netName) == 32, "ncclConfig_t.netName offset");
static_assert(offsetof(Config, splitShare) == 40, "ncclConfig_t.splitShare offset");
static_assert(offsetof(Config, commName) == 48, "ncclConfig_t.commName offset");
static_assert(offsetof(Config, shrinkShare) == 64, "ncclConfig_t.shrinkShare offset");

// NCCL_CONFIG_INITIALIZER for the declared prefix.
inline Config default_config() {
  Config c{};
  c.size = sizeof(Config);
  c.magic = kApiMagic;
  c.version = static_cast<unsigned>(version_code(2, 27, 0));
  c.blocking = c.cgaClusterSize = c.minCTAs = c.maxCTAs = kConfigUndefInt;
  c.netName = nullptr;
  c.splitShare = c.trafficClass = kConfigUndefInt;
  c.commName = nullptr;
  c.collnetEnable = c.CTAPolicy = c.shrinkShare = kConfigUndefInt;
  return c;
}

// ---------------------------------------------------------------------- CUDA runtime

using CudaError = int;                       // cudaError_t
constexpr CudaError kCudaSuccess = 0;        // cudaSuccess
constexpr CudaError kCudaErrorNotReady = 600;  // cudaErrorNotReady
constexpr int kCudaMemcpyDefault = 4;        // cudaMemcpyDefault: direction from the pointers (UVA)
constexpr unsigned kCudaEventDisableTiming = 0x02;

struct CudaPitchedPtr {  // struct cudaPitchedPtr
  void* ptr;
  std::size_t pitch;
  std::size_t xsize;
  std::size_t ysize;
};
struct CudaPos {  // struct cudaPos
  std::size_t x, y, z;
};
struct CudaExtent {  // struct cudaExtent (width in bytes for linear memory)
  std::size_t width, height, depth;
};
struct CudaMemcpy3DParms {  // struct cudaMemcpy3DParms
  void* srcArray;
  CudaPos srcPos;
  CudaPitchedPtr srcPtr;
  void* dstArray;
  CudaPos dstPos;
  CudaPitchedPtr dstPtr;
  CudaExtent extent;
  int kind;
};
static_assert(sizeof(CudaMemcpy3DParms) == 160, "cudaMemcpy3DParms size");

}  // namespace layoutlang::nccl
