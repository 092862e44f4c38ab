"""Probe runs: per-CTA timelines (probe module's g_timeline) or per-kernel CUPTI times."""
import ctypes, os, sys, statistics as st
import numpy as np
import jax, jax.numpy as jnp
import jax_flash
import jax_flash._jax_flash_ext as ext
from jax.experimental.mosaic.gpu import profiler

mode = sys.argv[1]
cells = [tuple(int(x) for x in c.split("x")) for c in sys.argv[2:]]  # BxTxS
N, K, H = 32, 8, 128
GHZ = 1.98
names = ["prod_ready", "loads_issued", "cons_tile", "q_arrived", "mma_done", "store_done", "end"]
for B, T, S in cells:
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
  impls = {"jax_flash": jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v)),
           "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))}
  if mode == "loop":
    f = impls["jax_flash"]
    for i in range(8):
      jax.block_until_ready(f(q, k, v))
    continue
  if mode == "probe":
    lib = ctypes.CDLL(ext.__file__)
    f = impls["jax_flash"]
    buf = np.zeros((4096, 10), np.int64)
    for i in range(6):
      buf[:] = 0
      jax.block_until_ready(f(q, k, v))
      rc = lib.jax_flash_read_timeline(buf.ctypes.data_as(ctypes.c_void_p), 4096)
      rows = buf[buf[:, 1] != 0]
      if i < 2 or rc:
        print(f"call {i}: rc {rc}, {len(rows)} CTAs"); continue
      g0 = rows[:, 1].min()
      ent = rows[:, 1] - g0; end = rows[:, 2] - g0
      print(f"{B}x{T}x{S} call {i}: {len(rows)} CTAs; entry offset ns min/med/max {ent.min()}/{int(np.median(ent))}/{ent.max()}; "
            f"end ns min/med/max {end.min()}/{int(np.median(end))}/{end.max()}; SMs {len(set(rows[:,0]))}")
      for j, n in enumerate(names):
        vals = rows[:, 3 + j] / GHZ
        print(f"   {n:>13}: ns after CTA entry min/med/max {vals.min():7.0f} {np.median(vals):7.0f} {vals.max():7.0f}")
      order = np.argsort(end)
      print("   last 3 CTAs (sm, entry, end, q_arrived, mma_done):", [(int(rows[o,0]), int(ent[o]), int(end[o]), int(rows[o,6]/GHZ), int(rows[o,7]/GHZ)) for o in order[-3:]])
      print("   first 3 CTAs:", [(int(rows[o,0]), int(ent[o]), int(end[o]), int(rows[o,6]/GHZ), int(rows[o,7]/GHZ)) for o in order[:3]])
  else:
    for name, f in impls.items():
      jax.block_until_ready(f(q, k, v))
      _, t = profiler.measure(f, aggregate=False, iterations=30)(q, k, v)
      per = {}
      for it in t:
        for kname, ms in it:
          per.setdefault(kname, []).append(ms * 1e3)
      tot = st.median([sum(ms for _, ms in it) * 1e3 for it in t])
      print(f"CUPTI {B}x{T}x{S} {name} total {tot:.2f} us :: " + " | ".join(
          f"{kn[:50]} {st.median(v):.2f}" for kn, v in per.items()), flush=True)
