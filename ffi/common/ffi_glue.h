/*! \file ffi_glue.h
    \brief The XLA FFI surface of jax_flash: the attribute struct, the one operand/result
           signature shared by the CPU and CUDA handlers, and the translation of XLA buffers
           into ForwardParams/BackwardParams with full validation. Host compiler only.

    Targets (same names on the "cpu" and "CUDA" platforms):
      jax_flash_fwd(q, k, v, [bias], [bias_blocks], [mask], [mask_tiles], [q_seqlens],
                    [kv_seqlens], [segments]) -> (out, lse)
      jax_flash_bwd(q, k, v, out, lse, dout, dlse, [bias], [bias_blocks], [mask], [mask_tiles],
                    [q_seqlens], [kv_seqlens], [segments]) -> (dq, dk, dv, [dbias], platform
                    results...)
    where [mask_tiles] is the two operands mask_blocks, mask_bits (attribute has_mask_blocks),
    the Hopper kernels' form of a mask, given in place of [mask] (the CPU kernels' form),
    and [segments] the four operands q_segment_ids, kv_segment_ids, kv_span, q_span. The
    bracketed operands are present in that order exactly when the matching has_* attribute
    is true; so is [dbias], with has_dbias (a backward whose bias is not differentiated leaves
    it out). The CUDA backward has one platform result: its workspace, uint8 of the size
    jax_flash._extension.backward_workspace_bytes reports (XLA allocates it like a temporary).
*/
#pragma once

#include <cstdint>
#include <string>

#include "attention_params.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = ::xla::ffi;

struct AttentionAttrs {
  double scale;
  double softcap;  //!< 0: off
  int64_t window_left;
  int64_t window_right;
  bool has_bias;
  bool has_bias_blocks;  //!< bias_blocks follows the bias (attention_params.h)
  bool has_mask;
  bool has_mask_blocks;  //!< mask_blocks and mask_bits follow the mask (attention_params.h)
  bool has_q_seqlens;
  bool has_kv_seqlens;
  bool has_segment_ids;  //!< the four segment operands (see above)
  bool deterministic;  //!< backward: bit-identical gradients across runs (forward: unused)
  bool has_dbias;  //!< backward: the bias gradient is returned (needs has_bias; forward: unused)
  //! forward: G >= 1; with G > 1 the kernels attend the call's q (batch..., T, N, H) as N / G
  //! heads of T*G rows, row t*G + g of head k being query row t of head k*G + g (out and lse
  //! keep the call's layouts), so that a decoding step's query heads of a key/value group are
  //! rows of one head without a copy (jax_flash/_split_kv.py); backward: must be 1.
  int64_t query_groups;
  //! forward: the Hopper tile to run, by its block_m among its head dim's tiles
  //! (kernel_configs.json), as jax_flash/_config.py's Kernel.tile_for picks it; 0: the head
  //! dim's default. The CPU kernels have no tiles (any value >= 0). Backward: must be 0.
  int64_t block_m;
};

//! Appends the shared forward signature to a binding that already holds the platform context.
template <typename Binding>
auto BindForward(Binding binding) {
  return std::move(binding)
      .template Attrs<AttentionAttrs>()
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .RemainingArgs()                 // [bias], [mask], [mask_tiles], [lengths], [segments]
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>();  // lse
}

//! Appends the shared backward signature to a binding that already holds the platform context.
template <typename Binding>
auto BindBackward(Binding binding) {
  return std::move(binding)
      .template Attrs<AttentionAttrs>()
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // out
      .template Arg<ffi::AnyBuffer>()  // lse
      .template Arg<ffi::AnyBuffer>()  // dout
      .template Arg<ffi::AnyBuffer>()  // dlse
      .RemainingArgs()                 // [bias], [mask], [mask_tiles], [lengths], [segments]
      .template Ret<ffi::AnyBuffer>()  // dq
      .template Ret<ffi::AnyBuffer>()  // dk
      .template Ret<ffi::AnyBuffer>()  // dv
      .RemainingRets();                // [dbias] (has_dbias), then the platform's own results
}

//! Validates every buffer against the attributes and fills the parameters; errors name the
//! argument and the expected value.
Status MakeForwardParams(const AttentionAttrs& attrs, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, const ffi::RemainingArgs& optional_args,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                         ForwardParams* params);

Status MakeBackwardParams(const AttentionAttrs& attrs, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                          ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                          const ffi::RemainingArgs& optional_args, ffi::Result<ffi::AnyBuffer> dq,
                          ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                          const ffi::RemainingRets& optional_rets, size_t platform_rets,
                          BackwardParams* params);

//! The buffers of the forward merge (the CUDA handler that joins a forward split along the
//! keys), with T query rows, K key/value heads and G query heads per key/value head: out_parts
//! (items, parts, T*G, K, H) and lse_parts (items, parts, K, T*G) into out (items, T, K*G, H)
//! and lse (items, K*G, T). Parts in the call's layout are the case G = 1, K = N.
struct ForwardMergeOperands {
  Operand out_parts, lse_parts, out, lse;
  int64_t items = 0, parts = 0, query_rows = 0, kv_heads = 0, group = 0, head_dim = 0;
};

//! Checks the merge's buffers against each other: ranks, extents, a 16-bit floating output
//! dtype, and float32 parts (outputs and log-sum-exps) and merged log-sum-exp.
Status DescribeForwardMerge(ffi::AnyBuffer out_parts, ffi::AnyBuffer lse_parts,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                            ForwardMergeOperands* operands);

//! The buffers of the bias classes (the CUDA handler that classifies a bias's blocks for a
//! pass's tile): bias (items..., rows, cols) into classes (items..., row_blocks, col_blocks)
//! int8, with the tile's block sizes (1 along an axis of extent 1, which the bias broadcasts).
struct BiasClassesOperands {
  const void* bias = nullptr;
  void* classes = nullptr;
  ElementType dtype = ElementType::kFloat32;
  int64_t items = 0, rows = 0, cols = 0;
  int64_t block_rows = 0, block_cols = 0, row_blocks = 0, col_blocks = 0;
};

//! Checks the bias classes' buffers against each other and the tile's block sizes.
Status DescribeBiasClasses(ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> classes,
                           int64_t block_m, int64_t block_n, BiasClassesOperands* operands);

ffi::Error ToFfiError(const Status& status);

const char* ElementTypeName(ElementType dtype);

}  // namespace jax_flash

// Attribute names are the Python keyword arguments of jax.ffi.ffi_call (see jax_flash/_primitive.py).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_flash::AttentionAttrs,
                                      ::xla::ffi::StructMember<double>("scale"),
                                      ::xla::ffi::StructMember<double>("softcap"),
                                      ::xla::ffi::StructMember<int64_t>("window_left"),
                                      ::xla::ffi::StructMember<int64_t>("window_right"),
                                      ::xla::ffi::StructMember<bool>("has_bias"),
                                      ::xla::ffi::StructMember<bool>("has_bias_blocks"),
                                      ::xla::ffi::StructMember<bool>("has_mask"),
                                      ::xla::ffi::StructMember<bool>("has_mask_blocks"),
                                      ::xla::ffi::StructMember<bool>("has_q_seqlens"),
                                      ::xla::ffi::StructMember<bool>("has_kv_seqlens"),
                                      ::xla::ffi::StructMember<bool>("has_segment_ids"),
                                      ::xla::ffi::StructMember<bool>("deterministic"),
                                      ::xla::ffi::StructMember<bool>("has_dbias"),
                                      ::xla::ffi::StructMember<int64_t>("query_groups"),
                                      ::xla::ffi::StructMember<int64_t>("block_m"));
