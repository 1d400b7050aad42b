#include "planner.hpp"

#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "plan_geometry.hpp"

namespace layoutlang {
namespace {

// Marks the lost ranks: lost[rank] != 0. Sized to cover every rank of every layout.
std::vector<char> lost_mask(const std::vector<const LayoutCore*>& sources, const LayoutCore& dst,
                            const std::vector<int64_t>& lost) {
  int64_t max_rank = 0;
  for (const LayoutCore* src : sources) {
    for (int64_t r : src->ranks()) max_rank = std::max(max_rank, r);
  }
  for (int64_t r : dst.ranks()) max_rank = std::max(max_rank, r);
  std::vector<char> mask(static_cast<std::size_t>(max_rank + 1), 0);
  for (int64_t r : lost) {
    if (r >= 0 && r <= max_rank) mask[static_cast<std::size_t>(r)] = 1;
  }
  return mask;
}

// Marks the destination ranks a plan fills: every rank of `dst` without `fill`, else the
// ranks listed (each must be in `dst`). Sized like lost_mask.
std::vector<char> fill_mask(std::size_t size, const LayoutCore& dst, const std::optional<std::vector<int64_t>>& fill) {
  std::vector<char> mask(size, fill.has_value() ? 0 : 1);
  for (int64_t r : fill.value_or(std::vector<int64_t>{})) {
    if (dst.mesh_index(r) < 0) {
      throw CoreValueError("argument", "rank " + std::to_string(r) + " is to be filled but is not in the destination layout",
                           -1, r);
    }
    mask[static_cast<std::size_t>(r)] = 1;
  }
  return mask;
}

// The ranks of one node (a DGX H100's 8 GPUs): domains of at most this many ranks never land
// a region in scratch (see Builder::deliver).
constexpr int64_t kNodeRanks = 8;

class Builder {
 public:
  Builder(const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost, const LayoutCore& dst,
          const std::vector<uint8_t>& policies, const PlanOptions& options,
          const std::optional<std::vector<int64_t>>& fill = std::nullopt)
      : srcs_(sources), src_(*sources.at(0)), dst_(dst), policies_(policies), options_(options), dst_groups_(dst),
        lost_(lost_mask(sources, dst, lost)), fill_(fill_mask(lost_.size(), dst, fill)) {
    for (const LayoutCore* s : srcs_) src_groups_.emplace_back(*s);
    const auto n = lost_.size();
    net_send_.assign(n, 0);
    net_recv_.assign(n, 0);
    domain_send_.assign(n, 0);
    root_load_.assign(n, 0);
    src_group_of_rank_.assign(srcs_.size(), std::vector<int64_t>(n, -1));
    recovery_ = srcs_.size() > 1 || !lost.empty() || fill.has_value();
    // A few ranks to fill (a spare in a lost rank's place): looked up in each replica group
    // instead of scanning every group's ranks, so the plan's time follows the ranks it fills,
    // not the fleet.
    if (fill.has_value() && fill->size() * 8 <= dst_.ranks().size()) {
      fill_list_ = *fill;
      std::sort(fill_list_.begin(), fill_list_.end());
      fill_list_.erase(std::unique(fill_list_.begin(), fill_list_.end()), fill_list_.end());
      sparse_fill_ = true;
    }
    if (srcs_.size() > 255) throw CoreValueError("argument", "a plan reads from at most 255 source layouts");
    if (options_.domain_size < 1) throw CoreValueError("argument", "domain size must be at least 1");
    if (options_.bucket_bytes < 1) throw CoreValueError("argument", "bucket size must be at least 1 byte");
  }

  PlanData build() {
    for (const LayoutCore* src : srcs_) {
      if (src->num_tensors() != dst_.num_tensors() || policies_.size() != src->num_tensors()) {
        throw CoreValueError("mismatch", "source and destination layouts cover different tensors");
      }
    }
    for (int64_t r : dst_.ranks()) {
      if (lost_[static_cast<std::size_t>(r)]) {
        throw CoreValueError("lost", "rank " + std::to_string(r) + " is lost but belongs to the destination layout", -1, r);
      }
    }
    if (recovery_) {
      for (uint8_t p : policies_) {
        if (p != kReshard) {
          throw CoreValueError("argument", "recovery plans move exact overlaps: every tensor's policy must be reshard");
        }
      }
    }
    for (std::size_t t = 0; t < src_.num_tensors(); ++t) {
      const int64_t itemsize = src_.tensor(static_cast<int32_t>(t)).itemsize;
      if (itemsize > options_.bucket_bytes) {
        throw CoreValueError("argument", "the bucket budget of " + std::to_string(options_.bucket_bytes) +
                                             " bytes is smaller than one element (" + std::to_string(itemsize) +
                                             " bytes)");
      }
    }
    // Every destination rank of every tensor gets at least one move: reserve that much up
    // front, since growing columns of millions of moves costs more than planning them.
    std::size_t expected_moves = 0, expected_regions = 0, expected_dims = 0;
    for (std::size_t t = 0; t < src_.num_tensors(); ++t) {
      const auto tid = static_cast<int32_t>(t);
      for (const LayoutCore* src : srcs_) {
        if (src->tensor(tid).shape != dst_.tensor(tid).shape) {
          throw CoreValueError("mismatch", "its shape differs between the two layouts", tid);
        }
      }
      for (const HoldingGroup& g : dst_groups_.groups(tid)) {
        filled_among(g.ranks, needy_);
        expected_moves += needy_.size();
        expected_regions += 1;
      }
      expected_dims += src_.tensor(tid).shape.size() * dst_groups_.groups(tid).size();
    }
    reserve(expected_moves, expected_regions, expected_dims);
    for (std::size_t t = 0; t < src_.num_tensors(); ++t) plan_tensor(static_cast<int32_t>(t));
    assign_buckets();
    return std::move(plan_);
  }

 private:
  int64_t domain(int64_t rank) const { return rank / options_.domain_size; }

  void reserve(std::size_t moves, std::size_t regions, std::size_t dims) {
    for (auto* column : {&plan_.move_region, &plan_.move_src, &plan_.move_dst}) column->reserve(moves);
    for (auto* column :
         {&plan_.move_kind, &plan_.move_stage, &plan_.move_src_space, &plan_.move_dst_space, &plan_.move_source}) {
      column->reserve(moves);
    }
    plan_.region_tensor.reserve(regions);
    plan_.region_dims_start.reserve(regions);
    plan_.region_bytes.reserve(regions);
    plan_.region_offsets.reserve(dims);
    plan_.region_sizes.reserve(dims);
  }

  // ---------------------------------------------------------------- regions
  int32_t add_region(int32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
    int64_t bytes = src_.tensor(tensor).itemsize;
    for (int64_t s : sizes) bytes *= s;
    return append_region(plan_, tensor, offsets, sizes, bytes);
  }

  // Splits a box into slabs of at most bucket_bytes (a tensor larger than a bucket is cut,
  // never refused) and calls `emit(region id)` for each slab.
  template <class Emit>
  void slabs(int32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes, Emit emit) {
    auto region = [&](const std::vector<int64_t>& at, const std::vector<int64_t>& size) {
      emit(add_region(tensor, at, size));
    };
    for_each_slab(src_, dst_, options_.bucket_bytes, tensor, offsets, sizes, region);
  }

  // Per dim pieces of a group's own runs (for gather and extraction).
  static std::vector<std::vector<Piece>> own_pieces(const HoldingGroup& g) {
    std::vector<std::vector<Piece>> pieces(g.runs.size());
    for (std::size_t d = 0; d < g.runs.size(); ++d) {
      for (const Run& r : g.runs[d]) pieces[d].push_back(Piece{r.global_start, r.length, r.local_start, r.local_start});
    }
    return pieces;
  }

  // Every box of the product of per-dim pieces, cut into slabs: `emit(region id)` for each.
  template <class Emit>
  void product(int32_t tensor, const std::vector<std::vector<Piece>>& pieces, Emit emit) {
    auto region = [&](const std::vector<int64_t>& at, const std::vector<int64_t>& size) {
      emit(add_region(tensor, at, size));
    };
    for_each_slab_of_product(src_, dst_, options_.bucket_bytes, tensor, pieces, region);
  }

  void interleave_cuts(int32_t tensor, std::vector<std::vector<Piece>>& pieces, bool cut_src, bool cut_dst) {
    cut_interleaved(tensor, pieces, cut_src ? srcs_[source_] : nullptr, cut_dst ? &dst_ : nullptr);
  }

  // ------------------------------------------------------------------ moves
  void add_move(int32_t region, int64_t src, int64_t dst, uint8_t kind, uint8_t stage, uint8_t src_space,
                uint8_t dst_space) {
    append_move(plan_, region, src, dst, kind, stage, src_space, dst_space, source_);
  }

  static int64_t least_loaded(const std::vector<int64_t>& candidates, const std::vector<int64_t>& load) {
    int64_t best = candidates.front();
    for (int64_t r : candidates) {
      if (load[r] < load[best]) best = r;
    }
    return best;
  }

