#include "plan_geometry.hpp"

#include <algorithm>

namespace layoutlang {

int64_t runs_length(const std::vector<Run>& runs) {
  int64_t n = 0;
  for (const Run& r : runs) n += r.length;
  return n;
}

int64_t holding_volume(const HoldingGroup& g) {
  int64_t v = 1;
  for (const auto& runs : g.runs) v *= runs_length(runs);
  return v;
}

void meet_runs(const std::vector<Run>& need, const std::vector<Run>& held, std::vector<Piece>& pieces) {
  for (const Run& b : need) {
    for (const Run& a : held) {
      const auto [lo, hi] =
          intersect(a.global_start, a.global_start + a.length, b.global_start, b.global_start + b.length);
      if (hi <= lo) continue;
      pieces.push_back(
          Piece{lo, hi - lo, a.local_start + (lo - a.global_start), b.local_start + (lo - b.global_start)});
    }
  }
}

void cut_at_blocks(std::vector<Piece>& pieces, int64_t block, bool source_side) {
  std::vector<Piece> out;
  for (const Piece& p : pieces) {
    int64_t done = 0;
    while (done < p.length) {
      const int64_t local = (source_side ? p.src_local : p.dst_local) + done;
      const int64_t take = std::min(block - local % block, p.length - done);
      out.push_back(Piece{p.global_start + done, take, p.src_local + done, p.dst_local + done});
      done += take;
    }
  }
  pieces.swap(out);
}

void cut_interleaved(int32_t tensor, std::vector<std::vector<Piece>>& pieces, const LayoutCore* source,
                     const LayoutCore* destination) {
  const std::pair<const LayoutCore*, bool> sides[] = {{source, true}, {destination, false}};
  for (const auto& [layout, source_side] : sides) {
    if (layout == nullptr) continue;
    const StorageEntry& storage = layout->storage(layout->tensor(tensor).storage);
    if (storage.block_sizes.empty()) continue;
    const auto dim = static_cast<std::size_t>(storage.dim);
    if (dim < pieces.size()) cut_at_blocks(pieces[dim], interleave_of(storage, tensor).block, source_side);
  }
}

int32_t append_region(PlanData& plan, int32_t tensor, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& sizes, int64_t bytes) {
  const auto id = static_cast<int32_t>(plan.region_tensor.size());
  plan.region_tensor.push_back(tensor);
  plan.region_dims_start.push_back(static_cast<int64_t>(plan.region_offsets.size()));
  plan.region_offsets.insert(plan.region_offsets.end(), offsets.begin(), offsets.end());
  plan.region_sizes.insert(plan.region_sizes.end(), sizes.begin(), sizes.end());
  plan.region_bytes.push_back(bytes);
  return id;
}

void append_move(PlanData& plan, int32_t region, int64_t src, int64_t dst, uint8_t kind, uint8_t stage,
                 uint8_t src_space, uint8_t dst_space, uint8_t source) {
  plan.move_region.push_back(region);
  plan.move_src.push_back(static_cast<int32_t>(src));
  plan.move_dst.push_back(static_cast<int32_t>(dst));
  plan.move_kind.push_back(kind);
  plan.move_stage.push_back(stage);
  plan.move_src_space.push_back(src_space);
  plan.move_dst_space.push_back(dst_space);
  plan.move_source.push_back(source);
}

bool check_region_columns(const PlanData& plan, const LayoutCore& layout, std::vector<std::string>& problems,
                          std::size_t max_problems, bool stop_at_bytes) {
  const std::size_t regions = plan.region_tensor.size();
  if (plan.region_dims_start.size() != regions || plan.region_bytes.size() != regions ||
      plan.region_offsets.size() != plan.region_sizes.size()) {
    problems.push_back("region columns have different lengths");
    return false;
  }
  for (std::size_t r = 0; r < regions && (stop_at_bytes || problems.size() < max_problems); ++r) {
    const int32_t tensor = plan.region_tensor[r];
    if (tensor < 0 || static_cast<std::size_t>(tensor) >= layout.num_tensors()) {
      problems.push_back("region " + std::to_string(r) + " refers to a tensor that does not exist");
      return false;
    }
    const std::size_t ndim = layout.tensor(tensor).shape.size();
    const int64_t start = plan.region_dims_start[r];
    if (start < 0 || static_cast<std::size_t>(start) + ndim > plan.region_offsets.size()) {
      problems.push_back("region " + std::to_string(r) + " has its dims outside the coordinate columns");
      return false;
    }
    int64_t bytes = layout.tensor(tensor).itemsize;
    for (std::size_t d = 0; d < ndim; ++d) bytes *= plan.region_sizes[static_cast<std::size_t>(start) + d];
    if (bytes != plan.region_bytes[r]) {
      problems.push_back("region " + std::to_string(r) + " claims " + std::to_string(plan.region_bytes[r]) +
                         " bytes, its sizes give " + std::to_string(bytes));
      if (stop_at_bytes) return false;
    }
  }
  return true;
}

int64_t PlanRegions::volume(int32_t region) const {
  int64_t v = 1;
  for (std::size_t d = 0; d < ndim(region); ++d) v *= size(region, d);
  return v;
}

int64_t PlanRegions::written(const std::size_t* first, const std::size_t* last) const {
  int64_t total = 0;
  for (const std::size_t* w = first; w != last; ++w) total += volume(plan_.move_region[*w]);
  return total;
}

std::string cover_problem(int32_t tensor, int64_t rank, int64_t written, int64_t held) {
  return "tensor " + std::to_string(tensor) + " on rank " + std::to_string(rank) + ": " + std::to_string(written) +
         " of its " + std::to_string(held) + " destination elements are written";
}

int64_t PlanRegions::overlap(int32_t a, int32_t b) const {
  int64_t v = 1;
  for (std::size_t d = 0; d < ndim(a); ++d) {
    const auto [l, h] = intersect(lo(a, d), lo(a, d) + size(a, d), lo(b, d), lo(b, d) + size(b, d));
    v *= h - l;
  }
  return v;
}

bool PlanRegions::inside(int32_t region, const HoldingGroup& group) const {
  for (std::size_t d = 0; d < group.runs.size(); ++d) {
    const int64_t a = lo(region, d), b = a + size(region, d);
    int64_t covered = 0;
    for (const Run& r : group.runs[d]) {
      const auto [l, h] = intersect(a, b, r.global_start, r.global_start + r.length);
      covered += h - l;
    }
    if (covered != b - a) return false;
  }
  return true;
}

bool PlanRegions::within_one_block(int32_t region, const HoldingGroup& group, const LayoutCore& layout) const {
  const int32_t tensor = plan_.region_tensor[static_cast<std::size_t>(region)];
  const StorageEntry& storage = layout.storage(layout.tensor(tensor).storage);
  if (storage.block_sizes.empty()) return true;
  const auto dim = static_cast<std::size_t>(storage.dim);
  if (dim >= group.runs.size()) return true;
  const int64_t block = interleave_of(storage, tensor).block;
  const int64_t a = lo(region, dim), b = a + size(region, dim);
  for (const Run& run : group.runs[dim]) {
    if (a >= run.global_start && b <= run.global_start + run.length) {
      const int64_t local = run.local_start + (a - run.global_start);
      return local / block == (local + (b - a) - 1) / block;
    }
  }
  return false;
}

}  // namespace layoutlang
