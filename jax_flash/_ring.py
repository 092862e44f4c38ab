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

Positions are global: for each pair of chunks, the offset between their global positions
turns the call's window (causal is one) into a Block: the rows and keys that can see each other,
sliced out, with the window in the slice's coordinates. Which Block a device runs at a step
depends on its index; where only one Block of a step sees anything, the devices that see
nothing run it with key/value length 0 instead of a conditional (see `_run_blocks`). Sequence
lengths are global and become per-block lengths. Segment ids, where given, are sharded like
their sequence: each device keeps its queries' ids and the key/value ids travel with the
key/value shard, so that each block compares the ids of the rows in hand. Rows that see
nothing in a step contribute nothing (log-sum-exp ``-inf``). Key/value heads travel as they are
(GQA/MQA without copies).

With the ALL_GATHER exchange, key/value (and their ids) are gathered whole instead, in the
sequence's natural order, each query chunk attends to them in one call, and the backward's
dK/dV are summed over the devices and scattered back to their shards (``psum_scatter``).

Used by ``jax_flash.ring_attention`` (inside ``shard_map``) and by the partitioned calls when
``jit`` meets sequence-sharded operands (``_sharding``). Operands have any number of leading
batch axes: q ``(batch..., T, N, H)``, k/v ``(batch..., S, K, H)``, lse ``(batch..., N, T)``,
lengths ``(batch...)``, segment ids ``(batch..., T)`` and ``(batch..., S)`` (or None). The
per-block kernels are passed in, so that each caller runs them at its own level (the full call
inside ``shard_map``, the platform routing inside a partitioned call).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import _config, _validation, _varying
from ._validation import AttentionConfig

#: How the global sequence is laid out over the ring's devices.
CONTIGUOUS = "contiguous"  # device d holds chunk d of P
ZIGZAG = "zigzag"  # device d holds chunks d and 2P - 1 - d of 2P, in that order
LAYOUTS = (CONTIGUOUS, ZIGZAG)

#: How the key/value shards reach every device's queries.
RING = "ring"  # passed around the ring, one shard per step, overlapping the attention
ALL_GATHER = "all_gather"  # gathered whole on every device first; dK/dV reduce-scattered
EXCHANGES = (RING, ALL_GATHER)

#: (config, q, k, v, q_len, kv_len, q_seg, kv_seg) -> (out, lse) of one block.
ForwardBlock = Callable
#: (config, q, k, v, out, lse, dout, dlse, q_len, kv_len, q_seg, kv_seg) -> (dq, dk, dv) of one
#: block.
BackwardBlock = Callable


