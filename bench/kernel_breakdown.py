"""Per-kernel device time of one forward+backward (or forward) call, jax_flash and its GPU peers.

bench_attention.py reports one number per call; this script lists the kernels behind it, with
each kernel's CUPTI duration (median over --iterations calls), so that a gap to a peer can be
located: the main backward kernel, or the memory-bound passes around it (row terms, clearing
and converting the fp32 dQ accumulator). It also reports whether each implementation's
gradients are finite, since a peer that returns NaN is timed all the same.

  python bench/kernel_breakdown.py --head-dim 128 --seqlens 512,4096 --causal both \\
      --impls jax_flash,cudnn,fa3 --out bench/out

Shapes and inputs are the Hopper grid's of bench_attention.py (bfloat16, B*T = 16384,
N*H = 2048, K = N, T = S). Writes ``kernel_breakdown.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__:
  from . import bench_attention, configs
else:  # run as a script: this file's directory is on sys.path
  import bench_attention
  import configs


def breakdown(fn, args, iterations: int) -> list[tuple[str, float]]:
  """(kernel name, median ms) in launch order, over `iterations` calls."""
  from jax.experimental.mosaic.gpu import profiler

  _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
  names = [name for name, _ in runs[0]]
  if any([name for name, _ in run] != names for run in runs):
    raise RuntimeError("the kernels of one call differ between calls")
  return [(name, statistics.median(run[i][1] for run in runs)) for i, name in enumerate(names)]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seqlens", default="512,4096")
  parser.add_argument("--causal", choices=("yes", "no", "both"), default="both")
  parser.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
  parser.add_argument("--impls", default="jax_flash,cudnn,fa3")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--out", type=Path, default=bench_attention.DEFAULT_OUT)
  opts = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp

  impls = opts.impls.split(",")
  causal_flags = {"yes": (True,), "no": (False,), "both": (False, True)}[opts.causal]
  shapes = configs.get_grid("gpu").shapes(head_dims=(opts.head_dim,),
                                          seqlens=configs.parse_ints(opts.seqlens),
                                          causal=causal_flags)
  key = jax.random.key(0)
  records = []
  for shape in shapes:
    inputs = bench_attention.CellInputs(shape, opts.mode, key)
    for impl in impls:
      try:
        prepared = bench_attention.BUILDERS[impl](shape, "gpu", opts.mode)
      except bench_attention.Unsupported as e:
        print(f"{impl}: {e}")
        continue
      args = inputs.args(prepared.dtype, prepared.q_scale)
      timed = bench_attention.make_timed(prepared.fn, opts.mode)
      compiled = jax.jit(timed).lower(*args).compile()
      results = compiled(*args)
      finite = {name: bool(jnp.isfinite(x.astype(jnp.float32)).all())
                for name, x in zip(("out", "dq", "dk", "dv"), results)}
      kernels = breakdown(compiled, args, opts.iterations)
      total = sum(ms for _, ms in kernels)
      print(f"\nH={shape.head_dim} T={shape.q_len} causal={shape.causal} {impl}: {total:.4f} ms, "
            f"finite {finite}")
      for name, ms in kernels:
        print(f"  {ms:9.4f} ms  {name[:110]}")
      records.append(dict(shape=shape.__dict__, impl=impl, total_ms=total, finite=finite,
                          kernels=[dict(name=n, ms=ms) for n, ms in kernels]))
  opts.out.mkdir(parents=True, exist_ok=True)
  path = opts.out / "kernel_breakdown.json"
  path.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, records=records),
                             indent=1))
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
