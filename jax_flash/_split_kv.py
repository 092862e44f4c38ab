"""The GPU forward of few query rows against many keys (decoding): key/value split, query
heads of a group packed.

The forward kernel gives each CTA one query block of one query head. A decoding step (one or a
few query rows against a long key/value cache) has one query block per (batch item, head), too
few to fill the GPU, and under grouped-query attention every query head of a group reads the
same keys again. So, for calls that fit (`plan`):

- the query heads of a key/value group become query rows: q ``(batch..., T, K*G, H)`` is
  attended as K heads of T*G rows (row ``t*G + g``), and K/V are read once per group. The
  forward kernel reads them in place (the FFI call's query_groups): one row's G heads are
  rows one head apart, several rows' are addressed by the Hopper kernels in two strides,
  where G divides their query blocks. Otherwise (and on the CPU, whose kernel packs one row
  only) q is transposed into ``(batch..., T*G, K, H)`` first;
- the keys are split into `splits` equal chunks, each a batch item of its own (a reshape, no
  copy; the queries broadcast over the new batch axis), and the chunks' partial results merge
  exactly through their log-sum-exps (`merge`), from outputs in the accumulation dtype (no
  rounding before the merge's one). On the GPU one small kernel (jax_flash's forward merge)
  merges them and writes the rows back in the call's layout, where XLA would take three
  reductions and the transpositions; chunks against at most 16 packed rows run on the Hopper
  decoding kernel rather than the forward tiles, at the chunk lengths kernel_configs.json
  prefers it for per head dim (`_config.SM90_DECODE`).

The log-sum-exp returned is the merged one, so the backward (which recomputes from it) is that
of the plain call. Only calls without a window (and so without causal masking, whose rows
would see different keys in each chunk) and without segment ids take this path; sequence
lengths do (a chunk's key length is the part of the global length inside it), and so do mask
and bias arrays (a decoding step's mask of the cache's filled positions, as Flax builds it):
their heads and rows are packed as the query's, their keys chunked as the keys (`_packed`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import _config, _validation

#: At most this many query rows (after packing the groups) per (batch item, key/value head):
#: one query block of any forward tile.
MAX_PACKED_ROWS = 64
#: The keys of a chunk: a multiple of CHUNK_QUANTUM (whole key blocks), and at least S / 16
#: keys within [MIN_CHUNK, LONG_CHUNK]. More and shorter chunks spread a small cache over more
#: SMs but cost more in the merge and in each CTA's query load and epilogue: on an H200, 256-key
#: chunks beat 1024-key ones at S = 4096 (13.9 against 19.6 us, B = 1) and lost at S = 16384
#: (32.5 against 25.5 us).
CHUNK_QUANTUM = 128
MIN_CHUNK = 256
LONG_CHUNK = 1024
#: Split while the doubled split still gives at most this many CTAs per SM: one round of
#: tiles. A second round of the persistent grid costs more than it spreads (H200, N = 32,
#: K = 8, H = 128: B = 1, S = 131072: 16 splits 123.0 us, 32 splits 127.5; B = 8, S = 4096:
#: 2 splits 37.2 us, 4 splits 39.9, 8 splits 40.2).
CTAS_PER_SM = 1
_DEFAULT_SMS = 132  # an H100/H200, where the device does not say


@dataclasses.dataclass(frozen=True)
class Plan:
  groups: int  # query heads per key/value head packed into rows (1: no packing)
  splits: int  # key/value chunks (1: no split)


def _sm_count() -> int:
  try:
    return int(jax.devices("gpu")[0].core_count)
  except (RuntimeError, AttributeError, IndexError, TypeError):
    return _DEFAULT_SMS


def plan(q_shape, k_shape, config, has_segments: bool, sm_count: int | None = None) -> Plan | None:
  """How to run a forward of these shapes, or None for the plain kernel call."""
  if has_segments or config.window_left != -1 or config.window_right != -1:
    return None
  T, N, _ = q_shape[-3:]
  S, K, _ = k_shape[-3:]
  groups = N // K
  if T * groups > MAX_PACKED_ROWS:
    return None
  items = 1
  for extent in jnp.broadcast_shapes(q_shape[:-3], k_shape[:-3]):
    items *= extent
  target = CTAS_PER_SM * (sm_count or _sm_count())
  min_chunk = max(MIN_CHUNK, min(LONG_CHUNK, S // 16))
  splits = 1
  while (items * K * 2 * splits <= target and S % (2 * splits * CHUNK_QUANTUM) == 0
         and S // (2 * splits) >= min_chunk):
    splits *= 2
  if splits == 1 and groups == 1:
    return None
  return Plan(groups, splits)


def _to_call_layout(out, lse, query_rows: int):
  """The forward's results of packed query heads, out (..., T*G, K, H) and lse (..., K, T*G),
  as out (..., T, K, G, H) and lse (..., T, K, G). Results in the call's layout, out
  (..., T, N, H) and lse (..., N, T), are the case G = 1, K = N."""
  T = query_rows
  *lead, TG, K, H = out.shape
  G = TG // T
  out = jnp.swapaxes(out.reshape(tuple(lead) + (T, G, K, H)), -3, -2)
  lse = jnp.moveaxis(lse.reshape(lse.shape[:-2] + (K, T, G)), -3, -2)
  return out, lse


def _from_call_layout(out, lse):
  """out (..., T, K, G, H) and lse (..., T, K, G) as the call's (..., T, N, H) and (..., N, T)."""
  T, K, G, H = out.shape[-4:]
  lse = jnp.moveaxis(lse, -3, -1)  # (..., K, G, T)
  return out.reshape(out.shape[:-3] + (K * G, H)), lse.reshape(lse.shape[:-3] + (K * G, T))


