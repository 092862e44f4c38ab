/*! \file dispatch.cc
    \brief Runs a problem on the compiled Hopper configuration it names (the forward tile by
           its block_m, which Python picks) and checks what the kernels require of it (host
           compiler; the configurations and the operands each kernel takes come from the
           generated table).
*/
#include <cstdint>
#include <cstdio>
#include <string>

#include "launch.h"
#include "sm90_decode.h"  // generated from jax_flash/kernel_configs.json

namespace jax_flash::sm90 {
namespace {

std::string Number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

//! What both passes require of the problem and of the buffers they read and write.
//! Segment ids and spans as the kernels read them: dense rows per batch item, the spans as
//! 8-byte (lo, hi) pairs.
bool DenseSegmentOperands(const ForwardParams& p) {
  for (const Operand* ids : {&p.q_segment_ids, &p.kv_segment_ids}) {
    if (ids->stride[0] != 1) return false;
  }
  for (const Operand* spans : {&p.kv_span, &p.q_span}) {
    if (spans->stride[0] != 2 || spans->stride[1] != 1 ||
        reinterpret_cast<uintptr_t>(spans->data) % 8 != 0) {
      return false;
    }
  }
  return true;
}

Status CheckProblem(const ForwardParams& p, const char* pass, const KernelFeatures& features,
                    int max_head_dim,
                    std::initializer_list<const Operand*> tensors) {
  const AttentionShape& s = p.shape;
  if (s.dtype != ElementType::kBFloat16 && s.dtype != ElementType::kFloat16) {
    return Status::InvalidArgument(
        "jax_flash: the Hopper kernels take bfloat16 or float16 inputs, got dtype id " +
        std::to_string(static_cast<int>(s.dtype)));
  }
  if (p.mask.present() || p.mask_blocks.present() != p.mask_bits.present()) {
    return Status::InvalidArgument("jax_flash: the Hopper kernels take a mask as its block "
                                   "classes and bits together (mask_blocks, mask_bits), not as "
                                   "the array");
  }
  if (!takes_features(p, features)) {
    return Status::InvalidArgument(std::string("jax_flash: the Hopper ") + pass +
                                   " kernel does not take this call's soft-capping, segment ids "
                                   "or mask or bias array, or not in this combination (jax_flash "
                                   "routes such calls to its blockwise path)");
  }
  if (p.bias.present() && !(p.options.scale >= kBiasMinScale)) {
    return Status::InvalidArgument("jax_flash: the Hopper kernels add a bias divided by the "
                                   "scale, which must then be at least " +
                                   Number(kBiasMinScale) + ", got " + Number(p.options.scale) +
                                   " (jax_flash routes such calls to its blockwise path)");
  }
  const bool segments = p.q_segment_ids.present();
  if (segments != p.kv_segment_ids.present() || segments != p.kv_span.present() ||
      segments != p.q_span.present()) {
    return Status::InvalidArgument("jax_flash: segment ids and their spans come together");
  }
  if (segments && !DenseSegmentOperands(p)) {
    return Status::InvalidArgument("jax_flash: the Hopper kernels need dense segment ids and "
                                   "spans, the spans 8-byte aligned");
  }
  if (s.head_dim % kHeadDimMultiple != 0 || s.head_dim > max_head_dim) {
    return Status::InvalidArgument("jax_flash: head dim " + std::to_string(s.head_dim) +
                                   " is not supported by the Hopper " + pass +
                                   " kernel (multiples of " + std::to_string(kHeadDimMultiple) +
                                   " up to " + std::to_string(max_head_dim) + ")");
  }
  for (const Operand* op : tensors) {
    if (!Aligned16(op->data)) {
      return Status::InvalidArgument("jax_flash: the Hopper kernels need 16-byte aligned buffers");
    }
  }
  // jax_flash answers calls without keys itself (zeros, and an LSE of -inf); the kernels'
  // TMA descriptors and schedules need at least one key block.
  if (s.seqlen_k == 0 && s.seqlen_q > 0 && s.batch.count() * s.num_heads > 0) {
    return Status::InvalidArgument(std::string("jax_flash: the Hopper ") + pass +
                                   " kernel needs at least one key (got a key length of 0)");
  }
  constexpr int64_t kInt32Max = INT32_MAX;
  if (s.seqlen_q > kInt32Max || s.seqlen_k > kInt32Max || s.num_heads > kInt32Max ||
      s.batch.count() > kInt32Max) {
    return Status::InvalidArgument("jax_flash: sequence length, heads and batch must each be "
                                   "below 2^31 for the Hopper kernels");
  }
  return Status::Ok();
}

Status CheckBackward(const BackwardParams& p) {
  const ForwardParams& f = p.fwd;
  if (p.dbias.present() && !kBackwardTakesBiasGradient) {
    return Status::InvalidArgument("jax_flash: the Hopper backward computes no bias gradient "
                                   "(jax_flash routes calls that need dbias to its blockwise "
                                   "path)");
  }
  return CheckProblem(f, "backward", kBackwardFeatures, kBackwardMaxHeadDim,
                      {&f.q, &f.k, &f.v, &f.out, &p.dout, &p.dq, &p.dk, &p.dv});
}

template <int kTileHeadDim, int kTileBlockM>
Status RunForwardForDtype(const ForwardParams& p, const LaunchContext& context) {
  return p.shape.dtype == ElementType::kBFloat16
             ? RunForwardTile<ElementType::kBFloat16, kTileHeadDim, kTileBlockM>(p, context)
             : RunForwardTile<ElementType::kFloat16, kTileHeadDim, kTileBlockM>(p, context);
}

template <int kTileHeadDim>
Status RunBackwardForDtype(const BackwardParams& p, const BackwardWorkspaceLayout& layout,
                           void* workspace, const LaunchContext& context) {
  return p.fwd.shape.dtype == ElementType::kBFloat16
             ? RunBackwardTile<ElementType::kBFloat16, kTileHeadDim>(p, layout, workspace, context)
             : RunBackwardTile<ElementType::kFloat16, kTileHeadDim>(p, layout, workspace, context);
}

int64_t RoundUp256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

BackwardWorkspaceLayout MakeBackwardLayout(const AttentionShape& s, int64_t block_m,
                                           int64_t tile_head_dim, bool deterministic,
                                           int64_t dbias_elements) {
  BackwardWorkspaceLayout layout;
  const int64_t query_blocks = s.batch.count() * s.num_heads * ((s.seqlen_q + block_m - 1) / block_m);
  int64_t offset = 0;
  layout.dq_accum = offset;
  offset += RoundUp256(query_blocks * block_m * tile_head_dim * int64_t(sizeof(float)));
  if (deterministic) {
    layout.dq_semaphore = offset;
    offset += RoundUp256(query_blocks * int64_t(sizeof(int32_t)));
  }
  layout.lse_log2 = offset;
  offset += RoundUp256(query_blocks * block_m * int64_t(sizeof(float)));
  layout.row_term = offset;
  offset += RoundUp256(query_blocks * block_m * int64_t(sizeof(float)));
  if (dbias_elements > 0 && bias_gradient_accumulates(s, dbias_elements)) {
    layout.dbias_accum = offset;
    offset += RoundUp256(dbias_elements * int64_t(sizeof(float)));
  }
  layout.bytes = offset;
  return layout;
}

}  // namespace

Status RunForward(const ForwardParams& params, const LaunchContext& context) {
  Status status = CheckProblem(params, "forward", kForwardFeatures, kForwardMaxHeadDim,
                               {&params.q, &params.k, &params.v, &params.out});
  if (!status.ok()) return status;
  if (params.block_m == kForwardDecodeRows) return RunDecodeForward(params, context);
  // Tiles are listed by ascending head dim: the first head dim that covers the problem's runs
  // it, on the tile Python chose by its preferences (Kernel.tile_for, block_m), else on the
  // head dim's default.
  int64_t tile_head_dim = 0;
#define JAX_FLASH_FIND_HEAD_DIM(HEAD_DIM, BLOCK_M, CAUSAL_UP_TO, SEGMENT_IDS, ROWS_UP_TO, ARRAYS) \
  if (tile_head_dim == 0 && params.shape.head_dim <= HEAD_DIM) tile_head_dim = HEAD_DIM;
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_FIND_HEAD_DIM)
#undef JAX_FLASH_FIND_HEAD_DIM
#define JAX_FLASH_TRY_TILE(HEAD_DIM, BLOCK_M, CAUSAL_UP_TO, SEGMENT_IDS, ROWS_UP_TO, ARRAYS) \
  if (tile_head_dim == HEAD_DIM &&                                                           \
      (params.block_m == 0 ? is_default_forward_tile(HEAD_DIM, BLOCK_M)                      \
                           : params.block_m == BLOCK_M))                                     \
    return RunForwardForDtype<HEAD_DIM, BLOCK_M>(params, context);
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_TRY_TILE)
#undef JAX_FLASH_TRY_TILE
  if (tile_head_dim == 0) {
    return Status::Internal("jax_flash: no compiled Hopper forward tile covers head dim " +
                            std::to_string(params.shape.head_dim));
  }
  return Status::InvalidArgument("jax_flash: no compiled Hopper forward tile of head dim " +
                                 std::to_string(tile_head_dim) + " has block_m " +
                                 std::to_string(params.block_m) + " (kernel_configs.json)");
}

