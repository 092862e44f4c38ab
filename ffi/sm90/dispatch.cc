/*! \file dispatch.cc
    \brief Picks the compiled Hopper forward configuration for a problem and checks what the
           kernels require of it (host compiler; the configurations come from the table).
*/
#include <cstdint>
#include <string>

#include "launch.h"
#include "sm90_forward_tiles.h"

namespace jax_flash::sm90 {
namespace {

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

Status CheckForward(const ForwardParams& p) {
  const AttentionShape& s = p.shape;
  if (s.dtype != ElementType::kBFloat16 && s.dtype != ElementType::kFloat16) {
    return Status::InvalidArgument(
        "jax_flash: the Hopper kernels take bfloat16 or float16 inputs, got dtype id " +
        std::to_string(static_cast<int>(s.dtype)));
  }
  if (p.bias.present() || p.mask.present()) {
    return Status::InvalidArgument(
        "jax_flash: the Hopper forward kernel takes no bias or mask arrays (jax_flash routes "
        "those calls to its blockwise path)");
  }
  if (s.head_dim % kForwardHeadDimMultiple != 0 || s.head_dim > kForwardMaxHeadDim) {
    return Status::InvalidArgument("jax_flash: head dim " + std::to_string(s.head_dim) +
                                   " is not supported by the Hopper kernels (multiples of " +
                                   std::to_string(kForwardHeadDimMultiple) + " up to " +
                                   std::to_string(kForwardMaxHeadDim) + ")");
  }
  for (const Operand* op : {&p.q, &p.k, &p.v, &p.out}) {
    if (!Aligned16(op->data)) {
      return Status::InvalidArgument("jax_flash: the Hopper kernels need 16-byte aligned buffers");
    }
  }
  constexpr int64_t kInt32Max = INT32_MAX;
  if (s.seqlen_q > kInt32Max || s.seqlen_k > kInt32Max || s.num_heads > kInt32Max ||
      s.batch.count() > kInt32Max) {
    return Status::InvalidArgument("jax_flash: sequence length, heads and batch must each be "
                                   "below 2^31 for the Hopper kernels");
  }
  return Status::Ok();
}

template <int kTileHeadDim>
Status RunTileForDtype(const ForwardParams& p, const LaunchContext& context) {
  return p.shape.dtype == ElementType::kBFloat16
             ? RunForwardTile<ElementType::kBFloat16, kTileHeadDim>(p, context)
             : RunForwardTile<ElementType::kFloat16, kTileHeadDim>(p, context);
}

}  // namespace

Status RunForward(const ForwardParams& params, const LaunchContext& context) {
  Status status = CheckForward(params);
  if (!status.ok()) return status;
  const int64_t head_dim = params.shape.head_dim;
  // Tiles are listed by ascending head dim: the first that covers the problem runs it.
#define JAX_FLASH_TRY_TILE(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES) \
  if (head_dim <= HEAD_DIM) return RunTileForDtype<HEAD_DIM>(params, context);
  JAX_FLASH_SM90_FORWARD_TILES(JAX_FLASH_TRY_TILE)
#undef JAX_FLASH_TRY_TILE
  return Status::Internal("jax_flash: no compiled Hopper tile covers head dim " +
                          std::to_string(head_dim));
}

}  // namespace jax_flash::sm90