def merge(out, lse, query_rows: int, dtype):
  """The exact combination of the chunks' partial results, laid out as the forward kernel gave
  them: out (..., P, T*G, K, H) and lse (..., P, K, T*G), or in the call's layout, out (..., P,
  T, N, H) and lse (..., P, N, T) (the case G = 1) -> the call's out (..., T, K*G, H) in
  `dtype` and lse (..., K*G, T). (On the GPU one kernel does the same: jax_flash's forward
  merge.)"""
  out, lse = _to_call_layout(out, lse, query_rows)
  total = jax.nn.logsumexp(lse, axis=-4)
  live = jnp.isfinite(total)[..., None, :, :, :]
  safe = jnp.where(live, total[..., None, :, :, :], 0)
  weight = jnp.where(live, jnp.exp(lse - safe), 0)[..., None]  # (..., P, T, K, G, 1)
  acc = _config.accumulation_dtype(dtype)
  return _from_call_layout(jnp.sum(out.astype(acc) * weight, axis=-5).astype(dtype), total)


def _only_chunk(out, lse, query_rows: int):
  """`merge` of a key range left whole (P = 1): the layout change alone."""
  out, lse = _to_call_layout(out[..., 0, :, :, :], lse[..., 0, :, :], query_rows)
  return _from_call_layout(out, lse)


def _packed(x, T: int, K: int, G: int, P: int):
  """A mask or bias (..., N|1, T|1, S|1) as the packed and chunked problem's: (..., P|1, K|1,
  R|1, C|1), its rows R those of the packed query (t*G + g) and C = S / P keys of chunk p.
  Axes it broadcasts stay broadcast where the packing allows (a mask of the keys alone, as
  Flax's decoding step gives it, is only reshaped)."""
  if x is None:
    return None
  *lead, heads, rows, keys = x.shape
  lead = tuple(lead)
  if heads > 1:
    x = x.reshape(lead + (K, G, rows, keys))
    if T == 1:  # rows g
      x = x[..., 0, :]
    else:  # rows t*G + g
      x = jnp.broadcast_to(jnp.swapaxes(x, -3, -2), lead + (K, T, G, keys))
      x = x.reshape(lead + (K, T * G, keys))
  elif rows > 1:  # the same for every head: rows t*G + g of row t
    x = jnp.broadcast_to(x[..., None, :], lead + (1, T, G, keys))
    x = x.reshape(lead + (1, T * G, keys))
  if keys == 1:
    return x[..., None, :, :, :]
  x = x.reshape(x.shape[:-1] + (P, keys // P))
  return jnp.moveaxis(x, -2, -4)


def forward(p: Plan, call, q, k, v, bias, mask, q_len, kv_len, merge_parts=merge,
            rows_in_place=False):
  """(out, lse) of the attention of q against k, v by `p`, where
  `call(q, k, v, bias, mask, q_len, kv_len, query_groups, parts)` runs the forward kernel on
  operands with any number of leading batch axes (query_groups as the FFI call's: the query
  heads of a group read as rows in place; parts: results to merge, the output in the
  accumulation dtype), `merge_parts` combines the chunks' results as `merge` does, and
  rows_in_place says whether `call` takes query_groups with several query rows."""
  T, _, H = q.shape[-3:]
  S, K, _ = k.shape[-3:]
  G = p.groups
  batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3],
                               *(x.shape[:-3] for x in (bias, mask) if x is not None),
                               *(x.shape for x in (q_len, kv_len) if x is not None))
  # Query heads k*G + g -> rows t*G + g of head k: read in place (G dividing every tile's query
  # block, a multiple of MAX_PACKED_ROWS), else transposed into (..., T*G, K, H).
  if T == 1 or (rows_in_place and MAX_PACKED_ROWS % G == 0):
    rows, query_groups = q, G
  else:
    rows = q.reshape(q.shape[:-2] + (K, G, H))
    rows = jnp.swapaxes(rows, -3, -2).reshape(q.shape[:-3] + (T * G, K, H))
    query_groups = 1
  # Lengths are taken within their axes first (any int32 is a legal length), so that the
  # arithmetic below cannot wrap around.
  if q_len is not None:
    q_len = jnp.broadcast_to(_validation.lengths_within(q_len, 0, T) * G, batch)
  P, C = p.splits, S // p.splits
  # Chunk c of the keys is batch item c of a new axis; the queries broadcast over it.
  chunk = lambda x: x.reshape(x.shape[:-3] + (P, C) + x.shape[-2:])
  k, v = chunk(k), chunk(v)
  rows = rows[..., None, :, :, :]
  if q_len is not None:
    q_len = jnp.broadcast_to(q_len[..., None], batch + (P,))
  if kv_len is not None:
    starts = jnp.arange(P, dtype=jnp.int32) * C
    kv_len = _validation.lengths_within(jnp.broadcast_to(kv_len, batch)[..., None], starts, C)
  bias, mask = (_packed(x, T, K, G, P) for x in (bias, mask))
  out, lse = call(rows, k, v, bias, mask, q_len, kv_len, query_groups, P > 1)
  # In place: the call's (batch..., P, T, N, H) and (batch..., P, N, T); transposed: (..., P,
  # T*G, K, H) and (..., P, K, T*G).
  if P == 1:
    return _only_chunk(out, lse, T)
  return merge_parts(out, lse, T, q.dtype)
