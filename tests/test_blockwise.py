"""The blockwise JAX attention (jax_flash/_blockwise.py) against float64 references.

References, both on the float64 upcast of the very values the tested dtype holds:
  * jax.nn.dot_product_attention(implementation='xla'): the output and its gradient, on the rows
    that see a key (jax averages all values where none is visible). jax computes its softmax in
    float32 even for float64 inputs, which bounds how closely it can be matched.
  * `_dense`: the definition, a max-subtracted softmax over the visible keys in float64, which
    also gives the log-sum-exp (differentiable) and which rows are live. It is the precise
    reference for every dtype and the only one for the lse and its gradient.

The blockwise functions run with the dtype's natural x64 setting (off unless float64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_flash import _blockwise
from jax_flash._validation import AttentionConfig

BF16 = np.dtype(ml_dtypes.bfloat16)

# Allowed max|ours - ref| / max(1, max|ref|) against the float64 definition, per dtype.
TOL = {
    # Both sides accumulate in float64; only the summation order differs.
    "float64": dict(out=1e-12, lse=1e-12, grad=1e-11),
    # float32 accumulation over <= 1000 keys or query rows: tens of ulps (seen: 2e-6).
    "float32": dict(out=5e-6, lse=1e-6, grad=1e-5),
    # P and dS are rounded to 8 bits before their matmuls, results to bfloat16: a few 2^-9
    # roundings (seen: 8e-3). lse comes from exact products summed in float32.
    "bfloat16": dict(out=1e-2, lse=1e-6, grad=2e-2),
    # As bfloat16 with 11 bits, 2^-11 per rounding (seen: 1.3e-3).
    "float16": dict(out=2e-3, lse=1e-6, grad=5e-3),
}
# jax's xla path runs its softmax in float32 even for float64 inputs: its float32 rounding.
TOL_JAX_F64 = 2e-6


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  window: tuple[int, int] = (-1, -1)  # (left, right), -1 unbounded; (-1, 0) is causal
  bias: str | None = None  # per axis of (B, N, T, S): "x" full extent, "1" broadcast
  mask: str | None = None
  q_len: tuple[int, ...] | None = None
  kv_len: tuple[int, ...] | None = None
  block_k: int | None = None
  neg_inf_bias: bool = False  # some bias entries and whole bias rows are -inf
  big: bool = False  # |logits| ~ 1e3..1e4 and bias entries of -1e30
  tied_big: bool = False  # bias of +1e30 on one, two or three keys of most rows (ties)


CASES = {
    "tiny": Case(1, 1, 1, 1, 1, 8),
    "causal_T<S_gqa_full_bias": Case(2, 7, 65, 4, 2, 8, (-1, 0), bias="xxxx", block_k=16),
    "causal_T>S_mqa_head_mask_block1": Case(1, 65, 7, 3, 1, 16, (-1, 0), mask="1x1x", block_k=1),
    "window_head_key_bias_kv_len": Case(2, 127, 239, 4, 4, 8, (5, 2), bias="1x1x",
                                         kv_len=(239, 100), block_k=32),
    "right_window_batch_key_bias_q_len": Case(3, 239, 127, 4, 2, 8, (-1, 4), bias="x11x",
                                              q_len=(0, 100, 300), block_k=16),
    "diagonal_band_neg_inf_bias_full_mask": Case(2, 65, 65, 2, 1, 8, (0, 2), bias="xxxx",
                                                 mask="xxxx", block_k=16, neg_inf_bias=True),
    "left_window_scalar_bias_long_q": Case(2, 1000, 7, 2, 2, 8, (10, -1), bias="1111",
                                           kv_len=(7, 3)),
    "long_kv_default_block_row_bias": Case(1, 7, 1000, 4, 2, 8, bias="11x1", mask="111x"),
    "band_lengths_zero_and_over": Case(4, 33, 70, 4, 2, 8, (3, 3), bias="xxxx",
                                       q_len=(0, 20, 40, 33), kv_len=(70, 0, 100, 35), block_k=16),
    # Windows past int32 cut nothing: the block arithmetic must not take them as int32.
    "windows_past_int32": Case(2, 65, 127, 4, 2, 8, (2**40, 2**31 - 1), bias="1x1x",
                               kv_len=(127, 50), block_k=16),
}
DTYPE_CASE = Case(2, 65, 127, 4, 2, 16, (-1, 0), bias="x1xx", mask="1x1x", kv_len=(127, 50),
                  block_k=16)
BIG_CASE = Case(1, 65, 127, 2, 1, 8, bias="x1xx", block_k=32, big=True)
TIED_BIG_CASE = Case(2, 33, 70, 4, 2, 8, (-1, 0), bias="xxxx", block_k=16, tied_big=True)


def _x64_if(dtype):
  return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def _extents(spec, full):
  return tuple(n if c == "x" else 1 for c, n in zip(spec, full))


def _inputs(case: Case, dtype, seed=0):
  """numpy operands holding values of `dtype`, and dout / dlse cotangents."""
  rng = np.random.default_rng(seed)
  B, T, S, N, K, H = case.B, case.T, case.S, case.N, case.K, case.H
  full = (B, N, T, S)
  q = rng.standard_normal((B, T, N, H))
  k = rng.standard_normal((B, S, K, H))
  v = rng.standard_normal((B, S, K, H))
  if case.big:
    q, k = 30 * q, 30 * k
  bias = mask = None
  if case.bias is not None:
    bias = rng.standard_normal(_extents(case.bias, full))
    if case.neg_inf_bias:
      bias[rng.random(bias.shape) < 0.3] = -np.inf
      bias[..., ::5, :] = -np.inf  # whole rows
    if case.big:
      bias[rng.random(bias.shape) < 0.2] = -1e30
    if case.tied_big:
      # lse = 1e30 + log(ties) rounds to 1e30 in every dtype: exp(S - lse) alone would give each
      # tied key P = 1. Row i (causal) picks from keys 0..i.
      for index in np.ndindex(bias.shape[:3]):
        i = index[2]
        ties = rng.integers(0, 4)
        bias[index][rng.choice(i + 1, size=min(ties, i + 1), replace=False)] = 1e30
  if case.mask is not None:
    mask = rng.random(_extents(case.mask, full)) < 0.7
  as_len = lambda x: None if x is None else np.asarray(x, np.int32)
  dout = rng.standard_normal((B, T, N, H))
  dlse = rng.standard_normal((B, N, T))
  cast = lambda x: None if x is None else x.astype(dtype)
  return dict(q=cast(q), k=cast(k), v=cast(v), bias=cast(bias), mask=mask,
              q_len=as_len(case.q_len), kv_len=as_len(case.kv_len)), cast(dout), dlse


def _config(case: Case) -> AttentionConfig:
  return AttentionConfig(1.0 / math.sqrt(case.H), *case.window)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ours(config, block_k, q, k, v, bias, mask, q_len, kv_len, dout, dlse):
  out, lse = _blockwise.forward(config, q, k, v, bias, mask, q_len, kv_len, block_k=block_k)
  grads = _blockwise.backward(config, q, k, v, bias, mask, q_len, kv_len, out, lse,
                              dout, dlse, block_k=block_k)
  return out, lse, grads


def _visibility(config, B, N, T, S, mask, q_len, kv_len):
  i = jnp.arange(T)[:, None]
  j = jnp.arange(S)[None, :]
  vis = jnp.ones((T, S), bool)
  if config.window_left >= 0:
    vis &= j >= i - config.window_left
  if config.window_right >= 0:
    vis &= j <= i + config.window_right
  vis = jnp.broadcast_to(vis, (B, N, T, S))
  if mask is not None:
    vis &= mask
  if q_len is not None:
    vis &= (i < q_len[:, None, None, None])
  if kv_len is not None:
    vis &= (j < kv_len[:, None, None, None])
  return vis


def _dense(config, q, k, v, bias, mask, q_len, kv_len):
  """(out (B, T, N, H), lse (B, N, T), live (B, N, T)) by the definition, in q's dtype."""
  B, T, N, _ = q.shape
  S, K = k.shape[1:3]
  k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * config.scale
  if bias is not None:
    s = s + bias
  seen = _visibility(config, B, N, T, S, mask, q_len, kv_len) & (s > -jnp.inf)
  live = jnp.any(seen, axis=-1)
  s = jnp.where(seen, s, 0.0)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(seen, s, -jnp.inf), axis=-1, keepdims=True))
  m = jnp.where(live[..., None], m, 0.0)
  e = jnp.where(seen, jnp.exp(s - m), 0.0)
  total = jnp.where(live, jnp.sum(e, axis=-1), 1.0)
  out = jnp.einsum("bnts,bsnh->btnh", e / total[..., None], v, precision="highest")
  lse = jnp.where(live, m[..., 0] + jnp.log(total), -jnp.inf)
  return out, lse, live


