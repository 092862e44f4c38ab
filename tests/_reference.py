"""Reference implementations the tests compare jax_flash with.

* `xla_function`: ``jax.nn.dot_product_attention(implementation='xla')`` (or cuDNN) on the same
  inputs cast to a given dtype: the baseline of the accuracy criterion, run in the input dtype
  (bfloat16 of head dim 1 on a zero-padded head dim 2, the same computation: see there).
* `attention_with_lse`: the definition, transcribed like jax's xla path (logits from
  preferred_element_type float32, or float64 for float64; P cast to the value dtype), that also
  returns the log-sum-exp of the masked logits without stopping its gradient. It also takes
  jax_flash's logit soft-capping (``softcap``: scaled logits x become softcap * tanh(x / softcap)
  before the bias), which jax's path does not have; its gradient, the tanh's derivative
  included, is jax's derivative of the definition. In float64 (from
  the upcast inputs, under a scoped x64) it is the precise reference: jax's own path cannot be,
  because it always computes its softmax in float32, even for float64 inputs. It agrees with
  jax's path wherever a row sees a key (test_reference.py checks that); rows that see no key give
  0 and lse -inf, where jax averages all values.
* `visibility`: the visibility rule as a numpy mask, segment ids included (jax_flash's packed
  sequences: the definition then runs on that mask, which is how jax's path expresses them).
"""

from __future__ import annotations

import contextlib
import functools
import jax
import jax.numpy as jnp
import numpy as np


BIG = 1e30  # "infinite" bias magnitude of the tests, clipped to the dtype's range


def cpu_device():
  return jax.devices("cpu")[0]


@contextlib.contextmanager
def precise():
  """float64 computations on the CPU, scoped: x64 never leaks out of the block."""
  with jax.enable_x64(True), jax.default_device(cpu_device()):
    yield


def x64_if(dtype):
  """Scoped x64 for float64 inputs; nothing for other dtypes."""
  return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def rank4(x: np.ndarray) -> np.ndarray:
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def window_pair(window, T: int, S: int):
  """(left, right) or None. Sides past both sequences cut nothing; they come as T + S, so that
  integer arithmetic on them (numpy's int64, jax.nn's int32) cannot overflow."""
  if window is None:
    return None
  pair = (window, window) if isinstance(window, int) else tuple(window)
  return tuple(min(side, T + S) for side in pair)


def visibility(B, N, T, S, *, mask=None, is_causal=False, window=None, q_lens=None,
               kv_lens=None, q_seg=None, kv_seg=None) -> np.ndarray:
  """(B, N, T, S) bool: key j is visible to query i (the rule of attention_params.h). Segment
  ids q_seg (B, T) and kv_seg (B, S) ((T,) and (S,) for B == 1), both or neither: only keys of
  the query's segment are visible."""
  i = np.arange(T)[:, None]
  j = np.arange(S)[None, :]
  vis = np.ones((B, N, T, S), bool)
  if mask is not None:
    vis &= np.broadcast_to(rank4(np.asarray(mask, bool)), (B, N, T, S))
  if is_causal:
    vis &= (j <= i)
  pair = window_pair(window, T, S)
  if pair is not None:
    left, right = pair
    vis &= (i - left <= j) & (j <= i + right)
  if q_lens is not None:
    vis &= (np.arange(T)[None, :] < np.asarray(q_lens)[:, None])[:, None, :, None]
  if kv_lens is not None:
    vis &= (np.arange(S)[None, :] < np.asarray(kv_lens)[:, None])[:, None, None, :]
  if q_seg is not None:
    q_seg = np.asarray(q_seg).reshape(-1, T)
    kv_seg = np.asarray(kv_seg).reshape(-1, S)
    vis &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  return vis


def _xla_eager(q, k, v, bias, mask, q_lens, kv_lens, *, scale, is_causal, window,
               implementation, return_residual):
  return jax.nn.dot_product_attention(
      q, k, v, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=q_lens,
      key_value_seq_lengths=kv_lens, local_window_size=window, implementation=implementation,
      return_residual=return_residual)


_xla_jit = jax.jit(_xla_eager, static_argnames=("scale", "is_causal", "window", "implementation",
                                                "return_residual"))


