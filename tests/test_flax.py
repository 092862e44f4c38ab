"""jax_flash.flax: flax's attention layers with jax_flash's attention_fn give the outputs and
gradients of the same layers (same parameters) with flax's own attention.

Compared under jax.jit: the layer output and the gradients of a weighted sum of it with respect
to the parameters and the inputs. Query rows that see no key (padding queries) are excluded
from the loss: flax averages all values there, jax_flash gives 0 (documented).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash.flax as jf  # noqa: E402
from _platforms import PLATFORMS, platform_params, with_platform  # noqa: E402

B, L, FEATURES, HEADS = 2, 12, 64, 4  # head dim 16 on the CPU

# Tolerances. float32 (CPU): both sides accumulate every product in float32 (flax's einsums at
# jax's default precision are exact float32 on the CPU); they differ by the order of the sums
# and the online softmax, a few float32 ulps times the reduction length: 1e-5 on unit-scale
# outputs, 5e-5 on gradients (two more reductions).
# bfloat16 (GPU): flax rounds its logits and softmax weights to bfloat16, jax_flash keeps them
# in float32, so a direct comparison measures flax's rounding. Both are compared with the same
# layer computed in float32 at the highest matmul precision instead: jax_flash's largest error
# may not exceed twice flax's plus one bfloat16 ulp (2^-8) of the value scale. Where the call
# reaches a fused attention kernel (causal without a mask), the yardstick is the larger of
# flax's error and that of the same layer with cuDNN's attention: a kernel returns dv rounded
# to bfloat16 before the value projection sums it over positions for its bias gradient, where
# flax's XLA graph may fuse that sum into its einsum in float32 (measured on an H200: jax_flash's
# and cuDNN's dv are equally accurate, and both layers' value-bias gradients err alike).
CPU_TOLERANCE = dict(out=1e-5, grad=5e-5)
GPU_ERROR_RATIO, GPU_ERROR_SLACK = 2.0, 2.0 ** -8


def _dtype(platform):
  return "float32" if platform == "cpu" else "bfloat16"


def _features(platform):
  return FEATURES if platform == "cpu" else HEADS * 64  # GPU head dims are multiples of 8


def _assert_tree_close(what, ours, theirs, tol):
  leaves_o, tree_o = jax.tree.flatten(ours)
  leaves_t, tree_t = jax.tree.flatten(theirs)
  assert tree_o == tree_t, what
  for path, o, t in zip(jax.tree_util.tree_flatten_with_path(theirs)[0], leaves_o, leaves_t):
    o, t = np.asarray(o, np.float64), np.asarray(t, np.float64)
    scale = max(1.0, float(np.abs(t).max()))
    np.testing.assert_allclose(o, t, rtol=0, atol=tol * scale,
                               err_msg=f"{what} {jax.tree_util.keystr(path[0])}")


def _inputs(platform, batch=(B,), length=L, seed=0):
  rng = np.random.default_rng(seed)
  dt = _dtype(platform)
  x = jnp.asarray(rng.standard_normal(batch + (length, _features(platform))), dt)
  ct = jnp.asarray(rng.standard_normal(batch + (length, _features(platform))), dt)
  tokens = jnp.asarray(rng.integers(1, 9, batch + (length,)))
  # Padding: the last tokens of the first sequence are 0.
  tokens = tokens.at[(0,) * len(batch) + (slice(length - 4, None),)].set(0)
  return x, ct, tokens


def _masks(tokens):
  causal = nn.make_causal_mask(tokens)
  valid = tokens > 0
  key_padding = nn.make_attention_mask(jnp.ones_like(valid), valid)
  padding = nn.make_attention_mask(valid, valid)
  return {
      "none": None,
      "causal": causal,
      "key-padding": key_padding,
      "padding": padding,
      "causal-padding": nn.combine_masks(causal, padding).astype(bool),  # bool masks too
  }


MASKS = ["none", "causal", "key-padding", "causal-padding"]


def _row_weight(mask, shape):
  """1 for query rows that see at least one key, else 0 (flax and jax_flash differ there)."""
  if mask is None:
    return jnp.ones(shape[:-1] + (1,), jnp.float32)
  sees = jnp.any(mask != 0, axis=-1)  # (batch..., 1|heads, q)
  sees = jnp.all(sees, axis=-2)  # (batch..., q)
  return sees.astype(jnp.float32)[..., None]


# --- linen -------------------------------------------------------------------------------------


def _linen_models(platform, attention_fn=None, **kwargs):
  """(stock, jax_flash, float32 stock) layers; the same parameters fit all three."""
  def make(dtype, fn):
    kw = dict(num_heads=HEADS, qkv_features=_features(platform), dtype=dtype,
              param_dtype=jnp.float32, deterministic=True)
    kw.update(kwargs)
    if fn is not None:
      kw["attention_fn"] = fn
    return nn.MultiHeadDotProductAttention(**kw)

  dt = _dtype(platform)
  return make(dt, None), make(dt, attention_fn or jf.attention_fn), make(jnp.float32, None)


def _linen_value_and_grads(model, params, x, ct, weight, mask):
  def loss(params, x):
    out = model.apply(params, x, mask=mask)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32) * weight), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out * weight.astype(out.dtype), grads


def _f32(x):
  return x.astype(jnp.float32)


def _cudnn_causal_attention(query, key, value, bias=None, mask=None, **unused):
  """A flax attention_fn with cuDNN's fused causal attention (for calls without bias or mask)."""
  assert bias is None and mask is None
  return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")