  // Delivers one region held by `sources` (ascending) to `needy` (ascending): a local copy
  // where the rank holds it already, a domain move from a source in the same domain, else
  // one network move per domain to the least loaded receiver there, relayed to the others.
  void deliver(int32_t region, const std::vector<int64_t>& sources, uint8_t src_space,
               const std::vector<int64_t>& needy, uint8_t dst_space, uint8_t stage) {
    const int64_t bytes = plan_.region_bytes[region];
    remote_.clear();
    for (int64_t rank : needy) {
      if (src_space == kSource && std::binary_search(sources.begin(), sources.end(), rank)) {
        add_move(region, rank, rank, kLocal, stage, src_space, dst_space);
      } else {
        remote_.push_back(rank);
      }
    }
    std::size_t begin = 0;
    std::size_t below = 0;  // sources[below:] lie in the current domain or after it (both ascending)
    while (begin < remote_.size()) {
      const int64_t dom = domain(remote_[begin]);
      std::size_t end = begin + 1;
      while (end < remote_.size() && domain(remote_[end]) == dom) ++end;
      while (below < sources.size() && domain(sources[below]) < dom) ++below;
      near_.clear();
      for (std::size_t k = below; k < sources.size() && domain(sources[k]) == dom; ++k) near_.push_back(sources[k]);
      if (!near_.empty()) {
        for (std::size_t i = begin; i < end; ++i) {
          const int64_t s = least_loaded(near_, domain_send_);
          domain_send_[s] += bytes;
          add_move(region, s, remote_[i], kDomain, stage, src_space, dst_space);
        }
      } else {
        build_domains();
        const int64_t s = least_loaded(sources, net_send_);
        int64_t landing = remote_[begin];
        for (std::size_t i = begin; i < end; ++i) {
          if (net_recv_[remote_[i]] < net_recv_[landing]) landing = remote_[i];
        }
        // Where the reshard has landed a whole region more on the holder than on another
        // rank of the domain, and the holder is ahead of the domain's mean by a region and
        // by 1/16, that rank receives the region into scratch and relays it to every holder:
        // a domain whose replicas are cut unevenly (GB200: 40 ranks of a 72-rank domain hold
        // 1 1/4 replicas) then spreads what enters it over all its NICs, as the lower bound
        // lets it, instead of over the only holders of each slice. A domain whose ranks need
        // the same share (a DGX H100 domain holding one TP8 replica) keeps landing on
        // holders: its loads only drift a region apart, and the relays a scratch landing
        // adds would cost staging for nothing. Only the reshard's own landings count (a
        // broadcast tensor lands whole on one rank per domain, and keeps its scratch on the
        // ranks that hold it); recovery plans land on holders as before. A landing in
        // scratch moves its region twice (in, then to the holder), so domains of at most a
        // node's kNodeRanks ranks, which hold whole replicas of the layouts engines use
        // there, keep plans that move every byte once (moved = lower bound, as the plan
        // tests check): the gain is a multi-node NVLink domain's.
        const bool reshard = src_space == kSource && dst_space == kDestination && !recovery_;
        const bool may_land_in_scratch = reshard && options_.domain_size > kNodeRanks;
        const int64_t spare = may_land_in_scratch ? least_loaded_bystander(dom, begin, end, reshard_recv_[landing] - bytes) : -1;
        bool scratch = spare >= 0 && reshard_recv_[spare] + bytes <= reshard_recv_[landing];
        if (scratch) {  // ahead of the domain's mean by a region and by 1/16
          const auto d = static_cast<std::size_t>(dom);
          const auto ranks = static_cast<double>(domain_start_[d + 1] - domain_start_[d]);
          const double ahead = static_cast<double>(reshard_recv_[landing]) * ranks;
          const double mean = static_cast<double>(domain_recv_[d]);  // times ranks
          scratch = ahead - mean >= static_cast<double>(bytes) * ranks && ahead * 16 > mean * 17;
        }
        if (scratch) landing = spare;
        const uint8_t relay_space = scratch ? kScratch : dst_space;
        net_send_[s] += bytes;
        net_recv_[landing] += bytes;
        if (reshard) {
          reshard_recv_[landing] += bytes;
          domain_recv_[static_cast<std::size_t>(dom)] += bytes;
        }
        add_move(region, s, landing, kNetwork, stage, src_space, relay_space);
        for (std::size_t i = begin; i < end; ++i) {
          if (remote_[i] == landing) continue;
          domain_send_[landing] += bytes;
          add_move(region, landing, remote_[i], kDomain, static_cast<uint8_t>(stage + 1), relay_space, dst_space);
        }
      }
      begin = end;
    }
  }

  // The job's ranks by domain and what the reshard landed on each, built at the first
  // network move.
  void build_domains() {
    if (!domain_start_.empty()) return;
    for (const LayoutCore* layout : srcs_) job_.insert(job_.end(), layout->ranks().begin(), layout->ranks().end());
    job_.insert(job_.end(), dst_.ranks().begin(), dst_.ranks().end());
    std::sort(job_.begin(), job_.end());
    job_.erase(std::unique(job_.begin(), job_.end()), job_.end());
    job_.erase(std::remove_if(job_.begin(), job_.end(), [&](int64_t r) { return lost_[static_cast<std::size_t>(r)] != 0; }),
               job_.end());
    const auto domains = static_cast<std::size_t>(job_.empty() ? 0 : domain(job_.back()) + 1);
    domain_start_.assign(domains + 1, 0);
    for (int64_t r : job_) ++domain_start_[static_cast<std::size_t>(domain(r)) + 1];
    for (std::size_t d = 0; d < domains; ++d) domain_start_[d + 1] += domain_start_[d];
    domain_least_.assign(domains, 0);
    domain_recv_.assign(domains, 0);
    reshard_recv_.assign(net_recv_.size(), 0);
  }

  // The rank of domain `dom` with the least reshard bytes landed so far among the job's
  // ranks there (both meshes, none lost) that are not remote_[begin:end) (the domain's
  // receivers of the region, ascending); -1 when there is none or when none has received
  // at most `most` bytes (known without a look at the ranks from the least any rank of the
  // domain had received at the last look: loads only grow, so it stays a lower bound).
  int64_t least_loaded_bystander(int64_t dom, std::size_t begin, std::size_t end, int64_t most) {
    const auto d = static_cast<std::size_t>(dom);
    if (d + 1 >= domain_start_.size() || domain_least_[d] > most) return -1;
    int64_t best = -1, least = INT64_MAX;
    std::size_t at = begin;  // remote_ and job_ are both ascending: one merge
    for (std::size_t k = domain_start_[d]; k < domain_start_[d + 1]; ++k) {
      const int64_t r = job_[k];
      least = std::min(least, reshard_recv_[r]);
      while (at < end && remote_[at] < r) ++at;
      if (at < end && remote_[at] == r) continue;
      if (best < 0 || reshard_recv_[r] < reshard_recv_[best]) best = r;
    }
    domain_least_[d] = least;
    return best;
  }

  // The ranks of `ranks` (ascending) that the plan fills, ascending, into `out`.
  void filled_among(const std::vector<int64_t>& ranks, std::vector<int64_t>& out) const {
    out.clear();
    if (sparse_fill_ && fill_list_.size() < ranks.size()) {
      for (int64_t r : fill_list_) {
        if (std::binary_search(ranks.begin(), ranks.end(), r)) out.push_back(r);
      }
      return;
    }
    for (int64_t r : ranks) {
      if (fill_[static_cast<std::size_t>(r)]) out.push_back(r);
    }
  }

  // The replica group of `tensor` in source k that holds `rank` (-1: none), by search.
  int64_t group_of(std::size_t k, int32_t tensor, int64_t rank) {
    const std::vector<HoldingGroup>& groups = src_groups_[k].groups(tensor);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (std::binary_search(groups[g].ranks.begin(), groups[g].ranks.end(), rank)) return static_cast<int64_t>(g);
    }
    return -1;
  }

  // ---------------------------------------------------------------- tensors
  void plan_tensor(int32_t tensor) {
    const std::vector<HoldingGroup>& dgroups = dst_groups_.groups(tensor);
    const TensorEntry& entry = src_.tensor(tensor);
    int64_t numel = 1;
    for (int64_t s : entry.shape) numel *= s;

    // Coverage: each source's replica groups must hold every element (their holdings are
    // disjoint); which of them survive is the cascade's business.
    for (std::size_t k = 0; k < srcs_.size(); ++k) {
      const std::vector<HoldingGroup>& sgroups = src_groups_[k].groups(tensor);
      int64_t covered = 0;
      for (const HoldingGroup& g : sgroups) covered += holding_volume(g);
      if (covered != numel && !dgroups.empty()) {
        throw CoreValueError("coverage", "the source layout holds " + std::to_string(covered) + " of its " +
                                             std::to_string(numel) + " elements",
                             tensor);
      }
      if (sparse_fill_) continue;  // add_lower_bound looks the few filled ranks up instead
      for (std::size_t gi = 0; gi < sgroups.size(); ++gi) {
        for (int64_t r : sgroups[gi].ranks) src_group_of_rank_[k][r] = static_cast<int64_t>(gi);
      }
    }
    add_lower_bound(tensor, dgroups);

    if (policies_[tensor] == kBroadcast) {
      plan_broadcast(tensor, src_groups_[0].groups(tensor), dgroups, numel * entry.itemsize);
    } else {
      for (const HoldingGroup& dg : dgroups) {
        filled_among(dg.ranks, needy_);
        if (!needy_.empty()) cascade(tensor, dg.runs, needy_, 0);
      }
    }
    source_ = 0;
    for (std::size_t k = 0; k < srcs_.size() && !sparse_fill_; ++k) {
      for (const HoldingGroup& g : src_groups_[k].groups(tensor)) {
        for (int64_t r : g.ranks) src_group_of_rank_[k][r] = -1;
      }
    }
  }

  // Delivers the box `need` (per dim, runs whose local_start is the destination's) to the
  // destination ranks `needy` from source layout k: each part held by a surviving replica
  // there is delivered from it; each part whose replicas are all lost falls through to
  // source k + 1. With one source and no lost rank this is the plain reshard.
  void cascade(int32_t tensor, const std::vector<std::vector<Run>>& need, const std::vector<int64_t>& needy,
               std::size_t k) {
    if (k == srcs_.size()) {
      std::string box;
      for (std::size_t d = 0; d < need.size(); ++d) {
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (const Run& r : need[d]) {
          lo = std::min(lo, r.global_start);
          hi = std::max(hi, r.global_start + r.length);
        }
        box += (d ? ", " : "") + std::to_string(lo) + ":" + std::to_string(hi);
      }
      throw CoreValueError("lost", "the region [" + box + "] has no copy on a surviving rank of any source layout",
                           tensor);
    }
    const std::size_t ndim = need.size();
    std::vector<int64_t> alive;
    for (const HoldingGroup& sg : src_groups_[k].groups(tensor)) {
      std::vector<std::vector<Piece>> pieces(ndim);
      bool empty = false;
      for (std::size_t d = 0; d < ndim && !empty; ++d) {
        meet_runs(need[d], sg.runs[d], pieces[d]);
        empty = pieces[d].empty();
      }
      if (empty) continue;
      alive.clear();
      for (int64_t r : sg.ranks) {
        if (!lost_[static_cast<std::size_t>(r)]) alive.push_back(r);
      }
      if (alive.empty()) {
        std::vector<std::vector<Run>> rest(ndim);
        for (std::size_t d = 0; d < ndim; ++d) {
          for (const Piece& p : pieces[d]) rest[d].push_back(Run{p.global_start, p.length, p.dst_local});
        }
        cascade(tensor, rest, needy, k + 1);
        continue;
      }
      source_ = static_cast<uint8_t>(k);
      interleave_cuts(tensor, pieces, true, true);
      product(tensor, pieces, [&](int32_t region) { deliver(region, alive, kSource, needy, kDestination, 0); });
    }
  }

  // What no plan can avoid: the bytes each destination rank holds minus what it holds itself
  // on a surviving rank of a source. Overlaps of several sources are summed (capped at what
  // the rank holds), so the bound stays a lower bound when a rank holds a box twice.
  void add_lower_bound(int32_t tensor, const std::vector<HoldingGroup>& dgroups) {
    const int64_t itemsize = src_.tensor(tensor).itemsize;
    std::vector<int64_t> filled;
    for (const HoldingGroup& dg : dgroups) {
      const int64_t held = itemsize * holding_volume(dg);
      filled_among(dg.ranks, filled);  // a rank the plan does not fill needs nothing
      for (int64_t rank : filled) {
        int64_t own = 0;
        for (std::size_t k = 0; k < srcs_.size() && !lost_[static_cast<std::size_t>(rank)]; ++k) {
          const int64_t gi = sparse_fill_ ? group_of(k, tensor, rank) : src_group_of_rank_[k][rank];
          if (gi < 0) continue;
          const HoldingGroup& sg = src_groups_[k].groups(tensor)[static_cast<std::size_t>(gi)];
          int64_t overlap = itemsize;
          for (std::size_t d = 0; d < dg.runs.size(); ++d) {
            int64_t common = 0;
            for (const Run& a : sg.runs[d]) {
              for (const Run& b : dg.runs[d]) {
                const auto [lo, hi] = intersect(a.global_start, a.global_start + a.length, b.global_start,
                                                b.global_start + b.length);
                common += hi - lo;
              }
            }
            overlap *= common;
          }
          own += overlap;
        }
        plan_.lower_bound_bytes += held - std::min(held, own);
      }
    }
  }

