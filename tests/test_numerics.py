"""Numerical robustness: large logits, extreme and infinite bias, determinism, and the memory
footprint of a long sequence."""

from __future__ import annotations

import math
import resource

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config

import _reference as ref
from _harness import (Case, assert_close, check_forward, check_gradients, default_dtype,
                      default_head_dim, make_inputs, visibility)
from _platforms import platform_dtypes, with_platform


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  return Case(**fields)


def large_logit_std(target: float) -> float:
  """Standard deviation of q and k entries for logits q.k / sqrt(H) of magnitude `target`:
  with N(0, std**2) entries they have standard deviation std**2, whatever H."""
  return math.sqrt(target)


@with_platform("platform,dtype", platform_dtypes())
@pytest.mark.parametrize("target", [1e3, 1e4], ids=["logits1e3", "logits1e4"])
def test_large_logits(platform, dtype, target):
  case = case_on(platform, T=45, S=67, dtype=dtype, is_causal=True,
                 std=large_logit_std(target))
  inp = make_inputs(case)
  L = ref.logits_max(inp.q, inp.k, None, visibility(case, inp))
  assert target <= L <= 100 * target, f"the case must reach logits of {target:g}, got {L:g}"
  check_forward(case, platform, inp=inp)


@with_platform("platform,dtype", platform_dtypes())
def test_large_logits_gradients(platform, dtype):
  case = case_on(platform, T=33, S=40, dtype=dtype, std=large_logit_std(1e3))
  check_gradients(case, platform)


EXTREME = {
    "full": dict(bias="BNTS"),
    "broadcast-heads": dict(bias="B1TS", is_causal=True),
    "with-lengths": dict(bias="1NTS", kv_lens=(40, 23), q_lens=(31, 12)),
}


@with_platform("platform,dtype", platform_dtypes())
@pytest.mark.parametrize("name", EXTREME)
def test_extreme_and_infinite_bias(platform, dtype, name):
  """Bias entries of +-1e30 (clipped to the dtype) and -inf: no NaN or inf in live rows."""
  case = case_on(platform, T=31, S=40, dtype=dtype, extreme_bias=True, **EXTREME[name])
  inp = make_inputs(case)
  assert np.isneginf(inp.bias.astype(np.float64)).any()
  check_forward(case, platform, inp=inp)


@with_platform("platform,dtype", platform_dtypes())
def test_extreme_and_infinite_bias_gradients(platform, dtype):
  case = case_on(platform, T=29, S=36, dtype=dtype, extreme_bias=True, bias="BNTS",
                 is_causal=True)
  check_gradients(case, platform)


def test_row_dominated_by_one_large_bias(platform):
  """A bias of +BIG on one key per row makes the output that key's value exactly."""
  case = case_on(platform, B=1, T=12, S=20, N=2, K=1, bias="BNTS")
  inp = make_inputs(case)
  chosen = np.arange(case.T) * 7 % case.S
  bias = np.zeros(inp.bias.shape, np.float64)
  bias[:, :, np.arange(case.T), chosen] = min(ref.BIG, float(ml_dtypes.finfo(inp.bias.dtype).max))
  inp.bias = bias.astype(inp.bias.dtype)
  out, _ = check_forward(case, platform, inp=inp)
  expected = np.broadcast_to(inp.v[0, chosen, 0][:, None, :], out[0].shape)
  np.testing.assert_array_equal(out[0], expected)


# Logits rising towards the first keys, which the Hopper forward visits last: each row's
# running maximum rises in every key block, by less than the lazy rescaling's staleness bound (8
# in log2 units, 5.5 in natural ones) in one head and by more in the other, so the kernels both
# keep a stale maximum (probabilities up to 2^8) and move it. Lazy rescaling runs in the
# soft-capped kernels and, uncapped, where a row holds more output columns than logits (the
# largest head dim; kernel_traits_fwd.h).
RISING_PER_KEY = (0.02, 0.06)  # per head: a rise of 2.6 and 7.7 per 128-key block


def rising_params():
  params = []
  for p in platform_dtypes():
    platform, dtype = p.values
    head_dims = _config.GPU_HEAD_DIMS if platform == "gpu" else (16,)
    for name, softcap, H in (("uncapped", None, max(head_dims)), ("capped", 50.0, min(head_dims))):
      params.append(pytest.param(platform, dtype, H, softcap, marks=p.marks, id=f"{p.id}-{name}"))
  return params


