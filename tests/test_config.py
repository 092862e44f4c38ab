"""The configuration table, what capabilities() reports, and how the extension was built."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _extension


def _table():
  return json.loads(pathlib.Path(_config.__file__).with_name("kernel_configs.json").read_text())


def test_capabilities_agree_with_the_table():
  caps = jax_flash.capabilities()
  assert caps["cpu"]["dtypes"] == [d.name for d in _config.CPU_DTYPES]
  assert caps["gpu"]["dtypes"] == [d.name for d in _config.GPU_DTYPES]
  assert caps["gpu"]["blockwise_dtypes"] == [d.name for d in _config.GPU_BLOCKWISE_DTYPES]
  assert caps["gpu"]["built"] == _extension.cuda_built()
  assert caps["gpu"]["tiles"] == [
      dict(head_dim=t.head_dim, block_m=t.block_m, block_n=t.block_n, stages=t.stages,
           prefer_causal_up_to=t.prefer_causal_up_to, prefer_segment_ids=t.prefer_segment_ids,
           prefer_rows_up_to=t.prefer_rows_up_to, arrays=t.arrays, softmax_turns=t.softmax_turns,
           one_loop_body=t.one_loop_body)
      for t in _config.SM90_FORWARD_TILES]
  assert [t["head_dim"] for t in caps["gpu"]["backward_tiles"]] == list(_config.GPU_HEAD_DIMS)
  assert caps["gpu"]["kernel_features"] == {
      "forward": sorted(_config.SM90_FORWARD.features),
      "backward": sorted(_config.SM90_BACKWARD.features)}
  assert caps["gpu"]["kernel_feature_combinations"] == {
      "forward": sorted(sorted(c) for c in _config.SM90_FORWARD.combinations),
      "backward": sorted(sorted(c) for c in _config.SM90_BACKWARD.combinations)}
  assert str(_config.GPU_MAX_HEAD_DIM) in caps["gpu"]["head_dims"]
  assert str(_config.GPU_HEAD_DIM_MULTIPLE) in caps["gpu"]["head_dims"]


def test_config_module_reads_the_json_table():
  table = _table()
  assert [d.name for d in _config.CPU_DTYPES] == table["cpu"]["dtypes"]
  assert [d.name for d in _config.GPU_DTYPES] == table["sm90"]["dtypes"]
  assert _config.GPU_HEAD_DIM_MULTIPLE == table["sm90"]["head_dim_multiple"]
  for kernel, entry in ((_config.SM90_FORWARD, table["sm90"]["forward"]),
                        (_config.SM90_BACKWARD, table["sm90"]["backward"])):
    assert list(kernel.tiles) == [type(t)(**row) for t, row in zip(kernel.tiles, entry["tiles"])]
    assert len(kernel.tiles) == len(entry["tiles"])
    assert kernel.features == frozenset(entry["features"])
    assert kernel.combinations == {frozenset(c) for c in entry.get("feature_combinations", ())}
    assert all(len(c) >= 2 and c <= kernel.features for c in kernel.combinations)
  assert _config.GPU_MAX_HEAD_DIM == max(row["head_dim"] for row in table["sm90"]["forward"]["tiles"])


def _config_of_table(tmp_path, edit):
  """jax_flash/_config.py loaded beside a copy of the table changed by edit(table)."""
  table = _table()
  edit(table)
  (tmp_path / "kernel_configs.json").write_text(json.dumps(table))
  (tmp_path / "_config.py").write_text(pathlib.Path(_config.__file__).read_text())
  spec = importlib.util.spec_from_file_location("_config_of_table", tmp_path / "_config.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # where its dataclasses look for their module
  try:
    spec.loader.exec_module(module)
  finally:
    del sys.modules[spec.name]
  return module


def _first_forward_tile(table, where):
  return next(row for row in table["sm90"]["forward"]["tiles"] if where(row))


def _drop_preferences(row):
  for key in [k for k in row if k.startswith("prefer_")]:
    del row[key]


@pytest.mark.parametrize("edit,message", [
    (lambda t: _first_forward_tile(t, lambda r: r["block_m"] != 128).update(softmax_turns=True),
     "softmax_turns needs a tile of two consumer warpgroups"),
    (lambda t: _drop_preferences(_first_forward_tile(t, lambda r: "prefer_causal_up_to" in r)),
     "exactly one sm90 forward tile without preferences"),
    (lambda t: t["sm90"]["backward"]["tiles"].pop(), "must cover the same head dims"),
    (lambda t: t["sm90"]["forward"]["feature_combinations"].append(["softcap", "dropout"]),
     "a feature combination names a feature"),
], ids=["turns-off-two-warpgroups", "two-defaults", "head-dims-differ", "unknown-combination"])
def test_the_table_is_checked_at_import(tmp_path, edit, message):
  unchanged = _config_of_table(tmp_path, lambda table: None)
  assert ([dataclasses.asdict(t) for t in unchanged.SM90_FORWARD_TILES] ==
          [dataclasses.asdict(t) for t in _config.SM90_FORWARD_TILES])
  with pytest.raises(ImportError, match=message):
    _config_of_table(tmp_path, edit)


def test_kernel_features_route_calls():
  kernel = _config.Kernel(tiles=(), features=frozenset({"bias"}))
  plain = dict(bias=False, mask=False, softcap=False, segment_ids=False)
  assert kernel.takes(**plain)
  assert kernel.takes(**dict(plain, bias=True))
  assert not kernel.takes(**dict(plain, mask=True))
  assert not kernel.takes(**dict(plain, bias=True, softcap=True))
  assert not kernel.takes(**dict(plain, segment_ids=True))
  assert not _config.Kernel(tiles=(), features=frozenset()).takes(**dict(plain, bias=True))
  capping = _config.Kernel(tiles=(), features=frozenset({"softcap"}))
  assert capping.takes(**dict(plain, softcap=True))
  assert not capping.takes(**dict(plain, mask=True, softcap=True))
  packing = _config.Kernel(tiles=(), features=frozenset({"segment_ids"}))
  assert packing.takes(**dict(plain, segment_ids=True))
  assert not packing.takes(**dict(plain, softcap=True, segment_ids=True))
  # Several features together only where a combination lists exactly them.
  masking = _config.Kernel(tiles=(), features=frozenset({"mask", "softcap", "segment_ids"}),
                           combinations=frozenset({frozenset({"softcap", "segment_ids"})}))
  assert masking.takes(**dict(plain, mask=True))
  assert masking.takes(**dict(plain, softcap=True, segment_ids=True))
  assert not masking.takes(**dict(plain, mask=True, softcap=True))
  assert not masking.takes(**dict(plain, mask=True, segment_ids=True))
  both = _config.Kernel(tiles=(), features=masking.features, combinations=frozenset(
      {frozenset({"softcap", "segment_ids"}), frozenset({"softcap", "mask"})}))
  assert both.takes(**dict(plain, mask=True, softcap=True))
  assert not both.takes(**dict(plain, mask=True, softcap=True, segment_ids=True))
  three = _config.Kernel(tiles=(), features=masking.features, combinations=frozenset(
      {frozenset({"softcap", "segment_ids", "mask"})}))
  assert three.takes(**dict(plain, mask=True, softcap=True, segment_ids=True))
  assert not three.takes(**dict(plain, mask=True, softcap=True))
  # A bias whose gradient is wanted needs a kernel that computes it.
  assert not kernel.takes(**dict(plain, bias=True, bias_gradient=True))
  differentiating = _config.Kernel(tiles=(), features=frozenset({"bias", "bias_gradient"}))
  assert differentiating.takes(**dict(plain, bias=True, bias_gradient=True))


def test_table_is_consistent():
  assert set(_config.GPU_DTYPES) <= set(_config.CPU_DTYPES)
  assert len(set(_config.GPU_HEAD_DIMS)) == len(_config.GPU_HEAD_DIMS)
  for tile in _config.SM90_FORWARD_TILES:
    assert tile.head_dim % _config.GPU_HEAD_DIM_MULTIPLE == 0
    assert tile.block_m > 0 and tile.block_n > 0 and tile.stages > 0
  # Each head dim: one default forward tile, and no two tiles alike.
  for head_dim in _config.GPU_HEAD_DIMS:
    tiles = [t for t in _config.SM90_FORWARD_TILES if t.head_dim == head_dim]
    assert sum(t.is_default for t in tiles) == 1, tiles
    assert len({t.block_m for t in tiles}) == len(tiles), tiles
  for tile in _config.SM90_BACKWARD_TILES:
    # Each of the two MMA warpgroups holds 64 key rows of S^T and of dK/dV, 64 rows of dQ.
    assert tile.block_n == 64 * tile.sdp_warpgroups_along_keys
    assert tile.block_n == 64 * tile.dkv_warpgroups_along_keys
    assert tile.block_m == 64 * tile.dq_warpgroups_along_queries
    assert tile.head_dim % (tile.dq_slices * 8) == 0
    assert min(tile.stages_q, tile.stages_do, tile.stages_ds) >= 1
    assert tile.stages_q_with_bias >= 0


def test_forward_tile_for_follows_the_preferences():
  """A problem runs on the first tile of its head dim whose preference names it (with a mask
  or bias array, the first that also takes arrays), else on the default: the forward call
  passes that tile's block_m to the CUDA handler, and a mask's or bias's blocks are classified
  for it (the handler checks the classes' extents)."""
  forward = _config.SM90_FORWARD
  for head_dim in _config.GPU_HEAD_DIMS:
    tiles = [t for t in _config.SM90_FORWARD_TILES if t.head_dim == head_dim]
    default = next(t for t in tiles if t.is_default)
    assert forward.tile_for(head_dim) == default
    assert len({t.block_m for t in tiles}) == len(tiles)  # block_m names the tile
    for rows in (1, 16, 64, 65, 128, 2048, 2049, 8192):
      for causal in (False, True):
        for segment_ids in (False, True):
          for arrays in (False, True):
            tile = forward.tile_for(head_dim, rows, causal, segment_ids, arrays)
            listed = [t for t in tiles if t.prefers(rows, causal, segment_ids)
                      and (t.arrays or not arrays)]
            assert tile == (listed[0] if listed else default)
            assert tile.is_default or (tile.prefers(rows, causal, segment_ids)
                                       and (tile.arrays or not arrays))
  decoding = [t for t in _config.SM90_FORWARD_TILES if t.arrays and t.prefer_rows_up_to]
  for tile in decoding:  # a decoding step's packed rows run on the tile that prefers few rows
    assert forward.tile_for(tile.head_dim, tile.prefer_rows_up_to, arrays=True) == tile


def test_gpu_head_dim_supported_follows_the_table():
  m, top = _config.GPU_HEAD_DIM_MULTIPLE, _config.GPU_MAX_HEAD_DIM
  for h in range(0, top + 3 * m):
    expected = 0 < h <= top and h % m == 0
    assert _config.gpu_head_dim_supported(h) == expected, h


def test_capabilities_is_plain_data():
  """JSON-serialisable, so it can be printed or logged as is."""
  caps = jax_flash.capabilities()
  assert json.loads(json.dumps(caps)) == caps


def test_gpu_available_needs_the_cuda_handlers(monkeypatch):
  monkeypatch.setattr(_extension, "cuda_built", lambda: False)
  assert jax_flash.gpu_available() is False


def test_gpu_available_matches_the_devices():
  try:
    has_gpu = len(jax.devices("gpu")) > 0
  except RuntimeError:
    has_gpu = False
  assert jax_flash.gpu_available() == (has_gpu and _extension.cuda_built())


def test_build_info():
  info = jax_flash.build_info()
  assert info["cuda"] == _extension.cuda_built()
  # Says in words whether the CUDA handlers were built, and why not.
  assert info["cuda_status"].startswith("built" if info["cuda"] else "not built: ")
  assert isinstance(info["jaxlib_version"], str) and info["jaxlib_version"]
  major, minor = info["xla_ffi_api_version"]
  assert major >= 0 and minor >= 0


def test_registration_is_idempotent():
  _extension.ensure_registered()
  _extension.ensure_registered()
  q = np.ones((1, 3, 1, 4), np.float32)
  out = jax_flash.dot_product_attention(q, q, q)
  np.testing.assert_array_equal(np.asarray(out), q)  # equal logits: the mean of equal values
