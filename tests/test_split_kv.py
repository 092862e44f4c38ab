"""The forward of decoding shapes (few query rows against many keys): key/value split into
chunks merged through their log-sum-exps, query heads of a group packed into rows
(jax_flash/_split_kv.py). The GPU routes such calls there by itself; on the CPU the same
transformation runs around the CPU kernel, called directly, against the plain kernel call."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _primitive, _split_kv
from jax_flash._validation import AttentionConfig

from _harness import Case, check_forward, check_gradients

PLAIN = AttentionConfig(scale=0.25, window_left=-1, window_right=-1)


def _inputs(B, T, S, N, K, H, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype)
             for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  return q, k, v


_INT32_MAX, _INT32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min
#: Query and key/value lengths of the three items: ragged (an item without keys, one ending
#: inside a chunk, one without queries), or the int32 extremes (beyond the axis: all of it;
#: below 0: none of it), which the packing's and the chunks' arithmetic must not wrap around:
#: an item that sees everything, one query row without keys, an item without queries.
LENGTHS = {"none": None,
           "ragged": (lambda T, S: [T, T - 1, 0], lambda T, S: [0, 300, S]),
           "extremes": (lambda T, S: [_INT32_MAX, 1, _INT32_MIN],
                        lambda T, S: [_INT32_MAX, _INT32_MIN, S + 1])}


#: Mask and bias arrays of a decoding step, (B|1, N|1, T|1, S|1): the cache's filled positions
#: per item (as Flax's decoding mask), a random mask per head and row, a bias per head and key
#: (ALiBi-like), a bias per item, row and key; and a mask with a bias.
def _logit_arrays(kind, B, T, S, N, rng):
  filled = np.arange(S) < np.asarray([S, 700, 1])[:B, None]  # item 2: one key
  arrays = {
      "none": (None, None),
      "cache_mask": (None, filled[:, None, None, :]),
      "head_row_mask": (None, rng.random((B, N, T, S)) < 0.7),
      "head_bias": (rng.standard_normal((1, N, 1, S)), None),
      "row_bias": (rng.standard_normal((B, 1, T, S)), None),
      "mask_and_bias": (rng.standard_normal((1, N, 1, S)), filled[:, None, None, :]),
  }
  bias, mask = arrays[kind]
  return (None if bias is None else jnp.asarray(bias, jnp.float32),
          None if mask is None else jnp.asarray(mask))


@pytest.mark.parametrize("groups,splits", [(1, 2), (4, 1), (4, 8), (2, 4)])
@pytest.mark.parametrize("lengths,arrays", [(lengths, "none") for lengths in LENGTHS] + [
    (lengths, arrays) for lengths in ("none", "ragged")
    for arrays in ("cache_mask", "head_row_mask", "head_bias", "row_bias", "mask_and_bias")])
@pytest.mark.parametrize("T", [3, 1])
def test_split_and_packed_forward_equals_the_plain_call(groups, splits, lengths, arrays, T):
  """The transformation around the CPU kernel gives the plain call's output and log-sum-exp,
  without lengths, with ragged ones and with the int32 extremes (LENGTHS), and with mask and
  bias arrays packed and chunked as the query and the keys. One query row's heads are packed
  in place (query_groups), more rows' by the transposed query."""
  B, S, K, H = 3, 1024, 2, 16
  q, k, v = _inputs(B, T, S, K * groups, K, H, jnp.float32)
  bias, mask = _logit_arrays(arrays, B, T, S, K * groups, np.random.default_rng(1))
  q_len = kv_len = None
  if LENGTHS[lengths] is not None:
    q_len, kv_len = (jnp.asarray(f(T, S), jnp.int32) for f in LENGTHS[lengths])
  call = functools.partial(_primitive._forward_call, PLAIN)
  want_out, want_lse = jax.jit(call)(q, k, v, bias, mask, q_len, kv_len, None, None)
  layouts = []

  def kernel(q, k, v, bias, mask, q_len, kv_len, query_groups, parts):
    layouts.append((query_groups, parts))
    return call(q, k, v, bias, mask, q_len, kv_len, None, None, query_groups=query_groups,
                parts=parts)

  def split(q, k, v, bias, mask):
    return _split_kv.forward(_split_kv.Plan(groups, splits), kernel, q, k, v, bias, mask, q_len,
                             kv_len)

  out, lse = jax.jit(split)(q, k, v, bias, mask)
  # The CPU kernel packs one row in place; parts where there is a merge.
  assert layouts == [(groups if T == 1 else 1, splits > 1)]
  assert out.shape == want_out.shape and lse.shape == want_lse.shape
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  np.testing.assert_allclose(np.where(np.isneginf(want_lse), 0, lse),
                             np.where(np.isneginf(want_lse), 0, want_lse), rtol=0, atol=2e-6)
  np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-6)


