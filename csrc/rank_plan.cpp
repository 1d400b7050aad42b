#include "rank_plan.hpp"

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>

#include "plan_geometry.hpp"
#include "replica_groups.hpp"

namespace layoutlang {
namespace {

// A hash both ends of a move compute alike (splitmix64's finalizer over a running value).
uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The index of the replica group of `tensor` holding `rank`, -1 when none: one table per
// set of groups (tensors sharing spec, shape and sub-mesh share it), made on first use.
class GroupIndex {
 public:
  GroupIndex(const LayoutCore& layout, GroupCache& cache) : layout_(layout), cache_(cache) {}
  int64_t of(int32_t tensor, int64_t rank) {
    const int64_t index = layout_.mesh_index(rank);
    if (index < 0) return -1;
    return table(tensor)[static_cast<std::size_t>(index)];
  }
  const std::vector<int32_t>& table(int32_t tensor) {
    const int32_t key = cache_.key_id(tensor);
    if (static_cast<std::size_t>(key) >= tables_.size()) tables_.resize(static_cast<std::size_t>(key) + 1);
    std::vector<int32_t>& t = tables_[static_cast<std::size_t>(key)];
    if (t.empty()) {
      t.assign(layout_.ranks().size(), -1);
      const auto& groups = cache_.groups(tensor);
      for (std::size_t g = 0; g < groups.size(); ++g) {
        for (int64_t r : groups[g].ranks) t[static_cast<std::size_t>(layout_.mesh_index(r))] = static_cast<int32_t>(g);
      }
    }
    return t;
  }

 private:
  const LayoutCore& layout_;
  GroupCache& cache_;
  std::vector<std::vector<int32_t>> tables_;
};

// The group holding `rank` by binary search of each group's ranks (for one rank, cheaper
// than a table over the mesh), memoized per set of groups.
int64_t find_group(GroupCache& cache, int32_t tensor, int64_t rank, std::unordered_map<int32_t, int64_t>& memo) {
  const int32_t key = cache.key_id(tensor);
  auto found = memo.find(key);
  if (found != memo.end()) return found->second;
  const auto& groups = cache.groups(tensor);
  int64_t at = -1;
  for (std::size_t g = 0; g < groups.size() && at < 0; ++g) {
    if (std::binary_search(groups[g].ranks.begin(), groups[g].ranks.end(), rank)) at = static_cast<int64_t>(g);
  }
  memo.emplace(key, at);
  return at;
}

void check_options(const LayoutCore& src, const LayoutCore& dst, const std::vector<uint8_t>& policies,
                   const PlanOptions& options) {
  if (options.domain_size < 1) throw CoreValueError("argument", "domain size must be at least 1");
  if (options.bucket_bytes < 1) throw CoreValueError("argument", "bucket size must be at least 1 byte");
  if (src.num_tensors() != dst.num_tensors() || policies.size() != src.num_tensors()) {
    throw CoreValueError("mismatch", "source and destination layouts cover different tensors");
  }
  for (std::size_t t = 0; t < src.num_tensors(); ++t) {
    const auto tid = static_cast<int32_t>(t);
    if (policies[t] != kReshard) {
      throw CoreValueError("argument",
                           "pairwise (per-rank) plans move exact overlaps: its policy must be reshard "
                           "(use the whole-fleet plan for broadcast)",
                           tid);
    }
    if (src.tensor(tid).shape != dst.tensor(tid).shape) {
      throw CoreValueError("mismatch", "its shape differs between the two layouts", tid);
    }
    if (src.tensor(tid).itemsize > options.bucket_bytes) {
      throw CoreValueError("argument", "the bucket budget of " + std::to_string(options.bucket_bytes) +
                                           " bytes is smaller than one element (" +
                                           std::to_string(src.tensor(tid).itemsize) + " bytes)");
    }
  }
}

class PairwiseBuilder {
 public:
  PairwiseBuilder(const LayoutCore& src, const LayoutCore& dst, const std::vector<uint8_t>& policies,
                  const PlanOptions& options, int64_t rank)
      : src_(src), dst_(dst), policies_(policies), options_(options), rank_(rank), src_groups_(src),
        dst_groups_(dst), src_index_(src, src_groups_) {
    cap_ = std::max<int64_t>(1, options_.bucket_bytes / 4);
  }

