"""Packed sequences (``query_segment_ids`` / ``key_value_segment_ids``): key j is visible to query
i only if their segment ids are equal, on top of every other rule, in the kernels, in the
blockwise path (called directly) and through jax's transformations.

Results are compared with the float64 definition (tests/_reference.py, whose visibility rule
includes the ids), under the criterion of tests/_tolerances.py; jax's own attention has no
segment ids, so the baseline of a case is the definition in the input dtype (float32 on the CPU
for the log-sum-exp). Packed rows are also compared with their documents run one by one without
ids, the documents' own results serving as the baseline of the criterion.

Segment ids are given as run lengths (Case.q_segs, Case.kv_segs): (20, 37, 13) is a row of 70
holding documents 0, 1 and 2; a run of length 0 leaves that id out of its side, so queries of
an id that no key has see nothing, and keys of an id that no query has receive no gradient.
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

import _reference as ref
from _harness import (Case, assert_close, blockwise_forward, blockwise_grads, blockwise_run,
                      check_forward, check_gradients, check_ordered_dq_reduction, cotangents, default_dtype, default_head_dim,
                      forward_baseline, live_rows, lse_dtype, make_inputs, np_dtype, reference_hi,
                      visibility)
from _platforms import (GPU, named_cases_and_dtypes, named_platform_dtypes, platform_dtypes,
                        with_platform)

DOCS = (20, 37, 13)  # documents packed in a row of 70


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  fields.setdefault("T", sum(DOCS))
  fields.setdefault("S", sum(DOCS))
  fields.setdefault("q_segs", DOCS)
  fields.setdefault("kv_segs", fields["q_segs"])
  return Case(**fields)


CASES = {
    # The second batch item holds one document over the whole row.
    "packed-causal-gqa": dict(N=4, K=2, is_causal=True, q_segs=(DOCS, (70, 0, 0))),
    "unbatched-unsorted-mqa-negative-scale": dict(B=None, T=40, S=40, q_segs=(13, 15, 12),
                                                  shuffle_segs="both", N=4, K=1, bias="NTS",
                                                  scale=-0.4),
    # Sorted query ids, unsorted key ids.
    "cross-window-lengths": dict(B=3, T=40, S=66, q_segs=(10, 25, 5), kv_segs=(30, 20, 16),
                                 shuffle_segs="kv", window=(12, 4), q_lens=(40, 17, 0),
                                 kv_lens=(66, 30, 20)),
    "bias-mask-softcap": dict(bias="BNTS", mask="B1TS", softcap=5.0, std=3.0),
    # Query document 1 has no key, key document 3 no query.
    "one-sided-ids": dict(q_segs=(20, 37, 13, 0), kv_segs=(20, 0, 30, 20), bias="1NTS"),
}
# Each dtype on the CPU kernels for these; the default dtype for the others.
ALL_DTYPE_CASES = ("packed-causal-gqa",)


@with_platform("platform,dtype,name", named_cases_and_dtypes(CASES, ALL_DTYPE_CASES))
def test_forward(platform, dtype, name):
  case = case_on(platform, dtype=dtype, **CASES[name])
  inp = make_inputs(case)
  ordered = lambda ids: bool(np.all(np.diff(ids, axis=-1) >= 0))
  assert ordered(inp.q_seg) == (case.shuffle_segs not in ("q", "both"))
  assert ordered(inp.kv_seg) == (case.shuffle_segs not in ("kv", "both"))
  check_forward(case, platform, inp=inp)


@with_platform("platform,dtype,name", named_cases_and_dtypes(CASES, ALL_DTYPE_CASES))
def test_gradients(platform, dtype, name):
  """dq, dk, dv, dbias; the cotangent also reaches the log-sum-exp."""
  check_gradients(case_on(platform, dtype=dtype, **CASES[name]), platform, through_lse=True)


def _documents(runs, batch):
  """(b, start, stop) of every non-empty document of every batch item."""
  rows = runs if isinstance(runs[0], tuple) else (runs,) * batch
  spans = []
  for b, row in enumerate(rows):
    bounds = np.cumsum((0,) + row)
    spans += [(b, int(a), int(z)) for a, z in zip(bounds[:-1], bounds[1:]) if z > a]
  return spans


@with_platform("platform,dtype", platform_dtypes(["float32", "bfloat16"]))
def test_packed_documents_equal_documents_one_by_one(platform, dtype):
  """A packed row of causal, windowed, grouped-query attention gives each document what the
  document alone gives without segment ids (positions restart at 0 there, which causality and
  windows, relative to the diagonal, do not see): outputs, lse and gradients, judged against
  the float64 definition with the documents' own results as the baseline."""
  case = case_on(platform, dtype=dtype, N=4, K=2, is_causal=True, window=(15, 0),
                 q_segs=(DOCS, (35, 35, 0)))
  inp = make_inputs(case)
  vis = visibility(case, inp)
  dout, dlse = cotangents(case, inp, vis, seed=0)
  dt = np_dtype(dtype)

  def run(q, k, v, dout, dlse, q_seg=None, kv_seg=None):
    def f(q, k, v):
      return jax_flash.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(15, 0), return_residual=True,
          query_segment_ids=q_seg, key_value_segment_ids=kv_seg)
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return (out, lse) + pullback((dout, dlse))

  arrays = [jnp.asarray(x) for x in (inp.q, inp.k, inp.v, dout, dlse)]
  packed = jax.jit(run)(*arrays, jnp.asarray(inp.q_seg), jnp.asarray(inp.kv_seg))
  packed = [np.asarray(x) for x in packed]
  with ref.precise():
    def definition(q, k, v):
      return ref.attention_with_lse(q, k, v, None, vis)
    (out_hi, lse_hi), pullback = jax.vjp(
        definition, *(jnp.asarray(x, jnp.float64) for x in (inp.q, inp.k, inp.v)))
    hi = [np.asarray(x) for x in (out_hi, lse_hi) + pullback(
        (jnp.asarray(dout, jnp.float64), jnp.asarray(dlse, jnp.float64)))]

  names = ("output", "lse", "dq", "dk", "dv")
  kinds = ("fwd", "lse", "grad", "grad", "grad")
  for b, start, stop in _documents(case.q_segs, case.B):
    piece = lambda x: x[b:b + 1, start:stop]
    alone = jax.jit(run)(*(piece(x) for x in arrays))
    for name, kind, ours, want, base in zip(names, kinds, packed, hi, alone):
      assert_close(f"document [{start}, {stop}) of item {b}: {name}", piece(ours), piece(want),
                   np.asarray(base), kind=kind, dtype=dt,
                   result_dtype=lse_dtype(dt) if kind == "lse" else dt, note="document alone")


