"""Test cases, their inputs, and the comparisons against the references."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_flash
from jax_flash import _blockwise, _config
from jax_flash._validation import canonicalize

import _reference as ref
from _tolerances import allowed_error, gamma

from _reference import BIG


def np_dtype(name) -> np.dtype:
  return np.dtype(ml_dtypes.bfloat16) if str(name) == "bfloat16" else np.dtype(name)


def lse_dtype(dtype) -> np.dtype:
  return np.dtype(np.float64) if np_dtype(dtype) == np.float64 else np.dtype(np.float32)


def default_dtype(platform: str) -> str:
  """float32 on the CPU; the first compiled dtype on the GPU."""
  return "float32" if platform == "cpu" else _config.GPU_DTYPES[0].name


def default_head_dim(platform: str) -> int:
  """Small on the CPU (speed); the smallest compiled tile on the GPU."""
  return 16 if platform == "cpu" else min(_config.GPU_HEAD_DIMS)


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem. bias/mask are shape specs over the letters B, N, T, S and '1'
  (extent 1), e.g. "B1TS" or "TS" (rank 2, leading axes added as in jax)."""

  T: int
  S: int
  B: int | None = 2  # None: unbatched (T, N, H) inputs
  N: int = 2
  K: int | None = None  # None: K == N
  H: int = 16
  dtype: str = "float32"
  is_causal: bool = False
  window: Any = None
  bias: str | None = None
  mask: str | None = None
  q_lens: tuple | None = None
  kv_lens: tuple | None = None
  scale: float | None = None
  std: float = 1.0  # standard deviation of query and key entries
  extreme_bias: bool = False  # bias entries of +-BIG and -inf; key 0 always finite
  dead_rows: bool = False  # the mask hides every key from every third query row
  softcap: float | None = None  # logits_soft_cap (jax_flash only: jax's path has none)
  # Segment ids (jax_flash only), both or neither: the run lengths of ids 0, 1, 2, ... along T
  # (q_segs) and S (kv_segs), e.g. (20, 37, 13); a run of length 0 leaves its id out of that
  # side. One tuple for every batch item, or a tuple of them, one per batch item.
  q_segs: tuple | None = None
  kv_segs: tuple | None = None
  shuffle_segs: str | None = None  # "q", "kv" or "both": those ids in random (unsorted) order

  @property
  def kv_heads(self) -> int:
    return self.N if self.K is None else self.K

  @property
  def batch(self) -> int:
    return 1 if self.B is None else self.B

  def replace(self, **kw) -> "Case":
    return dataclasses.replace(self, **kw)

  @property
  def beyond_jax_nn(self) -> bool:
    """Whether the case uses jax_flash's extensions (soft-capping, segment ids), which jax's
    own path cannot compute: its baselines are then the definition in the input dtype."""
    return self.softcap is not None or self.q_segs is not None

  def kwargs(self) -> dict:
    return dict(scale=self.scale, is_causal=self.is_causal, window=self.window)

  def shape_of(self, spec: str) -> tuple:
    sizes = dict(B=self.batch, N=self.N, T=self.T, S=self.S)
    return tuple(1 if c == "1" else sizes[c] for c in spec)

  def __str__(self) -> str:
    parts = [f"B{self.B}", f"T{self.T}", f"S{self.S}", f"N{self.N}", f"K{self.kv_heads}",
             f"H{self.H}", self.dtype]
    for name in ("is_causal", "window", "bias", "mask", "q_lens", "kv_lens", "scale",
                 "extreme_bias", "dead_rows", "softcap", "q_segs", "kv_segs", "shuffle_segs"):
      value = getattr(self, name)
      if value not in (None, False):
        parts.append(f"{name}={value}")
    if self.std != 1.0:
      parts.append(f"std={self.std}")
    return "-".join(str(p) for p in parts)


@dataclasses.dataclass
class Inputs:
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  bias: np.ndarray | None
  mask: np.ndarray | None
  q_lens: np.ndarray | None
  kv_lens: np.ndarray | None
  q_seg: np.ndarray | None = None
  kv_seg: np.ndarray | None = None


