/*! \file launch.h
    \brief Host entry points of the Hopper kernels. Plain C++ (no CuTe), so the FFI handlers are
           compiled by the host compiler; the kernel templates are instantiated in generated
           translation units, one per (pass, tile), its dtypes together.
*/
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/attention_params.h"
#include "../common/status.h"
#include "kernel_features.h"
#include "sm90_tiles.h"  // generated from jax_flash/kernel_configs.json

namespace jax_flash::sm90 {

//! What a launch needs to know about its device and stream.
struct LaunchContext {
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 0;
  int l2_bytes = 0;
};

//! Byte offsets of the backward's workspace regions in one allocation: the fp32 dQ accumulator
//! and, for a deterministic backward, the counters that order its additions (both cleared by
//! the backward's first kernel), then its per-row statistics and the bias gradient's
//! accumulator.
struct BackwardWorkspaceLayout {
  int64_t dq_accum = 0;       //!< (batch, heads, query blocks, block_m * tile head dim) fp32
  int64_t dq_semaphore = -1;  //!< (batch, heads, query blocks) int32; -1 when not deterministic
  int64_t lse_log2 = 0;       //!< (batch, heads, query blocks * block_m) fp32
  int64_t row_term = 0;       //!< same shape
  //! float32, laid out like the dbias result; -1 without a bias gradient or where the backward
  //! stores it directly (bias_gradient_accumulates). Cleared before the main kernel.
  int64_t dbias_accum = -1;
  int64_t bytes = 0;
};

//! The features the call uses, as a set of FeatureBit.
inline unsigned features_of(const ForwardParams& p) {
  return (p.options.softcap > 0 ? kSoftcapBit : 0u) |
         (p.q_segment_ids.present() ? kSegmentIdsBit : 0u) |
         (p.mask_bits.present() ? kMaskBit : 0u) | (p.bias.present() ? kBiasBit : 0u);
}

//! Whether kernels taking `features` run the call: each feature it uses is taken, alone or,
//! for several, in a listed combination.
inline bool takes_features(const ForwardParams& p, const KernelFeatures& features) {
  return features.compiles(features_of(p));
}

//! Elements of the dbias result (and of its float32 accumulator); 0 when it is not wanted.
inline int64_t bias_gradient_elements(const BackwardParams& params) {
  const Operand& dbias = params.dbias;
  if (!dbias.present()) return 0;
  return own_batch_items(params.fwd.shape.batch, dbias.batch) * dbias.batch_stride;
}

//! Whether the backward adds the bias gradient of `dbias_elements` elements into a float32
//! accumulator, then rounds it into the result: where dbias sums over an axis of the problem's
//! logits (a broadcast bias), several steps add into each element. One with an element per
//! logit takes one step's dS per element, which the backward stores into the result directly,
//! unless there is one query or one key: an axis of extent 1 has stride 0, like a broadcast
//! one, and the kernel sums the gradient along it in registers before adding it.
inline bool bias_gradient_accumulates(const AttentionShape& s, int64_t dbias_elements) {
  return s.seqlen_q == 1 || s.seqlen_k == 1 ||
         dbias_elements != s.batch.count() * s.num_heads * s.seqlen_q * s.seqlen_k;
}

//! Whether the compiled forward tile (head_dim, block_m) states no preference: its head dim's
//! default (kernel_configs.json).
constexpr bool is_default_forward_tile(int head_dim, int block_m) {
#define JAX_FLASH_IS_DEFAULT(HEAD_DIM, BLOCK_M, CAUSAL_UP_TO, SEGMENT_IDS, ROWS_UP_TO, ARRAYS) \
  if (HEAD_DIM == head_dim && BLOCK_M == block_m)                                              \
    return CAUSAL_UP_TO == 0 && !SEGMENT_IDS && ROWS_UP_TO == 0;
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_IS_DEFAULT)
#undef JAX_FLASH_IS_DEFAULT
  return false;
}

//! Whether the compiled forward tile (head_dim, block_m) takes mask and bias arrays: its head
//! dim's default, and a tile that lists "arrays" (kernel_configs.json).
constexpr bool forward_tile_takes_arrays(int head_dim, int block_m) {
  if (is_default_forward_tile(head_dim, block_m)) return true;
#define JAX_FLASH_TAKES_ARRAYS(HEAD_DIM, BLOCK_M, CAUSAL_UP_TO, SEGMENT_IDS, ROWS_UP_TO, ARRAYS) \
  if (HEAD_DIM == head_dim && BLOCK_M == block_m) return ARRAYS;
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_TAKES_ARRAYS)
#undef JAX_FLASH_TAKES_ARRAYS
  return false;
}

