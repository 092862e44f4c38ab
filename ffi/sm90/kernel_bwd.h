/*! \file kernel_bwd.h
    \brief The warp-specialised Hopper backward kernel, one CTA per (key block, key/value head,
           batch) tile: barrier setup, register reallocation between roles, the producer warps
           (TMA loads; dQ reductions) and the MMA warpgroups (mainloop, then the dK/dV
           epilogue).
*/
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "epilogue_bwd.h"
#include "mainloop_bwd.h"
#include "seqlen.h"
#include "tile_scheduler.h"

namespace jax_flash::sm90 {

using namespace cute;

template <class Traits>
struct BackwardKernel {
  using Mainloop = BackwardMainloop<Traits>;
  using Epilogue = BackwardEpilogue<Traits>;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    AttentionProblem problem;
    TileSchedulerParams scheduler;  //!< launched with one CTA per tile
  };

  //! The epilogue writes dK and dV through the mainloop's K and V tiles.
  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
  };
  static constexpr int kSharedStorageBytes = sizeof(SharedStorage);
  static_assert(kSharedStorageBytes <= Traits::kSmemBudget, "tile configuration exceeds shared memory");
};

//! The TMA pipelines (Q and dO, each stage its tile and one fp32 statistic per row; the bias
//! tile): thread 0 loads `transaction_bytes` per stage, the MMA threads consume.
template <class Traits, class Pipeline>
CUTE_DEVICE typename Pipeline::Params tma_pipeline_params(bool is_producer, int transaction_bytes) {
  typename Pipeline::Params params;
  params.transaction_bytes = transaction_bytes;
  params.role = is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = Traits::kNumMmaThreads;
  return params;
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    backward_kernel(CUTE_GRID_CONSTANT typename BackwardKernel<Traits>::Params const params) {
  using Kernel = BackwardKernel<Traits>;
  using Mainloop = typename Kernel::Mainloop;
  using Epilogue = typename Kernel::Epilogue;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineDo = typename Traits::PipelineDo;
  using TileInfo = typename Mainloop::TileInfo;

  extern __shared__ char shared_memory[];
  auto& storage = reinterpret_cast<typename Kernel::SharedStorage*>(shared_memory)->mainloop;

  const int warp_group = cutlass::canonical_warp_group_idx();
  const bool is_producer = warp_group == 0;

  if (threadIdx.x == 0) {
    storage.kv_full.init(/*arrive_count=*/1);
    Mainloop::prefetch_descriptors(params.mainloop);
    Epilogue::prefetch_descriptors(params.epilogue);
  }
  constexpr int kRowTileBytes = Traits::kQStageBytes + Traits::kRowStatBytes;
  PipelineQ pipeline_q(storage.pipeline_q,
                       tma_pipeline_params<Traits, PipelineQ>(is_producer, kRowTileBytes),
                       Shape<_1, _1, _1>{});
  PipelineDo pipeline_do(storage.pipeline_do,
                         tma_pipeline_params<Traits, PipelineDo>(is_producer, kRowTileBytes),
                         Shape<_1, _1, _1>{});
  using PipelineBias = typename Mainloop::PipelineBias;
  PipelineBias pipeline_bias(
      storage.pipeline_bias,
      tma_pipeline_params<Traits, PipelineBias>(is_producer, Traits::kBiasTileBytes),
      Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread

  const TileInfo info(params.problem, StaticPersistentScheduler(params.scheduler).coord());
  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = warp_index_in_warp_group();
    if (warp == 0) {
      if (threadIdx.x == 0 && !info.empty()) {  // the pipelines' leader issues every load
        auto write_q = cutlass::make_producer_start_state<PipelineQ>();
        auto write_do = cutlass::make_producer_start_state<PipelineDo>();
        auto write_bias = cutlass::make_producer_start_state<PipelineBias>();
        Mainloop::load(params.mainloop, params.problem, storage, pipeline_q, pipeline_do,
                       pipeline_bias, write_q, write_do, write_bias, info);
        pipeline_q.producer_tail(write_q);
        pipeline_do.producer_tail(write_do);
        if (params.mainloop.bias_in_tiles) pipeline_bias.producer_tail(write_bias);
      }
    } else if (warp == 1 && !info.empty()) {
      Mainloop::free_dq_staging();
      Mainloop::reduce_dq(params.mainloop, params.problem, storage, info);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
    const int thread_idx = threadIdx.x - kThreadsPerWarpGroup;
    typename Traits::TiledMmaDkv mma_dkv;
    using ShapeDkv = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
    Tensor tdKrdK = partition_fragment_C(mma_dkv, ShapeDkv{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, ShapeDkv{});
    clear(tdKrdK);
    clear(tdVrdV);
    if (!info.empty()) {
      typename Mainloop::StateQ read_q;
      typename Mainloop::StateDo read_do;
      typename Mainloop::StateBias read_bias;
      Mainloop::mma(params.mainloop, params.problem, storage, pipeline_q, pipeline_do,
                    pipeline_bias, read_q, read_do, read_bias, info, warp_group - 1, thread_idx,
                    tdKrdK, tdVrdV);
    }
    Epilogue::store(params.epilogue, storage.k.data(), storage.v.data(), info, thread_idx, tdKrdK,
                    tdVrdV);
  }
}

}  // namespace jax_flash::sm90