def segment_ids(runs: tuple, batch: int | None, length: int, shuffle: bool, rng) -> np.ndarray:
  """Ids from run lengths (see Case.q_segs): (batch, length) int32, (length,) when unbatched."""
  rows = runs if runs and isinstance(runs[0], tuple) else (runs,) * (batch or 1)
  assert len(rows) == (batch or 1), f"one tuple of runs per batch item, got {runs}"
  ids = []
  for row in rows:
    assert sum(row) == length, f"runs {row} must add up to {length}"
    x = np.repeat(np.arange(len(row), dtype=np.int32), row)
    ids.append(rng.permutation(x) if shuffle else x)
  ids = np.stack(ids)
  return ids[0] if batch is None else ids


def make_inputs(case: Case, seed: int = 0) -> Inputs:
  rng = np.random.default_rng(seed)
  dt = np_dtype(case.dtype)
  lead = () if case.B is None else (case.B,)
  qshape = lead + (case.T, case.N, case.H)
  kshape = lead + (case.S, case.kv_heads, case.H)

  def normal(shape, std=1.0):
    return (rng.standard_normal(shape) * std).astype(np.float64).astype(dt)

  q, k, v = normal(qshape, case.std), normal(kshape, case.std), normal(kshape)
  bias = mask = None
  if case.bias is not None:
    bias = rng.standard_normal(case.shape_of(case.bias))
    if case.extreme_bias:
      assert case.bias.endswith("S"), "extreme bias entries need a bias over keys"
      big = min(BIG, float(ml_dtypes.finfo(dt).max))
      u = rng.random(bias.shape)
      bias = np.where(u < 0.05, big, bias)
      bias = np.where((u >= 0.05) & (u < 0.2), -big, bias)
      bias = np.where((u >= 0.2) & (u < 0.3), -np.inf, bias)
      bias[..., 0] = rng.standard_normal(bias[..., 0].shape)
    bias = bias.astype(dt)
  if case.mask is not None:
    mask = rng.random(case.shape_of(case.mask)) < 0.8
    if case.dead_rows:
      assert "T" in case.mask, "dead rows need a mask with a T axis"
      mask[..., ::3, :] = False
  q_lens = None if case.q_lens is None else np.asarray(case.q_lens, np.int32)
  kv_lens = None if case.kv_lens is None else np.asarray(case.kv_lens, np.int32)
  q_seg = kv_seg = None
  if case.q_segs is not None:
    shuffle = case.shuffle_segs or ""
    q_seg = segment_ids(case.q_segs, case.B, case.T, shuffle in ("q", "both"), rng)
    kv_seg = segment_ids(case.kv_segs, case.B, case.S, shuffle in ("kv", "both"), rng)
  return Inputs(q, k, v, bias, mask, q_lens, kv_lens, q_seg, kv_seg)


def visibility(case: Case, inp: Inputs) -> np.ndarray:
  """(B, N, T, S) visibility; B == 1 for unbatched cases."""
  return ref.visibility(case.batch, case.N, case.T, case.S, mask=inp.mask,
                        is_causal=case.is_causal, window=case.window, q_lens=inp.q_lens,
                        kv_lens=inp.kv_lens, q_seg=inp.q_seg, kv_seg=inp.kv_seg)


def live_rows(case: Case, vis: np.ndarray) -> np.ndarray:
  """Rows of the output that see at least one key: (B, T, N), or (T, N) when unbatched."""
  live = np.swapaxes(vis.any(-1), 1, 2)
  return live[0] if case.B is None else live


def as_jax(x):
  return None if x is None else jnp.asarray(x)


def handler_attrs(**overrides):
  """The attributes of a direct FFI call of jax_flash's forward or backward handler: a plain
  call (scale 1/8, no window, no optional operand), with `overrides`."""
  attrs = dict(scale=np.float64(0.125), softcap=np.float64(0.0), window_left=np.int64(-1),
               window_right=np.int64(-1), has_bias=False, has_bias_blocks=False, has_mask=False,
               has_mask_blocks=False, has_q_seqlens=False, has_kv_seqlens=False,
               has_segment_ids=False, deterministic=False, has_dbias=False,
               query_groups=np.int64(1), block_m=np.int64(0))
  attrs.update(overrides)
  return attrs