  PlanData build() {
    check_options(src_, dst_, policies_, options_);
    for (std::size_t t = 0; t < src_.num_tensors(); ++t) plan_tensor(static_cast<int32_t>(t));
    int32_t top = -1;
    for (int32_t b : plan_.move_bucket) top = std::max(top, b);
    plan_.num_buckets = top + 1;
    return std::move(plan_);
  }

 private:
  bool whole() const { return rank_ < 0; }
  int64_t domain(int64_t rank) const { return rank / options_.domain_size; }

  void plan_tensor(int32_t tensor) {
    const std::vector<HoldingGroup>& sgroups = src_groups_.groups(tensor);
    const std::vector<HoldingGroup>& dgroups = dst_groups_.groups(tensor);
    check_coverage(tensor, sgroups, dgroups);
    int64_t dgr = -1, sgr = -1;
    if (!whole()) {
      dgr = find_group(dst_groups_, tensor, rank_, dst_memo_);
      sgr = find_group(src_groups_, tensor, rank_, src_memo_);
      if (dgr < 0 && sgr < 0) return;  // this rank neither holds nor needs any of it
    }
    add_lower_bound(tensor, dgroups, dgr);
    for (std::size_t g = 0; g < dgroups.size(); ++g) {
      if (whole() || static_cast<int64_t>(g) == dgr) {
        for (const HoldingGroup& sg : sgroups) deliver_pair(tensor, dgroups[g], sg);
      } else if (sgr >= 0) {
        deliver_pair(tensor, dgroups[g], sgroups[static_cast<std::size_t>(sgr)]);
      }
    }
  }

  // The source's replica groups hold every element (checked once per set of groups).
  void check_coverage(int32_t tensor, const std::vector<HoldingGroup>& sgroups,
                      const std::vector<HoldingGroup>& dgroups) {
    if (dgroups.empty()) return;
    const int32_t key = src_groups_.key_id(tensor);
    if (static_cast<std::size_t>(key) < covered_.size() && covered_[static_cast<std::size_t>(key)]) return;
    int64_t numel = 1, covered = 0;
    for (int64_t s : src_.tensor(tensor).shape) numel *= s;
    for (const HoldingGroup& g : sgroups) covered += holding_volume(g);
    if (covered != numel) {
      throw CoreValueError("coverage", "the source layout holds " + std::to_string(covered) + " of its " +
                                           std::to_string(numel) + " elements",
                           tensor);
    }
    if (static_cast<std::size_t>(key) >= covered_.size()) covered_.resize(static_cast<std::size_t>(key) + 1, 0);
    covered_[static_cast<std::size_t>(key)] = 1;
  }

  // What the ranks this plan fills must receive at least: what each holds in the
  // destination minus what it holds of it in the source.
  void add_lower_bound(int32_t tensor, const std::vector<HoldingGroup>& dgroups, int64_t dgr) {
    const int64_t itemsize = src_.tensor(tensor).itemsize;
    const auto& sgroups = src_groups_.groups(tensor);
    auto bound = [&](const HoldingGroup& dg, int64_t rank) {
      const int64_t held = itemsize * holding_volume(dg);
      const int64_t gi = src_index_.of(tensor, rank);
      if (gi < 0) return held;
      const HoldingGroup& sg = sgroups[static_cast<std::size_t>(gi)];
      int64_t overlap = itemsize;
      for (std::size_t d = 0; d < dg.runs.size(); ++d) {
        int64_t common = 0;
        for (const Run& a : sg.runs[d]) {
          for (const Run& b : dg.runs[d]) {
            const auto [lo, hi] =
                intersect(a.global_start, a.global_start + a.length, b.global_start, b.global_start + b.length);
            common += hi - lo;
          }
        }
        overlap *= common;
      }
      return held - std::min(held, overlap);
    };
    if (whole()) {
      for (const HoldingGroup& dg : dgroups)
        for (int64_t r : dg.ranks) plan_.lower_bound_bytes += bound(dg, r);
    } else if (dgr >= 0) {
      plan_.lower_bound_bytes += bound(dgroups[static_cast<std::size_t>(dgr)], rank_);
    }
  }

