"""Attention benchmark: jax_flash side by side with jax's and other FlashAttention kernels.

For every cell of a grid (``bench/configs.py``) the requested implementations are compiled, run
once and compared with jax_flash's result (max abs difference of the output, and of dq/dk/dv with
``--mode fwd_bwd``), then timed, all in one process:

  jax_flash    jax_flash.dot_product_attention(q, k, v, is_causal=...)
  jax_flash_det  the same with deterministic=True (ordered dQ reduction in the Hopper backward;
               not a peer: excluded from ours/best; opt-in with --impls)
  jax_flash_softcap  the same with logits_soft_cap=--softcap (default 50, Gemma 2's): the cost
               of soft-capping next to jax_flash in one run. A different function, so not
               compared with jax_flash's result and not a peer; no peer soft-caps. Opt-in.
  xla          jax.nn.dot_product_attention(..., implementation='xla'); skipped when one head's
               T x S float32 logits exceed --xla-max-logits-mib
  cudnn        jax.nn.dot_product_attention(..., implementation='cudnn')             (GPU only)
  pallas_mgpu  jax.experimental.pallas.ops.gpu.attention_mgpu, float16, block_q 64, block_kv
               128 (64 at head dim 256); its backward exists only without causal masking (GPU only)
  fa3          flash_attn3_jax.flash_mha (FlashAttention-3; the wheel has head dim 128 only)
                                                                                       (GPU only)

A case an implementation does not support, or any error, becomes an "error: <reason>" cell.

Timing: on the GPU, the kernels' device time of one call measured with CUPTI
(jax.experimental.mosaic.gpu.profiler.measure), median over --iterations calls after a warm-up;
on the CPU, the median wall-clock time of --iterations calls of the compiled function (after
--warmup calls), the implementations' calls interleaved so that a change in the machine's load
affects them alike. Both report XLA's memory analysis of each compiled executable (its temporary
buffers include the workspace of jax_flash's GPU backward, a result of the FFI call; its size is
also recorded in the JSON as backward_workspace_bytes). Throughput counts FlashAttention FLOPs:
4*B*N*T*S*H for the forward, halved when causal; fwd_bwd counts 3.5x the forward.

Results: a table on stdout (printed cell by cell), and under --out (default bench/out) a JSON file
with every number and the run's metadata, rewritten after each cell, and a PNG plot (TFLOP/s
against sequence length, one panel per head dim and causal flag). File names are
``<platform>_<mode>_<grid>.json/.png``.

Usage (run the script by path, from any directory, so that an installed jax_flash is imported
rather than the source tree's package):

  # CPU acceptance comparison: float32, B=1, N=16, T=S=2048, H=64
  python bench/bench_attention.py --platform cpu --grid cpu_target --mode fwd
  python bench/bench_attention.py --platform cpu --grid cpu_target --mode fwd_bwd

  # More CPU sizes (T=S in 512..4096, B*N=16), and the long case (T=32768) for memory
  python bench/bench_attention.py --platform cpu --grid cpu --mode fwd
  python bench/bench_attention.py --platform cpu --grid cpu_long --mode fwd

  # Full Hopper grid (bfloat16, H in 64/128/256, T=S in 512..16384, B*T=16384, N*H=2048),
  # one command per mode; --max-seconds stops starting cells before an external time limit
  python bench/bench_attention.py --platform gpu --grid gpu --mode fwd --max-seconds 480
  python bench/bench_attention.py --platform gpu --grid gpu --mode fwd_bwd --max-seconds 480
  # ... and if a run stopped early, the same command with --resume runs only the missing cells
  python bench/bench_attention.py --platform gpu --grid gpu --mode fwd_bwd --max-seconds 480 --resume

  # A subset, and a plot redrawn from a saved JSON
  python bench/bench_attention.py --platform gpu --grid gpu --head-dims 128 --seqlens 4096,8192 \
      --causal yes --impls jax_flash,cudnn,fa3
  python bench/bench_attention.py --plot-only bench/out/gpu_fwd_gpu.json

  # Soft-capped against uncapped jax_flash
  python bench/bench_attention.py --platform gpu --grid gpu --mode fwd_bwd \
      --impls jax_flash,jax_flash_softcap --softcap 50

  # Smoke run (seconds, CPU)
  python bench/bench_attention.py --platform cpu --grid smoke

``--list-grids`` prints the grids and their shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform as _pyplatform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__:
  from . import configs
else:  # run as a script: this file's directory is on sys.path
  import configs

IMPLS = ("jax_flash", "jax_flash_det", "cudnn", "xla", "pallas_mgpu", "fa3", "jax_flash_softcap")
OURS = ("jax_flash", "jax_flash_det", "jax_flash_softcap")  # never counted as peers
NAME_WIDTH = max(len(n) for n in IMPLS)  # of the implementations' names in the log
DEFAULT_IMPLS = {"cpu": ("jax_flash", "xla"),
                 "gpu": ("jax_flash", "cudnn", "xla", "pallas_mgpu", "fa3")}
GPU_ONLY = ("cudnn", "pallas_mgpu", "fa3")
REFERENCE = "jax_flash"
DEFAULT_ITERATIONS = {"cpu": 5, "gpu": 20}
DEFAULT_SOFTCAP = 50.0  # jax_flash_softcap's cap: Gemma 2's attention logit cap
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
# Max abs difference from jax_flash beyond which a result is flagged as suspect (or a NaN/Inf).
DIFF_TOLERANCE = {"float64": 1e-8, "float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
STATUS_OK = "ok"
STATUS_MEMORY = "skipped (memory)"
STATUS_BUDGET = "not run (time budget)"


def log(*args) -> None:
  print(*args, flush=True)


def short_reason(exc: BaseException, limit: int = 160) -> str:
  """First meaningful line of an exception, prefixed by its type."""
  text = str(exc).strip()
  line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
  reason = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
  return reason if len(reason) <= limit else reason[:limit - 3] + "..."


def finite_or_str(x: float | None):
  """JSON has no NaN/Inf: keep them as strings."""
  if x is None:
    return None
  x = float(x)
  return x if math.isfinite(x) else str(x)


class Unsupported(Exception):
  """The implementation does not support this case (raised before compiling anything)."""


# --------------------------------------------------------------------------------------------
# Implementations. Each builder returns how to call one implementation on one shape.


@dataclasses.dataclass
class Prepared:
  fn: Callable  # (q, k, v) -> out, all (B, T|S, N|K, H)
  dtype: str  # dtype of the inputs the implementation runs on
  q_scale: float = 1.0  # the implementation receives q * q_scale (its dq is scaled back to compare)
  config: dict | None = None  # implementation settings worth recording
  softcap: float | None = None  # soft-capped logits: another function than the reference's


def _require_gpu(platform: str) -> None:
  if platform != "gpu":
    raise Unsupported("GPU only")


def build_jax_flash(shape: configs.Shape, platform: str, mode: str,
                    deterministic: bool = False, softcap: float | None = None) -> Prepared:
  import jax_flash
  from jax_flash import _extension

  causal = shape.causal
  config = None
  if platform == "gpu" and mode == "fwd_bwd":
    config = dict(deterministic=deterministic,
                  backward_workspace_bytes=_extension.backward_workspace_bytes(
                      shape.batch, shape.q_len, shape.heads, shape.head_dim, shape.dtype,
                      deterministic))
  if softcap is not None:
    config = dict(config or {}, logits_soft_cap=softcap)
  return Prepared(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=causal, deterministic=deterministic, logits_soft_cap=softcap),
      shape.dtype, config=config, softcap=softcap)


def build_jax_flash_det(shape: configs.Shape, platform: str, mode: str) -> Prepared:
  return build_jax_flash(shape, platform, mode, deterministic=True)


def build_jax_flash_softcap(shape: configs.Shape, platform: str, mode: str,
                            softcap: float = DEFAULT_SOFTCAP) -> Prepared:
  return build_jax_flash(shape, platform, mode, softcap=softcap)


def _jax_nn(implementation: str, shape: configs.Shape) -> Callable:
  import jax

  causal = shape.causal
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=implementation)


def build_xla(shape: configs.Shape, platform: str, mode: str) -> Prepared:
  return Prepared(_jax_nn("xla", shape), shape.dtype)


def build_cudnn(shape: configs.Shape, platform: str, mode: str) -> Prepared:
  _require_gpu(platform)
  return Prepared(_jax_nn("cudnn", shape), shape.dtype)


def build_pallas_mgpu(shape: configs.Shape, platform: str, mode: str) -> Prepared:
  """JAX's Pallas Mosaic-GPU FlashAttention-3 style kernel (attention_mgpu).

  Its kernels stage Q/K/V through float16 shared memory, so it runs on float16 inputs. It
  applies no softmax scale (softmax(q k^T)), so it receives q pre-multiplied by 1/sqrt(H),
  outside the timed function. Its forward needs H % 64 == 0, T % (2 * block_q) == 0 and
  S % block_kv == 0; its backward needs explicit backward blocks and no causal mask.
  """
  _require_gpu(platform)
  h = shape.head_dim
  block_kv = 64 if h >= 256 else 128
  if h % 64:
    raise Unsupported(f"head dim {h} is not a multiple of 64")
  if shape.q_len % 128 or shape.kv_len % block_kv:
    raise Unsupported(f"T must be a multiple of 128 and S of {block_kv}")
  settings = dict(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=shape.causal)
  if mode == "fwd_bwd":
    if shape.causal:
      raise Unsupported("no causal backward in attention_mgpu")
    # Backward blocks and warpgroup count as in jax's own attention_mgpu tests.
    settings.update(compute_wgs_bwd=2 if h <= 128 else 1, block_q_dq=64, block_kv_dq=64,
                    block_q_dkv=64, block_kv_dkv=64)
  from jax.experimental.pallas.ops.gpu import attention_mgpu

  config = attention_mgpu.TuningConfig(**settings)
  return Prepared(lambda q, k, v: attention_mgpu.attention(q, k, v, config), "float16",
                  q_scale=1.0 / math.sqrt(h), config=settings)


def build_fa3(shape: configs.Shape, platform: str, mode: str) -> Prepared:
  _require_gpu(platform)
  if shape.head_dim != 128:
    raise Unsupported("flash_attn3_jax wheel has head dim 128 only")
  if shape.dtype not in ("bfloat16", "float16"):
    raise Unsupported(f"{shape.dtype} (bfloat16/float16 only)")
  from flash_attn3_jax import flash_mha

  causal = shape.causal
  return Prepared(lambda q, k, v: flash_mha(q, k, v, is_causal=causal), shape.dtype)


BUILDERS: dict[str, Callable[[configs.Shape, str, str], Prepared]] = {
    "jax_flash": build_jax_flash,
    "jax_flash_det": build_jax_flash_det,
    "jax_flash_softcap": build_jax_flash_softcap,
    "xla": build_xla,
    "cudnn": build_cudnn,
    "pallas_mgpu": build_pallas_mgpu,
    "fa3": build_fa3,
}


# --------------------------------------------------------------------------------------------
# Measurement.


def make_timed(attn: Callable, mode: str) -> Callable:
  """The function that is compiled and timed: the forward, or forward + backward through a vjp
  whose gradients are outputs (so the backward cannot be pruned)."""
  if mode == "fwd":
    return lambda q, k, v: attn(q, k, v)

  import jax

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    dq, dk, dv = vjp(do)
    return out, dq, dk, dv

  return fwd_bwd


@functools.lru_cache(maxsize=None)
def _max_abs_diff_fn():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def max_abs_diff(a, b, scale):
    return jnp.max(jnp.abs(a.astype(jnp.float32) * scale - b.astype(jnp.float32)))

  return max_abs_diff


def compare(outputs, reference, q_scale: float, mode: str) -> dict:
  """Max abs differences of an implementation's outputs against the reference's."""
  names = ("out",) if mode == "fwd" else ("out", "dq", "dk", "dv")
  if mode == "fwd":
    outputs, reference = (outputs,), (reference,)
  diff = _max_abs_diff_fn()
  result = {}
  for name, a, b in zip(names, outputs, reference):
    # dL/dq = q_scale * dL/d(q * q_scale): bring a pre-scaled query's gradient back.
    scale = q_scale if name == "dq" else 1.0
    result[name] = float(diff(a, b, scale))
  return result


def memory_stats(compiled) -> dict | None:
  try:
    m = compiled.memory_analysis()
  except Exception:  # not every backend implements it
    return None
  if m is None:
    return None
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
  return {f.replace("_size_in_bytes", "_bytes"): int(getattr(m, f)) for f in fields
          if hasattr(m, f)}


def peak_rss_mib() -> float | None:
  """The process's resident-set high-water mark so far (monotone over the whole run)."""
  try:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
  except Exception:
    return None


