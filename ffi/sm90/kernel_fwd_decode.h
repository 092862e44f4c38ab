/*! \file kernel_fwd_decode.h
    \brief The decoding forward: a split's key chunks against at most 16 packed query rows, in
           warp-level MMAs.

    A decoding step's CTA of the forward tiles computes a 64-row tile of which a few rows live
    (one query row's G heads), and walks one or two key blocks: its time is fixed costs (its
    code fetched cold, its parameters, its pipeline's set-up) more than work. This kernel is
    the small form of the same computation, for calls without mask or bias arrays, windows,
    soft-capping or segment ids: one CTA of four warps per (batch item, key/value head, key
    chunk), the rows an m16 tile of mma.sync products, each warp the owner of 32 keys of every
    128-key block. A warp loads its own keys (cp.async, zero-filled past the chunk's length)
    and keeps its own running max, sum and O, so the key loop has no CTA barrier; the four
    warps' results merge through shared memory once, into the float32 part and the
    log-sum-exp that the forward tiles' epilogue would write (jax_flash/_split_kv.py merges
    them).
*/
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cutlass/numeric_types.h>

#include "element_types.h"
#include "seqlen.h"
#include "utils.h"

namespace jax_flash::sm90 {

//! One operand's place in the problem: its own items through the batch map, then strides (in
//! elements).
struct DecodeOperand {
  DeviceBatchMap batch;
  int64_t item_stride = 0;
};

//! Where the kernel reads and writes. Rows are the packed query rows r = t*G + g of key/value
//! head k (query row t of head k*G + g; G = 2^query_group_shift, or G = 1), stepping by
//! row_stride over t and group_stride over g; the lse is laid out as the call's (items, K*G, T).
struct DecodeForwardParams {
  //! Sizes (seqlen_q: the packed rows T*G, at most kDecodeRows), the group shift, the lengths
  //! (q_seqlens in packed rows) and the batch axes, as the forward tiles read them.
  AttentionProblem problem;
  const void* q;
  const void* k;
  const void* v;
  float* out;  //!< the float32 part of each item
  float* lse;  //!< natural-log units
  DecodeOperand q_item, k_item, v_item, out_item, lse_item;
  int64_t q_head_stride, q_row_stride, q_group_stride;
  int64_t k_head_stride, k_key_stride, v_head_stride, v_key_stride;
  int64_t out_head_stride, out_row_stride, out_group_stride;
  float scale_log2;
};

inline constexpr int kDecodeRows = 16;
inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = kDecodeWarps * 32;
inline constexpr int kDecodeBlockKeys = 128;
inline constexpr int kDecodeWarpKeys = kDecodeBlockKeys / kDecodeWarps;
//! Chunks of at most this many key blocks run with one buffer of each warp's keys, longer ones
//! with two, so that the next block loads while one computes. A short chunk's second block
//! loading behind its first ran faster than both in flight from the start (H200, head dim 128,
//! 16 chunks of 256 keys: 7.17 against 7.65 us; head dim 64: 4.83 against 5.25).
inline constexpr int kDecodeShortChunkBlocks = 2;

//! The warp MMA of each 16-bit input type, accumulating in ElementAccum (float32).
template <class Element>
struct DecodeMma;
template <>
struct DecodeMma<cutlass::bfloat16_t> {
  using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct DecodeMma<cutlass::half_t> {
  using Op = cute::SM80_16x8x16_F32F16F16F32_TN;
};

//! Shared memory: rows of kHeadDim elements padded by 16 bytes, so that the eight rows of an
//! ldmatrix read fall in different banks. kStages buffers of each warp's keys: block b's K
//! buffer takes block b + kStages once b's S is computed, its V buffer once b's P V is.
template <class Element, int kHeadDim, int kStages>
struct DecodeSharedStorage {
  static constexpr int kRowElements = kHeadDim + 16 / int(sizeof(Element));
  struct alignas(16) Loads {
    Element q[kDecodeRows][kRowElements];
    Element k[kStages][kDecodeWarps][kDecodeWarpKeys][kRowElements];
    Element v[kStages][kDecodeWarps][kDecodeWarpKeys][kRowElements];
  };
  struct alignas(16) Merge {
    float max[kDecodeWarps][kDecodeRows];
    float sum[kDecodeWarps][kDecodeRows];
    float o[kDecodeWarps][kDecodeRows][kHeadDim + 4];
  };
  union {
    Loads loads;
    Merge merge;
  };
};

//! Two floats as the 16-bit pair of an MMA fragment register, the first in the low half.
template <class Element>
CUTE_DEVICE uint32_t pack_pair(float first, float second) {
  const Element pair[2] = {Element(first), Element(second)};
  return *reinterpret_cast<const uint32_t*>(pair);
}

template <class Element, int kHeadDim, int kStages>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_forward_kernel(const __grid_constant__ DecodeForwardParams p) {
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "head dims of 16n up to 128");
  static_assert(std::is_same_v<ElementAccum, float>, "the MMAs accumulate in float32");
  using Storage = DecodeSharedStorage<Element, kHeadDim, kStages>;
  using Mma = typename DecodeMma<Element>::Op;
  using Chunk = cute::uint128_t;
  constexpr int kChunkElements = 16 / int(sizeof(Element));
  constexpr int kRowChunks = kHeadDim / kChunkElements;
  constexpr int kKSteps = kHeadDim / 16;   // of Q K^T, over the head dim
  constexpr int kOutTiles = kHeadDim / 8;  // n8 tiles of O
  constexpr int kKeyTiles = kDecodeWarpKeys / 8;
  constexpr int kKeySteps = kDecodeWarpKeys / 16;  // of P V, over the warp's keys
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const int32_t item = blockIdx.x, head = blockIdx.y;
  const AttentionProblem& problem = p.problem;
  const SeqLengths lengths(problem, item);
  const int keys = lengths.kv_len, live_rows = lengths.q_len;
  const int group_shift = problem.query_group_shift, group_mask = (1 << group_shift) - 1;
  const int blocks = (keys + kDecodeBlockKeys - 1) / kDecodeBlockKeys;

