/*! \file launch_fwd.cuh
    \brief Definition of RunForwardTile: builds the TMA descriptors and kernel parameters for
           one compiled tile, sizes the persistent grid and launches. Included only by the
           generated instantiation units.
*/
#pragma once

#include <algorithm>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernel_fwd.h"
#include "kernel_traits.h"
#include "launch.h"

namespace jax_flash::sm90 {

template <ElementType kDtype>
struct CutlassElement;
template <>
struct CutlassElement<ElementType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<ElementType::kFloat16> {
  using type = cutlass::half_t;
};

//! Number of distinct batch items an operand holds (it may broadcast some batch axes).
inline int64_t own_batch_items(const BatchShape& shape, const BatchMap& map) {
  int64_t items = 1;
  for (int i = 0; i < shape.rank; ++i) {
    if (map.stride[i] != 0) items = std::max(items, map.stride[i] * shape.extent[i]);
  }
  return items;
}

//! Coalesces the problem's batch axes for the device: drops extent-1 axes and merges adjacent
//! axes that every operand either broadcasts or holds contiguously. The flat batch index is
//! unchanged (row-major over the remaining axes), so results land where the host expects.
template <size_t kOperands>
void coalesce_batch(const BatchShape& shape, const BatchMap* const (&maps)[kOperands],
                    DeviceBatch* device, DeviceBatchMap* const (&device_maps)[kOperands]) {
  struct Axis {
    int64_t extent;
    int64_t stride[kOperands];
  };
  Axis axes[kMaxBatchRank];
  int count = 0;
  for (int i = shape.rank - 1; i >= 0; --i) {  // innermost first
    if (shape.extent[i] == 1) continue;
    bool merge = count > 0;
    for (size_t op = 0; merge && op < kOperands; ++op) {
      const int64_t outer = maps[op]->stride[i], inner = axes[count - 1].stride[op];
      merge = (outer == 0 && inner == 0) ||
              (outer != 0 && inner != 0 && outer == inner * axes[count - 1].extent);
    }
    if (merge) {
      axes[count - 1].extent *= shape.extent[i];
    } else {
      axes[count].extent = shape.extent[i];
      for (size_t op = 0; op < kOperands; ++op) axes[count].stride[op] = maps[op]->stride[i];
      ++count;
    }
  }
  device->rank = count;
  for (int a = 0; a < count; ++a) {  // back to outermost first
    const Axis& axis = axes[count - 1 - a];
    device->extent[a] = int32_t(axis.extent);
    for (size_t op = 0; op < kOperands; ++op) device_maps[op]->stride[a] = int32_t(axis.stride[op]);
  }
}

//! Global tensor (sequence, head dim, heads, batch items) of a BTNH operand read in place.
template <class Traits>
auto sequence_tensor(const Operand& op, int64_t seqlen, int64_t heads, int64_t head_dim,
                     const BatchShape& batch) {
  using Element = typename Traits::Element;
  auto shape = typename Traits::ShapeSeq(int32_t(seqlen), int32_t(head_dim), int32_t(heads),
                                         int32_t(own_batch_items(batch, op.batch)));
  auto stride = typename Traits::StrideSeq(heads * head_dim, _1{}, head_dim, op.batch_stride);
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(op.data)), shape, stride);
}