def test_rows_without_visible_keys(platform):
  """Queries of a segment no key has, and keys of a segment no query has (test_forward checks
  their output 0 and lse -inf): no NaN anywhere, cotangents on the empty rows change no
  gradient, dq of the empty rows and dk, dv of the unseen keys are exactly 0, and the segment
  ids, integer operands, get symbolic zero cotangents (float0)."""
  case = case_on(platform, q_segs=(20, 37, 13, 0), kv_segs=(20, 0, 30, 20), is_causal=True,
                 q_lens=(70, 60), bias="BNTS")
  inp = make_inputs(case)
  vis = visibility(case, inp)
  live = live_rows(case, vis)
  seen = vis.any(axis=(1, 2))  # (B, S): keys some query sees
  assert (~live).any() and live.any() and (~seen).any()
  dout, dlse = cotangents(case, inp, vis, seed=0)  # zero on empty rows
  rng = np.random.default_rng(7)
  dout_noisy = np.where(live[..., None], dout, rng.standard_normal(dout.shape)).astype(dout.dtype)
  dlse_noisy = np.where(live, dlse, rng.standard_normal(dlse.shape)).astype(dlse.dtype)

  def f(q, k, v, b, q_seg, kv_seg):
    return jax_flash.dot_product_attention(
        q, k, v, b, is_causal=True, query_seq_lengths=jnp.asarray(inp.q_lens),
        return_residual=True, query_segment_ids=q_seg, key_value_segment_ids=kv_seg)

  @jax.jit
  def pullback(dout, dlse):
    primals = (inp.q, inp.k, inp.v, inp.bias, inp.q_seg, inp.kv_seg)
    return jax.vjp(f, *(jnp.asarray(x) for x in primals))[1]((dout, dlse))

  def grads(dout, dlse):
    grads = pullback(jnp.asarray(dout), jnp.asarray(dlse))
    assert [g.dtype for g in grads[4:]] == [jax.dtypes.float0] * 2
    return [np.asarray(g) for g in grads[:4]]

  clean, noisy = grads(dout, dlse), grads(dout_noisy, dlse_noisy)
  for name, a, b in zip(("dq", "dk", "dv", "dbias"), clean, noisy):
    assert np.isfinite(b.astype(np.float64)).all(), name
    np.testing.assert_array_equal(a, b, err_msg=name)
  dq, dk, dv, dbias = noisy
  assert np.all(dq[~live] == 0)
  assert np.all(dk[~seen] == 0) and np.all(dv[~seen] == 0)
  assert np.all(np.swapaxes(dbias, 1, 2)[~live] == 0)
  assert np.all(dbias[~vis] == 0)