Status GetBackwardWorkspaceLayout(const BackwardParams& params, BackwardWorkspaceLayout* layout) {
  return GetBackwardWorkspaceLayout(params, bias_gradient_elements(params), layout);
}

Status GetBackwardWorkspaceLayout(const BackwardParams& params, int64_t dbias_elements,
                                  BackwardWorkspaceLayout* layout) {
  Status status = CheckBackward(params);
  if (!status.ok()) return status;
  const AttentionShape& s = params.fwd.shape;
#define JAX_FLASH_TRY_TILE(HEAD_DIM, BLOCK_M)                                                   \
  if (s.head_dim <= HEAD_DIM) {                                                                 \
    *layout = MakeBackwardLayout(s, BLOCK_M, HEAD_DIM, params.deterministic, dbias_elements);   \
    return Status::Ok();                                                                        \
  }
  JAX_FLASH_SM90_BACKWARD_TILES(JAX_FLASH_TRY_TILE)
#undef JAX_FLASH_TRY_TILE
  return Status::Internal("jax_flash: no compiled Hopper backward tile covers head dim " +
                          std::to_string(s.head_dim));
}

Status RunBackward(const BackwardParams& params, const BackwardWorkspaceLayout& layout,
                   void* workspace, const LaunchContext& context) {
  if (layout.bytes > 0 && workspace == nullptr) {
    return Status::Internal("jax_flash: the Hopper backward got no workspace");
  }
  const int64_t head_dim = params.fwd.shape.head_dim;
#define JAX_FLASH_TRY_TILE(HEAD_DIM, BLOCK_M) \
  if (head_dim <= HEAD_DIM) return RunBackwardForDtype<HEAD_DIM>(params, layout, workspace, context);
  JAX_FLASH_SM90_BACKWARD_TILES(JAX_FLASH_TRY_TILE)
#undef JAX_FLASH_TRY_TILE
  return Status::Internal("jax_flash: no compiled Hopper backward tile covers head dim " +
                          std::to_string(head_dim));
}

}  // namespace jax_flash::sm90
