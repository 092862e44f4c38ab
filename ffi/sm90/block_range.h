/*! \file block_range.h
    \brief Which blocks of the (query, key) plane can hold a visible pair, seen from either axis:
           the key blocks a query block must visit (forward) and the query blocks a key block
           must visit (backward), and which blocks need per-element masking. One rule for both
           passes, so the backward visits exactly the pairs the forward summed.

    Key j is visible to query i iff i < q_len, j < kv_len, and, where bounded,
    i - window_left <= j <= i + window_right (causal: window_right == 0); with segment ids,
    also q_ids[i] == kv_ids[j], which SegmentReach bounds by the ids' spans; with a mask array,
    also mask[i, j], which its block classes bound (narrow_by_mask).
*/
#pragma once

#include <cstdint>
#include <type_traits>

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

//! Segment ids seen from one tile, over its own positions [begin, end) of one batch item (queries
//! in the forward, keys in the backward): the partners that share a segment with some of them
//! (the union of their spans: blocks outside it are skipped) and those that share it with every
//! one of them (the intersection: blocks inside it need no per-element test). Without segment
//! ids, every partner is in both.
struct SegmentReach {
  int32_t some_begin = 0, some_end = INT32_MAX;
  int32_t every_begin = 0, every_end = INT32_MAX;
  bool exact = true;  //!< every span exact: a row's partners in its span all share its id

  //! From the spans (own positions x [lo, hi)) of one batch item, over the own positions
  //! [begin, end), at most kPositions of them. A collective of the whole warp, each lane
  //! reading every 32nd position (all loads in flight together); every lane returns the same
  //! reach. An empty span leaves the intersection empty; an inexact one (lo < 0) counts as the
  //! whole axis and leaves the intersection empty.
  template <int kPositions>
  CUTE_DEVICE static SegmentReach of(const int32_t* spans, int32_t begin, int32_t end) {
    int32_t some_begin = INT32_MAX, some_end = INT32_MIN;
    int32_t every_begin = INT32_MIN, every_end = INT32_MAX;
    bool exact = true;
    CUTE_UNROLL
    for (int k = 0; k < (kPositions + 31) / 32; ++k) {
      const int32_t i = begin + int32_t(threadIdx.x % 32) + 32 * k;
      if (i >= end) continue;
      const int2 span = *reinterpret_cast<const int2*>(spans + 2 * int64_t(i));
      const int32_t lo = max(span.x, 0);
      if (lo < span.y) {
        some_begin = min(some_begin, lo);
        some_end = max(some_end, span.y);
      }
      exact &= span.x >= 0;
      every_begin = max(every_begin, span.x < 0 ? INT32_MAX : lo);
      every_end = min(every_end, span.y);
    }
    constexpr unsigned kWarp = 0xffffffffu;
    return {__reduce_min_sync(kWarp, some_begin), __reduce_max_sync(kWarp, some_end),
            __reduce_max_sync(kWarp, every_begin), __reduce_min_sync(kWarp, every_end),
            bool(__all_sync(kWarp, exact))};
  }

  //! The blocks of `blocks` (kPartner positions each) that hold a partner of some own position.
  template <int kPartner>
  CUTE_DEVICE BlockSpan narrow(BlockSpan blocks) const {
    if (some_end <= some_begin) return {0, 0};
    return {max(blocks.begin, some_begin / kPartner),
            min(blocks.end, (some_end + kPartner - 1) / kPartner)};
  }

  //! Whether every partner in [begin, end) shares the segment of every own position.
  CUTE_DEVICE bool every_covers(int32_t begin, int32_t end) const {
    return begin >= every_begin && end <= every_end;
  }
};

//! The reach of a tile without segment ids: every partner, known at compile time.
struct NoSegmentReach {
  static constexpr bool exact = true;
  CUTE_DEVICE static constexpr bool every_covers(int32_t, int32_t) { return true; }
};

template <bool kSegments>
using SegmentReachOf = std::conditional_t<kSegments, SegmentReach, NoSegmentReach>;

//! The blocks of `blocks` (partners of block `own` along the other axis) that a mask array
//! leaves non-empty, from the first to the last of them (empty blocks between stay in the span
//! and are skipped where visited). Query blocks index the classes' rows: with kOwnIsKeyBlock
//! `own` is a key block and the partners query blocks. A collective of the whole warp, each
//! lane reading every 32nd class; every lane returns the same span.
template <bool kOwnIsKeyBlock>
CUTE_DEVICE BlockSpan narrow_by_mask(MaskArray const& array, MaskView const& mask, int32_t own,
                                     BlockSpan blocks) {
  int32_t first = INT32_MAX, last = INT32_MIN;
#pragma unroll 4
  for (int32_t b = blocks.begin + int32_t(threadIdx.x % 32); b < blocks.end; b += 32) {
    const MaskBlock c = kOwnIsKeyBlock ? mask.block(array, b, own) : mask.block(array, own, b);
    if (c != MaskBlock::kEmpty) {
      first = min(first, b);
      last = max(last, b);
    }
  }
  constexpr unsigned kWarp = 0xffffffffu;
  first = __reduce_min_sync(kWarp, first);
  last = __reduce_max_sync(kWarp, last);
  return first > last ? BlockSpan{0, 0} : BlockSpan{first, last + 1};
}

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
