"""The FFI calls, their batching, partitioning and custom_vjp.

Forward:  jax_flash_fwd(q, k, v, [bias], [bias_blocks], [mask], [mask_tiles], [q_len],
          [kv_len], [segments]) -> (out, lse (B, N, T))
Backward: jax_flash_bwd(q, k, v, out, lse, dout, dlse, [bias], [bias_blocks], [mask],
          [mask_tiles], [q_len], [kv_len], [segments]) -> (dq, dk, dv, [dbias])

where [bias_blocks], passed to the Hopper kernels with a bias (attribute has_bias_blocks), is
the class of every block of the bias for the pass's tile (`_bias_tiles`: 0 where the bias
drops every logit of the block, which the kernels skip), and [dbias] is returned where the
bias is differentiated (attribute has_dbias; the custom_vjp knows it from symbolic zeros).

where [mask_tiles], passed to the Hopper kernels in place of a mask (attribute
has_mask_blocks; [mask] goes to the CPU kernels), is two operands (`_mask_tiles`): the class of
every (query block, key block) of the mask for the pass's tile (0 when the block keeps no
logit, 2 when it keeps all, 1 otherwise) and the mask packed as bits along the pass's rows
(queries forward, keys backward). A mask the program computes (from segment ids, from
positions) then fuses into those reductions and is never stored. The kernels skip the
empty blocks and read the bits only in the partial ones, so a causal, padding or document
mask costs little more than the structured arguments would. With both a mask and a bias the
kernels read the mask's classes alone (`_logit_array_tiles`); [bias_blocks] is then absent.

where [segments], present with segment ids (attribute has_segment_ids), is four operands:
q_seg (B, T) and kv_seg (B, S), the ids, and kv_span (B, T, 2) and q_span (B, S, 2), computed
here from them (`_spans`): for each query the range [lo, hi) of key positions whose id can
equal its own, and for each key the same range of query positions, so that the kernels visit
only the key (query) blocks that overlap it. A range is exact where the ids searched are
non-decreasing (packed sequences): every position inside has the id, and the Hopper kernels
then skip the per-element id test in blocks that lie inside the ranges of all their rows.
Otherwise it is the whole axis, marked inexact by lo = -1; the kernels then compare the ids
everywhere. The results of the calls are typed like their operands inside shard_map
(_varying.varying_like), as those of the blockwise path are.

Layers, outermost first:

  custom_vjp     `attention`: the gradient also flows through the log-sum-exp: the backward
                 folds dlse into the row term, dS = P * (dP - (rowsum(dO * O) - dlse)). A bias
                 that is not differentiated gets no gradient computed (symbolic zeros tell;
                 the backward call then returns no dbias).
  custom_vmap    `_batched`: batching with the semantics of ffi_call's
                 vmap_method="expand_dims". A vmapped axis arrives as a leading batch axis on
                 every operand; operands that are not mapped get a leading axis of extent 1,
                 which the kernels broadcast (no copies of K/V or bias). Nested vmaps stack
                 further leading axes. The backward writes its gradients with the full batch
                 shape (one per mapped problem; the bias gradient keeps the bias's own extent
                 on its B axis) and jax sums them over the axes of unmapped primals. This covers
                 vmap over any subset of the arguments, vmap(grad) and grad(vmap) with one
                 mechanism. (custom_partitioning has no batching rule, hence this layer.)
  custom_partitioning  `_sharding.partitioned`: under jit with sharded operands each device
                 runs the call on its shard (batch and head sharding; see _sharding.py).
  platform routing  `_forward_impl` / `_backward_impl`: the CPU runs both passes in the C++
                 kernels. On CUDA the Hopper kernels run both passes of calls in the dtypes
                 they list ("sm90" "dtypes" in kernel_configs.json). A call in another dtype
                 (float32, or float64 with x64 enabled), like every call to a build without
                 the CUDA handlers, runs both passes through the blockwise JAX path instead
                 (_blockwise.py, same semantics, O(T * block) memory, float32 and float64
                 matmuls at HIGHEST precision: no TF32), and so does a pass whose kernel does
                 not read the call's bias or mask array, apply its logit soft-capping or take
                 its segment ids (the kernel's "features"). The platform is chosen per
                 lowering (lax.platform_dependent), not at trace time.

All layers below the custom_vjp take operands with any number r >= 1 of leading batch axes
(q (batch..., T, N, H), bias (batch..., N|1, T|1, S|1), lengths (batch...), segment ids
(batch..., T) and (batch..., S)); every batch axis of an operand has the problem's extent or 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _blockwise, _config, _extension, _ring, _sharding, _split_kv, _varying
from ._validation import AttentionConfig, gpu_kernels_run



def _attributes(config: AttentionConfig, bias, bias_tiles, mask, mask_tiles, q_len, kv_len,
                q_seg, bias_gradient=False, query_groups=1, gpu_tile=None) -> dict:
  # XLA FFI attributes are typed exactly: float64 scale and softcap, int64 windows, bool flags.
  return dict(
      scale=np.float64(config.scale),
      softcap=np.float64(config.softcap),
      window_left=np.int64(config.window_left),
      window_right=np.int64(config.window_right),
      has_bias=bias is not None,
      has_bias_blocks=bool(bias_tiles),
      has_mask=mask is not None,
      has_mask_blocks=bool(mask_tiles),
      has_q_seqlens=q_len is not None,
      has_kv_seqlens=kv_len is not None,
      has_segment_ids=q_seg is not None,
      deterministic=bool(config.deterministic),
      has_dbias=bool(bias_gradient),
      query_groups=np.int64(query_groups),
      # The Hopper forward's tile (Kernel.tile_for), which the CUDA handler runs; 0 elsewhere.
      block_m=np.int64(0 if gpu_tile is None else gpu_tile.block_m),
  )


def _present(*operands):
  return [x for x in operands if x is not None]


def _batch_shape(q, *operands) -> tuple[int, ...]:
  """The problem's batch shape: per leading axis, the extent of the operands that are not 1."""
  rank = q.ndim - 3
  batch = list(q.shape[:rank])
  for x in operands:
    if x is not None:
      for i in range(rank):
        if x.shape[i] != 1:
          batch[i] = x.shape[i]
  return tuple(batch)


