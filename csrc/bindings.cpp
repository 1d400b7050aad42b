// The only file that knows Python: converts plain Python values to the core's arrays and
// back, and maps the core's exceptions to layoutlang.errors (one translator).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <tuple>
#include <vector>

#include "layout_core.hpp"
#include "planner.hpp"
#include "shard_math.hpp"

namespace nb = nanobind;
using namespace layoutlang;

// The NCCL core's bindings (csrc/nccl/bindings_nccl.cpp): the `_core.nccl` submodule.
void register_nccl_bindings(nb::module_& m);

namespace {

using SplitTuple = std::tuple<int32_t, int32_t, int32_t>;        // axis, pieces, blocks
using DimTuple = std::tuple<int64_t, std::vector<SplitTuple>>;    // pad multiple, splits
using Shape = std::vector<int64_t>;
using BoxTuple = std::tuple<Shape, Shape, Shape>;                 // offsets, sizes, storage offsets

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

std::vector<BoxTuple> to_tuples(const std::vector<BoxRecord>& boxes) {
  std::vector<BoxTuple> out;
  out.reserve(boxes.size());
  for (const BoxRecord& b : boxes) out.emplace_back(b.offsets, b.sizes, b.storage_offsets);
  return out;
}

void make_core(
    LayoutCore* self, Shape axis_sizes, Shape ranks, const std::vector<std::vector<DimTuple>>& specs,
    const std::vector<std::tuple<Shape, int32_t, std::vector<int32_t>, int32_t, int32_t>>& tensors,
    const std::vector<std::tuple<int32_t, std::vector<int32_t>, Shape, Shape>>& storages) {
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
  for (const auto& [dim, parts, blocks, declared] : storages) {
    core_storages.push_back(StorageEntry{dim, parts, blocks, declared});
  }
  // nanobind's idiom for custom constructors: construct in place.
  new (self) LayoutCore(std::move(axis_sizes), std::move(ranks), std::move(core_specs),
                        std::move(core_tensors), std::move(core_storages));
}

template <class T>
using Column = nb::ndarray<nb::numpy, const T, nb::ndim<1>>;

// A read-only numpy view of a plan column; the plan object stays alive while it is used.
template <class T>
Column<T> view(const std::vector<T>& column, nb::handle owner) {
  const std::size_t shape[1] = {column.size()};
  return Column<T>(column.data(), 1, shape, owner);
}

template <class T>
std::vector<T> copy(const nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>& array) {
  return std::vector<T>(array.data(), array.data() + array.shape(0));
}

#define PLAN_COLUMN(type, name) \
  def_prop_ro(#name, [](nb::handle self) { return view<type>(nb::cast<const PlanData&>(self).name, self); })

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "layoutlang's C++ core: shard interval math and compiled layouts.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CoreValueError& e) {
      nb::object cls = nb::module_::import_("layoutlang.errors").attr("LayoutValueError");
      PyErr_SetObject(cls.ptr(), nb::str(e.what()).ptr());
    }
  });

  m.def("chunk_bounds", &chunk_bounds, nb::arg("n"), nb::arg("k"), nb::arg("i"),
        "[start, stop) of chunk i when n elements are cut into k chunks as torch.chunk does.");

  m.def(
      "dim_runs",
      [](int64_t n, const DimTuple& dim, const Shape& coords, const Shape& axis_sizes) {
        const DimSpec spec = to_dim_spec(dim);
        check_spec(ShardSpec{spec}, 1, axis_sizes);
        if (coords.size() != axis_sizes.size()) throw CoreValueError("one coordinate per axis");
        std::vector<Run> runs;
        const int64_t length = dim_runs(n, spec, coords.data(), axis_sizes.data(), runs);
        std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
        for (const Run& r : runs) out.emplace_back(r.global_start, r.length, r.local_start);
        return std::make_pair(length, out);
      },
      nb::arg("n"), nb::arg("dim"), nb::arg("coords"), nb::arg("axis_sizes"),
      "(local length, [(global start, length, local start)]) of one dim at one mesh coordinate.");

  m.def(
      "intersect_boxes",
      [](const Shape& a_off, const Shape& a_size, const Shape& b_off,
         const Shape& b_size) -> std::optional<std::pair<Shape, Shape>> {
        if (a_off.size() != b_off.size() || a_size.size() != a_off.size() || b_size.size() != b_off.size()) {
          throw CoreValueError("boxes of different ranks (number of dims)");
        }
        Shape off(a_off.size()), size(a_off.size());
        for (std::size_t d = 0; d < a_off.size(); ++d) {
          const auto [lo, hi] = intersect(a_off[d], a_off[d] + a_size[d], b_off[d], b_off[d] + b_size[d]);
          if (hi <= lo) return std::nullopt;
          off[d] = lo;
          size[d] = hi - lo;
        }
        return std::make_pair(off, size);
      },
      nb::arg("a_offsets"), nb::arg("a_sizes"), nb::arg("b_offsets"), nb::arg("b_sizes"),
      "The box both boxes cover, or None.");

  nb::class_<LayoutCore>(m, "LayoutCore")
      .def("__init__", &make_core, nb::arg("axis_sizes"), nb::arg("ranks"), nb::arg("specs"),
           nb::arg("tensors"), nb::arg("storages"))
      .def_prop_ro("axis_sizes", &LayoutCore::axis_sizes)
      .def_prop_ro("ranks", &LayoutCore::ranks)
      .def("mesh_index", &LayoutCore::mesh_index, nb::arg("rank"))
      .def("holds", &LayoutCore::holds, nb::arg("tensor"), nb::arg("rank"))
      .def("holders", &LayoutCore::holders, nb::arg("tensor"))
      .def(
          "local_shape",
          [](const LayoutCore& core, int32_t tensor, int64_t rank) -> std::optional<Shape> {
            Shape shape;
            if (!core.local_shape(tensor, rank, shape)) return std::nullopt;
            return shape;
          },
          nb::arg("tensor"), nb::arg("rank"))
      .def(
          "storage_shape",
          [](const LayoutCore& core, int32_t storage, int64_t rank) -> std::optional<Shape> {
            Shape shape;
            if (!core.storage_shape(storage, rank, shape)) return std::nullopt;
            return shape;
          },
          nb::arg("storage"), nb::arg("rank"))
      .def(
          "boxes",
          [](const LayoutCore& core, int32_t tensor, int64_t rank) {
            std::vector<BoxRecord> found;
            core.boxes(tensor, rank, found);
            return to_tuples(found);
          },
          nb::arg("tensor"), nb::arg("rank"))
      .def(
          "validate",
          [](const LayoutCore& core, std::size_t max_problems) {
            std::vector<std::tuple<std::string, int32_t, int64_t, std::string>> out;
            for (const Problem& p : core.validate(max_problems)) out.emplace_back(p.kind, p.storage, p.rank, p.message);
            return out;
          },
          nb::arg("max_problems") = 20)
      .def(
          "summarize",
          [](const LayoutCore& core) {
            std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> out;
            {
              nb::gil_scoped_release release;
              for (const RankSummary& r : core.summarize()) out.emplace_back(r.rank, r.tensors, r.boxes, r.elements, r.bytes);
            }
            return out;
          },
          "Per rank: (rank, tensors, boxes, elements, bytes), from every box of every tensor.")
      .def(
          "locate",
          [](const LayoutCore& core, int32_t tensor, int64_t rank, const Shape& offsets) -> std::optional<Shape> {
            if (offsets.size() != core.tensor(tensor).shape.size()) throw CoreValueError("one offset per dim");
            Shape out(offsets.size());
            if (!core.locate(tensor, rank, offsets.data(), out.data())) return std::nullopt;
            return out;
          },
          nb::arg("tensor"), nb::arg("rank"), nb::arg("offsets"),
          "Place in the rank's storage of the element at `offsets`, or None when not held.");

  using I32 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using U8 = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

  nb::class_<PlanData>(m, "PlanArrays", "A plan's columns (read-only numpy views).")
      .def("__init__",
           [](PlanData* self, I32 region_tensor, I64 region_dims_start, I64 region_offsets, I64 region_sizes,
              I64 region_bytes, I32 move_region, I32 move_src, I32 move_dst, I32 move_bucket, U8 move_kind,
              U8 move_stage, U8 move_src_space, U8 move_dst_space, U8 move_source, int32_t num_buckets,
              int64_t lower_bound_bytes, int64_t broadcast_payload_bytes) {
             new (self) PlanData{copy(region_tensor), copy(region_dims_start), copy(region_offsets),
                                 copy(region_sizes),  copy(region_bytes),      copy(move_region),
                                 copy(move_src),      copy(move_dst),          copy(move_bucket),
                                 copy(move_kind),     copy(move_stage),        copy(move_src_space),
                                 copy(move_dst_space), copy(move_source),     num_buckets,
                                 lower_bound_bytes,    broadcast_payload_bytes};
           })
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
      [](const LayoutCore& source, const LayoutCore& destination, const std::vector<uint8_t>& policies,
         int64_t domain_size, int64_t bucket_bytes) {
        nb::gil_scoped_release release;
        return build_plan(source, destination, policies, PlanOptions{domain_size, bucket_bytes});
      },
      nb::arg("source"), nb::arg("destination"), nb::arg("policies"), nb::arg("domain_size"),
      nb::arg("bucket_bytes"), "Compile the plan that turns the source layout into the destination layout.");

  m.def(
      "build_recovery_plan",
      [](const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
         const LayoutCore& destination, int64_t domain_size, int64_t bucket_bytes) {
        nb::gil_scoped_release release;
        return build_recovery_plan(sources, lost, destination, PlanOptions{domain_size, bucket_bytes});
      },
      nb::arg("sources"), nb::arg("lost"), nb::arg("destination"), nb::arg("domain_size"), nb::arg("bucket_bytes"),
      "Compile a recovery plan: each region from the first source layout that holds it on a rank not lost.");

  m.def(
      "validate_recovery_plan",
      [](const PlanData& plan, const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
         const LayoutCore& destination, int64_t domain_size, int64_t bucket_bytes, std::size_t max_problems) {
        nb::gil_scoped_release release;
        return validate_recovery_plan(plan, sources, lost, destination, PlanOptions{domain_size, bucket_bytes},
                                      max_problems);
      },
      nb::arg("plan"), nb::arg("sources"), nb::arg("lost"), nb::arg("destination"), nb::arg("domain_size"),
      nb::arg("bucket_bytes"), nb::arg("max_problems") = 20);

  m.def(
      "plan_totals",
      [](const PlanData& plan, int64_t num_ranks) {
        PlanTotals t;
        {
          nb::gil_scoped_release release;
          t = plan_totals(plan, num_ranks);
        }
        nb::dict out;
        out["bytes"] = std::vector<int64_t>(t.bytes, t.bytes + 3);
        out["moves"] = std::vector<int64_t>(t.moves, t.moves + 3);
        out["messages"] = t.messages;
        out["sent"] = t.sent;
        out["received"] = t.received;
        return out;
      },
      nb::arg("plan"), nb::arg("num_ranks"),
      "Bytes and moves by kind (local, domain, network), messages, and per rank (rank * 3 + kind) "
      "bytes sent and received.");

  m.def(
      "validate_plan",
      [](const PlanData& plan, const LayoutCore& source, const LayoutCore& destination, int64_t domain_size,
         int64_t bucket_bytes, std::size_t max_problems) {
        nb::gil_scoped_release release;
        return validate_plan(plan, source, destination, PlanOptions{domain_size, bucket_bytes}, max_problems);
      },
      nb::arg("plan"), nb::arg("source"), nb::arg("destination"), nb::arg("domain_size"), nb::arg("bucket_bytes"),
      nb::arg("max_problems") = 20, "Problems with the plan (empty when it is valid).");

  register_nccl_bindings(m);
}
