#include "communicator.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace layoutlang::nccl {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  const double capped = std::min(std::max(seconds, 0.0), 1e7);  // no overflow for "forever"
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(capped));
}

// Polling backoff: short first (most completions are fast), at most 1 ms between polls so
// a timeout is noticed promptly without spinning a core.
struct Backoff {
  std::chrono::microseconds delay{20};
  void pause() {
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::microseconds(1000));
  }
};

std::string id_key(const UniqueId& id) {
  return std::string(id.internal, kUniqueIdBytes);
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

const char* state_name(CommState state) {
  switch (state) {
    case CommState::Ready: return "ready";
    case CommState::Failed: return "failed";
    case CommState::Revoked: return "revoked";
    case CommState::Aborted: return "aborted";
    case CommState::Destroyed: return "destroyed";
  }
  return "unknown";
}

void throw_nccl(NcclApi& api, const std::string& call, Result code, Comm comm, const std::string& where) {
  std::string text = call + " failed" + (where.empty() ? "" : " on " + where) + ": " + result_name(code) + ", " +
                     result_meaning(code);
  const char* detail = nullptr;
  try {
    detail = api.getLastError(comm);
  } catch (const std::exception&) {
    detail = nullptr;  // the detail is a courtesy; never hide the real error behind it
  }
  if (detail && detail[0]) text += " (NCCL: " + std::string(detail) + ")";
  if (code == kTimeout) throw NcclTimeout(call, code, text);
  throw NcclError(call, code, text);
}

// ------------------------------------------------------------------ construction

UniqueId Communicator::new_unique_id(NcclApi& api) {
  UniqueId id;
  std::memset(&id, 0, sizeof id);
  const Result r = api.getUniqueId(&id);
  if (r != kSuccess) throw_nccl(api, "ncclGetUniqueId", r, nullptr, "");
  return id;
}

namespace {

Config make_config(const CommOptions& options) {
  Config c = default_config();
  c.blocking = options.blocking ? 1 : 0;
  return c;
}

// Shared by init and join: settle a communicator that is being created, or clean it up.
std::shared_ptr<Communicator> finish_creation(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda,
                                              const char* call, Result r, Comm comm, int rank, int nranks,
                                              const CommOptions& options) {
  const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(nranks);
  auto deadline = deadline_after(options.timeout);
  Backoff backoff;
  while (r == kInProgress && comm) {
    Result state = kSuccess;
    const Result q = api->commGetAsyncError(comm, &state);
    if (q != kSuccess) {
      r = q;
      break;
    }
    r = state;
    if (r != kInProgress) break;
    if (Clock::now() >= deadline) {
      api->commAbort(comm);
      throw NcclTimeout(call, kTimeout,
                        std::string(call) + " did not complete within " + seconds(options.timeout) + " s on " + where +
                            ": not every rank joined (a rank may have died, hung or never started); the "
                            "communicator was aborted");
    }
    backoff.pause();
  }
  if (r != kSuccess) {
    try {
      throw_nccl(*api, call, r == kInProgress ? kInternalError : r, comm, where);
    } catch (const NcclError& e) {
      if (comm) api->commAbort(comm);
      throw;
    }
  }
  if (!comm) throw NcclError(call, kInternalError, std::string(call) + " returned no communicator on " + where);
  return std::make_shared<Communicator>(std::move(api), std::move(cuda), comm, rank, nranks, options);
}

}  // namespace

std::shared_ptr<Communicator> Communicator::init(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda,
                                                 int nranks, int rank, const UniqueId& id,
                                                 const CommOptions& options) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw NcclError("ncclCommInitRankConfig", kInvalidArgument,
                    "ncclCommInitRankConfig not called: rank " + std::to_string(rank) + " is not in 0.." +
                        std::to_string(nranks - 1));
  }
  Comm comm = nullptr;
  Config config = make_config(options);
  const Result r = api->commInitRankConfig(&comm, nranks, id, rank, &config);
  return finish_creation(std::move(api), std::move(cuda), "ncclCommInitRankConfig", r, comm, rank, nranks, options);
}

std::shared_ptr<Communicator> Communicator::join(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda,
                                                 int nranks, int rank, const UniqueId& id,
                                                 const CommOptions& options) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw NcclError("ncclCommGrow", kInvalidArgument,
                    "ncclCommGrow not called: the new rank " + std::to_string(rank) + " is not in 0.." +
                        std::to_string(nranks - 1));
  }
  Comm comm = nullptr;
  Config config = make_config(options);
  const Result r = api->commGrow(nullptr, nranks, &id, rank, &comm, &config);
  return finish_creation(std::move(api), std::move(cuda), "ncclCommGrow", r, comm, rank, nranks, options);
}

