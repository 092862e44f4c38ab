/*! \file kernel_fwd.h
    \brief The warp-specialised, persistent Hopper forward kernel: its shared storage (the
           collectives' storage side by side), barrier setup, register reallocation between
           roles, and the per-tile loops of the producer (TMA) and the consumer warpgroups
           (WGMMA + softmax + epilogue).
*/
#pragma once

#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "epilogue_fwd.h"
#include "mainloop_fwd.h"
#include "seqlen.h"
#include "tile_scheduler.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct ForwardKernel {
  using Mainloop = ForwardMainloop<Traits>;
  using Epilogue = ForwardEpilogue<Traits>;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    AttentionProblem problem;
    TileSchedulerParams scheduler;
    //! Last, read only where query heads are packed as rows of several query rows: ahead of
    //! the rest they would move the parameters every tile reads.
    typename Mainloop::QueryGroups mainloop_groups;
    typename Epilogue::QueryGroups epilogue_groups;
  };

  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;

  struct StorageWithOutputTiles {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::SharedStorage epilogue;
    //! Consumer warpgroup `warp_group`'s output tile.
    CUTE_DEVICE Element* output_tile(int warp_group, bool, PipelineState const&) {
      return Epilogue::output_tile(epilogue, warp_group);
    }
  };
  struct StorageWithoutOutputTiles {
    typename Mainloop::SharedStorage mainloop;
    //! Where consumer warpgroup `warp_group` stores a tile's O without Traits::kOwnOutputTiles: the
    //! K (warpgroup 0) or V (1) stage `last_stage` of its last key block, or for a tile without
    //! keys, whose Q is not loaded, its rows' part of the Q tile.
    CUTE_DEVICE Element* output_tile(int warp_group, bool empty, PipelineState const& last_stage) {
      constexpr int kStageElements = Traits::kKVStageBytes / sizeof(Element);
      if (empty) return mainloop.q.data() + warp_group * cosize_v<typename Traits::SmemLayoutO>;
      return (warp_group == 0 ? mainloop.k.data() : mainloop.v.data()) +
             last_stage.index() * kStageElements;
    }
  };
  using SharedStorage = std::conditional_t<Traits::kOwnOutputTiles, StorageWithOutputTiles,
                                           StorageWithoutOutputTiles>;
  static constexpr int kSharedStorageBytes = sizeof(SharedStorage);
  static_assert(kSharedStorageBytes <= Traits::kSmemBudget, "tile configuration exceeds shared memory");
};

