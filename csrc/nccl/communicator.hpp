// An NCCL communicator for running plans: grouped point-to-point exchanges on the caller's
// CUDA stream, and the failure operations the elastic package builds on.
//
// Communicators are non-blocking by default (ncclConfig_t.blocking = 0): every NCCL call
// returns at once (ncclInProgress) and completion is polled with ncclCommGetAsyncError
// under a deadline, so a hung peer never blocks the host and the communicator can be
// aborted or revoked from the thread that waits. Pointers and streams are integers;
// Python owns the tensors.
//
// States and what each operation guarantees:
//   ready      exchanges run.
//   failed     an NCCL call or an asynchronous error failed. Only revoke, abort, shrink
//              and destroy are allowed.
//   revoked    ncclCommRevoke returned: every in-flight operation is stopped and the
//              communicator is quiescent, so shrink (default mode) and destroy are safe.
//   aborted    ncclCommAbort returned: the communicator is gone; it cannot shrink.
//   destroyed  finalized (when ready) and destroyed.
// A default-mode shrink after a failure revokes first (a quiescent parent is what
// NCCL_SHRINK_DEFAULT needs); abort mode (NCCL_SHRINK_ABORT) lets NCCL terminate the
// parent's operations itself. A grow id (ncclCommGetUniqueId) is single-use: one may be
// outstanding per communicator, and a grow consumes it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "nccl_api.hpp"

namespace layoutlang::nccl {

struct Transfer {
  int peer;        // rank in this communicator
  uint64_t ptr;    // device pointer
  uint64_t bytes;  // message size
};

struct CommOptions {
  bool blocking = false;  // true: NCCL calls block (no abort from the waiting thread)
  double timeout = 300.0;  // seconds for init, shrink, grow, revoke and finalize to complete
};

enum class CommState { Ready, Failed, Revoked, Aborted, Destroyed };
const char* state_name(CommState state);

class Communicator {
 public:
  // A fresh id for init (ncclGetUniqueId): rank 0 creates it and publishes it to the others.
  static UniqueId new_unique_id(NcclApi& api);
  // ncclCommInitRankConfig: every rank of the communicator calls it with the same id.
  static std::shared_ptr<Communicator> init(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, int nranks,
                                            int rank, const UniqueId& id, const CommOptions& options);
  // A new rank joining a grow (ncclCommGrow with no parent), with the coordinator's id.
  static std::shared_ptr<Communicator> join(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, int nranks,
                                            int rank, const UniqueId& id, const CommOptions& options);

  Communicator(std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, Comm comm, int rank, int size,
               const CommOptions& options);
  ~Communicator();  // aborts a communicator that was neither destroyed nor aborted
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  CommState state() const { return state_.load(); }
  const CommOptions& options() const { return options_; }

  // ncclCommGetAsyncError once; a real error moves the communicator to failed.
  Result async_error();

  // One ncclGroupStart / ncclGroupEnd holding every receive and send, enqueued on `stream`.
  // Returns a ticket for wait() (0 when there was nothing to do). The group is always
  // closed, even when a send or receive inside it fails.
  uint64_t exchange(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, uint64_t stream);
  // Polls the asynchronous error and the ticket's completion until `timeout` seconds pass.
  // True when done; false on timeout (the caller decides: abort or revoke). Throws
  // NcclError on an asynchronous error.
  bool wait(uint64_t ticket, double timeout);

  void abort();    // ncclCommAbort; idempotent
  void revoke();   // ncclCommRevoke, then wait until quiescent
  void destroy();  // finalize and destroy when ready; destroy when revoked; abort when failed

  // ncclCommShrink without the ranks in `exclude`; abort_mode selects NCCL_SHRINK_ABORT.
  std::shared_ptr<Communicator> shrink(const std::vector<int>& exclude, bool abort_mode);
  // ncclCommGetUniqueId: the coordinator's id for the next grow.
  UniqueId grow_unique_id();
  // ncclCommGrow of an existing rank to `nranks` ranks: the coordinator passes its id,
  // the other existing ranks pass none.
  std::shared_ptr<Communicator> grow(int nranks, const UniqueId* id);

 private:
  // Polls `comm` while `result` is ncclInProgress, until `timeout` seconds pass;
  // returns the final result, or kTimeout (ours) when the deadline passed.
  Result settle(Comm comm, Result result, double timeout);
  [[noreturn]] void fail(const std::string& call, Result code, Comm comm, const std::string& context = "");
  void require_ready(const char* call) const;
  void revoke_locked();
  void release_tickets();
  Config config() const;
  std::string where() const;

  std::shared_ptr<NcclApi> api_;
  std::shared_ptr<CudaApi> cuda_;
  Comm comm_;
  int rank_;
  int size_;
  CommOptions options_;
  std::atomic<CommState> state_{CommState::Ready};
  mutable std::recursive_mutex mu_;
  std::map<uint64_t, void*> tickets_;  // ticket -> CUDA event
  uint64_t next_ticket_ = 1;
  std::optional<UniqueId> pending_grow_id_;
  std::set<std::string> consumed_grow_ids_;
};

// Fails with the same message as the communicator would, for calls made without one.
[[noreturn]] void throw_nccl(NcclApi& api, const std::string& call, Result code, Comm comm, const std::string& where);

}  // namespace layoutlang::nccl