Communicator::Communicator(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, Comm comm, int rank,
                           int size, const CommOptions& options)
    : api_(std::move(api)), cuda_(std::move(cuda)), comm_(comm), rank_(rank), size_(size), options_(options) {}

Communicator::~Communicator() {
  try {
    const CommState s = state_.load();
    if (s != CommState::Aborted && s != CommState::Destroyed) abort();
  } catch (...) {
    // A destructor must not throw; the process is tearing the communicator down anyway.
  }
}

// ------------------------------------------------------------------ helpers

std::string Communicator::where() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(size_);
}

Config Communicator::config() const {
  return make_config(options_);
}

void Communicator::fail(const std::string& call, Result code, Comm comm, const std::string& context) {
  if (state_.load() == CommState::Ready) state_.store(CommState::Failed);
  throw_nccl(*api_, call, code, comm ? comm : comm_, where() + context);
}

void Communicator::require_ready(const char* call) const {
  const CommState s = state_.load();
  if (s == CommState::Ready) return;
  throw NcclError(call, kInvalidUsage,
                  std::string(call) + " not called on " + where() + ": the communicator is " + state_name(s) +
                      (s == CommState::Failed ? " (revoke, shrink or abort it)" : ""));
}

Result Communicator::settle(Comm comm, Result result, double timeout) {
  auto deadline = deadline_after(timeout);
  Backoff backoff;
  while (result == kInProgress) {
    Result state = kSuccess;
    const Result q = api_->commGetAsyncError(comm, &state);
    if (q != kSuccess) return q;
    result = state;
    if (result != kInProgress) break;
    if (Clock::now() >= deadline) return kTimeout;
    backoff.pause();
  }
  return result;
}

void Communicator::release_tickets() {
  for (auto& [ticket, event] : tickets_) {
    if (event) cuda_->eventDestroy(event);  // freed once its work is done or abandoned
  }
  tickets_.clear();
}

// ------------------------------------------------------------------ exchange

Result Communicator::async_error() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const CommState s = state_.load();
  if (s == CommState::Aborted || s == CommState::Destroyed) return kInvalidUsage;
  Result state = kSuccess;
  const Result q = api_->commGetAsyncError(comm_, &state);
  if (q != kSuccess) fail("ncclCommGetAsyncError", q, comm_);
  if (state != kSuccess && state != kInProgress && s == CommState::Ready) state_.store(CommState::Failed);
  return state;
}

uint64_t Communicator::exchange(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs,
                                uint64_t stream) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  require_ready("ncclGroupStart");
  for (const auto* list : {&recvs, &sends}) {
    for (const Transfer& t : *list) {
      if (t.peer < 0 || t.peer >= size_) {
        throw NcclError(list == &sends ? "ncclSend" : "ncclRecv", kInvalidArgument,
                        "exchange not started on " + where() + ": peer " + std::to_string(t.peer) +
                            " is not a rank of the communicator (0.." + std::to_string(size_ - 1) + ")");
      }
      if (t.bytes > 0 && t.ptr == 0) {
        throw NcclError(list == &sends ? "ncclSend" : "ncclRecv", kInvalidArgument,
                        "exchange not started on " + where() + ": a null buffer for " + std::to_string(t.bytes) +
                            " bytes with peer " + std::to_string(t.peer));
      }
    }
  }
  if (sends.empty() && recvs.empty()) return 0;
  void* s = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));

  Result r = api_->groupStart();
  if (r != kSuccess) fail("ncclGroupStart", r, comm_);
  // Every call inside the group is made under one rule: after the first failure no
  // further operation is posted, but ncclGroupEnd is always called, so the thread's
  // group depth returns to zero and NCCL is usable again.
  std::string failed_call;
  Result failed = kSuccess;
  int failed_peer = -1;
  for (const Transfer& t : recvs) {
    r = api_->recv(reinterpret_cast<void*>(static_cast<uintptr_t>(t.ptr)), t.bytes, kUint8, t.peer, comm_, s);
    if (r != kSuccess && r != kInProgress) {
      failed_call = "ncclRecv", failed = r, failed_peer = t.peer;
      break;
    }
  }
  if (failed == kSuccess) {
    for (const Transfer& t : sends) {
      r = api_->send(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.ptr)), t.bytes, kUint8, t.peer, comm_, s);
      if (r != kSuccess && r != kInProgress) {
        failed_call = "ncclSend", failed = r, failed_peer = t.peer;
        break;
      }
    }
  }
  r = api_->groupEnd();
  if (failed != kSuccess) fail(failed_call, failed, comm_, " (peer " + std::to_string(failed_peer) + ")");
  r = settle(comm_, r, options_.timeout);
  if (r == kTimeout) {
    fail("ncclGroupEnd", kTimeout, comm_, ": the group was not enqueued within " + seconds(options_.timeout) + " s");
  }
  if (r != kSuccess) fail("ncclGroupEnd", r, comm_);

  // An event after the group: waiting on it waits for these transfers only, not for
  // work the caller enqueues later on the same stream (the next bucket's packing).
  void* event = nullptr;
  check_cuda(*cuda_, "cudaEventCreateWithFlags", cuda_->eventCreate(&event));
  const CudaError recorded = cuda_->eventRecord(event, s);
  if (recorded != kCudaSuccess) {
    cuda_->eventDestroy(event);
    check_cuda(*cuda_, "cudaEventRecord", recorded);
  }
  const uint64_t ticket = next_ticket_++;
  tickets_[ticket] = event;
  return ticket;
}

