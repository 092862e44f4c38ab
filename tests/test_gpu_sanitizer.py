"""compute-sanitizer (memcheck, racecheck, synccheck) over the Hopper forward kernel on small
problems of every compiled tile (tests/_sanitizer_driver.py). GPU only; skipped (or failed with
JAX_FLASH_REQUIRE_GPU=1) without a GPU, and skipped when compute-sanitizer is not installed."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import _sanitizer_driver
from conftest import require_gpu

DRIVER = pathlib.Path(__file__).resolve().with_name("_sanitizer_driver.py")


def _sanitizer() -> str | None:
  found = shutil.which("compute-sanitizer")
  if found:
    return found
  cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
  candidate = pathlib.Path(cuda_home) / "bin" / "compute-sanitizer"
  return str(candidate) if candidate.exists() else None


@pytest.mark.gpu
def test_forward_kernel_is_clean_under_compute_sanitizer():
  require_gpu()
  sanitizer = _sanitizer()
  if sanitizer is None:
    pytest.skip("compute-sanitizer not found")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  # The three tools run concurrently (each in its own process) to bound the wall time.
  runs = {
      tool: subprocess.Popen(
          [sanitizer, "--tool", tool, "--error-exitcode", "99",
           # Only jax_flash's kernels: XLA's and cuDNN's own kernels are not under test.
           "--kernel-name", "kns=forward_kernel", sys.executable, str(DRIVER)],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for tool in ("memcheck", "racecheck", "synccheck")
  }
  expected_cases = len(list(_sanitizer_driver.cases()))
  for tool, proc in runs.items():
    output, _ = proc.communicate(timeout=900)
    report = output[-6000:]
    assert proc.returncode == 0, f"{tool} exit status {proc.returncode}:\n{report}"
    assert "ERROR SUMMARY: 0 errors" in output, f"{tool}:\n{report}"
    assert output.count("ok {") == expected_cases, f"{tool}:\n{report}"
