#include "recovery.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "replica_groups.hpp"

namespace layoutlang {
namespace {

int64_t volume(const std::vector<std::vector<Run>>& runs) {
  int64_t v = 1;
  for (const auto& dim : runs) {
    int64_t n = 0;
    for (const Run& r : dim) n += r.length;
    v *= n;
  }
  return v;
}

// Marks the lost ranks: mask[rank] != 0, sized to cover every rank of every layout.
std::vector<char> lost_mask(const std::vector<const LayoutCore*>& layouts, const std::vector<int64_t>& lost) {
  int64_t top = 0;
  for (const LayoutCore* layout : layouts) {
    for (int64_t r : layout->ranks()) top = std::max(top, r);
  }
  std::vector<char> mask(static_cast<std::size_t>(top) + 1, 0);
  for (int64_t r : lost) {
    if (r >= 0 && r <= top) mask[static_cast<std::size_t>(r)] = 1;
  }
  return mask;
}

// What the lost ranks do to the groups of one (spec, shape, sub-mesh) of one layout.
struct GroupsFate {
  bool computed = false;
  bool any_lost = false;     // some holder is lost
  int64_t alive_volume = 0;  // elements held by groups with a surviving member
};

// A grid of cells cut from one tensor at the given boundaries, for the exact analysis.
class Grid {
 public:
  explicit Grid(std::vector<std::vector<int64_t>> cuts) : cuts_(std::move(cuts)) {
    const std::size_t ndim = cuts_.size();
    shape_.resize(ndim);
    strides_.assign(ndim, 1);
    for (std::size_t d = 0; d < ndim; ++d) shape_[d] = static_cast<int64_t>(cuts_[d].size()) - 1;
    for (std::size_t d = ndim; d-- > 1;) strides_[d - 1] = strides_[d] * shape_[d];
    int64_t cells = 1;
    for (int64_t s : shape_) cells *= s;
    free_.assign(static_cast<std::size_t>(cells), 1);
  }

  // The cells of a box [offsets, offsets + sizes) whose bounds are cuts.
  void cells_of(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes, std::vector<int64_t>& lo,
                std::vector<int64_t>& hi) const {
    const std::size_t ndim = cuts_.size();
    lo.resize(ndim);
    hi.resize(ndim);
    for (std::size_t d = 0; d < ndim; ++d) {
      const auto& c = cuts_[d];
      lo[d] = std::lower_bound(c.begin(), c.end(), offsets[d]) - c.begin();
      hi[d] = std::lower_bound(c.begin(), c.end(), offsets[d] + sizes[d]) - c.begin() - 1;  // inclusive
    }
  }

  // Calls f(flat index) for every cell of the inclusive sub-grid [lo, hi]; stops when f is false.
  template <class F>
  bool each(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi, F f) const {
    const std::size_t ndim = cuts_.size();
    for (std::size_t d = 0; d < ndim; ++d) {
      if (hi[d] < lo[d]) return true;
    }
    std::vector<int64_t> at(lo);
    while (true) {
      int64_t flat = 0;
      for (std::size_t d = 0; d < ndim; ++d) flat += at[d] * strides_[d];
      if (!f(flat)) return false;
      std::size_t d = ndim;
      while (d > 0) {
        --d;
        if (++at[d] <= hi[d]) break;
        at[d] = lo[d];
        if (d == 0) return true;
      }
      if (ndim == 0) return true;
    }
  }

  void clear(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi) {
    each(lo, hi, [&](int64_t i) { return (free_[static_cast<std::size_t>(i)] = 0, true); });
  }
  bool all_free(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi) const {
    return each(lo, hi, [&](int64_t i) { return free_[static_cast<std::size_t>(i)] != 0; });
  }

