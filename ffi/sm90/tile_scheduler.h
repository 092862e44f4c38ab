/*! \file tile_scheduler.h
    \brief Persistent tile scheduler: each CTA walks a static sequence of (query block, head,
           batch) tiles. Tiles are grouped in sections of heads (chosen by the host so that their
           K/V share L2), and within a section the query blocks go longest first when a window
           (causal) makes later blocks cheaper. Rounds of gridDim.x tiles are dealt in a snake
           order (CTA i takes the i-th tile of even rounds and the i-th from the end of odd ones),
           so a CTA that drew a longer tile in one round draws a shorter one in the next.
*/
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace jax_flash::sm90 {

struct TileCoord {
  int32_t m_block;
  int32_t head;
  int32_t batch;  //!< flat index over the problem's batch shape
};

//! 32-bit throughout: the host checks that the tile count plus two rounds fits.
struct TileSchedulerParams {
  int32_t num_m_blocks = 0;
  int32_t num_heads = 0;
  int32_t num_heads_total = 0;     //!< num_heads * batch count
  int32_t heads_per_section = 1;   //!< heads whose K/V share L2 while their blocks run
  int32_t num_tiles = 0;
  bool longest_first = false;      //!< visit query blocks from the last (most keys) to the first
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
    const int32_t section_tiles = params_.heads_per_section * params_.num_m_blocks;
    const int32_t section = tile_ / section_tiles;
    const int32_t offset = tile_ - section * section_tiles;
    const int32_t first_head = section * params_.heads_per_section;
    const int32_t heads = min(params_.heads_per_section, params_.num_heads_total - first_head);
    const int32_t m_index = offset / heads;
    const int32_t head_linear = first_head + (offset - m_index * heads);
    TileCoord c;
    c.m_block = params_.longest_first ? params_.num_m_blocks - 1 - m_index : m_index;
    c.batch = head_linear / params_.num_heads;
    c.head = head_linear - c.batch * params_.num_heads;
    return c;
  }

 private:
  TileSchedulerParams params_;
  int32_t tile_;
  int32_t round_ = 0;
};

}  // namespace jax_flash::sm90
