/*! \file softcap.h
    \brief Logit soft-capping, shared by the forward and backward mainloops: a scaled logit
           x = scale * q.k becomes z = cap * tanh(x / cap) before masking and the softmax.

    The mainloops hold logits as raw products s = q.k and fold the scale into the exponent
    (exp2(s * scale * log2 e - ...)). The capped logit is stored back in those units, as
    z / scale, so the softmax, the saved log-sum-exp and P are computed as without the cap.
    The backward needs tanh'(x / cap) = 1 - t^2 with t = z / cap where it forms dS; rather than
    keeping a second register tile of t, it recovers t from P and the log-sum-exp:
    log2 P = z * log2 e - lse * log2 e. That holds because these kernels add no bias (a bias
    would be in log2 P too); launch_bwd.cuh asserts it.
*/
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace jax_flash::sm90 {

//! tanh(x) on one special-function op, to a relative error of about 2e-6 (absolute 1.3e-6 for
//! |x| >= 1/16): tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|), so 1 + e lies in [1, 2],
//! where a quadratic gives its reciprocal to 1% and one third-order Newton step to 1e-6. Below
//! 1/16, where 1 - e would cancel, x - x^3/3 + 2x^5/15 (truncation 3e-9). The capped logit's
//! error is cap times tanh's: tanh.approx.f32 (2^-11 relative) would shift probabilities by
//! percents at caps like 50.
CUTE_DEVICE float tanh_one_mufu(float x) {
  constexpr float kMinusTwoLog2e = -2.8853900817779268f;
  const float e = fast_exp2(fabsf(x) * kMinusTwoLog2e);
  const float d = 1.f + e;
  float r = fmaf(fmaf(0.32323235f, d, -1.45454555f), d, 2.12121219f);  // minimax on [1, 2]
  const float err = fmaf(-d, r, 1.f);
  r = fmaf(r, fmaf(err, err, err), r);  // r (1 + err + err^2): relative error err^3
  const float x2 = x * x;
  const float series = fmaf(x * x2, fmaf(x2, 0.13333334f, -0.33333334f), x);
  return fabsf(x) < 0.0625f ? series : copysignf((1.f - e) * r, x);
}

//! log2(x) on the special-function unit (lg2.approx); log2(0) = -inf.
CUTE_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct LogitSoftcap {
  float to_tanh;        //!< scale / cap: raw product -> tanh argument
  float from_tanh;      //!< cap / scale: tanh -> capped raw product
  float tanh_per_log2;  //!< 1 / (cap * log2 e): t from log2 P + lse * log2 e

  static LogitSoftcap make(float scale, float cap) {
    constexpr float kLog2e = 1.4426950408889634f;
    return {scale / cap, cap / scale, 1.f / (cap * kLog2e)};
  }

  //! Caps every raw product of `s` in place.
  template <class TensorS>
  CUTE_DEVICE void apply(TensorS& s) const {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = from_tanh * tanh_one_mufu(s(i) * to_tanh);
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
