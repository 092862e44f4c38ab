"""Trace-time argument validation and canonicalisation for dot_product_attention.

Every malformed call raises here, before anything reaches XLA, with an exception naming the
argument and the expected value: ValueError for shapes and values, TypeError for dtypes and
argument types, NotImplementedError for valid inputs the selected backend does not support.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _config, _extension


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """The static (hashable) part of a call; becomes the FFI attributes."""

  scale: float  # >= 0: canonicalize folds a negative scale into the query
  window_left: int  # -1: unbounded
  window_right: int  # -1: unbounded; causal is window_right == 0
  deterministic: bool = False  # the GPU backward adds its dQ partial sums in a fixed order
  softcap: float = 0.0  # > 0: scaled logits x become softcap * tanh(x / softcap); 0: off


def windows_within(config: AttentionConfig, T: int, S: int) -> AttentionConfig:
  """`config` for a call of T queries and S keys, with the windows that cut nothing there
  unbounded (-1), so that index arithmetic on them cannot overflow. The kernels' rule: query i
  sees key j where i - left <= j <= i + right, so left >= T and right >= S cut nothing. (The FFI
  handlers apply the same rule to the windows they are given.)"""
  left = -1 if config.window_left >= T else config.window_left
  right = -1 if config.window_right >= S else config.window_right
  if (left, right) == (config.window_left, config.window_right):
    return config
  return dataclasses.replace(config, window_left=left, window_right=right)


def lengths_within(lengths, start, size: int):
  """Per-item lengths (int32, any value: beyond the axis all of it, below 0 none of it) as
  lengths within the `size` rows from row `start` (>= 0, broadcasting against `lengths`). A
  negative length is clipped first, so that subtracting `start` cannot wrap around int32."""
  return jnp.clip(jnp.maximum(lengths, 0) - start, 0, size).astype(jnp.int32)


@dataclasses.dataclass
class CanonicalCall:
  """A validated call: q/k/v rank 4 (B, T|S, N|K, H); bias/mask rank 4; seq lengths (B,) int32;
  segment ids (B, T) and (B, S) int32, both or neither."""

  query: jax.Array
  key: jax.Array
  value: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  query_seq_lengths: jax.Array | None
  key_value_seq_lengths: jax.Array | None
  query_segment_ids: jax.Array | None
  key_value_segment_ids: jax.Array | None
  config: AttentionConfig
  unbatched: bool  # the query had no batch axis; results drop it again


def _as_array(x: Any, name: str) -> jax.Array:
  if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "__jax_array__"):
    return x if hasattr(x, "dtype") and hasattr(x, "shape") else jnp.asarray(x)
  if isinstance(x, (list, tuple, numbers.Number)):
    return jnp.asarray(x)
  raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _with_leading_axes(x: jax.Array, rank: int) -> jax.Array:
  return x.reshape((1,) * (rank - x.ndim) + tuple(x.shape)) if x.ndim < rank else x


def on_gpu() -> bool:
  """Whether the call will run on the GPU, as far as trace time can tell: the platform of
  `jax.default_device` when one is set, else jax's default backend."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend() == "gpu"
  platform = device if isinstance(device, str) else device.platform
  return platform in ("gpu", "cuda")


def _check_qkv(query, key, value) -> None:
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must have rank 4 (B, T, N, H) or 3 (T, N, H), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype "
                      f"({', '.join(d.name for d in _config.CPU_DTYPES)}), got {x.dtype}")
  if key.dtype != query.dtype or value.dtype != query.dtype:
    raise TypeError(f"query, key and value must share one dtype, got query {query.dtype}, "
                    f"key {key.dtype}, value {value.dtype}")
  if query.dtype not in _config.CPU_DTYPES:
    raise TypeError(f"query dtype {query.dtype} is not supported; supported: "
                    f"{', '.join(d.name for d in _config.CPU_DTYPES)}")
  if key.shape != value.shape:
    raise ValueError(f"value shape {value.shape} must equal key shape {key.shape}")