//! One pipeline per consumer warpgroup over its storage in `storage` (index_sequence I).
template <class Pipeline, class Storage, size_t... I>
CUTE_DEVICE cute::array<Pipeline, sizeof...(I)> make_pipelines(
    Storage& storage, typename Pipeline::Params const& params, std::index_sequence<I...>) {
  return {{Pipeline(storage[I], params, Shape<_1, _1, _1>{})...}};
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    forward_kernel(CUTE_GRID_CONSTANT typename ForwardKernel<Traits>::Params const params) {
  using Kernel = ForwardKernel<Traits>;
  using Mainloop = typename Kernel::Mainloop;
  using Epilogue = typename Kernel::Epilogue;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;
  using TileInfo = typename Mainloop::TileInfo;

  extern __shared__ char shared_memory[];
  auto& storage = *reinterpret_cast<typename Kernel::SharedStorage*>(shared_memory);
  auto& mainloop_storage = storage.mainloop;

  const int warp_group = cutlass::canonical_warp_group_idx();
  const bool is_producer = warp_group == 0;

  if (threadIdx.x == 0) {
    mainloop_storage.q_full.init(/*arrive_count=*/1);
    // Every consumer thread frees Q once its last QK^T GEMM is complete (for a tile without
    // keys, once the output store that went through it has read it).
    mainloop_storage.q_empty.init(Traits::kNumConsumerThreads);
    Mainloop::prefetch_descriptors(params.mainloop);
  }
  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kKVStageBytes;
  pipeline_params.role = is_producer ? PipelineKV::ThreadCategory::Producer
                                     : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kNumConsumerThreads;
  PipelineKV pipeline_k(mainloop_storage.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  PipelineKV pipeline_v(mainloop_storage.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  // The bias tiles' pipelines: the producer warpgroup's second warp loads, each consumer
  // warpgroup reads its own.
  using PipelineBias = typename Mainloop::PipelineBias;
  constexpr int kBiasLoaderThread = 32, kOutputPrefetchThread = 64;
  typename PipelineBias::Params bias_pipeline_params;
  bias_pipeline_params.transaction_bytes = Traits::kBiasRowsBytes;
  bias_pipeline_params.role = is_producer ? PipelineBias::ThreadCategory::Producer
                                          : PipelineBias::ThreadCategory::Consumer;
  bias_pipeline_params.is_leader = threadIdx.x == kBiasLoaderThread;
  bias_pipeline_params.num_consumers = kThreadsPerWarpGroup;
  auto pipeline_bias = make_pipelines<PipelineBias>(
      mainloop_storage.pipeline_bias, bias_pipeline_params,
      std::make_index_sequence<Traits::kNumConsumerWarpGroups>{});
  // Barrier initialisation visible to every thread. The loader's warp only arrives, then issues
  // its first tile's Q and first K/V block at once while the other warps go on: through the
  // producer's own code (past the consumers', cold in the instruction and constant caches) a
  // decoding CTA reached its first load 1.3 us after it started, of about 6 (H200), and its
  // consumers waited for the data. With segment ids or a mask array the warp builds the
  // TileInfo (a warp collective).
  StaticPersistentScheduler scheduler(params.scheduler);
  constexpr bool kWarpBuildsTileInfo = Traits::kSegments || Traits::kBlockClasses;
  PipelineState write_state = cutlass::make_producer_start_state<PipelineKV>();
  bool first_block_loaded = false;
  if (threadIdx.x < 32) {
    prologue_barrier_arrive(Traits::kNumThreads);
    if (scheduler.valid()) {
      const TileInfo info(params.problem, scheduler.coord());
      if (!info.empty()) {
        if (threadIdx.x == 0) {
          Mainloop::load(params.mainloop, params.problem, params.mainloop_groups,
                         mainloop_storage, pipeline_k, pipeline_v, write_state, info,
                         LoadBlocks::kFirst);
        }
        first_block_loaded = true;
      }
    }
  } else {
    prologue_barrier_sync(Traits::kNumThreads);
  }

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    // One thread issues every TMA load; with segment ids or a mask array its whole warp builds
    // each tile's TileInfo (a warp collective).
    if (Traits::kBiasInTiles && params.mainloop.bias_in_tiles && threadIdx.x / 32 == 1) {
      // The bias loader: every tile's bias rows, on its own (its warp builds each TileInfo).
      auto write_bias = cutlass::make_producer_start_state<PipelineBias>();
      for (; scheduler.valid(); scheduler.advance()) {
        const TileInfo info(params.problem, scheduler.coord());
        if (threadIdx.x == kBiasLoaderThread && !info.empty()) {
          Mainloop::load_bias(params.mainloop, params.problem, mainloop_storage,
                              pipeline_bias.data(), write_bias, info);
        }
        __syncwarp();
      }
      if (threadIdx.x == kBiasLoaderThread) {
        for (auto& pipeline : pipeline_bias) {
          auto tail = write_bias;
          pipeline.producer_tail(tail);
        }
      }
      return;
    }
    if (threadIdx.x >= (kWarpBuildsTileInfo ? 32 : 1)) {
      // A warp with nothing else to do (neither the loader's nor the bias loader's) prefetches
      // the output's descriptors: their parameters, read on the loader's or the consumers'
      // path to the first tile, would delay it (constant-cache misses).
      if (threadIdx.x == kOutputPrefetchThread) {
        Epilogue::prefetch_descriptors(params.epilogue, params.epilogue_groups,
                                       params.problem.query_group_shift > 0);
      }
      return;
    }
    const bool loader = threadIdx.x == 0;
    if (loader && params.problem.query_group_shift > 0) {
      cute::prefetch_tma_descriptor(&params.mainloop_groups.q);
    }
    uint32_t q_empty_phase = 1;  // the first wait on a fresh barrier passes
    for (; scheduler.valid(); scheduler.advance()) {
      const TileInfo info(params.problem, scheduler.coord());
      if (loader) {
        mainloop_storage.q_empty.wait(q_empty_phase);
        if (!info.empty()) {
          Mainloop::load(params.mainloop, params.problem, params.mainloop_groups,
                         mainloop_storage, pipeline_k, pipeline_v, write_state, info,
                         first_block_loaded ? LoadBlocks::kRest : LoadBlocks::kAll);
        } else {
          // Nothing to load, but the Q handshake still takes its turn: consumers that freed Q
          // for several empty tiles in a row would otherwise complete q_empty phases the
          // producer has not waited for yet, and its parity wait would then never return.
          mainloop_storage.q_full.arrive();
        }
      }
      q_empty_phase ^= 1;
      first_block_loaded = false;
      if constexpr (kWarpBuildsTileInfo) __syncwarp();
    }
    if (loader) {
      pipeline_k.producer_tail(write_state);
      pipeline_v.producer_tail(write_state);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int thread_idx = threadIdx.x - kThreadsPerWarpGroup;
    const int consumer_warp_group = warp_group - 1;
    typename Traits::TiledMmaPV mma_pv;
    PipelineState read_state;
    typename Mainloop::StateBias read_bias;
    uint32_t q_full_phase = 0;
    auto release_q = [&] { mainloop_storage.q_empty.arrive(); };
    Mainloop::start_turns(consumer_warp_group);
    for (; scheduler.valid(); scheduler.advance()) {
      const TileInfo info(params.problem, scheduler.coord());
      Tensor tOrO = partition_fragment_C(mma_pv, select<0, 2>(typename Traits::TileShapeQK{}));
      clear(tOrO);
      typename Traits::Softmax softmax(Mainloop::maxima_floor(params.mainloop));
      PipelineState last_stage;
      if (!info.empty()) {
        last_stage = Mainloop::mma(params.mainloop, params.problem, mainloop_storage, pipeline_k,
                                   pipeline_v, read_state, q_full_phase, pipeline_bias.data(),
                                   read_bias, info, consumer_warp_group, thread_idx, tOrO, softmax,
                                   release_q);
      } else {
        mainloop_storage.q_full.wait(q_full_phase);  // the producer's turn for this tile
        if constexpr (Traits::kOwnOutputTiles) release_q();
      }
      q_full_phase ^= 1;
      Epilogue::store(params.epilogue, params.problem, params.epilogue_groups,
                      storage.output_tile(consumer_warp_group, info.empty(), last_stage), info,
                      consumer_warp_group, thread_idx, tOrO, softmax);
      if constexpr (!Traits::kOwnOutputTiles) {
        // The store has read the shared memory it went through.
        if (info.empty()) {
          release_q();
        } else {
          pipeline_k.consumer_release(last_stage);
          pipeline_v.consumer_release(last_stage);
        }
      }
    }
    Mainloop::finish_turns(consumer_warp_group);
    Epilogue::finish(thread_idx);
  }
}

}  // namespace jax_flash::sm90
