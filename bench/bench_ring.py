"""Context-parallel (ring) attention: one sequence split over P devices.

For each sequence length, causal flag, layout and mode, times the attention of one batch row
(B = 1) on 1 device (the plain jax_flash call) and on P devices (``jax_flash.ring_attention``
inside ``shard_map`` over a mesh axis of P devices; with the zigzag layout the tokens are put in
zigzag order before the timed program) and reports the time, TFLOP/s per device (FlashAttention
convention: forward 4*B*N*T*S*H, halved when causal; forward+backward 3.5x that), the scaling
efficiency t1 / (P * tP) and the compiled program's memory per device (XLA temporaries,
arguments and outputs).

For P > 1 it also times the two halves of the ring apart, to show how far the transfers hide
behind the attention: the same program with the transfers left out (every device computes on
the shard it holds: the same kernels and block kinds), and the transfers alone (the ring's
`ppermute`s of the same arrays, step after step). `hidden` is the share of the transfer time
the ring does not add to its compute time: 1 - (t_ring - t_compute) / t_transfer. With
`--profile-dir`, one call of each such cell is traced (`jax.profiler`) and the GPU kernels'
timeline gives the share of the NCCL kernels' time that runs while an attention kernel runs.

`--simulate` predicts a ring of more devices than the machine has: each device's program runs
in turn on one device, its index fixed and its transfers left out, and the slowest device's
time stands for the ring's, which holds while each step's transfer (`transfer_step_bytes` per
device) takes less time over the link than the step's attention.

Times are wall-clock per call (median over the iterations, after a warm-up call): a multi-device
step ends when its slowest device does, which per-kernel device time would not show.

  python bench/bench_ring.py                          # GPU: T = 16k..256k on 1 and 2 GPUs
  python bench/bench_ring.py --devices 1,2,4 --seqlens 32768,131072 --causal yes
  python bench/bench_ring.py --seqlens 65536 --modes fwd_bwd --profile-dir /tmp/ring_trace
  python bench/bench_ring.py --devices 1,2,4,8 --simulate   # one GPU: each ring device in turn
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python bench/bench_ring.py --platform cpu --devices 1,2,4 --seqlens 1024 --head-dim 64

Writes ring_<platform>.json and ring_<platform>.png under --out (default bench/out).
"""

from __future__ import annotations

import argparse
import contextlib
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
  exchange: str = "ring"


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
                                      layout=c.layout, kv_exchange=c.exchange)

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


def build_transfers(c: Cell, args_in):
  """(jitted function, its arguments): the ring's transfers of cell `c` alone, step after step:
  the key/value shard P - 1 times in the forward; in the backward the shard again P - 1 times
  and its float32 gradient accumulators P times, sent together with it where both travel."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from jax_flash import _ring

  _, k, v = args_in[:3]
  mesh = k.sharding.mesh
  spec = P(None, "sp")
  ring = _ring.Ring("sp", c.devices, None, c.layout)

  def local(k, v):
    kv = (k, v)
    for _ in range(c.devices - 1):
      kv = ring.pass_on(kv)
    if c.mode == "fwd_bwd":
      dkv = (k.astype(jnp.float32), v.astype(jnp.float32))
      for step in range(c.devices):
        moved = ring.pass_on((kv, dkv) if step + 1 < c.devices else dkv)
        kv, dkv = moved if step + 1 < c.devices else (kv, moved)
      return dkv
    return kv

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 2, out_specs=(spec,) * 2))
  return fn, [k, v]


def _local_stand_in(tree):
  """What a device computes on in place of a transfer's result: its own data, rotated by one
  element (a copy of the size of the transfer). The kernels and block kinds depend on the step
  and the device index, not on the data; the rotation keeps XLA from merging the now identical
  kernel calls of different steps into one."""
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda x: jnp.roll(x, 1), tree)


@contextlib.contextmanager
def _ring_patched(**methods):
  """While tracing: the ring's methods named here replaced (restored afterwards)."""
  from jax_flash import _ring

  saved = {name: getattr(_ring.Ring, name) for name in methods}
  for name, f in methods.items():
    setattr(_ring.Ring, name, f)
  try:
    yield
  finally:
    for name, f in saved.items():
      setattr(_ring.Ring, name, f)


