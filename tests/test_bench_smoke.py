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


def test_ab_builds_times_two_builds_and_restores_the_installed_one(tmp_path):
  """bench/ab_builds.py over two copies of the installed extension module: every row of each
  build and round is timed, b/a and the peer ratios come out, and the installed module is
  the same file afterwards (it was replaced by each copy in turn)."""
  import hashlib
  import shutil

  spec = importlib.util.spec_from_file_location("ab_builds", SCRIPT.with_name("ab_builds.py"))
  ab = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ab)
  installed = ab.installed_module()
  before = hashlib.sha256(installed.read_bytes()).hexdigest()
  builds = [tmp_path / name for name in ("a.so", "b.so")]
  for build in builds:
    shutil.copyfile(installed, build)
  data = ab.main(["--a", str(builds[0]), "--b", str(builds[1]), "--rounds", "2", "--peer", "xla",
                  "--out", str(tmp_path / "out"), "bench_attention.py", "--platform", "cpu",
                  "--grid", "smoke", "--impls", "jax_flash,xla", "--iterations", "1",
                  "--warmup", "0", "--no-plot"])
  assert hashlib.sha256(installed.read_bytes()).hexdigest() == before
  assert not list(installed.parent.glob(".ab_*"))
  assert [(r["round"], r["build"]) for r in data["runs"]] == [(1, "a"), (1, "b"), (2, "b"),
                                                              (2, "a")]
  rows = data["rows"]
  assert [r["label"].split()[3] for r in rows] == ["full", "causal"]  # the smoke grid's cells
  for row in rows:
    assert row["impl"] == "jax_flash" and row["peer"] == "xla"
    for key in ("a", "b", "b_over_a", "a_over_peer", "b_over_peer"):
      assert len(row[key]) == 2 and all(v is not None and v > 0 for v in row[key]), (key, row)
  saved = json.loads((tmp_path / "out" / "ab_builds.json").read_text())
  assert saved["rows"] == rows
