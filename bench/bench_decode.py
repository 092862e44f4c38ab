"""Decoding: a few query rows against a long key/value cache, forward only.

For each (batch B, query rows T, cached keys S) times jax_flash's forward (which runs such
shapes with the keys split and the query heads of a group packed: jax_flash/_split_kv.py),
the same forward without that (``jax_flash_unsplit``), cuDNN through
``jax.nn.dot_product_attention`` and FlashAttention-3's key/value-cache forward through
``flash_attn3_jax.flash_mha_with_kvcache`` (``fa3``; head dim 128 in its wheel) at the fastest of
its split counts FA3_SPLITS, each as the sum of its kernels' CUPTI durations. The bar is
the HBM bandwidth: the bytes of K and V over the time, against what a device-to-device copy
reaches in the same run (bytes read + written over its time, on a 2 GiB buffer).

  python bench/bench_decode.py                       # B = 1, 8, 64; T = 1, 4, 16; S = 4k..128k
  python bench/bench_decode.py --batches 1 --queries 1 --seqlens 131072
  python bench/bench_decode.py --filled 0.9   # a mask of the cache's first 90% of keys

Writes decode_gpu.json and decode_gpu.png under --out (default bench/out). With --filled the
K/V bytes counted are those of the filled keys.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402  (timing, metadata and result files)

IMPLS = ("jax_flash", "jax_flash_unsplit", "cudnn", "fa3")
#: The key/value splits tried for FA3's cache forward, which takes the count from its caller
#: (`num_splits`, no heuristic in this binding); the fastest is recorded with it.
FA3_SPLITS = (1, 2, 4, 8, 16, 32, 64)


@contextlib.contextmanager
def _unsplit():
  """While tracing: the plain forward kernel call for every shape."""
  from jax_flash import _split_kv

  plan = _split_kv.plan
  _split_kv.plan = lambda *args, **kwargs: None
  try:
    yield
  finally:
    _split_kv.plan = plan


def _compile(name: str, q, k, v, filled=None, fa3_splits: int = 1):
  """The compiled call of `name`; with `filled` (int32 (B,): the cache's filled keys, a prefix)
  its keys are limited by a mask array built in the program from it, as Flax's decoding step
  builds one from the cache index (FA3, which takes no mask: by its cache lengths)."""
  import jax
  import jax.numpy as jnp

  import jax_flash

  def mask_of(filled):
    if filled is None:
      return None
    return (jnp.arange(k.shape[1]) < filled[:, None])[:, None, None, :]  # (B, 1, 1, S)

  if name == "fa3":
    from flash_attn3_jax import flash_mha_with_kvcache

    fn = jax.jit(lambda q, k, v, filled: flash_mha_with_kvcache(
        q, k, v, cache_seqlens=filled, num_splits=fa3_splits))
  elif name == "cudnn":
    fn = jax.jit(lambda q, k, v, filled: jax.nn.dot_product_attention(
        q, k, v, mask=mask_of(filled), implementation="cudnn"))
  else:
    fn = jax.jit(lambda q, k, v, filled: jax_flash.dot_product_attention(
        q, k, v, mask=mask_of(filled)))
  with _unsplit() if name == "jax_flash_unsplit" else contextlib.nullcontext():
    return fn.lower(q, k, v, filled).compile()


def copy_bandwidth(iterations: int) -> float:
  """Bytes read + written per second by a device-to-device copy of 2 GiB."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((2 ** 30,), jnp.bfloat16)
  compiled = jax.jit(lambda x: x * 2).lower(x).compile()  # one fusion: read x, write a copy
  ms, _ = bench_attention.time_gpu(compiled, [x], iterations, warmup=1)
  return 2 * x.nbytes / (statistics.median(ms) * 1e-3)


def _fastest_fa3(args: list, S: int):
  """FA3's split count of FA3_SPLITS (at least 128 keys a split) with the least median time
  over a few calls of `args` (q, k, v, filled), and its compiled call."""
  import jax

  best, failure = None, None
  for splits in (n for n in FA3_SPLITS if n == 1 or S // n >= 128):
    try:
      compiled = _compile("fa3", *args, fa3_splits=splits)
      jax.block_until_ready(compiled(*args))
      times, _ = bench_attention.time_gpu(compiled, args, 5, warmup=1)
    except Exception as e:  # a count this shape does not take
      failure = e
      continue
    us = statistics.median(times)
    if best is None or us < best[0]:
      best = (us, splits, compiled)
  if best is None:
    raise failure
  return best[1], best[2]


def run_cell(B: int, T: int, S: int, args, copy_bw: float) -> dict:
  import jax
  import numpy as np

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (B, T, args.heads, args.head_dim), args.dtype)
  k = jax.random.normal(keys[1], (B, S, args.kv_heads, args.head_dim), args.dtype)
  v = jax.random.normal(keys[2], (B, S, args.kv_heads, args.head_dim), args.dtype)
  filled = None
  kv_bytes = k.nbytes + v.nbytes
  if args.filled is not None:  # the keys to read: the cache's filled prefix
    keys_filled = max(1, int(S * args.filled))
    filled = jax.numpy.full((B,), keys_filled, jax.numpy.int32)
    kv_bytes = kv_bytes * keys_filled // S
  call_args = [q, k, v, filled]
  record = {"B": B, "T": T, "S": S, "kv_bytes": kv_bytes, "results": {}}
  reference = None
  for name in args.impls.split(","):
    r = {}
    try:
      if name == "fa3":
        r["num_splits"], compiled = _fastest_fa3(call_args, S)
      else:
        compiled = _compile(name, *call_args)
      out = compiled(*call_args)
      if reference is None:
        reference = np.asarray(out, np.float32)
      r["max_abs_diff"] = float(np.abs(np.asarray(out, np.float32) - reference).max())
      times, method = bench_attention.time_gpu(compiled, call_args, args.iterations, warmup=1)
      r.update(us=statistics.median(times) * 1e3, timing=method)
      r["bandwidth"] = kv_bytes / (r["us"] * 1e-6)
      r["of_copy"] = r["bandwidth"] / copy_bw
    except Exception as e:  # a peer that does not take the shape
      r["error"] = bench_attention.short_reason(e)
    record["results"][name] = r
    jax.clear_caches()
  ours = record["results"].get("jax_flash", {})
  for peer in ("cudnn", "fa3"):
    theirs = record["results"].get(peer, {})
    if "us" in ours and "us" in theirs:
      record[f"speedup_vs_{peer}"] = theirs["us"] / ours["us"]
  return record


def table(data: dict) -> list[str]:
  impls = data["metadata"]["impls"]
  head = (f"{'B':>3} {'T':>3} {'S':>7} | " + " ".join(f"{n:>24}" for n in impls) +
          " | vs cuDNN | vs FA3")
  lines = [head, "-" * len(head)]
  for r in data["results"]:
    cells = []
    for n in impls:
      x = r["results"].get(n, {})
      cells.append(f"{'error':>24}" if "us" not in x else
                   f"{x['us']:>9.1f} us {x['bandwidth'] / 1e9:>6.0f} GB/s {100 * x['of_copy']:>3.0f}%")
    speeds = [r.get(f"speedup_vs_{peer}") for peer in ("cudnn", "fa3")]
    lines.append(f"{r['B']:>3} {r['T']:>3} {r['S']:>7} | " + " ".join(cells) + " | " +
                 " | ".join(f"{'':>8}" if x is None else f"{x:>7.2f}x" for x in speeds))
  lines.append(f"copy bandwidth: {data['metadata']['copy_bandwidth'] / 1e9:.0f} GB/s "
               "(bytes read + written); % = K/V bytes over time, of that")
  return lines


def plot(data: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta = data["metadata"]
  pairs = sorted({(r["B"], r["T"]) for r in data["results"]})
  # Reads beyond the copy's 100% are common (a copy also writes): the axis shows them all.
  top = max([110.0] + [5 + 100 * v["of_copy"] for r in data["results"]
                       for v in r["results"].values() if "of_copy" in v])
  fig, axes = plt.subplots(1, len(pairs), squeeze=False, figsize=(4 * len(pairs), 3.6))
  for ax, (B, T) in zip(axes[0], pairs):
    for name in meta["impls"]:
      pts = sorted((r["S"], r["results"][name]["of_copy"]) for r in data["results"]
                   if (r["B"], r["T"]) == (B, T) and "of_copy" in r["results"].get(name, {}))
      if pts:
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
    ax.axhline(80, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, top)
    ax.set_title(f"B={B}, T={T}")
    ax.set_xlabel("cached keys S")
    ax.set_ylabel("K/V read bandwidth, % of copy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"decode | {meta['device_kind']} | N={meta['heads']}, K={meta['kv_heads']}, "
               f"H={meta['head_dim']}, {meta['dtype']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batches", default="1,8,64")
  p.add_argument("--queries", default="1,4,16")
  p.add_argument("--seqlens", default="4096,16384,65536,131072")
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--filled", type=float, default=None,
                 help="a decoding step's mask: keys past this fraction of the cache masked, by "
                      "a (B, 1, 1, S) mask array built in the program (FA3: its cache lengths)")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--max-kv-gib", type=float, default=16.0,
                 help="skip cells whose K and V take more than this")
  p.add_argument("--out", default=str(HERE / "out"))
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  bench_attention.select_platform("gpu")
  copy_bw = copy_bandwidth(args.iterations)
  results = []
  for B in map(int, args.batches.split(",")):
    for T in map(int, args.queries.split(",")):
      for S in map(int, args.seqlens.split(",")):
        if 2 * B * S * args.kv_heads * args.head_dim * 2 > args.max_kv_gib * 2 ** 30:
          continue
        results.append(run_cell(B, T, S, args, copy_bw))
        print(table({"metadata": {"impls": args.impls.split(","), "copy_bandwidth": copy_bw},
                     "results": results[-1:]})[2], flush=True)
  data = {
      "metadata": {**bench_attention.run_metadata("gpu"), "impls": args.impls.split(","),
                   "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "dtype": args.dtype, "iterations": args.iterations, "copy_bandwidth": copy_bw,
                   "filled": args.filled,
                   "timing": "sum of the kernels' CUPTI durations per call, median"},
      "results": results,
  }
  bench_attention.save_results(data, args.out, "decode_gpu", table(data), plot)
  return data


if __name__ == "__main__":
  main()
