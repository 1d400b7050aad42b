// Recovery decisions: what a set of lost ranks takes away, and which ranks hold something
// else in the next generation's layout. Pure functions of compiled layouts.
//
// Both work replica group by replica group (replica_groups.hpp), never rank by rank over
// every tensor: a tensor's groups are computed once per (spec, shape, sub-mesh) and the
// per-rank questions are asked once per distinct pair of groups, so the time grows with
// the tensors and the distinct placements, not with tensors x ranks. Only where the quick
// answers do not decide (a tensor whose every copy in some layout is not intact; a rank
// whose shards differ) is the exact rank-by-rank computation made.
#pragma once

#include <cstdint>
#include <vector>

#include "layout_core.hpp"

namespace layoutlang {

// Disjoint boxes of logical tensors, as columns: region i is tensor[i] at
// offsets/sizes [dims_start[i], dims_start[i] + ndim).
struct Regions {
  std::vector<int32_t> tensor;
  std::vector<int64_t> dims_start;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};

// Every region of every logical tensor that no rank outside `lost` holds in any of
// `layouts`, for the tensors some lost rank holds (a region nobody held is no loss).
//
// The caller numbers the logical tensors 0..shapes.size()-1; tensor_ids[k][t] is the
// caller's number of tensor t of layouts[k]. Each tensor is cut at every boundary of
// the boxes surviving ranks hold, and the cells nobody holds are merged greedily in
// row-major order (the last dim grown first, then earlier dims): the regions come in
// the order of the caller's numbers, then of their first cells.
Regions lost_regions(const std::vector<const LayoutCore*>& layouts,
                     const std::vector<std::vector<int32_t>>& tensor_ids,
                     const std::vector<std::vector<int64_t>>& shapes, const std::vector<int64_t>& lost);

// One side of a holdings comparison: a compiled layout and what the core does not know of
// its storages: a number per storage for its name (equal numbers: equal names, across
// both layouts) and the shape it is viewed as (has_view[s] == 0: its own shape).
struct NamedLayout {
  const LayoutCore* core;
  std::vector<int64_t> storage_names;
  std::vector<uint8_t> has_view;
  std::vector<std::vector<int64_t>> views;
};

// For each of `ranks`: whether it holds, in `before` and in `after`, the same storages
// (names and shapes) and the same boxes of every tensor at the same places in storages of
// the same names. A rank outside either mesh does not. The layouts must number the same
// tensors alike.
std::vector<uint8_t> same_holdings(const NamedLayout& before, const NamedLayout& after,
                                   const std::vector<int64_t>& ranks);

}  // namespace layoutlang