  // Every region of what `dg` needs that `sg` holds, delivered from sg's ranks.
  void deliver_pair(int32_t tensor, const HoldingGroup& dg, const HoldingGroup& sg) {
    const std::size_t ndim = dg.runs.size();
    std::vector<std::vector<Piece>> pieces(ndim);
    for (std::size_t d = 0; d < ndim; ++d) {
      meet_runs(dg.runs[d], sg.runs[d], pieces[d]);
      if (pieces[d].empty()) return;
    }
    cut_interleaved(tensor, pieces, &src_, &dst_);
    auto emit = [&](const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
      deliver(tensor, offsets, sizes, sg.ranks, dg.ranks);
    };
    for_each_slab_of_product(src_, dst_, options_.bucket_bytes, tensor, pieces, emit);
  }

  bool involved(int64_t s, int64_t d) const { return whole() || s == rank_ || d == rank_; }

  // One region held by `sources` to `needy` (both ascending): local copies where a needy
  // rank holds it, then per destination domain a domain move from a holder there to each
  // needy rank, or one network move from a holder to a landing rank, relayed to the rest.
  // The holder and the landing rank: by hash of (tensor, box, domain), never by load.
  void deliver(int32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
               const std::vector<int64_t>& sources, const std::vector<int64_t>& needy) {
    int32_t region = -1;
    const int64_t itemsize = src_.tensor(tensor).itemsize;
    int64_t bytes = itemsize;
    for (int64_t s : sizes) bytes *= s;
    auto add = [&](int64_t s, int64_t d, uint8_t kind, uint8_t stage, uint8_t src_space) {
      if (region < 0) region = add_region(tensor, offsets, sizes, bytes);
      add_move(region, bytes, s, d, kind, stage, src_space);
    };
    auto holds = [&](int64_t r) { return std::binary_search(sources.begin(), sources.end(), r); };
    const bool self_source = !whole() && holds(rank_);
    const bool self_needy = !whole() && std::binary_search(needy.begin(), needy.end(), rank_);
    // The needy ranks to visit: all of them, unless this rank only receives (its domain's).
    auto first = needy.begin(), last = needy.end();
    if (!whole() && !self_source) {
      first = std::lower_bound(needy.begin(), needy.end(), domain(rank_) * options_.domain_size);
      last = std::lower_bound(first, needy.end(), (domain(rank_) + 1) * options_.domain_size);
    }
    if (whole()) {
      for (int64_t r : needy)
        if (holds(r)) add(r, r, kLocal, 0, kSource);
    } else if (self_source && self_needy) {
      add(rank_, rank_, kLocal, 0, kSource);
    }
    uint64_t h0 = mix(0x6c61796f75746c61ULL, static_cast<uint64_t>(tensor));
    for (std::size_t d = 0; d < offsets.size(); ++d) h0 = mix(mix(h0, static_cast<uint64_t>(offsets[d])), static_cast<uint64_t>(sizes[d]));
    auto it = first;
    while (it != last) {
      const int64_t dom = domain(*it);
      auto end = std::lower_bound(it, last, (dom + 1) * options_.domain_size);
      remote_.clear();
      for (auto r = it; r != end; ++r)
        if (!holds(*r)) remote_.push_back(*r);
      it = end;
      if (remote_.empty()) continue;
      const uint64_t h = mix(h0, static_cast<uint64_t>(dom));
      const auto near_begin = std::lower_bound(sources.begin(), sources.end(), dom * options_.domain_size);
      const auto near_end = std::lower_bound(near_begin, sources.end(), (dom + 1) * options_.domain_size);
      const auto near = static_cast<uint64_t>(near_end - near_begin);
      if (near > 0) {
        for (std::size_t i = 0; i < remote_.size(); ++i) {
          const int64_t s = *(near_begin + static_cast<std::ptrdiff_t>((h + i) % near));
          if (involved(s, remote_[i])) add(s, remote_[i], kDomain, 0, kSource);
        }
        continue;
      }
      const int64_t s = sources[static_cast<std::size_t>(h % sources.size())];
      const std::size_t li = static_cast<std::size_t>((h >> 32) % remote_.size());
      const int64_t landing = remote_[li];
      if (involved(s, landing)) add(s, landing, kNetwork, 0, kSource);
      if (!whole() && !self_needy) continue;  // relays run between needy ranks only
      for (std::size_t i = 0; i < remote_.size(); ++i) {
        if (i != li && involved(landing, remote_[i])) add(landing, remote_[i], kDomain, 1, kDestination);
      }
    }
  }