@dataclasses.dataclass(frozen=True)
class Block:
  """The part of a (query chunk, key/value chunk) pair that can see itself under the call's
  window, for one offset between their global positions: query rows ``[rows[0], rows[1])``
  and key rows ``[cols[0], cols[1])`` of the chunks, attended with `config`, whose window is
  in the slice's own coordinates (the kernels' rule, i - left <= j <= i + right, top-left)."""

  rows: tuple[int, int]
  cols: tuple[int, int]
  config: AttentionConfig

  @staticmethod
  def of(config: AttentionConfig, offset: int, rows: int, cols: int) -> "Block | None":
    """The block of `rows` queries whose first has global position `offset` + that of the
    first of `cols` keys; None when no pair is visible. Global visibility is
    ``offset + i - left <= j <= offset + i + right``; rows and keys that see nothing are
    sliced off, which brings the diagonal back into the slice, so the slice's window has
    non-negative bounds (or none) and the kernels run it as they are."""
    left, right = config.window_left, config.window_right
    r0, r1, c0, c1 = 0, rows, 0, cols
    if left >= 0:  # key j >= i + offset - left
      c0, r1 = max(c0, offset - left), min(r1, cols + left - offset)
    if right >= 0:  # key j <= i + offset + right
      r0, c1 = max(r0, -offset - right), min(c1, rows + offset + right)
    if r1 <= r0 or c1 <= c0:
      return None
    diagonal = offset + r0 - c0  # the offset between the slice's first row and first key
    left = -1 if left < 0 or left - diagonal >= r1 - r0 - 1 else left - diagonal
    right = -1 if right < 0 or right + diagonal >= c1 - c0 - 1 else right + diagonal
    return Block((r0, r1), (c0, c1),
                 dataclasses.replace(config, window_left=left, window_right=right))


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static part of a ring call."""

  axis_name: str | tuple[str, ...]  # one mesh axis, or several taken together (row-major)
  size: int
  config: AttentionConfig  # the call's, with its window over global positions
  layout: str = CONTIGUOUS
  exchange: str = RING  # how the key/value shards reach the queries (EXCHANGES)

  @property
  def chunks(self) -> int:
    """Chunks of the global sequence per device."""
    return 2 if self.layout == ZIGZAG else 1

  def index(self):
    return lax.axis_index(self.axis_name)

  def chunk_ids(self, device):
    """Global chunk indices held by `device` (an index, traced or not), in local order."""
    if self.layout == ZIGZAG:
      return (device, 2 * self.size - 1 - device)
    return (device,)

  def blocks(self, step: int, i: int, j: int, rows: int, cols: int):
    """The Blocks of local query chunk `i` (`rows` long) against local key/value chunk `j`
    (`cols` long) of the shard received `step` steps ago, over the ring's devices: the
    distinct Blocks (None: nothing visible) and, per device, the index of its own."""
    return _distinct([
        Block.of(self.config, self.chunk_ids(device)[i] * rows
                 - self.chunk_ids((device - step) % self.size)[j] * cols, rows, cols)
        for device in range(self.size)])

  def gathered_blocks(self, i: int, rows: int, cols: int):
    """As `blocks`, for local query chunk `i` against the whole key/value sequence (`cols`
    long, gathered in its natural order)."""
    return _distinct([Block.of(self.config, self.chunk_ids(device)[i] * rows, rows, cols)
                      for device in range(self.size)])

  def gather(self, x, axis: int):
    """`x`'s shards of the whole ring, concatenated along `axis` in the sequence's natural
    order (None for None)."""
    if x is None:
      return None
    x = lax.all_gather(x, self.axis_name, axis=axis % x.ndim, tiled=True)
    return zigzag_restore(x, self.size, axis) if self.layout == ZIGZAG else x

  def scatter_sum(self, x, axis: int):
    """The inverse of `gather` for a sum: this device's shard of the sum over the ring of `x`
    (a whole sequence in its natural order)."""
    if self.layout == ZIGZAG:
      x = zigzag_order(x, self.size, axis)
    return lax.psum_scatter(x, self.axis_name, scatter_dimension=axis % x.ndim, tiled=True)

  def pass_on(self, tree):
    """Sends `tree` to the next device of the ring, receives the previous device's."""
    perm = [(d, (d + 1) % self.size) for d in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


def _distinct(per_device: list):
  """(the distinct entries of `per_device` in first-seen order, each device's index into them)."""
  distinct = list(dict.fromkeys(per_device))
  return distinct, [distinct.index(x) for x in per_device]


def choose_exchange(q_shape, k_shape) -> str:
  """The key/value exchange used when the caller names none: ALL_GATHER where key/value are
  small next to the queries (at least 4 query heads per key/value head), RING otherwise."""
  return ALL_GATHER if 4 * k_shape[-2] <= q_shape[-2] else RING


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



def _slice_lengths(lengths, start, size: int):
  """Global lengths as lengths within the `size` rows from global row `start` (None: all)."""
  return None if lengths is None else _validation.lengths_within(lengths, start, size)


def _merge(out, lse, block_out, block_lse):
  """Adds one block's normalised output and log-sum-exp to the running ones (all in the
  accumulation dtype)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  live = jnp.isfinite(new_lse)
  safe = jnp.where(live, new_lse, 0)

  def weight(x):  # (..., N, T) -> (..., T, N, 1)
    return jnp.swapaxes(jnp.where(live, jnp.exp(x - safe), 0), -1, -2)[..., None]

  return out * weight(lse) + block_out * weight(block_lse), new_lse


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


def _rows(x, span: tuple[int, int], axis: int):
  """Rows `span` of `x` along `axis` (x itself when the span is all of it)."""
  if x is None or span == (0, x.shape[axis]):
    return x
  return lax.slice_in_dim(x, span[0], span[1], axis=axis % x.ndim)


def _pad_rows(x, span: tuple[int, int], length: int, axis: int, value=0):
  """`x`, the rows `span` of an axis of `length` rows, padded to all of them with `value`."""
  if span == (0, length):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis % x.ndim] = (span[0], length - span[1])
  return jnp.pad(x, widths, constant_values=value)


def _run_blocks(ring: Ring, blocks, q_start, kv_start, batch, run, skip):
  """Runs `run(block, q_len_of, kv_len_of)` for this device's Block, or returns None when no
  device of the ring sees anything. `blocks` is (distinct Blocks, each device's index into
  them) for a query chunk whose first row has global position `q_start` against keys from
  global position `kv_start`; `q_len_of(lengths)` and `kv_len_of(lengths)` turn the global
  lengths into the block's.

  Where only one Block has visible pairs, the devices that see nothing run it too, with
  key/value length 0 (the kernels then skip every key block): a conditional would make XLA
  wait on the host for its branch index. Only when devices need different Blocks (windows,
  T != S, gathered keys) does a switch pick each device's."""
  distinct, index = blocks
  live = [b for b in distinct if b is not None]
  if not live:
    return None

  def lengths_of(block, gate):
    def q_len_of(lengths):
      return _slice_lengths(lengths, q_start + block.rows[0], block.rows[1] - block.rows[0])

    def kv_len_of(lengths):
      size = block.cols[1] - block.cols[0]
      local = _slice_lengths(lengths, kv_start + block.cols[0], size)
      if gate is None:
        return local
      return jnp.where(gate, jnp.full(batch, size, jnp.int32) if local is None else local, 0)

    return q_len_of, kv_len_of

  me = ring.index()
  if len(live) == 1:
    gate = None
    if None in distinct:
      gate = jnp.asarray([distinct[x] is not None for x in index])[me]
    return run(live[0], *lengths_of(live[0], gate))
  branches = [skip if b is None else functools.partial(run, b, *lengths_of(b, None))
              for b in distinct]
  return lax.switch(jnp.asarray(index, jnp.int32)[me], branches)


def _forward_runner(block: ForwardBlock, q, q_seg, kv, q_len, kv_len, acc, like):
  """run(b, q_len_of, kv_len_of) for `_run_blocks`: Block `b` of queries `q` against
  `kv` = (k, v, kv_seg), its (out, lse) padded back to all of q's rows."""
  rows = q.shape[-3]

  def run(b, q_len_of, kv_len_of):
    k, v, kv_seg = kv
    out, lse = block(b.config, _rows(q, b.rows, -3), _rows(k, b.cols, -3),
                     _rows(v, b.cols, -3), q_len_of(q_len), kv_len_of(kv_len),
                     _rows(q_seg, b.rows, -1), _rows(kv_seg, b.cols, -1))
    return (_varying.varying_like(_pad_rows(out.astype(acc), b.rows, rows, -3), like),
            _varying.varying_like(_pad_rows(lse.astype(acc), b.rows, rows, -1, -jnp.inf),
                                  like))

  return run


def _backward_runner(block: BackwardBlock, qs, kv, q_len, kv_len, acc, likes):
  """run(b, q_len_of, kv_len_of) for `_run_blocks`: the gradients (dq, dk, dv) of Block `b`
  of the queries' `qs` = (q, out, lse, dout, dlse, q_seg) against `kv` = (k, v, kv_seg), in
  the accumulation dtype, padded back to all rows of q and of k."""
  q, out, lse, dout, dlse, q_seg = qs
  k, v, kv_seg = kv

  def run(b, q_len_of, kv_len_of):
    # Every block's P comes from the merged log-sum-exp, and its row term from the merged
    # output: the block gradients are the exact terms of the full gradient.
    rows = lambda x, axis=-3: _rows(x, b.rows, axis)
    cols = lambda x, axis=-3: _rows(x, b.cols, axis)
    grads = block(b.config, rows(q), cols(k), cols(v), rows(out), rows(lse, -1), rows(dout),
                  rows(dlse, -1), q_len_of(q_len), kv_len_of(kv_len), rows(q_seg, -1),
                  cols(kv_seg, -1))
    spans = ((b.rows, q.shape[-3]), (b.cols, k.shape[-3]), (b.cols, k.shape[-3]))
    return tuple(_varying.varying_like(_pad_rows(g.astype(acc), span, n, -3), x)
                 for g, (span, n), x in zip(grads, spans, likes))

  return run


def _add(total, x):
  """total + x, where None is an empty sum."""
  return x if total is None else total + x


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
  skip = lambda: (_varying.varying_like(jnp.zeros(out_shape, acc), q),
                  _varying.varying_like(jnp.full(lse_shape, -jnp.inf, acc), q))
  results = [None] * ring.chunks  # (out, lse) of each query chunk so far
  if ring.exchange == ALL_GATHER:
    kv_all = (ring.gather(k, -3), ring.gather(v, -3), ring.gather(kv_seg, -1))
    blocks = lambda i: ring.gathered_blocks(i, C, kv_all[0].shape[-3])
    for i, q_id in enumerate(q_ids):
      run = _forward_runner(block, q_parts[i], q_segs[i], kv_all, q_len, kv_len, acc, q)
      results[i] = _run_blocks(ring, blocks(i), q_id * C, 0, batch, run, skip)
  else:
    kv = (k, v, kv_seg)  # the key/value ids travel with their shard
    for step in range(ring.size):
      src = (me - step) % ring.size
      # The next shard is requested before this one is used, so the transfer can overlap.
      next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
      for j, (kv_id, kv_part) in enumerate(zip(ring.chunk_ids(src), _kv_chunks(ring, kv))):
        for i, q_id in enumerate(q_ids):
          run = _forward_runner(block, q_parts[i], q_segs[i], kv_part, q_len, kv_len, acc, q)
          result = _run_blocks(ring, ring.blocks(step, i, j, C, Ck), q_id * C, kv_id * Ck,
                               batch, run, skip)
          if result is not None:
            results[i] = result if results[i] is None else _merge(*results[i], *result)
      kv = next_kv
  results = [skip() if r is None else r for r in results]
  return (_join([out for out, _ in results], -3).astype(q.dtype),
          _join([lse for _, lse in results], -1))


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
  split_rows = lambda x: _split(x, ring.chunks, -1)
  # Per query chunk: (q, out, lse, dout, dlse, q_seg).
  q_parts = list(zip(split_q(q), split_q(out), split_rows(lse), split_q(dout),
                     split_rows(dlse), split_rows(q_seg)))
  dqs = [None] * ring.chunks
  if ring.exchange == ALL_GATHER:
    kv_all = (ring.gather(k, -3), ring.gather(v, -3), ring.gather(kv_seg, -1))
    S = kv_all[0].shape[-3]
    skip = lambda: (grad_zeros(q, C), grad_zeros(k, S), grad_zeros(v, S))
    dk_all = dv_all = None
    for i, q_id in enumerate(q_ids):
      run = _backward_runner(block, q_parts[i], kv_all, q_len, kv_len, acc, (q, k, v))
      result = _run_blocks(ring, ring.gathered_blocks(i, C, S), q_id * C, 0, batch, run, skip)
      if result is not None:
        dqs[i] = result[0]
        dk_all, dv_all = _add(dk_all, result[1]), _add(dv_all, result[2])
    dk = ring.scatter_sum(dk_all if dk_all is not None else grad_zeros(k, S), -3)
    dv = ring.scatter_sum(dv_all if dv_all is not None else grad_zeros(v, S), -3)
  else:
    skip = lambda: (grad_zeros(q, C), grad_zeros(k, Ck), grad_zeros(v, Ck))
    # The gradients of the shard in hand travel with it, as do its ids.
    kv = (k, v, kv_seg)
    dkv = (grad_zeros(k, k.shape[-3]), grad_zeros(v, v.shape[-3]))
    for step in range(ring.size):
      src = (me - step) % ring.size
      next_kv = ring.pass_on(kv) if step + 1 < ring.size else None
      dk_parts, dv_parts = _split(dkv[0], ring.chunks, -3), _split(dkv[1], ring.chunks, -3)
      for j, (kv_id, kv_part) in enumerate(zip(ring.chunk_ids(src), _kv_chunks(ring, kv))):
        for i, q_id in enumerate(q_ids):
          run = _backward_runner(block, q_parts[i], kv_part, q_len, kv_len, acc, (q, k, v))
          result = _run_blocks(ring, ring.blocks(step, i, j, C, Ck), q_id * C, kv_id * Ck,
                               batch, run, skip)
          if result is not None:
            dqs[i] = _add(dqs[i], result[0])
            dk_parts[j] = dk_parts[j] + result[1]
            dv_parts[j] = dv_parts[j] + result[2]
      dkv = ring.pass_on((_join(dk_parts, -3), _join(dv_parts, -3)))
      kv = next_kv
    dk, dv = dkv
  dq = _join([grad_zeros(q, C) if x is None else x for x in dqs], -3)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
