"""The table of compiled configurations (kernel_configs.json), read once.

The same file drives the CMake build (which instantiates the Hopper kernels from it and compiles
in which optional operands each takes), the argument validation and the routing of calls in this
package, and the tests.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

_TABLE = json.loads((pathlib.Path(__file__).with_name("kernel_configs.json")).read_text())


def accumulation_dtype(dtype) -> np.dtype:
  """The dtype every kernel and path accumulates in, and of the log-sum-exp: float64 for
  float64 inputs, float32 for every other dtype."""
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Sm90ForwardTile:
  head_dim: int
  block_m: int
  block_n: int
  stages: int
  # Problems this tile runs instead of its head dim's default (the tile with none): causal
  # ones of at most this many query rows (0: none), those with segment ids, and those of at
  # most this many query rows (0: none).
  prefer_causal_up_to: int = 0
  prefer_segment_ids: bool = False
  prefer_rows_up_to: int = 0
  # Takes mask and bias arrays too, and prefers the calls with them its preference names (a
  # default tile takes them always).
  arrays: bool = False
  # The consumer warpgroups take turns at the softmax (tiles of two warpgroups, kernels without
  # soft-capping; kernel only).
  softmax_turns: bool = False
  # The consumers take every key block through one loop body (kernel only).
  one_loop_body: bool = False

  @property
  def is_default(self) -> bool:
    return not (self.prefer_causal_up_to or self.prefer_segment_ids or self.prefer_rows_up_to)

  def prefers(self, rows: int, causal: bool, segment_ids: bool) -> bool:
    """Whether the tile's preferences name a problem of `rows` query rows (the kernel's rows:
    packed query heads count as rows), causal or not, with or without segment ids."""
    return bool((self.prefer_causal_up_to and causal and rows <= self.prefer_causal_up_to) or
                (self.prefer_segment_ids and segment_ids) or
                (self.prefer_rows_up_to and rows <= self.prefer_rows_up_to))


@dataclasses.dataclass(frozen=True)
class Sm90BackwardTile:
  head_dim: int
  block_m: int  # queries per step
  block_n: int  # keys per CTA
  stages_q: int
  stages_do: int
  stages_ds: int
  dq_slices: int
  sdp_warpgroups_along_keys: int
  dkv_warpgroups_along_keys: int
  dq_warpgroups_along_queries: int
  # Q stages of the kernels that read a bias (0: stages_q).
  stages_q_with_bias: int = 0


@dataclasses.dataclass(frozen=True)
class Sm90DecodeKernel:
  """The Hopper decoding forward (kernel_fwd_decode.h): a split's key chunks against a few
  packed query rows, in place of the forward tiles."""
  rows: int  # at most this many packed query rows: the block_m the forward call names it by
  # (head dim, longest chunk in keys it takes in place of the tiles, None: any) per head dim
  # it has, exactly these
  prefer_keys_up_to: tuple

  @property
  def block_m(self) -> int:
    return self.rows

  @property
  def head_dims(self) -> tuple:
    return tuple(head_dim for head_dim, _ in self.prefer_keys_up_to)

  def runs(self, head_dim: int, rows: int, keys: int, *, arrays: bool, softcap: bool) -> bool:
    """Whether a split's forward of `rows` packed query rows against chunks of `keys` keys runs
    on this kernel (splits take no window or segment ids, `_split_kv.plan`)."""
    longest = dict(self.prefer_keys_up_to)
    if head_dim not in longest or rows > self.rows or arrays or softcap:
      return False
    return longest[head_dim] is None or keys <= longest[head_dim]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One compiled kernel: its tiles and its optional features: the logit arrays it reads
  ("bias", "mask"), whether it soft-caps logits ("softcap"), whether it takes segment ids
  ("segment_ids") and, for a backward, whether it computes the bias gradient
  ("bias_gradient"). It takes each feature alone, and two together where `combinations` (a
  set of frozensets) lists them."""
  tiles: tuple
  features: frozenset
  combinations: frozenset = frozenset()

  def takes(self, *, bias: bool, mask: bool, softcap: bool, segment_ids: bool,
            bias_gradient: bool = False) -> bool:
    """Whether a call with (or without) bias and mask arrays, logit soft-capping and segment
    ids runs on this kernel, computing the bias gradient where `bias_gradient`."""
    if bias_gradient and "bias_gradient" not in self.features:
      return False
    wanted = (("bias", bias), ("mask", mask), ("softcap", softcap),
              ("segment_ids", segment_ids))
    used = {name for name, on in wanted if on}
    return used <= self.features and (len(used) <= 1 or used in self.combinations)

  def tile_for(self, head_dim: int, rows: int | None = None, causal: bool = False,
               segment_ids: bool = False, arrays: bool = False):
    """The tile of the smallest compiled head dim that covers `head_dim`; of a forward's
    several, the one a problem of `rows` query rows (None: a problem no preference names)
    runs on: the first whose preference names the problem (Sm90ForwardTile.prefers) and, for
    a problem with a mask or bias array (`arrays`), that takes arrays; else the default. The
    forward call passes its block_m to the CUDA handler, which runs that tile (the one rule),
    and a mask's or bias's block classes are computed for it."""
    covering = min(t.head_dim for t in self.tiles if t.head_dim >= head_dim)
    tiles = [t for t in self.tiles if t.head_dim == covering]
    if len(tiles) == 1:
      return tiles[0]
    default = next(t for t in tiles if t.is_default)
    if rows is None:
      return default
    return next((t for t in tiles
                 if t.prefers(rows, causal, segment_ids) and (t.arrays or not arrays)), default)