  // Disjoint boxes exactly covering the free cells: from each free cell in row-major order,
  // grow the last dim as far as the cells are free, then each earlier dim.
  void merge(int32_t tensor, Regions& out) {
    const std::size_t ndim = cuts_.size();
    std::vector<int64_t> start(ndim), end(ndim), lo(ndim), hi(ndim);
    for (std::size_t flat = 0; flat < free_.size(); ++flat) {
      if (!free_[flat]) continue;
      int64_t rest = static_cast<int64_t>(flat);
      for (std::size_t d = 0; d < ndim; ++d) {
        start[d] = rest / strides_[d];
        rest %= strides_[d];
      }
      end = start;
      for (std::size_t d = ndim; d-- > 0;) {
        while (end[d] + 1 < shape_[d]) {
          lo = start;
          hi = end;
          lo[d] = hi[d] = end[d] + 1;
          if (!all_free(lo, hi)) break;
          ++end[d];
        }
      }
      clear(start, end);
      out.tensor.push_back(tensor);
      out.dims_start.push_back(static_cast<int64_t>(out.offsets.size()));
      for (std::size_t d = 0; d < ndim; ++d) {
        out.offsets.push_back(cuts_[d][static_cast<std::size_t>(start[d])]);
        out.sizes.push_back(cuts_[d][static_cast<std::size_t>(end[d]) + 1] - cuts_[d][static_cast<std::size_t>(start[d])]);
      }
    }
  }

 private:
  std::vector<std::vector<int64_t>> cuts_;
  std::vector<int64_t> shape_, strides_;
  std::vector<char> free_;
};

bool same_runs(const HoldingGroup& a, const HoldingGroup& b) {
  if (a.shape != b.shape || a.runs.size() != b.runs.size()) return false;
  for (std::size_t d = 0; d < a.runs.size(); ++d) {
    const auto& x = a.runs[d];
    const auto& y = b.runs[d];
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (x[i].global_start != y[i].global_start || x[i].length != y[i].length || x[i].local_start != y[i].local_start) {
        return false;
      }
    }
  }
  return true;
}

bool same_storage(const StorageEntry& a, const StorageEntry& b) {
  return a.dim == b.dim && a.parts == b.parts && a.block_sizes == b.block_sizes &&
         a.declared_shape == b.declared_shape && a.element_of == b.element_of && a.transposed == b.transposed;
}

bool part_transposed(const StorageEntry& storage, int32_t tensor) {
  const auto at = std::find(storage.parts.begin(), storage.parts.end(), tensor);
  return at != storage.parts.end() && storage.is_transposed(static_cast<std::size_t>(at - storage.parts.begin()));
}

void check_named(const NamedLayout& side, const char* which) {
  const std::size_t n = side.core->num_storages();
  if (side.storage_names.size() != n || side.has_view.size() != n || side.views.size() != n) {
    throw CoreValueError("argument", std::string("the ") + which + " layout needs a name and a view per storage (" +
                                         std::to_string(n) + " storages)");
  }
}

// Storage name -> the shape the rank holds it as (its view where it has one); a later
// storage of a repeated name wins, as in a dict.
std::map<int64_t, std::vector<int64_t>> storages_on(const NamedLayout& side, int64_t rank) {
  std::map<int64_t, std::vector<int64_t>> out;
  std::vector<int64_t> shape;
  for (std::size_t s = 0; s < side.core->num_storages(); ++s) {
    if (!side.core->storage_shape(static_cast<int32_t>(s), rank, shape)) continue;
    out[side.storage_names[s]] = side.has_view[s] ? side.views[s] : shape;
  }
  return out;
}

bool same_box(const BoxRecord& a, const BoxRecord& b) {
  return a.offsets == b.offsets && a.sizes == b.sizes && a.storage_offsets == b.storage_offsets &&
         a.storage_sizes == b.storage_sizes;
}

// The rank-by-rank comparison: every storage and every box of every tensor.
bool exactly_same(const NamedLayout& before, const NamedLayout& after, int64_t rank) {
  if (storages_on(before, rank) != storages_on(after, rank)) return false;
  std::vector<BoxRecord> a, b;
  for (std::size_t t = 0; t < before.core->num_tensors(); ++t) {
    const auto tid = static_cast<int32_t>(t);
    a.clear();
    b.clear();
    before.core->boxes(tid, rank, a);
    after.core->boxes(tid, rank, b);
    if (a.size() != b.size()) return false;
    if (a.empty()) continue;
    const int32_t sa = before.core->tensor(tid).storage, sb = after.core->tensor(tid).storage;
    if (before.storage_names[sa] != after.storage_names[sb] ||
        part_transposed(before.core->storage(sa), tid) != part_transposed(after.core->storage(sb), tid)) {
      return false;
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!same_box(a[i], b[i])) return false;
    }
  }
  return true;
}