//! Whether a compiled forward tile of `head_dim` prefers problems with segment ids: its head
//! dim's default then runs segment ids only beside a mask or bias array.
constexpr bool forward_tile_prefers_segment_ids(int head_dim) {
#define JAX_FLASH_PREFERS_SEGMENT_IDS(HEAD_DIM, BLOCK_M, CAUSAL_UP_TO, SEGMENT_IDS, ROWS_UP_TO, \
                                      ARRAYS)                                                  \
  if (HEAD_DIM == head_dim && SEGMENT_IDS) return true;
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_PREFERS_SEGMENT_IDS)
#undef JAX_FLASH_PREFERS_SEGMENT_IDS
  return false;
}

//! Runs the forward on a compiled tile of the smallest head dim that covers the problem's: the
//! first of that head dim whose preference the problem meets, else its default (see
//! kernel_configs.json); problems with a mask or bias array only on tiles that take them (the
//! default, and those listing "arrays"), the tile their block classes are computed for
//! (jax_flash/_config.py, Kernel.tile_for, follows the same rule). Validates what the kernels
//! require (dtype, head dim, alignment) and reports CUDA errors.
Status RunForward(const ForwardParams& params, const LaunchContext& context);

//! Runs a split's forward (ForwardParams::out in float32) of at most kForwardDecodeRows
//! (sm90_decode.h) packed query rows on the decoding kernel (kernel_fwd_decode.h), which the
//! forward call asks for with block_m = kForwardDecodeRows (jax_flash/_config.py,
//! Sm90DecodeKernel); head dims, features and strides it does not take are refused.
Status RunDecodeForward(const ForwardParams& params, const LaunchContext& context);

//! The workspace layout of the backward of `params` (zero bytes where it has nothing to do),
//! with room for a bias gradient of `dbias_elements` elements (0: none wanted). Fails like
//! RunBackward for problems the Hopper backward does not take.
Status GetBackwardWorkspaceLayout(const BackwardParams& params, int64_t dbias_elements,
                                  BackwardWorkspaceLayout* layout);
//! The same, for the bias gradient that params.dbias describes.
Status GetBackwardWorkspaceLayout(const BackwardParams& params, BackwardWorkspaceLayout* layout);

//! Runs the backward (preprocess, main kernel, dQ convert) on the smallest compiled tile whose
//! head dim covers the problem's. `layout` comes from GetBackwardWorkspaceLayout (which also
//! validated the problem), `workspace` has its size.
Status RunBackward(const BackwardParams& params, const BackwardWorkspaceLayout& layout,
                   void* workspace, const LaunchContext& context);

//! The merge of a forward split along the keys into parts (jax_flash/_split_kv.py), each part
//! holding its rows' normalised outputs and log-sum-exps in float32 (kernel_fwd_merge.h): query
//! rows T, key/value heads K and the G query heads of each packed as the forward ran them; G = 1
//! and K = N for parts in the call's layout, (T, N, H) and (N, T).
struct ForwardMergeParams {
  const float* out_parts = nullptr;  //!< (items, parts, T*G, K, H)
  const float* lse_parts = nullptr;  //!< (items, parts, K, T*G)
  void* out = nullptr;               //!< (items, T, K*G, H), dtype
  float* lse = nullptr;              //!< (items, K*G, T)
  int64_t items = 0;
  int32_t parts = 0;
  int32_t query_rows = 0;  //!< T
  int32_t kv_heads = 0;    //!< K
  int32_t group = 0;       //!< G
  int32_t head_dim = 0;
  ElementType dtype = ElementType::kBFloat16;
};

//! Merges the parts of a split forward: rows' log-sum-exps over the parts and outputs weighted
//! by exp(lse_part - lse). Validates the extents it relies on.
Status RunForwardMerge(const ForwardMergeParams& params, const LaunchContext& context);

//! The block classes of a bias array, (items, rows, cols) of the inputs' dtype, for a tile of
//! (block_rows, block_cols) blocks (kernel_bias_classes.h): classes (items, row_blocks,
//! col_blocks) int8.
struct BiasClassesParams {
  const void* bias = nullptr;
  int8_t* classes = nullptr;
  int64_t items = 0;
  int32_t rows = 0, cols = 0;
  int32_t block_rows = 0, block_cols = 0;
  int32_t row_blocks = 0, col_blocks = 0;
  float drops_at = 0.f;   //!< entries at most this may drop their block
  float row_holds = 0.f;  //!< ... where each row of the block holds an entry above this
  ElementType dtype = ElementType::kBFloat16;
};

//! Classifies the blocks of a bias. Validates the extents it relies on.
Status RunBiasClasses(const BiasClassesParams& params, const LaunchContext& context);

//! One compiled configuration of each pass; defined in launch_fwd.cuh / launch_bwd.cuh,
//! instantiated per tile and dtype.
template <ElementType kDtype, int kTileHeadDim, int kTileBlockM>
Status RunForwardTile(const ForwardParams& params, const LaunchContext& context);
template <ElementType kDtype, int kTileHeadDim>
Status RunBackwardTile(const BackwardParams& params, const BackwardWorkspaceLayout& layout,
                       void* workspace, const LaunchContext& context);

}  // namespace jax_flash::sm90