  // The bytes above which a broadcast tensor is cut into parts, each gathered, broadcast and
  // extracted on its own: half a bucket, so that a part's scratch on a rank and one move of
  // it into or out of that scratch fit one bucket's budget together (see first_fit_broadcast).
  int64_t broadcast_share() const { return std::max<int64_t>(1, options_.bucket_bytes / 2); }
  // layoutlang/runtime/schedule.py's OWN_TRANSFER_BYTES: a region this large travels alone.
  static constexpr int64_t kOwnTransferBytes = int64_t{1} << 20;

  // The pieces of `pieces` (per dim, a group's own runs) that lie in the box [at, at + size):
  // local starts shift with the global one. A dim may come out empty.
  static void clip_pieces(std::vector<std::vector<Piece>>& pieces, const std::vector<int64_t>& at,
                          const std::vector<int64_t>& size) {
    for (std::size_t d = 0; d < pieces.size(); ++d) {
      std::vector<Piece> kept;
      for (const Piece& p : pieces[d]) {
        const auto [lo, hi] = intersect(p.global_start, p.global_start + p.length, at[d], at[d] + size[d]);
        if (hi <= lo) continue;
        const int64_t shift = lo - p.global_start;
        kept.push_back(Piece{lo, hi - lo, p.src_local + shift, p.dst_local + shift});
      }
      pieces[d].swap(kept);
    }
  }

  // Gathers and broadcasts a tensor. A tensor of at most broadcast_share() bytes is one part:
  // gathered whole into one root's scratch (stage 0), sent from there slab by slab to one rank
  // per domain (stage 1), relayed inside the domain (stage 2), and every receiver keeps its
  // own boxes (stage 3). A larger tensor (an embedding of hundreds of MiB) is cut along its
  // leading dims into parts of at most the share (on the destination's quantization blocks,
  // as slabs are), each planned so with its own root, the least loaded rank among those
  // holding most of it, so no rank holds more than a part in scratch and the parts spread
  // over the source ranks. Every part goes to every receiver of the tensor, as the whole
  // tensor did: the baseline moves the same bytes, cut finer.
  void plan_broadcast(int32_t tensor, const std::vector<HoldingGroup>& sgroups,
                      const std::vector<HoldingGroup>& dgroups, int64_t tensor_bytes) {
    std::vector<int64_t> receivers;
    for (const HoldingGroup& dg : dgroups) {
      bool any = true;
      for (const auto& runs : dg.runs) any = any && runs_length(runs) > 0;
      if (any) receivers.insert(receivers.end(), dg.ranks.begin(), dg.ranks.end());
    }
    if (receivers.empty()) return;
    std::sort(receivers.begin(), receivers.end());
    std::vector<int64_t> holders;
    for (const HoldingGroup& g : sgroups) holders.insert(holders.end(), g.ranks.begin(), g.ranks.end());
    std::sort(holders.begin(), holders.end());
    plan_.broadcast_payload_bytes += 2 * tensor_bytes;
    const TensorEntry& entry = src_.tensor(tensor);
    const std::vector<int64_t> zeros(entry.shape.size(), 0);
    if (tensor_bytes <= broadcast_share()) {
      broadcast_part(tensor, sgroups, dgroups, receivers, holders, zeros, entry.shape, tensor_bytes, false);
      return;
    }
    std::vector<int64_t> candidates;
    auto part = [&](const std::vector<int64_t>& at, const std::vector<int64_t>& size) {
      int64_t bytes = entry.itemsize, most = 0;
      for (int64_t s : size) bytes *= s;
      candidates.clear();
      for (const HoldingGroup& g : sgroups) {  // the groups holding most of the part
        auto pieces = own_pieces(g);
        clip_pieces(pieces, at, size);
        int64_t volume = 1;
        for (const auto& dim : pieces) {
          int64_t common = 0;
          for (const Piece& p : dim) common += p.length;
          volume *= common;
        }
        if (volume > most) {
          most = volume;
          candidates.clear();
        }
        if (volume == most && volume > 0) candidates.insert(candidates.end(), g.ranks.begin(), g.ranks.end());
      }
      std::sort(candidates.begin(), candidates.end());
      broadcast_part(tensor, sgroups, dgroups, receivers, candidates.empty() ? holders : candidates, at, size, bytes,
                     true);
    };
    for_each_slab(src_, dst_, broadcast_share(), tensor, zeros, entry.shape, part);
  }

  // Whether region `region` is the box [at, at + size).
  bool same_box(int32_t region, const std::vector<int64_t>& at, const std::vector<int64_t>& size) const {
    const auto start = static_cast<std::size_t>(plan_.region_dims_start[region]);
    for (std::size_t d = 0; d < at.size(); ++d) {
      if (plan_.region_offsets[start + d] != at[d] || plan_.region_sizes[start + d] != size[d]) return false;
    }
    return true;
  }

  // One part of a broadcast tensor, the box [at, at + size) (`clip`: less than the whole
  // tensor), gathered on the least loaded of `candidates` (ascending) and broadcast to
  // `receivers` (ascending); its moves are contiguous and make one unit of
  // first_fit_broadcast.
  void broadcast_part(int32_t tensor, const std::vector<HoldingGroup>& sgroups, const std::vector<HoldingGroup>& dgroups,
                      const std::vector<int64_t>& receivers, const std::vector<int64_t>& candidates,
                      const std::vector<int64_t>& at, const std::vector<int64_t>& size, int64_t part_bytes, bool clip) {
    const std::size_t first_move = plan_.move_region.size();
    const int64_t root = least_loaded(candidates, root_load_);
    root_load_[root] += part_bytes;
    const std::vector<int64_t> at_root{root};

    // Stage 0: gather the part into the root's scratch buffer.
    int32_t gathered = -1;  // the part's one gathered region (-2: several)
    for (const HoldingGroup& sg : sgroups) {
      auto pieces = own_pieces(sg);
      if (clip) clip_pieces(pieces, at, size);
      interleave_cuts(tensor, pieces, true, false);
      product(tensor, pieces, [&](int32_t region) {
        gathered = gathered == -1 ? region : -2;
        if (std::binary_search(sg.ranks.begin(), sg.ranks.end(), root)) {
          add_move(region, root, root, kLocal, 0, kSource, kScratch);
        } else {
          deliver(region, sg.ranks, kSource, at_root, kScratch, 0);
        }
      });
    }
    // Stages 1-2: the part to every receiver's scratch buffer (once per domain, relayed
    // inside it, as a broadcast over NVLink domains would).
    std::vector<int64_t> others;
    for (int64_t r : receivers) {
      if (r != root) others.push_back(r);
    }
    // A part gathered as one region of its own box is sent as that region (a root that
    // received it sends it in place); a whole tensor keeps its slabs.
    if (clip && gathered >= 0 && same_box(gathered, at, size) && part_bytes <= options_.bucket_bytes) {
      if (!others.empty()) deliver(gathered, at_root, kScratch, others, kScratch, 1);
    } else if (!others.empty()) {
      slabs(tensor, at, size, [&](int32_t region) { deliver(region, at_root, kScratch, others, kScratch, 1); });
    }
    // Stage 3: every receiver keeps its own boxes.
    for (const HoldingGroup& dg : dgroups) {
      auto pieces = own_pieces(dg);
      if (clip) clip_pieces(pieces, at, size);
      interleave_cuts(tensor, pieces, false, true);
      for (int64_t rank : dg.ranks) {
        if (!std::binary_search(receivers.begin(), receivers.end(), rank)) continue;
        product(tensor, pieces, [&](int32_t region) { add_move(region, rank, rank, kLocal, 3, kScratch, kDestination); });
      }
    }
    if (plan_.move_region.size() > first_move) broadcast_units_.emplace_back(first_move, plan_.move_region.size());
  }

