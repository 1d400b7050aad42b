#include "nccl_mock.hpp"

#include <cstring>
#include <sstream>

namespace layoutlang::nccl {

namespace {

std::string id_string(const UniqueId& id) {
  return std::string(id.internal, strnlen(id.internal, kUniqueIdBytes));
}

UniqueId make_id(const std::string& text) {
  UniqueId id;
  std::memset(&id, 0, sizeof id);
  std::memcpy(id.internal, text.data(), std::min(text.size(), kUniqueIdBytes - 1));
  return id;
}

const char* keep(const std::string& text) {
  // The C API returns const char*; one per thread stays valid until that thread's next call.
  thread_local std::string held;
  held = text;
  return held.c_str();
}

}  // namespace

// ===================================================================== NcclMock

NcclMock::NcclMock(int version, int progress_polls) : version_(version), progress_polls_(progress_polls) {}

void NcclMock::fail(const std::string& call, Result result, int skip, int times, bool async) {
  std::lock_guard<std::mutex> lock(mu_);
  scripts_.push_back(Script{call, result, skip, times, async});
}

void NcclMock::fail_async(Result result, int after_polls, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  async_scripts_.push_back(AsyncScript{result, after_polls, rank});
}

void NcclMock::remove_symbol(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  missing_.insert(name);
}

void NcclMock::set_version(int version) {
  std::lock_guard<std::mutex> lock(mu_);
  version_ = version;
}

std::vector<std::string> NcclMock::calls() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

void NcclMock::clear_calls() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
}

int64_t NcclMock::polls() {
  std::lock_guard<std::mutex> lock(mu_);
  return polls_;
}

int NcclMock::group_depth() {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = depth_.find(std::this_thread::get_id());
  return it == depth_.end() ? 0 : it->second;
}

int NcclMock::live_comms() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(comms_.size());
}

int NcclMock::pending_recvs() {
  std::lock_guard<std::mutex> lock(mu_);
  deliver();
  return static_cast<int>(recvs_.size());
}

std::string NcclMock::describe() {
  return "NcclMock (NCCL " + version_string(version_) + ")";
}

bool NcclMock::has(const std::string& symbol) {
  std::lock_guard<std::mutex> lock(mu_);
  return missing_.count(symbol) == 0;
}

Result NcclMock::enter(const char* name, const std::string& args, bool* async) {
  calls_.push_back(std::string(name) + "(" + args + ")");
  if (missing_.count(name)) {
    throw NcclUnavailable(name, introduced_in(name), missing_symbol_message(name, describe()));
  }
  return scripted(name, async);
}

Result NcclMock::scripted(const char* name, bool* async) {
  for (auto it = scripts_.begin(); it != scripts_.end(); ++it) {
    if (it->call != name) continue;
    if (it->skip > 0) {
      --it->skip;
      return -1;
    }
    const Result r = it->result;
    if (async) *async = it->async;
    if (--it->times <= 0) scripts_.erase(it);
    last_error_ = std::string("mock: scripted ") + result_name(r) + " from " + name;
    return r;
  }
  return -1;
}

NcclMock::MockComm* NcclMock::find(Comm comm) {
  auto it = comms_.find(comm);
  return it == comms_.end() ? nullptr : &it->second;
}

Comm NcclMock::create(MockComm c) {
  Comm handle = reinterpret_cast<Comm>(static_cast<uintptr_t>(0x10000 + 0x10 * next_comm_++));
  comms_[handle] = std::move(c);
  return handle;
}

Result NcclMock::start(MockComm& c, Result after) {
  if (c.blocking) {
    if (after != kSuccess && after != kInProgress) c.async = after;
    return after;
  }
  c.async = kInProgress;
  c.countdown = progress_polls_;
  c.after = after;
  return kInProgress;
}

Result NcclMock::error(Result code, const std::string& message) {
  last_error_ = "mock: " + message;
  return code;
}

std::string NcclMock::rank_of(Comm comm) {
  MockComm* c = find(comm);
  return c ? std::to_string(c->rank) : std::string("?");
}

void NcclMock::cancel(Comm comm) {
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if (it->second.comm == comm) {
      it = recvs_.erase(it);
    } else {
      ++it;
    }
  }
}