def time_wall(compiled, args, iterations: int, warmup: int) -> list[float]:
  import jax

  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return times


def time_cupti(compiled, args, iterations: int) -> list[float]:
  """Device time (ms) of each of `iterations` calls: the sum of the kernels' CUPTI durations.
  `measure` runs one warm-up call of its own first."""
  from jax.experimental.mosaic.gpu import profiler

  _, timings = profiler.measure(compiled, iterations=iterations)(*args)
  if timings is None:
    raise RuntimeError("CUPTI recorded no kernels")
  return [float(t) for t in (timings if isinstance(timings, (list, tuple)) else [timings])]


def time_gpu(compiled, args, iterations: int, warmup: int) -> tuple[list[float], str]:
  try:
    return time_cupti(compiled, args, iterations), "cupti"
  except Exception as e:  # no CUPTI in this jaxlib, or inconsistent kernel lists
    first = short_reason(e)
  try:
    # One call per measurement: tolerates kernel lists that vary between calls.
    return [time_cupti(compiled, args, 1)[0] for _ in range(iterations)], "cupti (per call)"
  except Exception:
    pass
  return time_wall(compiled, args, iterations, warmup), f"wall ({first})"


# --------------------------------------------------------------------------------------------
# One cell.


@dataclasses.dataclass
class Options:
  platform: str
  mode: str
  impls: tuple[str, ...]
  iterations: int
  warmup: int
  xla_max_logits_mib: float
  seed: int
  softcap: float = DEFAULT_SOFTCAP  # the cap of jax_flash_softcap