  // ---------------------------------------------------------------- buckets
  // Buckets are the schedule: every rank runs its buckets in order, and a bucket takes as
  // long as its busiest port. Filling buckets first come, first served (tensor by tensor)
  // packs each rank's work into its first buckets, so a rank with a few slow network bytes
  // and one with many fast NVLink bytes do their work in different buckets instead of side
  // by side, and each pair of ranks exchanges a message in almost every bucket. So:
  //
  //  - broadcast tensors keep first fit, tensor by tensor (their whole-tensor scratch
  //    buffers live from the gather to the extraction: keeping a tensor's phases close
  //    keeps that memory bounded);
  //  - the moves of resharded tensors are grouped by (stage, sending rank, receiving rank),
  //    in plan order, and cut into chunks of about a quarter of what the busiest port of
  //    their kind carries per bucket (at least 1 MiB, at most 1/16 of the budget), so a
  //    pair of ranks exchanges a few large messages instead of one per bucket;
  //  - the number of buckets K is what the rank with the most staging needs (its bytes over
  //    15/16 of the budget), and every chunk, largest first, goes to the bucket in which the
  //    fuller of the two ports it uses (the sender's send side, the receiver's receive
  //    side, of its kind) carries the least so far, among the buckets where both ranks have
  //    room. Every port's work is so spread over the K buckets, and a bucket lasts about as
  //    long as every other. Two exceptions: a bucket already made long by one port (4 times
  //    the busiest port's share per bucket or more) takes first the chunks that fit under
  //    that port's load, and a relay goes to one of the first two buckets with room from
  //    its earliest, so that the relays of the last network moves still find room.
  //
  // A relay never goes to an earlier bucket than the network move that delivered its region
  // to its sending rank (it follows that move in the plan); any other move that reads what
  // an earlier stage wrote, not before the latest write of an earlier stage of its tensor
  // into its sending rank.
  void assign_buckets() {
    const std::size_t n = plan_.move_region.size();
    const std::size_t R = net_send_.size();
    plan_.move_bucket.assign(n, 0);
    if (n == 0) {
      plan_.num_buckets = 0;
      return;
    }
    if (n >= UINT32_MAX) throw CoreValueError("argument", "a plan holds fewer than 2^32 moves");
    const int64_t budget = options_.bucket_bytes;
    // Plans of hundreds of millions of moves: no column beside the plan's own (the grouping
    // below holds an eighth of a stage's moves at a time, and a chunk takes 24 bytes). A
    // move's earliest bucket, then its chunk, waits in its bucket column until it is placed.
    // (a plan that broadcasts no tensor skips the look-up of each move's tensor)
    const bool any_broadcast = std::find(policies_.begin(), policies_.end(), kBroadcast) != policies_.end();
    auto broadcast = [&](std::size_t i) {
      return any_broadcast && policies_[plan_.region_tensor[plan_.move_region[i]]] == kBroadcast;
    };
    uint8_t last_stage = 0;
    // The buckets the rank with the most reshard staging needs, and every port's bytes.
    std::vector<int64_t> per_rank(R, 0), per_port(4 * R, 0);
    for (std::size_t i = 0; i < n; ++i) {
      if (broadcast(i)) continue;
      last_stage = std::max(last_stage, plan_.move_stage[i]);
      if (plan_.move_kind[i] == kLocal) continue;
      const int64_t bytes = plan_.region_bytes[plan_.move_region[i]];
      const std::size_t port = plan_.move_kind[i] == kNetwork ? 0 : 2;
      per_rank[plan_.move_src[i]] += bytes;
      per_rank[plan_.move_dst[i]] += bytes;
      per_port[4 * static_cast<std::size_t>(plan_.move_src[i]) + port] += bytes;
      per_port[4 * static_cast<std::size_t>(plan_.move_dst[i]) + port + 1] += bytes;
    }
    const int64_t most = *std::max_element(per_rank.begin(), per_rank.end());
    const int64_t usable = std::max<int64_t>(1, budget - budget / 16);
    // staging per rank and bucket (send and receive sides together), and per port
    Loads staging(R, static_cast<std::size_t>((most + usable - 1) / usable) + 1);
    const int32_t last_broadcast = first_fit_broadcast(staging);
    const auto buckets = static_cast<int32_t>(std::max<int64_t>(last_broadcast + 1, (most + usable - 1) / usable));
    Loads ports[4] = {Loads(R, static_cast<std::size_t>(buckets)), Loads(R, static_cast<std::size_t>(buckets)),
                      Loads(R, static_cast<std::size_t>(buckets)), Loads(R, static_cast<std::size_t>(buckets))};
    staging.reserve(static_cast<std::size_t>(buckets));
    int64_t caps[2] = {0, 0};  // network, NVLink
    for (std::size_t r = 0; r < R; ++r) {
      caps[0] = std::max({caps[0], per_port[4 * r], per_port[4 * r + 1]});
      caps[1] = std::max({caps[1], per_port[4 * r + 2], per_port[4 * r + 3]});
    }
    const int64_t typical[2] = {std::max<int64_t>(1, caps[0] / buckets), std::max<int64_t>(1, caps[1] / buckets)};
    // per bucket, the busiest port of each kind so far, and how many buckets have a tall one
    std::vector<int64_t> roofs[2] = {std::vector<int64_t>(static_cast<std::size_t>(buckets), 0),
                                     std::vector<int64_t>(static_cast<std::size_t>(buckets), 0)};
    std::size_t talls[2] = {0, 0};
    for (int64_t& cap : caps) {
      cap = std::clamp<int64_t>(cap / buckets / 4, std::min<int64_t>(int64_t{1} << 20, budget / 16), budget / 16);
      cap = std::max<int64_t>(cap, 1);
    }
    std::vector<int32_t>& earliest = plan_.move_bucket;  // until placed (a local copy: for good)
    const bool region_bytes_fit =
        *std::max_element(plan_.region_bytes.begin(), plan_.region_bytes.end()) <= INT32_MAX;
    // The stage's staged moves are grouped by (sending rank, receiving rank) a batch of
    // sending ranks at a time, so that the grouping holds about an eighth of the stage's
    // moves (8 bytes each) at once, not all of them: each batch costs one more pass over
    // the plan's stage and kind columns, instead of a column of 8 bytes a move. A move's
    // chunk waits in its bucket column (in place of its bytes, or of its earliest bucket,
    // read first) until the chunks are placed; one pass in plan order then turns each
    // chunk into its bucket, instead of a write at random per move.
    std::vector<uint64_t> order;  // a staged move as (receiving rank << 32 | move)
    ChunkStore chunks;
    std::vector<uint32_t> by_size;
    std::vector<int32_t> chunk_bucket;
    std::vector<uint32_t> first_chunk(R + 1, 0);  // rank r's chunks: [first_chunk[r], first_chunk[r + 1])
    for (uint8_t stage = 0; stage <= last_stage; ++stage) {
      if (stage > 0) earliest_buckets(stage, earliest);
      std::vector<std::size_t> start(R + 1, 0);
      int32_t latest = 0;
      auto staged = [&](std::size_t i) {
        return plan_.move_stage[i] == stage && plan_.move_kind[i] != kLocal && !broadcast(i);
      };
      // In the first stage no move waits for an earlier bucket: the bucket column holds each
      // move's bytes until its chunk is known. Read in plan order here, the chunks below find
      // them in one look-up instead of two (the region, then its bytes) at random.
      const bool bytes_in_bucket = stage == 0 && region_bytes_fit;
      for (std::size_t i = 0; i < n; ++i) {
        if (!staged(i)) continue;
        ++start[static_cast<std::size_t>(plan_.move_src[i]) + 1];
        latest = std::max(latest, earliest[i]);
        if (bytes_in_bucket) plan_.move_bucket[i] = static_cast<int32_t>(plan_.region_bytes[plan_.move_region[i]]);
      }
      for (std::size_t r = 0; r < R; ++r) start[r + 1] += start[r];
      if (start[R] == 0) continue;
      const std::size_t staged_moves = start[R];
      auto move_bytes = [&](uint32_t i) {
        return bytes_in_bucket ? int64_t{plan_.move_bucket[i]} : plan_.region_bytes[plan_.move_region[i]];
      };
      const std::size_t batch_moves = std::max<std::size_t>(kBatchMoves, (staged_moves + kBatches - 1) / kBatches);
      chunks.clear();
      std::size_t lo = 0;  // sending ranks [lo, hi)
      while (lo < R) {
        std::size_t hi = lo + 1;
        while (hi < R && start[hi + 1] - start[lo] <= batch_moves) ++hi;
        const std::size_t base = start[lo], count = start[hi] - base;
        if (count > 0) {
          order.resize(count);
          std::vector<std::size_t> at(start.begin() + static_cast<std::ptrdiff_t>(lo),
                                      start.begin() + static_cast<std::ptrdiff_t>(hi));
          for (std::size_t i = 0; i < n; ++i) {
            if (!staged(i)) continue;
            const auto src = static_cast<std::size_t>(plan_.move_src[i]);
            if (src < lo || src >= hi) continue;
            order[at[src - lo]++ - base] = static_cast<uint64_t>(static_cast<uint32_t>(plan_.move_dst[i])) << 32 | i;
          }
          group_by_receiver(order, start, lo, hi, latest > 0);
        }
        // The batch's chunks, sending rank by sending rank, receiving rank by receiving rank.
        // The moves are read in `order`, i.e. at random in the plan's columns: each one's
        // bytes are asked for kPrefetch moves ahead, so that the misses overlap.
        for (std::size_t r = lo; r < hi; ++r) {
          first_chunk[r] = static_cast<uint32_t>(chunks.size());
          uint64_t pair_dst = UINT64_MAX;
          int64_t cap = 0;
          for (std::size_t k = start[r] - base; k < start[r + 1] - base; ++k) {
            if (k + kPrefetch < count) {
              const auto ahead = static_cast<uint32_t>(order[k + kPrefetch]);
              __builtin_prefetch(&plan_.move_bucket[ahead], 1);  // bytes or earliest bucket, then chunk
              if (!bytes_in_bucket) __builtin_prefetch(&plan_.move_region[ahead]);
            }
            const uint64_t dst = order[k] >> 32;
            const auto i = static_cast<uint32_t>(order[k]);
            const int64_t bytes = move_bytes(i);
            if (dst != pair_dst) {
              pair_dst = dst;
              cap = caps[domain(static_cast<int64_t>(r)) == domain(static_cast<int64_t>(dst)) ? 1 : 0];
              chunks.push_back(Chunk{0, 0, static_cast<int32_t>(dst)});
            } else if (chunks.back().bytes + bytes > cap) {
              chunks.push_back(Chunk{0, 0, static_cast<int32_t>(dst)});
            }
            Chunk& c = chunks.back();
            c.bytes += bytes;
            if (latest > 0) c.earliest = std::max(c.earliest, earliest[i]);
            plan_.move_bucket[i] = static_cast<int32_t>(chunks.size() - 1);  // its chunk, until placed
          }
        }
        lo = hi;
      }
      first_chunk[R] = static_cast<uint32_t>(chunks.size());
      std::vector<uint64_t>().swap(order);
      // Largest first, by powers of two (then by pair and plan order, i.e. as made): what is
      // placed last is small and fills the gaps. A counting sort: millions of chunks.
      {
        auto size_class = [](int64_t bytes) { return 63 - __builtin_clzll(static_cast<unsigned long long>(bytes | 1)); };
        std::size_t begin[65] = {0};
        for (std::size_t c = 0; c < chunks.size(); ++c) ++begin[64 - size_class(chunks[c].bytes)];
        for (std::size_t k = 1; k < 65; ++k) begin[k] += begin[k - 1];
        by_size.resize(chunks.size());
        for (std::size_t c = 0; c < chunks.size(); ++c) {
          by_size[begin[63 - size_class(chunks[c].bytes)]++] = static_cast<uint32_t>(c);
        }
      }
      chunk_bucket.resize(chunks.size());
      for (std::size_t ci = 0; ci < by_size.size(); ++ci) {
        const uint32_t id = by_size[ci];
        const Chunk& c = chunks[id];
        // chunks lie at random in the store (by size): a few ahead are asked for now
        if (ci + kChunkPrefetch < by_size.size()) __builtin_prefetch(&chunks[by_size[ci + kChunkPrefetch]]);
        const int64_t s = static_cast<int64_t>(
            std::upper_bound(first_chunk.begin(), first_chunk.end(), id) - first_chunk.begin() - 1);
        const int64_t d = c.dst;
        const int network = domain(s) != domain(d) ? 0 : 2;
        Loads& out = ports[network];
        Loads& in = ports[network + 1];
        // The bucket where the fuller of the chunk's two ports carries least so far, among
        // those where both ranks have room (the first of equals).
        int32_t best = -1;
        int64_t best_cost = INT64_MAX;
        const int64_t* stage_s = staging.row(s);
        const int64_t* stage_d = staging.row(d);
        const int64_t* out_s = out.row(s);
        const int64_t* in_d = in.row(d);
        const int64_t room = budget - c.bytes;
        // A relay (a move that reads what an earlier stage wrote) goes to the lesser of the
        // first two buckets from its earliest where both ranks have room: the relays of the
        // last network moves need room in the last buckets, and one that strays later for a
        // slightly emptier NVLink port took it (Qwen3-235B on GB200: 73 buckets of relays
        // alone after the network moves). A bucket whose busiest port of the chunk's kind is
        // at least 4 times the busiest port's share per bucket (a bucket holding an
        // embedding's 250 MiB slab) is as long as that port makes it: a chunk that fits under
        // it there adds no time, and goes there first.
        int32_t window = buckets;
        std::vector<int64_t>& roof = roofs[network / 2];
        const int64_t tall = 4 * typical[network / 2];
        bool best_free = false;
        for (int32_t b = c.earliest; b < window; ++b) {
          if (stage_s[b] > room || stage_d[b] > room) continue;
          if (stage > 0 && window == buckets) window = static_cast<int32_t>(std::min<int64_t>(buckets, int64_t{b} + 2));
          const int64_t cost = std::max(out_s[b], in_d[b]);
          const bool free = roof[b] >= tall && cost + c.bytes <= roof[b];
          if ((free && !best_free) || (free == best_free && cost < best_cost)) {
            best = b;
            best_cost = cost;
            best_free = free;
            if (cost == 0 && (free || talls[network / 2] == 0)) break;  // none later is better
          }
        }
        if (best < 0) {  // no room in the K buckets: the first bucket after them with room
          best = std::max(buckets, c.earliest);
          while (staging.at(s, best) + c.bytes > budget || staging.at(d, best) + c.bytes > budget) ++best;
        }
        staging.add(s, best, c.bytes);
        staging.add(d, best, c.bytes);
        out.add(s, best, c.bytes);
        in.add(d, best, c.bytes);
        if (best < buckets) {
          const int64_t was = roof[best];
          roof[best] = std::max({was, out.at(s, best), in.at(d, best)});
          if (was < tall && roof[best] >= tall) ++talls[network / 2];
        }
        chunk_bucket[id] = best;
      }
      // Each staged move's chunk becomes the chunk's bucket, in plan order.
      for (std::size_t i = 0; i < n; ++i) {
        if (staged(i)) plan_.move_bucket[i] = chunk_bucket[static_cast<uint32_t>(plan_.move_bucket[i])];
      }
    }
    int32_t top = 0;
    for (int32_t b : plan_.move_bucket) top = std::max(top, b);
    plan_.num_buckets = top + 1;
  }

