#include "layout_core.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

namespace layoutlang {
namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::size_t part_pos(const StorageEntry& s, int32_t tensor) {
  for (std::size_t p = 0; p < s.parts.size(); ++p) {
    if (s.parts[p] == tensor) return p;
  }
  return s.parts.size();
}

void swap_last(std::vector<int64_t>& v) {
  if (v.size() >= 2) std::swap(v[v.size() - 1], v[v.size() - 2]);
}

// The local shape of part p as it sits in the storage (its last two dims swapped when transposed).
std::vector<int64_t> placed_shape(const StorageEntry& s, std::size_t p, std::vector<int64_t> shape) {
  if (s.is_transposed(p)) swap_last(shape);
  return shape;
}

}  // namespace

void Placing::offsets(std::vector<int64_t>& coords) const {
  if (transposed) swap_last(coords);
  if (dim < coords.size()) coords[dim] += base;
  if (stacked) coords.insert(coords.begin(), stack);
}

void Placing::sizes(std::vector<int64_t>& coords) const {
  if (transposed) swap_last(coords);
  if (stacked) coords.insert(coords.begin(), 1);
}

Interleave interleave_of(const StorageEntry& s, int32_t tensor) {
  Interleave il;
  for (std::size_t p = 0; p < s.parts.size(); ++p) {
    if (s.parts[p] == tensor) {
      il.block = s.block_sizes[p];
      il.prefix = il.group_stride;
    }
    il.group_stride += s.block_sizes[p];
  }
  return il;
}

LayoutCore::LayoutCore(std::vector<int64_t> axis_sizes, std::vector<int64_t> ranks,
                       std::vector<ShardSpec> specs, std::vector<TensorEntry> tensors,
                       std::vector<StorageEntry> storages)
    : axis_sizes_(std::move(axis_sizes)),
      ranks_(std::move(ranks)),
      specs_(std::move(specs)),
      tensors_(std::move(tensors)),
      storages_(std::move(storages)) {
  int64_t size = 1;
  for (int64_t s : axis_sizes_) {
    if (s < 1) throw CoreValueError("mesh", "mesh axis sizes must be at least 1");
    size *= s;
  }
  if (size != static_cast<int64_t>(ranks_.size())) {
    throw CoreValueError("mesh", "mesh of " + std::to_string(size) + " positions given " +
                                     std::to_string(ranks_.size()) + " ranks");
  }
  const std::size_t naxes = axis_sizes_.size();
  coords_.assign(ranks_.size() * naxes, 0);
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (!index_of_.emplace(ranks_[i], static_cast<int64_t>(i)).second) {
      throw CoreValueError("mesh", "rank " + std::to_string(ranks_[i]) + " appears twice in the mesh", -1, ranks_[i]);
    }
    int64_t rest = static_cast<int64_t>(i);
    for (std::size_t a = naxes; a-- > 0;) {
      coords_[i * naxes + a] = rest % axis_sizes_[a];
      rest /= axis_sizes_[a];
    }
  }
  for (std::size_t ti = 0; ti < tensors_.size(); ++ti) {
    const TensorEntry& t = tensors_[ti];
    const auto tensor = static_cast<int32_t>(ti);
    if (t.spec < 0 || static_cast<std::size_t>(t.spec) >= specs_.size()) {
      throw CoreValueError("tensor", "refers to a missing placement spec", tensor);
    }
    if (t.storage < 0 || static_cast<std::size_t>(t.storage) >= storages_.size()) {
      throw CoreValueError("tensor", "refers to a missing storage", tensor);
    }
    if (t.fixed.size() != naxes) throw CoreValueError("tensor", "sub-mesh coordinates do not match the mesh", tensor);
    for (std::size_t a = 0; a < naxes; ++a) {
      if (t.fixed[a] >= axis_sizes_[a]) {
        throw CoreValueError("tensor",
                             "sub-mesh coordinate " + std::to_string(t.fixed[a]) + " is out of range for axis " +
                                 std::to_string(a) + " of size " + std::to_string(axis_sizes_[a]),
                             tensor);
      }
    }
    check_spec(specs_[t.spec], t.shape.size(), axis_sizes_, tensor);
  }
  for (const StorageEntry& s : storages_) {
    if (s.parts.empty()) throw CoreValueError("storage", "storage without parts");
    if (!s.block_sizes.empty() && s.block_sizes.size() != s.parts.size()) {
      throw CoreValueError("storage", "storage needs one block size per part");
    }
    for (int32_t p : s.parts) {
      if (p < 0 || static_cast<std::size_t>(p) >= tensors_.size()) {
        throw CoreValueError("storage", "storage refers to a missing tensor");
      }
    }
    if (s.stacked() && s.element_of.size() != s.parts.size()) {
      throw CoreValueError("storage", "a stacked storage needs one element per part");
    }
    for (std::size_t p = 1; p < s.element_of.size(); ++p) {
      if (s.element_of[p] < s.element_of[p - 1]) {
        throw CoreValueError("storage", "the parts of a stacked storage must come in element order");
      }
    }
    if (!s.transposed.empty() && s.transposed.size() != s.parts.size()) {
      throw CoreValueError("storage", "a storage with transposed parts needs one flag per part");
    }
    const bool transposes = std::any_of(s.transposed.begin(), s.transposed.end(), [](uint8_t t) { return t != 0; });
    if (!s.block_sizes.empty() && (s.stacked() || transposes)) {
      throw CoreValueError("storage", "an interleaved storage can be neither stacked nor transposed");
    }
    for (std::size_t p = 0; p < s.parts.size(); ++p) {
      if (s.is_transposed(p) && tensors_[s.parts[p]].shape.size() < 2) {
        throw CoreValueError("storage", "a transposed part needs at least 2 dims", s.parts[p]);
      }
    }
  }
}

