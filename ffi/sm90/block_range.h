/*! \file block_range.h
    \brief Which blocks of the (query, key) plane can hold a visible pair, seen from either axis:
           the key blocks a query block must visit (forward) and the query blocks a key block
           must visit (backward), and which blocks need per-element masking. One rule for both
           passes, so the backward visits exactly the pairs the forward summed.

    Key j is visible to query i iff i < q_len, j < kv_len, and, where bounded,
    i - window_left <= j <= i + window_right (causal: window_right == 0).
*/
#pragma once

#include <cstdint>

#include <cute/config.hpp>
#include <cute/numeric/math.hpp>

#include "seqlen.h"

namespace jax_flash::sm90 {

//! A half-open range [begin, end) of block indices; empty when end <= begin.
struct BlockSpan {
  int32_t begin;
  int32_t end;
  CUTE_HOST_DEVICE bool empty() const { return end <= begin; }
};

template <int kBlockM, int kBlockN>
struct BlockRange {
  //! The blocks of kPartner positions along one axis that hold a position visible to some
  //! position of block `block` (kOwn positions) along the other: own positions below own_len,
  //! partners below partner_len and, where bounded (>= 0), own - lower <= partner <= own +
  //! upper. Exact: empty when no pair is visible.
  template <int kOwn, int kPartner>
  CUTE_HOST_DEVICE static BlockSpan partner_blocks(int32_t block, int32_t own_len,
                                                   int32_t partner_len, int32_t lower,
                                                   int32_t upper) {
    const int32_t start = block * kOwn;
    const int32_t end = cute::min(start + kOwn, own_len);
    const int32_t first = lower >= 0 ? cute::max(0, start - lower) : 0;
    const int32_t last = upper >= 0 ? cute::min(partner_len, end + upper) : partner_len;
    if (start >= own_len || first >= last) return {0, 0};
    return {first / kPartner, (last + kPartner - 1) / kPartner};
  }

  //! Key blocks that hold a key visible to some row of query block m_block.
  CUTE_HOST_DEVICE static BlockSpan key_blocks(AttentionProblem const& p, SeqLengths const& lens,
                                               int32_t m_block) {
    return partner_blocks<kBlockM, kBlockN>(m_block, lens.q_len, lens.kv_len, p.window_left,
                                            p.window_right);
  }

  //! Query blocks with a row that sees some key of key block n_block (j <= i + right and
  //! j >= i - left read from the key's side).
  CUTE_HOST_DEVICE static BlockSpan query_blocks(AttentionProblem const& p, SeqLengths const& lens,
                                                 int32_t n_block) {
    return partner_blocks<kBlockN, kBlockM>(n_block, lens.kv_len, lens.q_len, p.window_right,
                                            p.window_left);
  }

  //! Whether block (m_block, n_block) holds a pair that must not be seen (a key past kv_len, a
  //! window boundary, and with kMaskQueryTail a query row past q_len); only such blocks pay
  //! for masking. The forward leaves query rows past q_len unmasked: only their own outputs,
  //! which are discarded, read them. The backward masks them, since every key's dK and dV sum
  //! over the queries' rows (whose Q and dO past q_len may hold anything).
  template <bool kMaskQueryTail>
  CUTE_DEVICE static bool needs_mask(AttentionProblem const& p, SeqLengths const& lens,
                                     int32_t m_block, int32_t n_block) {
    const int32_t m_start = m_block * kBlockM;
    const int32_t n_start = n_block * kBlockN;
    bool mask = n_start + kBlockN > lens.kv_len;
    if constexpr (kMaskQueryTail) mask |= m_start + kBlockM > lens.q_len;
    if (p.window_right >= 0) mask |= n_start + kBlockN - 1 > m_start + p.window_right;
    if (p.window_left >= 0) mask |= n_start < m_start + kBlockM - 1 - p.window_left;
    return mask;
  }
};

}  // namespace jax_flash::sm90