def one_device_of_the_ring(device: int, size: int):
  """While tracing: the ring runs on this one device as its device `device` of `size` would,
  transfers left out: its index is fixed, a transfer's result is `_local_stand_in`, gathering
  repeats the local shard `size` times and the scattered sum keeps the first shard's rows."""
  import jax.numpy as jnp

  return _ring_patched(
      index=lambda self: jnp.int32(device),
      pass_on=lambda self, tree: _local_stand_in(tree),
      gather=lambda self, x, axis: None if x is None else jnp.concatenate([x] * size, axis=axis),
      scatter_sum=lambda self, x, axis: jnp.split(x, size, axis=axis)[0])


def simulate(c: Cell, args, platform: str) -> dict:
  """Cell `c` of P devices simulated on one: each device's program of the ring in turn
  (`one_device_of_the_ring`); `ms` is the slowest device's, the time of the P-device ring when
  its transfers hide behind the attention (check `transfer_step_bytes` against the link)."""
  import jax
  import jax.numpy as jnp

  from jax_flash import _primitive, _ring
  from jax_flash._validation import AttentionConfig

  N, K, H = args.heads, args.kv_heads, args.head_dim
  T = c.T // c.devices
  device0 = jax.devices(platform)[0]
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  shapes = ((1, T, N, H), (1, T, K, H), (1, T, K, H), (1, T, N, H))
  inputs = [jax.device_put(jax.random.normal(key, shape, args.dtype), device0)
            for key, shape in zip(keys, shapes)]
  config = AttentionConfig(scale=H ** -0.5, window_left=-1, window_right=0 if c.causal else -1)
  ring = _ring.Ring("sp", c.devices, config, c.layout, c.exchange)

  def attention(q, k, v):
    return _primitive.ring_attention(ring, q, k, v, None, None, None, None)[0]

  if c.mode == "fwd":
    fn, inputs = jax.jit(attention), inputs[:3]
  else:
    def fwd_bwd(q, k, v, dout):
      out, vjp = jax.vjp(attention, q, k, v)
      return (out,) + vjp(dout)
    fn = jax.jit(fwd_bwd)
  device_ms = []
  for device in range(c.devices):
    with one_device_of_the_ring(device, c.devices):
      compiled = fn.lower(*inputs).compile()
    device_ms.append(statistics.median(
        bench_attention.time_wall(compiled, inputs, args.iterations, warmup=1)))
    jax.clear_caches()
  ms = max(device_ms)
  shard_bytes = 2 * T * K * H * jnp.dtype(args.dtype).itemsize  # k and v
  return dict(ms=ms, simulated=True, device_ms=device_ms,
              # a forward step moves k and v; a backward step also their float32 gradients
              transfer_step_bytes=shard_bytes * (1 if c.mode == "fwd" else 1 + 4 // jnp.dtype(
                  args.dtype).itemsize),
              flops_per_s_per_device=flops(c, N, H) / (ms * 1e-3) / c.devices)


def transfers_left_out():
  """While tracing: the ring passes nothing on; each device computes on `_local_stand_in` of
  the shard it holds instead of the next device's."""
  return _ring_patched(pass_on=lambda self, tree: _local_stand_in(tree))


