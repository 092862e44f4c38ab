"""FA3 with its soft cap (the patched attribute) against jax_flash's, forward and gradients."""
import os
import jax
import jax.numpy as jnp
import jax_flash
from flash_attn3_jax import flash_mha

cap = float(os.environ["FA3_SOFTCAP"])
key = jax.random.PRNGKey(0)
kq, kk, kv, kd = jax.random.split(key, 4)
B, T, N, H = 2, 512, 4, 128
for q_scale in (1.0, 30.0):
  q = (q_scale * jax.random.normal(kq, (B, T, N, H))).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (B, T, N, H)).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (B, T, N, H)).astype(jnp.bfloat16)
  do = jax.random.normal(kd, (B, T, N, H)).astype(jnp.bfloat16)
  for causal in (False, True):
    f3 = lambda q, k, v: flash_mha(q, k, v, is_causal=causal)
    fj = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal,
                                                         logits_soft_cap=cap)
    fu = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal)
    def fwd_bwd(f):
      o, vjp = jax.vjp(f, q, k, v)
      return (o,) + vjp(do)
    r3, rj, ru = (fwd_bwd(f) for f in (f3, fj, fu))
    largest = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    diffs = [largest(a.astype(jnp.float32) - b.astype(jnp.float32)) for a, b in zip(r3, rj)]
    capped_vs_uncapped = largest(rj[0].astype(jnp.float32) - ru[0].astype(jnp.float32))
    scale = [largest(b) for b in rj]
    print(f"q_scale {q_scale} causal {causal}: |fa3 - jax_flash| out/dq/dk/dv {diffs}  "
          f"(max |jax_flash| {scale}); |capped - uncapped| out {capped_vs_uncapped}")