def ours_function(case: Case, *, return_residual=False):
  """f(q, k, v, bias, mask, q_lens, kv_lens, q_seg, kv_seg) calling jax_flash with the case's
  options."""

  def f(q, k, v, bias=None, mask=None, q_lens=None, kv_lens=None, q_seg=None, kv_seg=None):
    return jax_flash.dot_product_attention(
        q, k, v, bias, mask, scale=case.scale, is_causal=case.is_causal,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        local_window_size=case.window, return_residual=return_residual,
        logits_soft_cap=case.softcap, query_segment_ids=q_seg, key_value_segment_ids=kv_seg)

  return f


def run_ours(case: Case, inp: Inputs, *, return_residual=False, wrap=jax.jit):
  """jax_flash on the inputs, under `wrap` (jit by default: one compilation per case instead of
  one per eager op; test_transforms.py also runs it eagerly)."""
  with ref.x64_if(case.dtype):
    args = [as_jax(x) for x in (inp.q, inp.k, inp.v, inp.bias, inp.mask, inp.q_lens,
                                inp.kv_lens, inp.q_seg, inp.kv_seg)]
    f = ours_function(case, return_residual=return_residual)
    result = (f if wrap is None else wrap(f))(*args)
    return jax.tree.map(np.asarray, result)


def _operands(inp: Inputs):
  return (inp.q, inp.k, inp.v, inp.bias, inp.mask, inp.q_lens, inp.kv_lens)


def reference_hi(case: Case, inp: Inputs, vis: np.ndarray):
  """(out, lse) of the definition in float64 on the CPU (x64 scoped to this call)."""
  with ref.precise():
    out, lse = ref.attention_with_lse(*(jnp.asarray(x, jnp.float64) for x in (inp.q, inp.k, inp.v)),
                                      None if inp.bias is None else
                                      jnp.asarray(inp.bias, jnp.float64), vis, scale=case.scale,
                                      softcap=case.softcap)
    return np.asarray(out), np.asarray(lse)


def cudnn_eligible(case: Case) -> bool:
  """Cases whose semantics cuDNN shares: no local window, causal only for square problems, no
  jax_flash extension."""
  return (case.window is None and (not case.is_causal or case.T == case.S)
          and not case.beyond_jax_nn)


def baseline_device(dtype, platform: str):
  """Where the baselines in `dtype` (xla, the definition) run: on the platform, but on the CPU
  for float32, whose matmuls XLA runs in TF32 on the GPU at jax's default precision: a TF32
  baseline would allow TF32's error."""
  if platform == "gpu" and np_dtype(dtype) == np.float32:
    return jax.default_device(ref.cpu_device())
  return contextlib.nullcontext()


def forward_baseline(case: Case, inp: Inputs, platform: str):
  """(output, name): cuDNN on the GPU where it supports the case, else xla in the input dtype
  (see `baseline_device`); (None, None) for float64, which has no baseline."""
  dt = np_dtype(case.dtype)
  if dt == np.float64:
    return None, None
  if platform == "gpu" and cudnn_eligible(case):
    try:
      f = ref.xla_function(dt, implementation="cudnn", **case.kwargs())
      return np.asarray(f(*_operands(inp))), "cudnn"
    except Exception:  # cuDNN rejects the case: fall back to xla, as the criterion says
      pass
  with baseline_device(dt, platform):
    if xla_unavailable(dt, platform) or case.beyond_jax_nn:
      out, _ = definition_output(case, inp, dt)
      return np.asarray(out), f"definition in {dt.name}"
    f = ref.xla_function(dt, **case.kwargs())
    return np.asarray(f(*_operands(inp))), "xla"


