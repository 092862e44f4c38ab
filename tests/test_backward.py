"""Gradients w.r.t. query, key, value and bias, also through the returned log-sum-exp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash

import _reference as ref
from _harness import (Case, check_gradients, cotangents, default_dtype, default_head_dim,
                      live_rows, make_inputs, visibility)
from _platforms import platform_dtypes, platform_params, with_platform


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  return Case(**fields)


GRAD_CASES = {
    "plain": dict(T=37, S=53),
    "causal-gqa": dict(T=61, S=45, N=4, K=2, is_causal=True),
    "bias-and-mask": dict(T=29, S=41, bias="BNTS", mask="B1TS"),
    "lengths-and-window": dict(B=3, T=40, S=33, q_lens=(40, 17, 0), kv_lens=(33, 5, 20),
                               window=(6, 3)),
    "mqa-broadcast-bias": dict(T=24, S=70, N=4, K=1, bias="1NT1", is_causal=True),
    "negative-scale": dict(T=21, S=30, scale=-0.4, bias="B1TS"),
}


@with_platform("platform,dtype", platform_dtypes())
@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients(platform, dtype, name):
  check_gradients(case_on(platform, dtype=dtype, **GRAD_CASES[name]), platform)


SIZES = [(1, 1), (239, 1), (1, 239), (113, 203)]


@pytest.mark.parametrize("T,S", SIZES, ids=[f"T{t}-S{s}" for t, s in SIZES])
def test_gradients_awkward_sizes(platform, T, S):
  check_gradients(case_on(platform, T=T, S=S, B=1, bias="BNTS"), platform)


@with_platform("platform,H", platform_params([1, 40, 64], gpu_values=[64, 128]))
def test_gradients_head_dims(platform, H):
  check_gradients(case_on(platform, T=31, S=44, H=H, is_causal=True), platform)


BIAS_SPECS = ["1NTS", "B1TS", "BN1S", "BNT1", "TS", ""]


@pytest.mark.parametrize("spec", BIAS_SPECS, ids=lambda s: s or "scalar")
def test_bias_gradient_sums_over_broadcast_axes(platform, spec):
  check_gradients(case_on(platform, B=2, N=3, T=17, S=29, bias=spec, mask="BNTS"), platform)


LSE_CASES = {
    "plain": dict(T=23, S=37),
    "bias-causal-gqa": dict(T=40, S=31, N=4, K=2, bias="BNTS", is_causal=True),
    "empty-rows": dict(T=30, S=19, mask="BNTS", dead_rows=True, q_lens=(30, 20)),
}


@with_platform("platform,dtype", platform_dtypes())
@pytest.mark.parametrize("name", LSE_CASES)
def test_gradients_through_log_sum_exp(platform, dtype, name):
  check_gradients(case_on(platform, dtype=dtype, **LSE_CASES[name]), platform, through_lse=True)


def _grads(case, inp, dout, dlse):
  f = lambda q, k, v, b: jax_flash.dot_product_attention(  # noqa: E731
      q, k, v, b, inp.mask, is_causal=case.is_causal, query_seq_lengths=inp.q_lens,
      key_value_seq_lengths=inp.kv_lens, local_window_size=case.window, return_residual=True)
  _, pullback = jax.vjp(f, *(jnp.asarray(x) for x in (inp.q, inp.k, inp.v, inp.bias)))
  return [np.asarray(g) for g in pullback((jnp.asarray(dout), jnp.asarray(dlse)))]


def test_rows_without_visible_keys_pass_no_gradient(platform):
  """Output 0 and lse -inf are constants on empty rows: their cotangents change nothing, and
  dq is exactly 0 there (no NaN from exp(-inf - -inf))."""
  case = case_on(platform, T=30, S=25, mask="BNTS", dead_rows=True, bias="BNTS",
                 q_lens=(30, 12), kv_lens=(25, 20))
  inp = make_inputs(case)
  vis = visibility(case, inp)
  live = live_rows(case, vis)
  dout, dlse = cotangents(case, inp, vis, seed=0)  # zero on empty rows
  rng = np.random.default_rng(7)
  dout_noisy = np.where(live[..., None], dout, rng.standard_normal(dout.shape)).astype(dout.dtype)
  dlse_noisy = np.where(live, dlse, rng.standard_normal(dlse.shape)).astype(dlse.dtype)
  clean = _grads(case, inp, dout, dlse)
  noisy = _grads(case, inp, dout_noisy, dlse_noisy)
  for name, a, b in zip(("dq", "dk", "dv", "dbias"), clean, noisy):
    assert np.isfinite(b.astype(np.float64)).all(), name
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert np.all(noisy[0][~live] == 0), "dq of rows without visible keys must be 0"
  dbias_dead = np.swapaxes(noisy[3], 1, 2)[~live]
  assert np.all(dbias_dead == 0), "dbias of rows without visible keys must be 0"


# float64 finite-difference checks on the CPU: the VJP against numerical derivatives.
CHECK_GRADS_CASES = {
    "plain": dict(T=5, S=7, N=2, K=1, H=4),
    "bias-causal": dict(T=6, S=4, H=3, bias="BNTS", is_causal=True),
    "window-lengths-mask": dict(T=7, S=6, H=4, window=(2, 1), q_lens=(7, 5), kv_lens=(6, 4),
                                mask="1NTS", bias="B1TS"),
}


@pytest.mark.parametrize("through_lse", [False, True], ids=["output", "output-and-lse"])
@pytest.mark.parametrize("name", CHECK_GRADS_CASES)
def test_check_grads_float64(name, through_lse):
  case = Case(dtype="float64", **CHECK_GRADS_CASES[name])
  inp = make_inputs(case, seed=3)
  if inp.mask is not None:
    # Finite differences of lse need every row live: keep key 0 visible everywhere.
    inp.mask[..., 0] = True
  live = live_rows(case, visibility(case, inp))

  with ref.x64_if("float64"):
    def f(q, k, v, *bias):
      result = jax_flash.dot_product_attention(
          q, k, v, *bias, mask=None if inp.mask is None else jnp.asarray(inp.mask),
          is_causal=case.is_causal, local_window_size=case.window,
          query_seq_lengths=None if inp.q_lens is None else jnp.asarray(inp.q_lens),
          key_value_seq_lengths=None if inp.kv_lens is None else jnp.asarray(inp.kv_lens),
          return_residual=through_lse)
      if through_lse:
        out, lse = result
        # Padding rows have lse -inf: keep the compared values finite.
        return out, jnp.where(jnp.asarray(live), lse, 0.0)
      return result

    args = [jnp.asarray(x) for x in (inp.q, inp.k, inp.v)]
    if inp.bias is not None:
      args.append(jnp.asarray(inp.bias))
    check_grads(f, args, order=1, modes=("rev",))