def _intervals_union(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def _overlap_ns(intervals, union) -> float:
  """Total length of `intervals` that lies inside the disjoint sorted intervals `union`."""
  import bisect

  starts = [u[0] for u in union]
  total = 0.0
  for start, end in intervals:
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(union) and union[i][0] < end:
      total += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
      i += 1
  return total


def profile_overlap(compiled, inputs, trace_dir: Path) -> list[dict]:
  """Traces one call and, per GPU, how much of its NCCL kernels' time runs while one of its
  other kernels (the attention and the merges) runs."""
  import glob

  import jax
  from jax.profiler import ProfileData

  jax.block_until_ready(compiled(*inputs))
  trace_dir.mkdir(parents=True, exist_ok=True)
  with jax.profiler.trace(str(trace_dir)):
    jax.block_until_ready(compiled(*inputs))
  path = sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True),
                key=lambda f: Path(f).stat().st_mtime)[-1]
  devices = []
  for plane in ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:GPU:"):
      continue
    comm, compute = [], []
    for line in plane.lines:
      for e in line.events:
        (comm if "nccl" in e.name.lower() else compute).append((e.start_ns, e.end_ns))
    if not comm:
      continue
    busy = _intervals_union(compute)
    comm_ns = sum(end - start for start, end in _intervals_union(comm))
    devices.append(dict(device=plane.name, nccl_ms=comm_ns * 1e-6,
                        compute_ms=sum(e - s for s, e in busy) * 1e-6,
                        nccl_overlapped=_overlap_ns(_intervals_union(comm), busy) / comm_ns,
                        trace=path))
  return devices


def run_cell(c: Cell, args, platform: str) -> dict:
  import jax

  fn, inputs = build(c, args.heads, args.kv_heads, args.head_dim, args.dtype, platform)
  t0 = time.perf_counter()
  compiled = fn.lower(*inputs).compile()
  compile_s = time.perf_counter() - t0
  memory = bench_attention.memory_stats(compiled)
  median_ms = lambda f, x: statistics.median(
      bench_attention.time_wall(f, x, args.iterations, warmup=1))
  times = bench_attention.time_wall(compiled, inputs, args.iterations, warmup=1)
  ms = statistics.median(times)
  record = dict(ms=ms, ms_min=min(times), compile_s=compile_s, memory=memory,
                flops_per_s_per_device=flops(c, args.heads, args.head_dim) / (ms * 1e-3)
                / c.devices)
  if c.devices > 1 and c.exchange == "ring":
    with transfers_left_out():
      compute_only = fn.lower(*inputs).compile()
    transfers, transfer_inputs = build_transfers(c, inputs)
    record["compute_ms"] = median_ms(compute_only, inputs)
    record["transfer_ms"] = median_ms(transfers.lower(*transfer_inputs).compile(),
                                      transfer_inputs)
    # Steps with a transfer: P - 1 in the forward, P more in the backward.
    record["transfer_steps"] = c.devices - 1 + (c.devices if c.mode == "fwd_bwd" else 0)
    record["hidden"] = 1 - (ms - record["compute_ms"]) / record["transfer_ms"]
    if args.profile_dir and platform == "gpu":
      record["profile"] = profile_overlap(
          compiled, inputs, Path(args.profile_dir) / f"{c.mode}_T{c.T}_{c.layout}_P{c.devices}")
  jax.clear_caches()
  return record