def build(name: str, shape: configs.Shape, opts: Options) -> Prepared:
  """BUILDERS[name] for this run's options (the cap of jax_flash_softcap)."""
  if name == "jax_flash_softcap":
    return build_jax_flash_softcap(shape, opts.platform, opts.mode, softcap=opts.softcap)
  return BUILDERS[name](shape, opts.platform, opts.mode)


class CellInputs:
  """Random normal inputs for one cell, generated on the device, in each dtype asked for.

  Other dtypes are casts of the base dtype's arrays, so every implementation sees the same
  values; a pre-scaled query is computed once here, outside any timed function."""

  def __init__(self, shape: configs.Shape, mode: str, key):
    import jax

    self.shape, self.mode = shape, mode
    kq, kk, kv, kd = jax.random.split(key, 4)
    dtype = shape.dtype
    self._base = {
        "q": _normal(kq, shape.q_shape, dtype),
        "k": _normal(kk, shape.kv_shape, dtype),
        "v": _normal(kv, shape.kv_shape, dtype),
    }
    if mode == "fwd_bwd":
      self._base["do"] = _normal(kd, shape.q_shape, dtype)
    self._cache: dict[tuple[str, float], tuple] = {}

  def args(self, dtype: str, q_scale: float = 1.0) -> tuple:
    key = (dtype, q_scale)
    if key not in self._cache:
      arrays = {n: _cast(x, dtype) for n, x in self._base.items()}
      if q_scale != 1.0:
        arrays["q"] = _scale(arrays["q"], q_scale)
      names = ("q", "k", "v") + (("do",) if self.mode == "fwd_bwd" else ())
      self._cache[key] = tuple(arrays[n] for n in names)
    return self._cache[key]


@functools.lru_cache(maxsize=None)
def _normal_fn(shape: tuple, dtype: str):
  import jax

  return jax.jit(lambda key: jax.random.normal(key, shape, dtype))


def _normal(key, shape, dtype):
  return _normal_fn(tuple(shape), dtype)(key)


def _cast(x, dtype: str):
  return x if x.dtype.name == dtype else _cast_fn(dtype)(x)


