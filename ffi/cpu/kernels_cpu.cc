/*! \file kernels_cpu.cc
    \brief Out-of-line parts of the CPU building blocks: row conversions, the GEMM driver,
           per-thread scratch and the parallel loop.
*/
#include "kernels_cpu.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define JF_CPU_HAVE_MXCSR 1
#endif

namespace jax_flash::cpu {

// ------------------------------------------------------------------------------------------
// Conversions
// ------------------------------------------------------------------------------------------

namespace {

void HalfRowToFloat(const uint16_t* src, int64_t count, float scale, float* dst) {
  int64_t i = 0;
#if defined(JF_CPU_HAVE_F16C)
#if defined(__AVX512F__)
  const __m512 vscale = _mm512_set1_ps(scale);
  for (; i + 16 <= count; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xffff, h), vscale));
  }
#endif
  const __m256 vscale8 = _mm256_set1_ps(scale);
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), vscale8));
  }
#endif
  for (; i < count; ++i) dst[i] = HalfToFloat(src[i]) * scale;
}

}  // namespace

template <typename A>
void ConvertRow(const void* src, ElementType type, int64_t offset, int64_t count, A scale,
                A* dst) {
  switch (type) {
    case ElementType::kFloat64: {
      const double* s = static_cast<const double*>(src) + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<A>(s[i]) * scale;
      break;
    }
    case ElementType::kFloat32: {
      const float* s = static_cast<const float*>(src) + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<A>(s[i]) * scale;
      break;
    }
    case ElementType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<A>(Bf16ToFloat(s[i])) * scale;
      break;
    }
    case ElementType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      if constexpr (std::is_same_v<A, float>) {
        HalfRowToFloat(s, count, scale, dst);
      } else {
        for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<A>(HalfToFloat(s[i])) * scale;
      }
      break;
    }
    default:
      for (int64_t i = 0; i < count; ++i) dst[i] = A(0);
      break;
  }
}

template <typename A>
void AddBias(const void* bias, ElementType type, int64_t offset, int64_t stride, int64_t count,
             A* dst, int64_t dst_stride) {
  switch (type) {
    case ElementType::kFloat64: {
      const double* s = static_cast<const double*>(bias) + offset;
      for (int64_t t = 0; t < count; ++t) dst[t * dst_stride] += static_cast<A>(s[t * stride]);
      break;
    }
    case ElementType::kFloat32: {
      const float* s = static_cast<const float*>(bias) + offset;
      for (int64_t t = 0; t < count; ++t) dst[t * dst_stride] += static_cast<A>(s[t * stride]);
      break;
    }
    case ElementType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(bias) + offset;
      for (int64_t t = 0; t < count; ++t) {
        dst[t * dst_stride] += static_cast<A>(Bf16ToFloat(s[t * stride]));
      }
      break;
    }
    case ElementType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(bias) + offset;
      for (int64_t t = 0; t < count; ++t) {
        dst[t * dst_stride] += static_cast<A>(HalfToFloat(s[t * stride]));
      }
      break;
    }
    default: break;
  }
}

// tanh(a) = sign(a) r(|a|): for |a| < 0.625, r(a) = a + a^3 P(a^2) / Q(a^2) (Cephes' rational
// approximation, 5e-18 relative), otherwise r(a) = (1 - e) / (1 + e) with e = exp(-2a) in
// [0, 0.29], where 1 - e >= 0.71 cancels less than a bit. Both as one quotient (num / den
// selected per lane), so one division per element; relative error a few ulp everywhere (what
// z = cap * tanh needs to be as accurate as an uncapped logit when the cap is large), no
// overflow (+-inf give +-1, NaN stays NaN). 1 - tanh^2 is (1 - r)(1 + r) for |a| < 0.625 and
// e (1 + r)^2 = 4e / (1 + e)^2 beyond, which keeps a relative error of a few ulp where r
// rounds to 1.
template <typename A>
void SoftCapRows(A* tile, int64_t rows, A cap, A* dtanh) {
  using V = VecOf<A>;
  constexpr int W = Simd<A>::kWidth;
  const V vcap = Splat<V>(cap);
  const V inv_cap = Splat<V>(A(1) / cap);
  const V one = Splat<V>(A(1));
  const int64_t count = rows * kLanes<A>;
  for (int64_t o = 0; o < count; o += W) {
    const V x = Load<V>(tile + o);
    const auto negative = x < V{};
    const V a = (negative ? -x : x) * inv_cap;
    const V e = Exp(a * A(-2));
    const V z = a * a;
    V p = Splat<V>(A(-9.64399179425052238628e-1));
    p = p * z + A(-9.92877231001918586564e1);
    p = p * z + A(-1.61468768441708447952e3);
    V q = z + A(1.12811678491632931402e2);
    q = q * z + A(2.23548839060100448583e3);
    q = q * z + A(4.84406305325125486048e3);
    const auto small = a < A(0.625);
    const V r = (small ? a * (q + z * p) : one - e) / (small ? q : one + e);
    Store(tile + o, vcap * (negative ? -r : r));
    if (dtanh != nullptr) {
      const V up = one + r;
      Store(dtanh + o, small ? (one - r) * up : e * (up * up));
    }
  }
}

template void ConvertRow<float>(const void*, ElementType, int64_t, int64_t, float, float*);
template void ConvertRow<double>(const void*, ElementType, int64_t, int64_t, double, double*);
template void AddBias<float>(const void*, ElementType, int64_t, int64_t, int64_t, float*, int64_t);
template void AddBias<double>(const void*, ElementType, int64_t, int64_t, int64_t, double*,
                              int64_t);
