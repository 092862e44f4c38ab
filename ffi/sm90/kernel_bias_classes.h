/*! \file kernel_bias_classes.h
    \brief The block classes of a bias array for a pass's tile (jax_flash/_primitive.py,
           _bias_tiles): a block is dropped (class 0) where every entry is at most drops_at
           and every row of the block, within the sequence, holds an entry above row_holds;
           else kept (1). One CTA per block. Most blocks are decided by their first entry:
           one above drops_at keeps the block, so a learned bias costs one load per block.
           Where it is low (a causal bias of the lowest value, above the diagonal), the CTA
           reads the whole block, all its loads in flight at once, then its rows.
*/
#pragma once

#include <type_traits>

#include <cute/config.hpp>

#include "launch.h"

namespace jax_flash::sm90 {

inline constexpr int kBiasClassesThreads = 128;
//! Loads each thread issues before it looks at any: a 128 x 128 block of 2-byte entries in two
//! rounds of 16-byte loads.
inline constexpr int kBiasClassesLoadsInFlight = 8;

//! Whether `x` may keep a block: above `bound`, or NaN (never dropped: it reaches the output).
CUTE_DEVICE bool above(float x, float bound) { return !(x <= bound); }

//! Whether any of the block's entries lies above `bound`, read in `Chunk`s (16 bytes of
//! entries where the rows and the block's columns are aligned to them; else one entry).
template <class Element, class Chunk>
CUTE_DEVICE bool block_holds_above(const Element* bias, int64_t cols, int32_t rows,
                                   int32_t width, float bound) {
  constexpr int kPerChunk = sizeof(Chunk) / sizeof(Element);
  const int32_t chunks_per_row = width / kPerChunk;
  const int32_t count = rows * chunks_per_row;
  bool high = false;
  for (int32_t first = threadIdx.x; first < count;
       first += kBiasClassesLoadsInFlight * kBiasClassesThreads) {
    Chunk chunk[kBiasClassesLoadsInFlight];
#pragma unroll
    for (int j = 0; j < kBiasClassesLoadsInFlight; ++j) {
      const int32_t i = first + j * kBiasClassesThreads;
      if (i < count) {
        const int32_t row = i / chunks_per_row;
        chunk[j] = *reinterpret_cast<const Chunk*>(
            bias + row * cols + (i - row * chunks_per_row) * kPerChunk);
      }
    }
#pragma unroll
    for (int j = 0; j < kBiasClassesLoadsInFlight; ++j) {
      if (first + j * kBiasClassesThreads < count) {
        const Element* entries = reinterpret_cast<const Element*>(&chunk[j]);
#pragma unroll
        for (int k = 0; k < kPerChunk; ++k) high |= above(float(entries[k]), bound);
      }
    }
  }
  return high;
}

//! kVectorLoads: the host found the bias, its rows and the blocks' columns 16-byte aligned.
template <class Element, bool kVectorLoads>
__global__ void __launch_bounds__(kBiasClassesThreads)
    bias_classes_kernel(CUTE_GRID_CONSTANT BiasClassesParams const p) {
  constexpr unsigned kWarp = 0xffffffffu;
  const int64_t block = blockIdx.x;
  const int64_t blocks_per_item = int64_t(p.row_blocks) * p.col_blocks;
  const int64_t item = block / blocks_per_item;
  const int32_t row_block = int32_t(block % blocks_per_item / p.col_blocks);
  const int32_t col_block = int32_t(block % p.col_blocks);
  const Element* bias = static_cast<const Element*>(p.bias) + item * p.rows * p.cols;
  auto at = [&](int32_t row, int32_t col) { return float(bias[int64_t(row) * p.cols + col]); };
  const int32_t row_begin = row_block * p.block_rows;
  const int32_t row_end = min(row_begin + p.block_rows, p.rows);
  const int32_t col_begin = col_block * p.block_cols;
  const int32_t width = min(col_begin + p.block_cols, p.cols) - col_begin;
  auto write = [&](bool kept) {
    if (threadIdx.x == 0) p.classes[block] = kept ? 1 : 0;
  };

  // Every thread reads the same first entry, so the CTA returns as one.
  if (above(at(row_begin, col_begin), p.drops_at)) return write(true);

  using Chunk = std::conditional_t<kVectorLoads, uint4, Element>;
  const bool high = block_holds_above<Element, Chunk>(
      bias + int64_t(row_begin) * p.cols + col_begin, p.cols, row_end - row_begin, width,
      p.drops_at);
  if (__syncthreads_or(high)) return write(true);

  // Every entry is low: the block is dropped only if each of its rows holds a larger entry,
  // anywhere along the keys. Each lane tries a row's first entry (a causal bias keeps it); its
  // warp then searches each row this left open, 32 entries a step.
  const int lane = threadIdx.x % 32;
  bool row_without = false;
  for (int32_t base = row_begin + int32_t(threadIdx.x) / 32 * 32; base < row_end && !row_without;
       base += kBiasClassesThreads) {
    const int32_t row = base + lane;
    const bool found = row >= row_end || above(at(row, 0), p.row_holds);
    for (unsigned open = __ballot_sync(kWarp, !found); open != 0 && !row_without;
         open &= open - 1) {
      const int32_t searched = base + __ffs(open) - 1;
      bool holds = false;
      for (int32_t col = 1; !holds && col < p.cols; col += 32) {
        holds = __any_sync(kWarp, col + lane < p.cols &&
                                      above(at(searched, col + lane), p.row_holds));
      }
      row_without = !holds;
    }
  }
  write(__syncthreads_or(row_without));
}

}  // namespace jax_flash::sm90
