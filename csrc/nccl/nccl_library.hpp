// The real NCCL and CUDA runtime, loaded with dlopen when first used; never linked, so the
// core builds and imports on machines without CUDA.
//
// Where a library comes from is a list of candidates tried in order (the Python side
// builds it, since it knows the environment variable and where pip put the wheels):
//   "process"   a library already loaded in this process (torch's): first a symbol in the
//               global namespace (dlsym(RTLD_DEFAULT)), then any loaded object whose file
//               name starts with libnccl.so / libcudart.so (loaded RTLD_LOCAL, as a
//               dependency of libtorch_cuda.so);
//   otherwise   a path or soname for dlopen (RTLD_LOCAL, so ours never shadows torch's).
// Functions are resolved lazily, on first call; a missing one throws NcclUnavailable
// naming the function and the NCCL version that introduced it. Libraries are never
// unloaded: NCCL keeps threads that would run unmapped code.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "nccl_api.hpp"

namespace layoutlang::nccl {

// Where a loaded library came from.
struct LoadedLibrary {
  void* handle = nullptr;
  std::string path;    // the file, as the dynamic linker reports it
  std::string origin;  // the candidate that matched ("process", a path, a soname)
};

// Tries each candidate; returns the first library that exports `probe`. On failure the
// message lists every candidate and why it failed.
LoadedLibrary load_first(const std::vector<std::string>& candidates, const char* probe, const char* file_prefix,
                         std::string& failures);

class NcclLibrary final : public NcclApi {
 public:
  // Throws NcclUnavailable (symbol "libnccl.so.2") when no candidate loads.
  static std::shared_ptr<NcclLibrary> load(const std::vector<std::string>& candidates);

  const std::string& path() const { return lib_.path; }
  const std::string& origin() const { return lib_.origin; }
  int version();

  std::string describe() override;
  bool has(const std::string& symbol) override;
  Result getVersion(int* version) override;
  Result getUniqueId(UniqueId* id) override;
  Result commInitRankConfig(Comm* comm, int nranks, UniqueId id, int rank, Config* config) override;
  Result commFinalize(Comm comm) override;
  Result commDestroy(Comm comm) override;
  Result commAbort(Comm comm) override;
  Result commRevoke(Comm comm, int flags) override;
  Result commShrink(Comm comm, int* exclude, int count, Comm* newcomm, Config* config, int flags) override;
  Result commGetUniqueId(Comm comm, UniqueId* id) override;
  Result commGrow(Comm comm, int nranks, const UniqueId* id, int rank, Comm* newcomm, Config* config) override;
  Result commGetAsyncError(Comm comm, Result* error) override;
  Result commCount(Comm comm, int* count) override;
  Result commUserRank(Comm comm, int* rank) override;
  Result groupStart() override;
  Result groupEnd() override;
  Result send(const void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) override;
  Result recv(void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) override;
  const char* getErrorString(Result code) override;
  const char* getLastError(Comm comm) override;

  enum Sym : int {
    GetVersion, GetUniqueId, CommInitRankConfig, CommFinalize, CommDestroy, CommAbort, CommRevoke, CommShrink,
    CommGetUniqueId, CommGrow, CommGetAsyncError, CommCount, CommUserRank, GroupStart, GroupEnd, Send, Recv,
    GetErrorString, GetLastError, NumSyms
  };

 private:
  explicit NcclLibrary(LoadedLibrary lib) : lib_(std::move(lib)) {
    for (auto& slot : cache_) slot.store(nullptr);
  }
  void* resolve(Sym sym);  // throws NcclUnavailable when missing
  template <class F>
  F fn(Sym sym) {
    return reinterpret_cast<F>(resolve(sym));
  }

  LoadedLibrary lib_;
  std::array<std::atomic<void*>, NumSyms> cache_;
  std::atomic<int> version_{0};
};

class CudaRuntime final : public CudaApi {
 public:
  // Throws CudaFailure (call "dlopen", code -1) when no candidate loads.
  static std::shared_ptr<CudaRuntime> load(const std::vector<std::string>& candidates);

  const std::string& path() const { return lib_.path; }
  const std::string& origin() const { return lib_.origin; }

  std::string describe() override;
  CudaError memcpyAsync(void* dst, const void* src, std::size_t bytes, void* stream) override;
  CudaError memcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
                          std::size_t height, void* stream) override;
  CudaError memcpy3DAsync(const CudaMemcpy3DParms* params, void* stream) override;
  CudaError eventCreate(void** event) override;
  CudaError eventRecord(void* event, void* stream) override;
  CudaError eventQuery(void* event) override;
  CudaError eventDestroy(void* event) override;
  CudaError runtimeGetVersion(int* version) override;
  CudaError driverGetVersion(int* version) override;
  CudaError getDeviceCount(int* count) override;
  const char* getErrorString(CudaError code) override;

  enum Sym : int {
    MemcpyAsync, Memcpy2DAsync, Memcpy3DAsync, EventCreateWithFlags, EventRecord, EventQuery, EventDestroy,
    RuntimeGetVersion, DriverGetVersion, GetDeviceCount, GetErrorString, NumSyms
  };

 private:
  explicit CudaRuntime(LoadedLibrary lib) : lib_(std::move(lib)) {
    for (auto& slot : cache_) slot.store(nullptr);
  }
  void* resolve(Sym sym);
  template <class F>
  F fn(Sym sym) {
    return reinterpret_cast<F>(resolve(sym));
  }

  LoadedLibrary lib_;
  std::array<std::atomic<void*>, NumSyms> cache_;
};

}  // namespace layoutlang::nccl
