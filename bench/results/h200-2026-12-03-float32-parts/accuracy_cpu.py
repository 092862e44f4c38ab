"""The CPU kernel's decode forward against the float64 definition: unsplit, split with its parts
in bfloat16 and in float32 (parts=True)."""
import functools, numpy as np, jax, jax.numpy as jnp
from jax_flash import _primitive, _split_kv
from jax_flash._validation import AttentionConfig
B,T,N,K,H,S,P = 4,1,32,8,128,4096,16
cfg = AttentionConfig(scale=H**-0.5, window_left=-1, window_right=-1)
rng = np.random.default_rng(0)
q = rng.standard_normal((B,T,N,H)); k = rng.standard_normal((B,S,K,H)); v = rng.standard_normal((B,S,K,H))
qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q,k,v))
q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (qb,kb,vb))
G = N//K
kk = np.repeat(k64, G, axis=2); vv = np.repeat(v64, G, axis=2)
s = np.einsum('btnh,bsnh->bnts', q64, kk) * cfg.scale
p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
ref = np.einsum('bnts,bsnh->btnh', p, vv)
call = functools.partial(_primitive._forward_call, cfg)
def split(parts_f32):
  def kernel(q, k, v, bias, mask, q_len, kv_len, query_groups, parts):
    return call(q, k, v, bias, mask, q_len, kv_len, None, None, query_groups=query_groups, parts=parts and parts_f32)
  return jax.jit(lambda q,k,v: _split_kv.forward(_split_kv.Plan(G, P), kernel, q, k, v, None, None, None, None))(qb,kb,vb)[0]
plain = jax.jit(lambda q,k,v: call(q,k,v,None,None,None,None,None,None))(qb,kb,vb)[0]
def err(x):
  x = np.asarray(x.astype(jnp.float32), np.float64)
  # error in units of the bf16 spacing at the reference's magnitude
  e = np.floor(np.log2(np.maximum(np.abs(ref), 1e-30)))
  spacing = 2.0**(e - 7)
  d = np.abs(x - ref) / spacing
  return d.max(), d.mean(), (d > 0.5 + 1e-6).mean()
for name, x in [("unsplit", plain), ("parts bf16", split(False)), ("parts f32", split(True))]:
  print(name, "max %.3f ulp, mean %.4f ulp, beyond half an ulp: %.4f%%" % (lambda a,b,c: (a,b,100*c))(*err(x)))