def table(results: list[dict], unit: str, scale: float) -> list[str]:
  lines = [f"{'T':>7} {'causal':>6} {'layout':>10} {'exchange':>10} {'mode':>7} {'P':>2} | {'ms':>10} "
           f"{unit + '/dev':>12} {'eff':>6} {'MiB/dev':>9} | {'compute':>9} {'transfer':>9} "
           f"{'hidden':>6} {'nccl||':>6}"]
  lines.append("-" * len(lines[0]))
  for r in results:
    c = r["cell"]
    if r.get("error"):
      lines.append(f"{c['T']:>7} {str(c['causal']):>6} {c['layout']:>10} {c['exchange']:>10} "
                   f"{c['mode']:>7} {c['devices']:>2} | error: {r['error']}")
      continue
    mem = r.get("memory") or {}
    mib = sum(mem.get(f, 0) for f in ("temp_bytes", "argument_bytes", "output_bytes")) / 2**20
    eff = r.get("efficiency")
    ring = " | simulated on one device" if r.get("simulated") else ""
    if "compute_ms" in r:
      overlapped = [d["nccl_overlapped"] for d in r.get("profile") or []]
      ring = (f" | {r['compute_ms']:>9.3f} {r['transfer_ms']:>9.3f} {r['hidden']:>6.2f} "
              f"{f'{min(overlapped):.2f}' if overlapped else '':>6}")
    lines.append(f"{c['T']:>7} {str(c['causal']):>6} {c['layout']:>10} {c['exchange']:>10} "
                 f"{c['mode']:>7} {c['devices']:>2} | {r['ms']:>10.3f} "
                 f"{r['flops_per_s_per_device'] / scale:>12.2f} "
                 f"{'' if eff is None else f'{eff:.2f}':>6} {mib:>9.1f}{ring}")
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
    variant = lambda c: (c["devices"], c["layout"], c.get("exchange", "ring"))
    series = sorted({variant(r["cell"]) for r in data["results"]
                     if r["cell"]["mode"] == mode and r["cell"]["causal"] == causal})
    for devices, layout, exchange in series:
      pts = sorted((r["cell"]["T"], r["flops_per_s_per_device"] / scale)
                   for r in data["results"]
                   if r["cell"]["mode"] == mode and r["cell"]["causal"] == causal
                   and variant(r["cell"]) == (devices, layout, exchange)
                   and not r.get("error"))
      if pts:
        label = "1 device" if devices == 1 else f"{devices} devices, {layout}, {exchange}"
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
  bench_attention.add_run_arguments(p, iterations=5)
  p.add_argument("--devices", default="1,2", help="comma list of device counts (1 = no ring)")
  p.add_argument("--seqlens", default=None,
                 help="comma list of T = S (default: 16384..262144 on the GPU, 1024 on the CPU)")
  p.add_argument("--causal", choices=("yes", "no", "both"), default="yes")
  p.add_argument("--layouts", default="contiguous,zigzag")
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--exchanges", default="ring",
                 help="comma list of kv_exchange values for P > 1 (ring, all_gather)")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--max-seconds", type=float, default=None,
                 help="stop starting cells after this many seconds")
  p.add_argument("--simulate", action="store_true",
                 help="run each multi-device cell on one device, one ring device's program "
                 "after another, transfers left out (a prediction for more devices than are "
                 "here: the slowest device's time, valid while transfers hide)")
  p.add_argument("--profile-dir", default=None,
                 help="GPU: trace one call of each multi-device cell here and report how much "
                 "of the NCCL kernels' time overlaps the other kernels")
  args = p.parse_args(argv)
  args.kv_heads = args.kv_heads or args.heads
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax

  platform = bench_attention.select_platform(args.platform)
  args.dtype = bench_attention.run_dtype(args.dtype, platform)
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
          variants = [("contiguous", "ring")] if devices == 1 else [
              (layout, exchange) for exchange in args.exchanges.split(",")
              for layout in args.layouts.split(",")]
          for layout, exchange in variants:
            c = Cell(T, causal, layout, mode, devices, exchange)
            record = {"cell": dataclasses.asdict(c)}
            if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
              record["error"] = "not run (time limit)"
            elif devices > available and not args.simulate:
              record["error"] = f"needs {devices} devices, have {available}"
            else:
              try:
                record.update(simulate(c, args, platform) if args.simulate and devices > 1
                              else run_cell(c, args, platform))
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
          "ring_parts": "compute_ms: the ring without its transfers; transfer_ms: its transfers "
          "alone (over transfer_steps steps); hidden = 1 - (ms - compute_ms) / transfer_ms; "
          "profile: per GPU, the share of NCCL kernel time overlapping other kernels",
          "simulated": "--simulate: each device's program run in turn on one device, transfers "
          "left out; ms = the slowest device's (device_ms); transfer_step_bytes per device and "
          "step, for comparing with the link",
      },
      "results": results,
  }
  bench_attention.save_results(data, args.out, f"ring_{platform}", table(results, unit, scale),
                               plot)
  return data


if __name__ == "__main__":
  main()
