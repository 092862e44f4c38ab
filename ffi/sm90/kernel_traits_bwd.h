/*! \file kernel_traits_bwd.h
    \brief Compile-time description of one Hopper backward kernel: tile sizes and warpgroup
           layouts (from the generated configuration table), register budgets, the WGMMA types of
           the five products, shared-memory layouts, TMA types, and the order in which the fp32
           dQ partial sums travel (shared by the main kernel and the dQ convert kernel).

    Every product runs with the key block as the M side of S and dP: S^T = K Q^T and
    dP^T = V dO^T leave each warpgroup holding rows of keys, which are the rows of dV += P^T dO
    and dK += dS^T Q. When a warpgroup's S^T rows are exactly its dK/dV rows, P^T and dS^T feed
    those products straight from registers; otherwise (head dim 256, where dK and dV are split
    along the head dim to fit the registers) they go through shared memory. dS^T is always
    staged in shared memory for dQ = dS K, which reads it transposed.
*/
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernel_traits.h"
#include "sm90_tiles.h"  // generated from jax_flash/kernel_configs.json

namespace jax_flash::sm90 {

using namespace cute;

template <class Element_, int kHeadDim_, bool kSoftcap_, bool kSegments_, bool kMask_,
          bool kBias_>
struct BackwardKernelTraits {
  using Element = Element_;
  using Tile = BackwardTileConfig<kHeadDim_>;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSoftcap = kSoftcap_;  //!< logits are soft-capped (softcap.h)
  //! Segment ids (packed sequences) narrow the blocks visited and mask by id.
  static constexpr bool kSegments = kSegments_;
  //! A mask array: its block classes narrow the blocks visited and skip the empty ones, its
  //! elements mask the partial ones.
  static constexpr bool kMask = kMask_;
  //! A bias array, added to every block's logits; its gradient is computed when wanted.
  static constexpr bool kBias = kBias_;
  //! Block classes (of the mask, or where the bias drops whole blocks) narrow the blocks
  //! visited and skip the empty ones.
  static constexpr bool kBlockClasses = kMask || kBias;
  static constexpr int kBlockM = Tile::kBlockM;  //!< queries per step
  static constexpr int kBlockN = Tile::kBlockN;  //!< keys per CTA
  //! A bias tile per step takes shared memory that some tiles find by fewer Q stages.
  static constexpr int kStagesQ =
      kBias && Tile::kStagesQWithBias > 0 ? Tile::kStagesQWithBias : Tile::kStagesQ;
  static constexpr int kStagesDo = Tile::kStagesDo;
  static constexpr int kStagesDs = Tile::kStagesDs;
  //! dQ is computed and reduced in this many slices of the head dim (fewer registers and less
  //! shared memory for its fp32 staging).
  static constexpr int kDqSlices = Tile::kDqSlices;

  // Warp roles: one producer warpgroup (warp 0 issues the TMA loads, warp 1 reduces the dQ
  // partial sums into global memory) and two MMA warpgroups.
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * kThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + kThreadsPerWarpGroup;
  //! Both producer warps run short loops of address arithmetic; 24 leaves the MMA warpgroups
  //! 240, which the dK and dV accumulators (half the register file) need.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = mma_registers(kNumMmaThreads, kProducerRegisters);

  // How the MMA warpgroups split each product: along keys (M) or queries / head dim (N).
  static constexpr int kSdpWarpGroupsAlongKeys = Tile::kSdpWarpGroupsAlongKeys;
  static constexpr int kDkvWarpGroupsAlongKeys = Tile::kDkvWarpGroupsAlongKeys;
  static constexpr int kDqWarpGroupsAlongQueries = Tile::kDqWarpGroupsAlongQueries;
  static constexpr int kSdpWarpGroupsAlongQueries = kNumMmaWarpGroups / kSdpWarpGroupsAlongKeys;
  static constexpr int kDkvWarpGroupsAlongHeadDim = kNumMmaWarpGroups / kDkvWarpGroupsAlongKeys;
  static constexpr int kDqWarpGroupsAlongHeadDim = kNumMmaWarpGroups / kDqWarpGroupsAlongQueries;
  static_assert(kBlockN == 64 * kSdpWarpGroupsAlongKeys && kBlockN == 64 * kDkvWarpGroupsAlongKeys,
                "each warpgroup holds 64 key rows of S^T and of dK/dV");
  static_assert(kBlockM == 64 * kDqWarpGroupsAlongQueries, "each warpgroup holds 64 dQ rows");
  static_assert(kHeadDim % (kDqSlices * kDqWarpGroupsAlongHeadDim * 8) == 0);

