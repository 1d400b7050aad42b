// A layout compiled to plain arrays: which boxes of which logical tensor each rank holds,
// and where each box sits in the rank's storage.
//
// The Python model resolves names, rules and expressions; it hands this class only
// integers: the mesh (axis sizes, ranks in row-major order), one ShardSpec per distinct
// placement, per logical tensor its shape, spec, sub-mesh coordinates and storage, and per
// storage the tensors it holds and how they are fused. Everything rank-by-rank (boxes,
// storage shapes, validation, bulk summaries) is computed here.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "shard_math.hpp"

namespace layoutlang {

struct TensorEntry {
  std::vector<int64_t> shape;
  int32_t spec = 0;              // index into the layout's specs
  std::vector<int32_t> fixed;    // per axis: the coordinate of the sub-mesh, or -1 for all
  int32_t storage = 0;           // index into the layout's storages
  int32_t itemsize = 1;          // bytes per element
  // A destination's quantization block (one size per dim; empty: not quantized): a plan's
  // slab cuts fall on its boundaries, so that a slab holds whole blocks (issue 16).
  std::vector<int64_t> quant_block;
};

// The end of a slab that starts at `start` along a dim, at most `rows` long and ending at
// `stop` at the latest: moved back onto a multiple of `block` (a quantization block) where
// that leaves the slab non-empty, so that no slab cut splits a block between two slabs.
inline int64_t slab_end(int64_t start, int64_t rows, int64_t stop, int64_t block) {
  int64_t end = start + rows < stop ? start + rows : stop;
  if (block > 1 && end < stop) {
    const int64_t aligned = end / block * block;
    if (aligned > start) end = aligned;
  }
  return end;
}

// A rank's local buffer holding the local shards of one or more tensors ("parts"),
// concatenated along `dim`; with block_sizes, interleaved in blocks of block_sizes[p]
// elements of part p (Megatron's fused QKV per query group).
//
// A stacked storage (element_of not empty) groups its parts into elements (element_of[p],
// ascending, the parts of one element adjacent): each element is its parts concatenated
// along `dim`, and a rank stacks the elements it holds, in element order, along a new
// leading dim (vLLM's w13_weight: [local experts, 2 * I / tp, H]). A transposed part
// (transposed[p]) sits in the storage with its last two dims swapped (Megatron's GroupedMLP
// keeps [in, out]); `dim` counts the dims as placed.
struct StorageEntry {
  int32_t dim = 0;
  std::vector<int32_t> parts;
  std::vector<int64_t> block_sizes;     // empty: plain concatenation
  std::vector<int64_t> declared_shape;  // empty: not declared; otherwise checked on every rank
  std::vector<int32_t> element_of;      // empty: not stacked; otherwise one element per part
  std::vector<uint8_t> transposed;      // empty: no part transposed; otherwise one flag per part
  bool stacked() const { return !element_of.empty(); }
  bool is_transposed(std::size_t p) const { return !transposed.empty() && transposed[p] != 0; }
};

// Where part `tensor` of an interleaved storage goes: block b of the part (block elements
// along the storage dim) starts at b * group_stride + prefix.
struct Interleave {
  int64_t block = 1;
  int64_t prefix = 0;
  int64_t group_stride = 0;
};
Interleave interleave_of(const StorageEntry& storage, int32_t tensor);

// One box: offsets and sizes in the logical tensor, offsets and sizes in the storage (one
// per storage dim: a stacked storage has a leading dim of size 1 here, a transposed part its
// last two dims swapped; otherwise the same sizes).
struct BoxRecord {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::vector<int64_t> storage_offsets;
  std::vector<int64_t> storage_sizes;
};

// How one part's local coordinates become storage coordinates on one rank: the last two
// dims swapped (transposed), `base` added along the storage dim `dim` (the parts before it
// in its element), and the stack index put in front (stacked).
struct Placing {
  bool transposed = false;
  bool stacked = false;
  std::size_t dim = 0;
  int64_t base = 0;
  int64_t stack = 0;
  void offsets(std::vector<int64_t>& coords) const;  // local offsets -> storage offsets
  void sizes(std::vector<int64_t>& coords) const;    // local sizes -> storage sizes
};

struct Problem {
  std::string kind;  // "storage-shape", "storage-blocks", "storage-rank", "storage-declared", "storage-element"
  int32_t storage;
  int64_t rank;
  std::string message;
};

struct RankSummary {
  int64_t rank;
  int64_t boxes = 0;
  int64_t elements = 0;
  int64_t bytes = 0;
  int64_t tensors = 0;
};

// What one rank holds of one tensor: its local shape and, per dim, the runs of global
// indices it holds in local order.
struct Holding {
  std::vector<int64_t> shape;
  std::vector<std::vector<Run>> runs;  // per dim
};

class LayoutCore {
 public:
  LayoutCore(std::vector<int64_t> axis_sizes, std::vector<int64_t> ranks,
             std::vector<ShardSpec> specs, std::vector<TensorEntry> tensors,
             std::vector<StorageEntry> storages);