@functools.lru_cache(maxsize=None)
def _cast_fn(dtype: str):
  import jax

  return jax.jit(lambda x: x.astype(dtype))


@functools.lru_cache(maxsize=None)
def _scale_fn():
  import jax
  import jax.numpy as jnp

  return jax.jit(lambda x, s: (x.astype(jnp.float32) * s).astype(x.dtype))


def _scale(x, s: float):
  return _scale_fn()(x, s)


def throughput_unit(platform: str) -> tuple[str, float]:
  return ("TFLOP/s", 1e12) if platform == "gpu" else ("GFLOP/s", 1e9)


def run_cell(shape: configs.Shape, opts: Options, key) -> dict:
  """Compile, check and time every implementation on one shape. Never raises for an
  implementation's failure: it becomes that implementation's status."""
  import jax

  flops = shape.flops(opts.mode)
  inputs = CellInputs(shape, opts.mode, key)
  results: dict[str, dict] = {}
  references: dict[str, Any] = {}  # dtype -> jax_flash outputs on that dtype's inputs
  reference_errors: dict[str, str] = {}

  def reference(dtype: str):
    if dtype in references:
      return references[dtype]
    if dtype in reference_errors:
      return None
    try:
      prep = build_jax_flash(shape.replace(dtype=dtype), opts.platform, opts.mode)
      out = jax.jit(make_timed(prep.fn, opts.mode))(*inputs.args(dtype))
      references[dtype] = jax.block_until_ready(out)
    except Exception as e:
      reference_errors[dtype] = short_reason(e)
      return None
    return references[dtype]

  # Phase 1, one implementation after the other: compile, run once, compare. The reference goes
  # first so that its outputs are at hand for every comparison.
  order = sorted(opts.impls, key=lambda name: name != REFERENCE)
  ready: dict[str, tuple] = {}  # name -> (compiled, args, warm-up calls)
  for name in order:
    t_start = time.perf_counter()
    result: dict[str, Any] = {}
    results[name] = result
    try:
      if name == "xla" and shape.logits_bytes_per_head() > opts.xla_max_logits_mib * 2**20:
        result.update(status=STATUS_MEMORY,
                      logits_mib_per_head=shape.logits_bytes_per_head() / 2**20)
        if opts.platform == "cpu":
          # Compiling costs no memory: record what the run would have needed.
          prep = build(name, shape, opts)
          specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs.args(prep.dtype)]
          compiled = jax.jit(make_timed(prep.fn, opts.mode)).lower(*specs).compile()
          result["memory"] = memory_stats(compiled)
        continue

      prep = build(name, shape, opts)
      result["dtype"] = prep.dtype
      if prep.config:
        result["config"] = prep.config
      args = inputs.args(prep.dtype, prep.q_scale)
      t0 = time.perf_counter()
      compiled = jax.jit(make_timed(prep.fn, opts.mode)).lower(*args).compile()
      result["compile_s"] = time.perf_counter() - t0
      result["memory"] = memory_stats(compiled)

      t0 = time.perf_counter()
      outputs = jax.block_until_ready(compiled(*args))
      result["first_call_s"] = time.perf_counter() - t0
      if opts.platform == "cpu":
        result["process_peak_rss_mib"] = peak_rss_mib()

      if name == REFERENCE:
        references.setdefault(prep.dtype, outputs)
        result["max_abs_diff"] = None
        result["diff_note"] = "reference"
      elif prep.softcap is not None:
        result["max_abs_diff"] = None
        result["diff_note"] = f"soft-capped at {prep.softcap:g}: not compared with {REFERENCE}"
      elif (ref := reference(prep.dtype)) is not None:
        diffs = compare(outputs, ref, prep.q_scale, opts.mode)
        result["max_abs_diff"] = {k: finite_or_str(v) for k, v in diffs.items()}
        tol = DIFF_TOLERANCE.get(prep.dtype, 0.1)
        if any(not math.isfinite(v) or v > tol for v in diffs.values()):
          result["suspect"] = f"differs from {REFERENCE} by more than {tol:g} (or not finite)"
      else:
        result["max_abs_diff"] = None
        result["diff_note"] = f"no reference: {reference_errors.get(prep.dtype, 'n/a')}"
      del outputs
      # A slow first call has already done whatever a warm-up would.
      ready[name] = (compiled, args, opts.warmup if result["first_call_s"] < 2.0 else 0)
    except Exception as e:
      _record_error(result, e)
      if name == REFERENCE:
        reference_errors.setdefault(result.get("dtype", shape.dtype), result["status"])
    finally:
      result["wall_s"] = time.perf_counter() - t_start
  references.clear()

  # Phase 2: timing.
  times: dict[str, list[float]] = {name: [] for name in ready}
  timers: dict[str, str] = {}
  if opts.platform == "gpu":
    # Device time does not depend on what the host does: one implementation after the other.
    for name, (compiled, args, warmup) in ready.items():
      try:
        times[name], timers[name] = time_gpu(compiled, args, opts.iterations, warmup)
      except Exception as e:
        _record_error(results[name], e)
  else:
    # Wall-clock time does: interleave the implementations' calls so that a change in the
    # machine's load affects them alike.
    for name, (compiled, args, warmup) in ready.items():
      try:
        time_wall(compiled, args, 0, warmup)
        timers[name] = "wall (interleaved)" if len(ready) > 1 else "wall"
      except Exception as e:
        _record_error(results[name], e)
    for _ in range(opts.iterations):
      for name, (compiled, args, _) in ready.items():
        if name not in timers:
          continue
        try:
          times[name] += time_wall(compiled, args, 1, 0)
        except Exception as e:
          _record_error(results[name], e)
          del timers[name]
  for name in ready:
    result = results[name]
    if name in timers and times[name]:
      ms = statistics.median(times[name])
      result.update(status=STATUS_OK, timer=timers[name], iterations=len(times[name]), ms=ms,
                    ms_min=min(times[name]), ms_all=times[name], flops_per_s=flops / (ms * 1e-3))
  ready.clear()
  for name in order:
    _log_result(name, results[name], opts.platform)

  ratio, best_peer = ratio_vs_best_peer(results)
  return {"shape": shape.to_dict(), "mode": opts.mode, "flops": flops, "results": results,
          "ratio_vs_best_peer": ratio, "best_peer": best_peer}


