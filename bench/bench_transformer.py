"""End-to-end benchmark: training steps of a small decoder-only transformer (Flax) with the
attention implementation as the only difference.

Model: token embedding, L pre-norm blocks (RMSNorm -> causal grouped-query self-attention with
rotary position embeddings -> residual; RMSNorm -> SwiGLU MLP -> residual), final RMSNorm,
untied output projection; next-token cross-entropy (computed in float32) on random tokens.
Parameters and activations in --dtype (bfloat16 by default; float32 for --tiny); AdamW (optax)
with its first moment in float32. One step = forward + backward + optimizer update, one jitted function.

Attention implementations (--impls):
  jax_flash   jax_flash.flax.make_attention_fn(is_causal=True): the kernels' causal path
  cudnn       jax.nn.dot_product_attention(..., is_causal=True, implementation='cudnn') (GPU)
  xla         jax.nn.dot_product_attention(..., is_causal=True, implementation='xla')
All start from the same initial parameters and see the same batches.

What is reported, per implementation:
  * the losses of the first --check-steps steps (each implementation trains from the same
    initial state on the same batches); they must agree with the first implementation's within
    --loss-rtol (default 2%: the implementations round attention differently in bfloat16, and
    the differences grow a little with each update), else the run exits with status 1;
  * step time: on the GPU the device time of one step, summed over its kernels by CUPTI
    (jax.experimental.mosaic.gpu.profiler.measure), median of --iterations steps after its
    warm-up; on the CPU the wall-clock time of one step (block_until_ready), median of
    --iterations after --warmup steps;
  * tokens/s (batch * seq_len / step time) and model TFLOP/s (6 * parameters * tokens for the
    dense layers plus the causal attention's 3.5 * 2*B*N*T^2*H per layer, i.e. FLOPs a
    FlashAttention-style implementation does, divided by step time);
  * the attention share of the step, two ways:
      - "share (stand-in)": 1 - t(step with attention replaced by a stand-in of negligible
        cost) / t(step). The stand-in, out = q + broadcast(mean_S(k) + mean_S(v)), keeps the
        key/value projections alive (their matmuls and gradients stay in the step) and costs
        O(B*T*N*H); this measures what the step would save if attention were free, including
        what XLA fuses around it;
      - "share (isolated)": layers * t(attention forward+backward alone, at the model's
        shapes) / t(step), timed like the step. Ignores fusion and overlap with the rest.

Output: a table on stdout, and under --out (default bench/out) transformer_<platform>.json
(every number and the run's metadata) and transformer_<platform>.png (a bar chart of step time
split into attention / rest, when matplotlib is available).

Usage (run the script by path so that an installed jax_flash is imported):

  # Hopper default: 12 layers, d_model 2048, 16 heads of 128, 4 KV heads, T=4096, batch 4
  python bench/bench_transformer.py
  python bench/bench_transformer.py --batch 8 --remat      # more tokens per step
  # CPU smoke size (seconds; float32)
  python bench/bench_transformer.py --tiny --steps 2 --no-isolated
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform as _pyplatform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

IMPLS = ("jax_flash", "cudnn", "xla")
STANDIN = "stand-in"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  layers: int = 12
  d_model: int = 2048
  heads: int = 16
  kv_heads: int = 4
  head_dim: int = 128
  d_ff: int = 5632  # SwiGLU hidden size, ~8/3 * d_model rounded to a multiple of 256
  vocab: int = 32000
  seq_len: int = 4096
  batch: int = 4
  dtype: str = "bfloat16"
  rope_base: float = 10000.0

  def __post_init__(self):
    if self.heads % self.kv_heads:
      raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

  @property
  def tokens(self) -> int:
    return self.batch * self.seq_len

  def parameter_count(self) -> int:
    attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    mlp = 3 * self.d_model * self.d_ff
    norms = 2 * self.d_model
    return (self.layers * (attn + mlp + norms) + 2 * self.vocab * self.d_model + self.d_model)

  def step_flops(self) -> float:
    """Dense matmuls 6 * params * tokens (embedding lookup excluded), plus causal attention:
    forward 2 matmuls of 2*T*T*H per head, halved for causality, 3.5x for forward+backward."""
    dense = 6.0 * (self.parameter_count() - self.vocab * self.d_model) * self.tokens
    attn_fwd = 4.0 * self.batch * self.heads * self.seq_len ** 2 * self.head_dim / 2
    return dense + 3.5 * attn_fwd * self.layers


GPU_DEFAULT = ModelConfig()
# The CPU smoke size runs in float32: CPUs emulate bfloat16 matmuls, slowly and slow to compile.
TINY = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, d_ff=128, vocab=256,
                   seq_len=64, batch=2, dtype="float32")


# --------------------------------------------------------------------------------------------
# Attention implementations: f(q (B, T, N, H), k, v (B, T, K, H)) -> (B, T, N, H), causal.


def attention_impl(name: str) -> Callable:
  import jax
  import jax.numpy as jnp

  if name == "jax_flash":
    import jax_flash.flax

    fn = jax_flash.flax.make_attention_fn(is_causal=True)
    return lambda q, k, v: fn(q, k, v, deterministic=True)
  if name in ("cudnn", "xla"):
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=name)
  if name == STANDIN:
    def standin(q, k, v):
      group = q.shape[2] // k.shape[2]
      kv = jnp.mean(k, axis=1, keepdims=True) + jnp.mean(v, axis=1, keepdims=True)
      return q + jnp.repeat(kv, group, axis=2).astype(q.dtype)
    return standin
  raise ValueError(f"unknown attention implementation {name!r}")


# --------------------------------------------------------------------------------------------
# The model.


def build_model(cfg: ModelConfig, attention: Callable, remat: bool = False):
  import jax.numpy as jnp
  from flax import linen as nn

  dtype = jnp.dtype(cfg.dtype)
  init = nn.initializers.normal(stddev=0.02)

  def rope(x, positions):
    """Rotary embedding of x (B, T, heads, H) at integer positions (T,), rotating halves."""
    half = cfg.head_dim // 2
    freq = cfg.rope_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # (T, half)
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = functools.partial(nn.DenseGeneral, axis=-1, use_bias=False, dtype=dtype,
                                param_dtype=dtype, kernel_init=init)
      q = dense((cfg.heads, cfg.head_dim), name="query")(x)
      k = dense((cfg.kv_heads, cfg.head_dim), name="key")(x)
      v = dense((cfg.kv_heads, cfg.head_dim), name="value")(x)
      positions = jnp.arange(x.shape[1])
      q, k = rope(q, positions), rope(k, positions)
      out = attention(q, k, v)
      return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=dtype,
                             param_dtype=dtype, kernel_init=init, name="out")(out)

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = functools.partial(nn.Dense, use_bias=False, dtype=dtype, param_dtype=dtype,
                                kernel_init=init)
      gate = dense(cfg.d_ff, name="gate")(x)
      up = dense(cfg.d_ff, name="up")(x)
      return dense(cfg.d_model, name="down")(nn.silu(gate) * up)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      norm = functools.partial(nn.RMSNorm, dtype=dtype, param_dtype=dtype)
      x = x + Attention(name="attention")(norm(name="attention_norm")(x))
      return x + Mlp(name="mlp")(norm(name="mlp_norm")(x))

  block = nn.remat(Block) if remat else Block

  class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(cfg.vocab, cfg.d_model, dtype=dtype, param_dtype=dtype,
                   embedding_init=init, name="embed")(tokens)
      for i in range(cfg.layers):
        x = block(name=f"block_{i}")(x)
      x = nn.RMSNorm(dtype=dtype, param_dtype=dtype, name="final_norm")(x)
      return nn.Dense(cfg.vocab, use_bias=False, dtype=dtype, param_dtype=dtype,
                      kernel_init=init, name="unembed")(x)

  return Decoder()


def make_train_step(cfg: ModelConfig, attention: Callable, optimizer, remat: bool):
  import jax
  import jax.numpy as jnp
  import optax

  model = build_model(cfg, attention, remat)

  def loss_fn(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return model, jax.jit(step)


def make_optimizer(learning_rate: float):
  import jax.numpy as jnp
  import optax

  return optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1, mu_dtype=jnp.float32)


# --------------------------------------------------------------------------------------------
# Timing.


def short_reason(exc: BaseException, limit: int = 200) -> str:
  text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
  return text if len(text) <= limit else text[:limit - 3] + "..."


def time_wall(fn, args, iterations: int, warmup: int) -> list[float]:
  import jax

  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return times


def time_device(fn, args, iterations: int, warmup: int) -> tuple[list[float], str]:
  """GPU: CUPTI kernel time (ms) of each of `iterations` calls, one call per measurement (each
  after measure's own warm-up call), so that only one call's outputs (a whole updated model and
  optimizer state) are alive at a time. Wall clock where CUPTI is unavailable."""
  try:
    from jax.experimental.mosaic.gpu import profiler

    times = []
    for _ in range(iterations):
      _, t = profiler.measure(fn, iterations=1)(*args)
      if t is None:
        raise RuntimeError("CUPTI recorded no kernels")
      times.append(float(t))
    return times, "cupti"
  except Exception as e:  # noqa: BLE001 - fall back, and say so in the results
    if "RESOURCE_EXHAUSTED" in str(e):
      raise
    return time_wall(fn, args, iterations, warmup), f"wall ({short_reason(e, 120)})"


def measure(platform: str, fn, args, iterations: int, warmup: int) -> dict:
  if platform == "gpu":
    times, method = time_device(fn, args, iterations, warmup)
  else:
    times, method = time_wall(fn, args, iterations, warmup), "wall"
  return dict(ms=statistics.median(times), ms_all=times, method=method)


# --------------------------------------------------------------------------------------------
# One run.


@dataclasses.dataclass
class Options:
  platform: str
  impls: tuple[str, ...]
  check_steps: int
  iterations: int
  warmup: int
  loss_rtol: float
  learning_rate: float
  remat: bool
  seed: int
  isolated: bool
  standin: bool


def _batches(cfg: ModelConfig, count: int, seed: int):
  import jax

  keys = jax.random.split(jax.random.key(seed + 1), count)
  return [jax.random.randint(k, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab) for k in keys]


def _attention_alone(cfg: ModelConfig, name: str, opts: Options, key) -> dict:
  """Forward + backward of one layer's attention at the model's shapes, times layers."""
  import jax
  import jax.numpy as jnp

  attn = attention_impl(name)
  dt = jnp.dtype(cfg.dtype)
  kq, kk, kv, kd = jax.random.split(key, 4)
  q = jax.random.normal(kq, (cfg.batch, cfg.seq_len, cfg.heads, cfg.head_dim), dt)
  k = jax.random.normal(kk, (cfg.batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim), dt)
  v = jax.random.normal(kv, (cfg.batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim), dt)
  do = jax.random.normal(kd, q.shape, dt)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)

  timing = measure(opts.platform, fwd_bwd, (q, k, v, do), opts.iterations, opts.warmup)
  timing["ms_per_step"] = timing["ms"] * cfg.layers
  return timing


def run(cfg: ModelConfig, opts: Options) -> dict:
  import jax

  optimizer = make_optimizer(opts.learning_rate)
  batches = _batches(cfg, max(opts.check_steps, 1), opts.seed)
  init_model = build_model(cfg, attention_impl(STANDIN))
  params = jax.jit(init_model.init)(jax.random.key(opts.seed), batches[0][:, :-1])
  opt_state = jax.jit(optimizer.init)(params)
  jax.block_until_ready((params, opt_state))

  results: dict[str, dict] = {}
  names = list(opts.impls) + ([STANDIN] if opts.standin else [])
  for name in names:
    r: dict[str, Any] = {}
    results[name] = r
    try:
      _, step = make_train_step(cfg, attention_impl(name), optimizer, opts.remat)
      compiled = step.lower(params, opt_state, batches[0]).compile()
      try:
        mem = compiled.memory_analysis()
        r["temp_mib"] = mem.temp_size_in_bytes / 2**20
      except Exception:  # noqa: BLE001 - not every backend reports it
        pass
      if name != STANDIN:
        losses = []
        p, s = params, opt_state
        for tokens in batches[:opts.check_steps]:
          p, s, loss = compiled(p, s, tokens)
          losses.append(float(loss))
        r["losses"] = losses
        del p, s
      r.update(measure(opts.platform, compiled, (params, opt_state, batches[0]),
                       opts.iterations, opts.warmup))
      r["tokens_per_s"] = cfg.tokens / (r["ms"] / 1e3)
      if name != STANDIN:
        r["model_tflops_per_s"] = cfg.step_flops() / (r["ms"] / 1e3) / 1e12
      if opts.isolated and name != STANDIN:
        r["attention_alone"] = _attention_alone(cfg, name, opts, jax.random.key(opts.seed + 7))
      r["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - an implementation's failure is a result
      r["status"] = f"error: {short_reason(e)}"
    log(f"  {name}: {r.get('status')}"
        + (f", {r['ms']:.3f} ms/step" if "ms" in r else "")
        + (f", losses {', '.join(f'{x:.5f}' for x in r['losses'])}" if "losses" in r else ""))

  standin_ms = results.get(STANDIN, {}).get("ms")
  for name in opts.impls:
    r = results[name]
    if r.get("status") != "ok":
      continue
    if standin_ms is not None:
      r["attention_share_standin"] = max(0.0, 1.0 - standin_ms / r["ms"])
    if "attention_alone" in r:
      r["attention_share_isolated"] = r["attention_alone"]["ms_per_step"] / r["ms"]
  return results


def check_losses(results: dict, impls, rtol: float) -> tuple[bool, list[str]]:
  """Every implementation's losses against the first one's that has them (losses are kept
  when only the timing failed)."""
  ok, lines = True, []
  ran = [n for n in impls if results[n].get("losses")]
  if not ran:
    return False, ["no implementation ran"]
  ref = ran[0]
  for name in ran[1:]:
    for step, (a, b) in enumerate(zip(results[name]["losses"], results[ref]["losses"])):
      rel = abs(a - b) / max(abs(b), 1e-12)
      good = rel <= rtol
      ok &= good
      lines.append(f"step {step}: {name} {a:.5f} vs {ref} {b:.5f}: relative difference "
                   f"{rel:.2e} {'<=' if good else '>'} {rtol:g}")
  return ok, lines


def table(cfg: ModelConfig, results: dict, impls) -> list[str]:
  head = (f"{'attention':<11} {'ms/step':>10} {'tokens/s':>12} {'TFLOP/s':>9} "
          f"{'share(stand-in)':>16} {'share(isolated)':>16} {'losses':>0}")
  lines = [head, "-" * len(head)]
  for name in list(impls) + [STANDIN]:
    r = results.get(name)
    if r is None:
      continue
    if r.get("status") != "ok":
      losses = " ".join(f"{x:.4f}" for x in r.get("losses", []))
      lines.append(f"{name:<11} {r.get('status')}" + (f" (losses {losses})" if losses else ""))
      continue

    def pct(key):
      return f"{100 * r[key]:.1f}%" if key in r else "-"

    losses = " ".join(f"{x:.4f}" for x in r.get("losses", []))
    tflops = f"{r['model_tflops_per_s']:.2f}" if "model_tflops_per_s" in r else "-"
    lines.append(f"{name:<11} {r['ms']:>10.3f} {r['tokens_per_s']:>12.0f} "
                 f"{tflops:>9} {pct('attention_share_standin'):>16} "
                 f"{pct('attention_share_isolated'):>16} {losses}")
  return lines


def plot(data: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  results = data["results"]
  names = [n for n in data["metadata"]["impls"] if results[n].get("status") == "ok"]
  if not names:
    return
  total = [results[n]["ms"] for n in names]
  attn = [results[n]["ms"] * results[n].get("attention_share_standin", 0.0) for n in names]
  rest = [t - a for t, a in zip(total, attn)]
  fig, ax = plt.subplots(figsize=(1.8 * len(names) + 3, 4))
  ax.bar(names, rest, color="C7", label="rest of the step")
  ax.bar(names, attn, bottom=rest, color="C0", label="attention (stand-in method)")
  for i, t in enumerate(total):
    ax.text(i, t, f"{t:.1f} ms\n{results[names[i]]['tokens_per_s']:.0f} tok/s",
            ha="center", va="bottom", fontsize=8)
  ax.set_ylabel("step time (ms)")
  ax.set_ylim(0, max(total) * 1.25)
  ax.legend(fontsize=8)
  cfg = data["config"]
  ax.set_title(f"{data['metadata']['device_kind']} | L={cfg['layers']} d={cfg['d_model']} "
               f"N={cfg['heads']}/{cfg['kv_heads']}x{cfg['head_dim']} T={cfg['seq_len']} "
               f"B={cfg['batch']} {cfg['dtype']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def metadata(opts: Options, argv) -> dict:
  import jax
  import jaxlib

  device = jax.devices(opts.platform)[0]
  meta = {
      "platform": opts.platform,
      "device_kind": device.device_kind,
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "python": sys.version.split()[0],
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": shlex.join([Path(sys.executable).name, sys.argv[0]] + list(argv)),
      "impls": list(opts.impls),
      "check_steps": opts.check_steps,
      "iterations": opts.iterations,
      "warmup": opts.warmup,
      "loss_rtol": opts.loss_rtol,
      "remat": opts.remat,
      "timing": ("GPU: CUPTI kernel time of one step, median" if opts.platform == "gpu"
                 else "CPU: wall clock of one step (block_until_ready), median"),
      "cpu_count": os.cpu_count(),
      "machine": _pyplatform.machine(),
  }
  try:
    meta["load_average_at_start"] = list(os.getloadavg())
  except OSError:
    pass
  try:
    import jax_flash

    meta["jax_flash_version"] = jax_flash.__version__
    meta["jax_flash_build"] = jax_flash.build_info()
  except Exception as e:  # noqa: BLE001
    meta["jax_flash_version"] = f"error: {short_reason(e)}"
  return meta


def log(*args) -> None:
  print(*args, flush=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--platform", choices=("cpu", "gpu"), default=None,
                 help="default: gpu when jax sees one, else cpu")
  p.add_argument("--tiny", action="store_true", help="the CPU smoke size (2 layers, d=64, T=64)")
  for field in dataclasses.fields(ModelConfig):
    if field.name == "rope_base":
      continue
    p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=None,
                   help=f"default {field.default} ({getattr(TINY, field.name)} with --tiny)")
  p.add_argument("--impls", default=None,
                 help=f"comma-separated from {','.join(IMPLS)}; default all the platform has")
  p.add_argument("--steps", "--check-steps", dest="check_steps", type=int, default=3,
                 help="training steps whose losses are compared (default 3)")
  p.add_argument("--iterations", type=int, default=None, help="timed steps (default 10; 3 tiny)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (wall clock)")
  p.add_argument("--loss-rtol", type=float, default=0.02)
  p.add_argument("--learning-rate", type=float, default=3e-4)
  p.add_argument("--remat", action="store_true", help="rematerialise each block in the backward")
  p.add_argument("--no-standin", dest="standin", action="store_false",
                 help="skip the stand-in step (no attention share by that method)")
  p.add_argument("--no-isolated", dest="isolated", action="store_false",
                 help="skip timing attention alone")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax

  platform = args.platform
  if platform is None:
    try:
      platform = "gpu" if jax.devices("gpu") else "cpu"
    except RuntimeError:
      platform = "cpu"
  base = TINY if args.tiny else GPU_DEFAULT
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
               if f.name != "rope_base" and getattr(args, f.name) is not None}
  cfg = dataclasses.replace(base, **overrides)
  available = IMPLS if platform == "gpu" else tuple(i for i in IMPLS if i != "cudnn")
  impls = tuple(args.impls.split(",")) if args.impls else available
  for name in impls:
    if name not in IMPLS:
      raise SystemExit(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
  iterations = args.iterations if args.iterations is not None else (3 if args.tiny else 10)
  opts = Options(platform=platform, impls=impls, check_steps=args.check_steps,
                 iterations=iterations, warmup=args.warmup, loss_rtol=args.loss_rtol,
                 learning_rate=args.learning_rate, remat=args.remat, seed=args.seed,
                 isolated=args.isolated, standin=args.standin)

  log(f"decoder: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads of "
      f"{cfg.head_dim} ({cfg.kv_heads} KV heads), d_ff {cfg.d_ff}, vocab {cfg.vocab}, "
      f"T={cfg.seq_len}, batch {cfg.batch}, {cfg.dtype}, "
      f"{cfg.parameter_count() / 1e6:.1f}M parameters, {platform}")
  with jax.default_device(jax.devices(platform)[0]):
    results = run(cfg, opts)

  ok, loss_lines = check_losses(results, impls, opts.loss_rtol)
  data = {"metadata": metadata(opts, argv if argv is not None else sys.argv[1:]),
          "config": dataclasses.asdict(cfg), "parameters": cfg.parameter_count(),
          "step_flops": cfg.step_flops(), "results": results,
          "losses_agree": ok, "loss_checks": loss_lines}
  log("")
  for line in table(cfg, results, impls):
    log(line)
  log("")
  log("attention share: stand-in = 1 - t(step, attention ~ free) / t(step); "
      "isolated = layers * t(attention fwd+bwd alone) / t(step)")
  for line in loss_lines:
    log(line)
  log(f"losses agree within rtol {opts.loss_rtol:g}: {ok}")

  args.out.mkdir(parents=True, exist_ok=True)
  json_path = args.out / f"transformer_{platform}.json"
  json_path.write_text(json.dumps(data, indent=1))
  log(f"wrote {json_path}")
  try:
    png_path = json_path.with_suffix(".png")
    plot(data, png_path)
    log(f"wrote {png_path}")
  except ImportError:
    pass
  data["ok"] = ok
  return data


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