# --- transformations (every other test runs under jit) ------------------------------------------


def test_eager(platform):
  check_forward(case_on(platform, T=13, S=17, q_segs=(5, 8), kv_segs=(9, 8), is_causal=True,
                        kv_lens=(17, 9)), platform, wrap=None)


M = 3  # mapped size of vmap
# Per mapped problem, the (query, key/value) runs of ids 0, 1, 2 in rows of 13 and 17: two
# documents, one document with no key (every row empty), three documents.
VMAP_RUNS = (((5, 8, 0), (9, 8, 0)), ((13, 0, 0), (0, 17, 0)), ((2, 2, 9), (4, 4, 9)))
OPERANDS = ("q", "k", "v", "q_seg", "kv_seg")
VMAP_SUBSETS = {
    "all": {"q", "k", "v", "q_seg", "kv_seg"},
    "only-ids": {"q_seg", "kv_seg"},
    "query-and-its-ids": {"q", "q_seg"},
    "only-query-ids-shared": {"q"},
}


@pytest.mark.parametrize("subset", VMAP_SUBSETS)
def test_jit_of_vmap_of_grad(platform, subset):
  """jit(vmap(grad)) over a leading axis of a subset of the operands, ids mapped or shared:
  outputs against the float64 definition of each problem, and outputs and gradients equal to
  one call per problem."""
  mapped = VMAP_SUBSETS[subset]
  case = case_on(platform, T=13, S=17, N=4, K=2, q_segs=VMAP_RUNS[0][0],
                 kv_segs=VMAP_RUNS[0][1], is_causal=True, shuffle_segs="kv")
  shared = make_inputs(case)
  problems = []
  for m, (q_runs, kv_runs) in enumerate(VMAP_RUNS):
    own = make_inputs(case.replace(q_segs=q_runs, kv_segs=kv_runs,
                                   shuffle_segs=None if m == 0 else "kv"), seed=1 + m)
    problems.append(dataclasses.replace(shared, **{n: getattr(own, n) for n in mapped}))
  dt = np_dtype(case.dtype)
  rng = np.random.default_rng(11)
  dout = jnp.asarray(rng.standard_normal((M,) + shared.q.shape).astype(dt))

  def value_and_grads(q, k, v, q_seg, kv_seg, dout):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=q_seg,
                                            key_value_segment_ids=kv_seg)
      return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out,) + grads

  args = [jnp.asarray(np.stack([getattr(p, n) for p in problems]) if n in mapped
                      else getattr(shared, n)) for n in OPERANDS]
  in_axes = tuple(0 if n in mapped else None for n in OPERANDS) + (0,)
  got = jax.jit(jax.vmap(value_and_grads, in_axes=in_axes))(*args, dout)
  single = jax.jit(value_and_grads)
  want = [single(*(jnp.asarray(getattr(p, n)) for n in OPERANDS), dout[m])
          for m, p in enumerate(problems)]
  for i, name in enumerate(("out", "dq", "dk", "dv")):
    stacked = np.stack([np.asarray(w[i], np.float64) for w in want])
    # The same kernels on the same rows: on the CPU bit for bit; the Hopper backward adds dQ in
    # any order.
    tol = 0.0 if platform == "cpu" else 4 * float(jnp.finfo(dt).eps) * max(
        1.0, np.abs(stacked).max())
    np.testing.assert_allclose(np.asarray(got[i], np.float64), stacked, rtol=0, atol=tol,
                               err_msg=name)

  out = np.asarray(got[0])
  his, bases, lives = [], [], []
  for p in problems:
    vis = visibility(case, p)
    his.append(reference_hi(case, p, vis)[0])
    bases.append(forward_baseline(case, p, platform)[0])
    lives.append(live_rows(case, vis))
  live = np.stack(lives)
  if {"q_seg", "kv_seg"} <= mapped:
    assert not live[1].any() and live[0].any()
  assert np.all(out.astype(np.float64)[~live] == 0)
  assert_close(f"vmap {subset}", out.astype(np.float64)[live], np.stack(his)[live],
               np.stack(bases)[live], kind="fwd", dtype=dt, note="definition")


