/*! \file attention_params.h
    \brief Plain-data description of one attention call, shared by the FFI glue, the CPU
           kernels and the Hopper kernels. No XLA and no CuTe types live here, so every
           layer can include it.

    Layout conventions (all row-major, as XLA hands buffers to FFI handlers):
      q, out, dq          (batch..., T, N, H)
      k, v, dk, dv        (batch..., S, K, H)       K divides N; kv head = n / (N / K)
      bias, mask, dbias   (batch..., N|1, T|1, S|1) any axis of extent 1 broadcasts
      mask_blocks         (batch..., N|1, MB|1, SB|1) int8, a mask's block classes (see below)
      mask_bits           (batch..., N|1, R|1, W)     uint32, a mask's rows as bits (see below)
      lse, dlse           (batch..., N, T)
      q/kv seq lengths    (batch...)                 int32
      q/kv segment ids    (batch..., T|S)            int32
      kv_span             (batch..., T, 2)           int32 [lo, hi) per query row
      q_span              (batch..., S, 2)           int32 [lo, hi) per key
    "batch..." is the problem's batch shape: jax's B axis plus any axes added by vmap. An
    operand may hold extent 1 on any batch axis (vmap of an unmapped operand); the kernels
    broadcast it without copies through BatchMap.
*/
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif

namespace jax_flash {

inline constexpr int kMaxBatchRank = 8;

enum class ElementType : int32_t {
  kFloat64, kFloat32, kBFloat16, kFloat16, kBool, kInt32, kInt8, kUInt32
};

//! Extents of the problem's batch axes (those of the output).
struct BatchShape {
  int32_t rank = 0;
  int64_t extent[kMaxBatchRank] = {};

  JF_HOST_DEVICE int64_t count() const {
    int64_t n = 1;
    for (int32_t i = 0; i < rank; ++i) n *= extent[i];
    return n;
  }
};

//! Maps a flat problem batch index to the flat index of one operand's own batch items.
//! stride[i] is 0 where the operand broadcasts batch axis i.
struct BatchMap {
  int64_t stride[kMaxBatchRank] = {};
};

JF_HOST_DEVICE int64_t map_batch(const BatchShape& shape, const BatchMap& map, int64_t b) {
  int64_t own = 0;
  for (int32_t i = shape.rank - 1; i >= 0; --i) {
    const int64_t extent = shape.extent[i];
    own += (b % extent) * map.stride[i];
    b /= extent;
  }
  return own;
}

//! Number of distinct batch items an operand holds (it may broadcast some batch axes).
inline int64_t own_batch_items(const BatchShape& shape, const BatchMap& map) {
  int64_t items = 1;
  for (int32_t i = 0; i < shape.rank; ++i) {
    if (map.stride[i] != 0 && map.stride[i] * shape.extent[i] > items) {
      items = map.stride[i] * shape.extent[i];
    }
  }
  return items;
}

//! One operand or result. `stride` covers the operand's own non-batch axes in the order of
//! the layout table above (e.g. {T, N, H} for q); a stride of 0 broadcasts that axis.
struct Operand {
  void* data = nullptr;  //!< nullptr when an optional operand is absent
  ElementType dtype = ElementType::kFloat32;
  BatchMap batch;
  int64_t batch_stride = 0;  //!< elements between consecutive own batch items
  int64_t stride[3] = {};
  int64_t extent[3] = {};  //!< own extents of the non-batch axes (1 where broadcast)

  JF_HOST_DEVICE bool present() const { return data != nullptr; }
  JF_HOST_DEVICE int64_t batch_offset(const BatchShape& shape, int64_t b) const {
    return map_batch(shape, batch, b) * batch_stride;
  }
};

//! Sizes and options common to the forward and backward passes.
struct AttentionShape {
  BatchShape batch;
  int64_t seqlen_q = 0;      //!< T
  int64_t seqlen_k = 0;      //!< S
  int64_t num_heads = 0;     //!< N
  int64_t num_kv_heads = 0;  //!< K
  int64_t head_dim = 0;      //!< H
  ElementType dtype = ElementType::kFloat32;  //!< dtype of q, k, v, out and their gradients