# --- FFI calls ---------------------------------------------------------------------------------


def _spans(ids, other):
  """For each entry of `ids` (batch..., L) the range [lo, hi) of positions of `other`
  (batch..., M) holding the same id, as (batch..., L, 2) int32 over the batch shape of both:
  the bounds of a binary search where the batch item's `other` is non-decreasing, else
  (-1, M): the whole axis, marked inexact. O(L log M) per batch item; nothing of size L x M is
  formed."""
  batch = jnp.broadcast_shapes(ids.shape[:-1], other.shape[:-1])
  L, M = ids.shape[-1], other.shape[-1]

  def one(ids, other):
    ordered = jnp.all(other[1:] >= other[:-1])
    # Unrolled: the rolled search is a loop of small kernels on the GPU (10x slower there).
    lo = jnp.searchsorted(other, ids, side="left", method="scan_unrolled")
    hi = jnp.searchsorted(other, ids, side="right", method="scan_unrolled")
    lo = jnp.where(ordered, lo, -1)
    hi = jnp.where(ordered, hi, M)
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)

  flat = [jnp.broadcast_to(x, batch + x.shape[-1:]).reshape(-1, x.shape[-1])
          for x in (ids, other)]
  return jax.vmap(one)(*flat).reshape(batch + (L, 2))


def _segments(q_seg, kv_seg) -> list:
  """The FFI calls' segment operands: [q_seg, kv_seg, kv_span, q_span], or none."""
  if q_seg is None:
    return []
  return [q_seg, kv_seg, _spans(q_seg, kv_seg), _spans(kv_seg, q_seg)]


