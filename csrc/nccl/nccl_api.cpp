#include "nccl_api.hpp"

#include <map>

namespace layoutlang::nccl {

std::string result_name(Result code) {
  switch (code) {
    case kSuccess: return "ncclSuccess";
    case kUnhandledCudaError: return "ncclUnhandledCudaError";
    case kSystemError: return "ncclSystemError";
    case kInternalError: return "ncclInternalError";
    case kInvalidArgument: return "ncclInvalidArgument";
    case kInvalidUsage: return "ncclInvalidUsage";
    case kRemoteError: return "ncclRemoteError";
    case kInProgress: return "ncclInProgress";
    case kTimeout: return "ncclTimeout";
    default: return "ncclResult " + std::to_string(code);
  }
}

std::string result_meaning(Result code) {
  // Worded for the person who reads the exception: what probably happened.
  switch (code) {
    case kSuccess: return "success";
    case kUnhandledCudaError: return "a CUDA call inside NCCL failed (device lost, out of memory, bad pointer)";
    case kSystemError: return "a system call inside NCCL failed (socket, shared memory, out of host memory)";
    case kInternalError: return "an internal check of NCCL failed (a bug in NCCL, or memory corruption)";
    case kInvalidArgument: return "an argument was invalid (pointer, rank, count or configuration)";
    case kInvalidUsage: return "NCCL was used incorrectly (calls that do not match across ranks, or a misuse of the API)";
    case kRemoteError: return "a remote peer failed (its process died, was aborted, or the network failed)";
    case kInProgress: return "the operation is still in progress";
    case kTimeout: return "the operation timed out";
    default: return "an error code this version of layoutlang does not know";
  }
}

std::string introduced_in(const std::string& symbol) {
  // The functions the core resolves that are newer than the oldest NCCL it supports (2.14).
  static const std::map<std::string, std::string> versions = {
      {"ncclCommInitRankConfig", "2.14"}, {"ncclCommFinalize", "2.14"}, {"ncclCommShrink", "2.27"},
      {"ncclCommRevoke", "2.28"},         {"ncclCommGrow", "2.29"},     {"ncclCommGetUniqueId", "2.29"},
  };
  auto it = versions.find(symbol);
  return it == versions.end() ? std::string() : it->second;
}

std::string missing_symbol_message(const std::string& symbol, const std::string& where) {
  const std::string since = introduced_in(symbol);
  std::string text = symbol + " is not in " + where;
  if (!since.empty()) {
    text += ": it needs NCCL " + since +
            " or later (pip install -U nvidia-nccl-cu12, or point LAYOUTLANG_NCCL_LIBRARY at a newer libnccl.so.2)";
  }
  return text;
}

std::string version_string(int code) {
  if (code <= 0) return "unknown";
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

void check_cuda(CudaApi& cuda, const char* call, CudaError code) {
  if (code == kCudaSuccess) return;
  const char* text = cuda.getErrorString(code);
  throw CudaFailure(call, code,
                    std::string(call) + " failed: " + (text ? text : "unknown error") + " (cudaError " +
                        std::to_string(code) + ")");
}

}  // namespace layoutlang::nccl