def xla_unavailable(dtype, platform: str) -> bool:
  """jax's float16 path cannot be compiled whole on XLA:CPU (it asks for an F16_F16_F32 dot).
  Run eagerly it falls back to the default precision op by op, which is slow; what it then
  computes on live rows is the definition in float16 (logits from a float32-accumulated dot,
  softmax in float32, P rounded to float16, P.V in float16), which serves as the baseline.
  The same definition in the input dtype is the baseline of the cases that use jax_flash's
  extensions (soft-capping, segment ids), which jax's path cannot compute."""
  return np_dtype(dtype) == np.float16 and platform == "cpu"


def definition_output(case: Case, inp: Inputs, dtype, vis=None):
  """(out, lse) of the definition on the inputs cast to dtype, on the default device."""
  vis = visibility(case, inp) if vis is None else vis
  cast = [None if x is None else jnp.asarray(x).astype(dtype)
          for x in (inp.q, inp.k, inp.v, inp.bias)]
  return ref.attention_with_lse(*cast, vis, scale=case.scale, softcap=case.softcap)


def lse_baseline(case: Case, inp: Inputs):
  """xla's float32 log-sum-exp of the upcast inputs, on the CPU (the definition in float32 for
  cases beyond jax.nn); None for float64."""
  return _xla_float32_on_cpu(case, inp)[1]


def _xla_float32_on_cpu(case: Case, inp: Inputs):
  if np_dtype(case.dtype) == np.float64:
    return None, None
  with jax.default_device(ref.cpu_device()):
    if case.beyond_jax_nn:
      return tuple(np.asarray(x) for x in definition_output(case, inp, np.float32))
    f = ref.xla_function(np.float32, return_residual=True, **case.kwargs())
    return tuple(np.asarray(x) for x in f(*_operands(inp)))


def assert_close(what: str, ours, ref_hi, baseline, *, kind: str, dtype, result_dtype=None,
                 chain: int = 0, logit_max: float = 0.0, note: str = "", propagated=None):
  """The criterion of _tolerances on one result (already restricted to live entries).

  propagated: optional elementwise error inherited through the backward's row term (see
  `row_term_error`), subtracted from the error before the criterion applies.
  """
  ours = np.asarray(ours, np.float64)
  ref_hi = np.asarray(ref_hi, np.float64)
  assert ours.shape == ref_hi.shape, (what, ours.shape, ref_hi.shape)
  if ours.size == 0:
    return
  assert np.isfinite(ours).all(), f"{what}: non-finite values where the reference is finite"
  deviation = np.abs(ours - ref_hi)
  magnitude = np.abs(ref_hi)
  if propagated is not None:
    deviation = np.maximum(deviation - propagated, 0.0)
    magnitude = magnitude + propagated  # ours legitimately holds values this large: the
    # rounding granularity of the result applies at this magnitude
  error = float(deviation.max())
  ref_max = float(magnitude.max())
  base_error = None
  if baseline is not None:
    base_error = float(np.abs(np.asarray(baseline, np.float64) - ref_hi).max())
  allowed = allowed_error(kind, dtype, baseline_error=base_error, ref_max=ref_max,
                          result_dtype=result_dtype, chain=chain, logit_max=logit_max)
  assert error <= allowed, (
      f"{what}: max error {error:.3g} > allowed {allowed:.3g} (baseline {note} error "
      f"{base_error}, max |ref| {ref_max:.3g})")


