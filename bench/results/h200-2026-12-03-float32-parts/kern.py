"""Per-kernel CUPTI times of decode calls: python kern.py LABEL"""
import sys, statistics
import jax, jax.numpy as jnp, numpy as np
import jax_flash
from jax.experimental.mosaic.gpu import profiler
label = sys.argv[1]
for (B, T, S) in [(1, 1, 4096), (1, 16, 4096), (8, 1, 4096), (1, 1, 16384)]:
  N, K, H = 32, 8, 128
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v))
  f(q, k, v).block_until_ready()
  runs = []
  for _ in range(5):
    _, t = profiler.measure(f, aggregate=False, iterations=30)(q, k, v)
    runs.append(t)
  # t: list over iterations of list of (name, ms)
  per = {}
  for t in runs:
    for it in t:
      for name, ms in it:
        key = ("fwd" if "forward_kernel" in name else "merge" if "merge" in name
               else name[:40])
        per.setdefault(key, []).append(ms * 1e3)
  line = " | ".join(f"{n}: {statistics.median(v):.2f}" for n, v in per.items())
  print(f"{label} B={B} T={T} S={S}: {line}", flush=True)
