// Replica groups: the ranks of a layout that hold exactly the same runs of one tensor.
//
// Ranks that pick the same chunk at every split of a tensor's spec hold the same runs (in
// the same local order, with the same local shape), and the groups of one tensor hold
// disjoint parts of it. Groups depend only on a tensor's spec, shape and sub-mesh
// coordinates, so tensors that share them (every expert of a layer, every layer's
// projections) share one computation: GroupCache keeps them per (spec, shape, sub-mesh).
// The planner, the plan validator and the recovery decisions (recovery.hpp) read them.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "layout_core.hpp"

namespace layoutlang {

// One replica group of a tensor: ranks holding exactly the same runs.
struct HoldingGroup {
  std::vector<std::vector<Run>> runs;  // per dim, in local order
  std::vector<int64_t> ranks;          // ascending
  std::vector<int64_t> shape;          // the local shape of each member (padding included)
};

class GroupCache {
 public:
  explicit GroupCache(const LayoutCore& layout) : layout_(layout) {}

  // The groups of `tensor`; the reference stays valid as long as the cache.
  const std::vector<HoldingGroup>& groups(int32_t tensor);
  // A small integer naming the groups of `tensor`: equal for tensors that share them.
  int32_t key_id(int32_t tensor);

 private:
  std::vector<HoldingGroup> compute(int32_t tensor) const;
  void make_key(int32_t tensor);

  struct Entry {
    int32_t id;
    std::vector<HoldingGroup> groups;
  };
  const LayoutCore& layout_;
  std::map<std::vector<int64_t>, Entry> cache_;
  std::vector<int64_t> key_;
};

}  // namespace layoutlang