def check_forward(case: Case, platform: str = "cpu", seed: int = 0, inp: Inputs | None = None,
                  wrap=jax.jit):
  """Output and lse against the references; rows that see no key are exactly 0 and -inf."""
  inp = make_inputs(case, seed) if inp is None else inp
  dt = np_dtype(case.dtype)
  out, lse = run_ours(case, inp, return_residual=True, wrap=wrap)
  assert out.shape == inp.q.shape and out.dtype == dt, (out.shape, out.dtype)
  assert lse.shape == inp.q.shape[:-1] and lse.dtype == lse_dtype(dt), (lse.shape, lse.dtype)

  vis = visibility(case, inp)
  live = live_rows(case, vis)
  out64 = out.astype(np.float64)
  dead_out = out64[~live]
  assert np.all(dead_out == 0), f"rows that see no key must be 0, got max |out| {np.abs(dead_out).max()}"
  assert np.all(lse[~live] == -np.inf), "rows that see no key must have lse -inf"
  assert np.isfinite(out64).all(), "non-finite output"

  ref_out, ref_lse = reference_hi(case, inp, vis)
  if platform == "cpu" and dt == np.float32:  # one xla call gives both baselines
    (base_out, base_lse), base_name = _xla_float32_on_cpu(case, inp), "xla"
    if case.beyond_jax_nn:
      base_name = "definition in float32"
  else:
    base_out, base_name = forward_baseline(case, inp, platform)
    base_lse = lse_baseline(case, inp)
  L = ref.logits_max(inp.q, inp.k, inp.bias, vis, scale=case.scale)
  chain = case.S + case.H
  assert_close(f"output [{case}]", out64[live], ref_out[live],
               None if base_out is None else base_out[live], kind="fwd", dtype=dt,
               chain=chain, logit_max=L, note=base_name or "")
  assert_close(f"lse [{case}]", lse[live], ref_lse[live],
               None if base_lse is None else base_lse[live], kind="lse", dtype=dt,
               result_dtype=lse_dtype(dt), chain=chain, logit_max=L, note="xla float32")
  return out, lse


def _grad_argnums(inp: Inputs, bias_gradient: bool = True):
  return (0, 1, 2, 3) if inp.bias is not None and bias_gradient else (0, 1, 2)


def cotangents(case: Case, inp: Inputs, vis: np.ndarray, seed: int):
  """Random output and lse cotangents, zero on rows that see no key (where jax's xla path
  averages the values instead of returning 0, so its gradients differ by design)."""
  rng = np.random.default_rng(seed + 1000)
  dt = np_dtype(case.dtype)
  live = live_rows(case, vis)
  dout = rng.standard_normal(inp.q.shape) * live[..., None]
  dlse = rng.standard_normal(inp.q.shape[:-1]) * live
  return dout.astype(dt), dlse.astype(lse_dtype(dt))


def vjp(f, primals, cotangent, *, with_primal_out=False):
  primal_out, pullback = jax.vjp(f, *primals)
  grads = [np.asarray(g) for g in pullback(cotangent)]
  return (grads, jax.tree.map(np.asarray, primal_out)) if with_primal_out else grads


def probabilities(case: Case, inp: Inputs, vis: np.ndarray) -> np.ndarray:
  """Softmax of the visible scaled, soft-capped, biased logits in float64, (B, N, T, S); 0 on
  empty rows."""
  q, k = (np.asarray(x, np.float64) for x in (inp.q, inp.k))
  if case.B is None:
    q, k = q[None], k[None]
  G = case.N // case.kv_heads
  scale = 1.0 / np.sqrt(case.H) if case.scale is None else case.scale
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2)) * scale
  if case.softcap is not None:
    logits = case.softcap * np.tanh(logits / case.softcap)
  if inp.bias is not None:
    logits = logits + ref.rank4(np.asarray(inp.bias, np.float64))
  logits = np.where(vis, np.broadcast_to(logits, vis.shape), -np.inf)
  live = vis.any(-1, keepdims=True)
  peak = np.where(live, logits.max(-1, keepdims=True), 0.0)
  p = np.where(vis, np.exp(logits - peak), 0.0)
  return p / np.where(live, p.sum(-1, keepdims=True), 1.0)


