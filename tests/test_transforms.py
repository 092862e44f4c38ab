"""jax transformations: jit, grad, value_and_grad, checkpoint, vmap (any subset of arguments,
non-leading axes, nested), vmap(grad), grad(vmap), jit(vmap(grad)), jacobians; second
derivatives and forward mode are refused with clear errors.

Mapped sizes (3, and 4 for the inner map) always differ from the batch size (2), so a mixed-up
axis changes shapes instead of passing silently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

import _reference as ref
from _harness import (Case, Inputs, assert_close, check_forward, check_gradients, default_dtype,
                      default_head_dim, forward_baseline, live_rows, make_inputs, np_dtype,
                      reference_hi, visibility)

M = 3  # mapped size of vmap
M_INNER = 4  # mapped size of an inner vmap


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  fields.setdefault("B", 2)
  fields.setdefault("T", 13)
  fields.setdefault("S", 17)
  return Case(**fields)


# --- jit, grad, value_and_grad, checkpoint ---------------------------------------------------


@pytest.mark.parametrize("wrap", [None, jax.jit], ids=["eager", "jit"])
def test_eager_and_jit(platform, wrap):
  check_forward(case_on(platform, is_causal=True, bias="1NTS", kv_lens=(17, 9)), platform,
                wrap=wrap)


def _loss_grads(f, primals, cotangent, transform):
  """Gradients of sum(f(*p) * cotangent) through jax.grad under `transform`."""
  def loss(*p):
    out = f(*p)
    return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

  argnums = tuple(range(len(primals)))
  grads = transform(jax.grad(loss, argnums=argnums))(*primals)
  return grads, f(*primals)


GRAD_TRANSFORMS = {
    "grad": lambda g: g,
    "jit-grad": jax.jit,
}


@pytest.mark.parametrize("name", GRAD_TRANSFORMS)
def test_grad(platform, name):
  case = case_on(platform, is_causal=True, bias="BNTS")
  check_gradients(case, platform,
                  grad_fn=lambda f, p, ct: _loss_grads(f, p, ct, GRAD_TRANSFORMS[name]))


def test_value_and_grad(platform):
  case = case_on(platform, window=(4, 2), mask="B1TS")
  seen = {}

  def grad_fn(f, primals, cotangent):
    def loss(*p):
      return jnp.sum(f(*p).astype(jnp.float32) * cotangent.astype(jnp.float32))
    value, grads = jax.value_and_grad(loss, argnums=tuple(range(len(primals))))(*primals)
    seen["value"], seen["expected"] = float(value), float(loss(*primals))
    return grads, f(*primals)

  check_gradients(case, platform, grad_fn=grad_fn)
  # The value comes from the custom_vjp's forward rule, the expected loss from the primal
  # call: the same kernel on the same inputs, summed by the same ops.
  assert seen["value"] == seen["expected"]


def test_checkpoint(platform):
  case = case_on(platform, is_causal=True, q_lens=(13, 6))

  def grad_fn(f, primals, cotangent):
    return _loss_grads(jax.checkpoint(f), primals, cotangent, jax.jit)

  check_gradients(case, platform, grad_fn=grad_fn)


# --- vmap --------------------------------------------------------------------------------------


def _mapped_inputs(case: Case, mapped: set, n: int = M, seed: int = 0):
  """n problems that differ only in the `mapped` operands (names of Inputs fields); mapped
  sequence lengths are drawn per problem (0 included)."""
  shared = make_inputs(case, seed)
  rng = np.random.default_rng(seed + 99)
  problems = []
  for m in range(n):
    own = make_inputs(case, seed + 1 + m)
    if own.q_lens is not None:
      own.q_lens = rng.integers(0, case.T + 1, own.q_lens.shape).astype(np.int32)
    if own.kv_lens is not None:
      own.kv_lens = rng.integers(0, case.S + 1, own.kv_lens.shape).astype(np.int32)
    problems.append(dataclasses.replace(
        shared, **{name: getattr(own, name) for name in mapped}))
  return problems


def _stack(problems, name, axis=0):
  return np.stack([getattr(p, name) for p in problems], axis=axis)


def _expected(case: Case, problems, platform, *, fn=None):
  """Per-problem float64 definition and baseline outputs, stacked, plus live-row masks."""
  his, bases, lives = [], [], []
  for inp in problems:
    vis = visibility(case, inp)
    out_hi, _ = reference_hi(case, inp, vis)
    base, _ = forward_baseline(case, inp, platform)
    his.append(out_hi)
    bases.append(base)
    lives.append(live_rows(case, vis))
  base = None if bases[0] is None else np.stack(bases)
  return np.stack(his), base, np.stack(lives)


def _check_stacked(what, case, ours, problems, platform):
  hi, base, live = _expected(case, problems, platform)
  dt = np_dtype(case.dtype)
  assert ours.shape == hi.shape and ours.dtype == dt, (ours.shape, hi.shape, ours.dtype)
  assert np.all(ours.astype(np.float64)[~live] == 0)
  assert_close(what, ours.astype(np.float64)[live], hi[live],
               None if base is None else base[live], kind="fwd", dtype=dt,
               chain=case.S + case.H,
               logit_max=max(ref.logits_max(p.q, p.k, p.bias, visibility(case, p))
                             for p in problems))


def _call(case: Case):
  def f(q, k, v, bias=None, mask=None, q_lens=None, kv_lens=None):
    return jax_flash.dot_product_attention(
        q, k, v, bias, mask, scale=case.scale, is_causal=case.is_causal,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, local_window_size=case.window)
  return f


OPERANDS = ("q", "k", "v", "bias", "mask", "q_lens", "kv_lens")

# Which operands are mapped (on axis 0); the rest are shared by all mapped problems.
VMAP_SUBSETS = {
    "all": {"q", "k", "v", "bias", "mask", "q_lens", "kv_lens"},
    "only-query": {"q"},
    "only-key-value": {"k", "v"},
    "only-bias": {"bias"},
    "only-mask": {"mask"},
    "only-lengths": {"q_lens", "kv_lens"},
    "query-and-bias": {"q", "bias"},
}


@pytest.mark.parametrize("subset", VMAP_SUBSETS)
def test_vmap_over_a_subset_of_arguments(platform, subset):
  case = case_on(platform, N=4, K=2, bias="1NTS", mask="B1TS", q_lens=(13, 8), kv_lens=(11, 17),
                 is_causal=True)
  mapped = VMAP_SUBSETS[subset]
  problems = _mapped_inputs(case, mapped)
  args = [jnp.asarray(_stack(problems, n) if n in mapped else getattr(problems[0], n))
          for n in OPERANDS]
  in_axes = tuple(0 if n in mapped else None for n in OPERANDS)
  ours = np.asarray(jax.vmap(_call(case), in_axes=in_axes)(*args))
  _check_stacked(f"vmap {subset}", case, ours, problems, platform)


def test_vmap_over_non_leading_axes(platform):
  """Query mapped on axis 2, key on the last axis, value on axis 1, bias on axis -2."""
  case = case_on(platform, bias="BNTS")
  problems = _mapped_inputs(case, {"q", "k", "v", "bias"})
  q = _stack(problems, "q", axis=2)
  k = _stack(problems, "k", axis=-1)
  v = _stack(problems, "v", axis=1)
  bias = _stack(problems, "bias", axis=-2)
  f = jax.vmap(_call(case), in_axes=(2, -1, 1, -2), out_axes=1)
  ours = np.asarray(f(*(jnp.asarray(x) for x in (q, k, v, bias))))
  _check_stacked("vmap non-leading axes", case, np.moveaxis(ours, 1, 0), problems, platform)


def test_vmap_over_unbatched_inputs(platform):
  """Rank-3 (T, N, H) inputs under vmap: the mapped axis plays the batch."""
  case = case_on(platform, B=None, bias="NTS", is_causal=True)
  problems = _mapped_inputs(case, {"q", "k", "v", "bias"})
  args = [jnp.asarray(_stack(problems, n)) for n in ("q", "k", "v", "bias")]
  ours = np.asarray(jax.vmap(_call(case))(*args))
  _check_stacked("vmap unbatched", case, ours, problems, platform)


def test_nested_vmap(platform):
  """Outer map over q, k, v (M problems); inner map over q only (M_INNER problems each)."""
  case = case_on(platform, T=9, S=11, kv_lens=(11, 5))
  outer = _mapped_inputs(case, {"q", "k", "v"})
  grid = [_mapped_inputs(case.replace(), {"q"}, n=M_INNER, seed=100 * (i + 1)) for i in range(M)]
  # Inner problems share the outer problem's k and v.
  grid = [[dataclasses.replace(p, k=outer[i].k, v=outer[i].v) for p in row]
          for i, row in enumerate(grid)]
  q = np.stack([np.stack([p.q for p in row]) for row in grid])  # (M, M_INNER, B, T, N, H)
  k, v = _stack(outer, "k"), _stack(outer, "v")
  kv_lens = jnp.asarray(outer[0].kv_lens)
  inner = jax.vmap(lambda q, k, v: _call(case)(q, k, v, kv_lens=kv_lens), in_axes=(0, None, None))
  f = jax.vmap(inner, in_axes=(0, 0, 0))
  ours = np.asarray(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
  flat = [p for row in grid for p in row]
  ours = ours.reshape((M * M_INNER,) + ours.shape[2:])
  _check_stacked("nested vmap", case, ours, flat, platform)


# --- vmap and grad together -------------------------------------------------------------------


def _grad_names(case: Case):
  """The differentiated operands: the bias too when the case has one."""
  return ("q", "k", "v", "bias") if case.bias is not None else ("q", "k", "v")


def _loss(case: Case, dout, *operands):
  out = _call(case)(*operands)
  return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))


def _reference_grads(case: Case, inp: Inputs, dout, dtype):
  vis = visibility(case, inp)
  names = _grad_names(case)

  def loss(*operands):
    bias = operands[3] if len(operands) > 3 else None
    out, _ = ref.attention_with_lse(*operands[:3], bias, vis, scale=case.scale)
    return jnp.sum(out * jnp.asarray(dout).astype(out.dtype))

  args = [jnp.asarray(getattr(inp, n)).astype(dtype) for n in names]
  return [np.asarray(g) for g in jax.grad(loss, argnums=tuple(range(len(names))))(*args)]


def _check_grads_stacked(what, case, ours, problems, dout, kv_shared: bool):
  """ours: (dq, dk, dv[, dbias]), each stacked over problems (dk/dv summed when k/v are
  shared). References: the definition in float64, and as baseline in the input dtype (the cases
  have no empty rows, where the definition and jax's path agree)."""
  dt = np_dtype(case.dtype)
  with ref.precise():
    hi = [_reference_grads(case, p, dout[m], np.float64) for m, p in enumerate(problems)]
  base = None
  if dt != np.float64:
    base = [_reference_grads(case, p, dout[m], dt) for m, p in enumerate(problems)]
  assert len(ours) == len(_grad_names(case))
  for g, name in enumerate(("dq", "dk", "dv", "dbias")[:len(ours)]):
    reduce = kv_shared and name in ("dk", "dv")
    h = np.stack([x[g] for x in hi])
    b = None if base is None else np.stack([np.asarray(x[g], np.float64) for x in base])
    if reduce:  # a shared k/v gets the sum of the problems' gradients
      h = h.sum(0)
      b = None if b is None else b.sum(0)
    o = np.asarray(ours[g])
    assert o.shape == h.shape and o.dtype == dt, (name, o.shape, h.shape, o.dtype)
    assert_close(f"{what} {name}", o, h, b, kind="grad", dtype=dt,
                 chain=case.S + case.T + case.H + (len(problems) if reduce else 0))


# With a bias the GPU backward runs on the blockwise path, without one on the Hopper kernel.
GRAD_BIAS = pytest.mark.parametrize("bias", ["BNTS", None], ids=["bias", "no-bias"])


def _grad_setup(platform, mapped, bias):
  case = case_on(platform, bias=bias, is_causal=True, N=2, K=1)
  problems = _mapped_inputs(case, mapped)
  rng = np.random.default_rng(11)
  dout = rng.standard_normal((M,) + problems[0].q.shape).astype(np_dtype(case.dtype))
  return case, problems, dout


def _grad_fn(case: Case):
  names = _grad_names(case)
  return jax.grad(lambda d, *operands: _loss(case, d, *operands),
                  argnums=tuple(range(1, len(names) + 1)))


@GRAD_BIAS
def test_vmap_of_grad(platform, bias):
  case, problems, dout = _grad_setup(platform, {"q", "k", "v", "bias"}, bias)
  args = [jnp.asarray(_stack(problems, n)) for n in _grad_names(case)]
  ours = jax.vmap(_grad_fn(case))(jnp.asarray(dout), *args)
  _check_grads_stacked("vmap(grad)", case, ours, problems, dout, kv_shared=False)


@GRAD_BIAS
def test_jit_of_vmap_of_grad_with_shared_key_value(platform, bias):
  """k and v unmapped: vmap(grad) still returns one gradient per mapped problem (the backward
  sees a broadcast k/v, extent 1 on the mapped axis)."""
  case, problems, dout = _grad_setup(platform, {"q", "bias"}, bias)
  in_axes = (0, 0, None, None, 0)[:len(_grad_names(case)) + 1]
  f = jax.jit(jax.vmap(_grad_fn(case), in_axes=in_axes))
  args = [jnp.asarray(_stack(problems, "q")), jnp.asarray(problems[0].k),
          jnp.asarray(problems[0].v)]
  if case.bias is not None:
    args.append(jnp.asarray(_stack(problems, "bias")))
  ours = f(jnp.asarray(dout), *args)
  _check_grads_stacked("jit(vmap(grad))", case, ours, problems, dout, kv_shared=False)


@GRAD_BIAS
def test_grad_of_vmap_with_shared_key_value(platform, bias):
  """k and v unmapped inside grad: their gradient is the sum over the mapped problems."""
  case, problems, dout = _grad_setup(platform, {"q", "bias"}, bias)
  names = _grad_names(case)

  def total(*operands):
    in_axes = (0, None, None, 0)[:len(names)]
    out = jax.vmap(_call(case), in_axes=in_axes)(*operands)
    return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout).astype(jnp.float32))

  args = [jnp.asarray(_stack(problems, "q")), jnp.asarray(problems[0].k),
          jnp.asarray(problems[0].v)]
  if case.bias is not None:
    args.append(jnp.asarray(_stack(problems, "bias")))
  ours = jax.grad(total, argnums=tuple(range(len(names))))(*args)
  _check_grads_stacked("grad(vmap) shared k/v", case, ours, problems, dout, kv_shared=True)


