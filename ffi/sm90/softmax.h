/*! \file softmax.h
    \brief Online softmax over the rows a consumer thread holds (two per 64-row atom).

    Logits arrive in the units the mainloops hold them (raw products q.k, capped or biased in
    those units); a logit map (ScaledLogits, Log2Logits, or softcap.h's SeriesCappedLogits)
    takes them to log2 units, in which the running maximum is kept, and forms each exponent in
    one FFMA (an FADD for Log2Logits), so that exp2(exponent) is one MUFU.EX2 per element. Row
    sums stay per thread and are reduced across the quad once, at the end. Rows without a
    visible key keep max = -inf: their exponent base is taken as 0, so every term is
    exp2(-inf) = 0 and no -inf - (-inf) NaN appears; finalize gives them O = 0, lse = -inf.
*/
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

//! Logits times the softmax scale in log2 units (scale_log2 = scale * log2 e, > 0, so maxima
//! commute with the scaling). kRounded: each s * scale_log2 is rounded before the base is
//! subtracted, instead of one FFMA. With logits near the float range (biases of 1e30 used as
//! masks), the FFMA leaves the rounding residue of max * scale_log2, up to an ulp of it, in
//! every exponent: exp2 of that overflows. Rounded, each exponent is the difference of two
//! rounded values, never above that of the block's maximum.
template <bool kRounded>
struct ScaledLogits {
  float scale_log2;

  CUTE_DEVICE float log2(float s) const { return __fmul_rn(s, scale_log2); }
  CUTE_DEVICE float exponent(float s, float base) const {
    return kRounded ? __fmul_rn(s, scale_log2) - base : fmaf(s, scale_log2, -base);
  }
};

//! Logits already in log2 units (capped in place, softcap.h).
struct Log2Logits {
  CUTE_DEVICE float log2(float x) const { return x; }
  CUTE_DEVICE float exponent(float x, float base) const { return x - base; }
};

//! A bound, in log2 units, that a step may take in place of the block maxima of the rows the
//! calling thread holds (`known`; the same for the quad's four threads), saving their
//! reductions. Exponents then lie at or below 0, and a row's largest probability is
//! 2^-(bound - its maximum): the caller gives a bound only where that stays normal and exact
//! in P's dtype (2^-kDistanceLog2Limit at the least), and only for blocks where every row has a
//! visible key (a row of masked logits would take a finite maximum that none of its logits
//! reaches).
struct BlockBound {
  //! How far, in log2 units, a bound or a floor of the running maxima may lie above a row's
  //! maximum: its largest probability stays at or above 2^-80, normal and as exact as ever in
  //! bfloat16 and float32 but not in float16 (least normal 2^-14).
  static constexpr double kDistanceLog2Limit = 80.0;

  bool known = false;
  float log2_max = 0.f;
};

//! Per row, the factor by which earlier accumulations must be rescaled, and whether they must
//! be (warp-uniform: after every block but the first, or with lazy rescaling only where a row
//! of the calling warp moved its maximum).
template <int kRows>
struct Rescale {
  cute::array<float, kRows> factor;
  bool needed;
};

//! kChains: the row maximum and sum run in up to this many chains (chained_reduce).
//! kLazyRescale: the running maximum moves only when a block's exceeds it by more than
//! kStaleMaxLog2, and a warp none of whose rows moved leaves the output unscaled. A stale
//! maximum leaves exponents up to that bound, probabilities up to 2^8: exact in bf16/fp16
//! (relative rounding is scale-free) and far from overflowing the float32 sums, while the
//! output's rescaling (one FMUL per accumulator element) is skipped in most blocks. Otherwise
//! the maximum is exact and the output is rescaled after every block.
template <int kRows, int kChains, bool kLazyRescale>
struct OnlineSoftmax {
  static constexpr float kStaleMaxLog2 = kLazyRescale ? 8.f : 0.f;

  float row_max[kRows];  //!< log2 units
  float row_sum[kRows];