def row_term_error(case: Case, inp: Inputs, vis: np.ndarray, out_ours, out_hi, dout):
  """Elementwise first-order error the gradients inherit from the row term of the backward.

  The backward forms dS = P * (dP - D) with dP = dO . v and D = rowsum(dO * O) - dlse
  (_primitive.py), as FlashAttention does: a difference of two length-H dot products, where
  O is the forward's rounded output. Exactly, sum_j dS_ij = -dlse_i; computed, the difference
  carries (1) the output's own error, already judged by the forward criterion, through
  dO . (O_ours - O_exact), and (2) the rounding of both dot products in the accumulation type,
  at most gamma_H * sum_h |terms| each (Higham). Both reach dS multiplied by P and from there
  dq, dk and dbias (dv does not use the row term). They dominate where the exact result is
  (close to) zero while its terms are not: a bias broadcast over keys (its exact gradient is
  0, softmax being shift invariant) or a single key (S == 1: dS is exactly 0). With
  soft-capping dq and dk receive dS times the cap's derivative, which is at most 1: the same
  bound holds.
  Returns arrays shaped like (dq, dk, dv, dbias or None).
  """
  def batched(x):
    x = np.asarray(x, np.float64)
    return x[None] if case.B is None else x

  q, k, v, dout = batched(inp.q), batched(inp.k), batched(inp.v), batched(dout)
  out_ours = batched(out_ours)
  d_out = out_ours - batched(out_hi)
  G = case.N // case.kv_heads
  scale = 1.0 / np.sqrt(case.H) if case.scale is None else abs(case.scale)
  accumulation = np.float64 if np_dtype(case.dtype) == np.float64 else np.float32
  g = gamma(case.H, accumulation)
  delta_d = (np.abs(np.einsum("btnh,btnh->bnt", dout, d_out)) +
             g * np.einsum("btnh,btnh->bnt", np.abs(dout), np.abs(out_ours)))
  delta_dp = g * np.einsum("btnh,bsnh->bnts", np.abs(dout), np.abs(np.repeat(v, G, axis=2)))
  err_ds = probabilities(case, inp, vis) * (delta_d[..., None] + delta_dp)  # (B, N, T, S)
  dq = scale * np.einsum("bnts,bsnh->btnh", err_ds, np.abs(np.repeat(k, G, axis=2)))
  dk = scale * np.einsum("bnts,btnh->bsnh", err_ds, np.abs(q))
  dk = dk.reshape(dk.shape[:2] + (case.kv_heads, G, case.H)).sum(3)
  dv = np.zeros_like(dk)
  dbias = None
  if inp.bias is not None:
    bshape = ref.rank4(np.asarray(inp.bias)).shape
    axes = tuple(a for a in range(4) if bshape[a] == 1)
    dbias = err_ds.sum(axis=axes, keepdims=True).reshape(np.shape(inp.bias))
  if case.B is None:
    dq, dk, dv = dq[0], dk[0], dv[0]
  return dq, dk, dv, dbias


