/*! \file tile_schedule.cu
    \brief make_schedule: the host's choice of the tile walk (sections of heads, block order) for
           the persistent forward and the backward. Host code only, in a unit of its own so that
           the kernels' instantiation units do not each compile it.
*/
#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tile_schedule.h"

namespace jax_flash::sm90 {

namespace {

//! The work of the busiest CTA when a persistent grid of `grid` CTAs deals the tiles of
//! `params` statically, as StaticPersistentScheduler does. A block's work is modelled as a
//! causal query block's, in key blocks: its index plus one, and one more for the tile's fixed
//! costs (Q load, epilogue).
int64_t busiest_cta_work(TileSchedulerParams const& params, int32_t grid) {
  std::vector<int64_t> work(size_t(grid), 0);
  for (int32_t tile = 0; tile < params.num_tiles; ++tile) {
    const int32_t round = tile / grid;
    const int32_t lane = snake_tile(round, tile - round * grid, grid) - round * grid;
    work[size_t(lane)] += tile_coord(params, tile).block + 2;
  }
  return *std::max_element(work.begin(), work.end());
}

//! Sections of uneven blocks for a persistent grid: the rule's heads per section (in `params`),
//! unless a smaller power of two deals the tiles to the CTAs more evenly (by busiest_cta_work).
//! The powers are tried from one head up, and each replaces the choice so far only if it beats
//! it by more than 1%, so the smallest good one wins (fewer heads' operands in flight at once).
//! How sections fall across rounds decides how the long blocks spread over the CTAs, and no
//! closed rule gets that right for every count of blocks and heads: sections sized for L2 deal
//! short rows (a few blocks per head, many heads) unevenly, small sections deal long rows
//! unevenly. Decisions are cached per problem size: programs repeat their shapes, and the model
//! costs a pass over the tiles per candidate.
int32_t balanced_heads_per_section(TileSchedulerParams params, int32_t grid) {
  constexpr int32_t kMaxModelledTiles = int32_t(1) << 15;  // past this the rounds even out
  if (params.num_tiles > kMaxModelledTiles || grid <= 1) return params.heads_per_section;
  const std::array<int32_t, 5> key{params.num_blocks, params.num_heads_total,
                                   params.heads_per_section, grid, int32_t(params.reverse_blocks)};
  static std::mutex mutex;
  static std::map<std::array<int32_t, 5>, int32_t> decisions;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = decisions.find(key); it != decisions.end()) return it->second;
  }
  const int32_t rule = params.heads_per_section;
  int32_t best = rule;
  int64_t best_work = busiest_cta_work(with_divisors(params), grid);
  for (int32_t heads = 1; heads < rule; heads *= 2) {
    params.heads_per_section = heads;
    const int64_t work = busiest_cta_work(with_divisors(params), grid);
    if (100 * work < 99 * best_work) {
      best = heads;
      best_work = work;
    }
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (decisions.size() >= 4096) decisions.clear();
  decisions.emplace(key, best);
  return best;
}

}  // namespace

Status make_schedule(const ScheduleRequest& request, const LaunchContext& context,
                     const char* kernel_name, TileSchedulerParams* sched, int* grid) {
  const int64_t num_tiles = request.num_heads_total * request.num_blocks;
  if (num_tiles > INT32_MAX - 2 * int64_t(context.sm_count)) {
    return Status::InvalidArgument(std::string("jax_flash: too many blocks x heads x batch (") +
                                   std::to_string(num_tiles) + ") for the Hopper " +
                                   kernel_name + " kernel");
  }
  sched->num_blocks = int32_t(request.num_blocks);
  sched->num_heads_total = int32_t(request.num_heads_total);
  sched->num_tiles = int32_t(num_tiles);
  sched->reverse_blocks = request.reverse_blocks;
  const int64_t heads = std::max<int64_t>(request.num_heads, 1);
  sched->inner_extent =
      int32_t(request.items_adjacent ? request.num_heads_total / heads : heads);
  sched->items_adjacent = request.items_adjacent;
  const int64_t l2_heads =
      (int64_t(context.l2_bytes) / 2) / std::max<int64_t>(request.bytes_per_head, 1);
  int64_t heads_per_section = 1;
  switch (request.sections) {
    case HeadSections::kWaveOfHeads:
      heads_per_section = std::min<int64_t>(
          l2_heads, context.sm_count / std::max<int64_t>(request.num_blocks, 1));
      break;
    case HeadSections::kOneHead:
      // Sections sized for L2 spread a head's blocks over rounds, which cost 7-15% at
      // T <= 1024 and 1-2% at T = 4096 (H100); one head keeps a round to its own K and V.
      heads_per_section = 1;
      break;
    case HeadSections::kBalanced:
      // A persistent grid deals its tiles statically, and longest first then balances the
      // CTAs only over a section several rounds long: one shorter than a round deals the long
      // blocks to the same CTAs round after round. Sections may therefore grow past L2 up to a
      // quarter of the grid in heads: a round then still runs four or more CTAs per head side
      // by side, on blocks of about the same length, reading the same data together. Where that
      // still deals unevenly (short rows), balanced_heads_per_section picks smaller sections.
      heads_per_section = std::max<int64_t>(l2_heads, context.sm_count / 4);
      break;
  }
  sched->heads_per_section =
      int32_t(std::clamp<int64_t>(heads_per_section, 1, request.num_heads_total));
  *grid = request.persistent ? int(std::min<int64_t>(num_tiles, context.sm_count))
                             : int(num_tiles);
  if (request.sections == HeadSections::kBalanced && request.persistent) {
    sched->heads_per_section = balanced_heads_per_section(*sched, *grid);
  }
  *sched = with_divisors(*sched);
  return Status::Ok();
}

}  // namespace jax_flash::sm90