def _compare(platform, stock_result, ours_result, reference=None, kernel=None):
  """(output, gradients) of jax_flash against flax's; on the GPU both against `reference()`,
  the float32 layer, and with `kernel()` (the layer on cuDNN's attention) also that layer's
  error as a yardstick (see the tolerances above)."""
  if platform == "cpu":
    _assert_tree_close("output", ours_result[0], stock_result[0], CPU_TOLERANCE["out"])
    _assert_tree_close("gradients", ours_result[1], stock_result[1], CPU_TOLERANCE["grad"])
    return
  with jax.default_matmul_precision("highest"):
    ref_result = reference()
  kernel_result = kernel() if kernel is not None else stock_result
  for what, i in (("output", 0), ("gradients", 1)):
    refs = jax.tree_util.tree_flatten_with_path(ref_result[i])[0]
    stocks, ours = jax.tree.leaves(stock_result[i]), jax.tree.leaves(ours_result[i])
    kernels = jax.tree.leaves(kernel_result[i])
    assert len(refs) == len(stocks) == len(ours) == len(kernels), what
    for (path, r), s, o, k in zip(refs, stocks, ours, kernels):
      r, s, o, k = (np.asarray(a, np.float64) for a in (r, s, o, k))
      scale = max(1.0, float(np.abs(r).max()))
      ours_err = float(np.abs(o - r).max())
      flax_err = max(float(np.abs(s - r).max()), float(np.abs(k - r).max()))
      assert ours_err <= GPU_ERROR_RATIO * flax_err + GPU_ERROR_SLACK * scale, (
          f"{what} {jax.tree_util.keystr(path)}: jax_flash's error {ours_err:.3g} vs flax's "
          f"{flax_err:.3g} (scale {scale:.3g})")


def _linen_check(platform, models, params, x, ct, weight, stock_mask, ours_mask, kernel=None):
  stock, ours, f32 = models
  kernel_result = None
  if kernel is not None:
    kernel_result = lambda: _linen_value_and_grads(kernel, params, x, ct, weight, None)  # noqa
  _compare(platform, _linen_value_and_grads(stock, params, x, ct, weight, stock_mask),
           _linen_value_and_grads(ours, params, x, ct, weight, ours_mask),
           lambda: _linen_value_and_grads(f32, params, _f32(x), _f32(ct), weight, stock_mask),
           kernel_result)