  // Sorts each sending rank's moves of the batch [lo, hi) (order[start[r] - start[lo]:
  // start[r + 1] - start[lo]], in plan order) by receiving rank (then by earliest bucket, from
  // the bucket column, when `by_earliest`), keeping plan order among equals: a counting sort
  // inside each sending rank's moves (a few hundred thousand at most: it stays in cache).
  void group_by_receiver(std::vector<uint64_t>& order, const std::vector<std::size_t>& start, std::size_t lo,
                         std::size_t hi, bool by_earliest) const {
    const std::size_t R = net_send_.size();
    const std::size_t base = start[lo];
    std::vector<std::size_t> count(R + 1, 0);
    std::vector<int32_t> touched;
    std::vector<uint64_t> scratch;
    for (std::size_t r = lo; r < hi; ++r) {
      const std::size_t a = start[r] - base, b = start[r + 1] - base;
      if (b - a < 2) continue;
      scratch.assign(order.begin() + static_cast<std::ptrdiff_t>(a), order.begin() + static_cast<std::ptrdiff_t>(b));
      touched.clear();
      for (uint64_t m : scratch) {
        const auto d = static_cast<int32_t>(m >> 32);
        if (count[static_cast<std::size_t>(d)]++ == 0) touched.push_back(d);
      }
      std::sort(touched.begin(), touched.end());
      std::size_t at = a;
      for (int32_t d : touched) {
        const std::size_t c = count[static_cast<std::size_t>(d)];
        count[static_cast<std::size_t>(d)] = at;  // now: where the next move to d goes
        at += c;
      }
      for (uint64_t m : scratch) order[count[static_cast<std::size_t>(m >> 32)]++] = m;
      for (int32_t d : touched) count[static_cast<std::size_t>(d)] = 0;
      if (!by_earliest) continue;
      std::size_t run = a;  // within each pair, by earliest bucket (relays: few moves per pair)
      while (run < b) {
        std::size_t end = run + 1;
        while (end < b && order[end] >> 32 == order[run] >> 32) ++end;
        std::stable_sort(order.begin() + static_cast<std::ptrdiff_t>(run), order.begin() + static_cast<std::ptrdiff_t>(end),
                         [&](uint64_t x, uint64_t y) {
                           return plan_.move_bucket[static_cast<uint32_t>(x)] < plan_.move_bucket[static_cast<uint32_t>(y)];
                         });
        run = end;
      }
    }
  }

  // Per rank and bucket, bytes: one row of `width` buckets per rank, widened on demand.
  class Loads {
   public:
    Loads(std::size_t ranks, std::size_t width) : ranks_(ranks), width_(std::max<std::size_t>(width, 1)),
                                                   of_(ranks_ * width_, 0) {}
    int64_t at(int64_t rank, int32_t bucket) const {
      const auto b = static_cast<std::size_t>(bucket);
      return b < width_ ? of_[static_cast<std::size_t>(rank) * width_ + b] : 0;
    }
    const int64_t* row(int64_t rank) const { return of_.data() + static_cast<std::size_t>(rank) * width_; }
    void add(int64_t rank, int32_t bucket, int64_t bytes) {
      if (static_cast<std::size_t>(bucket) >= width_) reserve(std::max(width_ * 2, static_cast<std::size_t>(bucket) + 1));
      of_[static_cast<std::size_t>(rank) * width_ + static_cast<std::size_t>(bucket)] += bytes;
    }
    // At least `width` buckets per row (rows read up to there through row()).
    void reserve(std::size_t width) {
      if (width <= width_) return;
      std::vector<int64_t> wider(ranks_ * width, 0);
      for (std::size_t r = 0; r < ranks_; ++r) {
        std::copy_n(of_.begin() + static_cast<std::ptrdiff_t>(r * width_), width_,
                    wider.begin() + static_cast<std::ptrdiff_t>(r * width));
      }
      of_.swap(wider);
      width_ = width;
    }

   private:
    std::size_t ranks_, width_;
    std::vector<int64_t> of_;
  };

  // Consecutive moves of one pair of ranks, in plan order (or by earliest bucket), that
  // share a bucket: their bytes, the earliest bucket they may go to, and the receiving rank
  // (the sending rank is known from the chunk's number: a sending rank's chunks are
  // numbered together). Each move's bucket column names its chunk until the chunks are placed.
  struct Chunk {
    int64_t bytes;
    int32_t earliest;
    int32_t dst;
  };
  // Millions of chunks, in pages of 2^16: grown without a copy, nor twice what it holds.
  class ChunkStore {
   public:
    static constexpr std::size_t kPageBits = 16, kPage = std::size_t{1} << kPageBits;
    std::size_t size() const { return size_; }
    void clear() { size_ = 0; }  // the pages stay, for the next stage
    void push_back(const Chunk& c) {
      if (size_ >> kPageBits == pages_.size()) pages_.push_back(std::make_unique<Chunk[]>(kPage));
      (*this)[size_++] = c;
    }
    Chunk& back() { return (*this)[size_ - 1]; }
    Chunk& operator[](std::size_t k) { return pages_[k >> kPageBits][k & (kPage - 1)]; }
    const Chunk& operator[](std::size_t k) const { return pages_[k >> kPageBits][k & (kPage - 1)]; }

   private:
    std::vector<std::unique_ptr<Chunk[]>> pages_;
    std::size_t size_ = 0;
  };
  // How many moves ahead assign_buckets asks for a move's bytes (the plan's columns are read
  // at random there): enough misses in flight to cover memory's latency; and chunks ahead.
  static constexpr std::size_t kPrefetch = 16, kChunkPrefetch = 8;
  // A stage's staged moves are grouped in about kBatches batches of sending ranks, of at
  // least kBatchMoves moves each (8 MiB of them) unless a stage has fewer.
  static constexpr std::size_t kBatches = 8, kBatchMoves = std::size_t{1} << 20;

  // For every resharded move of `stage` that reads what an earlier stage wrote: a relay
  // follows the network move that delivered its region to its sending rank, and goes no
  // earlier than that move's bucket; any other, no earlier than the latest bucket of a move
  // of an earlier stage of its tensor into its sending rank. Moves of one tensor are
  // contiguous, as built.
  void earliest_buckets(uint8_t stage, std::vector<int32_t>& earliest) {
    const std::size_t n = plan_.move_region.size();
    std::vector<int32_t> written(net_send_.size(), -1);
    std::vector<int64_t> touched;
    std::size_t begin = 0;
    while (begin < n) {
      const int32_t tensor = plan_.region_tensor[plan_.move_region[begin]];
      std::size_t end = begin;
      while (end < n && plan_.region_tensor[plan_.move_region[end]] == tensor) ++end;
      if (policies_[tensor] == kBroadcast) {
        begin = end;
        continue;
      }
      bool resolved = true;
      std::size_t feeder = n;  // the last move of an earlier stage
      for (std::size_t i = begin; i < end; ++i) {
        if (plan_.move_stage[i] < stage) {
          feeder = i;
        } else if (plan_.move_stage[i] == stage && plan_.move_src_space[i] != kSource) {
          if (feeder < n && plan_.move_region[feeder] == plan_.move_region[i] && plan_.move_dst[feeder] == plan_.move_src[i]) {
            earliest[i] = plan_.move_bucket[feeder];
          } else {
            resolved = false;
          }
        }
      }
      if (!resolved) {  // a read of an earlier stage that does not follow its write
        for (std::size_t i = begin; i < end; ++i) {
          if (plan_.move_stage[i] >= stage) continue;
          int32_t& w = written[plan_.move_dst[i]];
          if (w < 0) touched.push_back(plan_.move_dst[i]);
          w = std::max(w, plan_.move_bucket[i]);
        }
        for (std::size_t i = begin; i < end; ++i) {
          if (plan_.move_stage[i] == stage && plan_.move_src_space[i] != kSource) {
            earliest[i] = std::max(0, written[plan_.move_src[i]]);
          }
        }
        for (int64_t r : touched) written[r] = -1;
        touched.clear();
      }
      begin = end;
    }
  }

