"""Mask and bias arrays against the structured arguments they express, and against cuDNN.

Two families of one shape (B, T = S, N, H), timed in one process:

  causal family   causal attention expressed three ways, for jax_flash and for
                  jax.nn.dot_product_attention(implementation='cudnn'):
                    causal         is_causal=True
                    causal_mask    mask = tril, a (1, 1, T, S) boolean array (Flax's
                                   make_causal_mask)
                    causal_bias    bias = 0 on and below the diagonal, the dtype's lowest value
                                   above, a (1, 1, T, S) array
  padding family  keys past a per-item length (T, 3T/4, T/2, T/4, ... cycling) dropped:
                    lengths        key_value_seq_lengths
                    padding_mask   mask = (B, 1, 1, S) boolean array
  documents family  packed documents of --doc-len tokens, causal within each:
                    segment_ids    query_segment_ids = key_value_segment_ids (jax_flash only)
                    document_mask  is_causal and the (B, 1, T, S) mask of equal ids, what
                                   flax.linen.make_attention_mask(ids, ids, jnp.equal) builds
  learned bias family  a learned per-head bias (T5's relative positions, ALiBi):
                    head_bias      a random (1, N, T, S) bias, not causal, differentiated in
                                   fwd_bwd (dbias summed over the batch)
  learned item bias family  a learned bias per batch item and head:
                    item_head_bias  a random (B, N, T, S) bias, differentiated in fwd_bwd
                                   (dbias with an element per logit)
  masked learned bias families  the learned bias with a mask array, or with segment ids:
                    padded_head_bias    head_bias with the padding family's (B, 1, 1, S) mask
                                        (T5's encoder)
                    causal_head_bias    head_bias with the (1, 1, T, S) causal mask
                    segment_head_bias   head_bias with the documents family's segment ids
                                        (jax_flash only; T5 on packed rows)
                    document_head_bias  head_bias with the documents family's mask
  capped family   Gemma 2's causal attention under its logit cap (logits_soft_cap=50; jax_flash
                  only, cuDNN has no soft-capping):
                    capped_causal       is_causal=True
                    capped_causal_mask  mask = tril, the (1, 1, T, S) array Flax passes
                    capped_causal_bias  the causal bias above, added to the capped logits
  capped learned bias family  the learned bias under the cap (jax_flash only):
                    capped_head_bias    head_bias with logits_soft_cap=50

Implementations are named <impl>:<way>, impl jax_flash or cudnn (GPU only). Throughput counts
the visible work only, the same for every way of a family: 4 * B * N * T * S * H halved for
causal (and capped), 4 * N * T * H * sum(lengths) for padding, 4 * B * N * T * doc_len * H halved for
documents, 4 * B * N * T * S * H for the learned biases (with a mask or segment ids, as the
family whose mask it takes), 3.5x for fwd_bwd. Columns: `vs struct`,
jax_flash's throughput over its structured way in the family (is_causal, lengths); `vs cudnn`,
over cuDNN's same way. Every output (and gradient) is checked against the family's first row:
`max diff`.

Timing as in bench_attention.py: CUPTI device time per call on the GPU, median over
--iterations; wall-clock on the CPU.

  python bench/bench_masks.py                      # GPU: B 4, T 4096, N 16, H 128, bf16
  python bench/bench_masks.py --platform cpu --batch 2 --seq 512 --heads 4 --head-dim 64

The causal bias is a constant (no gradient asked for); the learned bias family times the bias
gradient, jax_flash's against cuDNN's.

Writes masks_<platform>.json and masks_<platform>.png under --out (default bench/out).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402  (timing helpers shared with the main benchmark)

FAMILIES = {"causal": ("causal", "causal_mask", "causal_bias"),
            "padding": ("lengths", "padding_mask"),
            "documents": ("segment_ids", "document_mask"),
            "learned_bias": ("head_bias",),
            "learned_item_bias": ("item_head_bias",),
            "padded_learned_bias": ("padded_head_bias",),
            "causal_learned_bias": ("causal_head_bias",),
            "packed_learned_bias": ("segment_head_bias", "document_head_bias"),
            "capped": ("capped_causal", "capped_causal_mask", "capped_causal_bias"),
            "capped_learned_bias": ("capped_head_bias",)}
SOFTCAP = 50.0  # the capped family's logits_soft_cap (Gemma 2's)
# Ways an implementation does not have.
UNSUPPORTED = {("cudnn", "segment_ids"), ("cudnn", "segment_head_bias"),
               ("cudnn", "capped_causal"),
               ("cudnn", "capped_causal_mask"), ("cudnn", "capped_causal_bias"),
               ("cudnn", "capped_head_bias")}
IMPLS = ("jax_flash", "cudnn")
GPU_ONLY = ("cudnn",)


def lengths_of(B: int, T: int):
  return [T - (b % 4) * T // 4 for b in range(B)]


def visible_flops(family: str, args, mode: str) -> float:
  B, T, N, H = args.batch, args.seq, args.heads, args.head_dim
  if family in ("causal", "capped", "causal_learned_bias"):
    flops = 4.0 * B * N * T * T * H * 0.5
  elif family in ("documents", "packed_learned_bias"):
    flops = 4.0 * B * N * T * args.doc_len * H * 0.5
  elif family in ("learned_bias", "learned_item_bias", "capped_learned_bias"):
    flops = 4.0 * B * N * T * T * H
  else:
    flops = 4.0 * N * T * H * sum(lengths_of(B, T))
  return flops * (3.5 if mode == "fwd_bwd" else 1.0)


def build(impl: str, way: str, args, mode: str):
  """(jitted function, arguments) of one row."""
  import jax
  import jax.numpy as jnp

  import jax_flash

  B, T, N, H = args.batch, args.seq, args.heads, args.head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k, v, dout = (jax.random.normal(key, (B, T, N, H), args.dtype) for key in keys[:4])
  def causal_mask():
    return jnp.tril(jnp.ones((T, T), bool))[None, None]

  causal_bias = jnp.where(causal_mask(), 0, jnp.finfo(args.dtype).min).astype(args.dtype)

  lengths = jnp.asarray(lengths_of(B, T), jnp.int32)
  ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // args.doc_len, (B, T))
  # Masks are built inside the timed program from positions, lengths or ids, as a Flax model
  # builds them (make_causal_mask, make_attention_mask).
  def padding_mask():
    return (jnp.arange(T) < lengths[:, None])[:, None, None]

  def document_mask():
    return (ids[:, :, None] == ids[:, None, :])[:, None]

  packed = dict(query_segment_ids=ids, key_value_segment_ids=ids)
  options = {
      "causal": dict(is_causal=True),
      "causal_mask": dict(mask=causal_mask),
      "causal_bias": dict(bias=causal_bias),
      "lengths": dict(key_value_seq_lengths=lengths),
      "padding_mask": dict(mask=padding_mask),
      "segment_ids": dict(is_causal=True, **packed),
      "document_mask": dict(is_causal=True, mask=document_mask),
      "head_bias": {},
      "item_head_bias": {},
      "padded_head_bias": dict(mask=padding_mask),
      "causal_head_bias": dict(mask=causal_mask),
      "segment_head_bias": dict(is_causal=True, **packed),
      "document_head_bias": dict(is_causal=True, mask=document_mask),
      "capped_causal": dict(is_causal=True, logits_soft_cap=SOFTCAP),
      "capped_causal_mask": dict(mask=causal_mask, logits_soft_cap=SOFTCAP),
      "capped_causal_bias": dict(bias=causal_bias, logits_soft_cap=SOFTCAP),
      "capped_head_bias": dict(logits_soft_cap=SOFTCAP),
  }[way]
  # Differentiated operands: q, k, v and, for the learned bias, the bias.
  primals = (q, k, v)
  if way.endswith("head_bias"):
    items = B if way == "item_head_bias" else 1
    primals += (jax.random.normal(keys[4], (items, N, T, T), args.dtype),)
  if impl == "jax_flash":
    call = jax_flash.dot_product_attention
  elif impl == "cudnn":
    call = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
  else:
    raise ValueError(f"unknown implementation {impl!r}")

  def attention(*p):
    return call(*p, **{k: v() if callable(v) else v for k, v in options.items()})
  if mode == "fwd":
    return jax.jit(attention), primals

  def fwd_bwd(dout, *primals):
    out, vjp = jax.vjp(attention, *primals)
    return (out, *vjp(dout))

  return jax.jit(fwd_bwd), (dout, *primals)


def run_cell(impl: str, family: str, way: str, mode: str, args, platform: str,
             reference) -> tuple[dict, tuple]:
  fn, inputs = build(impl, way, args, mode)
  return bench_attention.measure_call(fn, inputs, platform, args.iterations,
                                      visible_flops(family, args, mode), reference)


def table(rows: list[dict], unit: str, scale: float) -> list[str]:
  lines = [f"{'mode':>7} {'implementation':>24} | {'ms':>9} {unit:>8} {'vs struct':>9} "
           f"{'vs cudnn':>9} {'max diff':>9}"]
  lines.append("-" * len(lines[0]))
  for r in rows:
    head = f"{r['mode']:>7} {r['impl'] + ':' + r['way']:>24} | "
    if r.get("error"):
      lines.append(head + f"error: {r['error']}")
      continue
    cells = [r.get("vs_structured"), r.get("vs_cudnn")]
    diff = r.get("max_diff")
    lines.append(head + f"{r['ms']:>9.3f} {r['flops_per_s'] / scale:>8.1f} " +
                 " ".join(f"{'' if c is None else f'{c:.3f}':>9}" for c in cells) +
                 f" {'' if diff is None else f'{diff:.2e}':>9}")
  return lines


def plot(data: dict, path: Path) -> None:
  meta = data["metadata"]
  bench_attention.plot_by_mode(
      data, path, groups=[w for family in FAMILIES.values() for w in family],
      series=sorted({r["impl"] for r in data["results"]}, key=IMPLS.index),
      key=lambda r: (r["impl"], r["way"]),
      title=f"mask and bias arrays | {meta['device_kind']} | B={meta['batch']}, "
            f"T=S={meta['seq']}, N={meta['heads']}, H={meta['head_dim']}, {meta['dtype']}",
      panel_width=6, label_size=7)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  bench_attention.add_run_arguments(p, iterations=10)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--doc-len", type=int, default=512)
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--families", default=",".join(FAMILIES),
                 help="comma list of families to run (default: all)")
  args = p.parse_args(argv)
  unknown = set(args.families.split(",")) - set(FAMILIES)
  if unknown:
    p.error(f"--families: unknown {sorted(unknown)} (known: {', '.join(FAMILIES)})")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  platform = bench_attention.select_platform(args.platform)
  args.dtype = bench_attention.run_dtype(args.dtype, platform)
  impls = [i for i in IMPLS if platform == "gpu" or i not in GPU_ONLY]
  unit, scale = bench_attention.throughput_unit(platform)
  print("\n".join(table([], unit, scale)), flush=True)
  rows = []
  for mode in args.modes.split(","):
    for family in args.families.split(","):
      ways = FAMILIES[family]
      reference = None
      throughput = {}
      for impl in impls:
        for way in ways:
          if (impl, way) in UNSUPPORTED:
            continue
          row = {"mode": mode, "family": family, "impl": impl, "way": way}
          try:
            record, results = run_cell(impl, family, way, mode, args, platform, reference)
            row.update(record)
            reference = results if reference is None else reference
            throughput[impl, way] = record["flops_per_s"]
          except Exception as e:  # one failing cell must not end the run
            row["error"] = bench_attention.short_reason(e)
          rows.append(row)
      for row in rows:
        if row["mode"] != mode or row["family"] != family or row.get("error"):
          continue
        if row["impl"] == "jax_flash":
          if len(ways) > 1 and ("jax_flash", ways[0]) in throughput:
            row["vs_structured"] = row["flops_per_s"] / throughput["jax_flash", ways[0]]
          if ("cudnn", row["way"]) in throughput:
            row["vs_cudnn"] = row["flops_per_s"] / throughput["cudnn", row["way"]]
        print("\n".join(table([row], unit, scale)[2:]), flush=True)
  data = {
      "metadata": {
          **bench_attention.run_metadata(platform),
          "batch": args.batch, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
          "doc_len": args.doc_len,
          "dtype": args.dtype, "iterations": args.iterations,
          "flops": "visible work: causal and capped 4*B*N*T*S*H/2, padding "
                   "4*N*T*H*sum(lengths), documents 4*B*N*T*doc_len*H/2, learned bias "
                   "4*B*N*T*S*H (with a mask or segment ids, as the family whose mask it "
                   "takes); fwd_bwd 3.5x forward",
          "softcap": SOFTCAP,
      },
      "results": rows,
  }
  bench_attention.save_results(data, args.out, f"masks_{platform}", table(rows, unit, scale), plot)
  return data


if __name__ == "__main__":
  main()
