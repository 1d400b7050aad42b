#include "shard_math.hpp"

#include <algorithm>

namespace layoutlang {
namespace {

// Keeps the local positions [start, stop) of the local sequence `in`, appending to `out`.
// `in` runs carry their local_start; positions are relative to the sequence.
void keep_range(const std::vector<Run>& in, int64_t start, int64_t stop, std::vector<Run>& out) {
  for (const Run& run : in) {
    const int64_t run_stop = run.local_start + run.length;
    if (run_stop <= start) continue;
    if (run.local_start >= stop) break;
    const int64_t lo = std::max(start, run.local_start);
    const int64_t hi = std::min(stop, run_stop);
    Run piece{run.global_start + (lo - run.local_start), hi - lo, 0};
    // Adjacent global indices stay one run, so plain shards never fragment.
    if (!out.empty()) {
      Run& last = out.back();
      if (last.global_start + last.length == piece.global_start) {
        last.length += piece.length;
        continue;
      }
    }
    out.push_back(piece);
  }
}

void renumber(std::vector<Run>& runs) {
  int64_t local = 0;
  for (Run& run : runs) {
    run.local_start = local;
    local += run.length;
  }
}

}  // namespace

int64_t dim_runs(int64_t n, const DimSpec& spec, const int64_t* coords, const int64_t* axis_sizes,
                 std::vector<Run>& runs) {
  const int64_t pad = spec.pad_multiple > 1 ? spec.pad_multiple : 1;
  const int64_t padded = (n + pad - 1) / pad * pad;
  runs.clear();
  if (padded > 0) runs.push_back(Run{0, padded, 0});  // an empty dim holds no run
  int64_t length = padded;

  std::vector<Run> next;
  for (const Split& split : spec.splits) {
    const int64_t axis_size = axis_sizes[split.axis];
    const int64_t pieces = split.pieces > 0 ? split.pieces : axis_size;
    const int64_t index = coords[split.axis] / (axis_size / pieces);
    next.clear();
    if (split.blocks <= 1) {
      const auto [start, stop] = chunk_bounds(length, pieces, index);
      if (stop > start) keep_range(runs, start, stop, next);
    } else {
      for (int64_t b = 0; b < split.blocks; ++b) {
        const auto [block_start, block_stop] = chunk_bounds(length, split.blocks, b);
        const auto [start, stop] = chunk_bounds(block_stop - block_start, pieces, index);
        if (stop > start) keep_range(runs, block_start + start, block_start + stop, next);
      }
    }
    runs.swap(next);
    renumber(runs);
    length = runs.empty() ? 0 : runs.back().local_start + runs.back().length;
  }

  if (padded != n) {
    // Drop padding: local positions stay where they were, the runs just shrink.
    std::size_t kept = 0;
    for (Run run : runs) {
      const int64_t stop = std::min(n, run.global_start + run.length);
      if (stop <= run.global_start) continue;
      run.length = stop - run.global_start;
      runs[kept++] = run;
    }
    runs.resize(kept);
  }
  return length;
}

void check_spec(const ShardSpec& spec, std::size_t ndim, const std::vector<int64_t>& axis_sizes,
                int32_t tensor) {
  const auto fail = [tensor](const std::string& detail) { throw CoreValueError("placement", detail, tensor); };
  if (spec.size() != ndim) {
    fail("placement has " + std::to_string(spec.size()) + " dims, tensor has " + std::to_string(ndim));
  }
  for (std::size_t d = 0; d < spec.size(); ++d) {
    const std::string dim = "dim " + std::to_string(d) + ": ";
    if (spec[d].pad_multiple < 1) fail(dim + "pad multiple must be at least 1");
    for (const Split& split : spec[d].splits) {
      if (split.axis < 0 || static_cast<std::size_t>(split.axis) >= axis_sizes.size()) {
        fail(dim + "axis index " + std::to_string(split.axis) + " is not a mesh axis");
      }
      const int64_t size = axis_sizes[split.axis];
      const int64_t pieces = split.pieces > 0 ? split.pieces : size;
      if (pieces > size || size % pieces != 0) {
        fail(dim + std::to_string(pieces) + " chunks do not divide axis " + std::to_string(split.axis) +
             " of size " + std::to_string(size));
      }
      if (split.blocks < 1) fail(dim + "blocks must be at least 1");
    }
  }
}

}  // namespace layoutlang
