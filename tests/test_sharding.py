"""Multi-device partitioning: sharded calls equal the single-device call and communicate only
where the mathematics requires it.

jax fixes its device count when it initialises, so the multi-device checks run in child
pytest processes: `test_cpu_devices` starts them with 8 host CPU devices
(--xla_force_host_platform_device_count=8), and the gpu-marked `test_gpu_devices` on the
machine's GPUs (at least 2). A child process collects the `check_*` tests of this file (they
exist only there, selected by JAX_FLASH_SHARDING_CHILD) and runs one group of them
(CHECK_GROUPS) on the devices of its platform.

Each check compares the sharded forward (output and log-sum-exp) and backward (gradients of
query, key, value and bias for given output and lse cotangents) with the same computation on
one device, and inspects the compiled multi-device program for collectives.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

CHILD_ENV = "JAX_FLASH_SHARDING_CHILD"
CHILD = os.environ.get(CHILD_ENV)  # None, "cpu" or "gpu"
CPU_DEVICES = 8
HERE = pathlib.Path(__file__).resolve().parent


# The checks in groups (pytest -k expressions), a child process each, so that pytest-xdist
# workers share them out: all of them in one child took a third of the CPU suite's time. The
# last group takes every check the others leave, so each check runs exactly once.
_NAMED_CHECK_GROUPS = {
    "sharded": "check_sharded_equals_single_device",
    "ring-shard-map": "check_ring_attention_equals_single_device and shard_map",
    "ring-jit": "check_ring_attention_equals_single_device and jit",
}
CHECK_GROUPS = {
    **{name: f"check_ and ({expr})" for name, expr in _NAMED_CHECK_GROUPS.items()},
    "other": "check_ and not ({})".format(
        " or ".join(f"({expr})" for expr in _NAMED_CHECK_GROUPS.values())),
}


def _run_child(platform: str, group: str, extra_env: dict) -> None:
  env = dict(os.environ)
  env.update(extra_env)
  env[CHILD_ENV] = platform
  env.pop("PYTEST_ADDOPTS", None)
  # The child runs from the tests directory: the conftest and helpers are found, and the
  # installed jax_flash (with its extension) is imported rather than a source tree.
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(pathlib.Path(__file__).name), "-k", CHECK_GROUPS[group]]
  proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    # Exit status 5 (no test collected) fails too: a group that selects nothing is a mistake.
    pytest.fail(f"multi-device checks '{group}' failed on {platform} (exit "
                f"{proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}",
                pytrace=False)


if CHILD is None:

  @pytest.mark.parametrize("group", CHECK_GROUPS)
  def test_cpu_devices(group):
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    _run_child("cpu", group, {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                                           f"{CPU_DEVICES}".strip()})

  @pytest.mark.gpu
  @pytest.mark.parametrize("group", CHECK_GROUPS)
  def test_gpu_devices(group):
    import jax

    from conftest import require_gpu

    require_gpu()
    if len(jax.devices("gpu")) < 2:
      pytest.skip(f"needs 2 GPUs, found {len(jax.devices('gpu'))}")
    _run_child("gpu", group, {})

else:
  # --- the multi-device checks (child process only) --------------------------------------------
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_flash
  from jax_flash import _ring

  PLATFORM = CHILD
  DEVICES = jax.devices(PLATFORM)
  DTYPE = jnp.float32 if PLATFORM == "cpu" else jnp.bfloat16
  HEAD_DIM = 16 if PLATFORM == "cpu" else 64
  COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
                 "reduce-scatter", "collective-broadcast")

  @pytest.fixture(autouse=True)
  def _platform_device():
    with jax.default_device(DEVICES[0]):
      yield

  @dataclasses.dataclass(frozen=True)
  class Setup:
    """One problem and its sharding: mesh (x, y) with `batch_shards` x `head_shards` devices;
    specs over the canonical axes (B, T, N, H) for the query and (B, S, K, H) for key/value."""

    name: str
    mesh: tuple[int, int]
    q_spec: tuple
    kv_spec: tuple | None = None  # None: like q_spec
    N: int = 8
    K: int = 8
    B: int = 4
    T: int = 16
    S: int = 24
    bias: str | None = None  # letters of the bias's non-broadcast axes among "BNTS"
    bias_spec: tuple = ()
    mask: str | None = None
    mask_spec: tuple = ()
    lengths: bool = False
    segments: bool = False  # packed rows: sorted segment ids, sharded with the batch
    is_causal: bool = True
    explicit: bool = False
    dbias_all_reduced: bool = False  # the bias gradient is all-reduced in the backward

  def _operand_shape(letters: str, s: Setup):
    full = dict(B=s.B, N=s.N, T=s.T, S=s.S)
    return tuple(full[c] if c in letters else 1 for c in "BNTS")

  def _inputs(s: Setup, seed: int = 0):
    rng = np.random.default_rng(seed)

    def normal(shape, scale=1.0):
      return jnp.asarray(rng.standard_normal(shape) * scale, DTYPE)

    x = dict(q=normal((s.B, s.T, s.N, HEAD_DIM)), k=normal((s.B, s.S, s.K, HEAD_DIM)),
             v=normal((s.B, s.S, s.K, HEAD_DIM)))
    x["bias"] = None if s.bias is None else normal(_operand_shape(s.bias, s), 0.5)
    if s.mask is None:
      x["mask"] = None
    else:
      m = rng.random(_operand_shape(s.mask, s)) < 0.8
      m[..., 0] = True  # every row sees a key
      x["mask"] = jnp.asarray(m)
    if s.lengths:
      x["q_len"] = jnp.asarray(rng.integers(s.T // 2, s.T + 1, s.B), jnp.int32)
      x["kv_len"] = jnp.asarray(rng.integers(s.S // 2, s.S + 1, s.B), jnp.int32)
    else:
      x["q_len"] = x["kv_len"] = None
    if s.segments:
      x["q_seg"] = jnp.asarray(np.sort(rng.integers(0, 4, (s.B, s.T)), axis=1), jnp.int32)
      x["kv_seg"] = jnp.asarray(np.sort(rng.integers(0, 4, (s.B, s.S)), axis=1), jnp.int32)
    else:
      x["q_seg"] = x["kv_seg"] = None
    x["dout"] = normal((s.B, s.T, s.N, HEAD_DIM))
    x["dlse"] = jnp.asarray(rng.standard_normal((s.B, s.T, s.N)) * 0.1, jnp.float32)
    return x

  def _mesh(s: Setup):
    count = s.mesh[0] * s.mesh[1]
    if count > len(DEVICES):
      pytest.skip(f"needs {count} {PLATFORM} devices, have {len(DEVICES)}")
    kind = AxisType.Explicit if s.explicit else AxisType.Auto
    return jax.make_mesh(s.mesh, ("x", "y"), axis_types=(kind, kind), devices=DEVICES[:count])

  def _attention(s: Setup):
    def f(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg):
      return jax_flash.dot_product_attention(
          q, k, v, bias, mask, is_causal=s.is_causal, query_seq_lengths=q_len,
          key_value_seq_lengths=kv_len, return_residual=True, query_segment_ids=q_seg,
          key_value_segment_ids=kv_seg)
    return f

  def _forward_and_grads(s: Setup):
    """(out, lse, dq, dk, dv, dbias) for given cotangents, as one function."""
    f = _attention(s)

    def run(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, dout, dlse):
      def diff(q, k, v, bias):
        return f(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg)
      (out, lse), vjp = jax.vjp(diff, q, k, v, bias)
      dq, dk, dv, dbias = vjp((dout, dlse))
      return out, lse, dq, dk, dv, dbias

    return run

  ARGS = ("q", "k", "v", "bias", "mask", "q_len", "kv_len", "q_seg", "kv_seg", "dout", "dlse")

  def _shardings(s: Setup, mesh, x):
    kv = s.q_spec if s.kv_spec is None else s.kv_spec
    specs = dict(q=s.q_spec, k=kv, v=kv, bias=s.bias_spec, mask=s.mask_spec,
                 q_len=s.q_spec[:1], kv_len=s.q_spec[:1], q_seg=s.q_spec[:1],
                 kv_seg=s.q_spec[:1], dout=s.q_spec, dlse=s.q_spec[:3])
    return [None if x[a] is None else NamedSharding(mesh, P(*specs[a])) for a in ARGS]

  def _place(x, shardings):
    return [None if x[a] is None else jax.device_put(x[a], sh)
            for a, sh in zip(ARGS, shardings)]

  def _collective_shapes(hlo: str) -> dict[str, list[str]]:
    """Result shapes of each collective in an HLO module (tuple results give several). An
    asynchronous collective is read at its `-done`: the `-start` tuple holds its operands too."""
    found = {}
    for line in hlo.splitlines():
      for name in COLLECTIVES:
        m = re.search(rf"=\s*(.*?)\s+{name}(-done)?\(", line)
        if m:
          found.setdefault(name, []).extend(re.findall(r"\w+\[[\d,]*\]", m.group(1)))
    return found

  def _local_shape(global_shape, spec, mesh):
    shape = list(global_shape)
    for i, entry in enumerate(spec):
      for axis in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
        shape[i] //= mesh.shape[axis]
    return tuple(shape)

  def _hlo_shape(shape, dtype) -> str:
    name = {np.dtype(np.float32): "f32", np.dtype(jnp.bfloat16): "bf16",
            np.dtype(np.float16): "f16", np.dtype(np.float64): "f64"}[np.dtype(dtype)]
    return f"{name}[{','.join(map(str, shape))}]"

  def _assert_same(name, ours, want):
    ours, want = np.asarray(ours, np.float64), np.asarray(want, np.float64)
    assert ours.shape == want.shape, (name, ours.shape, want.shape)
    if PLATFORM == "cpu":
      # The CPU kernels compute each (batch, head, row) alone, in a fixed order: a shard runs
      # the very same arithmetic as the single-device call. Only sums across shards (a
      # psum'd bias or shared key/value gradient) may add in another order: one float32
      # rounding per addend.
      tol = 0.0 if name not in ("dbias", "dk", "dv") else 1e-6 * max(1.0, np.abs(want).max())
    else:
      # On the GPU the backward runs through XLA (blockwise path), which may fuse a shard's
      # smaller problem differently: bfloat16 results within a few units in the last place.
      tol = 2.0 ** -6 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(ours, want, rtol=0, atol=tol, err_msg=name)

  def _kv_gradient_collective(s: Setup, mesh) -> str | None:
    """The collective that brings dk/dv to the layout of k/v when the query heads are sharded
    and k/v are replicated over those mesh axes (see _sharding.py): with whole groups per shard
    (shards divide K) each shard computes its own key/value heads' gradients, which are
    gathered; with shards inside a group they hold partial sums of one head's, all-reduced."""
    kv_spec = s.q_spec if s.kv_spec is None else s.kv_spec
    head_axes = s.q_spec[2] if len(s.q_spec) > 2 else None
    if head_axes is None or (len(kv_spec) > 2 and kv_spec[2] is not None):
      return None
    shards = int(np.prod([mesh.shape[a] for a in
                          ((head_axes,) if isinstance(head_axes, str) else head_axes)]))
    if shards == 1:
      return None
    return "all-gather" if s.K % shards == 0 else "all-reduce"

  def _check(s: Setup):
    mesh = _mesh(s)
    x = _inputs(s)
    run = _forward_and_grads(s)
    with jax.default_device(DEVICES[0]):
      want = jax.jit(run)(*(x[a] for a in ARGS))
    shardings = _shardings(s, mesh, x)
    placed = _place(x, shardings)
    fwd = jax.jit(lambda *a: _attention(s)(*a[:9]))
    both = jax.jit(run)
    got = both(*placed)
    fwd_hlo = fwd.lower(*placed).compile().as_text()
    bwd_hlo = both.lower(*placed).compile().as_text()
    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    for name, a, b in zip(names, got, want):
      if b is None:
        assert a is None
      else:
        _assert_same(name, a, b)

    # The kernels run on local shards: the forward custom call sees the local query.
    q_local = _local_shape(x["q"].shape, s.q_spec, mesh)
    calls = [l for l in fwd_hlo.splitlines() if "jax_flash_fwd" in l]
    if PLATFORM == "cpu" or (s.bias is None and s.mask is None):  # else the blockwise path
      assert calls and all(_hlo_shape(q_local, DTYPE) in l for l in calls), calls
    if PLATFORM == "cpu":
      assert any("jax_flash_bwd" in l for l in bwd_hlo.splitlines())

    # Forward: no collective at all. Backward: only the gradient collectives the layout requires.
    assert not _collective_shapes(fwd_hlo), _collective_shapes(fwd_hlo)
    found = _collective_shapes(bwd_hlo)
    allowed = {}
    if s.dbias_all_reduced:
      local = _local_shape(x["bias"].shape, s.bias_spec, mesh)
      allowed["all-reduce"] = {_hlo_shape(local, DTYPE if DTYPE == jnp.float64 else jnp.float32)}
    kv_collective = _kv_gradient_collective(s, mesh)
    if kv_collective:
      local = _local_shape(x["k"].shape, (s.q_spec[0], None, None, None), mesh)
      allowed.setdefault(kv_collective, set()).update(
          _hlo_shape(local, dtype) for dtype in (jnp.float32, DTYPE))
    assert set(found) <= set(allowed), (found, allowed)
    for name, shapes in found.items():
      assert set(shapes) <= allowed[name], (found, allowed)
    if PLATFORM == "cpu":
      assert set(found) == set(allowed), ("expected the gradient reductions", found, allowed)
    return got

  # 2 x 4 on the 8 CPU devices; on GPUs, the cases that fit the devices.
  SETUPS = [
      Setup("batch", (2, 1), ("x",)),
      Setup("batch-8", (2, 4), (("x", "y"),), B=8),
      Setup("heads", (1, 4), (None, None, "y")),
      Setup("batch-heads", (2, 4), ("x", None, "y")),
      Setup("gqa-kv-heads-sharded", (2, 4), ("x", None, "y"), N=8, K=4),
      Setup("gqa-kv-heads-replicated", (1, 4), (None, None, "y"), N=8, K=2, kv_spec=(None,)),
      Setup("gqa-kv-heads-replicated-whole-groups", (1, 2), (None, None, "y"), N=8, K=2,
            kv_spec=(None,)),
      Setup("mqa", (2, 4), ("x", None, "y"), N=8, K=1, kv_spec=("x",)),
      Setup("bias-mask-lengths", (2, 4), ("x", None, "y"), bias="BNTS",
            bias_spec=("x", "y"), mask="BTS", mask_spec=("x",), lengths=True),
      Setup("bias-broadcast-batch", (2, 4), ("x", None, "y"), bias="NTS",
            bias_spec=(None, "y"), dbias_all_reduced=True),
      Setup("bias-broadcast-heads", (2, 4), ("x", None, "y"), bias="BTS",
            bias_spec=("x",), dbias_all_reduced=True),
      Setup("segment-ids-lengths-gqa", (2, 4), ("x", None, "y"), N=8, K=4, segments=True,
            lengths=True),
      Setup("explicit-mesh", (2, 4), ("x", None, "y"), N=8, K=4, explicit=True),
      Setup("explicit-mesh-bias-mask", (2, 4), ("x", None, "y"), bias="BNTS",
            bias_spec=("x", "y"), mask="BTS", mask_spec=("x",), explicit=True),
  ]
  if PLATFORM == "gpu":
    SETUPS = [dataclasses.replace(s, mesh=(min(s.mesh[0], 2), 1 if s.mesh[0] > 1 else
                                          min(s.mesh[1], 2)))
              for s in SETUPS if s.name != "batch-8"]

  @pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
  def test_check_sharded_equals_single_device(setup):
    _check(setup)

  def test_check_vmap_over_a_sharded_axis():
    """vmap adds a leading batch axis, which may be sharded like any batch axis; the unmapped
    key/value get one gradient summed over the mapped problems (by jax, across shards)."""
    s = Setup("vmap", (2, 4), ("x", None, "y"))
    mesh = _mesh(s)
    rng = np.random.default_rng(3)
    M = 2
    q = jnp.asarray(rng.standard_normal((M, s.B, s.T, s.N, HEAD_DIM)), DTYPE)
    k = jnp.asarray(rng.standard_normal((s.B, s.S, s.K, HEAD_DIM)), DTYPE)
    v = jnp.asarray(rng.standard_normal((s.B, s.S, s.K, HEAD_DIM)), DTYPE)
    dout = jnp.asarray(rng.standard_normal(q.shape), DTYPE)

    def run(q, k, v, dout):
      f = jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True),
                   in_axes=(0, None, None))
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + vjp(dout)

    want = jax.jit(run)(q, k, v, dout)
    q_sharding = NamedSharding(mesh, P("x", None, None, "y"))
    kv_sharding = NamedSharding(mesh, P(None, None, "y"))
    placed = [jax.device_put(a, sh) for a, sh in
              ((q, q_sharding), (k, kv_sharding), (v, kv_sharding), (dout, q_sharding))]
    got = jax.jit(run)(*placed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
      _assert_same(name, a, b)
    fwd = jax.jit(jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v),
                           in_axes=(0, None, None)))
    hlo = fwd.lower(*placed[:3]).compile().as_text()
    assert not _collective_shapes(hlo)
    assert _hlo_shape((1, s.B, s.T, s.N // 4, HEAD_DIM), DTYPE) in hlo

  def test_check_head_dim_sharding_raises():
    s = Setup("head-dim", (2, 1), ("x",))
    mesh = _mesh(s)
    x = _inputs(s)
    spec = NamedSharding(mesh, P(None, None, None, "x"))
    q, k, v = (jax.device_put(x[n], spec) for n in ("q", "k", "v"))
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True))
    with pytest.raises(Exception, match=r"query \(shape .*\) is sharded along its head dim "
                                        r"axis \(H\)"):
      f.lower(q, k, v).compile()

  def test_check_incompatible_head_sharding_raises():
    s = Setup("heads", (1, 4), (None, None, "y"), N=12, K=3)
    mesh = _mesh(s)
    x = _inputs(s)
    q = jax.device_put(x["q"], NamedSharding(mesh, P(None, None, "y")))
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v))
    with pytest.raises(Exception, match="must divide K or be a multiple of K"):
      f.lower(q, x["k"], x["v"]).compile()

  # --- ring attention (sequence split over a mesh axis, inside shard_map) ----------------------

  @dataclasses.dataclass(frozen=True)
  class RingSetup:
    """`ring` devices along "sp" hold consecutive sequence chunks; `outer` more devices along
    "dp" shard the batch (or, with `outer_heads`, the heads)."""

    name: str
    ring: int
    outer: int = 1
    outer_heads: bool = False
    is_causal: bool = False
    # True: ragged lengths; "extremes": int32's (an item without rows, one without keys).
    lengths: bool | str = False
    N: int = 4
    K: int = 4
    B: int = 2
    T: int = 40  # global; a multiple of ring (of twice the ring with the zigzag layout)
    S: int = 40
    layout: str = "contiguous"
    softcap: float | None = None  # logits_soft_cap (elementwise: the ring's merge is unchanged)
    # Segment ids, split like their sequence ("sorted": packed documents across the chunks;
    # "unsorted": random key/value ids).
    segments: str | None = None
    window: tuple[int, int] | None = None  # local_window_size, over global positions
    exchange: str = "ring"  # kv_exchange (the jit entry always runs the ring)

  RING_SETUPS = [
      RingSetup("ring-2", 2),
      RingSetup("ring-2-causal", 2, is_causal=True),
      RingSetup("ring-4-causal-lengths", 4, is_causal=True, lengths=True),
      RingSetup("ring-8", 8, T=24, S=56),
      RingSetup("ring-8-causal-gqa", 8, is_causal=True, N=8, K=2),
      RingSetup("ring-8-mqa-lengths", 8, lengths=True, N=4, K=1),
      RingSetup("ring-4-batch-2", 4, outer=2, is_causal=True),
      RingSetup("ring-4-heads-2", 4, outer=2, outer_heads=True, is_causal=True, lengths=True,
                N=4, K=2),
      RingSetup("ring-4-zigzag-causal", 4, is_causal=True, layout="zigzag"),
      RingSetup("ring-8-zigzag-causal-lengths-gqa", 8, is_causal=True, lengths=True, N=8, K=2,
                T=48, S=48, layout="zigzag"),
      RingSetup("ring-2-zigzag-lengths", 2, lengths=True, T=24, S=40, layout="zigzag"),
      RingSetup("ring-4-causal-lengths-gqa-softcap", 4, is_causal=True, lengths=True, N=4, K=2,
                softcap=1.5),
      RingSetup("ring-4-causal-lengths-segments", 4, is_causal=True, lengths=True,
                segments="sorted"),
      RingSetup("ring-2-zigzag-causal-gqa-segments", 2, is_causal=True, N=4, K=2,
                layout="zigzag", segments="sorted"),
      RingSetup("ring-2-unsorted-segments", 2, T=24, S=40, segments="unsorted"),
      # Windows and causal attention with T != S: each device's blocks have their own offset
      # between query and key positions, and the window cuts chunks in their middle.
      RingSetup("ring-4-causal-window", 4, is_causal=True, window=(13, 0)),
      RingSetup("ring-4-window-two-sided-lengths", 4, window=(7, 9), lengths=True),
      RingSetup("ring-4-int32-extreme-lengths", 4, lengths="extremes"),
      RingSetup("ring-8-causal-t-neq-s-gqa", 8, is_causal=True, T=24, S=56, N=4, K=2),
      RingSetup("ring-4-window-t-neq-s", 4, window=(6, 11), T=24, S=40),
      RingSetup("ring-2-zigzag-causal-window-gqa-segments", 2, is_causal=True, window=(9, 0),
                N=4, K=2, layout="zigzag", segments="sorted"),
      RingSetup("ring-4-zigzag-window-t-neq-s", 4, window=(5, 3), T=48, S=32,
                layout="zigzag"),
      # Key/value gathered whole on every device instead of passed around the ring.
      RingSetup("gather-4-causal-lengths-gqa", 4, is_causal=True, lengths=True, N=4, K=1,
                exchange="all_gather"),
      RingSetup("gather-8-zigzag-causal-window", 8, is_causal=True, window=(11, 0), T=48,
                S=48, layout="zigzag", exchange="all_gather"),
      RingSetup("gather-4-batch-2-t-neq-s-segments", 4, outer=2, T=24, S=40,
                segments="unsorted", exchange="all_gather"),
      RingSetup("gather-2-zigzag-causal-softcap", 2, is_causal=True, softcap=1.5,
                layout="zigzag", exchange="all_gather"),
  ]
  if PLATFORM == "gpu":
    RING_SETUPS = [dataclasses.replace(s, ring=2, outer=1, T=256, S=256)
                   for s in RING_SETUPS if s.ring * s.outer <= 8]

  def _ring_mesh(s: RingSetup):
    count = s.ring * s.outer
    if count > len(DEVICES):
      pytest.skip(f"needs {count} {PLATFORM} devices, have {len(DEVICES)}")
    return jax.make_mesh((s.outer, s.ring), ("dp", "sp"),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=DEVICES[:count])

  @pytest.mark.parametrize("entry", ["shard_map", "jit"])
  @pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: s.name)
  def test_check_ring_attention_equals_single_device(setup, entry):
    """jax_flash.ring_attention inside shard_map, and the plain call under jit with operands
    sharded along the sequence (which runs the same ring, in the contiguous layout). With the
    zigzag layout the sequence is put in zigzag order before the ring and restored after."""
    s = setup
    if entry == "jit" and s.layout != "contiguous":
      pytest.skip("jit splits the sequence in its natural, contiguous order")
    # Under jit the key/value exchange follows jax_flash's rule.
    exchange = s.exchange if entry == "shard_map" else _ring.choose_exchange(
        (s.B, s.T, s.N, HEAD_DIM), (s.B, s.S, s.K, HEAD_DIM))
    mesh = _ring_mesh(s)
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((s.B, s.T, s.N, HEAD_DIM)), DTYPE)
    k = jnp.asarray(rng.standard_normal((s.B, s.S, s.K, HEAD_DIM)), DTYPE)
    v = jnp.asarray(rng.standard_normal((s.B, s.S, s.K, HEAD_DIM)), DTYPE)
    dout = jnp.asarray(rng.standard_normal(q.shape), DTYPE)
    dlse = jnp.asarray(rng.standard_normal((s.B, s.T, s.N)) * 0.1, jnp.float32)
    if s.lengths == "extremes":  # the chunks' arithmetic must not wrap around int32
      q_len = jnp.asarray([np.iinfo(np.int32).min, np.iinfo(np.int32).max], jnp.int32)
      kv_len = jnp.asarray([np.iinfo(np.int32).max, np.iinfo(np.int32).min], jnp.int32)
    elif s.lengths:  # one short item (rows past it are padding), ends inside a middle chunk
      q_len = jnp.asarray([s.T, s.T // 2 + 1], jnp.int32)
      kv_len = jnp.asarray([s.S // 3, s.S], jnp.int32)
    else:
      q_len = kv_len = None
    if s.segments:  # ids that change inside the chunks and across their boundaries
      q_seg = np.sort(rng.integers(0, 4, (s.B, s.T)), axis=1)
      kv_seg = rng.integers(0, 4, (s.B, s.S))
      if s.segments == "sorted":
        kv_seg = np.sort(kv_seg, axis=1)
      q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
    else:
      q_seg = kv_seg = None

    def full(q, k, v, q_seg=q_seg, kv_seg=kv_seg):
      return jax_flash.dot_product_attention(
          q, k, v, is_causal=s.is_causal, query_seq_lengths=q_len,
          key_value_seq_lengths=kv_len, local_window_size=s.window, return_residual=True,
          logits_soft_cap=s.softcap, query_segment_ids=q_seg, key_value_segment_ids=kv_seg)

    batch = None if s.outer_heads else "dp"
    heads = "dp" if s.outer_heads else None
    seq_spec = P(batch, "sp", heads)
    len_spec = P(batch)
    ids_spec = P(batch, "sp")

    def sharded_call(q, k, v):
      constrain = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
      ids = [None if x is None else constrain(x, ids_spec) for x in (q_seg, kv_seg)]
      return full(*(constrain(x, seq_spec) for x in (q, k, v)), *ids)

    def ring(q, k, v):
      if entry == "jit":
        return sharded_call(q, k, v)

      def local(q, k, v, q_len, kv_len, q_seg, kv_seg):
        return jax_flash.ring_attention(
            q, k, v, axis_name="sp", is_causal=s.is_causal, query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len, local_window_size=s.window, layout=s.layout,
            kv_exchange=s.exchange, return_residual=True, logits_soft_cap=s.softcap, query_segment_ids=q_seg,
            key_value_segment_ids=kv_seg)
      lens = (q_len, kv_len)
      ids = tuple(None if x is None else order(x) for x in (q_seg, kv_seg))
      specs = (tuple(None if x is None else len_spec for x in lens) +
               tuple(None if x is None else ids_spec for x in ids))
      return jax.shard_map(local, mesh=mesh, in_specs=(seq_spec,) * 3 + specs,
                           out_specs=(seq_spec, P(batch, "sp", heads)))(q, k, v, *lens, *ids)

    def forward_and_grads(f):
      def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse) + vjp((dout, dlse))
      return jax.jit(run)

    want = forward_and_grads(full)(q, k, v, dout, dlse)
    # The zigzag layout is the caller's order of the tokens (every operand and result has its
    # sequence on axis 1): put in before the program, undone after.
    order, restore = ((lambda x: jax_flash.zigzag_order(x, s.ring),
                       lambda x: jax_flash.zigzag_restore(x, s.ring))
                      if s.layout == "zigzag" else (lambda x: x, lambda x: x))
    args = tuple(order(x) for x in (q, k, v, dout, dlse))
    got = tuple(restore(x) for x in forward_and_grads(ring)(*args))
    eps = float(jnp.finfo(DTYPE).eps)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      assert a.shape == b.shape, (name, a.shape, b.shape)
      # Rows that see no key: lse -inf in both.
      np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
      a, b = np.where(np.isneginf(b), 0, a), np.where(np.isneginf(b), 0, b)
      # Each of the ring's blocks is rounded to the input dtype before the exact merge (a
      # rescaling by at most 1 and an addition per block): 2 roundings per block.
      tol = 2 * s.ring * eps * max(1.0, np.abs(b).max())
      np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=name)

    hlo = forward_and_grads(ring).lower(*args).compile().as_text()
    found = _collective_shapes(hlo)
    assert "all-to-all" not in found, found
    if exchange == "ring":  # the key/value shards travel around the ring; nothing is gathered
      assert "collective-permute" in found, found
      assert "all-gather" not in found, found
    else:  # key/value (and their ids) are gathered, never the queries
      assert "all-gather" in found and "collective-permute" not in found, found
      # Compared without unit axes: the GPU compiler gathers K = 1 key/value heads as
      # (B, S, H), the CPU's as (B, S, 1, H).
      def squeezed(dims):
        return tuple(d for d in dims if d != 1)

      kv_dims = {squeezed((s.S, s.K, HEAD_DIM)), (s.S,)}
      for shape in found["all-gather"]:
        dims = tuple(int(d) for d in shape[shape.index("[") + 1:-1].split(","))
        assert squeezed(dims[1:]) in kv_dims or squeezed(dims[2:]) in kv_dims, (shape, found)

  def _ring_inputs(T=32, S=32, N=4, K=2):
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((2, T, N, HEAD_DIM)), DTYPE)
    k = jnp.asarray(rng.standard_normal((2, S, K, HEAD_DIM)), DTYPE)
    return q, k, k

  def test_check_query_sequence_alone_sharded_runs_the_ring():
    """Only the query arrives split along its sequence: key/value are split to match (a local
    slice of the replicated arrays) and the ring runs; the output stays split like the query."""
    mesh = _ring_mesh(RingSetup("t-only", 4))
    q, k, v = _ring_inputs()
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True))
    want = f(q, k, v)
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "sp")))
    got = f(qs, k, v)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=0, atol=8 * 4 * float(jnp.finfo(DTYPE).eps))
    assert got.sharding.spec[1] == "sp", got.sharding
    assert "collective-permute" in _collective_shapes(f.lower(qs, k, v).compile().as_text())

  @pytest.mark.parametrize("case,error,match", [
      ("uneven", ValueError, r"must divide the query sequence \(T\) length 30"),
      ("bias", NotImplementedError, "does not take bias or mask arrays yet"),
  ])
  def test_check_unsupported_sequence_splits_raise(case, error, match):
    """jax_flash's error is raised inside XLA's partitioner, which reports it as a
    JaxRuntimeError (INTERNAL: custom_partitioner) quoting the error's type and message."""
    mesh = _ring_mesh(RingSetup(case, 4))
    q, k, v = _ring_inputs(T=30 if case == "uneven" else 32)
    kwargs = dict(is_causal=True)
    bias = jnp.zeros((2, 4, q.shape[1], k.shape[1]), DTYPE) if case == "bias" else None
    spec = NamedSharding(mesh, P(None, "sp"))

    def f(q, k, v):  # an uneven split can only be asked for inside the program
      q = jax.lax.with_sharding_constraint(q, spec)
      return jax_flash.dot_product_attention(q, k, v, bias, **kwargs)

    with pytest.raises(jax.errors.JaxRuntimeError, match=f"{error.__name__}: jax_flash: .*{match}"):
      jax.jit(f).lower(q, k, v).compile()

  @pytest.mark.parametrize("mapped", ["query", "key-value"])
  def test_check_vmap_over_a_split_sequence(mapped):
    """vmap adds a batch axis where only some operands are mapped; the ring's results and
    gradients have the full batch shape, summed by jax over the unmapped operands' axis."""
    mesh = _ring_mesh(RingSetup("vmap", 4, outer=2))
    rng = np.random.default_rng(5)
    M, B, T = 3, 2, 32
    q_shape = (M, B, T, 4, HEAD_DIM) if mapped == "query" else (B, T, 4, HEAD_DIM)
    kv_shape = (M, B, T, 2, HEAD_DIM) if mapped == "key-value" else (B, T, 2, HEAD_DIM)
    q = jnp.asarray(rng.standard_normal(q_shape), DTYPE)
    k = jnp.asarray(rng.standard_normal(kv_shape), DTYPE)
    v = jnp.asarray(rng.standard_normal(kv_shape), DTYPE)
    in_axes = (0, None, None) if mapped == "query" else (None, 0, 0)

    def run(q, k, v):
      f = jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True),
                   in_axes=in_axes)
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + vjp(jnp.ones_like(out))

    want = jax.jit(run)(q, k, v)

    def place(x):
      spec = P("dp", "sp") if x.ndim == 4 else P(None, "dp", "sp")
      return jax.device_put(x, NamedSharding(mesh, spec))

    got = jax.jit(run)(*(place(x) for x in (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      np.testing.assert_allclose(a, b, rtol=0, err_msg=name,
                                 atol=2 * 4 * float(jnp.finfo(DTYPE).eps) * max(1.0, np.abs(b).max()))

  def test_check_ring_benchmark_runs(tmp_path):
    """bench/bench_ring.py end to end on 2 CPU devices (timings there mean nothing)."""
    if PLATFORM != "cpu":
      pytest.skip("the benchmark's smoke run is a CPU check")
    import importlib.util
    import sys

    script = HERE.parent / "bench" / "bench_ring.py"
    spec = importlib.util.spec_from_file_location("bench_ring", script)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    data = bench.main(["--platform", "cpu", "--devices", "1,2", "--seqlens", "256",
                       "--modes", "fwd_bwd", "--head-dim", "16", "--heads", "2",
                       "--iterations", "1", "--out", str(tmp_path)])
    cells = {(r["cell"]["devices"], r["cell"]["layout"]): r for r in data["results"]}
    assert set(cells) == {(1, "contiguous"), (2, "contiguous"), (2, "zigzag")}
    for r in cells.values():
      assert not r.get("error"), r
      assert r["ms"] > 0 and r["flops_per_s_per_device"] > 0 and r["efficiency"] > 0
    assert (tmp_path / "ring_cpu.json").exists()

  def test_check_ring_second_derivative_fails_naming_jax_flash():
    mesh = _ring_mesh(RingSetup("grad-of-grad", 2))
    q, k, v = _ring_inputs()

    def loss(q):
      f = jax.shard_map(lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp"),
                        mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
      return jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)

    with pytest.raises(NotImplementedError, match="has first derivatives only"):
      jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)