def _block_extents(mask, tile):
  """(bm, bn, MB, SB): the tile's block sizes along the mask's query and key axes (1 along an
  axis the mask broadcasts) and the blocks' counts."""
  T, S = mask.shape[-2:]
  bm = tile.block_m if T > 1 else 1
  bn = tile.block_n if S > 1 else 1
  return bm, bn, -(-T // bm), -(-S // bn)


def _classes(kept, mask, tile):
  """Block classes from the kept pairs of each block, (batch..., N|1, MB, SB): 0 none, 1 some,
  2 all of the block's pairs inside the sequences."""
  T, S = mask.shape[-2:]
  bm, bn, MB, SB = _block_extents(mask, tile)
  # From iotas, not numpy arrays: custom_partitioning's implementation may capture no constants.
  pairs = (jnp.minimum(bm, T - bm * lax.iota(jnp.int32, MB))[:, None] *
           jnp.minimum(bn, S - bn * lax.iota(jnp.int32, SB))[None, :])
  return jnp.where(kept == pairs, 2, (kept > 0).astype(jnp.int8)).astype(jnp.int8)


def _mask_blocks(mask, tile):
  """The classes of the mask's (tile.block_m x tile.block_n) blocks, (batch..., N|1, MB|1,
  SB|1) int8: 0 no logit kept, 1 some, 2 all; one block along an axis the mask broadcasts.
  Positions past the sequence ends count as neither kept nor dropped."""
  *lead, T, S = mask.shape
  bm, bn, MB, SB = _block_extents(mask, tile)
  padded = jnp.pad(mask, [(0, 0)] * len(lead) + [(0, MB * bm - T), (0, SB * bn - S)])
  # Kept pairs per block, summed along the contiguous key axis first.
  per_row = padded.reshape(*lead, MB * bm, SB, bn).sum(-1, dtype=jnp.int32)
  return _classes(per_row.reshape(*lead, MB, bm, SB).sum(-2), mask, tile)


def _mask_blocks_from_bits(mask, bits, tile, rows_are_keys):
  """_mask_blocks counted from the packed bits (_mask_bits) instead of the mask: an eighth of
  the bytes read. For tiles whose blocks along the bits' columns are whole words and masks
  that do not broadcast that axis (whose words repeat one bit into the padding); None
  otherwise."""
  bm, bn, MB, SB = _block_extents(mask, tile)
  col_block, row_block = (bm, bn) if rows_are_keys else (bn, bm)
  col_axis = -2 if rows_are_keys else -1
  if mask.shape[col_axis] == 1 or col_block % 32:
    return None
  *lead, rows, words = bits.shape
  row_blocks, col_blocks = (SB, MB) if rows_are_keys else (MB, SB)
  block_words = col_block // 32
  if row_block == 1:
    # Blocks of one row (a mask of keys alone in the forward: Flax's padding and decoding
    # masks): the words' counts added as slices, which XLA fuses with the classes'
    # comparisons into one kernel; as a reduction they took a kernel of their own (0.8-1.5 us
    # of a decoding step on an H200, bench/RESULTS.md).
    padded = jnp.pad(bits, [(0, 0)] * (len(lead) + 1) + [(0, col_blocks * block_words - words)])
    block = padded.reshape(*lead, row_blocks, col_blocks, block_words)
    kept = lax.population_count(block[..., 0]).astype(jnp.int32)
    for i in range(1, block_words):
      kept = kept + lax.population_count(block[..., i]).astype(jnp.int32)
  else:
    counts = lax.population_count(bits).astype(jnp.int32)
    counts = jnp.pad(counts, [(0, 0)] * len(lead) + [(0, row_blocks * row_block - rows),
                                                     (0, col_blocks * block_words - words)])
    kept = counts.reshape(*lead, row_blocks, row_block, col_blocks, block_words).sum((-3, -1))
  return _classes(jnp.swapaxes(kept, -1, -2) if rows_are_keys else kept, mask, tile)


def _mask_bits(mask, T, S, rows_are_keys):
  """The mask's rows as bits, (batch..., N|1, rows|1, ceil(columns / 32)) uint32, bit j % 32
  of word j / 32 holding column j: rows are queries (T) and columns keys (S), or the reverse
  with rows_are_keys. A row axis the mask broadcasts stays one row; a broadcast column axis
  gives whole words of its one bit (the bits past the last column are 0 otherwise)."""
  axis = -2 if rows_are_keys else -1  # the columns' axis in the mask
  cols = T if rows_are_keys else S
  words = -(-cols // 32)
  if mask.shape[axis] == 1 and cols > 1:
    shape = list(mask.shape)
    shape[axis] = words
    bits = jnp.broadcast_to(jnp.where(mask, jnp.uint32(0xFFFFFFFF), jnp.uint32(0)), shape)
  else:
    pad = [(0, 0)] * mask.ndim
    pad[axis] = (0, words * 32 - cols)
    padded = jnp.pad(mask, pad)
    if rows_are_keys:  # packed along the queries in place; only the packed words transposed
      shifts = lax.iota(jnp.uint32, 32)[:, None]
      split = padded.reshape(*mask.shape[:-2], words, 32, mask.shape[-1]).astype(jnp.uint32)
      bits = jnp.sum(split << shifts, axis=-2, dtype=jnp.uint32)
    else:
      split = padded.reshape(*mask.shape[:-1], words, 32).astype(jnp.uint32)
      bits = jnp.sum(split << lax.iota(jnp.uint32, 32), axis=-1, dtype=jnp.uint32)
  return jnp.swapaxes(bits, -1, -2) if rows_are_keys else bits


def _mask_tiles(mask, tile, T, S, rows_are_keys):
  """The Hopper pass's mask operands [mask_blocks, mask_bits] for its tile (rows: queries in
  the forward, keys in the backward), which the Hopper calls take in place of the mask; none
  without a mask. Computed on the device, not folded into constants: for a mask built from
  shapes alone (causal, Flax's make_causal_mask) XLA would otherwise fold these reductions at
  compile time, seconds per million blocks' elements, where the device takes microseconds."""
  if mask is None:
    return []
  # An opaque false keeps these reductions off the constants while the mask's own producer
  # (positions compared, segment ids compared) still fuses into them: the FFI calls take the
  # mask only through these operands, so a mask built in the program is never stored.
  mask = mask | lax.optimization_barrier(jnp.zeros((), bool))
  bits = _mask_bits(mask, T, S, rows_are_keys)
  blocks = _mask_blocks_from_bits(mask, bits, tile, rows_are_keys)
  return [_mask_blocks(mask, tile) if blocks is None else blocks, bits]


# A bias drops a block of logits where every entry is at most _BIAS_DROPS_AT and every row of
# the block holds an entry above _BIAS_ROW_HOLDS somewhere. With logits q.k scale below 2^96 in
# magnitude, each dropped logit then lies more than 2^98 below its row's maximum: its
# probability is exactly 0 in float32 (and in float64), so skipping the block changes nothing.
# A row whose every entry is that low keeps its blocks (jax's definition averages such rows).
_BIAS_DROPS_AT = -2.0 ** 100
_BIAS_ROW_HOLDS = -2.0 ** 99


def _bias_tiles(bias, tile):
  """The Hopper pass's bias operand [bias_blocks] for its tile: the class of each block,
  (batch..., N|1, MB|1, SB|1) int8, 0 where the bias drops the block (see _BIAS_DROPS_AT), else
  1; none without a bias. A causal bias of bfloat16's lowest value drops the blocks above the
  diagonal (float16's, -65504, lies above _BIAS_DROPS_AT: only -inf drops). By a CUDA kernel
  of jax_flash's that decides most blocks by their first entry (a learned bias: one load per
  block) and reads a block, then its rows, only where that entry is low."""
  if bias is None:
    return []
  _extension.ensure_registered()
  *lead, _, _ = bias.shape
  _, _, MB, SB = _block_extents(bias, tile)
  call = jax.ffi.ffi_call(_extension.BIAS_CLASSES_TARGET,
                          jax.ShapeDtypeStruct((*lead, MB, SB), jnp.int8),
                          vmap_method="expand_dims")
  classes = call(bias, block_m=np.int64(tile.block_m), block_n=np.int64(tile.block_n),
                 drops_at=np.float32(_BIAS_DROPS_AT), row_holds=np.float32(_BIAS_ROW_HOLDS))
  return [_varying.varying_like(classes, bias)]


def _logit_array_tiles(bias, mask, tile, T, S, rows_are_keys):
  """The Hopper pass's operands for its mask and bias arrays on its tile: (_mask_tiles,
  _bias_tiles). With both, the kernels read the mask's block classes alone and the bias travels
  without its own: blocks the bias would drop are computed, to probabilities of 0. (Whether
  the bias drops a block depends on the entries the mask keeps, a pass over both arrays'
  shapes together: B times the bias for a bias shared by a batch's items, slower than the
  blocks it saves.)"""
  if mask is not None:
    return _mask_tiles(mask, tile, T, S, rows_are_keys), []
  return [], _bias_tiles(bias, tile)


def _forward_call(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, *, gpu_tile=None,
                  query_groups=1, parts=False):
  """The forward FFI call. With gpu_tile (the Hopper tile that runs the problem,
  Kernel.tile_for; the CUDA handler takes its block_m) a mask or bias travels with its operands
  for the Hopper kernels (`_mask_tiles`, `_bias_tiles`). With
  query_groups G > 1 the kernels attend q (batch..., T, N, H) as N / G heads of T*G rows (row
  t*G + g of head k: query row t of head k*G + g), which a mask or bias and the lengths then
  describe; the results keep the call's layouts. With parts (a split's, `_split_kv`) the output
  comes in the accumulation dtype, unrounded for the merge."""
  _extension.ensure_registered()
  batch = _batch_shape(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)
  T, N, _ = q.shape[-3:]
  acc = _config.accumulation_dtype(q.dtype)
  result_types = (jax.ShapeDtypeStruct(batch + q.shape[-3:], acc if parts else q.dtype),
                  jax.ShapeDtypeStruct(batch + (N, T), acc))
  call = jax.ffi.ffi_call(_extension.FORWARD_TARGET, result_types, vmap_method="expand_dims")
  tiles, bias_tiles = [], []
  if gpu_tile is not None:
    tiles, bias_tiles = _logit_array_tiles(bias, mask, gpu_tile, T * query_groups, k.shape[-3],
                                           rows_are_keys=False)
    mask = None  # taken as its tiles
  operands = (q, k, v, *_present(bias), *bias_tiles, *_present(mask), *tiles,
              *_present(q_len, kv_len), *_segments(q_seg, kv_seg))
  results = call(*operands, **_attributes(config, bias, bias_tiles, mask, tiles, q_len, kv_len,
                                          q_seg, query_groups=query_groups, gpu_tile=gpu_tile))
  return tuple(_varying.varying_like(results, *operands))


def _forward_merge_call(out, lse, query_rows: int, dtype):
  """`_split_kv.merge` by the CUDA handler's kernel: the chunks' float32 out (..., P, T*G, K, H)
  and lse (..., P, K, T*G), or in the call's layout (G = 1, K = N), -> the call's out (..., T,
  K*G, H) in `dtype` (16-bit) and lse (..., K*G, T)."""
  _extension.ensure_registered()
  lead, (P, TG, K, H) = out.shape[:-4], out.shape[-4:]
  T, N = query_rows, TG * K // query_rows
  items = math.prod(lead)
  call = jax.ffi.ffi_call(_extension.FORWARD_MERGE_TARGET,
                          (jax.ShapeDtypeStruct((items, T, N, H), dtype),
                           jax.ShapeDtypeStruct((items, N, T), lse.dtype)))
  parts = (out.reshape(items, P, TG, K, H), lse.reshape((items,) + lse.shape[-3:]))
  merged, total = _varying.varying_like(call(*parts), *parts)
  return merged.reshape(lead + (T, N, H)), total.reshape(lead + (N, T))


def _backward_call(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg,
                   kv_seg, *, bias_gradient, gpu_workspace=False):
  """The backward FFI call; the bias gradient is computed where `bias_gradient` (else None).
  With gpu_workspace (the CUDA handler) one more result: the Hopper backward's workspace,
  which XLA allocates with the call's other buffers and which is dropped here (a temporary of
  the compiled program); a mask or bias then travels with its operands for the Hopper kernels
  (`_mask_tiles`, `_bias_tiles`)."""
  _extension.ensure_registered()
  batch = _batch_shape(q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg, kv_seg)
  rank = len(batch)
  result_types = [jax.ShapeDtypeStruct(batch + x.shape[rank:], x.dtype) for x in (q, k, v)]
  bias_gradient = bias is not None and bias_gradient
  if bias_gradient:
    # The bias gradient has the full extent on the axes added by vmap (one gradient per mapped
    # problem) and the bias's own extents elsewhere: the kernels sum over the axes where a
    # problem broadcasts the bias.
    result_types.append(jax.ShapeDtypeStruct(batch[:-1] + bias.shape[rank - 1:], bias.dtype))
  if gpu_workspace:
    T, N, H = q.shape[rank:]
    nbytes = _extension.backward_workspace_bytes(
        math.prod(batch), T, N, H, q.dtype, config.deterministic,
        dbias_elements=math.prod(result_types[3].shape) if bias_gradient else 0,
        seqlen_k=k.shape[-3])
    result_types.append(jax.ShapeDtypeStruct((nbytes,), np.uint8))
  call = jax.ffi.ffi_call(_extension.BACKWARD_TARGET, tuple(result_types),
                          vmap_method="expand_dims")
  tiles, bias_tiles = [], []
  if gpu_workspace:
    tile = _config.SM90_BACKWARD.tile_for(q.shape[-1])
    tiles, bias_tiles = _logit_array_tiles(bias, mask, tile, q.shape[-3], k.shape[-3],
                                           rows_are_keys=True)
    mask = None  # taken as its tiles
  operands = (q, k, v, out, lse, dout, dlse, *_present(bias), *bias_tiles, *_present(mask),
              *tiles, *_present(q_len, kv_len), *_segments(q_seg, kv_seg))
  grads = _varying.varying_like(
      call(*operands, **_attributes(config, bias, bias_tiles, mask, tiles, q_len, kv_len, q_seg,
                                    bias_gradient)),
      *operands)
  dq, dk, dv = grads[:3]
  return dq, dk, dv, (grads[3] if bias_gradient else None)


# --- the blockwise path on several batch axes --------------------------------------------------


def _over_batch_axes(fn, operands, batch):
  """fn on canonical operands (one batch axis), applied over the leading batch axes of
  `operands` by nested vmaps: an operand of extent 1 on an axis of larger extent is not mapped
  there (broadcast). Results have the full extent on every mapped axis."""
  if len(batch) == 1:
    return fn(*operands)
  extent = batch[0]
  mapped = [x is not None and (x.shape[0] == extent) for x in operands]
  args = [x if m or x is None else x[0] for x, m in zip(operands, mapped)]
  in_axes = [0 if m else None for m in mapped]
  inner = lambda *xs: _over_batch_axes(fn, xs, batch[1:])
  return jax.vmap(inner, in_axes=in_axes)(*args)


def _with_auto_axes(fn, operands):
  """fn(*operands) with the explicit mesh axes of the operands' types (arrays, or pytrees of
  them) made Auto inside.

  Over a mesh with explicit axes a call's operands carry their shardings in their types, and
  lax.platform_dependent traces the blockwise path on them whatever the platform: its
  reshapes and updates of sharded axes would need their output shardings spelled out. Its
  results are typed unsharded, as the FFI calls' results are. A partitioned call runs each
  shard on local operands, which have no explicit axes: only the unpartitioned program changes.
  """
  meshes = (jax.typeof(x).sharding.mesh for x in jax.tree.leaves(operands))
  mesh = next((m for m in meshes if m.explicit_axes), None)
  if mesh is None:
    return fn(*operands)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=replicated)(*operands)


def _blockwise_forward(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  def canonical(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
    return _blockwise.forward(config, q, k, v, bias, mask, q_len, kv_len, q_seg=q_seg,
                              kv_seg=kv_seg)

  def run(*operands):
    return tuple(_over_batch_axes(canonical, operands, _batch_shape(*operands)))

  return _with_auto_axes(run, (q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg))


def _blockwise_backward(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg,
                        kv_seg, *, bias_gradient):
  def run(renormalize, operands):
    def canonical(q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg, kv_seg):
      dq, dk, dv, dbias = _blockwise.backward(config, q, k, v, bias, mask, q_len, kv_len, out,
                                              lse, dout, dlse, q_seg=q_seg, kv_seg=kv_seg,
                                              renormalize=renormalize)
      return dq, dk, dv, (dbias if bias_gradient else None)

    return tuple(_over_batch_axes(canonical, operands, _batch_shape(*operands)))

  def call(lse, operands):
    # Decided once for the whole call, outside the vmaps over batch axes (where a cond would
    # turn into a select running both branches): the renormalisation pass runs only when some
    # row needs it.
    return lax.cond(_blockwise.needs_renormalization(lse), functools.partial(run, True),
                    functools.partial(run, False), operands)

  operands = (q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg, kv_seg)
  return _with_auto_axes(call, (lse, operands))


# --- platform routing --------------------------------------------------------------------------


def _on_gpu_kernel(kernel: _config.Kernel, kernel_call, blockwise_call, config, q, bias, mask,
                   q_seg, bias_gradient=False):
  """The Hopper kernel's call when it reads the call's optional arrays (a bias of the inputs'
  dtype, with a scale of at least GPU_BIAS_MIN_SCALE), applies its logit soft-capping, takes
  its segment ids and computes the gradients asked for, else the blockwise one."""
  if bias is not None and (bias.dtype != q.dtype or config.scale < _config.GPU_BIAS_MIN_SCALE):
    return blockwise_call
  if kernel.takes(bias=bias is not None, mask=mask is not None, softcap=config.softcap > 0,
                  segment_ids=q_seg is not None, bias_gradient=bias_gradient):
    return kernel_call
  return blockwise_call


def _cuda_call(kernel: _config.Kernel, kernel_call, blockwise_call, config, q, bias, mask,
               q_seg, bias_gradient=False):
  """The call a pass runs on CUDA: the blockwise one where the Hopper kernels cannot run the
  call's dtype (or were not built), else as `_on_gpu_kernel` decides by its features."""
  if not gpu_kernels_run(q.dtype):
    return blockwise_call
  return _on_gpu_kernel(kernel, kernel_call, blockwise_call, config, q, bias, mask, q_seg,
                        bias_gradient)


def _gpu_forward_call(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  """The Hopper forward; decoding shapes (few query rows against many keys) by `_split_kv`."""
  plan = _split_kv.plan(q.shape, k.shape, config, q_seg is not None)
  arrays = bias is not None or mask is not None
  if plan is None:
    tile = _config.SM90_FORWARD.tile_for(q.shape[-1], q.shape[-3], config.window_right == 0,
                                         q_seg is not None, arrays=arrays)
    return _forward_call(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg,
                         gpu_tile=tile)

  def call(q, k, v, bias, mask, q_len, kv_len, query_groups, parts):
    # Split problems have no window (_split_kv.plan): rows are the packed query heads'. A
    # split's chunks of few rows run on the decoding kernel at the lengths it is preferred for.
    rows = q.shape[-3] * query_groups
    if parts and _config.SM90_DECODE.runs(q.shape[-1], rows, k.shape[-3], arrays=arrays,
                                          softcap=config.softcap > 0):
      tile = _config.SM90_DECODE
    else:
      tile = _config.SM90_FORWARD.tile_for(q.shape[-1], rows, arrays=arrays)
    return _forward_call(config, q, k, v, bias, mask, q_len, kv_len, None, None, gpu_tile=tile,
                         query_groups=query_groups, parts=parts)

  return _split_kv.forward(plan, call, q, k, v, bias, mask, q_len, kv_len,
                           merge_parts=_forward_merge_call, rows_in_place=True)


def _forward_impl(spec: _sharding.CallSpec, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  config = spec.config
  cuda = _cuda_call(_config.SM90_FORWARD, functools.partial(_gpu_forward_call, config),
                    functools.partial(_blockwise_forward, config), config, q, bias, mask, q_seg)
  return tuple(lax.platform_dependent(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg,
                                      cpu=functools.partial(_forward_call, config), cuda=cuda))


# |lse| from which the Hopper backward with a bias hands a call to the blockwise one. The
# kernels recover P = exp2(S log2(e) - lse log2(e)) from the float32 lse, which shifts every P of
# a row by up to half an ulp of lse (relative 1e-4 here, within the 16-bit dtypes' rounding);
# without a bias logits stay far below this, but a bias can carry them anywhere (1e30 used as a
# mask), and only the blockwise backward renormalises such rows. math.inf: never (the kernels
# alone, as tests/_sanitizer_driver.py runs them).
_KERNEL_BIAS_LSE_LIMIT = 2.0 ** 12


def _bias_gradient_sums(out, k, bias) -> bool:
  """Whether dbias sums over some axis of the problem: the bias broadcasts over the batch
  axis of jax.nn's B (dbias is full on the axes vmap adds), the heads, the queries or the
  keys."""
  B, T, N = out.shape[-4:-1]
  return any(own == 1 and extent > 1
             for own, extent in zip(bias.shape[-4:], (B, N, T, k.shape[-3])))


def _gpu_backward_call(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg,
                       kv_seg, *, bias_gradient):
  """The Hopper backward; with a bias, the blockwise one where some |lse| reaches
  _KERNEL_BIAS_LSE_LIMIT (decided on the device, once per call), and where a deterministic
  backward's bias gradient sums over an axis (the kernels add into it atomically from many
  CTAs, in no fixed order)."""
  operands = (q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg, kv_seg)
  kernel = functools.partial(_backward_call, config, bias_gradient=bias_gradient,
                             gpu_workspace=True)
  blockwise = functools.partial(_blockwise_backward, config, bias_gradient=bias_gradient)
  if (bias is not None and bias_gradient and config.deterministic and
      _bias_gradient_sums(out, k, bias)):
    return blockwise(*operands)
  if bias is None or math.isinf(_KERNEL_BIAS_LSE_LIMIT):
    return kernel(*operands)
  return lax.cond(_blockwise.needs_renormalization(lse, _KERNEL_BIAS_LSE_LIMIT),
                  lambda ops: tuple(blockwise(*ops)), lambda ops: tuple(kernel(*ops)), operands)


def _backward_impl(spec: _sharding.CallSpec, q, k, v, out, lse, dout, dlse, bias, mask, q_len,
                   kv_len, q_seg, kv_seg):
  config = spec.config
  wanted = spec.bias_gradient
  cuda = _cuda_call(_config.SM90_BACKWARD,
                    functools.partial(_gpu_backward_call, config, bias_gradient=wanted),
                    functools.partial(_blockwise_backward, config, bias_gradient=wanted), config,
                    q, bias, mask, q_seg, wanted)
  return tuple(lax.platform_dependent(q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len,
                                      q_seg, kv_seg,
                                      cpu=functools.partial(_backward_call, config,
                                                            bias_gradient=wanted),
                                      cuda=cuda))


_partitioned_forward = _sharding.partitioned(_sharding.FORWARD, _forward_impl)
_partitioned_backward = _sharding.partitioned(_sharding.BACKWARD, _backward_impl)


# --- batching ----------------------------------------------------------------------------------


def _expand_unbatched(in_batched, operands):
  return [x if x is None or batched else jnp.expand_dims(x, 0)
          for x, batched in zip(operands, in_batched)]


@functools.lru_cache(maxsize=None)
def _batched(kind: str, spec: _sharding.CallSpec):
  """The partitioned call of `kind` ("fwd" or "bwd") with expand_dims batching."""
  partitioned = _partitioned_forward if kind == "fwd" else _partitioned_backward

  @jax.custom_batching.custom_vmap
  def call(*operands):
    return tuple(partitioned(spec, *operands))

  @call.def_vmap
  def rule(axis_size, in_batched, *operands):
    del axis_size
    results = call(*_expand_unbatched(in_batched, operands))
    return results, tuple(None if x is None else True for x in results)

  return call


def _forward(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  spec = _sharding.CallSpec.of(config, bias, mask, q_len, kv_len, q_seg)
  return _batched("fwd", spec)(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)


def _backward(config, q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg, kv_seg,
              bias_gradient=True):
  spec = _sharding.CallSpec.of(config, bias, mask, q_len, kv_len, q_seg, bias_gradient)
  return _batched("bwd", spec)(q, k, v, out, lse, dout, dlse, bias, mask, q_len, kv_len, q_seg,
                               kv_seg)


# --- custom_vjp --------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(config: AttentionConfig, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  """Attention on canonical operands; returns (out (B, T, N, H), lse (B, N, T))."""
  return _forward(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward_of_derivative(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  """The forward as the derivative rule runs it. Only a second derivative (grad of grad,
  Hessian-vector products, jax.hessian) differentiates it, and its jvp rule says that this is
  not supported, where jax would fail deep inside with "Differentiation rule for
  'custom_partitioning' not implemented"."""
  return _forward(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)


@_forward_of_derivative.defjvp
def _forward_of_derivative_jvp(config, primals, tangents):
  del config, primals, tangents
  raise NotImplementedError(
      "jax_flash's attention (dot_product_attention, ring_attention) has first derivatives "
      "only (grad, vjp, value_and_grad, and jit/vmap/checkpoint of them): its backward is a "
      "kernel that is not differentiated again, so grad of grad, Hessian-vector products and "
      "jax.hessian are not supported. For higher-order derivatives use "
      "jax.nn.dot_product_attention (implementation='xla').")


@jax.tree_util.register_pytree_node_class
class _BiasResidual:
  """The bias as the backward keeps it, with whether its gradient is wanted (static: a bias
  that is not differentiated, such as a constant one, lets the Hopper backward run)."""

  def __init__(self, bias, wanted: bool):
    self.bias, self.wanted = bias, wanted

  def tree_flatten(self):
    return (self.bias,), self.wanted

  @classmethod
  def tree_unflatten(cls, wanted, children):
    return cls(children[0], wanted)


def _primal(x):
  return x.value if isinstance(x, jax.custom_derivatives.CustomVJPPrimal) else x


def _dense(cotangent):
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent


def _attention_fwd(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
  # symbolic_zeros: the operands come as CustomVJPPrimal leaves, which say whether the bias
  # is differentiated.
  bias_wanted = bias is not None and bias.perturbed
  q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg = map(
      _primal, (q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg))
  out, lse = _forward_of_derivative(config, q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)
  return (out, lse), (q, k, v, _BiasResidual(bias, bias_wanted), mask, q_len, kv_len, q_seg,
                      kv_seg, out, lse)


def _attention_bwd(config, residuals, cotangents):
  q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, out, lse = residuals
  dout, dlse = map(_dense, cotangents)
  dq, dk, dv, dbias = _backward(config, q, k, v, out, lse, dout.astype(out.dtype),
                                dlse.astype(lse.dtype), bias.bias, mask, q_len, kv_len, q_seg,
                                kv_seg, bias_gradient=bias.wanted)
  # Masks, sequence lengths and segment ids are not differentiable, nor a bias whose gradient
  # is not wanted: None is their zero cotangent.
  return dq, dk, dv, dbias, None, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# --- ring attention inside shard_map -----------------------------------------------------------


def _ring_forward_block(config, q, k, v, q_len, kv_len, q_seg, kv_seg):
  return _forward(config, q, k, v, None, None, q_len, kv_len, q_seg, kv_seg)


def _ring_forward_block_of_derivative(config, q, k, v, q_len, kv_len, q_seg, kv_seg):
  return _forward_of_derivative(config, q, k, v, None, None, q_len, kv_len, q_seg, kv_seg)


def _ring_backward_block(config, q, k, v, out, lse, dout, dlse, q_len, kv_len, q_seg, kv_seg):
  return _backward(config, q, k, v, out, lse, dout, dlse, None, None, q_len, kv_len, q_seg,
                   kv_seg)[:3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(ring: _ring.Ring, q, k, v, q_len, kv_len, q_seg, kv_seg):
  """Ring attention over `ring` on canonical local operands; returns (out, lse (B, N, T))."""
  return _ring.forward(ring, _ring_forward_block, q, k, v, q_len, kv_len, q_seg, kv_seg)


def _ring_attention_fwd(ring, q, k, v, q_len, kv_len, q_seg, kv_seg):
  out, lse = _ring.forward(ring, _ring_forward_block_of_derivative, q, k, v, q_len, kv_len,
                           q_seg, kv_seg)
  return (out, lse), (q, k, v, q_len, kv_len, q_seg, kv_seg, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents):
  q, k, v, q_len, kv_len, q_seg, kv_seg, out, lse = residuals
  dout, dlse = cotangents
  dq, dk, dv = _ring.backward(ring, _ring_backward_block, q, k, v, out, lse,
                              dout.astype(out.dtype), dlse.astype(lse.dtype), q_len, kv_len,
                              q_seg, kv_seg)
  return dq, dk, dv, None, None, None, None


ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