int64_t LayoutCore::mesh_index(int64_t rank) const {
  auto it = index_of_.find(rank);
  return it == index_of_.end() ? -1 : it->second;
}

bool LayoutCore::holds_index(int32_t tensor, int64_t index) const {
  const std::vector<int32_t>& fixed = tensors_[tensor].fixed;
  const int64_t* coords = &coords_[index * axis_sizes_.size()];
  for (std::size_t a = 0; a < fixed.size(); ++a) {
    if (fixed[a] >= 0 && coords[a] != fixed[a]) return false;
  }
  return true;
}

bool LayoutCore::holds(int32_t tensor, int64_t rank) const {
  const int64_t index = mesh_index(rank);
  return index >= 0 && holds_index(tensor, index);
}

std::vector<int64_t> LayoutCore::holders(int32_t tensor) const {
  std::vector<int64_t> out;
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (holds_index(tensor, static_cast<int64_t>(i))) out.push_back(ranks_[i]);
  }
  return out;
}

bool LayoutCore::local_shard(int32_t tensor, int64_t index, LocalShard& out) const {
  if (!holds_index(tensor, index)) return false;
  const TensorEntry& t = tensors_[tensor];
  const ShardSpec& spec = specs_[t.spec];
  const int64_t* coords = &coords_[index * axis_sizes_.size()];
  out.shape.resize(t.shape.size());
  out.runs.resize(t.shape.size());
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    out.shape[d] = dim_runs(t.shape[d], spec[d], coords, axis_sizes_.data(), out.runs[d]);
  }
  return true;
}

bool LayoutCore::local_shape(int32_t tensor, int64_t rank, std::vector<int64_t>& shape) const {
  const int64_t index = mesh_index(rank);
  LocalShard shard;
  if (index < 0 || !local_shard(tensor, index, shard)) return false;
  shape = std::move(shard.shape);
  return true;
}

int64_t LayoutCore::part_base(int32_t storage, int32_t tensor, int64_t index) const {
  const StorageEntry& s = storages_[storage];
  const std::size_t me = part_pos(s, tensor);
  int64_t base = 0;
  LocalShard shard;
  for (std::size_t p = 0; p < me; ++p) {
    if (s.stacked() && s.element_of[p] != s.element_of[me]) continue;  // another element
    if (local_shard(s.parts[p], index, shard)) base += placed_shape(s, p, shard.shape)[s.dim];
  }
  return base;
}

int64_t LayoutCore::stack_index(int32_t storage, int32_t tensor, int64_t index) const {
  const StorageEntry& s = storages_[storage];
  const std::size_t me = part_pos(s, tensor);
  int64_t count = 0;
  int64_t counted = -1;  // the last element counted (each element once)
  for (std::size_t p = 0; p < me; ++p) {
    const int32_t element = s.element_of[p];
    if (element == s.element_of[me]) break;
    if (element != counted && holds_index(s.parts[p], index)) {
      ++count;
      counted = element;
    }
  }
  return count;
}

