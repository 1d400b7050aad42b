#include "nccl_library.hpp"

#include <dlfcn.h>
#include <link.h>

#include <cstring>

namespace layoutlang::nccl {

namespace {

const char* const kNcclNames[NcclLibrary::NumSyms] = {
    "ncclGetVersion",    "ncclGetUniqueId",     "ncclCommInitRankConfig", "ncclCommFinalize",
    "ncclCommDestroy",   "ncclCommAbort",       "ncclCommRevoke",         "ncclCommShrink",
    "ncclCommGetUniqueId", "ncclCommGrow",      "ncclCommGetAsyncError",  "ncclCommCount",
    "ncclCommUserRank",  "ncclGroupStart",      "ncclGroupEnd",           "ncclSend",
    "ncclRecv",          "ncclGetErrorString",  "ncclGetLastError",
};

const char* const kCudaNames[CudaRuntime::NumSyms] = {
    "cudaMemcpyAsync",   "cudaMemcpy2DAsync",    "cudaMemcpy3DAsync", "cudaEventCreateWithFlags",
    "cudaEventRecord",   "cudaEventQuery",       "cudaEventDestroy",  "cudaRuntimeGetVersion",
    "cudaDriverGetVersion", "cudaGetDeviceCount", "cudaGetErrorString",
};

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// The path of the object a handle refers to.
std::string handle_path(void* handle, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && map->l_name[0]) return map->l_name;
  return fallback;
}

struct PhdrSearch {
  const char* prefix;
  std::string found;
};

int find_by_prefix(struct dl_phdr_info* info, size_t, void* data) {
  auto* search = static_cast<PhdrSearch*>(data);
  if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
  const char* slash = std::strrchr(info->dlpi_name, '/');
  const char* base = slash ? slash + 1 : info->dlpi_name;
  if (std::strncmp(base, search->prefix, std::strlen(search->prefix)) == 0) {
    search->found = info->dlpi_name;
    return 1;
  }
  return 0;
}

// A library already in the process that exports `probe`; handle is null when none.
LoadedLibrary find_in_process(const char* probe, const char* file_prefix, std::string& why) {
  LoadedLibrary lib;
  std::string path;
  // Global namespace first: torch's CUDA builds load their NVIDIA libraries RTLD_GLOBAL.
  if (void* sym = dlsym(RTLD_DEFAULT, probe)) {
    Dl_info info;
    if (dladdr(sym, &info) && info.dli_fname) path = info.dli_fname;
  }
  // Then objects loaded RTLD_LOCAL (a dependency of an extension module).
  if (path.empty()) {
    PhdrSearch search{file_prefix, {}};
    dl_iterate_phdr(find_by_prefix, &search);
    path = search.found;
  }
  if (path.empty()) {
    why = std::string("no ") + file_prefix + "* is loaded in this process";
    return lib;
  }
  void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (!handle) {
    why = path + ": " + dl_error();
    return lib;
  }
  if (!dlsym(handle, probe)) {
    why = path + " is loaded but does not export " + probe;
    return lib;
  }
  lib.handle = handle;
  lib.path = handle_path(handle, path);
  lib.origin = "process";
  return lib;
}

}  // namespace

LoadedLibrary load_first(const std::vector<std::string>& candidates, const char* probe, const char* file_prefix,
                         std::string& failures) {
  for (const std::string& candidate : candidates) {
    std::string why;
    if (candidate == "process") {
      LoadedLibrary lib = find_in_process(probe, file_prefix, why);
      if (lib.handle) return lib;
    } else {
      void* handle = dlopen(candidate.c_str(), RTLD_LAZY | RTLD_LOCAL);
      if (!handle) {
        why = dl_error();
      } else if (!dlsym(handle, probe)) {
        why = std::string("does not export ") + probe;
      } else {
        return LoadedLibrary{handle, handle_path(handle, candidate), candidate};
      }
    }
    failures += "\n  " + candidate + ": " + why;
  }
  return LoadedLibrary{};
}

// ------------------------------------------------------------------------- NCCL