template void SoftCapRows<float>(float*, int64_t, float, float*);
template void SoftCapRows<double>(double*, int64_t, double, double*);

// ------------------------------------------------------------------------------------------
// GEMM driver
// ------------------------------------------------------------------------------------------

namespace {

template <typename T, int MR>
void RemainderRows(T* c, int64_t ldc, int64_t rows, const T* a, int64_t a_row, int64_t a_col,
                   const T* b, int64_t ldb, int64_t len, bool accumulate) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      MicroKernel<T, MR>(c, ldc, a, a_row, a_col, b, ldb, len, accumulate);
    } else {
      RemainderRows<T, MR - 1>(c, ldc, rows, a, a_row, a_col, b, ldb, len, accumulate);
    }
  }
}

}  // namespace

template <typename T>
void Gemm(T* c, int64_t ldc, int64_t rows, const T* a, int64_t a_row, int64_t a_col, const T* b,
          int64_t ldb, int64_t len, bool accumulate) {
  constexpr int MR = kMicroRows;
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) {
    MicroKernel<T, MR>(c + r * ldc, ldc, a + r * a_row, a_row, a_col, b, ldb, len, accumulate);
  }
  if (r < rows) {
    RemainderRows<T, MR - 1>(c + r * ldc, ldc, rows - r, a + r * a_row, a_row, a_col, b, ldb,
                             len, accumulate);
  }
}

template void Gemm<float>(float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                          int64_t, int64_t, bool);
template void Gemm<double>(double*, int64_t, int64_t, const double*, int64_t, int64_t,
                           const double*, int64_t, int64_t, bool);

// ------------------------------------------------------------------------------------------
// Workspace
// ------------------------------------------------------------------------------------------

void Workspace::Free::operator()(void* p) const {
  ::operator delete(p, std::align_val_t(kTileAlign));
}

void* Workspace::Raw(int slot, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (sizes_[slot] < bytes) {
    buffers_[slot].reset();
    sizes_[slot] = 0;
    // Round up so that vector loads just past a ragged end stay inside the buffer.
    const size_t rounded = (bytes + 2 * kTileAlign - 1) / kTileAlign * kTileAlign;
    buffers_[slot].reset(::operator new(rounded, std::align_val_t(kTileAlign)));
    sizes_[slot] = bytes;
  }
  return buffers_[slot].get();
}

// ------------------------------------------------------------------------------------------
// Parallel loop
// ------------------------------------------------------------------------------------------

namespace {

//! Round to nearest, all exceptions masked, denormal results flushed and denormal operands
//! read as zero: the same on every thread, so results never depend on the thread an item ran
//! on, and no slow denormal assists in the exp tails.
class ScopedKernelFloatMode {
 public:
#if defined(JF_CPU_HAVE_MXCSR)
  ScopedKernelFloatMode() : saved_(_mm_getcsr()) { _mm_setcsr(0x9fc0u); }
  ~ScopedKernelFloatMode() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  ScopedKernelFloatMode() = default;
#endif
  ScopedKernelFloatMode(const ScopedKernelFloatMode&) = delete;
  ScopedKernelFloatMode& operator=(const ScopedKernelFloatMode&) = delete;
};

struct LoopState {
  LoopState(int64_t n, const ItemBody* b) : total(n), body(b) {}
  std::atomic<int64_t> next{0};
  const int64_t total;
  const ItemBody* body;  //!< only dereferenced for a claimed item, while the caller waits
  std::mutex mu;
  std::condition_variable cv;
  int64_t completed = 0;  //!< guarded by mu
  std::string error;      //!< first failure, guarded by mu
};

void RecordError(LoopState& state, const char* what) {
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.error.empty()) state.error = what;
}

//! Claims and runs items until none are left, then reports how many it ran.
void Drain(LoopState& state) {
  int64_t ran = 0;
  try {
    ScopedKernelFloatMode mode;
    Workspace workspace;
    for (;;) {
      const int64_t item = state.next.fetch_add(1, std::memory_order_relaxed);
      if (item >= state.total) break;
      ++ran;
      try {
        (*state.body)(item, workspace);
      } catch (const std::exception& e) {
        RecordError(state, e.what());
      } catch (...) {
        RecordError(state, "unknown exception");
      }
    }
  } catch (...) {
    RecordError(state, "unknown exception");
  }
  if (ran == 0) return;
  std::lock_guard<std::mutex> lock(state.mu);
  state.completed += ran;
  if (state.completed == state.total) state.cv.notify_all();
}

}  // namespace

Status ParallelFor(TaskRunner& runner, int64_t num_items, const ItemBody& body) {
  if (num_items <= 0) return Status::Ok();
  std::shared_ptr<LoopState> state;
  try {
    state = std::make_shared<LoopState>(num_items, &body);
  } catch (...) {
    return Status::Internal("jax_flash: cannot allocate the parallel loop state");
  }
  // The caller works too: with num_workers() - 1 helpers, as many threads run as the pool has,
  // whether or not the caller is one of the pool's threads.
  const int64_t helpers =
      std::max<int64_t>(0, std::min<int64_t>(runner.num_workers() - 1, num_items - 1));
  for (int64_t h = 0; h < helpers; ++h) {
    try {
      runner.schedule([state]() { Drain(*state); });
    } catch (...) {
      break;  // the caller runs whatever the missing helpers would have
    }
  }
  Drain(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->completed == state->total; });
  if (!state->error.empty()) return Status::Internal("jax_flash: CPU kernel failed: " + state->error);
  return Status::Ok();
}

void RunInKernelFloatMode(const std::function<void()>& fn) {
  ScopedKernelFloatMode mode;
  fn();
}

}  // namespace jax_flash::cpu
