"""Multi-device partitioning of the attention calls: each device runs the kernels on its shard.

A bare FFI call is opaque to XLA's SPMD partitioner, which would gather every sharded operand
onto every device and run the whole problem there. The forward and backward calls are
therefore wrapped in ``jax.experimental.custom_partitioning``: under ``jax.jit`` with sharded
operands (a ``NamedSharding`` over a ``Mesh``; automatic or explicit mesh axes) each device
calls the kernels on its local shard, and the program contains no collective for the
supported layouts. On one device, and inside ``shard_map`` (where the body is already
per-device), the wrapper lowers to the plain call.

What may be sharded
  * Batch: the ``B`` axis and any leading axis added by ``vmap``. Operands that broadcast over
    batch (a bias or mask with ``B == 1``) are replicated. Sequence lengths and segment ids are
    sharded with their batch axis.
  * Heads: the query heads ``N`` together with their key/value heads ``K``. Query head ``n``
    reads key/value head ``n // (N // K)``, so a shard of query heads needs exactly the
    key/value heads of its groups. With ``m`` head shards:
      - ``m`` divides ``K``: key/value heads are sharded like the query heads (each shard holds
        whole groups), nothing is communicated. Key/value that arrive replicated are sliced
        locally; their gradients, computed per shard, are then gathered back to that
        replicated layout (an all-gather of dk/dv in the backward);
      - ``m`` is a multiple of ``K`` (e.g. MQA, or more shards than groups): each shard's query
        heads fall inside one group; key/value are replicated over the head mesh axes and each
        shard slices its one key/value head. The forward communicates nothing; the backward
        sums the key/value gradients of the ``m / K`` shards that share a key/value head
        (an all-reduce over the head mesh axes);
      - otherwise the call raises ``NotImplementedError``.
  * The sequences: when the query sequence ``T`` or the key/value sequence ``S`` arrives
    sharded (over the mesh axes of the first tensor sharded along one, which then split both),
    each device runs ring attention (``_ring.py``) on its chunks: the key/value chunks (with
    their segment ids, split like their sequence) and, in the backward, their gradient
    accumulators travel by ``ppermute`` around those mesh axes, or are all-gathered (and
    reduce-scattered) where ``_ring.choose_exchange`` says so. Causal attention and windows
    apply to global positions. Both sequences must divide into the shards (``ValueError``), and
    bias/mask arrays are not supported over a split sequence (``NotImplementedError``).
  * The head dim ``H`` may not be sharded: the kernels need whole head vectors. If an operand
    arrives sharded along it (from its own sharding or propagated from the consumers of the
    result), compilation fails with a ``ValueError`` naming the operand, the axis and the mesh
    axes; the sharding is never silently gathered. Replicate the axis first, e.g. with
    ``jax.lax.with_sharding_constraint``.
  These errors are raised inside XLA's partitioner, which reports them as a
  ``JaxRuntimeError`` (``INTERNAL: custom_partitioner``) quoting jax_flash's message.

Which sharding is used
  The partitioner picks, for each batch axis and for the heads, the mesh axes of the first
  operand that is sharded along it (query, then key and value, then the other operands), else
  those that sharding propagation chose for the results. Operands that are sharded differently
  are resharded to that choice by XLA (replicated operands are only sliced locally); results
  come out sharded like the query (the log-sum-exp ``(B, N, T)`` accordingly).

Gradients
  ``dq``, ``dk``, ``dv`` come out sharded like ``q``, ``k``, ``v``. The gradient of an operand
  that broadcasts over a sharded axis (a bias with ``B == 1`` under batch sharding, or with
  ``N == 1`` under head sharding) is a sum over the shards: the backward reduces it with a
  ``psum`` over those mesh axes (an all-reduce of the bias-sized gradient, which single-device
  code performs as a local sum). Batch/head sharding therefore needs no collective in the
  forward, and in the backward only these reductions (plus, for key/value replicated
  over the head mesh axes, the dk/dv all-reduce or all-gather described above).

Transformations
  The partitioned calls sit inside the ``custom_vjp`` and inside a ``custom_vmap`` (see
  ``_primitive``): ``custom_partitioning`` has no batching rule, so ``vmap`` is handled before
  the partitioned call is reached, by adding leading batch axes exactly as
  ``vmap_method="expand_dims"`` does; the partitioning rules then see these axes as further
  batch axes, which may be sharded too.

Mechanics
  Shardy (the default partitioner) propagates shardings through the calls with an einsum-like
  ``sharding_rule`` built per call from the operand shapes, e.g. for the GQA forward
  ``b s n d, b t hk d, b t hk d -> b s n d, b n s``; broadcast axes of extent 1 get factors
  of their own. Query and key/value heads are separate factors when grouped: a compound
  ``(hk g)`` factor would let Shardy shard the key/value heads over a sub-axis of a mesh
  axis, which the partition callback cannot receive. Shardy hands the callback the operands'
  shardings as they arrive; the ``partition`` callback validates them, chooses the layout
  above for all operands and results and returns the per-shard function. Under the legacy GSPMD
  partitioner the same choice serves ``infer_sharding_from_operands``. The callbacks are
  Python functions embedded in the compiled program: a multi-device program that uses them
  cannot be serialised with ``jax.export``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from . import _config, _ring
from ._validation import AttentionConfig

# --- static description of one call ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallSpec:
  """The static part of a partitioned call: the kernel options, which optional operands
  (bias, mask, query lengths, key/value lengths, the pair of segment ids) are present and, for
  the backward, whether the bias gradient is wanted."""

  config: AttentionConfig
  has_bias: bool
  has_mask: bool
  has_q_len: bool
  has_kv_len: bool
  has_segment_ids: bool
  bias_gradient: bool = True

  @staticmethod
  def of(config, bias, mask, q_len, kv_len, q_seg, bias_gradient=True) -> "CallSpec":
    return CallSpec(config, bias is not None, mask is not None, q_len is not None,
                    kv_len is not None, q_seg is not None, bias is not None and bias_gradient)

  def optional_present(self) -> tuple[bool, ...]:
    return (self.has_bias, self.has_mask, self.has_q_len, self.has_kv_len,
            self.has_segment_ids, self.has_segment_ids)


# Roles give the meaning of the axes after the leading batch axes of an operand or result.
_INNER_AXES = {
    "q": ("s", "heads_q", "d"),  # (T, N, H)
    "kv": ("t", "heads_k", "d"),  # (S, K, H)
    "lse": ("heads_q", "s"),  # (N, T)
    "logits": ("heads_q", "s", "t"),  # (N|1, T|1, S|1)
    "lengths": (),
    "q_ids": ("s",),  # (T,)
    "kv_ids": ("t",),  # (S,)
}

_OPTIONAL = (("bias", "logits"), ("mask", "logits"), ("query_seq_lengths", "lengths"),
             ("key_value_seq_lengths", "lengths"), ("query_segment_ids", "q_ids"),
             ("key_value_segment_ids", "kv_ids"))


@dataclasses.dataclass(frozen=True)
class _Kind:
  """Operands and results of one of the two calls, as (name, role) pairs."""

  name: str
  operands: tuple[tuple[str, str], ...]  # before the optional operands
  results: tuple[tuple[str, str], ...]
  bias_gradient: bool  # the last result is d(bias), present when bias is and it is wanted

  def operand_roles(self, spec: CallSpec) -> list[tuple[str, str] | None]:
    return list(self.operands) + [o if p else None
                                  for o, p in zip(_OPTIONAL, spec.optional_present())]

  def result_roles(self, spec: CallSpec) -> list[tuple[str, str] | None]:
    roles: list[tuple[str, str] | None] = list(self.results)
    if self.bias_gradient:
      roles.append(("bias gradient", "logits") if spec.bias_gradient else None)
    return roles


FORWARD = _Kind(
    "forward",
    operands=(("query", "q"), ("key", "kv"), ("value", "kv")),
    results=(("output", "q"), ("lse", "lse")),
    bias_gradient=False)

BACKWARD = _Kind(
    "backward",
    operands=(("query", "q"), ("key", "kv"), ("value", "kv"), ("output", "q"), ("lse", "lse"),
              ("output cotangent", "q"), ("lse cotangent", "lse")),
    results=(("query gradient", "q"), ("key gradient", "kv"), ("value gradient", "kv")),
    bias_gradient=True)

# --- axis layout -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tensor:
  name: str
  role: str  # a key of _INNER_AXES
  is_operand: bool
  shape: tuple[int, ...]
  factors: list[str | None]  # logical factor per axis; None where the axis broadcasts


class _Layout:
  """Logical factors of every axis of every operand and result of one call.

  Factors: "b0".."b{r-1}" (batch axes), "s" (T), "t" (S), "d" (H), "heads_q" (N) and
  "heads_k" (K). An axis of extent 1 where the problem's extent is not 1 broadcasts (None).
  """

  def __init__(self, kind: _Kind, spec: CallSpec, operand_shapes: Sequence, result_shapes):
    q_shape = tuple(operand_shapes[0])
    k_shape = tuple(operand_shapes[1])
    self.rank = len(q_shape) - 3  # batch rank
    r = self.rank
    present = [tuple(s) for s in operand_shapes if s is not None]
    batch = [1] * r
    for shape in present:
      for i in range(r):
        if shape[i] != 1:
          batch[i] = shape[i]
    self.batch = tuple(batch)
    self.T, self.N, self.H = q_shape[r:]
    self.S, self.K = k_shape[r], k_shape[r + 1]
    self.G = self.N // self.K
    self.extent = {f"b{i}": batch[i] for i in range(r)}
    self.extent.update(s=self.T, t=self.S, d=self.H, heads_q=self.N, heads_k=self.K)
    self.tensors: list[_Tensor | None] = []
    for roles, shapes, is_operand in ((kind.operand_roles(spec), operand_shapes, True),
                                      (kind.result_roles(spec), result_shapes, False)):
      for role, shape in zip(roles, shapes):
        if role is None:
          self.tensors.append(None)
          continue
        name, axes_role = role
        shape = tuple(shape)
        logical = [f"b{i}" for i in range(r)] + list(_INNER_AXES[axes_role])
        if len(logical) != len(shape):
          raise ValueError(f"jax_flash: {kind.name} {name} has shape {shape}, expected rank "
                           f"{len(logical)}")
        factors = [f if (extent == self.extent[f] or extent != 1) else None
                   for f, extent in zip(logical, shape)]
        self.tensors.append(_Tensor(name, axes_role, is_operand, shape, factors))
    self.num_operands = len(operand_shapes)

  @property
  def operands(self) -> list[_Tensor | None]:
    return self.tensors[:self.num_operands]

  @property
  def results(self) -> list[_Tensor | None]:
    return self.tensors[self.num_operands:]

  # Shardy rule ---------------------------------------------------------------------------------

  def sharding_rule(self) -> tuple[str, dict]:
    """The einsum-like rule (factor names as in the class docstring, heads "n" and "hk")."""
    unique = iter(f"u{i}" for i in range(10_000))
    # Query and key/value heads share a factor only without grouping. With groups, a compound
    # (hk g) factor would let Shardy shard the key/value heads over a sub-axis when the head
    # shards outnumber them, which the partition callback cannot receive (a NamedSharding has
    # no sub-axes); the partition callback pairs the two itself.
    heads_q, heads_k = "n", ("n" if self.G == 1 else "hk")
    sizes: dict = {}

    def name(factor):
      if factor is None:
        return next(unique)
      if factor == "heads_q":
        return heads_q
      if factor == "heads_k":
        return heads_k
      return factor

    def mapping(tensors):
      return ", ".join(" ".join(name(f) for f in t.factors) for t in tensors if t is not None)

    return f"{mapping(self.operands)} -> {mapping(self.results)}", sizes


def _spec_axes(sharding, ndim: int, name: str) -> list[tuple[str, ...]]:
  """Mesh axes of each array axis of a sharding."""
  if isinstance(sharding, NamedSharding):
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    axes = []
    for entry in entries[:ndim]:
      if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        axes.append(())
      elif isinstance(entry, str):
        axes.append((entry,))
      else:
        axes.append(tuple(entry))
    return axes
  if sharding is None or sharding.is_fully_replicated:
    return [()] * ndim
  raise NotImplementedError(
      f"jax_flash: {name} has sharding {sharding}; partitioned attention needs a NamedSharding "
      "over a Mesh (e.g. jax.sharding.NamedSharding(mesh, P(...)), or run under jax.set_mesh)")


@dataclasses.dataclass
class _Plan:
  """The chosen partitioning of one call."""

  layout: _Layout
  mesh: Any
  axes: dict[str, tuple[str, ...]]  # factor -> mesh axes
  kv_heads_replicated: bool  # head shards outnumber kv heads: each shard slices its kv head
  seq_axes: tuple[str, ...] = ()  # the query and key/value sequences' ring, if split

  def _size(self, axes) -> int:
    return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1

  def sharding(self, tensor: _Tensor | None):
    if tensor is None:
      return None
    entries = []
    for factor in tensor.factors:
      if factor in ("s", "t"):
        axes = self.seq_axes
      elif factor is None or factor == "d":
        axes = ()
      elif factor == "heads_k" and self.kv_heads_replicated:
        axes = ()
      else:
        axes = self.axes.get(factor, ())
      entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(self.mesh, PartitionSpec(*entries))

  def head_shards(self) -> int:
    return self._size(self.axes.get("heads_q", ()))

  def shard_index(self, axes) -> jax.Array:
    index = jnp_int(0)
    for a in axes:
      index = index * self.mesh.shape[a] + lax.axis_index(a)
    return index

  def broadcast_axes(self, tensor: _Tensor) -> tuple[str, ...]:
    """Mesh axes of the sharded factors this tensor broadcasts over (its gradient is a sum
    over their shards)."""
    logical = [f"b{i}" for i in range(self.layout.rank)] + ["heads_q"]
    positions = list(range(self.layout.rank)) + [self.layout.rank]
    axes: list[str] = []
    for factor, pos in zip(logical, positions):
      if tensor.factors[pos] is None:
        axes.extend(self.axes.get(factor, ()))
    return tuple(axes)


def jnp_int(value: int) -> jax.Array:
  return lax.convert_element_type(value, np.int32)


def _check_ring(kind: _Kind, spec: CallSpec, layout: _Layout, mesh, seq_axes) -> None:
  """Raises unless the call can run as ring attention over `seq_axes`."""
  where = f"the attention {kind.name}'s sequence is sharded over mesh axes {seq_axes}"
  if spec.has_bias or spec.has_mask:
    raise NotImplementedError(
        f"jax_flash: {where}, which runs as ring attention; ring attention does not take "
        "bias or mask arrays yet: replicate the sequence axes of query, key and value")
  shards = int(np.prod([mesh.shape[a] for a in seq_axes]))
  for name, length in (("query sequence (T)", layout.T), ("key/value sequence (S)", layout.S)):
    if length % shards:
      raise ValueError(
          f"jax_flash: {where} ({shards} shards), which must divide the {name} length "
          f"{length}: pad the sequence to a multiple of {shards}")


def _plan(kind: _Kind, spec: CallSpec, mesh, arg_shapes, result_shapes, *,
          check: bool = True) -> _Plan:
  if mesh is None or mesh.empty:
    raise NotImplementedError(
        f"jax_flash: the attention {kind.name} is partitioned without a mesh; shard its "
        "operands with a NamedSharding over a jax.sharding.Mesh (or run under jax.set_mesh)")
  operand_shapes = [None if a is None else a.shape for a in arg_shapes]
  layout = _Layout(kind, spec, operand_shapes, [None if r is None else r.shape
                                                for r in result_shapes])
  sharded = {}  # tensor index -> per-axis mesh axes
  for i, (tensor, sds) in enumerate(zip(layout.tensors, list(arg_shapes) + list(result_shapes))):
    if tensor is None or sds is None:
      continue
    sharding = getattr(sds, "sharding", None)
    if not tensor.is_operand and not isinstance(sharding, NamedSharding):
      sharding = None  # results: only a hint
    sharded[i] = _spec_axes(sharding, len(tensor.shape), f"the {kind.name} {tensor.name}")

  if check:
    for i, tensor in enumerate(layout.operands):
      if tensor is None:
        continue
      for axis, (factor, axes) in enumerate(zip(tensor.factors, sharded[i])):
        if factor == "d" and axes:
          raise ValueError(
              f"jax_flash: the attention {kind.name} {tensor.name} (shape {tensor.shape}) is "
              f"sharded along its head dim axis (H) (array axis {axis}, mesh axes "
              f"{axes}); the kernels need whole head vectors and jax_flash does not gather "
              "them implicitly. Replicate that axis before the call (e.g. "
              "jax.lax.with_sharding_constraint); the sharding may also have been propagated "
              "from the consumers of the result.")

  # A split sequence runs as ring attention over the mesh axes of the first tensor sharded
  # along a sequence axis (query and key/value are then split over the same axes).
  seq_axes: tuple[str, ...] = ()
  for i, tensor in enumerate(layout.tensors):
    if tensor is not None and not seq_axes:
      for axis, factor in enumerate(tensor.factors):
        if factor in ("s", "t") and sharded[i][axis]:
          seq_axes = sharded[i][axis]
          break
  if seq_axes and check:
    _check_ring(kind, spec, layout, mesh, seq_axes)

  # The first sharded candidate of each factor wins: operands in order, then results.
  axes: dict[str, tuple[str, ...]] = {}
  used: set[str] = set(seq_axes)
  factors = [f"b{i}" for i in range(layout.rank)] + ["heads"]
  for factor in factors:
    for i, tensor in enumerate(layout.tensors):
      if tensor is None:
        continue
      choice = None
      for axis, f in enumerate(tensor.factors):
        if f == factor or (factor == "heads" and f in ("heads_q", "heads_k")):
          if sharded[i][axis] and not used.intersection(sharded[i][axis]):
            choice = sharded[i][axis]
            break
      if choice is not None:
        axes["heads_q" if factor == "heads" else factor] = choice
        used.update(choice)
        break

  plan = _Plan(layout, mesh, axes, kv_heads_replicated=False, seq_axes=seq_axes)
  m = plan.head_shards()
  if m > 1:
    K = layout.K
    if K % m == 0:
      plan.axes["heads_k"] = plan.axes["heads_q"]
    elif m % K == 0:
      plan.kv_heads_replicated = True
    else:
      raise NotImplementedError(
          f"jax_flash: the attention {kind.name} shards its N={layout.N} query heads over "
          f"{m} shards (mesh axes {plan.axes['heads_q']}) but has K={K} key/value heads: the "
          "number of head shards must divide K or be a multiple of K")
  return plan


# --- the partitioned calls ---------------------------------------------------------------------


def _lower_fn(kind: _Kind, spec: CallSpec, plan: _Plan, impl: Callable):
  """The per-shard function: `impl` on local operands, plus the shard-level fix-ups."""
  layout = plan.layout
  kv_operands = [i for i, t in enumerate(layout.operands) if t is not None and t.role == "kv"]
  heads_axes = plan.axes.get("heads_q", ())
  m = plan.head_shards()

  def lower_fn(*operands):
    operands = list(operands)
    if plan.kv_heads_replicated:
      head = plan.shard_index(heads_axes) // (m // layout.K)
      for i in kv_operands:
        operands[i] = lax.dynamic_slice_in_dim(operands[i], head, 1, axis=layout.rank + 1)
    results = list(_ring_call(kind, spec, plan, impl, operands) if plan.seq_axes
                   else impl(spec, *operands))
    if kind is BACKWARD:
      if plan.kv_heads_replicated:
        for j in (1, 2):  # dk, dv: sum the shards that share the kv head
          local = results[j]
          full_shape = list(local.shape)
          full_shape[layout.rank + 1] = layout.K
          acc = _config.accumulation_dtype(local.dtype)
          full = lax.dynamic_update_slice_in_dim(
              lax.full(full_shape, 0, acc), local.astype(acc), head, axis=layout.rank + 1)
          results[j] = lax.psum(full, heads_axes).astype(local.dtype)
      bias_grad = layout.results[3]
      if bias_grad is not None:
        axes = plan.broadcast_axes(bias_grad)
        if axes:
          dbias = results[3]
          acc = _config.accumulation_dtype(dbias.dtype)
          results[3] = lax.psum(dbias.astype(acc), axes).astype(dbias.dtype)
    return tuple(results)

  return lower_fn


def _ring_call(kind: _Kind, spec: CallSpec, plan: _Plan, impl: Callable, operands):
  """The call of `kind` on this device's sequence shards, as ring attention over the plan's
  sequence axes; each block runs `impl` (the platform's kernels) on one pair of shards."""
  axes = plan.seq_axes
  q, k = operands[:2]
  ring = _ring.Ring(axes[0] if len(axes) == 1 else axes, plan._size(axes), spec.config,
                    exchange=_ring.choose_exchange(q.shape, k.shape))

  def block_spec(config):
    return dataclasses.replace(spec, config=config)

  if kind is FORWARD:
    q, k, v, _, _, q_len, kv_len, q_seg, kv_seg = operands

    def forward_block(config, q, k, v, q_len, kv_len, q_seg, kv_seg):
      return impl(block_spec(config), q, k, v, None, None, q_len, kv_len, q_seg, kv_seg)

    return _ring.forward(ring, forward_block, q, k, v, q_len, kv_len, q_seg, kv_seg)

  q, k, v, out, lse, dout, dlse, _, _, q_len, kv_len, q_seg, kv_seg = operands

  def backward_block(config, q, k, v, out, lse, dout, dlse, q_len, kv_len, q_seg, kv_seg):
    return impl(block_spec(config), q, k, v, out, lse, dout, dlse, None, None, q_len, kv_len,
                q_seg, kv_seg)[:3]

  grads = _ring.backward(ring, backward_block, q, k, v, out, lse, dout, dlse, q_len, kv_len,
                         q_seg, kv_seg)
  return grads + (None,)  # no bias, no bias gradient



def partitioned(kind: _Kind, impl: Callable) -> custom_partitioning:
  """Wraps `impl(spec, *operands) -> results` (operands and results as the FFI call of `kind`
  takes and returns them, None for absent optional ones) in custom_partitioning."""
  wrapped = custom_partitioning(impl, static_argnums=(0,))

  def sharding_rule(spec, mesh, operand_types, result_types):
    del mesh
    from jax.extend.mlir import ir  # only needed while lowering

    def shapes(roles, types):
      types = iter(types)
      return [None if role is None else tuple(ir.RankedTensorType(next(types)).shape)
              for role in roles]

    layout = _Layout(kind, spec, shapes(kind.operand_roles(spec), operand_types),
                     shapes(kind.result_roles(spec), result_types))
    return layout.sharding_rule()

  def partition(spec, mesh, arg_shapes, result_shape):
    plan = _plan(kind, spec, mesh, arg_shapes, result_shape)
    arg_shardings = tuple(plan.sharding(t) for t in plan.layout.operands)
    result_shardings = tuple(plan.sharding(t) for t in plan.layout.results)
    return mesh, _lower_fn(kind, spec, plan, impl), result_shardings, arg_shardings

  def infer_sharding_from_operands(spec, mesh, arg_shapes, result_shape):
    # GSPMD only (Shardy uses the rule); results carry no sharding here.
    plan = _plan(kind, spec, mesh, arg_shapes, [_no_sharding(r) for r in result_shape],
                 check=False)
    return tuple(plan.sharding(t) for t in plan.layout.results)

  wrapped.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                        sharding_rule=sharding_rule)
  return wrapped


def _no_sharding(shape):
  return None if shape is None else jax.ShapeDtypeStruct(shape.shape, shape.dtype)