void NcclMock::deliver() {
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    PendingRecv& r = it->second;
    auto box = mail_.find(std::make_tuple(r.world, r.src, r.dst));
    if (box == mail_.end() || box->second.empty()) {
      ++it;
      continue;
    }
    std::vector<char>& message = box->second.front();
    if (message.size() != r.bytes) {
      // NCCL would hang or corrupt memory; the mock reports it on the receiver.
      if (MockComm* c = find(r.comm)) c->async = kInvalidUsage;
      last_error_ = "mock: ncclRecv of " + std::to_string(r.bytes) + " bytes from rank " + std::to_string(r.src) +
                    " met an ncclSend of " + std::to_string(message.size()) + " bytes";
    } else if (r.bytes) {
      std::memcpy(r.ptr, message.data(), r.bytes);
    }
    box->second.pop_front();
    it = recvs_.erase(it);
  }
}

std::vector<uint64_t> NcclMock::pending_on_stream(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  deliver();
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : recvs_) {
    if (r.stream == stream) ids.push_back(id);
  }
  return ids;
}

bool NcclMock::all_done(const std::vector<uint64_t>& recv_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  deliver();
  for (uint64_t id : recv_ids) {
    if (recvs_.count(id)) return false;
  }
  return true;
}

Result NcclMock::getVersion(int* version) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclGetVersion", "", nullptr);
  if (s >= 0) return s;
  *version = version_;
  return kSuccess;
}

Result NcclMock::getUniqueId(UniqueId* id) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclGetUniqueId", "", nullptr);
  if (s >= 0) return s;
  *id = make_id("mock-init-" + std::to_string(next_uid_++));
  return kSuccess;
}

Result NcclMock::commInitRankConfig(Comm* comm, int nranks, UniqueId id, int rank, Config* config) {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream args;
  args << "nranks=" << nranks << ", rank=" << rank << ", blocking=" << (config ? config->blocking : -1);
  bool async = false;
  const Result s = enter("ncclCommInitRankConfig", args.str(), &async);
  *comm = nullptr;
  if (s >= 0 && !async) return s;
  if (!config || config->magic != kApiMagic || config->size < offsetof(Config, cgaClusterSize)) {
    return error(kInvalidArgument, "ncclConfig_t not initialized by NCCL_CONFIG_INITIALIZER");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) return error(kInvalidArgument, "invalid rank");
  MockComm c;
  c.world = id_string(id);
  c.rank = rank;
  c.nranks = nranks;
  c.blocking = config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT means blocking
  *comm = create(c);
  return start(comms_[*comm], s >= 0 ? s : kSuccess);
}

Result NcclMock::commFinalize(Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  bool async = false;
  const Result s = enter("ncclCommFinalize", "rank=" + rank_of(comm), &async);
  MockComm* c = find(comm);
  if (s >= 0 && !async) return s;
  if (!c) return error(kInvalidArgument, "ncclCommFinalize of an invalid communicator");
  if (c->revoked) return error(kInvalidUsage, "ncclCommFinalize after ncclCommRevoke is invalid");
  return start(*c, s >= 0 ? s : kSuccess);
}

Result NcclMock::commDestroy(Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclCommDestroy", "rank=" + rank_of(comm), nullptr);
  if (s >= 0) return s;
  if (!find(comm)) return error(kInvalidArgument, "ncclCommDestroy of an invalid communicator");
  cancel(comm);
  comms_.erase(comm);
  return kSuccess;
}

Result NcclMock::commAbort(Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclCommAbort", "rank=" + rank_of(comm), nullptr);
  if (s >= 0) return s;
  if (!find(comm)) return error(kInvalidArgument, "ncclCommAbort of an invalid communicator");
  cancel(comm);
  comms_.erase(comm);
  return kSuccess;
}

Result NcclMock::commRevoke(Comm comm, int flags) {
  std::lock_guard<std::mutex> lock(mu_);
  bool async = false;
  const Result s = enter("ncclCommRevoke", "rank=" + rank_of(comm) + ", flags=" + std::to_string(flags), &async);
  MockComm* c = find(comm);
  if (s >= 0 && !async) return s;
  if (!c) return error(kInvalidArgument, "ncclCommRevoke of an invalid communicator");
  if (flags != kRevokeDefault) return error(kInvalidArgument, "revokeFlags must be NCCL_REVOKE_DEFAULT");
  c->revoked = true;
  c->async = kSuccess;  // in-flight operations stop; the communicator becomes quiescent
  cancel(comm);
  return start(*c, s >= 0 ? s : kSuccess);
}

