/*! \file kernel_fwd_merge.h
    \brief The merge of a forward split along the keys (jax_flash/_split_kv.py): each part
           attended one chunk of the keys and holds a normalised output (float32) and its
           log-sum-exp; the whole row's lse is the log-sum-exp of the parts' lses, and its
           output the sum of the parts' outputs weighted by exp(lse_part - lse). The parts come
           in the forward's layout of packed query heads or in the call's, the merged rows go
           out in the call's (T, N, H) and (N, T). A group of up to kMergeMaxLanes threads per
           (item, row, kMergeColumns columns).
*/
#pragma once

#include <cute/config.hpp>
#include <cutlass/fast_math.h>

#include "launch.h"

namespace jax_flash::sm90 {

//! Threads per block, and fewer where that many would leave SMs without a block: a decoding
//! step's few rows then spread over more SMs, which share the loads of the parts from L2 (on
//! an H200, one row of 32 heads from 16 float32 parts: 2.08 us in blocks of 64 threads, 2.18 in
//! blocks of 256; 16 rows: 3.14 against 2.91 us).
inline constexpr int kMergeThreads = 256, kMergeFewThreads = 64;
//! Output columns a thread merges (16 bytes of a float32 part).
inline constexpr int kMergeColumns = 4;
//! The most lanes that share a row's parts (MergeShape).
inline constexpr int kMergeMaxLanes = 4;

//! The merge of kMergeColumns output columns of one row, by kLanes adjacent lanes: lane l takes
//! parts l, l + kLanes, ..., loading kInFlight of them before it adds any (the loads are in
//! flight together), then the lanes combine what they hold. Most of the merge's time is its
//! instructions, not its loads: lanes share a row's parts, and a merge of few parts loads as
//! many as it has (kInFlight rounded up), so that no thread runs instructions for absent ones.
template <int kLanes, int kInFlight>
struct MergeShape {
  static_assert(kLanes >= 1 && kLanes <= kMergeMaxLanes && (kLanes & (kLanes - 1)) == 0,
                "lanes that share a row's parts: a power of two up to kMergeMaxLanes");
  static constexpr int lanes = kLanes;
  static constexpr int in_flight = kInFlight;
};

//! Merges kMergeColumns output columns of one row over its `parts` parts, with the other
//! Shape::lanes - 1 lanes of its group (`lane`: its index there): part i's lse at
//! lse_parts[i * lse_stride], its columns at out_parts[i * out_stride]. The group's lane 0 writes
//! the merged columns to `out` and, where `lse` is not null, the merged lse there. A row no part
//! saw a key of keeps lse = -inf and an output of 0 (the forward's dead rows).
template <class Shape, class Element>
CUTE_DEVICE void merge_row_columns(const float* lse_parts, int64_t lse_stride,
                                   const float* out_parts, int64_t out_stride, int parts,
                                   int lane, Element* out, float* lse) {
  constexpr int kLanes = Shape::lanes, kInFlight = Shape::in_flight;
  static_assert(kMergeColumns == 4, "a part's columns are one float4 load");
  struct alignas(4 * sizeof(Element)) Columns {
    Element x[kMergeColumns];
  };
  // The running combination of the lane's parts so far, relative to their largest lse (as the
  // forward's online softmax): the weights' sum and the weighted columns. The exponentials and
  // the logarithm on the special-function unit (__expf: relative error about 2^-21 for the
  // weights near 1 that the sum and the lse depend on; weights of far smaller parts carry more,
  // but add that little).
  float max_lse = -INFINITY, sum = 0.f, acc[kMergeColumns] = {};
  for (int first = lane; first < parts; first += kLanes * kInFlight) {
    float part_lse[kInFlight];
    float4 part_columns[kInFlight];
    CUTE_UNROLL
    for (int j = 0; j < kInFlight; ++j) {
      const int part = first + j * kLanes;
      const bool present = part < parts;
      part_lse[j] = present ? lse_parts[part * lse_stride] : -INFINITY;
      part_columns[j] = present ? *reinterpret_cast<const float4*>(out_parts + part * out_stride)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float new_max = max_lse;
    CUTE_UNROLL
    for (int j = 0; j < kInFlight; ++j) new_max = fmaxf(new_max, part_lse[j]);
    if (new_max == -INFINITY) continue;  // no part so far saw a key
    const float rescale = __expf(max_lse - new_max);  // 0 while max_lse is -inf
    sum *= rescale;
    CUTE_UNROLL
    for (int c = 0; c < kMergeColumns; ++c) acc[c] *= rescale;
    CUTE_UNROLL
    for (int j = 0; j < kInFlight; ++j) {
      const float weight = __expf(part_lse[j] - new_max);  // 0 for a part without keys
      const float columns[kMergeColumns] = {part_columns[j].x, part_columns[j].y,
                                            part_columns[j].z, part_columns[j].w};
      sum += weight;
      CUTE_UNROLL
      for (int c = 0; c < kMergeColumns; ++c) acc[c] += weight * columns[c];
    }
    max_lse = new_max;
  }
  if constexpr (kLanes > 1) {
    // The group's lanes, adjacent and aligned within the warp, all present (a group past its
    // item's rows returns as a whole).
    const unsigned group_mask = ((1u << kLanes) - 1) << ((threadIdx.x % 32) & ~(kLanes - 1));
    float group_max = max_lse;
    CUTE_UNROLL
    for (int offset = 1; offset < kLanes; offset *= 2) {
      group_max = fmaxf(group_max, __shfl_xor_sync(group_mask, group_max, offset, kLanes));
    }
    const float rescale = group_max == -INFINITY ? 0.f : __expf(max_lse - group_max);
    sum *= rescale;
    CUTE_UNROLL
    for (int c = 0; c < kMergeColumns; ++c) acc[c] *= rescale;
    CUTE_UNROLL
    for (int offset = 1; offset < kLanes; offset *= 2) {
      sum += __shfl_xor_sync(group_mask, sum, offset, kLanes);
      CUTE_UNROLL
      for (int c = 0; c < kMergeColumns; ++c) {
        acc[c] += __shfl_xor_sync(group_mask, acc[c], offset, kLanes);
      }
    }
    max_lse = group_max;
    if (lane != 0) return;
  }
  const bool live = max_lse != -INFINITY;
  const float inv_sum = live ? 1.f / sum : 0.f;
  Columns merged;
  CUTE_UNROLL
  for (int c = 0; c < kMergeColumns; ++c) merged.x[c] = Element(acc[c] * inv_sum);
  *reinterpret_cast<Columns*>(out) = merged;
  if (lse != nullptr) *lse = live ? max_lse + __logf(sum) : -INFINITY;
}

//! How the parts' rows lie: in the call's layout (G = 1, K = N), in the merged output's order,
//! with one query row (whose lse is in that order too) or several; or packed in rows (T*G, K).
enum class MergeLayout { kCallOneRow, kCall, kRows };

//! The merge kernel's parameters: the call's, and the divisors of a thread's index within its
//! item as multiply-shifts (cutlass::FastDivmod, exact for the non-negative 32-bit indices
//! here). As integer divisions, the index math of packed rows was a dependent chain of four
//! divisions ahead of the first loads: on an H200, one row of 32 heads from 16 parts merged in
//! 2.08 us with them, in 1.89-1.92 us with these.
struct ForwardMergeKernelParams {
  ForwardMergeParams merge;
  cutlass::FastDivmod column_groups;  //!< head_dim / kMergeColumns: a row's groups of lanes
  cutlass::FastDivmod heads;          //!< K * G: the merged rows of one query row
  cutlass::FastDivmod group;          //!< G
};

//! One group of Shape::lanes threads per (row, kMergeColumns columns) of an item, the grid's x
//! over an item's rows and its y over the items (all of p.items), rows in the order of the
//! merged output: query row t, then key/value head k, then query head g of its group. Parts in
//! the call's layout are in that order too; their lse in (N, T) takes the row's t apart, and
//! parts in rows (T*G, K) its (t, k, g). A single row's merge, the most frequent, divides by
//! nothing but the row's column groups.
template <class Element, class Shape, MergeLayout kLayout>
__global__ void __launch_bounds__(kMergeThreads)
    forward_merge_kernel(CUTE_GRID_CONSTANT ForwardMergeKernelParams const kp) {
  ForwardMergeParams const& p = kp.merge;
  const int thread = int(blockIdx.x * blockDim.x + threadIdx.x);  // within the item
  int row, column_group;
  kp.column_groups(row, column_group, thread / Shape::lanes);
  const int rows = p.query_rows * p.kv_heads * p.group;  // per item
  if (row >= rows) return;  // past the item's rows: a lane group returns whole
  const int column = column_group * kMergeColumns;
  // The row's place among its part's rows, its part lse's at (k, t*G + g), and its merged lse's
  // at (k*G + g, t).
  int part_row = row, part_lse = row, merged_lse = row;
  if constexpr (kLayout != MergeLayout::kCallOneRow) {
    int t, head;  // head = k * G + g
    kp.heads(t, head, row);
    merged_lse = part_lse = head * p.query_rows + t;
    if constexpr (kLayout == MergeLayout::kRows) {
      int k, g;
      kp.group(k, g, head);
      part_row = (t * p.group + g) * p.kv_heads + k;
      part_lse = (k * p.query_rows + t) * p.group + g;
    }
  }
  const int64_t item = blockIdx.y;
  const int64_t first_part = item * p.parts * rows, item_row = item * rows + row;
  merge_row_columns<Shape>(
      p.lse_parts + first_part + part_lse, rows,
      p.out_parts + (first_part + part_row) * p.head_dim + column, int64_t(rows) * p.head_dim,
      p.parts, thread % Shape::lanes, static_cast<Element*>(p.out) + item_row * p.head_dim + column,
      column == 0 ? p.lse + item * rows + merged_lse : nullptr);
}

}  // namespace jax_flash::sm90
