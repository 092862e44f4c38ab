/*! \file softcap.h
    \brief Logit soft-capping, shared by the forward and backward mainloops: a scaled logit
           x = scale * q.k becomes z = cap * tanh(x / cap) before masking and the softmax.

    The mainloops hold logits as raw products s = q.k and fold the scale into the exponent
    (exp2(s * scale * log2 e - ...)). Where a warp's products of a block all lie within half the
    cap (less under caps far above the logits), tanh comes from an odd polynomial on the FMA
    units, with that scaling folded into its coefficients (SeriesCappedLogits): the
    special-function unit is left to the softmax's exp2, as without the cap. Within 0.14 of the
    cap a polynomial of three terms is as exact as the five needed up to half of it, and saves
    two of the FMA units' ops per logit, about a fifth of a capped logit's instructions. The
    forward applies it inside the softmax's exponent (a logit map of softmax.h); the backward
    caps in place. The warp's other blocks take exp and a reciprocal. Since a series' map is odd
    and increasing, the largest |product| of a quad's rows bounds their capped logits from both
    sides: in blocks that mask nothing, the forward takes that bound for the rows' maxima and
    saves their reductions (SeriesCappedLogits::bound), as long as P keeps its exactness at the
    bound's distance from them. In bfloat16, whose P has float32's exponent range, the running
    maxima rather start at a floor that the short series' blocks lie under, masked or not
    (LogitSoftcap::maxima_floor): those blocks need no maxima at all.
    Capped in place, logits are in log2 units (z * log2 e).
    The backward needs tanh'(x / cap) = 1 - t^2 with t = z / cap where it forms dS. Without a
    bias it takes the factor from the capped logits before P replaces them (a register tile of
    factors, or of P times them: mainloop_bwd.h's kSlopeTimesP). With a bias, whose capped
    kernels spill already, it recovers t from P and the log-sum-exp: log2 P = (z + b) * log2 e -
    lse * log2 e, so the bias b is read again and taken out. Masked logits give a factor of 0
    either way.
*/
#pragma once

#include <algorithm>
#include <cmath>

#include <cute/tensor.hpp>

#include "softmax.h"
#include "utils.h"

namespace jax_flash::sm90 {

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

//! Raw products within a series' reach, capped and taken to log2 units (a logit map,
//! softmax.h): cap * tanh(scale * s / cap) * log2 e = s * P(s^2). P is tanh(y) / y as a
//! polynomial of kTerms terms in y^2, each coefficient times scale * log2 e and its power of
//! (y / s)^2 = (scale / cap)^2, so the kernel squares s itself; in the exponent the softmax's
//! FFMA takes the product with s: kTerms + 1 FMA-unit ops per logit in all. A masked -inf gives
//! P = +inf (its leading coefficient is positive and normal) and an exponent of -inf.
//! The map is odd and increasing over the reach, so a block's largest |s| bounds its capped
//! logits from both sides (bound).
template <int kTerms>
struct SeriesCappedLogits {
  //! The largest bound, in log2 units, that may stand in for block maxima (softmax.h's
  //! BlockBound): a row's maximum then lies at most twice this below it, as far as
  //! BlockBound::kDistanceLog2Limit allows.
  static constexpr double kBoundLog2Limit = BlockBound::kDistanceLog2Limit / 2;

  float coefficient[kTerms];  //!< P's, the constant term (about scale * log2 e) first
  //! Whether the capped logits within the reach stay within kBoundLog2Limit, so that bound may
  //! stand in for block maxima.
  bool bounds_maxima;

  CUTE_DEVICE float factor(float s) const {
    const float z = s * s;
    float p = coefficient[kTerms - 1];
    CUTE_UNROLL
    for (int k = kTerms - 2; k >= 0; --k) p = fmaf(p, z, coefficient[k]);
    return p;
  }
  CUTE_DEVICE float log2(float s) const { return s * factor(s); }
  CUTE_DEVICE float exponent(float s, float base) const { return fmaf(s, factor(s), -base); }

