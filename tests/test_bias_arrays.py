"""Bias arrays on the Hopper kernels: the routing of bias calls (a bias of the inputs' dtype
runs on the kernels, forward and backward, its gradient included; a bias of another dtype, or
a deterministic backward whose bias gradient sums over an axis, takes the blockwise path), the
custom VJP's knowledge of whether the bias is differentiated, and forward and gradients (dbias
included) against the float64 definition (tests/_reference.py) under the criterion of
tests/_tolerances.py, for every broadcast of the bias.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _primitive
from jax_flash._validation import canonicalize

from _harness import (Case, check_equals_is_causal, check_forward, check_gradients,
                      check_vmap_over_logit_arrays, handler_attrs, make_inputs)
from _platforms import GPU, with_platform


def _config_of(scale=None, **options):
  return canonicalize(*(np.zeros((1, 4, 2, 8), np.float32),) * 3, None, None, scale=scale,
                      is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                      local_window_size=None, **options).config


def test_gpu_routing_of_bias_arrays():
  """A bias of the inputs' dtype runs on both Hopper kernels (they list "bias"), and the
  backward computes its gradient (it lists "bias_gradient"); a bias of another dtype, with a
  scale below bias_min_scale (the kernels divide the bias by it), or with another feature that
  no feature combination lists with it, runs blockwise; soft-capping and a mask array run on
  the kernels where a combination lists them with the bias."""
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  route = functools.partial(_primitive._on_gpu_kernel, kernel_call="kernel",
                            blockwise_call="blockwise", q=q, mask=None, q_seg=None)
  plain, capped = _config_of(), _config_of(logits_soft_cap=5.0)
  unscaled = _config_of(scale=0.0)
  assert unscaled.scale < _config.GPU_BIAS_MIN_SCALE <= _config_of(scale=1e-6).scale
  bias = jnp.zeros((1, 1, 4, 4), jnp.bfloat16)
  for kernel in (_config.SM90_FORWARD, _config.SM90_BACKWARD):
    assert {"bias"} <= kernel.features
    def paired_route(other):
      return "kernel" if frozenset({other, "bias"}) in kernel.combinations else "blockwise"
    assert route(kernel, config=plain, bias=bias) == "kernel"
    assert route(kernel, config=plain, bias=bias.astype(jnp.float32)) == "blockwise"
    assert route(kernel, config=capped, bias=bias) == paired_route("softcap")
    assert route(kernel, config=unscaled, bias=bias) == "blockwise"
    assert route(kernel, config=unscaled, bias=None) == "kernel"
    assert route(kernel, config=plain, bias=bias, mask=bias > 0) == paired_route("mask")
    assert route(kernel, config=capped, bias=bias, mask=bias > 0) == "blockwise"
  assert "bias_gradient" not in _config.SM90_FORWARD.features
  assert "bias_gradient" in _config.SM90_BACKWARD.features
  assert route(_config.SM90_BACKWARD, config=plain, bias=bias, bias_gradient=True) == "kernel"


@pytest.mark.parametrize("bias_shape,sums", [
    ((2, 4, 100, 300), False), ((1, 4, 100, 300), True), ((2, 1, 100, 300), True),
    ((2, 4, 1, 300), True), ((2, 4, 100, 1), True), ((3, 2, 4, 100, 300), False)], ids=str)
def test_bias_gradient_sums(bias_shape, sums):
  """Which bias gradients sum over an axis of a (B=2, N=4, T=100, S=300) problem (a
  deterministic backward sends those to the blockwise path): a bias broadcast over B, heads,
  queries or keys; not over the axes vmap adds (dbias is full there)."""
  lead = bias_shape[:-4]
  out = jnp.zeros((*lead, 2, 100, 4, 8))
  k = jnp.zeros((*lead, 2, 300, 2, 8))
  assert _primitive._bias_gradient_sums(out, k, jnp.zeros(bias_shape)) == sums


def _backward_attributes(text: str) -> list[str]:
  return [line for line in text.splitlines() if "jax_flash_bwd" in line and "custom_call" in line]


@pytest.mark.parametrize("wrt_bias", [False, True])
def test_backward_computes_dbias_only_when_differentiated(wrt_bias):
  """The custom VJP knows (symbolic zeros) whether the bias is differentiated: the backward
  call returns dbias only then, and the other gradients do not depend on it."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 16)), jnp.float32) for _ in range(3))
  bias = jnp.asarray(rng.standard_normal((1, 2, 24, 24)), jnp.float32)

  def loss(q, k, v, bias):
    out = jax_flash.dot_product_attention(q, k, v, bias, is_causal=True)
    return jnp.sum(out * jnp.cos(jnp.arange(24.0))[:, None, None])

  argnums = (0, 1, 2, 3) if wrt_bias else (0, 1, 2)
  grad = jax.jit(jax.grad(loss, argnums=argnums))
  with jax.default_device(jax.devices("cpu")[0]):
    calls = _backward_attributes(grad.lower(q, k, v, bias).as_text())
    assert calls and all(("has_dbias = " + str(wrt_bias).lower()) in c for c in calls), calls
    grads = grad(q, k, v, bias)
    full = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
  for ours, reference in zip(grads, full):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