std::shared_ptr<NcclLibrary> NcclLibrary::load(const std::vector<std::string>& candidates) {
  std::string failures;
  LoadedLibrary lib = load_first(candidates, "ncclGetVersion", "libnccl.so", failures);
  if (!lib.handle) {
    throw NcclUnavailable("libnccl.so.2", "", "no NCCL library could be loaded; tried:" + failures);
  }
  return std::shared_ptr<NcclLibrary>(new NcclLibrary(std::move(lib)));
}

void* NcclLibrary::resolve(Sym sym) {
  void* f = cache_[sym].load(std::memory_order_acquire);
  if (f) return f;
  f = dlsym(lib_.handle, kNcclNames[sym]);
  if (!f) {
    const std::string name = kNcclNames[sym];
    throw NcclUnavailable(name, introduced_in(name), missing_symbol_message(name, describe()));
  }
  cache_[sym].store(f, std::memory_order_release);
  return f;
}

int NcclLibrary::version() {
  int v = version_.load();
  if (v == 0) {
    if (getVersion(&v) != kSuccess) v = -1;
    version_.store(v);
  }
  return v;
}

std::string NcclLibrary::describe() {
  const int v = version();
  return "NCCL " + version_string(v) + " (" + lib_.path + ")";
}

bool NcclLibrary::has(const std::string& symbol) {
  return dlsym(lib_.handle, symbol.c_str()) != nullptr;
}

Result NcclLibrary::getVersion(int* version) {
  return fn<Result (*)(int*)>(GetVersion)(version);
}
Result NcclLibrary::getUniqueId(UniqueId* id) {
  return fn<Result (*)(UniqueId*)>(GetUniqueId)(id);
}
Result NcclLibrary::commInitRankConfig(Comm* comm, int nranks, UniqueId id, int rank, Config* config) {
  return fn<Result (*)(Comm*, int, UniqueId, int, Config*)>(CommInitRankConfig)(comm, nranks, id, rank, config);
}
Result NcclLibrary::commFinalize(Comm comm) {
  return fn<Result (*)(Comm)>(CommFinalize)(comm);
}
Result NcclLibrary::commDestroy(Comm comm) {
  return fn<Result (*)(Comm)>(CommDestroy)(comm);
}
Result NcclLibrary::commAbort(Comm comm) {
  return fn<Result (*)(Comm)>(CommAbort)(comm);
}
Result NcclLibrary::commRevoke(Comm comm, int flags) {
  return fn<Result (*)(Comm, int)>(CommRevoke)(comm, flags);
}
Result NcclLibrary::commShrink(Comm comm, int* exclude, int count, Comm* newcomm, Config* config, int flags) {
  return fn<Result (*)(Comm, int*, int, Comm*, Config*, int)>(CommShrink)(comm, exclude, count, newcomm, config, flags);
}
Result NcclLibrary::commGetUniqueId(Comm comm, UniqueId* id) {
  return fn<Result (*)(Comm, UniqueId*)>(CommGetUniqueId)(comm, id);
}
Result NcclLibrary::commGrow(Comm comm, int nranks, const UniqueId* id, int rank, Comm* newcomm, Config* config) {
  return fn<Result (*)(Comm, int, const UniqueId*, int, Comm*, Config*)>(CommGrow)(comm, nranks, id, rank, newcomm,
                                                                                 config);
}
Result NcclLibrary::commGetAsyncError(Comm comm, Result* error) {
  return fn<Result (*)(Comm, Result*)>(CommGetAsyncError)(comm, error);
}
Result NcclLibrary::commCount(Comm comm, int* count) {
  return fn<Result (*)(Comm, int*)>(CommCount)(comm, count);
}
Result NcclLibrary::commUserRank(Comm comm, int* rank) {
  return fn<Result (*)(Comm, int*)>(CommUserRank)(comm, rank);
}
Result NcclLibrary::groupStart() {
  return fn<Result (*)()>(GroupStart)();
}
Result NcclLibrary::groupEnd() {
  return fn<Result (*)()>(GroupEnd)();
}
Result NcclLibrary::send(const void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) {
  return fn<Result (*)(const void*, std::size_t, int, int, Comm, void*)>(Send)(buf, count, datatype, peer, comm, stream);
}
Result NcclLibrary::recv(void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) {
  return fn<Result (*)(void*, std::size_t, int, int, Comm, void*)>(Recv)(buf, count, datatype, peer, comm, stream);
}
const char* NcclLibrary::getErrorString(Result code) {
  return fn<const char* (*)(Result)>(GetErrorString)(code);
}
const char* NcclLibrary::getLastError(Comm comm) {
  // Older than 2.13: no ncclGetLastError; an empty detail is better than a second error.
  if (!has("ncclGetLastError")) return "";
  return fn<const char* (*)(Comm)>(GetLastError)(comm);
}

