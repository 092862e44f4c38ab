/*! \file kernel_bwd_postprocess.h
    \brief The backward's last kernel: per (query block, head, batch), reads the fp32 dQ partial
           sums back in the accumulator layout the main kernel's warpgroups wrote them in,
           scales, rounds to the input type and stores dQ through shared memory with one TMA
           store (which clips rows past the sequence and columns past the head dim); and the
           bias gradient's conversion from its float32 accumulator.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct BackwardPostprocess {
  using Element = typename Traits::Element;
  using DqTile = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  static constexpr int kNumThreads = Traits::kNumMmaThreads;  // the main kernel's MMA threads

  struct Arguments {
    const float* dq_accum;              //!< (batch, heads, query blocks, kDqBlockFloats)
    typename Traits::GmemTensorSeq dq;  //!< full batch shape
    int32_t num_m_blocks;
    int32_t num_heads;
    float scale;
  };

  struct Params {
    const float* dq_accum;
    typename Traits::TmaStoreDq tma_store_dq;
    typename Traits::ShapeSeq shape_dq;
    int32_t num_m_blocks;
    int32_t num_heads;
    float scale;
  };

  static Params to_params(Arguments const& args) {
    Params params;
    params.dq_accum = args.dq_accum;
    params.tma_store_dq = make_tma_copy(SM90_TMA_STORE{}, args.dq, typename Traits::SmemLayoutDq{},
                                        DqTile{}, _1{});
    params.shape_dq = args.dq.shape();
    params.num_m_blocks = args.num_m_blocks;
    params.num_heads = args.num_heads;
    params.scale = args.scale;
    return params;
  }

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutDq>, 1024> dq;
  };
  static constexpr int kSharedStorageBytes = sizeof(SharedStorage);
};

template <class Traits>
__global__ void __launch_bounds__(BackwardPostprocess<Traits>::kNumThreads)
    backward_postprocess_kernel(CUTE_GRID_CONSTANT typename BackwardPostprocess<Traits>::Params const params) {
  using Postprocess = BackwardPostprocess<Traits>;
  using Element = typename Traits::Element;
  extern __shared__ char shared_memory[];
  auto& storage = *reinterpret_cast<typename Postprocess::SharedStorage*>(shared_memory);

  // Blocks are numbered like the accumulator: (batch, head, query block).
  const int32_t tile = blockIdx.x;
  const int32_t m_block = tile % params.num_m_blocks;
  const int32_t head_linear = tile / params.num_m_blocks;
  const int32_t head = head_linear % params.num_heads;
  const int32_t batch = head_linear / params.num_heads;
  const float* block = params.dq_accum + int64_t(tile) * Traits::kDqBlockFloats;

  const int thread_idx = threadIdx.x;
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int lane = thread_idx % kThreadsPerWarpGroup;
  typename Traits::TiledMmaDq mma_dq;
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dq);
  auto thr_copy = smem_copy.get_thread_slice(thread_idx);
  Tensor sDq = make_tensor(make_smem_ptr(storage.dq.data()), typename Traits::SmemLayoutDq{});
  using SliceShape = Shape<Int<Traits::kBlockM>, Int<Traits::kDqSliceDim>>;
  for_each(make_int_sequence<Traits::kDqSlices>{}, [&](auto slice) {
    Tensor acc = partition_fragment_C(mma_dq, SliceShape{});
    const float4* unit = reinterpret_cast<const float4*>(
        block + (decltype(slice)::value * Traits::kNumMmaWarpGroups + warp_group) *
                    Traits::kDqUnitFloats);
    CUTE_UNROLL
    for (int i = 0; i < size(acc) / 4; ++i) {
      const float4 v = unit[i * kThreadsPerWarpGroup + lane];
      acc(4 * i) = v.x * params.scale;
      acc(4 * i + 1) = v.y * params.scale;
      acc(4 * i + 2) = v.z * params.scale;
      acc(4 * i + 3) = v.w * params.scale;
    }
    Tensor out = make_tensor<Element>(acc.layout());
    convert_into(acc, out);
    Tensor sSlice = local_tile(sDq, SliceShape{}, make_coord(_0{}, slice));
    copy(smem_copy, thr_copy.retile_S(out), thr_copy.partition_D(sSlice));
  });
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  if (thread_idx == 0) {
    Tensor mDq = params.tma_store_dq.get_tma_tensor(params.shape_dq);
    Tensor gDq = local_tile(mDq(_, _, head, batch), typename Postprocess::DqTile{},
                            make_coord(m_block, _0{}));
    auto tma = params.tma_store_dq.get_slice(_0{});
    copy(params.tma_store_dq, tma.partition_S(sDq), tma.partition_D(gDq));
    tma_store_arrive();
    tma_store_wait<0>();
  }
}

//! Threads per CTA of the bias gradient's conversion.
inline constexpr int kBiasGradientConvertThreads = 256;

template <class Element>
struct BiasGradientConvertParams {
  const float* accum;  //!< see BiasGradient
  Element* dbias;      //!< laid out like the accumulator
  int64_t count;       //!< elements of both
};

//! The bias gradient's conversion: rounds the float32 accumulator into the dbias result,
//! element by element.
template <class Element>
__global__ void __launch_bounds__(kBiasGradientConvertThreads)
    bias_gradient_convert_kernel(CUTE_GRID_CONSTANT BiasGradientConvertParams<Element> const p) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    p.dbias[i] = Element(p.accum[i]);
  }
}

}  // namespace jax_flash::sm90
