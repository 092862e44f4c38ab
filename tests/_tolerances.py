"""The accuracy criterion of the suite: one table, one entry per dtype.

A result ``ours`` is compared with ``ref_hi``, the same computation in float64 on the CPU from
the same input values (they upcast exactly). For float32, bfloat16 and float16 the allowed error
follows FlashAttention-3's tests:

    max|ours - ref_hi| <= k * max|baseline - ref_hi| + floor_ulps * granularity(max|ref_hi|)

``baseline`` is an established implementation run in the input dtype: jax's xla path
(``jax.nn.dot_product_attention(implementation='xla')``), or cuDNN on the GPU where cuDNN supports
the case. Its error measures how hard the case is in that precision; ``k`` says how much worse
than the baseline ours may be. float32 baselines run on the CPU, for GPU results too: at jax's
default precision XLA runs float32 matmuls on the GPU in TF32, and a TF32 baseline would allow
TF32's error. ``granularity(m)`` is the spacing of the result dtype at magnitude
``m``: the result is rounded to that dtype, so two roundings of it must always be allowed (cases
such as S == 1 are computed exactly by the baseline).

For float64 no more precise jax reference exists (the baseline would be ref_hi itself), so the
criterion is an a-priori rounding bound (Higham's gamma_n = n u / (1 - n u), u = eps / 2) on
dot-product chains of length ``n``, counted once for ours and once for the reference, with the
logits' magnitude L entering through the exponential:

    max|ours - ref_hi| <= 2 * gamma_n * max(1, max|ref_hi|) * (1 + L)

n is S + H for the output and log-sum-exp (logits, then the softmax sums) and S + T + H for the
gradients (the backward also sums over queries).

Gradients get one more, elementwise, allowance in every dtype (_harness.row_term_error): the
backward forms dS = P * (dP - rowsum(dO * O)) from the forward's rounded output O, as
FlashAttention does, so the output's judged error and the accumulation-type rounding of the two
length-H dot products (gamma_H * sum of |terms|) propagate, scaled by P, into dq, dk and dbias.
It is what remains where the exact gradient vanishes while its terms do not (a bias broadcast
over keys, a single key).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
  fwd_k: float | None  # multiple of the baseline's error allowed for the output
  lse_k: float | None  # the same for the log-sum-exp (always float32 or float64)
  grad_k: float | None  # the same for dq, dk, dv and dbias
  grad_cudnn_k: float | None  # the same for gradients where the baseline is cuDNN (GPU)
  floor_ulps: float  # multiples of the result dtype's granularity always allowed
  why: dict


TOLERANCES = {
    "float64": Tolerance(
        fwd_k=None, lse_k=None, grad_k=None, grad_cudnn_k=None, floor_ulps=2.0,
        why={
            "fwd_k": "no baseline: float64 is already the reference precision; the a-priori "
                     "bound 2*gamma_(S+H)*max(1,|ref|)*(1+L) is used instead",
            "lse_k": "same a-priori bound as the output (log and exp of the same sums)",
            "grad_k": "a-priori bound with n = S+T+H: the backward adds a sum over queries",
            "grad_cudnn_k": "cuDNN has no float64 attention",
            "floor_ulps": "the result itself is rounded once by ours and once by the reference",
        }),
    "float32": Tolerance(
        fwd_k=2.0, lse_k=2.0, grad_k=2.0, grad_cudnn_k=None, floor_ulps=2.0,
        why={
            "fwd_k": "FlashAttention-3's factor: the online softmax adds one rescaling rounding "
                     "per key block that xla's two-pass softmax does not have",
            "lse_k": "baseline is xla's float32 logsumexp; ours accumulates in float32 the same way",
            "grad_k": "FlashAttention-3's backward factor: blocked float32 accumulation of dS, "
                      "dQ, dK, dV in another order than xla",
            "grad_cudnn_k": "cuDNN's attention takes no float32: no cuDNN baseline",
            "floor_ulps": "the result is rounded to float32 once by ours and once by the baseline",
        }),
    "bfloat16": Tolerance(
        fwd_k=1.5, lse_k=2.0, grad_k=2.0, grad_cudnn_k=1.5, floor_ulps=2.0,
        why={
            "fwd_k": "ours accumulates in float32 and rounds the output once to 8 bits, the "
                     "baseline also rounds P to bfloat16: ours must be at least as accurate, "
                     "1.5 only leaves room for a different rounding pattern",
            "lse_k": "lse is float32 in both: compared with xla's float32 logsumexp of the same "
                     "(upcast) inputs, factor as for float32",
            "grad_k": "FlashAttention-3's backward factor: P and dS are rounded to bfloat16 "
                      "before their matmuls in either implementation",
            "grad_cudnn_k": "against cuDNN's backward, which computes what the Hopper kernel "
                            "does (float32 accumulation, P and dS rounded to bfloat16, dQ "
                            "summed over key blocks in float32): no more than 1.5x its error",
            "floor_ulps": "each gradient and output is rounded to bfloat16 once; two roundings "
                          "of slack at its magnitude",
        }),
    "float16": Tolerance(
        fwd_k=1.5, lse_k=2.0, grad_k=2.0, grad_cudnn_k=1.5, floor_ulps=2.0,
        why={
            "fwd_k": "as bfloat16: float32 accumulation, one rounding to 11 bits at the end",
            "lse_k": "as bfloat16: float32 log-sum-exp against xla's float32 logsumexp",
            "grad_k": "as bfloat16: FlashAttention-3's backward factor",
            "grad_cudnn_k": "as bfloat16: at most 1.5x cuDNN's error",
            "floor_ulps": "each result is rounded to float16 once",
        }),
}


def _finfo(dtype):
  dtype = np.dtype(dtype)
  return ml_dtypes.finfo(dtype) if dtype == np.dtype(ml_dtypes.bfloat16) else np.finfo(dtype)


def granularity(magnitude: float, dtype) -> float:
  """The spacing of `dtype` at `magnitude` (its unit in the last place there)."""
  info = _finfo(dtype)
  magnitude = max(abs(float(magnitude)), float(info.smallest_normal))
  return float(info.eps) * 2.0 ** math.floor(math.log2(magnitude))


def gamma(n: int, dtype=np.float64) -> float:
  u = float(_finfo(dtype).eps) / 2
  return n * u / (1 - n * u)


def allowed_error(kind: str, dtype, *, baseline_error: float | None, ref_max: float,
                  result_dtype=None, chain: int = 0, logit_max: float = 0.0) -> float:
  """The largest max-abs error accepted for one result.

  kind: "fwd", "lse", "grad" or "grad_cudnn" (a gradient judged against cuDNN's error).
  dtype: the inputs' dtype (selects the table entry).
  result_dtype: the compared result's dtype (lse is float32 for low-precision inputs).
  chain, logit_max: n and L of the float64 bound.
  """
  name = np.dtype(dtype).name
  tol = TOLERANCES[name]
  result_dtype = np.dtype(dtype) if result_dtype is None else np.dtype(result_dtype)
  floor = tol.floor_ulps * granularity(ref_max, result_dtype)
  k = getattr(tol, f"{kind}_k")
  if k is None:
    return 2 * gamma(chain) * max(1.0, ref_max) * (1.0 + logit_max) + floor
  assert baseline_error is not None, f"{name} {kind} needs a baseline"
  return k * baseline_error + floor
