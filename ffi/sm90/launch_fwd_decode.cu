/*! \file launch_fwd_decode.cu
    \brief RunDecodeForward: checks that a call is one the decoding forward takes, builds its
           parameters and launches a CTA per (batch item, key/value head). One instantiation
           per dtype, head dim that kernel_configs.json lists for it and key buffer count (one
           for chunks of at most kDecodeShortChunkBlocks key blocks, two for longer ones).
*/
#include <string>
#include <type_traits>

#include "element_types.h"
#include "kernel_fwd_decode.h"
#include "launch_common.cuh"
#include "launch_kernel.cuh"
#include "sm90_decode.h"  // generated from jax_flash/kernel_configs.json

namespace jax_flash::sm90 {

static_assert(kDecodeRows == kForwardDecodeRows,
              "kernel_configs.json's forward.decode rows are the kernel's m16 tile");

namespace {

bool Aligned16Elements(int64_t stride, int64_t element_bytes) {
  return (stride * element_bytes) % 16 == 0;
}

//! What the kernel's 16-byte loads and stores need of an operand's strides (its head dim
//! contiguous).
bool TakesStrides(const Operand& op, int64_t element_bytes) {
  return op.stride[2] == 1 && Aligned16Elements(op.stride[0], element_bytes) &&
         Aligned16Elements(op.stride[1], element_bytes) &&
         Aligned16Elements(op.batch_stride, element_bytes);
}

Status CheckDecode(const ForwardParams& p, int head_dim) {
  const AttentionShape& s = p.shape;
  const auto refuse = [](const std::string& why) {
    return Status::InvalidArgument("jax_flash: the Hopper decoding forward " + why +
                                   " (kernel_configs.json, forward.decode)");
  };
  if (s.head_dim != head_dim) {
    return refuse("has no kernel for head dim " + std::to_string(s.head_dim));
  }
  if (p.out.dtype != ElementType::kFloat32) {
    return refuse("writes a split's float32 parts only");
  }
  if (s.seqlen_q > kDecodeRows) {
    return refuse("takes at most " + std::to_string(kDecodeRows) + " (packed) query rows, got " +
                  std::to_string(s.seqlen_q));
  }
  if (s.num_heads != s.num_kv_heads) {
    return refuse("takes query heads packed into rows (as many heads as key/value heads)");
  }
  if (p.options.softcap > 0 || p.options.window_left >= 0 || p.options.window_right >= 0 ||
      p.bias.present() || p.mask_bits.present() || p.q_segment_ids.present()) {
    return refuse("takes no soft-capping, window, mask or bias array or segment ids");
  }
  // Keys and items below 2^31: RunForward's checks. The key/value heads are the grid's y.
  if (s.num_kv_heads > 65535) {
    return refuse("takes at most 65535 key/value heads");
  }
  const int64_t element_bytes = 2;
  if (!TakesStrides(p.q, element_bytes) || !TakesStrides(p.k, element_bytes) ||
      !TakesStrides(p.v, element_bytes) || !TakesStrides(p.out, sizeof(float))) {
    return refuse("needs 16-byte aligned strides and a contiguous head dim");
  }
  return Status::Ok();
}

template <class Element, int kHeadDim>
Status LaunchDecode(const ForwardParams& p, const LaunchContext& context) {
  Status status = CheckDecode(p, kHeadDim);
  if (!status.ok()) return status;
  const AttentionShape& s = p.shape;
  const int64_t items = s.batch.count();
  if (items * s.num_kv_heads * s.seqlen_q == 0) return Status::Ok();

  DecodeForwardParams dp;
  dp.problem = make_problem(p);
  status = query_group_shift(p.query_groups, &dp.problem.query_group_shift);
  if (!status.ok()) return status;
  dp.q = p.q.data;
  dp.k = p.k.data;
  dp.v = p.v.data;
  dp.out = static_cast<float*>(p.out.data);
  dp.lse = static_cast<float*>(p.lse.data);
  coalesce_batch(s.batch,
                 {&p.q.batch, &p.k.batch, &p.v.batch, &p.out.batch, &p.lse.batch,
                  &p.q_seqlens.batch, &p.kv_seqlens.batch},
                 &dp.problem.batch,
                 {&dp.q_item.batch, &dp.k_item.batch, &dp.v_item.batch, &dp.out_item.batch,
                  &dp.lse_item.batch, &dp.problem.q_seqlens_batch,
                  &dp.problem.kv_seqlens_batch});
  dp.q_item.item_stride = p.q.batch_stride;
  dp.k_item.item_stride = p.k.batch_stride;
  dp.v_item.item_stride = p.v.batch_stride;
  dp.out_item.item_stride = p.out.batch_stride;
  dp.lse_item.item_stride = p.lse.batch_stride;
  const PackedRowStrides q_rows = packed_row_strides(p.q, s, p.query_groups);
  const PackedRowStrides out_rows = packed_row_strides(p.out, s, p.query_groups);
  dp.q_head_stride = p.q.stride[1];
  dp.q_row_stride = q_rows.query_row;
  dp.q_group_stride = q_rows.group_row;
  dp.out_head_stride = p.out.stride[1];
  dp.out_row_stride = out_rows.query_row;
  dp.out_group_stride = out_rows.group_row;
  dp.k_head_stride = p.k.stride[1];
  dp.k_key_stride = p.k.stride[0];
  dp.v_head_stride = p.v.stride[1];
  dp.v_key_stride = p.v.stride[0];
  dp.scale_log2 = kernel_scale(p) * kLog2e;
  const auto launch = [&](auto stages) {
    constexpr int kStages = decltype(stages)::value;
    return launch_kernel(decode_forward_kernel<Element, kHeadDim, kStages>,
                         dim3(uint32_t(items), uint32_t(s.num_kv_heads)), kDecodeThreads,
                         int(sizeof(DecodeSharedStorage<Element, kHeadDim, kStages>)), dp,
                         context, "decoding forward");
  };
  const bool short_chunks = s.seqlen_k <= int64_t(kDecodeShortChunkBlocks) * kDecodeBlockKeys;
  return short_chunks ? launch(std::integral_constant<int, 1>{})
                      : launch(std::integral_constant<int, 2>{});
}

template <class Element>
Status RunDecodeForDtype(const ForwardParams& p, const LaunchContext& context) {
#define JAX_FLASH_TRY_HEAD_DIM(HEAD_DIM) \
  if (p.shape.head_dim == HEAD_DIM) return LaunchDecode<Element, HEAD_DIM>(p, context);
  JAX_FLASH_SM90_DECODE_HEAD_DIMS(JAX_FLASH_TRY_HEAD_DIM)
#undef JAX_FLASH_TRY_HEAD_DIM
  return CheckDecode(p, 0);
}

}  // namespace

Status RunDecodeForward(const ForwardParams& params, const LaunchContext& context) {
  return params.shape.dtype == ElementType::kBFloat16
             ? RunDecodeForDtype<CutlassElement<ElementType::kBFloat16>::type>(params, context)
             : RunDecodeForDtype<CutlassElement<ElementType::kFloat16>::type>(params, context);
}

}  // namespace jax_flash::sm90
