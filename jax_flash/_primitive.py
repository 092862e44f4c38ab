"""The FFI calls and their custom_vjp.

Forward:  jax_flash_fwd(q, k, v, [bias], [mask], [q_len], [kv_len]) -> (out, lse (B, N, T))
Backward: jax_flash_bwd(q, k, v, out, lse, dout, dlse, [bias], [mask], [q_len], [kv_len])
          -> (dq, dk, dv, [dbias])

Batching: both calls use vmap_method="expand_dims". A vmapped axis arrives as a leading batch
axis on every operand; operands that are not mapped get a leading axis of extent 1, which the
kernels broadcast (no copies of K/V or bias). Nested vmaps stack further leading axes. The
backward writes gradients with the full batch shape and jax sums them over the axes of unmapped
primals. This covers vmap over any subset of the arguments, vmap(grad) and grad(vmap) with one
mechanism, at the cost of per-mapped-element gradients for unmapped K/V before jax's sum.

The gradient also flows through the log-sum-exp: the backward folds dlse into the row term,
dS = P * (dP - (rowsum(dO * O) - dlse)).

Platforms: the CPU runs both passes in the C++ kernels. On CUDA the Hopper kernel runs the
forward; calls with bias or mask arrays, and the backward, run through the blockwise JAX path
(_blockwise.py, same semantics, O(T * block) memory) until Hopper kernels cover them. The
choice is made per lowering platform (lax.platform_dependent), not at trace time.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from . import _blockwise, _extension
from ._validation import AttentionConfig


def lse_dtype(dtype) -> np.dtype:
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _attributes(config: AttentionConfig, bias, mask, q_len, kv_len) -> dict:
  # XLA FFI attributes are typed exactly: float64 scale, int64 windows, bool flags.
  return dict(
      scale=np.float64(config.scale),
      window_left=np.int64(config.window_left),
      window_right=np.int64(config.window_right),
      has_bias=bias is not None,
      has_mask=mask is not None,
      has_q_seqlens=q_len is not None,
      has_kv_seqlens=kv_len is not None,
  )


def _present(*operands):
  return [x for x in operands if x is not None]


def _forward_call(config, q, k, v, bias, mask, q_len, kv_len):
  _extension.ensure_registered()
  B, T, N, _ = q.shape
  result_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((B, N, T), lse_dtype(q.dtype)))
  call = jax.ffi.ffi_call(_extension.FORWARD_TARGET, result_types, vmap_method="expand_dims")
  return call(q, k, v, *_present(bias, mask, q_len, kv_len),
              **_attributes(config, bias, mask, q_len, kv_len))


def _backward_call(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len):
  _extension.ensure_registered()
  result_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
  if bias is not None:
    result_types.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
  call = jax.ffi.ffi_call(_extension.BACKWARD_TARGET, tuple(result_types),
                          vmap_method="expand_dims")
  grads = call(q, k, v, out, lse, dout, dlse, *_present(bias, mask, q_len, kv_len),
               **_attributes(config, bias, mask, q_len, kv_len))
  dq, dk, dv = grads[:3]
  return dq, dk, dv, (grads[3] if bias is not None else None)


def _forward(config, q, k, v, bias, mask, q_len, kv_len):
  def cuda(*operands):
    if bias is not None or mask is not None:
      return _blockwise.forward(config, *operands)
    return _forward_call(config, *operands)

  return jax.lax.platform_dependent(q, k, v, bias, mask, q_len, kv_len,
                                    cpu=functools.partial(_forward_call, config), cuda=cuda)


def _backward(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len):
  return jax.lax.platform_dependent(
      q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len,
      cpu=functools.partial(_backward_call, config),
      cuda=lambda q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len: _blockwise.backward(
          config, q, k, v, bias, mask, q_len, kv_len, out, lse, dout, dlse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(config: AttentionConfig, q, k, v, bias, mask, q_len, kv_len):
  """Attention on canonical operands; returns (out (B, T, N, H), lse (B, N, T))."""
  return _forward(config, q, k, v, bias, mask, q_len, kv_len)


def _attention_fwd(config, q, k, v, bias, mask, q_len, kv_len):
  out, lse = _forward(config, q, k, v, bias, mask, q_len, kv_len)
  return (out, lse), (q, k, v, bias, mask, q_len, kv_len, out, lse)


def _attention_bwd(config, residuals, cotangents):
  q, k, v, bias, mask, q_len, kv_len, out, lse = residuals
  dout, dlse = cotangents
  dq, dk, dv, dbias = _backward(config, q, k, v, out, lse, dout.astype(out.dtype),
                                dlse.astype(lse.dtype), bias, mask, q_len, kv_len)
  # Masks and sequence lengths are not differentiable: None is their zero cotangent.
  return dq, dk, dv, dbias, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)