def _record_error(result: dict, exc: BaseException) -> None:
  result["status"] = f"error: {short_reason(exc)}"
  detail = str(exc).strip()
  if detail:
    result["error_detail"] = detail[:2000]


def _log_result(name: str, r: dict, platform: str) -> None:
  unit, scale = throughput_unit(platform)
  if r.get("status") == STATUS_OK:
    diff = r.get("max_abs_diff")
    diff_text = ("diff " + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in diff.items())) if diff else \
        r.get("diff_note", "")
    mem = r.get("memory") or {}
    mem_text = (f"  mem temp/args/out {mem['temp_bytes'] / 2**20:.1f}/"
                f"{mem['argument_bytes'] / 2**20:.1f}/{mem['output_bytes'] / 2**20:.1f} MiB"
                if {"temp_bytes", "argument_bytes", "output_bytes"} <= mem.keys() else "")
    log(f"    {name:<{NAME_WIDTH}} {r['ms']:10.3f} ms  {r['flops_per_s'] / scale:9.2f} {unit}  "
        f"[{r['dtype']}, {r['timer']}, compile {r['compile_s']:.1f} s]{mem_text}  {diff_text}"
        + ("  SUSPECT" if r.get("suspect") else ""))
  else:
    extra = ""
    if r.get("status") == STATUS_MEMORY:
      extra = f" ({r['logits_mib_per_head']:.0f} MiB of logits per head"
      mem = r.get("memory") or {}
      if "temp_bytes" in mem:
        extra += f"; compiled temp {mem['temp_bytes'] / 2**30:.1f} GiB"
      extra += ")"
    log(f"    {name:<{NAME_WIDTH}} {r.get('status')}{extra}")


def ratio_vs_best_peer(results: dict) -> tuple[float | None, str | None]:
  ours = results.get(REFERENCE, {})
  if ours.get("status") != STATUS_OK:
    return None, None
  peers = {n: r["flops_per_s"] for n, r in results.items()
           if n not in OURS and r.get("status") == STATUS_OK}
  if not peers:
    return None, None
  best = max(peers, key=peers.get)
  return ours["flops_per_s"] / peers[best], best


# --------------------------------------------------------------------------------------------
# Reporting.


def cell_key(shape: dict) -> tuple:
  return tuple(sorted(shape.items()))


def format_value(r: dict | None, scale: float) -> str:
  if r is None:
    return "-"
  status = r.get("status", "")
  if status == STATUS_OK:
    return f"{r['flops_per_s'] / scale:.2f}" + ("!" if r.get("suspect") else "")
  if status == STATUS_MEMORY:
    return "skip(mem)"
  if status == STATUS_BUDGET:
    return "not run"
  return "error"


def table_lines(data: dict) -> list[str]:
  meta = data["metadata"]
  impls = meta["impls"]
  unit, scale = throughput_unit(meta["platform"])
  width = {n: max(12, len(n)) for n in impls}  # of each implementation's column
  head = f"{'H':>4} {'T':>6} {'causal':>6} {'B':>4} {'N':>4} | " + " ".join(
      f"{n:>{width[n]}}" for n in impls) + f" | {'ours/best':>9} {'best peer':>12}"
  lines = [f"{unit}, mode {meta['mode']}, {meta['device_kind']}", head, "-" * len(head)]
  for cell in data["cells"]:
    s = cell["shape"]
    ratio = cell.get("ratio_vs_best_peer")
    lines.append(
        f"{s['head_dim']:>4} {s['q_len']:>6} {('yes' if s['causal'] else 'no'):>6} "
        f"{s['batch']:>4} {s['heads']:>4} | "
        + " ".join(f"{format_value(cell['results'].get(n), scale):>{width[n]}}" for n in impls)
        + f" | {(f'{ratio:.2f}' if ratio is not None else '-'):>9} {cell.get('best_peer') or '-':>12}")
  mem_rows = []
  for cell in data["cells"]:
    temps = [((cell["results"].get(n) or {}).get("memory") or {}).get("temp_bytes") for n in impls]
    if any(t is not None for t in temps):
      s = cell["shape"]
      mem_rows.append(f"{s['head_dim']:>4} {s['q_len']:>6} {('yes' if s['causal'] else 'no'):>6} "
                      f"{s['batch']:>4} {s['heads']:>4} | " + " ".join(
                          f"{(f'{t / 2**20:.1f}' if t is not None else '-'):>{width[n]}}"
                          for n, t in zip(impls, temps)))
  if mem_rows:
    lines += ["", "XLA temp buffers of the compiled function, MiB (memory_analysis; includes "
              "jax_flash's GPU backward workspace)",
              head.split(" | ")[0] + " | " +
              " ".join(f"{n:>{width[n]}}" for n in impls)] + mem_rows
  errors: dict[tuple[str, str], int] = {}
  for cell in data["cells"]:
    for n, r in cell["results"].items():
      status = r.get("status", "")
      if status.startswith("error"):
        errors[(n, status)] = errors.get((n, status), 0) + 1
  suspects = sorted({n for cell in data["cells"] for n, r in cell["results"].items()
                     if r.get("suspect")})
  if suspects:
    lines.append(f"! = output or gradients differ from {REFERENCE}'s beyond tolerance or are not "
                 f"finite (see max_abs_diff in the JSON): {', '.join(suspects)}")
  if errors:
    lines.append("errors:")
    lines += [f"  {n}: {status} (x{count})" for (n, status), count in errors.items()]
  return lines


