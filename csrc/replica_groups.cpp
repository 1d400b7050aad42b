#include "replica_groups.hpp"

#include <algorithm>

namespace layoutlang {

void GroupCache::make_key(int32_t tensor) {
  const TensorEntry& entry = layout_.tensor(tensor);
  key_.clear();
  key_.push_back(entry.spec);
  key_.push_back(static_cast<int64_t>(entry.shape.size()));
  key_.insert(key_.end(), entry.shape.begin(), entry.shape.end());
  key_.insert(key_.end(), entry.fixed.begin(), entry.fixed.end());
}

const std::vector<HoldingGroup>& GroupCache::groups(int32_t tensor) {
  make_key(tensor);
  auto found = cache_.find(key_);
  if (found != cache_.end()) return found->second.groups;
  const auto id = static_cast<int32_t>(cache_.size());
  return cache_.emplace(key_, Entry{id, compute(tensor)}).first->second.groups;
}

int32_t GroupCache::key_id(int32_t tensor) {
  make_key(tensor);
  auto found = cache_.find(key_);
  if (found != cache_.end()) return found->second.id;
  const auto id = static_cast<int32_t>(cache_.size());
  cache_.emplace(key_, Entry{id, compute(tensor)});
  return id;
}

std::vector<HoldingGroup> GroupCache::compute(int32_t tensor) const {
  const TensorEntry& entry = layout_.tensor(tensor);
  const ShardSpec& spec = layout_.spec(entry.spec);
  const std::vector<int64_t>& sizes = layout_.axis_sizes();
  std::map<std::vector<int64_t>, std::size_t> group_of;
  std::vector<HoldingGroup> groups;
  std::vector<int64_t> split_key;
  Holding holding;
  for (std::size_t index = 0; index < layout_.ranks().size(); ++index) {
    const auto idx = static_cast<int64_t>(index);
    if (!layout_.holds_index(tensor, idx)) continue;
    // Ranks that pick the same chunk at every split hold exactly the same runs.
    const int64_t* coords = layout_.coords(idx);
    split_key.clear();
    for (const DimSpec& dim : spec) {
      for (const Split& split : dim.splits) {
        const int64_t size = sizes[split.axis];
        const int64_t pieces = split.pieces > 0 ? split.pieces : size;
        split_key.push_back(coords[split.axis] / (size / pieces));
      }
    }
    auto [it, inserted] = group_of.emplace(split_key, groups.size());
    if (inserted) {
      layout_.holding(tensor, idx, holding);
      groups.push_back(HoldingGroup{holding.runs, {}, holding.shape});
    }
    groups[it->second].ranks.push_back(layout_.ranks()[index]);
  }
  for (HoldingGroup& g : groups) std::sort(g.ranks.begin(), g.ranks.end());
  return groups;
}

}  // namespace layoutlang
