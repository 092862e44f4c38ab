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
per-block lengths. Segment ids, where given, are sharded like their sequence: each device keeps
its queries' ids and the key/value ids travel with the key/value shard, so that each block
compares the ids of the rows in hand (the kernels' search ranges are computed per block).
Rows that see nothing in a step contribute nothing (log-sum-exp ``-inf``). Key/value heads
travel as they are (GQA/MQA without copies).

Used by ``jax_flash.ring_attention`` (inside ``shard_map``) and by the partitioned calls when
``jit`` meets sequence-sharded operands (``_sharding``). Operands have any number of leading
batch axes: q ``(batch..., T, N, H)``, k/v ``(batch..., S, K, H)``, lse ``(batch..., N, T)``,
lengths ``(batch...)``, segment ids ``(batch..., T)`` and ``(batch..., S)`` (or None). The
per-block kernels are passed in, so that each caller runs them at its own level (the full call
inside ``shard_map``, the platform routing inside a partitioned call).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import _config, _varying
from ._validation import AttentionConfig

# Which kernel a (query chunk, key/value chunk) block runs under causal attention.
_FULL, _CAUSAL, _SKIP = 0, 1, 2

#: How the global sequence is laid out over the ring's devices.
CONTIGUOUS = "contiguous"  # device d holds chunk d of P
ZIGZAG = "zigzag"  # device d holds chunks d and 2P - 1 - d of 2P, in that order
LAYOUTS = (CONTIGUOUS, ZIGZAG)

#: (config, q, k, v, q_len, kv_len, q_seg, kv_seg) -> (out, lse) of one block.
ForwardBlock = Callable
#: (config, q, k, v, out, lse, dout, dlse, q_len, kv_len, q_seg, kv_seg) -> (dq, dk, dv) of one
#: block.
BackwardBlock = Callable


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static part of a ring call."""

  axis_name: str | tuple[str, ...]  # one mesh axis, or several taken together (row-major)
  size: int
  is_causal: bool
  full: AttentionConfig  # a block of earlier keys (or any block when not causal)
  causal: AttentionConfig  # a chunk attending to its own keys
  layout: str = CONTIGUOUS

  @staticmethod
  def of(axis_name, size: int, config: AttentionConfig, layout: str = CONTIGUOUS) -> "Ring":
    """The ring for a call with `config`, which must have no window but causal."""
    is_causal = config.window_right == 0
    if config.window_left != -1 or config.window_right not in (-1, 0):
      raise NotImplementedError(
          "jax_flash: ring attention takes causal or full attention; local windows are not "
          "supported over a split sequence yet")
    return Ring(axis_name, int(size), is_causal,
                full=dataclasses.replace(config, window_left=-1, window_right=-1),
                causal=dataclasses.replace(config, window_left=-1, window_right=0),
                layout=layout)

  @property
  def chunks(self) -> int:
    """Chunks of the global sequence per device."""
    return 2 if self.layout == ZIGZAG else 1

  def index(self):
    return lax.axis_index(self.axis_name)

  def chunk_ids(self, device):
    """Global chunk indices held by `device` (a traced index), in local order."""
    if self.layout == ZIGZAG:
      return (device, 2 * self.size - 1 - device)
    return (device,)

  def block_kind(self, q_chunk, kv_chunk):
    """_FULL, _CAUSAL or _SKIP for queries of chunk `q_chunk` against keys of `kv_chunk`."""
    if not self.is_causal:
      return None
    return jnp.where(kv_chunk < q_chunk, _FULL, jnp.where(kv_chunk == q_chunk, _CAUSAL, _SKIP))

  def pass_on(self, tree):
    """Sends `tree` to the next device of the ring, receives the previous device's."""
    perm = [(d, (d + 1) % self.size) for d in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


def _zigzag_chunks(ring_size: int) -> list[int]:
  """The global chunks in zigzag order: device d's two, d and 2P - 1 - d, device after device."""
  return [c for d in range(ring_size) for c in (d, 2 * ring_size - 1 - d)]


def zigzag_order(x, ring_size: int, axis: int = 1):
  """Reorders the sequence axis `axis` of `x` (length divisible by 2 * ring_size) into the
  zig-zag layout: 2P chunks, device d's contiguous slice holding chunks d and 2P - 1 - d.
  Under causal attention every device then has the same work."""
  return _permute_chunks(x, _zigzag_chunks(ring_size), 2 * ring_size, axis)


def zigzag_restore(x, ring_size: int, axis: int = 1):
  """The inverse of zigzag_order."""
  order = _zigzag_chunks(ring_size)
  return _permute_chunks(x, [order.index(c) for c in range(2 * ring_size)], 2 * ring_size, axis)


def _permute_chunks(x, order, count: int, axis: int):
  axis = axis % x.ndim
  length = x.shape[axis]
  if length % count:
    raise ValueError(f"the sequence axis {axis} of length {length} must divide into {count} "
                     f"chunks (2 per device of the ring)")
  chunks = jnp.split(x, count, axis=axis)
  return jnp.concatenate([chunks[c] for c in order], axis=axis)



def _local_lengths(lengths, chunk, size):
  """Global lengths as lengths within global chunk `chunk` of `size` rows (None: all rows)."""
  if lengths is None:
    return None
  return jnp.clip(lengths - chunk * size, 0, size).astype(jnp.int32)


def _merge(out, lse, block_out, block_lse):
  """Adds one block's normalised output and log-sum-exp to the running ones (in the
  accumulation dtype of `out`)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  live = jnp.isfinite(new_lse)
  safe = jnp.where(live, new_lse, 0)

  def weight(x):  # (..., N, T) -> (..., T, N, 1)
    return jnp.swapaxes(jnp.where(live, jnp.exp(x - safe), 0), -1, -2)[..., None]

  return out * weight(lse) + block_out.astype(out.dtype) * weight(block_lse), new_lse


def _split(x, parts: int, axis: int):
  """`parts` chunks of `x` along `axis`; None chunks for None."""
  if x is None:
    return [None] * parts
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _kv_chunks(ring: Ring, kv):
  """The chunks (k, v, kv_seg or None) of the shard in hand (k, v, kv_seg), in local order."""
  k, v, kv_seg = kv
  return list(zip(_split(k, ring.chunks, -3), _split(v, ring.chunks, -3),
                  _split(kv_seg, ring.chunks, -1)))


def _join(xs, axis: int):
  return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _switch(kind, full, causal, skip):
  """full() when not causal (kind None), else the branch `kind` selects."""
  if kind is None:
    return full()
  return lax.switch(kind, [full, causal, skip])


def forward(ring: Ring, block: ForwardBlock, q, k, v, q_len, kv_len, q_seg, kv_seg):
  """(out, lse) of this device's queries against the whole ring's keys."""
  me = ring.index()
  N = q.shape[-2]
  C, Ck = q.shape[-3] // ring.chunks, k.shape[-3] // ring.chunks  # chunk lengths
  acc = _config.accumulation_dtype(q.dtype)
  # Results have the problem's full batch shape, also where q broadcasts over a batch axis.
  batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
  out_shape, lse_shape = batch + (C,) + q.shape[-2:], batch + (N, C)
  q_ids = ring.chunk_ids(me)
  q_parts = _split(q, ring.chunks, -3)
  q_segs = _split(q_seg, ring.chunks, -1)
  q_lens = [_local_lengths(q_len, c, C) for c in q_ids]
  outs = [_varying.varying_like(jnp.zeros(out_shape, acc), q) for _ in q_ids]
  lses = [_varying.varying_like(jnp.full(lse_shape, -jnp.inf, acc), q) for _ in q_ids]
  kv = (k, v, kv_seg)  # the key/value ids travel with their shard
  for step in range(ring.size):
    src = (me - step) % ring.size
    # The next shard is requested before this one is used, so the transfer can overlap.
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_parts = _kv_chunks(ring, kv)
    for j, kv_id in enumerate(ring.chunk_ids(src)):
      kv_len_local = _local_lengths(kv_len, kv_id, Ck)
      for i, q_id in enumerate(q_ids):
        def run(config, q=q_parts[i], kv=kv_parts[j], q_len=q_lens[i], kv_len=kv_len_local,
                q_seg=q_segs[i]):
          kb, vb, kv_seg = kv
          block_out, block_lse = block(config, q, kb, vb, q_len, kv_len, q_seg, kv_seg)
          return (_varying.varying_like(block_out, q),
                  _varying.varying_like(block_lse.astype(acc), q))

        skip = lambda: (_varying.varying_like(jnp.zeros(out_shape, q.dtype), q),
                        _varying.varying_like(jnp.full(lse_shape, -jnp.inf, acc), q))
        block_out, block_lse = _switch(ring.block_kind(q_id, kv_id), lambda: run(ring.full),
                                       lambda: run(ring.causal), skip)
        outs[i], lses[i] = _merge(outs[i], lses[i], block_out, block_lse)
    kv = next_kv
  return _join(outs, -3).astype(q.dtype), _join(lses, -1)


def backward(ring: Ring, block: BackwardBlock, q, k, v, out, lse, dout, dlse, q_len, kv_len,
             q_seg, kv_seg):
  """(dq, dk, dv) of this device's shards, for the ring's merged `out` and `lse`. Like the
  blocks' gradients they have the problem's full batch shape, also where an operand broadcasts
  over a batch axis (jax sums them over it)."""
  me = ring.index()
  C, Ck = q.shape[-3] // ring.chunks, k.shape[-3] // ring.chunks
  acc = _config.accumulation_dtype(q.dtype)
  batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])

  def grad_zeros(x, rows):
    return _varying.varying_like(jnp.zeros(batch + (rows,) + x.shape[-2:], acc), x)

  q_ids = ring.chunk_ids(me)
  split_q = lambda x: _split(x, ring.chunks, -3)
  q_parts, out_parts, dout_parts = split_q(q), split_q(out), split_q(dout)
  lse_parts, dlse_parts = _split(lse, ring.chunks, -1), _split(dlse, ring.chunks, -1)
  q_segs = _split(q_seg, ring.chunks, -1)
  q_lens = [_local_lengths(q_len, c, C) for c in q_ids]
  dqs = [grad_zeros(q, C) for _ in q_ids]
  # The gradients of the shard in hand travel with it, as do its ids.
  kv = (k, v, kv_seg)
  dkv = (grad_zeros(k, k.shape[-3]), grad_zeros(v, v.shape[-3]))
  for step in range(ring.size):
    src = (me - step) % ring.size
    next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
    kv_parts = _kv_chunks(ring, kv)
    dk_parts, dv_parts = _split(dkv[0], ring.chunks, -3), _split(dkv[1], ring.chunks, -3)
    for j, kv_id in enumerate(ring.chunk_ids(src)):
      kv_len_local = _local_lengths(kv_len, kv_id, Ck)
      for i, q_id in enumerate(q_ids):
        def run(config, i=i, kv=kv_parts[j], kv_len=kv_len_local):
          # Every block's P comes from the merged log-sum-exp, and its row term from the
          # merged output: the block gradients are the exact terms of the full gradient.
          kb, vb, kv_seg = kv
          grads = block(config, q_parts[i], kb, vb, out_parts[i], lse_parts[i], dout_parts[i],
                        dlse_parts[i], q_lens[i], kv_len, q_segs[i], kv_seg)
          return tuple(_varying.varying_like(g.astype(acc), x) for g, x in zip(grads, (q, k, v)))

        skip = lambda: (grad_zeros(q, C), grad_zeros(k, Ck), grad_zeros(v, Ck))
        bq, bk, bv = _switch(ring.block_kind(q_id, kv_id), lambda: run(ring.full),
                             lambda: run(ring.causal), skip)
        dqs[i] = dqs[i] + bq
        dk_parts[j] = dk_parts[j] + bk
        dv_parts[j] = dv_parts[j] + bv
    dkv = ring.pass_on((_join(dk_parts, -3), _join(dv_parts, -3)))
    kv = next_kv
  dk, dv = dkv
  return _join(dqs, -3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