Placing LayoutCore::placing(int32_t tensor, int64_t index) const {
  const TensorEntry& t = tensors_[tensor];
  const StorageEntry& s = storages_[t.storage];
  Placing out;
  out.transposed = s.is_transposed(part_pos(s, tensor));
  out.stacked = s.stacked();
  out.dim = static_cast<std::size_t>(s.dim);
  out.base = s.block_sizes.empty() && !t.shape.empty() ? part_base(t.storage, tensor, index) : 0;
  out.stack = out.stacked ? stack_index(t.storage, tensor, index) : 0;
  return out;
}

void LayoutCore::boxes_at(int32_t tensor, int64_t index, const LocalShard& shard,
                          std::vector<BoxRecord>& out) const {
  const TensorEntry& t = tensors_[tensor];
  const StorageEntry& s = storages_[t.storage];
  const std::size_t ndim = t.shape.size();
  const std::size_t dim = static_cast<std::size_t>(s.dim);
  for (std::size_t d = 0; d < ndim; ++d) {
    if (shard.runs[d].empty()) return;  // an empty shard holds no box
  }

  const bool interleaved = !s.block_sizes.empty();
  const Interleave il = interleaved ? interleave_of(s, tensor) : Interleave{};
  const Placing place = interleaved ? Placing{} : placing(tensor, index);

  // Cartesian product of the runs of every dim (odometer over run indices).
  std::vector<std::size_t> pick(ndim, 0);
  while (true) {
    BoxRecord box;
    box.offsets.resize(ndim);
    box.sizes.resize(ndim);
    box.storage_offsets.resize(ndim);
    for (std::size_t d = 0; d < ndim; ++d) {
      const Run& run = shard.runs[d][pick[d]];
      box.offsets[d] = run.global_start;
      box.sizes[d] = run.length;
      box.storage_offsets[d] = run.local_start;
    }
    box.storage_sizes = box.sizes;
    if (ndim == 0 || !interleaved) {  // a scalar has no dim to place along, at most a stack index
      place.offsets(box.storage_offsets);
      place.sizes(box.storage_sizes);
      out.push_back(std::move(box));
    } else {
      // Cut the box where the part's blocks end; each piece lands in its own group.
      const int64_t local_start = box.storage_offsets[dim];
      const int64_t local_stop = local_start + box.sizes[dim];
      int64_t pos = local_start;
      while (pos < local_stop) {
        const int64_t group = pos / il.block;
        const int64_t stop = std::min(local_stop, (group + 1) * il.block);
        BoxRecord piece = box;
        piece.offsets[dim] = box.offsets[dim] + (pos - local_start);
        piece.sizes[dim] = stop - pos;
        piece.storage_offsets[dim] = group * il.group_stride + il.prefix + (pos - group * il.block);
        piece.storage_sizes = piece.sizes;
        out.push_back(std::move(piece));
        pos = stop;
      }
    }
    std::size_t d = ndim;
    while (d > 0) {
      --d;
      if (++pick[d] < shard.runs[d].size()) break;
      pick[d] = 0;
      if (d == 0) return;
    }
    if (ndim == 0) return;
  }
}

void LayoutCore::boxes(int32_t tensor, int64_t rank, std::vector<BoxRecord>& out) const {
  out.clear();
  const int64_t index = mesh_index(rank);
  LocalShard shard;
  if (index < 0 || !local_shard(tensor, index, shard)) return;
  boxes_at(tensor, index, shard, out);
}

bool LayoutCore::locate(int32_t tensor, int64_t rank, const int64_t* offsets,
                        std::vector<int64_t>& storage_offsets) const {
  const int64_t index = mesh_index(rank);
  LocalShard shard;
  if (index < 0 || !local_shard(tensor, index, shard)) return false;
  const std::size_t ndim = shard.runs.size();
  storage_offsets.assign(ndim, 0);
  for (std::size_t d = 0; d < ndim; ++d) {
    bool found = false;
    for (const Run& run : shard.runs[d]) {
      if (offsets[d] >= run.global_start && offsets[d] < run.global_start + run.length) {
        storage_offsets[d] = run.local_start + (offsets[d] - run.global_start);
        found = true;
        break;
      }
    }
    if (!found) return false;
  }
  const TensorEntry& t = tensors_[tensor];
  const StorageEntry& s = storages_[t.storage];
  if (ndim == 0 || s.block_sizes.empty()) {  // a scalar sits at its stack index, or at the start
    placing(tensor, index).offsets(storage_offsets);
    return true;
  }
  const std::size_t dim = static_cast<std::size_t>(s.dim);
  const Interleave il = interleave_of(s, tensor);
  const int64_t local = storage_offsets[dim];
  storage_offsets[dim] = (local / il.block) * il.group_stride + il.prefix + local % il.block;
  return true;
}

