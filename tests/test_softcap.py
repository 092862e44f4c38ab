"""Logit soft-capping (``logits_soft_cap``, Gemma 2): every scaled logit x = scale * q.k becomes
cap * tanh(x / cap) before the bias and masking, in the kernels, in the blockwise path (called
directly) and through jax's transformations.

Results are compared with the float64 definition (tests/_reference.py, which soft-caps the same
way and whose gradient, by jax's derivative of the definition, includes the tanh's), under the
criterion of tests/_tolerances.py. jax's own attention has no soft-capping, so the baseline of
a soft-capped case is the definition in the input dtype (float32 on the CPU for the log-sum-exp).

The queries and keys of the capped cases are scaled up (STD) so that most logits lie far
beyond the cap, where the cap changes the result most and its derivative is close to 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import jax_flash.flax as jf
from jax_flash import _config, _primitive
from jax_flash._validation import canonicalize

from _harness import (Case, assert_close, blockwise_forward, blockwise_grads, blockwise_run,
                      check_forward, check_gradients, cotangents, default_dtype, default_head_dim,
                      forward_baseline, live_rows, lse_baseline, make_inputs, np_dtype,
                      reference_hi, run_ours, visibility)
from _platforms import (GPU, named_cases_and_dtypes, named_platform_dtypes, platform_dtypes,
                        platform_params, with_platform)

CAP = 5.0
# q and k entries of standard deviation STD give scaled logits of standard deviation STD**2 = 9
# (scale 1/sqrt(H)): most lie beyond the cap.
STD = 3.0
NO_BIND = 1e4  # a cap far above every logit of unit-scale inputs


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  fields.setdefault("softcap", CAP)
  fields.setdefault("std", STD)
  return Case(**fields)


def scaled_logits(case: Case, inp) -> np.ndarray:
  """The scaled logits x = scale * q.k in float64, (B, N, T, S)."""
  q, k = (np.asarray(x, np.float64) for x in (inp.q, inp.k))
  if case.B is None:
    q, k = q[None], k[None]
  scale = 1.0 / np.sqrt(case.H) if case.scale is None else case.scale
  return np.einsum("btnh,bsnh->bnts", q, np.repeat(k, case.N // case.kv_heads, axis=2)) * scale


def assert_cap_binds(case: Case, inp) -> None:
  """The case tests the cap: half of the visible logits lie beyond it, some far beyond."""
  x = np.broadcast_to(scaled_logits(case, inp), (case.batch, case.N, case.T, case.S))
  x = np.abs(x[visibility(case, inp)])
  assert np.mean(x > case.softcap) > 0.5 and np.mean(x > 3 * case.softcap) > 0.05, (
      "the cap must bind on this case")


CASES = {
    "awkward-sizes": dict(T=37, S=53, H=24),
    "causal-gqa": dict(T=61, S=45, N=4, K=2, is_causal=True),
    "window-lengths": dict(B=3, T=40, S=33, q_lens=(40, 17, 0), kv_lens=(33, 5, 20),
                           window=(6, 3)),
    "bias-mask": dict(T=29, S=41, bias="BNTS", mask="B1TS"),
    "dead-rows-broadcast-bias": dict(T=30, S=19, bias="B1TS", mask="BNTS", dead_rows=True,
                                     q_lens=(30, 20)),
    "unbatched-mqa-negative-scale": dict(B=None, T=21, S=30, N=4, K=1, bias="NTS", scale=-0.4),
}
# Each dtype on the CPU kernels for these; the default dtype for the others.
ALL_DTYPE_CASES = ("causal-gqa",)


@with_platform("platform,dtype,name", named_cases_and_dtypes(CASES, ALL_DTYPE_CASES))
def test_forward(platform, dtype, name):
  case = case_on(platform, dtype=dtype, **CASES[name])
  inp = make_inputs(case)
  assert_cap_binds(case, inp)
  check_forward(case, platform, inp=inp)


@with_platform("platform,dtype,name", named_cases_and_dtypes(CASES, ALL_DTYPE_CASES))
def test_gradients(platform, dtype, name):
  """dq, dk, dv, dbias; the cotangent also reaches the log-sum-exp."""
  check_gradients(case_on(platform, dtype=dtype, **CASES[name]), platform, through_lse=True)


@with_platform("platform,dtype", platform_dtypes(["float32"]))
@pytest.mark.parametrize("bias", ["B1TS", None], ids=["bias", "no-bias"])
def test_cap_that_does_not_bind_equals_uncapped(platform, dtype, bias):
  """A cap far above every logit changes them by about x^3 / (3 cap^2), below the dtype's
  resolution: the result is the uncapped one, judged like the uncapped call (xla's baseline).
  (On the Hopper kernels such a cap puts the series' high coefficients below the float range,
  softcap.h.)"""
  plain = case_on(platform, dtype=dtype, T=37, S=53, N=4, K=2, is_causal=True, bias=bias,
                  softcap=None, std=1.0)
  capped = plain.replace(softcap=NO_BIND)
  inp = make_inputs(plain)
  out, lse = check_forward(capped, platform, inp=inp)
  vis = visibility(plain, inp)
  live = live_rows(plain, vis)
  ref_out, ref_lse = reference_hi(plain, inp, vis)
  base, base_name = forward_baseline(plain, inp, platform)
  base_lse = lse_baseline(plain, inp)
  assert_close("output against the uncapped reference", out.astype(np.float64)[live],
               ref_out[live], base[live], kind="fwd", dtype=np_dtype(dtype), note=base_name)
  assert_close("lse against the uncapped reference", lse[live], ref_lse[live], base_lse[live],
               kind="lse", dtype=np_dtype(dtype), result_dtype=np.float32, note="xla float32")


def test_cap_changes_the_result(platform):
  """The capped cases are not the uncapped ones in disguise."""
  case = case_on(platform, T=37, S=53)
  inp = make_inputs(case)
  capped, _ = run_ours(case, inp, return_residual=True)
  plain, _ = run_ours(case.replace(softcap=None), inp, return_residual=True)
  assert np.abs(capped.astype(np.float64) - plain.astype(np.float64)).max() > 0.1


def test_rows_without_visible_keys(platform):
  """Rows that see no key: output 0 and lse -inf, no NaN anywhere, and cotangents on those rows
  change no gradient (dq and dbias are exactly 0 there)."""
  case = case_on(platform, T=30, S=25, mask="BNTS", dead_rows=True, bias="BNTS",
                 q_lens=(30, 12), kv_lens=(25, 0))
  inp = make_inputs(case)
  vis = visibility(case, inp)
  live = live_rows(case, vis)
  assert (~live).any() and live.any()
  check_forward(case, platform, inp=inp)
  dout, dlse = cotangents(case, inp, vis, seed=0)  # zero on empty rows
  rng = np.random.default_rng(7)
  dout_noisy = np.where(live[..., None], dout, rng.standard_normal(dout.shape)).astype(dout.dtype)
  dlse_noisy = np.where(live, dlse, rng.standard_normal(dlse.shape)).astype(dlse.dtype)

  def grads(dout, dlse):
    def f(q, k, v, b):
      return jax_flash.dot_product_attention(
          q, k, v, b, jnp.asarray(inp.mask), query_seq_lengths=jnp.asarray(inp.q_lens),
          key_value_seq_lengths=jnp.asarray(inp.kv_lens), return_residual=True,
          logits_soft_cap=case.softcap)
    _, pullback = jax.vjp(f, *(jnp.asarray(x) for x in (inp.q, inp.k, inp.v, inp.bias)))
    return [np.asarray(g) for g in pullback((jnp.asarray(dout), jnp.asarray(dlse)))]

  clean, noisy = grads(dout, dlse), grads(dout_noisy, dlse_noisy)
  for name, a, b in zip(("dq", "dk", "dv", "dbias"), clean, noisy):
    assert np.isfinite(b.astype(np.float64)).all(), name
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert np.all(noisy[0][~live] == 0)
  assert np.all(np.swapaxes(noisy[3], 1, 2)[~live] == 0)


# --- transformations ---------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [None, jax.jit], ids=["eager", "jit"])
def test_eager_and_jit(platform, wrap):
  check_forward(case_on(platform, T=13, S=17, is_causal=True, kv_lens=(17, 9)), platform,
                wrap=wrap)


def test_jit_of_grad(platform):
  case = case_on(platform, T=13, S=17, bias="BNTS", is_causal=True)

  def grad_fn(f, primals, cotangent):
    def loss(*p):
      return jnp.sum(f(*p).astype(jnp.float32) * cotangent.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
    return grads, f(*primals)

  check_gradients(case, platform, grad_fn=grad_fn)


def test_vmap_and_grad_of_vmap(platform):
  """vmap over the query with shared key/value equals one call per mapped query, for the output
  and for the gradients (the shared key/value's summed over the mapped problems)."""
  case = case_on(platform, T=13, S=17, N=4, K=2, is_causal=True)
  rng = np.random.default_rng(3)
  dt = np_dtype(case.dtype)
  inp = make_inputs(case)
  qs = jnp.asarray((rng.standard_normal((3,) + inp.q.shape) * STD).astype(dt))
  k, v = jnp.asarray(inp.k), jnp.asarray(inp.v)
  dout = jnp.asarray(rng.standard_normal(qs.shape).astype(dt))

  def call(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=CAP)

  def loss(q, k, v):
    out = jax.vmap(call, in_axes=(0, None, None))(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  mapped = np.asarray(jax.jit(jax.vmap(call, in_axes=(0, None, None)))(qs, k, v))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qs, k, v)
  single = [np.asarray(call(qs[m], k, v)) for m in range(3)]
  single_grads = [jax.grad(lambda q, k, v, m=m: jnp.sum(call(q, k, v).astype(jnp.float32)
                                                         * dout[m].astype(jnp.float32)),
                           argnums=(0, 1, 2))(qs[m], k, v) for m in range(3)]
  # The same kernels on the same rows: the same values (on the CPU, bit for bit; the Hopper
  # backward adds dQ in any order), up to the order of the sums over the mapped problems for the
  # shared key/value.
  results = [("out", mapped, np.stack(single)),
             ("dq", grads[0], np.stack([g[0] for g in single_grads]))]
  results += [(name, grads[i], sum(np.asarray(g[i], np.float64) for g in single_grads))
              for i, name in ((1, "dk"), (2, "dv"))]
  for name, got, want in results:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    exact = platform == "cpu" and name in ("out", "dq")
    tol = 0.0 if exact else 4 * float(jnp.finfo(dt).eps) * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)


# --- the blockwise path, called directly -------------------------------------------------------

BLOCKWISE_CASES = {
    "causal-gqa-bias": dict(T=37, S=53, N=4, K=2, H=24, is_causal=True, bias="B1TS"),
    "window-lengths-mask": dict(B=3, T=40, S=50, q_lens=(40, 17, 0), kv_lens=(50, 5, 20),
                                window=(9, 3), mask="1NTS", dead_rows=True),
}


def _blockwise_params():
  return named_platform_dtypes((("causal-gqa-bias", ["bfloat16"]),
                                ("window-lengths-mask", ["float64"])))


@with_platform("platform,dtype,name", _blockwise_params())
def test_blockwise_path(platform, dtype, name):
  case = case_on(platform, dtype=dtype, **BLOCKWISE_CASES[name])
  inp = make_inputs(case)
  assert_cap_binds(case, inp)
  run = blockwise_run(case, inp)
  check_forward(case, platform, inp=inp, wrap=blockwise_forward(run))
  check_gradients(case, platform, inp=inp, through_lse=True, grad_fn=blockwise_grads(run))


# --- routing -----------------------------------------------------------------------------------


def test_gpu_routing_follows_the_softcap_feature():
  """A soft-capped call runs on a Hopper kernel only if the kernel lists "softcap"."""
  config = canonicalize(*(np.zeros((1, 4, 2, 8), np.float32),) * 3, None, None, scale=None,
                        is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, logits_soft_cap=CAP).config
  plain = canonicalize(*(np.zeros((1, 4, 2, 8), np.float32),) * 3, None, None, scale=None,
                       is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                       local_window_size=None).config
  assert plain.softcap == 0.0 and config.softcap == CAP
  with_cap = _config.Kernel(tiles=(), features=frozenset({"softcap"}))
  without = _config.Kernel(tiles=(), features=frozenset())
  route = functools.partial(_primitive._on_gpu_kernel, kernel_call="kernel",
                            blockwise_call="blockwise", q=jnp.zeros((1, 4, 2, 8), jnp.bfloat16),
                            bias=None, mask=None, q_seg=None)
  assert route(with_cap, config=config) == "kernel"
  assert route(without, config=config) == "blockwise"
  assert route(without, config=plain) == "kernel"


@pytest.mark.parametrize("platform", [GPU], indirect=True)
@pytest.mark.parametrize("with_bias", [False, True], ids=["alone", "with-bias"])
def test_soft_capped_calls_reach_the_hopper_kernels(platform, with_bias):
  """Soft-capping alone, and with a differentiated bias where a combination lists the two."""
  q = jnp.zeros((1, 64, 2, 64), _config.GPU_DTYPES[0])
  bias = jnp.zeros((1, 2, 64, 64), q.dtype)

  def loss(q, k, v, bias):
    return jnp.sum(jax_flash.dot_product_attention(
        q, k, v, bias if with_bias else None, is_causal=True,
        logits_soft_cap=CAP).astype(jnp.float32))

  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(
      q, q, q, bias).compile().as_text()
  for name, kernel in (("jax_flash_fwd", _config.SM90_FORWARD),
                       ("jax_flash_bwd", _config.SM90_BACKWARD)):
    takes = kernel.takes(bias=with_bias, mask=False, softcap=True, segment_ids=False,
                         bias_gradient=with_bias and "bias_gradient" in kernel.features)
    assert (name in hlo) == takes, name


# --- the Hopper kernels ------------------------------------------------------------------------


def _gpu_head_dims():
  """Every compiled tile's head dim and one that is padded onto a tile (72)."""
  return sorted(set(_config.GPU_HEAD_DIMS) | {72})


@with_platform("platform,H", platform_params([], _gpu_head_dims()))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_kernels_head_dims(platform, H, is_causal):
  """Forward and gradients of the Hopper kernels over several query and key blocks, with GQA
  and ragged lengths, in each dtype."""
  for i, dtype in enumerate(_config.GPU_DTYPES):
    case = Case(B=2, T=190, S=190 if is_causal else 230, N=4, K=2, H=H, dtype=dtype.name,
                is_causal=is_causal, q_lens=(190, 77), kv_lens=(150 + 40 * i, 100),
                softcap=CAP, std=STD)
    check_forward(case, platform)
    check_gradients(case, platform, through_lse=True)


@with_platform("platform,cap", platform_params([], [1.0, 30.0]))
def test_gpu_kernels_caps(platform, cap):
  """A tight cap (almost every logit saturated) and a loose one, over many key blocks."""
  case = Case(B=1, T=300, S=300, N=2, H=128, dtype=_config.GPU_DTYPES[-1].name,
              is_causal=True, softcap=cap, std=STD)
  check_forward(case, platform)
  check_gradients(case, platform)


BIAS_CASES = {
    # Logits mostly beyond the cap (the exp form), a bias per item and head.
    "beyond-cap-BNTS": dict(bias="BNTS", std=STD, softcap=CAP),
    # Logits within half the cap (the series, in place), a bias over heads and keys.
    "within-cap-1NTS": dict(bias="1NTS", std=1.0, softcap=30.0),
    # Broadcast over heads and queries: dbias sums over them.
    "beyond-cap-B11S": dict(bias="B11S", std=STD, softcap=CAP),
}


@with_platform("platform,H,name",
               [pytest.param("gpu", H, name, marks=pytest.mark.gpu, id=f"gpu-{H}-{name}")
                for H in _gpu_head_dims() for name in BIAS_CASES])
def test_gpu_kernels_with_a_bias(platform, H, name):
  """The cap, then a bias, on the Hopper kernels (where a feature combination lists the two):
  forward, and gradients with dbias, over several query and key blocks with GQA, a causal
  window and ragged lengths, in each dtype. The second dtype's key count is a multiple of 8:
  the backward reads a bias that keeps both axes (and stores its gradient) in TMA tiles."""
  for i, dtype in enumerate(_config.GPU_DTYPES):
    case = Case(B=2, T=190, S=230 + 2 * i, N=4, K=2, H=H, dtype=dtype.name, is_causal=i == 0,
                q_lens=(190, 77), kv_lens=(190 + 40 * i, 100), **BIAS_CASES[name])
    check_forward(case, platform)
    check_gradients(case, platform, through_lse=True)


# The forms of softcap.h by the reach of |scaled logit| / cap in which each holds (the short
# series up to 0.14, the series up to 0.5, the exp form beyond), and cases that give each warp
# one of them: the cap over the largest ordinary logit, the factor that scales the outlier
# rows' queries (1: none), and the forms the warps take.
SERIES_REACH = {"short series": 0.14, "series": 0.5}
SERIES_FORM_CASES = {
    "series": (2.2, 1.0, {"series"}),
    "series-and-exp": (2.2, 4.0, {"series", "exp"}),
    "short-series": (7.5, 1.0, {"short series"}),
    "short-and-long-series": (7.5, 2.5, {"short series", "series"}),
    "short-series-and-exp": (7.5, 6.0, {"short series", "exp"}),
}


def _in_each_gpu_dtype(case: Case, inp):
  """(case, inputs) in each GPU dtype: q, k and v of `inp` (float64 or any dtype) cast to it."""
  for dtype in _config.GPU_DTYPES:
    dt = np_dtype(dtype.name)
    yield case.replace(dtype=dtype.name), dataclasses.replace(
        inp, q=inp.q.astype(dt), k=inp.k.astype(dt), v=inp.v.astype(dt))


def _cap_form(largest, cap):
  for form, reach in SERIES_REACH.items():
    if largest <= reach * cap:
      return form
  return "exp"


@with_platform("platform,name", platform_params([], list(SERIES_FORM_CASES)))
def test_gpu_kernels_series_form(platform, name):
  """The kernels cap a warp's logits of a block with an odd polynomial when all of them lie
  within half the cap (a shorter one within 0.14 of it), else with exp and a reciprocal
  (softcap.h). The cap here is 2.2 or 7.5 times the largest logit, so that every warp takes
  the series or the short one, while the cap still lowers the row maxima, which rule the
  softmax (by 3 to 6% under the first). With outliers the queries of rows 128-191 are
  scaled up: the warps and backward steps holding them take a longer form, beside ones that
  do not, in the same kernels. In each dtype: in bfloat16 the forward takes the series' bound
  for the row maxima of the blocks off the diagonal, and the floor of the running maxima
  (LogitSoftcap::maxima_floor) for those of the short series' blocks, the diagonal's too."""
  cap_over_largest, outlier_factor, want_forms = SERIES_FORM_CASES[name]
  case = Case(B=2, T=300, S=300, N=2, H=128, dtype=_config.GPU_DTYPES[-1].name, is_causal=True,
              std=STD)
  inp = make_inputs(case)
  ordinary = float(np.abs(scaled_logits(case, inp)).max())
  case = case.replace(softcap=cap_over_largest * ordinary)
  forms = {_cap_form(ordinary, case.softcap)}
  if outlier_factor != 1.0:
    q = inp.q.astype(np.float64)
    q[:, 128:192] *= outlier_factor
    inp = dataclasses.replace(inp, q=q.astype(inp.q.dtype))
    outlying = float(np.abs(scaled_logits(case, inp)[:, :, 128:192]).max())
    forms.add(_cap_form(outlying, case.softcap))
  assert forms == want_forms
  for typed, cast in _in_each_gpu_dtype(case, inp):
    check_forward(typed, platform, inp=cast)
    check_gradients(typed, platform, inp=cast, through_lse=True)


# Key blocks (128 keys, visited from the last) whose keys are scaled up so that the products
# leave the short series' reach there, under a cap 7.5 times the largest ordinary logit: the
# warps cap those blocks in the long series and the others in the short one, and in bfloat16
# the row maxima are taken as the long series' bound (softmax.h's BlockBound) in the first and
# as the floor of the running maxima (LogitSoftcap::maxima_floor) in the second.
LEAVING_BLOCKS = {"one-block": (2,), "last-two-blocks": (0, 1)}


@with_platform("platform,name", platform_params([], list(LEAVING_BLOCKS)))
def test_gpu_blocks_that_leave_the_short_series(platform, name):
  """Exact results where key blocks leave the short series' reach among blocks that do not, in
  each dtype; four key blocks, no masking."""
  case = Case(B=1, T=200, S=512, N=2, H=128, dtype=_config.GPU_DTYPES[0].name, std=STD)
  inp = make_inputs(case)
  ordinary = float(np.abs(scaled_logits(case, inp)).max())
  case = case.replace(softcap=7.5 * ordinary)
  k = inp.k.astype(np.float64)
  for block in LEAVING_BLOCKS[name]:
    k[:, 128 * block:128 * (block + 1)] *= 3.0
  for typed, cast in _in_each_gpu_dtype(case, dataclasses.replace(inp, k=k)):
    logits = np.abs(scaled_logits(typed, cast))
    for block in range(4):
      largest = float(logits[..., 128 * block:128 * (block + 1)].max())
      leaves = block in LEAVING_BLOCKS[name]
      assert (_cap_form(largest, case.softcap) != "short series") == leaves
    check_forward(typed, platform, inp=cast)
    check_gradients(typed, platform, inp=cast, through_lse=True)


@with_platform("platform,H", platform_params([], _gpu_head_dims()))
def test_gpu_gemma_cap_over_unit_logits(platform, H):
  """Gemma 2's cap (50) over unit-scale logits, as the benchmarks run it: every warp takes the
  short series, and in bfloat16 every block, the diagonal's too, takes the floor of the running
  maxima for the row maxima (LogitSoftcap::maxima_floor, softmax.h's BlockBound); causal, with
  grouped heads, over several key blocks, in each dtype."""
  for dtype in _config.GPU_DTYPES:
    case = Case(B=2, T=400, S=400, N=4, K=2, H=H, dtype=dtype.name, is_causal=True,
                softcap=50.0)
    check_forward(case, platform)
    check_gradients(case, platform, through_lse=True)


# Rows whose logits lie far below the running maxima that a bfloat16 forward keeps (softmax.h's
# BlockBound, softcap.h): each key is a shared direction u plus noise, each query row +-alpha u,
# so that a row's logits lie near +-`level` times the cap (a tenth within it) with alternating
# signs. Under cap 50 the running maxima have a floor of about 8 in log2 units
# (LogitSoftcap::maxima_floor), which short-series blocks take for their maxima; cap 60 allows
# none, and there a block that masks nothing takes the capped largest |logit| of the quad's rows
# as the maxima in either series, as the series does under cap 50. The negative rows' maxima lie
# about 50 (the series), 15 (the short one) and, under the floor, 73 (exp form) below the
# running maxima in log2 units. float16 kernels reduce the maxima. Key counts of whole blocks
# (every block bounded) and not (the last, visited first, is masked by lengths).
BOUND_LEVELS = {"short-series": 0.1, "series": 0.36, "exp": 1.5}


@with_platform("platform,name,S,cap",
               [pytest.param("gpu", name, S, cap, marks=pytest.mark.gpu,
                             id=f"gpu-{name}-S{S}-cap{cap:g}")
                for name in BOUND_LEVELS for S in (256, 300) for cap in (50.0, 60.0)])
def test_gpu_series_bound_far_above_the_rows(platform, name, S, cap):
  """Exact results where the forward takes a series' bound or the floor for the row maxima,
  with the rows' true maxima far below it (BOUND_LEVELS), in each dtype."""
  level = BOUND_LEVELS[name]
  case = Case(B=2, T=200, S=S, N=2, H=128, dtype=_config.GPU_DTYPES[0].name, softcap=cap)
  rng = np.random.default_rng(7)
  u = rng.standard_normal(case.H)
  u /= np.linalg.norm(u)
  k = u + 0.1 * rng.standard_normal((case.B, S, case.N, case.H))
  signs = np.where(np.arange(case.T) % 2 == 0, 1.0, -1.0)[None, :, None, None]
  alpha = level * cap * np.sqrt(case.H)
  q = signs * alpha * u + 0.01 * rng.standard_normal((case.B, case.T, case.N, case.H))
  for typed, inp in _in_each_gpu_dtype(case, dataclasses.replace(make_inputs(case), q=q, k=k)):
    largest = float(np.abs(scaled_logits(typed, inp)).max())
    assert _cap_form(largest, cap) == name.replace("-", " ")
    if name != "exp":
      # Within the series' reach (half the cap, 0.14 of it for the short one), and bounded in
      # log2 units by 40 (kBoundLog2Limit).
      assert cap * np.tanh(largest / cap) * np.log2(np.e) <= 40
    check_forward(typed, platform, inp=inp)
    check_gradients(typed, platform, inp=inp, through_lse=True)


# --- Flax ----------------------------------------------------------------------------------------


def test_flax_attention_fn_soft_caps():
  """make_attention_fn(logits_soft_cap=...) passes the cap on, with flax's float masks and
  extra batch axes folded."""
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((2, 3, 7, 4, 16)) * STD, jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 3, 11, 4, 16)) * STD, jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 3, 11, 4, 16)), jnp.float32)
  mask = (rng.random((2, 3, 1, 7, 11)) < 0.8).astype(np.float32)
  mask[..., 0] = 1
  fn = jf.make_attention_fn(is_causal=False, logits_soft_cap=CAP)
  assert f"logits_soft_cap={CAP!r}" in fn.__doc__

  def flat(x):
    return x.reshape((6,) + x.shape[2:])

  out = fn(q, k, v, mask=jnp.asarray(mask), deterministic=True)
  want = jax_flash.dot_product_attention(flat(q), flat(k), flat(v), mask=flat(mask) != 0,
                                         logits_soft_cap=CAP)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want).reshape(out.shape))
  grads = jax.grad(lambda q: jnp.sum(jnp.sin(fn(q, k, v, mask=jnp.asarray(mask)))))(q)
  assert np.isfinite(np.asarray(grads)).all()
