"""Blockwise attention in plain JAX: FlashAttention-2 forward and backward, scanned over keys.

The same contract as the FFI calls in `_primitive` (`forward` mirrors `_forward_call`,
`backward` mirrors `_backward_call`), on canonical operands:

  q (B, T, N, H); k, v (B, S, K, H) with K dividing N (query head n reads kv head n // (N // K));
  bias, mask: None or (B|1, N|1, T|1, S|1), bias floating, mask bool; q_len, kv_len: None or
  (B,) int32; the keyword arguments q_seg, kv_seg: None or segment ids (B, T) and (B, S) int32,
  both or neither (the FFI calls' spans are not needed here).

Semantics (those of the kernels, see ffi/common/attention_params.h):
  x = scale * q.k, with products accumulated in float32 (float64 for float64 problems);
  logits = softcap * tanh(x / softcap) + bias with soft-capping (config.softcap > 0), else
  x + bias, in the accumulation dtype; key j is visible to query i iff (left < 0 or
  j >= i - left) and (right < 0 or j <= i + right) and j < kv_len[b] and mask and i < q_len[b]
  and q_seg[b, i] == kv_seg[b, j]. The softmax runs over the visible keys only; a row that sees
  no key, or whose visible logits are all -inf, gives output 0 and lse -inf. The backward takes
  the lse cotangent: D = rowsum(dout * out) - dlse, dS = P * (dP - D), which is the bias
  gradient; dq and dk take dS times the soft-cap's derivative 1 - tanh(x / softcap)^2.

Structure. Nothing of size T x S per head is ever formed. The key axis is cut into blocks of
`block_k` keys and a `lax.scan` walks them:
  * forward: the carry is the online-softmax state (running max m, running sum l, unnormalised
    output acc), all (B, K, G*T[, H]) in the accumulation dtype;
  * backward: P is recomputed per block from the saved lse (renormalised where the lse is
    large, see `backward`); the carry accumulates dq (and dbias
    when the bias broadcasts over keys); dk and dv of the block are scan outputs; a bias that
    varies over keys gets its gradient written block by block into a carried (B|1, N|1, T|1, S)
    buffer with dynamic_update_slice (in place under XLA, no stacked copy).
The query heads are viewed as (K, G) with G = N // K, and the G query heads of one kv head
together with their T rows form the M = G*T rows of one batched matmul per kv head: K/V are
never repeated. Blocks are not padded: the last block starts at S - block_k, overlapping its
predecessor, and its keys already covered are masked out. Keys past T - 1 + window_right are
never visible and are not visited at all.

Block rule (`block_size`): the largest power of two block_k <= 512 whose float32 logits block
(B, N, T, block_k) fits in 256 MiB, but not below 16; then the blocks are evened out
(block_k = ceil(S / ceil(S / block_k)) rounded up to a multiple of 16, at most S). A forward step
holds about two such blocks (logits, P), a backward step about four (logits, P, dP, dS; five
with soft-capping, which keeps its derivative). Large blocks matter on the GPU, where each scan
step costs several kernel launches: at (1, 16384, 16, 64) bfloat16 on an H200, blocks of 512
keys ran the forward 2.2x faster than blocks of 64. Under vmap the budget applies per mapped
element.

Matmul operands stay in the input dtype (P and dS are rounded to it before their matmuls, as in
the GPU kernels); every product accumulates in float32 (float64 for float64 inputs). float32 and
float64 matmuls run at HIGHEST precision.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config, _validation, _varying

# Rows whose saved lse has at least this magnitude get P renormalised in the backward: from there
# on, the rounding of lse alone (half an ulp) shifts every exp(S - lse) of the row by 64 units of
# roundoff or more (the CPU kernels use the same rule).
RENORMALIZE_FROM = 64.0
BLOCK_K_MAX = 512
BLOCK_K_MIN = 16
BLOCK_K_MULTIPLE = 16
LOGITS_BUDGET_BYTES = 256 << 20



def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def block_size(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
               acc_itemsize: int = 4) -> int:
  """The default key block: see the module docstring."""
  if seqlen_k <= 0:
    return 1
  column_bytes = max(1, batch * num_heads * seqlen_q * acc_itemsize)
  bk = BLOCK_K_MAX
  while bk > BLOCK_K_MIN and bk * column_bytes > LOGITS_BUDGET_BYTES:
    bk //= 2
  return _even_blocks(bk, seqlen_k)


def _even_blocks(bk: int, seqlen_k: int) -> int:
  if seqlen_k <= bk:
    return seqlen_k
  num_blocks = _cdiv(seqlen_k, bk)
  even = _cdiv(_cdiv(seqlen_k, num_blocks), BLOCK_K_MULTIPLE) * BLOCK_K_MULTIPLE
  return min(bk, even, seqlen_k)


def _visited_keys(config, seqlen_q: int, seqlen_k: int) -> int:
  """Keys j > T - 1 + window_right are invisible to every query: they are never visited."""
  if config.window_right >= 0:
    return min(seqlen_k, seqlen_q + config.window_right)
  return seqlen_k


def _dot(spec: str, a, b, acc_dtype):
  precision = (lax.Precision.HIGHEST if a.dtype in (np.float32, np.float64) else None)
  return jnp.einsum(spec, a, b, preferred_element_type=acc_dtype, precision=precision)


class _Plan:
  """Static shapes and the per-block views shared by the forward and the backward."""

  def __init__(self, config, q, k, bias, mask, kv_len, q_seg, kv_seg, block_k):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    self.B, self.T, self.N, self.H, self.S, self.K = B, T, N, H, S, K
    self.G = N // K
    self.config = config = _validation.windows_within(config, T, S)
    self.acc = _config.accumulation_dtype(q.dtype)
    self.s_eff = _visited_keys(config, T, S)
    if block_k is None:
      bk = block_size(B, N, T, self.s_eff, self.acc.itemsize)
    else:
      if int(block_k) < 1:
        raise ValueError(f"block_k must be positive, got {block_k}")
      bk = min(int(block_k), self.s_eff)
    self.bk = bk
    self.num_blocks = _cdiv(self.s_eff, bk)
    # The last block starts at s_eff - bk; `overlap` of its leading keys belong to the
    # previous block and are masked out there.
    self.overlap = self.num_blocks * bk - self.s_eff
    # Kept in their own shape: a reshape of a full-size operand outside the loop makes XLA copy
    # it into the loop state; each block's slice is reshaped instead.
    self.bias = bias
    self.mask = mask
    self.kv_len = kv_len
    self.q_seg = q_seg
    self.kv_seg = kv_seg

  def _five(self, x):
    """(B|1, N|1, T|1, S|1) -> (B|1, K|1, G|1, T|1, S|1)."""
    return None if x is None else x.reshape(self.five_shape(x.shape))

  def five_shape(self, shape):
    b, n, t, s = shape
    return (b, self.K, self.G, t, s) if n == self.N else (b, 1, 1, t, s)

  def start(self, j):
    return jnp.minimum(j * self.bk, self.s_eff - self.bk)

  def block_of(self, x, start):
    """The block's keys of a bias or mask, as (B|1, K|1, G|1, T|1, bk|1)."""
    if x.shape[3] != 1:
      x = lax.dynamic_slice_in_dim(x, start, self.bk, axis=3)
    return self._five(x)

  def logits(self, qt, kb, start, *, derivative=False):
    """Scaled, soft-capped, biased logits of one block, (B, K, G, T, bk), in the accumulation
    dtype. With `derivative` the pair (logits, d capped / d scaled logit): 1 - tanh^2 of the
    soft-cap's argument, or None without soft-capping."""
    s = _dot("bkmh,bksh->bkms", qt, kb, self.acc)
    s = s * jnp.asarray(self.config.scale, self.acc)
    s = s.reshape(self.B, self.K, self.G, self.T, self.bk)
    slope = None
    if self.config.softcap > 0:
      cap = jnp.asarray(self.config.softcap, self.acc)
      t = jnp.tanh(s / cap)
      s = cap * t
      if derivative:
        slope = 1 - t * t
    if self.bias is not None:
      s = s + self.block_of(self.bias, start).astype(self.acc)
    return (s, slope) if derivative else s

  def visible(self, j, start):
    """Key visibility of one block, broadcastable to (B, K, G, T, bk); None if all visible."""
    cfg = self.config
    key = start + jnp.arange(self.bk, dtype=jnp.int32)[None, :]
    row = jnp.arange(self.T, dtype=jnp.int32)[:, None]
    vis = None

    def conj(a, b):
      return b if a is None else a & b

    if self.overlap:
      vis = conj(vis, key >= j * self.bk)
    if cfg.window_left >= 0:
      vis = conj(vis, key >= row - cfg.window_left)
    if cfg.window_right >= 0:
      vis = conj(vis, key <= row + cfg.window_right)
    if vis is not None:
      vis = vis[None, None, None]
    if self.kv_len is not None:
      vis = conj(vis, key[None, None, None] < self.kv_len[:, None, None, None, None])
    if self.mask is not None:
      vis = conj(vis, self.block_of(self.mask, start))
    if self.kv_seg is not None:
      kv_seg = lax.dynamic_slice_in_dim(self.kv_seg, start, self.bk, axis=1)
      vis = conj(vis, self.q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :])
    return vis

  def unblock(self, ys, dtype):
    """Scan outputs (num_blocks, B, K, bk, H) -> (B, S, K, H)."""
    nb, bk = self.num_blocks, self.bk
    ys = ys.astype(dtype)
    parts = []
    if nb > 1:
      head = jnp.transpose(ys[:nb - 1], (1, 0, 3, 2, 4))
      parts.append(head.reshape(self.B, (nb - 1) * bk, self.K, self.H))
    parts.append(jnp.transpose(ys[nb - 1][:, :, self.overlap:], (0, 2, 1, 3)))
    if self.s_eff < self.S:
      parts.append(jnp.zeros((self.B, self.S - self.s_eff, self.K, self.H), dtype))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _rows(x, plan):
  """(B, T, N, H) -> (B, K, G*T, H): the rows of one kv head's batched matmul."""
  B, T, K, G, H = plan.B, plan.T, plan.K, plan.G, plan.H
  return jnp.transpose(x.reshape(B, T, K, G, H), (0, 2, 3, 1, 4)).reshape(B, K, G * T, H)