bool Communicator::wait(uint64_t ticket, double timeout) {
  if (ticket == 0) return true;
  auto deadline = deadline_after(timeout);
  Backoff backoff;
  while (true) {
    {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      const CommState s = state_.load();
      if (s == CommState::Aborted || s == CommState::Destroyed || s == CommState::Revoked) {
        throw NcclError("ncclCommGetAsyncError", kInvalidUsage,
                        "the exchange on " + where() + " was abandoned: the communicator was " + state_name(s) +
                            " while waiting");
      }
      auto it = tickets_.find(ticket);
      if (it == tickets_.end()) {
        throw NcclError("ncclCommGetAsyncError", kInvalidUsage,
                        "no exchange with ticket " + std::to_string(ticket) + " is pending on " + where());
      }
      Result state = kSuccess;
      const Result q = api_->commGetAsyncError(comm_, &state);
      if (q != kSuccess) fail("ncclCommGetAsyncError", q, comm_);
      if (state != kSuccess && state != kInProgress) fail("ncclCommGetAsyncError", state, comm_, " (during an exchange)");
      const CudaError done = cuda_->eventQuery(it->second);
      if (done == kCudaSuccess) {
        cuda_->eventDestroy(it->second);
        tickets_.erase(it);
        return true;
      }
      if (done != kCudaErrorNotReady) check_cuda(*cuda_, "cudaEventQuery", done);
    }
    if (Clock::now() >= deadline) return false;
    backoff.pause();
  }
}

// ------------------------------------------------------------------ failure operations

void Communicator::abort() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const CommState s = state_.load();
  if (s == CommState::Aborted || s == CommState::Destroyed) return;
  release_tickets();
  state_.store(CommState::Aborted);
  const Result r = api_->commAbort(comm_);
  // ncclInProgress: NCCL finishes the teardown on its own; nothing is left to poll.
  if (r != kSuccess && r != kInProgress) throw_nccl(*api_, "ncclCommAbort", r, nullptr, where());
}

void Communicator::revoke_locked() {
  const Result r = api_->commRevoke(comm_, kRevokeDefault);
  const Result settled = r == kInProgress ? settle(comm_, r, options_.timeout) : r;
  if (settled == kTimeout) {
    fail("ncclCommRevoke", kTimeout, comm_,
         ": in-flight operations did not stop within " + seconds(options_.timeout) + " s");
  }
  if (settled != kSuccess) fail("ncclCommRevoke", settled, comm_);
  release_tickets();
  state_.store(CommState::Revoked);
}

void Communicator::revoke() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const CommState s = state_.load();
  if (s == CommState::Revoked) return;
  if (s == CommState::Aborted || s == CommState::Destroyed) {
    throw NcclError("ncclCommRevoke", kInvalidUsage,
                    std::string("ncclCommRevoke not called on ") + where() + ": the communicator is " + state_name(s));
  }
  revoke_locked();
}

void Communicator::destroy() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const CommState s = state_.load();
  if (s == CommState::Aborted || s == CommState::Destroyed) return;
  if (s == CommState::Failed) {
    abort();  // a failed communicator cannot finalize: its peers may never answer
    return;
  }
  release_tickets();
  if (s == CommState::Ready) {
    // Finalize flushes what was issued, so a peer still receiving gets its bytes.
    Result r = api_->commFinalize(comm_);
    r = settle(comm_, r, options_.timeout);
    if (r != kSuccess) {
      const Result code = r;
      abort();
      throw_nccl(*api_, "ncclCommFinalize", code, nullptr, where() + " (the communicator was aborted)");
    }
  }
  // After revoke, finalize is invalid; destroy is what NCCL allows.
  const Result r = api_->commDestroy(comm_);
  state_.store(CommState::Destroyed);
  if (r != kSuccess && r != kInProgress) throw_nccl(*api_, "ncclCommDestroy", r, nullptr, where());
}

