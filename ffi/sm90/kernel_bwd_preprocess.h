/*! \file kernel_bwd_preprocess.h
    \brief The backward's first kernel: per query row, the row term D = rowsum(dO * O) - dlse
           and the log-sum-exp in base 2, into padded fp32 arrays the main kernel loads with
           its query blocks. Rows that see no key (lse = -inf) and padding rows past the
           sequence get +inf, so that every probability recomputed from them is exactly 0.
           Each CTA also clears its rows of the fp32 dQ accumulator (and, for the ordered
           reduction, the counters of the query blocks that start in them), so the backward
           needs no separate memset pass. Head-dim generic: one instantiation per input type.
*/
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "seqlen.h"
#include "utils.h"

namespace jax_flash::sm90 {

template <class Element>
struct BackwardPreprocessParams {
  const Element* out;   //!< (items, T, N, H)
  const Element* dout;  //!< (items, T, N, H)
  const float* lse;     //!< (items, N, T)
  const float* dlse;    //!< (items, N, T)
  int64_t out_item_stride, dout_item_stride, lse_item_stride, dlse_item_stride;
  DeviceBatch batch;
  DeviceBatchMap out_batch, dout_batch, lse_batch, dlse_batch;
  int32_t seqlen_q, num_heads, head_dim;
  int32_t padded_rows;        //!< rows per (batch, head) in the results: query blocks * block_m
  int32_t lanes_per_row_log2;  //!< threads that share one row (each reads 8 elements at a time)
  float* lse_log2;   //!< (batch, N, padded_rows)
  float* row_term;   //!< (batch, N, padded_rows)
  float* dq_accum;   //!< (batch, N, padded_rows, dq_row_floats), cleared
  int32_t dq_row_floats;  //!< floats per accumulator row: the tile's head dim, a multiple of 4
  int* dq_semaphore;  //!< (batch, N, padded_rows / block_m), cleared; nullptr when unordered
  int32_t block_m;
};

inline constexpr int kPreprocessThreads = 256;

template <class Element>
__global__ void __launch_bounds__(kPreprocessThreads)
    backward_preprocess_kernel(CUTE_GRID_CONSTANT BackwardPreprocessParams<Element> const p) {
  constexpr int kVector = 8;  // 16 bytes of 16-bit elements
  const int lanes = 1 << p.lanes_per_row_log2;
  const int rows_per_cta = kPreprocessThreads >> p.lanes_per_row_log2;
  const int row_blocks = (p.padded_rows + rows_per_cta - 1) / rows_per_cta;
  int tile = blockIdx.x;
  const int row_block = tile % row_blocks;
  tile /= row_blocks;
  const int head = tile % p.num_heads;
  const int batch = tile / p.num_heads;
  const int first_row = row_block * rows_per_cta;
  const int row = first_row + (threadIdx.x >> p.lanes_per_row_log2);
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t head_rows = (int64_t(batch) * p.num_heads + head) * p.padded_rows;

  // The accumulator rows of this CTA are contiguous (whatever order the main kernel keeps
  // inside a query block, a block's rows occupy their own span of the array).
  float4* accum = reinterpret_cast<float4*>(p.dq_accum + (head_rows + first_row) * p.dq_row_floats);
  const int accum_vectors = min(rows_per_cta, p.padded_rows - first_row) * p.dq_row_floats / 4;
  for (int i = threadIdx.x; i < accum_vectors; i += kPreprocessThreads) {
    accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq_semaphore != nullptr && lane == 0 && row < p.padded_rows && row % p.block_m == 0) {
    p.dq_semaphore[(head_rows + row) / p.block_m] = 0;
  }

  float dot = 0.f;
  if (row < p.seqlen_q) {
    const int64_t offset = (int64_t(row) * p.num_heads + head) * p.head_dim;
    const Element* o = p.out + p.out_batch(p.batch, batch) * p.out_item_stride + offset;
    const Element* d = p.dout + p.dout_batch(p.batch, batch) * p.dout_item_stride + offset;
    using Vector = cutlass::Array<Element, kVector>;
    cutlass::NumericArrayConverter<float, Element, kVector> to_float;
    for (int col = lane * kVector; col < p.head_dim; col += lanes * kVector) {
      const auto ov = to_float(*reinterpret_cast<const Vector*>(o + col));
      const auto dv = to_float(*reinterpret_cast<const Vector*>(d + col));
      CUTE_UNROLL
      for (int i = 0; i < kVector; ++i) dot = fmaf(ov[i], dv[i], dot);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2) {
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  }
  if (lane == 0 && row < p.padded_rows) {
    float lse_log2 = INFINITY;
    float term = 0.f;
    if (row < p.seqlen_q) {
      const int64_t stat = int64_t(head) * p.seqlen_q + row;
      const float lse = p.lse[p.lse_batch(p.batch, batch) * p.lse_item_stride + stat];
      const float dlse = p.dlse[p.dlse_batch(p.batch, batch) * p.dlse_item_stride + stat];
      lse_log2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
      term = dot - dlse;
    }
    p.lse_log2[head_rows + row] = lse_log2;
    p.row_term[head_rows + row] = term;
  }
}

}  // namespace jax_flash::sm90