def _unrows(x, plan):
  """(B, K, G*T, H) -> (B, T, N, H)."""
  B, T, K, G, H = plan.B, plan.T, plan.K, plan.G, plan.H
  return jnp.transpose(x.reshape(B, K, G, T, H), (0, 3, 1, 2, 4)).reshape(B, T, K * G, H)


def _row_live(q_len, plan):
  """Query rows inside q_len, (B, 1, 1, T); None without q_len."""
  if q_len is None:
    return None
  row = jnp.arange(plan.T, dtype=jnp.int32)
  return (row[None, :] < q_len[:, None])[:, None, None, :]


def _empty_forward(q):
  B, T, N, _ = q.shape
  return (jnp.zeros(q.shape, q.dtype),
          jnp.full((B, N, T), -jnp.inf, _config.accumulation_dtype(q.dtype)))


def forward(config, q, k, v, bias, mask, q_len, kv_len, *, q_seg=None, kv_seg=None,
            block_k=None):
  """(out (B, T, N, H) in q.dtype, lse (B, N, T) float32 or float64): see the module docstring."""
  B, T, N, H = q.shape
  if B == 0 or T == 0 or N == 0 or k.shape[1] == 0:
    return _empty_forward(q)
  plan = _Plan(config, q, k, bias, mask, kv_len, q_seg, kv_seg, block_k)
  acc, K, G = plan.acc, plan.K, plan.G
  M = G * T
  qt = _rows(q, plan)
  kt = jnp.swapaxes(k, 1, 2)  # (B, K, S, H)
  vt = jnp.swapaxes(v, 1, 2)
  neg_inf = jnp.asarray(-jnp.inf, acc)

  def step(carry, j):
    m, l, o = carry
    start = plan.start(j)
    kb = lax.dynamic_slice_in_dim(kt, start, plan.bk, axis=2)
    vb = lax.dynamic_slice_in_dim(vt, start, plan.bk, axis=2)
    s = plan.logits(qt, kb, start)
    vis = plan.visible(j, start)
    if vis is not None:
      s = jnp.where(vis, s, neg_inf)
    s = s.reshape(B, K, M, plan.bk)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row with nothing finite so far keeps m = -inf; 0 stands in so that exp gives 0, not NaN.
    m_ref = jnp.where(m_new == neg_inf, jnp.zeros((), acc), m_new)
    p = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(m - m_ref)
    l = alpha * l + jnp.sum(p, axis=-1)
    o = alpha[..., None] * o + _dot("bkms,bksh->bkmh", p.astype(v.dtype), vb, acc)
    return (m_new, l, o), None

  # Inside shard_map the carry varies over the mesh axes of the operands, as the body's does.
  init = _varying.varying_like(
      (jnp.full((B, K, M), -jnp.inf, acc), jnp.zeros((B, K, M), acc),
       jnp.zeros((B, K, M, H), acc)), q, k, v, bias, mask, kv_len, q_seg, kv_seg)
  (m, l, o), _ = lax.scan(step, init, jnp.arange(plan.num_blocks, dtype=jnp.int32))

  live = l > 0
  row_live = _row_live(q_len, plan)
  if row_live is not None:
    live = live & jnp.broadcast_to(row_live, (B, K, G, T)).reshape(B, K, M)
  safe_l = jnp.where(live, l, jnp.ones((), acc))
  out = jnp.where(live[..., None], o / safe_l[..., None], jnp.zeros((), acc))
  lse = jnp.where(live, m + jnp.log(safe_l), neg_inf)
  return _unrows(out, plan).astype(q.dtype), lse.reshape(B, N, T)


