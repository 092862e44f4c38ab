"""Mask arrays on the Hopper kernels: the block classes that let the kernels skip empty blocks
and the bits they read in partial ones (`_primitive._mask_tiles`), the routing of mask calls,
and forward and gradients of structured and random masks against the float64 definition
(tests/_reference.py) under the criterion of tests/_tolerances.py.

The masks are shaped to give every block class at the kernels' tiles: causal and document
masks (empty blocks above the diagonal and between documents, full blocks below, partial ones
on the edges), padding masks broadcast over queries, and random masks made of 32 x 32 patches
that are empty, full or mixed, per head, with grouped key/value heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _primitive
from jax_flash._validation import canonicalize

from _harness import (Case, check_equals_is_causal, check_forward, check_gradients,
                      check_ordered_dq_reduction, check_vmap_over_logit_arrays, handler_attrs,
                      make_inputs)
from _platforms import GPU, with_platform


# --- block classes -----------------------------------------------------------------------------


def _brute_classes(mask, block_m, block_n):
  """The classes of _mask_blocks, block by block: 0 none kept, 1 some, 2 all."""
  *lead, T, S = mask.shape
  bm, bn = (block_m if T > 1 else 1), (block_n if S > 1 else 1)
  MB, SB = -(-T // bm), -(-S // bn)
  out = np.zeros((*lead, MB, SB), np.int8)
  for i in range(MB):
    for j in range(SB):
      block = mask[..., i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
      out[..., i, j] = np.where(block.all(axis=(-2, -1)), 2, block.any(axis=(-2, -1)))
  return out


@dataclasses.dataclass(frozen=True)
class _Tile:
  block_m: int
  block_n: int


@pytest.mark.parametrize("shape", [(2, 3, 200, 300), (1, 1, 129, 64), (2, 1, 1, 300),
                                   (3, 2, 200, 1), (2, 4, 1, 1, 70, 90)], ids=str)
def test_mask_blocks_classify_every_block(shape):
  """Random masks with runs of empty and full blocks, sizes that do not divide the tile, and
  broadcast query or key axes (one block along them)."""
  rng = np.random.default_rng(0)
  coarse = rng.integers(0, 3, shape[:-2] + (-(-shape[-2] // 16), -(-shape[-1] // 16)))
  mask = np.repeat(np.repeat(coarse, 16, -2), 16, -1)[..., :shape[-2], :shape[-1]]
  mask = np.where(mask == 2, rng.random(shape) < 0.5, mask == 1)
  T, S = shape[-2:]
  for tile in (_Tile(64, 128), _Tile(192, 128), _Tile(128, 80)):
    want = _brute_classes(mask, tile.block_m, tile.block_n)
    assert set(np.unique(want)) <= {0, 1, 2}
    got = np.asarray(_primitive._mask_blocks(jnp.asarray(mask), tile))
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, want)
    # Counted from the bits, where the tile's blocks along the bits' columns are whole words
    # (and the same classes whichever way _mask_tiles takes).
    for rows_are_keys in (False, True):
      bits = _primitive._mask_bits(jnp.asarray(mask), T, S, rows_are_keys)
      from_bits = _primitive._mask_blocks_from_bits(jnp.asarray(mask), bits, tile, rows_are_keys)
      col_block, col_extent = ((tile.block_m, shape[-2]) if rows_are_keys
                               else (tile.block_n, shape[-1]))
      assert (from_bits is None) == (col_block % 32 != 0 or col_extent == 1)
      if from_bits is not None:
        np.testing.assert_array_equal(np.asarray(from_bits), want)
      blocks, _ = _primitive._mask_tiles(jnp.asarray(mask), tile, T, S, rows_are_keys)
      np.testing.assert_array_equal(np.asarray(blocks), want)


@pytest.mark.parametrize("spec", ["BNTS", "B1TS", "B11S", "BNT1", "1111"])
@pytest.mark.parametrize("T,S", [(70, 33), (64, 96)], ids=["T70-S33", "T64-S96"])
def test_mask_bits_pack_rows(spec, T, S):
  """Bit j % 32 of word j / 32 of row i is mask[i, j] (queries as rows) or mask[j, i] (keys as
  rows) for every column j; a row axis the mask broadcasts stays one row."""
  rng = np.random.default_rng(1)
  sizes = dict(B=2, N=3, T=T, S=S)
  mask = rng.random(tuple(1 if c == "1" else sizes[c] for c in spec)) < 0.5
  tiles = _primitive._mask_tiles(jnp.asarray(mask), _Tile(64, 64), T, S, rows_are_keys=False)
  assert len(tiles) == 2 and tiles[1].dtype == np.uint32
  for rows_are_keys in (False, True):
    own = np.swapaxes(mask, -1, -2) if rows_are_keys else mask
    cols = T if rows_are_keys else S
    rows = np.broadcast_to(own, own.shape[:-1] + (cols,))
    bits = np.asarray(_primitive._mask_bits(jnp.asarray(mask), T, S, rows_are_keys))
    assert bits.shape == rows.shape[:-1] + (-(-cols // 32),)
    unpacked = (bits[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    unpacked = unpacked.reshape(bits.shape[:-1] + (-1,))
    np.testing.assert_array_equal(unpacked[..., :cols].astype(bool), rows)
  assert _primitive._mask_tiles(None, _Tile(64, 64), T, S, rows_are_keys=False) == []


def test_mask_tiles_capture_no_constants():
  """The mask operands are computed inside custom_partitioning's implementation, which must
  capture no constants (jax asserts it when the call is partitioned)."""
  mask = jnp.ones((2, 1, 70, 90), bool)
  for rows_are_keys in (False, True):
    jaxpr = jax.make_jaxpr(lambda m: _primitive._mask_tiles(
        m, _Tile(64, 128), 70, 90, rows_are_keys=rows_are_keys))(mask)
    assert not jaxpr.consts


# --- routing -----------------------------------------------------------------------------------


def test_gpu_routing_of_mask_arrays():
  """A mask array runs on the Hopper kernels alone, and with soft-capping (Gemma 2's masks),
  segment ids or a bias where a feature combination lists the pair ("feature_combinations"),
  with two of them on the blockwise path; mask problems run on each head dim's default
  forward tile."""
  for kernel in (_config.SM90_FORWARD, _config.SM90_BACKWARD):
    none = dict(bias=False, mask=False, softcap=False, segment_ids=False)
    assert kernel.takes(**dict(none, mask=True))
    for other in ("softcap", "segment_ids", "bias"):
      assert kernel.takes(**dict(none, mask=True, **{other: True})) == (
          frozenset({"mask", other}) in kernel.combinations)
    assert not kernel.takes(**dict(none, mask=True, softcap=True, segment_ids=True))
    assert not kernel.takes(**dict(none, mask=True, bias=True, softcap=True))
  for head_dim in range(8, _config.GPU_MAX_HEAD_DIM + 1, 8):
    tile = _config.SM90_FORWARD.tile_for(head_dim)
    assert tile.is_default and tile.head_dim >= head_dim
    assert not any(head_dim <= t.head_dim < tile.head_dim for t in _config.SM90_FORWARD_TILES)
    assert _config.SM90_BACKWARD.tile_for(head_dim).head_dim == tile.head_dim
  config = canonicalize(*(np.zeros((1, 4, 2, 8), np.float32),) * 3, None, None, scale=None,
                        is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None).config
  route = functools.partial(_primitive._on_gpu_kernel, kernel_call="kernel",
                            blockwise_call="blockwise", q=jnp.zeros((1, 4, 2, 8), jnp.bfloat16),
                            config=config, q_seg=None)
  mask = jnp.ones((1, 1, 4, 4), bool)
  assert route(_config.SM90_FORWARD, bias=None, mask=mask) == "kernel"
  assert route(_config.SM90_FORWARD, bias=mask.astype(jnp.float32), mask=mask) == "blockwise"
  paired = "kernel" if frozenset({"mask", "bias"}) in _config.SM90_FORWARD.combinations else (
      "blockwise")
  assert route(_config.SM90_FORWARD, bias=mask.astype(jnp.bfloat16), mask=mask) == paired


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_calls_with_mask_arrays_reach_the_kernels(platform):
  """On the GPU, forward and backward with a mask array compile to the Hopper kernels' calls
  with the mask's block classes, with soft-capping too; with segment ids and soft-capping too,
  to the blockwise path."""
  q = jnp.zeros((1, 256, 2, 64), _config.GPU_DTYPES[0])
  mask = jnp.tril(jnp.ones((256, 256), bool))[None, None]

  def hlo(**options):
    def loss(q, k, v):
      return jnp.sum(jax_flash.dot_product_attention(q, k, v, mask=mask, **options)
                     .astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()

  text = hlo()
  assert "jax_flash_fwd" in text and "jax_flash_bwd" in text
  capped = hlo(logits_soft_cap=5.0)
  assert "jax_flash_fwd" in capped and "jax_flash_bwd" in capped
  ids = jnp.zeros((1, 256), jnp.int32)
  packed = hlo(query_segment_ids=ids, key_value_segment_ids=ids, logits_soft_cap=5.0)
  assert "jax_flash_fwd" not in packed and "jax_flash_bwd" not in packed


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_handler_checks_the_mask_operands(platform):
  """The CUDA handler takes a mask as its block classes and bits, in place of the array, and
  rejects the array, classes without bits, classes of another tile and bits of the other pass
  with an error naming them (the Python layer always passes the right ones)."""
  from jax_flash import _extension

  _extension.ensure_registered()
  dtype = _config.GPU_DTYPES[0]
  q = jnp.zeros((1, 256, 2, 64), dtype)
  mask = jnp.ones((1, 1, 256, 256), bool)
  tile = _config.SM90_FORWARD.tile_for(64)
  blocks, bits = _primitive._mask_tiles(mask, tile, 256, 256, rows_are_keys=False)
  wrong_blocks = jnp.ones(blocks.shape[:-1] + (blocks.shape[-1] + 1,), jnp.int8)
  wrong_bits = jnp.ones(bits.shape[:-1] + (bits.shape[-1] * 2,), jnp.uint32)
  call = jax.ffi.ffi_call(_extension.FORWARD_TARGET,
                          (jax.ShapeDtypeStruct(q.shape, dtype),
                           jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)))
  jax.block_until_ready(call(q, q, q, blocks, bits, **handler_attrs(has_mask_blocks=True)))
  for operands, array, with_tiles, name in (
      ((q, q, q, mask), True, False, "not as the array"),
      ((q, q, q, mask, blocks, bits), True, True, "not both"),
      ((q, q, q, wrong_blocks, bits), False, True, "mask_blocks"),
      ((q, q, q, blocks, wrong_bits), False, True, "mask_bits")):
    with pytest.raises(jax.errors.JaxRuntimeError, match=name):
      jax.block_until_ready(call(*operands,
                                 **handler_attrs(has_mask=array, has_mask_blocks=with_tiles)))


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_mask_built_in_the_program_is_not_stored(platform):
  """A mask the program computes from segment ids reaches the Hopper calls only through its
  block classes and bits, into whose reductions it fuses: the compiled program holds no
  (B, 1, T, S) boolean buffer."""
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 128)[None].repeat(2, 0)
  q = jnp.zeros((2, 512, 2, 64), _config.GPU_DTYPES[0])

  def loss(q, k, v, ids):
    mask = (ids[:, :, None] == ids[:, None, :])[:, None]
    out = jax_flash.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    return jnp.sum(out.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, ids).compile().as_text()
  assert "jax_flash_fwd" in text and "jax_flash_bwd" in text
  assert "pred[2,1,512,512]" not in text


# --- the GPU -----------------------------------------------------------------------------------


def _causal(T, S):
  return np.tril(np.ones((T, S), bool))


def _documents(runs, T, S):
  """Causal attention within documents of the given lengths (the dense mask Flax builds from
  segment ids), (T, S) with T == S."""
  ids = np.repeat(np.arange(len(runs)), runs)
  return (ids[:, None] == ids[None, :]) & _causal(T, S)


def _patches(rng, shape, patch=32):
  """32 x 32 patches that are empty, full or random, each (independently per leading index)."""
  *lead, T, S = shape
  kind = rng.integers(0, 3, (*lead, -(-T // patch), -(-S // patch)))
  kind = np.repeat(np.repeat(kind, patch, -2), patch, -1)[..., :T, :S]
  return np.where(kind == 2, rng.random(shape) < 0.5, kind == 1)


GPU_MASKS = {
    # spec, builder (case, rng) -> mask of the spec's shape
    "causal": ("11TS", lambda c, rng: _causal(c.T, c.S)[None, None]),
    "documents": ("B1TS", lambda c, rng: np.stack(
        [_documents((300, 1, 211), c.T, c.S), _documents((512,), c.T, c.S)])[:, None]),
    "padding": ("B11S", lambda c, rng: (np.arange(c.S) < np.array([[400], [77]]))[:, None, None]),
    # Keys alone, per head: runs of 64 empty, full or random keys, in blocks of 80 keys too.
    "keys-per-head": ("BN1S", lambda c, rng: _patches(rng, (c.B, c.N, 1, c.S), patch=64)),
    "patches-per-head": ("BNTS", lambda c, rng: _patches(rng, (c.B, c.N, c.T, c.S))),
    "dead-rows": ("1NTS", lambda c, rng: _patches(rng, (1, c.N, c.T, c.S))
                  & (np.arange(c.T) % 5 != 0)[:, None]),
}


def _mask_case(H, dtype, name) -> tuple[Case, object]:
  spec, build = GPU_MASKS[name]
  case = Case(B=2, T=512, S=512, N=4, K=2, H=H, dtype=dtype, mask=spec)
  inp = make_inputs(case)
  mask = build(case, np.random.default_rng(1))
  assert mask.shape == inp.mask.shape, (name, mask.shape, inp.mask.shape)
  return case, dataclasses.replace(inp, mask=mask)


@with_platform("platform,H,name",
               [pytest.param("gpu", H, name, marks=pytest.mark.gpu, id=f"gpu-{H}-{name}")
                for H in _config.GPU_HEAD_DIMS for name in GPU_MASKS])
def test_gpu_mask_arrays(platform, H, name):
  """Forward and gradients (also through the log-sum-exp) of each mask, in every GPU dtype,
  on the Hopper kernels."""
  for dtype in _config.GPU_DTYPES:
    case, inp = _mask_case(H, dtype.name, name)
    check_forward(case, platform, inp=inp)
    check_gradients(case, platform, inp=inp, through_lse=True)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_mask_with_causal_window_and_lengths(platform):
  """A mask array on top of causal attention, a window and ragged lengths, T != S."""
  case = Case(B=2, T=300, S=700, N=4, K=1, H=128, dtype=_config.GPU_DTYPES[0].name,
              mask="BNTS", is_causal=False, window=(350, 40), q_lens=(300, 131),
              kv_lens=(650, 700))
  inp = make_inputs(case)
  inp = dataclasses.replace(inp, mask=_patches(np.random.default_rng(2), inp.mask.shape))
  check_forward(case, platform, inp=inp)
  check_gradients(case, platform, inp=inp)


#: Tiles that also take mask and bias arrays for the few query rows they prefer (decoding).
_FEW_ROWS_TILES = [t for t in _config.SM90_FORWARD_TILES if t.arrays and t.prefer_rows_up_to]


@with_platform("platform,H,rows",
               [pytest.param("gpu", t.head_dim, rows, marks=pytest.mark.gpu,
                             id=f"gpu-{t.head_dim}-T{rows}")
                for t in _FEW_ROWS_TILES for rows in (1, 37, t.prefer_rows_up_to)])
def test_gpu_logit_arrays_of_few_query_rows(platform, H, rows):
  """Few query rows with logit arrays run on the tile that prefers them, which classifies
  their blocks as its own: a mask per head with dead rows and ragged lengths, the same under a
  soft cap, and a bias with a mask of keys where the kernels combine the pair; forward and
  gradients, both dtypes. (As many query as key/value heads and 700 keys: the plain forward,
  not the decoding split.)"""
  assert _config.SM90_FORWARD.tile_for(H, rows, arrays=True).arrays
  for dtype in _config.GPU_DTYPES:
    case = Case(B=2, T=rows, S=700, N=4, K=4, H=H, dtype=dtype.name, mask="BNTS",
                q_lens=(rows, max(rows - 3, 0)), kv_lens=(700, 301))
    inp = make_inputs(case)
    inp = dataclasses.replace(inp, mask=_patches(np.random.default_rng(3), inp.mask.shape)
                              & (np.arange(rows) % 5 != 1)[:, None])
    check_forward(case, platform, inp=inp)
    check_gradients(case, platform, inp=inp)
    if _config.SM90_FORWARD.takes(bias=False, mask=True, softcap=True, segment_ids=False):
      capped = dataclasses.replace(case, softcap=20.0)
      check_forward(capped, platform, inp=inp)
    if _config.SM90_FORWARD.takes(bias=True, mask=True, softcap=False, segment_ids=False):
      paired = dataclasses.replace(case, bias="1NTS", mask="B11S")
      check_forward(paired, platform)
      check_gradients(paired, platform)


@with_platform("platform,H,cap",
               [pytest.param("gpu", H, cap, marks=pytest.mark.gpu, id=f"gpu-{H}-cap{cap:g}")
                for H, cap in zip(_config.GPU_HEAD_DIMS, (5.0, 30.0, 50.0))])
def test_gpu_mask_with_soft_capping(platform, H, cap):
  """A mask array with soft-capped logits (Gemma 2's local and global masks under a cap), on
  the kernels: per-head masks with dead rows, both dtypes, forward and gradients."""
  for dtype in _config.GPU_DTYPES:
    case, inp = _mask_case(H, dtype.name, "dead-rows")
    case = dataclasses.replace(case, softcap=cap)
    check_forward(case, platform, inp=inp)
    check_gradients(case, platform, inp=inp, through_lse=True)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_causal_mask_array_equals_is_causal(platform):
  """The causal mask as an array gives is_causal's result within rounding of the two tiles."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 1000, 4, 64)), _config.GPU_DTYPES[0])
             for _ in range(3))
  check_equals_is_causal(q, k, v, mask=jnp.asarray(_causal(1000, 1000))[None, None])


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_deterministic_gradients_with_mask(platform):
  """The ordered dQ reduction visits empty mask blocks too (its turns count them): bit-identical
  from run to run, and equal to the unordered one within rounding."""
  case, inp = _mask_case(128, _config.GPU_DTYPES[0].name, "documents")
  q, k, v, mask = (jnp.asarray(x) for x in (inp.q, inp.k, inp.v, inp.mask))
  check_ordered_dq_reduction(q, k, v, mask=mask)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_gpu_vmap_over_masks_only(platform):
  """vmap over the mask alone (q, k, v unmapped: the kernels broadcast them) equals the calls one
  by one, up to the order of the dQ additions."""
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 384, 2, 128)), _config.GPU_DTYPES[0])
             for _ in range(3))
  masks = jnp.asarray(np.stack([_patches(rng, (1, 2, 384, 384)) for _ in range(3)]))
  check_vmap_over_logit_arrays(q, k, v, "mask", masks)
