/*! \file kernel_fwd_merge.h
    \brief The merge of a forward split along the keys (jax_flash/_split_kv.py): each part
           attended one chunk of the keys and holds a normalised output and its log-sum-exp;
           the whole row's lse is the log-sum-exp of the parts' lses, and its output the sum of
           the parts' outputs weighted by exp(lse_part - lse). One warp per (item, row).
*/
#pragma once

#include <cute/config.hpp>

#include "launch.h"

namespace jax_flash::sm90 {

inline constexpr int kMergeThreads = 256;
//! Output columns per lane and load (8 bytes of 16-bit elements).
inline constexpr int kMergeColumnsPerLoad = 4;
//! Parts whose columns a lane loads before it adds any: their loads are in flight together
//! (the merge is bound by memory latency, not bandwidth).
inline constexpr int kMergePartsInFlight = 16;

template <class Element>
__global__ void __launch_bounds__(kMergeThreads)
    forward_merge_kernel(CUTE_GRID_CONSTANT ForwardMergeParams const p) {
  const int64_t warp = (int64_t(blockIdx.x) * kMergeThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= p.items * p.rows) return;
  const int64_t item = warp / p.rows;
  const int64_t row = warp % p.rows;
  // Part i of this row: its lse at lse_parts[i * rows], its output at out_parts[i * rows * H].
  const float* lse_parts = p.lse_parts + item * p.parts * p.rows + row;
  const Element* out_parts = static_cast<const Element*>(p.out_parts) +
                             (item * p.parts * p.rows + row) * p.head_dim;
  const int64_t out_part_stride = int64_t(p.rows) * p.head_dim;

  float max_lse = -INFINITY;
  for (int i = lane; i < p.parts; i += 32) max_lse = fmaxf(max_lse, lse_parts[i * p.rows]);
  for (int offset = 16; offset > 0; offset /= 2) {
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  }
  // A row no part saw a key of keeps lse = -inf and an output of 0 (the kernel's dead rows).
  const bool live = max_lse != -INFINITY;
  float sum = 0.f;
  for (int i = lane; i < p.parts; i += 32) {
    sum += live ? expf(lse_parts[i * p.rows] - max_lse) : 0.f;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float lse = live ? max_lse + logf(sum) : -INFINITY;

  struct alignas(8) Columns {
    Element x[kMergeColumnsPerLoad];
  };
  Element* out = static_cast<Element*>(p.out) + (item * p.rows + row) * p.head_dim;
  for (int col = lane * kMergeColumnsPerLoad; col < p.head_dim; col += 32 * kMergeColumnsPerLoad) {
    float acc[kMergeColumnsPerLoad] = {};
    for (int first = 0; first < p.parts; first += 32) {
      // Lane l holds the weight of part first + l; the parts' loads go out in groups.
      const int part = first + lane;
      const float lane_weight = live && part < p.parts ? expf(lse_parts[part * p.rows] - lse) : 0.f;
      const int count = min(32, p.parts - first);
      for (int group = 0; group < count; group += kMergePartsInFlight) {
        Columns parts[kMergePartsInFlight];
        CUTE_UNROLL
        for (int j = 0; j < kMergePartsInFlight; ++j) {
          if (group + j < count) {
            parts[j] = *reinterpret_cast<const Columns*>(
                out_parts + (first + group + j) * out_part_stride + col);
          }
        }
        CUTE_UNROLL
        for (int j = 0; j < kMergePartsInFlight; ++j) {
          const float weight = __shfl_sync(0xffffffffu, lane_weight, (group + j) % 32);
          if (group + j < count) {
            CUTE_UNROLL
            for (int c = 0; c < kMergeColumnsPerLoad; ++c) acc[c] += weight * float(parts[j].x[c]);
          }
        }
      }
    }
    Columns merged;
    CUTE_UNROLL
    for (int c = 0; c < kMergeColumnsPerLoad; ++c) merged.x[c] = Element(acc[c]);
    *reinterpret_cast<Columns*>(out + col) = merged;
  }
  if (lane == 0) p.lse[item * p.rows + row] = lse;
}

}  // namespace jax_flash::sm90