  //! P^T and dS^T reach the dV and dK products from registers when each warpgroup's S^T rows
  //! are its whole dK/dV rows.
  static constexpr bool kDkvFromRegisters =
      kSdpWarpGroupsAlongKeys == kNumMmaWarpGroups && kDkvWarpGroupsAlongKeys == kNumMmaWarpGroups;

  using TileShape = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;

  // S^T = K Q^T and dP^T = V dO^T: (keys, queries, head dim), both operands K-major.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum,
                           Shape<_64, Int<kBlockM / kSdpWarpGroupsAlongQueries>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kSdpWarpGroupsAlongKeys>, Int<kSdpWarpGroupsAlongQueries>, _1>>{}));
  // dV += P^T dO and dK += dS^T Q: (keys, head dim, queries); dO and Q are read transposed.
  using AtomShapeDkv = Shape<_64, Int<kHeadDim / kDkvWarpGroupsAlongHeadDim>, Int<kBlockM>>;
  using TiledMmaDkv = decltype(make_tiled_mma(
      std::conditional_t<
          kDkvFromRegisters,
          decltype(GMMA::rs_op_selector<Element, Element, ElementAccum, AtomShapeDkv,
                                        GMMA::Major::K, GMMA::Major::MN>()),
          decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, AtomShapeDkv,
                                        GMMA::Major::K, GMMA::Major::MN>())>{},
      Layout<Shape<Int<kDkvWarpGroupsAlongKeys>, Int<kDkvWarpGroupsAlongHeadDim>, _1>>{}));
  // dQ = dS K, one slice of the head dim at a time: (queries, head dim slice, keys); dS and K
  // are both read transposed (MN-major).
  static constexpr int kDqSliceDim = kHeadDim / kDqSlices;
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum,
                           Shape<_64, Int<kDqSliceDim / kDqWarpGroupsAlongHeadDim>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWarpGroupsAlongQueries>, Int<kDqWarpGroupsAlongHeadDim>, _1>>{}));

  // Shared memory. Q and dO: (queries, head dim), K-major, also read as (head dim, queries) by
  // the dK/dV products, whose warpgroups may each take a slice of the head dim: the swizzle
  // atom must not be wider than that slice.
  using SmemLayoutAtomQdO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                     GMMA::Major::K, Element, Int<kBlockM>,
                                     Int<kHeadDim / kDkvWarpGroupsAlongHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemLayoutAtomQdO{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesQ>>{}));
  using SmemLayoutDo = decltype(tile_to_shape(
      SmemLayoutAtomQdO{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesDo>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesQ>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutDot = decltype(composition(
      SmemLayoutDo{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesDo>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K and V: (keys, head dim), K-major, resident for the whole CTA. dQ reads K as (head dim,
  // keys) in slices; the epilogue stores dK and dV through these same tiles.
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   GMMA::Major::K, Element, Int<kBlockN>,
                                   Int<kDqSliceDim / kDqWarpGroupsAlongHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemLayoutAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  using SmemLayoutAtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutV = decltype(tile_to_shape(SmemLayoutAtomV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS^T (and P^T when it goes through shared memory): (keys, queries) with queries contiguous,
  // as the accumulators hold them; dQ reads dS as (queries, keys), MN-major.
  using SmemLayoutAtomPdS = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                     GMMA::Major::K, Element, Int<kBlockN>,
                                     Int<kBlockM / kDqWarpGroupsAlongQueries>>());
  using SmemLayoutPdS = decltype(tile_to_shape(
      SmemLayoutAtomPdS{}, Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesDs>>{}));
  using SmemLayoutDsTransposed = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockM>, Int<kBlockN>, Int<kStagesDs>>{},
                                   Stride<Int<kBlockN>, _1, Int<kBlockM * kBlockN>>{})));
  //! How P^T and dS^T leave the S^T/dP^T accumulators for shared memory.
  using SmemCopyAtomPdS = Copy_Atom<
      std::conditional_t<(kBlockM * kBlockN / kNumMmaThreads) % 8 == 0, SM90_U32x4_STSM_N,
                         SM90_U32x2_STSM_N>,
      Element>;

  // The bias of a step, where TMA can read it (it keeps the query and key axes; see
  // BackwardMainloop): (keys, queries) with keys contiguous, as the bias lies in memory. The
  // MMA warpgroups read it into the S^T accumulator layout with transposing ldmatrix.
  using SmemLayoutBias = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kBlockN>,
                                                          Int<kBlockM>>(),
      Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemCopyAtomBias = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  //! A bias gradient with an element per logit leaves through the same tile, written with
  //! transposing stmatrix once the step has read the bias.
  using SmemCopyAtomBiasGradient = Copy_Atom<SM90_U16x8_STSM_T, Element>;
  static constexpr int kBiasTileBytes = kBias ? kBlockN * kBlockM * int(sizeof(Element)) : 0;

  // The fp32 dQ partial sums of one (query block, head) travel as kDqSlices x warpgroups units,
  // each in the order the warpgroup holds them in registers (groups of 4 consecutive registers
  // per thread, thread-minor), so that writing a unit to shared memory is conflict-free and
  // the bulk reduction into global memory is one contiguous copy. The convert kernel reads them
  // back with the same accumulator layout.
  static constexpr int kDqUnitFloats = kBlockM * kDqSliceDim / kNumMmaWarpGroups;
  static constexpr int kDqBlockFloats = kBlockM * kHeadDim;

  // dQ in the input type, (queries, head dim), as the convert kernel stores it.
  using SmemLayoutAtomDq = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                    GMMA::Major::K, Element, Int<kBlockM>,
                                    Int<kDqSliceDim / kDqWarpGroupsAlongHeadDim>>());
  using SmemLayoutDq = decltype(tile_to_shape(SmemLayoutAtomDq{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  static constexpr int kQStageBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr int kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kRowStatBytes = kBlockM * sizeof(float);
  static constexpr int kSmemBudget = 227 * 1024;

  using GmemTensorSeq = typename SequenceTensor<Element>::Type;
  using ShapeSeq = typename SequenceTensor<Element>::Shape;
  using TmaLoadQdO = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{},
                                            take<0, 2>(SmemLayoutQ{}),
                                            Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaLoadK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{}, SmemLayoutK{},
                                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaLoadV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorSeq{}, SmemLayoutV{},
                                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaStoreK = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorSeq{}, SmemLayoutK{},
                                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaStoreV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorSeq{}, SmemLayoutV{},
                                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  using TmaStoreDq = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorSeq{}, SmemLayoutDq{},
                                            Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));

  using GmemTensorBias = typename LogitTensor<Element>::Type;
  using ShapeBias = typename LogitTensor<Element>::Shape;
  using TmaLoadBias = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorBias{}, SmemLayoutBias{},
                                             Shape<Int<kBlockN>, Int<kBlockM>>{}, _1{}));
  using TmaStoreBias = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorBias{}, SmemLayoutBias{},
                                              Shape<Int<kBlockN>, Int<kBlockM>>{}, _1{}));

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelineDo = cutlass::PipelineTmaAsync<kStagesDo>;
  //! One bias tile in flight: the MMA warpgroups free it early in their step (soft-capped, once
  //! they read it again for tanh'; with a gradient stored through it, once its store has read
  //! it, as the step's dQ product starts), so the next one loads during the rest of the step.
  using PipelineBias = cutlass::PipelineTmaAsync<1>;
};

}  // namespace jax_flash::sm90