bool LayoutCore::storage_shape(int32_t storage, int64_t rank, std::vector<int64_t>& shape) const {
  const int64_t index = mesh_index(rank);
  if (index < 0) return false;
  const StorageEntry& s = storages_[storage];
  LocalShard shard;
  bool any = false;
  int64_t elements = 0;
  int64_t first = -1, last = -1;  // the first element held (it gives the shape), the last counted
  for (std::size_t p = 0; p < s.parts.size(); ++p) {
    if (!local_shard(s.parts[p], index, shard)) continue;
    const int64_t element = s.stacked() ? s.element_of[p] : 0;
    if (element != last) {
      ++elements;
      last = element;
    }
    std::vector<int64_t> placed = placed_shape(s, p, shard.shape);
    if (!any) {
      shape = std::move(placed);
      first = element;
      any = true;
    } else if (element == first && !shape.empty()) {
      shape[s.dim] += placed[s.dim];
    }
  }
  if (any && s.stacked()) shape.insert(shape.begin(), elements);
  return any;
}

// A stacked storage on one rank: each element's parts fit beside each other and are held
// together, every element held has the same shape, and the stack matches a declared shape.
void LayoutCore::validate_stacked(int32_t storage, int64_t index, std::vector<Problem>& problems) const {
  const StorageEntry& s = storages_[storage];
  const int64_t rank = ranks_[index];
  const std::size_t dim = static_cast<std::size_t>(s.dim);
  LocalShard shard;
  std::vector<int64_t> first_shape;
  int64_t elements = 0;
  std::size_t p = 0;
  while (p < s.parts.size()) {
    std::size_t end = p;
    while (end < s.parts.size() && s.element_of[end] == s.element_of[p]) ++end;
    std::vector<int64_t> shape;
    std::size_t held = 0;
    for (std::size_t q = p; q < end; ++q) {
      if (!local_shard(s.parts[q], index, shard)) continue;
      std::vector<int64_t> placed = placed_shape(s, q, shard.shape);
      if (held++ == 0) {
        shape = std::move(placed);
        continue;
      }
      bool same = placed.size() == shape.size() && dim < shape.size();
      for (std::size_t d = 0; same && d < shape.size(); ++d) same = d == dim || shape[d] == placed[d];
      if (!same) {
        problems.push_back({"storage-shape", storage, rank,
                            "part " + std::to_string(q) + " has local shape " + shape_str(placed) +
                                ", which does not fit beside the earlier parts of its element " +
                                shape_str(shape) + " along dim " + std::to_string(dim)});
        return;
      }
      shape[dim] += placed[dim];
    }
    if (held > 0 && held != end - p) {
      problems.push_back({"storage-element", storage, rank,
                          "holds " + std::to_string(held) + " of the " + std::to_string(end - p) +
                              " parts of element " + std::to_string(elements) +
                              " of the stack; the parts of one element must live on the same ranks"});
      return;
    }
    if (held > 0) {
      if (elements == 0) {
        first_shape = shape;
      } else if (shape != first_shape) {
        problems.push_back({"storage-shape", storage, rank,
                            "element " + std::to_string(elements) + " of the stack has local shape " +
                                shape_str(shape) + ", the first has " + shape_str(first_shape) +
                                "; stacked elements must have one shape"});
        return;
      }
      ++elements;
    }
    p = end;
  }
  if (elements > 0 && !s.declared_shape.empty()) {
    first_shape.insert(first_shape.begin(), elements);
    if (first_shape != s.declared_shape) {
      problems.push_back({"storage-declared", storage, rank,
                          "the stacked parts make " + shape_str(first_shape) + ", the storage is declared " +
                              shape_str(s.declared_shape)});
    }
  }
}

