"""Ring attention: exact attention over a sequence split across the devices of one mesh axis,
for code inside ``shard_map``.

Device ``d`` of the ring holds query rows ``[d*T, (d+1)*T)`` and key/value rows
``[d*S, (d+1)*S)`` of the global sequence (a contiguous split, ``T`` and ``S`` the local
lengths). The key/value shards travel around the ring (``ppermute`` to the next device) while
each device attends its queries to the shard in hand with jax_flash's kernels; the partial
outputs merge exactly through their log-sum-exps. The backward circulates the key/value shards
again, with their fp32 gradient accumulators travelling along: each device adds the gradient of
its queries' block and passes both on, and after a full turn every accumulator is back on the
device that owns its shard. Each step's transfer depends only on the previous step's data, so
XLA can overlap it with that step's attention.

Positions are global: causal attention (``T == S``) attends a shard to itself with the causal
kernel, to earlier shards in full and skips later ones; sequence lengths are global and become
per-block lengths. Rows that see nothing in a step contribute nothing (log-sum-exp ``-inf``).
Key/value heads travel as they are (GQA/MQA without copies).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _primitive
from ._validation import AttentionConfig, canonicalize

# Which kernel a (query shard, key/value shard) block runs under causal attention.
_FULL, _CAUSAL, _SKIP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static part of a ring call."""

  axis_name: str
  size: int
  is_causal: bool
  full: AttentionConfig  # a block of earlier keys (or any block when not causal)
  causal: AttentionConfig  # a shard attending to its own keys

  def block_kind(self, src):
    """_FULL, _CAUSAL or _SKIP for the block of key/value shard `src` on this device."""
    me = lax.axis_index(self.axis_name)
    return jnp.where(src < me, _FULL, jnp.where(src == me, _CAUSAL, _SKIP))

  def pass_on(self, tree):
    """Sends `tree` to the next device of the ring, receives the previous device's."""
    perm = [(d, (d + 1) % self.size) for d in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


def ring_attention(query, key, value, *, axis_name: str, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, return_residual=False,
                   deterministic=None):
  r"""Attention over a sequence split along the mesh axis ``axis_name``, inside ``shard_map``.

  Args:
    query: this device's ``(B, T, N, H)`` (or ``(T, N, H)``) shard: global query rows
      ``[i*T, (i+1)*T)`` on the device of index ``i`` along ``axis_name``.
    key, value: this device's ``(B, S, K, H)`` shards, rows ``[i*S, (i+1)*S)``.
    axis_name: the mesh axis the sequence is split over (the ring). Other mesh axes may shard
      the batch or the heads as usual.
    scale, deterministic: as in :func:`jax_flash.dot_product_attention`.
    is_causal: causal over global positions; needs ``T == S``.
    query_seq_lengths, key_value_seq_lengths: optional global lengths ``(B,)`` (the same on
      every device of the ring).
    return_residual: also return this shard's log-sum-exp ``(B, T, N)`` (float32).

  Returns:
    This device's rows of the output (and log-sum-exp), exactly as
    :func:`jax_flash.dot_product_attention` on the whole sequence would give them.

  Bias and mask arrays and local windows are not supported here.
  """
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be the name of a mesh axis (a str), got {axis_name!r}")
  call = canonicalize(query, key, value, None, None, scale=scale, is_causal=is_causal,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths, local_window_size=None,
                      deterministic=deterministic)
  q, k, v = call.query, call.key, call.value
  if is_causal and q.shape[1] != k.shape[1]:
    raise ValueError(f"causal ring attention needs query and key/value shards of the same "
                     f"length, got T={q.shape[1]} and S={k.shape[1]}")
  try:
    size = lax.axis_size(axis_name)
  except NameError as err:
    raise ValueError(f"ring_attention must run inside shard_map over a mesh axis named "
                     f"{axis_name!r}") from err
  config = call.config
  ring = _Ring(axis_name, int(size), bool(is_causal),
               full=dataclasses.replace(config, window_left=-1, window_right=-1),
               causal=dataclasses.replace(config, window_left=-1, window_right=0))
  out, lse = _ring_attention(ring, q, k, v, call.query_seq_lengths, call.key_value_seq_lengths)
  if call.unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2)


