/*! \file epilogue_bwd.h
    \brief Backward epilogue collective: scales dK, rounds dK and dV to the input type and stores
           both tiles through the CTA's K and V tiles in shared memory (stmatrix, then one TMA
           store each, which clips keys past the sequence and columns past the head dim).
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "mainloop_bwd.h"
#include "named_barriers.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct BackwardEpilogue {
  using Element = typename Traits::Element;
  using TileInfo = typename BackwardMainloop<Traits>::TileInfo;
  using KVTile = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;

  struct Arguments {
    typename Traits::GmemTensorSeq dk, dv;  //!< full batch shape, key/value heads
    float scale;                            //!< softmax scale: dK = scale * dS^T Q
  };

  struct Params {
    typename Traits::TmaStoreK tma_store_dk;
    typename Traits::TmaStoreV tma_store_dv;
    typename Traits::ShapeSeq shape_dk, shape_dv;
    float scale;
  };

  static Params to_params(Arguments const& args) {
    Params params;
    params.tma_store_dk = make_tma_copy(SM90_TMA_STORE{}, args.dk, typename Traits::SmemLayoutK{},
                                        KVTile{}, _1{});
    params.tma_store_dv = make_tma_copy(SM90_TMA_STORE{}, args.dv, typename Traits::SmemLayoutV{},
                                        KVTile{}, _1{});
    params.shape_dk = args.dk.shape();
    params.shape_dv = args.dv.shape();
    params.scale = args.scale;
    return params;
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_store_dv.get_tma_descriptor());
  }

  //! Every MMA thread calls it, for empty tiles too (dK = dV = 0 then). `smem_k` and `smem_v`
  //! are the mainloop's K and V tiles, free once both warpgroups finished their products.
  template <class FragmentDkv>
  CUTE_DEVICE static void store(Params const& params, Element* smem_k, Element* smem_v,
                                TileInfo const& info, int thread_idx, FragmentDkv& tdKrdK,
                                FragmentDkv const& tdVrdV) {
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.scale;
    Tensor rdK = make_tensor<Element>(tdKrdK.layout());
    Tensor rdV = make_tensor<Element>(tdVrdV.layout());
    convert_into(tdKrdK, rdK);
    convert_into(tdVrdV, rdV);

    constexpr uint32_t kBarrier = static_cast<uint32_t>(BackwardBarrier::kEpilogue);
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrier);  // K and V are free
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                       typename Traits::TiledMmaDkv{});
    auto thr_copy = smem_copy.get_thread_slice(thread_idx);
    copy(smem_copy, thr_copy.retile_S(rdK), thr_copy.partition_D(sK));
    copy(smem_copy, thr_copy.retile_S(rdV), thr_copy.partition_D(sV));
    // Generic-proxy writes must be visible to the TMA (async proxy) before the stores.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrier);
    if (thread_idx == 0) {
      Tensor mdK = params.tma_store_dk.get_tma_tensor(params.shape_dk);
      Tensor mdV = params.tma_store_dv.get_tma_tensor(params.shape_dv);
      Tensor gdK = local_tile(mdK(_, _, info.coord.head, info.coord.batch), KVTile{},
                              make_coord(info.coord.block, _0{}));
      Tensor gdV = local_tile(mdV(_, _, info.coord.head, info.coord.batch), KVTile{},
                              make_coord(info.coord.block, _0{}));
      auto tma_dk = params.tma_store_dk.get_slice(_0{});
      auto tma_dv = params.tma_store_dv.get_slice(_0{});
      copy(params.tma_store_dk, tma_dk.partition_S(sK), tma_dk.partition_D(gdK));
      copy(params.tma_store_dv, tma_dv.partition_S(sV), tma_dv.partition_D(gdV));
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory must outlive the stores' reads
    }
  }
};

}  // namespace jax_flash::sm90
