/*! \file seqlen.h
    \brief Sequence and batch mapping shared by the forward and backward kernels: the problem's
           runtime scalars, how a flat batch index reaches each operand's own batch items (vmap
           broadcasting), and the query/key lengths of one batch item.
*/
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/config.hpp>

#include "../common/attention_params.h"

namespace jax_flash::sm90 {

//! Batch axes as the device walks them: coalesced on the host (axes of extent 1 dropped,
//! adjacent axes that every operand maps alike merged), so usually one axis, and 32-bit.
struct DeviceBatch {
  int32_t rank = 0;
  int32_t extent[kMaxBatchRank] = {};
};

//! Per operand: stride of each device batch axis in that operand's own batch items (0 where
//! the operand broadcasts the axis).
struct DeviceBatchMap {
  int32_t stride[kMaxBatchRank] = {};

  CUTE_HOST_DEVICE int32_t operator()(DeviceBatch const& batch, int32_t b) const {
    if (batch.rank <= 1) return b * stride[0];
    int32_t own = 0;
    // Rolled: unrolled over kMaxBatchRank axes with two divisions each, this map took ~230
    // instructions per operand, which a CTA's first loads jump over (cold instruction fetches).
#pragma unroll 1
    for (int i = batch.rank - 1; i >= 0; --i) {
      own += (b % batch.extent[i]) * stride[i];
      b /= batch.extent[i];
    }
    return own;
  }
};

//! An int32 array with one row per batch item of an operand (segment ids, their spans).
struct ItemRows {
  const int32_t* data = nullptr;
  int64_t item_stride = 0;  //!< elements between consecutive own batch items
  DeviceBatchMap batch;

  CUTE_HOST_DEVICE const int32_t* of(DeviceBatch const& problem_batch, int32_t b) const {
    return data + int64_t(batch(problem_batch, b)) * item_stride;
  }
};

//! Packed sequences: query i sees key j only if q_ids[i] == kv_ids[j]. kv_span[i] = [lo, hi)
//! holds every key with query i's id and q_span[j] every query with key j's id; lo < 0 marks
//! a span that is the whole axis and not exact (ids not ordered), see attention_params.h.
struct SegmentIds {
  ItemRows q_ids, kv_ids;    //!< (items, seqlen_q) and (items, seqlen_k)
  ItemRows kv_span, q_span;  //!< (items, seqlen_q, 2) and (items, seqlen_k, 2)
  //! The backward skips the query blocks outside its key blocks' spans. Off for the ordered
  //! (deterministic) dQ reduction, whose turns count every key block the window lets see a
  //! query block: skipping there would leave turns that no CTA takes.
  bool backward_skips_blocks = true;

  CUTE_HOST_DEVICE bool present() const { return q_ids.data != nullptr; }
};

//! How jax_flash/_primitive.py classifies each (query block, key block) of a mask array for a
//! pass's tile: no pair kept, some kept, every pair kept. A bias's blocks are empty where the
//! bias drops every logit (see _bias_tiles there), else partial; with both arrays the mask's
//! serve alone.
enum class MaskBlock : int8_t { kEmpty = 0, kPartial = 1, kFull = 2 };

//! A boolean mask array (true keeps a logit) as the kernels read it: its rows as bits,
//! (items, N|1, rows|1, words_per_row) uint32 with the pass's rows (queries forward, keys
//! backward), and its block classes (items, N|1, query blocks|1, key blocks|1) for the pass's
//! tile, each with zero strides on its broadcast axes. The kernels visit only the blocks that
//! are not empty and read the bits only in the partial ones. With a bias instead of a mask,
//! only the classes are set (from the bias's own, broadcast like the bias).
struct MaskArray {
  const uint32_t* bits = nullptr;
  DeviceBatchMap batch;
  int64_t item_stride = 0, head_stride = 0;  //!< words; 0 where broadcast
  int32_t row_stride = 0;                    //!< words; 0 where the rows broadcast
  int32_t words_per_row = 0;
  const MaskBlock* blocks = nullptr;
  DeviceBatchMap blocks_batch;
  int64_t blocks_item_stride = 0;
  int32_t blocks_head_stride = 0, blocks_m_stride = 0, blocks_n_stride = 0;
  //! The backward visits empty blocks too under the ordered (deterministic) dQ reduction, whose
  //! turns count every key block the window lets see a query block.
  bool skip_empty_blocks = true;

  CUTE_HOST_DEVICE bool present() const { return bits != nullptr; }
};

//! One (batch item, query head) of a MaskArray: its two base pointers only, the strides are
//! read from the kernel's parameters where used (registers are scarce in the mainloops).
struct MaskView {
  const uint32_t* bits;
  const MaskBlock* blocks;