def _check_logits_operand(x, name: str, full: tuple[int, int, int, int]) -> jax.Array:
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 and broadcast to (B, N, T, S) = {full}, "
                     f"got shape {x.shape}")
  x = _with_leading_axes(x, 4)
  for axis, (got, want) in enumerate(zip(x.shape, full)):
    if got not in (1, want):
      raise ValueError(f"{name} shape {x.shape} does not broadcast to (B, N, T, S) = {full}: "
                       f"axis {axis} is {got}, expected 1 or {want}")
  return x


def _check_seq_lengths(x, name: str, batch: int) -> jax.Array:
  x = _as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape (B,) = ({batch},), got {x.shape}")
  return x.astype(jnp.int32)


def _check_segment_ids(x, name: str, batch: int, axis: str, length: int,
                       unbatched: bool) -> jax.Array:
  """Segment ids of shape (B, length), or (length,) for an unbatched call, as (B, length)
  int32; `axis` names the length ("T" or "S")."""
  x = _as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
  expected, spelled = (((length,), f"({axis},)") if unbatched else
                       ((batch, length), f"(B, {axis})"))
  if x.shape != expected:
    raise ValueError(f"{name} must have shape {spelled} = {expected}, got {x.shape}")
  return x.astype(jnp.int32).reshape(batch, length)


def _segment_ids(query_segment_ids, key_value_segment_ids, batch: int, T: int, S: int,
                 unbatched: bool):
  if query_segment_ids is None and key_value_segment_ids is None:
    return None, None
  if query_segment_ids is None or key_value_segment_ids is None:
    given, missing = (("query_segment_ids", "key_value_segment_ids")
                      if key_value_segment_ids is None else
                      ("key_value_segment_ids", "query_segment_ids"))
    raise ValueError(f"segment ids come in pairs: {given} was given without {missing} (pass "
                     "both, or neither)")
  return (_check_segment_ids(query_segment_ids, "query_segment_ids", batch, "T", T, unbatched),
          _check_segment_ids(key_value_segment_ids, "key_value_segment_ids", batch, "S", S,
                             unbatched))


#: Window sides past this cut nothing in any call (no sequence is this long); larger ones are
#: taken as this, so that they fit the FFI handlers' int64 attributes.
_MAX_WINDOW = 2**62


def _window(local_window_size, is_causal: bool) -> tuple[int, int]:
  left = right = -1
  if local_window_size is not None:
    pair = ((local_window_size, local_window_size)
            if isinstance(local_window_size, numbers.Integral) else local_window_size)
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or
        not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in pair)):
      raise TypeError("local_window_size must be an int or a (left, right) pair of ints, "
                      f"got {local_window_size!r}")
    left, right = (int(w) for w in pair)
    if left < 0 or right < 0:
      raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    left, right = min(left, _MAX_WINDOW), min(right, _MAX_WINDOW)
  if is_causal:
    right = 0
  return left, right


def _xla_deterministic_ops() -> bool:
  """Whether XLA_FLAGS asks XLA for deterministic GPU ops (--xla_gpu_deterministic_ops)."""
  value = None
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, setting = flag.partition("=")
    if name.lstrip("-") == "xla_gpu_deterministic_ops":
      value = setting.lower() in ("", "true", "1")
  return bool(value)


def _deterministic(deterministic) -> bool:
  if deterministic is None:
    return _xla_deterministic_ops()
  if not isinstance(deterministic, (bool, np.bool_)):
    raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
  return bool(deterministic)


def _static_number(value, name: str) -> float:
  """A static Python real number (not a bool, array or traced value) as a float."""
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    raise TypeError(f"{name} must be a static Python number or None, got "
                    f"{type(value).__name__}")
  return float(value)


def _softcap(logits_soft_cap) -> float:
  if logits_soft_cap is None:
    return 0.0
  cap = _static_number(logits_soft_cap, "logits_soft_cap")
  if not (math.isfinite(cap) and cap > 0):
    raise ValueError(f"logits_soft_cap must be finite and positive (None turns soft-capping "
                     f"off), got {logits_soft_cap!r}")
  return cap