std::shared_ptr<Communicator> Communicator::shrink(const std::vector<int>& exclude, bool abort_mode) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const CommState s = state_.load();
  if (s == CommState::Aborted || s == CommState::Destroyed) {
    throw NcclError("ncclCommShrink", kInvalidUsage,
                    std::string("ncclCommShrink not called on ") + where() + ": the communicator is " + state_name(s) +
                        " (an aborted communicator cannot shrink; revoke a failed one instead of aborting it)");
  }
  std::set<int> unique(exclude.begin(), exclude.end());
  for (int r : unique) {
    if (r < 0 || r >= size_ || r == rank_) {
      throw NcclError("ncclCommShrink", kInvalidArgument,
                      "ncclCommShrink not called on " + where() + ": cannot exclude rank " + std::to_string(r) +
                          (r == rank_ ? " (this rank: excluded ranks do not call shrink)" : " (not a rank of it)"));
    }
  }
  // Revoke before shrink after a failure: NCCL_SHRINK_DEFAULT needs a quiescent parent.
  if (!abort_mode && s == CommState::Failed) revoke_locked();

  std::vector<int> list(unique.begin(), unique.end());
  Comm child = nullptr;
  Config cfg = config();
  Result r = api_->commShrink(comm_, list.data(), static_cast<int>(list.size()), &child, &cfg,
                              abort_mode ? kShrinkAbort : kShrinkDefault);
  if (r == kInProgress && child) r = settle(child, r, options_.timeout);
  if (r != kSuccess) {
    std::string context;
    if (r == kTimeout) context = ": not every remaining rank joined within " + seconds(options_.timeout) + " s";
    try {
      throw_nccl(*api_, "ncclCommShrink", r, child, where() + context);
    } catch (const NcclError&) {
      if (child) api_->commAbort(child);
      throw;
    }
  }
  int new_rank = -1, new_size = -1;
  if (api_->commUserRank(child, &new_rank) != kSuccess || api_->commCount(child, &new_size) != kSuccess) {
    new_rank = rank_ - static_cast<int>(std::count_if(list.begin(), list.end(), [&](int x) { return x < rank_; }));
    new_size = size_ - static_cast<int>(list.size());
  }
  return std::make_shared<Communicator>(api_, cuda_, child, new_rank, new_size, options_);
}

UniqueId Communicator::grow_unique_id() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  require_ready("ncclCommGetUniqueId");
  if (pending_grow_id_) {
    throw NcclError("ncclCommGetUniqueId", kInvalidUsage,
                    "ncclCommGetUniqueId not called on " + where() +
                        ": a grow id from this communicator is still unconsumed; grow with it first (NCCL allows "
                        "one outstanding grow id per communicator)");
  }
  UniqueId id;
  std::memset(&id, 0, sizeof id);
  const Result r = api_->commGetUniqueId(comm_, &id);
  if (r != kSuccess) fail("ncclCommGetUniqueId", r, comm_);
  pending_grow_id_ = id;
  return id;
}

std::shared_ptr<Communicator> Communicator::grow(int nranks, const UniqueId* id) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  require_ready("ncclCommGrow");
  if (nranks <= size_) {
    throw NcclError("ncclCommGrow", kInvalidArgument,
                    "ncclCommGrow not called on " + where() + ": growing to " + std::to_string(nranks) +
                        " ranks does not add any");
  }
  if (id) {
    const std::string key = id_key(*id);
    if (consumed_grow_ids_.count(key)) {
      throw NcclError("ncclCommGrow", kInvalidUsage,
                      "ncclCommGrow not called on " + where() +
                          ": this grow id was already used; ids are single-use, ask for a new one");
    }
    if (!pending_grow_id_ || id_key(*pending_grow_id_) != key) {
      throw NcclError("ncclCommGrow", kInvalidUsage,
                      "ncclCommGrow not called on " + where() +
                          ": the id is not the one this communicator issued (only the coordinator passes an id; "
                          "the other existing ranks pass none)");
    }
  }
  Comm child = nullptr;
  Config cfg = config();
  Result r = api_->commGrow(comm_, nranks, id, -1, &child, &cfg);
  if (id) {
    // Consumed whatever the outcome: NCCL never accepts an id twice.
    consumed_grow_ids_.insert(id_key(*id));
    pending_grow_id_.reset();
  }
  if (r == kInProgress && child) r = settle(child, r, options_.timeout);
  if (r != kSuccess) {
    std::string context;
    if (r == kTimeout) context = ": not every new rank joined within " + seconds(options_.timeout) + " s";
    try {
      throw_nccl(*api_, "ncclCommGrow", r, child, where() + context);
    } catch (const NcclError&) {
      if (child) api_->commAbort(child);
      throw;
    }
  }
  return std::make_shared<Communicator>(api_, cuda_, child, rank_, nranks, options_);
}

}  // namespace layoutlang::nccl
