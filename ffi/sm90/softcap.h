/*! \file softcap.h
    \brief Logit soft-capping, shared by the forward and backward mainloops: a scaled logit
           x = scale * q.k becomes z = cap * tanh(x / cap) before masking and the softmax.

    The mainloops hold logits as raw products s = q.k and fold the scale into the exponent
    (exp2(s * scale * log2 e - ...)). The capped logit is stored back in those units, as
    z / scale, so the softmax, the saved log-sum-exp and P are computed as without the cap.
    Where a warp's logits of a block all lie within half the cap, tanh comes from an odd
    polynomial on the FMA units, leaving the special-function unit to the softmax's exp2 as
    without the cap; the warp's other blocks take exp and a reciprocal.
    The backward needs tanh'(x / cap) = 1 - t^2 with t = z / cap where it forms dS; rather than
    keeping a second register tile of t, it recovers t from P and the log-sum-exp:
    log2 P = z * log2 e - lse * log2 e. That holds because these kernels add no bias (a bias
    would be in log2 P too; with_features never instantiates the two together). A mask array
    keeps it: masked logits have P = 0, where the factor is clamped to 0.
*/
#pragma once

#include <cmath>

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
  //! tanh's argument y = x / cap up to which the odd polynomial serves.
  static constexpr float kSeriesReach = 0.5f;

  float exp2_per_raw;      //!< -2 * log2(e) * scale / cap: raw product -> log2 of exp(-2|x| / cap)
  float two_from_tanh;     //!< 2 * cap / scale
  float from_tanh;         //!< cap / scale: tanh -> capped raw product
  float tanh_per_log2;     //!< 1 / (cap * log2 e): t from log2 P + lse * log2 e
  float series[4];         //!< tanh(y) / y = 1 + sum_k series[k-1] * s^2k, s the raw product
  float series_limit;      //!< |raw product| of |y| = kSeriesReach (0: never the series)

  static LogitSoftcap make(float scale, float cap) {
    constexpr float kLog2e = 1.4426950408889634f;
    // tanh(y) / y for |y| <= kSeriesReach as a polynomial in y^2: the minimax fit of relative
    // error 1.3e-8 (degree 9 in y), its constant term 1. Each coefficient carries its power of
    // y / s = scale / cap, so the kernel squares s itself; below 2^-14 the last of them would
    // be subnormal, flushed to 0, and such caps take the exp form throughout. In float32, tanh
    // then errs by at most 6e-8 absolute and 1.1e-7 relative.
    constexpr double kTanhOverArg[4] = {-0.3333306939411152, 0.13324779318868757,
                                        -0.052986075371308464, 0.01713500679008545};
    const double y_per_raw = double(scale) / cap;
    LogitSoftcap cap_constants{};
    cap_constants.exp2_per_raw = -2.f * kLog2e * scale / cap;
    cap_constants.two_from_tanh = 2.f * cap / scale;
    cap_constants.from_tanh = cap / scale;
    cap_constants.tanh_per_log2 = 1.f / (cap * kLog2e);
    double power = 1.0;
    for (int k = 0; k < 4; ++k) {
      power *= y_per_raw * y_per_raw;
      cap_constants.series[k] = float(kTanhOverArg[k] * power);
    }
    cap_constants.series_limit =
        std::abs(y_per_raw) >= 0x1p-14 ? float(kSeriesReach / std::abs(y_per_raw)) : 0.f;
    return cap_constants;
  }

  //! Caps every raw product of `s` in place, with tanh's absolute error about 2.4e-7 at most,
  //! so the capped logit errs by about cap * 2.4e-7; tanh.approx.f32 (2^-11 relative) would
  //! shift probabilities by percents at caps like 50. The warp takes one form for all of its
  //! products (a uniform branch, no divergence):
  //! - all within kSeriesReach: the odd polynomial, six FMA-unit ops per logit beside the
  //!   maximum;
  //! - else exp and a reciprocal, whose unit kReciprocalOnFma (kSoftcapReciprocalOnFma) picks:
  //!   - on the FMA units, tanh|y| = 2 / (1 + e) - 1 with e = exp(-2|y|), so the divisor stays
  //!     in [1, 2]: one SFU op and ten others per logit;
  //!   - on the SFU, tanh y = 1 - 2 / (1 + exp(2y)), the sign included (exp2 overflows to
  //!     +inf for large y, whose reciprocal is 0): two SFU ops and three others.
  //! Every thread of the warp must call it.
  template <bool kReciprocalOnFma, class TensorS>
  CUTE_DEVICE void apply(TensorS& s) const {
    constexpr int kSize = decltype(size(s))::value;
    // NaN products do not count here (fmaxf drops them); they stay NaN in either form.
    const float largest = chained_reduce<kSize>([&](int i) { return fabsf(s(i)); }, MaxOp{});
    if (__all_sync(0xffffffffu, largest <= series_limit)) {
      CUTE_UNROLL
      for (int i = 0; i < kSize; ++i) {
        const float z = s(i) * s(i);
        float r = fmaf(series[3], z, series[2]);
        r = fmaf(r, z, series[1]);
        r = fmaf(r, z, series[0]);
        s(i) *= fmaf(r, z, 1.f);
      }
      return;
    }
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
