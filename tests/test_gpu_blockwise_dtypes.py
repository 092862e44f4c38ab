"""GPU calls that the Hopper kernels do not run, and run on the blockwise JAX path instead: calls
in the dtypes the kernels do not list (float32, and float64 with x64: GPU_BLOCKWISE_DTYPES of
kernel_configs.json), and every call to a build without the CUDA handlers.

On the GPU (marked `gpu`): results in those dtypes against the float64 definition under the
criterion of tests/_tolerances.py (float32 baselines run on the CPU, so TF32 arithmetic would
fail it), with each feature of the blockwise path, under vmap, in ring attention and through the
Flax attention_fn; and float32's error checked directly to be far below TF32's. On any machine:
the routing, seen in programs lowered for CUDA, and the one-time warning of a build without the
CUDA handlers, whose fallback runs here on the CPU as a GPU would run it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_flash
import jax_flash.flax as jf
from jax_flash import _config, _extension, _primitive, _validation

import _reference as ref
from _harness import (Case, check_forward, check_gradients, make_inputs, np_dtype, visibility,
                      vjp)
from _platforms import GPU, platform_dtypes, with_platform

BLOCKWISE_DTYPES = [d.name for d in _config.GPU_BLOCKWISE_DTYPES]
H = min(_config.GPU_HEAD_DIMS)

CASES = {
    "awkward-sizes": dict(T=65, S=127),
    "causal-gqa": dict(T=190, S=190, N=4, K=2, is_causal=True),
    "bias-mask": dict(T=73, S=90, N=4, K=2, bias="B1TS", mask="1NTS"),
    "window-lengths": dict(B=3, T=40, S=33, q_lens=(40, 17, 0), kv_lens=(33, 5, 20),
                           window=(6, 3)),
    "softcap": dict(T=61, S=45, N=4, K=2, is_causal=True, softcap=5.0, std=3.0),
    "segment-ids": dict(T=64, S=64, N=4, K=2, is_causal=True, q_segs=(20, 30, 14),
                        kv_segs=(20, 30, 14)),
    "unbatched-mqa-negative-scale": dict(B=None, T=21, S=30, N=4, K=1, bias="NTS", scale=-0.4),
    # No Hopper tile has it; the blockwise path takes any head dim.
    "head-dim-beyond-the-tiles": dict(T=33, S=47, H=_config.GPU_MAX_HEAD_DIM + 3),
}

# max|ours - float64| / max|float64| of float32 output and gradients: the blockwise path stays
# near 1e-6 (about 7e-7 measured at T=256, S=512, H=64); TF32's 10-bit mantissas (unit roundoff
# 2^-11) give 1.5e-4 to 1.3e-3 there from rounding the inputs alone.
TF32_FREE = 1e-5


def gpu_blockwise_dtypes():
  return platform_dtypes(cpu_dtypes=[], gpu_dtypes=BLOCKWISE_DTYPES)


def case_of(dtype: str, name: str) -> Case:
  return Case(**{"H": H, "dtype": dtype, **CASES[name]})


# --- on the GPU --------------------------------------------------------------------------------


@with_platform("platform,dtype", gpu_blockwise_dtypes())
@pytest.mark.parametrize("name", CASES)
def test_forward(platform, dtype, name):
  check_forward(case_of(dtype, name), platform)


@with_platform("platform,dtype", gpu_blockwise_dtypes())
@pytest.mark.parametrize("name", CASES)
def test_gradients(platform, dtype, name):
  """dq, dk, dv, dbias; the cotangent also reaches the log-sum-exp."""
  check_gradients(case_of(dtype, name), platform, through_lse=True)


def assert_tf32_free(what: str, case: Case, f) -> None:
  """f(q, k, v) -> output on float32 inputs of `case` (no bias or mask): output and gradients
  within TF32_FREE of the float64 definition, relative to their largest entry."""
  inp = make_inputs(case)
  vis = visibility(case, inp)
  dout = np.random.default_rng(1).standard_normal(inp.q.shape).astype(np.float32)
  grads, out = vjp(jax.jit(f), [jnp.asarray(x) for x in (inp.q, inp.k, inp.v)],
                   jnp.asarray(dout), with_primal_out=True)
  with ref.precise():
    def definition(q, k, v):
      return ref.attention_with_lse(q, k, v, None, vis, scale=case.scale)[0]

    hi_grads, hi_out = vjp(definition, [jnp.asarray(x, jnp.float64) for x in (inp.q, inp.k,
                                                                              inp.v)],
                           jnp.asarray(dout, jnp.float64), with_primal_out=True)
  for name, ours, hi in zip(("output", "dq", "dk", "dv"), (out, *grads), (hi_out, *hi_grads)):
    assert ours.dtype == np.float32, (what, name, ours.dtype)
    error = float(np.abs(ours.astype(np.float64) - hi).max() / np.abs(hi).max())
    assert error < TF32_FREE, f"{what} {name}: relative error {error:.3g} >= {TF32_FREE}"


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_float32_is_not_tf32(platform):
  case = Case(B=2, T=256, S=512, N=4, K=2, H=H, dtype="float32", is_causal=True)
  assert_tf32_free("dot_product_attention", case, lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True))


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_float32_ring_attention(platform):
  """ring_attention routes its blocks like dot_product_attention (here on a ring of one GPU)."""
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,),
                       devices=jax.devices("gpu")[:1])
  ring = jax.shard_map(
      lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=True),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
  assert_tf32_free("ring_attention", Case(T=128, S=128, N=4, K=2, H=H, is_causal=True), ring)


@pytest.mark.parametrize("platform", [GPU], indirect=True)
def test_float32_flax_attention_fn(platform):
  """The Flax attention_fn, with extra batch axes folded, keeps float32 on the GPU."""
  attention_fn = jf.make_attention_fn(is_causal=True)
  case = Case(B=2, T=96, S=96, N=4, K=2, H=H, is_causal=True)

  def f(q, k, v):
    unfold = lambda x: x.reshape((2, 1) + x.shape[1:])
    return attention_fn(unfold(q), unfold(k), unfold(v)).reshape(q.shape)

  assert_tf32_free("flax attention_fn", case, f)


@with_platform("platform,dtype", gpu_blockwise_dtypes())
def test_vmap_of_grad(platform, dtype):
  """vmap(grad) over three problems equals the gradients of each problem alone."""
  case = Case(T=33, S=47, N=4, K=2, H=H, dtype=dtype, is_causal=True, bias="B1TS")
  problems = [make_inputs(case, seed) for seed in range(3)]

  def loss(q, k, v, bias):
    out = jax_flash.dot_product_attention(q, k, v, bias, is_causal=True)
    return jnp.sum(jnp.sin(out))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  with ref.x64_if(dtype):
    stacked = [jnp.stack([getattr(p, name) for p in problems]) for name in ("q", "k", "v",
                                                                            "bias")]
    mapped = [np.asarray(g) for g in jax.jit(jax.vmap(grad))(*stacked)]
    alone = [[np.asarray(g) for g in jax.jit(grad)(p.q, p.k, p.v, p.bias)] for p in problems]
  eps = float(np.finfo(np_dtype(dtype)).eps)
  for i, grads in enumerate(alone):
    for name, g_mapped, g in zip(("dq", "dk", "dv", "dbias"), mapped, grads):
      # The same arithmetic, batched: at most a few roundings per reduction apart.
      np.testing.assert_allclose(g_mapped[i], g, rtol=0, atol=100 * eps * np.abs(g).max(),
                                 err_msg=f"problem {i} {name}")


# --- the routing, lowered for CUDA on any machine ----------------------------------------------


def lowered_for_cuda(dtype) -> str:
  """StableHLO of the forward and gradients of a causal call, lowered for CUDA."""
  def loss(q, k, v):
    out = jax_flash.dot_product_attention(q, k, v, is_causal=True)
    return jnp.sum(out.astype(jnp.float32))

  with ref.x64_if(dtype):
    q = jnp.zeros((1, 64, 2, H), dtype)
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, q, q)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def ffi_calls(hlo: str) -> set:
  return {t for t in (_extension.FORWARD_TARGET, _extension.BACKWARD_TARGET) if t in hlo}


@pytest.fixture
def fresh_traces():
  """The routing is decided while tracing, from the build (constant in a process, patched
  here), and jax caches traces: none may carry over into or out of a test."""
  jax.clear_caches()
  yield
  jax.clear_caches()


def test_cuda_lowering_runs_the_hopper_kernels_in_their_dtypes_only(fresh_traces, monkeypatch):
  monkeypatch.setattr(_extension, "cuda_built", lambda: True)
  # A CPU-only build cannot size the Hopper backward's workspace; lowering needs only a shape.
  monkeypatch.setattr(_extension, "backward_workspace_bytes", lambda *args, **kwargs: 0)
  for dtype in _config.GPU_DTYPES:
    assert ffi_calls(lowered_for_cuda(dtype)) == {_extension.FORWARD_TARGET,
                                                  _extension.BACKWARD_TARGET}, dtype
  for dtype in _config.GPU_BLOCKWISE_DTYPES:
    assert ffi_calls(lowered_for_cuda(dtype)) == set(), dtype


def test_cuda_lowering_without_the_cuda_handlers_runs_no_kernel(fresh_traces, monkeypatch):
  monkeypatch.setattr(_extension, "cuda_built", lambda: False)
  for dtype in _config.CPU_DTYPES:
    assert ffi_calls(lowered_for_cuda(dtype)) == set(), dtype


# --- a build without the CUDA handlers on a GPU backend ----------------------------------------


@pytest.fixture
def gpu_backend_without_cuda_handlers(fresh_traces, monkeypatch):
  """Trace-time validation as on a GPU backend, a build without the CUDA handlers, and every
  lax.platform_dependent call running its CUDA branch (on this CPU: the program a GPU would
  run). Yields the list of the CUDA branches run; the one-time warning is re-armed around."""
  monkeypatch.setattr(_validation, "on_gpu", lambda: True)
  monkeypatch.setattr(_extension, "cuda_built", lambda: False)
  branches = []

  def cuda_branch(*operands, cuda, **others):
    del others
    branches.append(cuda.func)
    return cuda(*operands)

  monkeypatch.setattr(jax.lax, "platform_dependent", cuda_branch)
  _extension.warn_cuda_handlers_not_built.cache_clear()
  yield branches
  _extension.warn_cuda_handlers_not_built.cache_clear()


def test_without_cuda_handlers_a_gpu_call_warns_once_and_runs_blockwise(
    gpu_backend_without_cuda_handlers):
  """The first call warns, quoting build_info()'s cuda_status and how to build the handlers;
  forward and gradients run on the blockwise path (in a dtype and at a head dim the Hopper
  kernels would otherwise take or refuse) and match the float64 definition."""
  case = Case(T=37, S=53, N=4, K=2, H=_config.GPU_MAX_HEAD_DIM + 3,
              dtype=_config.GPU_DTYPES[0].name, is_causal=True, bias="B1TS")
  with pytest.warns(jax_flash.CudaHandlersNotBuiltWarning) as record:
    check_forward(case)
    check_gradients(case, through_lse=True)
  warned = [w for w in record if issubclass(w.category, jax_flash.CudaHandlersNotBuiltWarning)]
  assert len(warned) == 1, [str(w.message) for w in warned]
  message = str(warned[0].message)
  for words in (jax_flash.build_info()["cuda_status"], "blockwise", "nvidia-cutlass",
                "JAX_FLASH_CUDA=ON"):
    assert words in message, (words, message)
  assert set(gpu_backend_without_cuda_handlers) == {_primitive._blockwise_forward,
                                                   _primitive._blockwise_backward}
