// The plan compiler: turns a source and a destination layout of the same logical tensors
// into the moves that give every destination rank exactly the boxes it holds.
//
// Vocabulary (shared with the Python side):
//   region  a box of one logical tensor that moves as a unit;
//   move    one transfer of one region between two ranks, `local` (same rank), `domain`
//           (same domain) or `network`; a *relay* is a domain move whose source is a rank
//           that received the region in an earlier stage;
//   space   where a move reads or writes: the rank's source storage, its destination
//           storage, or a scratch buffer holding a whole tensor (gather-and-broadcast);
//   stage   moves of a later stage read what earlier stages wrote (relays after the network
//           stage; broadcast after gather);
//   bucket  moves executed together, with at most `bucket_bytes` of staging per rank.
//
// For the `reshard` policy each region is read from a source replica chosen in this order:
// the destination rank itself (local copy), a source in the destination's domain, else the
// least loaded source over the network, once per destination domain, relayed inside it.
// For the `broadcast` policy the whole tensor is gathered on one source rank (the root),
// sent to every destination rank that holds any of it, and each keeps its boxes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "layout_core.hpp"
#include "replica_groups.hpp"

namespace layoutlang {

enum MoveKind : uint8_t { kLocal = 0, kDomain = 1, kNetwork = 2 };
enum Space : uint8_t { kSource = 0, kDestination = 1, kScratch = 2 };
enum Policy : uint8_t { kReshard = 0, kBroadcast = 1 };

struct PlanOptions {
  int64_t domain_size = 1;
  int64_t bucket_bytes = int64_t{256} << 20;
};

// The plan as columns. Region r covers offsets/sizes [dims_start[r], dims_start[r] + ndim)
// of the flat coordinate arrays.
struct PlanData {
  std::vector<int32_t> region_tensor;
  std::vector<int64_t> region_dims_start;
  std::vector<int64_t> region_offsets;
  std::vector<int64_t> region_sizes;
  std::vector<int64_t> region_bytes;

  std::vector<int32_t> move_region;
  std::vector<int32_t> move_src;
  std::vector<int32_t> move_dst;
  std::vector<int32_t> move_bucket;
  std::vector<uint8_t> move_kind;
  std::vector<uint8_t> move_stage;
  std::vector<uint8_t> move_src_space;
  std::vector<uint8_t> move_dst_space;
  // Which source layout a move reads from (0 unless the plan is a recovery plan).
  std::vector<uint8_t> move_source;

  int32_t num_buckets = 0;
  // What no plan can avoid: bytes each destination rank holds and does not hold as a source.
  int64_t lower_bound_bytes = 0;
  // Gathered plus broadcast bytes, each tensor counted once per phase (the "logical payload").
  int64_t broadcast_payload_bytes = 0;
};

PlanData build_plan(const LayoutCore& source, const LayoutCore& destination,
                    const std::vector<uint8_t>& policies, const PlanOptions& options);

// A recovery plan: every destination region is read from the first source layout (in the
// order given: e.g. the surviving inference replicas, then the training side) that still
// holds it on a rank not in `lost`; within that source, as build_plan chooses. Only the
// `reshard` policy. Throws CoreValueError naming the tensor and box when no source holds
// a region on a surviving rank, or when a lost rank is in the destination.
//
// With `fill`, only the destination ranks listed get moves (the ranks whose holdings changed
// after a membership change: the others keep their storages): the plan is as long as what
// they need, not as the whole destination.
PlanData build_recovery_plan(const std::vector<const LayoutCore*>& sources, const std::vector<int64_t>& lost,
                             const LayoutCore& destination, const PlanOptions& options,
                             const std::optional<std::vector<int64_t>>& fill = std::nullopt);

// Totals of a plan: bytes and moves by kind, sent and received per rank by kind, and the
// number of messages (all moves between one pair of ranks in one bucket and stage).
struct PlanTotals {
  int64_t bytes[3] = {0, 0, 0};
  int64_t moves[3] = {0, 0, 0};
  int64_t messages = 0;
  std::vector<int64_t> sent;      // rank * 3 + kind
  std::vector<int64_t> received;  // rank * 3 + kind
};
PlanTotals plan_totals(const PlanData& plan, int64_t num_ranks);

// Problems found by validate_plan: every destination byte written exactly once, every read
// inside what the reading rank holds (or received earlier), kinds consistent with domains.
std::vector<std::string> validate_plan(const PlanData& plan, const LayoutCore& source,
                                       const LayoutCore& destination, const PlanOptions& options,
                                       std::size_t max_problems);

// The same for a recovery plan: reads lie in what the rank holds in the move's source
// layout, and no move reads from or writes to a lost rank. With `fill`, every byte of the
// ranks listed is written exactly once and nothing is written anywhere else.
std::vector<std::string> validate_recovery_plan(const PlanData& plan, const std::vector<const LayoutCore*>& sources,
                                                const std::vector<int64_t>& lost, const LayoutCore& destination,
                                                const PlanOptions& options, std::size_t max_problems,
                                                const std::optional<std::vector<int64_t>>& fill = std::nullopt);

}  // namespace layoutlang
