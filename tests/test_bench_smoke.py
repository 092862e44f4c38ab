"""Smoke test of the end-to-end benchmark (bench/bench_transformer.py): the tiny CPU model
trains 2 steps with jax_flash and with jax's xla attention, the losses agree, and the results
are written."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_transformer.py"


def _load():
  spec = importlib.util.spec_from_file_location("bench_transformer", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_tiny_transformer_trains_two_steps(tmp_path):
  bench = _load()
  start = time.perf_counter()
  data = bench.main(["--tiny", "--platform", "cpu", "--steps", "2", "--impls", "jax_flash,xla",
                     "--iterations", "2", "--warmup", "0", "--no-isolated",
                     "--out", str(tmp_path)])
  elapsed = time.perf_counter() - start
  results = data["results"]
  for name in ("jax_flash", "xla", "stand-in"):
    assert results[name]["status"] == "ok", (name, results[name]["status"])
    assert results[name]["ms"] > 0
  for name in ("jax_flash", "xla"):
    losses = results[name]["losses"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), losses
    assert 0 <= results[name]["attention_share_standin"] < 1
  # float32 on the CPU: the two attentions differ by float32 rounding only.
  for a, b in zip(results["jax_flash"]["losses"], results["xla"]["losses"]):
    assert abs(a - b) <= 1e-4 * abs(b), (a, b)
  assert data["ok"] and data["losses_agree"]
  saved = json.loads((tmp_path / "transformer_cpu.json").read_text())
  assert saved["results"]["jax_flash"]["losses"] == results["jax_flash"]["losses"]
  assert elapsed < 120, f"the smoke run took {elapsed:.0f} s"