@with_platform("platform,dtype,H,softcap", rising_params())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_row_maxima_rising_across_key_blocks(platform, dtype, H, softcap, is_causal):
  case = Case(B=2, T=640, S=640, N=2, H=H, dtype=dtype, is_causal=is_causal, scale=1.0,
              softcap=softcap)
  inp = make_inputs(case)
  q = inp.q.astype(np.float64) * 0.1
  k = inp.k.astype(np.float64) * 0.1
  # The rising product sits in the last head dim: the tensor cores add the head dim's slices
  # in order into a float32 sum that they round at its magnitude (not to nearest; cuBLAS's dot
  # of these inputs errs alike), so a product of 40 added first would leave every later slice
  # rounded at 40 and the logits several ulps off, an error that is not the softmax's.
  q[..., -1] = 1.0
  k[..., -1] = np.asarray(RISING_PER_KEY) * np.arange(case.S - 1, -1, -1)[:, None]
  inp.q, inp.k = q.astype(inp.q.dtype), k.astype(inp.k.dtype)
  logits = ref.logits_max(inp.q, inp.k, None, visibility(case, inp), scale=1.0)
  assert logits > 30, f"the keys' logits must rise over several blocks, got a maximum of {logits:g}"
  check_forward(case, platform, inp=inp)


# --- determinism -------------------------------------------------------------------------------


def test_determinism(platform):
  """Two runs of the forward and of the gradients are bit-identical (no order-dependent
  accumulation across threads or blocks), with GQA so that dk/dv sum over query heads."""
  case = case_on(platform, B=2, T=300, S=333, N=4, K=1, bias="B1TS", is_causal=True,
                 window=(200, 0))
  inp = make_inputs(case)
  args = [jnp.asarray(x) for x in (inp.q, inp.k, inp.v, inp.bias)]
  dout = jnp.asarray(np.random.default_rng(5).standard_normal(inp.q.shape).astype(inp.q.dtype))

  def run():
    def f(q, k, v, b):
      return jax_flash.dot_product_attention(q, k, v, b, is_causal=True,
                                             local_window_size=(200, 0), return_residual=True)
    (out, lse), pullback = jax.vjp(f, *args)
    grads = pullback((dout, jnp.zeros_like(lse)))
    return [np.asarray(x) for x in (out, lse, *grads)]

  first, second = run(), run()
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), first, second):
    np.testing.assert_array_equal(a, b, err_msg=name)


# --- memory --------------------------------------------------------------------------------------


def test_long_sequence_runs_in_linear_memory():
  """(1, 32768, 8, 64) float32: xla's path needs a 32768 x 32768 logit matrix per head (4 GiB
  each); ours needs O(T * H) scratch. Compiled temporaries are compared, a few rows checked."""
  B, T, N, H = 1, 32768, 8, 64
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, T, N, H), np.float32) for _ in range(3))

  def ours(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True)

  spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  ours_temp = jax.jit(ours).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
  logits_bytes = T * T * 4
  assert ours_temp <= q.nbytes, (ours_temp, q.nbytes)  # no (T, S) buffer, not even one head's
  xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                             implementation="xla"))
  xla_temp = xla.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
  assert xla_temp >= logits_bytes, (xla_temp, logits_bytes)  # what the point of the test is

  peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  out = np.asarray(jax.jit(ours)(q, k, v))
  peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
  # The kernels' own scratch is invisible to XLA's analysis: the process's peak resident memory
  # must not have grown by one head's logit matrix either.
  assert peak_growth < logits_bytes, (peak_growth, logits_bytes)
  assert out.shape == q.shape and np.isfinite(out).all()
  # Causal row i sees keys 0..i: check rows at both ends and inside, against the float64
  # definition and xla's float32 path on those keys only.
  for i in (0, 1, 4095, 32767):
    qi, ki, vi = q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1]
    vis = np.ones((B, N, 1, i + 1), bool)
    with ref.precise():
      hi, _ = ref.attention_with_lse(*(jnp.asarray(x, jnp.float64) for x in (qi, ki, vi)),
                                     None, vis)
    base = jax.nn.dot_product_attention(qi, ki, vi, implementation="xla")
    assert_close(f"row {i}", out[:, i:i + 1], np.asarray(hi), np.asarray(base), kind="fwd",
                 dtype=np.float32)