def needs_renormalization(lse, limit=RENORMALIZE_FROM):
  """Whether any live row of `lse` reaches `limit` in magnitude (a traced bool)."""
  return jnp.any(jnp.isfinite(lse) & (jnp.abs(lse) >= limit))


def backward(config, q, k, v, bias, mask, q_len, kv_len, out, lse, dout, dlse, *, q_seg=None,
             kv_seg=None, block_k=None, renormalize=True):
  """(dq, dk, dv, dbias or None) in the dtypes of q, k, v, bias: see the module docstring.

  P = exp(S - lse) is only as accurate as the saved lse, which is rounded to the accumulation
  dtype: that gives each row's P a common relative error of up to half an ulp of lse, and where
  lse cannot hold log(sum) at all (logits of 1e30) tied maxima would each get P = 1. With
  `renormalize` (static), rows with |lse| >= RENORMALIZE_FROM use P = norm * exp(S - lse), norm
  = 1 / sum_j exp(S_ij - lse_i) over the visible keys, found in an extra pass over the keys;
  callers that know no row needs it (`needs_renormalization`) pass False and skip that pass.
  """
  B, T, N, H = q.shape
  S = k.shape[1]
  if B == 0 or T == 0 or N == 0 or S == 0:
    return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
            None if bias is None else jnp.zeros_like(bias))
  plan = _Plan(config, q, k, bias, mask, kv_len, q_seg, kv_seg, block_k)
  acc, K, G, bk = plan.acc, plan.K, plan.G, plan.bk
  M = G * T
  qt = _rows(q, plan)
  dot = _rows(dout.astype(q.dtype), plan)
  kt = jnp.swapaxes(k, 1, 2)
  vt = jnp.swapaxes(v, 1, 2)
  zero = jnp.zeros((), acc)

  # D = rowsum(dout * out) - dlse, (B, K, G, T) like the logits' rows.
  d = jnp.swapaxes(jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1), 1, 2)
  if dlse is not None:
    d = d - dlse.astype(acc)
  d = d.reshape(B, K, G, T)
  lse = lse.astype(acc).reshape(B, K, G, T)
  row_live = lse > -jnp.inf
  if q_len is not None:
    row_live = row_live & _row_live(q_len, plan)
  lse = jnp.where(row_live, lse, zero)
  norm = _row_norm(plan, qt, kt, lse, row_live) if renormalize else None

  if bias is not None:
    bias5 = plan.five_shape(bias.shape)
    b_axes = tuple(ax for ax in range(4) if bias5[ax] == 1 and (B, K, G, T)[ax] != 1)
    keyed_bias = bias.shape[3] != 1
    if keyed_bias:
      dbias_init = jnp.zeros(bias.shape, bias.dtype)  # written block by block
    else:
      dbias_init = jnp.zeros(bias5, acc)  # summed over blocks
  else:
    dbias_init = None

  def step(carry, j):
    dq, dbias = carry
    start = plan.start(j)
    kb = lax.dynamic_slice_in_dim(kt, start, bk, axis=2)
    vb = lax.dynamic_slice_in_dim(vt, start, bk, axis=2)
    s, slope = plan.logits(qt, kb, start, derivative=True)
    vis = plan.visible(j, start)
    vis = row_live[..., None] if vis is None else vis & row_live[..., None]
    p = jnp.exp(s - lse[..., None])
    if norm is not None:
      p = p * norm[..., None]
    p = jnp.where(vis, p, zero)
    dp = _dot("bkmh,bksh->bkms", dot, vb, acc).reshape(B, K, G, T, bk)
    ds = jnp.where(vis, p * (dp - d[..., None]), zero)  # the gradient of the biased logits
    dx = ds if slope is None else ds * slope  # ... and of the scaled ones
    p = p.reshape(B, K, M, bk)
    ds_c = dx.reshape(B, K, M, bk).astype(q.dtype)
    dv_b = _dot("bkms,bkmh->bksh", p.astype(q.dtype), dot, acc).astype(v.dtype)
    dk_b = (_dot("bkms,bkmh->bksh", ds_c, qt, acc)
            * jnp.asarray(config.scale, acc)).astype(k.dtype)
    dq = dq + _dot("bkms,bksh->bkmh", ds_c, kb, acc)
    if dbias is not None:
      db = jnp.sum(ds, axis=b_axes, keepdims=True) if b_axes else ds
      if keyed_bias:
        db = db.reshape(bias.shape[:3] + (bk,)).astype(bias.dtype)
        if plan.overlap:
          # Keys the previous block already covered keep their gradient.
          old = lax.dynamic_slice_in_dim(dbias, start, bk, axis=3)
          fresh = start + jnp.arange(bk, dtype=jnp.int32) >= j * bk
          db = jnp.where(fresh, db, old)
        dbias = lax.dynamic_update_slice_in_dim(dbias, db, start, axis=3)
      else:
        dbias = dbias + jnp.sum(db, axis=4, keepdims=True)
    return (dq, dbias), (dk_b, dv_b)

  init = _varying.varying_like((jnp.zeros((B, K, M, H), acc), dbias_init), q, k, v, bias, mask,
                              q_len, kv_len, q_seg, kv_seg, out, lse, dout, dlse)
  (dq, dbias), (dk, dv) = lax.scan(step, init, jnp.arange(plan.num_blocks, dtype=jnp.int32))
  dq = _unrows(dq * jnp.asarray(config.scale, acc), plan).astype(q.dtype)
  dk = plan.unblock(dk, k.dtype)
  dv = plan.unblock(dv, v.dtype)
  if dbias is not None:
    dbias = dbias.reshape(bias.shape).astype(bias.dtype)
  return dq, dk, dv, dbias


