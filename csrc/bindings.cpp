// The only file of the layout core that knows Python: converts plain Python values to the
// core's arrays and back. It imports no Python package. What crosses the boundary is typed:
// enums for move kinds, spaces and policies, a named class for every result, and one
// exception type, `CoreError`, whose fields (kind, tensor, rank, detail) the Python model
// and planner read to name the tensor for the user (the core knows tensors by index).
// The stub `_core.pyi` is generated from this module at build time (nanobind_add_stub).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "delta.hpp"
#include "layout_core.hpp"
#include "planner.hpp"
#include "quantize.hpp"
#include "rank_plan.hpp"
#include "recovery.hpp"
#include "shard_math.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using namespace layoutlang;

// The NCCL core's bindings (csrc/nccl/bindings_nccl.cpp): the `_core.nccl` submodule.
void register_nccl_bindings(nb::module_& m);

namespace {

using SplitTuple = std::tuple<int32_t, int32_t, int32_t>;      // axis, pieces, blocks
using DimTuple = std::tuple<int64_t, std::vector<SplitTuple>>;  // pad multiple, splits
using Shape = std::vector<int64_t>;

// ------------------------------------------------------------------ named results

// [start, stop) of one chunk.
struct Interval {
  int64_t start = 0;
  int64_t stop = 0;
};

// What one mesh coordinate holds of one dim: its local length (padding included) and the
// runs of global indices, in local order.
struct DimRuns {
  int64_t length = 0;
  std::vector<Run> runs;
};

// A box of a logical tensor: offsets and sizes in global coordinates.
struct Box {
  Shape offsets;
  Shape sizes;
};

std::string text(const Shape& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

std::string text(const Run& r) {
  return "Run(global_start=" + std::to_string(r.global_start) + ", length=" + std::to_string(r.length) +
         ", local_start=" + std::to_string(r.local_start) + ")";
}

// ------------------------------------------------------------------ inputs

DimSpec to_dim_spec(const DimTuple& dim) {
  DimSpec spec;
  spec.pad_multiple = std::get<0>(dim);
  for (const auto& [axis, pieces, blocks] : std::get<1>(dim)) spec.splits.push_back({axis, pieces, blocks});
  return spec;
}

ShardSpec to_spec(const std::vector<DimTuple>& dims) {
  ShardSpec spec;
  spec.reserve(dims.size());
  for (const DimTuple& dim : dims) spec.push_back(to_dim_spec(dim));
  return spec;
}

void make_core(
    LayoutCore* self, Shape axis_sizes, Shape ranks, const std::vector<std::vector<DimTuple>>& specs,
    const std::vector<std::tuple<Shape, int32_t, std::vector<int32_t>, int32_t, int32_t>>& tensors,
    const std::vector<std::tuple<int32_t, std::vector<int32_t>, Shape, Shape, std::vector<int32_t>, std::vector<uint8_t>>>&
        storages) {
  std::vector<ShardSpec> core_specs;
  core_specs.reserve(specs.size());
  for (const auto& s : specs) core_specs.push_back(to_spec(s));
  std::vector<TensorEntry> core_tensors;
  core_tensors.reserve(tensors.size());
  for (const auto& [shape, spec, fixed, storage, itemsize] : tensors) {
    core_tensors.push_back(TensorEntry{shape, spec, fixed, storage, itemsize});
  }
  std::vector<StorageEntry> core_storages;
  core_storages.reserve(storages.size());
  for (const auto& [dim, parts, blocks, declared, element_of, transposed] : storages) {
    core_storages.push_back(StorageEntry{dim, parts, blocks, declared, element_of, transposed});
  }
  // nanobind's idiom for custom constructors: construct in place.
  new (self) LayoutCore(std::move(axis_sizes), std::move(ranks), std::move(core_specs),
                        std::move(core_tensors), std::move(core_storages));
}

// ------------------------------------------------------------------ plan columns

template <class T>
using Column = nb::ndarray<nb::numpy, const T, nb::ndim<1>>;

// A read-only numpy view of a plan column; the plan object stays alive while it is used.
template <class T>
Column<T> view(const std::vector<T>& column, nb::handle owner) {
  const std::size_t shape[1] = {column.size()};
  return Column<T>(column.data(), 1, shape, owner);
}

// A read-only (ranks, 3) view of per-rank totals by kind.
nb::ndarray<nb::numpy, const int64_t, nb::ndim<2>> by_rank(const std::vector<int64_t>& values, nb::handle owner) {
  const std::size_t shape[2] = {values.size() / 3, 3};
  return nb::ndarray<nb::numpy, const int64_t, nb::ndim<2>>(values.data(), 2, shape, owner);
}

template <class T>
using Input = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <class T>
std::vector<T> copy(const Input<T>& array) {
  return std::vector<T>(array.data(), array.data() + array.shape(0));
}

#define PLAN_COLUMN(type, name) \
  def_prop_ro(#name, [](nb::handle self) { return view<type>(nb::cast<const PlanData&>(self).name, self); })

std::vector<uint8_t> policy_codes(const std::vector<Policy>& policies) {
  return std::vector<uint8_t>(policies.begin(), policies.end());
}

// ------------------------------------------------------------------ errors

// The registered exception type. A plain Python exception class (made with the C API, so
// the module imports nothing); its fields are set on each instance by the translator.
nb::handle core_error;

nb::object new_exception(nb::module_& m, const char* name, PyObject* base, const char* doc, nb::dict fields) {
  const std::string qualified = nb::cast<std::string>(m.attr("__name__")) + "." + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, fields.ptr());
  if (type == nullptr) throw nb::python_error();
  nb::object result = nb::steal(type);
  m.attr(name) = result;
  return result;
}

void raise_core_error(const CoreValueError& e) {
  nb::object exc = core_error(nb::str(e.what()));
  exc.attr("kind") = nb::str(e.kind().c_str());
  exc.attr("detail") = nb::str(e.detail().c_str());
  exc.attr("tensor") = e.tensor() >= 0 ? nb::object(nb::int_(e.tensor())) : nb::none();
  exc.attr("rank") = e.rank() >= 0 ? nb::object(nb::int_(e.rank())) : nb::none();
  PyErr_SetObject(core_error.ptr(), exc.ptr());
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "layoutlang's C++ core: shard interval math, compiled layouts and the planner.";

  nb::dict fields;
  fields["kind"] = "argument";
  fields["detail"] = "";
  fields["tensor"] = nb::none();
  fields["rank"] = nb::none();
  core_error = new_exception(
                   m, "CoreError", PyExc_ValueError,
                   "A mistake in what the core was given. ``kind`` says what is wrong (argument, mesh, "
                   "placement, tensor, storage, mismatch, coverage, lost, plan); ``tensor`` is the index of "
                   "the tensor concerned and ``rank`` the rank (each None when none is); ``detail`` is the "
                   "message without the tensor.",
                   fields)
                   .release();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CoreValueError& e) {
      raise_core_error(e);
    }
  });

  // ---------------------------------------------------------------- enums
  nb::enum_<MoveKind>(m, "MoveKind", nb::is_arithmetic(), "Where a move goes: the same rank, domain or network.")
      .value("local", kLocal)
      .value("domain", kDomain)
      .value("network", kNetwork);
  nb::enum_<Space>(m, "Space", nb::is_arithmetic(),
                   "Where a move reads or writes on its rank: source storage, destination storage, scratch.")
      .value("source", kSource)
      .value("destination", kDestination)
      .value("scratch", kScratch);
  nb::enum_<Policy>(m, "Policy", nb::is_arithmetic(), "How a tensor moves: exact overlaps, or gather and broadcast.")
      .value("reshard", kReshard)
      .value("broadcast", kBroadcast);

  // ---------------------------------------------------------------- result classes
  nb::class_<Interval>(m, "Interval", "[start, stop) of one chunk.")
      .def_ro("start", &Interval::start)
      .def_ro("stop", &Interval::stop)
      .def("__repr__", [](const Interval& i) {
        return "Interval(start=" + std::to_string(i.start) + ", stop=" + std::to_string(i.stop) + ")";
      });

  nb::class_<Run>(m, "Run", "Global indices [global_start, global_start + length), at local_start locally.")
      .def_ro("global_start", &Run::global_start)
      .def_ro("length", &Run::length)
      .def_ro("local_start", &Run::local_start)
      .def("__repr__", [](const Run& r) { return text(r); });

  nb::class_<DimRuns>(m, "DimRuns", "What one mesh coordinate holds of one dim: local length and runs.")
      .def_ro("length", &DimRuns::length)
      .def_ro("runs", &DimRuns::runs)
      .def("__repr__", [](const DimRuns& d) {
        std::string runs;
        for (std::size_t i = 0; i < d.runs.size(); ++i) runs += (i ? ", " : "") + text(d.runs[i]);
        return "DimRuns(length=" + std::to_string(d.length) + ", runs=[" + runs + "])";
      });

  nb::class_<Box>(m, "Box", "A box of a logical tensor: offsets and sizes in global coordinates.")
      .def_ro("offsets", &Box::offsets)
      .def_ro("sizes", &Box::sizes)
      .def("__repr__",
           [](const Box& b) { return "Box(offsets=" + text(b.offsets) + ", sizes=" + text(b.sizes) + ")"; });

  nb::class_<BoxRecord>(m, "PlacedBox", "A box a rank holds, with its place (offsets) in the rank's storage.")
      .def_ro("offsets", &BoxRecord::offsets)
      .def_ro("sizes", &BoxRecord::sizes)
      .def_ro("storage_offsets", &BoxRecord::storage_offsets, "One per storage dim.")
      .def_ro("storage_sizes", &BoxRecord::storage_sizes,
              "One per storage dim: the sizes, swapped for a transposed part, behind a 1 in a stacked storage.")
      .def("__repr__", [](const BoxRecord& b) {
        return "PlacedBox(offsets=" + text(b.offsets) + ", sizes=" + text(b.sizes) +
               ", storage_offsets=" + text(b.storage_offsets) + ", storage_sizes=" + text(b.storage_sizes) + ")";
      });

  nb::class_<Problem>(m, "StorageProblem", "A storage that is wrong on one rank (LayoutCore.validate).")
      .def_ro("kind", &Problem::kind, "storage-shape, storage-blocks, storage-rank or storage-declared.")
      .def_ro("storage", &Problem::storage, "The storage's index in the layout.")
      .def_ro("rank", &Problem::rank)
      .def_ro("message", &Problem::message)
      .def("__repr__", [](const Problem& p) {
        return "StorageProblem(kind='" + p.kind + "', storage=" + std::to_string(p.storage) +
               ", rank=" + std::to_string(p.rank) + ", message='" + p.message + "')";
      });

  nb::class_<RankSummary>(m, "RankSummary", "What one rank holds, counted over every box of every tensor.")
      .def_ro("rank", &RankSummary::rank)
      .def_ro("tensors", &RankSummary::tensors)
      .def_ro("boxes", &RankSummary::boxes)
      .def_ro("elements", &RankSummary::elements)
      .def_ro("bytes", &RankSummary::bytes)
      .def("__repr__", [](const RankSummary& r) {
        return "RankSummary(rank=" + std::to_string(r.rank) + ", tensors=" + std::to_string(r.tensors) +
               ", boxes=" + std::to_string(r.boxes) + ", elements=" + std::to_string(r.elements) +
               ", bytes=" + std::to_string(r.bytes) + ")";
      });

  nb::class_<PlanTotals>(m, "PlanTotals", "What a plan moves: by kind, and per rank by kind.")
      .def_prop_ro(
          "bytes", [](const PlanTotals& t) { return Shape(t.bytes, t.bytes + 3); },
          "Bytes moved, indexed by MoveKind.")
      .def_prop_ro(
          "moves", [](const PlanTotals& t) { return Shape(t.moves, t.moves + 3); }, "Moves, indexed by MoveKind.")
      .def_ro("messages", &PlanTotals::messages,
              "Messages: all moves between one pair of ranks in one bucket and stage travel as one.")
      .def_prop_ro(
          "sent", [](nb::handle self) { return by_rank(nb::cast<const PlanTotals&>(self).sent, self); },
          "Bytes each rank sends, shape (ranks, 3): [rank, MoveKind].")
      .def_prop_ro(
          "received", [](nb::handle self) { return by_rank(nb::cast<const PlanTotals&>(self).received, self); },
          "Bytes each rank receives, shape (ranks, 3): [rank, MoveKind].");

  // ---------------------------------------------------------------- shard math
  m.def(
      "chunk_bounds",
      [](int64_t n, int64_t k, int64_t i) {
        const auto [start, stop] = chunk_bounds(n, k, i);
        return Interval{start, stop};
      },
      "n"_a, "k"_a, "i"_a, "Chunk i when n elements are cut into k chunks as torch.chunk does.");

  m.def(
      "dim_runs",
      [](int64_t n, const DimTuple& dim, const Shape& coords, const Shape& axis_sizes) {
        const DimSpec spec = to_dim_spec(dim);
        check_spec(ShardSpec{spec}, 1, axis_sizes);
        if (coords.size() != axis_sizes.size()) throw CoreValueError("argument", "one coordinate per axis");
        DimRuns out;
        out.length = dim_runs(n, spec, coords.data(), axis_sizes.data(), out.runs);
        return out;
      },
      "n"_a, "dim"_a, "coords"_a, "axis_sizes"_a,
      "The local length and runs of one dim, spec (pad multiple, [(axis, pieces, blocks)]), at one mesh "
      "coordinate.");

  m.def(
      "intersect_boxes",
      [](const Shape& a_off, const Shape& a_size, const Shape& b_off, const Shape& b_size) -> std::optional<Box> {
        if (a_off.size() != b_off.size() || a_size.size() != a_off.size() || b_size.size() != b_off.size()) {
          throw CoreValueError("argument", "boxes of different ranks (number of dims)");
        }
        Box box{Shape(a_off.size()), Shape(a_off.size())};
        for (std::size_t d = 0; d < a_off.size(); ++d) {
          const auto [lo, hi] = intersect(a_off[d], a_off[d] + a_size[d], b_off[d], b_off[d] + b_size[d]);
          if (hi <= lo) return std::nullopt;
          box.offsets[d] = lo;
          box.sizes[d] = hi - lo;
        }
        return box;
      },
      "a_offsets"_a, "a_sizes"_a, "b_offsets"_a, "b_sizes"_a, "The box both boxes cover, or None.");

  // ---------------------------------------------------------------- compiled layouts
  nb::class_<LayoutCore>(m, "LayoutCore", "A layout compiled to plain arrays (see csrc/layout_core.hpp).")
      .def("__init__", &make_core, "axis_sizes"_a, "ranks"_a, "specs"_a, "tensors"_a, "storages"_a)
      .def_prop_ro("axis_sizes", &LayoutCore::axis_sizes)
      .def_prop_ro("ranks", &LayoutCore::ranks)
      .def("mesh_index", &LayoutCore::mesh_index, "rank"_a)
      .def("holds", &LayoutCore::holds, "tensor"_a, "rank"_a)
      .def("holders", &LayoutCore::holders, "tensor"_a)
      .def(
          "local_shape",
          [](const LayoutCore& core, int32_t tensor, int64_t rank) -> std::optional<Shape> {
            Shape shape;
            if (!core.local_shape(tensor, rank, shape)) return std::nullopt;
            return shape;
          },
          "tensor"_a, "rank"_a)
      .def(
          "storage_shape",
          [](const LayoutCore& core, int32_t storage, int64_t rank) -> std::optional<Shape> {
            Shape shape;
            if (!core.storage_shape(storage, rank, shape)) return std::nullopt;
            return shape;
          },
          "storage"_a, "rank"_a)
      .def(
          "boxes",
          [](const LayoutCore& core, int32_t tensor, int64_t rank) {
            std::vector<BoxRecord> found;
            core.boxes(tensor, rank, found);
            return found;
          },
          "tensor"_a, "rank"_a, "The boxes of a tensor that a rank holds, with their places in its storage.")
      .def("validate", &LayoutCore::validate, "max_problems"_a = 20,
           "Every storage on every rank it exists on: shapes agree, blocks divide, declared shapes hold.")
      .def(
          "summarize",
          [](const LayoutCore& core) {
            nb::gil_scoped_release release;
            return core.summarize();
          },
          "Per rank, from every box of every tensor.")
      .def(
          "locate",
          [](const LayoutCore& core, int32_t tensor, int64_t rank, const Shape& offsets) -> std::optional<Shape> {
            if (offsets.size() != core.tensor(tensor).shape.size()) {
              throw CoreValueError("argument", "one offset per dim", tensor, rank);
            }
            Shape out;
            if (!core.locate(tensor, rank, offsets.data(), out)) return std::nullopt;
            return out;
          },
          "tensor"_a, "rank"_a, "offsets"_a,
          "Place in the rank's storage (one offset per storage dim) of the element at `offsets`, or None when not "
          "held.");

  // ---------------------------------------------------------------- plans
  nb::class_<PlanData>(m, "PlanArrays",
                       "A plan's columns (read-only numpy views). Built by the planner, or from named columns.")
      .def(
          "__init__",
          [](PlanData* self, const Input<int32_t>& region_tensor, const Input<int64_t>& region_dims_start,
             const Input<int64_t>& region_offsets, const Input<int64_t>& region_sizes,
             const Input<int64_t>& region_bytes, const Input<int32_t>& move_region, const Input<int32_t>& move_src,
             const Input<int32_t>& move_dst, const Input<int32_t>& move_bucket, const Input<uint8_t>& move_kind,
             const Input<uint8_t>& move_stage, const Input<uint8_t>& move_src_space,
             const Input<uint8_t>& move_dst_space, const Input<uint8_t>& move_source, int32_t num_buckets,
             int64_t lower_bound_bytes, int64_t broadcast_payload_bytes) {
            PlanData* plan = new (self) PlanData();
            plan->region_tensor = copy(region_tensor);
            plan->region_dims_start = copy(region_dims_start);
            plan->region_offsets = copy(region_offsets);
            plan->region_sizes = copy(region_sizes);
            plan->region_bytes = copy(region_bytes);
            plan->move_region = copy(move_region);
            plan->move_src = copy(move_src);
            plan->move_dst = copy(move_dst);
            plan->move_bucket = copy(move_bucket);
            plan->move_kind = copy(move_kind);
            plan->move_stage = copy(move_stage);
            plan->move_src_space = copy(move_src_space);
            plan->move_dst_space = copy(move_dst_space);
            plan->move_source = copy(move_source);
            plan->num_buckets = num_buckets;
            plan->lower_bound_bytes = lower_bound_bytes;
            plan->broadcast_payload_bytes = broadcast_payload_bytes;
          },
          // Seventeen columns and totals: by name only, so none can be passed in another's place.
          nb::kw_only(), "region_tensor"_a, "region_dims_start"_a, "region_offsets"_a, "region_sizes"_a,
          "region_bytes"_a, "move_region"_a, "move_src"_a, "move_dst"_a, "move_bucket"_a, "move_kind"_a,
          "move_stage"_a, "move_src_space"_a, "move_dst_space"_a, "move_source"_a, "num_buckets"_a,
          "lower_bound_bytes"_a, "broadcast_payload_bytes"_a)
      .PLAN_COLUMN(int32_t, region_tensor)
      .PLAN_COLUMN(int64_t, region_dims_start)
      .PLAN_COLUMN(int64_t, region_offsets)
      .PLAN_COLUMN(int64_t, region_sizes)
      .PLAN_COLUMN(int64_t, region_bytes)
      .PLAN_COLUMN(int32_t, move_region)
      .PLAN_COLUMN(int32_t, move_src)
      .PLAN_COLUMN(int32_t, move_dst)
      .PLAN_COLUMN(int32_t, move_bucket)
      .PLAN_COLUMN(uint8_t, move_kind)
      .PLAN_COLUMN(uint8_t, move_stage)
      .PLAN_COLUMN(uint8_t, move_src_space)
      .PLAN_COLUMN(uint8_t, move_dst_space)
      .PLAN_COLUMN(uint8_t, move_source)
      .def_ro("num_buckets", &PlanData::num_buckets)
      .def_ro("lower_bound_bytes", &PlanData::lower_bound_bytes)
      .def_ro("broadcast_payload_bytes", &PlanData::broadcast_payload_bytes);

  m.def(
      "build_plan",
      [](const LayoutCore& source, const LayoutCore& destination, const std::vector<Policy>& policies,
         int64_t domain_size, int64_t bucket_bytes) {
        const std::vector<uint8_t> codes = policy_codes(policies);
        nb::gil_scoped_release release;
        return build_plan(source, destination, codes, PlanOptions{domain_size, bucket_bytes});
      },
      "source"_a, "destination"_a, "policies"_a, "domain_size"_a, "bucket_bytes"_a,
      "Compile the plan that turns the source layout into the destination layout (one policy per tensor).");

  m.def(
      "build_recovery_plan",
      [](const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
         const LayoutCore& destination, int64_t domain_size, int64_t bucket_bytes,
         const std::optional<std::vector<int64_t>>& fill) {
        nb::gil_scoped_release release;
        return build_recovery_plan(sources, lost, destination, PlanOptions{domain_size, bucket_bytes}, fill);
      },
      "sources"_a, "lost"_a, "destination"_a, "domain_size"_a, "bucket_bytes"_a, "fill"_a = nb::none(),
      "Compile a recovery plan: each region from the first source layout that holds it on a rank not lost; "
      "with `fill`, for those destination ranks only.");

  m.def(
      "validate_recovery_plan",
      [](const PlanData& plan, const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
         const LayoutCore& destination, int64_t domain_size, int64_t bucket_bytes, std::size_t max_problems,
         const std::optional<std::vector<int64_t>>& fill) {
        nb::gil_scoped_release release;
        return validate_recovery_plan(plan, sources, lost, destination, PlanOptions{domain_size, bucket_bytes},
                                      max_problems, fill);
      },
      "plan"_a, "sources"_a, "lost"_a, "destination"_a, "domain_size"_a, "bucket_bytes"_a, "max_problems"_a = 20,
      "fill"_a = nb::none(),
      "Problems with a recovery plan (empty when it is valid); with `fill`, a plan of those destination ranks only.");

  m.def(
      "plan_totals",
      [](const PlanData& plan, int64_t num_ranks) {
        nb::gil_scoped_release release;
        return plan_totals(plan, num_ranks);
      },
      "plan"_a, "num_ranks"_a, "Bytes and moves by kind, messages, and bytes sent and received per rank by kind.");

  m.def(
      "validate_plan",
      [](const PlanData& plan, const LayoutCore& source, const LayoutCore& destination, int64_t domain_size,
         int64_t bucket_bytes, std::size_t max_problems) {
        nb::gil_scoped_release release;
        return validate_plan(plan, source, destination, PlanOptions{domain_size, bucket_bytes}, max_problems);
      },
      "plan"_a, "source"_a, "destination"_a, "domain_size"_a, "bucket_bytes"_a, "max_problems"_a = 20,
      "Problems with the plan (empty when it is valid).");

  m.def(
      "build_pairwise_plan",
      [](const LayoutCore& source, const LayoutCore& destination, const std::vector<Policy>& policies,
         int64_t domain_size, int64_t bucket_bytes, int64_t rank) {
        const std::vector<uint8_t> codes = policy_codes(policies);
        nb::gil_scoped_release release;
        return build_pairwise_plan(source, destination, codes, PlanOptions{domain_size, bucket_bytes}, rank);
      },
      "source"_a, "destination"_a, "policies"_a, "domain_size"_a, "bucket_bytes"_a, "rank"_a = -1,
      "Compile a pairwise plan (every choice computable by both ends of a move): the moves `rank` sends or "
      "receives, or the whole fleet's when rank < 0. Reshard policy only.");

  m.def(
      "validate_pairwise_plan",
      [](const PlanData& plan, const LayoutCore& source, const LayoutCore& destination, int64_t domain_size,
         int64_t bucket_bytes, int64_t rank, std::size_t max_problems) {
        nb::gil_scoped_release release;
        return validate_pairwise_plan(plan, source, destination, PlanOptions{domain_size, bucket_bytes}, rank,
                                      max_problems);
      },
      "plan"_a, "source"_a, "destination"_a, "domain_size"_a, "bucket_bytes"_a, "rank"_a = -1, "max_problems"_a = 20,
      "Problems with a pairwise plan of `rank` (of the whole fleet when rank < 0); empty when it is valid.");

  // ---------------------------------------------------------------- recovery decisions
  nb::class_<Regions>(m, "Regions",
                      "Disjoint boxes of logical tensors: region i is tensor[i] at offsets/sizes "
                      "[dims_start[i], dims_start[i] + ndim).")
      .def_ro("tensor", &Regions::tensor)
      .def_ro("dims_start", &Regions::dims_start)
      .def_ro("offsets", &Regions::offsets)
      .def_ro("sizes", &Regions::sizes)
      .def("__len__", [](const Regions& r) { return r.tensor.size(); });

  m.def(
      "lost_regions",
      [](const std::vector<const LayoutCore*>& layouts, const std::vector<std::vector<int32_t>>& tensor_ids,
         const std::vector<Shape>& shapes, const std::vector<int64_t>& lost) {
        nb::gil_scoped_release release;
        return lost_regions(layouts, tensor_ids, shapes, lost);
      },
      "layouts"_a, "tensor_ids"_a, "shapes"_a, "lost"_a,
      "The regions of the tensors (numbered 0..len(shapes)-1; tensor_ids[k][t]: the number of tensor t of "
      "layouts[k]) that no rank outside `lost` holds in any layout, for the tensors a lost rank holds.");

  m.def(
      "same_holdings",
      [](const LayoutCore& before, const std::vector<int64_t>& before_names,
         const std::vector<std::optional<Shape>>& before_views, const LayoutCore& after,
         const std::vector<int64_t>& after_names, const std::vector<std::optional<Shape>>& after_views,
         const std::vector<int64_t>& ranks) {
        auto side = [](const LayoutCore& core, const std::vector<int64_t>& names,
                       const std::vector<std::optional<Shape>>& views) {
          NamedLayout out{&core, names, {}, {}};
          for (const auto& view : views) {
            out.has_view.push_back(view.has_value() ? 1 : 0);
            out.views.push_back(view.value_or(Shape{}));
          }
          return out;
        };
        const NamedLayout b = side(before, before_names, before_views);
        const NamedLayout a = side(after, after_names, after_views);
        nb::gil_scoped_release release;
        const std::vector<uint8_t> same = same_holdings(b, a, ranks);
        return std::vector<bool>(same.begin(), same.end());
      },
      "before"_a, "before_names"_a, "before_views"_a, "after"_a, "after_names"_a, "after_views"_a, "ranks"_a,
      "For each rank: whether it holds the same storages (names: a number per storage, equal for equal names; "
      "views: the shape a storage is viewed as, or None) and the same boxes at the same places in both layouts.");

  m.def(
      "quantize_blocks",
      [](uintptr_t source, const std::string& source_dtype, const Shape& shape, const Shape& source_strides,
         const Shape& block, const std::string& format, const std::string& convention, uintptr_t values,
         const Shape& value_strides, uintptr_t scales, const Shape& scale_shape, const Shape& scale_strides,
         int threads, const std::string& kernel) {
        const QuantSource dtype = quant_source(source_dtype);
        const QuantFormat fmt = quant_format(format);
        const ScaleConvention conv = scale_convention(convention);
        const QuantKernel which = quant_kernel_named(kernel);
        nb::gil_scoped_release release;
        quantize_blocks(QuantView{source, shape, source_strides}, dtype, block, fmt, conv,
                        QuantView{values, shape, value_strides}, QuantView{scales, scale_shape, scale_strides},
                        threads, which);
      },
      "source"_a, "source_dtype"_a, "shape"_a, "source_strides"_a, "block"_a, "format"_a, "convention"_a,
      "values"_a, "value_strides"_a, "scales"_a, "scale_shape"_a, "scale_strides"_a, "threads"_a = 1,
      "kernel"_a = "auto",
      "Quantizes the strided view at address `source` (bf16, fp16 or fp32; strides in elements) block by block "
      "into fp8 bytes at `values` and scales at `scales` (fp32, or e8m0 bytes for mxfp8; shape ceil(shape / "
      "block)), by the rule of csrc/quantize.hpp, on at most `threads` threads (0: the hardware's, at most 8; "
      "the bytes do not depend on it), with the block-strip `kernel` ('auto', 'avx512', 'avx2' or 'generic'; the same "
      "bytes). The caller keeps the memory alive.");
  m.def("quantize_kernels", &quantize_kernels,
        "The quantizer's block-strip kernels this build runs on this CPU, fastest first ('avx512', 'avx2', 'generic').");
  m.def("default_quantize_threads", &default_quantize_threads,
        "The threads quantize_blocks uses for threads = 0: the hardware's, at most 8.");

  // ---------------------------------------------------------------- delta refits
  // Raw addresses of contiguous CPU bytes the caller keeps alive; the kernels allocate nothing.
  m.def(
      "delta_checksum",
      [](uintptr_t data, int64_t nbytes) {
        nb::gil_scoped_release release;
        return delta_checksum(reinterpret_cast<const uint8_t*>(data), nbytes);
      },
      "data"_a, "nbytes"_a,
      "The checksum of `nbytes` bytes at address `data` (any alignment): the wrapping int64 sum of its 8-byte "
      "words, plus 3 times the sum of the words at even word index, plus the sum of the bytes past the last "
      "whole word, by the rule of csrc/delta.hpp.");

  m.def(
      "delta_encode",
      [](uintptr_t fresh, int64_t rows, int64_t row_stride, uintptr_t kept, int64_t nbytes, int unit, uintptr_t body,
         int index_bytes, int64_t index_room, int64_t mask_room) {
        nb::gil_scoped_release release;
        const DeltaEncoded out = delta_encode(reinterpret_cast<const uint8_t*>(fresh), rows, row_stride,
                                              reinterpret_cast<uint8_t*>(kept), nbytes, unit,
                                              reinterpret_cast<uint8_t*>(body), index_bytes, index_room, mask_room);
        return std::make_tuple(out.encoding, out.changed, out.checksum);
      },
      "new"_a, "rows"_a, "row_stride"_a, "kept"_a, "nbytes"_a, "unit"_a, "body"_a, "index_bytes"_a, "index_room"_a,
      "mask_room"_a,
      "Compares the `nbytes` bytes of `new` (`rows` rows of nbytes / rows bytes, `row_stride` bytes apart; more "
      "than one row: whole 8-byte words) with those at `kept` (contiguous) in `unit`-byte units (1, 2, 4, 8; bit "
      "by bit), in one pass that also checksums `new`, and writes a delta message's body to `body`: INDICES (the "
      "changed units' indices, `index_bytes` 4 or 8 each, zeros to 16 bytes, their values) when at most "
      "`index_room` changed, else BITMASK (one bit per unit, zeros to 16 bytes, the values) when at most "
      "`mask_room` (< 0: none), else DENSE (every byte). `kept` is made equal to `new`. Returns (encoding: 0 "
      "DENSE, 1 BITMASK, 2 INDICES; the units that changed, all for DENSE; the checksum of `new`), by the rule of "
      "csrc/delta.hpp.");

  m.def(
      "delta_apply_indices",
      [](uintptr_t base, int64_t nbytes, int unit, uintptr_t indices, int index_bytes, uintptr_t values,
         int64_t count) {
        nb::gil_scoped_release release;
        delta_apply_indices(reinterpret_cast<uint8_t*>(base), nbytes, unit, reinterpret_cast<const void*>(indices),
                            index_bytes, reinterpret_cast<const uint8_t*>(values), count);
      },
      "base"_a, "nbytes"_a, "unit"_a, "indices"_a, "index_bytes"_a, "values"_a, "count"_a,
      "Writes `count` `unit`-byte values from `values` to the units of the `nbytes` bytes at `base` whose "
      "indices (`index_bytes` 4 or 8 each) are at `indices`. Raises CoreError, writing nothing, when an index "
      "is not a unit of the base.");

  m.def(
      "delta_apply_bitmask",
      [](uintptr_t base, int64_t nbytes, int unit, uintptr_t mask, uintptr_t values, int64_t count) {
        nb::gil_scoped_release release;
        return delta_apply_bitmask(reinterpret_cast<uint8_t*>(base), nbytes, unit,
                                   reinterpret_cast<const uint8_t*>(mask), reinterpret_cast<const uint8_t*>(values),
                                   count);
      },
      "base"_a, "nbytes"_a, "unit"_a, "mask"_a, "values"_a, "count"_a,
      "Writes the `unit`-byte values at `values` to the units of the `nbytes` bytes at `base` whose bits are set "
      "in `mask` (ceil(units / 8) bytes, least significant bit first); returns how many (`count`). Raises "
      "CoreError, writing nothing, when a bit past the last unit is set or the mask does not mark `count` "
      "units (the values the message holds).");

  m.def(
      "set_quant_block",
      [](LayoutCore& core, int32_t tensor, const Shape& block) {
        if (tensor < 0 || static_cast<std::size_t>(tensor) >= core.num_tensors()) {
          throw CoreValueError("argument", "no tensor " + std::to_string(tensor) + " in this layout", tensor);
        }
        core.set_quant_block(tensor, block);
      },
      "core"_a, "tensor"_a, "block"_a,
      "Records the quantization block of a destination layout's tensor (one size per dim): the plans into "
      "it cut slabs on block boundaries.");

  register_nccl_bindings(m);
}
