/*! \file tile_schedule.h
    \brief The host's request for a tile walk (make_schedule, tile_schedule.cu): how many
           blocks and heads, how the heads form sections, the blocks' order. Plain C++.
*/
#pragma once

#include <cstdint>

#include "launch.h"
#include "tile_scheduler.h"

namespace jax_flash::sm90 {

//! How make_schedule sizes the sections of heads.
enum class HeadSections {
  //! As many heads as keep `bytes_per_head` of operands that all blocks of a head read within
  //! half of L2 (the rest serves the streamed operands), but no more than one wave of CTAs
  //! covers whole: the blocks of a head then run side by side and meet in L2 on the data they
  //! share, before the next heads' blocks evict it.
  kWaveOfHeads,
  //! One head: a persistent walk over even blocks, whose head's blocks then go to adjacent
  //! CTAs of one round and read the head's operands from L2 together.
  kOneHead,
  //! A persistent walk over uneven blocks (a window, or a mask's or bias's block classes):
  //! sections grown past L2 so that the static deal balances its CTAs, then checked against a
  //! model of the deal.
  kBalanced,
};

//! The tile walk a launch asks make_schedule for: `num_blocks` blocks of `num_heads_total`
//! heads (`num_heads` per batch item).
struct ScheduleRequest {
  int64_t num_blocks = 0;
  int64_t num_heads = 0;
  int64_t num_heads_total = 0;
  int64_t bytes_per_head = 0;  //!< of the operands that every block of a head reads
  HeadSections sections = HeadSections::kWaveOfHeads;
  bool reverse_blocks = false;  //!< the blocks from the last to the first
  //! The batch items of a head one after another (see TileSchedulerParams).
  bool items_adjacent = false;
  //! A kernel that walks several tiles gets one CTA per SM; any other, one per tile.
  bool persistent = false;
};

//! Fills the scheduler's tile walk (tile_schedule.cu) and the CTAs to launch.
Status make_schedule(const ScheduleRequest& request, const LaunchContext& context,
                     const char* kernel_name, TileSchedulerParams* sched, int* grid);

}  // namespace jax_flash::sm90