  int32_t add_region(int32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                     int64_t bytes) {
    return append_region(plan_, tensor, offsets, sizes, bytes);
  }

  // The move's bucket is its chunk among its pair's moves of its stage (pair-local).
  void add_move(int32_t region, int64_t bytes, int64_t s, int64_t d, uint8_t kind, uint8_t stage,
                uint8_t src_space) {
    int32_t bucket = 0;
    if (kind != kLocal) {
      const uint64_t key = (static_cast<uint64_t>(s) << 33) | (static_cast<uint64_t>(d) << 2) | stage;
      auto& [chunk, filled] = chunks_[key];
      if (filled > 0 && filled + bytes > cap_) {
        ++chunk;
        filled = 0;
      }
      filled += bytes;
      bucket = chunk;
    }
    append_move(plan_, region, s, d, kind, stage, src_space, kDestination, 0);
    plan_.move_bucket.push_back(bucket);
  }

  const LayoutCore& src_;
  const LayoutCore& dst_;
  const std::vector<uint8_t>& policies_;
  PlanOptions options_;
  int64_t rank_;
  int64_t cap_;
  GroupCache src_groups_, dst_groups_;
  GroupIndex src_index_;
  std::unordered_map<int32_t, int64_t> src_memo_, dst_memo_;
  std::vector<char> covered_;
  std::vector<int64_t> remote_;
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> chunks_;  // pair and stage -> chunk, bytes
  PlanData plan_;
};

// Checks a pairwise plan tensor by tensor (the moves of one tensor are contiguous).
class PairwiseValidator {
 public:
  PairwiseValidator(const PlanData& plan, const LayoutCore& src, const LayoutCore& dst, const PlanOptions& options,
                    int64_t rank, std::size_t max_problems)
      : plan_(plan), src_(src), dst_(dst), options_(options), rank_(rank), max_(max_problems), src_groups_(src),
        dst_groups_(dst), src_index_(src, src_groups_), dst_index_(dst, dst_groups_), regions_(plan, src) {}

  std::vector<std::string> run() {
    const std::size_t n = plan_.move_region.size();
    for (std::size_t c : {plan_.move_src.size(), plan_.move_dst.size(), plan_.move_bucket.size(),
                          plan_.move_kind.size(), plan_.move_stage.size(), plan_.move_src_space.size(),
                          plan_.move_dst_space.size(), plan_.move_source.size()}) {
      if (c != n) return {"move columns have different lengths"};
    }
    if (!check_regions()) return problems_;
    std::vector<char> seen(src_.num_tensors(), 0);
    std::size_t begin = 0;
    while (begin < n && problems_.size() < max_) {
      const int32_t tensor = plan_.region_tensor[static_cast<std::size_t>(plan_.move_region[begin])];
      std::size_t end = begin;
      while (end < n && plan_.region_tensor[static_cast<std::size_t>(plan_.move_region[end])] == tensor) ++end;
      if (seen[static_cast<std::size_t>(tensor)]) {
        problem(begin, "moves of one tensor are not contiguous");
        return problems_;
      }
      seen[static_cast<std::size_t>(tensor)] = 1;
      check_tensor(tensor, begin, end);
      begin = end;
    }
    for (std::size_t t = 0; t < seen.size() && problems_.size() < max_; ++t) {
      if (!seen[t]) check_cover(static_cast<int32_t>(t), {});
    }
    for (const auto& [key, bytes] : messages_) {
      if (bytes > options_.bucket_bytes && problems_.size() < max_) {
        const auto& [bucket, stage, s, d] = key;
        problems_.push_back("the message from rank " + std::to_string(s) + " to rank " + std::to_string(d) +
                            " in stage " + std::to_string(stage) + ", bucket " + std::to_string(bucket) + " carries " +
                            std::to_string(bytes) + " bytes, more than the budget of " +
                            std::to_string(options_.bucket_bytes));
      }
    }
    return problems_;
  }

