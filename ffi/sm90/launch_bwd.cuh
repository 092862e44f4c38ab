/*! \file launch_bwd.cuh
    \brief Definition of RunBackwardTile: carves the workspace and launches the backward
           kernels (row terms with the clearing of the dQ accumulator, main, dQ convert and,
           for a bias gradient, its convert) with the collectives' arguments for one compiled
           tile. Included only by the generated instantiation units.
*/
#pragma once

#include <algorithm>

#include <cute/tensor.hpp>

#include "kernel_bwd.h"
#include "kernel_bwd_postprocess.h"
#include "kernel_bwd_preprocess.h"
#include "kernel_traits_bwd.h"
#include "launch.h"
#include "launch_common.cuh"

namespace jax_flash::sm90 {

//! log2 of the threads that share one row in the row-term kernel: enough for two 8-element
//! vectors each (a power of two, at most a warp), so that every thread has two loads of O and
//! two of dO in flight.
inline int preprocess_lanes_log2(int64_t head_dim) {
  const int64_t vectors = (head_dim + 15) / 16;
  int log2 = 0;
  while ((int64_t(1) << log2) < vectors && log2 < 5) ++log2;
  return log2;
}

//! Checks a wanted bias gradient in a deterministic backward: no axis it sums over (additions
//! from several CTAs into one element would land in any order).
inline Status check_bias_gradient(const BackwardParams& p) {
  if (!p.dbias.present() || !p.deterministic) return Status::Ok();
  const AttentionShape& s = p.fwd.shape;
  bool sums = (p.dbias.extent[0] == 1 && s.num_heads > 1) ||
              (p.dbias.extent[1] == 1 && s.seqlen_q > 1) ||
              (p.dbias.extent[2] == 1 && s.seqlen_k > 1);
  for (int i = 0; i < s.batch.rank; ++i) {
    sums = sums || (p.dbias.batch.stride[i] == 0 && s.batch.extent[i] > 1);
  }
  if (sums) {
    return Status::InvalidArgument(
        "jax_flash: the deterministic Hopper backward computes the gradient of a bias that "
        "broadcasts over no axis only (jax_flash routes the others to its blockwise path)");
  }
  return Status::Ok();
}

template <class Traits>
Status launch_backward(const BackwardParams& p, const BackwardWorkspaceLayout& layout,
                       void* workspace, const LaunchContext& context) {
  using Element = typename Traits::Element;
  using Kernel = BackwardKernel<Traits>;
  using Postprocess = BackwardPostprocess<Traits>;
  const ForwardParams& f = p.fwd;
  const AttentionShape& s = f.shape;
  const int64_t batch_count = s.batch.count();
  const int64_t num_m_blocks = (s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_n_blocks = (s.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  if (batch_count * s.num_heads * num_m_blocks == 0) return Status::Ok();
  if (batch_count * s.num_heads * num_m_blocks > INT32_MAX) {
    return Status::InvalidArgument("jax_flash: too many query blocks x heads x batch (" +
                                   std::to_string(batch_count * s.num_heads * num_m_blocks) +
                                   ") for the Hopper backward kernels");
  }

  typename Kernel::Params kp;
  Status status = check_mask_operands(f, Traits::kBlockM, Traits::kBlockN,
                                      /*rows_are_keys=*/true);
  if (status.ok()) status = check_bias_operands(f, Traits::kBlockM, Traits::kBlockN);
  if (status.ok()) status = check_bias_gradient(p);
  if (!status.ok()) return status;
  kp.problem = make_problem(f);
  typename Kernel::Mainloop::Arguments mainloop;
  BackwardPreprocessParams<Element> pre;
  SegmentIds& segments = kp.problem.segments;
  MaskArray& mask = kp.problem.mask;
  coalesce_batch(s.batch,
                 {&f.q.batch, &f.k.batch, &f.v.batch, &p.dout.batch, &f.out.batch, &f.lse.batch,
                  &p.dlse.batch, &f.q_seqlens.batch, &f.kv_seqlens.batch,
                  &f.q_segment_ids.batch, &f.kv_segment_ids.batch, &f.q_span.batch,
                  &f.mask_bits.batch, &block_classes(f).batch, &f.bias.batch, &p.dbias.batch},
                 &kp.problem.batch,
                 {&mainloop.q_batch, &mainloop.k_batch, &mainloop.v_batch, &mainloop.dout_batch,
                  &pre.out_batch, &pre.lse_batch, &pre.dlse_batch, &kp.problem.q_seqlens_batch,
                  &kp.problem.kv_seqlens_batch, &segments.q_ids.batch, &segments.kv_ids.batch,
                  &segments.q_span.batch, &mask.batch, &mask.blocks_batch,
                  &kp.problem.bias.batch, &mainloop.dbias.batch});
  segments.backward_skips_blocks = !p.deterministic;
  mask.skip_empty_blocks = !p.deterministic;
  pre.dout_batch = mainloop.dout_batch;

  char* base = static_cast<char*>(workspace);
  float* dq_accum = reinterpret_cast<float*>(base + layout.dq_accum);
  float* lse_log2 = reinterpret_cast<float*>(base + layout.lse_log2);
  float* row_term = reinterpret_cast<float*>(base + layout.row_term);
  int* dq_semaphore = layout.dq_semaphore < 0 ? nullptr
                                              : reinterpret_cast<int*>(base + layout.dq_semaphore);
  const int64_t dbias_count = bias_gradient_elements(p);
  if (dbias_count > 0) {
    // Blocks the kernel skips hold no gradient: the accumulator, or the result stored into
    // directly, starts at zero.
    BiasGradient& dbias = mainloop.dbias;
    dbias.direct = !bias_gradient_accumulates(s, dbias_count);
    if (!dbias.direct && layout.dbias_accum < 0) {
      return Status::Internal("jax_flash: the backward workspace has no bias gradient accumulator");
    }
    point_at(dbias, dbias.direct ? p.dbias.data : static_cast<void*>(base + layout.dbias_accum),
             p.dbias);
    const cudaError_t err = cudaMemsetAsync(
        dbias.data, 0, dbias_count * (dbias.direct ? sizeof(Element) : sizeof(float)),
        context.stream);
    if (err != cudaSuccess) {
      return Status::Internal(std::string("jax_flash: clearing the bias gradient failed: ") +
                              cudaGetErrorString(err));
    }
  }

  // Row terms and base-2 log-sum-exp; clears the dQ accumulator and counters.
  pre.out = static_cast<const Element*>(f.out.data);
  pre.dout = static_cast<const Element*>(p.dout.data);
  pre.lse = static_cast<const float*>(f.lse.data);
  pre.dlse = static_cast<const float*>(p.dlse.data);
  pre.out_item_stride = f.out.batch_stride;
  pre.dout_item_stride = p.dout.batch_stride;
  pre.lse_item_stride = f.lse.batch_stride;
  pre.dlse_item_stride = p.dlse.batch_stride;
  pre.batch = kp.problem.batch;
  pre.seqlen_q = int32_t(s.seqlen_q);
  pre.num_heads = int32_t(s.num_heads);
  pre.head_dim = int32_t(s.head_dim);
  pre.padded_rows = int32_t(num_m_blocks * Traits::kBlockM);
  pre.lanes_per_row_log2 = preprocess_lanes_log2(s.head_dim);
  pre.lse_log2 = lse_log2;
  pre.row_term = row_term;
  pre.dq_accum = dq_accum;
  pre.dq_row_floats = Traits::kHeadDim;
  pre.dq_semaphore = dq_semaphore;
  pre.block_m = Traits::kBlockM;
  const int64_t rows_per_cta = kPreprocessThreads >> pre.lanes_per_row_log2;
  const int64_t preprocess_ctas =
      batch_count * s.num_heads * ((pre.padded_rows + rows_per_cta - 1) / rows_per_cta);
  if (preprocess_ctas > INT32_MAX) {
    return Status::InvalidArgument("jax_flash: too many query rows x heads x batch for the "
                                   "Hopper backward kernels");
  }
  status = launch_kernel(backward_preprocess_kernel<Element>, int(preprocess_ctas),
                                kPreprocessThreads, 0, pre, context, "backward preprocess");
  if (!status.ok()) return status;

  // The main kernel: one CTA per (key block, key/value head, batch).
  mainloop.q = sequence_tensor<Element>(f.q, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  mainloop.k = sequence_tensor<Element>(f.k, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  mainloop.v = sequence_tensor<Element>(f.v, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  mainloop.dout = sequence_tensor<Element>(p.dout, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  mainloop.lse_log2 = lse_log2;
  mainloop.row_term = row_term;
  mainloop.dq_accum = dq_accum;
  mainloop.dq_semaphore = dq_semaphore;
  mainloop.num_m_blocks = int32_t(num_m_blocks);
  mainloop.scale_log2 = kernel_scale(f) * kLog2e;
  mainloop.softcap = kernel_softcap(f);
  mainloop.bias_units = bias_units<Traits>(f);
  mainloop.bias_in_tiles = Traits::kBias && moves_in_tiles<Element>(f.bias);
  if (mainloop.bias_in_tiles) mainloop.bias = logit_tensor<Element>(f.bias, s.batch);
  // A gradient stored directly leaves through the bias's tile, once the step has read it.
  mainloop.dbias_in_tiles =
      mainloop.bias_in_tiles && mainloop.dbias.direct && moves_in_tiles<Element>(p.dbias);
  if (mainloop.dbias_in_tiles) mainloop.dbias_tensor = logit_tensor<Element>(p.dbias, s.batch);
  // A window bounded on one side only makes the key blocks at the other end see more queries:
  // causal (bounded on the right) gives the first key blocks the most work, which the natural
  // order already runs first. Every key block of a head reads all its queries' Q and dO and
  // adds into all their dQ sums: a wave runs whole heads, so that each (query block, head)
  // is read from memory and its sums cross L2 about once rather than once per key block. The
  // grid has a CTA per tile, which the hardware hands to SMs as they free up: that balances
  // uneven blocks (causal, a mask's or a bias's classes) within a section by itself, so the
  // sections stay at a wave of heads there too (longer ones, as the forward's persistent grid
  // needs, cost the causal head dim 256 backward a fifth of its time at T = 4096).
  const bool reverse = f.options.window_left >= 0 && f.options.window_right < 0;
  const int64_t shared_bytes_per_head =
      (2 * s.seqlen_q * s.head_dim * int64_t(sizeof(Element)) +
       num_m_blocks * int64_t(Traits::kDqBlockFloats * sizeof(float))) * s.group_size();
  ScheduleRequest schedule;
  schedule.num_blocks = num_n_blocks;
  schedule.num_heads = s.num_kv_heads;
  schedule.num_heads_total = s.num_kv_heads * batch_count;
  schedule.bytes_per_head = shared_bytes_per_head;
  schedule.sections = HeadSections::kWaveOfHeads;
  schedule.reverse_blocks = reverse;
  schedule.items_adjacent = items_share_bias(f);
  int grid = 0;
  status = make_schedule(schedule, context, "backward", &kp.scheduler, &grid);
  if (!status.ok()) return status;
  mainloop.reverse_key_blocks = kp.scheduler.reverse_blocks;
  kp.mainloop = Kernel::Mainloop::to_params(mainloop);
  typename Kernel::Epilogue::Arguments epilogue;
  epilogue.dk = sequence_tensor<Element>(p.dk, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  epilogue.dv = sequence_tensor<Element>(p.dv, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  epilogue.scale = kernel_scale(f);
  kp.epilogue = Kernel::Epilogue::to_params(epilogue);
  if (kp.scheduler.num_tiles > 0) {
    status = launch_kernel(backward_kernel<Traits>, grid, Traits::kNumThreads,
                           Kernel::kSharedStorageBytes, kp, context, "backward");
    if (!status.ok()) return status;
  }

  // dQ: scale, round, store.
  typename Postprocess::Arguments post;
  post.dq_accum = dq_accum;
  post.dq = sequence_tensor<Element>(p.dq, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  post.num_m_blocks = int32_t(num_m_blocks);
  post.num_heads = int32_t(s.num_heads);
  post.scale = kernel_scale(f);
  status = launch_kernel(backward_postprocess_kernel<Traits>,
                         int(batch_count * s.num_heads * num_m_blocks), Postprocess::kNumThreads,
                         Postprocess::kSharedStorageBytes, Postprocess::to_params(post), context,
                         "backward dQ convert");
  if (!status.ok() || dbias_count == 0 || mainloop.dbias.direct) return status;

  // dbias: round the accumulator into the result (a few waves of CTAs stride over it).
  const BiasGradientConvertParams<Element> convert{
      static_cast<const float*>(mainloop.dbias.data), static_cast<Element*>(p.dbias.data),
      dbias_count};
  const int64_t convert_ctas = std::min<int64_t>(
      (dbias_count + kBiasGradientConvertThreads - 1) / kBiasGradientConvertThreads,
      8 * int64_t(context.sm_count));
  return launch_kernel(bias_gradient_convert_kernel<Element>, int(convert_ctas),
                       kBiasGradientConvertThreads, 0, convert, context, "bias gradient convert");
}

template <ElementType kDtype, int kTileHeadDim>
Status RunBackwardTile(const BackwardParams& params, const BackwardWorkspaceLayout& layout,
                       void* workspace, const LaunchContext& context) {
  using Element = typename CutlassElement<kDtype>::type;
  return with_features<kBackwardFeatures>(
      params.fwd, [&](auto softcap, auto segments, auto mask, auto bias) {
        return launch_backward<BackwardKernelTraits<Element, kTileHeadDim, decltype(softcap)::value,
                                                    decltype(segments)::value,
                                                    decltype(mask)::value, decltype(bias)::value>>(
            params, layout, workspace, context);
      });
}

}  // namespace jax_flash::sm90