# --- blocks a bias drops ------------------------------------------------------------------------


def _brute_bias_classes(bias, block_m, block_n):
  """_bias_tiles' classes block by block: 0 where every entry is at most _BIAS_DROPS_AT and
  every row of the block holds an entry above _BIAS_ROW_HOLDS, else 1."""
  *lead, T, S = bias.shape
  bm, bn = (block_m if T > 1 else 1), (block_n if S > 1 else 1)
  b = bias.astype(np.float64)
  holds = b.max(-1) > _primitive._BIAS_ROW_HOLDS  # (..., T)
  out = np.ones((*lead, -(-T // bm), -(-S // bn)), np.int8)
  for i in range(out.shape[-2]):
    for j in range(out.shape[-1]):
      block = b[..., i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
      dropped = (block <= _primitive._BIAS_DROPS_AT).all(axis=(-2, -1))
      out[..., i, j] = ~(dropped & holds[..., i * bm:(i + 1) * bm].all(-1))
  return out


def _lowest_patches(rng, shape, dtype, patch=32):
  """A bias of 32 x 32 patches that are the dtype's lowest value, -inf or random, with the
  first patch column random (every row then holds a finite entry)."""
  *lead, T, S = shape
  kind = rng.integers(0, 3, (*lead, -(-T // patch), -(-S // patch)))
  kind[..., 0] = 2
  kind = np.repeat(np.repeat(kind, patch, -2), patch, -1)[..., :T, :S]
  lowest = float(jnp.finfo(dtype).min)
  return np.where(kind == 0, lowest, np.where(kind == 1, -np.inf,
                                              rng.standard_normal(shape))).astype(dtype)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
@pytest.mark.parametrize("shape", [(2, 3, 200, 300), (1, 2, 150, 200), (1, 1, 129, 64),
                                   (2, 1, 1, 300), (3, 2, 200, 1), (2, 2, 1, 3, 70, 90)], ids=str)
@pytest.mark.parametrize("dtype", _config.GPU_DTYPES, ids=lambda d: d.name)
def test_gpu_bias_tiles_drop_only_blocks_without_probability(platform, shape, dtype):
  """The CUDA kernel's classes: blocks of the lowest value and -inf are dropped where their
  rows hold finite entries (float16's lowest value, -65504, drops nothing: there only blocks of
  -inf alone); a row whose every entry is that low keeps its blocks; rows whose finite entries
  start far along the keys; a causal bias; sizes that do not divide the tile, broadcast query
  or key axes (one block along them), several leading axes; a random bias keeps every block.
  Key counts of a multiple of 8 (16-byte rows: the kernel's vector loads) and of others."""
  rng = np.random.default_rng(0)
  bias = _lowest_patches(rng, shape, dtype, patch=16)
  bias[..., min(5, shape[-2] - 1), :] = jnp.finfo(dtype).min  # a row holding nothing
  tile = _config.Sm90ForwardTile(head_dim=64, block_m=64, block_n=32, stages=2)
  [ours] = _primitive._bias_tiles(jnp.asarray(bias), tile)
  np.testing.assert_array_equal(np.asarray(ours), _brute_bias_classes(bias, 64, 32))
  if shape[-1] > 1 and shape[-2] > 1:
    assert (np.asarray(ours) == 1).any()
    if dtype == jnp.bfloat16:
      assert (np.asarray(ours) == 0).any()
  learned = jnp.asarray(rng.standard_normal(shape), dtype)
  [ours] = _primitive._bias_tiles(learned, tile)
  assert (np.asarray(ours) == 1).all()
  # -inf left of a column that moves with the row (past the first 32 keys in many rows), and
  # causal: blocks read whole, rows searched.
  t, s = np.ogrid[:shape[-2], :shape[-1]]
  for keeps in (s >= (t * 37) % shape[-1], s <= t):
    bias = np.broadcast_to(np.where(keeps, rng.standard_normal(shape), -np.inf), shape)
    [ours] = _primitive._bias_tiles(jnp.asarray(bias, dtype), tile)
    np.testing.assert_array_equal(np.asarray(ours), _brute_bias_classes(bias, 64, 32))


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_bias_classes_handler_checks(platform):
  """The bias classes' CUDA handler refuses classes of another shape or dtype, a bias of rank
  1 or of a dtype the Hopper kernels do not read, with an error naming them."""
  from jax_flash import _extension
  _extension.ensure_registered()
  bias = jnp.zeros((2, 100, 70), jnp.bfloat16)
  attrs = dict(block_m=np.int64(64), block_n=np.int64(32),
               drops_at=np.float32(_primitive._BIAS_DROPS_AT),
               row_holds=np.float32(_primitive._BIAS_ROW_HOLDS))

  def classes(bias, shape, dtype=jnp.int8):
    call = jax.ffi.ffi_call(_extension.BIAS_CLASSES_TARGET, jax.ShapeDtypeStruct(shape, dtype))
    return jax.block_until_ready(call(bias, **attrs))

  assert np.asarray(classes(bias, (2, 2, 3))).tolist() == [[[1] * 3] * 2] * 2
  for operand, shape, dtype, message in (
      (bias, (2, 2, 2), jnp.int8, "must be shaped"),
      (bias, (1, 2, 3), jnp.int8, "must be shaped"),
      (bias, (2, 2, 3), jnp.int32, "int8"),
      (bias[0, 0], (1, 3), jnp.int8, "rank 2"),
      (bias.astype(jnp.float32), (2, 2, 3), jnp.int8, "bfloat16 or float16")):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
      classes(operand, shape, dtype)


def test_a_bias_with_a_mask_travels_with_the_mask_classes_alone():
  """With both arrays the Hopper kernels read the mask's block classes and bits alone; the bias
  takes no classes of its own (its low blocks are computed, to probabilities of 0)."""
  rng = np.random.default_rng(5)
  bias = jnp.asarray(_lowest_patches(rng, (1, 3, 200, 300), jnp.bfloat16, patch=16))
  mask = jnp.asarray(rng.random((2, 1, 200, 300)) < 0.9)
  tile = _config.Sm90ForwardTile(head_dim=64, block_m=64, block_n=32, stages=2)
  for rows_are_keys in (False, True):
    tiles, bias_tiles = _primitive._logit_array_tiles(bias, mask, tile, 200, 300, rows_are_keys)
    want = _primitive._mask_tiles(mask, tile, 200, 300, rows_are_keys)
    assert bias_tiles == [] and len(tiles) == len(want) == 2
    for got, expected in zip(tiles, want):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    tiles, bias_tiles = jax.eval_shape(functools.partial(
        _primitive._logit_array_tiles, mask=None, tile=tile, T=200, S=300,
        rows_are_keys=rows_are_keys), bias)
    assert tiles == [] and [(b.shape, b.dtype) for b in bias_tiles] == [((1, 3, 4, 10), np.int8)]


# --- the GPU -----------------------------------------------------------------------------------

# Every broadcast of a bias: over batch, heads, queries (rows) or keys (a per-query constant,
# which moves the log-sum-exp only).
GPU_BIAS_SPECS = ("11TS", "B1TS", "1NTS", "BNTS", "B11S", "BNT1")


@with_platform("platform,H,spec",
               [pytest.param("gpu", H, spec, marks=pytest.mark.gpu, id=f"gpu-{H}-{spec}")
                for H in _config.GPU_HEAD_DIMS for spec in GPU_BIAS_SPECS])
def test_gpu_bias_arrays(platform, H, spec):
  """Forward, the gradients of q, k, v and the bias (summed over its broadcast axes), and
  those of q, k, v of a constant bias through the log-sum-exp, on the Hopper kernels, every
  GPU dtype; grouped key/value heads, sizes that do not divide the tiles, causal. The key
  count is odd for the first dtype and a multiple of 8 for the next: the forward reads the
  bias in pairs of keys, and the backward a bias that keeps both axes in TMA tiles, only where
  its rows keep those alignments."""
  for i, dtype in enumerate(_config.GPU_DTYPES):
    case = Case(B=2, T=333, S=461 + 3 * i, N=4, K=2, H=H, dtype=dtype.name, bias=spec,
                is_causal=True)
    check_forward(case, platform)
    check_gradients(case, platform)
    check_gradients(case, platform, through_lse=True, bias_gradient=False)


@with_platform("platform,H", [pytest.param("gpu", H, marks=pytest.mark.gpu, id=f"gpu-{H}")
                              for H in _config.GPU_HEAD_DIMS])
def test_gpu_bias_dropping_blocks(platform, H):
  """A bias with patches of the dtype's lowest value and -inf, per head with grouped heads: the
  kernels skip the blocks it drops; forward and gradients as the definition, every dtype."""
  for dtype in _config.GPU_DTYPES:
    case = Case(B=2, T=512, S=640, N=4, K=2, H=H, dtype=dtype.name, bias="BNTS")
    inp = make_inputs(case)
    inp.bias = _lowest_patches(np.random.default_rng(H), inp.bias.shape, inp.bias.dtype,
                               patch=64)
    check_forward(case, platform, inp=inp)
    check_gradients(case, platform, inp=inp, through_lse=True)


# A bias with a mask array, on the kernels where a feature combination lists the pair: a
# relative-position bias per head with a padding mask (T5), a bias per batch item with a mask
# shared by every head, and both full.
GPU_BIAS_MASK_SPECS = (("1NTS", "B11S"), ("B1TS", "11TS"), ("BNTS", "BNTS"))


@with_platform("platform,H,specs",
               [pytest.param("gpu", H, specs, marks=pytest.mark.gpu,
                             id=f"gpu-{H}-{specs[0]}-{specs[1]}")
                for H in _config.GPU_HEAD_DIMS for specs in GPU_BIAS_MASK_SPECS])
def test_gpu_bias_with_a_mask(platform, H, specs):
  """A bias and a mask array together: forward and gradients (dbias summed over the bias's
  broadcast axes; zero where the mask hides a logit) against the definition, every GPU dtype,
  grouped heads, causal and not, dead rows where the mask holds queries; keys as in
  test_gpu_bias_arrays."""
  bias, mask = specs
  for i, dtype in enumerate(_config.GPU_DTYPES):
    case = Case(B=2, T=333, S=461 + 3 * i, N=4, K=2, H=H, dtype=dtype.name, bias=bias, mask=mask,
                is_causal=i == 0, dead_rows="T" in mask)
    check_forward(case, platform)
    check_gradients(case, platform)


@with_platform("platform,H", [pytest.param("gpu", H, marks=pytest.mark.gpu, id=f"gpu-{H}")
                              for H in _config.GPU_HEAD_DIMS])
def test_gpu_bias_low_patches_under_a_mask(platform, H):
  """Patches of the lowest value and -inf beside a mask, whose classes alone the kernels read:
  the blocks such a bias would drop are computed, to probabilities of 0. Rows 128-191 keep
  only entries of -2^110, their finite entries hidden by the mask: jax's definition averages
  their visible keys. (-2^110 rather than the lowest value, which the kernels' units, the bias
  over the scale, take to -inf: a row that sees nothing else sees no key there; see README.)
  bfloat16: its lowest value lies below the float range in those units, float16's does not."""
  dtype = jnp.bfloat16
  case = Case(B=2, T=512, S=640, N=4, K=2, H=H, dtype="bfloat16", bias="BNTS", mask="B1TS")
  inp = make_inputs(case)
  rng = np.random.default_rng(H)
  bias = _lowest_patches(rng, inp.bias.shape, dtype, patch=64)
  bias[..., 128:192, 64:] = -2.0 ** 110
  mask = rng.random(inp.mask.shape) < 0.9
  mask[..., 128:192, :64] = False
  inp.bias, inp.mask = bias, mask
  check_forward(case, platform, inp=inp)
  check_gradients(case, platform, inp=inp, through_lse=True)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
@pytest.mark.parametrize("S", [512, 333], ids=["even-keys", "odd-keys"])
def test_gpu_bias_with_window_lengths_and_extremes(platform, S):
  """A bias with entries of +-1e30 and -inf (key 0 finite), a window and ragged lengths,
  T != S; an odd S makes the bias rows unaligned (read element by element)."""
  case = Case(B=2, T=300, S=S, N=4, K=1, H=128, dtype=_config.GPU_DTYPES[0].name, bias="BNTS",
              extreme_bias=True, window=(250, 40), q_lens=(300, 131), kv_lens=(S - 20, S))
  check_forward(case, platform)
  check_gradients(case, platform)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_bias_gradient_routing_and_determinism(platform):
  """A differentiated bias runs both kernels; a deterministic backward keeps a bias gradient
  that sums over no axis on the kernel, bit-identical from run to run, and sends one that sums
  over an axis (1NTS: over the batch) to the blockwise path. The gradients' values are
  test_gpu_bias_arrays' (BNTS)."""
  dtype = _config.GPU_DTYPES[0].name
  full = Case(B=2, T=200, S=300, N=4, K=2, H=64, dtype=dtype, bias="BNTS", is_causal=True)
  inp = make_inputs(full)
  q, k, v, bias = (jnp.asarray(x) for x in (inp.q, inp.k, inp.v, inp.bias))

  def grad(bias, argnums, **options):
    def loss(q, k, v, bias):
      out = jax_flash.dot_product_attention(q, k, v, bias, is_causal=True, **options)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[1]))[:, None, None])
    return jax.jit(jax.grad(loss, argnums=argnums))

  def compiled(bias, argnums=(0, 1, 2, 3), **options):
    return grad(bias, argnums, **options).lower(q, k, v, bias).compile().as_text()

  for text in (compiled(bias, (0, 1, 2)), compiled(bias), compiled(bias[:1]),
               compiled(bias, deterministic=True)):
    assert "jax_flash_fwd" in text and "jax_flash_bwd" in text
  assert "jax_flash_bwd" not in compiled(bias[:1], deterministic=True)
  ordered = grad(bias, (0, 1, 2, 3), deterministic=True)
  first, second = ordered(q, k, v, bias), ordered(q, k, v, bias)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Each element of a dbias that sums over nothing receives one addition in either mode.
  unordered = grad(bias, (0, 1, 2, 3))(q, k, v, bias)
  np.testing.assert_array_equal(np.asarray(first[3]), np.asarray(unordered[3]))


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_causal_bias_equals_is_causal(platform):
  """A causal bias of the dtype's lowest value above the diagonal (what masks become as biases)
  gives is_causal's result within rounding."""
  rng = np.random.default_rng(3)
  dtype = _config.GPU_DTYPES[0]
  q, k, v = (jnp.asarray(rng.standard_normal((2, 1000, 4, 128)), dtype) for _ in range(3))
  tril = jnp.tril(jnp.ones((1000, 1000), bool))[None, None]
  check_equals_is_causal(q, k, v, bias=jnp.where(tril, 0, jnp.finfo(dtype).min).astype(dtype))


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_vmap_over_biases_only(platform):
  """vmap over the bias alone (q, k, v unmapped: the kernels broadcast them) equals the calls
  one by one, up to the order of the dQ additions."""
  rng = np.random.default_rng(4)
  dtype = _config.GPU_DTYPES[0]
  q, k, v = (jnp.asarray(rng.standard_normal((1, 384, 2, 128)), dtype) for _ in range(3))
  biases = jnp.asarray(rng.standard_normal((3, 1, 2, 384, 384)) * 2, dtype)
  check_vmap_over_logit_arrays(q, k, v, "bias", biases)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_bias_handler_checks(platform):
  """The CUDA handlers refuse a bias of another dtype, a bias without its block classes or with
  classes of another tile, bias classes beside a mask's (whose classes the kernels read alone),
  a bias with a zero scale (the kernels divide it by the scale), a workspace without room for
  dbias, and a deterministic dbias that sums over an axis."""
  from jax_flash import _extension
  _extension.ensure_registered()
  dtype = _config.GPU_DTYPES[0]
  q = jnp.zeros((1, 128, 2, 64), dtype)
  bias = jnp.zeros((1, 1, 128, 128), dtype)
  blocks = jnp.ones((1, 1, 1, 1), jnp.int8)  # one block of either pass's tile at head dim 64
  attrs = handler_attrs(has_bias=True, has_bias_blocks=True)
  forward = jax.ffi.ffi_call(_extension.FORWARD_TARGET,
                             (jax.ShapeDtypeStruct(q.shape, dtype),
                              jax.ShapeDtypeStruct((1, 2, 128), jnp.float32)))
  jax.block_until_ready(forward(q, q, q, bias, blocks, **attrs))
  mask_tiles = _primitive._mask_tiles(jnp.ones((1, 1, 128, 128), bool),
                                      _config.SM90_FORWARD.tile_for(64), 128, 128,
                                      rows_are_keys=False)
  with_mask = dict(has_mask_blocks=True)
  paired = frozenset({"mask", "bias"}) in _config.SM90_FORWARD.combinations
  if paired:
    jax.block_until_ready(forward(q, q, q, bias, *mask_tiles,
                                  **dict(attrs, has_bias_blocks=False, **with_mask)))
  for operands, overrides, message in (
      ((bias.astype(jnp.float32), blocks), {}, "bias of the inputs' dtype"),
      ((bias,), dict(has_bias_blocks=False), "bias_blocks"),
      ((bias, jnp.ones((1, 1, 2, 1), jnp.int8)), {}, "bias_blocks"),
      ((bias, blocks, *mask_tiles), with_mask,
       "takes no bias_blocks" if paired else "not in this combination"),
      ((bias, blocks), dict(scale=np.float64(0.0)), "divided by the scale")):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
      jax.block_until_ready(forward(q, q, q, *operands, **dict(attrs, **overrides)))
  lse = jnp.zeros((1, 2, 128), jnp.float32)

  def backward(deterministic, dbias_elements):
    workspace = _extension.backward_workspace_bytes(1, 128, 2, 64, dtype, deterministic,
                                                    dbias_elements=dbias_elements, seqlen_k=128)
    call = jax.ffi.ffi_call(
        _extension.BACKWARD_TARGET,
        tuple(jax.ShapeDtypeStruct(q.shape, dtype) for _ in range(3)) +
        (jax.ShapeDtypeStruct(bias.shape, dtype), jax.ShapeDtypeStruct((workspace,), np.uint8)))
    return jax.block_until_ready(call(q, q, q, q, lse, q, lse, bias, blocks,
                                      **dict(attrs, has_dbias=True, deterministic=deterministic)))

  backward(False, bias.size)
  with pytest.raises(jax.errors.JaxRuntimeError, match="workspace has"):
    backward(False, 0)
  with pytest.raises(jax.errors.JaxRuntimeError, match="broadcasts over no axis"):
    backward(True, bias.size)


def test_bias_cases_are_not_trivial():
  """The GPU cases' biases vary along every axis they hold (a constant bias would not test
  the kernels' indexing)."""
  for spec in GPU_BIAS_SPECS:
    case = Case(B=2, T=33, S=47, N=4, K=2, H=64, bias=spec)
    bias = make_inputs(case).bias
    for axis, letter in enumerate(spec):
      if letter != "1":
        assert np.ptp(bias.astype(np.float64), axis=axis).max() > 0, (spec, letter)