  CUTE_HOST_DEVICE static MaskView of(MaskArray const& mask, DeviceBatch const& problem_batch,
                                      int32_t b, int32_t head) {
    return {mask.bits + int64_t(mask.batch(problem_batch, b)) * mask.item_stride +
                head * mask.head_stride,
            mask.blocks + int64_t(mask.blocks_batch(problem_batch, b)) * mask.blocks_item_stride +
                head * mask.blocks_head_stride};
  }
  CUTE_DEVICE MaskBlock block(MaskArray const& mask, int32_t m_block, int32_t n_block) const {
    return MaskBlock(__ldg(reinterpret_cast<const signed char*>(blocks) +
                           m_block * mask.blocks_m_stride + n_block * mask.blocks_n_stride));
  }
};

//! A logit-shaped array as the kernels address it: element (query i, key j) of a (batch item,
//! query head) at item * item_stride + head * head_stride + i * row_stride + j * col_stride,
//! each stride 0 where the array broadcasts (a gradient: sums over) that axis. Value is float
//! for the bias gradient's accumulator, const void for a bias, whose dtype is the kernel's.
template <class Value>
struct LogitArray {
  Value* data = nullptr;
  DeviceBatchMap batch;
  int64_t item_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;

  CUTE_HOST_DEVICE bool present() const { return data != nullptr; }
  //! Element (0, 0) of (batch item b, query head `head`), read as Element (const if Value is).
  template <class Element = Value>
  CUTE_HOST_DEVICE auto of(DeviceBatch const& problem_batch, int32_t b, int32_t head) const {
    using Pointer = std::conditional_t<std::is_const_v<Value>, const Element*, Element*>;
    return static_cast<Pointer>(data) + int64_t(batch(problem_batch, b)) * item_stride +
           head * head_stride;
  }
  //! The array's own index of query head `head`: 0 where it broadcasts the heads.
  CUTE_HOST_DEVICE int32_t own_head(int32_t head) const { return head_stride == 0 ? 0 : head; }
};

//! An additive bias array of the inputs' dtype. `paired`: col_stride is 1 and every other
//! stride even, so two adjacent keys' elements are one aligned 32-bit word.
struct BiasArray : LogitArray<const void> {
  bool paired = false;
};

//! Where the backward puts the bias gradient, laid out like the dbias result (the bias's own
//! extents, full on the batch axes vmap added): a float32 accumulator into which every block's
//! dS is added and which a last pass converts to the bias's dtype, or, `direct`, the result
//! itself, into which each block's dS is stored (one with an element per logit,
//! bias_gradient_accumulates).
struct BiasGradient : LogitArray<void> {
  bool direct = false;
};

//! The runtime scalars of an attention problem that every pass needs: sizes, the visibility
//! rule (window; causal is window_right == 0), the optional per-item lengths, segment ids,
//! mask and bias arrays.
struct AttentionProblem {
  int32_t seqlen_q = 0;
  int32_t seqlen_k = 0;
  int32_t num_heads = 0;
  int32_t group_size = 1;     //!< query heads per key/value head
  int32_t window_left = -1;   //!< -1: unbounded
  int32_t window_right = -1;  //!< -1: unbounded
  //! Forward: rows t*G + g of G = 2^shift packed query heads of several query rows
  //! (ForwardParams::query_groups, whose q and out move through descriptors of their own); 0:
  //! plain rows. Here, beside the sizes every tile reads first, because a kernel parameter
  //! elsewhere costs a short tile a constant-cache miss of its own (bench/RESULTS.md).
  int32_t query_group_shift = 0;
  DeviceBatch batch;
  DeviceBatchMap q_seqlens_batch, kv_seqlens_batch;
  const int32_t* q_seqlens = nullptr;
  const int32_t* kv_seqlens = nullptr;
  SegmentIds segments;
  MaskArray mask;
  BiasArray bias;
};

//! Query and key lengths of one batch item: query rows at or past q_len are padding, keys at or
//! past kv_len are masked. Both are clamped to the problem's extents.
struct SeqLengths {
  int32_t q_len;
  int32_t kv_len;

  CUTE_DEVICE SeqLengths(AttentionProblem const& p, int32_t batch) {
    q_len = p.seqlen_q;
    if (p.q_seqlens != nullptr) {
      q_len = max(0, min(p.seqlen_q, p.q_seqlens[p.q_seqlens_batch(p.batch, batch)]));
    }
    kv_len = p.seqlen_k;
    if (p.kv_seqlens != nullptr) {
      kv_len = max(0, min(p.seqlen_k, p.kv_seqlens[p.kv_seqlens_batch(p.batch, batch)]));
    }
  }
};

}  // namespace jax_flash::sm90