  // Q: every thread a share of the rows' 16-byte chunks; rows past the live ones read as zeros.
  const Element* q = static_cast<const Element*>(p.q) +
                     p.q_item.batch(problem.batch, item) * p.q_item.item_stride +
                     head * p.q_head_stride;
  static_assert(kDecodeRows * kRowChunks % kDecodeThreads == 0, "whole chunks per thread");
  CUTE_UNROLL
  for (int j = 0; j < kDecodeRows * kRowChunks / kDecodeThreads; ++j) {
    const int i = thread + j * kDecodeThreads;
    const int row = i / kRowChunks, column = (i % kRowChunks) * kChunkElements;
    const bool live = row < live_rows;
    const Element* src = live ? q + (row >> group_shift) * p.q_row_stride +
                                    (row & group_mask) * p.q_group_stride + column
                              : q;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(
        *reinterpret_cast<const Chunk*>(src),
        *reinterpret_cast<Chunk*>(&smem.loads.q[row][column]), live);
  }
  cute::cp_async_fence();

  // This warp's 32 keys of block `block` of K or V into its buffer, as one group (empty past
  // the last block, so that every wait counts the same groups). Keys past the length read as
  // zeros: their V rows meet zero weights.
  const Element* k_head = static_cast<const Element*>(p.k) +
                          p.k_item.batch(problem.batch, item) * p.k_item.item_stride +
                          head * p.k_head_stride;
  const Element* v_head = static_cast<const Element*>(p.v) +
                          p.v_item.batch(problem.batch, item) * p.v_item.item_stride +
                          head * p.v_head_stride;
  auto load_keys = [&](const Element* base, int64_t key_stride,
                       Element (&buffer)[kDecodeWarpKeys][Storage::kRowElements], int block) {
    if (block < blocks) {
      CUTE_UNROLL
      for (int j = 0; j < kDecodeWarpKeys * kRowChunks / 32; ++j) {
        const int i = lane + j * 32;
        const int row = i / kRowChunks, column = (i % kRowChunks) * kChunkElements;
        const int key = block * kDecodeBlockKeys + warp * kDecodeWarpKeys + row;
        const bool live = key < keys;
        const Element* src = live ? base + key * key_stride + column : base;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(
            *reinterpret_cast<const Chunk*>(src), *reinterpret_cast<Chunk*>(&buffer[row][column]),
            live);
      }
    }
    cute::cp_async_fence();
  };
  CUTE_UNROLL
  for (int stage = 0; stage < kStages; ++stage) {
    load_keys(k_head, p.k_key_stride, smem.loads.k[stage][warp], stage);
    load_keys(v_head, p.v_key_stride, smem.loads.v[stage][warp], stage);
  }
  // Groups, in order: Q, then each block's K and V. Waiting for one, the 2 * kStages - 1
  // committed after it may still be in flight.
  constexpr int kGroupsAhead = 2 * kStages - 1;

  // Q is the oldest group; every warp reads all of it (its A fragments, from shared memory at
  // each block: kept in registers they would crowd out the loads' addresses).
  cute::cp_async_wait<kGroupsAhead + 1>();
  __syncthreads();

