/*! \file utils.h
    \brief Small device helpers for the Hopper kernels: warpgroup GEMM issue, register layout
           views of WGMMA accumulators, numeric conversion, quad reductions, bulk reductions
           into global memory and the counters that order them.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace jax_flash::sm90 {

using namespace cute;

inline constexpr int kThreadsPerWarpGroup = 128;
//! log2(e): exponentials run in base 2 (exp(x) = exp2(x * kLog2e)).
inline constexpr float kLog2e = 1.44269504088896340736f;

//! `value` through an opaque move: what is computed from the result cannot be hoisted out of the
//! enclosing loop. Used for per-thread epilogue addresses, which would otherwise stay live in
//! the consumers' registers across the whole mainloop of a persistent CTA.
CUTE_DEVICE int opaque(int value) {
  int result;
  asm volatile("mov.b32 %0, %1;" : "=r"(result) : "r"(value));
  return result;
}

//! Issues one warpgroup GEMM C (+)= A * B over all k-blocks as one wgmma batch.
//! kWaitGroups >= 0 waits until at most that many batches are in flight; -1 leaves it async.
template <bool kZeroInit, int kWaitGroups, class TiledMma, class TensorA, class TensorB,
          class TensorC>
CUTE_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TensorA const& a, TensorB const& b,
                                TensorC& c) {
  constexpr bool kAInRegisters =
      !cute::is_same_v<typename TensorA::engine_type::iterator, GMMA::DescriptorIterator>;
  // Operands in registers must not be touched by the compiler while wgmma reads them.
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k_block = 0; k_block < size<2>(a); ++k_block) {
    cute::gemm(tiled_mma, a(_, _, k_block), b(_, _, k_block), c);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWaitGroups >= 0) warpgroup_wait<kWaitGroups>();
  warpgroup_fence_operand(c);
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
}

//! View of an SM90 accumulator ((2, 2, V), M, N) as (rows, cols): rows = (2, M), cols = (2, V, N).
//! Each thread holds two rows of every 64-row atom (r and r + 8) and pairs of adjacent columns.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto accumulator_rowcol(Layout acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

//! Reinterprets a 16-bit copy of an accumulator ((2, 2, V), M, N) as the register A operand of
//! the next wgmma (k-blocks of 16 columns): ((2, 2, 2), M, (V / 2, N)). The per-thread register
//! order of the two layouts coincides, so no data moves.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto accumulator_as_a_operand(Layout acc) {
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, V/2))
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(acc),
                     make_layout(get<2, 1>(v), get<2>(acc)));
}

//! Converts register tensor `src` elementwise into `dst` (same size), in storage order and
//! in pairs, so that `dst` may view the same registers through another layout.
template <class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
CUTE_DEVICE void convert_into(Tensor<SrcEngine, SrcLayout> const& src,
                              Tensor<DstEngine, DstLayout>& dst) {
  using From = typename SrcEngine::value_type;
  using To = typename DstEngine::value_type;
  constexpr int kSize = decltype(size(src))::value;
  static_assert(kSize == decltype(size(dst))::value && kSize % 2 == 0);
  using Converter = cutlass::NumericArrayConverter<To, From, 2>;
  auto const* in = reinterpret_cast<cutlass::Array<From, 2> const*>(raw_pointer_cast(src.data()));
  auto* out = reinterpret_cast<cutlass::Array<To, 2>*>(raw_pointer_cast(dst.data()));
  CUTE_UNROLL
  for (int i = 0; i < kSize / 2; ++i) out[i] = Converter::convert(in[i]);
}

//! Adds units * a shared-memory tile into an accumulator through `copy` (ldmatrix), one slice
//! (the copy's third mode) at a time, so that few registers hold the tile: `tile` is the
//! copy's source partition of it, `acc` the copy's retiled view of the accumulator.
template <class Element, class TiledCopy, class TensorTile, class TensorAcc>
CUTE_DEVICE void add_tile_in_slices(TiledCopy const& copy, TensorTile const& tile, TensorAcc&& acc,
                                    float units) {
  CUTE_UNROLL
  for (int n = 0; n < size<2>(acc); ++n) {
    Tensor slice = make_fragment_like<Element>(acc(_, _, n));
    cute::copy(copy, tile(_, _, n), slice);
    Tensor acc_slice = acc(_, _, n);
    CUTE_UNROLL
    for (int i = 0; i < size(slice); ++i) acc_slice(i) = fmaf(float(slice(i)), units, acc_slice(i));
  }
}

//! 2^x on the special-function unit (ex2.approx, ~2 ulp); exp2(-inf) = +0.
CUTE_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

//! 1/x on the special-function unit (rcp.approx, about 1 ulp; 1/inf = 0).
CUTE_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

//! log2(x) on the special-function unit (lg2.approx, absolute error below 2^-22); log2(0) =
//! -inf.
CUTE_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

//! Reduces over the 4 threads (a quad) that share one accumulator row.
template <class Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return op(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

//! op over value(0), ..., value(kLength - 1), in source order, accumulated in up to kMaxChains
//! (1, 2 or 4) independent chains that are combined at the end: a single chain of dependent
//! FMNMX or FADD (32 per accumulator row at 128 columns) is latency the next step waits on.
template <int kLength, int kMaxChains = 4, class Value, class Op>
CUTE_DEVICE float chained_reduce(Value&& value, Op op) {
  static_assert(kMaxChains == 1 || kMaxChains == 2 || kMaxChains == 4);
  constexpr int kChains = kMaxChains == 4 && kLength % 4 == 0   ? 4
                          : kMaxChains >= 2 && kLength % 2 == 0 ? 2
                                                                : 1;
  float chain[kChains];
  CUTE_UNROLL
  for (int k = 0; k < kChains; ++k) chain[k] = value(k);
  CUTE_UNROLL
  for (int i = kChains; i < kLength; ++i) chain[i % kChains] = op(chain[i % kChains], value(i));
  CUTE_UNROLL
  for (int width = kChains / 2; width > 0; width /= 2) {
    CUTE_UNROLL
    for (int k = 0; k < width; ++k) chain[k] = op(chain[k], chain[k + width]);
  }
  return chain[0];
}

//! The CTA barrier (0, __syncthreads's) split: warps that arrive go on, warps that sync wait
//! for `threads` arrivals in all. Memory operations before either are visible to the threads
//! that synced.
CUTE_DEVICE void prologue_barrier_arrive(int threads) {
  asm volatile("barrier.cta.arrive.aligned 0, %0;\n" : : "r"(threads) : "memory");
}
CUTE_DEVICE void prologue_barrier_sync(int threads) {
  asm volatile("barrier.cta.sync.aligned 0, %0;\n" : : "r"(threads) : "memory");
}

//! The index of the calling thread's warp within its warpgroup, in a form the compiler knows to
//! be warp-uniform (so code selected by it stays uniform).
CUTE_DEVICE int warp_index_in_warp_group() {
  return __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0);
}

//! Adds `bytes` of fp32 values from shared memory into global memory, elementwise, as one bulk
//! asynchronous reduction in the current bulk group (TMA engine; the additions happen in L2).
CUTE_DEVICE void bulk_reduce_add(float const* smem, float* gmem, int32_t bytes) {
  const uint32_t smem_address = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(gmem), "r"(smem_address), "r"(bytes)
               : "memory");
}

//! Waits until at most kPending of this thread's committed bulk groups are still in flight, with
//! their global writes complete (not only their shared-memory reads).
template <int kPending>
CUTE_DEVICE void bulk_wait_complete() {
  asm volatile("cp.async.bulk.wait_group %0;\n" : : "n"(kPending) : "memory");
}

//! Spins until the 32-bit counter at `counter` reads `value` (acquire, GPU scope).
CUTE_DEVICE void wait_counter_equals(int const* counter, int value) {
  int current;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(current) : "l"(counter) : "memory");
  } while (current != value);
}

//! Increments the counter at `counter` (release, GPU scope): what this thread wrote before, its
//! completed bulk reductions included, is visible to whoever reads the new value with acquire.
CUTE_DEVICE void release_counter_increment(int* counter) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" : : "l"(counter) : "memory");
}

struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};

}  // namespace jax_flash::sm90
