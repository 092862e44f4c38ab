"""Ring attention: exact attention over a sequence split across the devices of a mesh axis.

Device ``d`` of the ring holds query rows ``[d*T, (d+1)*T)`` and key/value rows
``[d*S, (d+1)*S)`` of the global sequence (a contiguous split, ``T`` and ``S`` the local
lengths). The key/value shards travel around the ring (``ppermute`` to the next device) while
each device attends its queries to the shard in hand with jax_flash's kernels; the partial
outputs merge exactly through their log-sum-exps. The backward circulates the key/value shards
again, with their gradient accumulators travelling along: each device adds the gradient of its
queries' block and passes both on, and after a full turn every accumulator is back on the
device that owns its shard. Each step's transfer depends only on the previous step's data, so
XLA can overlap it with that step's attention.

Positions are global: causal attention (``T == S``) attends a shard to itself with the causal
kernel, to earlier shards in full and skips later ones; sequence lengths are global and become
per-block lengths. Rows that see nothing in a step contribute nothing (log-sum-exp ``-inf``).
Key/value heads travel as they are (GQA/MQA without copies).

Used by ``jax_flash.ring_attention`` (inside ``shard_map``) and by the partitioned calls when
``jit`` meets sequence-sharded operands (``_sharding``). Operands have any number of leading
batch axes: q ``(batch..., T, N, H)``, k/v ``(batch..., S, K, H)``, lse ``(batch..., N, T)``,
lengths ``(batch...)``. The per-block kernels are passed in, so that each caller runs them at its
own level (the full call inside ``shard_map``, the platform routing inside a partitioned call).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._validation import AttentionConfig

# Which kernel a (query shard, key/value shard) block runs under causal attention.
_FULL, _CAUSAL, _SKIP = 0, 1, 2

#: (config, q, k, v, q_len, kv_len) -> (out, lse) of one block.
ForwardBlock = Callable
#: (config, q, k, v, out, lse, dout, dlse, q_len, kv_len) -> (dq, dk, dv) of one block.
BackwardBlock = Callable


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static part of a ring call."""

  axis_name: str | tuple[str, ...]  # one mesh axis, or several taken together (row-major)
  size: int
  is_causal: bool
  full: AttentionConfig  # a block of earlier keys (or any block when not causal)
  causal: AttentionConfig  # a shard attending to its own keys

  @staticmethod
  def of(axis_name, size: int, config: AttentionConfig) -> "Ring":
    """The ring for a call with `config`, which must have no window but causal."""
    is_causal = config.window_right == 0
    if config.window_left != -1 or config.window_right not in (-1, 0):
      raise NotImplementedError(
          "jax_flash: ring attention takes causal or full attention; local windows are not "
          "supported over a split sequence yet")
    return Ring(axis_name, int(size), is_causal,
                full=dataclasses.replace(config, window_left=-1, window_right=-1),
                causal=dataclasses.replace(config, window_left=-1, window_right=0))

  def index(self):
    return lax.axis_index(self.axis_name)

  def block_kind(self, src):
    """_FULL, _CAUSAL or _SKIP for the block of key/value shard `src` on this device."""
    me = self.index()
    return jnp.where(src < me, _FULL, jnp.where(src == me, _CAUSAL, _SKIP))

  def pass_on(self, tree):
    """Sends `tree` to the next device of the ring, receives the previous device's."""
    perm = [(d, (d + 1) % self.size) for d in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


def _acc_dtype(dtype) -> np.dtype:
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _like(x, ref):
  """`x` typed as varying over the same manual mesh axes as `ref`: shard_map checks that a
  custom_vjp's gradients, and the branches of a switch, carry their operands' types, and the
  kernels' calls return values that carry none."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  missing = tuple(sorted(varying(ref) - varying(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def _local_lengths(lengths, shard, size):
  """Global lengths as lengths within shard `shard` of `size` rows (None: all rows)."""
  if lengths is None:
    return None
  return jnp.clip(lengths - shard * size, 0, size).astype(jnp.int32)


def _merge(out, lse, block_out, block_lse):
  """Adds one block's normalised output and log-sum-exp to the running ones (in the
  accumulation dtype of `out`)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  live = jnp.isfinite(new_lse)
  safe = jnp.where(live, new_lse, 0)

  def weight(x):  # (..., N, T) -> (..., T, N, 1)
    return jnp.swapaxes(jnp.where(live, jnp.exp(x - safe), 0), -1, -2)[..., None]

  return out * weight(lse) + block_out.astype(out.dtype) * weight(block_lse), new_lse