  // Rows lane / 4 and lane / 4 + 8 of this warp's running statistics, in raw logits (the scale
  // is positive, so maxima commute with it).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float o[kOutTiles][4];
  CUTE_UNROLL
  for (int n = 0; n < kOutTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  for (int block = 0; block < blocks; ++block) {
    const int stage = block % kStages;
    cute::cp_async_wait<kGroupsAhead>();  // this block's K
    __syncwarp();
    float s[kKeyTiles][4];
    CUTE_UNROLL
    for (int n = 0; n < kKeyTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    {
      // Q: matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15 of a k step); K: matrices (keys 0-7
      // | 8-15 of a key tile pair) x (columns 0-7 | 8-15 of a k step).
      const int q_row = (lane % 8) + 8 * ((lane / 8) % 2), q_column = 8 * (lane / 16);
      const int row = (lane % 8) + 8 * (lane / 16), column = 8 * ((lane / 8) % 2);
      CUTE_UNROLL
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[4];
        cute::SM75_U32x4_LDSM_N::copy(
            *reinterpret_cast<const Chunk*>(&smem.loads.q[q_row][kk * 16 + q_column]), a[0], a[1],
            a[2], a[3]);
        CUTE_UNROLL
        for (int n = 0; n < kKeyTiles; n += 2) {
          uint32_t b[4];
          cute::SM75_U32x4_LDSM_N::copy(
              *reinterpret_cast<const Chunk*>(
                  &smem.loads.k[stage][warp][n * 8 + row][kk * 16 + column]),
              b[0], b[1], b[2], b[3]);
          Mma::fma(s[n][0], s[n][1], s[n][2], s[n][3], a[0], a[1], a[2], a[3], b[0], b[1],
                   s[n][0], s[n][1], s[n][2], s[n][3]);
          Mma::fma(s[n + 1][0], s[n + 1][1], s[n + 1][2], s[n + 1][3], a[0], a[1], a[2], a[3],
                   b[2], b[3], s[n + 1][0], s[n + 1][1], s[n + 1][2], s[n + 1][3]);
        }
      }
    }
    __syncwarp();
    load_keys(k_head, p.k_key_stride, smem.loads.k[stage][warp], block + kStages);
    // Keys past the length take no weight.
    const int first_key = block * kDecodeBlockKeys + warp * kDecodeWarpKeys + 2 * (lane % 4);
    if (first_key + kDecodeWarpKeys > keys) {
      CUTE_UNROLL
      for (int n = 0; n < kKeyTiles; ++n) {
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) {
          if (first_key + n * 8 + (e % 2) >= keys) s[n][e] = -INFINITY;
        }
      }
    }
    // Online softmax of the warp's rows: element e of a tile is row lane / 4 + 8 * (e / 2).
    float rescale[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int n = 0; n < kKeyTiles; ++n) m = fmaxf(m, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      // A row with no visible key yet keeps base 0: exp2(-inf) = 0, no inf - inf.
      const float base = m == -INFINITY ? 0.f : m * p.scale_log2;
      rescale[r] = fast_exp2(row_max[r] * p.scale_log2 - base);
      row_max[r] = m;
      float sum = 0.f;
      CUTE_UNROLL
      for (int n = 0; n < kKeyTiles; ++n) {
        CUTE_UNROLL
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[n][e] = fast_exp2(fmaf(s[n][e], p.scale_log2, -base));
          sum += s[n][e];
        }
      }
      row_sum[r] = fmaf(row_sum[r], rescale[r], sum);
    }
    CUTE_UNROLL
    for (int n = 0; n < kOutTiles; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) o[n][e] *= rescale[e / 2];
    }
    // The S accumulators of key tiles 2j, 2j + 1 are the A fragment of k step j of P V.
    uint32_t p_frag[kKeySteps][4];
    CUTE_UNROLL
    for (int j = 0; j < kKeySteps; ++j) {
      p_frag[j][0] = pack_pair<Element>(s[2 * j][0], s[2 * j][1]);
      p_frag[j][1] = pack_pair<Element>(s[2 * j][2], s[2 * j][3]);
      p_frag[j][2] = pack_pair<Element>(s[2 * j + 1][0], s[2 * j + 1][1]);
      p_frag[j][3] = pack_pair<Element>(s[2 * j + 1][2], s[2 * j + 1][3]);
    }
    cute::cp_async_wait<kGroupsAhead>();  // this block's V
    __syncwarp();
    {
      // Transposed matrices (keys 0-7 | 8-15 of a k step) x (columns 0-7 | 8-15 of an output
      // tile pair).
      const int row = (lane % 8) + 8 * ((lane / 8) % 2), column = 8 * (lane / 16);
      CUTE_UNROLL
      for (int j = 0; j < kKeySteps; ++j) {
        CUTE_UNROLL
        for (int n = 0; n < kOutTiles; n += 2) {
          uint32_t b[4];
          cute::SM75_U16x8_LDSM_T::copy(
              *reinterpret_cast<const Chunk*>(
                  &smem.loads.v[stage][warp][j * 16 + row][n * 8 + column]),
              b[0], b[1], b[2], b[3]);
          Mma::fma(o[n][0], o[n][1], o[n][2], o[n][3], p_frag[j][0], p_frag[j][1],
                   p_frag[j][2], p_frag[j][3], b[0], b[1], o[n][0], o[n][1], o[n][2], o[n][3]);
          Mma::fma(o[n + 1][0], o[n + 1][1], o[n + 1][2], o[n + 1][3], p_frag[j][0],
                   p_frag[j][1], p_frag[j][2], p_frag[j][3], b[2], b[3], o[n + 1][0],
                   o[n + 1][1], o[n + 1][2], o[n + 1][3]);
        }
      }
    }
    __syncwarp();
    load_keys(v_head, p.v_key_stride, smem.loads.v[stage][warp], block + kStages);
  }

  // The four warps' statistics and O merge in shared memory (over the loads' buffers).
  cute::cp_async_wait<0>();
  __syncthreads();
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    if (lane % 4 == 0) {
      smem.merge.max[warp][lane / 4 + 8 * r] = row_max[r];
      smem.merge.sum[warp][lane / 4 + 8 * r] = row_sum[r];
    }
  }
  __syncthreads();
  auto merged_max = [&](int row) {
    float m = smem.merge.max[0][row];
    CUTE_UNROLL
    for (int w = 1; w < kDecodeWarps; ++w) m = fmaxf(m, smem.merge.max[w][row]);
    return m;
  };
  // A warp's weight in the merge: exp2 of its maximum's distance below the row's (0 for a warp
  // that saw no key of the row).
  auto weight = [&](float warp_max, float m) {
    return warp_max == -INFINITY ? 0.f : fast_exp2((warp_max - m) * p.scale_log2);
  };
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    const float factor = weight(row_max[r], merged_max(row));
    CUTE_UNROLL
    for (int n = 0; n < kOutTiles; ++n) {
      *reinterpret_cast<float2*>(&smem.merge.o[warp][row][n * 8 + 2 * (lane % 4)]) =
          make_float2(o[n][2 * r] * factor, o[n][2 * r + 1] * factor);
    }
  }
  __syncthreads();

  // Thread t: row t / 8, kHeadDim / 8 columns from (t % 8) * kHeadDim / 8.
  constexpr int kThreadsPerRow = kDecodeThreads / kDecodeRows;
  constexpr int kColumnsPerThread = kHeadDim / kThreadsPerRow;
  const int row = thread / kThreadsPerRow;
  if (row >= problem.seqlen_q) return;
  const float m = merged_max(row);
  float sum = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < kDecodeWarps; ++w) {
    sum += smem.merge.sum[w][row] * weight(smem.merge.max[w][row], m);
  }
  // Dead rows (past the query length) and rows that saw no key: O = 0, lse = -inf.
  const bool empty = row >= live_rows || !(sum > 0.f);
  const float rcp = fast_rcp(sum);
  const float inv_sum = empty ? 0.f : fmaf(rcp, fmaf(-sum, rcp, 1.f), rcp);
  const int query_row = row >> group_shift, member = row & group_mask;
  float* out = p.out + p.out_item.batch(problem.batch, item) * p.out_item.item_stride +
               head * p.out_head_stride + query_row * p.out_row_stride +
               member * p.out_group_stride;
  const int first_column = (thread % kThreadsPerRow) * kColumnsPerThread;
  CUTE_UNROLL
  for (int c = first_column; c < first_column + kColumnsPerThread; c += 4) {
    float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
    CUTE_UNROLL
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float4 part = *reinterpret_cast<const float4*>(&smem.merge.o[w][row][c]);
      total.x += part.x;
      total.y += part.y;
      total.z += part.z;
      total.w += part.w;
    }
    *reinterpret_cast<float4*>(out + c) =
        make_float4(total.x * inv_sum, total.y * inv_sum, total.z * inv_sum, total.w * inv_sum);
  }
  if (thread % kThreadsPerRow == 0) {
    // The call's lse layout: row t*G + g of head k at (k*G + g, t).
    constexpr float kLn2 = 0.69314718055994530942f;
    const int query_rows = problem.seqlen_q >> group_shift;
    p.lse[p.lse_item.batch(problem.batch, item) * p.lse_item.item_stride + head * problem.seqlen_q +
          member * query_rows + query_row] =
        empty ? -INFINITY : (m * p.scale_log2 + fast_log2(sum)) * kLn2;
  }
}

}  // namespace jax_flash::sm90
