"""Flax integration: an ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` and
``flax.nnx.MultiHeadAttention``.

.. code-block:: python

  import jax_flash.flax

  # linen
  layer = flax.linen.MultiHeadDotProductAttention(
      num_heads=8, attention_fn=jax_flash.flax.attention_fn)
  # nnx (also with num_kv_heads for grouped-query attention)
  layer = flax.nnx.MultiHeadAttention(
      num_heads=8, in_features=512, attention_fn=jax_flash.flax.attention_fn, rngs=rngs)
  # the kernels' fast paths: causal (or windowed) attention without a mask array
  layer = flax.linen.MultiHeadDotProductAttention(
      num_heads=8, attention_fn=jax_flash.flax.make_attention_fn(is_causal=True))

This module does not import flax: the functions only mirror the signature of flax's
``dot_product_attention`` (flax 0.12: ``query, key, value, bias=None, mask=None,
broadcast_dropout=True, dropout_rng=None, dropout_rate=0., deterministic=False, dtype=None,
precision=None, module=None``, plus ``force_fp32_for_softmax``, ``einsum_dot_general``,
``qk_attn_weights_einsum``, ``attn_weights_value_einsum`` from linen and ``promote_dtype``,
``is_causal`` from nnx). linen passes only the keyword arguments that appear in the
signature of ``attention_fn``; nnx passes its set directly.

Semantics, argument by argument:

* ``query``, ``key``, ``value``: ``(batch..., length, heads, head_dim)``, any number of batch
  axes (none included); they are folded into one batch axis for the kernels and unfolded
  afterwards. ``key``/``value`` may have fewer heads than ``query`` (grouped-query attention,
  ``flax.nnx.MultiHeadAttention(num_kv_heads=...)``). ``value`` must have the head dim of
  ``key``.
* ``mask``: broadcastable to ``(batch..., heads, q_length, kv_length)``, as made by
  ``flax.linen.make_attention_mask`` / ``make_causal_mask`` (float 0/1 by default): nonzero
  keeps a logit, as in flax. It goes to jax_flash's mask operand (broadcast axes stay
  broadcast, nothing of size ``q_length x kv_length`` is formed beyond the mask itself).
* ``bias``: additive, broadcastable like ``mask``; differentiable.
* ``is_causal`` (nnx's call argument) and the factory's ``is_causal`` /
  ``local_window_size`` are applied on top of any mask: a mask is never dropped. On the GPU a
  mask runs in the kernels, which skip the blocks it empties; still, the fastest path passes no
  mask and lets ``is_causal`` (and segment ids for packed documents) express it, which saves
  reading the mask.
* The factory's ``logits_soft_cap`` soft-caps the logits (Gemma 2) before bias and masks, a
  jax_flash extension that flax's own attention does not have.
* ``query_segment_ids``, ``key_value_segment_ids``: integer ``(batch..., q_length)`` and
  ``(batch..., kv_length)``, both or neither: packed sequences, as in
  :func:`jax_flash.dot_product_attention` (key ``j`` is visible to query ``i`` only if their ids
  are equal), for modules that pass them as keyword arguments (flax's own layers do not; a
  custom module calling ``self.attention_fn(..., query_segment_ids=...)`` may). A jax_flash
  extension: flax's attention has no segment ids.
* Rows that see no key at all (e.g. padding queries whose mask row is all False) give output
  0, where flax's attention averages all values uniformly. Padding keys behave identically.
* ``dropout_rate > 0`` with ``deterministic=False`` raises ``NotImplementedError``:
  jax_flash has no attention dropout (evaluation, ``deterministic=True``, works).
* ``dtype``: the computation dtype, as in flax: ``query``, ``key`` and ``value`` are cast to it
  (to their promoted common dtype when None, or with nnx's ``promote_dtype`` function when one
  is passed); the output has that dtype. jax_flash takes float32, bfloat16 and float16 (and
  float64 with x64); on the GPU float32 and float64 run on its blockwise JAX path, with
  matmuls at HIGHEST precision.
* ``precision``: accepted and ignored: the kernels' arithmetic is fixed; they multiply in the
  input dtype and accumulate in float32 (float64 for float64), at least as precise as any
  ``jax.lax.Precision`` for that dtype. ``force_fp32_for_softmax`` is likewise ignored: the
  softmax is always computed in float32 (or float64).
* ``module`` (flax passes it when attention weights are to be sown, ``sow_weights=True``),
  ``einsum_dot_general``, ``qk_attn_weights_einsum`` and ``attn_weights_value_einsum``
  raise ``NotImplementedError`` when set: the attention weights are never formed.
* Other keyword arguments (from newer flax versions) are accepted when they are None or False,
  and raise ``NotImplementedError`` otherwise.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .attention import dot_product_attention

__all__ = ["attention_fn", "make_attention_fn"]


def _fold_batch(x, batch: tuple[int, ...], inner_rank: int):
  """(batch..., *inner) -> (prod(batch), *inner); operands broadcast over every batch axis keep
  a single axis of extent 1 (no copies)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  rank = len(batch) + inner_rank
  if x.ndim > rank:
    raise ValueError(f"attention operand of shape {x.shape} has more axes than "
                     f"(batch..., ...) = {batch} + {inner_rank} trailing axes")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  lead, tail = x.shape[:len(batch)], x.shape[len(batch):]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tail)
  x = jnp.broadcast_to(x, batch + tail)
  return x.reshape((math.prod(batch),) + tail)


