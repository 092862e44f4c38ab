"""Parametrisation helpers over (platform, ...): CPU always, GPU marked `gpu`."""

from __future__ import annotations

import pytest

from jax_flash import _config

GPU = pytest.param("gpu", marks=pytest.mark.gpu)
PLATFORMS = ["cpu", GPU]


def with_platform(argnames: str, params):
  """pytest.mark.parametrize over (platform, ...) routed through the `platform` fixture, which
  skips (or fails, with JAX_FLASH_REQUIRE_GPU=1) gpu cases without a GPU."""
  return pytest.mark.parametrize(argnames, params, indirect=["platform"])


def platform_dtypes(cpu_dtypes=None, gpu_dtypes=None):
  """(platform, dtype) parameters: each CPU dtype of the table, then each GPU dtype (marked)."""
  cpu_dtypes = [d.name for d in _config.CPU_DTYPES] if cpu_dtypes is None else cpu_dtypes
  gpu_dtypes = [d.name for d in _config.GPU_DTYPES] if gpu_dtypes is None else gpu_dtypes
  return ([pytest.param("cpu", d, id=f"cpu-{d}") for d in cpu_dtypes] +
          [pytest.param("gpu", d, marks=pytest.mark.gpu, id=f"gpu-{d}") for d in gpu_dtypes])


def platform_params(values, gpu_values=None, ids=str):
  """(platform, value) parameters: the same values on both platforms unless gpu_values."""
  gpu_values = values if gpu_values is None else gpu_values
  return ([pytest.param("cpu", v, id=f"cpu-{ids(v)}") for v in values] +
          [pytest.param("gpu", v, marks=pytest.mark.gpu, id=f"gpu-{ids(v)}") for v in gpu_values])


def named_platform_dtypes(cpu_dtypes_by_name):
  """(platform, dtype, name) parameters: for each (name, CPU dtypes) pair, those dtypes on the
  CPU and every GPU dtype of the table on the GPU (marked)."""
  params = []
  for name, cpu_dtypes in cpu_dtypes_by_name:
    for p in platform_dtypes(cpu_dtypes):
      platform, dtype = p.values
      params.append(pytest.param(platform, dtype, name, marks=p.marks, id=f"{p.id}-{name}"))
  return params


def named_cases_and_dtypes(names, all_dtype_names):
  """named_platform_dtypes over named cases: every CPU dtype for the names in all_dtype_names,
  float32 for the others (the GPU dtypes for all of them)."""
  all_cpu = [d.name for d in _config.CPU_DTYPES]
  return named_platform_dtypes((name, all_cpu if name in all_dtype_names else ["float32"])
                               for name in names)