  const std::vector<int64_t>& axis_sizes() const { return axis_sizes_; }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  std::size_t num_tensors() const { return tensors_.size(); }
  std::size_t num_storages() const { return storages_.size(); }

  // Position of `rank` in the mesh (row-major), or -1 when the mesh does not cover it.
  int64_t mesh_index(int64_t rank) const;
  bool holds(int32_t tensor, int64_t rank) const;
  std::vector<int64_t> holders(int32_t tensor) const;

  // Local shape of the tensor's shard (padding included); false when not held.
  bool local_shape(int32_t tensor, int64_t rank, std::vector<int64_t>& shape) const;
  bool storage_shape(int32_t storage, int64_t rank, std::vector<int64_t>& shape) const;
  // Boxes of `tensor` on `rank`, with their places in the storage; empty when not held.
  void boxes(int32_t tensor, int64_t rank, std::vector<BoxRecord>& out) const;

  // Where a region (inside one box of the rank) sits in the rank's storage, one offset per
  // storage dim; false when the rank does not hold the region's first element.
  bool locate(int32_t tensor, int64_t rank, const int64_t* offsets, std::vector<int64_t>& storage_offsets) const;

  const TensorEntry& tensor(int32_t t) const { return tensors_[t]; }
  // Records the quantization block of tensor `t` (a destination layout's, for slab cuts).
  void set_quant_block(int32_t t, std::vector<int64_t> block) { tensors_.at(t).quant_block = std::move(block); }
  const StorageEntry& storage(int32_t s) const { return storages_[s]; }
  const ShardSpec& spec(int32_t s) const { return specs_[s]; }
  // Row-major coordinates of the mesh position `index`.
  const int64_t* coords(int64_t index) const { return &coords_[index * axis_sizes_.size()]; }
  bool holds_index(int32_t tensor, int64_t index) const;
  bool holding(int32_t tensor, int64_t index, Holding& out) const { return local_shard(tensor, index, out); }

  // Every storage on every rank it exists on: shapes agree, blocks divide, declared shapes hold.
  std::vector<Problem> validate(std::size_t max_problems) const;
  // Every box of every tensor on every rank, counted per rank.
  std::vector<RankSummary> summarize() const;

 private:
  using LocalShard = Holding;
  bool local_shard(int32_t tensor, int64_t index, LocalShard& out) const;
  void boxes_at(int32_t tensor, int64_t index, const LocalShard& shard,
                std::vector<BoxRecord>& out) const;
  int64_t part_base(int32_t storage, int32_t tensor, int64_t index) const;
  // The position, among the elements `index` holds, of the element holding `tensor`.
  int64_t stack_index(int32_t storage, int32_t tensor, int64_t index) const;
  // How local coordinates of `tensor` at mesh position `index` map into its storage.
  Placing placing(int32_t tensor, int64_t index) const;
  void validate_stacked(int32_t storage, int64_t index, std::vector<Problem>& problems) const;

  std::vector<int64_t> axis_sizes_;
  std::vector<int64_t> ranks_;
  std::vector<int64_t> coords_;  // mesh size x axes, row-major coordinates of each index
  std::unordered_map<int64_t, int64_t> index_of_;
  std::vector<ShardSpec> specs_;
  std::vector<TensorEntry> tensors_;
  std::vector<StorageEntry> storages_;
};

}  // namespace layoutlang