// Per (spec, shape, sub-mesh) of a layout: the group of each mesh position (-1: not held).
class GroupIndex {
 public:
  explicit GroupIndex(const LayoutCore& layout) : layout_(layout), cache_(layout) {}
  int32_t key(int32_t tensor) { return cache_.key_id(tensor); }
  const HoldingGroup* group_at(int32_t tensor, int64_t index) {
    const int32_t id = cache_.key_id(tensor);
    if (static_cast<std::size_t>(id) >= at_.size()) at_.resize(static_cast<std::size_t>(id) + 1);
    std::vector<int32_t>& at = at_[static_cast<std::size_t>(id)];
    const std::vector<HoldingGroup>& groups = cache_.groups(tensor);
    if (at.empty()) {
      at.assign(layout_.ranks().size(), -1);
      for (std::size_t g = 0; g < groups.size(); ++g) {
        for (int64_t r : groups[g].ranks) at[static_cast<std::size_t>(layout_.mesh_index(r))] = static_cast<int32_t>(g);
      }
    }
    const int32_t g = at[static_cast<std::size_t>(index)];
    return g < 0 ? nullptr : &groups[static_cast<std::size_t>(g)];
  }

 private:
  const LayoutCore& layout_;
  GroupCache cache_;
  std::vector<std::vector<int32_t>> at_;  // per key id
};

}  // namespace

Regions lost_regions(const std::vector<const LayoutCore*>& layouts,
                     const std::vector<std::vector<int32_t>>& tensor_ids,
                     const std::vector<std::vector<int64_t>>& shapes, const std::vector<int64_t>& lost) {
  if (tensor_ids.size() != layouts.size()) {
    throw CoreValueError("argument", "give the tensor numbers of every layout (" + std::to_string(layouts.size()) +
                                         " layouts, " + std::to_string(tensor_ids.size()) + " lists)");
  }
  // Where each of the caller's tensors is, layout by layout.
  std::vector<std::vector<std::pair<std::size_t, int32_t>>> where(shapes.size());
  for (std::size_t k = 0; k < layouts.size(); ++k) {
    if (tensor_ids[k].size() != layouts[k]->num_tensors()) {
      throw CoreValueError("argument", "layout " + std::to_string(k) + " has " +
                                           std::to_string(layouts[k]->num_tensors()) + " tensors, but " +
                                           std::to_string(tensor_ids[k].size()) + " numbers are given");
    }
    for (std::size_t t = 0; t < tensor_ids[k].size(); ++t) {
      const int32_t id = tensor_ids[k][t];
      if (id < 0 || static_cast<std::size_t>(id) >= shapes.size()) {
        throw CoreValueError("argument", "tensor number " + std::to_string(id) + " is out of range");
      }
      if (layouts[k]->tensor(static_cast<int32_t>(t)).shape != shapes[static_cast<std::size_t>(id)]) {
        throw CoreValueError("mismatch", "its shape differs between the layouts", id);
      }
      where[static_cast<std::size_t>(id)].emplace_back(k, static_cast<int32_t>(t));
    }
  }
  const std::vector<char> mask = lost_mask(layouts, lost);
  std::vector<GroupCache> caches;
  caches.reserve(layouts.size());
  for (const LayoutCore* layout : layouts) caches.emplace_back(*layout);
  std::vector<std::vector<GroupsFate>> fates(layouts.size());
  auto alive = [&](int64_t r) { return !mask[static_cast<std::size_t>(r)]; };

  Regions out;
  std::vector<BoxRecord> boxes;
  for (std::size_t id = 0; id < shapes.size(); ++id) {
    const std::vector<int64_t>& shape = shapes[id];
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    if (numel == 0) continue;
    bool any_lost = false, covered = false;
    for (const auto& [k, t] : where[id]) {
      const auto key = static_cast<std::size_t>(caches[k].key_id(t));
      if (key >= fates[k].size()) fates[k].resize(key + 1);
      GroupsFate& fate = fates[k][key];
      if (!fate.computed) {
        fate.computed = true;
        for (const HoldingGroup& g : caches[k].groups(t)) {
          const bool survives = std::any_of(g.ranks.begin(), g.ranks.end(), alive);
          fate.any_lost = fate.any_lost || !std::all_of(g.ranks.begin(), g.ranks.end(), alive);
          if (survives) fate.alive_volume += volume(g.runs);
        }
      }
      any_lost = any_lost || fate.any_lost;
      // A layout's groups hold disjoint parts: surviving groups holding every element
      // between them cover the tensor.
      covered = covered || fate.alive_volume == numel;
    }
    if (!any_lost || covered) continue;

    // The exact analysis: the boxes of one surviving member of every surviving group (the
    // members of a group hold the same boxes), the tensor cut at all their boundaries.
    std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> held;
    for (const auto& [k, t] : where[id]) {
      for (const HoldingGroup& g : caches[k].groups(t)) {
        const auto member = std::find_if(g.ranks.begin(), g.ranks.end(), alive);
        if (member == g.ranks.end()) continue;
        boxes.clear();
        layouts[k]->boxes(t, *member, boxes);
        for (BoxRecord& b : boxes) {
          int64_t n = 1;
          for (int64_t s : b.sizes) n *= s;
          if (n > 0) held.emplace_back(std::move(b.offsets), std::move(b.sizes));
        }
      }
    }
    const std::size_t ndim = shape.size();
    std::vector<std::vector<int64_t>> cuts(ndim);
    for (std::size_t d = 0; d < ndim; ++d) {
      cuts[d] = {0, shape[d]};
      for (const auto& [offsets, sizes] : held) {
        cuts[d].push_back(offsets[d]);
        cuts[d].push_back(offsets[d] + sizes[d]);
      }
      std::sort(cuts[d].begin(), cuts[d].end());
      cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    }
    Grid grid(std::move(cuts));
    std::vector<int64_t> lo, hi;
    for (const auto& [offsets, sizes] : held) {
      grid.cells_of(offsets, sizes, lo, hi);
      grid.clear(lo, hi);
    }
    grid.merge(static_cast<int32_t>(id), out);
  }
  return out;
}