def check_gradients(case: Case, platform: str = "cpu", seed: int = 0, *, through_lse=False,
                    inp: Inputs | None = None, grad_fn=None, bias_gradient=True):
  """dq, dk, dv (and dbias) against those of the definition in float64, with the baseline's
  error as the yardstick (xla or cuDNN in the input dtype). With through_lse the cotangent also
  reaches the returned log-sum-exp; jax's path stops that gradient, so the baseline is then the
  definition in the input dtype. grad_fn(f, primals, cotangent) -> (grads, primal output)
  replaces jax.vjp for ours (to go through jax.grad, jit, checkpoint...). Without
  bias_gradient a bias is a constant of the differentiated function (no dbias)."""
  inp = make_inputs(case, seed) if inp is None else inp
  dt = np_dtype(case.dtype)
  vis = visibility(case, inp)
  dout, dlse = cotangents(case, inp, vis, seed)
  argnums = _grad_argnums(inp, bias_gradient)
  ops = _operands(inp)
  diff = [ops[i] for i in argnums]

  def split(fn):
    """fn of all operands -> function of the differentiable ones."""
    def g(*d):
      full = list(ops)
      for i, x in zip(argnums, d):
        full[i] = x
      return fn(*full)
    return g

  ours_f = jax.jit(ours_function(case, return_residual=through_lse))
  segments = (inp.q_seg, inp.kv_seg)  # operands of ours only (jax's path has none)
  with ref.x64_if(dt):
    ours, ours_out = (grad_fn or functools.partial(vjp, with_primal_out=True))(
        split(lambda *operands: ours_f(*operands, *segments)), [jnp.asarray(x) for x in diff],
        (jnp.asarray(dout), jnp.asarray(dlse)) if through_lse else jnp.asarray(dout))
    ours = [np.asarray(g) for g in ours]
    ours_out = jax.tree.map(np.asarray, ours_out)
  if through_lse:
    ours_out = ours_out[0]

  def definition(dtype, with_primal_out=False):
    """vjp of the definition on the inputs cast to dtype (gradients in dtype)."""
    constant_bias = None if inp.bias is None else jnp.asarray(inp.bias).astype(dtype)

    def f(*d):
      out, lse = ref.attention_with_lse(*d[:3], d[3] if len(d) > 3 else constant_bias, vis,
                                        scale=case.scale, softcap=case.softcap)
      return (out, lse) if through_lse else out
    ct = jnp.asarray(dout).astype(dtype)
    if through_lse:
      ct = (ct, jnp.asarray(dlse).astype(lse_dtype(dtype)))
    return vjp(f, [jnp.asarray(x).astype(dtype) for x in diff], ct,
               with_primal_out=with_primal_out)

  with ref.precise():
    hi, out_hi = definition(np.float64, with_primal_out=True)
  if through_lse:
    out_hi = out_hi[0]
  base, base_name = None, None
  if dt != np.float64:
    base_name = "xla"
    if not through_lse and platform == "gpu" and cudnn_eligible(case):
      try:
        f = split(ref.xla_function(dt, implementation="cudnn", **case.kwargs()))
        base, base_name = vjp(f, [jnp.asarray(x) for x in diff], jnp.asarray(dout)), "cudnn"
      except Exception:  # cuDNN rejects the case: xla in the same dtype instead
        base = None
    if base is None:
      with baseline_device(dt, platform):
        if through_lse:  # jax's path stops the lse gradient: the definition in the input dtype
          base_name = "definition in the input dtype"
          base = definition(dt)
        elif xla_unavailable(dt, platform) or case.beyond_jax_nn:
          base_name = f"definition in {dt.name}"
          base = definition(dt)
        else:
          base_name = "xla"
          f = split(ref.xla_function(dt, **case.kwargs()))
          base = vjp(f, [jnp.asarray(x) for x in diff], jnp.asarray(dout))
  L = ref.logits_max(inp.q, inp.k, inp.bias, vis, scale=case.scale)
  inherited = row_term_error(case, inp, vis, ours_out, out_hi, dout)
  names = ("dq", "dk", "dv", "dbias")
  for name, i, g, h, b, e in zip(names, argnums, ours, hi, base or [None] * 4, inherited):
    primal = ops[i]
    assert g.shape == primal.shape and g.dtype == primal.dtype, (name, g.shape, g.dtype)
    assert_close(f"{name} [{case}]", g, h, b, kind="grad_cudnn" if base_name == "cudnn" else "grad",
                 dtype=dt,
                 chain=case.S + case.T + case.H, logit_max=L, note=base_name or "",
                 propagated=e)
  return ours


# --- the blockwise path called directly ----------------------------------------------------------

BLOCKWISE_BLOCK_K = 16  # several key blocks, the last one overlapping its predecessor


def blockwise_run(case: Case, inp):
  """run(q, k, v, bias, dout, dlse) -> ([dq, dk, dv(, dbias)], (out, lse)): _blockwise.forward,
  then _blockwise.backward with the output and lse cotangents (no jax differentiation
  involved); mask, lengths, soft-cap and segment ids are the case's. One compilation serves
  the forward check and the gradient check."""
  assert case.scale is None or case.scale >= 0, "a negative scale negates the query"

  @jax.jit
  def run(q, k, v, bias, dout, dlse):
    call = canonicalize(q, k, v, bias, inp.mask, scale=case.scale, is_causal=case.is_causal,
                        query_seq_lengths=inp.q_lens, key_value_seq_lengths=inp.kv_lens,
                        local_window_size=case.window, logits_soft_cap=case.softcap,
                        query_segment_ids=inp.q_seg, key_value_segment_ids=inp.kv_seg)
    args = (call.config, call.query, call.key, call.value, call.bias, call.mask,
            call.query_seq_lengths, call.key_value_seq_lengths)
    segments = dict(q_seg=call.query_segment_ids, kv_seg=call.key_value_segment_ids)
    out, lse = _blockwise.forward(*args, **segments, block_k=BLOCKWISE_BLOCK_K)
    dout = dout.reshape(out.shape)
    dlse = jnp.swapaxes(dlse.reshape(lse.shape[:1] + dlse.shape[-2:]), -1, -2)
    dq, dk, dv, dbias = _blockwise.backward(*args, out, lse, dout, dlse, **segments,
                                            block_k=BLOCKWISE_BLOCK_K)
    grads = [g.reshape(x.shape) for g, x in ((dq, q), (dk, k), (dv, v))]
    if bias is not None:
      grads.append(dbias.reshape(bias.shape))
    lse = jnp.swapaxes(lse, -1, -2)
    return grads, ((out[0], lse[0]) if call.unbatched else (out, lse))

  return run


