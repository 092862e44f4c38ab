"""The table of compiled configurations (kernel_configs.json), read once.

The same file drives the CMake build (which instantiates the Hopper kernels from it), the
argument validation in this package, and the tests.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

_TABLE = json.loads((pathlib.Path(__file__).with_name("kernel_configs.json")).read_text())


@dataclasses.dataclass(frozen=True)
class Sm90ForwardTile:
  head_dim: int
  block_m: int
  block_n: int
  stages: int


def _dtype(name: str) -> np.dtype:
  import ml_dtypes  # jax dependency; provides bfloat16 as a numpy dtype

  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


CPU_DTYPES = tuple(_dtype(d) for d in _TABLE["cpu"]["dtypes"])
GPU_DTYPES = tuple(_dtype(d) for d in _TABLE["sm90"]["dtypes"])
GPU_HEAD_DIM_MULTIPLE: int = _TABLE["sm90"]["head_dim_multiple"]
SM90_FORWARD_TILES = tuple(Sm90ForwardTile(**row) for row in _TABLE["sm90"]["forward"])
GPU_HEAD_DIMS = tuple(t.head_dim for t in SM90_FORWARD_TILES)
GPU_MAX_HEAD_DIM = max(GPU_HEAD_DIMS)


def gpu_head_dim_supported(head_dim: int) -> bool:
  """A GPU problem runs on the smallest compiled tile whose head dim covers it."""
  return 0 < head_dim <= GPU_MAX_HEAD_DIM and head_dim % GPU_HEAD_DIM_MULTIPLE == 0