std::vector<uint8_t> same_holdings(const NamedLayout& before, const NamedLayout& after,
                                   const std::vector<int64_t>& ranks) {
  check_named(before, "first");
  check_named(after, "second");
  const std::size_t num_tensors = before.core->num_tensors();
  if (after.core->num_tensors() != num_tensors) {
    throw CoreValueError("mismatch", "the two layouts cover different tensors");
  }
  // The storages are alike when every tensor sits in a storage of the same name, view and
  // form in both; then a rank whose every shard is the same holds the same boxes at the
  // same places (places follow from the storage's form and the shards of its parts).
  bool alike = true;
  for (std::size_t t = 0; t < num_tensors && alike; ++t) {
    const int32_t sb = before.core->tensor(static_cast<int32_t>(t)).storage;
    const int32_t sa = after.core->tensor(static_cast<int32_t>(t)).storage;
    alike = before.storage_names[sb] == after.storage_names[sa] && before.has_view[sb] == after.has_view[sa] &&
            (!before.has_view[sb] || before.views[sb] == after.views[sa]) &&
            same_storage(before.core->storage(sb), after.core->storage(sa));
  }
  GroupIndex groups_before(*before.core), groups_after(*after.core);
  // One tensor per distinct pair of (spec, shape, sub-mesh): tensors of a pair have the
  // same shards on every rank.
  std::map<std::pair<int32_t, int32_t>, int32_t> pairs;
  for (std::size_t t = 0; t < num_tensors && alike; ++t) {
    const auto tid = static_cast<int32_t>(t);
    pairs.emplace(std::make_pair(groups_before.key(tid), groups_after.key(tid)), tid);
  }
  std::vector<uint8_t> out;
  out.reserve(ranks.size());
  for (int64_t rank : ranks) {
    const int64_t ib = before.core->mesh_index(rank), ia = after.core->mesh_index(rank);
    if (ib < 0 || ia < 0) {
      out.push_back(0);
      continue;
    }
    bool same = alike;
    for (auto it = pairs.begin(); same && it != pairs.end(); ++it) {
      const HoldingGroup* b = groups_before.group_at(it->second, ib);
      const HoldingGroup* a = groups_after.group_at(it->second, ia);
      same = (a == nullptr) == (b == nullptr) && (a == nullptr || same_runs(*a, *b));
    }
    // Shards that differ (or storages of other forms) may still give the same boxes and
    // storage shapes (an empty shard held or not): compare those.
    out.push_back(same || exactly_same(before, after, rank) ? 1 : 0);
  }
  return out;
}

}  // namespace layoutlang