@with_platform("platform, mask_name", platform_params(MASKS))
def test_linen_matches_flax(platform, mask_name):
  x, ct, tokens = _inputs(platform)
  mask = _masks(tokens)[mask_name]
  models = _linen_models(platform)
  params = models[0].init(jax.random.key(0), x)
  _linen_check(platform, models, params, x, ct, _row_weight(mask, x.shape), mask, mask)


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
def test_linen_factory_causal_without_mask(platform):
  """make_attention_fn(is_causal=True) without a mask = flax with make_causal_mask."""
  x, ct, tokens = _inputs(platform)
  models = _linen_models(platform, jf.make_attention_fn(is_causal=True))
  params = models[0].init(jax.random.key(1), x)
  kernel = None
  if platform == "gpu":
    kernel = _linen_models(platform, _cudnn_causal_attention)[1]
  _linen_check(platform, models, params, x, ct, _row_weight(None, x.shape),
               nn.make_causal_mask(tokens), None, kernel)


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
def test_linen_factory_causal_keeps_the_mask(platform):
  """The factory's causality applies on top of a padding mask: the mask is not dropped."""
  x, ct, tokens = _inputs(platform)
  masks = _masks(tokens)
  models = _linen_models(platform, jf.make_attention_fn(is_causal=True))
  params = models[0].init(jax.random.key(2), x)
  _linen_check(platform, models, params, x, ct, _row_weight(masks["causal-padding"], x.shape),
               masks["causal-padding"], masks["padding"])


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
def test_linen_extra_batch_axes(platform):
  """(batch1, batch2, length, features) inputs and a (batch1, batch2, 1, q, kv) mask."""
  x, ct, tokens = _inputs(platform, batch=(2, 3))
  mask = nn.combine_masks(nn.make_causal_mask(tokens),
                          nn.make_attention_mask(tokens > 0, tokens > 0))
  models = _linen_models(platform)
  params = models[0].init(jax.random.key(3), x)
  _linen_check(platform, models, params, x, ct, _row_weight(mask, x.shape), mask, mask)


