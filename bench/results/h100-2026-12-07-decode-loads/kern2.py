"""Per-kernel CUPTI times (median of 150 calls): python kern2.py LABEL HEAD_DIM [cudnn]"""
import os, statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import jax_flash
from jax_flash import _split_kv
if os.environ.get("JF_CTAS"): _split_kv.CTAS_PER_SM = int(os.environ["JF_CTAS"])
if os.environ.get("JF_MINCHUNK"): _split_kv.MIN_CHUNK = int(os.environ["JF_MINCHUNK"])
label, H = sys.argv[1], int(sys.argv[2]); with_cudnn = len(sys.argv) > 3
def kind(name):
  for key in ("decode_forward", "forward_kernel", "merge"):
    if key in name: return key
  return "cudnn_fwd" if "fprop" in name or "fpro" in name else name[:24]
cells = [(1, 1, 4096), (1, 4, 4096), (2, 1, 4096), (8, 1, 4096), (1, 1, 16384), (8, 1, 16384), (1, 1, 65536)]
for (B, T, S) in cells:
  N, K = 32, 8
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  impls = [("jf", lambda q, k, v: jax_flash.dot_product_attention(q, k, v))]
  if with_cudnn: impls.append(("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")))
  ref = None
  for impl, fn in impls:
    f = jax.jit(fn)
    o = f(q, k, v).block_until_ready()
    if ref is None: ref = np.asarray(jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)))
    err = float(np.max(np.abs(np.asarray(o, np.float32) - ref)))
    per, calls = {}, []
    for _ in range(5):
      _, t = profiler.measure(f, aggregate=False, iterations=30)(q, k, v)
      for it in t:
        calls.append(sum(ms for _, ms in it) * 1e3)
        for name, ms in it: per.setdefault(kind(name), []).append(ms * 1e3)
    line = " | ".join(f"{n}: {statistics.median(v):.2f}" for n, v in per.items())
    print(f"{label} H={H} B={B} T={T} S={S} {impl}: call {statistics.median(calls):.2f} | {line} | err {err:.1e}", flush=True)
