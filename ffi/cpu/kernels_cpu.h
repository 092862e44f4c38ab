/*! \file kernels_cpu.h
    \brief Internal building blocks of the CPU kernels: SIMD vector types (GCC/Clang vector
           extensions, lowered to whatever the target offers), a vectorised exp, float16 and
           bfloat16 conversions, the register-blocked GEMM micro-kernel, per-thread scratch and
           the parallel loop over work items.

    Tile layout. Every matrix product of the kernels is C (rows x kLanes) += A (rows x len) *
    B (len x kLanes): B and C are packed, 64-byte aligned row-major tiles whose rows hold
    kLanes = 4 vectors, and A is read element by element (broadcast) through a row stride and
    a column stride, so that it can be read straight from the input buffers in any
    orientation. The forward and the dq pass put query rows on the lanes (S^T = K Q^T,
    O^T += V^T P^T), the dk/dv pass puts keys on the lanes (S = Q K^T, dV^T += dO^T P, ...).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>

#include "../common/attention_params.h"
#include "../common/status.h"
#include "attention_cpu.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#define JF_CPU_HAVE_F16C 1
#endif

#define JF_INLINE inline __attribute__((always_inline))

namespace jax_flash::cpu {

// ------------------------------------------------------------------------------------------
// SIMD configuration
// ------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
inline constexpr int kVectorBytes = 64;
inline constexpr int kVectorRegisters = 32;
#elif defined(__AVX__)
inline constexpr int kVectorBytes = 32;
inline constexpr int kVectorRegisters = 16;
#elif defined(__aarch64__)
inline constexpr int kVectorBytes = 16;
inline constexpr int kVectorRegisters = 32;
#else
inline constexpr int kVectorBytes = 16;
inline constexpr int kVectorRegisters = 16;
#endif

//! Vectors per tile row: a tile row holds kLanes = kTileVectors * width elements.
inline constexpr int kTileVectors = 4;
//! Alignment of every packed tile.
inline constexpr int64_t kTileAlign = 64;

template <typename T>
struct Simd;

template <>
struct Simd<float> {
  typedef float Vec __attribute__((vector_size(kVectorBytes)));
  typedef int32_t IVec __attribute__((vector_size(kVectorBytes)));
  typedef int32_t Int;
  static constexpr int kWidth = kVectorBytes / sizeof(float);
};

template <>
struct Simd<double> {
  typedef double Vec __attribute__((vector_size(kVectorBytes)));
  typedef int64_t IVec __attribute__((vector_size(kVectorBytes)));
  typedef int64_t Int;
  static constexpr int kWidth = kVectorBytes / sizeof(double);
};

template <typename T>
using VecOf = typename Simd<T>::Vec;

//! Elements per tile row (the query block of the forward and dq pass, the key block of the
//! dk/dv pass): 64 floats / 32 doubles with AVX-512.
template <typename T>
inline constexpr int64_t kLanes = kTileVectors * Simd<T>::kWidth;

//! Rows per micro-kernel call: as many accumulator rows as the register file holds next to
//! the kTileVectors B vectors and a broadcast.
inline constexpr int kMicroRows = [] {
  const int rows = (kVectorRegisters - kTileVectors - 2) / kTileVectors;
  return rows < 1 ? 1 : (rows > 8 ? 8 : rows);
}();

template <typename V, typename T>
JF_INLINE V Splat(T s) {
  return s - V{};  // x - 0 is exact for every x (including -0), so this folds to a broadcast
}

template <typename To, typename From>
JF_INLINE To BitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast between types of different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename V>
JF_INLINE V Load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
JF_INLINE void Store(void* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

template <typename V>
JF_INLINE V Max(V a, V b) {
  return a > b ? a : b;
}

// ------------------------------------------------------------------------------------------
// exp
// ------------------------------------------------------------------------------------------
//
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite
// reduction with a two-part ln 2 whose high part times n is exact), exp(r) = 1 + r + r^2 q(r)
// with q a Chebyshev fit (degree 4 for float, approximation error 1e-8 relative = 0.2 ulp;
// degree 9 for double, 1.6e-17 = 0.15 ulp), and 2^n applied as two factors 2^(n/2) 2^(n - n/2)
// so that results in the subnormal range round once and overflow gives +inf. Measured with
// FMA contraction (AVX-512 build): at most 1.08 ulp over every float32 input with a normal
// result (exhaustive), at most 1.19 ulp for float64 (1.6e8 random inputs in [-745, 709.7]).
// Special values: -inf -> +0 exactly, +inf -> +inf, NaN -> NaN. Inputs are clamped to a
// range whose ends already round to 0 and +inf, which keeps the exponent arithmetic exact.
// Under the kernels' floating-point mode (denormals flushed) subnormal results become 0.

JF_INLINE VecOf<float> Exp(VecOf<float> x) {
  using V = VecOf<float>;
  using I = Simd<float>::IVec;
  x = x > Splat<V>(88.9f) ? Splat<V>(88.9f) : x;  // NaN compares false and passes through
  x = x < Splat<V>(-104.0f) ? Splat<V>(-104.0f) : x;
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V t = x * 1.44269504088896341f + kMagic;
  const V n = t - kMagic;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440054690583e-4f;
  V q = Splat<V>(1.39261759e-3f);
  q = q * r + 8.36317334e-3f;
  q = q * r + 4.16665561e-2f;
  q = q * r + 1.66665778e-1f;
  q = q * r + 0.5f;
  const V p = (q * r) * r + r + 1.0f;
  const I ni = BitCast<I>(t) - BitCast<I>(Splat<V>(kMagic));
  const I n1 = ni >> 1;
  const I n2 = ni - n1;
  return (p * BitCast<V>((n1 + 127) << 23)) * BitCast<V>((n2 + 127) << 23);
}

JF_INLINE VecOf<double> Exp(VecOf<double> x) {
  using V = VecOf<double>;
  using I = Simd<double>::IVec;
  x = x > Splat<V>(710.0) ? Splat<V>(710.0) : x;
  x = x < Splat<V>(-746.0) ? Splat<V>(-746.0) : x;
  const double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  const V t = x * 1.4426950408889634 + kMagic;
  const V n = t - kMagic;
  V r = x - n * 0.6931471804855391;  // ln 2 with 20 trailing zero bits
  r = r - n * 7.440617110012397e-11;
  V q = Splat<V>(2.5100375832561234e-08);
  q = q * r + 2.7620075879983367e-07;
  q = q * r + 2.7557268480310024e-06;
  q = q * r + 2.4801521322368692e-05;
  q = q * r + 1.9841269863040545e-04;
  q = q * r + 1.3888888917196719e-03;
  q = q * r + 8.333333333330065e-03;
  q = q * r + 4.1666666666624164e-02;
  q = q * r + 1.6666666666666669e-01;
  q = q * r + 0.5;
  const V p = (q * r) * r + r + 1.0;
  const I ni = BitCast<I>(t) - BitCast<I>(Splat<V>(kMagic));
  const I n1 = ni >> 1;
  const I n2 = ni - n1;
  return (p * BitCast<V>((n1 + 1023) << 52)) * BitCast<V>((n2 + 1023) << 52);
}

// ------------------------------------------------------------------------------------------
// float16 / bfloat16
// ------------------------------------------------------------------------------------------

JF_INLINE float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

JF_INLINE uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

JF_INLINE float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

//! Round to nearest even; NaN stays NaN (quietened, sign kept).
JF_INLINE uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

//! Exact: every float16 value (subnormals, infinities, NaN payloads) is a float.
JF_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  return BitsToFloat(sign | FloatToBits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));
}

//! Round to nearest even, with float16 subnormals, overflow to infinity and NaN kept NaN.
JF_INLINE uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
  if (a >= 0x38800000u) {  // >= 2^-14: normal float16
    const uint32_t rebased = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  // Below 2^-14: float16 subnormal or zero, in units of 2^-24. Adding 0.5 (whose ulp is 2^-24)
  // rounds to nearest even in one floating-point addition; a carry into 2^-14 gives the
  // smallest normal, which is the right encoding.
  const float shifted = BitsToFloat(a) + 0.5f;
  return static_cast<uint16_t>(sign | (FloatToBits(shifted) - 0x3f000000u));
}

//! Converts `count` contiguous elements of dtype `type` (q/k/v/out/dout dtypes) to A,
//! multiplying by `scale`.
template <typename A>
void ConvertRow(const void* src, ElementType type, int64_t offset, int64_t count, A scale,
                A* dst);

//! Reads one element of a floating operand as A (bias, lse, dlse).
template <typename A>
JF_INLINE A LoadAs(const void* base, ElementType type, int64_t index) {
  switch (type) {
    case ElementType::kFloat64: return static_cast<A>(static_cast<const double*>(base)[index]);
    case ElementType::kFloat32: return static_cast<A>(static_cast<const float*>(base)[index]);
    case ElementType::kBFloat16:
      return static_cast<A>(Bf16ToFloat(static_cast<const uint16_t*>(base)[index]));
    case ElementType::kFloat16:
      return static_cast<A>(HalfToFloat(static_cast<const uint16_t*>(base)[index]));
    default: return A(0);
  }
}

//! Writes one element of a floating result, rounding once to its dtype.
template <typename A>
JF_INLINE void StoreAs(void* base, ElementType type, int64_t index, A value) {
  switch (type) {
    case ElementType::kFloat64: static_cast<double*>(base)[index] = static_cast<double>(value); break;
    case ElementType::kFloat32: static_cast<float*>(base)[index] = static_cast<float>(value); break;
    case ElementType::kBFloat16:
      static_cast<uint16_t*>(base)[index] = FloatToBf16(static_cast<float>(value));
      break;
    case ElementType::kFloat16:
      static_cast<uint16_t*>(base)[index] = FloatToHalf(static_cast<float>(value));
      break;
    default: break;
  }
}

//! Adds `count` elements of a bias row (element stride `stride`, possibly 0) to dst[0],
//! dst[dst_stride], ...
template <typename A>
void AddBias(const void* bias, ElementType type, int64_t offset, int64_t stride, int64_t count,
             A* dst, int64_t dst_stride);

//! Logit soft-capping of `rows` tile rows (kLanes elements each, row stride kLanes, aligned):
//! x becomes cap * tanh(x / cap); `dtanh` (same layout) or nullptr receives 1 - tanh^2(x / cap).
//! Out of line, so that every pass caps its logits with the same instructions.
template <typename A>
void SoftCapRows(A* tile, int64_t rows, A cap, A* dtanh);

// ------------------------------------------------------------------------------------------
// GEMM micro-kernel
// ------------------------------------------------------------------------------------------

//! Terms summed from zero before joining a product's running sum: a chain of n float32 terms
//! accumulates rounding error like n, chunks of c like c + n / c, which keeps the logits of
//! long head dims (and every other product over many terms) within a few units of the
//! correctly rounded sums.
inline constexpr int64_t kSumChunk = 32;

//! C[r][0:kLanes] (+)= sum_t A(r, t) * B[t][0:kLanes] for r < MR, with A(r, t) at
//! a[r * a_row + t * a_col], B rows at b + t * ldb and C rows at c + r * ldc (both aligned).
//! The sum runs over chunks of kSumChunk terms in increasing t, each chunk from zero.
template <typename T, int MR>
JF_INLINE void MicroKernel(T* __restrict c, int64_t ldc, const T* __restrict a, int64_t a_row,
                           int64_t a_col, const T* __restrict b, int64_t ldb, int64_t len,
                           bool accumulate) {
  using V = VecOf<T>;
  constexpr int W = Simd<T>::kWidth;
  static_assert(kTileVectors == 4, "the micro-kernel is written for four vectors per row");
  const T* rows[MR];
  for (int r = 0; r < MR; ++r) rows[r] = a + r * a_row;
  int64_t t = 0;
  do {
    V acc[MR][4];
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < 4; ++v) acc[r][v] = V{};
    }
    const int64_t end = t + kSumChunk < len ? t + kSumChunk : len;
    for (; t < end; ++t) {
      const V* bt = reinterpret_cast<const V*>(b + t * ldb);
      const V b0 = bt[0], b1 = bt[1], b2 = bt[2], b3 = bt[3];
      const int64_t at = t * a_col;
      for (int r = 0; r < MR; ++r) {
        const T s = rows[r][at];
        acc[r][0] += s * b0;
        acc[r][1] += s * b1;
        acc[r][2] += s * b2;
        acc[r][3] += s * b3;
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < 4; ++v) {
        V* dst = reinterpret_cast<V*>(c + r * ldc + v * W);
        *dst = accumulate ? *dst + acc[r][v] : acc[r][v];
      }
    }
    accumulate = true;
  } while (t < len);
}

//! The same product for any number of rows. Each element of C is the same sum (chunks in
//! increasing t) whatever `rows` is, so results never depend on how rows are blocked.
template <typename T>
void Gemm(T* c, int64_t ldc, int64_t rows, const T* a, int64_t a_row, int64_t a_col, const T* b,
          int64_t ldb, int64_t len, bool accumulate);

// ------------------------------------------------------------------------------------------
// Scratch and parallel loop
// ------------------------------------------------------------------------------------------

//! Per-thread scratch: a few aligned buffers, grown on demand and reused across items.
class Workspace {
 public:
  static constexpr int kSlots = 12;
  template <typename T>
  T* Get(int slot, int64_t count) {
    return static_cast<T*>(Raw(slot, static_cast<size_t>(count) * sizeof(T)));
  }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  void* Raw(int slot, size_t bytes);
  std::unique_ptr<void, Free> buffers_[kSlots];
  size_t sizes_[kSlots] = {};
};

using ItemBody = std::function<void(int64_t item, Workspace& workspace)>;

//! Runs body(i, workspace) for every i in [0, num_items): the caller claims items from a shared
//! counter together with up to num_workers() - 1 helper tasks (the caller is the remaining
//! worker) and returns once every item is done. It never waits for a helper that has not
//! started: helpers that start late (even after the return) hold the loop state through a
//! shared_ptr and find nothing left. Results must not depend on which thread runs an
//! item: every item runs under the same floating-point mode (round to nearest, denormals
//! flushed), whatever the thread's own mode. Exceptions thrown by the body become the Status.
Status ParallelFor(TaskRunner& runner, int64_t num_items, const ItemBody& body);

//! Runs `fn` under the same floating-point mode as ParallelFor items (for serial work).
void RunInKernelFloatMode(const std::function<void()>& fn);

// ------------------------------------------------------------------------------------------
// Problem helpers
// ------------------------------------------------------------------------------------------

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

//! clamp(lengths[b], 0, full), or full when the operand is absent.
inline int64_t SeqLen(const Operand& lengths, const BatchShape& batch, int64_t b, int64_t full) {
  if (!lengths.present()) return full;
  const int64_t v = static_cast<const int32_t*>(lengths.data)[lengths.batch_offset(batch, b)];
  return v < 0 ? 0 : (v > full ? full : v);
}

//! Visible key range [lo, hi) of the query rows [i_begin, i_end) under the window and the
//! key length; rows inside may see less (see NeedsElementMask).
inline void KeyRange(const AttentionOptions& o, int64_t i_begin, int64_t i_end, int64_t kv_len,
                     int64_t* lo, int64_t* hi) {
  *lo = o.window_left >= 0 ? std::max<int64_t>(0, i_begin - o.window_left) : 0;
  *hi = o.window_right >= 0 ? std::min<int64_t>(kv_len, i_end - 1 + o.window_right + 1) : kv_len;
}

//! Visible query range [lo, hi) of the keys [j_begin, j_end) (q_len bounds the rows).
inline void QueryRange(const AttentionOptions& o, int64_t j_begin, int64_t j_end, int64_t q_len,
                       int64_t* lo, int64_t* hi) {
  *lo = o.window_right >= 0 ? std::max<int64_t>(0, j_begin - o.window_right) : 0;
  *hi = o.window_left >= 0 ? std::min<int64_t>(q_len, j_end - 1 + o.window_left + 1) : q_len;
}

//! Segment ids: narrows [*lo, *hi) to the union of the spans (a kv_span or q_span operand) of
//! the rows [begin, end) of batch item b, i.e. to the keys (queries) that may share a segment
//! with one of those queries (keys). Spans are clipped to [*lo, *hi) (an inexact lo = -1 with
//! them), empty ones ignored; the range becomes empty when no span meets it. Nothing changes
//! when `spans` is absent.
inline void IntersectSpans(const Operand& spans, const BatchShape& batch, int64_t b,
                           int64_t begin, int64_t end, int64_t* lo, int64_t* hi) {
  if (!spans.present() || *lo >= *hi) return;
  const int32_t* span = static_cast<const int32_t*>(spans.data) + spans.batch_offset(batch, b);
  int64_t first = *hi, last = *lo;
  for (int64_t r = begin; r < end; ++r) {
    const int32_t* row = span + r * spans.stride[0];
    const int64_t a = std::max<int64_t>(row[0], *lo);
    const int64_t z = std::min<int64_t>(row[spans.stride[1]], *hi);
    if (a < z) {
      first = std::min(first, a);
      last = std::max(last, z);
    }
  }
  *lo = first;
  *hi = last;
}

//! Whether some (i, j) of the block [i_begin, i_end) x [j_begin, j_end) is outside the window.
inline bool WindowCutsBlock(const AttentionOptions& o, int64_t i_begin, int64_t i_end,
                            int64_t j_begin, int64_t j_end) {
  if (o.window_left >= 0 && j_begin < i_end - 1 - o.window_left) return true;
  if (o.window_right >= 0 && j_end - 1 > i_begin + o.window_right) return true;
  return false;
}

}  // namespace jax_flash::cpu
