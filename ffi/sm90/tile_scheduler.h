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
#include <cutlass/fast_math.h>

namespace jax_flash::sm90 {

struct TileCoord {
  int32_t block;
  int32_t head;
  int32_t batch;  //!< flat index over the problem's batch shape
};

//! tile_coord's divisors as multiply-shifts (cutlass::FastDivmod, exact for the non-negative
//! 32-bit operands here): integer divisions by runtime values cost a persistent CTA about a
//! hundred cycles each at every tile boundary, where no GEMM runs beside them.
struct TileDivisors {
  cutlass::FastDivmod section_tiles;       //!< heads_per_section * num_blocks
  cutlass::FastDivmod section_heads;       //!< heads_per_section
  cutlass::FastDivmod last_section_heads;  //!< the heads of the last section (may be fewer)
  cutlass::FastDivmod inner_extent;
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
  TileDivisors divisors;           //!< from the fields above: with_divisors()
};

//! `params` with its divisors derived from its other fields (host: after any of them changes).
//! A walk without tiles never divides; its divisors are 1.
inline TileSchedulerParams with_divisors(TileSchedulerParams params) {
  const auto divisor = [](int32_t d) { return cutlass::FastDivmod(d > 1 ? d : 1); };
  const int32_t heads = params.heads_per_section > 1 ? params.heads_per_section : 1;
  const int32_t sections = (params.num_heads_total + heads - 1) / heads;
  params.divisors.section_tiles = divisor(heads * params.num_blocks);
  params.divisors.section_heads = divisor(heads);
  params.divisors.last_section_heads = divisor(params.num_heads_total - (sections - 1) * heads);
  params.divisors.inner_extent = divisor(params.inner_extent);
  return params;
}

//! The tile that CTA `lane` of a grid of `grid` CTAs takes in round `round`. The snake is its
//! own inverse: given a tile's position within its round, it also returns the CTA that takes it
//! (plus round * grid).
CUTE_HOST_DEVICE int32_t snake_tile(int32_t round, int32_t lane, int32_t grid) {
  return round * grid + ((round & 1) ? grid - 1 - lane : lane);
}

//! A tile's coordinates: its section of heads, then within the section block by block, the
//! section's heads side by side.
CUTE_HOST_DEVICE TileCoord tile_coord(TileSchedulerParams const& params, int32_t tile) {
  TileDivisors const& div = params.divisors;
  int32_t section, offset;
  div.section_tiles(section, offset, tile);
  const int32_t first_head = section * params.heads_per_section;
  const bool last_section = params.num_heads_total - first_head < params.heads_per_section;
  int32_t block_index, head_in_section;
  (last_section ? div.last_section_heads : div.section_heads)(block_index, head_in_section, offset);
  const int32_t head_linear = first_head + head_in_section;
  TileCoord c;
  c.block = params.reverse_blocks ? params.num_blocks - 1 - block_index : block_index;
  int32_t outer, inner;
  div.inner_extent(outer, inner, head_linear);
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
  TileSchedulerParams const& params_;  //!< the kernel's (grid-constant) parameters
  int32_t tile_;
  int32_t round_ = 0;
};

}  // namespace jax_flash::sm90