// ------------------------------------------------------------------------- CUDA runtime

std::shared_ptr<CudaRuntime> CudaRuntime::load(const std::vector<std::string>& candidates) {
  std::string failures;
  LoadedLibrary lib = load_first(candidates, "cudaEventQuery", "libcudart.so", failures);
  if (!lib.handle) throw CudaFailure("dlopen", -1, "no CUDA runtime could be loaded; tried:" + failures);
  return std::shared_ptr<CudaRuntime>(new CudaRuntime(std::move(lib)));
}

void* CudaRuntime::resolve(Sym sym) {
  void* f = cache_[sym].load(std::memory_order_acquire);
  if (f) return f;
  f = dlsym(lib_.handle, kCudaNames[sym]);
  if (!f) throw CudaFailure(kCudaNames[sym], -1, std::string(kCudaNames[sym]) + " is not in " + lib_.path);
  cache_[sym].store(f, std::memory_order_release);
  return f;
}

std::string CudaRuntime::describe() {
  int v = 0;
  std::string version = runtimeGetVersion(&v) == kCudaSuccess
                            ? std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10)
                            : std::string("unknown");
  return "CUDA runtime " + version + " (" + lib_.path + ")";
}

CudaError CudaRuntime::memcpyAsync(void* dst, const void* src, std::size_t bytes, void* stream) {
  return fn<CudaError (*)(void*, const void*, std::size_t, int, void*)>(MemcpyAsync)(dst, src, bytes,
                                                                                     kCudaMemcpyDefault, stream);
}
CudaError CudaRuntime::memcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                     std::size_t width, std::size_t height, void* stream) {
  return fn<CudaError (*)(void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t, int, void*)>(
      Memcpy2DAsync)(dst, dpitch, src, spitch, width, height, kCudaMemcpyDefault, stream);
}
CudaError CudaRuntime::memcpy3DAsync(const CudaMemcpy3DParms* params, void* stream) {
  return fn<CudaError (*)(const CudaMemcpy3DParms*, void*)>(Memcpy3DAsync)(params, stream);
}
CudaError CudaRuntime::eventCreate(void** event) {
  return fn<CudaError (*)(void**, unsigned)>(EventCreateWithFlags)(event, kCudaEventDisableTiming);
}
CudaError CudaRuntime::eventRecord(void* event, void* stream) {
  return fn<CudaError (*)(void*, void*)>(EventRecord)(event, stream);
}
CudaError CudaRuntime::eventQuery(void* event) {
  return fn<CudaError (*)(void*)>(EventQuery)(event);
}
CudaError CudaRuntime::eventDestroy(void* event) {
  return fn<CudaError (*)(void*)>(EventDestroy)(event);
}
CudaError CudaRuntime::runtimeGetVersion(int* version) {
  return fn<CudaError (*)(int*)>(RuntimeGetVersion)(version);
}
CudaError CudaRuntime::driverGetVersion(int* version) {
  return fn<CudaError (*)(int*)>(DriverGetVersion)(version);
}
CudaError CudaRuntime::getDeviceCount(int* count) {
  return fn<CudaError (*)(int*)>(GetDeviceCount)(count);
}
const char* CudaRuntime::getErrorString(CudaError code) {
  return fn<const char* (*)(CudaError)>(GetErrorString)(code);
}

}  // namespace layoutlang::nccl
