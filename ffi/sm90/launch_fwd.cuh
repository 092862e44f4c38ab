/*! \file launch_fwd.cuh
    \brief Definition of RunForwardTile: builds the collectives' arguments for one compiled tile,
           sizes the persistent grid and launches. Included only by the generated instantiation
           units.
*/
#pragma once

#include <algorithm>

#include <cute/tensor.hpp>

#include "kernel_fwd.h"
#include "kernel_traits_fwd.h"
#include "launch.h"
#include "launch_common.cuh"

namespace jax_flash::sm90 {

template <class Traits>
Status launch_forward(const ForwardParams& p, const LaunchContext& context) {
  using Element = typename Traits::Element;
  using Kernel = ForwardKernel<Traits>;
  const AttentionShape& s = p.shape;
  const int64_t num_m_blocks = (s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_heads_total = s.num_heads * s.batch.count();
  if (num_m_blocks * num_heads_total == 0) return Status::Ok();
  typename Kernel::Params kp;

  Status status = check_mask_operands(p, Traits::kBlockM, Traits::kBlockN,
                                      /*rows_are_keys=*/false);
  if (status.ok()) {
    status = check_bias_operands(p, Traits::kBlockM, Traits::kBlockN);
  }
  if (!status.ok()) return status;
  kp.problem = make_problem(p);
  typename Kernel::Mainloop::Arguments mainloop;
  SegmentIds& segments = kp.problem.segments;
  MaskArray& mask = kp.problem.mask;
  coalesce_batch(s.batch,
                 {&p.q.batch, &p.k.batch, &p.v.batch, &p.q_seqlens.batch, &p.kv_seqlens.batch,
                  &p.q_segment_ids.batch, &p.kv_segment_ids.batch, &p.kv_span.batch,
                  &p.mask_bits.batch, &block_classes(p).batch, &p.bias.batch},
                 &kp.problem.batch,
                 {&mainloop.q_batch, &mainloop.k_batch, &mainloop.v_batch,
                  &kp.problem.q_seqlens_batch, &kp.problem.kv_seqlens_batch,
                  &segments.q_ids.batch, &segments.kv_ids.batch, &segments.kv_span.batch,
                  &mask.batch, &mask.blocks_batch, &kp.problem.bias.batch});
  mainloop.q = sequence_tensor<Element>(p.q, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  mainloop.k = sequence_tensor<Element>(p.k, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  mainloop.v = sequence_tensor<Element>(p.v, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  mainloop.scale_log2 = kernel_scale(p) * kLog2e;
  mainloop.softcap = kernel_softcap(p);
  mainloop.bias_units = bias_units<Traits>(p);
  mainloop.bias_in_tiles = Traits::kBiasInTiles && moves_in_tiles<Element>(p.bias);
  if (mainloop.bias_in_tiles) mainloop.bias = logit_tensor<Element>(p.bias, s.batch);
  kp.mainloop = Kernel::Mainloop::to_params(mainloop);

  typename Kernel::Epilogue::Arguments epilogue;
  // A split's parts in float32 (ForwardParams::out): rows t*G + g of packed query heads step by
  // out's strides of the G heads and of the query rows.
  const bool float_parts = p.out.dtype == ElementType::kFloat32;
  if (float_parts) {
    auto& parts = epilogue.parts;
    parts.data = static_cast<float*>(p.out.data);
    parts.item_stride = p.out.batch_stride;
    parts.head_stride = p.out.stride[1];
    const PackedRowStrides rows = packed_row_strides(p.out, s, p.query_groups);
    parts.query_row_stride = rows.query_row;
    parts.group_row_stride = rows.group_row;
    parts.head_dim = int32_t(s.head_dim);
  } else {
    epilogue.o = sequence_tensor<Element>(p.out, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  }
  epilogue.lse = static_cast<float*>(p.lse.data);
  if (p.query_groups > 1) {
    // Rows t*G + g have two strides: q and out move through descriptors of their own.
    const int64_t groups = p.query_groups;
    status = query_group_shift(groups, &kp.problem.query_group_shift);
    if (status.ok()) {
      status = make_query_groups_tma<Element>(p.q, s, groups, Traits::kBlockM,
                                              &kp.mainloop_groups.q);
    }
    if (status.ok() && !float_parts) {
      status = make_query_groups_tma<Element>(
          p.out, s, groups, size<0>(typename Traits::OutputTileShape{}), &kp.epilogue_groups.o);
    }
    if (!status.ok()) return status;
  }
  kp.epilogue = Kernel::Epilogue::to_params(epilogue);

  // A window (causal) makes later query blocks see more keys: schedule them first, over
  // sections long enough to balance. Every query block of a head reads all its K and V; with
  // segment ids (packed sequences) only those of its own segments, which the blocks of one
  // head share with their neighbours: a round then covers whole heads (so its blocks read
  // K and V together from L2), and the lengths of the blocks follow the segments, not their
  // position, so longest-first needs no long sections. A mask array's work per block is not
  // known here; the masks that make it uneven are mostly causal ones (Flax's), so they are
  // scheduled like a window, and so are a bias's (causal ones, where it drops blocks). Blocks
  // that are all alike (none of these) take a head per section.
  const bool windowed = p.options.window_left >= 0 || p.options.window_right >= 0 ||
                        block_classes(p).present();
  const bool packed = p.q_segment_ids.present();
  const int64_t kv_bytes_per_head = 2 * s.seqlen_k * s.head_dim * int64_t(sizeof(Element));
  int grid = 0;
  ScheduleRequest schedule;
  schedule.num_blocks = num_m_blocks;
  schedule.num_heads = s.num_heads;
  schedule.num_heads_total = num_heads_total;
  schedule.bytes_per_head = kv_bytes_per_head;
  schedule.sections = packed     ? HeadSections::kWaveOfHeads
                      : windowed ? HeadSections::kBalanced
                                 : HeadSections::kOneHead;
  schedule.reverse_blocks = windowed;
  schedule.items_adjacent = items_share_bias(p);
  schedule.persistent = true;
  status = make_schedule(schedule, context, "forward", &kp.scheduler, &grid);
  if (!status.ok()) return status;
  return launch_kernel(forward_kernel<Traits>, grid, Traits::kNumThreads,
                       Kernel::kSharedStorageBytes, kp, context, "forward");
}

//! The feature sets a forward tile is instantiated for: the tile Python picks for a call
//! (Kernel.tile_for, passed as block_m) is one that takes its features. Mask and bias arrays run
//! on each head dim's default tile and on the tiles that list them, for which Python classifies
//! the arrays' blocks (instantiations for the tiles that gain most, not for every one); segment
//! ids without them, on a tile that prefers them where there is one.
template <int kTileHeadDim, int kTileBlockM>
inline constexpr KernelFeatures kForwardTileFeatures =
    !is_default_forward_tile(kTileHeadDim, kTileBlockM)
        ? (forward_tile_takes_arrays(kTileHeadDim, kTileBlockM)
               ? kForwardFeatures
               : kForwardFeatures.without_arrays())
    : forward_tile_prefers_segment_ids(kTileHeadDim)
        ? kForwardFeatures.with_arrays_only(kSegmentIdsBit)
        : kForwardFeatures;

template <ElementType kDtype, int kTileHeadDim, int kTileBlockM>
Status RunForwardTile(const ForwardParams& params, const LaunchContext& context) {
  using Element = typename CutlassElement<kDtype>::type;
  return with_features<kForwardTileFeatures<kTileHeadDim, kTileBlockM>>(
      params, [&](auto softcap, auto segments, auto mask, auto bias) {
        return launch_forward<ForwardKernelTraits<Element, kTileHeadDim, kTileBlockM,
                                                  decltype(softcap)::value,
                                                  decltype(segments)::value,
                                                  decltype(mask)::value, decltype(bias)::value>>(
            params, context);
      });
}

}  // namespace jax_flash::sm90