  //! `floor_log2`: a value below which the running maxima never go (-inf: none), see
  //! exponentiate_under_floor. A row without a visible key keeps it, with a sum of 0.
  CUTE_DEVICE explicit OnlineSoftmax(float floor_log2 = -INFINITY) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = floor_log2;
      row_sum[r] = 0.f;
    }
  }

  //! The block maxima, in log2 units, of the rows of the rowcol view `s` of a logits block,
  //! whose `logits` map takes it to log2 units; `bound`, where known, stands in for them.
  //! Every thread of the warp must call it, with the same bound.known.
  template <class TensorS, class Logits>
  CUTE_DEVICE cute::array<float, kRows> block_maxima(TensorS const& s, Logits const& logits,
                                                     BlockBound bound = {}) const {
    static_assert(decltype(size<0>(s))::value == kRows);
    constexpr int kColumns = decltype(size<1>(s))::value;
    cute::array<float, kRows> block_max;
    // A warp-uniform branch around the reductions, which a known bound saves (one FMNMX per
    // logit and the quad's shuffles).
    if (bound.known) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) block_max[r] = bound.log2_max;
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        block_max[r] = logits.log2(quad_allreduce(
            chained_reduce<kColumns, kChains>([&](int c) { return s(r, c); }, MaxOp{}),
            MaxOp{}));
      }
    }
    return block_max;
  }

  //! Replaces `s` by its unnormalised probabilities, given its block maxima (block_maxima,
  //! with the same `logits`), and moves the running maxima and sums.
  template <bool kFirst, class TensorS, class Logits>
  CUTE_DEVICE Rescale<kRows> exponentiate(TensorS& s, Logits const& logits,
                                          cute::array<float, kRows> const& block_max) {
    Rescale<kRows> rescale;
    bool moved = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Selects, not branches (rows differ across the warp's quads). The maximum moves on the
      // first block (from the floor, if above it) and past the staleness bound; a NaN or -inf
      // block maximum never moves it.
      const float new_max = kFirst ? fmaxf(row_max[r], block_max[r])
                            : block_max[r] - row_max[r] > kStaleMaxLog2 ? block_max[r]
                                                                         : row_max[r];
      const float base = new_max == -INFINITY ? 0.f : new_max;
      rescale.factor[r] = kFirst ? 1.f : fast_exp2(row_max[r] - base);  // exp2(-inf) = 0
      if constexpr (kLazyRescale) moved |= new_max != row_max[r];
      row_max[r] = new_max;
      const float sum = exponentiate_row(s, r, logits, base);
      row_sum[r] = kFirst ? sum : fmaf(row_sum[r], rescale.factor[r], sum);
    }
    if constexpr (kLazyRescale) {
      rescale.needed = !kFirst && __any_sync(0xffffffffu, moved);
    } else {
      rescale.needed = !kFirst;
    }
    return rescale;
  }

  //! As exponentiate, for a block whose logits (in log2 units, by `logits`) the caller knows to
  //! lie at most a few units above the floor of the running maxima (the constructor's; finite),
  //! so that the maxima need not move: neither the block maxima nor any rescaling is computed.
  //! Exponents lie at most those units above 0; a row's largest probability lies no further
  //! below 1 than the floor lies above its maximum, which the caller keeps within BlockBound's
  //! contract. Masked rows are welcome: their terms are 0.
  template <bool kFirst, class TensorS, class Logits>
  CUTE_DEVICE Rescale<kRows> exponentiate_under_floor(TensorS& s, Logits const& logits) {
    Rescale<kRows> rescale;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      rescale.factor[r] = 1.f;
      const float sum = exponentiate_row(s, r, logits, row_max[r]);
      row_sum[r] = kFirst ? sum : row_sum[r] + sum;
    }
    rescale.needed = false;
    return rescale;
  }

  //! Replaces row r of `s` by exp2 of its exponents over `base` (by `logits`) and returns
  //! their sum.
  template <class TensorS, class Logits>
  CUTE_DEVICE static float exponentiate_row(TensorS& s, int r, Logits const& logits, float base) {
    constexpr int kColumns = decltype(size<1>(s))::value;
    return chained_reduce<kColumns, kChains>(
        [&](int c) {
          s(r, c) = fast_exp2(logits.exponent(s(r, c), base));
          return s(r, c);
        },
        SumOp{});
  }

  //! Final normalisation: returns 1/sum per row (0 for rows without a visible key or marked
  //! dead) and writes the natural-log log-sum-exp into `lse`. Branch-free, on the
  //! special-function unit: the correctly rounded division and log2f take a slow-path branch
  //! each, which serialised the rows into about 700 cycles of every tile's epilogue (H200,
  //! head dim 64), with no GEMM beside them. A sum is a normal float (its largest term is at
  //! least 2^-80, BlockBound::kDistanceLog2Limit), where one Newton step takes rcp.approx to
  //! float rounding and lg2.approx errs by less than 2^-22, below the rounding of the
  //! log-sum-exp itself.
  CUTE_DEVICE cute::array<float, kRows> finalize(bool const (&dead)[kRows], float (&lse)[kRows]) {
    cute::array<float, kRows> inv_sum;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_allreduce(row_sum[r], SumOp{});
      const bool empty = dead[r] || !(sum > 0.f);
      const float rcp = fast_rcp(sum);
      inv_sum[r] = empty ? 0.f : fmaf(rcp, fmaf(-sum, rcp, 1.f), rcp);
      constexpr float kLn2 = 0.69314718055994530942f;
      lse[r] = empty ? -INFINITY : (row_max[r] + fast_log2(sum)) * kLn2;
    }
    return inv_sum;
  }
};

//! Multiplies each row of the rowcol view `o` by factor[row].
template <class TensorO, size_t kRows>
CUTE_DEVICE void scale_rows(TensorO& o, cute::array<float, kRows> const& factor) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(o); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= factor[r];
  }
}

}  // namespace jax_flash::sm90
