"""Public API: a drop-in for jax.nn.dot_product_attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _config, _primitive, _ring
from ._validation import canonicalize


def _results(call, out, lse, return_residual: bool):
  """The public results from (out (B, T, N, H), lse (B, N, T)): the batch axis dropped again
  for an unbatched call, lse shaped like the query without its last axis."""
  if call.unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2)


#: Values of ``implementation`` that hand the call to jax.nn.dot_product_attention.
JAX_NN_IMPLEMENTATIONS = ("xla", "cudnn")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          deterministic=None, logits_soft_cap=None, query_segment_ids=None,
                          key_value_segment_ids=None):
  r"""Scaled dot-product attention, exact, in O(T*H + S*H) memory.

  Same arguments and meaning as ``jax.nn.dot_product_attention``, plus ``deterministic``,
  ``logits_soft_cap`` and the segment ids:

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``.
    key, value: ``(B, S, K, H)`` or ``(S, K, H)``; ``N`` must be a multiple of ``K``
      (GQA; MQA when ``K == 1``). One floating dtype for query, key and value: float32,
      bfloat16, float16 or float64 (with x64). On the GPU the Hopper kernels run bfloat16 and
      float16; float32 and float64 run on the blockwise JAX path (matmuls at HIGHEST
      precision: no TF32), at that path's speed.
    bias: optional floating array broadcastable to ``(B, N, T, S)``, added to the scaled (and
      soft-capped) logits. Differentiable.
    mask: optional boolean array broadcastable to ``(B, N, T, S)``; ``True`` keeps a logit.
    scale: logit scale; ``1/sqrt(H)`` when None. A static Python number.
    is_causal: key ``j`` is visible to query ``i`` only if ``j <= i`` (top-left aligned, as
      ``jnp.tril`` of a ``T x S`` matrix).
    query_seq_lengths, key_value_seq_lengths: optional integer ``(B,)``; query rows at or past
      the length are padding and give zeros, keys at or past the length are masked.
    local_window_size: ``int`` or ``(left, right)``: key ``j`` is visible to query ``i`` only if
      ``i - left <= j <= i + right``.
    implementation: ``None`` or ``"jax_flash"``: jax_flash's kernels. ``"xla"`` or ``"cudnn"``:
      the call is handed to ``jax.nn.dot_product_attention`` with that implementation (and
      jax's semantics, e.g. for rows that see no key), so code written for jax.nn runs
      unchanged.
    return_residual: also return the log-sum-exp of the logits (scaled, soft-capped when asked,
      biased), shaped like ``query`` without its last axis, in float32 (float64 for float64
      inputs).
    deterministic: whether the gradients must be bit-identical from run to run. The Hopper
      backward adds the dQ partial sums of its key blocks in whatever order they finish unless
      this is True, which orders them (somewhat slower; the gradient of a bias that
      broadcasts over an axis then takes the blockwise backward); the CPU kernels are always
      deterministic. ``None`` follows XLA's ``--xla_gpu_deterministic_ops`` flag in
      ``XLA_FLAGS`` (off by default). Not part of ``jax.nn.dot_product_attention``.
    logits_soft_cap: logit soft-capping (Gemma 2): a static positive number ``cap`` replaces
      each scaled logit ``x = scale * q . k`` by ``cap * tanh(x / cap)``, before the bias is
      added and before masking; ``None`` (default) leaves the logits as they are. Gradients
      include the ``tanh``'s derivative. Not part of ``jax.nn.dot_product_attention``, so not
      available with ``implementation="xla"`` or ``"cudnn"``.
    query_segment_ids, key_value_segment_ids: packed sequences: integer arrays ``(B, T)`` and
      ``(B, S)`` (``(T,)`` and ``(S,)`` for unbatched inputs), both or neither, converted to
      int32. Key ``j`` is visible to query ``i`` only if their ids are equal, on top of every
      rule above (causality and windows still count positions in the packed row). Ids need
      not be sorted; sorted (non-decreasing) ids let the CPU kernels skip the key blocks of
      other segments. Not differentiable. On the GPU such calls run through the blockwise
      path for now. Not part of ``jax.nn.dot_product_attention``, so not available with
      ``implementation="xla"`` or ``"cudnn"``.

  Raises:
    NotImplementedError: when differentiated twice (grad of grad, Hessian-vector products):
      the backward is a kernel with no derivative of its own.

  Warns:
    CudaHandlersNotBuiltWarning: once per process, at the first call on a GPU backend when
      jax_flash was built without its CUDA handlers; every GPU call then runs on the
      blockwise JAX path.

  Returns:
    The attention output, shaped and typed like ``query``; with ``return_residual`` a pair
    ``(output, lse)``. Rows that see no key (all masked, padding rows, empty windows, a
    segment id that no key has) give output 0 and lse ``-inf``, where jax's xla path would
    average all values uniformly.
    Unlike jax, the gradient flows through the returned log-sum-exp.
  """
  if implementation in JAX_NN_IMPLEMENTATIONS:
    if deterministic is not None:
      raise ValueError(f"deterministic applies to jax_flash's kernels only; got deterministic="
                       f"{deterministic!r} with implementation={implementation!r} (jax.nn's "
                       "cuDNN path follows XLA's --xla_gpu_deterministic_ops)")
    if logits_soft_cap is not None:
      raise ValueError(f"logits_soft_cap applies to jax_flash's kernels only; got "
                       f"logits_soft_cap={logits_soft_cap!r} with implementation="
                       f"{implementation!r} (jax.nn.dot_product_attention has no logit "
                       "soft-capping)")
    for name, ids in (("query_segment_ids", query_segment_ids),
                      ("key_value_segment_ids", key_value_segment_ids)):
      if ids is not None:
        raise ValueError(f"{name} applies to jax_flash's kernels only; got it with "
                         f"implementation={implementation!r} (jax.nn.dot_product_attention "
                         "has no segment ids)")
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual)
  if implementation not in (None, "jax_flash"):
    raise ValueError(f"implementation must be None, 'jax_flash', 'xla' or 'cudnn'; got "
                     f"{implementation!r}")
  call = canonicalize(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      local_window_size=local_window_size, deterministic=deterministic,
                      logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
                      key_value_segment_ids=key_value_segment_ids)
  q = call.query
  B, T, N, _ = q.shape
  if B == 0 or T == 0 or call.key.shape[1] == 0:
    # Nothing to compute, or no key at all: every row is empty.
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full((B, N, T), -jnp.inf, _config.accumulation_dtype(q.dtype))
  else:
    out, lse = _primitive.attention(call.config, q, call.key, call.value, call.bias, call.mask,
                                    call.query_seq_lengths, call.key_value_seq_lengths,
                                    call.query_segment_ids, call.key_value_segment_ids)
  return _results(call, out, lse, return_residual)


def ring_attention(query, key, value, *, axis_name, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   layout="contiguous", kv_exchange=None, return_residual=False,
                   deterministic=None, logits_soft_cap=None, query_segment_ids=None,
                   key_value_segment_ids=None):
  r"""Attention over a sequence split along the mesh axis ``axis_name``, inside ``shard_map``.

  The key/value shards travel around the devices of ``axis_name`` while each attends its
  queries to the shard in hand; partial results merge exactly (``jax_flash/_ring.py``).

  Args:
    query: this device's ``(B, T, N, H)`` (or ``(T, N, H)``) shard: global query rows
      ``[i*T, (i+1)*T)`` on the device of index ``i`` along ``axis_name``.
    key, value: this device's ``(B, S, K, H)`` shards, rows ``[i*S, (i+1)*S)``.
    axis_name: the mesh axis (or tuple of mesh axes) the sequence is split over. Other mesh
      axes may shard the batch or the heads as usual.
    scale, deterministic, logits_soft_cap: as in :func:`dot_product_attention` (the soft-cap
      acts on each logit alone, so the ring's exact merge is unchanged).
    is_causal, local_window_size: as in :func:`dot_product_attention`, over global positions
      (query ``i`` and key ``j`` of the whole sequence).
    query_seq_lengths, key_value_seq_lengths: optional global lengths ``(B,)``, the same on
      every device of the ring.
    query_segment_ids, key_value_segment_ids: as in :func:`dot_product_attention`, this
      device's shards ``(B, T)`` and ``(B, S)`` of the global ids, split like query and
      key/value (in the zigzag order too); the key/value ids travel with their shard.
    layout: ``"contiguous"`` (device ``i`` holds chunk ``i`` of the sequence, as above) or
      ``"zigzag"``: the sequence is cut into ``2P`` chunks and device ``i`` holds chunks ``i``
      and ``2P - 1 - i``, in that order, so that causal attention gives every device the same
      work. :func:`zigzag_order` puts a sequence in that order (shard the result contiguously)
      and :func:`zigzag_restore` undoes it.
    kv_exchange: how the key/value shards reach every device: ``"ring"`` (passed from device
      to device, one shard per step, each transfer overlapping the previous step's
      attention; no device holds the whole sequence), ``"all_gather"`` (gathered whole on
      every device first, one kernel call per query chunk, dK/dV reduce-scattered back), or
      ``None``: ``"all_gather"`` when there are at least 4 query heads per key/value head
      (key/value are then small next to the queries), else ``"ring"``.
    return_residual: also return this shard's log-sum-exp ``(B, T, N)``.

  Returns:
    This device's rows of the output (and log-sum-exp), as :func:`dot_product_attention` on
    the whole sequence gives them.

  Bias and mask arrays are not supported here yet.
  """
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if not isinstance(names, tuple) or not names or not all(isinstance(a, str) for a in names):
    raise TypeError(f"axis_name must name a mesh axis (a str, or a tuple of str), got "
                    f"{axis_name!r}")
  call = canonicalize(query, key, value, None, None, scale=scale, is_causal=is_causal,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      local_window_size=local_window_size,
                      deterministic=deterministic, logits_soft_cap=logits_soft_cap,
                      query_segment_ids=query_segment_ids,
                      key_value_segment_ids=key_value_segment_ids)
  q, k, v = call.query, call.key, call.value
  if layout not in _ring.LAYOUTS:
    raise ValueError(f"layout must be one of {_ring.LAYOUTS}, got {layout!r}")
  if kv_exchange is not None and kv_exchange not in _ring.EXCHANGES:
    raise ValueError(f"kv_exchange must be one of {_ring.EXCHANGES} or None, got "
                     f"{kv_exchange!r}")
  if layout == _ring.ZIGZAG and (q.shape[1] % 2 or k.shape[1] % 2):
    raise ValueError(f"the zigzag layout holds two chunks per device: the shard lengths must be "
                     f"even, got T={q.shape[1]} and S={k.shape[1]}")
  try:
    size = lax.axis_size(axis_name)
  except NameError as err:
    raise ValueError(f"ring_attention must run inside shard_map over a mesh axis named "
                     f"{axis_name!r}") from err
  if kv_exchange is None:
    kv_exchange = _ring.choose_exchange(q.shape, k.shape)
  ring = _ring.Ring(axis_name, size, call.config, layout, kv_exchange)
  out, lse = _primitive.ring_attention(ring, q, k, v, call.query_seq_lengths,
                                       call.key_value_seq_lengths, call.query_segment_ids,
                                       call.key_value_segment_ids)
  return _results(call, out, lse, return_residual)


def zigzag_order(x, ring_size: int, axis: int = 1):
  """Puts the sequence axis `axis` of `x` in the zigzag layout of :func:`ring_attention` for a
  ring of `ring_size` devices (the length must divide into ``2 * ring_size`` chunks); shard the
  result contiguously along that axis."""
  return _ring.zigzag_order(x, ring_size, axis)


def zigzag_restore(x, ring_size: int, axis: int = 1):
  """Undoes :func:`zigzag_order`: the sequence axis back in its natural order."""
  return _ring.zigzag_restore(x, ring_size, axis)