Result NcclMock::commShrink(Comm comm, int* exclude, int count, Comm* newcomm, Config* config, int flags) {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream args;
  args << "rank=" << rank_of(comm) << ", exclude=[";
  for (int i = 0; i < count; ++i) args << (i ? ", " : "") << exclude[i];
  args << "], flags=" << (flags == kShrinkAbort ? "NCCL_SHRINK_ABORT" : flags == kShrinkDefault ? "NCCL_SHRINK_DEFAULT" : std::to_string(flags));
  bool async = false;
  const Result s = enter("ncclCommShrink", args.str(), &async);
  *newcomm = nullptr;
  if (s >= 0 && !async) return s;
  MockComm* c = find(comm);
  if (!c) return error(kInvalidArgument, "ncclCommShrink of an invalid communicator");
  if (flags != kShrinkDefault && flags != kShrinkAbort) return error(kInvalidArgument, "invalid shrinkFlags");
  const bool failed = c->async != kSuccess && c->async != kInProgress;
  if (failed && !c->revoked && flags == kShrinkDefault) {
    return error(kInvalidUsage,
                 "ncclCommShrink(NCCL_SHRINK_DEFAULT) of a communicator with an error: revoke it first or use "
                 "NCCL_SHRINK_ABORT");
  }
  std::set<int> excluded;
  for (int i = 0; i < count; ++i) {
    if (exclude[i] < 0 || exclude[i] >= c->nranks || exclude[i] == c->rank) {
      return error(kInvalidArgument, "invalid rank " + std::to_string(exclude[i]) + " in excludeRanksList");
    }
    excluded.insert(exclude[i]);
  }
  if (flags == kShrinkAbort) cancel(comm);
  MockComm child;
  child.world = c->world + "/shrink" + std::to_string(c->shrinks++);
  child.rank = c->rank;
  for (int r : excluded) child.rank -= r < c->rank ? 1 : 0;
  child.nranks = c->nranks - static_cast<int>(excluded.size());
  child.blocking = config ? config->blocking != 0 : c->blocking;
  *newcomm = create(child);
  return start(comms_[*newcomm], s >= 0 ? s : kSuccess);
}

Result NcclMock::commGetUniqueId(Comm comm, UniqueId* id) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclCommGetUniqueId", "rank=" + rank_of(comm), nullptr);
  if (s >= 0) return s;
  MockComm* c = find(comm);
  if (!c) return error(kInvalidArgument, "ncclCommGetUniqueId of an invalid communicator");
  if (c->grow_outstanding) return error(kInvalidUsage, "a previous grow id of this communicator is unconsumed");
  GrowId g;
  g.issuer = comm;
  g.world = c->world + "/grow" + std::to_string(c->grows);
  g.old_nranks = c->nranks;
  const std::string key = "mock-grow-" + std::to_string(next_uid_++);
  grow_ids_[key] = g;
  c->grow_outstanding = true;
  *id = make_id(key);
  return kSuccess;
}

