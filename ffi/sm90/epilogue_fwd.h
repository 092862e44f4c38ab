/*! \file epilogue_fwd.h
    \brief Forward epilogue collective: its arguments, parameters and shared storage (an output
           tile per consumer warpgroup, where shared memory has room for them); normalises O,
           writes the log-sum-exp, and stores each consumer warpgroup's O rows through shared
           memory (stmatrix) with a TMA store, which clips rows past the sequence and columns
           past the head dim; or, for a split's parts, in float32 from the registers.
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

  //! A split's parts (jax_flash/_split_kv.py): O in float32, which the merge reads without a
  //! rounding in between, stored from the registers where the call's out would hold it
  //! (strides in elements). A part's tile has few live rows (a decoding step's), and float32
  //! output tiles would take twice the shared memory.
  struct FloatParts {
    float* data = nullptr;  //!< null: O in Element, through tma_store_o
    int64_t item_stride = 0, head_stride = 0;
    int64_t query_row_stride = 0;  //!< between query rows t (rows t*G + g: see group_row_stride)
    int64_t group_row_stride = 0;  //!< between rows g of a query row's packed heads
    int32_t head_dim = 0;          //!< the problem's: columns past it are not stored
  };

  struct Arguments {
    typename Traits::GmemTensorSeq o;  //!< full batch shape; unused with float parts
    float* lse;                        //!< (batch, heads, seqlen_q)
    FloatParts parts;
  };

  //! Packed query heads of several query rows (AttentionProblem::query_group_shift): out
  //! stored through a descriptor of its own (make_query_groups_tma, boxes of an output tile's
  //! 64 rows) in place of tma_store_o's tiles, lse in the call's layout. Not part of Params:
  //! ForwardKernel::Params holds it last (see there).
  struct QueryGroups {
    cute::TmaDescriptor o;
  };

  using SmemLayoutO = typename Traits::SmemLayoutO;

  struct Params {
    typename Traits::TmaStoreO tma_store_o;
    typename Traits::ShapeSeq shape_o;
    float* lse;
    FloatParts parts;
  };

  static Params to_params(Arguments const& args) {
    Params params;
    if (args.parts.data == nullptr) {
      params.tma_store_o = make_tma_copy(SM90_TMA_STORE{}, args.o, SmemLayoutO{},
                                         typename Traits::OutputTileShape{}, _1{});
      params.shape_o = args.o.shape();
    }
    params.lse = args.lse;
    params.parts = args.parts;
    return params;
  }

  //! The consumer warpgroups' output tiles (Traits::kOwnOutputTiles), or nothing: the kernel
  //! then lends the epilogue shared memory that the tile no longer reads.
  struct OutputTiles {
    cute::array_aligned<Element, cosize_v<SmemLayoutO> * Traits::kNumConsumerWarpGroups, 1024> o;
  };
  struct NoOutputTiles {};
  using SharedStorage = std::conditional_t<Traits::kOwnOutputTiles, OutputTiles, NoOutputTiles>;
  //! Consumer warpgroup `warp_group`'s output tile in `storage`.
  CUTE_DEVICE static Element* output_tile(OutputTiles& storage, int warp_group) {
    return storage.o.data() + warp_group * cosize_v<SmemLayoutO>;
  }

  //! The output's TMA descriptors, where O goes through them (not for float parts).
  CUTE_DEVICE static void prefetch_descriptors(Params const& params, QueryGroups const& groups,
                                               bool packed_rows) {
    if (params.parts.data != nullptr) return;
    if (packed_rows) {
      cute::prefetch_tma_descriptor(&groups.o);
    } else {
      cute::prefetch_tma_descriptor(params.tma_store_o.get_tma_descriptor());
    }
  }

  //! Normalises one tile's O and stores the calling consumer warpgroup's rows through
  //! `smem_o`: its output tile, or (without Traits::kOwnOutputTiles) a buffer lent for this
  //! tile, which every consumer warpgroup's GEMMs may have read and which the caller frees once
  //! this returns (the store has read it by then). Every consumer thread calls it, for empty
  //! tiles too (tOrO is then zero and every row comes out as O = 0, lse = -inf). The
  //! warpgroup's first thread issues its store. `warp_group`: the consumer warpgroup,
  //! warp-uniform as the mainloop's.
  template <class TensorO>
  CUTE_DEVICE static void store(Params const& params, AttentionProblem const& problem,
                                QueryGroups const& groups, Element* smem_o, TileInfo const& info,
                                int warp_group, int thread_idx, TensorO& tOrO,
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
      // Packed query heads keep the call's lse layout: row t*G + g of head k at (k, g, t).
      const int shift = problem.query_group_shift, query_rows = problem.seqlen_q >> shift;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = info.m_start() + get<0>(rows(r, 0));
        if (row < problem.seqlen_q) {
          lse_rows[(row & ((1 << shift) - 1)) * query_rows + (row >> shift)] = lse[r];
        }
      }
    }

    if (params.parts.data != nullptr) {
      store_float_part(params.parts, problem, info, o, rows);
      return;
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, tOrO_out);

    const int group_thread = thread_idx % kThreadsPerWarpGroup;
    const uint32_t group_barrier =
        Traits::Barriers::kOutputFirst + warp_group;
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});
    if constexpr (Traits::kOwnOutputTiles) {
      // The warpgroup's previous store must have finished reading its output tile.
      if (group_thread == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(kThreadsPerWarpGroup, group_barrier);
    } else {
      // Every consumer warpgroup's GEMMs, which read the lent buffer, are complete.
      cutlass::arch::NamedBarrier::sync(kNumConsumerThreads,
                                        Traits::Barriers::kOutputBorrowed);
    }
    typename Traits::TiledMmaPVStored mma_stored;
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_stored);
    auto thr_copy = smem_copy.get_thread_slice(opaque(group_thread));
    copy(smem_copy, thr_copy.retile_S(tOrO_out), thr_copy.partition_D(sO));
    // Generic-proxy writes must be visible to the TMA (async proxy) before the store.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kThreadsPerWarpGroup, group_barrier);
    if (group_thread == 0) {
      const int output_tile = info.coord.block * Traits::kNumConsumerWarpGroups + warp_group;
      if (problem.query_group_shift > 0) {
        store_query_groups(groups, problem.query_group_shift, smem_o, output_tile,
                           info.coord.head, info.coord.batch);
      } else {
        Tensor mO = params.tma_store_o.get_tma_tensor(params.shape_o);
        Tensor gO = local_tile(mO(_, _, info.coord.head, info.coord.batch),
                               typename Traits::OutputTileShape{}, make_coord(output_tile, _0{}));
        auto tma_o = params.tma_store_o.get_slice(_0{});
        copy(params.tma_store_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
      }
      tma_store_arrive();
      if constexpr (!Traits::kOwnOutputTiles) tma_store_wait<0>();
    }
    if constexpr (!Traits::kOwnOutputTiles) {
      cutlass::arch::NamedBarrier::sync(kThreadsPerWarpGroup, group_barrier);
    }
  }

  //! The output tile `output_tile` (of 64 rows) of packed query heads (QueryGroups),
  //! each 64-column block of its shared layout by one five-dimensional TMA box: 64 / G query
  //! rows of all G heads, rows t*G + g in order, clipped past the call's rows and head dim.
  CUTE_DEVICE static void store_query_groups(QueryGroups const& groups, int shift,
                                             Element const* smem_o, int output_tile, int head,
                                             int item) {
    constexpr int kRows = size<0>(typename Traits::OutputTileShape{}), kColumns = 64;
    static_assert(Traits::kHeadDim % kColumns == 0 && SmemLayoutO{}(1, 0) == kColumns &&
                      (Traits::kHeadDim == kColumns ||
                       SmemLayoutO{}(0, kColumns) == kRows * kColumns),
                  "O's shared layout: rows of 64 columns, one column block after another");
    const int first_query_row = (output_tile * kRows) >> shift;
    CUTE_UNROLL
    for (int c = 0; c < Traits::kHeadDim / kColumns; ++c) {
      SM90_TMA_STORE_5D::copy(&groups.o, smem_o + c * kRows * kColumns, c * kColumns,
                              0, first_query_row, head, item);
    }
  }

  //! Stores the calling thread's rows of the normalised O (`o`, as (rows, cols), and `rows`,
  //! their coordinates) to the float parts, column pairs (adjacent in an SM90 accumulator) as
  //! 8-byte stores; rows past the problem's and columns past its head dim stay unwritten.
  template <class TensorO, class TensorRows>
  CUTE_DEVICE static void store_float_part(FloatParts const& parts, AttentionProblem const& problem,
                                           TileInfo const& info, TensorO const& o,
                                           TensorRows const& rows) {
    const int shift = problem.query_group_shift;
    float* head = parts.data + info.coord.batch * parts.item_stride +
                  info.coord.head * parts.head_stride;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(o); ++r) {
      const int row = info.m_start() + get<0>(rows(r, 0));
      if (row >= problem.seqlen_q) continue;
      float* out_row = head + (row >> shift) * parts.query_row_stride +
                       (row & ((1 << shift) - 1)) * parts.group_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); c += 2) {
        const int column = get<1>(rows(r, c));
        if (column < parts.head_dim) {
          *reinterpret_cast<float2*>(out_row + column) = make_float2(o(r, c), o(r, c + 1));
        }
      }
    }
  }

  //! Before the CTA exits, each warpgroup's last store must have read shared memory.
  CUTE_DEVICE static void finish(int thread_idx) {
    if (thread_idx % kThreadsPerWarpGroup == 0) tma_store_wait<0>();
  }
};

}  // namespace jax_flash::sm90