def _jax_nn(config, q, k, v, bias, mask, q_len, kv_len):
  T, S = q.shape[1], k.shape[1]
  left, right = config.window_left, config.window_right
  window = None
  if left >= 0 or right >= 0:
    window = (left if left >= 0 else T + S, right if right >= 0 else T + S)
  return jax.nn.dot_product_attention(
      q, k, v, bias, mask, scale=config.scale, query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len, local_window_size=window, implementation="xla")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _references(config, with_jax, q, k, v, bias, mask, q_len, kv_len, dout, dlse):
  """The definition's (out, lse, live) and gradients for the cotangents (dout, dlse); with
  `with_jax`, also jax.nn's output and its gradients for dout restricted to the live rows."""

  def dense(q, k, v, bias):
    out, lse, live = _dense(config, q, k, v, bias, mask, q_len, kv_len)
    return (out, lse), live

  (out, lse), vjp, live = jax.vjp(dense, q, k, v, bias, has_aux=True)
  dense_results = (out, lse, live, vjp((dout, jnp.where(live, dlse, 0.0))))
  if not with_jax:
    return dense_results, None
  dout_live = jnp.where(jnp.swapaxes(live, 1, 2)[..., None], dout, 0.0)
  jax_out, jax_vjp = jax.vjp(lambda q, k, v, bias: _jax_nn(config, q, k, v, bias, mask, q_len,
                                                           kv_len), q, k, v, bias)
  return dense_results, (jax_out, jax_vjp(dout_live))


