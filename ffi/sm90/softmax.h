/*! \file softmax.h
    \brief Online softmax over the rows a consumer thread holds (two per 64-row atom).

    The running maximum is kept on raw logits; exponentials are exp2(s * scale_log2 - m), one
    FFMA and one MUFU.EX2 per element (the host guarantees scale > 0, so max commutes with the
    scaling). Row sums stay per thread and are reduced across the quad once, at the end.
    Rows without a visible key keep max = -inf: their exponent base is taken as 0, so every term
    is exp2(-inf) = 0 and no -inf - (-inf) NaN appears; finalize gives them O = 0, lse = -inf.
*/
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

//! kChains: the row maximum and sum run in up to this many chains (chained_reduce).
//! kRoundedProducts: each s * scale_log2 is rounded before the maximum's is subtracted, instead
//! of one FFMA. With logits near the float range (biases of 1e30 used as masks), the FFMA
//! leaves the rounding residue of max * scale_log2, up to an ulp of it, in every exponent: exp2
//! of that overflows. Rounded, the row's maximum gives exactly exp2(0) and every exponent is
//! consistent across blocks.
template <int kRows, bool kRoundedProducts, int kChains>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  //! Replaces the rowcol view `s` of a logits block by its unnormalised probabilities and
  //! returns, per row, the factor by which earlier accumulations must be rescaled.
  template <bool kFirst, class TensorS>
  CUTE_DEVICE cute::array<float, kRows> step(TensorS& s) {
    static_assert(decltype(size<0>(s))::value == kRows);
    cute::array<float, kRows> rescale;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      constexpr int kColumns = decltype(size<1>(s))::value;
      const float block_max = quad_allreduce(
          chained_reduce<kColumns, kChains>([&](int c) { return s(r, c); }, MaxOp{}), MaxOp{});
      const float new_max = fmaxf(row_max[r], block_max);
      const float base = __fmul_rn(new_max == -INFINITY ? 0.f : new_max, scale_log2);
      if constexpr (kFirst) {
        rescale[r] = 1.f;
      } else {
        // exp2(-inf) = 0 for empty history.
        rescale[r] = fast_exp2(kRoundedProducts ? __fmul_rn(row_max[r], scale_log2) - base
                                                : row_max[r] * scale_log2 - base);
      }
      row_max[r] = new_max;
      const float sum = chained_reduce<kColumns, kChains>(
          [&](int c) {
            s(r, c) = fast_exp2(kRoundedProducts ? __fmul_rn(s(r, c), scale_log2) - base
                                                 : fmaf(s(r, c), scale_log2, -base));
            return s(r, c);
          },
          SumOp{});
      row_sum[r] = kFirst ? sum : fmaf(row_sum[r], rescale[r], sum);
    }
    return rescale;
  }

  //! Final normalisation: returns 1/sum per row (0 for rows without a visible key or marked
  //! dead) and writes the natural-log log-sum-exp into `lse`.
  CUTE_DEVICE cute::array<float, kRows> finalize(bool const (&dead)[kRows], float (&lse)[kRows]) {
    cute::array<float, kRows> inv_sum;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_allreduce(row_sum[r], SumOp{});
      const bool empty = dead[r] || !(sum > 0.f);
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      constexpr float kLn2 = 0.69314718055994530942f;
      lse[r] = empty ? -INFINITY : (row_max[r] * scale_log2 + log2f(sum)) * kLn2;
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