def _fold_ids(ids, name: str, batch: tuple[int, ...]):
  """Segment ids (batch..., length) -> (prod(batch), length)."""
  if ids is None:
    return None
  ids = jnp.asarray(ids)
  if ids.shape[:-1] != batch:
    raise ValueError(f"{name} must have shape (batch..., length) with the query's batch axes "
                     f"{batch}, got {ids.shape}")
  return ids.reshape((math.prod(batch),) + ids.shape[-1:])


def _promote(query, key, value, dtype, promote_dtype):
  if promote_dtype is not None:
    return tuple(promote_dtype((query, key, value), dtype=dtype))
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  if dtype is None:
    dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.result_type(dtype, jnp.float32)
  return tuple(x.astype(dtype) for x in (query, key, value))


def _reject_unsupported(dropout_rate, deterministic, module, einsums, extra):
  if not isinstance(dropout_rate, numbers.Real) or isinstance(dropout_rate, bool):
    raise TypeError(f"dropout_rate must be a Python number, got {type(dropout_rate).__name__}")
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"jax_flash has no attention dropout (dropout_rate={dropout_rate}, "
        "deterministic=False); use dropout_rate=0, or deterministic=True for evaluation, or "
        "flax's own attention_fn for training with attention dropout")
  if module is not None:
    raise NotImplementedError(
        "jax_flash never forms the attention weights, so they cannot be sown into "
        "'intermediates' (module was passed: sow_weights=True); call with sow_weights=False")
  for name, value in einsums.items():
    if value is not None:
      raise NotImplementedError(
          f"jax_flash cannot apply a custom {name} (the attention weights are never formed); "
          "use flax's own attention_fn with it")
  for name, value in extra.items():
    if value is not None and value is not False:
      raise NotImplementedError(
          f"jax_flash's attention_fn does not support the argument {name}={value!r}")


def make_attention_fn(*, is_causal: bool = False, local_window_size=None,
                      scale: float | None = None,
                      logits_soft_cap: float | None = None) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for flax's attention layers, with static options of jax_flash.

  Args:
    is_causal: apply causal attention (query ``i`` sees keys ``j <= i``, top-left aligned) in
      the kernels, without a mask array. Combined with any ``mask`` flax passes (both apply).
    local_window_size: ``int`` or ``(left, right)``: sliding-window attention, as in
      :func:`jax_flash.dot_product_attention`; combined with masks and causality.
    scale: the logit scale; ``1/sqrt(head_dim)`` (flax's) when None.
    logits_soft_cap: ``cap``: each scaled logit ``x`` becomes ``cap * tanh(x / cap)`` before
      bias and masks (Gemma 2's attention soft-capping), as in
      :func:`jax_flash.dot_product_attention`; None: off.

  Returns:
    A function with the call signature of ``flax.linen.dot_product_attention`` /
    ``flax.nnx.dot_product_attention``; see the module docstring for the handling of each
    argument.
  """
  factory_causal = bool(is_causal)
  window = local_window_size

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                   dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype=None, precision=None, module=None, force_fp32_for_softmax: bool = False,
                   einsum_dot_general=None, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, promote_dtype=None, is_causal: bool = False,
                   query_segment_ids=None, key_value_segment_ids=None,
                   **kwargs: Any) -> jax.Array:
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    _reject_unsupported(
        dropout_rate, deterministic, module,
        dict(einsum_dot_general=einsum_dot_general,
             qk_attn_weights_einsum=qk_attn_weights_einsum,
             attn_weights_value_einsum=attn_weights_value_einsum), kwargs)
    query, key, value = _promote(query, key, value, dtype, promote_dtype)
    if not (query.ndim == key.ndim == value.ndim):
      raise ValueError(f"query, key and value must have the same rank, got shapes "
                       f"{query.shape}, {key.shape}, {value.shape}")
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.dtype != jnp.bool_:
        mask = mask != 0
    causal = factory_causal or bool(is_causal)
    options = dict(scale=scale, is_causal=causal, local_window_size=window,
                   logits_soft_cap=logits_soft_cap)

    if query.ndim <= 4:
      return dot_product_attention(query, key, value, bias, mask, **options,
                                   query_segment_ids=query_segment_ids,
                                   key_value_segment_ids=key_value_segment_ids)
    batch = query.shape[:-3]
    for name, x in (("key", key), ("value", value)):
      if x.shape[:-3] != batch:
        raise ValueError(f"{name} batch axes {x.shape[:-3]} must equal the query's {batch}")
    q, k, v = (x.reshape((math.prod(batch),) + x.shape[-3:]) for x in (query, key, value))
    out = dot_product_attention(
        q, k, v, _fold_batch(bias, batch, 3), _fold_batch(mask, batch, 3), **options,
        query_segment_ids=_fold_ids(query_segment_ids, "query_segment_ids", batch),
        key_value_segment_ids=_fold_ids(key_value_segment_ids, "key_value_segment_ids", batch))
    return out.reshape(query.shape[:-1] + (out.shape[-1],))

  attention_fn.__doc__ = (
      "jax_flash attention with flax's attention_fn signature "
      f"(is_causal={factory_causal}, local_window_size={window!r}, scale={scale!r}, "
      f"logits_soft_cap={logits_soft_cap!r}); "
      "see jax_flash.flax.")
  return attention_fn


attention_fn = make_attention_fn()
attention_fn.__name__ = "attention_fn"