def _like(x, ref):
  """`x` typed as varying over the same manual mesh axes as `ref`: shard_map checks that a
  custom_vjp's gradients, and the branches of a switch, carry their operands' types, and the
  kernels' calls return values that carry none."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  missing = tuple(sorted(varying(ref) - varying(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def _local_lengths(lengths, shard, size):
  """Global lengths (B,) as lengths within shard `shard` of `size` rows (None: all rows)."""
  if lengths is None:
    return None
  return jnp.clip(lengths - shard * size, 0, size).astype(jnp.int32)


def _merge(out, lse, block_out, block_lse):
  """Adds one block's normalised output and log-sum-exp to the running ones (in the
  accumulation dtype of `out`)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  live = jnp.isfinite(new_lse)
  safe = jnp.where(live, new_lse, 0.0)

  def weight(x):  # (B, N, T) -> (B, T, N, 1)
    return jnp.swapaxes(jnp.where(live, jnp.exp(x - safe), 0), 1, 2)[..., None]

  return out * weight(lse) + block_out.astype(out.dtype) * weight(block_lse), new_lse


def _ring_forward(ring: _Ring, q, k, v, q_len, kv_len):
  me = lax.axis_index(ring.axis_name)
  B, T, N, _ = q.shape
  S = k.shape[1]
  acc = _primitive.lse_dtype(q.dtype)  # float32, float64 for float64 inputs
  q_len_local = _local_lengths(q_len, me, T)
  out = _like(jnp.zeros(q.shape, acc), q)
  lse = _like(jnp.full((B, N, T), -jnp.inf, acc), q)
  kv = (k, v)
  for step in range(ring.size):
    src = (me - step) % ring.size
    # The next shard is requested before this one is used, so the transfer can overlap.
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_len_local = _local_lengths(kv_len, src, S)

    def block(config, kv=kv, kv_len_local=kv_len_local):
      block_out, block_lse = _primitive._forward(config, q, *kv, None, None, q_len_local,
                                                 kv_len_local)
      return _like(block_out, q), _like(block_lse, q)

    if ring.is_causal:
      skip = (_like(jnp.zeros(q.shape, q.dtype), q),
              _like(jnp.full((B, N, T), -jnp.inf, acc), q))
      block_out, block_lse = lax.switch(
          ring.block_kind(src),
          [lambda: block(ring.full), lambda: block(ring.causal), lambda: skip])
    else:
      block_out, block_lse = block(ring.full)
    out, lse = _merge(out, lse, block_out, block_lse)
    kv = next_kv
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_len, kv_len):
  return _ring_forward(ring, q, k, v, q_len, kv_len)


def _ring_attention_fwd(ring, q, k, v, q_len, kv_len):
  out, lse = _ring_forward(ring, q, k, v, q_len, kv_len)
  return (out, lse), (q, k, v, q_len, kv_len, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents):
  q, k, v, q_len, kv_len, out, lse = residuals
  dout, dlse = cotangents
  dout = dout.astype(out.dtype)
  dlse = dlse.astype(lse.dtype)
  me = lax.axis_index(ring.axis_name)
  T, S = q.shape[1], k.shape[1]
  acc = _primitive.lse_dtype(q.dtype)
  q_len_local = _local_lengths(q_len, me, T)
  dq = _like(jnp.zeros(q.shape, acc), q)
  # The gradients of the shard in hand travel with it.
  kv = (k, v)
  dkv = (_like(jnp.zeros(k.shape, acc), k), _like(jnp.zeros(v.shape, acc), v))
  for step in range(ring.size):
    src = (me - step) % ring.size
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_len_local = _local_lengths(kv_len, src, S)

    def block(config, kv=kv, kv_len_local=kv_len_local):
      # Every block's P comes from the merged log-sum-exp, and its row term from the merged
      # output: the block gradients are the exact terms of the full gradient.
      grads = _primitive._backward(config, q, *kv, out, lse, dout, dlse, None, None,
                                   q_len_local, kv_len_local)
      return tuple(_like(g.astype(acc), x) for g, x in zip(grads[:3], (q, k, v)))

    if ring.is_causal:
      zeros = tuple(_like(jnp.zeros(x.shape, acc), x) for x in (q, k, v))
      bq, bk, bv = lax.switch(ring.block_kind(src),
                              [lambda: block(ring.full), lambda: block(ring.causal),
                               lambda: zeros])
    else:
      bq, bk, bv = block(ring.full)
    dq = dq + bq
    dkv = ring.pass_on((dkv[0] + bk, dkv[1] + bv))
    kv = next_kv
  dk, dv = dkv
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