 private:
  bool check_regions() {
    if (!check_region_columns(plan_, src_, problems_, max_, true)) return false;
    const std::size_t regions = plan_.region_tensor.size();
    for (std::size_t i = 0; i < plan_.move_region.size(); ++i) {
      if (plan_.move_region[i] < 0 || static_cast<std::size_t>(plan_.move_region[i]) >= regions) {
        problem(i, "refers to a region that does not exist");
        return false;
      }
      if (plan_.move_kind[i] > kNetwork || plan_.move_src_space[i] > kDestination ||
          plan_.move_dst_space[i] != kDestination || plan_.move_stage[i] > 1 || plan_.move_bucket[i] < 0 ||
          plan_.move_source[i] != 0) {
        problem(i, "has a kind, space, stage, bucket or source a pairwise plan does not have");
      }
    }
    return problems_.empty();
  }

  void problem(std::size_t move, const std::string& what) {
    if (problems_.size() < max_) problems_.push_back("move " + std::to_string(move) + ": " + what);
  }

  void check_tensor(int32_t tensor, std::size_t begin, std::size_t end) {
    const auto& sgroups = src_groups_.groups(tensor);
    const auto& dgroups = dst_groups_.groups(tensor);
    const std::vector<int64_t>& shape = src_.tensor(tensor).shape;
    std::map<int64_t, std::vector<std::size_t>> writes;  // destination rank -> moves writing there
    for (std::size_t i = begin; i < end && problems_.size() < max_; ++i) {
      const int32_t region = plan_.move_region[i];
      const int64_t s = plan_.move_src[i], d = plan_.move_dst[i];
      if (rank_ >= 0 && s != rank_ && d != rank_) {
        problem(i, "neither sends to nor receives on rank " + std::to_string(rank_) + ", whose plan this is");
        continue;
      }
      for (std::size_t k = 0; k < shape.size(); ++k) {
        const int64_t lo = regions_.lo(region, k), size = regions_.size(region, k);
        if (lo < 0 || size < 1 || lo + size > shape[k]) {
          problem(i, "region lies outside its tensor");
        }
      }
      const uint8_t expected =
          s == d ? kLocal : (s / options_.domain_size == d / options_.domain_size ? kDomain : kNetwork);
      if (plan_.move_kind[i] != expected) problem(i, "kind does not match the ranks' domains");
      const int64_t sg = src_index_.of(tensor, s);
      const int64_t sdg = dst_index_.of(tensor, s);
      const int64_t ddg = dst_index_.of(tensor, d);
      if (plan_.move_src_space[i] == kSource) {
        if (plan_.move_stage[i] != 0) problem(i, "reads a source storage after stage 0");
        if (sg < 0 || !regions_.inside(region, sgroups[static_cast<std::size_t>(sg)])) {
          problem(i, "reads what rank " + std::to_string(s) + " does not hold in the source layout");
        } else if (!regions_.within_one_block(region, sgroups[static_cast<std::size_t>(sg)], src_)) {
          problem(i, "spans two blocks of an interleaved storage");
        }
      } else if (sdg < 0 || !regions_.inside(region, dgroups[static_cast<std::size_t>(sdg)])) {
        problem(i, "relays what rank " + std::to_string(s) + " does not hold in the destination layout");
      }
      if (ddg < 0 || !regions_.inside(region, dgroups[static_cast<std::size_t>(ddg)])) {
        problem(i, "writes what rank " + std::to_string(d) + " does not hold in the destination layout");
      } else if (!regions_.within_one_block(region, dgroups[static_cast<std::size_t>(ddg)], dst_)) {
        problem(i, "spans two blocks of an interleaved storage");
      }
      writes[d].push_back(i);
      if (plan_.move_kind[i] != kLocal) {
        messages_[{plan_.move_bucket[i], plan_.move_stage[i], s, d}] += plan_.region_bytes[static_cast<std::size_t>(region)];
      }
    }
    // A relay reads what an earlier stage wrote into its sending rank (checked where the
    // plan holds those writes: the whole fleet's, or the plan of the sending rank).
    for (std::size_t i = begin; i < end && problems_.size() < max_; ++i) {
      const int64_t s = plan_.move_src[i];
      if (plan_.move_src_space[i] != kDestination || (rank_ >= 0 && s != rank_)) continue;
      int64_t covered = 0;
      auto found = writes.find(s);
      if (found != writes.end()) {
        for (std::size_t w : found->second) {
          if (plan_.move_stage[w] < plan_.move_stage[i]) {
            covered += regions_.overlap(plan_.move_region[w], plan_.move_region[i]);
          }
        }
      }
      if (covered != regions_.volume(plan_.move_region[i])) problem(i, "relays data that no earlier stage delivered");
    }
    for (const auto& [rank, list] : writes) {
      if (rank_ >= 0 && rank != rank_) continue;
      for (std::size_t a = 0; a < list.size(); ++a) {
        for (std::size_t b = a + 1; b < list.size(); ++b) {
          if (regions_.overlap(plan_.move_region[list[a]], plan_.move_region[list[b]]) > 0) {
            problem(list[b], "writes bytes that move " + std::to_string(list[a]) + " also writes");
          }
        }
      }
    }
    check_cover(tensor, writes);
  }

