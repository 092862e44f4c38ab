/*! \file tile_scheduler.h
    \brief Static tile scheduler shared by the passes. A tile is (block, head, batch), where the
           block runs along the pass's own axis: query blocks in the forward, key blocks in the
           backward (whose heads are key/value heads). Tiles are grouped in sections of heads
           (chosen by the host: so that the operands the section's blocks all read share L2,
           and for a persistent grid's uneven blocks, so that the deal below balances its CTAs;
           tile_schedule.cu), and within a section a window (causal) may make blocks at one end
           longer: the host then asks for the blocks from the last to the first. Heads are
           numbered batch item by batch item, or, where the items share a bias, head by head:
           the items of a head then run side by side, reading the bias from L2 together and
           summing its gradient there. Rounds of gridDim.x tiles are dealt in a snake order
           (CTA i takes the i-th tile of even rounds and the i-th from the end of odd ones), so
           a CTA that drew a longer tile in one round draws a shorter one in the next. A grid of
           one CTA per tile makes it a plain (non-persistent) map. The mapping is written once,
           for the device and for the host's model of the deal alike (snake_tile, tile_coord).
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

//! The tile that CTA `lane` of a grid of `grid` CTAs takes in round `round`. The snake is its
//! own inverse: given a tile's position within its round, it also returns the CTA that takes it
//! (plus round * grid).
CUTE_HOST_DEVICE int32_t snake_tile(int32_t round, int32_t lane, int32_t grid) {
  return round * grid + ((round & 1) ? grid - 1 - lane : lane);
}

//! A tile's coordinates: its section of heads, then within the section block by block, the
//! section's heads side by side.
CUTE_HOST_DEVICE TileCoord tile_coord(TileSchedulerParams const& params, int32_t tile) {
  const int32_t section_tiles = params.heads_per_section * params.num_blocks;
  const int32_t section = tile / section_tiles;
  const int32_t offset = tile - section * section_tiles;
  const int32_t first_head = section * params.heads_per_section;
  const int32_t heads_left = params.num_heads_total - first_head;
  const int32_t heads = params.heads_per_section < heads_left ? params.heads_per_section
                                                              : heads_left;
  const int32_t block_index = offset / heads;
  const int32_t head_linear = first_head + (offset - block_index * heads);
  TileCoord c;
  c.block = params.reverse_blocks ? params.num_blocks - 1 - block_index : block_index;
  const int32_t outer = head_linear / params.inner_extent;
  const int32_t inner = head_linear - outer * params.inner_extent;
  c.head = params.items_adjacent ? outer : inner;
  c.batch = params.items_adjacent ? inner : outer;
  return c;
}

class StaticPersistentScheduler {
 public:
  CUTE_DEVICE explicit StaticPersistentScheduler(TileSchedulerParams const& params)
      : params_(params), tile_(blockIdx.x) {}

  //! Rounds cover increasing ranges of tiles, so the first tile past the end ends the walk.
  CUTE_DEVICE bool valid() const { return tile_ < params_.num_tiles; }
  CUTE_DEVICE void advance() {
    ++round_;
    tile_ = snake_tile(round_, int32_t(blockIdx.x), int32_t(gridDim.x));
  }

  CUTE_DEVICE TileCoord coord() const { return tile_coord(params_, tile_); }

 private:
  TileSchedulerParams params_;
  int32_t tile_;
  int32_t round_ = 0;
};

}  // namespace jax_flash::sm90
