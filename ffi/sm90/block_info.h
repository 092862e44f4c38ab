/*! \file block_info.h
    \brief Everything one (query block, head, batch) tile needs to know about its problem: which
           batch items of q/k/v it reads (vmap broadcasting), its sequence lengths, and the range
           of key blocks that can hold a visible key. Producer and consumers compute it alike.
*/
#pragma once

#include <cstdint>

#include <cute/config.hpp>

#include "../common/attention_params.h"
#include "tile_scheduler.h"

namespace jax_flash::sm90 {

//! Batch axes as the device walks them: coalesced on the host (axes of extent 1 dropped,
//! adjacent axes that every operand maps alike merged), so usually one axis, and 32-bit.
struct DeviceBatch {
  int32_t rank = 0;
  int32_t extent[kMaxBatchRank] = {};
};

//! Per operand: stride of each device batch axis in that operand's own batch items (0 where
//! the operand broadcasts the axis).
struct DeviceBatchMap {
  int32_t stride[kMaxBatchRank] = {};

  CUTE_HOST_DEVICE int32_t operator()(DeviceBatch const& batch, int32_t b) const {
    if (batch.rank <= 1) return b * stride[0];
    int32_t own = 0;
    for (int i = batch.rank - 1; i >= 0; --i) {
      own += (b % batch.extent[i]) * stride[i];
      b /= batch.extent[i];
    }
    return own;
  }
};

//! The runtime scalars of a forward problem that the device needs besides the TMA descriptors.
struct ForwardProblem {
  int32_t seqlen_q = 0;
  int32_t seqlen_k = 0;
  int32_t num_heads = 0;
  int32_t group_size = 1;  //!< query heads per key/value head
  int32_t window_left = -1;   //!< -1: unbounded
  int32_t window_right = -1;  //!< -1: unbounded
  DeviceBatch batch;
  DeviceBatchMap q_batch, k_batch, v_batch, q_seqlens_batch, kv_seqlens_batch;
  const int32_t* q_seqlens = nullptr;
  const int32_t* kv_seqlens = nullptr;
};

template <int kBlockM, int kBlockN>
struct BlockInfo {
  int32_t m_block;
  int32_t head;
  int32_t kv_head;
  int32_t out_batch;  //!< batch item of out/lse (always the full batch shape)
  int32_t q_batch, k_batch, v_batch;
  int32_t q_len, kv_len;
  int32_t n_block_min, n_block_max;  //!< key blocks [min, max) may hold visible keys

  CUTE_DEVICE BlockInfo(ForwardProblem const& p, TileCoord const& c)
      : m_block(c.m_block), head(c.head), kv_head(c.head / p.group_size), out_batch(c.batch) {
    q_batch = p.q_batch(p.batch, c.batch);
    k_batch = p.k_batch(p.batch, c.batch);
    v_batch = p.v_batch(p.batch, c.batch);
    q_len = p.seqlen_q;
    if (p.q_seqlens != nullptr) {
      q_len = max(0, min(p.seqlen_q, p.q_seqlens[p.q_seqlens_batch(p.batch, c.batch)]));
    }
    kv_len = p.seqlen_k;
    if (p.kv_seqlens != nullptr) {
      kv_len = max(0, min(p.seqlen_k, p.kv_seqlens[p.kv_seqlens_batch(p.batch, c.batch)]));
    }
    const int32_t m_start = m_block * kBlockM;
    const int32_t m_end = min(m_start + kBlockM, q_len);  // rows past q_len are padding
    int32_t kv_end = kv_len;
    if (p.window_right >= 0) kv_end = min(kv_end, m_end + p.window_right);
    n_block_max = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;
    n_block_min = p.window_left >= 0 ? max(0, m_start - p.window_left) / kBlockN : 0;
    if (m_start >= q_len) n_block_max = n_block_min;  // a block of padding rows only
  }

  CUTE_DEVICE bool empty() const { return n_block_max <= n_block_min; }
  CUTE_DEVICE int32_t m_start() const { return m_block * kBlockM; }

  //! Whether key block n holds a key some row of this block must not see (sequence tail or a
  //! window boundary); only such blocks pay for per-element masking.
  CUTE_DEVICE bool needs_mask(ForwardProblem const& p, int32_t n_block) const {
    const int32_t col_begin = n_block * kBlockN;
    const int32_t col_end = col_begin + kBlockN;
    bool mask = col_end > kv_len;
    if (p.window_right >= 0) mask |= col_end - 1 > m_start() + p.window_right;
    if (p.window_left >= 0) mask |= col_begin < m_start() + kBlockM - 1 - p.window_left;
    return mask;
  }
};

}  // namespace jax_flash::sm90