  // Every rank the plan fills (the plan's rank, or all) receives exactly what it holds.
  void check_cover(int32_t tensor, const std::map<int64_t, std::vector<std::size_t>>& writes) {
    const auto& dgroups = dst_groups_.groups(tensor);
    auto check = [&](const HoldingGroup& g, int64_t rank) {
      const int64_t held = holding_volume(g);
      auto found = writes.find(rank);
      const int64_t written = found != writes.end() ? regions_.written(found->second) : 0;
      if (written != held && problems_.size() < max_) problems_.push_back(cover_problem(tensor, rank, written, held));
    };
    if (rank_ < 0) {
      for (const HoldingGroup& g : dgroups)
        for (int64_t r : g.ranks) check(g, r);
    } else {
      const int64_t g = dst_index_.of(tensor, rank_);
      if (g >= 0) check(dgroups[static_cast<std::size_t>(g)], rank_);
    }
  }

  const PlanData& plan_;
  const LayoutCore& src_;
  const LayoutCore& dst_;
  PlanOptions options_;
  int64_t rank_;
  std::size_t max_;
  GroupCache src_groups_, dst_groups_;
  GroupIndex src_index_, dst_index_;
  PlanRegions regions_;
  std::map<std::tuple<int32_t, uint8_t, int64_t, int64_t>, int64_t> messages_;
  std::vector<std::string> problems_;
};

}  // namespace

PlanData build_pairwise_plan(const LayoutCore& source, const LayoutCore& destination,
                             const std::vector<uint8_t>& policies, const PlanOptions& options, int64_t rank) {
  return PairwiseBuilder(source, destination, policies, options, rank).build();
}

std::vector<std::string> validate_pairwise_plan(const PlanData& plan, const LayoutCore& source,
                                                const LayoutCore& destination, const PlanOptions& options,
                                                int64_t rank, std::size_t max_problems) {
  return PairwiseValidator(plan, source, destination, options, rank, max_problems).run();
}

}  // namespace layoutlang