def _f64(x):
  return None if x is None else np.asarray(x, np.float64)


def _err(ours, ref, rows=None):
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  if rows is not None:
    ours, ref = np.where(rows, ours, 0.0), np.where(rows, ref, 0.0)
  return float(np.max(np.abs(ours - ref), initial=0.0) / max(1.0, np.max(np.abs(ref), initial=0.0)))


def _check(case: Case, dtype, compare_jax: bool, tol=None):
  dtype = np.dtype(dtype)
  tol = tol or TOL[dtype.name]
  config = _config(case)
  ops, dout, dlse = _inputs(case, dtype)
  lse_dtype = np.float64 if dtype == np.float64 else np.float32
  with _x64_if(dtype):
    out, lse, grads = _ours(config, case.block_k, *ops.values(), dout, dlse.astype(lse_dtype))
    out, lse, grads = jax.device_get((out, lse, grads))
  dq, dk, dv, dbias = grads

  assert out.dtype == dtype and lse.dtype == lse_dtype
  assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
  assert (dbias is None) == (case.bias is None)
  if dbias is not None:
    assert dbias.shape == ops["bias"].shape and dbias.dtype == dtype
  for name, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias).items():
    if x is not None:
      assert not np.isnan(np.asarray(x, np.float64)).any(), name

  ops64 = {name: _f64(x) if name in ("q", "k", "v", "bias") else x for name, x in ops.items()}
  with jax.enable_x64(True):
    (ref_out, ref_lse, live, ref_grads), jax_results = jax.device_get(
        _references(config, compare_jax, *ops64.values(), _f64(dout), dlse))
  rows = np.swapaxes(live, 1, 2)[..., None]  # (B, T, N, 1)
  errors = {}

  # Rows that see no key: exactly 0, -inf and no gradient.
  dead = np.broadcast_to(~rows, out.shape)
  assert np.all(np.asarray(out, np.float64)[dead] == 0)
  assert np.all(np.isneginf(lse[~live]))
  assert np.all(np.asarray(dq, np.float64)[dead] == 0)
  assert np.all(np.isfinite(lse[live]))

  errors["out"] = _err(out, ref_out, rows)
  errors["lse"] = float(np.max(np.abs(np.where(live, lse - np.where(live, ref_lse, 0), 0)),
                               initial=0.0) / max(1.0, np.max(np.abs(ref_lse[live]), initial=0)))
  for name, ours, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
    if ours is not None:
      errors[name] = _err(ours, ref)
  for name, e in errors.items():
    assert e <= tol["out" if name == "out" else "lse" if name == "lse" else "grad"], (
        name, e, errors)

  if compare_jax:
    # jax.nn on the live rows, gradients of the output alone (no lse cotangent).
    dout_live = np.where(rows, _f64(dout), 0.0)
    with _x64_if(dtype):
      _, _, grads_o = jax.device_get(_ours(config, case.block_k, *ops.values(),
                                           dout_live.astype(dtype), np.zeros_like(lse)))
    jax_out, jax_grads = jax_results
    tol_jax = {"float64": TOL_JAX_F64}.get(dtype.name, tol["grad"])
    assert _err(out, jax_out, rows) <= max(tol_jax, tol["out"])
    for name, ours, ref in zip(("dq", "dk", "dv", "dbias"), grads_o, jax_grads):
      if ours is not None:
        assert _err(ours, ref) <= max(tol_jax, tol["grad"]), name
  return errors