  // First fit for the moves of broadcast tensors, unit by unit (a unit: one part of a
  // tensor, see plan_broadcast; moves in plan order). Two loads per rank and bucket: its
  // staging, as the validator counts it (both sides of every move between two ranks), and
  // its memory: the scratch the units hold there plus what is staged besides. A unit's
  // scratch on a rank (every byte its moves write into that rank's scratch) counts from the
  // bucket of the first of those writes to the bucket of the last move that reads it. A
  // region of kOwnTransferBytes or more travels alone and in place (layoutlang/runtime/
  // schedule.py's OWN_TRANSFER_BYTES): received into its own scratch buffer, it takes no
  // memory besides that buffer; sent from the buffer it was received in (a relay), none
  // either. A move goes to the first bucket where both loads of both of its ranks have room
  // for it, so no rank's staging, nor its staging plus live scratch, exceeds the budget in a
  // bucket (a part is at most half a bucket: its scratch and one move of it fit an empty
  // one). A move that reads a rank's scratch goes no earlier than the latest write into it so
  // far (a relay after the delivery to its landing rank, a root's sends after the gather, an
  // extraction after the last write: steps run (bucket, stage) in order, so the same bucket
  // serves a later stage). Where a unit's scratch would have to live through a bucket without
  // room for it, the unit is placed again from the bucket after that one. The memory is left
  // in `staging` where it exceeds the staging, so the reshard's moves placed after these
  // keep room for the scratch. Returns the last bucket used (0 when none).
  int32_t first_fit_broadcast(Loads& staging) {
    if (broadcast_units_.empty()) return 0;
    const std::size_t R = net_send_.size();
    BroadcastFit fit(R);
    const int64_t budget = options_.bucket_bytes;
    int32_t last = 0;
    for (const auto& [begin, end] : broadcast_units_) {
      for (std::size_t i = begin; i < end; ++i) {
        const int32_t region = plan_.move_region[i];
        if (plan_.move_src_space[i] == kScratch && plan_.move_kind[i] != kLocal &&
            !sent_in_place(i, fit.last_region[plan_.move_src[i]])) {
          fit.sends[plan_.move_src[i]] += plan_.region_bytes[region];
        }
        if (plan_.move_dst_space[i] != kScratch) continue;
        const int64_t d = plan_.move_dst[i];
        if (fit.scratch[d] == 0) fit.ranks.push_back(d);
        fit.scratch[d] += plan_.region_bytes[region];
        fit.last_region[d] = plan_.move_kind[i] != kLocal ? region : -1;
      }
      for (int64_t r : fit.ranks) fit.last_region[r] = -1;
      int32_t start = 0;
      while (true) {
        const int32_t conflict = place_broadcast_unit(begin, end, start, staging, fit);
        if (conflict < 0) break;
        for (const auto& [r, b, bytes, memory] : fit.log) (memory ? fit.memory : staging).add(r, b, -bytes);
        fit.log.clear();
        for (int64_t r : fit.ranks) fit.written[r] = fit.from[r] = fit.to[r] = fit.last_region[r] = -1;
        start = conflict;
      }
      for (const auto& [r, b, bytes, memory] : fit.log) {
        if (memory) fit.frontier[r] = std::max(fit.frontier[r], b + 1);
        // A bucket with less than 1/64 of the budget left counts as full: searching it again
        // for every later move would cost more than the space is worth.
        while (std::max(staging.at(r, fit.open[r]), fit.memory.at(r, fit.open[r])) > budget - budget / 64) ++fit.open[r];
        last = std::max(last, b);
      }
      for (std::size_t i = begin; i < end; ++i) last = std::max(last, plan_.move_bucket[i]);
      for (int64_t r : fit.ranks) {
        fit.scratch[r] = fit.sends[r] = 0;
        fit.written[r] = fit.from[r] = fit.to[r] = fit.last_region[r] = -1;
      }
      fit.ranks.clear();
      fit.log.clear();
    }
    for (std::size_t r = 0; r < R; ++r) {
      for (int32_t b = 0; b <= last; ++b) {
        const auto rank = static_cast<int64_t>(r);
        const int64_t more = fit.memory.at(rank, b) - staging.at(rank, b);
        if (more > 0) staging.add(rank, b, more);
      }
    }
    return last;
  }

  // first_fit_broadcast's state: every rank's memory per bucket; per rank, `open`, the first
  // bucket not yet full, and `frontier`, the first after every bucket it has memory in; for
  // the unit being placed, per rank, its scratch bytes there, what it sends from them not in
  // place, the latest bucket of a write into it, the buckets [from, to] its scratch counts in
  // (-1: none yet) and the region last written into it; the ranks it writes scratch on, and
  // what it added (rank, bucket, bytes, to the memory: else the staging), undone when it is
  // placed again.
  struct BroadcastFit {
    explicit BroadcastFit(std::size_t ranks)
        : memory(ranks, 16), open(ranks, 0), frontier(ranks, 0), scratch(ranks, 0), sends(ranks, 0),
          written(ranks, -1), from(ranks, -1), to(ranks, -1), last_region(ranks, -1) {}
    Loads memory;
    std::vector<int32_t> open, frontier;
    std::vector<int64_t> scratch, sends;
    std::vector<int32_t> written, from, to, last_region;
    std::vector<int64_t> ranks;
    std::vector<std::tuple<int64_t, int32_t, int64_t, bool>> log;
  };

  // Whether move i sends from scratch, in place, the region last received into its sending
  // rank's scratch (`last_region`): a relay of what its landing rank received, a part's
  // sends from a root that received it whole. (What a rank copied into its own scratch is
  // sent from there in place only where the copy aliases its source: not counted on.)
  bool sent_in_place(std::size_t i, int32_t last_region) const {
    return plan_.move_src_space[i] == kScratch && plan_.move_region[i] == last_region &&
           plan_.region_bytes[plan_.move_region[i]] >= kOwnTransferBytes;
  }

  // Places the moves of plan_[begin:end) (one broadcast unit) in buckets from `start` on;
  // -1 when done, else the bucket from which to place the unit again: its scratch on some
  // rank would have to live through a bucket without room for it (the bucket before that).
  int32_t place_broadcast_unit(std::size_t begin, std::size_t end, int32_t start, Loads& staging, BroadcastFit& fit) {
    const int64_t budget = options_.bucket_bytes;
    Loads& memory = fit.memory;
    for (std::size_t i = begin; i < end; ++i) {
      const int64_t s = plan_.move_src[i], d = plan_.move_dst[i];
      const bool staged = plan_.move_kind[i] != kLocal;  // a copy on one rank needs no staging
      const int64_t bytes = staged ? plan_.region_bytes[plan_.move_region[i]] : 0;
      const bool received_in_place = plan_.move_dst_space[i] == kScratch && bytes >= kOwnTransferBytes;
      const bool sent = sent_in_place(i, fit.last_region[s]);
      // what the move stages on rank r besides the scratch (0 on a rank it moves nothing on)
      auto besides = [&](int64_t r) {
        if (!staged || (r != s && r != d)) return int64_t{0};
        return (r == d && received_in_place) || (r == s && sent) ? int64_t{0} : bytes;
      };
      // the ranks whose scratch of this unit the move reads or writes (at most two)
      int64_t holds[2];
      std::size_t n = 0;
      int32_t bucket = start;
      if (plan_.move_src_space[i] == kScratch) {
        holds[n++] = s;
        bucket = std::max(bucket, fit.written[s]);
      }
      if (plan_.move_dst_space[i] == kScratch && (n == 0 || d != s)) {
        holds[n++] = d;
        bucket = std::max(bucket, fit.from[d]);  // a rank's scratch range only grows later
        // A rank whose scratch and sends of the unit exceed a bucket keeps its scratch over
        // several buckets: from the first bucket after all it holds so far, where nothing can
        // be in the way, rather than through the gaps others left (each a new placement).
        if (fit.from[d] < 0 && fit.scratch[d] + fit.sends[d] > budget) bucket = std::max(bucket, fit.frontier[d]);
      }
      if (staged) bucket = std::max({bucket, fit.open[s], fit.open[d]});
      for (std::size_t k = 0; k < n; ++k) bucket = std::max(bucket, fit.open[holds[k]]);
      // The buckets between a rank's scratch range and `bucket` would hold its scratch too.
      auto through = [&](int64_t r, int32_t b) {
        return fit.from[r] < 0 || b <= fit.to[r] || memory.at(r, b) == 0 || memory.at(r, b) + fit.scratch[r] <= budget;
      };
      for (std::size_t k = 0; k < n; ++k) {
        const int64_t r = holds[k];
        if (fit.from[r] < 0) continue;
        for (int32_t b = fit.to[r] + 1; b < bucket; ++b) {
          if (!through(r, b)) return b + 1;
        }
      }
      // What the move adds to rank r's memory in bucket b: its staging besides the scratch,
      // and the unit's scratch there where b is outside the rank's range so far. The first
      // write into a rank's scratch also asks for room for what the unit sends from it (up to
      // the whole bucket): the scratch then seldom has to live on into a bucket that other
      // units filled, which would place the unit again. A load holding nothing on the rank
      // takes the move whatever it needs (a part cut on quantization blocks may exceed half a
      // bucket).
      auto fits = [&](int64_t r, int32_t b) {
        if (staged && (r == s || r == d) && staging.at(r, b) != 0 && staging.at(r, b) + bytes > budget) return false;
        int64_t extra = besides(r);
        for (std::size_t k = 0; k < n; ++k) {
          if (holds[k] != r) continue;
          if (fit.from[r] < 0) {
            extra += fit.scratch[r] + std::min(fit.sends[r], std::max<int64_t>(0, budget - fit.scratch[r] - extra));
          } else if (b > fit.to[r]) {
            extra += fit.scratch[r];
          }
        }
        const int64_t held = memory.at(r, b);
        return held == 0 || held + extra <= budget;
      };
      while (true) {
        bool ok = !staged || (fits(s, bucket) && fits(d, bucket));
        for (std::size_t k = 0; k < n && ok; ++k) ok = fits(holds[k], bucket);
        if (ok) break;
        for (std::size_t k = 0; k < n; ++k) {
          if (!through(holds[k], bucket)) return bucket + 1;
        }
        ++bucket;
      }
      if (staged) {
        for (int64_t r : {s, d}) {
          staging.add(r, bucket, bytes);
          fit.log.emplace_back(r, bucket, bytes, false);
          if (besides(r) == 0) continue;
          memory.add(r, bucket, bytes);
          fit.log.emplace_back(r, bucket, bytes, true);
        }
      }
      for (std::size_t k = 0; k < n; ++k) {
        const int64_t r = holds[k];
        const int32_t from = fit.from[r] < 0 ? bucket : fit.to[r] + 1;
        for (int32_t b = from; b <= bucket; ++b) {
          memory.add(r, b, fit.scratch[r]);
          fit.log.emplace_back(r, b, fit.scratch[r], true);
        }
        if (fit.from[r] < 0) fit.from[r] = bucket;
        fit.to[r] = std::max(fit.to[r], bucket);
      }
      if (plan_.move_dst_space[i] == kScratch) {
        fit.written[d] = std::max(fit.written[d], bucket);
        fit.last_region[d] = staged ? plan_.move_region[i] : -1;
      }
      plan_.move_bucket[i] = bucket;
    }
    return -1;
  }

