"""Every error of the API, raised at trace time with the argument's name, and the handlers'
own validation (a malformed FFI call returns an error instead of aborting)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _extension, _validation

from _harness import handler_attrs
from _tolerances import granularity


def arrays(B=2, T=5, S=7, N=4, K=2, H=8, dtype=jnp.float32):
  q = jnp.zeros((B, T, N, H), dtype)
  k = jnp.zeros((B, S, K, H), dtype)
  return q, k, k


def attend(*args, **kwargs):
  return jax_flash.dot_product_attention(*args, **kwargs)


# --- query, key, value -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("rank", [2, 5])
def test_wrong_rank(name, rank):
  args = list(arrays())
  i = ("query", "key", "value").index(name)
  args[i] = jnp.zeros((3,) * rank, jnp.float32)
  with pytest.raises(ValueError, match=name):
    attend(*args)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_not_an_array(name):
  args = list(arrays())
  args[("query", "key", "value").index(name)] = "not an array"
  with pytest.raises(TypeError, match=name):
    attend(*args)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_integer_inputs(name):
  args = list(arrays())
  i = ("query", "key", "value").index(name)
  args[i] = args[i].astype(jnp.int32)
  with pytest.raises(TypeError, match=name):
    attend(*args)


def test_mismatched_dtypes():
  q, k, v = arrays()
  with pytest.raises(TypeError, match="query, key and value"):
    attend(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="value"):
    attend(q, k, v.astype(jnp.float16))


def _unsupported_floating_dtypes():
  candidates = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16, np.float32,
                np.float64, ml_dtypes.bfloat16]
  return [np.dtype(d) for d in candidates if np.dtype(d) not in _config.CPU_DTYPES]


@pytest.mark.parametrize("dtype", _unsupported_floating_dtypes(), ids=str)
def test_floating_dtype_outside_the_table(dtype):
  q, k, v = (x.astype(dtype) for x in arrays())
  with pytest.raises(TypeError, match="query dtype"):
    attend(q, k, v)


def test_key_value_shape_mismatch():
  q, k, _ = arrays()
  with pytest.raises(ValueError, match="value shape"):
    attend(q, k, jnp.zeros((2, 6, 2, 8), jnp.float32))


def test_mismatched_batch():
  q, _, _ = arrays(B=2)
  _, k, v = arrays(B=3)
  with pytest.raises(ValueError, match="key batch size"):
    attend(q, k, v)


def test_mismatched_head_dims():
  q, _, _ = arrays(H=8)
  _, k, v = arrays(H=16)
  with pytest.raises(ValueError, match="key head dim"):
    attend(q, k, v)


def test_unbatched_query_with_batched_key():
  q = jnp.zeros((5, 4, 8), jnp.float32)
  _, k, v = arrays(B=3)
  with pytest.raises(ValueError, match="key batch size"):
    attend(q, k, v)


@pytest.mark.parametrize("N,K", [(4, 3), (2, 4), (5, 2)])
def test_query_heads_not_a_multiple_of_key_heads(N, K):
  with pytest.raises(ValueError, match="query heads"):
    attend(*arrays(N=N, K=K))


@pytest.mark.parametrize("N,K,H", [(0, 1, 8), (4, 0, 8), (4, 2, 0)])
def test_zero_heads_or_head_dim(N, K, H):
  with pytest.raises(ValueError, match="heads and head dim"):
    attend(*arrays(N=N, K=K, H=H))


# --- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 0, None, "yes", np.array([True])], ids=repr)
def test_is_causal_not_bool(value):
  with pytest.raises(TypeError, match="is_causal"):
    attend(*arrays(), is_causal=value)


def test_is_causal_accepts_numpy_bool():
  out = attend(*arrays(), is_causal=np.bool_(True))
  assert out.shape == (2, 5, 4, 8)


STATIC_NUMBERS = ("scale", "logits_soft_cap")  # keyword arguments taking a static number


@pytest.mark.parametrize("name", STATIC_NUMBERS)
@pytest.mark.parametrize("value", [True, "0.5", jnp.float32(0.5), np.array([0.5]), 1j],
                         ids=["bool", "str", "jax-scalar", "array", "complex"])
def test_not_a_static_number(name, value):
  with pytest.raises(TypeError, match=name):
    attend(*arrays(), **{name: value})


@pytest.mark.parametrize("name", STATIC_NUMBERS)
def test_static_number_traced_under_jit(name):
  q, k, v = arrays()
  f = jax.jit(lambda q, k, v, x: attend(q, k, v, **{name: x}))
  with pytest.raises(TypeError, match=name):
    f(q, k, v, 0.5)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_scale_not_finite(value):
  with pytest.raises(ValueError, match="scale"):
    attend(*arrays(), scale=value)


@pytest.mark.parametrize("window", [-1, (-1, 2), (3, -2)], ids=str)
def test_negative_window(window):
  with pytest.raises(ValueError, match="local_window_size"):
    attend(*arrays(), local_window_size=window)


@pytest.mark.parametrize("window", [1.5, (1,), (1, 2, 3), (1.0, 2), True, (True, 1), "3",
                                    [1, None], np.array([1, 2])],
                         ids=["float", "1-tuple", "3-tuple", "float-in-pair", "bool",
                              "bool-in-pair", "str", "none-in-pair", "array"])
def test_window_of_wrong_type(window):
  with pytest.raises(TypeError, match="local_window_size"):
    attend(*arrays(), local_window_size=window)


def test_window_accepts_numpy_integers_and_lists():
  a = attend(*arrays(), local_window_size=np.int64(2))
  b = attend(*arrays(), local_window_size=[np.int32(2), 2])
  assert a.shape == b.shape == (2, 5, 4, 8)


@pytest.mark.parametrize("value", [1, "yes", jnp.array(True)], ids=["int", "str", "array"])
def test_deterministic_not_bool(value):
  with pytest.raises(TypeError, match="deterministic"):
    attend(*arrays(), deterministic=value)


@pytest.mark.parametrize("flags,expected", [
    ("", False),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
], ids=["unset", "true", "bare", "false", "last-wins"])
def test_deterministic_default_follows_xla_flags(monkeypatch, flags, expected):
  monkeypatch.setenv("XLA_FLAGS", flags)
  call = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None)
  assert call.config.deterministic is expected
  explicit = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                      query_seq_lengths=None, key_value_seq_lengths=None,
                                      local_window_size=None, deterministic=not expected)
  assert explicit.config.deterministic is (not expected)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("inf"), float("nan")], ids=repr)
def test_logits_soft_cap_not_positive_and_finite(value):
  with pytest.raises(ValueError, match="logits_soft_cap"):
    attend(*arrays(), logits_soft_cap=value)


@pytest.mark.parametrize("value", [50, 30.0, np.float32(2.5), np.int64(7)], ids=repr)
def test_logits_soft_cap_accepts_python_and_numpy_numbers(value):
  call = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None, logits_soft_cap=value)
  assert call.config.softcap == float(value) and isinstance(call.config.softcap, float)
  assert attend(*arrays(), logits_soft_cap=value).shape == (2, 5, 4, 8)


def test_logits_soft_cap_none_is_off():
  call = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None, logits_soft_cap=None)
  assert call.config.softcap == 0.0


# --- implementation ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["flash", "XLA", 1, True], ids=["name", "case", "int", "bool"])
def test_unknown_implementation(value):
  with pytest.raises(ValueError, match="implementation"):
    attend(*arrays(), implementation=value)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_deterministic_with_a_jax_nn_implementation(implementation):
  with pytest.raises(ValueError, match="deterministic"):
    attend(*arrays(), implementation=implementation, deterministic=True)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_logits_soft_cap_with_a_jax_nn_implementation(implementation):
  with pytest.raises(ValueError, match="logits_soft_cap .*jax.nn.dot_product_attention has no "
                                       "logit soft-capping"):
    attend(*arrays(), implementation=implementation, logits_soft_cap=30.0)


# --- ring attention ----------------------------------------------------------------------------


def test_ring_attention_axis_name_not_a_string():
  with pytest.raises(TypeError, match="axis_name"):
    jax_flash.ring_attention(*arrays(), axis_name=0)


def test_ring_attention_outside_shard_map():
  with pytest.raises(ValueError, match="inside shard_map over a mesh axis named 'sp'"):
    jax_flash.ring_attention(*arrays(), axis_name="sp")


def test_ring_attention_unknown_layout():
  with pytest.raises(ValueError, match="layout"):
    jax_flash.ring_attention(*arrays(), axis_name="sp", layout="striped")


def test_ring_attention_unknown_kv_exchange():
  with pytest.raises(ValueError, match="kv_exchange must be one of"):
    jax_flash.ring_attention(*arrays(), axis_name="sp", kv_exchange="all_to_all")


def test_ring_attention_zigzag_needs_even_shards():
  with pytest.raises(ValueError, match="even"):
    jax_flash.ring_attention(*arrays(T=5, S=7), axis_name="sp", layout="zigzag")


def test_zigzag_order_needs_whole_chunks():
  with pytest.raises(ValueError, match="must divide into 8 chunks"):
    jax_flash.zigzag_order(jnp.zeros((1, 12, 2, 4)), ring_size=4)


def test_zigzag_order_and_restore():
  x = jnp.arange(8)[None, :, None, None] * jnp.ones((1, 8, 1, 1), jnp.int32)
  ordered = jax_flash.zigzag_order(x, ring_size=2)
  # Chunks of 2 tokens: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
  assert ordered[0, :, 0, 0].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
  np.testing.assert_array_equal(jax_flash.zigzag_restore(ordered, ring_size=2), x)


def test_ring_attention_checks_its_operands_like_the_call():
  q, k, v = arrays()
  with pytest.raises(ValueError, match="key"):
    jax_flash.ring_attention(q, k[:, :, :, :4], v, axis_name="sp")


@pytest.mark.parametrize("value,error", [(-2.0, ValueError), ("50", TypeError)], ids=repr)
def test_ring_attention_checks_the_soft_cap(value, error):
  with pytest.raises(error, match="logits_soft_cap"):
    jax_flash.ring_attention(*arrays(), axis_name="sp", logits_soft_cap=value)


# --- bias and mask -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bias", "mask"])
def test_bias_or_mask_rank_above_four(name):
  dtype = jnp.float32 if name == "bias" else jnp.bool_
  x = jnp.zeros((1, 2, 4, 5, 7), dtype)
  with pytest.raises(ValueError, match=name):
    attend(*arrays(), **{name: x})


BAD_SHAPES = {
    "batch": (3, 4, 5, 7),
    "heads": (2, 2, 5, 7),
    "query-length": (2, 4, 6, 7),
    "key-length": (2, 4, 5, 8),
    "rank-2": (5, 8),
    "rank-3": (3, 5, 7),
}


@pytest.mark.parametrize("name", ["bias", "mask"])
@pytest.mark.parametrize("shape", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_bias_or_mask_not_broadcastable(name, shape):
  dtype = jnp.float32 if name == "bias" else jnp.bool_
  with pytest.raises(ValueError, match=name):
    attend(*arrays(), **{name: jnp.zeros(shape, dtype)})


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8], ids=str)
def test_bias_not_floating(dtype):
  with pytest.raises(TypeError, match="bias"):
    attend(*arrays(), bias=jnp.zeros((5, 7), dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.uint8], ids=str)
def test_mask_not_bool(dtype):
  with pytest.raises(TypeError, match="mask"):
    attend(*arrays(), mask=jnp.ones((5, 7), dtype))


@pytest.mark.parametrize("name", ["bias", "mask"])
def test_bias_or_mask_not_an_array(name):
  with pytest.raises(TypeError, match=name):
    attend(*arrays(), **{name: object()})


# --- sequence lengths --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 1), (1,)], ids=str)
def test_seq_lengths_of_wrong_shape(name, shape):
  with pytest.raises(ValueError, match=name):
    attend(*arrays(B=2), **{name: jnp.ones(shape, jnp.int32)})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_], ids=str)
def test_seq_lengths_not_integer(name, dtype):
  with pytest.raises(TypeError, match=name):
    attend(*arrays(B=2), **{name: jnp.ones((2,), dtype)})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_seq_lengths_accept_other_integer_types(name):
  out = attend(*arrays(B=2), **{name: np.array([3, 9], np.int16)})
  assert out.shape == (2, 5, 4, 8)


# --- segment ids -------------------------------------------------------------------------------


def segment_ids(B=2, T=5, S=7, dtype=jnp.int32):
  """Ids for arrays(B, T, S): two segments on each side."""
  return dict(query_segment_ids=jnp.zeros((B, T), dtype).at[:, T // 2:].set(1),
              key_value_segment_ids=jnp.zeros((B, S), dtype).at[:, S // 2:].set(1))


@pytest.mark.parametrize("given,missing", [("query_segment_ids", "key_value_segment_ids"),
                                           ("key_value_segment_ids", "query_segment_ids")])
def test_segment_ids_come_in_pairs(given, missing):
  with pytest.raises(ValueError, match=f"{given} was given without {missing}"):
    attend(*arrays(), **{given: segment_ids()[given]})


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_], ids=str)
def test_segment_ids_not_integer(name, dtype):
  ids = segment_ids()
  ids[name] = ids[name].astype(dtype)
  with pytest.raises(TypeError, match=name):
    attend(*arrays(), **ids)


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
def test_segment_ids_not_an_array(name):
  ids = segment_ids()
  ids[name] = object()
  with pytest.raises(TypeError, match=name):
    attend(*arrays(), **ids)


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
@pytest.mark.parametrize("change", ["length", "batch", "rank-1", "rank-3", "swapped"])
def test_segment_ids_of_wrong_shape(name, change):
  ids = segment_ids()
  x = ids[name]
  ids[name] = {"length": x[:, 1:], "batch": jnp.concatenate([x, x]), "rank-1": x[0],
               "rank-3": x[None], "swapped": x.T}[change]
  with pytest.raises(ValueError, match=rf"{name} must have shape \(B, [TS]\)"):
    attend(*arrays(), **ids)


def test_segment_ids_of_an_unbatched_call():
  """(T,) and (S,) for (T, N, H) inputs; batched ids are refused there."""
  q, k, v = (x[0] for x in arrays())
  ids = {n: x[0] for n, x in segment_ids().items()}
  assert attend(q, k, v, **ids).shape == (5, 4, 8)
  with pytest.raises(ValueError, match=r"query_segment_ids must have shape \(T,\) = \(5,\)"):
    attend(q, k, v, **dict(ids, query_segment_ids=ids["query_segment_ids"][None]))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.uint32], ids=str)
def test_segment_ids_become_int32(dtype):
  ids = {n: np.asarray(x, dtype) for n, x in segment_ids().items()}
  call = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None, **ids)
  for got, want in ((call.query_segment_ids, ids["query_segment_ids"]),
                    (call.key_value_segment_ids, ids["key_value_segment_ids"])):
    assert got.dtype == jnp.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  lists = {n: x.tolist() for n, x in ids.items()}
  assert attend(*arrays(), **lists).shape == (2, 5, 4, 8)


def test_segment_ids_absent():
  call = _validation.canonicalize(*arrays(), None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None)
  assert call.query_segment_ids is None and call.key_value_segment_ids is None


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
def test_segment_ids_with_a_jax_nn_implementation(implementation, name):
  with pytest.raises(ValueError, match=f"{name} .*jax.nn.dot_product_attention has no segment "
                                       "ids"):
    attend(*arrays(), implementation=implementation, **{name: segment_ids()[name]})


def test_ring_attention_checks_the_segment_ids():
  ids = segment_ids()
  with pytest.raises(ValueError, match="query_segment_ids was given without"):
    jax_flash.ring_attention(*arrays(), axis_name="sp",
                             query_segment_ids=ids["query_segment_ids"])
  with pytest.raises(TypeError, match="key_value_segment_ids"):
    jax_flash.ring_attention(*arrays(), axis_name="sp", **dict(
        ids, key_value_segment_ids=ids["key_value_segment_ids"].astype(jnp.float32)))


def test_errors_are_raised_at_trace_time():
  """Under jit the errors come from tracing, before anything reaches XLA."""
  q, k, v = arrays()
  f = jax.jit(lambda q, k, v: attend(q, k, v, mask=jnp.zeros((5, 7), jnp.float32)))
  with pytest.raises(TypeError, match="mask"):
    f.lower(q, k, v)


# --- the GPU's limits, with the GPU backend simulated ------------------------------------------


@pytest.fixture
def simulated_gpu(monkeypatch):
  """Trace-time validation as on a GPU backend, with the CUDA handlers built."""
  monkeypatch.setattr(_validation, "on_gpu", lambda: True)
  monkeypatch.setattr(_extension, "cuda_built", lambda: True)


def _gpu_unsupported_head_dims():
  m, top = _config.GPU_HEAD_DIM_MULTIPLE, _config.GPU_MAX_HEAD_DIM
  dims = [1, m - 1, m + 1, top - 1, top + m, 2 * top]
  return sorted({d for d in dims if d > 0 and not _config.gpu_head_dim_supported(d)})


def _gpu_supported_head_dims():
  m = _config.GPU_HEAD_DIM_MULTIPLE
  return sorted({m, *_config.GPU_HEAD_DIMS, *(t - m for t in _config.GPU_HEAD_DIMS)} - {0})


@pytest.mark.parametrize("H", _gpu_unsupported_head_dims())
@pytest.mark.parametrize("dtype", _config.GPU_BLOCKWISE_DTYPES, ids=str)
def test_gpu_takes_any_head_dim_in_the_blockwise_dtypes(simulated_gpu, dtype, H):
  """Dtypes the Hopper kernels do not list run on the blockwise path, whose head dim is free."""
  with jax.enable_x64(dtype == np.float64):
    q = np.zeros((1, 4, 2, H), dtype)
    call = _validation.canonicalize(q, q, q, None, None, scale=None, is_causal=False,
                                    query_seq_lengths=None, key_value_seq_lengths=None,
                                    local_window_size=None)
    assert call.query.dtype == dtype


@pytest.mark.parametrize("H", _gpu_unsupported_head_dims())
def test_gpu_rejects_head_dims_outside_the_table(simulated_gpu, H):
  q = np.zeros((1, 4, 2, H), _config.GPU_DTYPES[0])
  with pytest.raises(NotImplementedError, match="head dim"):
    attend(q, q, q)


@pytest.mark.parametrize("H", _gpu_supported_head_dims())
@pytest.mark.parametrize("dtype", _config.GPU_DTYPES, ids=str)
def test_gpu_accepts_the_table(simulated_gpu, dtype, H):
  q = np.zeros((1, 4, 2, H), dtype)
  call = _validation.canonicalize(q, q, q, None, None, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None,
                                  local_window_size=None)
  assert call.query.shape == (1, 4, 2, H)


def test_default_device_selects_the_gpu_checks(monkeypatch):
  """jax.default_device('gpu') makes trace-time validation apply the GPU's limits: a head dim
  past the table raises (with the CUDA handlers, simulated where they are not built)."""
  monkeypatch.setattr(_extension, "cuda_built", lambda: True)
  H = _config.GPU_MAX_HEAD_DIM + _config.GPU_HEAD_DIM_MULTIPLE
  q = np.zeros((1, 4, 2, H), _config.GPU_DTYPES[0])
  with jax.default_device("gpu"):
    assert _validation.on_gpu()
    with pytest.raises(NotImplementedError, match="head dim"):
      attend(q, q, q)
  with jax.default_device(jax.devices("cpu")[0]):
    assert not _validation.on_gpu()


# --- the handlers' own validation --------------------------------------------------------------


def _attrs(**overrides):
  return handler_attrs(**{"scale": np.float64(0.5), **overrides})


def _forward(operands, out_shape=(2, 5, 4, 8), out_dtype=jnp.float32, lse_shape=(2, 4, 5),
             lse_dtype=jnp.float32, **attrs):
  _extension.ensure_registered()
  call = jax.ffi.ffi_call(_extension.FORWARD_TARGET,
                          (jax.ShapeDtypeStruct(out_shape, out_dtype),
                           jax.ShapeDtypeStruct(lse_shape, lse_dtype)))
  return jax.block_until_ready(call(*operands, **_attrs(**attrs)))


def _bad_forward_calls():
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())
  bias = np.zeros((1, 4, 5, 7), np.float32)
  lens = np.array([5, 5], np.int32)
  q_seg, kv_seg = np.zeros((2, 5), np.int32), np.zeros((2, 7), np.int32)
  kv_span = np.tile(np.array([0, 7], np.int32), (2, 5, 1))
  q_span = np.tile(np.array([0, 5], np.int32), (2, 7, 1))
  blocks, bits = np.zeros((1, 4, 1, 1), np.int8), np.zeros((1, 4, 5, 1), np.uint32)
  return {
      "missing-optional": ([q, k, v], dict(has_bias=True), "optional"),
      "extra-optional": ([q, k, v, bias], dict(), "optional"),
      "key-rank": ([q, k[0], v], dict(), "key"),
      "key-length-vs-value": ([q, k, v[:, :6]], dict(), "value"),
      "key-dtype": ([q, k.astype(np.float16), v], dict(), "key"),
      "value-dtype": ([q, k, v.astype(np.float16)], dict(), "value"),
      "query-vs-output": ([q[:, :4], k, v], dict(), "query"),
      "heads": ([q, np.zeros((2, 7, 3, 8), np.float32), np.zeros((2, 7, 3, 8), np.float32)],
                dict(), "heads"),
      "window": ([q, k, v], dict(window_left=np.int64(-2)), "window_left"),
      "scale-negative": ([q, k, v], dict(scale=np.float64(-0.5)), "scale"),
      "scale-infinite": ([q, k, v], dict(scale=np.float64(np.inf)), "scale"),
      "scale-nan": ([q, k, v], dict(scale=np.float64(np.nan)), "scale"),
      "softcap-negative": ([q, k, v], dict(softcap=np.float64(-1.0)), "softcap"),
      "softcap-infinite": ([q, k, v], dict(softcap=np.float64(np.inf)), "softcap"),
      "softcap-nan": ([q, k, v], dict(softcap=np.float64(np.nan)), "softcap"),
      "bias-shape": ([q, k, v, np.zeros((1, 4, 5, 6), np.float32)], dict(has_bias=True), "bias"),
      "bias-dtype": ([q, k, v, np.zeros((1, 4, 5, 7), np.int32)], dict(has_bias=True), "bias"),
      "mask-dtype": ([q, k, v, bias], dict(has_mask=True), "mask"),
      "mask-tiles-on-cpu": ([q, k, v, blocks, bits], dict(has_mask_blocks=True), "mask_blocks"),
      "mask-and-tiles": ([q, k, v, bias > 0, blocks, bits],
                         dict(has_mask=True, has_mask_blocks=True), "not both"),
      "mask-blocks-dtype": ([q, k, v, blocks.astype(np.int32), bits],
                            dict(has_mask_blocks=True), "mask_blocks"),
      "mask-blocks-heads": ([q, k, v, blocks[:, :3], bits], dict(has_mask_blocks=True),
                            "mask_blocks"),
      "mask-bits-dtype": ([q, k, v, blocks, bits.astype(np.int32)], dict(has_mask_blocks=True),
                          "mask_bits"),
      "mask-bits-missing": ([q, k, v, blocks], dict(has_mask_blocks=True), "optional"),
      "q-lengths-dtype": ([q, k, v, lens.astype(np.float32)], dict(has_q_seqlens=True),
                          "query_seq_lengths"),
      "kv-lengths-shape": ([q, k, v, np.array([5, 5, 5], np.int32)], dict(has_kv_seqlens=True),
                           "key_value_seq_lengths"),
      "segments-missing": ([q, k, v, q_seg, kv_seg], dict(has_segment_ids=True), "optional"),
      "segments-unexpected": ([q, k, v, q_seg, kv_seg, kv_span, q_span], dict(), "optional"),
      "q-segment-ids-dtype": ([q, k, v, q_seg.astype(np.float32), kv_seg, kv_span, q_span],
                              dict(has_segment_ids=True), "q_segment_ids"),
      "kv-segment-ids-shape": ([q, k, v, q_seg, kv_seg[:, 1:], kv_span, q_span],
                               dict(has_segment_ids=True), "kv_segment_ids"),
      "kv-span-shape": ([q, k, v, q_seg, kv_seg, kv_span[..., :1], q_span],
                        dict(has_segment_ids=True), "kv_span"),
      "q-span-dtype": ([q, k, v, q_seg, kv_seg, kv_span, q_span.astype(np.int16)],
                       dict(has_segment_ids=True), "q_span"),
  }


@pytest.mark.parametrize("name", _bad_forward_calls())
def test_forward_handler_rejects_inconsistent_operands(name):
  operands, attrs, mentioned = _bad_forward_calls()[name]
  with pytest.raises(jax.errors.JaxRuntimeError, match=mentioned):
    _forward(operands, **attrs)


@pytest.mark.parametrize("result,mentioned", [
    (dict(out_shape=(2, 5, 8)), "output"),
    (dict(out_dtype=jnp.float16), "output"),
    (dict(lse_shape=(2, 5, 4)), "lse"),
    (dict(lse_dtype=jnp.float16), "lse"),
], ids=["output-rank", "output-dtype", "lse-shape", "lse-dtype"])
def test_forward_handler_rejects_inconsistent_results(result, mentioned):
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())
  with pytest.raises(jax.errors.JaxRuntimeError, match=mentioned):
    _forward([q, k, v], **result)


def _backward(operands, results, **attrs):
  _extension.ensure_registered()
  call = jax.ffi.ffi_call(_extension.BACKWARD_TARGET,
                          tuple(jax.ShapeDtypeStruct(s, d) for s, d in results))
  return jax.block_until_ready(call(*operands, **_attrs(**attrs)))


def _backward_parts():
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())
  out = np.zeros_like(q)
  lse = np.zeros((2, 4, 5), np.float32)
  results = [(q.shape, np.float32), (k.shape, np.float32), (v.shape, np.float32)]
  return [q, k, v, out, lse, out, lse], results


def test_backward_handler_rejects_dbias_without_bias():
  operands, results = _backward_parts()
  with pytest.raises(jax.errors.JaxRuntimeError, match="dbias"):
    _backward(operands, results + [((1, 4, 5, 7), np.float32)])


def test_backward_handler_rejects_dbias_of_another_shape():
  operands, results = _backward_parts()
  bias = np.zeros((1, 4, 5, 7), np.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match="dbias"):
    _backward(operands + [bias], results + [((1, 4, 5, 1), np.float32)], has_bias=True,
              has_dbias=True)


def test_backward_handler_rejects_dbias_flag_without_bias():
  operands, results = _backward_parts()
  with pytest.raises(jax.errors.JaxRuntimeError, match="has_dbias"):
    _backward(operands, results + [((1, 4, 5, 7), np.float32)], has_dbias=True)


@pytest.mark.parametrize("groups", [0, -2, 3])
def test_forward_handler_rejects_query_groups_that_do_not_divide_the_heads(groups):
  """query_groups must be positive and divide the query heads (4 here)."""
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())  # q (2, 5, 4, 8): T = 5, N = 4
  with pytest.raises(jax.errors.JaxRuntimeError, match="query_groups"):
    _forward([q, k, v], out_shape=q.shape, query_groups=np.int64(groups))


def test_backward_handler_rejects_query_groups():
  operands, results = _backward_parts()
  with pytest.raises(jax.errors.JaxRuntimeError, match="query_groups"):
    _backward(operands, results, query_groups=np.int64(2))


def test_forward_handler_rejects_a_negative_block_m():
  """block_m names the Hopper forward's tile (0: the default); the CPU kernels have none."""
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())
  with pytest.raises(jax.errors.JaxRuntimeError, match="block_m"):
    _forward([q, k, v], block_m=np.int64(-1))