def gpu_kernels_run(dtype) -> bool:
  """Whether a GPU call in `dtype` can run on the Hopper kernels: the CUDA handlers are built and
  kernel_configs.json lists the dtype for them. Every other GPU call (float32, float64, or any
  call to a build without the handlers) runs on the blockwise JAX path (_blockwise.py, whose
  float32 and float64 matmuls run at HIGHEST precision, without TF32)."""
  return _extension.cuda_built() and np.dtype(dtype) in _config.GPU_DTYPES


def _check_gpu_support(query: jax.Array, head_dim: int) -> None:
  if not _extension.cuda_built():
    _extension.warn_cuda_handlers_not_built()
  # The head dim limits the Hopper kernels' tiles; the blockwise path takes any.
  if gpu_kernels_run(query.dtype) and not _config.gpu_head_dim_supported(head_dim):
    raise NotImplementedError(
        f"head dim {head_dim} is not supported on the GPU for query dtype {query.dtype}: it "
        f"must be a multiple of {_config.GPU_HEAD_DIM_MULTIPLE} and at most "
        f"{_config.GPU_MAX_HEAD_DIM} (compiled tiles: "
        f"{', '.join(map(str, _config.GPU_HEAD_DIMS))}); inputs in "
        f"{' or '.join(d.name for d in _config.GPU_BLOCKWISE_DTYPES)} run on the blockwise JAX "
        "path, which takes any head dim")


def canonicalize(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
                 key_value_seq_lengths, local_window_size, deterministic=None,
                 logits_soft_cap=None, query_segment_ids=None,
                 key_value_segment_ids=None) -> CanonicalCall:
  query, key, value = (_as_array(x, n) for x, n in ((query, "query"), (key, "key"),
                                                    (value, "value")))
  _check_qkv(query, key, value)
  unbatched = query.ndim == 3
  query, key, value = (_with_leading_axes(x, 4) for x in (query, key, value))
  B, T, N, H = query.shape
  _, S, K, Hk = key.shape
  if key.shape[0] != B:
    raise ValueError(f"key batch size {key.shape[0]} must equal query batch size {B}")
  if Hk != H:
    raise ValueError(f"key head dim {Hk} must equal query head dim {H}")
  if H == 0 or N == 0 or K == 0:
    raise ValueError(f"heads and head dim must be positive, got query shape {query.shape}, "
                     f"key shape {key.shape}")
  if N % K != 0:
    raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")

  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
  scale = 1.0 / math.sqrt(H) if scale is None else _static_number(scale, "scale")
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  if scale < 0:
    # The kernels track row maxima of raw logits, valid for a non-negative scale only;
    # (-scale) * (-q) . k is the same logit, and the gradient flows through the negation.
    query, scale = -query, -scale
  window_left, window_right = _window(local_window_size, bool(is_causal))
  deterministic = _deterministic(deterministic)
  softcap = _softcap(logits_soft_cap)

  full = (B, N, T, S)
  if bias is not None:
    bias = _check_logits_operand(_as_array(bias, "bias"), "bias", full)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must have a floating dtype, got {bias.dtype} "
                      "(pass boolean masks as mask=)")
    if bias.dtype == np.float64 and query.dtype != np.float64:
      # jax adds the bias to float32 logits and casts back: the same values as a float32 bias.
      bias = bias.astype(jnp.float32)
  if mask is not None:
    mask = _check_logits_operand(_as_array(mask, "mask"), "mask", full)
    if mask.dtype != np.bool_:
      raise TypeError(f"mask must have dtype bool (True keeps a logit), got {mask.dtype} "
                      "(pass additive masks as bias=)")
  if query_seq_lengths is not None:
    query_seq_lengths = _check_seq_lengths(query_seq_lengths, "query_seq_lengths", B)
  if key_value_seq_lengths is not None:
    key_value_seq_lengths = _check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", B)
  query_segment_ids, key_value_segment_ids = _segment_ids(
      query_segment_ids, key_value_segment_ids, B, T, S, unbatched)

  if on_gpu():
    _check_gpu_support(query, H)

  return CanonicalCall(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                       query_segment_ids, key_value_segment_ids,
                       AttentionConfig(scale, window_left, window_right, deterministic,
                                       softcap),
                       unbatched)