Result NcclMock::commGrow(Comm comm, int nranks, const UniqueId* id, int rank, Comm* newcomm, Config* config) {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream args;
  args << "rank=" << (comm ? rank_of(comm) : std::string("new")) << ", nranks=" << nranks
       << ", id=" << (id ? "set" : "null") << ", newrank=" << rank;
  bool async = false;
  const Result s = enter("ncclCommGrow", args.str(), &async);
  *newcomm = nullptr;
  if (s >= 0 && !async) return s;
  MockComm child;
  if (comm) {
    MockComm* c = find(comm);
    if (!c) return error(kInvalidArgument, "ncclCommGrow of an invalid communicator");
    if (rank != -1) return error(kInvalidArgument, "existing ranks pass rank = -1 to ncclCommGrow");
    if (nranks <= c->nranks) return error(kInvalidArgument, "ncclCommGrow must add ranks");
    if (id) {
      auto it = grow_ids_.find(id_string(*id));
      if (it == grow_ids_.end() || it->second.issuer != comm) {
        return error(kInvalidUsage, "the grow id was not issued by this communicator");
      }
      if (it->second.consumed) return error(kInvalidUsage, "the grow id was already consumed");
      it->second.consumed = true;
      c->grow_outstanding = false;
    }
    child.world = c->world + "/grow" + std::to_string(c->grows++);
    child.rank = c->rank;
    child.blocking = config ? config->blocking != 0 : c->blocking;
  } else {
    if (!id) return error(kInvalidArgument, "a new rank needs the coordinator's grow id");
    auto it = grow_ids_.find(id_string(*id));
    if (it == grow_ids_.end()) return error(kInvalidUsage, "unknown grow id");
    GrowId& g = it->second;
    if (rank < g.old_nranks || rank >= nranks) return error(kInvalidArgument, "invalid rank for a new rank of a grow");
    if (g.joined.count(rank)) return error(kInvalidUsage, "rank " + std::to_string(rank) + " already joined with this id");
    g.joined.insert(rank);
    child.world = g.world;
    child.rank = rank;
    child.blocking = config ? config->blocking != 0 : true;
  }
  child.nranks = nranks;
  *newcomm = create(child);
  return start(comms_[*newcomm], s >= 0 ? s : kSuccess);
}

Result NcclMock::commGetAsyncError(Comm comm, Result* error_out) {
  std::lock_guard<std::mutex> lock(mu_);
  ++polls_;  // counted, not logged: waits poll it many times
  const Result s = scripted("ncclCommGetAsyncError", nullptr);
  if (s >= 0) return s;
  MockComm* c = find(comm);
  if (!c) return error(kInvalidArgument, "ncclCommGetAsyncError of an invalid communicator");
  deliver();
  for (auto it = async_scripts_.begin(); it != async_scripts_.end(); ++it) {
    if (it->rank != -1 && it->rank != c->rank) continue;
    if (c->async != kSuccess) break;
    if (it->after-- <= 0) {
      c->async = it->result;
      last_error_ = "mock: scripted asynchronous " + result_name(it->result);
      async_scripts_.erase(it);
    }
    break;
  }
  if (c->async == kInProgress && --c->countdown <= 0) c->async = c->after;
  *error_out = c->async;
  return kSuccess;
}

Result NcclMock::commCount(Comm comm, int* count) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclCommCount", "rank=" + rank_of(comm), nullptr);
  if (s >= 0) return s;
  MockComm* c = find(comm);
  if (!c) return error(kInvalidArgument, "ncclCommCount of an invalid communicator");
  *count = c->nranks;
  return kSuccess;
}

Result NcclMock::commUserRank(Comm comm, int* rank) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclCommUserRank", "rank=" + rank_of(comm), nullptr);
  if (s >= 0) return s;
  MockComm* c = find(comm);
  if (!c) return error(kInvalidArgument, "ncclCommUserRank of an invalid communicator");
  *rank = c->rank;
  return kSuccess;
}

Result NcclMock::groupStart() {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclGroupStart", "", nullptr);
  if (s >= 0) return s;
  ++depth_[std::this_thread::get_id()];
  return kSuccess;
}

Result NcclMock::execute(std::vector<Op>& ops, Result scripted, bool scripted_async) {
  // Validate everything first: NCCL fails the whole group on a bad argument.
  std::set<Comm> involved;
  for (const Op& op : ops) {
    MockComm* c = find(op.comm);
    if (!c) return error(kInvalidArgument, "an operation on an invalid communicator");
    if (c->revoked) return error(kInvalidUsage, "an operation on a revoked communicator");
    if (op.peer < 0 || op.peer >= c->nranks) return error(kInvalidArgument, "invalid peer " + std::to_string(op.peer));
    involved.insert(op.comm);
  }
  if (scripted >= 0 && !scripted_async) return scripted;
  if (scripted < 0) {
    for (const Op& op : ops) {
      MockComm& c = comms_[op.comm];
      if (op.is_send) {
        const char* p = static_cast<const char*>(op.buf);
        mail_[std::make_tuple(c.world, c.rank, op.peer)].emplace_back(p, p + op.bytes);
      } else {
        recvs_[next_recv_++] = PendingRecv{c.world, op.peer, c.rank, static_cast<char*>(const_cast<void*>(op.buf)),
                                           op.bytes, op.stream, op.comm};
      }
    }
  }
  Result result = kSuccess;
  for (Comm comm : involved) {
    const Result r = start(comms_[comm], scripted >= 0 ? scripted : kSuccess);
    if (r != kSuccess) result = r;
  }
  return result;
}