@GRAD_BIAS
def test_grad_of_vmap(platform, bias):
  case, problems, dout = _grad_setup(platform, {"q", "k", "v", "bias"}, bias)
  names = _grad_names(case)

  def total(*operands):
    out = jax.vmap(_call(case))(*operands)
    return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout).astype(jnp.float32))

  args = [jnp.asarray(_stack(problems, n)) for n in names]
  ours = jax.grad(total, argnums=tuple(range(len(names))))(*args)
  _check_grads_stacked("grad(vmap)", case, ours, problems, dout, kv_shared=False)


# --- jacobians ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argnum", [0, 1, 2], ids=["wrt-query", "wrt-key", "wrt-value"])
def test_jacobian(platform, argnum):
  """jax.jacrev maps the backward over a basis of output cotangents."""
  H = 4 if platform == "cpu" else default_head_dim(platform)
  case = case_on(platform, B=1, T=3, S=5, N=2, K=1, H=H, is_causal=True)
  inp = make_inputs(case)
  vis = visibility(case, inp)
  dt = np_dtype(case.dtype)
  args = [inp.q, inp.k, inp.v]
  ours = np.asarray(jax.jacrev(_call(case), argnums=argnum)(*(jnp.asarray(x) for x in args)))

  def definition(dtype):
    def f(*a):
      return ref.attention_with_lse(*a, None, vis, scale=case.scale)[0]
    return np.asarray(jax.jacrev(f, argnums=argnum)(*(jnp.asarray(x).astype(dtype)
                                                      for x in args)))

  with ref.precise():
    hi = definition(np.float64)
  base = None
  if dt != np.float64:
    xla = ref.xla_function(dt, is_causal=True)
    base = np.asarray(jax.jacrev(lambda *a: xla(*a), argnums=argnum)(
        *(jnp.asarray(x) for x in args)))
  assert ours.shape == inp.q.shape + args[argnum].shape
  assert_close("jacobian", ours, hi, base, kind="grad", dtype=dt, chain=case.S + case.T + case.H)


