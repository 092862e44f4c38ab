"""Platform parametrisation, device scoping and x64 hygiene for the jax_flash tests.

Tests that take the ``platform`` fixture run once on "cpu" and once on "gpu" (marked ``gpu``).
A gpu case skips when the CUDA handlers or a GPU are missing, and fails instead when the
environment sets JAX_FLASH_REQUIRE_GPU=1. Every test runs under ``jax.default_device`` of its
platform ("cpu" for tests without the fixture), so that on a GPU machine the CPU cases really
run on the CPU.
"""

from __future__ import annotations

import os

# pytest-xdist workers share a GPU: each takes memory as it needs it, where XLA would claim 75%
# of it for the first worker. Set before jax initialises a backend.
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import pytest

try:
  import jax_flash
except ImportError as error:  # e.g. the source tree's jax_flash/, which has no extension
  raise ImportError(
      "the tests need an installed jax_flash with its compiled extension: pip install "
      "--no-build-isolation . (or --target DIR and PYTHONPATH=DIR), then run `pytest tests`"
  ) from error

from _platforms import PLATFORMS


def require_gpu() -> None:
  if jax_flash.gpu_available():
    return
  reason = ("no GPU or no CUDA handlers (built: "
            f"{jax_flash.build_info()['cuda']})")
  if os.environ.get("JAX_FLASH_REQUIRE_GPU") == "1":
    pytest.fail(f"JAX_FLASH_REQUIRE_GPU=1 but {reason}")
  pytest.skip(reason)


@pytest.fixture(params=PLATFORMS)
def platform(request):
  name = request.param
  if name == "gpu":
    require_gpu()
  return name


@pytest.fixture(autouse=True)
def _platform_device(request):
  """Runs the test under its platform's default device (the CPU for platform-less tests)."""
  name = request.getfixturevalue("platform") if "platform" in request.fixturenames else "cpu"
  with jax.default_device(jax.devices(name)[0]):
    yield


@pytest.fixture(autouse=True)
def _x64_does_not_leak():
  before = jax.config.jax_enable_x64
  yield
  assert jax.config.jax_enable_x64 == before, "a test left jax_enable_x64 changed"
