// Per-dim interval math: how placements cut one tensor dim into the runs a rank holds.
//
// Naming: an *axis* is a mesh axis, a *dim* is a tensor dimension. A rank's shard of a
// dim is a *local sequence*: an ordered list of runs of global indices, concatenated in
// the rank's local tensor. Placements act on the local sequence left to right, exactly
// as DTensor applies placements in mesh-axis order:
//
//   Shard(d) over an axis of size k (torch.chunk): chunk c = ceil(L/k); coordinate i
//   keeps local positions [min(L, i*c), min(L, (i+1)*c)).
//   _StridedShard(d, sf): cut the local sequence into sf chunks, cut each of them into
//   k chunks, keep the i-th sub-chunk of every one (vLLM's fused gate_up layout).
//
// Two extensions that DTensor lacks and inference engines need:
//   pieces < k: the dim is cut into `pieces` chunks and coordinate i keeps chunk
//   i / (k / pieces) (vLLM's GQA kv heads replicated when tp > kv_heads);
//   pad_multiple: the dim is padded up to a multiple before any cut and the padding is
//   dropped from the runs afterwards (vLLM's vocab-parallel embedding).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace layoutlang {

// A mistake in what the core was given. bindings.cpp raises it as `_core.CoreError` with
// these fields, and the Python model and planner turn it into the LayoutValueError a user
// reads, naming the tensor by name (the core only knows its index).
//
//   kind    what is wrong: "argument" (a call's own arguments), "mesh", "placement" (a
//           dim's spec), "tensor" and "storage" (entries of a compiled layout), "mismatch"
//           (the layouts of one plan disagree), "coverage" (a source layout does not hold
//           a whole tensor), "lost" (nothing survives to read from), "plan" (plan columns
//           out of range);
//   tensor  the tensor's index in the layout, or -1;
//   rank    the rank concerned, or -1;
//   detail  the message without the tensor: what() is "tensor 3: <detail>" when a tensor
//           is set, else the detail alone.
class CoreValueError : public std::invalid_argument {
 public:
  CoreValueError(std::string kind, const std::string& detail, int32_t tensor = -1, int64_t rank = -1)
      : std::invalid_argument(tensor >= 0 ? "tensor " + std::to_string(tensor) + ": " + detail : detail),
        kind_(std::move(kind)),
        detail_(detail),
        tensor_(tensor),
        rank_(rank) {}

  const std::string& kind() const { return kind_; }
  const std::string& detail() const { return detail_; }
  int32_t tensor() const { return tensor_; }
  int64_t rank() const { return rank_; }

 private:
  std::string kind_;
  std::string detail_;
  int32_t tensor_;
  int64_t rank_;
};

// [start, stop) of chunk i when n elements are cut into k chunks as torch.chunk does.
inline std::pair<int64_t, int64_t> chunk_bounds(int64_t n, int64_t k, int64_t i) {
  const int64_t c = (n + k - 1) / k;
  const int64_t start = std::min(n, i * c);
  const int64_t stop = std::min(n, (i + 1) * c);
  return {start, stop};
}

// One cut of a dim by one mesh axis.
struct Split {
  int32_t axis = 0;    // mesh axis whose coordinate picks the chunk
  int32_t pieces = 0;  // number of chunks; divides the axis size (0 means the axis size)
  int32_t blocks = 1;  // > 1: strided, DTensor's _StridedShard(split_factor=blocks)
};

struct DimSpec {
  int64_t pad_multiple = 1;
  std::vector<Split> splits;  // applied in order
};

// Placements of one tensor, dim by dim (a dim with no splits is whole on every rank).
using ShardSpec = std::vector<DimSpec>;

// A run of global indices [global_start, global_start + length) that sits at
// local_start in the rank's local tensor.
struct Run {
  int64_t global_start;
  int64_t length;
  int64_t local_start;
};

// The runs one coordinate holds of one dim of size n; returns the local length
// (padding included). `runs` is cleared first.
int64_t dim_runs(int64_t n, const DimSpec& spec, const int64_t* coords,
                 const int64_t* axis_sizes, std::vector<Run>& runs);

// Intersection of two half-open intervals; length 0 when disjoint.
inline std::pair<int64_t, int64_t> intersect(int64_t a_start, int64_t a_stop, int64_t b_start,
                                             int64_t b_stop) {
  const int64_t start = std::max(a_start, b_start);
  const int64_t stop = std::min(a_stop, b_stop);
  return {start, std::max(start, stop)};
}

// Checks a spec against a tensor's number of dims and the mesh; throws CoreValueError
// (kind "placement", for `tensor` when one is given) naming the dim and axis.
void check_spec(const ShardSpec& spec, std::size_t ndim, const std::vector<int64_t>& axis_sizes,
                int32_t tensor = -1);

}  // namespace layoutlang
