// Python bindings of the NCCL core: the `_core.nccl` submodule. The only file under
// csrc/nccl that knows Python; it imports no Python package. Registered from bindings.cpp
// with one call.
//
// Every failure of the NCCL core is raised as one exception type, `NcclCoreError`, whose
// fields say what failed: `kind` (nccl: a call returned an error; timeout: it did not
// complete in time; unavailable: no library, or a function missing from it; cuda: a CUDA
// runtime call failed), `call` and `code` (the function and its result; for unavailable,
// `call` is the missing symbol and `code` None), `symbol` and `introduced` (unavailable
// only: the missing function and the NCCL version that introduced it). The transport
// (layoutlang.transport.nccl) turns it into layoutlang.errors' NcclError family or
// CudaError. Mocks are passed in by the caller like the real libraries. Calls that may wait
// (init, exchange, wait, shrink, grow, revoke, destroy, copies) release the GIL, so ranks
// running in threads progress together and a waiting thread never blocks the interpreter.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <string>
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

// The registered exception type (a plain Python exception class made with the C API).
nb::handle nccl_core_error;

void raise_failure(const char* kind, const std::exception& e, std::optional<std::string> call,
                   std::optional<int> code, std::optional<std::string> symbol = std::nullopt,
                   std::optional<std::string> introduced = std::nullopt) {
  nb::object exc = nccl_core_error(nb::str(e.what()));
  exc.attr("kind") = nb::str(kind);
  exc.attr("call") = call ? nb::object(nb::str(call->c_str())) : nb::none();
  exc.attr("code") = code ? nb::object(nb::int_(*code)) : nb::none();
  exc.attr("symbol") = symbol ? nb::object(nb::str(symbol->c_str())) : nb::none();
  // NCCL older than the oldest version we know of introduced it: "" in C++, None here.
  exc.attr("introduced") = introduced && !introduced->empty() ? nb::object(nb::str(introduced->c_str())) : nb::none();
  PyErr_SetObject(nccl_core_error.ptr(), exc.ptr());
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

  nb::dict fields;
  for (const char* name : {"call", "code", "symbol", "introduced"}) fields[name] = nb::none();
  fields["kind"] = "nccl";
  const std::string qualified = nb::cast<std::string>(m.attr("__name__")) + ".NcclCoreError";
  PyObject* type = PyErr_NewExceptionWithDoc(
      qualified.c_str(),
      "A failure of the NCCL core. ``kind``: nccl (a call returned an error), timeout (it did not complete "
      "in time), unavailable (no library, or a function missing from it) or cuda (a CUDA runtime call "
      "failed); ``call`` and ``code`` name the function and its result; ``symbol`` and ``introduced`` the "
      "missing function and the NCCL version that introduced it.",
      PyExc_RuntimeError, fields.ptr());
  if (type == nullptr) throw nb::python_error();
  m.attr("NcclCoreError") = nb::handle(type);
  nccl_core_error = type;  // the module keeps the reference made here, for the process's life

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NcclTimeout& e) {
      raise_failure("timeout", e, e.call(), static_cast<int>(e.code()));
    } catch (const NcclError& e) {
      raise_failure("nccl", e, e.call(), static_cast<int>(e.code()));
    } catch (const NcclUnavailable& e) {
      raise_failure("unavailable", e, e.symbol(), std::nullopt, e.symbol(), e.introduced());
    } catch (const CudaFailure& e) {
      raise_failure("cuda", e, e.call(), e.code());
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
      .def_prop_ro("host_memory", &CudaApi::host_memory,
                   "Whether its pointers are host addresses (the mock): transports over it move CPU tensors.")
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

  nb::class_<PitchedCopy>(m, "PitchedCopy", "One CUDA runtime copy: depth slices of height rows of width bytes.")
      .def_ro("dst", &PitchedCopy::dst)
      .def_ro("src", &PitchedCopy::src)
      .def_ro("width", &PitchedCopy::width, "Bytes per row.")
      .def_ro("height", &PitchedCopy::height, "Rows per slice.")
      .def_ro("depth", &PitchedCopy::depth, "Slices.")
      .def_ro("dpitch", &PitchedCopy::dpitch, "Bytes between destination rows.")
      .def_ro("spitch", &PitchedCopy::spitch, "Bytes between source rows.")
      .def_ro("dheight", &PitchedCopy::dheight, "Destination rows between slices.")
      .def_ro("sheight", &PitchedCopy::sheight, "Source rows between slices.")
      .def("__repr__", [](const PitchedCopy& c) {
        return "PitchedCopy(dst=" + std::to_string(c.dst) + ", src=" + std::to_string(c.src) +
               ", width=" + std::to_string(c.width) + ", height=" + std::to_string(c.height) +
               ", depth=" + std::to_string(c.depth) + ", dpitch=" + std::to_string(c.dpitch) +
               ", spitch=" + std::to_string(c.spitch) + ", dheight=" + std::to_string(c.dheight) +
               ", sheight=" + std::to_string(c.sheight) + ")";
      });

  nb::class_<CopyStats>(m, "CopyStats", "What copy_boxes issued: CUDA runtime calls and payload bytes.")
      .def_ro("calls", &CopyStats::calls)
      .def_ro("bytes", &CopyStats::bytes)
      .def("__repr__", [](const CopyStats& s) {
        return "CopyStats(calls=" + std::to_string(s.calls) + ", bytes=" + std::to_string(s.bytes) + ")";
      });

  m.def(
      "plan_box_copies", [](const Desc& desc) { return plan_box_copies(to_copies(desc)); }, "desc"_a,
      "The pitched copies that perform box copies, one row each: (dst, src, itemsize, sizes[D], "
      "dst_strides[D], src_strides[D]).");

  m.def(
      "copy_boxes",
      [](CudaApi& cuda, const Desc& desc, uint64_t stream) {
        const auto copies = to_copies(desc);
        nb::gil_scoped_release release;
        return run_box_copies(cuda, plan_box_copies(copies), stream);
      },
      "cuda"_a, "desc"_a, "stream"_a, "Enqueue box copies (rows as for plan_box_copies) on a stream.");

  m.def("self_test", &run_self_tests, nb::call_guard<nb::gil_scoped_release>(),
        "Run the C++ checks over NcclMock; returns the failures.");
}

}  // namespace layoutlang::nccl

// The entry point bindings.cpp calls (declared there, so no header is needed).
void register_nccl_bindings(nb::module_& m) {
  layoutlang::nccl::register_bindings(m);
}
