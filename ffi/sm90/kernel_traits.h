/*! \file kernel_traits.h
    \brief What the Hopper kernels share at compile time: element types (element_types.h), the
           global views of a BTNH operand read in place and of a bias moved in tiles, and the
           register budget split between a producer warpgroup and the MMA warpgroups.
*/
#pragma once

#include <cute/tensor.hpp>

#include "element_types.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

inline constexpr int kRegistersPerSm = 64 * 1024;

//! Registers per thread when `threads` threads share one SM (allocation granularity 8).
constexpr int registers_at_launch(int threads) { return (kRegistersPerSm / threads) / 8 * 8; }

//! setmaxnreg budget of the MMA warpgroups of a block of one producer warpgroup and
//! `mma_threads` MMA threads: what the launch allocation (all the block owns) leaves after the
//! producer's `producer_registers`, at most 256.
constexpr int mma_registers(int mma_threads, int producer_registers) {
  const int owned = registers_at_launch(mma_threads + kThreadsPerWarpGroup) *
                    (mma_threads + kThreadsPerWarpGroup);
  const int left = (owned - producer_registers * kThreadsPerWarpGroup) / mma_threads / 8 * 8;
  return left < 256 ? left : 256;
}

//! A four-mode global tensor read in place, one of its modes contiguous (Stride says which).
template <class Element, class Stride_>
struct GmemTensor4 {
  using Shape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using Stride = Stride_;
  using Type = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape{},
                                    Stride{}));
};

//! A BTNH operand (or result) read in place, as (sequence, head dim, heads, batch items).
template <class Element>
using SequenceTensor = GmemTensor4<Element, cute::Stride<int64_t, _1, int64_t, int64_t>>;

//! A logit array (a bias) moved in tiles by TMA, as (keys, queries, heads, batch items): keys
//! contiguous, an axis it broadcasts of extent 1.
template <class Element>
using LogitTensor = GmemTensor4<Element, cute::Stride<_1, int64_t, int64_t, int64_t>>;

}  // namespace jax_flash::sm90
