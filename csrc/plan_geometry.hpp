// The plan geometry both planners share: the whole-fleet planner (planner.cpp) and the
// pairwise one (rank_plan.cpp) cut the overlap of two holdings into per-dim pieces, the
// product of those pieces into slabs of at most a bucket, and their validators read the
// same region columns back. One copy here, so that the two plan modes cannot drift apart
// in how they cut a box (a slab boundary both must agree on, quantization blocks included).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "layout_core.hpp"
#include "planner.hpp"

namespace layoutlang {

// A piece of one dim: global run plus its local position on each side.
struct Piece {
  int64_t global_start;
  int64_t length;
  int64_t src_local;
  int64_t dst_local;
};

int64_t runs_length(const std::vector<Run>& runs);

// The elements a replica group holds (the product of its runs' lengths over dims).
int64_t holding_volume(const HoldingGroup& g);

// Appends to `pieces` where the runs `held` (source side) of one dim meet the runs `need`
// (destination side), in the order of `need`'s runs, then `held`'s.
void meet_runs(const std::vector<Run>& need, const std::vector<Run>& held, std::vector<Piece>& pieces);

// Cuts pieces where the local position (source or destination side) crosses a multiple of
// `block`, so every piece lands in one block of an interleaved storage.
void cut_at_blocks(std::vector<Piece>& pieces, int64_t block, bool source_side);

// Cuts `tensor`'s pieces at the blocks of its interleaved storage in `source` (when not
// null) and in `destination` (when not null): a side left null is not cut.
void cut_interleaved(int32_t tensor, std::vector<std::vector<Piece>>& pieces, const LayoutCore* source,
                     const LayoutCore* destination);

// Appends a region (a box of `tensor` of `bytes`) to the plan's region columns: its id.
int32_t append_region(PlanData& plan, int32_t tensor, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& sizes, int64_t bytes);

// Appends a move to the plan's move columns, all but move_bucket (which each planner fills
// its own way: the whole-fleet one after every move is known, the pairwise one per pair).
void append_move(PlanData& plan, int32_t region, int64_t src, int64_t dst, uint8_t kind, uint8_t stage,
                 uint8_t src_space, uint8_t dst_space, uint8_t source);

// Splits a box of `tensor` into slabs of at most bucket_bytes along its outermost dims (a
// tensor larger than a bucket is cut, never refused), each slab of whole quantization blocks
// of the destination along the dim it is cut in, and calls `emit(offsets, sizes)` per slab.
template <class Emit>
void for_each_slab(const LayoutCore& source, const LayoutCore& destination, int64_t bucket_bytes, int32_t tensor,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes, Emit& emit) {
  const int64_t itemsize = source.tensor(tensor).itemsize;
  const std::size_t ndim = sizes.size();
  int64_t bytes = itemsize;
  for (int64_t s : sizes) bytes *= s;
  if (bytes <= bucket_bytes || ndim == 0) {
    emit(offsets, sizes);
    return;
  }
  // The outermost dim whose inner block fits: slabs of whole inner blocks along it.
  std::size_t cut = ndim - 1;
  int64_t inner = itemsize;
  for (std::size_t d = ndim; d-- > 0;) {
    if (inner * sizes[d] > bucket_bytes) {
      cut = d;
      break;
    }
    inner *= sizes[d];
  }
  const int64_t rows = std::max<int64_t>(1, bucket_bytes / inner);
  const std::vector<int64_t>& block = destination.tensor(tensor).quant_block;  // 1 where not quantized
  const int64_t along = cut < block.size() ? block[cut] : 1;
  std::vector<int64_t> at(offsets), size(sizes);
  std::vector<int64_t> outer(cut, 0);  // odometer over the dims before `cut`, one index each
  for (std::size_t d = 0; d < cut; ++d) size[d] = 1;
  while (true) {
    for (std::size_t d = 0; d < cut; ++d) at[d] = offsets[d] + outer[d];
    for (int64_t row = 0; row < sizes[cut];) {
      at[cut] = offsets[cut] + row;
      size[cut] = slab_end(at[cut], rows, offsets[cut] + sizes[cut], along) - at[cut];
      emit(at, size);
      row += size[cut];
    }
    if (cut == 0) return;
    std::size_t d = cut;
    while (d > 0) {
      --d;
      if (++outer[d] < sizes[d]) break;
      outer[d] = 0;
      if (d == 0) return;
    }
  }
}

// Every box of the product of per-dim pieces (none when a dim has no piece), cut into slabs
// by for_each_slab, in odometer order (the last dim fastest).
template <class Emit>
void for_each_slab_of_product(const LayoutCore& source, const LayoutCore& destination, int64_t bucket_bytes,
                              int32_t tensor, const std::vector<std::vector<Piece>>& pieces, Emit& emit) {
  const std::size_t ndim = pieces.size();
  for (const auto& p : pieces) {
    if (p.empty()) return;
  }
  std::vector<std::size_t> pick(ndim, 0);
  std::vector<int64_t> offsets(ndim), sizes(ndim);
  while (true) {
    for (std::size_t d = 0; d < ndim; ++d) {
      offsets[d] = pieces[d][pick[d]].global_start;
      sizes[d] = pieces[d][pick[d]].length;
    }
    for_each_slab(source, destination, bucket_bytes, tensor, offsets, sizes, emit);
    if (ndim == 0) return;
    std::size_t d = ndim;
    while (d > 0) {
      --d;
      if (++pick[d] < pieces[d].size()) break;
      pick[d] = 0;
      if (d == 0) return;
    }
  }
}

// Checks the region columns of a plan over `layout`'s tensors: their lengths, every region's
// tensor, its dims inside the coordinate columns and its bytes against its sizes. Appends
// what it finds to `problems`; false when the columns cannot be read further. A region whose
// bytes do not match stops the check there (false) when `stop_at_bytes`, else the check goes
// on to the next region while fewer than `max_problems` problems are found.
bool check_region_columns(const PlanData& plan, const LayoutCore& layout, std::vector<std::string>& problems,
                          std::size_t max_problems, bool stop_at_bytes);

// The validators' problem of a rank that is written `written` of its `held` destination
// elements of `tensor`.
std::string cover_problem(int32_t tensor, int64_t rank, int64_t written, int64_t held);

// A plan's regions read back from its columns (checked by check_region_columns first): the
// geometry both validators test moves against.
class PlanRegions {
 public:
  PlanRegions(const PlanData& plan, const LayoutCore& layout) : plan_(plan), layout_(layout) {}