  std::vector<const LayoutCore*> srcs_;
  const LayoutCore& src_;  // the first source: tensor shapes and item sizes
  const LayoutCore& dst_;
  const std::vector<uint8_t>& policies_;
  PlanOptions options_;
  std::vector<GroupCache> src_groups_;
  GroupCache dst_groups_;
  std::vector<char> lost_;
  std::vector<char> fill_;  // the destination ranks the plan fills
  std::vector<int64_t> needy_;
  std::vector<int64_t> fill_list_;  // the ranks to fill, ascending, when they are few (sparse_fill_)
  bool sparse_fill_ = false;
  bool recovery_ = false;
  uint8_t source_ = 0;  // the source layout of the moves being added
  PlanData plan_;
  std::vector<int64_t> net_send_, net_recv_, domain_send_, root_load_;
  // the broadcast units (one part of a broadcast tensor each) as [first move, end)
  std::vector<std::pair<std::size_t, std::size_t>> broadcast_units_;
  std::vector<std::vector<int64_t>> src_group_of_rank_;  // per source
  std::vector<int64_t> remote_, near_;
  std::vector<int64_t> job_;  // the job's ranks that may land a region in scratch, ascending
  std::vector<std::size_t> domain_start_;  // job_[domain_start_[d]:domain_start_[d + 1]]: domain d's
  // what the reshard's own network moves (not a broadcast's, nor a recovery's) landed, per
  // rank and per domain; per domain, at most the least of its job ranks' (a lower bound)
  std::vector<int64_t> reshard_recv_, domain_recv_, domain_least_;
};

// Checks a plan tensor by tensor (moves of one tensor are contiguous, as built).
class Validator {
 public:
  Validator(const PlanData& plan, const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
            const LayoutCore& dst, const PlanOptions& options, std::size_t max_problems,
            const std::optional<std::vector<int64_t>>& fill = std::nullopt)
      : plan_(plan), srcs_(sources), src_(*sources.at(0)), dst_(dst), options_(options), max_(max_problems),
        dst_groups_(dst), lost_(lost_mask(sources, dst, lost)), fill_(fill_mask(lost_.size(), dst, fill)),
        regions_(plan, *sources.at(0)), writes_(lost_.size()) {
    for (const LayoutCore* s : srcs_) src_groups_.emplace_back(*s);
    src_group_.assign(srcs_.size(), std::vector<int64_t>(lost_.size(), -1));
    dst_group_.assign(lost_.size(), -1);
  }

  std::vector<std::string> run() {
    const std::size_t n = plan_.move_region.size();
    const std::size_t columns[] = {plan_.move_src.size(), plan_.move_dst.size(), plan_.move_bucket.size(),
                                   plan_.move_kind.size(), plan_.move_stage.size(), plan_.move_src_space.size(),
                                   plan_.move_dst_space.size(), plan_.move_source.size()};
    for (std::size_t c : columns) {
      if (c != n) return {"move columns have different lengths"};
    }
    if (!check_regions()) return problems_;
    std::vector<char> seen(src_.num_tensors(), 0);
    std::size_t begin = 0;
    while (begin < n && problems_.size() < max_) {
      if (plan_.move_region[begin] < 0 ||
          static_cast<std::size_t>(plan_.move_region[begin]) >= plan_.region_tensor.size()) {
        problem(begin, "refers to a region that does not exist");
        return problems_;
      }
      const int32_t tensor = plan_.region_tensor[plan_.move_region[begin]];
      std::size_t end = begin;
      while (end < n && plan_.move_region[end] >= 0 &&
             static_cast<std::size_t>(plan_.move_region[end]) < plan_.region_tensor.size() &&
             plan_.region_tensor[plan_.move_region[end]] == tensor) {
        ++end;
      }
      if (tensor < 0 || static_cast<std::size_t>(tensor) >= seen.size() || seen[tensor]) {
        problem(begin, "moves of one tensor are not contiguous");
        return problems_;
      }
      seen[tensor] = 1;
      check_tensor(tensor, begin, end);
      begin = end;
    }
    // Destinations of tensors that have no moves at all must hold nothing.
    for (std::size_t t = 0; t < seen.size() && problems_.size() < max_; ++t) {
      if (!seen[t]) {
        writes_.clear();
        check_writes_cover(static_cast<int32_t>(t));
      }
    }
    return problems_;
  }

 private:
  // The moves of one tensor that write into each (rank, space), in plan order: what
  // check_tensor asks of every move, so kept flat (a tree of vectors per tensor took most of
  // validate()'s time at thousands of ranks). add() every write, group(), then look up.
  class Writes {
   public:
    struct Moves {
      const std::size_t *first, *last;
      const std::size_t* begin() const { return first; }
      const std::size_t* end() const { return last; }
      std::size_t size() const { return static_cast<std::size_t>(last - first); }
      std::size_t operator[](std::size_t k) const { return first[k]; }
    };
    explicit Writes(std::size_t ranks) : slot_of_(ranks * kSpaces, -1) {}
    void clear() {
      for (std::size_t key : keys_) slot_of_[key] = -1;
      keys_.clear();
      pending_.clear();
      start_.assign(1, 0);
    }
    void add(int64_t rank, uint8_t space, std::size_t move) { pending_.emplace_back(key(rank, space), move); }
    // Slots in ascending (rank, space), each slot's moves in plan order.
    void group() {
      for (const auto& [k, move] : pending_) {
        if (slot_of_[k] < 0) {
          slot_of_[k] = 0;
          keys_.push_back(k);
        }
      }
      std::sort(keys_.begin(), keys_.end());
      start_.assign(keys_.size() + 1, 0);
      for (std::size_t slot = 0; slot < keys_.size(); ++slot) slot_of_[keys_[slot]] = static_cast<int64_t>(slot);
      for (const auto& [k, move] : pending_) ++start_[static_cast<std::size_t>(slot_of_[k]) + 1];
      for (std::size_t slot = 0; slot < keys_.size(); ++slot) start_[slot + 1] += start_[slot];
      moves_.resize(pending_.size());
      std::vector<std::size_t> at(start_.begin(), start_.end() - 1);
      for (const auto& [k, move] : pending_) moves_[at[static_cast<std::size_t>(slot_of_[k])]++] = move;
    }
    std::size_t slots() const { return keys_.size(); }
    Moves in_slot(std::size_t slot) const { return {moves_.data() + start_[slot], moves_.data() + start_[slot + 1]}; }
    // The moves writing into (rank, space); none for a rank or space out of range.
    Moves into(int64_t rank, uint8_t space) const {
      if (rank < 0 || space >= kSpaces || static_cast<std::size_t>(rank) >= slot_of_.size() / kSpaces) return {};
      const int64_t slot = slot_of_[key(rank, space)];
      return slot < 0 ? Moves{} : in_slot(static_cast<std::size_t>(slot));
    }

   private:
    static constexpr std::size_t kSpaces = 3;
    static std::size_t key(int64_t rank, uint8_t space) { return static_cast<std::size_t>(rank) * kSpaces + space; }
    std::vector<int64_t> slot_of_;  // per key: its slot (-1: none; 0 while group() collects keys)
    std::vector<std::size_t> keys_, start_{0}, moves_;
    std::vector<std::pair<std::size_t, std::size_t>> pending_;  // (key, move)
  };

  // Every region's dims lie inside the coordinate columns and its bytes match its sizes.
  bool check_regions() {
    if (!check_region_columns(plan_, src_, problems_, max_, false)) return false;
    int32_t last_bucket = 0;
    for (std::size_t i = 0; i < plan_.move_kind.size() && problems_.size() < max_; ++i) {
      if (plan_.move_kind[i] > kNetwork || plan_.move_src_space[i] > kScratch || plan_.move_dst_space[i] > kScratch ||
          plan_.move_stage[i] > 3 || plan_.move_bucket[i] < 0 || plan_.move_source[i] >= srcs_.size()) {
        problem(i, "has a kind, space, stage, bucket or source out of range");
      }
      last_bucket = std::max(last_bucket, plan_.move_bucket[i]);
    }
    staged_.size_for(lost_.size(), last_bucket);
    return problems_.empty();
  }

  void problem(std::size_t move, const std::string& what) {
    if (problems_.size() < max_) problems_.push_back("move " + std::to_string(move) + ": " + what);
  }

  bool earlier(std::size_t a, std::size_t b) const {
    return plan_.move_bucket[a] < plan_.move_bucket[b] ||
           (plan_.move_bucket[a] == plan_.move_bucket[b] && plan_.move_stage[a] < plan_.move_stage[b]);
  }

  void check_tensor(int32_t tensor, std::size_t begin, std::size_t end) {
    const auto& dgroups = dst_groups_.groups(tensor);
    // each source's groups of the tensor, looked up once (the cache is a tree keyed by spec)
    std::vector<const std::vector<HoldingGroup>*> groups_of(srcs_.size());
    for (std::size_t k = 0; k < srcs_.size(); ++k) {
      const auto& sgroups = src_groups_[k].groups(tensor);
      groups_of[k] = &sgroups;
      for (std::size_t g = 0; g < sgroups.size(); ++g)
        for (int64_t r : sgroups[g].ranks) src_group_[k][r] = static_cast<int64_t>(g);
    }
    for (std::size_t g = 0; g < dgroups.size(); ++g)
      for (int64_t r : dgroups[g].ranks) dst_group_[r] = static_cast<int64_t>(g);
    const std::vector<int64_t>& shape = src_.tensor(tensor).shape;

    writes_.clear();
    for (std::size_t i = begin; i < end; ++i) {
      const int32_t region = plan_.move_region[i];
      const int64_t s = plan_.move_src[i], d = plan_.move_dst[i];
      const auto start = static_cast<std::size_t>(plan_.region_dims_start[region]);
      for (std::size_t k = 0; k < shape.size(); ++k) {
        if (plan_.region_offsets[start + k] < 0 || plan_.region_sizes[start + k] < 1 ||
            plan_.region_offsets[start + k] + plan_.region_sizes[start + k] > shape[k]) {
          problem(i, "region lies outside its tensor");
        }
      }
      if (s < 0 || d < 0 || static_cast<std::size_t>(std::max(s, d)) >= lost_.size()) {
        problem(i, "rank outside both meshes");
        continue;
      }
      if (lost_[static_cast<std::size_t>(s)] || lost_[static_cast<std::size_t>(d)]) {
        problem(i, "moves data from or to rank " + std::to_string(lost_[static_cast<std::size_t>(s)] ? s : d) +
                       ", which is lost");
      }
      const std::size_t k = plan_.move_source[i];
      const auto& sgroups = *groups_of[k];
      const int64_t sgroup = src_group_[k][s];
      const uint8_t expected = s == d ? kLocal : (s / options_.domain_size == d / options_.domain_size ? kDomain : kNetwork);
      if (plan_.move_kind[i] != expected) problem(i, "kind does not match the ranks' domains");
      if (plan_.move_src_space[i] == kSource && (sgroup < 0 || !regions_.inside(region, sgroups[sgroup]))) {
        problem(i, "reads what rank " + std::to_string(s) + " does not hold in the source layout");
      }
      if (plan_.move_src_space[i] == kDestination &&
          (dst_group_[s] < 0 || !regions_.inside(region, dgroups[dst_group_[s]]))) {
        problem(i, "relays what rank " + std::to_string(s) + " does not hold in the destination layout");
      }
      if (plan_.move_dst_space[i] == kDestination &&
          (dst_group_[d] < 0 || !regions_.inside(region, dgroups[dst_group_[d]]))) {
        problem(i, "writes what rank " + std::to_string(d) + " does not hold in the destination layout");
      }
      if (plan_.move_dst_space[i] == kSource) problem(i, "writes into a source storage");
      if (plan_.move_dst_space[i] == kDestination && !fill_[static_cast<std::size_t>(d)]) {
        problem(i, "writes to rank " + std::to_string(d) + ", which the plan does not fill");
      }
      if ((plan_.move_src_space[i] == kSource && sgroup >= 0 &&
           !regions_.within_one_block(region, sgroups[sgroup], *srcs_[k])) ||
          (plan_.move_dst_space[i] == kDestination && dst_group_[d] >= 0 &&
           !regions_.within_one_block(region, dgroups[dst_group_[d]], dst_))) {
        problem(i, "spans two blocks of an interleaved storage");
      }
      writes_.add(d, plan_.move_dst_space[i], i);
    }
    writes_.group();
    // Reads of received data (relays, scratch) must be covered by earlier writes.
    for (std::size_t i = begin; i < end; ++i) {
      if (plan_.move_src_space[i] == kSource) continue;
      const int32_t region = plan_.move_region[i];
      int64_t covered = 0;
      for (std::size_t w : writes_.into(plan_.move_src[i], plan_.move_src_space[i])) {
        if (earlier(w, i)) covered += regions_.overlap(plan_.move_region[w], region);
      }
      if (covered != regions_.volume(region)) problem(i, "reads data that no earlier move delivered");
    }
    // No rank stages more than the budget in one bucket (send and receive sides together).
    for (std::size_t i = begin; i < end; ++i) {
      if (plan_.move_kind[i] == kLocal) continue;
      const int64_t bytes = plan_.region_bytes[plan_.move_region[i]];
      for (int64_t r : {static_cast<int64_t>(plan_.move_src[i]), static_cast<int64_t>(plan_.move_dst[i])}) {
        if (r < 0 || static_cast<std::size_t>(r) >= lost_.size()) continue;  // refused above
        const int64_t total = staged_.add(r, plan_.move_bucket[i], bytes);
        if (total > options_.bucket_bytes && total - bytes <= options_.bucket_bytes) {
          problem(i, "rank " + std::to_string(r) + " stages more than the bucket budget in bucket " +
                         std::to_string(plan_.move_bucket[i]));
        }
      }
    }
    // Writes never overlap (every byte written once).
    for (std::size_t slot = 0; slot < writes_.slots(); ++slot) {
      const Writes::Moves list = writes_.in_slot(slot);
      for (std::size_t a = 0; a < list.size(); ++a) {
        for (std::size_t b = a + 1; b < list.size(); ++b) {
          if (regions_.overlap(plan_.move_region[list[a]], plan_.move_region[list[b]]) > 0) {
            problem(list[b], "writes bytes that move " + std::to_string(list[a]) + " also writes");
          }
        }
      }
    }
    check_writes_cover(tensor);
    for (std::size_t k = 0; k < srcs_.size(); ++k)
      for (const auto& g : src_groups_[k].groups(tensor))
        for (int64_t r : g.ranks) src_group_[k][r] = -1;
    for (const auto& g : dgroups)
      for (int64_t r : g.ranks) dst_group_[r] = -1;
  }