Result NcclMock::groupEnd() {
  std::lock_guard<std::mutex> lock(mu_);
  bool async = false;
  const Result s = enter("ncclGroupEnd", "", &async);
  const auto me = std::this_thread::get_id();
  int& depth = depth_[me];
  if (depth == 0) return error(kInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--depth > 0) return s >= 0 ? s : kSuccess;
  std::vector<Op> ops;
  ops.swap(group_ops_[me]);
  return execute(ops, s, async);
}

Result NcclMock::send(const void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclSend",
                         "rank=" + rank_of(comm) + ", peer=" + std::to_string(peer) + ", bytes=" + std::to_string(count),
                         nullptr);
  if (s >= 0) return s;
  if (datatype != kUint8) return error(kInvalidArgument, "the mock moves ncclUint8 only");
  if (!find(comm)) return error(kInvalidArgument, "ncclSend on an invalid communicator");
  std::vector<Op> single{Op{true, buf, count, peer, comm, stream}};
  const auto me = std::this_thread::get_id();
  if (depth_[me] > 0) {
    group_ops_[me].push_back(single[0]);
    return kSuccess;
  }
  return execute(single, -1, false);
}

Result NcclMock::recv(void* buf, std::size_t count, int datatype, int peer, Comm comm, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const Result s = enter("ncclRecv",
                         "rank=" + rank_of(comm) + ", peer=" + std::to_string(peer) + ", bytes=" + std::to_string(count),
                         nullptr);
  if (s >= 0) return s;
  if (datatype != kUint8) return error(kInvalidArgument, "the mock moves ncclUint8 only");
  if (!find(comm)) return error(kInvalidArgument, "ncclRecv on an invalid communicator");
  std::vector<Op> single{Op{false, buf, count, peer, comm, stream}};
  const auto me = std::this_thread::get_id();
  if (depth_[me] > 0) {
    group_ops_[me].push_back(single[0]);
    return kSuccess;
  }
  return execute(single, -1, false);
}

const char* NcclMock::getErrorString(Result code) {
  return keep(result_name(code));
}

const char* NcclMock::getLastError(Comm) {
  std::lock_guard<std::mutex> lock(mu_);
  return keep(last_error_);
}

// ===================================================================== CudaMock

CudaMock::CudaMock(std::shared_ptr<NcclMock> fabric) : fabric_(std::move(fabric)) {}

void CudaMock::fail(const std::string& call, CudaError code, int skip, int times) {
  std::lock_guard<std::mutex> lock(mu_);
  scripts_.emplace_back(call, code, skip, times);
}

std::vector<std::string> CudaMock::calls() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

void CudaMock::clear_calls() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
}

std::string CudaMock::describe() {
  return "CudaMock (host memory)";
}

CudaError CudaMock::enter(const char* name, const std::string& args) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.push_back(std::string(name) + "(" + args + ")");
  for (auto it = scripts_.begin(); it != scripts_.end(); ++it) {
    auto& [call, code, skip, times] = *it;
    if (call != name) continue;
    if (skip > 0) {
      --skip;
      return -1;
    }
    const CudaError r = code;
    if (--times <= 0) scripts_.erase(it);
    return r;
  }
  return -1;
}

CudaError CudaMock::memcpyAsync(void* dst, const void* src, std::size_t bytes, void*) {
  const CudaError s = enter("cudaMemcpyAsync", "bytes=" + std::to_string(bytes));
  if (s >= 0) return s;
  if (bytes) std::memmove(dst, src, bytes);
  return kCudaSuccess;
}

