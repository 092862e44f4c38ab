"""Context-parallel (ring) attention: one sequence split over P devices.

For each sequence length, causal flag, layout and mode, times the attention of one batch row
(B = 1) on 1 device (the plain jax_flash call) and on P devices (``jax_flash.ring_attention``
inside ``shard_map`` over a mesh axis of P devices; with the zigzag layout the tokens are put in
zigzag order before the timed program) and reports the time, TFLOP/s per device (FlashAttention
convention: forward 4*B*N*T*S*H, halved when causal; forward+backward 3.5x that), the scaling
efficiency t1 / (P * tP) and the compiled program's memory per device (XLA temporaries,
arguments and outputs).

Times are wall-clock per call (median over the iterations, after a warm-up call): a multi-device
step ends when its slowest device does, which per-kernel device time would not show.

  python bench/bench_ring.py                          # GPU: T = 16k..256k on 1 and 2 GPUs
  python bench/bench_ring.py --devices 1,2,4 --seqlens 32768,131072 --causal yes
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python bench/bench_ring.py --platform cpu --devices 1,2,4 --seqlens 1024 --head-dim 64

Writes ring_<platform>.json and ring_<platform>.png under --out (default bench/out).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402  (timing and memory helpers shared with the main benchmark)


@dataclasses.dataclass(frozen=True)
class Cell:
  T: int
  causal: bool
  layout: str
  mode: str
  devices: int


def flops(c: Cell, N: int, H: int) -> float:
  forward = 4.0 * c.T * c.T * N * H * (0.5 if c.causal else 1.0)
  return forward * (3.5 if c.mode == "fwd_bwd" else 1.0)


def build(c: Cell, N: int, K: int, H: int, dtype: str, platform: str):
  """(jitted function, its arguments) for one cell."""
  import jax
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_flash

  devices = jax.devices(platform)[:c.devices]
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (1, c.T, N, H), dtype)
  k = jax.random.normal(keys[1], (1, c.T, K, H), dtype)
  v = jax.random.normal(keys[2], (1, c.T, K, H), dtype)
  dout = jax.random.normal(keys[3], (1, c.T, N, H), dtype)

  if c.devices == 1:
    def attention(q, k, v):
      return jax_flash.dot_product_attention(q, k, v, is_causal=c.causal)
    placed = [jax.device_put(x, devices[0]) for x in (q, k, v, dout)]
  else:
    mesh = jax.make_mesh((c.devices,), ("sp",), axis_types=(AxisType.Auto,), devices=devices)
    spec = P(None, "sp")

    def local(q, k, v):
      return jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=c.causal,
                                      layout=c.layout)

    def attention(q, k, v):
      return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

    order = (lambda x: jax_flash.zigzag_order(x, c.devices)) if c.layout == "zigzag" else \
        (lambda x: x)
    sharding = NamedSharding(mesh, spec)
    placed = [jax.device_put(order(x), sharding) for x in (q, k, v, dout)]

  if c.mode == "fwd":
    fn = jax.jit(attention)
    args = placed[:3]
  else:
    def fwd_bwd(q, k, v, dout):
      out, vjp = jax.vjp(attention, q, k, v)
      return (out,) + vjp(dout)
    fn = jax.jit(fwd_bwd)
    args = placed
  return fn, args


def run_cell(c: Cell, args, platform: str) -> dict:
  import jax

  fn, inputs = build(c, args.heads, args.kv_heads, args.head_dim, args.dtype, platform)
  t0 = time.perf_counter()
  compiled = fn.lower(*inputs).compile()
  compile_s = time.perf_counter() - t0
  memory = bench_attention.memory_stats(compiled)
  times = bench_attention.time_wall(compiled, inputs, args.iterations, warmup=1)
  ms = statistics.median(times)
  jax.clear_caches()
  return dict(ms=ms, ms_min=min(times), compile_s=compile_s, memory=memory,
              flops_per_s_per_device=flops(c, args.heads, args.head_dim) / (ms * 1e-3) / c.devices)


def table(results: list[dict], unit: str, scale: float) -> list[str]:
  lines = [f"{'T':>7} {'causal':>6} {'layout':>10} {'mode':>7} {'P':>2} | {'ms':>10} "
           f"{unit + '/dev':>12} {'eff':>6} {'MiB/dev':>9}"]
  lines.append("-" * len(lines[0]))
  for r in results:
    c = r["cell"]
    if r.get("error"):
      lines.append(f"{c['T']:>7} {str(c['causal']):>6} {c['layout']:>10} {c['mode']:>7} "
                   f"{c['devices']:>2} | error: {r['error']}")
      continue
    mem = r.get("memory") or {}
    mib = sum(mem.get(f, 0) for f in ("temp_bytes", "argument_bytes", "output_bytes")) / 2**20
    eff = r.get("efficiency")
    lines.append(f"{c['T']:>7} {str(c['causal']):>6} {c['layout']:>10} {c['mode']:>7} "
                 f"{c['devices']:>2} | {r['ms']:>10.3f} "
                 f"{r['flops_per_s_per_device'] / scale:>12.2f} "
                 f"{'' if eff is None else f'{eff:.2f}':>6} {mib:>9.1f}")
  return lines


def plot(data: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta = data["metadata"]
  unit, scale = bench_attention.throughput_unit(meta["platform"])
  panels = sorted({(r["cell"]["mode"], r["cell"]["causal"]) for r in data["results"]})
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), squeeze=False, figsize=(5.5 * len(panels), 4))
  for ax, (mode, causal) in zip(axes[0], panels):
    series = sorted({(r["cell"]["devices"], r["cell"]["layout"]) for r in data["results"]
                     if r["cell"]["mode"] == mode and r["cell"]["causal"] == causal})
    for devices, layout in series:
      pts = sorted((r["cell"]["T"], r["flops_per_s_per_device"] / scale)
                   for r in data["results"]
                   if r["cell"]["mode"] == mode and r["cell"]["causal"] == causal
                   and r["cell"]["devices"] == devices and r["cell"]["layout"] == layout
                   and not r.get("error"))
      if pts:
        label = "1 device" if devices == 1 else f"{devices} devices, {layout}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
    ax.set_xlabel("sequence length T = S (B = 1)")
    ax.set_ylabel(f"{unit} per device")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"ring attention | {meta['device_kind']} | H={meta['head_dim']}, "
               f"N={meta['heads']}, K={meta['kv_heads']}, {meta['dtype']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--platform", choices=("cpu", "gpu"), default=None)
  p.add_argument("--devices", default="1,2", help="comma list of device counts (1 = no ring)")
  p.add_argument("--seqlens", default=None,
                 help="comma list of T = S (default: 16384..262144 on the GPU, 1024 on the CPU)")
  p.add_argument("--causal", choices=("yes", "no", "both"), default="yes")
  p.add_argument("--layouts", default="contiguous,zigzag")
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default=None, help="default: bfloat16 on the GPU, float32 on the CPU")
  p.add_argument("--iterations", type=int, default=5)
  p.add_argument("--max-seconds", type=float, default=None,
                 help="stop starting cells after this many seconds")
  p.add_argument("--out", default=str(HERE / "out"))
  args = p.parse_args(argv)
  args.kv_heads = args.kv_heads or args.heads
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax

  platform = bench_attention.select_platform(args.platform)
  args.dtype = args.dtype or ("bfloat16" if platform == "gpu" else "float32")
  seqlens = [int(t) for t in (args.seqlens or ("16384,32768,65536,131072,262144"
                                               if platform == "gpu" else "1024")).split(",")]
  device_counts = [int(d) for d in args.devices.split(",")]
  available = len(jax.devices(platform))
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  unit, scale = bench_attention.throughput_unit(platform)
  start = time.monotonic()
  results = []
  for mode in args.modes.split(","):
    for causal in causals:
      for T in seqlens:
        t1 = None
        for devices in device_counts:
          layouts = ["contiguous"] if devices == 1 else args.layouts.split(",")
          for layout in layouts:
            c = Cell(T, causal, layout, mode, devices)
            record = {"cell": dataclasses.asdict(c)}
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
              record["error"] = "not run (time limit)"
            elif devices > available:
              record["error"] = f"needs {devices} devices, have {available}"
            else:
              try:
                record.update(run_cell(c, args, platform))
              except Exception as e:  # one failing cell (memory, say) must not end the run
                record["error"] = bench_attention.short_reason(e)
            if not record.get("error"):
              if devices == 1:
                t1 = record["ms"]
              record["efficiency"] = None if t1 is None else t1 / (devices * record["ms"])
            results.append(record)
            print("\n".join(table([record], unit, scale)[2:]), flush=True)
  data = {
      "metadata": {
          **bench_attention.run_metadata(platform), "devices_available": available,
          "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
          "dtype": args.dtype, "batch": 1, "iterations": args.iterations,
          "timing": "wall clock per call, median", "flops": "forward 4*B*N*T*S*H (halved when "
          "causal); fwd_bwd 3.5x forward; per device = total / P",
      },
      "results": results,
  }
  bench_attention.save_results(data, args.out, f"ring_{platform}", table(results, unit, scale),
                               plot)
  return data


if __name__ == "__main__":
  main()