# --- the FFI calls' segment operands -----------------------------------------------------------


def _brute_spans(ids, other):
  """_primitive._spans by its definition, per batch item: the tight range where `other` is
  sorted, else everything, marked inexact (lo = -1)."""
  lo = np.full(ids.shape, -1, np.int32)
  hi = np.full(ids.shape, other.shape[-1], np.int32)
  if np.all(np.diff(other) >= 0):
    lo = np.searchsorted(other, ids, side="left")
    hi = np.searchsorted(other, ids, side="right")
  return np.stack([lo, hi], axis=-1)


def test_spans():
  """Sorted, unsorted and absent ids; batch axes of extent 1 on either side broadcast."""
  rng = np.random.default_rng(5)
  q_seg = np.stack([np.repeat([0, 1, 2], [4, 3, 2]), np.repeat([1, 3, 4], [2, 2, 5]),
                    rng.integers(0, 3, 9)]).astype(np.int32)  # (3, 9)
  kv_seg = np.stack([np.repeat([0, 2, 5], [3, 6, 2]), rng.integers(0, 3, 11),
                     np.repeat([0, 1, 2], [1, 1, 9])]).astype(np.int32)  # (3, 11)
  spans = jax.jit(_primitive._spans)
  for a, b in ((q_seg, kv_seg), (kv_seg, q_seg)):
    got = np.asarray(spans(a, b))
    assert got.shape == a.shape + (2,) and got.dtype == np.int32
    for i in range(3):
      np.testing.assert_array_equal(got[i], _brute_spans(a[i], b[i]))
  # (2, 1, T) ids against (1, 3, S): (2, 3, T, 2) spans.
  got = np.asarray(spans(q_seg[:2, None], kv_seg[None]))
  assert got.shape == (2, 3, 9, 2)
  for i in range(2):
    for j in range(3):
      np.testing.assert_array_equal(got[i, j], _brute_spans(q_seg[i], kv_seg[j]))


def test_cpu_kernels_take_the_ids_and_their_spans():
  """On the CPU both passes run in the kernels, which receive the ids and the spans."""
  B, T, S = 2, 13, 17
  q, k = jnp.zeros((B, T, 2, 8)), jnp.zeros((B, S, 1, 8))
  q_seg, kv_seg = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)

  def loss(q, k, v):
    return jnp.sum(jax_flash.dot_product_attention(
        q, k, v, query_segment_ids=q_seg, key_value_segment_ids=kv_seg))

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
  for target in ("jax_flash_fwd", "jax_flash_bwd"):
    (call,) = [l for l in hlo.splitlines() if f'custom_call_target="{target}"' in l]
    for shape in (f"s32[{B},{T}]", f"s32[{B},{S}]", f"s32[{B},{T},2]", f"s32[{B},{S},2]"):
      assert shape in call, (target, shape)