# Compared with jax.nn too: the cases whose visibility comes from jax's own arguments (windows,
# causality, lengths). jax.nn's gradient is NaN on rows whose logits are all -inf, and that
# spreads to dk/dv, so the -inf bias case is compared with the definition alone.
JAX_CASES = ("causal_T<S_gqa_full_bias", "causal_T>S_mqa_head_mask_block1",
             "window_head_key_bias_kv_len", "right_window_batch_key_bias_q_len",
             "left_window_scalar_bias_long_q", "band_lengths_zero_and_over")


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_references(name):
  _check(CASES[name], np.float64, compare_jax=name in JAX_CASES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes_match_references(dtype):
  _check(DTYPE_CASE, BF16 if dtype == "bfloat16" else np.dtype(dtype), compare_jax=True)


def test_large_logits_stay_finite_and_accurate():
  # Logits ~ 1e4 carry an absolute float32 rounding of ~1e-3 (their own ulp, and lse's in
  # P = exp(s - lse)), which the output and gradients inherit (seen: 5e-5).
  _check(BIG_CASE, np.float32, compare_jax=False, tol=dict(out=2e-4, lse=1e-6, grad=5e-4))


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_tied_extreme_bias(dtype):
  # Rows whose maximum logit (1e30) is tied between keys: P splits evenly between them.
  _check(TIED_BIG_CASE, BF16 if dtype == "bfloat16" else np.dtype(dtype), compare_jax=False)


def test_renormalization_is_skipped_exactly_when_unneeded():
  case = DTYPE_CASE
  config = _config(case)
  ops, dout, dlse = _inputs(case, np.float32)
  out, lse = _blockwise.forward(config, *ops.values(), block_k=case.block_k)
  assert not bool(_blockwise.needs_renormalization(lse))
  assert bool(_blockwise.needs_renormalization(lse.at[0, 0, 0].set(-_blockwise.RENORMALIZE_FROM)))
  assert not bool(_blockwise.needs_renormalization(lse.at[0, 0, 0].set(-np.inf)))
  args = (config, *ops.values(), out, lse, dout, dlse.astype(np.float32))
  with_pass = jax.device_get(_blockwise.backward(*args, block_k=case.block_k, renormalize=True))
  without = jax.device_get(_blockwise.backward(*args, block_k=case.block_k, renormalize=False))
  for a, b in zip(jax.tree.leaves(with_pass), jax.tree.leaves(without)):
    np.testing.assert_array_equal(a, b)


def test_deterministic():
  case = DTYPE_CASE
  ops, dout, dlse = _inputs(case, np.float32)
  config = _config(case)
  run = lambda: jax.device_get(_ours(config, case.block_k, *ops.values(), dout,
                                     dlse.astype(np.float32)))
  first, again = run(), run()
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)


