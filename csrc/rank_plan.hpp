// Pairwise plans: a plan mode in which every choice is a function of data both ends of a
// move can compute alone, so that one rank compiles, validates and runs only its own part.
//
// The whole-fleet planner (planner.hpp) picks holders and landing ranks by fleet-wide load
// counters and places moves in buckets by fleet-wide port loads: a rank cannot know its
// own moves without planning everyone's. In the pairwise mode:
//
//   - a region is delivered as build_plan delivers it (a local copy where the destination
//     rank holds it, a domain move from a holder in its domain, else one network move per
//     destination domain to a landing rank, relayed inside the domain), but the holder and
//     the landing rank are chosen by a hash of (tensor, region box, destination domain)
//     over the candidates, in the order the layouts give them;
//   - buckets are pair-local: the moves between one sending and one receiving rank in one
//     stage, in plan order, are cut into chunks of at most a quarter of the budget (a
//     region larger than that is a chunk of its own; regions are slabs of at most the
//     budget), and a chunk's index is its bucket. Both ends of a pair see the pair's moves
//     in the same order, so they agree on every message's bucket. Local copies are in
//     bucket 0 of stage 0.
//
// Plan order is tensor, destination replica group, source replica group, region, then the
// destination ranks as deliver() visits them. The plan of rank r is the moves of the whole
// pairwise plan that r sends or receives, in that order: it visits only the replica groups
// that hold r (as a destination, or as a source, with every destination group that needs
// part of its box), so its time and memory grow with what r moves, not with the fleet.
// Only the `reshard` policy.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout_core.hpp"
#include "planner.hpp"

namespace layoutlang {

// The pairwise plan of `rank`'s moves, or of the whole fleet when rank < 0. Its
// lower_bound_bytes are what the ranks it fills (rank, or all) must receive at least.
PlanData build_pairwise_plan(const LayoutCore& source, const LayoutCore& destination,
                             const std::vector<uint8_t>& policies, const PlanOptions& options, int64_t rank);

// Problems with a pairwise plan of `rank` (of the whole fleet when rank < 0): every move
// involves the rank, every byte the rank holds in the destination is written exactly once,
// reads lie in what the reading rank holds in the source or received in an earlier stage,
// kinds match domains, regions sit in one block of interleaved storages, and every message
// (one pair, stage and bucket) carries at most bucket_bytes.
std::vector<std::string> validate_pairwise_plan(const PlanData& plan, const LayoutCore& source,
                                                const LayoutCore& destination, const PlanOptions& options,
                                                int64_t rank, std::size_t max_problems);

}  // namespace layoutlang
