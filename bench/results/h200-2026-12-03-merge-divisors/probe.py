"""Per-kernel CUPTI medians of decode cells: python probe.py LABEL [min_chunk]"""
import sys, statistics
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import bench_decode
from jax_flash import _split_kv
label = sys.argv[1]
if len(sys.argv) > 2:
  _split_kv.MIN_CHUNK = int(sys.argv[2])

def per_kernel(fn, args):
  fn(*args)
  per = {}
  for _ in range(5):
    _, t = profiler.measure(fn, aggregate=False, iterations=30)(*args)
    for it in t:
      for name, ms in it:
        key = ("fwd" if "forward_kernel" in name else "merge" if "merge" in name
               else name[:28])
        per.setdefault(key, []).append(ms * 1e3)
  return {n: statistics.median(v) for n, v in per.items()}

# calibration: the floor of a tiny XLA kernel
x = jnp.ones((8,), jnp.float32)
tiny = jax.jit(lambda x: x * 2 + 1)
t = per_kernel(tiny, [x])
print(f"{label} tiny kernel: " + " | ".join(f"{n}: {v:.2f}" for n, v in t.items()), flush=True)

for (B, T, S, filled) in [(1, 1, 4096, None), (1, 1, 4096, 0.9375), (8, 1, 4096, None),
                          (1, 16, 4096, None), (1, 1, 16384, None)]:
  N, K, H = 32, 8, 128
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  fl = None if filled is None else jnp.full((B,), int(S * filled), jnp.int32)
  out = []
  for name in ("jax_flash", "cudnn"):
    fn = bench_decode._compile(name, q, k, v, fl)
    t = per_kernel(fn, [q, k, v, fl])
    out.append(f"{name} {sum(t.values()):.2f} [" + " ".join(f"{n}:{v:.2f}" for n, v in t.items()) + "]")
  print(f"{label} B={B} T={T} S={S} filled={filled}: " + " || ".join(out), flush=True)
