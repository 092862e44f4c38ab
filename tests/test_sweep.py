"""Seeded random sweep over every feature at once: 30 configurations on the CPU, 10 on the GPU.

The configurations are drawn once from fixed seeds, so a failure names a reproducible case.
Half of them also check gradients (a third of those through the log-sum-exp).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_flash import _config

from _harness import Case, check_forward, check_gradients
from _platforms import with_platform

SPECS = ["BNTS", "1NTS", "B1TS", "BN1S", "BNT1", "11TS", "TS", "S", ""]


def _draw(rng, options):
  return options[rng.integers(len(options))]


def _random_case(rng, *, dtypes, head_dims, lengths) -> Case:
  B = _draw(rng, [None, 1, 2, 3])
  T, S = int(_draw(rng, lengths)), int(_draw(rng, lengths))
  N, K = _draw(rng, [(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)])
  fields = dict(B=B, T=T, S=S, N=N, K=K, H=int(_draw(rng, head_dims)),
                dtype=str(_draw(rng, dtypes)), is_causal=bool(rng.random() < 0.4))
  window = _draw(rng, [None, None, int(rng.integers(0, 9)),
                       (int(rng.integers(0, 30)), int(rng.integers(0, 30)))])
  fields["window"] = window
  if rng.random() < 0.5:
    fields["bias"] = _draw(rng, SPECS)
  if rng.random() < 0.4:
    fields["mask"] = _draw(rng, SPECS)
  batch = 1 if B is None else B
  if B is not None and rng.random() < 0.4:
    fields["q_lens"] = tuple(int(x) for x in rng.integers(0, T + 3, batch))
  if B is not None and rng.random() < 0.4:
    fields["kv_lens"] = tuple(int(x) for x in rng.integers(0, S + 3, batch))
  if rng.random() < 0.2:
    fields["scale"] = float(np.round(rng.uniform(-1.0, 2.0), 3))
  if (fields.get("bias", "").endswith("S") and "mask" not in fields and window is None
      and rng.random() < 0.3):
    fields["extreme_bias"] = True  # key 0 stays finite and visible to every live row
  return Case(**fields)


def _sweep(seed: int, count: int, **space):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    case = _random_case(rng, **space)
    grads = i % 2 == 1
    through_lse = grads and i % 3 == 0
    out.append((case, grads, through_lse))
  return out


CPU_SWEEP = _sweep(20240601, 30, dtypes=[d.name for d in _config.CPU_DTYPES],
                   head_dims=[1, 8, 16, 24, 40, 64], lengths=[1, 2, 7, 16, 33, 65, 100, 127])
GPU_SWEEP = _sweep(20240602, 10, dtypes=[d.name for d in _config.GPU_DTYPES],
                   head_dims=[d for d in range(1, _config.GPU_MAX_HEAD_DIM + 1)
                              if _config.gpu_head_dim_supported(d)],
                   lengths=[1, 7, 65, 127, 239, 384, 1000])


def _ids(sweep):
  return [f"{i}-{'grad-' if g else ''}{'lse-' if l else ''}{c}" for i, (c, g, l) in enumerate(sweep)]


def _run(case, grads, through_lse, platform, seed):
  check_forward(case, platform, seed=seed)
  if grads:
    check_gradients(case, platform, seed=seed, through_lse=through_lse)


@pytest.mark.parametrize("index", range(len(CPU_SWEEP)), ids=_ids(CPU_SWEEP))
def test_random_configuration_cpu(index):
  _run(*CPU_SWEEP[index], platform="cpu", seed=index)


@with_platform("platform,index", [pytest.param("gpu", i, marks=pytest.mark.gpu, id=name)
                                  for i, name in enumerate(_ids(GPU_SWEEP))])
def test_random_configuration_gpu(platform, index):
  _run(*GPU_SWEEP[index], platform=platform, seed=index)
