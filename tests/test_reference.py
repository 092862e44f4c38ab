"""The tests' precise reference (the definition in float64, _reference.attention_with_lse with
the numpy visibility rule) agrees with jax's own xla path wherever a row sees a key, and marks
exactly the rows jax's path masks entirely. jax's float64 path computes its softmax in float32,
so it is judged as a float32 implementation, with jax's float32 path as its baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _reference as ref
from _harness import Case, assert_close, cotangents, live_rows, make_inputs, reference_hi, visibility

FEATURES = {
    "plain": dict(),
    "gqa": dict(N=4, K=2),
    "mqa-unbatched": dict(B=None, N=3, K=1),
    "causal-wide": dict(T=9, S=20, is_causal=True),
    "causal-tall": dict(T=20, S=9, is_causal=True),
    "window": dict(window=(3, 1)),
    "window-int-causal": dict(window=2, is_causal=True),
    "lengths": dict(q_lens=(11, 0), kv_lens=(4, 13)),
    "bias-and-mask": dict(bias="1NT1", mask="B1TS", dead_rows=True),
    "scale": dict(scale=0.7, bias="TS"),
    "extreme-bias": dict(bias="BNTS", extreme_bias=True, T=20, S=40),
}


@pytest.mark.parametrize("name", FEATURES)
def test_definition_agrees_with_jax_xla_path(name):
  case = Case(**{**dict(T=11, S=13, H=8), **FEATURES[name]})
  inp = make_inputs(case)
  vis = visibility(case, inp)
  live = live_rows(case, vis)
  ops = (inp.q, inp.k, inp.v, inp.bias, inp.mask, inp.q_lens, inp.kv_lens)
  out_hi, lse_hi = reference_hi(case, inp, vis)
  with ref.precise():
    xla64_out, xla64_lse = (np.asarray(x) for x in ref.xla_function(
        np.float64, return_residual=True, **case.kwargs())(*ops))
  xla32_out, xla32_lse = (np.asarray(x) for x in ref.xla_function(
      np.float32, return_residual=True, **case.kwargs())(*ops))

  # jax puts -0.7 * float32 max on masked logits: its lse is about that on rows with no key.
  assert np.array_equal(live, xla64_lse > -1e37), "visibility differs from jax's masks"
  assert np.all(lse_hi[~live] == -np.inf) and np.all(out_hi[~live] == 0)
  assert_close("jax float64 output", xla64_out[live], out_hi[live], xla32_out[live], kind="fwd",
               dtype=np.float32)
  assert_close("jax float64 lse", xla64_lse[live], lse_hi[live], xla32_lse[live], kind="lse",
               dtype=np.float32)


@pytest.mark.parametrize("name", ["causal-wide", "lengths", "bias-and-mask"])
def test_definition_gradients_agree_with_jax_xla_path(name):
  case = Case(**{**dict(T=11, S=13, H=8), **FEATURES[name]})
  inp = make_inputs(case)
  vis = visibility(case, inp)
  dout, _ = cotangents(case, inp, vis, seed=0)
  diff = [inp.q, inp.k, inp.v] + ([inp.bias] if inp.bias is not None else [])
  rest = (inp.mask, inp.q_lens, inp.kv_lens)

  def xla_grads(dtype):
    f = ref.xla_function(dtype, **case.kwargs())
    g = lambda *d: f(*d[:3], d[3] if len(d) > 3 else None, *rest)  # noqa: E731
    _, pullback = jax.vjp(g, *(jnp.asarray(x) for x in diff))
    return [np.asarray(x) for x in pullback(jnp.asarray(dout).astype(dtype))]

  def definition_grads():
    def g(*d):
      return ref.attention_with_lse(*d[:3], d[3] if len(d) > 3 else None, vis,
                                    scale=case.scale)[0]
    _, pullback = jax.vjp(g, *(jnp.asarray(x, jnp.float64) for x in diff))
    return [np.asarray(x) for x in pullback(jnp.asarray(dout, jnp.float64))]

  with ref.precise():
    hi = definition_grads()
    xla64 = xla_grads(np.float64)
  xla32 = xla_grads(np.float32)
  for name, a, h, b in zip(("dq", "dk", "dv", "dbias"), xla64, hi, xla32):
    assert_close(f"jax float64 {name}", a, h, b, kind="grad", dtype=np.float32)


@pytest.mark.parametrize("name", ["plain", "gqa", "causal-wide", "lengths", "bias-and-mask",
                                  "scale"])
def test_unit_head_dim_padding_changes_no_bit(name):
  """xla_function runs bfloat16 problems of head dim 1 on a zero-padded head dim 2 (XLA:CPU
  aborts on some of them otherwise): on problems small enough to compile unpadded, the output
  and the residual are bit for bit those of the unpadded call."""
  case = Case(**{**dict(T=11, S=13, H=1, dtype="bfloat16"), **FEATURES[name]})
  inp = make_inputs(case)
  ops = (inp.q, inp.k, inp.v, inp.bias, inp.mask, inp.q_lens, inp.kv_lens)

  def run(pad):
    f = ref.xla_function(jnp.bfloat16, return_residual=True, pad_unit_head_dim=pad,
                         **case.kwargs())
    return [np.asarray(x) for x in f(*ops)]

  for what, padded, plain in zip(("output", "residual"), run(True), run(False)):
    assert padded.shape == plain.shape and padded.dtype == plain.dtype, what
    np.testing.assert_array_equal(padded, plain, err_msg=what)
