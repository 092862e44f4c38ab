"""Forward correctness: sizes, dtypes, head dims, head grouping, layouts, scale, residual."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config

from _harness import (Case, assert_close, check_forward, default_dtype, default_head_dim,
                      handler_attrs, np_dtype)
from _platforms import GPU, platform_dtypes, platform_params, with_platform


def case_on(platform: str, **fields) -> Case:
  """A case with the platform's default dtype and head dim unless given."""
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  return Case(**fields)


def gpu_head_dims() -> list[int]:
  """Each compiled tile's head dim, one multiple below each (padded onto that tile) and the
  smallest multiple, as far as the table supports them."""
  m = _config.GPU_HEAD_DIM_MULTIPLE
  dims = set(_config.GPU_HEAD_DIMS) | {m} | {t - m for t in _config.GPU_HEAD_DIMS}
  return sorted(d for d in dims if _config.gpu_head_dim_supported(d))


# Head dims of the table plus odd ones no GPU tile has (the CPU takes any).
CPU_HEAD_DIMS = sorted(set(_config.GPU_HEAD_DIMS) | {1, 3, 40, 72})

# Sequence lengths that are not multiples of any tile, alone and in pairs.
SEQ_PAIRS = [(1, 1), (1, 7), (7, 1), (65, 127), (127, 65), (239, 1), (1, 239), (113, 203),
             (7, 1000), (1000, 65), (1023, 1024)]


@pytest.mark.parametrize("T,S", SEQ_PAIRS, ids=[f"T{t}-S{s}" for t, s in SEQ_PAIRS])
def test_awkward_sequence_lengths(platform, T, S):
  check_forward(case_on(platform, T=T, S=S, B=1 if T * S > 10**5 else 2), platform)


@with_platform("platform,dtype", platform_dtypes())
@pytest.mark.parametrize("T,S", [(65, 127), (127, 65)], ids=["T65-S127", "T127-S65"])
def test_dtypes(platform, dtype, T, S):
  check_forward(case_on(platform, T=T, S=S, dtype=dtype), platform)


@with_platform("platform,dtype", platform_dtypes())
def test_dtypes_with_causal_gqa_bias_and_mask(platform, dtype):
  check_forward(case_on(platform, T=73, S=90, N=4, K=2, dtype=dtype, is_causal=True,
                        bias="B1TS", mask="1NTS"), platform)


@with_platform("platform,H", platform_params(CPU_HEAD_DIMS, gpu_head_dims()))
def test_head_dims(platform, H):
  check_forward(case_on(platform, T=65, S=77, H=H, N=2, B=1), platform)


GROUPS = [(4, 4), (4, 2), (4, 1), (6, 3), (8, 1)]


@with_platform("platform,heads", platform_params(GROUPS, ids=lambda g: f"N{g[0]}-K{g[1]}"))
def test_grouped_and_multi_query_heads(platform, heads):
  N, K = heads
  check_forward(case_on(platform, T=33, S=70, N=N, K=K), platform)


@pytest.mark.parametrize("B", [1, 3, 5])
def test_batch_sizes(platform, B):
  check_forward(case_on(platform, T=19, S=41, B=B, N=3, K=1, is_causal=True), platform)


def test_unbatched_inputs(platform):
  out, lse = check_forward(case_on(platform, B=None, T=37, S=53, N=4, K=2, bias="NTS"), platform)
  assert out.ndim == 3 and lse.ndim == 2


@pytest.mark.parametrize("scale", [0.0, 0.3, 2.0, -1.0])
def test_explicit_scale(platform, scale):
  check_forward(case_on(platform, T=29, S=47, scale=scale, bias="BNTS"), platform)


def test_default_scale_is_inverse_sqrt_head_dim(platform):
  case = case_on(platform, T=21, S=34)
  out_default, _ = check_forward(case, platform)
  out_explicit, _ = check_forward(case.replace(scale=1.0 / np.sqrt(case.H)), platform)
  # Python float 1/sqrt(H) is what the default computes: the same attribute, the same result.
  np.testing.assert_array_equal(out_default, out_explicit)


def test_return_residual_false_returns_only_the_output(platform):
  q = jnp.ones((2, 5, 2, default_head_dim(platform)), np_dtype(default_dtype(platform)))
  out = jax_flash.dot_product_attention(q, q, q)
  assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == q.dtype