  //! The bound on the capped logits of rows whose raw products lie within +-largest (inside
  //! the reach): log2(largest), whose distance from the rows' maxima is at most twice itself,
  //! since the map is odd. Known where the series bounds maxima and `rows_visible` (every row
  //! of the block has a visible key, and P's dtype keeps 2^-80 exact).
  CUTE_DEVICE BlockBound bound(float largest, bool rows_visible) const {
    return {bounds_maxima && rows_visible, log2(largest)};
  }
};

//! How a warp caps a block: the series it fits, or exp and a reciprocal.
enum class CapForm { kShortSeries, kSeries, kExp };

//! A block's form, and the largest |raw product| of the rows of the calling thread's quad (of
//! its own elements only, where form() did not reduce it, see there).
struct CappedBlock {
  CapForm form;
  float largest;
};

struct LogitSoftcap {
  // tanh(y) / y as polynomials in y^2, minimax fits of relative error 1.3e-8 up to their reach
  // in |y|. In float32, tanh then errs by at most 6e-8 absolute and 1.1e-7 relative (the
  // five-term series) and 2e-8 absolute and 1.1e-7 relative (the three-term one).
  static constexpr double kSeriesReach = 0.5;
  static constexpr double kSeriesTerms[5] = {1.0, -0.3333306939411152, 0.13324779318868757,
                                             -0.052986075371308464, 0.01713500679008545};
  static constexpr double kShortSeriesReach = 0.14;
  static constexpr double kShortSeriesTerms[3] = {0.999999987460266, -0.3333218075595999,
                                                  0.13176091335295587};

  //! -2 * log2(e) * scale / cap: raw product -> log2 of exp(-2|x| / cap)
  float exp2_per_raw;
  float two_from_tanh;                  //!< 2 * cap * log2 e
  float from_tanh;                      //!< cap * log2 e: tanh -> capped logit in log2 units
  float tanh_per_log2;                  //!< 1 / (cap * log2 e): a capped logit in log2 units -> t
  SeriesCappedLogits<5> series;         //!< the map of a warp whose products fit the series
  SeriesCappedLogits<3> short_series;   //!< the same for products within the short one's reach
  float series_limit;                   //!< |raw product| up to which the series serves (0: never)
  float short_series_limit;             //!< the same for the short series
  //! A floor for the forward's running row maxima (log2 units; -inf where the cap allows none),
  //! under which blocks in the short series lie (softmax.h's exponentiate_under_floor), masked
  //! or not: they need no reduction across the quad, no maxima and no rescaling. Their capped
  //! logits lie below the short series' top (its value at its reach). The floor is as high as
  //! the contract of softmax.h's BlockBound allows (a row's largest probability at least
  //! 2^-kDistanceLog2Limit; a row whose logits all lie near -cap has it at floor + cap * log2 e
  //! below 1), at most that top, and kept only where the short series' probabilities stay below
  //! 2^kFloorExcessLog2 (far from overflowing the float32 sums and output, exact in bfloat16):
  //! caps up to about 58 at any scale. Float16 P has no such range; the forward takes the floor
  //! only where P is bfloat16.
  float maxima_floor;
  static constexpr double kFloorExcessLog2 = 16.0;

  static LogitSoftcap make(float scale, float cap) {
    LogitSoftcap cap_constants{};
    cap_constants.exp2_per_raw = -2.f * kLog2e * scale / cap;
    cap_constants.two_from_tanh = 2.f * cap * kLog2e;
    cap_constants.from_tanh = cap * kLog2e;
    cap_constants.tanh_per_log2 = 1.f / (cap * kLog2e);
    cap_constants.series_limit = fit(cap_constants.series, kSeriesTerms, kSeriesReach, scale, cap);
    cap_constants.short_series_limit = std::min(
        cap_constants.series_limit,
        fit(cap_constants.short_series, kShortSeriesTerms, kShortSeriesReach, scale, cap));
    const double short_series_top =
        double(cap) * std::tanh(double(cap_constants.short_series_limit) * scale / cap) * kLog2e;
    const double floor =
        std::min(short_series_top, BlockBound::kDistanceLog2Limit - double(cap) * kLog2e);
    cap_constants.maxima_floor =
        cap_constants.short_series_limit > 0 && floor >= short_series_top - kFloorExcessLog2
            ? float(floor)
            : -INFINITY;
    return cap_constants;
  }

  //! Stores `series`'s coefficients for this scale and cap and returns the |raw product| up to
  //! which it serves. Coefficient k is a_k * scale * log2 e * (scale / cap)^(2k). Under a cap
  //! far above the logits' scale the high ones fall below the float range (flushed to 0, a
  //! masked logit's exponent would be 0 * inf); there they are stood in by the least normal
  //! float and the reach shrinks until the dropped term and its stand-in each change the capped
  //! logit by at most 2^-26 relative, so that such caps too are computed by the series (the exp
  //! form's absolute error, about cap * 6e-8 in tanh's units, grows with the cap). Negative
  //! scales and caps whose coefficients overflow take the exp form throughout (0).
  template <int kTerms>
  static float fit(SeriesCappedLogits<kTerms>& series, const double (&terms)[kTerms],
                   double reach, float scale, float cap) {
    constexpr double kLeast = 0x1p-126;
    constexpr double kTermError = 0x1p-26;
    const double y_per_raw = double(scale) / cap;
    const double leading = double(scale) * kLog2e;
    const double r2 = y_per_raw * y_per_raw;
    bool usable = scale > 0;
    double coefficient = leading;
    for (int k = 0; k < kTerms; ++k) {
      const double exact = terms[k] * coefficient;
      float& stored = series.coefficient[k];
      stored = float(exact);
      if (!std::isfinite(stored)) usable = false;
      if (k > 0 && std::abs(exact) < kLeast) {
        stored = float(std::copysign(kLeast, terms[k]));
        const double dropped = std::pow(kTermError / std::abs(terms[k]), 0.5 / k);
        const double stand_in =
            std::abs(y_per_raw) * std::pow(kTermError * leading / kLeast, 0.5 / k);
        reach = std::min(reach, std::min(dropped, stand_in));
      }
      coefficient *= r2;
    }
    series.bounds_maxima = usable && double(cap) * std::tanh(reach) * kLog2e <=
                                         SeriesCappedLogits<kTerms>::kBoundLog2Limit;
    return usable ? float(reach / std::abs(y_per_raw)) : 0.f;
  }

