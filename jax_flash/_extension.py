"""Loads the compiled extension and registers its FFI handlers with XLA, once, on first use.

Registration is deferred to the first attention call so that importing jax_flash never
initialises a backend (on a GPU that preallocates most of its memory).
"""

from __future__ import annotations

import functools
import threading
import warnings

import jax
import jaxlib

try:
  from . import _jax_flash_ext
except ImportError as err:
  import os as _os
  _package_dir = _os.path.dirname(_os.path.abspath(__file__))
  raise ImportError(
      f"jax_flash's compiled extension is missing from {_package_dir}. If that is the source "
      "checkout, Python is importing it instead of the installed package (the current directory "
      "comes first on sys.path): run from another directory or with 'python -P'. Otherwise "
      "install with 'pip install --no-build-isolation .' (see README).") from err

FORWARD_TARGET = "jax_flash_fwd"
BACKWARD_TARGET = "jax_flash_bwd"
#: CUDA only: the merge of a forward split along the keys (jax_flash/_split_kv.py).
FORWARD_MERGE_TARGET = "jax_flash_fwd_merge"
#: CUDA only: the block classes of a bias for a Hopper pass's tile (_primitive._bias_tiles).
BIAS_CLASSES_TARGET = "jax_flash_bias_classes"

_BUILD_INFO = _jax_flash_ext.build_info()
_lock = threading.Lock()
_registered = False


def _version_tuple(version: str) -> tuple[int, ...]:
  parts = []
  for piece in version.split(".")[:3]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


def _check_jaxlib_version() -> None:
  built, running = _BUILD_INFO["jaxlib_version"], jaxlib.__version__
  # XLA rejects handlers built against a newer FFI API than the running jaxlib implements.
  if _version_tuple(running)[:2] < _version_tuple(built)[:2]:
    raise ImportError(
        f"jax_flash was built against jaxlib {built} but jaxlib {running} is running; "
        "reinstall with 'pip install --no-build-isolation .' in this environment")


_check_jaxlib_version()


def build_info() -> dict:
  """How the extension was built: jaxlib version, XLA FFI API version, whether the CUDA
  handlers were built (`cuda`) and, in words, why not (`cuda_status`)."""
  return dict(_BUILD_INFO)


def cuda_built() -> bool:
  return bool(_BUILD_INFO["cuda"])


class CudaHandlersNotBuiltWarning(UserWarning):
  """jax_flash runs on a GPU but was built without its CUDA handlers: attention runs on the
  blockwise JAX path there."""


@functools.cache  # once per process: the first GPU call says it, later calls stay quiet
def warn_cuda_handlers_not_built() -> None:
  """Says that the Hopper kernels were not built, why (`cuda_status`) and how to build them."""
  warnings.warn(
      f"jax_flash was built without its CUDA handlers ({_BUILD_INFO['cuda_status']}), so "
      "attention on the GPU runs on jax_flash's blockwise JAX path: correct, but slower than "
      "the Hopper kernels. To build them, reinstall with nvcc (CUDA >= 12.3) on PATH and the "
      "CUTLASS headers: 'python -m pip install --no-deps nvidia-cutlass==4.2.0.0', then "
      "'JAX_FLASH_CUDA=ON python -m pip install --no-build-isolation .' in the jax_flash "
      "source (see README, Install).", CudaHandlersNotBuiltWarning)


def backward_workspace_bytes(batch: int, seqlen_q: int, num_heads: int, head_dim: int, dtype,
                             deterministic: bool = False, dbias_elements: int = 0,
                             seqlen_k: int | None = None) -> int:
  """Bytes of the workspace the Hopper backward of `batch` items of (seqlen_q, num_heads,
  head_dim) queries takes as its last result: the fp32 dQ accumulator, two fp32 row statistics
  per query row (rows padded to the tile's query block), with `deterministic` one counter per
  query block, and an fp32 accumulator for a bias gradient of `dbias_elements` elements where
  it sums over an axis of the (seqlen_q, seqlen_k) logits (one with an element per logit is
  stored directly). 0 without the CUDA handlers, or for problems the Hopper kernels do not
  take (they fail with their own error when called)."""
  if dbias_elements and seqlen_k is None:
    raise TypeError("backward_workspace_bytes: seqlen_k is needed with dbias_elements")
  if not cuda_built():
    return 0
  import numpy as np
  try:
    return int(_jax_flash_ext.backward_workspace_bytes(
        batch=batch, seqlen_q=seqlen_q, num_heads=num_heads, head_dim=head_dim,
        bfloat16=np.dtype(dtype).name == "bfloat16", deterministic=deterministic,
        dbias_elements=dbias_elements, seqlen_k=1 if seqlen_k is None else seqlen_k))
  except ValueError:
    return 0


def ensure_registered() -> None:
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    for platform, targets in _jax_flash_ext.registrations().items():
      for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _registered = True