@with_platform("platform,dtype", platform_dtypes())
def test_return_residual_dtype_and_shape(platform, dtype):
  """lse is float32 for every dtype but float64, shaped (B, T, N) like jax's residual."""
  from _reference import x64_if
  with x64_if(dtype):
    q = jnp.zeros((3, 4, 2, default_head_dim(platform)), np_dtype(dtype))
    k = jnp.zeros((3, 6, 1, default_head_dim(platform)), np_dtype(dtype))
    out, lse = jax_flash.dot_product_attention(q, k, k, return_residual=True)
    want = jnp.float64 if dtype == "float64" else jnp.float32
    assert out.dtype == q.dtype and lse.dtype == want and lse.shape == (3, 4, 2)
    # All logits are 0: lse = log(S), exact up to the rounding of the result.
    exact = np.full(lse.shape, np.log(6.0))
    assert_close("lse", np.asarray(lse), exact, exact, kind="lse", dtype=np_dtype(dtype),
                 result_dtype=want, chain=6 + q.shape[-1])


def test_implementation_names_jax_flash(platform):
  """None and "jax_flash" are jax_flash's kernels: the same call, the same bits."""
  q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 2, default_head_dim(platform))),
                  np_dtype(default_dtype(platform)))
  ours = jax_flash.dot_product_attention(q, q, q, is_causal=True)
  named = jax_flash.dot_product_attention(q, q, q, is_causal=True, implementation="jax_flash")
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(named))


def test_implementation_xla_is_jax_nn():
  """implementation="xla" hands the call, every argument included, to jax.nn (with its
  semantics: a row that sees no key averages every value there, where jax_flash gives 0)."""
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((2, 7, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)))
  bias = jnp.asarray(rng.standard_normal((1, 4, 7, 9)), jnp.float32)
  kwargs = dict(is_causal=True, key_value_seq_lengths=jnp.array([9, 4], jnp.int32),
                scale=0.3, return_residual=True)
  ours = jax_flash.dot_product_attention(q, k, v, bias, implementation="xla", **kwargs)
  want = jax.nn.dot_product_attention(q, k, v, bias, implementation="xla", **kwargs)
  for a, b in zip(ours, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape_q,shape_k", [
    ((0, 5, 2, 8), (0, 7, 2, 8)),  # no batch
    ((2, 0, 2, 8), (2, 7, 2, 8)),  # no query
    ((2, 5, 2, 8), (2, 0, 2, 8)),  # no key: every row is empty
], ids=["B0", "T0", "S0"])
def test_empty_extents(shape_q, shape_k):
  q = jnp.ones(shape_q, jnp.float32)
  k = jnp.ones(shape_k, jnp.float32)
  out, lse = jax_flash.dot_product_attention(q, k, k, return_residual=True)
  assert out.shape == shape_q and lse.shape == shape_q[:-1]
  assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_handler_runs_the_tile_block_m_names(platform):
  """The CUDA handler runs the forward tile that block_m names among its head dim's tiles (0:
  the default), as Kernel.tile_for picks it; it refuses a block_m that names none. Every tile
  computes the same attention: outputs of two tiles, each float32 accumulation rounded once to
  bfloat16, differ by at most one rounding of each (2 ulps of the largest output)."""
  from jax_flash import _extension

  _extension.ensure_registered()
  rng = np.random.default_rng(0)
  dtype = _config.GPU_DTYPES[0]
  for head_dim in _config.GPU_HEAD_DIMS:
    q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, head_dim), np.float32), dtype)
               for _ in range(3))
    call = jax.ffi.ffi_call(_extension.FORWARD_TARGET,
                            (jax.ShapeDtypeStruct(q.shape, dtype),
                             jax.ShapeDtypeStruct((1, 2, 200), jnp.float32)))
    outputs = {}
    for block_m in [0] + [t.block_m for t in _config.SM90_FORWARD_TILES
                          if t.head_dim == head_dim]:
      out, lse = call(q, k, v, **handler_attrs(block_m=np.int64(block_m)))
      outputs[block_m] = (np.asarray(out, np.float64), np.asarray(lse))
    base_out, base_lse = outputs[0]
    ulp = 2.0 ** -7 * np.abs(base_out).max()  # bfloat16: 8 significant bits
    for block_m, (out, lse) in outputs.items():
      assert np.abs(out - base_out).max() <= 2 * ulp, (head_dim, block_m)
      np.testing.assert_allclose(lse, base_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(jax.errors.JaxRuntimeError, match="has block_m"):
      jax.block_until_ready(call(q, q, q, **handler_attrs(block_m=np.int64(7))))