def xla_function(dtype, *, scale=None, is_causal=False, window=None, implementation="xla",
                 return_residual=False, pad_unit_head_dim=True):
  """f(q, k, v, bias, mask, q_lens, kv_lens) -> output (and jax's residual), computed from the
  inputs cast to dtype. pad_unit_head_dim=False turns off the padding described below
  (test_reference.py checks that it changes no bit of the output)."""

  def cast(x):
    return None if x is None else jnp.asarray(x).astype(dtype)

  # jax's float16 path asks for an F16_F16_F32 dot, which XLA:CPU rejects when compiling; the
  # path falls back to the default precision only when the dot is compiled on its own, as it is
  # eagerly. Other dtypes are compiled whole, which is faster.
  xla = _xla_eager if np.dtype(dtype) == np.float16 else _xla_jit

  # XLA:CPU aborts the process (a failed check in its ynn_emitter: "reshape vs. bitcast") on
  # jax's path compiled whole for bfloat16 inputs of head dim 1 once the problem is large enough
  # (jax 0.10.2 to 0.12.0.1 at (B, T, S) = (1, 64, 64); 0.12.0.1 already at the sweep's
  # (2, 65, 33)). Those baselines run on head dim 2, the inputs' column and a zero one, with
  # the scale of head dim 1 (1.0 unless given): the logits are the same products, the output's
  # first column, which is returned, the same sums of the same terms, and gradients flow back
  # through the padding. Only XLA's order of a sum's terms may differ (test_reference.py).
  pad = (pad_unit_head_dim and implementation == "xla"
         and np.dtype(dtype) == np.dtype(jnp.bfloat16))

  def f(q, k, v, bias=None, mask=None, q_lens=None, kv_lens=None):
    pair = window_pair(window, q.shape[-3], k.shape[-3])
    q, k, v = cast(q), cast(k), cast(v)
    padded = pad and q.shape[-1] == 1
    if padded:
      q, k, v = (jnp.concatenate([x, jnp.zeros_like(x)], axis=-1) for x in (q, k, v))
    result = xla(q, k, v, cast(bias),
                 None if mask is None else jnp.asarray(mask),
                 None if q_lens is None else jnp.asarray(q_lens, jnp.int32),
                 None if kv_lens is None else jnp.asarray(kv_lens, jnp.int32),
                 scale=(1.0 if scale is None else scale) if padded else scale,
                 is_causal=is_causal, window=pair, implementation=implementation,
                 return_residual=return_residual)
    if not padded:
      return result
    return (result[0][..., :1], result[1]) if return_residual else result[..., :1]

  return f


def attention_with_lse(q, k, v, bias, vis, *, scale=None, softcap=None):
  """(out, lse (B, T, N)) by the definition; `vis` is the visibility (B, N, T, S) or
  broadcastable to it; `softcap` None or the soft-cap of the scaled logits. Differentiable
  through lse; rows with no visible key give 0 and -inf with zero gradients. Compiled once per
  shape and dtype."""
  return _attention_with_lse(q, k, v, bias, jnp.asarray(vis, bool), scale=scale,
                             softcap=softcap)


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def _attention_with_lse(q, k, v, bias, vis, *, scale, softcap):
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  B, T, N, H = q.shape
  G = N // k.shape[2]
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
  kk = jnp.repeat(k, G, axis=2)
  vv = jnp.repeat(v, G, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, kk, preferred_element_type=logits_dtype)
  logits = logits * jnp.asarray(scale, logits_dtype)
  if softcap is not None:
    cap = jnp.asarray(softcap, logits_dtype)
    logits = cap * jnp.tanh(logits / cap)
  if bias is not None:
    logits = (logits + bias).astype(logits_dtype)
  vis = jnp.broadcast_to(vis, logits.shape)
  live = vis.any(-1)
  masked = jnp.where(vis, logits, -jnp.inf)
  masked = jnp.where(live[..., None], masked, 0.0)  # keeps empty rows free of NaN
  # Normalise by the row maximum, not by exp(lse): with logits of 1e30 the lse cannot hold
  # log(sum) any more (1e30 + log 3 == 1e30) and exp(s - lse) would not sum to 1.
  peak = jax.lax.stop_gradient(masked.max(-1, keepdims=True))
  weights = jnp.exp(masked - peak)
  total = weights.sum(-1, keepdims=True)
  lse = (peak + jnp.log(total))[..., 0]
  probs = (weights / total).astype(v.dtype)
  out = jnp.einsum("bnts,bsnh->btnh", probs, vv)
  out = jnp.where(jnp.swapaxes(live, 1, 2)[..., None], out, jnp.zeros((), out.dtype))
  lse = jnp.swapaxes(jnp.where(live, lse, -jnp.inf), 1, 2)
  if unbatched:
    out, lse = out[0], lse[0]
  return out, lse


def logits_max(q, k, bias, vis, *, scale=None) -> float:
  """max |scaled, biased logit| over the visible entries (the L of the float64 bound).

  Logits that are soft-capped count before the cap: the rounding of the scaled logit, relative
  to its magnitude, is what propagates, and the cap's derivative (at most 1) only damps it.

  Entries with a bias of magnitude >= BIG / 2 are left out: in any precision q.k vanishes
  against them when they are added, so they are either exact ties at the row maximum (computed
  identically by every implementation) or weights that underflow to exactly 0.
  """
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  if q.ndim == 3:
    q, k = q[None], k[None]
  G = q.shape[2] // k.shape[2]
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2)) * scale
  keep = vis
  if bias is not None:
    bias = np.broadcast_to(rank4(np.asarray(bias, np.float64)), vis.shape)
    logits = logits + bias
    keep = vis & (np.abs(bias) < BIG / 2)
  logits = np.broadcast_to(logits, vis.shape)
  values = np.abs(logits[keep])
  values = values[np.isfinite(values)]
  return float(values.max()) if values.size else 0.0
