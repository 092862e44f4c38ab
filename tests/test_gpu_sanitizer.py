"""compute-sanitizer (memcheck, racecheck, synccheck) over the Hopper forward and backward
kernels on small problems of every compiled tile (tests/_sanitizer_driver.py), one test per
tool and case. GPU only; skipped (or failed with JAX_FLASH_REQUIRE_GPU=1) without a GPU, and
skipped when compute-sanitizer is not installed."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
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


# Seconds one case may take under one tool. memcheck is by far the slowest of the three.
CASE_TIMEOUT_S = float(os.environ.get("JAX_FLASH_SANITIZER_TIMEOUT", "420"))


# The summary line each tool prints when it found nothing.
CLEAN_SUMMARY = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    "synccheck": "ERROR SUMMARY: 0 errors",
}


def _tool_crashed(returncode: int, output: str) -> bool:
  """Whether compute-sanitizer itself died (a signal, no report of its own): with many
  instances at once on one GPU it occasionally segfaults before checking anything. A kernel
  fault is reported by the tool, with its summary, so it does not look like this."""
  signalled = returncode < 0 or returncode >= 128
  return signalled and "SUMMARY" not in output and "ok " not in output


# Runs of one case when the tool itself crashes. With many instances on one GPU, about a quarter
# of the runs died at start-up (H200, 2026-11-24: 5 of 18 runs, six at a time): one repeat
# leaves a case crashed twice with odds near 1 in 16, too often over some forty cases.
CRASH_ATTEMPTS = 4

# Runs of one case when a run outlasts CASE_TIMEOUT_S. With twelve instances on one GPU, 4 of 27
# runs stalled past 330 s while the others took 6-20 s, and each finished in seconds when run
# again (H100, 2026-11-25). A kernel that hangs stalls every time, so one repeat separates the
# two.
STALL_ATTEMPTS = 2


def _run_case(sanitizer: str, tool: str, index: int, attempts: int = CRASH_ATTEMPTS,
              stall_attempts: int = STALL_ATTEMPTS) -> str | None:
  """Runs one driver case under one tool; returns its failure report, or None if clean. A run in
  which the tool itself crashed is repeated, up to CRASH_ATTEMPTS runs in all, and one that
  timed out up to STALL_ATTEMPTS."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  command = [sanitizer, "--tool", tool, "--error-exitcode", "99",
             # Only jax_flash's kernels: XLA's and cuDNN's own kernels are not under test.
             "--kernel-name", "kns=jax_flash", sys.executable, str(DRIVER), str(index)]
  start = time.monotonic()
  try:
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CASE_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    if stall_attempts > 1:
      return _run_case(sanitizer, tool, index, attempts, stall_attempts - 1)
    output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
    return (f"timed out after {CASE_TIMEOUT_S:.0f} s in each of {STALL_ATTEMPTS} runs:\n"
            f"{output[-3000:]}")
  output = proc.stdout
  if attempts > 1 and _tool_crashed(proc.returncode, output):
    return _run_case(sanitizer, tool, index, attempts - 1, stall_attempts)
  ok = (proc.returncode == 0 and CLEAN_SUMMARY[tool] in output
        and output.count(f"ok {index} ") == 1)
  elapsed = time.monotonic() - start
  return None if ok else f"exit status {proc.returncode} after {elapsed:.0f} s:\n{output[-6000:]}"


def _case_id(index: int, case: dict) -> str:
  """A readable test id for driver case `index`: its head dim, dtype and features, so that
  pytest -k selects by them (e.g. -k "synccheck and softcap")."""
  parts = [str(index), f"h{case['H']}", np.dtype(case["dtype"]).name]
  if case["is_causal"]:
    parts.append("causal")
  if case.get("deterministic"):
    parts.append("deterministic")
  for name in ("window", "softcap"):
    if case.get(name) is not None:
      parts.append(name)
  for name in ("lengths", "segments", "mask", "bias"):
    if case.get(name):
      parts.append(f"{name}={case[name]}")
  if "T" in case:
    parts.append(f"T={case['T']}")
  return "-".join(parts)


CASES = list(_sanitizer_driver.cases())


# One test per tool and case, each a process of its own: the cases are independent and each is
# mostly host time (compiling, and the sanitizer patching every module loaded), so pytest-xdist
# spreads them over workers (.ci/gpu: six at most; 14-16 side by side stalled some for minutes), a
# partial run still reports the cases it finished, and -k picks cases by tool and feature.
@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[_case_id(i, case) for i, case in enumerate(CASES)])
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_kernel_is_clean_under_compute_sanitizer(tool, index):
  require_gpu()
  sanitizer = _sanitizer()
  if sanitizer is None:
    pytest.skip("compute-sanitizer not found")
  report = _run_case(sanitizer, tool, index)
  assert report is None, f"{tool}, case {index} {CASES[index]}: {report}"