template <class Traits>
Status launch_forward(const ForwardParams& p, const LaunchContext& context) {
  using Element = typename Traits::Element;
  const AttentionShape& s = p.shape;
  ForwardKernelParams<Traits> kp;

  ForwardProblem& problem = kp.problem;
  problem.seqlen_q = int32_t(s.seqlen_q);
  problem.seqlen_k = int32_t(s.seqlen_k);
  problem.num_heads = int32_t(s.num_heads);
  problem.group_size = int32_t(s.group_size());
  problem.window_left = int32_t(p.options.window_left);
  problem.window_right = int32_t(p.options.window_right);
  coalesce_batch(s.batch, {&p.q.batch, &p.k.batch, &p.v.batch, &p.q_seqlens.batch, &p.kv_seqlens.batch},
                 &problem.batch, {&problem.q_batch, &problem.k_batch, &problem.v_batch,
                                  &problem.q_seqlens_batch, &problem.kv_seqlens_batch});
  problem.q_seqlens = static_cast<const int32_t*>(p.q_seqlens.data);
  problem.kv_seqlens = static_cast<const int32_t*>(p.kv_seqlens.data);

  auto gQ = sequence_tensor<Traits>(p.q, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  auto gK = sequence_tensor<Traits>(p.k, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  auto gV = sequence_tensor<Traits>(p.v, s.seqlen_k, s.num_kv_heads, s.head_dim, s.batch);
  auto gO = sequence_tensor<Traits>(p.out, s.seqlen_q, s.num_heads, s.head_dim, s.batch);
  using TileShapeQK = typename Traits::TileShapeQK;
  kp.mainloop.tma_load_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, typename Traits::SmemLayoutQ{},
                                         select<0, 2>(TileShapeQK{}), _1{});
  kp.mainloop.tma_load_k = make_tma_copy(SM90_TMA_LOAD{}, gK, take<0, 2>(typename Traits::SmemLayoutKV{}),
                                         select<1, 2>(TileShapeQK{}), _1{});
  kp.mainloop.tma_load_v = make_tma_copy(SM90_TMA_LOAD{}, gV, take<0, 2>(typename Traits::SmemLayoutKV{}),
                                         select<1, 2>(TileShapeQK{}), _1{});
  kp.mainloop.shape_q = gQ.shape();
  kp.mainloop.shape_k = gK.shape();
  kp.mainloop.shape_v = gV.shape();
  // Positive scale is guaranteed by the Python layer; a zero scale is taken as the smallest
  // normal float, which gives the same (uniform) probabilities without a -inf * 0.
  const float scale = std::max(static_cast<float>(p.options.scale), 1.17549435e-38f);
  kp.mainloop.scale_log2 = scale * 1.44269504088896340736f;
  kp.epilogue.tma_store_o = make_tma_copy(SM90_TMA_STORE{}, gO, typename Traits::SmemLayoutO{},
                                          select<0, 2>(TileShapeQK{}), _1{});
  kp.epilogue.shape_o = gO.shape();
  kp.epilogue.lse = static_cast<float*>(p.lse.data);

  TileSchedulerParams& sched = kp.scheduler;
  const int64_t num_m_blocks = (s.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_heads_total = s.num_heads * s.batch.count();
  const int64_t num_tiles = num_heads_total * num_m_blocks;
  if (num_tiles == 0) return Status::Ok();
  if (num_tiles > INT32_MAX - 2 * int64_t(context.sm_count)) {
    return Status::InvalidArgument("jax_flash: too many query blocks x heads x batch (" +
                                   std::to_string(num_tiles) + ") for the Hopper forward kernel");
  }
  sched.num_m_blocks = int32_t(num_m_blocks);
  sched.num_heads = int32_t(s.num_heads);
  sched.num_heads_total = int32_t(num_heads_total);
  sched.num_tiles = int32_t(num_tiles);
  // A window (causal) makes later query blocks see more keys: schedule them first.
  sched.longest_first = p.options.window_left >= 0 || p.options.window_right >= 0;
  // Heads per section: as many as keep their K and V within half of L2 (the rest serves Q/O).
  const int64_t kv_bytes_per_head = 2 * s.seqlen_k * s.head_dim * int64_t(sizeof(Element));
  int64_t heads_per_section =
      (int64_t(context.l2_bytes) / 2) / std::max<int64_t>(kv_bytes_per_head, 1);
  if (sched.longest_first) {
    // Longest first balances the CTAs only over a section several rounds long: one shorter than
    // a round deals the long blocks to the same CTAs round after round. Sections may therefore
    // grow past L2 up to a quarter of the grid in heads: a round then still runs four or more
    // CTAs per head side by side, on blocks of about the same length, reading the same keys
    // together.
    heads_per_section = std::max<int64_t>(heads_per_section, context.sm_count / 4);
  }
  sched.heads_per_section = int32_t(std::clamp<int64_t>(heads_per_section, 1, num_heads_total));

  const int grid = std::min(sched.num_tiles, context.sm_count);
  const int smem_bytes = Traits::kSharedStorageBytes;
  auto kernel = forward_kernel<Traits>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) {
    kernel<<<grid, Traits::kNumThreads, smem_bytes, context.stream>>>(kp);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return Status::Internal(std::string("jax_flash: Hopper forward launch failed: ") +
                            cudaGetErrorString(err));
  }
  return Status::Ok();
}

template <ElementType kDtype, int kTileHeadDim>
Status RunForwardTile(const ForwardParams& params, const LaunchContext& context) {
  using Element = typename CutlassElement<kDtype>::type;
  return launch_forward<ForwardKernelTraits<Element, kTileHeadDim>>(params, context);
}

}  // namespace jax_flash::sm90
