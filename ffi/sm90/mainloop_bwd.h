/*! \file mainloop_bwd.h
    \brief The backward mainloop collective: its arguments, parameters (TMA descriptors) and
           shared storage; the producer's loads (K and V once, then Q with its log-sum-exp and
           dO with its row term, block after block, through two TMA pipelines); the reduction
           of the dQ partial sums into global memory; and the MMA warpgroups' step per query
           block: S^T and dP^T, P^T from the saved log-sum-exp, dS^T, then dV += P^T dO,
           dQ = dS K and dK += dS^T Q, and dbias += dS where the bias gradient is wanted.

    One CTA owns one key block of one key/value head: K and V stay in shared memory and dK, dV
    in registers while the CTA walks every query block that sees the key block, for each query
    head of the group in turn, so grouped heads need no atomics for dK/dV. Every CTA adds its dQ
    partial sums into an fp32 accumulator in global memory with bulk reductions issued by a
    producer warp; when dq_semaphore is set, the CTAs of a query block add in a fixed order.
    With segment ids a CTA visits only the query blocks its keys' segments reach, and with a
    mask or bias array only those its block classes leave non-empty, except under that fixed
    order, whose turns count every key block the window lets see a query block. A bias is added
    to S^T as in the forward. One that keeps the query and key axes comes by TMA, a tile per
    step through its own pipeline, and the MMA warpgroups read it with transposing ldmatrix
    (read from global memory transposed, each element was a 2-byte load of its own); one
    broadcast along either axis is read from global memory, where its few lines stay in L1.
    Where its gradient is wanted, each step adds its dS^T into a float32 accumulator with
    atomic additions, summed first over the keys where the bias broadcasts along them; one
    broadcast along the queries is summed in registers over a query head's steps and added once
    (skipped blocks have dS = 0). A gradient with an element per logit takes one step's dS per
    element: it is stored into the result directly, through the bias's tile (written over the
    bias once the step has read it, then sent by a TMA store) where TMA moves both.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "block_range.h"
#include "mask.h"
#include "named_barriers.h"
#include "seqlen.h"
#include "softcap.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct BackwardMainloop {
  using Element = typename Traits::Element;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineDo = typename Traits::PipelineDo;
  using StateQ = cutlass::PipelineState<Traits::kStagesQ>;
  using StateDo = cutlass::PipelineState<Traits::kStagesDo>;
  using PipelineBias = typename Traits::PipelineBias;
  using StateBias = cutlass::PipelineState<1>;
  using BiasTile = Shape<Int<Traits::kBlockN>, Int<Traits::kBlockM>>;  // (keys, queries)
  using Range = BlockRange<Traits::kBlockM, Traits::kBlockN>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNumMmaWarpGroups = Traits::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = Traits::kNumMmaThreads;
  static constexpr int kDqSlices = Traits::kDqSlices;
  static constexpr int kDqUnitFloats = Traits::kDqUnitFloats;
  //! Threads that meet at a dQ staging barrier: one MMA warpgroup and the reducing warp.
  static constexpr int kDqBarrierThreads = kThreadsPerWarpGroup + 32;
  //! Where a capped step takes tanh' (softcap.h): without a bias from the capped logits before
  //! P replaces them, into a register tile of its own; with a bias, whose capped kernels spill
  //! already, from P and the log-sum-exp after dP^T.
  static constexpr bool kSlopeFromLogits = Traits::kSoftcap && !Traits::kBias;
  static constexpr bool kSlopeFromP = Traits::kSoftcap && Traits::kBias;
  //! With kSlopeFromLogits, whether that tile holds P^T * tanh', formed with the exponentials,
  //! in place of tanh' until dS^T: it is then not held beside P^T across dP^T's wait. Where
  //! S^T has 64 elements per thread (head dim 64's 128 x 128 block), the factors held across
  //! the wait made ptxas spill (112 bytes stored, 252 with a mask array; with the product 16
  //! and 68) and the product ran 4-8% faster forward+backward; with 32 (head dim 128) neither
  //! spills and it ran 1% slower (H200, bf16, T = 1024 and 4096, cap 50).
  static constexpr bool kSlopeTimesP =
      kSlopeFromLogits && kBlockM * kBlockN / kNumMmaThreads >= 64;

  struct Arguments {
    typename Traits::GmemTensorSeq q, k, v, dout;
    DeviceBatchMap q_batch, k_batch, v_batch, dout_batch;  //!< own batch item of each operand
    const float* lse_log2;  //!< (batch, heads, padded rows): lse * log2(e), +inf for empty rows
    const float* row_term;  //!< (batch, heads, padded rows): rowsum(dO * O) - dlse
    float* dq_accum;        //!< (batch, heads, query blocks, kDqBlockFloats), zeroed
    int* dq_semaphore;      //!< (batch, heads, query blocks), zeroed; nullptr: unordered adds
    bool reverse_key_blocks;  //!< the scheduler launches a head's key blocks last to first
    int32_t num_m_blocks;
    float scale_log2;  //!< softmax scale times log2(e), > 0
    LogitSoftcap softcap;  //!< used when Traits::kSoftcap
    float bias_units;      //!< the bias's factor (bias_units())
    //! With a bias: whether TMA reads it in tiles (moves_in_tiles), and the bias as TMA sees it.
    bool bias_in_tiles;
    typename Traits::GmemTensorBias bias;
    BiasGradient dbias;    //!< with a bias (Traits::kBias), present when its gradient is wanted
    //! With bias_in_tiles and a gradient stored directly: whether TMA stores it in the bias's
    //! tiles, and the gradient as TMA sees it.
    bool dbias_in_tiles;
    typename Traits::GmemTensorBias dbias_tensor;
  };

  struct Params {
    typename Traits::TmaLoadQdO tma_load_q, tma_load_do;
    typename Traits::TmaLoadK tma_load_k;
    typename Traits::TmaLoadV tma_load_v;
    typename Traits::ShapeSeq shape_q, shape_k, shape_v, shape_do;
    DeviceBatchMap q_batch, k_batch, v_batch, dout_batch;
    const float* lse_log2;
    const float* row_term;
    float* dq_accum;
    int* dq_semaphore;
    bool reverse_key_blocks;
    int32_t num_m_blocks;
    float scale_log2;
    LogitSoftcap softcap;
    float bias_units;
    bool bias_in_tiles;
    typename Traits::TmaLoadBias tma_load_bias;
    typename Traits::ShapeBias shape_bias;
    BiasGradient dbias;
    bool dbias_in_tiles;
    typename Traits::TmaStoreBias tma_store_dbias;
    typename Traits::ShapeBias shape_dbias;
  };

  static Params to_params(Arguments const& args) {
    using QdOTile = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using KVTile = Shape<Int<kBlockN>, Int<kHeadDim>>;
    Params params;
    params.tma_load_q = make_tma_copy(SM90_TMA_LOAD{}, args.q,
                                      take<0, 2>(typename Traits::SmemLayoutQ{}), QdOTile{}, _1{});
    params.tma_load_do = make_tma_copy(SM90_TMA_LOAD{}, args.dout,
                                       take<0, 2>(typename Traits::SmemLayoutDo{}), QdOTile{}, _1{});
    params.tma_load_k = make_tma_copy(SM90_TMA_LOAD{}, args.k, typename Traits::SmemLayoutK{},
                                      KVTile{}, _1{});
    params.tma_load_v = make_tma_copy(SM90_TMA_LOAD{}, args.v, typename Traits::SmemLayoutV{},
                                      KVTile{}, _1{});
    params.shape_q = args.q.shape();
    params.shape_k = args.k.shape();
    params.shape_v = args.v.shape();
    params.shape_do = args.dout.shape();
    params.q_batch = args.q_batch;
    params.k_batch = args.k_batch;
    params.v_batch = args.v_batch;
    params.dout_batch = args.dout_batch;
    params.lse_log2 = args.lse_log2;
    params.row_term = args.row_term;
    params.dq_accum = args.dq_accum;
    params.dq_semaphore = args.dq_semaphore;
    params.reverse_key_blocks = args.reverse_key_blocks;
    params.num_m_blocks = args.num_m_blocks;
    params.scale_log2 = args.scale_log2;
    params.softcap = args.softcap;
    params.bias_units = args.bias_units;
    params.bias_in_tiles = Traits::kBias && args.bias_in_tiles;
    if constexpr (Traits::kBias) {
      if (params.bias_in_tiles) {
        params.tma_load_bias = make_tma_copy(SM90_TMA_LOAD{}, args.bias,
                                             typename Traits::SmemLayoutBias{}, BiasTile{}, _1{});
        params.shape_bias = args.bias.shape();
      }
    }
    params.dbias = args.dbias;
    params.dbias_in_tiles = params.bias_in_tiles && args.dbias_in_tiles;
    if constexpr (Traits::kBias) {
      if (params.dbias_in_tiles) {
        params.tma_store_dbias = make_tma_copy(SM90_TMA_STORE{}, args.dbias_tensor,
                                               typename Traits::SmemLayoutBias{}, BiasTile{}, _1{});
        params.shape_dbias = args.dbias_tensor.shape();
      }
    }
    return params;
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_v.get_tma_descriptor());
    if (params.bias_in_tiles) {
      cute::prefetch_tma_descriptor(params.tma_load_bias.get_tma_descriptor());
    }
    if (params.dbias_in_tiles) {
      cute::prefetch_tma_descriptor(params.tma_store_dbias.get_tma_descriptor());
    }
  }

  struct TensorsWithP {
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutPdS>, 1024> p;
  };
  struct TensorsWithoutP {};
  struct TensorsWithBias {
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutBias>, 1024> tile;
  };
  struct TensorsWithoutBias {};
  //! The bias tile (Traits::kBias): (keys, queries).
  template <class Storage>
  CUTE_DEVICE static auto bias_tile(Storage& storage) {
    return make_tensor(make_smem_ptr(storage.bias.tile.data()), typename Traits::SmemLayoutBias{});
  }

  struct alignas(1024) SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutDo>, 1024> dout;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutPdS>, 1024> ds;
    // Before the P tile, which may be empty: at head dim 64 its alignment padding would not fit.
    std::conditional_t<Traits::kBias, TensorsWithBias, TensorsWithoutBias> bias;
    std::conditional_t<Traits::kDkvFromRegisters, TensorsWithoutP, TensorsWithP> p_tile;
    cute::array_aligned<float, kNumMmaWarpGroups * kDqUnitFloats, 128> dq;
    cute::array_aligned<float, kBlockM * Traits::kStagesQ, 128> lse;
    cute::array_aligned<float, kBlockM * Traits::kStagesDo, 128> row_term;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    typename PipelineQ::SharedStorage pipeline_q;
    typename PipelineDo::SharedStorage pipeline_do;
    typename PipelineBias::SharedStorage pipeline_bias;
  };

  //! What every role knows alike about one (key block, key/value head, batch) tile. Built by
  //! every thread (with segment ids or a mask array, a warp collective narrows the queries).
  struct TileInfo {
    TileCoord coord;  //!< block: key block; head: key/value head
    SeqLengths lens;
    BlockSpan queries;  //!< query blocks that see some key of the block
    //! Queries sharing a segment with some / every key of the block.
    SegmentReachOf<Traits::kSegments> segments;

    CUTE_DEVICE TileInfo(AttentionProblem const& p, TileCoord const& c)
        : coord(c), lens(p, c.batch), queries(Range::query_blocks(p, lens, c.block)) {
      if constexpr (Traits::kSegments) {
        const int32_t n_start = c.block * kBlockN;
        const int32_t n_end = min(n_start + kBlockN, lens.kv_len);
        segments = SegmentReach::of<kBlockN>(p.segments.q_span.of(p.batch, c.batch), n_start,
                                             n_end);
        if (p.segments.backward_skips_blocks) queries = segments.template narrow<kBlockM>(queries);
      }
      if constexpr (Traits::kBlockClasses) {
        if (p.mask.skip_empty_blocks) {
          // The query blocks that some query head of the group sees through the mask (or the
          // bias).
          BlockSpan seen{INT32_MAX, INT32_MIN};
          for (int32_t g = 0; g < p.group_size; ++g) {
            const BlockSpan head_span = narrow_by_mask</*kOwnIsKeyBlock=*/true>(
                p.mask, mask_of(p, g), c.block, queries);
            if (!head_span.empty()) {
              seen = {min(seen.begin, head_span.begin), max(seen.end, head_span.end)};
            }
          }
          queries = seen.empty() ? BlockSpan{0, 0} : seen;
        }
      }
    }
    CUTE_DEVICE bool empty() const { return queries.empty(); }
    CUTE_DEVICE int32_t n_start() const { return coord.block * kBlockN; }
    //! The mask array of query head `g` of the group.
    CUTE_DEVICE MaskView mask_of(AttentionProblem const& p, int32_t g) const {
      return MaskView::of(p.mask, p.batch, coord.batch, coord.head * p.group_size + g);
    }
    //! The bias of query head `g` of the group at (query 0, key 0).
    CUTE_DEVICE const Element* bias_of(AttentionProblem const& p, int32_t g) const {
      return p.bias.template of<Element>(p.batch, coord.batch, coord.head * p.group_size + g);
    }
    //! The class of query block m_block under `mask` (every block is full without classes).
    CUTE_DEVICE MaskBlock query_block_class(AttentionProblem const& p, MaskView const& mask,
                                            int32_t m_block) const {
      if constexpr (Traits::kBlockClasses) {
        return mask.block(p.mask, m_block, coord.block);
      } else {
        return MaskBlock::kFull;
      }
    }
    //! Whether the roles pass over query block m_block of class `cls`.
    CUTE_DEVICE static bool skips(AttentionProblem const& p, MaskBlock cls) {
      if constexpr (Traits::kBlockClasses) {
        return cls == MaskBlock::kEmpty && p.mask.skip_empty_blocks;
      } else {
        return false;
      }
    }
  };

  //! Index of (batch, query head)'s first query block in the workspace arrays (row statistics
  //! have kBlockM entries per query block, the dQ accumulator kDqBlockFloats).
  CUTE_DEVICE static int64_t first_query_block(Params const& params, AttentionProblem const& problem,
                                               int32_t batch, int32_t head) {
    return (int64_t(batch) * problem.num_heads + head) * params.num_m_blocks;
  }

  //! Producer (one thread): K and V of the tile, then Q and dO with their row statistics (and
  //! the bias tile, where TMA reads it) for every query block of every query head of the group.
  CUTE_DEVICE static void load(Params const& params, AttentionProblem const& problem,
                               SharedStorage& storage, PipelineQ& pipeline_q,
                               PipelineDo& pipeline_do, PipelineBias& pipeline_bias,
                               StateQ& write_q, StateDo& write_do, StateBias& write_bias,
                               TileInfo const& info) {
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutDo{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{});
    Tensor mQ = params.tma_load_q.get_tma_tensor(params.shape_q);
    Tensor mDo = params.tma_load_do.get_tma_tensor(params.shape_do);
    Tensor mK = params.tma_load_k.get_tma_tensor(params.shape_k);
    Tensor mV = params.tma_load_v.get_tma_tensor(params.shape_v);
    const int32_t batch = info.coord.batch;
    const int32_t kv_head = info.coord.head;
    using KVTile = Shape<Int<kBlockN>, Int<kHeadDim>>;
    using QdOTile = Shape<Int<kBlockM>, Int<kHeadDim>>;
    Tensor gK = local_tile(mK(_, _, kv_head, params.k_batch(problem.batch, batch)), KVTile{},
                           make_coord(info.coord.block, _0{}));
    Tensor gV = local_tile(mV(_, _, kv_head, params.v_batch(problem.batch, batch)), KVTile{},
                           make_coord(info.coord.block, _0{}));
    auto tma_k = params.tma_load_k.get_slice(_0{});
    auto tma_v = params.tma_load_v.get_slice(_0{});
    storage.kv_full.arrive_and_expect_tx(2 * Traits::kKVBytes);
    copy(params.tma_load_k.with(reinterpret_cast<uint64_t&>(storage.kv_full), 0),
         tma_k.partition_S(gK), tma_k.partition_D(sK));
    copy(params.tma_load_v.with(reinterpret_cast<uint64_t&>(storage.kv_full), 0),
         tma_v.partition_S(gV), tma_v.partition_D(sV));

    auto tma_q = params.tma_load_q.get_slice(_0{});
    auto tma_do = params.tma_load_do.get_slice(_0{});
    Tensor tQsQ = group_modes<0, 3>(tma_q.partition_D(sQ));     // (TMA, stage)
    Tensor tDOsDO = group_modes<0, 3>(tma_do.partition_D(sDo));  // (TMA, stage)
    const int32_t q_item = params.q_batch(problem.batch, batch);
    const int32_t do_item = params.dout_batch(problem.batch, batch);
    for (int32_t g = 0; g < problem.group_size; ++g) {
      const int32_t head = kv_head * problem.group_size + g;
      // The bias tiles of the head's steps (kBias): (TMA, m).
      auto bias_tiles = [&] {
        if constexpr (Traits::kBias) {
          Tensor mBias = params.tma_load_bias.get_tma_tensor(params.shape_bias);
          const int32_t bias_item = problem.bias.batch(problem.batch, batch);
          return group_modes<0, 3>(params.tma_load_bias.get_slice(_0{}).partition_S(
              local_tile(mBias(_, _, problem.bias.own_head(head), bias_item), BiasTile{},
                         make_coord(info.coord.block, _))));
        } else {
          return 0;
        }
      }();
      Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(
          local_tile(mQ(_, _, head, q_item), QdOTile{}, make_coord(_, _0{}))));  // (TMA, m)
      Tensor tDOgDO = group_modes<0, 3>(tma_do.partition_S(
          local_tile(mDo(_, _, head, do_item), QdOTile{}, make_coord(_, _0{}))));
      const int64_t rows = first_query_block(params, problem, batch, head) * kBlockM;
      const auto mask = info.mask_of(problem, g);
      // Not unrolled: the producer has few registers.
      CUTE_NO_UNROLL
      for (int32_t m_block = info.queries.begin; m_block < info.queries.end; ++m_block) {
        if (TileInfo::skips(problem, info.query_block_class(problem, mask, m_block))) continue;
        pipeline_q.producer_acquire(write_q);
        uint64_t* q_barrier = pipeline_q.producer_get_barrier(write_q);
        copy(params.tma_load_q.with(*q_barrier, 0), tQgQ(_, m_block), tQsQ(_, write_q.index()));
        SM90_BULK_COPY_G2S::copy(params.lse_log2 + rows + m_block * kBlockM, q_barrier,
                                 storage.lse.data() + write_q.index() * kBlockM,
                                 Traits::kRowStatBytes);
        ++write_q;
        pipeline_do.producer_acquire(write_do);
        uint64_t* do_barrier = pipeline_do.producer_get_barrier(write_do);
        copy(params.tma_load_do.with(*do_barrier, 0), tDOgDO(_, m_block),
             tDOsDO(_, write_do.index()));
        SM90_BULK_COPY_G2S::copy(params.row_term + rows + m_block * kBlockM, do_barrier,
                                 storage.row_term.data() + write_do.index() * kBlockM,
                                 Traits::kRowStatBytes);
        ++write_do;
        if constexpr (Traits::kBias) {
          if (params.bias_in_tiles) {
            Tensor sBias = bias_tile(storage);
            pipeline_bias.producer_acquire(write_bias);
            copy(params.tma_load_bias.with(*pipeline_bias.producer_get_barrier(write_bias), 0),
                 bias_tiles(_, m_block),
                 group_modes<0, 3>(params.tma_load_bias.get_slice(_0{}).partition_D(sBias)));
            ++write_bias;
          }
        }
      }
    }
  }

  //! The reducing warp: adds each staged dQ unit into the global accumulator as one bulk
  //! reduction, then frees the staging buffer. With dq_semaphore, the key blocks that see a
  //! query block add in launch order: each waits for its turn and, once its additions are
  //! complete in global memory, passes it on.
  CUTE_DEVICE static void reduce_dq(Params const& params, AttentionProblem const& problem,
                                    SharedStorage& storage, TileInfo const& info) {
    const bool leader = cute::elect_one_sync();
    const int32_t batch = info.coord.batch;
    for (int32_t g = 0; g < problem.group_size; ++g) {
      const int32_t head = info.coord.head * problem.group_size + g;
      const int64_t head_blocks = first_query_block(params, problem, batch, head);
      const auto mask = info.mask_of(problem, g);
      CUTE_NO_UNROLL
      for (int32_t m_block = info.queries.begin; m_block < info.queries.end; ++m_block) {
        if (TileInfo::skips(problem, info.query_block_class(problem, mask, m_block))) continue;
        float* accum = params.dq_accum + (head_blocks + m_block) * Traits::kDqBlockFloats;
        int* semaphore = params.dq_semaphore == nullptr ? nullptr
                                                        : params.dq_semaphore + head_blocks + m_block;
        if (semaphore != nullptr && leader) {
          const BlockSpan keys = Range::key_blocks(problem, info.lens, m_block);
          const int turn = params.reverse_key_blocks ? keys.end - 1 - info.coord.block
                                                     : info.coord.block - keys.begin;
          wait_counter_equals(semaphore, turn);
          asm volatile("fence.proxy.async.global;\n" ::: "memory");
        }
        __syncwarp();
        CUTE_UNROLL
        for (int slice = 0; slice < kDqSlices; ++slice) {
          CUTE_UNROLL
          for (int wg = 0; wg < kNumMmaWarpGroups; ++wg) {
            cutlass::arch::NamedBarrier::sync(
                kDqBarrierThreads, static_cast<uint32_t>(BackwardBarrier::kDqFullFirst) + wg);
            if (leader) {
              bulk_reduce_add(storage.dq.data() + wg * kDqUnitFloats,
                              accum + (slice * kNumMmaWarpGroups + wg) * kDqUnitFloats,
                              kDqUnitFloats * int32_t(sizeof(float)));
              tma_store_arrive();  // commits the bulk group
            }
          }
          // Each staging buffer is free once its reduction has read it.
          for_each(make_int_sequence<kNumMmaWarpGroups>{}, [&](auto wg) {
            if (leader) tma_store_wait<kNumMmaWarpGroups - 1 - decltype(wg)::value>();
            __syncwarp();
            cutlass::arch::NamedBarrier::arrive(
                kDqBarrierThreads, static_cast<uint32_t>(BackwardBarrier::kDqEmptyFirst) + wg);
          });
        }
        if (semaphore != nullptr && leader) {
          bulk_wait_complete<0>();
          release_counter_increment(semaphore);
        }
        __syncwarp();
      }
    }
  }

  //! Before the first step: both staging buffers start out free.
  CUTE_DEVICE static void free_dq_staging() {
    CUTE_UNROLL
    for (int wg = 0; wg < kNumMmaWarpGroups; ++wg) {
      cutlass::arch::NamedBarrier::arrive(
          kDqBarrierThreads, static_cast<uint32_t>(BackwardBarrier::kDqEmptyFirst) + wg);
    }
  }

  //! MMA warpgroups: accumulates dK (unscaled) and dV of a non-empty tile over every query block
  //! of every query head of the group. `warp_group` must be warp-uniform in a form the compiler
  //! sees (the shared-memory descriptors are sliced with it).
  template <class FragmentDkv>
  CUTE_DEVICE static void mma(Params const& params, AttentionProblem const& problem,
                              SharedStorage& storage, PipelineQ& pipeline_q,
                              PipelineDo& pipeline_do, PipelineBias& pipeline_bias,
                              StateQ& read_q, StateDo& read_do, StateBias& read_bias,
                              TileInfo const& info, int warp_group, int thread_idx,
                              FragmentDkv& tdKrdK, FragmentDkv& tdVrdV) {
    using TiledMmaSdP = typename Traits::TiledMmaSdP;
    using TiledMmaDkv = typename Traits::TiledMmaDkv;
    using TiledMmaDq = typename Traits::TiledMmaDq;
    using ShapeSt = Shape<Int<kBlockN>, Int<kBlockM>>;  // S^T: (keys, queries)
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sDo = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutDo{});
    Tensor sDot = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutDot{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{});
    Tensor sDs = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutPdS{});
    Tensor sDsT = make_tensor(make_smem_ptr(storage.ds.data()),
                              typename Traits::SmemLayoutDsTransposed{});

    TiledMmaSdP mma_sdp;
    TiledMmaDkv mma_dkv;
    TiledMmaDq mma_dq;
    // Shared-memory operands depend only on the warpgroup (one descriptor for its 128 threads).
    auto wg_sdp = mma_sdp.get_thread_slice(warp_group * kThreadsPerWarpGroup);
    auto wg_dkv = mma_dkv.get_thread_slice(warp_group * kThreadsPerWarpGroup);
    auto wg_dq = mma_dq.get_thread_slice(warp_group * kThreadsPerWarpGroup);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);       // (MMA, MMA_M, MMA_K)
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, stage)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrDo = wg_sdp.partition_fragment_B(sDo);
    Tensor tdVrDo = wg_dkv.partition_fragment_B(sDot);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    Tensor tdQrDs = wg_dq.partition_fragment_A(sDsT);    // (MMA, MMA_M, MMA_K, stage)

    // P^T and dS^T leave their accumulators for shared memory with stmatrix.
    auto smem_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
    auto thr_copy_pds = smem_copy_pds.get_thread_slice(thread_idx);
    Tensor tdSsdS = thr_copy_pds.partition_D(sDs);  // (CPY, CPY_M, CPY_N, stage)

    // The query column, relative to the block, of each S^T element this thread holds.
    Tensor cSt = mma_sdp.get_thread_slice(thread_idx).partition_C(make_identity_tensor(ShapeSt{}));
    Tensor columns = make_tensor(cSt.data(), accumulator_rowcol(cSt.layout()));
    constexpr int kColumns = decltype(size<1>(columns))::value;
    // A per-query statistic of the step (lse, D) for each column this thread holds.
    auto column_values = [&](float const* per_query) {
      cute::array<float, kColumns> values;
      CUTE_UNROLL
      for (int c = 0; c < kColumns; ++c) values[c] = per_query[get<1>(columns(0, c))];
      return values;
    };

    BlockMask<kBlockN, kBlockM, TiledMmaSdP> mask(thread_idx);
    const RowVisibility visibility = RowVisibility::of</*kRowsAreKeys=*/true>(problem, info.lens);
    const SegmentAxes</*kRowsAreKeys=*/true> segments{problem, info.coord.batch};
    const float scale_log2 = params.scale_log2;

    // Each warpgroup writes its dQ unit to its staging buffer in register order: thread-minor
    // groups of 4 registers, so a warp's stores cover 512 contiguous bytes.
    auto stage_dq = [&](auto const& tdQrdQ) {
      const int lane = thread_idx % kThreadsPerWarpGroup;
      cutlass::arch::NamedBarrier::sync(
          kDqBarrierThreads, static_cast<uint32_t>(BackwardBarrier::kDqEmptyFirst) + warp_group);
      float4* unit = reinterpret_cast<float4*>(storage.dq.data() + warp_group * kDqUnitFloats);
      CUTE_UNROLL
      for (int i = 0; i < size(tdQrdQ) / 4; ++i) {
        unit[i * kThreadsPerWarpGroup + lane] =
            make_float4(tdQrdQ(4 * i), tdQrdQ(4 * i + 1), tdQrdQ(4 * i + 2), tdQrdQ(4 * i + 3));
      }
      // Generic-proxy writes must be visible to the bulk copy (async proxy) that reads them.
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::arrive(
          kDqBarrierThreads, static_cast<uint32_t>(BackwardBarrier::kDqFullFirst) + warp_group);
    };
    auto sync_pds = [&] {
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, static_cast<uint32_t>(BackwardBarrier::kPdS));
    };
    // dQ of one head-dim slice: dS (queries, keys) times K (keys, slice).
    auto issue_dq = [&](auto slice, int ds_stage, auto& tdQrdQ) {
      Tensor sKt_slice = local_tile(sKt, Shape<Int<Traits::kDqSliceDim>, Int<kBlockN>>{},
                                    make_coord(decltype(slice)::value, _0{}));
      Tensor tdQrK = wg_dq.partition_fragment_B(sKt_slice);
      warpgroup_gemm</*kZeroInit=*/true, /*kWaitGroups=*/-1>(mma_dq, tdQrDs(_, _, _, ds_stage),
                                                             tdQrK, tdQrdQ);
    };

    // The bias from global memory, read transposed: along the keys (rows) with its key
    // stride, along the queries (columns) with its query stride.
    auto prefetch_bias = [&](const Element* bias, int32_t m_block) {
      if constexpr (Traits::kBias) {
        if (!params.bias_in_tiles) {
          mask.prefetch_bias(bias, problem.bias.col_stride, problem.bias.row_stride,
                             info.n_start(), problem.seqlen_k, m_block * kBlockM,
                             problem.seqlen_q);
        }
      }
    };
    // The step's bias tile (TMA zero-fills the entries past the sequences, which lengths mask)
    // enters the S^T accumulator a slice of ldmatrix at a time, few registers held.
    auto smem_copy_bias = make_tiled_copy_C(typename Traits::SmemCopyAtomBias{}, mma_sdp);
    auto thr_copy_bias = smem_copy_bias.get_thread_slice(thread_idx);
    auto add_bias_tile = [&](auto& tSrS, float units) {
      if constexpr (Traits::kBias) {
        add_tile_in_slices<Element>(smem_copy_bias, thr_copy_bias.partition_S(bias_tile(storage)),
                                    thr_copy_bias.retile_D(tSrS), units);
      }
    };
    auto add_bias = [&](auto& tSrS, const Element* bias, int32_t m_block, float units) {
      if (params.bias_in_tiles) {
        add_bias_tile(tSrS, units);
      } else {
        Tensor s = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
        mask.add_bias(s, bias, problem.bias.col_stride, problem.bias.row_stride,
                      /*paired=*/false, units, info.n_start(), problem.seqlen_k,
                      m_block * kBlockM, problem.seqlen_q);
      }
    };
    // A gradient stored through the tile: dS^T in the input type, over the bias it replaces
    // (each thread writes the elements it read), then one thread's TMA store.
    auto smem_copy_dbias = make_tiled_copy_C(typename Traits::SmemCopyAtomBiasGradient{}, mma_sdp);
    auto thr_copy_dbias = smem_copy_dbias.get_thread_slice(thread_idx);
    auto write_bias_gradient_tile = [&](auto const& tdPrdP) {
      if constexpr (Traits::kBias) {
        Tensor sBias = bias_tile(storage);
        Tensor rdS = make_fragment_like<Element>(tdPrdP);
        convert_into(tdPrdP, rdS);
        copy(smem_copy_dbias, thr_copy_dbias.retile_S(rdS), thr_copy_dbias.partition_D(sBias));
      }
    };
    const int32_t dbias_item =
        Traits::kBias ? params.dbias.batch(problem.batch, info.coord.batch) : 0;
    int32_t dbias_head = 0;  // the query head of the steps, where dbias keeps the heads
    auto store_bias_gradient_tile = [&](int32_t m_block) {
      if constexpr (Traits::kBias) {
        Tensor sBias = bias_tile(storage);
        Tensor mDbias = params.tma_store_dbias.get_tma_tensor(params.shape_dbias);
        auto tma_dbias = params.tma_store_dbias.get_slice(_0{});
        Tensor gDbias = local_tile(mDbias(_, _, dbias_head, dbias_item), BiasTile{},
                                   make_coord(info.coord.block, m_block));
        copy(params.tma_store_dbias, tma_dbias.partition_S(sBias), tma_dbias.partition_D(gDbias));
        tma_store_arrive();
      }
    };
    // The bias tile is free once read for the last time in the step (with a gradient stored
    // through it, once its store has read it).
    auto release_bias = [&] {
      if (params.bias_in_tiles) {
        pipeline_bias.consumer_release(read_bias);
        ++read_bias;
      }
    };

    // A bias gradient summed over the queries (a bias broadcast along them): each thread's keys'
    // sums over the steps of a query head, added to memory once after them.
    cute::array<float, decltype(size<0>(columns))::value> dbias_key_sums;

    int ds_stage = 0;
    auto step = [&](int32_t m_block, MaskView const& mask_view, MaskBlock cls,
                    const Element* bias, void* dbias) {
      prefetch_bias(bias, m_block);
      // S^T = K Q^T and dP^T = V dO^T, back to back.
      Tensor tSrS = partition_fragment_C(mma_sdp, ShapeSt{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, ShapeSt{});
      pipeline_q.consumer_wait(read_q);
      warpgroup_gemm</*kZeroInit=*/true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, read_q.index()), tSrS);
      pipeline_do.consumer_wait(read_do);
      warpgroup_gemm</*kZeroInit=*/true, -1>(mma_sdp, tdPrV, tdPrDo(_, _, _, read_do.index()),
                                             tdPrdP);
      warpgroup_wait<1>();  // S^T complete; dP^T may still run

      // P^T = exp2(S^T * scale * log2(e) - lse * log2(e)), from the saved log-sum-exp, with
      // S^T capped or biased, and masked, as in the forward.
      Tensor s = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
      if constexpr (Traits::kSoftcap) {
        params.softcap.template apply<kSoftcapReciprocalOnFma<kHeadDim>>(s);  // to log2 units
      }
      if constexpr (Traits::kBias) {
        if (params.bias_in_tiles) pipeline_bias.consumer_wait(read_bias);
        add_bias(tSrS, bias, m_block, params.bias_units);
        if (!Traits::kSoftcap && !params.dbias_in_tiles) release_bias();
      }
      mask.apply_block(s, visibility,
                       Range::needs_mask</*kMaskQueryTail=*/true>(problem, info.lens, m_block,
                                                                  info.coord.block),
                       info.segments, segments, info.n_start(), m_block * kBlockM);
      if constexpr (Traits::kMask) {
        if (cls != MaskBlock::kFull) {
          mask.apply_mask_array(s, mask_view.bits, problem.mask.row_stride,
                                problem.mask.words_per_row, info.n_start(), problem.seqlen_k,
                                m_block * kBlockM);
        }
      }
      // kSlopeFromLogits: one more register tile, in place of a log2 (an SFU op) and the
      // log-sum-exps read again per element after dP^T (kSlopeFromP, below).
      [[maybe_unused]] auto slope = make_fragment_like<float>(s);
      if constexpr (kSlopeFromLogits && !kSlopeTimesP) {
        CUTE_UNROLL
        for (int i = 0; i < size(s); ++i) slope(i) = params.softcap.derivative_of_log2(s(i));
      }
      const auto lse_column = column_values(storage.lse.data() + read_q.index() * kBlockM);
      const auto logits = [&] {
        if constexpr (Traits::kSoftcap) {
          return Log2Logits{};
        } else {
          return ScaledLogits</*kRounded=*/false>{scale_log2};
        }
      }();
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < kColumns; ++c) {
          const float logit = s(r, c);
          s(r, c) = fast_exp2(logits.exponent(logit, lse_column[c]));
          if constexpr (kSlopeTimesP) {
            slope(r, c) = s(r, c) * params.softcap.derivative_of_log2(logit);
          }
        }
      }
      // P^T in the input type: the A operand of dV, from registers or through shared memory.
      Tensor tdVrP = make_tensor<Element>(accumulator_as_a_operand(tSrS.layout()));
      convert_into(tSrS, tdVrP);
      if constexpr (!Traits::kDkvFromRegisters) {
        // Every warpgroup must be done with the previous step's P^T and dS^T.
        if constexpr (Traits::kStagesDs == 1) sync_pds();
        Tensor sPt = make_tensor(make_smem_ptr(storage.p_tile.p.data()),
                                 typename Traits::SmemLayoutPdS{});
        Tensor rP = make_tensor(tdVrP.data(), tSrS.layout());
        copy(smem_copy_pds, thr_copy_pds.retile_S(rP), thr_copy_pds.partition_D(sPt)(_, _, _, ds_stage));
      }

      // dS^T = P^T * (dP^T - D), D = rowsum(dO * O) - dlse per query; times tanh' where
      // the logits are capped.
      warpgroup_wait<0>();
      Tensor dp = make_tensor(tdPrdP.data(), accumulator_rowcol(tdPrdP.layout()));
      const auto d_column = column_values(storage.row_term.data() + read_do.index() * kBlockM);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dp); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < kColumns; ++c) {
          if constexpr (kSlopeTimesP) {
            dp(r, c) = slope(r, c) * (dp(r, c) - d_column[c]);
          } else {
            dp(r, c) = s(r, c) * (dp(r, c) - d_column[c]);
            if constexpr (kSlopeFromLogits) dp(r, c) *= slope(r, c);
          }
        }
      }
      // dbias += dS (transposed); summed over the queries, into the key sums.
      auto add_bias_gradient = [&] {
        if (params.dbias_in_tiles) {
          write_bias_gradient_tile(tdPrdP);
        } else if (dbias != nullptr && params.dbias.row_stride == 0) {
          mask.add_row_sums(dp, dbias_key_sums, m_block * kBlockM, problem.seqlen_q);
        } else if (dbias != nullptr && params.dbias.direct) {
          mask.store_bias_gradient(dp, static_cast<Element*>(dbias), params.dbias.col_stride,
                                   params.dbias.row_stride, info.n_start(), problem.seqlen_k,
                                   m_block * kBlockM, problem.seqlen_q);
        } else if (dbias != nullptr) {
          mask.add_bias_gradient(dp, static_cast<float*>(dbias), params.dbias.col_stride,
                                 params.dbias.row_stride, info.n_start(), problem.seqlen_k,
                                 m_block * kBlockM, problem.seqlen_q);
        }
      };
      if constexpr (kSlopeFromP) {
        // The log-sum-exps are read again from shared memory (their Q stage is still held)
        // rather than kept in registers across dP^T.
        const auto lse_again = column_values(storage.lse.data() + read_q.index() * kBlockM);
        // P is spent: its log2, less the bias (read again, from its tile or from L1), gives
        // the capped logit.
        CUTE_UNROLL
        for (int i = 0; i < size(s); ++i) s(i) = fast_log2(s(i));
        add_bias(tSrS, bias, m_block, -params.bias_units);
        if (!params.dbias_in_tiles) release_bias();
        // The bias is added after the cap: its gradient takes no tanh'. (Once the bias is
        // read for the last time: a gradient stored through its tile overwrites it.)
        add_bias_gradient();
        CUTE_UNROLL
        for (int r = 0; r < size<0>(dp); ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kColumns; ++c) {
            dp(r, c) *= params.softcap.derivative_at(s(r, c), lse_again[c]);
          }
        }
      }
      Tensor tdKrdS = make_tensor<Element>(accumulator_as_a_operand(tdPrdP.layout()));
      convert_into(tdPrdP, tdKrdS);

      // dV += P^T dO.
      if constexpr (Traits::kDkvFromRegisters) {
        warpgroup_gemm</*kZeroInit=*/false, -1>(mma_dkv, tdVrP, tdVrDo(_, _, _, read_do.index()),
                                                tdVrdV);
      } else {
        cutlass::arch::fence_view_async_shared();
        sync_pds();  // P^T of both warpgroups in shared memory
        Tensor sPt = make_tensor(make_smem_ptr(storage.p_tile.p.data()),
                                 typename Traits::SmemLayoutPdS{});
        Tensor tdVrPt = wg_dkv.partition_fragment_A(sPt);
        warpgroup_gemm</*kZeroInit=*/false, -1>(mma_dkv, tdVrPt(_, _, _, ds_stage),
                                                tdVrDo(_, _, _, read_do.index()), tdVrdV);
      }
      // Uncapped, dbias is added while dV runs.
      if constexpr (Traits::kBias && !Traits::kSoftcap) add_bias_gradient();
      // dS^T to shared memory for dQ (and for dK when it does not come from registers).
      Tensor rdS = make_tensor(tdKrdS.data(), tdPrdP.layout());
      copy(smem_copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, ds_stage));
      cutlass::arch::fence_view_async_shared();
      sync_pds();
      if (params.dbias_in_tiles && thread_idx == 0) store_bias_gradient_tile(m_block);

      // dQ of the first slice, then dK += dS^T Q while it runs.
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Traits::kDqSliceDim>>{});
      issue_dq(_0{}, ds_stage, tdQrdQ);
      if (params.dbias_in_tiles) {
        if (thread_idx == 0) tma_store_wait<0>();
        release_bias();
      }
      warpgroup_wait<1>();  // dV complete: dO and its row term are no longer read
      pipeline_do.consumer_release(read_do);
      if constexpr (Traits::kDkvFromRegisters) {
        warpgroup_gemm</*kZeroInit=*/false, -1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, read_q.index()),
                                                tdKrdK);
      } else {
        Tensor tdKrDs = wg_dkv.partition_fragment_A(sDs);
        warpgroup_gemm</*kZeroInit=*/false, -1>(mma_dkv, tdKrDs(_, _, _, ds_stage),
                                                tdKrQ(_, _, _, read_q.index()), tdKrdK);
      }
      warpgroup_wait<1>();  // the first dQ slice complete
      stage_dq(tdQrdQ);
      for_each(make_int_range<1, kDqSlices>{}, [&](auto slice) {
        issue_dq(slice, ds_stage, tdQrdQ);
        warpgroup_wait<0>();
        stage_dq(tdQrdQ);
      });
      warpgroup_wait<0>();  // dK complete: Q and its log-sum-exp are no longer read
      pipeline_q.consumer_release(read_q);
      ++read_q;
      ++read_do;
      ds_stage = Traits::kStagesDs == 1 ? 0 : (ds_stage + 1) % Traits::kStagesDs;
    };

    storage.kv_full.wait(0);
    for (int32_t g = 0; g < problem.group_size; ++g) {
      const auto mask_view = info.mask_of(problem, g);
      const Element* bias = Traits::kBias ? info.bias_of(problem, g) : nullptr;
      void* dbias = nullptr;
      if (Traits::kBias && params.dbias.present()) {
        const int32_t head = info.coord.head * problem.group_size + g;
        dbias_head = params.dbias.own_head(head);
        dbias = params.dbias.direct
                    ? static_cast<void*>(
                          params.dbias.template of<Element>(problem.batch, info.coord.batch, head))
                    : static_cast<void*>(
                          params.dbias.template of<float>(problem.batch, info.coord.batch, head));
      }
      dbias_key_sums.fill(0.f);
      // Each block's class is read a step ahead, so that skipping does not wait on its load.
      MaskBlock cls = info.query_block_class(problem, mask_view, info.queries.begin);
      CUTE_NO_UNROLL
      for (int32_t m_block = info.queries.begin; m_block < info.queries.end; ++m_block) {
        const MaskBlock next = m_block + 1 < info.queries.end
                                   ? info.query_block_class(problem, mask_view, m_block + 1)
                                   : MaskBlock::kEmpty;
        if (!TileInfo::skips(problem, cls)) step(m_block, mask_view, cls, bias, dbias);
        cls = next;
      }
      if constexpr (Traits::kBias) {
        if (dbias != nullptr && params.dbias.row_stride == 0) {
          mask.add_row_sums_to(dbias_key_sums, static_cast<float*>(dbias),
                               params.dbias.col_stride, info.n_start(), problem.seqlen_k);
        }
      }
    }
  }
};

}  // namespace jax_flash::sm90
