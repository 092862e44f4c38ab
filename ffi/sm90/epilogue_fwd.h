/*! \file epilogue_fwd.h
    \brief Forward epilogue collective: its arguments, parameters and shared storage (an output
           tile per consumer warpgroup, unless O is written over Q); normalises O, writes the
           log-sum-exp, and stores O through shared memory (stmatrix) with a TMA store per
           warpgroup (per block over Q), which clips rows past the sequence and columns past
           the head dim.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "mainloop_fwd.h"
#include "named_barriers.h"
#include "softmax.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct ForwardEpilogue {
  using Element = typename Traits::Element;
  using TileShapeQK = typename Traits::TileShapeQK;
  using TileInfo = typename ForwardMainloop<Traits>::TileInfo;
  static constexpr int kNumConsumerThreads = Traits::kNumConsumerThreads;

  struct Arguments {
    typename Traits::GmemTensorSeq o;  //!< full batch shape
    float* lse;                        //!< (batch, heads, seqlen_q)
  };

  using SmemLayoutO = typename Traits::SmemLayoutO;
  static constexpr int kOutputRows = Traits::kOutputRows;
  //! Threads that store one tile of kOutputRows rows together.
  static constexpr int kStoreThreads = kOutputRows / 64 * kThreadsPerWarpGroup;

  struct Params {
    typename Traits::TmaStoreO tma_store_o;
    typename Traits::ShapeSeq shape_o;
    float* lse;
  };

  static Params to_params(Arguments const& args) {
    Params params;
    params.tma_store_o = make_tma_copy(SM90_TMA_STORE{}, args.o, SmemLayoutO{},
                                       typename Traits::OutputTileShape{}, _1{});
    params.shape_o = args.o.shape();
    params.lse = args.lse;
    return params;
  }

  //! The consumer warpgroups' output tiles, or nothing when the kernel hands the epilogue the
  //! query tile instead.
  struct OutputTile {
    cute::array_aligned<Element, cosize_v<SmemLayoutO> * Traits::kNumConsumerWarpGroups, 1024> o;
  };
  struct NoOutputTile {};
  using SharedStorage = std::conditional_t<Traits::kOutputAliasesQuery, NoOutputTile, OutputTile>;

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store_o.get_tma_descriptor());
  }

  //! Normalises and stores one tile through `smem_o` (this collective's storage, or the query
  //! tile when kOutputAliasesQuery). Every consumer thread calls it, for empty tiles too (tOrO
  //! is then zero and every row comes out as O = 0, lse = -inf). The first thread of each
  //! group of kStoreThreads issues the group's store, and with kOutputAliasesQuery it also
  //! waits for the store before returning, because the next tile's Q lands in the same shared
  //! memory. `warp_group`: the consumer warpgroup, warp-uniform as the mainloop's.
  template <class TensorO>
  CUTE_DEVICE static void store(Params const& params, AttentionProblem const& problem,
                                Element* smem_o, TileInfo const& info, int warp_group,
                                int thread_idx, TensorO& tOrO,
                                typename Traits::Softmax& softmax) {
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor cO = make_identity_tensor(select<0, 2>(TileShapeQK{}));
    Tensor tOcO = thr_pv.partition_C(cO);
    Tensor rows = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));

    bool dead[2];
    float lse[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) dead[r] = info.m_start() + get<0>(rows(r, 0)) >= info.lens.q_len;
    const auto inv_sum = softmax.finalize(dead, lse);
    Tensor o = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
    scale_rows(o, inv_sum);

    // One thread of each quad holds the row statistics.
    if (thread_idx % 4 == 0) {
      float* lse_rows = params.lse + (info.coord.batch * problem.num_heads + info.coord.head) *
                                         int64_t(problem.seqlen_q);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = info.m_start() + get<0>(rows(r, 0));
        if (row < problem.seqlen_q) lse_rows[row] = lse[r];
      }
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, tOrO_out);

    // The stored tile: the warpgroup's own, or the block's.
    const int group = kStoreThreads == kNumConsumerThreads ? 0 : warp_group;
    const int group_thread = thread_idx % kStoreThreads;
    const uint32_t group_barrier = static_cast<uint32_t>(ForwardBarrier::kOutputFirst) + group;
    Tensor sO = make_tensor(make_smem_ptr(smem_o + group * cosize_v<SmemLayoutO>), SmemLayoutO{});
    if constexpr (!Traits::kOutputAliasesQuery) {
      // The group's previous store must have finished reading its output tile.
      if (group_thread == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(kStoreThreads, group_barrier);
    }
    typename Traits::TiledMmaPVStored mma_stored;
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_stored);
    auto thr_copy = smem_copy.get_thread_slice(opaque(group_thread));
    copy(smem_copy, thr_copy.retile_S(tOrO_out), thr_copy.partition_D(sO));
    // Generic-proxy writes must be visible to the TMA (async proxy) before the store.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kStoreThreads, group_barrier);
    if (group_thread == 0) {
      Tensor mO = params.tma_store_o.get_tma_tensor(params.shape_o);
      Tensor gO = local_tile(mO(_, _, info.coord.head, info.coord.batch),
                             typename Traits::OutputTileShape{},
                             make_coord(info.coord.block * (Traits::kBlockM / kOutputRows) + group,
                                        _0{}));
      auto tma_o = params.tma_store_o.get_slice(_0{});
      copy(params.tma_store_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
      tma_store_arrive();
      if constexpr (Traits::kOutputAliasesQuery) tma_store_wait<0>();
    }
  }

  //! Before the CTA exits, each group's last store must have read shared memory.
  CUTE_DEVICE static void finish(int thread_idx) {
    if (thread_idx % kStoreThreads == 0) tma_store_wait<0>();
  }
};

}  // namespace jax_flash::sm90