  JF_HOST_DEVICE int64_t group_size() const { return num_heads / num_kv_heads; }
};

//! Logits are scale * q_i . k_j, soft-capped when softcap > 0, plus bias[i, j].
//! Visibility of key j to query i: window_left < 0 or j >= i - window_left, and
//! window_right < 0 or j <= i + window_right, and j < kv_len[b]; query rows i >= q_len[b]
//! are padding. Causal attention is window_right == 0 (top-left aligned, as jax's tril).
//! With segment ids (packed sequences), also q_seg[b, i] == kv_seg[b, j]; the windows still
//! apply to the positions i, j of the packed row.
struct AttentionOptions {
  double scale = 1.0;  //!< kernels round it to their accumulation type
  //! Logit soft-capping: > 0 replaces each scaled logit x by softcap * tanh(x / softcap), before
  //! bias and masking; 0: off.
  double softcap = 0.0;
  int64_t window_left = -1;   //!< -1: unbounded
  int64_t window_right = -1;  //!< -1: unbounded
};

struct ForwardParams {
  AttentionShape shape;
  AttentionOptions options;
  Operand q, k, v;
  Operand bias;        //!< optional, dtype float64/float32/bfloat16/float16
  //! Optional with a bias (the Hopper kernels need it without a mask, the CPU kernels do not
  //! read it): the class of every (query block, key block) of the bias for the pass's tile, as
  //! mask_blocks below: 0 where the bias drops every logit of the block
  //! (jax_flash/_primitive.py, _bias_tiles), 1 otherwise. With a mask too, absent: the kernels
  //! read the mask_blocks alone.
  Operand bias_blocks;
  Operand mask;        //!< optional, bool: true keeps the logit (the CPU kernels' form)
  //! The Hopper kernels' form of a mask, in place of the array (so that XLA need not build a
  //! mask it computes from segment ids or positions), together: mask_blocks, the class of
  //! every (query block, key block) of the mask for the pass's tile, 0 empty (no logit kept),
  //! 1 partial, 2 full, one block along an axis the mask broadcasts; mask_bits, the mask's rows
  //! as bits (bit j % 32 of word j / 32 is column j, W = ceil(columns / 32), every column's bit
  //! present), the rows being queries in the forward and keys in the backward (the mask
  //! transposed), one row where the mask broadcasts that axis.
  Operand mask_blocks;
  Operand mask_bits;
  Operand q_seqlens;   //!< optional, int32
  Operand kv_seqlens;  //!< optional, int32
  //! Segment ids, optional and present together, int32. kv_span[b, i] = [lo, hi) holds every
  //! key whose id is q_seg[b, i] (keys outside may be skipped); q_span[b, j] likewise every
  //! query whose id is kv_seg[b, j]. A span with lo >= 0 is exact: every position inside holds
  //! the id (Python computes it with searchsorted where the partner ids are sorted); lo = -1
  //! marks the whole axis, not exact (ids not sorted), to be read as lo = 0.
  Operand q_segment_ids, kv_segment_ids, kv_span, q_span;
  //! The inputs' dtype, or the accumulation dtype (lse's) for a split's parts, which their
  //! merge reads unrounded (jax_flash/_split_kv.py).
  Operand out;
  Operand lse;  //!< float32 (float64 for float64 problems); -inf where a row sees no key
  //! Packed query heads of several query rows (a decoding step, jax_flash/_split_kv.py): 1, or
  //! G when q and out are the call's (batch..., T, K*G, H) and lse its (batch..., K*G, T) but
  //! shape is the kernel's view, K heads of T*G rows, row t*G + g of head k being query row t
  //! of head k*G + g. Rows then step by two strides: q.stride[0] (out's alike) between the G
  //! heads of a query row, num_heads * q.stride[1] between query rows; lse is laid out (K, G,
  //! T). (A single query row packs with the one stride, as plain rows: this stays 1.)
  int64_t query_groups = 1;
  //! The Hopper forward tile (its block_m among the head dim's tiles, kernel_configs.json)
  //! that runs the call; 0: the head dim's default.
  int64_t block_m = 0;
};

struct BackwardParams {
  ForwardParams fwd;  //!< the forward operands, with out and lse as saved by the forward
  Operand dout;
  Operand dlse;  //!< cotangent of the log-sum-exp (zeros unless the residual is used)
  Operand dq, dk, dv;
  Operand dbias;  //!< optional with fwd.bias: present when its gradient is wanted
  //! Bit-identical gradients across runs: the GPU orders its dQ reductions (the CPU kernels
  //! always are).
  bool deterministic = false;
};

}  // namespace jax_flash