# --- the blockwise path, called directly -------------------------------------------------------

BLOCKWISE_CASES = {
    "packed-causal-gqa-bias": dict(N=4, K=2, H=24, is_causal=True, bias="B1TS",
                                   q_segs=(DOCS, (35, 35, 0))),
    "cross-unsorted-window-lengths-mask": dict(
        B=3, T=40, S=50, q_segs=(13, 15, 12, 0), kv_segs=(20, 0, 25, 5), shuffle_segs="both",
        q_lens=(40, 17, 0), kv_lens=(50, 5, 20), window=(19, 3), mask="1NTS", dead_rows=True),
}


def _blockwise_params():
  return named_platform_dtypes((("packed-causal-gqa-bias", ["bfloat16"]),
                                ("cross-unsorted-window-lengths-mask", ["float64"])))


@with_platform("platform,dtype,name", _blockwise_params())
def test_blockwise_path(platform, dtype, name):
  case = case_on(platform, dtype=dtype, **BLOCKWISE_CASES[name])
  inp = make_inputs(case)
  run = blockwise_run(case, inp)
  check_forward(case, platform, inp=inp, wrap=blockwise_forward(run))
  check_gradients(case, platform, inp=inp, through_lse=True, grad_fn=blockwise_grads(run))


# --- routing -----------------------------------------------------------------------------------


