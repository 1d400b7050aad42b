// NcclMock and CudaMock: stand-ins for NCCL and the CUDA runtime, for tests on machines
// without a GPU.
//
// NcclMock records every call (its name and arguments) in a log that tests compare
// with the expected sequence, enforces the rules NCCL enforces (group pairing, one
// outstanding grow id, single-use grow ids, revoke or abort mode before shrinking a
// failed communicator, no finalize after revoke), and can be scripted to fail any call,
// synchronously or through the asynchronous error, at the n-th occurrence. It is also a
// small fabric: communicators created from the same id in one process (one per thread)
// really exchange bytes, so the executor runs over it on CPU tensors. Sends are
// buffered at ncclGroupEnd; a receive completes when the matching send has arrived.
// Non-blocking communicators report ncclInProgress for `progress_polls` polls of
// ncclCommGetAsyncError before an operation completes, as NCCL does.
//
// CudaMock copies with host memcpy (pointers are host addresses) and completes an event
// when the receives enqueued before it on its stream have been delivered by the fabric.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "nccl_api.hpp"

namespace layoutlang::nccl {

class NcclMock final : public NcclApi {
 public:
  explicit NcclMock(int version = version_code(2, 32, 3), int progress_polls = 1);

  // Scripting. The (skip+1)-th next call of `call` returns `result`, `times` times in a
  // row; with `async`, the call returns ncclInProgress and its communicator's
  // asynchronous error becomes `result` once the operation "completes".
  void fail(const std::string& call, Result result, int skip = 0, int times = 1, bool async = false);
  // The asynchronous error of communicators with user rank `rank` (any when -1) becomes
  // `result` after `after_polls` polls of ncclCommGetAsyncError (a peer dying mid-transfer).
  void fail_async(Result result, int after_polls = 0, int rank = -1);
  // The library lacks `name` (an older NCCL): calling it throws NcclUnavailable.
  void remove_symbol(const std::string& name);
  void set_version(int version);

  std::vector<std::string> calls();  // "ncclSend(rank=0, peer=1, bytes=16)", in order
  void clear_calls();
  int64_t polls();                   // ncclCommGetAsyncError calls (not logged)
  int group_depth();                 // of the calling thread
  int live_comms();                  // communicators neither destroyed nor aborted
  int pending_recvs();               // posted receives whose send has not arrived

  // The fabric, for CudaMock.
  std::vector<uint64_t> pending_on_stream(void* stream);
  bool all_done(const std::vector<uint64_t>& recv_ids);

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

 private:
  struct MockComm {
    std::string world;
    int rank = 0;
    int nranks = 0;
    bool blocking = true;
    Result async = kSuccess;
    int countdown = 0;
    Result after = kSuccess;
    bool revoked = false;
    int shrinks = 0;
    int grows = 0;
    bool grow_outstanding = false;
  };
  struct Op {
    bool is_send;
    const void* buf;
    std::size_t bytes;
    int peer;
    Comm comm;
    void* stream;
  };
  struct PendingRecv {
    std::string world;
    int src, dst;
    char* ptr;
    std::size_t bytes;
    void* stream;
    Comm comm;
  };
  struct Script {
    std::string call;
    Result result;
    int skip;
    int times;
    bool async;
  };
  struct AsyncScript {
    Result result;
    int after;
    int rank;
  };
  struct GrowId {
    Comm issuer;
    bool consumed = false;
    std::string world;
    int old_nranks = 0;
    std::set<int> joined;
  };

  // Logs the call; throws NcclUnavailable for a removed symbol; returns a scripted result
  // (with *async set) or -1.
  Result enter(const char* name, const std::string& args, bool* async);
  Result scripted(const char* name, bool* async);  // the script part of enter, without the log
  MockComm* find(Comm comm);
  Comm create(MockComm c);
  Result start(MockComm& c, Result after);  // a (non-)blocking completion
  Result error(Result code, const std::string& message);
  Result execute(std::vector<Op>& ops, Result scripted, bool scripted_async);
  void deliver();
  void cancel(Comm comm);
  std::string rank_of(Comm comm);

  std::mutex mu_;
  int version_;
  int progress_polls_;
  std::map<Comm, MockComm> comms_;
  std::map<std::tuple<std::string, int, int>, std::deque<std::vector<char>>> mail_;
  std::map<uint64_t, PendingRecv> recvs_;
  std::map<std::thread::id, std::vector<Op>> group_ops_;
  std::map<std::thread::id, int> depth_;
  std::vector<std::string> calls_;
  std::vector<Script> scripts_;
  std::vector<AsyncScript> async_scripts_;
  std::set<std::string> missing_;
  std::map<std::string, GrowId> grow_ids_;
  uint64_t next_comm_ = 1;
  uint64_t next_uid_ = 1;
  uint64_t next_recv_ = 1;
  int64_t polls_ = 0;
  std::string last_error_;
};

class CudaMock final : public CudaApi {
 public:
  explicit CudaMock(std::shared_ptr<NcclMock> fabric = nullptr);

  // The (skip+1)-th next call of `call` returns `code`, `times` times.
  void fail(const std::string& call, CudaError code, int skip = 0, int times = 1);
  std::vector<std::string> calls();
  void clear_calls();

  std::string describe() override;
  bool host_memory() const override { return true; }
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

 private:
  CudaError enter(const char* name, const std::string& args);

  std::shared_ptr<NcclMock> fabric_;
  std::mutex mu_;
  std::vector<std::string> calls_;
  std::vector<std::tuple<std::string, CudaError, int, int>> scripts_;
  std::map<void*, std::vector<uint64_t>> events_;
  uint64_t next_event_ = 1;
};

}  // namespace layoutlang::nccl