def _packed_call(call, q, k, v, q_len, kv_len, G, **kwargs):
  """`call` of the query heads of each group transposed into rows t*G + g of N / G heads (q_len
  counts those rows), its results laid out as the call's again."""
  B, T, N, H = q.shape
  rows = jnp.swapaxes(q.reshape(B, T, N // G, G, H), 2, 3).reshape(B, T * G, N // G, H)
  out, lse = call(rows, k, v, None, None, q_len, kv_len, None, None, **kwargs)
  out = jnp.swapaxes(out.reshape(B, T, G, N // G, H), 2, 3).reshape(B, T, N, H)
  lse = jnp.swapaxes(lse.reshape(B, N // G, T, G), 2, 3).reshape(B, N, T)
  return out, lse


#: (T, N, K, G, H): one row (the CPU kernel packs it too), and several rows in groups of 2, 4,
#: 8 and 16 heads: one tile of rows or several, a head dim below its tile's.
QUERY_GROUPS = [(1, 12, 3, 4, 16), (3, 8, 2, 4, 64), (16, 32, 8, 4, 128), (5, 16, 2, 8, 72),
                (4, 16, 1, 16, 256), (40, 4, 2, 2, 128)]


def _check_query_groups(window, shape, dtype):
  """The forward FFI call with query_groups reads q (B, T, N, H) as the rows t*G + g of N / G
  heads in place and writes the call's layouts: the results of the call on the transposed
  query, bit for bit (the same kernel and tile see the same rows), with a window over the
  packed rows and ragged lengths (an item without queries, one without keys)."""
  T, N, K, G, H = shape
  B, S = 3, 300
  q, k, v = _inputs(B, T, S, N, K, H, dtype, seed=1)
  q_len = jnp.asarray([T, 0, max(T - 1, 1)], jnp.int32) * G  # in packed rows, as _split_kv's
  kv_len = jnp.asarray([S, 77, 0], jnp.int32)
  config = PLAIN if window is None else AttentionConfig(scale=0.25, window_left=window[0],
                                                        window_right=window[1])
  call = functools.partial(_primitive._forward_call, config)
  want_out, want_lse = jax.jit(functools.partial(_packed_call, call, G=G))(
      q, k, v, q_len, kv_len)
  out, lse = jax.jit(functools.partial(call, query_groups=G))(
      q, k, v, None, None, q_len, kv_len, None, None)
  assert out.shape == q.shape and lse.shape == (B, N, T)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


WINDOWS = pytest.mark.parametrize("window", [None, (40, 0)], ids=["full", "causal-window"])


@WINDOWS
def test_query_groups_forward_call_equals_the_packed_call(window):
  """_check_query_groups on the CPU kernel, which packs a single query row."""
  _check_query_groups(window, QUERY_GROUPS[0], jnp.float32)


@pytest.mark.gpu
@WINDOWS
@pytest.mark.parametrize("shape", QUERY_GROUPS, ids=lambda s: "T%d-N%d-K%d-G%d-H%d" % s)
def test_gpu_query_groups_forward_call_equals_the_packed_call(platform, window, shape):
  """_check_query_groups on the Hopper kernels: several query rows through their
  five-dimensional TMA boxes."""
  _check_query_groups(window, shape, jnp.bfloat16)


def test_cpu_forward_refuses_query_groups_of_several_rows():
  q, k, v = _inputs(1, 3, 64, 8, 2, 16, jnp.float32)
  call = functools.partial(_primitive._forward_call, PLAIN, query_groups=4)
  with pytest.raises(Exception, match="single query row only"):
    jax.block_until_ready(jax.jit(call)(q, k, v, None, None, None, None, None, None))


#: (T, N, K, query_groups, H, tile rows): one row's query heads packed in place (the CPU
#: kernel's packing too), several rows' in the call's layout and packed in place (two strides),
#: head dims below their tile's, the head dims' other tiles.
FLOAT_PARTS = [(1, 8, 2, 4, 128, 64), (3, 8, 2, 1, 72, 64), (3, 8, 2, 4, 128, 64),
               (16, 32, 8, 4, 128, 64), (1, 12, 3, 4, 64, None), (2, 4, 4, 1, 256, None),
               (5, 16, 4, 4, 120, 128)]


def _check_float_parts(shape, dtype, masked, platform):
  """A forward call with parts=True (a split's, the merge's input) gives the output in float32
  that its plain call rounds once to the dtype: the same kernel and tile, bit for bit after the
  rounding, in every layout of the rows, with ragged lengths (dead rows) and, masked, a mask
  array; the log-sum-exps alike."""
  T, N, K, G, H, rows = shape
  B, S = 3, 700
  q, k, v = _inputs(B, T, S, N, K, H, dtype, seed=2)
  q_len = jnp.asarray([T, 0, max(T - 1, 1)], jnp.int32) * G  # in packed rows
  kv_len = jnp.asarray([S, 300, 0], jnp.int32)
  mask = None
  if masked:
    mask = jnp.asarray(np.random.default_rng(3).random((B, N // G, T * G, S)) < 0.6)
  tile = None
  if platform == "gpu":
    tile = _config.SM90_FORWARD.tile_for(H, rows, arrays=masked)
    assert tile.block_m == (rows or tile.block_m)
  call = lambda parts: jax.jit(functools.partial(
      _primitive._forward_call, PLAIN, gpu_tile=tile, query_groups=G, parts=parts))(
          q, k, v, None, mask, q_len, kv_len, None, None)
  want_out, want_lse = call(False)
  out, lse = call(True)
  assert out.dtype == jnp.float32 and out.shape == want_out.shape == q.shape
  np.testing.assert_array_equal(np.asarray(out.astype(dtype), np.float32),
                                np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float_parts_round_to_the_plain_output(dtype, masked):
  """_check_float_parts on the CPU kernel, one row's heads packed."""
  _check_float_parts(FLOAT_PARTS[0][:5] + (None,), dtype, masked, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", FLOAT_PARTS, ids=lambda s: "T%d-N%d-K%d-G%d-H%d-rows%s" % s)
def test_gpu_float_parts_round_to_the_plain_output(platform, shape, dtype, masked):
  """_check_float_parts on the Hopper kernels: parts stored from the registers."""
  _check_float_parts(shape, dtype, masked, platform)


@pytest.mark.gpu
def test_gpu_split_parts_reach_the_merge_in_float32(platform):
  """A decoding step's compiled forward writes its parts in float32 and the merge reads them."""
  from jax_flash import _extension

  q, k, v = _inputs(1, 1, 4096, 32, 8, 128, jnp.bfloat16)
  assert _split_kv.plan(q.shape, k.shape, PLAIN, False).splits > 1
  hlo = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v)).lower(
      q, k, v).compile().as_text()
  calls = [line for line in hlo.splitlines() if "custom-call" in line and "custom_call_target"
           in line]
  forward = [c for c in calls if '"%s"' % _extension.FORWARD_TARGET in c]
  merge = [c for c in calls if '"%s"' % _extension.FORWARD_MERGE_TARGET in c]
  assert len(forward) == 1 and len(merge) == 1, calls
  assert re.search(r"=\s*\(f32\[", forward[0]), forward[0]  # (out, lse) in float32
  assert "operand_layout_constraints={f32[" in merge[0], merge[0]  # out_parts


def test_plan_splits_until_the_gpu_is_full():
  # Split (doubling) while the doubled split gives at most 132 CTAs (one per SM) and chunks of
  # at least S / 16 keys within [256, 1024].
  assert _split_kv.plan((1, 1, 16, 128), (1, 65536, 2, 128), PLAIN, False, 132) == \
      _split_kv.Plan(groups=8, splits=64)  # chunks of 1024
  assert _split_kv.plan((1, 4, 16, 128), (1, 8192, 2, 128), PLAIN, False, 132) == \
      _split_kv.Plan(groups=8, splits=16)  # chunks of 512 = S / 16
  assert _split_kv.plan((4, 1, 16, 128), (4, 8192, 8, 128), PLAIN, False, 132) == \
      _split_kv.Plan(groups=2, splits=4)  # 128 CTAs
  assert _split_kv.plan((1, 1, 32, 128), (1, 4096, 8, 128), PLAIN, False, 132) == \
      _split_kv.Plan(groups=4, splits=16)  # chunks of 256
  # Enough items already: only the packing.
  assert _split_kv.plan((64, 1, 32, 128), (64, 8192, 8, 128), PLAIN, False, 132) == \
      _split_kv.Plan(groups=4, splits=1)
  # A key length that does not cut into whole key blocks is not split.
  assert _split_kv.plan((1, 1, 4, 64), (1, 5000, 4, 64), PLAIN, False, 132) is None


@pytest.mark.parametrize("case", ["causal", "window", "segments", "many rows", "no gain"])
def test_plan_leaves_other_calls_alone(case):
  q, k = (1, 2, 8, 64), (1, 65536, 2, 64)
  config, segments = PLAIN, False
  if case == "causal":
    config = AttentionConfig(scale=0.25, window_left=-1, window_right=0)
  elif case == "window":
    config = AttentionConfig(scale=0.25, window_left=100, window_right=-1)
  elif case == "segments":
    segments = True
  elif case == "many rows":
    q = (1, 17, 8, 64)  # 17 * 4 packed rows > 64
  else:
    q, k = (64, 1, 8, 64), (64, 4096, 8, 64)  # 512 CTAs, one head per group
  assert _split_kv.plan(q, k, config, segments, 132) is None


DECODE_CASES = [
    Case(T=1, S=8192, B=2, N=8, K=2, H=128, kv_lens=(8192, 3001)),
    Case(T=4, S=16384, B=1, N=32, K=8, H=128, q_lens=(3,), kv_lens=(9000,)),
    Case(T=16, S=4096, B=3, N=8, K=2, H=64, kv_lens=(0, 4096, 1000)),
    Case(T=2, S=8192, B=None, N=4, K=4, H=64),
    Case(T=1, S=8192, B=2, N=8, K=1, H=256, softcap=30.0, kv_lens=(5000, 8192)),
    Case(T=1, S=4096, B=3, N=32, K=8, H=64, q_lens=(1, 0, 1), kv_lens=(4096, 1, 0)),
    # Mask and bias arrays, packed and chunked with the query and the keys: a mask of keys per
    # item (a decoding step's cache), one per head and row with dead rows, a bias per head and
    # key, a bias per row with a mask of keys, a mask under soft-capping.
    Case(T=1, S=8192, B=2, N=8, K=2, H=128, mask="B11S", kv_lens=(8192, 3001)),
    Case(T=4, S=4096, B=2, N=16, K=4, H=128, mask="BNTS", dead_rows=True),
    Case(T=1, S=8192, B=2, N=8, K=2, H=128, bias="1N1S"),
    Case(T=3, S=4096, B=2, N=8, K=2, H=64, bias="B1TS", mask="B11S"),
    Case(T=1, S=4096, B=2, N=16, K=4, H=128, mask="B11S", softcap=30.0),
    # Query heads read in place as rows in groups of 16; groups of 3, which divide no query
    # block, transposed.
    Case(T=4, S=8192, B=2, N=16, K=1, H=128, kv_lens=(8192, 5000)),
    Case(T=5, S=4096, B=2, N=12, K=4, H=128, mask="B11S"),
    # On the decoding kernel (at most 16 packed rows; the head dim 64 cases above too, with
    # chunks of 512 and 1024 keys, two buffers of keys), chunks of 128 or 256 keys (one buffer):
    # one row of 32 heads against 4096 keys (16 chunks); 15 rows of transposed groups of 3; one
    # query head per key/value head, chunks of one key block, lengths ending inside and at warps'
    # key ranges, large logits (std 4: logits of some 200).
    Case(T=1, S=4096, B=1, N=32, K=8, H=128),
    Case(T=5, S=2048, B=2, N=12, K=4, H=128, kv_lens=(2048, 129)),
    Case(T=3, S=1024, B=3, N=4, K=4, H=64, q_lens=(3, 1, 0), kv_lens=(97, 32, 1024)),
    Case(T=1, S=2048, B=2, N=16, K=2, H=64, std=4.0, kv_lens=(2047, 255)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_gpu_decode_shapes(case, dtype):
  """Decoding shapes run split and packed on the GPU: output and log-sum-exp against the
  float64 definition, and the gradients (the plain backward, from the merged log-sum-exp)."""
  from conftest import require_gpu

  require_gpu()
  case = case.replace(dtype=dtype)
  q_shape = (case.batch, case.T, case.N, case.H)
  k_shape = (case.batch, case.S, case.kv_heads, case.H)
  assert _split_kv.plan(q_shape, k_shape, PLAIN, False) is not None, "not a decoding shape"
  check_forward(case, "gpu")
  check_gradients(case, "gpu")


@pytest.mark.parametrize("H,longest", _config.SM90_DECODE.prefer_keys_up_to)
def test_decoding_kernel_runs_the_chunks_it_prefers(H, longest):
  """A split's forward runs on the decoding kernel where its chunks have at most the head dim's
  prefer_keys_up_to keys (any, where it has none) and its packed rows fit the kernel's, in the
  head dims it lists, without logit arrays or soft-capping; elsewhere on the forward tiles."""
  decode = _config.SM90_DECODE
  keys = longest or 1 << 20
  assert decode.runs(H, decode.rows, keys, arrays=False, softcap=False)
  assert decode.runs(H, 1, 128, arrays=False, softcap=False)
  assert not decode.runs(H, decode.rows + 1, 128, arrays=False, softcap=False)
  assert decode.runs(H, 1, keys + 128, arrays=False, softcap=False) == (longest is None)
  assert not decode.runs(H, 1, 128, arrays=True, softcap=False)
  assert not decode.runs(H, 1, 128, arrays=False, softcap=True)
  assert not decode.runs(H - 8, 1, 128, arrays=False, softcap=False)
  assert decode.block_m not in {t.block_m for t in _config.SM90_FORWARD_TILES}


def _decode_forward_call(q, k, v, **kw):
  """The forward FFI call on the decoding kernel (its block_m), parts in float32."""
  kw.setdefault("parts", True)
  return jax.jit(functools.partial(_primitive._forward_call, PLAIN,
                                   gpu_tile=_config.SM90_DECODE, **kw))(
      q, k, v, None, None, None, None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("T,N,K,G,H,S", [(1, 8, 2, 4, 128, 300), (4, 16, 4, 4, 64, 256),
                                         (16, 4, 4, 1, 128, 1000), (1, 2, 2, 1, 64, 1)])
def test_gpu_decoding_kernel_equals_the_forward_tile(platform, dtype, T, N, K, G, H, S):
  """The decoding kernel's float32 parts against the forward tile's (both round P to the
  inputs' dtype for P V, at different maxima: they differ by that rounding, a few units of the
  dtype's last place of the output's scale) and its lse (float32 sums of the same
  exponentials), with rows packed as the split packs them, keys not a multiple of a block."""
  q, k, v = _inputs(2, T, S, N, K, H, dtype, seed=5)
  if T > 1 and G > 1:
    rows, groups = q, G
  else:
    rows = jnp.swapaxes(q.reshape(2, T, K, G, H), 2, 3).reshape(2, T * G, K, H)
    groups = 1
  tile = _config.SM90_FORWARD.tile_for(H, T * G)
  out, lse = _decode_forward_call(rows, k, v, query_groups=groups)
  want_out, want_lse = jax.jit(functools.partial(
      _primitive._forward_call, PLAIN, gpu_tile=tile, query_groups=groups, parts=True))(
          rows, k, v, None, None, None, None, None, None)
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=0,
                             atol=4 * eps * float(jnp.max(jnp.abs(want_out))))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_decoding_kernel_refuses_calls_it_does_not_take(platform):
  """The handler refuses, naming the decoding forward, what that kernel does not take: a
  rounded output, more packed rows than its tile's, a head dim it does not list."""
  rows = _config.SM90_DECODE.rows
  q, k, v = _inputs(1, 1, 256, 2, 2, 128, jnp.bfloat16)
  with pytest.raises(Exception, match="decoding forward writes a split's float32 parts only"):
    jax.block_until_ready(_decode_forward_call(q, k, v, parts=False))
  q, k, v = _inputs(1, rows + 1, 256, 2, 2, 128, jnp.bfloat16)
  with pytest.raises(Exception, match="decoding forward takes at most %d" % rows):
    jax.block_until_ready(_decode_forward_call(q, k, v))
  q, k, v = _inputs(1, 1, 256, 2, 2, 96, jnp.bfloat16)
  with pytest.raises(Exception, match="decoding forward has no kernel for head dim 96"):
    jax.block_until_ready(_decode_forward_call(q, k, v))


# --- the GPU's merge kernel --------------------------------------------------------------------


@pytest.fixture
def platform():
  """The merge kernel's tests run on the GPU only (skipped without one, failed with
  JAX_FLASH_REQUIRE_GPU=1), under its default device."""
  from conftest import require_gpu

  require_gpu()
  return "gpu"


def _parts(items, P, layout, H, seed=0):
  """Partial outputs (float32) and log-sum-exps of P chunks in the forward's layout of packed
  query heads (`layout`: T, K, G; G = 1 is the call's layout), some rows dead in some chunks or
  in all."""
  T, K, G = layout
  N = K * G
  rng = np.random.default_rng(seed)
  out = rng.standard_normal((items, P, T, N, H)).astype(np.float32)
  lse = (rng.standard_normal((items, P, T, N)) * 8).astype(np.float32)
  lse[:, ::3, 0, 1] = -np.inf  # sees no key in every third chunk: its output there is 0
  out[:, ::3, 0, 1] = 0
  lse[:, :, -1, -1] = -np.inf  # sees no key at all
  out[:, :, -1, -1] = 0
  # Head k*G + g of row t -> row t*G + g of head k: (items, P, T*G, K, H), (items, P, K, T*G).
  out = out.reshape(items, P, T, K, G, H).transpose(0, 1, 2, 4, 3, 5).reshape(
      items, P, T * G, K, H)
  lse = lse.reshape(items, P, T, K, G).transpose(0, 1, 3, 2, 4).reshape(items, P, K, T * G)
  return jnp.asarray(out), jnp.asarray(lse)


#: (T, K, G): the call's layout as the GPU's forward leaves it (G = 1: one row of 37 heads or of
#: 12, several rows of 10 or 32 heads), and query heads packed in rows, transposed (groups of
#: 4 of one row, of 5 and of 4 of several).
MERGE_LAYOUTS = [(1, 37, 1), (1, 12, 1), (3, 10, 1), (16, 32, 1), (1, 3, 4), (3, 2, 5),
                 (16, 8, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", MERGE_LAYOUTS, ids=lambda l: "T{}-K{}-G{}".format(*l))
@pytest.mark.parametrize("P,H", [(1, 64), (16, 128), (64, 256), (5, 72), (100, 128)])
def test_gpu_forward_merge_equals_the_definition(platform, P, H, layout, dtype):
  """The CUDA merge kernel against `_split_kv.merge` (float32 weights and sums, both), from
  each layout of the parts into the call's: the log-sum-exp to float32 rounding, the output to
  one rounding of the dtype and the float32 sums' rounding; dead rows exactly 0 and -inf."""
  _check_merge_kernel(*_parts(3, P, layout, H), layout, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [2, 16])
def test_gpu_forward_merge_of_more_items_than_one_launch_takes(platform, P):
  """Items past the 65535 of one launch's grid (several launches), each of fewer threads
  than a warp (blocks of one warp)."""
  layout = (1, 1, 2)
  _check_merge_kernel(*_parts(65535 + 7, P, layout, 8), layout, "bfloat16")


def _check_merge_kernel(out, lse, layout, dtype):
  """The merge kernel's results of these parts against `_split_kv.merge`'s (see
  test_gpu_forward_merge_equals_the_definition)."""
  T = layout[0]
  items, H = out.shape[0], out.shape[-1]
  merge = lambda f: jax.jit(f, static_argnums=(2, 3))(out, lse, T, dtype)
  got_out, got_lse = (np.asarray(x, np.float32) for x in merge(_primitive._forward_merge_call))
  want_out, want_lse = (np.asarray(x, np.float32) for x in merge(_split_kv.merge))
  N = layout[1] * layout[2]
  assert got_out.shape == want_out.shape == (items, T, N, H) and got_lse.shape == (items, N, T)
  assert np.all(got_lse[:, -1, -1] == -np.inf) and np.all(got_out[:, -1, -1] == 0)
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
  live = ~np.isneginf(want_lse)
  # Two float32 implementations of exp and log, sums in other orders: a few float32 ulps.
  np.testing.assert_allclose(got_lse[live], want_lse[live], rtol=1e-6, atol=1e-6)
  # Both sum float32 products in different orders and round once to the dtype: one rounding of
  # the dtype, plus the float32 sums' difference, which scales with the terms (where they
  # cancel, more than with the result). Measured below 2^-23 of sum_i w_i |out_i| at 2 to 64
  # parts (bench/RESULTS.md); 2^-18 is 64 float32 ulps of it, room for the longer sums here.
  # sum_i w_i |out_i| is `merge` of |out| in float32.
  terms = np.asarray(jax.jit(_split_kv.merge, static_argnums=(2, 3))(
      jnp.abs(out), lse, T, jnp.float32)[0])
  ulp = (np.abs(want_out) * float(jnp.finfo(dtype).eps) +
         float(jnp.finfo(dtype).smallest_normal) + terms * 2.0**-18)
  assert np.all(np.abs(got_out - want_out) <= ulp), np.abs(got_out - want_out).max()


#: Inconsistent buffers of the merge, each against a consistent set: parts of T = 5 rows, K = 3
#: and G = 2 in the rows layout (or in the call's layout, G = 1), and the message that names it.
_MERGE_ROWS = dict(out=((2, 4, 10, 3, 8), np.float32), lse=((2, 4, 3, 10), np.float32),
                   result=((2, 5, 6, 8), jnp.bfloat16), result_lse=((2, 6, 5), np.float32))
_MERGE_CALL = dict(out=((2, 4, 5, 6, 8), np.float32), lse=((2, 4, 6, 5), np.float32),
                   result=((2, 5, 6, 8), jnp.bfloat16), result_lse=((2, 6, 5), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("base,change,mentioned", [
    (_MERGE_ROWS, dict(out=((2, 4, 10, 3, 8), jnp.bfloat16)), "out_parts has dtype bfloat16"),
    (_MERGE_ROWS, dict(out=((2, 4, 3, 10, 8), np.float32)), "out_parts"),
    (_MERGE_ROWS, dict(out=((2, 4, 30, 8), np.float32)), "takes out_parts"),
    (_MERGE_ROWS, dict(lse=((2, 4, 3, 11), np.float32)), "lse_parts"),
    (_MERGE_ROWS, dict(lse=((2, 4, 3, 10), np.float16)), "lse_parts"),
    (_MERGE_ROWS, dict(result=((2, 5, 6, 9), jnp.bfloat16)), "output"),
    (_MERGE_ROWS, dict(result=((2, 5, 6, 8), np.float32)), "output has dtype float32"),
    (_MERGE_ROWS, dict(result=((2, 5, 7, 8), jnp.bfloat16), result_lse=((2, 7, 5), np.float32)),
     "multiple of lse_parts' key/value heads"),
    (_MERGE_ROWS, dict(result_lse=((2, 5, 6), np.float32)), "lse"),
    (_MERGE_ROWS, dict(out=((2, 4, 10, 3, 6), np.float32), result=((2, 5, 6, 6), jnp.bfloat16)),
     "multiples of 4"),
    (_MERGE_CALL, dict(out=((2, 4, 6, 5, 8), np.float32)), "out_parts"),
    (_MERGE_CALL, dict(lse=((2, 4, 5, 6), np.float32)), "multiple of lse_parts' key/value heads"),
], ids=["out-dtype", "out-layout", "out-rank", "lse-rows", "lse-dtype", "output-shape",
        "output-dtype", "heads-not-grouped", "lse-shape", "head-dim", "call-layout-transposed",
        "call-layout-lse-transposed"])
def test_gpu_forward_merge_handler_rejects_inconsistent_buffers(platform, base, change,
                                                                mentioned):
  from jax_flash import _extension

  _extension.ensure_registered()
  spec = dict(base)
  spec.update(change)
  call = jax.ffi.ffi_call(_extension.FORWARD_MERGE_TARGET,
                          tuple(jax.ShapeDtypeStruct(*spec[n]) for n in ("result", "result_lse")))
  with pytest.raises(jax.errors.JaxRuntimeError, match=mentioned):
    jax.block_until_ready(call(jnp.zeros(*spec["out"]), jnp.zeros(*spec["lse"])))