def _row_norm(plan, qt, kt, lse, row_live):
  """1 / sum_j exp(S_ij - lse_i) over the visible keys for live rows with |lse| >=
  RENORMALIZE_FROM, 1 elsewhere; (B, K, G, T) in the accumulation dtype."""
  zero = jnp.zeros((), plan.acc)

  def step(total, j):
    start = plan.start(j)
    kb = lax.dynamic_slice_in_dim(kt, start, plan.bk, axis=2)
    s = plan.logits(qt, kb, start)
    vis = plan.visible(j, start)
    vis = row_live[..., None] if vis is None else vis & row_live[..., None]
    return total + jnp.sum(jnp.where(vis, jnp.exp(s - lse[..., None]), zero), axis=-1), None

  init = _varying.varying_like(jnp.zeros(lse.shape, plan.acc), qt, kt, lse, row_live, plan.bias,
                              plan.mask, plan.kv_len, plan.q_seg, plan.kv_seg)
  total, _ = lax.scan(step, init, jnp.arange(plan.num_blocks, dtype=jnp.int32))
  flagged = row_live & (jnp.abs(lse) >= RENORMALIZE_FROM) & (total > 0)
  return jnp.where(flagged, 1 / jnp.where(flagged, total, jnp.ones((), plan.acc)),
                   jnp.ones((), plan.acc))