def blockwise_forward(run):
  """A `wrap` for check_forward: f(q, k, v, bias, ...) -> (out, lse) from `run`."""
  def f(q, k, v, bias=None, *unused):  # the other operands: the case's, already in `run`
    lse = jnp.zeros(q.shape[:-1], _config.accumulation_dtype(q.dtype))
    return run(q, k, v, bias, jnp.zeros_like(q), lse)[1]
  return lambda ours: f


def blockwise_grads(run):
  """A grad_fn for check_gradients from `run`."""
  def grad_fn(f, primals, cotangent):
    del f
    q, k, v, *bias = primals
    through_lse = isinstance(cotangent, tuple)
    dout, dlse = cotangent if through_lse else (cotangent, None)
    if dlse is None:
      dlse = jnp.zeros(q.shape[:-1], _config.accumulation_dtype(q.dtype))
    grads, (out, lse) = run(q, k, v, bias[0] if bias else None, dout, dlse)
    return grads, ((out, lse) if through_lse else out)

  return grad_fn


def check_ordered_dq_reduction(q, k, v, **options):
  """jax_flash's gradients with the ordered dQ reduction (deterministic=True), for a loss that
  weighs every query row differently: bit-identical from run to run, and equal to the unordered
  reduction's within rounding of the sums' order."""
  def grads(deterministic):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, deterministic=deterministic, **options)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[1]))[:, None, None])
    return [np.asarray(g.astype(jnp.float32)) for g in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)]

  first, second, unordered = grads(True), grads(True), grads(False)
  for a, b, c in zip(first, second, unordered):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=2e-2, atol=2e-2 * np.abs(c).max())


def check_equals_is_causal(q, k, v, **options):
  """jax_flash with `options` (a causal mask or bias array) gives is_causal's output and
  gradients within rounding (the two may run on different tiles, in different orders)."""
  T = q.shape[1]

  def loss(q, k, v, **options):
    out = jax_flash.dot_product_attention(q, k, v, **options)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(T))[:, None, None]), out

  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                static_argnames="is_causal")
  (_, out_array), grads_array = run(q, k, v, **options)
  (_, out_causal), grads_causal = run(q, k, v, is_causal=True)
  for a, b in zip((out_array, *grads_array), (out_causal, *grads_causal)):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


def check_vmap_over_logit_arrays(q, k, v, name: str, arrays):
  """vmap over a stack of logit arrays alone (keyword `name`: "mask" or "bias"; q, k, v
  unmapped, which the kernels broadcast) gives the calls one by one, up to the order of the dQ
  additions."""
  T = q.shape[1]

  def loss(q, k, v, array):
    out = jax_flash.dot_product_attention(q, k, v, **{name: array})
    return jnp.sum(out.astype(jnp.float32) * jnp.sin(jnp.arange(T))[:, None, None])

  grad = jax.grad(loss, argnums=(0, 1, 2))
  batched = jax.jit(jax.vmap(grad, in_axes=(None, None, None, 0)))(q, k, v, arrays)
  for i in range(arrays.shape[0]):
    one = jax.jit(grad)(q, k, v, arrays[i])
    for a, b in zip(batched, one):
      a, b = np.asarray(a[i].astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())
