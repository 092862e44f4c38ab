"""Per-kernel CUPTI times (median of 150 calls) of decode calls: python kern.py LABEL HEAD_DIM"""
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

import jax_flash

label, H = sys.argv[1], int(sys.argv[2])


def kind(name):
  for key in ("decode_forward", "forward_kernel", "merge"):
    if key in name:
      return key
  return name[:48]


for (B, T, S, filled) in [(1, 1, 4096, None), (1, 4, 4096, None), (2, 1, 4096, None),
                          (8, 1, 4096, None), (1, 1, 16384, None), (8, 1, 16384, None),
                          (1, 1, 65536, None)]:
  N, K = 32, 8
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  mask = None if filled is None else (jnp.arange(S) < filled)[None, None, None, :]
  for impl, fn in [("jax_flash", lambda q, k, v: jax_flash.dot_product_attention(q, k, v, mask=mask)),
                   ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                       q, k, v, mask=mask, implementation="cudnn"))]:
    f = jax.jit(fn)
    f(q, k, v).block_until_ready()
    per, calls = {}, []
    for _ in range(5):
      _, t = profiler.measure(f, aggregate=False, iterations=30)(q, k, v)
      for it in t:
        calls.append(sum(ms for _, ms in it) * 1e3)
        for name, ms in it:
          per.setdefault(kind(name), []).append(ms * 1e3)
    line = " | ".join(f"{n}: {statistics.median(v):.2f}" for n, v in per.items())
    print(f"{label} H={H} B={B} T={T} S={S} filled={filled} {impl}: call "
          f"{statistics.median(calls):.2f} | {line}", flush=True)