def forward(ring: Ring, block: ForwardBlock, q, k, v, q_len, kv_len):
  """(out, lse) of this device's queries against the whole ring's keys."""
  me = ring.index()
  T, N = q.shape[-3], q.shape[-2]
  S = k.shape[-3]
  acc = _acc_dtype(q.dtype)
  # Results have the problem's full batch shape, also where q broadcasts over a batch axis.
  batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
  out_shape, lse_shape = batch + q.shape[-3:], batch + (N, T)
  q_len_local = _local_lengths(q_len, me, T)
  out = _like(jnp.zeros(out_shape, acc), q)
  lse = _like(jnp.full(lse_shape, -jnp.inf, acc), q)
  kv = (k, v)
  for step in range(ring.size):
    src = (me - step) % ring.size
    # The next shard is requested before this one is used, so the transfer can overlap.
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_len_local = _local_lengths(kv_len, src, S)

    def run(config, kv=kv, kv_len_local=kv_len_local):
      block_out, block_lse = block(config, q, *kv, q_len_local, kv_len_local)
      return _like(block_out, q), _like(block_lse.astype(acc), q)

    if ring.is_causal:
      skip = (_like(jnp.zeros(out_shape, q.dtype), q),
              _like(jnp.full(lse_shape, -jnp.inf, acc), q))
      block_out, block_lse = lax.switch(
          ring.block_kind(src), [lambda: run(ring.full), lambda: run(ring.causal), lambda: skip])
    else:
      block_out, block_lse = run(ring.full)
    out, lse = _merge(out, lse, block_out, block_lse)
    kv = next_kv
  return out.astype(q.dtype), lse


def backward(ring: Ring, block: BackwardBlock, q, k, v, out, lse, dout, dlse, q_len, kv_len):
  """(dq, dk, dv) of this device's shards, for the ring's merged `out` and `lse`. Like the
  blocks' gradients they have the problem's full batch shape, also where an operand broadcasts
  over a batch axis (jax sums them over it)."""
  me = ring.index()
  T, S = q.shape[-3], k.shape[-3]
  acc = _acc_dtype(q.dtype)
  batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
  grad_zeros = lambda x: _like(jnp.zeros(batch + x.shape[-3:], acc), x)
  q_len_local = _local_lengths(q_len, me, T)
  dq = grad_zeros(q)
  # The gradients of the shard in hand travel with it.
  kv = (k, v)
  dkv = (grad_zeros(k), grad_zeros(v))
  for step in range(ring.size):
    src = (me - step) % ring.size
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_len_local = _local_lengths(kv_len, src, S)

    def run(config, kv=kv, kv_len_local=kv_len_local):
      # Every block's P comes from the merged log-sum-exp, and its row term from the merged
      # output: the block gradients are the exact terms of the full gradient.
      grads = block(config, q, *kv, out, lse, dout, dlse, q_len_local, kv_len_local)
      return tuple(_like(g.astype(acc), x) for g, x in zip(grads, (q, k, v)))

    if ring.is_causal:
      zeros = tuple(grad_zeros(x) for x in (q, k, v))
      bq, bk, bv = lax.switch(ring.block_kind(src),
                              [lambda: run(ring.full), lambda: run(ring.causal), lambda: zeros])
    else:
      bq, bk, bv = run(ring.full)
    dq = dq + bq
    dkv = ring.pass_on((dkv[0] + bk, dkv[1] + bv))
    kv = next_kv
  dk, dv = dkv
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