CudaError CudaMock::memcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                  std::size_t width, std::size_t height, void*) {
  const CudaError s = enter("cudaMemcpy2DAsync", "width=" + std::to_string(width) + ", height=" + std::to_string(height) +
                                                     ", dpitch=" + std::to_string(dpitch) + ", spitch=" + std::to_string(spitch));
  if (s >= 0) return s;
  if (dpitch < width || spitch < width) return 1;  // cudaErrorInvalidValue, as the runtime answers
  for (std::size_t y = 0; y < height; ++y) {
    std::memcpy(static_cast<char*>(dst) + y * dpitch, static_cast<const char*>(src) + y * spitch, width);
  }
  return kCudaSuccess;
}

CudaError CudaMock::memcpy3DAsync(const CudaMemcpy3DParms* p, void*) {
  const CudaExtent& e = p->extent;
  const CudaError s = enter("cudaMemcpy3DAsync", "width=" + std::to_string(e.width) + ", height=" + std::to_string(e.height) +
                                                     ", depth=" + std::to_string(e.depth));
  if (s >= 0) return s;
  if (p->srcArray || p->dstArray || p->srcPtr.pitch < e.width || p->dstPtr.pitch < e.width ||
      p->srcPtr.ysize < e.height || p->dstPtr.ysize < e.height) {
    return 1;  // cudaErrorInvalidValue
  }
  for (std::size_t z = 0; z < e.depth; ++z) {
    for (std::size_t y = 0; y < e.height; ++y) {
      char* d = static_cast<char*>(p->dstPtr.ptr) + (z * p->dstPtr.ysize + y) * p->dstPtr.pitch;
      const char* sp = static_cast<const char*>(p->srcPtr.ptr) + (z * p->srcPtr.ysize + y) * p->srcPtr.pitch;
      std::memcpy(d, sp, e.width);
    }
  }
  return kCudaSuccess;
}

CudaError CudaMock::eventCreate(void** event) {
  const CudaError s = enter("cudaEventCreateWithFlags", "");
  if (s >= 0) return s;
  std::lock_guard<std::mutex> lock(mu_);
  *event = reinterpret_cast<void*>(static_cast<uintptr_t>(0x20000 + 0x10 * next_event_++));
  events_[*event] = {};
  return kCudaSuccess;
}

CudaError CudaMock::eventRecord(void* event, void* stream) {
  const CudaError s = enter("cudaEventRecord", "");
  if (s >= 0) return s;
  std::vector<uint64_t> waiting = fabric_ ? fabric_->pending_on_stream(stream) : std::vector<uint64_t>{};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(event);
  if (it == events_.end()) return 400;  // cudaErrorInvalidResourceHandle
  it->second = std::move(waiting);
  return kCudaSuccess;
}

CudaError CudaMock::eventQuery(void* event) {
  // Not logged: waits poll it many times.
  std::vector<uint64_t> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = scripts_.begin(); it != scripts_.end(); ++it) {
      auto& [call, code, skip, times] = *it;
      if (call != "cudaEventQuery") continue;
      if (skip > 0) {
        --skip;
        break;
      }
      const CudaError r = code;
      if (--times <= 0) scripts_.erase(it);
      return r;
    }
    auto it = events_.find(event);
    if (it == events_.end()) return 400;
    waiting = it->second;
  }
  if (fabric_ && !fabric_->all_done(waiting)) return kCudaErrorNotReady;
  return kCudaSuccess;
}

CudaError CudaMock::eventDestroy(void* event) {
  const CudaError s = enter("cudaEventDestroy", "");
  if (s >= 0) return s;
  std::lock_guard<std::mutex> lock(mu_);
  return events_.erase(event) ? kCudaSuccess : 400;
}

CudaError CudaMock::runtimeGetVersion(int* version) {
  *version = 13000;
  return kCudaSuccess;
}

CudaError CudaMock::driverGetVersion(int* version) {
  *version = 0;
  return kCudaSuccess;
}

CudaError CudaMock::getDeviceCount(int* count) {
  *count = 0;
  return kCudaSuccess;
}

const char* CudaMock::getErrorString(CudaError code) {
  return keep(code == kCudaErrorNotReady ? "cudaErrorNotReady" : "mock CUDA error " + std::to_string(code));
}

}  // namespace layoutlang::nccl