std::vector<Problem> LayoutCore::validate(std::size_t max_problems) const {
  std::vector<Problem> problems;
  LocalShard shard;
  for (std::size_t si = 0; si < storages_.size() && problems.size() < max_problems; ++si) {
    const StorageEntry& s = storages_[si];
    const auto sid = static_cast<int32_t>(si);
    for (std::size_t index = 0; index < ranks_.size(); ++index) {
      if (s.stacked()) {
        validate_stacked(sid, static_cast<int64_t>(index), problems);
        if (problems.size() >= max_problems) break;
        continue;
      }
      const int64_t rank = ranks_[index];
      std::vector<int64_t> shape;
      int64_t groups = -1;
      std::size_t held = 0;
      bool bad = false;
      for (std::size_t p = 0; p < s.parts.size() && !bad; ++p) {
        const int32_t part = s.parts[p];
        if (!local_shard(part, static_cast<int64_t>(index), shard)) continue;
        shard.shape = placed_shape(s, p, shard.shape);
        ++held;
        if (static_cast<std::size_t>(s.dim) >= shard.shape.size() && !(shard.shape.empty() && s.parts.size() == 1)) {
          problems.push_back({"storage-shape", sid, rank,
                              "part " + std::to_string(p) + " has " +
                                  std::to_string(shard.shape.size()) +
                                  " dims, fewer than the storage dim " + std::to_string(s.dim)});
          bad = true;
          break;
        }
        if (held == 1) {
          shape = shard.shape;
          if (shape.empty()) continue;  // a scalar storage: nothing to add up
        } else {
          bool same = shard.shape.size() == shape.size();
          for (std::size_t d = 0; same && d < shape.size(); ++d) {
            same = d == static_cast<std::size_t>(s.dim) || shape[d] == shard.shape[d];
          }
          if (!same) {
            problems.push_back({"storage-shape", sid, rank,
                                "part " + std::to_string(p) + " has local shape " +
                                    shape_str(shard.shape) +
                                    ", which does not fit beside the earlier parts " +
                                    shape_str(shape) + " along dim " + std::to_string(s.dim)});
            bad = true;
            break;
          }
          shape[s.dim] += shard.shape[s.dim];
        }
        if (!s.block_sizes.empty()) {
          const int64_t block = s.block_sizes[p];
          const int64_t length = shard.shape[s.dim];
          if (block < 1 || length % block != 0) {
            problems.push_back({"storage-blocks", sid, rank,
                                "part " + std::to_string(p) + " has " + std::to_string(length) +
                                    " local elements along dim " + std::to_string(s.dim) +
                                    ", not a multiple of its block size " +
                                    std::to_string(block)});
            bad = true;
            break;
          }
          const int64_t part_groups = length / block;
          if (groups >= 0 && part_groups != groups) {
            problems.push_back({"storage-blocks", sid, rank,
                                "part " + std::to_string(p) + " has " +
                                    std::to_string(part_groups) +
                                    " blocks, the earlier parts have " + std::to_string(groups)});
            bad = true;
            break;
          }
          groups = part_groups;
        }
      }
      if (bad) {
        if (problems.size() >= max_problems) break;
        continue;
      }
      if (held > 0 && held != s.parts.size() && !s.block_sizes.empty()) {
        problems.push_back({"storage-rank", sid, rank,
                            "holds " + std::to_string(held) + " of the " +
                                std::to_string(s.parts.size()) +
                                " interleaved parts; interleaved parts must live on the same ranks"});
      } else if (held > 0 && !s.declared_shape.empty() && shape != s.declared_shape) {
        problems.push_back({"storage-declared", sid, rank,
                            "parts add up to " + shape_str(shape) + ", the storage is declared " +
                                shape_str(s.declared_shape)});
      }
      if (problems.size() >= max_problems) break;
    }
  }
  return problems;
}

std::vector<RankSummary> LayoutCore::summarize() const {
  std::vector<RankSummary> summary(ranks_.size());
  for (std::size_t i = 0; i < ranks_.size(); ++i) summary[i].rank = ranks_[i];
  LocalShard shard;
  std::vector<BoxRecord> found;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const auto tid = static_cast<int32_t>(t);
    for (std::size_t index = 0; index < ranks_.size(); ++index) {
      if (!local_shard(tid, static_cast<int64_t>(index), shard)) continue;
      RankSummary& row = summary[index];
      row.tensors += 1;
      if (storages_[tensors_[t].storage].block_sizes.empty()) {
        // Without interleaving the boxes are exactly the product of the runs of each dim.
        int64_t count = 1, elements = 1;
        for (const std::vector<Run>& runs : shard.runs) {
          int64_t length = 0;
          for (const Run& run : runs) length += run.length;
          count *= static_cast<int64_t>(runs.size());
          elements *= length;
        }
        row.boxes += count;
        row.elements += elements;
        row.bytes += elements * tensors_[t].itemsize;
        continue;
      }
      found.clear();
      boxes_at(tid, static_cast<int64_t>(index), shard, found);
      for (const BoxRecord& box : found) {
        int64_t elements = 1;
        for (int64_t s : box.sizes) elements *= s;
        row.boxes += 1;
        row.elements += elements;
        row.bytes += elements * tensors_[t].itemsize;
      }
    }
  }
  return summary;
}

}  // namespace layoutlang
