/*! \file tile_scheduler.h
    \brief Static tile scheduler shared by the passes. A tile is (block, head, batch), where the
           block runs along the pass's own axis: query blocks in the forward, key blocks in the
           backward (whose heads are key/value heads). Tiles are grouped in sections of heads
           (chosen by the host so that the operands the section's blocks all read share L2),
           and within a section a window (causal) may make blocks at one end longer: the host
           then asks for the blocks from the last to the first. Heads are numbered batch item
           by batch item, or, where the items share a bias, head by head: the items of a head
           then run side by side, reading the bias from L2 together and summing its gradient
           there. Rounds of gridDim.x tiles are dealt in a snake order (CTA i takes the i-th
           tile of even rounds and the i-th from the end of odd ones), so a CTA that drew a
           longer tile in one round draws a shorter one in the next. A grid of one CTA per
           tile makes it a plain (non-persistent) map.
*/
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace jax_flash::sm90 {

struct TileCoord {
  int32_t block;
  int32_t head;
  int32_t batch;  //!< flat index over the problem's batch shape
};

//! 32-bit throughout: the host checks that the tile count plus two rounds fits.
struct TileSchedulerParams {
  int32_t num_blocks = 0;
  int32_t num_heads_total = 0;     //!< heads * batch count
  int32_t heads_per_section = 1;   //!< heads whose shared operands stay in L2 together
  //! How the heads are numbered: batch item by batch item (inner_extent: the heads), or, with
  //! items_adjacent, head by head (inner_extent: the batch count).
  int32_t inner_extent = 1;
  bool items_adjacent = false;
  int32_t num_tiles = 0;
  bool reverse_blocks = false;     //!< visit blocks from the last to the first
};

class StaticPersistentScheduler {
 public:
  CUTE_DEVICE explicit StaticPersistentScheduler(TileSchedulerParams const& params)
      : params_(params), tile_(blockIdx.x) {}

  //! Rounds cover increasing ranges of tiles, so the first tile past the end ends the walk.
  CUTE_DEVICE bool valid() const { return tile_ < params_.num_tiles; }
  CUTE_DEVICE void advance() {
    ++round_;
    const int32_t lane = (round_ & 1) ? int32_t(gridDim.x - 1 - blockIdx.x) : int32_t(blockIdx.x);
    tile_ = round_ * int32_t(gridDim.x) + lane;
  }

  CUTE_DEVICE TileCoord coord() const {
    const int32_t section_tiles = params_.heads_per_section * params_.num_blocks;
    const int32_t section = tile_ / section_tiles;
    const int32_t offset = tile_ - section * section_tiles;
    const int32_t first_head = section * params_.heads_per_section;
    const int32_t heads = min(params_.heads_per_section, params_.num_heads_total - first_head);
    const int32_t block_index = offset / heads;
    const int32_t head_linear = first_head + (offset - block_index * heads);
    TileCoord c;
    c.block = params_.reverse_blocks ? params_.num_blocks - 1 - block_index : block_index;
    const int32_t outer = head_linear / params_.inner_extent;
    const int32_t inner = head_linear - outer * params_.inner_extent;
    c.head = params_.items_adjacent ? outer : inner;
    c.batch = params_.items_adjacent ? inner : outer;
    return c;
  }

 private:
  TileSchedulerParams params_;
  int32_t tile_;
  int32_t round_ = 0;
};

}  // namespace jax_flash::sm90
