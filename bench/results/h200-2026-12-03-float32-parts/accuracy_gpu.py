"""Error of the GPU decode forward (split, its parts as the build stores them) against the
float64 definition of its bf16 inputs. python accuracy_gpu.py LABEL"""
import sys
import numpy as np, jax, jax.numpy as jnp
import jax_flash
from jax_flash import _split_kv
from jax_flash._validation import AttentionConfig
label = sys.argv[1]
def stats(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)  # bf16 ulp of ref
  d = np.abs(x - ref) / spacing
  rms = np.sqrt((ref ** 2).mean(axis=-1, keepdims=True))
  r = np.abs(x - ref) / rms
  return "ulps: mean %.3f max %.1f, >1 ulp %.2f%%; |err|/rms(row): max %.2e mean %.2e" % (
      d.mean(), d.max(), 100 * (d > 1).mean(), r.max(), r.mean())
for (B, T, S) in [(1, 1, 16384), (1, 16, 16384), (8, 1, 4096)]:
  N, K, H = 32, 8, 128
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  q64, k64, v64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  G = N // K
  kk, vv = np.repeat(k64, G, axis=2), np.repeat(v64, G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q64, kk) / np.sqrt(H)
  p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
  ref = np.einsum("bnts,bsnh->btnh", p, vv)
  f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v)
  split = jax.jit(f)(q, k, v)
  splits = _split_kv.plan(q.shape, k.shape, AttentionConfig(scale=1.0, window_left=-1, window_right=-1), False)
  print(f"{label} B={B} T={T} S={S} {splits}: split {stats(split, ref)}", flush=True)
