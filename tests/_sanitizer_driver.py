"""Runs the Hopper forward and backward kernels on small problems of every compiled tile, for
compute-sanitizer (tests/test_gpu_sanitizer.py starts this script under it, one process per
case so that the cases run in parallel and a slow one is named).

    python tests/_sanitizer_driver.py [CASE_INDEX ...]   (default: every case)

Cases, for each compiled head dim: causal and not, a local window, ragged query and key/value
lengths (zero and past the end included), mostly empty batch items over a grid where every CTA walks
several tiles, grouped-query heads, sizes that are not multiples of any tile, every compiled dtype,
the backward's ordered (deterministic) dQ reduction, logit soft-capping (its own instantiation of
each tile; causal, ragged; and Gemma 2's cap over unit-scale logits, the forward's series bound) and
segment ids (sorted and not; their own instantiations, with and without soft-capping) and mask
arrays (their own instantiations on each head dim's default tile: empty, full and partial blocks,
per head with grouped heads, and soft-capped under the ordered dQ reduction, which visits the empty
ones; in decoding, per head and a mask of keys alone) and bias arrays (their own instantiations on
the default tiles: per head and batch item with grouped heads and odd key counts, read element by
element; broadcast over queries, read in pairs; patches of the lowest value and -inf, whose blocks
are skipped, under the ordered dQ reduction, which visits them, with odd key counts and 16-byte rows
by turns (the classes kernel's two ways of reading a block); their gradient, element by element and
summed over the queries), and the pairs of these the kernels combine (a bias with a mask, whose
classes the kernels read alone; a bias or a mask with segment ids).
A head dim with several forward tiles runs its causal, segment-id and few-row cases (decoding
among them) on the tile that prefers them (kernel_configs.json) and the others on its default.
Each case also runs the gradients (the backward's kernels). Every output and gradient is
checked to be finite, so a kernel that reads garbage fails here too. The backward with a bias
runs on the kernels alone, without its hand-over to the blockwise backward for huge
log-sum-exps (_primitive._KERNEL_BIAS_LSE_LIMIT): compute-sanitizer crashes on start-up in
processes whose programs hold that blockwise backward (XLA's loops and conditionals, not
jax_flash kernels).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _config, _primitive


def cases():
  dtypes = _config.GPU_DTYPES
  for i, H in enumerate(_config.GPU_HEAD_DIMS):
    yield dict(H=H, dtype=dtypes[i % len(dtypes)], is_causal=False, window=None, lengths=None)
    yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=True, window=None,
               lengths="ragged")
    yield dict(H=H, dtype=dtypes[0], is_causal=False, window=(37, 5), lengths="ragged",
               deterministic=True)
    # Enough tiles that every CTA of the persistent forward grid walks several, most of them
    # empty (the forward's case: the backward's grid is one CTA per tile).
    yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
               lengths="mostly_empty", B=24, N=16, K=4, grads=False)
    if any(t.prefer_causal_up_to for t in _config.SM90_FORWARD_TILES if t.head_dim == H):
      # The same on the tile this head dim prefers for short causal rows.
      yield dict(H=H, dtype=dtypes[0], is_causal=True, window=None, lengths="mostly_empty",
                 B=24, N=16, K=4, grads=False)
    if any(t.prefer_rows_up_to for t in _config.SM90_FORWARD_TILES if t.head_dim == H):
      # Few query rows (the tile this head dim prefers for them), and decoding steps: one
      # row and three rows against split keys (jax_flash/_split_kv.py), 4 query heads per
      # key/value head packed into rows in place, the chunks merged by the merge kernel from
      # the call's layout (its one-row and several-row forms); without logit arrays, on the
      # decoding kernel where it lists the head dim.
      yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
                 lengths=None, T=13)
      yield dict(H=H, dtype=dtypes[0], is_causal=False, window=None, lengths="ragged", T=1,
                 S=2048, N=8, K=2)
      yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
                 lengths="ragged", T=3, S=2048, N=8, K=2)
      # The same with logit arrays, packed and chunked as the query and the keys (the mask's
      # bits and classes, the bias's classes and TMA tiles on the default tile).
      if "mask" in _config.SM90_FORWARD.features:
        yield dict(H=H, dtype=dtypes[0], is_causal=False, window=None, lengths="ragged", T=1,
                   S=2048, N=8, K=2, mask="patches")
        # A mask of keys alone for every head (a decoding step's cache, as Flax masks it).
        yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
                   lengths="ragged", T=1, S=2048, N=8, K=2, mask="keys")
      if "bias" in _config.SM90_FORWARD.features:
        yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
                   lengths=None, T=3, S=2048, N=8, K=2, bias="B1TS")
    elif H in _config.SM90_DECODE.head_dims:
      # Decoding steps on the decoding kernel: one row's packed query heads against chunks of
      # 256 keys (one buffer of keys), three rows' against chunks of 512 (two buffers), ragged
      # lengths.
      yield dict(H=H, dtype=dtypes[0], is_causal=False, window=None, lengths="ragged", T=1,
                 S=2048, N=8, K=2)
      yield dict(H=H, dtype=dtypes[1 % len(dtypes)], is_causal=False, window=None,
                 lengths="ragged", T=3, S=8192, N=8, K=2)
    if "softcap" in _config.SM90_FORWARD.features | _config.SM90_BACKWARD.features:
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", softcap=2.0)
      # Gemma 2's cap over unit-scale logits: the short series, and in bfloat16 its bound in
      # place of the row maxima in the blocks that mask nothing.
      yield dict(H=H, dtype=dtypes[0], is_causal=False, window=None, lengths=None,
                 softcap=50.0)
    if "segment_ids" in _config.SM90_FORWARD.features | _config.SM90_BACKWARD.features:
      # Sorted ids (exact spans: blocks skipped, per-row ranges), and unsorted ids (compared
      # pair by pair) with soft-capping and the ordered dQ reduction.
      yield dict(H=H, dtype=dtypes[i % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", segments="sorted")
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=False, window=(50, 20),
                 lengths=None, segments="unsorted", softcap=3.0, deterministic=True)
    if "mask" in _config.SM90_FORWARD.features | _config.SM90_BACKWARD.features:
      yield dict(H=H, dtype=dtypes[i % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", mask="patches")
      # With soft-capping where the kernels combine the two.
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=False, window=None,
                 lengths=None, mask="patches", deterministic=True,
                 softcap=4.0 if _combined("softcap", "mask") else None)
    if "bias" in _config.SM90_FORWARD.features | _config.SM90_BACKWARD.features:
      # Keys a multiple of 8: the backward moves the bias and its gradient in TMA tiles;
      # soft-capped by turns, where the kernels combine the two.
      yield dict(H=H, dtype=dtypes[i % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", bias="BNTS", S=200,
                 softcap=2.5 if i % 2 and _combined("softcap", "bias") else None)
      # With soft-capping where the kernels combine the two.
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=False, window=(40, 9),
                 lengths=None, bias="B11S", S=256,
                 softcap=3.0 if _combined("softcap", "bias") else None)
      # Key counts that the classes kernel reads entry by entry and, with 16-byte rows, in
      # vectors, by turns over the head dims.
      yield dict(H=H, dtype=dtypes[0], is_causal=False, window=None, lengths="ragged",
                 bias="lowest", deterministic=True, S=(201, 256)[i % 2])
    # Pairs of logit arrays and segment ids, where the kernels combine them.
    if _combined("mask", "bias"):
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", bias="1NTS", mask="patches")
    if _combined("segment_ids", "bias"):
      yield dict(H=H, dtype=dtypes[i % len(dtypes)], is_causal=True, window=None,
                 lengths="ragged", bias="B1TS", segments="sorted")
    if _combined("segment_ids", "mask"):
      yield dict(H=H, dtype=dtypes[(i + 1) % len(dtypes)], is_causal=False, window=None,
                 lengths=None, mask="patches", segments="unsorted")


def _combined(*features):
  """Whether both Hopper passes take these features together."""
  return all(frozenset(features) in kernel.combinations
             for kernel in (_config.SM90_FORWARD, _config.SM90_BACKWARD))


def run(H, dtype, is_causal, window, lengths, B=3, T=167, S=201, N=4, K=2, deterministic=False,
        grads=True, softcap=None, segments=None, mask=None, bias=None):
  # Inputs from numpy: compiling jax.random's kernels under the sanitizer costs more host time
  # than the attention itself.
  rng = np.random.default_rng(H)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
             for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  kwargs = dict(is_causal=is_causal, local_window_size=window, logits_soft_cap=softcap)
  if lengths == "ragged":  # a full item, one without queries, one without keys
    kwargs.update(query_seq_lengths=jnp.array([T, 0, 100], jnp.int32),
                  key_value_seq_lengths=jnp.array([S + 5, 130, 0], jnp.int32))
  elif lengths == "mostly_empty":  # one item in six has queries that see keys
    b = np.arange(B)
    kwargs.update(query_seq_lengths=jnp.asarray(np.where(b % 2 == 1, 0, T), jnp.int32),
                  key_value_seq_lengths=jnp.asarray(np.where(b % 6 == 0, S, 0), jnp.int32))
  if segments is not None:  # documents of 1-90 positions; the ids of q and k/v runs differ
    q_seg, kv_seg = (np.sort(rng.integers(0, L // 45, (B, L)), axis=-1).astype(np.int32)
                     for L in (T, S))
    if segments == "unsorted":
      q_seg, kv_seg = rng.permuted(q_seg, axis=-1), rng.permuted(kv_seg, axis=-1)
    kwargs.update(query_segment_ids=jnp.asarray(q_seg), key_value_segment_ids=jnp.asarray(kv_seg))
  if mask == "patches":  # 16 x 16 patches empty, full or random, per head; rows of none
    kind = np.repeat(np.repeat(rng.integers(0, 3, (B, N, -(-T // 16), -(-S // 16))), 16, -2),
                     16, -1)[..., :T, :S]
    keep = np.where(kind == 2, rng.random((B, N, T, S)) < 0.5, kind == 1)
    keep[..., ::7, :] = False
    kwargs.update(mask=jnp.asarray(keep))
  if mask == "keys":  # runs of 16 keys empty, full or random per batch item, for every head
    kind = np.repeat(rng.integers(0, 3, (B, 1, 1, -(-S // 16))), 16, -1)[..., :S]
    kwargs.update(mask=jnp.asarray(np.where(kind == 2, rng.random((B, 1, 1, S)) < 0.5,
                                            kind == 1)))
  if bias is not None:  # differentiated: the backward computes dbias
    spec = "BNTS" if bias == "lowest" else bias
    shape = tuple({"B": B, "N": N, "T": T, "S": S, "1": 1}[c] for c in spec)
    values = rng.standard_normal(shape, np.float32) * 3
    if bias == "lowest":  # 16 x 16 patches of the lowest value or -inf; the first column kept
      kind = np.repeat(np.repeat(rng.integers(0, 3, (B, N, -(-T // 16), -(-S // 16))), 16, -2),
                       16, -1)[..., :T, :S]
      kind[..., :16] = 2
      values = np.where(kind == 0, float(jnp.finfo(dtype).min),
                        np.where(kind == 1, -np.inf, values))
  primals = (q, k, v) + (() if bias is None else (jnp.asarray(values, dtype),))
  dout = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32), dtype)

  def loss(q, k, v, bias=None):
    out, lse = jax_flash.dot_product_attention(q, k, v, bias, return_residual=True,
                                               deterministic=deterministic, **kwargs)
    live = jnp.isfinite(lse)
    return (jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) +
            jnp.sum(jnp.where(live, lse, 0.0))), out

  if grads:
    argnums = tuple(range(len(primals)))
    (_, out), results = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*primals)
  else:
    _, out = jax.jit(loss)(*primals)
    results = ()
  for name, x in zip(("output", "dq", "dk", "dv", "dbias"), (out, *results)):
    if not np.isfinite(np.asarray(x.astype(jnp.float32))).all():
      raise AssertionError(f"non-finite {name} for H={H} {dtype} causal={is_causal} "
                           f"window={window} lengths={lengths} softcap={softcap} "
                           f"segments={segments} mask={mask} bias={bias}")
  return out


def main(argv: list[str]) -> int:
  _primitive._KERNEL_BIAS_LSE_LIMIT = float("inf")
  if not jax_flash.gpu_available():
    print("no GPU or no CUDA handlers", file=sys.stderr)
    return 2
  all_cases = list(cases())
  selected = [int(i) for i in argv] or range(len(all_cases))
  with jax.default_device(jax.devices("gpu")[0]):
    for index in selected:
      start = time.perf_counter()
      run(**all_cases[index])
      print(f"ok {index} {all_cases[index]} {time.perf_counter() - start:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
