"""The Hopper backward kernel on its own terms (GPU only).

Gradients of every feature the kernel takes, for each compiled tile and for head dims that run
on the next tile, against the float64 definition, with cuDNN's error on the same inputs as the
yardstick where cuDNN takes the case (1.5x allowed) and xla's elsewhere; the gradient through
the returned log-sum-exp; bit-identical gradients with ``deterministic=True``; that calls
without bias or mask arrays really reach the kernel; and the handler's own errors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _extension

from _harness import Case, check_gradients, handler_attrs, make_inputs, np_dtype
from conftest import require_gpu

pytestmark = pytest.mark.gpu


@pytest.fixture
def platform():
  """Every test here runs on the GPU (skipped without one, failed with JAX_FLASH_REQUIRE_GPU=1)."""
  require_gpu()
  return "gpu"

DTYPES = [d.name for d in _config.GPU_DTYPES]

# Each case stresses one feature at sizes that are not multiples of any tile, over several
# query and key blocks.
CASES = {
    "plain": dict(B=2, T=300, S=300, N=4, H=64),
    "causal-square-gqa": dict(B=2, T=257, S=257, N=8, K=2, H=128, is_causal=True),
    "causal-t-neq-s": dict(B=2, T=200, S=333, N=2, H=64, is_causal=True),
    "causal-more-queries": dict(B=1, T=333, S=130, N=2, H=128, is_causal=True),
    "window": dict(B=2, T=300, S=280, N=2, H=64, window=(37, 5)),
    "window-left-only": dict(B=1, T=260, S=300, N=2, H=128, window=(50, 1000)),
    "ragged": dict(B=3, T=190, S=170, N=2, H=64, q_lens=(190, 0, 77), kv_lens=(170, 93, 0)),
    "mqa": dict(B=2, T=129, S=300, N=4, K=1, H=64),
    "tails": dict(B=1, T=77, S=77, N=2, H=128),
    "single-key": dict(B=2, T=65, S=1, N=2, H=64),
    "dead-rows": dict(B=2, T=150, S=100, N=2, H=64, window=(10, 0), kv_lens=(60, 100)),
    "large-logits": dict(B=1, T=150, S=150, N=2, H=64, std=math.sqrt(1e3)),
    "long": dict(B=1, T=1100, S=1100, N=2, H=128, is_causal=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_kernel_gradients(platform, dtype, name):
  check_gradients(Case(dtype=dtype, **CASES[name]), platform)


def _head_dims():
  """Every compiled tile, and a smaller multiple of 8 that runs on it."""
  m = _config.GPU_HEAD_DIM_MULTIPLE
  dims = set()
  lower = 0
  for tile in _config.SM90_BACKWARD_TILES:
    dims.add(tile.head_dim)
    dims.add(max(m, (lower + tile.head_dim) // 2 // m * m + m))
    lower = tile.head_dim
  return sorted(dims)


@pytest.mark.parametrize("H", _head_dims())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_kernel_head_dims(platform, H, is_causal):
  case = Case(B=2, T=150, S=170 if not is_causal else 150, N=4, K=2, H=H,
              dtype=DTYPES[H % len(DTYPES)], is_causal=is_causal)
  check_gradients(case, platform)


LSE_CASES = {
    "causal-gqa": dict(B=2, T=190, S=190, N=4, K=2, H=128, is_causal=True),
    "ragged-window": dict(B=2, T=150, S=140, N=2, H=64, window=(20, 20), q_lens=(150, 90),
                          kv_lens=(100, 140)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LSE_CASES)
def test_kernel_gradients_through_log_sum_exp(platform, dtype, name):
  check_gradients(Case(dtype=dtype, **LSE_CASES[name]), platform, through_lse=True)


def _run_grads(case: Case, inp, dout, deterministic):
  def loss(q, k, v):
    out = jax_flash.dot_product_attention(
        q, k, v, is_causal=case.is_causal, local_window_size=case.window,
        query_seq_lengths=None if inp.q_lens is None else jnp.asarray(inp.q_lens),
        deterministic=deterministic)
    return jnp.sum(out.astype(jnp.float32) * dout)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (inp.q, inp.k, inp.v)))
  return [np.asarray(g) for g in grads]


@pytest.mark.parametrize("H", [t.head_dim for t in _config.SM90_BACKWARD_TILES])
def test_deterministic_gradients_are_bit_identical(platform, H):
  """Many key blocks add into every query block's dQ; with deterministic=True in a fixed order.
  The ordered result is also close to the unordered one (both are the same sums)."""
  case = Case(B=2, T=1000, S=1000, N=8, K=2, H=H, dtype=DTYPES[0], is_causal=True,
              q_lens=(1000, 613))
  inp = make_inputs(case, seed=4)
  dout = jnp.asarray(np.random.default_rng(5).standard_normal(inp.q.shape), jnp.float32)
  first = _run_grads(case, inp, dout, deterministic=True)
  for _ in range(3):
    again = _run_grads(case, inp, dout, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
      np.testing.assert_array_equal(a, b, err_msg=name)
  unordered = _run_grads(case, inp, dout, deterministic=False)
  for name, a, b in zip(("dq", "dk", "dv"), first, unordered):
    scale = float(np.abs(a.astype(np.float32)).max())
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0,
                               atol=4 * scale * float(jnp.finfo(np_dtype(case.dtype)).eps),
                               err_msg=name)


def test_calls_without_arrays_reach_the_kernel(platform):
  q = jnp.zeros((1, 64, 2, 64), DTYPES[0])
  bias = jnp.zeros((1, 2, 64, 64), DTYPES[0])

  def hlo(*extra, **kwargs):
    def loss(q, k, v):
      return jnp.sum(jax_flash.dot_product_attention(q, k, v, *extra, **kwargs).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()

  assert "jax_flash_bwd" in hlo(is_causal=True, local_window_size=(3, 5))
  # Arrays the kernel does not read (kernel_configs.json) take the blockwise path.
  assert (_config.SM90_BACKWARD.takes(bias=True, mask=False, softcap=False, segment_ids=False)
          == ("jax_flash_bwd" in hlo(bias)))


def _direct_backward(q, workspace_bytes, kv=None, **overrides):
  """The CUDA backward handler called directly: (dq, dk, dv, workspace). Keys and values are
  `kv` (the query's shape by default)."""
  _extension.ensure_registered()
  kv = q if kv is None else kv
  lse = jnp.zeros(q.shape[:1] + q.shape[2:3] + q.shape[1:2], jnp.float32)
  results = (jax.ShapeDtypeStruct(q.shape, q.dtype),)
  results += tuple(jax.ShapeDtypeStruct(kv.shape, kv.dtype) for _ in range(2))
  results += (jax.ShapeDtypeStruct((workspace_bytes,), np.uint8),)
  call = jax.ffi.ffi_call(_extension.BACKWARD_TARGET, results)
  return jax.block_until_ready(call(q, kv, kv, q, lse, q, lse, **handler_attrs(**overrides)))


def _direct_forward(q, kv):
  """The CUDA forward handler called directly: (out, lse)."""
  _extension.ensure_registered()
  results = (jax.ShapeDtypeStruct(q.shape, q.dtype),
             jax.ShapeDtypeStruct(q.shape[:1] + q.shape[2:3] + q.shape[1:2], jnp.float32))
  call = jax.ffi.ffi_call(_extension.FORWARD_TARGET, results)
  return jax.block_until_ready(call(q, kv, kv, **handler_attrs()))


def test_handlers_reject_zero_keys(platform):
  """Python answers calls without keys itself; called directly, the kernels refuse them."""
  q = jnp.zeros((1, 8, 2, 64), DTYPES[0])
  kv = jnp.zeros((1, 0, 2, 64), DTYPES[0])
  with pytest.raises(jax.errors.JaxRuntimeError, match="at least one key"):
    _direct_forward(q, kv)
  needed = _extension.backward_workspace_bytes(1, 8, 2, 64, q.dtype)
  with pytest.raises(jax.errors.JaxRuntimeError, match="at least one key"):
    _direct_backward(q, needed, kv=kv)


def test_backward_handler_rejects_float32(platform):
  q = jnp.zeros((1, 8, 2, 64), jnp.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match="bfloat16 or float16"):
    _direct_backward(q, 1 << 20)


def test_backward_handler_rejects_a_short_workspace(platform):
  q = jnp.zeros((1, 8, 2, 64), DTYPES[0])
  needed = _extension.backward_workspace_bytes(1, 8, 2, 64, q.dtype)
  with pytest.raises(jax.errors.JaxRuntimeError, match="workspace"):
    _direct_backward(q, needed - 4)
  dq, dk, dv, _ = _direct_backward(q, needed)  # the same call with enough runs
  assert np.all(np.asarray(dq, np.float32) == 0) and np.all(np.asarray(dv, np.float32) == 0)


def test_backward_workspace_is_reported(platform):
  """The workspace taken from XLA: fp32 dQ accumulator plus two fp32 values per padded row;
  counters for the ordered dQ reduction; an fp32 accumulator for a bias gradient that sums."""
  tile = _config.SM90_BACKWARD_TILES[-1]
  T = 1000
  rows = -(-T // tile.block_m) * tile.block_m
  got = _extension.backward_workspace_bytes(2, T, 3, tile.head_dim, DTYPES[0],
                                            deterministic=False)
  assert got >= 2 * 3 * rows * (tile.head_dim + 2) * 4
  assert got < 2 * 3 * rows * (tile.head_dim + 2) * 4 + 3 * 256
  ordered = _extension.backward_workspace_bytes(2, T, 3, tile.head_dim, DTYPES[0],
                                                deterministic=True)
  assert ordered > got
  # A bias gradient with an element per logit is stored into the result: no room for it. One
  # that sums over an axis (here the batch) takes a float32 accumulator.
  S = 300
  per_logit = _extension.backward_workspace_bytes(2, T, 3, tile.head_dim, DTYPES[0],
                                                  dbias_elements=2 * 3 * T * S, seqlen_k=S)
  assert per_logit == got
  summed = _extension.backward_workspace_bytes(2, T, 3, tile.head_dim, DTYPES[0],
                                               dbias_elements=3 * T * S, seqlen_k=S)
  assert got + 3 * T * S * 4 <= summed < got + 3 * T * S * 4 + 256
  # One key: the kernel sums along the keys' axis (stride 0) before adding, into an accumulator.
  one_key = _extension.backward_workspace_bytes(2, T, 3, tile.head_dim, DTYPES[0],
                                                dbias_elements=2 * 3 * T, seqlen_k=1)
  assert got + 2 * 3 * T * 4 <= one_key < got + 2 * 3 * T * 4 + 256


def test_backward_workspace_needs_the_key_count_with_a_bias_gradient():
  """Whether a bias gradient needs an accumulator depends on the logits' extent (the keys too)."""
  with pytest.raises(TypeError, match="seqlen_k"):
    _extension.backward_workspace_bytes(1, 8, 2, 64, DTYPES[0], dbias_elements=16)