def test_linen_cross_attention_with_bias():
  """Called directly with a bias (flax's layers never pass one): jax_flash's bias path."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((B, 7, HEADS, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, 11, HEADS, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, 11, HEADS, 16)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, HEADS, 7, 11)), jnp.float32)

  def grads(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)

  stock = functools.partial(nn.dot_product_attention, deterministic=True)
  ours = functools.partial(jf.attention_fn, deterministic=True)
  _assert_tree_close("output", ours(q, k, v, bias), stock(q, k, v, bias), CPU_TOLERANCE["out"])
  _assert_tree_close("gradients", grads(ours), grads(stock), CPU_TOLERANCE["grad"])


def test_linen_dtype_casts():
  """dtype=bfloat16 casts float32 inputs; precision is accepted (and ignored)."""
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(rng.standard_normal((B, 9, HEADS, 16)), jnp.float32) for _ in range(3))
  out = jf.attention_fn(q, k, v, dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST,
                        deterministic=True)
  assert out.dtype == jnp.bfloat16
  want = nn.dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                  v.astype(jnp.bfloat16), force_fp32_for_softmax=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=2e-2)


def test_linen_dropout_raises():
  x, _, _ = _inputs("cpu")
  _, ours, _ = _linen_models("cpu", dropout_rate=0.1, deterministic=None)
  params = ours.init(jax.random.key(0), x, deterministic=True)
  # Evaluation (no dropout applied) works ...
  ours.apply(params, x, deterministic=True)
  # ... training with attention dropout does not.
  with pytest.raises(NotImplementedError, match="no attention dropout"):
    ours.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})


def test_linen_sow_weights_raises():
  x, _, _ = _inputs("cpu")
  _, ours, _ = _linen_models("cpu")
  params = ours.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="cannot be sown"):
    ours.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_unknown_keyword_arguments():
  q = jnp.ones((1, 4, 2, 8), jnp.float32)
  jf.attention_fn(q, q, q, input_positions=None)  # a newer flax's argument at its default
  with pytest.raises(NotImplementedError, match="input_positions"):
    jf.attention_fn(q, q, q, input_positions=jnp.arange(4))


# --- nnx ---------------------------------------------------------------------------------------


def _nnx_models(platform, num_kv_heads=None, attention_fn=jf.attention_fn):
  """(stock, jax_flash, float32 stock) layers, all initialised with the same parameters (the
  middle one with `attention_fn`)."""
  features = _features(platform)

  def make(dtype, attention_fn):
    kwargs = dict(num_heads=HEADS, in_features=features, qkv_features=features, dtype=dtype,
                  param_dtype=jnp.float32, decode=False, rngs=nnx.Rngs(0))
    if num_kv_heads is not None:
      kwargs["num_kv_heads"] = num_kv_heads
    if attention_fn is not None:
      kwargs["attention_fn"] = attention_fn
    return nnx.MultiHeadAttention(**kwargs)

  dt = _dtype(platform)
  return make(dt, None), make(dt, attention_fn), make(jnp.float32, None)


def _nnx_value_and_grads(model, x, ct, weight, mask, **call_kwargs):
  graphdef, params = nnx.split(model)

  @jax.jit
  def run(params, x):
    def loss(params, x):
      out = nnx.merge(graphdef, params)(x, mask=mask, **call_kwargs)
      return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32) * weight), out
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

  (_, out), grads = run(params, x)
  return out * weight.astype(out.dtype), grads


def _has_num_kv_heads():
  import inspect
  return "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


NNX_CASES = [("mha", None, "causal-padding"), ("gqa", 2, "none"), ("gqa", 2, "padding"),
             ("mqa", 1, "causal")]


@with_platform("platform, case", platform_params(NNX_CASES, ids=lambda c: f"{c[0]}-{c[2]}"))
def test_nnx_matches_flax(platform, case):
  _, num_kv_heads, mask_name = case
  if num_kv_heads is not None and not _has_num_kv_heads():
    pytest.skip("this flax has no num_kv_heads")
  x, ct, tokens = _inputs(platform, seed=7)
  mask = _masks(tokens)[mask_name]
  stock, ours, f32 = _nnx_models(platform, num_kv_heads)
  _assert_tree_close("parameters", nnx.state(ours, nnx.Param), nnx.state(stock, nnx.Param), 0)
  weight = _row_weight(mask, x.shape)
  _compare(platform, _nnx_value_and_grads(stock, x, ct, weight, mask),
           _nnx_value_and_grads(ours, x, ct, weight, mask),
           lambda: _nnx_value_and_grads(f32, _f32(x), _f32(ct), weight, mask))


@pytest.mark.parametrize("platform", PLATFORMS, indirect=True)
def test_nnx_is_causal_argument(platform):
  """nnx passes is_causal to attention_fn: jax_flash applies it in the kernels."""
  x, ct, tokens = _inputs(platform, seed=8)
  stock, ours, f32 = _nnx_models(platform)
  weight = _row_weight(None, x.shape)
  causal = nn.make_causal_mask(tokens)
  kernel = None
  if platform == "gpu":
    cudnn = _nnx_models(platform, attention_fn=_cudnn_causal_attention)[1]
    kernel = lambda: _nnx_value_and_grads(cudnn, x, ct, weight, None)  # noqa: E731
  _compare(platform, _nnx_value_and_grads(stock, x, ct, weight, causal),
           _nnx_value_and_grads(ours, x, ct, weight, None, is_causal=True),
           lambda: _nnx_value_and_grads(f32, _f32(x), _f32(ct), weight, causal), kernel)


def test_nnx_dropout_raises():
  features = _features("cpu")
  layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=features, dropout_rate=0.2,
                                 decode=False, attention_fn=jf.attention_fn, rngs=nnx.Rngs(0))
  x, _, _ = _inputs("cpu")
  layer(x, deterministic=True)
  with pytest.raises(NotImplementedError, match="no attention dropout"):
    layer(x, deterministic=False)