# --- higher-order and forward-mode derivatives -----------------------------------------------


SECOND_ORDER = {
    "grad-of-grad": lambda loss, q: jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(q),
    "hessian-vector": lambda loss, q: jax.jvp(jax.grad(loss), (q,), (jnp.ones_like(q),)),
    "hessian": lambda loss, q: jax.hessian(loss)(q),
}


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_second_derivatives_fail_naming_jax_flash(platform, name):
  """The backward is a kernel without a derivative of its own: differentiating it again must
  fail at trace time with an error that says so, not deep inside jax."""
  case = case_on(platform, B=1, T=5, S=7, N=2, is_causal=True)
  inp = make_inputs(case)
  q, k, v = (jnp.asarray(x) for x in (inp.q, inp.k, inp.v))

  def loss(q):
    out = _call(case)(q, k, v)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  with pytest.raises(NotImplementedError, match="jax_flash's attention .* has first "
                                                "derivatives only"):
    SECOND_ORDER[name](loss, q)


def test_forward_mode_is_refused(platform):
  """jax.jvp of a custom_vjp function is refused by jax itself, at trace time."""
  case = case_on(platform, B=1, T=5, S=7, N=2)
  inp = make_inputs(case)
  q, k, v = (jnp.asarray(x) for x in (inp.q, inp.k, inp.v))
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: _call(case)(x, k, v), (q,), (jnp.ones_like(q),))