def write_json(data: dict, path: Path) -> None:
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
  os.replace(tmp, path)


def run_metadata(platform: str) -> dict:
  """What the smaller benchmarks (ring, packed) record about their run."""
  import jax

  return {"platform": platform, "device_kind": jax.devices(platform)[0].device_kind,
          "jax_version": jax.__version__,
          "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}


def save_results(data: dict, out: str, stem: str, table: list[str], plot_fn) -> None:
  """The smaller benchmarks' ending: <stem>.json under `out`, the table on stdout and
  <stem>.png drawn by plot_fn(data, path) when matplotlib is installed."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  json_path = out / f"{stem}.json"
  write_json(data, json_path)
  print("\n".join(table))
  print(f"wrote {json_path}")
  try:
    plot_fn(data, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.png'}")
  except ImportError:
    print("matplotlib not installed: no plot")


def measure_call(fn, inputs, platform: str, iterations: int, flops: float,
                 reference=None) -> tuple[dict, tuple]:
  """The smaller benchmarks' cell: compiles the jitted fn, runs it once (its results, a tuple,
  compared with `reference` when given: max_diff) and times it (CUPTI on the GPU, wall clock
  on the CPU; median and minimum ms, throughput of `flops`). Returns (record, results)."""
  import jax
  import jax.numpy as jnp

  compiled = fn.lower(*inputs).compile()
  results = compiled(*inputs)
  results = results if isinstance(results, tuple) else (results,)
  record = {}
  if reference is not None:
    record["max_diff"] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                             for a, b in zip(results, reference))
  if platform == "gpu":
    times, method = time_gpu(compiled, inputs, iterations, warmup=1)
  else:
    times, method = time_wall(compiled, inputs, iterations, warmup=1), "wall"
  ms = statistics.median(times)
  record.update(ms=ms, ms_min=min(times), timing=method, flops_per_s=flops / (ms * 1e-3))
  jax.clear_caches()
  return record, results


def plot_by_mode(data: dict, path: Path, groups: list, series: list, key, title: str,
                 panel_width: float, label_size: int = 10) -> None:
  """The smaller benchmarks' plot: one panel per mode of data["results"], in each a bar per
  series for every group, as high as the throughput of the row (without error) whose
  key(row) is (series, group); `title` heads the figure."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  unit, scale = throughput_unit(data["metadata"]["platform"])
  rows = [r for r in data["results"] if not r.get("error")]
  modes = sorted({r["mode"] for r in data["results"]})
  fig, axes = plt.subplots(1, len(modes), squeeze=False, figsize=(panel_width * len(modes), 4))
  width = 0.8 / max(len(series), 1)
  for ax, mode in zip(axes[0], modes):
    for j, name in enumerate(series):
      values = [next((r["flops_per_s"] / scale for r in rows
                      if r["mode"] == mode and key(r) == (name, group)), 0.0) for group in groups]
      ax.bar([i + j * width for i in range(len(groups))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([str(g) for g in groups], fontsize=label_size)
    ax.set_title(mode)
    ax.set_ylabel(f"{unit} (visible work)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot(data: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta = data["metadata"]
  unit, scale = throughput_unit(meta["platform"])
  cells = data["cells"]
  head_dims = sorted({c["shape"]["head_dim"] for c in cells})
  causals = sorted({c["shape"]["causal"] for c in cells})
  if not cells:
    return
  fig, axes = plt.subplots(len(head_dims), len(causals), squeeze=False,
                           figsize=(5.5 * len(causals), 3.8 * len(head_dims)))
  markers = dict(zip(IMPLS, "oxsD^v*"))
  colors = {name: f"C{i}" for i, name in enumerate(IMPLS)}
  for i, h in enumerate(head_dims):
    for j, c in enumerate(causals):
      ax = axes[i][j]
      for name in meta["impls"]:
        pts = sorted((cell["shape"]["q_len"], cell["results"][name]["flops_per_s"] / scale)
                     for cell in cells
                     if cell["shape"]["head_dim"] == h and cell["shape"]["causal"] == c
                     and cell["results"].get(name, {}).get("status") == STATUS_OK)
        if pts:
          label = name + (" (fp16)" if name == "pallas_mgpu" else "")
          ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(name, "o"),
                  color=colors.get(name), label=label)
      ax.set_xscale("log", base=2)
      seqlens = sorted({cell["shape"]["q_len"] for cell in cells})
      ax.set_xticks(seqlens, [str(t) for t in seqlens])
      ax.minorticks_off()
      ax.set_title(f"H={h}, {'causal' if c else 'non-causal'}")
      ax.set_xlabel("sequence length T = S")
      ax.set_ylabel(unit)
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
  device = meta["device_kind"] if meta["platform"] == "gpu" else \
      f"{meta.get('cpu_model') or 'CPU'} ({meta.get('cpu_affinity') or meta.get('cpu_count')} cores)"
  fig.suptitle(f"{device} | {meta['mode']} | grid {meta['grid']} | "
               f"{meta['dtype']} | jax {meta['jax_version']}", fontsize=10)
  fig.tight_layout()
  tmp = path.with_suffix(".tmp.png")
  fig.savefig(tmp, dpi=110)
  plt.close(fig)
  os.replace(tmp, path)


def cpu_model() -> str | None:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return _pyplatform.processor() or None


def metadata(args, grid: configs.Grid, opts: Options) -> dict:
  import jax
  import jaxlib

  device = jax.devices(opts.platform)[0]
  meta = {
      "platform": opts.platform,
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "python": sys.version.split()[0],
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": shlex.join([Path(sys.executable).name] + sys.argv),
      "grid": grid.name,
      "grid_description": grid.description,
      "dtype": args.dtype or grid.dtype,
      "mode": opts.mode,
      "impls": list(opts.impls),
      "iterations": opts.iterations,
      "warmup": opts.warmup,
      "xla_max_logits_mib_per_head": opts.xla_max_logits_mib,
      "seed": opts.seed,
      "softcap": opts.softcap if "jax_flash_softcap" in opts.impls else None,
      "flops": "forward 4*B*N*T*S*H (halved when causal); fwd_bwd 3.5x forward",
      "timing": ("GPU: CUPTI kernel time per call, median" if opts.platform == "gpu"
                 else "CPU: wall clock per call (block_until_ready), median"),
      "cpu_model": cpu_model(),
      "cpu_count": os.cpu_count(),
  }
  try:
    meta["cpu_affinity"] = len(os.sched_getaffinity(0))
  except AttributeError:
    pass
  try:  # other work on the machine skews wall-clock CPU timings
    meta["load_average_at_start"] = list(os.getloadavg())
  except OSError:
    pass
  try:
    meta["platform_version"] = device.client.platform_version
  except Exception:
    pass
  try:
    import jax_flash

    meta["jax_flash_version"] = jax_flash.__version__
    meta["jax_flash_build"] = jax_flash.build_info()
  except Exception as e:
    meta["jax_flash_version"] = f"error: {short_reason(e)}"
  return meta


# --------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description="Benchmark jax_flash against jax's xla/cudnn attention, Pallas Mosaic-GPU "
                  "attention and FlashAttention-3. See the module docstring for examples.")
  p.add_argument("--platform", choices=("cpu", "gpu"), default=None,
                 help="where to run (default: gpu when jax sees one, else cpu)")
  p.add_argument("--grid", default=None,
                 help=f"named grid from bench/configs.py: {', '.join(configs.GRIDS)} "
                      "(default: 'gpu' on the GPU, 'cpu' on the CPU)")
  p.add_argument("--impls", default=None,
                 help=f"comma list from {','.join(IMPLS)} (default: cpu "
                      f"{','.join(DEFAULT_IMPLS['cpu'])}; gpu all)")
  p.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd",
                 help="forward only, or forward + backward (default: fwd)")
  p.add_argument("--head-dims", default=None, help="comma list overriding the grid's head dims")
  p.add_argument("--seqlens", default=None, help="comma list overriding the grid's T = S")
  p.add_argument("--causal", choices=("both", "yes", "no"), default=None,
                 help="causal flags (default: the grid's)")
  p.add_argument("--dtype", default=None, help="input dtype (default: the grid's; pallas_mgpu "
                                               "always runs in float16)")
  p.add_argument("--iterations", type=int, default=None,
                 help="timed calls per implementation and cell (default: the grid's, else "
                      f"{DEFAULT_ITERATIONS['gpu']} on the GPU, {DEFAULT_ITERATIONS['cpu']} on "
                      "the CPU)")
  p.add_argument("--warmup", type=int, default=1,
                 help="untimed calls before timing, after the compile and the checking call "
                      "(default: 1; none after a first call slower than 2 s)")
  p.add_argument("--out", default=None,
                 help="output directory (default: bench/out next to this script; with "
                      "--plot-only, the JSON file's directory)")
  p.add_argument("--max-seconds", type=float, default=None,
                 help="start no new cell after this many seconds")
  p.add_argument("--xla-max-logits-mib", type=float, default=512.0,
                 help="skip 'xla' when one head's T x S float32 logits exceed this many MiB "
                      "(default: 512, which skips T = S >= 16384)")
  p.add_argument("--seed", type=int, default=0, help="input random seed (default: 0)")
  p.add_argument("--softcap", type=float, default=DEFAULT_SOFTCAP, metavar="CAP",
                 help="logits_soft_cap of jax_flash_softcap (default: 50, Gemma 2's); add "
                      "jax_flash_softcap to --impls to time it next to jax_flash")
  p.add_argument("--resume", action="store_true",
                 help="keep the cells already in this run's JSON file and run only the others")
  p.add_argument("--no-plot", action="store_true", help="write no PNG")
  p.add_argument("--plot-only", metavar="JSON", default=None,
                 help="redraw the plot and reprint the table of a saved JSON file, then exit")
  p.add_argument("--list-grids", action="store_true", help="print the grids and exit")
  return p.parse_args(argv)


