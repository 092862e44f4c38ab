/*! \file softcap.h
    \brief Logit soft-capping, shared by the forward and backward mainloops: a scaled logit
           x = scale * q.k becomes z = cap * tanh(x / cap) before masking and the softmax.

    The mainloops hold logits as raw products s = q.k and fold the scale into the exponent
    (exp2(s * scale * log2 e - ...)). The capped logit is stored back in those units, as
    z / scale, so the softmax, the saved log-sum-exp and P are computed as without the cap.
    The backward needs tanh'(x / cap) = 1 - t^2 with t = z / cap where it forms dS; rather than
    keeping a second register tile of t, it recovers t from P and the log-sum-exp:
    log2 P = z * log2 e - lse * log2 e. That holds because these kernels add no bias (a bias
    would be in log2 P too; with_features never instantiates the two together). A mask array
    keeps it: masked logits have P = 0, where the factor is clamped to 0.
*/
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace jax_flash::sm90 {

//! 1/x on the special-function unit (rcp.approx, about 1 ulp; 1/inf = 0).
CUTE_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

//! 1/x for x in [1, 2] on the FMA units: a minimax quadratic (relative error 1.0e-2), then two
//! Newton steps (1e-8, below float rounding).
CUTE_DEVICE float reciprocal_one_to_two(float x) {
  float r = fmaf(fmaf(0.32323197f, x, -1.45454437f), x, 2.12121134f);
  r = fmaf(r, fmaf(-x, r, 1.f), r);
  return fmaf(r, fmaf(-x, r, 1.f), r);
}

//! Whether tiles of this head dim compute the cap's reciprocal on the FMA units. The softmax's
//! own exp2 already loads the special-function unit (SFU) by one op per logit, and at head dim
//! 64 a logit's products take half the tensor-core time they take at 128: there the SFU sets
//! the pace, and six FMAs in place of its rcp ran faster (H200, bf16, T = 4096: forward 0.49
//! of the uncapped speed against 0.45). From head dim 128 on, instruction issue binds first and
//! the SFU's rcp is the cheaper choice (0.63 against 0.59).
template <int kHeadDim>
inline constexpr bool kSoftcapReciprocalOnFma = kHeadDim <= 64;

//! log2(x) on the special-function unit (lg2.approx); log2(0) = -inf.
CUTE_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct LogitSoftcap {
  float exp2_per_raw;   //!< -2 * log2(e) * scale / cap: raw product -> log2 of exp(-2|x| / cap)
  float two_from_tanh;  //!< 2 * cap / scale
  float from_tanh;      //!< cap / scale: tanh -> capped raw product
  float tanh_per_log2;  //!< 1 / (cap * log2 e): t from log2 P + lse * log2 e

  static LogitSoftcap make(float scale, float cap) {
    constexpr float kLog2e = 1.4426950408889634f;
    return {-2.f * kLog2e * scale / cap, 2.f * cap / scale, cap / scale, 1.f / (cap * kLog2e)};
  }

  //! Caps every raw product of `s` in place, with tanh's absolute error about 2.4e-7 (two ulp
  //! of ex2, one of the reciprocal), so the capped logit errs by about cap * 2.4e-7 at most;
  //! tanh.approx.f32 (2^-11 relative) would shift probabilities by percents at caps like 50.
  //! kReciprocalOnFma (kSoftcapReciprocalOnFma) picks the unit of the reciprocal:
  //! - on the FMA units, tanh|y| = 2 / (1 + e) - 1 with e = exp(-2|y|), so the divisor stays
  //!   in [1, 2]: one SFU op and ten others per logit;
  //! - on the SFU, tanh y = 1 - 2 / (1 + exp(2y)), the sign included (exp2 overflows to +inf
  //!   for large y, whose reciprocal is 0): two SFU ops and three others.
  template <bool kReciprocalOnFma, class TensorS>
  CUTE_DEVICE void apply(TensorS& s) const {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      if constexpr (kReciprocalOnFma) {
        const float r = reciprocal_one_to_two(1.f + fast_exp2(fabsf(s(i)) * exp2_per_raw));
        s(i) = copysignf(fmaf(two_from_tanh, r, -from_tanh), s(i));
      } else {
        const float r = fast_rcp(1.f + fast_exp2(s(i) * -exp2_per_raw));
        s(i) = fmaf(-two_from_tanh, r, from_tanh);
      }
    }
  }

  //! 1 - t^2 for an element whose probability is p, in a row of log-sum-exp lse_log2 (base 2).
  //! Where p is 0 (masked, underflowed, or a row with no visible key, lse_log2 = +inf) t is
  //! clamped to -1, so the factor is 0 and never NaN; dS is 0 there anyway.
  CUTE_DEVICE float derivative(float p, float lse_log2) const {
    float t = (fast_log2(p) + lse_log2) * tanh_per_log2;
    t = fminf(fmaxf(t, -1.f), 1.f);  // fmaxf(NaN, -1) = -1
    return fmaf(-t, t, 1.f);
  }
};

}  // namespace jax_flash::sm90
