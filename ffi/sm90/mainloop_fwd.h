/*! \file mainloop_fwd.h
    \brief The forward mainloop collective: its arguments, parameters (TMA descriptors) and
           shared storage; the producer's TMA loads of Q and of the K/V pipeline; the consumers'
           QK^T -> soft-cap or bias (optional) -> mask -> online softmax -> PV sequence. With
           segment ids, a tile visits only the key blocks its rows' segments reach; with a mask
           or bias array, only the key blocks its block classes leave non-empty. A bias that
           keeps the query and key axes comes by TMA (each consumer warpgroup's 64 rows of a
           key block through a pipeline of its own, loaded by a second producer warp), read
           with ldmatrix; another is read from global memory in pairs of keys.

    Consumers overlap within a warpgroup: while the softmax of key block j runs, the wgmma of
    P_{j+1} V_{j+1} (issued just before) proceeds on the tensor cores (on tiles with
    one_loop_body, P_j V_j runs while the next block's K is awaited instead). Across
    warpgroups they take turns issuing their GEMMs (named barriers), so one warpgroup's softmax
    overlaps the other's GEMMs; on tiles with softmax_turns (kernel_configs.json) they also
    take turns at the softmax, so their exponentials do not contend for the special-function
    unit. Key blocks are visited from the last to the first, so the blocks that need per-element
    masking (the sequence tail and the causal diagonal) come first.
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/detail/helper_macros.hpp>

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

//! Which of a tile's loads ForwardMainloop::load issues: all, Q with the first K/V block (the
//! kernel's prologue issues them early), or the rest.
enum class LoadBlocks { kAll, kFirst, kRest };

template <class Traits>
struct ForwardMainloop {
  using Element = typename Traits::Element;
  using TileShapeQK = typename Traits::TileShapeQK;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;
  using Range = BlockRange<Traits::kBlockM, Traits::kBlockN>;
  static constexpr int kNumConsumerWarpGroups = Traits::kNumConsumerWarpGroups;
  //! Whether P's dtype keeps probabilities exact down to 2^-80 (BlockBound).
  static constexpr bool kPBoundable = std::is_same_v<Element, cutlass::bfloat16_t>;

  struct Arguments {
    typename Traits::GmemTensorSeq q, k, v;
    DeviceBatchMap q_batch, k_batch, v_batch;  //!< own batch item of each operand
    float scale_log2;                          //!< softmax scale times log2(e), > 0
    LogitSoftcap softcap;                      //!< used when Traits::kSoftcap
    float bias_units;                          //!< the bias's factor (bias_units())
    //! With Traits::kBiasInTiles: whether TMA reads the bias in tiles (moves_in_tiles), and
    //! the bias as TMA sees it.
    bool bias_in_tiles;
    typename Traits::GmemTensorBias bias;
  };

  //! Packed query heads of several query rows (AttentionProblem::query_group_shift): q read
  //! through a descriptor of its own (make_query_groups_tma, boxes of kBlockM rows) in place of
  //! tma_load_q's tiles. Not part of Params: ForwardKernel::Params holds it last (see there).
  struct QueryGroups {
    cute::TmaDescriptor q;
  };

  struct Params {
    typename Traits::TmaLoadQ tma_load_q;
    typename Traits::TmaLoadKV tma_load_k;
    typename Traits::TmaLoadKV tma_load_v;
    typename Traits::ShapeSeq shape_q, shape_k, shape_v;
    DeviceBatchMap q_batch, k_batch, v_batch;
    float scale_log2;
    LogitSoftcap softcap;
    float bias_units;
    bool bias_in_tiles;
    typename Traits::TmaLoadBias tma_load_bias;
    typename Traits::ShapeBias shape_bias;
  };

  static Params to_params(Arguments const& args) {
    Params params;
    params.tma_load_q = make_tma_copy(SM90_TMA_LOAD{}, args.q, typename Traits::SmemLayoutQ{},
                                      select<0, 2>(TileShapeQK{}), _1{});
    params.tma_load_k = make_tma_copy(SM90_TMA_LOAD{}, args.k,
                                      take<0, 2>(typename Traits::SmemLayoutKV{}),
                                      select<1, 2>(TileShapeQK{}), _1{});
    params.tma_load_v = make_tma_copy(SM90_TMA_LOAD{}, args.v,
                                      take<0, 2>(typename Traits::SmemLayoutKV{}),
                                      select<1, 2>(TileShapeQK{}), _1{});
    params.shape_q = args.q.shape();
    params.shape_k = args.k.shape();
    params.shape_v = args.v.shape();
    params.q_batch = args.q_batch;
    params.k_batch = args.k_batch;
    params.v_batch = args.v_batch;
    params.scale_log2 = args.scale_log2;
    params.softcap = args.softcap;
    params.bias_units = args.bias_units;
    params.bias_in_tiles = Traits::kBiasInTiles && args.bias_in_tiles;
    if constexpr (Traits::kBiasInTiles) {
      if (params.bias_in_tiles) {
        params.tma_load_bias = make_tma_copy(SM90_TMA_LOAD{}, args.bias,
                                             typename Traits::SmemLayoutBiasRows{},
                                             Shape<Int<Traits::kBlockN>, _64>{}, _1{});
        params.shape_bias = args.bias.shape();
      }
    }
    return params;
  }

  //! The floor of the running row maxima (softmax.h): the cap's (LogitSoftcap::maxima_floor),
  //! under which the short series' blocks exponentiate, where P is bfloat16 and the cap is
  //! applied in the softmax's exponent (no bias); else none (-inf).
  CUTE_DEVICE static float maxima_floor(Params const& params) {
    if constexpr (Traits::kSoftcap && !Traits::kBias && kPBoundable) {
      return params.softcap.maxima_floor;
    } else {
      return -INFINITY;
    }
  }

  using PipelineBias = typename Traits::PipelineBias;
  using StateBias = cutlass::PipelineState<1>;
  static constexpr int kBiasRowsElements = cosize_v<typename Traits::SmemLayoutBiasRows>;
  struct BiasRows {
    cute::array_aligned<Element, kBiasRowsElements * kNumConsumerWarpGroups, 1024> rows;
  };
  struct NoBiasRows {};

  struct alignas(1024) SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutKV>, 1024> v;
    //! Each consumer warpgroup's rows of a key block's bias (Traits::kBiasInTiles).
    std::conditional_t<Traits::kBiasInTiles, BiasRows, NoBiasRows> bias;
    cutlass::arch::ClusterTransactionBarrier q_full;
    cutlass::arch::ClusterBarrier q_empty;
    typename PipelineKV::SharedStorage pipeline_k;
    typename PipelineKV::SharedStorage pipeline_v;
    cute::array<typename PipelineBias::SharedStorage, kNumConsumerWarpGroups> pipeline_bias;
  };

  struct Absent {};

  //! What producer and consumers know alike about one (query block, head, batch) tile. Built
  //! by whole warps (with segment ids or block classes, a warp collective narrows the keys).
  struct TileInfo {
    TileCoord coord;
    SeqLengths lens;
    BlockSpan keys;  //!< key blocks that may hold visible keys
    //! Keys sharing a segment with some / every row of the tile.
    SegmentReachOf<Traits::kSegments> segments;
    std::conditional_t<Traits::kBlockClasses, MaskView, Absent> mask;
    //! The bias of the tile's (batch item, head) at (query 0, key 0).
    std::conditional_t<Traits::kBias, const Element*, Absent> bias;

    CUTE_DEVICE TileInfo(AttentionProblem const& p, TileCoord const& c)
        : coord(c), lens(p, c.batch), keys(Range::key_blocks(p, lens, c.block)) {
      if constexpr (Traits::kSegments) {
        const int32_t m_start = c.block * Traits::kBlockM;
        const int32_t m_end = min(m_start + Traits::kBlockM, lens.q_len);
        segments = SegmentReach::of<Traits::kBlockM>(p.segments.kv_span.of(p.batch, c.batch),
                                                     m_start, m_end);
        keys = segments.template narrow<Traits::kBlockN>(keys);
      }
      if constexpr (Traits::kBlockClasses) {
        mask = MaskView::of(p.mask, p.batch, c.batch, c.head);
        keys = narrow_by_mask</*kOwnIsKeyBlock=*/false>(p.mask, mask, c.block, keys);
      }
      if constexpr (Traits::kBias) bias = p.bias.template of<Element>(p.batch, c.batch, c.head);
    }
    CUTE_DEVICE bool empty() const { return keys.empty(); }
    CUTE_DEVICE int32_t m_start() const { return coord.block * Traits::kBlockM; }
    //! The class of key block n_block: the mask array's, or with a bias whether it drops the
    //! block (every block is full without classes).
    CUTE_DEVICE MaskBlock key_block_class(AttentionProblem const& p, int32_t n_block) const {
      if constexpr (Traits::kBlockClasses) {
        return mask.block(p.mask, coord.block, n_block);
      } else {
        return MaskBlock::kFull;
      }
    }
    //! The class of the key block below n_block, read ahead of its use (empty below the span).
    CUTE_DEVICE MaskBlock class_below(AttentionProblem const& p, int32_t n_block) const {
      return n_block > keys.begin ? key_block_class(p, n_block - 1) : MaskBlock::kEmpty;
    }
    //! Moves n_block to the next key block down that is not empty (below keys.begin when none
    //! is left) and `cls` to its class; `below` is class_below(n_block).
    CUTE_DEVICE void step_down(AttentionProblem const& p, int32_t& n_block, MaskBlock& cls,
                               MaskBlock below) const {
      --n_block;
      cls = below;
      if constexpr (Traits::kBlockClasses) {
        while (n_block >= keys.begin && cls == MaskBlock::kEmpty) {
          --n_block;
          cls = n_block >= keys.begin ? key_block_class(p, n_block) : MaskBlock::kEmpty;
        }
      }
    }
  };

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_v.get_tma_descriptor());
    if (Traits::kBiasInTiles && params.bias_in_tiles) {
      cute::prefetch_tma_descriptor(params.tma_load_bias.get_tma_descriptor());
    }
  }

  //! The bias loader (one thread; Traits::kBiasInTiles and params.bias_in_tiles): each consumer
  //! warpgroup's 64 rows of every visited key block's bias, in the consumers' order, through
  //! that warpgroup's pipeline. Apart from the K/V loader, so that neither waits on the other.
  CUTE_DEVICE static void load_bias(Params const& params, AttentionProblem const& problem,
                                    SharedStorage& storage, PipelineBias* pipeline_bias,
                                    StateBias& write_bias, TileInfo const& info) {
    if constexpr (Traits::kBiasInTiles) {
      Tensor mBias = params.tma_load_bias.get_tma_tensor(params.shape_bias);
      const int32_t bias_head = problem.bias.head_stride == 0 ? 0 : info.coord.head;
      const int32_t bias_item = problem.bias.batch(problem.batch, info.coord.batch);
      // (keys, 64 queries) blocks: (kBlockN, 64, key block, query block of 64 rows)
      Tensor gBias = local_tile(mBias(_, _, bias_head, bias_item),
                                Shape<Int<Traits::kBlockN>, _64>{}, make_coord(_, _));
      auto tma = params.tma_load_bias.get_slice(_0{});
      Tensor tBgB = tma.partition_S(gBias);  // (TMA, TMA_N, TMA_M, n, m64)
      // Not unrolled: the producer has few registers.
      CUTE_NO_UNROLL
      for (int32_t n_block = info.keys.end - 1; n_block >= info.keys.begin; --n_block) {
        if (info.key_block_class(problem, n_block) == MaskBlock::kEmpty) continue;
        CUTE_NO_UNROLL
        for (int wg = 0; wg < kNumConsumerWarpGroups; ++wg) {
          Tensor sBias = make_tensor(make_smem_ptr(storage.bias.rows.data() + wg * kBiasRowsElements),
                                     typename Traits::SmemLayoutBiasRows{});
          pipeline_bias[wg].producer_acquire(write_bias);
          copy(params.tma_load_bias.with(*pipeline_bias[wg].producer_get_barrier(write_bias), 0),
               tBgB(_, _, _, n_block, info.coord.block * kNumConsumerWarpGroups + wg),
               tma.partition_D(sBias));
        }
        ++write_bias;
      }
    }
  }

  //! Q of a tile of packed query heads (QueryGroups): each 64-column block of the tile's
  //! shared layout (the 128-byte swizzle's width) by one five-dimensional TMA box of its
  //! kBlockM rows, kBlockM / G query rows of all G heads, rows t*G + g in order.
  CUTE_DEVICE static void load_query_groups(QueryGroups const& groups, int shift,
                                            SharedStorage& storage, int block, int head,
                                            int item) {
    constexpr int kColumns = 64;
    using SmemLayoutQ = typename Traits::SmemLayoutQ;
    static_assert(Traits::kHeadDim % kColumns == 0 && SmemLayoutQ{}(1, 0) == kColumns &&
                      (Traits::kHeadDim == kColumns ||
                       SmemLayoutQ{}(0, kColumns) == Traits::kBlockM * kColumns),
                  "Q's shared layout: rows of 64 columns, one column block after another");
    const int first_query_row = (block * Traits::kBlockM) >> shift;
    CUTE_UNROLL
    for (int c = 0; c < Traits::kHeadDim / kColumns; ++c) {
      SM90_TMA_LOAD_5D::copy(&groups.q, reinterpret_cast<uint64_t*>(&storage.q_full),
                             static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST),
                             storage.q.data() + c * Traits::kBlockM * kColumns, c * kColumns, 0,
                             first_query_row, head, item);
    }
  }

  //! Producer (one thread): Q of the tile and every visible K/V block, into the pipelines; or
  //! (`blocks`) Q with the first K/V block alone, or the blocks after it.
  CUTE_DEVICE static void load(Params const& params, AttentionProblem const& problem,
                               QueryGroups const& groups, SharedStorage& storage,
                               PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                               PipelineState& write_state, TileInfo const& info,
                               LoadBlocks blocks = LoadBlocks::kAll) {
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});

    Tensor mQ = params.tma_load_q.get_tma_tensor(params.shape_q);
    Tensor mK = params.tma_load_k.get_tma_tensor(params.shape_k);
    Tensor mV = params.tma_load_v.get_tma_tensor(params.shape_v);
    const int32_t head = info.coord.head;
    const int32_t kv_head = head / problem.group_size;
    const int32_t batch = info.coord.batch;
    Tensor gQ = local_tile(mQ(_, _, head, params.q_batch(problem.batch, batch)),
                           select<0, 2>(TileShapeQK{}), make_coord(info.coord.block, _0{}));  // (M, D)
    Tensor gK = local_tile(mK(_, _, kv_head, params.k_batch(problem.batch, batch)),
                           select<1, 2>(TileShapeQK{}),
                           make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(mV(_, _, kv_head, params.v_batch(problem.batch, batch)),
                           select<1, 2>(TileShapeQK{}),
                           make_coord(_, _0{}));  // (N, D, n)

    auto tma_q = params.tma_load_q.get_slice(_0{});
    auto tma_k = params.tma_load_k.get_slice(_0{});
    auto tma_v = params.tma_load_v.get_slice(_0{});
    Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(gQ));  // (TMA)
    Tensor tQsQ = group_modes<0, 3>(tma_q.partition_D(sQ));  // (TMA)
    Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(gK));  // (TMA, n)
    Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(sK));  // (TMA, stage)
    Tensor tVgV = group_modes<0, 3>(tma_v.partition_S(gV));
    Tensor tVsV = group_modes<0, 3>(tma_v.partition_D(sV));

    // A K/V block that several tiles read (several query blocks, or several heads of a group)
    // should outlast the streamed Q tiles in L2 (+0.4-5% forward at T <= 1024, H100).
    const auto kv_hint = problem.seqlen_q > Traits::kBlockM || problem.group_size > 1
                             ? TMA::CacheHintSm90::EVICT_LAST
                             : TMA::CacheHintSm90::EVICT_NORMAL;
    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_state);
      copy(params.tma_load_k.with(*pipeline_k.producer_get_barrier(write_state), 0, kv_hint),
           tKgK(_, n_block), tKsK(_, write_state.index()));
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_state);
      copy(params.tma_load_v.with(*pipeline_v.producer_get_barrier(write_state), 0, kv_hint),
           tVgV(_, n_block), tVsV(_, write_state.index()));
    };

    // The first K block goes out before Q so both latencies overlap. The span's first and
    // last blocks are never empty.
    int n_block = info.keys.end - 1;
    if (blocks != LoadBlocks::kRest) {
      load_k(n_block);
      storage.q_full.arrive_and_expect_tx(Traits::kQBytes);
      // A Q tile is read by one tile (or, decoding with split keys, by one per key chunk, all
      // at once): it need not stay in L2.
      if (problem.query_group_shift > 0) {
        load_query_groups(groups, problem.query_group_shift, storage, info.coord.block, head,
                          params.q_batch(problem.batch, batch));
      } else {
        copy(params.tma_load_q.with(reinterpret_cast<uint64_t&>(storage.q_full), 0,
                                    TMA::CacheHintSm90::EVICT_FIRST),
             tQgQ, tQsQ);
      }
      load_v(n_block);
      ++write_state;
      if (blocks == LoadBlocks::kFirst) return;
    }
    for (--n_block; n_block >= info.keys.begin; --n_block) {
      if (info.key_block_class(problem, n_block) == MaskBlock::kEmpty) continue;
      load_k(n_block);
      load_v(n_block);
      ++write_state;
    }
  }

  //! The stage before `state`. V is read one key block behind K; deriving its stage instead of
  //! carrying a second state keeps the consumers of head dim 64 within their 160 registers.
  CUTE_DEVICE static PipelineState previous_stage(PipelineState const& state) {
    const bool wraps = state.index() == 0;
    return PipelineState(wraps ? Traits::kStages - 1 : state.index() - 1,
                         wraps ? state.phase() ^ 1 : state.phase(), state.count() - 1);
  }

  using Barriers = typename Traits::Barriers;

  //! Warpgroup turn-taking on a ring of named barriers, one per consumer warpgroup from
  //! `first`: wait for the calling warpgroup's turn, then pass it on to the next. The GEMM-issue
  //! ring orders the warpgroups' GEMMs; with Traits::kSoftmaxTurns a second ring orders their
  //! softmax steps.
  CUTE_DEVICE static void wait_turn(int warp_group,
                                    uint32_t first = Barriers::kWarpGroupTurnFirst) {
    if constexpr (kNumConsumerWarpGroups > 1) {
      cutlass::arch::NamedBarrier::sync(2 * kThreadsPerWarpGroup, first + warp_group);
    }
  }
  CUTE_DEVICE static void pass_turn(int warp_group,
                                    uint32_t first = Barriers::kWarpGroupTurnFirst) {
    if constexpr (kNumConsumerWarpGroups > 1) {
      cutlass::arch::NamedBarrier::arrive(2 * kThreadsPerWarpGroup,
                                          first + (warp_group + 1) % kNumConsumerWarpGroups);
    }
  }
  CUTE_DEVICE static void wait_softmax_turn(int warp_group) {
    if constexpr (Traits::kSoftmaxTurns) wait_turn(warp_group, Barriers::kSoftmaxTurnFirst);
  }
  CUTE_DEVICE static void pass_softmax_turn(int warp_group) {
    if constexpr (Traits::kSoftmaxTurns) pass_turn(warp_group, Barriers::kSoftmaxTurnFirst);
  }
  //! Before the first tile the last warpgroup hands the first turns to warpgroup 0.
  CUTE_DEVICE static void start_turns(int warp_group) {
    if (warp_group == kNumConsumerWarpGroups - 1) {
      pass_turn(warp_group);
      pass_softmax_turn(warp_group);
    }
  }
  //! After the last tile warpgroup 0 absorbs the turns the last warpgroup passed it.
  CUTE_DEVICE static void finish_turns(int warp_group) {
    if (warp_group == 0) {
      wait_turn(warp_group);
      wait_softmax_turn(warp_group);
    }
  }

  //! Consumers: accumulates the unnormalised output of a non-empty tile into tOrO and the
  //! row statistics into softmax. `release_q` is called once the last read of Q is complete.
  //! Returns the stage of the tile's last key block; without Traits::kOwnOutputTiles its K and
  //! V stay held for the output (kernel_traits_fwd.h), and the caller frees them.
  //! `warp_group` must be warp-uniform in a form the compiler can see (a shuffle): the Q, K and
  //! V descriptors are sliced with it, so they live in uniform registers and not in the
  //! consumers' register budget (16 Q descriptors at head dim 256 made ptxas spill).
  template <class TensorO, class ReleaseQ>
  CUTE_DEVICE static PipelineState mma(Params const& params, AttentionProblem const& problem,
                                       SharedStorage& storage, PipelineKV& pipeline_k,
                                       PipelineKV& pipeline_v, PipelineState& read_state,
                                       uint32_t q_phase, PipelineBias* pipeline_bias,
                                       StateBias& read_bias, TileInfo const& info, int warp_group,
                                       int thread_idx, TensorO& tOrO,
                                       typename Traits::Softmax& softmax, ReleaseQ&& release_q) {
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutVt{});

    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    // Shared-memory operands depend only on the warpgroup (one descriptor for its 128 threads).
    auto warp_group_qk = mma_qk.get_thread_slice(warp_group * kThreadsPerWarpGroup);
    auto warp_group_pv = mma_pv.get_thread_slice(warp_group * kThreadsPerWarpGroup);
    Tensor tSrQ = warp_group_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = warp_group_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrV = warp_group_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(TileShapeQK{}));
    Tensor tOrP = make_tensor<Element>(accumulator_as_a_operand(tSrS.layout()));
    Tensor s = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
    Tensor o = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
    BlockMask<Traits::kBlockM, Traits::kBlockN, typename Traits::TiledMmaQK> mask(thread_idx);
    const RowVisibility visibility = RowVisibility::of</*kRowsAreKeys=*/false>(problem, info.lens);
    const SegmentAxes</*kRowsAreKeys=*/false> segments{problem, info.coord.batch};

    // The warpgroup's rows of a key block's bias from its tile: (queries, keys) over the tile's
    // (keys, queries) layout, into the S accumulator layout with ldmatrix, a slice at a time.
    auto add_bias_rows = [&] {
      if constexpr (Traits::kBiasInTiles) {
        Tensor sBias = make_tensor(
            make_smem_ptr(storage.bias.rows.data() + warp_group * kBiasRowsElements),
            composition(typename Traits::SmemLayoutBiasRows{},
                        make_ordered_layout(Shape<_64, Int<Traits::kBlockN>>{}, Step<_2, _1>{})));
        auto copy_bias = make_tiled_copy_C(typename Traits::SmemCopyAtomBias{},
                                           typename Traits::MmaQKOneWarpGroup{});
        auto thr_copy_bias = copy_bias.get_thread_slice(thread_idx % kThreadsPerWarpGroup);
        pipeline_bias[warp_group].consumer_wait(read_bias);
        add_tile_in_slices<Element>(copy_bias, thr_copy_bias.partition_S(sBias),
                                    thr_copy_bias.retile_D(tSrS), params.bias_units);
        pipeline_bias[warp_group].consumer_release(read_bias);
        ++read_bias;
      }
    };

    const typename Traits::Logits scaled{params.scale_log2};
    // S of key block n_block into probabilities: the cap, then the bias, before masking,
    // since masked logits must end at -inf, then the softmax step. A warp whose products fit
    // one of the cap's series leaves them raw and caps them in the softmax's exponent, unless a
    // bias is added to the capped logits; otherwise the cap leaves them in log2 units. In a
    // block that masks nothing, the series' bound on the capped logits stands in for the row
    // maxima where P is bfloat16 (BlockBound: float16 would lose the exactness of P at the
    // bound's distance from them). Where the cap gives the running maxima a floor
    // (maxima_floor), blocks in the short series, masked or not, lie under it: they take it for
    // their base and move no maximum.
    // This step and the next are inlined by force: under a cap with a bias, the compiler made
    // them calls, which kept S in local memory and serialised every wgmma (ptxas C7514).
    const bool floored = maxima_floor(params) > -INFINITY;
    auto probabilities = [&](auto first, int n_block, MaskBlock cls,
                             bool needs_mask) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kFirst = decltype(first)::value;
      [[maybe_unused]] CappedBlock capped{CapForm::kExp, 0.f};
      if constexpr (Traits::kSoftcap && Traits::kBias) {
        params.softcap.template apply<kSoftcapReciprocalOnFma<Traits::kHeadDim>>(s);
      } else if constexpr (Traits::kSoftcap) {
        capped = params.softcap.form(s, /*short_needs_largest=*/!floored);
        // A block under the floor that nothing masks goes straight to its exponentials, ahead
        // of the other forms' and the masking's code: the hot loop's path then jumps less
        // (instruction fetch stalled 8% of the capped forward's warp samples; this ran 1-4%
        // faster at head dims 64 and 128, H200).
        if (floored && capped.form == CapForm::kShortSeries && !needs_mask &&
            cls == MaskBlock::kFull &&
            !mask.cuts_by_segments(visibility, info.segments, n_block * Traits::kBlockN)) {
          return softmax.template exponentiate_under_floor<kFirst>(s,
                                                                   params.softcap.short_series);
        }
        if (capped.form == CapForm::kExp) {
          params.softcap.template apply_exp_form<kSoftcapReciprocalOnFma<Traits::kHeadDim>>(s);
        }
      }
      if constexpr (Traits::kBias) {
        if (Traits::kBiasInTiles && params.bias_in_tiles) {
          add_bias_rows();
        } else {
          mask.add_bias(s, info.bias, problem.bias.row_stride, problem.bias.col_stride,
                        problem.bias.paired, params.bias_units, info.m_start(),
                        problem.seqlen_q, n_block * Traits::kBlockN, problem.seqlen_k);
        }
      }
      bool masked = mask.apply_block(
          s, visibility, needs_mask, info.segments, segments, info.m_start(),
          n_block * Traits::kBlockN);
      if constexpr (Traits::kMask) {
        masked |= cls != MaskBlock::kFull;
        if (cls != MaskBlock::kFull) {
          mask.apply_mask_array(s, info.mask.bits, problem.mask.row_stride,
                                problem.mask.words_per_row, info.m_start(), problem.seqlen_q,
                                n_block * Traits::kBlockN);
        }
      }
      if constexpr (Traits::kSoftcap) {
        // Each warp's cap form picks its logit map (a warp-uniform branch, taken once for the
        // maxima and once for the exponentials), and with a series the bound that may stand
        // in for the maxima. (One branch around both ran 2-4% slower on head dim 64's 192-row
        // tile, H200.)
        if (floored && capped.form == CapForm::kShortSeries) {
          return softmax.template exponentiate_under_floor<kFirst>(s,
                                                                   params.softcap.short_series);
        }
        const bool rows_visible = kPBoundable && !masked;
        auto with_logit_map = [&](auto&& step) {
          if (capped.form == CapForm::kShortSeries) {
            const auto& map = params.softcap.short_series;
            return step(map, map.bound(capped.largest, rows_visible));
          }
          if (capped.form == CapForm::kSeries) {
            const auto& map = params.softcap.series;
            return step(map, map.bound(capped.largest, rows_visible));
          }
          return step(Log2Logits{}, BlockBound{});
        };
        const auto block_max = with_logit_map([&](auto const& map, BlockBound bound) {
          return softmax.block_maxima(s, map, bound);
        });
        return with_logit_map([&](auto const& map, BlockBound) {
          return softmax.template exponentiate<kFirst>(s, map, block_max);
        });
      } else {
        return softmax.template exponentiate<kFirst>(s, scaled, softmax.block_maxima(s, scaled));
      }
    };
    auto softmax_step = [&](auto first, int n_block, MaskBlock cls,
                            bool needs_mask) CUTLASS_LAMBDA_FUNC_INLINE {
      wait_softmax_turn(warp_group);
      const auto rescale = probabilities(first, n_block, cls, needs_mask);
      pass_softmax_turn(warp_group);
      return rescale;
    };
    // Whether the sequences' ends or the window cut key block n_block: decided while its S is
    // computed, so that the test is off the softmax step's path.
    auto block_needs_mask = [&](int n_block) {
      return Range::needs_mask</*kMaskQueryTail=*/false>(problem, info.lens, info.coord.block,
                                                         n_block);
    };
    auto issue_qk = [&](PipelineState const& state) {
      warpgroup_gemm</*kZeroInit=*/true, /*kWaitGroups=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, state.index()), tSrS);
    };
    // The bias of a block is fetched into L1 while its S is computed (read from memory).
    auto prefetch_bias = [&](int n_block) {
      if constexpr (Traits::kBias) {
        if (Traits::kBiasInTiles && params.bias_in_tiles) return;
        mask.prefetch_bias(info.bias, problem.bias.row_stride, problem.bias.col_stride,
                           info.m_start(), problem.seqlen_q, n_block * Traits::kBlockN,
                           problem.seqlen_k);
      }
    };
    auto issue_pv = [&](PipelineState const& state) {
      warpgroup_gemm</*kZeroInit=*/false, /*kWaitGroups=*/-1>(mma_pv, tOrP, tOrV(_, _, _, state.index()), tOrO);
    };

    // After a key block's QK^T GEMM: its K stage is free (but the last block's, when it takes
    // the output), and after the last block's Q too.
    auto release_k = [&](PipelineState const& state, int n_block) {
      const bool last = n_block == info.keys.begin;
      if (Traits::kOwnOutputTiles || !last) pipeline_k.consumer_release(state);
      if (last) release_q();
    };

    storage.q_full.wait(q_phase);

    if constexpr (Traits::kOneLoopBody) {
      // S_j, its softmax step, then P_j V_j issued behind it; the next block's S waits for
      // both. The first block takes the same step: its rescale multiplies a zero O.
      int n_block = info.keys.end - 1;
      MaskBlock cls = info.key_block_class(problem, n_block);
      PipelineState v_state = read_state;
      for (bool first = true; n_block >= info.keys.begin; first = false) {
        const MaskBlock below = info.class_below(problem, n_block);
        pipeline_k.consumer_wait(read_state);
        wait_turn(warp_group);
        issue_qk(read_state);
        pass_turn(warp_group);
        prefetch_bias(n_block);
        const bool needs_mask = block_needs_mask(n_block);
        warpgroup_wait<0>();  // S_j and P_{j-1} V_{j-1} complete
        release_k(read_state, n_block);
        if (!first) pipeline_v.consumer_release(v_state);
        const auto rescale = softmax_step(std::false_type{}, n_block, cls, needs_mask);
        if (rescale.needed) scale_rows(o, rescale.factor);
        convert_into(tSrS, tOrP);
        pipeline_v.consumer_wait(read_state);
        wait_turn(warp_group);
        issue_pv(read_state);
        pass_turn(warp_group);
        v_state = read_state;
        ++read_state;
        info.step_down(problem, n_block, cls, below);
      }
      warpgroup_wait<0>();
      if constexpr (Traits::kOwnOutputTiles) pipeline_v.consumer_release(v_state);
      return v_state;
    }

    // First (last-visited) key block: S and its softmax step without history. The classes
    // of the next block down are read a block ahead, so that skipping empty blocks does not
    // wait on their loads.
    int n_block = info.keys.end - 1;
    MaskBlock cls = info.key_block_class(problem, n_block);
    MaskBlock below = info.class_below(problem, n_block);
    pipeline_k.consumer_wait(read_state);
    wait_turn(warp_group);
    issue_qk(read_state);
    pass_turn(warp_group);
    prefetch_bias(n_block);
    bool needs_mask = block_needs_mask(n_block);
    warpgroup_wait<0>();
    release_k(read_state, n_block);
    softmax_step(std::true_type{}, n_block, cls, needs_mask);
    convert_into(tSrS, tOrP);
    ++read_state;

    // Steady state: S_j and P_{j+1} V_{j+1} in flight together.
    for (info.step_down(problem, n_block, cls, below); n_block >= info.keys.begin;
         info.step_down(problem, n_block, cls, below)) {
      below = info.class_below(problem, n_block);
      pipeline_k.consumer_wait(read_state);
      wait_turn(warp_group);
      issue_qk(read_state);
      const PipelineState v_state = previous_stage(read_state);
      pipeline_v.consumer_wait(v_state);
      issue_pv(v_state);
      pass_turn(warp_group);
      prefetch_bias(n_block);
      needs_mask = block_needs_mask(n_block);
      warpgroup_wait<1>();  // S_j complete; P V may still run
      release_k(read_state, n_block);
      const auto rescale = softmax_step(std::false_type{}, n_block, cls, needs_mask);
      warpgroup_wait<0>();  // P V complete: O may be rescaled and P overwritten
      pipeline_v.consumer_release(v_state);
      if (rescale.needed) scale_rows(o, rescale.factor);
      convert_into(tSrS, tOrP);
      ++read_state;
    }

    // The first key block's P V.
    const PipelineState v_state = previous_stage(read_state);
    pipeline_v.consumer_wait(v_state);
    wait_turn(warp_group);
    issue_pv(v_state);
    pass_turn(warp_group);
    warpgroup_wait<0>();
    if constexpr (Traits::kOwnOutputTiles) pipeline_v.consumer_release(v_state);
    return v_state;
  }
};

}  // namespace jax_flash::sm90
