/*! \file launch_common.cuh
    \brief Host-side pieces the attention launches share: the device's view of the batch axes,
           global tensors of BTNH operands read in place, the checks of the logit arrays'
           operands, the dispatch on compiled features; with the schedule request
           (tile_schedule.h) and the kernel launch (launch_kernel.cuh). Included only by
           launch_{fwd,bwd}.cuh.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cute/tensor.hpp>

#include "kernel_traits.h"
#include "launch.h"
#include "launch_kernel.cuh"
#include "seqlen.h"
#include "softcap.h"
#include "tile_schedule.h"

namespace jax_flash::sm90 {

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

//! The block classes the kernels read: the mask's (with a bias too), else the bias's (absent
//! without either).
inline const Operand& block_classes(const ForwardParams& p) {
  return p.mask_bits.present() ? p.mask_blocks : p.bias_blocks;
}

//! Points `array` at `data`, addressed with the strides of `layout`, a (heads, rows, columns)
//! logit operand; its batch map is coalesce_batch's to fill.
template <class Value>
void point_at(LogitArray<Value>& array, Value* data, const Operand& layout) {
  array.data = data;
  array.item_stride = layout.batch_stride;
  array.head_stride = layout.stride[0];
  array.row_stride = layout.stride[1];
  array.col_stride = layout.stride[2];
}

//! The problem's sizes, visibility rule, segment ids, mask and bias arrays; the batch axes (of
//! the problem and of each per-item array) are filled by coalesce_batch.
inline AttentionProblem make_problem(const ForwardParams& p) {
  const AttentionShape& s = p.shape;
  AttentionProblem problem;
  problem.seqlen_q = int32_t(s.seqlen_q);
  problem.seqlen_k = int32_t(s.seqlen_k);
  problem.num_heads = int32_t(s.num_heads);
  problem.group_size = int32_t(s.group_size());
  problem.window_left = int32_t(p.options.window_left);
  problem.window_right = int32_t(p.options.window_right);
  problem.q_seqlens = static_cast<const int32_t*>(p.q_seqlens.data);
  problem.kv_seqlens = static_cast<const int32_t*>(p.kv_seqlens.data);
  auto rows = [](const Operand& op) {
    ItemRows rows;
    rows.data = static_cast<const int32_t*>(op.data);
    rows.item_stride = op.batch_stride;
    return rows;
  };
  problem.segments.q_ids = rows(p.q_segment_ids);
  problem.segments.kv_ids = rows(p.kv_segment_ids);
  problem.segments.kv_span = rows(p.kv_span);
  problem.segments.q_span = rows(p.q_span);
  MaskArray& mask = problem.mask;
  if (p.mask_bits.present()) {
    mask.bits = static_cast<const uint32_t*>(p.mask_bits.data);
    mask.item_stride = p.mask_bits.batch_stride;
    mask.head_stride = p.mask_bits.stride[0];
    mask.row_stride = int32_t(p.mask_bits.stride[1]);
    mask.words_per_row = int32_t(p.mask_bits.extent[2]);
  }
  const Operand& classes = block_classes(p);
  if (classes.present()) {
    mask.blocks = static_cast<const MaskBlock*>(classes.data);
    mask.blocks_item_stride = classes.batch_stride;
    mask.blocks_head_stride = int32_t(classes.stride[0]);
    mask.blocks_m_stride = int32_t(classes.stride[1]);
    mask.blocks_n_stride = int32_t(classes.stride[2]);
  }
  if (p.bias.present()) {
    BiasArray& bias = problem.bias;
    point_at(bias, static_cast<const void*>(p.bias.data), p.bias);
    bias.paired = bias.col_stride == 1 && bias.item_stride % 2 == 0 &&
                  bias.head_stride % 2 == 0 && bias.row_stride % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(bias.data) % 4 == 0;
  }
  return problem;
}

//! Checks an operand that travels with a logit array `of` (named `of_name`): dtype, extents
//! `want` and the batch axes broadcast exactly where the array's are.
inline Status check_companion(const ForwardParams& p, const char* name, const Operand& op,
                              ElementType dtype, const int64_t (&want)[3], const char* what,
                              const Operand& of, const char* of_name) {
  bool ok = op.present() && op.dtype == dtype;
  for (int i = 0; i < 3; ++i) ok = ok && op.extent[i] == want[i];
  for (int i = 0; i < p.shape.batch.rank; ++i) {
    ok = ok && (op.batch.stride[i] == 0) == (of.batch.stride[i] == 0);
  }
  if (ok) return Status::Ok();
  return Status::InvalidArgument(std::string("jax_flash: ") + name + " must be " + what +
                                 ", shaped (batch..., " + std::to_string(want[0]) + ", " +
                                 std::to_string(want[1]) + ", " + std::to_string(want[2]) +
                                 ") and broadcast like the " + of_name);
}

//! Checks the block classes of a logit array (mask or bias) for a (block_m, block_n) tile: one
//! per block of each axis the array holds (one where it broadcasts the axis).
inline Status check_block_classes(const ForwardParams& p, const char* name, const Operand& classes,
                                  const Operand& of, const char* of_name, int block_m,
                                  int block_n) {
  const int64_t blocks[3] = {of.extent[0], (of.extent[1] + block_m - 1) / block_m,
                             (of.extent[2] + block_n - 1) / block_n};
  const std::string what = std::string("the int8 classes of the ") + of_name + "'s " +
                           std::to_string(block_m) + " x " + std::to_string(block_n) + " blocks";
  return check_companion(p, name, classes, ElementType::kInt8, blocks, what.c_str(), of, of_name);
}

//! Checks a mask's operands for a pass whose rows are queries (or keys, with rows_are_keys) on
//! a (block_m, block_n) tile: the bits, one row per query (key) or one where the mask
//! broadcasts them and a bit per key (query); the block classes, one per block of each axis
//! the mask holds (with a bias too, the only classes the kernels read). The kernels take no
//! mask array: the mask these describe holds heads and the rows' axis as the bits do, the
//! columns' axis as the classes do (one block: broadcast).
inline Status check_mask_operands(const ForwardParams& p, int block_m, int block_n,
                                  bool rows_are_keys) {
  if (!p.mask_bits.present()) return Status::Ok();
  const AttentionShape& s = p.shape;
  const Operand& bits = p.mask_bits;
  const Operand& blocks = p.mask_blocks;
  const int64_t rows = rows_are_keys ? s.seqlen_k : s.seqlen_q;
  const int64_t cols = rows_are_keys ? s.seqlen_q : s.seqlen_k;
  if (!blocks.present() || (bits.extent[1] != 1 && bits.extent[1] != rows)) {
    return Status::InvalidArgument(
        std::string("jax_flash: mask_bits must come with mask_blocks and hold one row per ") +
        (rows_are_keys ? "key" : "query") + " (" + std::to_string(rows) +
        ", or one where the mask broadcasts them)");
  }
  Operand mask = bits;
  const int64_t cols_held = (rows_are_keys ? blocks.extent[1] : blocks.extent[2]) == 1 ? 1 : cols;
  mask.extent[1] = rows_are_keys ? cols_held : bits.extent[1];
  mask.extent[2] = rows_are_keys ? bits.extent[1] : cols_held;
  Status status = check_block_classes(p, "mask_blocks", blocks, mask, "mask", block_m, block_n);
  if (!status.ok()) return status;
  const int64_t want[3] = {mask.extent[0], bits.extent[1], (cols + 31) / 32};
  return check_companion(p, "mask_bits", bits, ElementType::kUInt32, want,
                         rows_are_keys ? "the mask's key rows (the mask transposed) as uint32 bits"
                                       : "the mask's query rows as uint32 bits",
                         mask, "mask");
}

//! Checks what the kernels require of a bias array: the inputs' dtype (they read it as such)
//! and its block classes for the (block_m, block_n) tile; with a mask, the kernels read the
//! mask's classes alone and the bias has none.
inline Status check_bias_operands(const ForwardParams& p, int block_m, int block_n) {
  if (!p.bias.present()) return Status::Ok();
  if (p.mask_bits.present() && p.bias_blocks.present()) {
    return Status::InvalidArgument("jax_flash: with a mask, the bias takes no bias_blocks (the "
                                   "kernels read the mask_blocks alone)");
  }
  Status status = p.mask_bits.present()
                      ? Status::Ok()
                      : check_block_classes(p, "bias_blocks", p.bias_blocks, p.bias, "bias",
                                            block_m, block_n);
  if (!status.ok()) return status;
  if (p.bias.dtype != p.shape.dtype) {
    return Status::InvalidArgument("jax_flash: the Hopper kernels read a bias of the inputs' "
                                   "dtype only (jax_flash routes others to its blockwise path)");
  }
  return Status::Ok();
}

//! Global tensor (sequence, head dim, heads, batch items) of a (T, N, H) operand read in place
//! with its own strides (a query row's packed heads among them); its batch items are those the
//! operand holds (broadcast axes excluded).
template <class Element>
auto sequence_tensor(const Operand& op, int64_t seqlen, int64_t heads, int64_t head_dim,
                     const BatchShape& batch) {
  using Seq = SequenceTensor<Element>;
  auto shape = typename Seq::Shape(int32_t(seqlen), int32_t(head_dim), int32_t(heads),
                                   int32_t(own_batch_items(batch, op.batch)));
  // An axis of extent 1 has stride 0 in an Operand; a TMA descriptor wants a nonzero stride
  // there, which never steps.
  auto axis_stride = [&](int axis) {
    return op.stride[axis] != 0 ? op.stride[axis] : op.batch_stride;
  };
  auto stride = typename Seq::Stride(axis_stride(0), _1{}, axis_stride(1), op.batch_stride);
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(op.data)), shape, stride);
}

//! Under packed query heads of several query rows (ForwardParams::query_groups = G > 1), the
//! stride between query rows t of q or out: one row of all K packed heads, each `op`'s head
//! stride (G of the call's heads) apart.
inline int64_t packed_query_row_stride(const Operand& op, const AttentionShape& s) {
  return s.num_heads * op.stride[1];
}

//! The strides of rows t*G + g of q or out (ForwardParams::query_groups = G): over the query
//! rows t and over the G heads g of a group (G = 1: plain rows, no group stride).
struct PackedRowStrides {
  int64_t query_row;
  int64_t group_row;
};
inline PackedRowStrides packed_row_strides(const Operand& op, const AttentionShape& s,
                                           int64_t groups) {
  if (groups > 1) return {packed_query_row_stride(op, s), op.stride[0]};
  return {op.stride[0], 0};
}

//! The shift of G = 2^shift packed query heads per group (ForwardParams::query_groups; 0 for
//! G = 1), into `shift`; other G are refused.
inline Status query_group_shift(int64_t groups, int32_t* shift) {
  if (groups > 1 && (groups & (groups - 1)) != 0) {
    return Status::InvalidArgument("jax_flash: packed query heads of several query rows need "
                                   "a power of two of heads per group, got " +
                                   std::to_string(groups));
  }
  *shift = 0;
  while ((int64_t(1) << *shift) < groups) ++*shift;
  return Status::Ok();
}

//! A TMA descriptor of q or out under packed query heads of several query rows
//! (ForwardParams::query_groups = G): the call's (T, K*G, H) as (H, G, T, K, own items), boxes
//! of 64 columns (the 128-byte swizzle's width, a column block of the tiles' shared layouts) by
//! `box_rows` kernel rows, box_rows / G query rows of all G heads: rows t*G + g in order. The
//! rows past T read as zeros and are not stored.
template <class Element>
Status make_query_groups_tma(const Operand& op, const AttentionShape& s, int64_t groups,
                             int64_t box_rows, cute::TmaDescriptor* desc) {
  static_assert(sizeof(Element) == 2, "16-bit elements: a 64-column box is 128 bytes");
  if (groups < 2 || box_rows % groups != 0 || box_rows / groups > 256) {
    return Status::InvalidArgument("jax_flash: packed query heads need query_groups (" +
                                   std::to_string(groups) + ") to divide the tile's rows (" +
                                   std::to_string(box_rows) + ")");
  }
  constexpr int64_t kBytes = sizeof(Element);
  const int64_t head_stride = op.stride[1];             // G of the call's heads; G > 1: nonzero
  const int64_t row_stride = packed_query_row_stride(op, s);
  const int64_t query_rows = s.seqlen_q / groups;
  const int64_t items = own_batch_items(s.batch, op.batch);
  const int64_t item_stride = op.batch_stride != 0 ? op.batch_stride : query_rows * row_stride;
  cuuint64_t dims[5] = {cuuint64_t(s.head_dim), cuuint64_t(groups), cuuint64_t(query_rows),
                        cuuint64_t(s.num_heads), cuuint64_t(items)};
  cuuint64_t strides[4] = {cuuint64_t(op.stride[0] * kBytes), cuuint64_t(row_stride * kBytes),
                           cuuint64_t(head_stride * kBytes), cuuint64_t(item_stride * kBytes)};
  cuuint32_t box[5] = {64, cuuint32_t(groups), cuuint32_t(box_rows / groups), 1, 1};
  cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<Element, cutlass::bfloat16_t>
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      desc, type, 5, op.data, dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return Status::Internal("jax_flash: cuTensorMapEncodeTiled failed (" +
                            std::to_string(int(result)) + ") for packed query heads");
  }
  return Status::Ok();
}

//! Whether TMA can move a logit array (a bias, its gradient) in (keys, queries) tiles: it
//! keeps both axes (a bias broadcast along one is read from global memory, where its few lines
//! stay in L1), its keys are contiguous, and its address and strides are 16-byte aligned.
template <class Element>
bool moves_in_tiles(const Operand& a) {
  constexpr int64_t kAligned = 16 / int64_t(sizeof(Element));
  return a.present() && a.extent[1] > 1 && a.extent[2] > 1 && a.stride[2] == 1 &&
         a.stride[0] % kAligned == 0 && a.stride[1] % kAligned == 0 &&
         a.batch_stride % kAligned == 0 && reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
}

//! A logit array as its TMA tiles see it (LogitTensor). An axis it broadcasts has extent 1 and
//! a stand-in stride, which never steps: a TMA descriptor wants a nonzero one.
template <class Element>
auto logit_tensor(const Operand& a, const BatchShape& batch) {
  using Logit = LogitTensor<Element>;
  const int64_t head_stride = a.stride[0] != 0 ? a.stride[0] : a.extent[1] * a.stride[1];
  const int64_t item_stride = a.batch_stride != 0 ? a.batch_stride : a.extent[0] * head_stride;
  auto shape = typename Logit::Shape(int32_t(a.extent[2]), int32_t(a.extent[1]),
                                     int32_t(a.extent[0]),
                                     int32_t(own_batch_items(batch, a.batch)));
  auto stride = typename Logit::Stride(_1{}, a.stride[1], head_stride, item_stride);
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(a.data)), shape, stride);
}

//! The scale as the kernels use it: positive scale is guaranteed by the Python layer; a zero
//! scale is taken as the smallest normal float, which gives the same (uniform) probabilities
//! without a -inf * 0.
inline float kernel_scale(const ForwardParams& p) {
  return std::max(static_cast<float>(p.options.scale), 1.17549435e-38f);
}

//! The soft-cap constants of the mainloops (softcap.h); unused when the cap is off.
inline LogitSoftcap kernel_softcap(const ForwardParams& p) {
  return p.options.softcap > 0 ? LogitSoftcap::make(kernel_scale(p), float(p.options.softcap))
                               : LogitSoftcap{};
}

//! The factor taking a bias to the units of the logits the mainloops add it to: raw products
//! q.k (the scale is applied in the exponent) or, soft-capped, capped logits in log2 units.
template <class Traits>
float bias_units(const ForwardParams& p) {
  return Traits::kSoftcap ? kLog2e : 1.f / kernel_scale(p);
}

//! Whether batch items share the bias (it broadcasts a batch axis): their tiles then run side
//! by side (make_schedule's items_adjacent).
inline bool items_share_bias(const ForwardParams& p) {
  return p.bias.present() && own_batch_items(p.shape.batch, p.bias.batch) < p.shape.batch.count();
}

//! Calls launch(softcap, segments, mask, bias) with the compile-time features the call uses,
//! each an std::bool_constant. A kernel is instantiated for no feature, for each feature in
//! kFeatures alone (a pass's, from kernel_configs.json through sm90_tiles.h) and for each
//! combination it lists. A call the instantiations do not cover is an error (dispatch routes
//! none here).
template <const KernelFeatures& kFeatures, class Launch>
Status with_features(const ForwardParams& p, Launch&& launch) {
  const unsigned used = features_of(p);
  if (!kFeatures.compiles(used)) {
    return Status::InvalidArgument("jax_flash: this Hopper tile is not compiled for the call's "
                                   "combination of soft-capping, segment ids and mask or bias "
                                   "arrays");
  }
  Status status = Status::Ok();
  cute::for_each(cute::make_int_sequence<kFeatureSets>{}, [&](auto set) {
    constexpr unsigned kSet = decltype(set)::value;
    if constexpr (kFeatures.compiles(kSet)) {
      if (used == kSet) {
        status = launch(std::bool_constant<(kSet & kSoftcapBit) != 0>{},
                        std::bool_constant<(kSet & kSegmentIdsBit) != 0>{},
                        std::bool_constant<(kSet & kMaskBit) != 0>{},
                        std::bool_constant<(kSet & kBiasBit) != 0>{});
      }
    }
  });
  return status;
}

}  // namespace jax_flash::sm90