def test_backward_handler_rejects_a_block_m():
  """The backward has one tile per head dim: block_m must be 0."""
  operands, results = _backward_parts()
  with pytest.raises(jax.errors.JaxRuntimeError, match="block_m"):
    _backward(operands, results, block_m=np.int64(64))


def test_backward_handler_takes_a_bias_without_its_gradient():
  """has_dbias off: the bias is read and no dbias is returned."""
  operands, results = _backward_parts()
  bias = np.zeros((1, 4, 5, 7), np.float32)
  dq, dk, dv = _backward(operands + [bias], results, has_bias=True)
  assert dq.shape == operands[0].shape and dk.shape == dv.shape == operands[1].shape


@pytest.mark.parametrize("index,name", [(4, "lse"), (5, "dout"), (6, "dlse")])
def test_backward_handler_rejects_wrong_residual_dtypes(index, name):
  operands, results = _backward_parts()
  operands[index] = operands[index].astype(np.float16)
  with pytest.raises(jax.errors.JaxRuntimeError, match=name):
    _backward(operands, results)


def test_backward_handler_rejects_wrong_gradient_shape():
  operands, results = _backward_parts()
  results[1] = ((2, 6, 2, 8), np.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match="dk"):
    _backward(operands, results)


def test_handler_errors_leave_the_process_usable():
  """After a rejected call, a well-formed one still runs."""
  q, k, v = (np.zeros(x.shape, np.float32) for x in arrays())
  with pytest.raises(jax.errors.JaxRuntimeError):
    _forward([q, k, v], has_mask=True)
  out, lse = _forward([q, k, v])
  # Zero logits: lse = log(S) up to the rounding of a float32 result.
  assert np.all(np.asarray(out) == 0)
  assert np.abs(np.asarray(lse, np.float64) - np.log(7)).max() <= 2 * granularity(
      np.log(7), np.float32)
