/*! \file kernel_traits_fwd.h
    \brief Compile-time description of one Hopper forward kernel: tile sizes (from the generated
           configuration table), warp roles and register budgets, WGMMA types, shared-memory
           layouts and TMA types. The collectives build their storage and parameters from it.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernel_traits.h"
#include "named_barriers.h"
#include "softmax.h"
#include "sm90_tiles.h"  // generated from jax_flash/kernel_configs.json

namespace jax_flash::sm90 {

using namespace cute;

template <class Element_, int kHeadDim_, int kTileBlockM_, bool kSoftcap_, bool kSegments_,
          bool kMask_, bool kBias_>
struct ForwardKernelTraits {
  using Element = Element_;
  using Tile = ForwardTileConfig<kHeadDim_, kTileBlockM_>;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSoftcap = kSoftcap_;  //!< logits are soft-capped (softcap.h)
  //! Segment ids (packed sequences) narrow the blocks visited and mask by id.
  static constexpr bool kSegments = kSegments_;
  //! A mask array: its block classes narrow the blocks visited and skip the empty ones, its
  //! elements mask the partial ones.
  static constexpr bool kMask = kMask_;
  //! A bias array, added to every block's logits.
  static constexpr bool kBias = kBias_;
  //! Block classes (of the mask, or where the bias drops whole blocks) narrow the blocks
  //! visited and skip the empty ones.
  static constexpr bool kBlockClasses = kMask || kBias;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;

  // Warp roles: one producer warpgroup issuing TMA loads, one consumer warpgroup per 64 rows.
  static constexpr int kNumConsumerWarpGroups = kBlockM / 64;
  static constexpr int kNumConsumerThreads = kNumConsumerWarpGroups * kThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumConsumerThreads + kThreadsPerWarpGroup;
  static_assert(kBlockM % 64 == 0 && kNumConsumerWarpGroups >= 1 && kNumConsumerWarpGroups <= 3);
  //! The consumer warpgroups take turns at each key block's softmax step as they do at GEMM
  //! issue (kernel_configs.json, softmax_turns): two warpgroups that run their exponentials at
  //! once crowd the special-function unit's queue (MIO throttle), which the turns leave to one
  //! at a time while the other's GEMMs run. Not under a soft cap: its series adds FMA-pipe work
  //! to every exponential, which the other warpgroup's step overlaps better than its wait at
  //! the turn (H200, T = 1024 and 4096: capped 2.3-4.6% faster without turns at head dim 128,
  //! unchanged at 64; uncapped 2.5-2.8% slower without them).
  static constexpr bool kSoftmaxTurns = Tile::kSoftmaxTurns && !kSoftcap;
  static_assert(!kSoftmaxTurns || kNumConsumerWarpGroups == 2,
                "softmax_turns needs a tile of two consumer warpgroups (block_m 128): one has no "
                "other to take turns with, three leave no named barriers for the turns");
  using Barriers = ForwardBarriers<kNumConsumerWarpGroups, kSoftmaxTurns>;
  //! The consumers take every key block through one loop body (kernel_configs.json,
  //! one_loop_body): no peeled first block, and a block's softmax waits for the previous
  //! block's P V instead of overlapping it. A tile of few key blocks per CTA (decoding's key
  //! chunks) then runs, and fetches cold, one copy of the code (the plain kernel: 4544 SASS
  //! instructions instead of 5480; a single row at B = 1, S = 4096 2-3% faster, H200).
  static constexpr bool kOneLoopBody = Tile::kOneLoopBody;

  // setmaxnreg budgets. With three consumer warpgroups the producer takes 32, which leaves each
  // consumer 160 (ptxas: no spills on either side); the 152 that any larger producer budget
  // leaves made the head-dim-64 consumers spill and lose 18-31% of their speed (measured on
  // H200). With two, 40 lets the producer run without spills and leaves the consumers 232.
  static constexpr int kProducerRegisters = kNumConsumerWarpGroups >= 3 ? 32 : 40;
  static constexpr int kConsumerRegisters = mma_registers(kNumConsumerThreads, kProducerRegisters);

  //! Skipping the output's rescale (softmax.h) costs a vote and a branch per block. It pays
  //! where the consumers' instruction issue binds (soft-capped logits: up to +6% forward at head
  //! dims 64 and 128) or where a row holds more output columns than logits (head dim 256, 80
  //! keys per block: +3-7%); elsewhere it lost up to 4% (H200, bf16, T = 1024 and 4096, same
  //! runs).
  static constexpr bool kLazyRescale = kSoftcap || kHeadDim > kBlockN;
  //! Two rows per thread (a 64-row atom). The row reductions run in four chains, except on
  //! 160-register consumers (three warpgroups), where four ran 2-3% slower and one chain is
  //! kept; elsewhere four gained up to 3.5% (H200, bf16, T = 1024 and 4096, same machine).
  using Softmax = OnlineSoftmax<2, kNumConsumerWarpGroups >= 3 ? 1 : 4, kLazyRescale>;
  //! Logits to log2 units: products rounded where a bias can make logits huge.
  using Logits = ScaledLogits<kBias>;

  // S = Q K^T from shared memory; O += P V with P in registers. Each consumer warpgroup owns
  // 64 rows of the block.
  using AtomLayoutMma = Layout<Shape<Int<kNumConsumerWarpGroups>, _1, _1>>;
  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayoutMma{}));
  //! O += P V over kWarpGroups consumer warpgroups of 64 rows each.
  template <int kWarpGroups>
  using MmaPVOver = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using TiledMmaPV = MmaPVOver<kNumConsumerWarpGroups>;

  // Shared memory: 128-byte swizzled K-major tiles for Q, K, V and O; V is read transposed
  // (MN-major) by the second GEMM through a composed view.
  //! A tile of kRows rows of the head dim (Q, O).
  template <int kRows>
  using SmemLayoutRows = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kRows>,
                                                          Int<kHeadDim>>(),
      Shape<Int<kRows>, Int<kHeadDim>>{}));
  using SmemLayoutQ = SmemLayoutRows<kBlockM>;
  using SmemLayoutAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                    GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemLayoutAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  static constexpr int kQBytes = cosize_v<SmemLayoutQ> * sizeof(Element);
  static constexpr int kKVStageBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kKVBytes = cosize_v<SmemLayoutKV> * sizeof(Element);
  static constexpr int kSmemBudget = 227 * 1024;
  //! One consumer warpgroup's 64 rows of O, stored by TMA through shared memory.
  using OutputTileShape = Shape<_64, Int<kHeadDim>>;
  using SmemLayoutO = SmemLayoutRows<64>;
  static constexpr int kOutputTileBytes = cosize_v<SmemLayoutO> * sizeof(Element);
  //! Whether the epilogue has an output tile per consumer warpgroup beside Q and the K/V
  //! stages; then each warpgroup stores its rows as soon as it has them. Where they do not fit
  //! (head dim 256), O goes through shared memory that the tile no longer reads, the K and V
  //! stages of its last key block (warpgroup 0's rows through K, 1's through V), freed once
  //! the stores have read them. So Q is still freed after the last QK^T GEMM and the next
  //! tile's Q loads under this tile's last block and epilogue (written over Q, O made that
  //! load wait for the output store).
  static constexpr bool kOwnOutputTiles =
      kQBytes + 2 * kKVBytes + kNumConsumerWarpGroups * kOutputTileBytes + 1024 <= kSmemBudget;
  static_assert(kOwnOutputTiles || (kNumConsumerWarpGroups <= 2 &&
                                    kKVStageBytes >= kOutputTileBytes && kKVStageBytes % 1024 == 0),
                "without output tiles of its own, each consumer warpgroup's O needs a K or V stage");
  //! The P V product of one consumer warpgroup: its C partition places the warpgroup's output
  //! fragments in its output tile.
  using TiledMmaPVStored = MmaPVOver<1>;

  using GmemTensorSeq = typename SequenceTensor<Element>::Type;
  using ShapeSeq = typename SequenceTensor<Element>::Shape;
  using TmaLoadQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{}, SmemLayoutQ{},
                                          select<0, 2>(TileShapeQK{}), _1{}));
  using TmaLoadKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{},
                                           take<0, 2>(SmemLayoutKV{}), select<1, 2>(TileShapeQK{}),
                                           _1{}));
  using TmaStoreO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorSeq{}, SmemLayoutO{},
                                           OutputTileShape{}, _1{}));

  // A bias that keeps the query and key axes reaches each consumer warpgroup by TMA, its 64
  // rows of a key block at a time, where shared memory holds that beside the rest (not at
  // head dim 256, whose K/V stages fill it). The tile lies as in memory, (keys, queries) with
  // keys contiguous; the consumers read it as (queries, keys) into the S accumulator layout
  // with ldmatrix.
  static constexpr int kBiasRowsBytes = 64 * kBlockN * int(sizeof(Element));
  static constexpr bool kBiasInTiles =
      kBias && (kOwnOutputTiles ? 2 : 1) * kQBytes + 2 * kKVBytes +
                       kNumConsumerWarpGroups * kBiasRowsBytes + 1024 <=
                   kSmemBudget;
  using SmemLayoutBiasRows = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kBlockN>,
                                                          _64>(),
      Shape<Int<kBlockN>, _64>{}));
  using SmemCopyAtomBias = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  //! S = Q K^T of one consumer warpgroup: its part of TiledMmaQK's accumulators.
  using MmaQKOneWarpGroup = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>()));
  using GmemTensorBias = typename LogitTensor<Element>::Type;
  using ShapeBias = typename LogitTensor<Element>::Shape;
  using TmaLoadBias = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorBias{}, SmemLayoutBiasRows{},
                                             Shape<Int<kBlockN>, _64>{}, _1{}));
  //! One tile in flight per consumer warpgroup: each frees its rows of a key block as soon as
  //! it added them, a whole key block before it needs the next.
  using PipelineBias = cutlass::PipelineTmaAsync<1>;

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
};

}  // namespace jax_flash::sm90
