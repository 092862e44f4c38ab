/*! \file kernel_traits.h
    \brief Compile-time description of one Hopper forward kernel: tile sizes (from the generated
           configuration table), warp roles and register budgets, WGMMA types, shared-memory
           layouts, TMA types and the shared-storage struct.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90_forward_tiles.h"  // generated from jax_flash/kernel_configs.json
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

inline constexpr int kRegistersPerSm = 64 * 1024;

//! Registers per thread when `threads` threads share one SM (allocation granularity 8).
constexpr int registers_at_launch(int threads) { return (kRegistersPerSm / threads) / 8 * 8; }

template <class Element_, int kHeadDim_>
struct ForwardKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  using Tile = ForwardTile<kHeadDim_>;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;

  // Warp roles: one producer warpgroup issuing TMA loads, one consumer warpgroup per 64 rows.
  static constexpr int kNumConsumerWarpGroups = kBlockM / 64;
  static constexpr int kNumConsumerThreads = kNumConsumerWarpGroups * kThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumConsumerThreads + kThreadsPerWarpGroup;
  static_assert(kBlockM % 64 == 0 && kNumConsumerWarpGroups >= 1 && kNumConsumerWarpGroups <= 3);

  // setmaxnreg budgets: consumers share what the launch allocation (all the block owns) leaves
  // after the producer. With three consumer warpgroups the producer takes 32, which leaves each
  // consumer 160 (ptxas: no spills on either side); the 152 that any larger producer budget
  // leaves made the head-dim-64 consumers spill and lose 18-31% of their speed (measured on
  // H200). With two, 40 lets the producer run without spills and leaves the consumers 232.
  static constexpr int kRegistersOwned = registers_at_launch(kNumThreads) * kNumThreads;
  static constexpr int kProducerRegisters = kNumConsumerWarpGroups >= 3 ? 32 : 40;
  static constexpr int kConsumerRegisters =
      cute::min(256, (kRegistersOwned - kProducerRegisters * kThreadsPerWarpGroup) /
                         kNumConsumerThreads / 8 * 8);
  static_assert(kConsumerRegisters * kNumConsumerThreads +
                    kProducerRegisters * kThreadsPerWarpGroup <= kRegistersOwned);

  // S = Q K^T from shared memory; O += P V with P in registers. Each consumer warpgroup owns
  // 64 rows of the block.
  using AtomLayoutMma = Layout<Shape<Int<kNumConsumerWarpGroups>, _1, _1>>;
  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayoutMma{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutMma{}));

  // Shared memory: 128-byte swizzled K-major tiles for Q, K, V and O; V is read transposed
  // (MN-major) by the second GEMM through a composed view.
  using SmemLayoutAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                    GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemLayoutAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kQBytes = cosize_v<SmemLayoutQ> * sizeof(Element);
  static constexpr int kKVStageBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kKVBytes = cosize_v<SmemLayoutKV> * sizeof(Element);
  static constexpr int kSmemBudget = 227 * 1024;
  //! Without room for a separate output tile the epilogue writes O over Q (dead by then); the
  //! next block's Q load then waits for the output store instead of the last QK^T GEMM.
  static constexpr bool kOutputAliasesQuery = kQBytes + 2 * kKVBytes + kQBytes + 1024 > kSmemBudget;

  // TMA over the BTNH layout read in place: (sequence, head dim, heads, batch items).
  using ShapeSeq = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSeq = cute::Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensorSeq = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                             ShapeSeq{}, StrideSeq{}));
  using TmaLoadQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{}, SmemLayoutQ{},
                                          select<0, 2>(TileShapeQK{}), _1{}));
  using TmaLoadKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{},
                                           take<0, 2>(SmemLayoutKV{}), select<1, 2>(TileShapeQK{}),
                                           _1{}));
  using TmaStoreO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorSeq{}, SmemLayoutO{},
                                           select<0, 2>(TileShapeQK{}), _1{}));

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct alignas(1024) TensorStorageSeparateOutput {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutO>, 1024> o;
    CUTE_DEVICE Element* output() { return o.data(); }
  };
  struct alignas(1024) TensorStorageOutputOverQuery {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    CUTE_DEVICE Element* output() { return q.data(); }
  };
  using TensorStorage = std::conditional_t<kOutputAliasesQuery, TensorStorageOutputOverQuery,
                                           TensorStorageSeparateOutput>;

  struct SharedStorage {
    TensorStorage tensors;
    struct Barriers {
      cutlass::arch::ClusterTransactionBarrier q_full;
      cutlass::arch::ClusterBarrier q_empty;
      typename PipelineKV::SharedStorage k;
      typename PipelineKV::SharedStorage v;
    } barriers;
  };
  static constexpr int kSharedStorageBytes = sizeof(SharedStorage);
  static_assert(kSharedStorageBytes <= kSmemBudget, "tile configuration exceeds shared memory");
};

}  // namespace jax_flash::sm90
