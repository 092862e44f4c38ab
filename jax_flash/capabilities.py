"""What this installation can run, from the configuration table and the build."""

from __future__ import annotations

import jax

from . import _config, _extension


def gpu_available() -> bool:
  """True when the CUDA handlers are built and jax sees a GPU."""
  if not _extension.cuda_built():
    return False
  try:
    return len(jax.devices("gpu")) > 0
  except RuntimeError:
    return False


def capabilities() -> dict:
  """Supported dtypes and head dims per platform, as compiled."""
  return {
      "cpu": {"dtypes": [d.name for d in _config.CPU_DTYPES], "head_dims": "any"},
      "gpu": {
          "built": _extension.cuda_built(),
          "dtypes": [d.name for d in _config.GPU_DTYPES],
          # Calls in these run on the blockwise JAX path (HIGHEST matmul precision, any head dim).
          "blockwise_dtypes": [d.name for d in _config.GPU_BLOCKWISE_DTYPES],
          "head_dims": f"multiples of {_config.GPU_HEAD_DIM_MULTIPLE} up to "
                       f"{_config.GPU_MAX_HEAD_DIM}",
          "tiles": [t.__dict__ for t in _config.SM90_FORWARD_TILES],
          "backward_tiles": [t.__dict__ for t in _config.SM90_BACKWARD_TILES],
          # Calls with arrays a kernel does not read run on the blockwise JAX path, and so do
          # calls combining features in a way a kernel does not list.
          "kernel_features": {"forward": sorted(_config.SM90_FORWARD.features),
                              "backward": sorted(_config.SM90_BACKWARD.features)},
          "kernel_feature_combinations": {
              pass_: sorted(sorted(c) for c in kernel.combinations)
              for pass_, kernel in (("forward", _config.SM90_FORWARD),
                                    ("backward", _config.SM90_BACKWARD))},
      },
  }
