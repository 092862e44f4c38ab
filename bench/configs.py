"""Named attention problem grids shared by the benchmark scripts and the tests.

A ``Shape`` is one attention problem in jax's layout: query ``(B, T, N, H)``, key and value
``(B, S, K, H)``. A ``Grid`` is a named family of shapes: the cartesian product of its head dims,
sequence lengths (``T = S``) and causal flags, with the batch and head counts either fixed or
derived from a constant token count (``B * T``) and a constant feature count (``N * H``), so that
every cell of a grid moves the same amount of Q/K/V data.

This module imports nothing but the standard library, so that a test can use the shapes without
pulling in the benchmark machinery.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Shape:
  """One problem: query (batch, q_len, heads, head_dim), key/value (batch, kv_len, kv_heads, head_dim)."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool
  dtype: str

  def __post_init__(self):
    for name in ("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.heads % self.kv_heads:
      raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

  @property
  def q_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.q_len, self.heads, self.head_dim)

  @property
  def kv_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.kv_len, self.kv_heads, self.head_dim)

  def forward_flops(self) -> float:
    """FlashAttention convention: two matmuls of 2*T*S*H flops per head, halved when causal."""
    flops = 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
    return flops / 2 if self.causal else flops

  def flops(self, mode: str) -> float:
    """``fwd``: the forward; ``fwd_bwd``: forward plus backward, counted as 3.5x the forward
    (the backward's five matmuls are 2.5x the forward's two)."""
    if mode == "fwd":
      return self.forward_flops()
    if mode == "fwd_bwd":
      return 3.5 * self.forward_flops()
    raise ValueError(f"unknown mode {mode!r}")

  def logits_bytes_per_head(self, itemsize: int = 4) -> int:
    """Size of one head's T x S logit matrix, as a materialising implementation holds it."""
    return self.q_len * self.kv_len * itemsize

  def replace(self, **changes) -> "Shape":
    return dataclasses.replace(self, **changes)

  def label(self) -> str:
    kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
    return (f"B={self.batch} T={self.q_len} S={self.kv_len} N={self.heads}{kv} H={self.head_dim} "
            f"{'causal' if self.causal else 'full'} {self.dtype}")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Grid:
  """A named family of shapes.

  The batch is ``batch`` when set, else ``tokens // seqlen``; the head count is ``heads`` when
  set, else ``head_features // head_dim``; ``kv_heads`` defaults to the head count.
  """

  name: str
  platform: str  # "cpu" or "gpu": where the grid is meant to run
  dtype: str
  head_dims: tuple[int, ...]
  seqlens: tuple[int, ...]
  causal: tuple[bool, ...]
  description: str
  batch: int | None = None
  tokens: int | None = None
  heads: int | None = None
  head_features: int | None = None
  kv_heads: int | None = None
  iterations: int | None = None  # default timing iterations for this grid (None: the platform's)

  def __post_init__(self):
    if (self.batch is None) == (self.tokens is None):
      raise ValueError(f"grid {self.name}: set exactly one of batch and tokens")
    if (self.heads is None) == (self.head_features is None):
      raise ValueError(f"grid {self.name}: set exactly one of heads and head_features")

  def shape(self, head_dim: int, seqlen: int, causal: bool, dtype: str | None = None) -> Shape:
    if self.batch is not None:
      batch = self.batch
    else:
      if self.tokens % seqlen:
        raise ValueError(f"grid {self.name}: seqlen {seqlen} does not divide {self.tokens} tokens")
      batch = self.tokens // seqlen
    if self.heads is not None:
      heads = self.heads
    else:
      if self.head_features % head_dim:
        raise ValueError(f"grid {self.name}: head dim {head_dim} does not divide "
                         f"{self.head_features} features")
      heads = self.head_features // head_dim
    kv_heads = self.kv_heads if self.kv_heads is not None else heads
    return Shape(batch=batch, q_len=seqlen, kv_len=seqlen, heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, causal=causal, dtype=dtype or self.dtype)

  def shapes(self, head_dims: Iterable[int] | None = None, seqlens: Iterable[int] | None = None,
             causal: Iterable[bool] | None = None, dtype: str | None = None) -> list[Shape]:
    """All shapes, ordered by head dim, then causal, then sequence length. Any axis may be
    overridden (values outside the grid's own axes are allowed)."""
    head_dims = tuple(head_dims) if head_dims is not None else self.head_dims
    seqlens = tuple(seqlens) if seqlens is not None else self.seqlens
    causal = tuple(causal) if causal is not None else self.causal
    return [self.shape(h, t, c, dtype)
            for h, c, t in itertools.product(head_dims, causal, seqlens)]


GPU_FORWARD_GRID = Grid(
    name="gpu",
    platform="gpu",
    dtype="bfloat16",
    head_dims=(64, 128, 256),
    seqlens=(512, 1024, 2048, 4096, 8192, 16384),
    causal=(False, True),
    tokens=16384,  # B * T
    head_features=2048,  # N * H
    description="Hopper grid: bfloat16, B*T = 16384, N*H = 2048, K = N, T = S",
)

CPU_TARGET = Grid(
    name="cpu_target",
    platform="cpu",
    dtype="float32",
    head_dims=(64,),
    seqlens=(2048,),
    causal=(False,),
    batch=1,
    heads=16,
    description="CPU acceptance case: float32, B=1, N=16, T=S=2048, H=64",
)

CPU_SIZES = Grid(
    name="cpu",
    platform="cpu",
    dtype="float32",
    head_dims=(64,),
    seqlens=(512, 1024, 2048, 4096),
    causal=(False, True),
    batch=1,
    heads=16,
    description="CPU sizes: float32, B=1, N=16 (B*N = 16), H=64, T = S",
)

CPU_LONG = Grid(
    name="cpu_long",
    platform="cpu",
    dtype="float32",
    head_dims=(64,),
    seqlens=(32768,),
    causal=(False,),
    batch=1,
    heads=8,
    iterations=1,
    description="CPU memory comparison: float32, B=1, T=S=32768, N=8, H=64; a materialising "
                "implementation needs 32768^2 floats (4 GiB) of logits per head",
)

SMOKE = Grid(
    name="smoke",
    platform="cpu",
    dtype="float32",
    head_dims=(32,),
    seqlens=(128,),
    causal=(False, True),
    batch=2,
    heads=4,
    kv_heads=2,
    iterations=2,
    description="Tiny GQA case that runs in seconds on the CPU",
)

GRIDS: dict[str, Grid] = {g.name: g for g in (GPU_FORWARD_GRID, CPU_TARGET, CPU_SIZES, CPU_LONG,
                                               SMOKE)}


def get_grid(name: str) -> Grid:
  try:
    return GRIDS[name]
  except KeyError:
    raise KeyError(f"unknown grid {name!r}; known: {', '.join(GRIDS)}") from None


def parse_ints(text: str | None) -> tuple[int, ...] | None:
  """'64,128' -> (64, 128); None or '' -> None."""
  if not text:
    return None
  return tuple(int(x) for x in text.split(",") if x.strip())


__all__ = ["Shape", "Grid", "GRIDS", "get_grid", "parse_ints", "GPU_FORWARD_GRID", "CPU_TARGET",
           "CPU_SIZES", "CPU_LONG", "SMOKE"]