  //! The form in which the calling warp caps `s`: a series whose reach holds every raw product
  //! of `s` in the warp (the short one where it does), else the exp form. One form per warp and
  //! block (a uniform branch, no divergence); every thread of the warp must call it. The
  //! limits are exclusive, so that a limit of 0 (never) excludes a block of zeros. The largest
  //! |product| of the quad's rows, for the series' bounds, is reduced across the quad only for
  //! a series and, for the short one, only where `short_needs_largest`.
  template <class TensorS>
  CUTE_DEVICE CappedBlock form(TensorS const& s, bool short_needs_largest = true) const {
    constexpr int kSize = decltype(size(s))::value;
    // NaN products do not count here (fmaxf drops them); they stay NaN in any form.
    const float thread_largest =
        chained_reduce<kSize>([&](int i) { return fabsf(s(i)); }, MaxOp{});
    if (__all_sync(0xffffffffu, thread_largest < short_series_limit)) {
      return {CapForm::kShortSeries,
              short_needs_largest ? quad_allreduce(thread_largest, MaxOp{}) : thread_largest};
    }
    if (__all_sync(0xffffffffu, thread_largest < series_limit)) {
      return {CapForm::kSeries, quad_allreduce(thread_largest, MaxOp{})};
    }
    return {CapForm::kExp, thread_largest};
  }

  //! Caps every raw product of `s` in place, to log2 units, with tanh's absolute error about
  //! 2.4e-7 at most, so the capped logit errs by about cap * 2.4e-7; tanh.approx.f32 (2^-11
  //! relative) would shift probabilities by percents at caps like 50. kReciprocalOnFma
  //! (kSoftcapReciprocalOnFma) picks the reciprocal's unit:
  //! - on the FMA units, tanh|y| = 2 / (1 + e) - 1 with e = exp(-2|y|), so the divisor stays
  //!   in [1, 2]: one SFU op and ten others per logit;
  //! - on the SFU, tanh y = 1 - 2 / (1 + exp(2y)), the sign included (exp2 overflows to
  //!   +inf for large y, whose reciprocal is 0): two SFU ops and three others.
  template <bool kReciprocalOnFma, class TensorS>
  CUTE_DEVICE void apply_exp_form(TensorS& s) const {
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

  //! Caps every raw product of `s` in place, to log2 units, in the warp's form. Every thread of
  //! the warp must call it.
  template <bool kReciprocalOnFma, class TensorS>
  CUTE_DEVICE void apply(TensorS& s) const {
    const CapForm cap_form = form(s, /*short_needs_largest=*/false).form;
    if (cap_form == CapForm::kShortSeries) {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = short_series.log2(s(i));
    } else if (cap_form == CapForm::kSeries) {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = series.log2(s(i));
    } else {
      apply_exp_form<kReciprocalOnFma>(s);
    }
  }

  //! 1 - t^2 for a capped logit in log2 units (z * log2 e, t = z / cap). Clamped at 0, so a
  //! masked -inf, a NaN and a |t| rounded past 1 give 0 (fmaxf drops the NaN), never NaN (its
  //! P is 0, and dS with it).
  CUTE_DEVICE float derivative_of_log2(float z_log2) const {
    const float t = z_log2 * tanh_per_log2;
    return fmaxf(fmaf(-t, t, 1.f), 0.f);
  }
  //! 1 - t^2 for an element whose log2 P less the bias is log2_p, in a row of log-sum-exp
  //! lse_log2 (base 2): its capped logit is their sum. Where P is 0 (masked, underflowed, or a
  //! row with no visible key, lse_log2 = +inf) that sum is -inf or NaN, and the factor 0.
  CUTE_DEVICE float derivative_at(float log2_p, float lse_log2) const {
    return derivative_of_log2(log2_p + lse_log2);
  }
};

}  // namespace jax_flash::sm90