def test_gpu_routing_follows_the_segment_ids_feature():
  """A call with segment ids runs on a Hopper kernel only if the kernel lists "segment_ids"
  (both do: kernel_configs.json); without ids the same kernel runs it."""
  config = canonicalize(*(np.zeros((1, 4, 2, 8), np.float32),) * 3, None, None, scale=None,
                        is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None).config
  ids = jnp.zeros((1, 4), jnp.int32)
  taking = _config.Kernel(tiles=(), features=frozenset({"segment_ids"}))
  plain = _config.Kernel(tiles=(), features=frozenset())
  route = functools.partial(_primitive._on_gpu_kernel, kernel_call="kernel",
                            blockwise_call="blockwise", q=jnp.zeros((1, 4, 2, 8), jnp.bfloat16),
                            config=config, bias=None, mask=None)
  assert route(taking, q_seg=ids) == "kernel"
  assert route(plain, q_seg=ids) == "blockwise"
  assert route(plain, q_seg=None) == "kernel"
  for kernel in (_config.SM90_FORWARD, _config.SM90_BACKWARD):
    assert "segment_ids" in kernel.features
    assert route(kernel, q_seg=ids) == "kernel"


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_calls_with_segment_ids_reach_the_kernels(platform):
  """On the GPU, forward and backward with segment ids compile to the Hopper kernels' calls
  where the kernels list the feature, as the same call without ids does; with a bias or a
  mask array too where a feature combination lists the pair."""
  dtype = _config.GPU_DTYPES[0]
  q = jnp.zeros((1, 64, 2, 64), dtype)
  ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 32)[None]

  def hlo(**options):
    def loss(q, k, v):
      return jnp.sum(jax_flash.dot_product_attention(
          q, k, v, is_causal=True, **options).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()

  def on_kernels(text, bias=False, mask=False):
    return [name in text for name in ("jax_flash_fwd", "jax_flash_bwd")] == [
        kernel.takes(bias=bias, mask=mask, softcap=False, segment_ids=True)
        for kernel in (_config.SM90_FORWARD, _config.SM90_BACKWARD)]

  packed = dict(query_segment_ids=ids, key_value_segment_ids=ids)
  assert on_kernels(hlo(**packed))
  assert on_kernels(hlo(bias=jnp.ones((1, 2, 64, 64), dtype), **packed), bias=True)
  assert on_kernels(hlo(mask=jnp.ones((1, 1, 64, 64), bool), **packed), mask=True)
  without = hlo()
  assert "jax_flash_fwd" in without and "jax_flash_bwd" in without


# --- the GPU -----------------------------------------------------------------------------------


# Runs over 800 positions that cross the kernels' blocks (64-192 rows) at odd places, a
# document of a single position, and a batch item holding one document over the whole row
# (whole blocks inside one document: no per-element test there).
LONG_RUNS = ((300, 1, 99, 250, 150), (800, 0, 0, 0, 0))
GPU_PACKED_ROWS = {
    "sorted": dict(),
    # Unsorted ids: spans cover the whole row (not exact) and the ids are compared everywhere.
    "unsorted": dict(shuffle_segs="both"),
    # Query document 1 has no key (its rows see nothing), key document 3 no query.
    "one-sided": dict(q_segs=((300, 100, 0, 250, 150), (800, 0, 0, 0, 0)),
                      kv_segs=((300, 0, 100, 250, 150), (800, 0, 0, 0, 0))),
    "window-softcap": dict(window=(90, 0), softcap=4.0),
    # A relative-position bias per head (dbias summed over the batch), and a mask array: each
    # with segment ids where a feature combination lists the pair.
    "bias": dict(bias="1NTS"),
    "mask": dict(mask="B1TS"),
}


@with_platform("platform,H,name",
               [pytest.param("gpu", H, name, marks=pytest.mark.gpu, id=f"gpu-{H}-{name}")
                for H in sorted(set(_config.GPU_HEAD_DIMS)) for name in GPU_PACKED_ROWS])
def test_gpu_long_packed_rows(platform, H, name):
  """Many documents per row over many key blocks, causal with GQA and ragged lengths, in each
  GPU dtype, on the Hopper kernels."""
  for i, dtype in enumerate(_config.GPU_DTYPES):
    fields = dict(B=2, T=800, S=800, N=4, K=2, H=H, dtype=dtype.name, is_causal=True,
                  q_lens=(800, 500), kv_lens=(700 + 50 * i, 800), q_segs=LONG_RUNS,
                  kv_segs=LONG_RUNS)
    case = Case(**{**fields, **GPU_PACKED_ROWS[name]})
    check_forward(case, platform)
    check_gradients(case, platform, through_lse=True)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_deterministic_gradients_with_segment_ids(platform):
  """The ordered dQ reduction with segment ids (whose key blocks visit every query block their
  window reaches): bit-identical from run to run, and equal to the unordered one within
  rounding."""
  case = Case(B=2, T=800, S=800, N=4, K=2, H=128, dtype=_config.GPU_DTYPES[0].name,
              is_causal=True, q_segs=LONG_RUNS, kv_segs=LONG_RUNS)
  inp = make_inputs(case)
  q, k, v = (jnp.asarray(x) for x in (inp.q, inp.k, inp.v))
  check_ordered_dq_reduction(q, k, v, is_causal=True,
                             query_segment_ids=jnp.asarray(inp.q_seg),
                             key_value_segment_ids=jnp.asarray(inp.kv_seg))


# --- Flax ----------------------------------------------------------------------------------------


def test_flax_attention_fn_passes_segment_ids():
  """attention_fn(..., query_segment_ids=, key_value_segment_ids=) with extra batch axes
  folded, as a module that packs its sequences would call it."""
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((2, 3, 7, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 3, 11, 4, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 3, 11, 4, 16)), jnp.float32)
  q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 3, 7)), axis=-1), jnp.int32)
  kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 3, 11)), axis=-1), jnp.int32)
  fn = jf.make_attention_fn(is_causal=True)

  def flat(x):
    return x.reshape((6,) + x.shape[2:])

  out = fn(q, k, v, deterministic=True, query_segment_ids=q_seg, key_value_segment_ids=kv_seg)
  want = jax_flash.dot_product_attention(flat(q), flat(k), flat(v), is_causal=True,
                                         query_segment_ids=flat(q_seg),
                                         key_value_segment_ids=flat(kv_seg))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want).reshape(out.shape))
  plain = fn(q[0], k[0], v[0], query_segment_ids=q_seg[0], key_value_segment_ids=kv_seg[0])
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(out[0]))
  with pytest.raises(ValueError, match="query_segment_ids"):
    fn(q, k, v, query_segment_ids=q_seg[0], key_value_segment_ids=kv_seg)