def list_grids() -> None:
  for g in configs.GRIDS.values():
    log(f"{g.name} ({g.platform}): {g.description}")
    for s in g.shapes():
      log(f"    {s.label()}")


def select_platform(requested: str | None) -> str:
  import jax

  if requested == "cpu":
    # Before any backend starts: keep jax (and jax_flash's platform check) on the CPU.
    jax.config.update("jax_platforms", "cpu")
    if jax.default_backend() != "cpu":  # backends were already up (an embedding process)
      jax.config.update("jax_default_device", jax.devices("cpu")[0])
    return "cpu"
  backend = jax.default_backend()
  if requested == "gpu" and backend != "gpu":
    raise SystemExit(f"--platform gpu: jax's default backend is {backend!r}, no GPU")
  return "gpu" if backend == "gpu" else "cpu"


def add_run_arguments(p: argparse.ArgumentParser, iterations: int) -> None:
  """The options the smaller benchmarks share: the platform, the input dtype (run_dtype), the
  timed iterations and the output directory."""
  p.add_argument("--platform", choices=("cpu", "gpu"), default=None)
  p.add_argument("--dtype", default=None, help="default: bfloat16 on the GPU, float32 on the CPU")
  p.add_argument("--iterations", type=int, default=iterations)
  p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))


def run_dtype(requested: str | None, platform: str) -> str:
  """The smaller benchmarks' input dtype: --dtype, else bfloat16 on the GPU, float32 on the
  CPU."""
  return requested or ("bfloat16" if platform == "gpu" else "float32")


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.list_grids:
    list_grids()
    return None
  if args.plot_only:
    path = Path(args.plot_only)
    data = json.loads(path.read_text())
    for line in table_lines(data):
      log(line)
    png = (Path(args.out) if args.out else path.parent) / (path.stem + ".png")
    if not args.no_plot:
      png.parent.mkdir(parents=True, exist_ok=True)
      plot(data, png)
      log(f"plot: {png}")
    return data

  platform = select_platform(args.platform)
  import jax

  grid = configs.get_grid(args.grid or ("gpu" if platform == "gpu" else "cpu"))
  impls = tuple(x.strip() for x in args.impls.split(",") if x.strip()) if args.impls \
      else DEFAULT_IMPLS[platform]
  unknown = [x for x in impls if x not in IMPLS]
  if unknown:
    raise SystemExit(f"unknown implementation(s) {unknown}; known: {', '.join(IMPLS)}")
  causal = {None: None, "both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  shapes = grid.shapes(head_dims=configs.parse_ints(args.head_dims),
                       seqlens=configs.parse_ints(args.seqlens), causal=causal, dtype=args.dtype)
  opts = Options(platform=platform, mode=args.mode, impls=impls,
                 iterations=args.iterations or grid.iterations or DEFAULT_ITERATIONS[platform],
                 warmup=args.warmup, xla_max_logits_mib=args.xla_max_logits_mib, seed=args.seed,
                 softcap=args.softcap)

  out_dir = Path(args.out) if args.out else DEFAULT_OUT
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = f"{platform}_{args.mode}_{grid.name}"
  json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"

  data = {"metadata": metadata(args, grid, opts), "cells": [], "complete": False}
  done: dict[tuple, dict] = {}
  if args.resume and json_path.exists():
    old = json.loads(json_path.read_text())
    for cell in old.get("cells", []):
      rs = cell.get("results", {})
      if all(n in rs and rs[n].get("status") != STATUS_BUDGET for n in impls):
        done[cell_key(cell["shape"])] = cell
    data["metadata"]["resumed_from"] = old.get("metadata", {}).get("date_utc")

  meta = data["metadata"]
  log(f"device {meta['device_kind']} ({platform}), jax {meta['jax_version']}, "
      f"jax_flash {meta['jax_flash_version']}")
  log(f"grid {grid.name}: {len(shapes)} cells, mode {opts.mode}, impls {','.join(impls)}, "
      f"{opts.iterations} iterations -> {json_path}")
  unit, scale = throughput_unit(platform)

  start = time.monotonic()
  key = jax.random.key(opts.seed)
  for index, shape in enumerate(shapes):
    k = cell_key(shape.to_dict())
    if k in done:
      cell = done[k]
      log(f"[{index + 1}/{len(shapes)}] {shape.label()}: kept from the earlier run")
    elif args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
      cell = {"shape": shape.to_dict(), "mode": opts.mode, "flops": shape.flops(opts.mode),
              "results": {n: {"status": STATUS_BUDGET} for n in impls},
              "ratio_vs_best_peer": None, "best_peer": None}
      log(f"[{index + 1}/{len(shapes)}] {shape.label()}: {STATUS_BUDGET}")
    else:
      log(f"[{index + 1}/{len(shapes)}] {shape.label()}  "
          f"({shape.flops(opts.mode) / 1e9:.1f} GFLOP)")
      cell = run_cell(shape, opts, jax.random.fold_in(key, index))
      ratio = cell["ratio_vs_best_peer"]
      if ratio is not None:
        log(f"    jax_flash / best peer ({cell['best_peer']}): {ratio:.2f}")
    data["cells"].append(cell)
    write_json(data, json_path)
    if not args.no_plot and cell is not done.get(k) and \
        any(r.get("status") == STATUS_OK for r in cell["results"].values()):
      try:
        plot(data, png_path)
      except Exception as e:  # a plot is not worth losing the run over
        log(f"    plot failed: {short_reason(e)}")

  data["complete"] = True
  data["metadata"]["elapsed_s"] = time.monotonic() - start
  write_json(data, json_path)
  if not args.no_plot:
    try:
      plot(data, png_path)
    except Exception as e:
      log(f"plot failed: {short_reason(e)}")
  log("")
  for line in table_lines(data):
    log(line)
  log(f"json: {json_path}")
  if not args.no_plot:
    log(f"plot: {png_path}")
  return data


if __name__ == "__main__":
  main()
