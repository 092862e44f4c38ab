"""Packed sequences: D documents of L tokens packed in one row (segment ids) against the same
documents as a batch of D, causal within each document.

For each head dim and mode, times in one process:

  batched        jax_flash.dot_product_attention, B = D, T = S = L, is_causal
  packed         the same documents in one row, B = 1, T = S = D * L, is_causal with
                 query_segment_ids = key_value_segment_ids = the document index (sorted)
  cudnn_batched  jax.nn.dot_product_attention(implementation='cudnn') on the batch   (GPU only)
  cudnn_packed   jax.nn's cuDNN path on the packed row with the document mask as a dense
                 (1, 1, T, S) boolean array, is_causal: what a jax.nn user packs with  (GPU only)

Throughput counts the visible work only, the same for every implementation: the batch's
FlashAttention FLOPs, 4 * D * N * L * L * H halved for causal, 3.5x for fwd_bwd. The table's
`packed/batched` column is jax_flash's packed throughput over its batched one. Each packed
output (and gradient) is checked against the batched one, reshaped: `max diff` is the largest
absolute difference over jax_flash's packed row and the batch.

Timing as in bench_attention.py: CUPTI device time per call on the GPU, median over
--iterations; wall-clock on the CPU.

  python bench/bench_packed.py                                    # GPU: H 64/128/256
  python bench/bench_packed.py --platform cpu --docs 4 --doc-len 512 --heads 8 --head-dims 64

Writes packed_<platform>.json and packed_<platform>.png under --out (default bench/out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402  (timing helpers shared with the main benchmark)

IMPLS = ("batched", "packed", "cudnn_batched", "cudnn_packed")
GPU_ONLY = ("cudnn_batched", "cudnn_packed")


def visible_flops(D: int, L: int, N: int, H: int, mode: str) -> float:
  return 4.0 * D * N * L * L * H * 0.5 * (3.5 if mode == "fwd_bwd" else 1.0)


def build(impl: str, D: int, L: int, N: int, H: int, dtype: str, mode: str):
  """(jitted function, arguments); the function returns the output (and with fwd_bwd the
  gradients of q, k, v) in the batch's layout (D, L, N, H) so that every implementation can be
  compared with the batched one."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_flash

  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, dout = (jax.random.normal(key, (D, L, N, H), dtype) for key in keys)
  packed = impl in ("packed", "cudnn_packed")
  ids = jnp.asarray(np.repeat(np.arange(D, dtype=np.int32), L)[None])

  def to_row(x):
    return x.reshape(1, D * L, N, H)

  def to_batch(x):
    return x.reshape(D, L, N, H)

  if impl == "batched":
    def attention(q, k, v):
      return jax_flash.dot_product_attention(q, k, v, is_causal=True)
  elif impl == "packed":
    def attention(q, k, v):
      return jax_flash.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                             key_value_segment_ids=ids)
  elif impl == "cudnn_batched":
    def attention(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  elif impl == "cudnn_packed":
    def attention(q, k, v):
      mask = (ids[0][:, None] == ids[0][None, :])[None, None]
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                          implementation="cudnn")
  else:
    raise ValueError(f"unknown implementation {impl!r}")

  def in_layout(q, k, v):
    if packed:
      return to_batch(attention(to_row(q), to_row(k), to_row(v)))
    return attention(q, k, v)

  if mode == "fwd":
    return jax.jit(in_layout), (q, k, v)

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(in_layout, q, k, v)
    return (out, *vjp(dout))

  return jax.jit(fwd_bwd), (q, k, v, dout)


def run_cell(impl: str, H: int, mode: str, args, platform: str, reference) -> tuple[dict, tuple]:
  fn, inputs = build(impl, args.docs, args.doc_len, args.heads, H, args.dtype, mode)
  return bench_attention.measure_call(
      fn, inputs, platform, args.iterations,
      visible_flops(args.docs, args.doc_len, args.heads, H, mode), reference)


def table(rows: list[dict], unit: str, scale: float) -> list[str]:
  lines = [f"{'H':>4} {'mode':>7} {'impl':>14} | {'ms':>9} {unit:>8} {'packed/batched':>14} "
           f"{'max diff':>9}"]
  lines.append("-" * len(lines[0]))
  for r in rows:
    head = f"{r['H']:>4} {r['mode']:>7} {r['impl']:>14} | "
    if r.get("error"):
      lines.append(head + f"error: {r['error']}")
      continue
    ratio = r.get("packed_over_batched")
    diff = r.get("max_diff")
    lines.append(head + f"{r['ms']:>9.3f} {r['flops_per_s'] / scale:>8.1f} "
                 f"{'' if ratio is None else f'{ratio:.3f}':>14} "
                 f"{'' if diff is None else f'{diff:.2e}':>9}")
  return lines


def plot(data: dict, path: Path) -> None:
  meta = data["metadata"]
  bench_attention.plot_by_mode(
      data, path, groups=[f"H={H}" for H in sorted({r["H"] for r in data["results"]})],
      series=[i for i in IMPLS if any(r["impl"] == i and not r.get("error")
                                      for r in data["results"])],
      key=lambda r: (r["impl"], f"H={r['H']}"),
      title=f"packed rows | {meta['device_kind']} | {meta['docs']} documents x "
            f"{meta['doc_len']} tokens, N={meta['heads']}, {meta['dtype']}, causal",
      panel_width=5.5)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  bench_attention.add_run_arguments(p, iterations=10)
  p.add_argument("--docs", type=int, default=8)
  p.add_argument("--doc-len", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dims", default="64,128,256")
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--impls", default=None, help=f"comma list of {', '.join(IMPLS)} (default: all "
                 "that run on the platform)")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  platform = bench_attention.select_platform(args.platform)
  args.dtype = bench_attention.run_dtype(args.dtype, platform)
  impls = (args.impls.split(",") if args.impls else
           [i for i in IMPLS if platform == "gpu" or i not in GPU_ONLY])
  unknown = set(impls) - set(IMPLS)
  if unknown:
    raise SystemExit(f"unknown implementations: {', '.join(sorted(unknown))}")
  if "batched" in impls:  # the reference of every other implementation
    impls = ["batched"] + [i for i in impls if i != "batched"]
  unit, scale = bench_attention.throughput_unit(platform)
  print("\n".join(table([], unit, scale)), flush=True)
  rows = []
  for mode in args.modes.split(","):
    for H in (int(h) for h in args.head_dims.split(",")):
      reference = batched = None
      for impl in impls:
        row = {"H": H, "mode": mode, "impl": impl}
        try:
          record, results = run_cell(impl, H, mode, args, platform, reference)
          row.update(record)
          if impl == "batched":
            reference, batched = results, record["flops_per_s"]
          elif impl == "packed" and batched is not None:
            row["packed_over_batched"] = record["flops_per_s"] / batched
        except Exception as e:  # one failing cell (memory, say) must not end the run
          row["error"] = bench_attention.short_reason(e)
        rows.append(row)
        print("\n".join(table([row], unit, scale)[2:]), flush=True)
  data = {
      "metadata": {
          **bench_attention.run_metadata(platform),
          "docs": args.docs, "doc_len": args.doc_len, "heads": args.heads, "dtype": args.dtype,
          "iterations": args.iterations,
          "flops": "visible work: 4*D*N*L*L*H halved (causal); fwd_bwd 3.5x forward",
      },
      "results": rows,
  }
  bench_attention.save_results(data, args.out, f"packed_{platform}", table(rows, unit, scale),
                               plot)
  return data


if __name__ == "__main__":
  main()