  // Every destination rank receives exactly its holding (writes_, the tensor's writes, are
  // disjoint and inside it).
  void check_writes_cover(int32_t tensor) {
    for (const HoldingGroup& g : dst_groups_.groups(tensor)) {
      const int64_t held = holding_volume(g);
      for (int64_t rank : g.ranks) {
        if (!fill_[static_cast<std::size_t>(rank)]) continue;  // checked above: nothing written there
        const Writes::Moves into = writes_.into(rank, kDestination);
        const int64_t written = regions_.written(into.begin(), into.end());
        if (written != held && problems_.size() < max_) {
          problems_.push_back(cover_problem(tensor, rank, written, held));
        }
      }
    }
  }

  const PlanData& plan_;
  std::vector<const LayoutCore*> srcs_;
  const LayoutCore& src_;  // the first source: tensor shapes and item sizes
  const LayoutCore& dst_;
  PlanOptions options_;
  std::size_t max_;
  std::vector<GroupCache> src_groups_;
  GroupCache dst_groups_;
  std::vector<char> lost_;
  std::vector<char> fill_;  // the destination ranks the plan fills
  std::vector<std::vector<int64_t>> src_group_;  // per source, per rank
  std::vector<int64_t> dst_group_;
  PlanRegions regions_;
  Writes writes_;
  // Bytes each rank stages in each bucket: a table of ranks x buckets, since a plan of
  // hundreds of millions of moves looks one up twice a move (a tree of (bucket, rank) keys
  // took most of validate()'s time); a hash map where the table would be large (a plan read
  // back may name any bucket).
  class StagedBytes {
   public:
    void size_for(std::size_t ranks, int32_t last_bucket) {
      width_ = static_cast<std::size_t>(last_bucket) + 1;
      if (ranks * width_ <= kMaxTable) table_.assign(ranks * width_, 0);
    }
    // Adds `bytes` to what `rank` stages in `bucket` and returns the new total.
    int64_t add(int64_t rank, int32_t bucket, int64_t bytes) {
      const std::size_t at = static_cast<std::size_t>(rank) * width_ + static_cast<std::size_t>(bucket);
      return (table_.empty() ? sparse_[at] : table_[at]) += bytes;
    }

   private:
    static constexpr std::size_t kMaxTable = std::size_t{1} << 24;  // 128 MiB
    std::size_t width_ = 1;
    std::vector<int64_t> table_;
    std::unordered_map<std::size_t, int64_t> sparse_;
  };
  StagedBytes staged_;
  std::vector<std::string> problems_;
};

}  // namespace

PlanData build_plan(const LayoutCore& source, const LayoutCore& destination,
                    const std::vector<uint8_t>& policies, const PlanOptions& options) {
  return Builder({&source}, {}, destination, policies, options).build();
}

PlanData build_recovery_plan(const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
                             const LayoutCore& destination, const PlanOptions& options,
                             const std::optional<std::vector<int64_t>>& fill) {
  if (sources.empty()) throw CoreValueError("argument", "a recovery plan needs at least one source layout");
  const std::vector<uint8_t> policies(destination.num_tensors(), kReshard);
  return Builder(sources, lost, destination, policies, options, fill).build();
}

namespace {

// Bits needed to write 0..most.
int bits_for(uint64_t most) { return most == 0 ? 0 : 64 - __builtin_clzll(most); }

// Sorts `keys` by their low `bits` bits (the rest are zero): least significant digit first,
// 11 bits a pass, through `spare` (as large as keys). Hundreds of millions of keys: a
// comparison sort of them took most of plan_totals' time.
void radix_sort(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare, int bits) {
  constexpr int kDigit = 11;
  std::vector<std::size_t> count(std::size_t{1} << kDigit);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    const uint64_t mask = (uint64_t{1} << kDigit) - 1;
    for (uint64_t k : keys) ++count[(k >> shift) & mask];
    std::size_t at = 0;
    for (std::size_t& c : count) {
      const std::size_t n = c;
      c = at;
      at += n;
    }
    for (uint64_t k : keys) spare[count[(k >> shift) & mask]++] = k;
    keys.swap(spare);
  }
}

}  // namespace

PlanTotals plan_totals(const PlanData& plan, int64_t num_ranks) {
  PlanTotals totals;
  totals.sent.assign(static_cast<std::size_t>(num_ranks) * 3, 0);
  totals.received.assign(static_cast<std::size_t>(num_ranks) * 3, 0);
  // A message: the moves between one pair of ranks in one bucket and stage.
  int32_t first_bucket = INT32_MAX, last_bucket = INT32_MIN;
  uint8_t last_stage = 0;
  std::size_t staged = 0;
  for (std::size_t i = 0; i < plan.move_region.size(); ++i) {
    const uint8_t kind = plan.move_kind[i];
    const int64_t bytes = plan.region_bytes[plan.move_region[i]];
    const int64_t src = plan.move_src[i], dst = plan.move_dst[i];
    if (kind > kNetwork || src < 0 || dst < 0 || src >= num_ranks || dst >= num_ranks) {
      throw CoreValueError("plan", "move " + std::to_string(i) + " has a kind or rank out of range");
    }
    totals.bytes[kind] += bytes;
    totals.moves[kind] += 1;
    totals.sent[static_cast<std::size_t>(src) * 3 + kind] += bytes;
    totals.received[static_cast<std::size_t>(dst) * 3 + kind] += bytes;
    if (kind == kLocal) continue;
    ++staged;
    first_bucket = std::min(first_bucket, plan.move_bucket[i]);
    last_bucket = std::max(last_bucket, plan.move_bucket[i]);
    last_stage = std::max(last_stage, plan.move_stage[i]);
  }
  if (staged == 0) return totals;
  // Each staged move's (bucket, stage, src, dst) packed into 64 bits where they fit (any plan
  // of fewer than 2^20 ranks and 2^20 buckets), then sorted and counted once each.
  const int rank_bits = bits_for(static_cast<uint64_t>(num_ranks - 1));
  const int stage_bits = bits_for(last_stage);
  const int bucket_bits = bits_for(static_cast<uint64_t>(int64_t{last_bucket} - first_bucket));
  const int bits = bucket_bits + stage_bits + 2 * rank_bits;
  if (bits <= 64) {
    std::vector<uint64_t> keys, spare(staged);
    keys.reserve(staged);
    for (std::size_t i = 0; i < plan.move_region.size(); ++i) {
      if (plan.move_kind[i] == kLocal) continue;
      uint64_t key = static_cast<uint64_t>(int64_t{plan.move_bucket[i]} - first_bucket);
      key = key << stage_bits | plan.move_stage[i];
      key = key << rank_bits | static_cast<uint64_t>(plan.move_src[i]);
      key = key << rank_bits | static_cast<uint64_t>(plan.move_dst[i]);
      keys.push_back(key);
    }
    radix_sort(keys, spare, bits);
    totals.messages = static_cast<int64_t>(std::unique(keys.begin(), keys.end()) - keys.begin());
    return totals;
  }
  std::vector<std::tuple<int32_t, uint8_t, int32_t, int32_t>> keys;  // bucket, stage, src, dst
  keys.reserve(staged);
  for (std::size_t i = 0; i < plan.move_region.size(); ++i) {
    if (plan.move_kind[i] != kLocal) {
      keys.emplace_back(plan.move_bucket[i], plan.move_stage[i], plan.move_src[i], plan.move_dst[i]);
    }
  }
  std::sort(keys.begin(), keys.end());
  totals.messages = static_cast<int64_t>(std::unique(keys.begin(), keys.end()) - keys.begin());
  return totals;
}

std::vector<std::string> validate_plan(const PlanData& plan, const LayoutCore& source,
                                       const LayoutCore& destination, const PlanOptions& options,
                                       std::size_t max_problems) {
  return Validator(plan, {&source}, {}, destination, options, max_problems).run();
}

std::vector<std::string> validate_recovery_plan(const PlanData& plan, const std::vector<const LayoutCore*>& sources,
                                                const std::vector<int64_t>& lost, const LayoutCore& destination,
                                                const PlanOptions& options, std::size_t max_problems,
                                                const std::optional<std::vector<int64_t>>& fill) {
  if (sources.empty()) return {"a recovery plan needs at least one source layout"};
  return Validator(plan, sources, lost, destination, options, max_problems, fill).run();
}

}  // namespace layoutlang