def _dtype(name: str) -> np.dtype:
  import ml_dtypes  # jax dependency; provides bfloat16 as a numpy dtype

  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _kernel(entry: dict, tile_type) -> Kernel:
  combinations = frozenset(frozenset(c) for c in entry.get("feature_combinations", ()))
  if any(not c <= frozenset(entry["features"]) for c in combinations):
    raise ImportError("kernel_configs.json: a feature combination names a feature its kernel "
                      "does not list")
  return Kernel(tuple(tile_type(**row) for row in entry["tiles"]), frozenset(entry["features"]),
                combinations)


CPU_DTYPES = tuple(_dtype(d) for d in _TABLE["cpu"]["dtypes"])
GPU_DTYPES = tuple(_dtype(d) for d in _TABLE["sm90"]["dtypes"])  # the Hopper kernels' dtypes
# Those the GPU runs on the blockwise JAX path instead (float32 and float64 matmuls at HIGHEST).
GPU_BLOCKWISE_DTYPES = tuple(d for d in CPU_DTYPES if d not in GPU_DTYPES)
GPU_HEAD_DIM_MULTIPLE: int = _TABLE["sm90"]["head_dim_multiple"]
# The Hopper kernels add a bias divided by the scale: with a bias, smaller scales go blockwise.
GPU_BIAS_MIN_SCALE: float = _TABLE["sm90"]["bias_min_scale"]
SM90_FORWARD = _kernel(_TABLE["sm90"]["forward"], Sm90ForwardTile)
SM90_BACKWARD = _kernel(_TABLE["sm90"]["backward"], Sm90BackwardTile)
_DECODE = _TABLE["sm90"]["forward"]["decode"]
SM90_DECODE = Sm90DecodeKernel(
    _DECODE["rows"],
    tuple((d["head_dim"], d.get("prefer_keys_up_to")) for d in _DECODE["head_dims"]))
SM90_FORWARD_TILES = SM90_FORWARD.tiles
SM90_BACKWARD_TILES = SM90_BACKWARD.tiles
GPU_HEAD_DIMS = tuple(sorted({t.head_dim for t in SM90_FORWARD_TILES}))
GPU_MAX_HEAD_DIM = max(GPU_HEAD_DIMS)
if tuple(t.head_dim for t in SM90_BACKWARD_TILES) != GPU_HEAD_DIMS:
  raise ImportError("kernel_configs.json: the sm90 forward and backward tiles must cover the same "
                    "head dims (one backward tile each)")
if any(sum(t.is_default for t in SM90_FORWARD_TILES if t.head_dim == h) != 1
       for h in GPU_HEAD_DIMS):
  raise ImportError("kernel_configs.json: every head dim needs exactly one sm90 forward tile "
                    "without preferences (its default)")

if any(t.softmax_turns and t.block_m != 128 for t in SM90_FORWARD_TILES):
  raise ImportError("kernel_configs.json: softmax_turns needs a tile of two consumer warpgroups "
                    "(block_m 128): one has no other to take turns with, three leave no named "
                    "barriers for the turns")


def gpu_head_dim_supported(head_dim: int) -> bool:
  """A GPU problem runs on the smallest compiled tile whose head dim covers it."""
  return 0 < head_dim <= GPU_MAX_HEAD_DIM and head_dim % GPU_HEAD_DIM_MULTIPLE == 0