  std::size_t ndim(int32_t region) const {
    return layout_.tensor(plan_.region_tensor[static_cast<std::size_t>(region)]).shape.size();
  }
  int64_t lo(int32_t region, std::size_t d) const { return plan_.region_offsets[start(region) + d]; }
  int64_t size(int32_t region, std::size_t d) const { return plan_.region_sizes[start(region) + d]; }
  int64_t volume(int32_t region) const;
  // The elements the moves `moves` write: their regions' volumes summed.
  int64_t written(const std::size_t* first, const std::size_t* last) const;
  int64_t written(const std::vector<std::size_t>& moves) const { return written(moves.data(), moves.data() + moves.size()); }
  int64_t overlap(int32_t a, int32_t b) const;
  // Whether the group's runs cover the region along every dim.
  bool inside(int32_t region, const HoldingGroup& group) const;
  // A region read from or written to an interleaved storage must sit in one block there.
  bool within_one_block(int32_t region, const HoldingGroup& group, const LayoutCore& layout) const;

 private:
  std::size_t start(int32_t region) const {
    return static_cast<std::size_t>(plan_.region_dims_start[static_cast<std::size_t>(region)]);
  }

  const PlanData& plan_;
  const LayoutCore& layout_;  // tensor shapes
};

}  // namespace layoutlang
