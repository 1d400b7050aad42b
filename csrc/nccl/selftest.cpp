// C++ tests of the communicator's call sequences over NcclMock, without Python in the loop
// (tests/test_nccl_mock.py runs them through _core.nccl.self_test() and checks the same
// paths again from Python). Each check appends a failure message; none means success.
#include "selftest.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <type_traits>

#include "box_copy.hpp"
#include "communicator.hpp"
#include "nccl_mock.hpp"

namespace layoutlang::nccl {

namespace {

struct Checker {
  std::vector<std::string> failures;
  std::string test;
  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back(test + ": " + what);
  }
};

std::vector<std::string> names(const std::vector<std::string>& calls) {
  std::vector<std::string> out;
  for (const std::string& c : calls) out.push_back(c.substr(0, c.find('(')));
  return out;
}

bool appears_before(const std::vector<std::string>& seq, const std::string& a, const std::string& b) {
  auto ia = std::find(seq.begin(), seq.end(), a);
  auto ib = std::find(seq.begin(), seq.end(), b);
  return ia != seq.end() && ib != seq.end() && ia < ib;
}

template <class E>
bool throws(const std::function<void()>& f, std::string* message = nullptr, std::string* call = nullptr) {
  try {
    f();
  } catch (const E& e) {
    if (message) *message = e.what();
    if constexpr (std::is_base_of_v<NcclError, E>) {
      if (call) *call = e.call();
    }
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

struct World {
  std::shared_ptr<NcclMock> nccl = std::make_shared<NcclMock>();
  std::shared_ptr<CudaMock> cuda = std::make_shared<CudaMock>(nccl);
  std::shared_ptr<Communicator> one(int nranks = 2, int rank = 0) {
    const UniqueId id = Communicator::new_unique_id(*nccl);
    return Communicator::init(nccl, cuda, nranks, rank, id, CommOptions{false, 5.0});
  }
};

void group_pairing(Checker& c) {
  c.test = "group pairing";
  World w;
  auto comm = w.one(2, 0);
  std::vector<char> a(16), b(16);
  w.nccl->clear_calls();
  w.nccl->fail("ncclSend", kInvalidArgument);
  std::string call;
  const bool thrown = throws<NcclError>(
      [&] {
        comm->exchange({{1, reinterpret_cast<uint64_t>(a.data()), 16}}, {{1, reinterpret_cast<uint64_t>(b.data()), 16}},
                       7);
      },
      nullptr, &call);
  c.expect(thrown && call == "ncclSend", "a failing ncclSend raises NcclError naming ncclSend");
  const auto seq = names(w.nccl->calls());
  c.expect(seq == std::vector<std::string>({"ncclGroupStart", "ncclRecv", "ncclSend", "ncclGroupEnd"}),
           "the group is closed after a failing send");
  c.expect(w.nccl->group_depth() == 0, "group depth returns to 0");
  c.expect(comm->state() == CommState::Failed, "the communicator is failed");
}

void revoke_before_shrink(Checker& c) {
  c.test = "revoke before shrink";
  World w;
  const UniqueId id = Communicator::new_unique_id(*w.nccl);
  // A 3-rank communicator of which only rank 0 lives here: its peers never answer.
  auto comm = Communicator::init(w.nccl, w.cuda, 3, 0, id, CommOptions{false, 5.0});
  std::vector<char> buf(8);
  const uint64_t t = comm->exchange({}, {{2, reinterpret_cast<uint64_t>(buf.data()), 8}}, 1);
  w.nccl->fail_async(kRemoteError, 2, 0);
  std::string call;
  c.expect(throws<NcclError>([&] { comm->wait(t, 5.0); }, nullptr, &call) && call == "ncclCommGetAsyncError",
           "an asynchronous error during wait raises NcclError naming ncclCommGetAsyncError");
  w.nccl->clear_calls();
  auto smaller = comm->shrink({2}, false);
  const auto seq = names(w.nccl->calls());
  c.expect(appears_before(seq, "ncclCommRevoke", "ncclCommShrink"), "ncclCommRevoke precedes ncclCommShrink");
  c.expect(smaller->size() == 2 && smaller->rank() == 0, "the shrunk communicator has 2 ranks");
  c.expect(comm->state() == CommState::Revoked, "the parent is revoked");
  // Abort mode: no revoke.
  World w2;
  auto comm2 = w2.one(3, 1);
  w2.nccl->fail_async(kRemoteError, 0, 1);
  comm2->async_error();
  w2.nccl->clear_calls();
  comm2->shrink({0}, true);
  const auto seq2 = names(w2.nccl->calls());
  c.expect(std::find(seq2.begin(), seq2.end(), "ncclCommRevoke") == seq2.end(), "abort mode does not revoke");
  c.expect(w2.nccl->calls().front().find("NCCL_SHRINK_ABORT") != std::string::npos, "abort mode passes NCCL_SHRINK_ABORT");
}

void grow_id_single_use(Checker& c) {
  c.test = "grow id";
  World w;
  auto comm = w.one(1, 0);
  const UniqueId id = comm->grow_unique_id();
  std::string message;
  c.expect(throws<NcclError>([&] { comm->grow_unique_id(); }, &message) && message.find("unconsumed") != std::string::npos,
           "a second id before the grow is refused");
  auto bigger = comm->grow(2, &id);
  c.expect(bigger->size() == 2 && bigger->rank() == 0, "the grown communicator has 2 ranks");
  const auto before = w.nccl->calls().size();
  c.expect(throws<NcclError>([&] { comm->grow(3, &id); }, &message) && message.find("already used") != std::string::npos,
           "a used id is refused");
  c.expect(w.nccl->calls().size() == before, "a refused grow makes no NCCL call");
  // A new rank joins with the id; a second join of the same rank is refused by NCCL.
  auto joined = Communicator::join(w.nccl, w.cuda, 2, 1, id, CommOptions{false, 5.0});
  c.expect(joined->rank() == 1 && joined->size() == 2, "a new rank joins as rank 1 of 2");
  c.expect(throws<NcclError>([&] { Communicator::join(w.nccl, w.cuda, 2, 1, id, CommOptions{false, 5.0}); }),
           "a second join of rank 1 with the same id fails");
}

void error_mapping(Checker& c) {
  c.test = "error mapping";
  const std::vector<Result> codes = {kUnhandledCudaError, kSystemError, kInternalError, kInvalidArgument,
                                     kInvalidUsage,       kRemoteError, kTimeout,       42};
  for (Result code : codes) {
    World w;
    auto comm = w.one(2, 0);
    w.nccl->fail("ncclGroupStart", code);
    std::vector<char> a(4);
    std::string message, call;
    const bool thrown = throws<NcclError>(
        [&] { comm->exchange({{1, reinterpret_cast<uint64_t>(a.data()), 4}}, {}, 1); }, &message, &call);
    c.expect(thrown && call == "ncclGroupStart" && message.find(result_name(code)) != std::string::npos &&
                 message.find("ncclGroupStart") != std::string::npos,
             "result " + std::to_string(code) + " names the call and the result: " + message);
    c.expect(w.nccl->group_depth() == 0, "no group left open when ncclGroupStart fails");
  }
}

void missing_symbol(Checker& c) {
  c.test = "missing symbol";
  World w;
  auto comm = w.one(2, 0);
  w.nccl->remove_symbol("ncclCommShrink");
  std::string message;
  c.expect(throws<NcclUnavailable>([&] { comm->shrink({1}, true); }, &message) &&
               message.find("ncclCommShrink") != std::string::npos && message.find("2.27") != std::string::npos,
           "a missing ncclCommShrink names itself and NCCL 2.27: " + message);
}

void box_copies(Checker& c) {
  c.test = "box copies";
  // A [3, 4, 5] box at (1, 2, 3) of a [6, 8, 10] float32 tensor, into a packed buffer.
  const int64_t D0 = 6, D1 = 8, D2 = 10;
  std::vector<float> src(D0 * D1 * D2), dst(3 * 4 * 5, -1.0f);
  std::iota(src.begin(), src.end(), 0.0f);
  BoxCopy box;
  box.src = reinterpret_cast<uint64_t>(src.data() + (1 * D1 + 2) * D2 + 3);
  box.dst = reinterpret_cast<uint64_t>(dst.data());
  box.itemsize = 4;
  box.sizes = {3, 4, 5};
  box.src_strides = {D1 * D2, D2, 1};
  box.dst_strides = {20, 5, 1};
  const auto plan = plan_box_copies({box});
  c.expect(plan.size() == 1 && plan[0].depth == 3 && plan[0].height == 4 && plan[0].width == 20,
           "a 3-D box is one 3-D copy");
  CudaMock cuda;
  const CopyStats stats = run_box_copies(cuda, plan, 0);
  c.expect(stats.calls == 1 && stats.bytes == 240, "one call, 240 bytes");
  bool same = true;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 5; ++k) same &= dst[(i * 4 + j) * 5 + k] == src[((1 + i) * D1 + 2 + j) * D2 + 3 + k];
  c.expect(same, "the packed bytes match the box");
  // Two adjacent contiguous pieces merge into one call.
  BoxCopy a, b;
  a.src = reinterpret_cast<uint64_t>(src.data());
  a.dst = reinterpret_cast<uint64_t>(dst.data());
  a.itemsize = 4, a.sizes = {10}, a.src_strides = {1}, a.dst_strides = {1};
  b = a;
  b.src += 40, b.dst += 40;
  c.expect(plan_box_copies({a, b}).size() == 1, "adjacent contiguous copies merge");
}

}  // namespace

std::vector<std::string> run_self_tests() {
  Checker c;
  const std::vector<std::function<void(Checker&)>> tests = {group_pairing, revoke_before_shrink, grow_id_single_use,
                                                             error_mapping, missing_symbol, box_copies};
  for (const auto& test : tests) {
    try {
      test(c);
    } catch (const std::exception& e) {
      c.failures.push_back(c.test + ": unexpected exception: " + e.what());
    }
  }
  return c.failures;
}

}  // namespace layoutlang::nccl