def test_jit_and_vmap_compose():
  # vmap over q, kv_len and the cotangent, k/v/bias shared: the forward and the backward agree
  # with separate calls per mapped problem.
  case = Case(2, 20, 40, 4, 2, 8, (-1, 0), bias="1x1x", kv_len=(40, 25), block_k=16)
  config = _config(case)
  ops, _, dlse = _inputs(case, np.float32)
  rng = np.random.default_rng(1)
  qs = rng.standard_normal((3,) + ops["q"].shape).astype(np.float32)
  douts = rng.standard_normal((3,) + ops["q"].shape).astype(np.float32)
  kv_lens = np.asarray([[40, 25], [10, 0], [33, 40]], np.int32)
  dlse = dlse.astype(np.float32)
  k, v, bias = ops["k"], ops["v"], ops["bias"]

  def one(q, kv_len, dout):
    return _ours(config, case.block_k, q, k, v, bias, None, None, kv_len, dout, dlse)

  mapped = jax.device_get(jax.jit(jax.vmap(one))(qs, kv_lens, douts))
  for i in range(3):
    single = jax.device_get(one(qs[i], kv_lens[i], douts[i]))
    for a, b in zip(jax.tree.leaves(mapped), jax.tree.leaves(single)):
      np.testing.assert_allclose(a[i], b, rtol=2e-5, atol=2e-5)


def test_block_size_rule():
  MiB = 1 << 20
  assert _blockwise.block_size(1, 16, 2048, 2048) == 512
  # 64 * 16384 * 128 * 4 B = 512 MiB is over the budget: 64 keys, 256 MiB.
  assert _blockwise.block_size(1, 64, 16384, 16384) == 64
  assert _blockwise.block_size(64, 64, 16384, 16384) == _blockwise.BLOCK_K_MIN
  assert _blockwise.block_size(1, 1, 1, 100) == 100  # one block
  assert _blockwise.block_size(1, 1, 1, 600) == 304  # two even blocks, a multiple of 16
  for args in [(1, 1, 1, 1000), (2, 8, 999, 777), (1, 4, 5, 5000), (3, 40, 3000, 9000)]:
    bk = _blockwise.block_size(*args)
    assert 1 <= bk <= min(_blockwise.BLOCK_K_MAX, args[3])
    assert bk == _blockwise.BLOCK_K_MIN or args[0] * args[1] * args[2] * bk * 4 <= 256 * MiB


def test_memory_scales_with_the_block_not_with_s():
  # T = S = 4096, 8 heads, a full-size bias: one float32 (B, N, T, S) array is 512 MiB.
  B, T, S, N, K, H = 1, 4096, 4096, 8, 8, 64
  config = AttentionConfig(1 / 8, -1, 0)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  q, k, lse, bias = f32(B, T, N, H), f32(B, S, K, H), f32(B, N, T), f32(B, N, T, S)
  kv_len = jax.ShapeDtypeStruct((B,), jnp.int32)
  full = B * N * T * S * 4
  bk = _blockwise.block_size(B, N, T, S)
  logits_block = B * N * T * bk * 4
  operands = 4 * B * T * N * H * 4  # transposed copies of q, k, v, dout / out

  def temp(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

  fwd = temp(lambda q, k, v, b, kl: _blockwise.forward(config, q, k, v, b, None, None, kl),
             q, k, k, bias, kv_len)
  bwd = temp(lambda q, k, v, b, kl, o, l, do, dl: _blockwise.backward(
      config, q, k, v, b, None, None, kl, o, l, do, dl), q, k, k, bias, kv_len, q, lse, q, lse)
  # No copy of the bias, no T x S array: a few logits blocks and copies of the operands.
  assert fwd <= 3 * logits_block + operands, fwd / 2**20
  assert bwd <= 6 * logits_block + operands, bwd / 2**20
  assert bwd < full, bwd / 2**20
