// Python bindings of the NCCL core: the `_core.nccl` submodule. The only file under
// csrc/nccl that knows Python. Registered from bindings.cpp with one call.
//
// Exceptions map to layoutlang.nccl (imported when an error is raised, so importing
// _core stays light): NcclError / NcclTimeoutError (call, code), NcclUnavailableError
// (symbol, introduced), CudaError (call, code). Calls that may wait (init, exchange, wait,
// shrink, grow, revoke, destroy, copies) release the GIL, so ranks running in threads
// progress together and a waiting thread never blocks the interpreter.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "box_copy.hpp"
#include "communicator.hpp"
#include "nccl_library.hpp"
#include "nccl_mock.hpp"
#include "selftest.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace layoutlang::nccl {

namespace {

void raise_python(const char* name, const nb::tuple& args) {
  nb::object cls = nb::module_::import_("layoutlang.nccl").attr(name);
  nb::object exc = cls(*args);
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

UniqueId to_id(const nb::bytes& data) {
  if (data.size() != kUniqueIdBytes) {
    throw nb::value_error(("an NCCL unique id has " + std::to_string(kUniqueIdBytes) + " bytes, not " +
                           std::to_string(data.size()))
                              .c_str());
  }
  UniqueId id;
  std::memcpy(id.internal, data.c_str(), kUniqueIdBytes);
  return id;
}

nb::bytes from_id(const UniqueId& id) {
  return nb::bytes(id.internal, kUniqueIdBytes);
}

using TransferTuple = std::tuple<int, uint64_t, uint64_t>;  // peer, pointer, bytes

std::vector<Transfer> to_transfers(const std::vector<TransferTuple>& list) {
  std::vector<Transfer> out;
  out.reserve(list.size());
  for (const auto& [peer, ptr, bytes] : list) out.push_back(Transfer{peer, ptr, bytes});
  return out;
}

using Desc = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// Rows: dst, src, itemsize, sizes[D], dst_strides[D], src_strides[D].
std::vector<BoxCopy> to_copies(const Desc& desc) {
  const std::size_t rows = desc.shape(0), cols = desc.shape(1);
  if (cols < 3 || (cols - 3) % 3 != 0) {
    throw nb::value_error("a box copy row is (dst, src, itemsize, sizes[D], dst_strides[D], src_strides[D])");
  }
  const std::size_t d = (cols - 3) / 3;
  std::vector<BoxCopy> out(rows);
  const int64_t* p = desc.data();
  for (std::size_t r = 0; r < rows; ++r, p += cols) {
    BoxCopy& c = out[r];
    c.dst = static_cast<uint64_t>(p[0]);
    c.src = static_cast<uint64_t>(p[1]);
    c.itemsize = p[2];
    c.sizes.assign(p + 3, p + 3 + d);
    c.dst_strides.assign(p + 3 + d, p + 3 + 2 * d);
    c.src_strides.assign(p + 3 + 2 * d, p + 3 + 3 * d);
  }
  return out;
}

CommOptions options(bool blocking, double timeout) {
  CommOptions o;
  o.blocking = blocking;
  o.timeout = timeout;
  return o;
}

}  // namespace

void register_bindings(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "nccl", "NCCL loaded at run time: communicators, grouped point-to-point, failure operations, box copies.");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NcclTimeout& e) {
      raise_python("NcclTimeoutError", nb::make_tuple(e.what(), e.call(), e.code()));
    } catch (const NcclError& e) {
      raise_python("NcclError", nb::make_tuple(e.what(), e.call(), e.code()));
    } catch (const NcclUnavailable& e) {
      raise_python("NcclUnavailableError", nb::make_tuple(e.what(), e.symbol(), e.introduced()));
    } catch (const CudaFailure& e) {
      raise_python("CudaError", nb::make_tuple(e.what(), e.call(), e.code()));
    }
  });

  m.attr("UNIQUE_ID_BYTES") = kUniqueIdBytes;
  m.attr("SHRINK_DEFAULT") = kShrinkDefault;
  m.attr("SHRINK_ABORT") = kShrinkAbort;
  m.def("result_name", &result_name, "code"_a, "ncclRemoteError for 6.");
  m.def("result_meaning", &result_meaning, "code"_a, "What a result means, in one clause.");
  m.def("introduced_in", &introduced_in, "symbol"_a, "The NCCL version that introduced a function, or ''.");
  m.def("version_string", &version_string, "code"_a, "'2.32.3' for 23203.");

  nb::class_<NcclApi>(m, "NcclApi", "NCCL behind an interface: the real library or the mock.")
      .def("describe", &NcclApi::describe)
      .def("has", &NcclApi::has, "symbol"_a, "Whether the library offers a function.")
      .def_prop_ro("version", [](NcclApi& api) {
        int v = 0;
        const Result r = api.getVersion(&v);
        if (r != kSuccess) throw_nccl(api, "ncclGetVersion", r, nullptr, "");
        return v;
      });

  nb::class_<NcclLibrary, NcclApi>(m, "NcclLibrary", "libnccl loaded with dlopen; functions resolved lazily.")
      .def_static("load", &NcclLibrary::load, "candidates"_a,
                  "The first candidate that loads ('process' = a libnccl already in this process).")
      .def_prop_ro("path", &NcclLibrary::path)
      .def_prop_ro("origin", &NcclLibrary::origin);

  nb::class_<NcclMock, NcclApi>(m, "NcclMock", "A scripted stand-in for NCCL that records every call.")
      .def(nb::init<int, int>(), "version"_a = version_code(2, 32, 3), "progress_polls"_a = 1)
      .def("fail", &NcclMock::fail, "call"_a, "result"_a, "skip"_a = 0, "times"_a = 1, "async_"_a = false)
      .def("fail_async", &NcclMock::fail_async, "result"_a, "after_polls"_a = 0, "rank"_a = -1)
      .def("remove_symbol", &NcclMock::remove_symbol, "name"_a)
      .def("set_version", &NcclMock::set_version, "version"_a)
      .def_prop_ro("calls", &NcclMock::calls)
      .def("clear_calls", &NcclMock::clear_calls)
      .def_prop_ro("polls", &NcclMock::polls)
      .def("group_depth", &NcclMock::group_depth)
      .def("live_comms", &NcclMock::live_comms)
      .def("pending_recvs", &NcclMock::pending_recvs);

  nb::class_<CudaApi>(m, "CudaApi", "The CUDA runtime behind an interface: the real one or the mock.")
      .def("describe", &CudaApi::describe)
      .def_prop_ro("runtime_version", [](CudaApi& c) {
        int v = 0;
        check_cuda(c, "cudaRuntimeGetVersion", c.runtimeGetVersion(&v));
        return v;
      })
      .def_prop_ro("driver_version", [](CudaApi& c) {
        int v = 0;
        // Without a driver the runtime answers 0 (or an error): both mean "no driver".
        return c.driverGetVersion(&v) == kCudaSuccess ? v : 0;
      })
      .def_prop_ro("device_count", [](CudaApi& c) {
        int n = 0;
        return c.getDeviceCount(&n) == kCudaSuccess ? n : 0;
      });

  nb::class_<CudaRuntime, CudaApi>(m, "CudaRuntime", "libcudart loaded with dlopen.")
      .def_static("load", &CudaRuntime::load, "candidates"_a)
      .def_prop_ro("path", &CudaRuntime::path)
      .def_prop_ro("origin", &CudaRuntime::origin);

  nb::class_<CudaMock, CudaApi>(m, "CudaMock", "Host-memory copies; events complete when the mock fabric delivers.")
      .def(nb::init<std::shared_ptr<NcclMock>>(), "fabric"_a = nb::none())
      .def("fail", &CudaMock::fail, "call"_a, "code"_a, "skip"_a = 0, "times"_a = 1)
      .def_prop_ro("calls", &CudaMock::calls)
      .def("clear_calls", &CudaMock::clear_calls);

  m.def(
      "unique_id", [](NcclApi& api) { return from_id(Communicator::new_unique_id(api)); }, "api"_a,
      "A fresh id for creating a communicator (ncclGetUniqueId), as 128 bytes.");

  nb::class_<Communicator>(m, "Communicator", "An NCCL communicator (see csrc/nccl/communicator.hpp).")
      .def_static(
          "init",
          [](std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, int nranks, int rank, nb::bytes id,
             bool blocking, double timeout) {
            const UniqueId uid = to_id(id);
            nb::gil_scoped_release release;
            return Communicator::init(std::move(api), std::move(cuda), nranks, rank, uid, options(blocking, timeout));
          },
          "api"_a, "cuda"_a, "nranks"_a, "rank"_a, "unique_id"_a, "blocking"_a = false, "timeout"_a = 300.0)
      .def_static(
          "join",
          [](std::shared_ptr<NcclApi> api, std::shared_ptr<CudaApi> cuda, int nranks, int rank, nb::bytes id,
             bool blocking, double timeout) {
            const UniqueId uid = to_id(id);
            nb::gil_scoped_release release;
            return Communicator::join(std::move(api), std::move(cuda), nranks, rank, uid, options(blocking, timeout));
          },
          "api"_a, "cuda"_a, "nranks"_a, "rank"_a, "unique_id"_a, "blocking"_a = false, "timeout"_a = 300.0)
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("state", [](const Communicator& c) { return std::string(state_name(c.state())); })
      .def_prop_ro("blocking", [](const Communicator& c) { return c.options().blocking; })
      .def_prop_ro("timeout", [](const Communicator& c) { return c.options().timeout; })
      .def("async_error", &Communicator::async_error)
      .def(
          "exchange",
          [](Communicator& c, const std::vector<TransferTuple>& sends, const std::vector<TransferTuple>& recvs,
             uint64_t stream) {
            const auto s = to_transfers(sends), r = to_transfers(recvs);
            nb::gil_scoped_release release;
            return c.exchange(s, r, stream);
          },
          "sends"_a, "recvs"_a, "stream"_a,
          "One group of receives and sends, each (peer, pointer, bytes); returns a ticket for wait().")
      .def("wait", &Communicator::wait, "ticket"_a, "timeout"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("abort", &Communicator::abort, nb::call_guard<nb::gil_scoped_release>())
      .def("revoke", &Communicator::revoke, nb::call_guard<nb::gil_scoped_release>())
      .def("destroy", &Communicator::destroy, nb::call_guard<nb::gil_scoped_release>())
      .def("shrink", &Communicator::shrink, "exclude"_a, "abort_mode"_a = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def("grow_unique_id", [](Communicator& c) { return from_id(c.grow_unique_id()); })
      .def(
          "grow",
          [](Communicator& c, int nranks, std::optional<nb::bytes> id) {
            std::optional<UniqueId> uid;
            if (id) uid = to_id(*id);
            nb::gil_scoped_release release;
            return c.grow(nranks, uid ? &*uid : nullptr);
          },
          "nranks"_a, "unique_id"_a = nb::none());

  m.def(
      "plan_box_copies",
      [](const Desc& desc) {
        std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>> out;
        for (const PitchedCopy& c : plan_box_copies(to_copies(desc))) {
          out.emplace_back(c.dst, c.src, c.width, c.height, c.depth, c.dpitch, c.spitch, c.dheight, c.sheight);
        }
        return out;
      },
      "desc"_a, "The pitched copies for box copies: (dst, src, width, height, depth, dpitch, spitch, dheight, sheight).");

  m.def(
      "copy_boxes",
      [](CudaApi& cuda, const Desc& desc, uint64_t stream) {
        const auto copies = to_copies(desc);
        nb::gil_scoped_release release;
        const CopyStats stats = run_box_copies(cuda, plan_box_copies(copies), stream);
        return std::make_pair(stats.calls, stats.bytes);
      },
      "cuda"_a, "desc"_a, "stream"_a, "Enqueue box copies on a stream; returns (runtime calls, bytes).");

  m.def("self_test", &run_self_tests, nb::call_guard<nb::gil_scoped_release>(),
        "Run the C++ checks over NcclMock; returns the failures.");
}

}  // namespace layoutlang::nccl

// The entry point bindings.cpp calls (declared there, so no header is needed).
void register_nccl_bindings(nb::module_& m) {
  layoutlang::nccl::register_bindings(m);
}
