// NCCL and the CUDA runtime behind small interfaces, so that a mock can stand in for both
// and the communicator's call sequences (group pairing, revoke before shrink, single-use
// grow ids, error mapping) are tested on machines without a GPU.
//
// NcclApi mirrors the NCCL functions the core calls, one virtual per function, with the
// same arguments. Implementations: NcclLibrary (dlopen, nccl_library.cpp) and NcclMock
// (nccl_mock.cpp). CudaApi likewise: CudaRuntime and CudaMock.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "nccl_abi.hpp"

namespace layoutlang::nccl {

// ------------------------------------------------------------------------- errors
// All derive from std::exception; bindings_nccl.cpp raises each as `_core.nccl.NcclCoreError`
// with its fields and a kind (nccl, timeout, unavailable, cuda), which
// layoutlang.transport.nccl turns into layoutlang.errors' NcclError family and CudaError.

// An NCCL call returned an error (or our own check refused a call, with kInvalidUsage).
class NcclError : public std::runtime_error {
 public:
  NcclError(std::string call, Result code, const std::string& message)
      : std::runtime_error(message), call_(std::move(call)), code_(code) {}
  const std::string& call() const { return call_; }
  Result code() const { return code_; }

 private:
  std::string call_;
  Result code_;
};

// An operation did not complete within its deadline (the communicator may have been aborted).
class NcclTimeout : public NcclError {
 public:
  using NcclError::NcclError;
};

// No NCCL library could be loaded, or a function is missing from the one loaded.
class NcclUnavailable : public std::runtime_error {
 public:
  NcclUnavailable(std::string symbol, std::string introduced, const std::string& message)
      : std::runtime_error(message), symbol_(std::move(symbol)), introduced_(std::move(introduced)) {}
  const std::string& symbol() const { return symbol_; }
  const std::string& introduced() const { return introduced_; }

 private:
  std::string symbol_;
  std::string introduced_;
};

// A CUDA runtime call failed (or the runtime could not be loaded: code -1).
class CudaFailure : public std::runtime_error {
 public:
  CudaFailure(std::string call, int code, const std::string& message)
      : std::runtime_error(message), call_(std::move(call)), code_(code) {}
  const std::string& call() const { return call_; }
  int code() const { return code_; }

 private:
  std::string call_;
  int code_;
};

// "ncclRemoteError" for 6; "ncclResult 42" for codes NCCL does not define.
std::string result_name(Result code);
// What a result means for the caller, in one clause.
std::string result_meaning(Result code);
// The NCCL version that introduced a function ("2.27"), or "" when it is older than 2.14.
std::string introduced_in(const std::string& symbol);
// "ncclCommShrink is not in <where>: it needs NCCL 2.27 or later (...)".
std::string missing_symbol_message(const std::string& symbol, const std::string& where);
// "2.32.3" from 23203.
std::string version_string(int code);

// ------------------------------------------------------------------------- NCCL
class NcclApi {
 public:
  virtual ~NcclApi() = default;
  // What this is, for messages: "NCCL 2.32.3 (/path/libnccl.so.2)" or "NcclMock (NCCL 2.32.3)".
  virtual std::string describe() = 0;
  // Whether the library offers a function (resolving it if needed; never throws).
  virtual bool has(const std::string& symbol) = 0;

  virtual Result getVersion(int* version) = 0;
  virtual Result getUniqueId(UniqueId* id) = 0;
  virtual Result commInitRankConfig(Comm* comm, int nranks, UniqueId id, int rank, Config* config) = 0;
  virtual Result commFinalize(Comm comm) = 0;
  virtual Result commDestroy(Comm comm) = 0;
  virtual Result commAbort(Comm comm) = 0;
  virtual Result commRevoke(Comm comm, int flags) = 0;
  virtual Result commShrink(Comm comm, int* exclude, int count, Comm* newcomm, Config* config, int flags) = 0;
  virtual Result commGetUniqueId(Comm comm, UniqueId* id) = 0;
  virtual Result commGrow(Comm comm, int nranks, const UniqueId* id, int rank, Comm* newcomm, Config* config) = 0;
  virtual Result commGetAsyncError(Comm comm, Result* error) = 0;
  virtual Result commCount(Comm comm, int* count) = 0;
  virtual Result commUserRank(Comm comm, int* rank) = 0;
  virtual Result groupStart() = 0;
  virtual Result groupEnd() = 0;
  virtual Result send(const void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) = 0;
  virtual Result recv(void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) = 0;
  virtual const char* getErrorString(Result code) = 0;
  virtual const char* getLastError(Comm comm) = 0;
};

// ------------------------------------------------------------------------- CUDA runtime
class CudaApi {
 public:
  virtual ~CudaApi() = default;
  virtual std::string describe() = 0;
  // Whether "device" pointers are host addresses (CudaMock): a transport over this runtime
  // moves CPU tensors. Callers ask this instead of checking which class they were given.
  virtual bool host_memory() const { return false; }

  virtual CudaError memcpyAsync(void* dst, const void* src, std::size_t bytes, void* stream) = 0;
  virtual CudaError memcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                  std::size_t width, std::size_t height, void* stream) = 0;
  virtual CudaError memcpy3DAsync(const CudaMemcpy3DParms* params, void* stream) = 0;
  virtual CudaError eventCreate(void** event) = 0;  // with cudaEventDisableTiming
  virtual CudaError eventRecord(void* event, void* stream) = 0;
  virtual CudaError eventQuery(void* event) = 0;    // kCudaSuccess, kCudaErrorNotReady or an error
  virtual CudaError eventDestroy(void* event) = 0;
  virtual CudaError runtimeGetVersion(int* version) = 0;
  virtual CudaError driverGetVersion(int* version) = 0;
  virtual CudaError getDeviceCount(int* count) = 0;
  virtual const char* getErrorString(CudaError code) = 0;
};

// Throws CudaFailure naming `call` unless `code` is kCudaSuccess.
void check_cuda(CudaApi& cuda, const char* call, CudaError code);

}  // namespace layoutlang::nccl
