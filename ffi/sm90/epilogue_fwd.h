/*! \file epilogue_fwd.h
    \brief Forward epilogue: normalise O, write the log-sum-exp, and store the O tile through
           shared memory (stmatrix) with one TMA store; the store clips rows past the sequence
           and columns past the head dim.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "block_info.h"
#include "named_barriers.h"
#include "softmax.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct ForwardEpilogue {
  using Element = typename Traits::Element;
  using TileShapeQK = typename Traits::TileShapeQK;
  using SharedStorage = typename Traits::SharedStorage;
  using Info = BlockInfo<Traits::kBlockM, Traits::kBlockN>;
  static constexpr int kNumConsumerThreads = Traits::kNumConsumerThreads;

  struct Params {
    typename Traits::TmaStoreO tma_store_o;
    typename Traits::ShapeSeq shape_o;
    float* lse;                //!< (batch, heads, seqlen_q)
  };

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store_o.get_tma_descriptor());
  }

  //! Normalises and stores one tile. Every consumer thread calls it, for empty tiles too (tOrO
  //! is then zero and every row comes out as O = 0, lse = -inf). The caller's thread 0 issues
  //! the store, and with kOutputAliasesQuery it also waits for the store before returning,
  //! because the next tile's Q lands in the same shared memory.
  template <class TensorO>
  CUTE_DEVICE static void store(Params const& params, ForwardProblem const& problem,
                                SharedStorage& storage, Info const& info, int thread_idx,
                                TensorO& tOrO, OnlineSoftmax<2>& softmax) {
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor cO = make_identity_tensor(select<0, 2>(TileShapeQK{}));
    Tensor tOcO = thr_pv.partition_C(cO);
    Tensor rows = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));

    bool dead[2];
    float lse[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) dead[r] = info.m_start() + get<0>(rows(r, 0)) >= info.q_len;
    const auto inv_sum = softmax.finalize(dead, lse);
    Tensor o = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
    scale_rows(o, inv_sum);

    // One thread of each quad holds the row statistics.
    if (thread_idx % 4 == 0) {
      float* lse_rows = params.lse + (info.out_batch * problem.num_heads + info.head) *
                                         int64_t(problem.seqlen_q);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = info.m_start() + get<0>(rows(r, 0));
        if (row < problem.seqlen_q) lse_rows[row] = lse[r];
      }
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, tOrO_out);

    Tensor sO = make_tensor(make_smem_ptr(storage.tensors.output()), typename Traits::SmemLayoutO{});
    if constexpr (!Traits::kOutputAliasesQuery) {
      // The previous tile's store must have finished reading the output tile.
      if (thread_idx == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(kNumConsumerThreads,
                                        static_cast<uint32_t>(ForwardBarrier::kOutputFree));
    }
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
    auto thr_copy = smem_copy.get_thread_slice(opaque(thread_idx));
    copy(smem_copy, thr_copy.retile_S(tOrO_out), thr_copy.partition_D(sO));
    // Generic-proxy writes must be visible to the TMA (async proxy) before the store.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kNumConsumerThreads,
                                      static_cast<uint32_t>(ForwardBarrier::kOutputReady));
    if (thread_idx == 0) {
      Tensor mO = params.tma_store_o.get_tma_tensor(params.shape_o);
      Tensor gO = local_tile(mO(_, _, info.head, info.out_batch), select<0, 2>(TileShapeQK{}),
                             make_coord(info.m_block, _0{}));
      auto tma_o = params.tma_store_o.get_slice(_0{});
      copy(params.tma_store_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
      tma_store_arrive();
      if constexpr (Traits::kOutputAliasesQuery) tma_store_wait<0>();
    }
  }

  //! Before the CTA exits, its last store must have read shared memory.
  CUTE_DEVICE static void finish(int thread_idx) {
    if (thread_idx == 0) tma_store_wait<0>();
  }
};

}  // namespace jax_flash::sm90
