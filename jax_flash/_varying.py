"""Typing of values inside shard_map: which manual mesh axes a value varies over."""

from __future__ import annotations

import jax
from jax import lax


def varying_like(tree, *operands):
  """`tree` typed as varying over every manual mesh axis that one of `operands` varies over.

  Inside shard_map jax types values by the mesh axes they vary over, and checks that a scan's
  carry keeps its type and that the branches of a switch (lax.platform_dependent) agree. A
  kernel's FFI call returns values typed as varying over nothing, and a scan's initial carry
  built from constants is typed alike, while what is computed from the operands varies with
  them. Outside shard_map this returns `tree` unchanged."""
  def varying(x):
    return jax.typeof(x).manual_axis_type.varying

  axes = frozenset().union(*(varying(x) for x in operands if x is not None))

  def typed(x):
    missing = tuple(sorted(axes - varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(typed, tree)
