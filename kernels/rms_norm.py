"""Residual add + RMSNorm in one launch, for the decode step's [B, D] activations.

h = x + delta (computed in float32 and rounded once to x's dtype: a correctly rounded add, as `x + delta`;
XLA may skip that rounding inside a fusion, as its excess-precision rewrites allow),
normed = w * (h_f32 * rsqrt(mean(h_f32^2) + eps)).astype(h.dtype): the model's `rms_norm(h, w, eps)` with
the same casts. One program per row holds the whole row (D padded to a power of two for Triton, pads
masked on load and store). In decode XLA ran this as three launch-bound kernels (add, sum-of-squares,
scale) per norm on the H200; here it is one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.checks import FLOAT_DTYPES, check_dtype
from rocketkv_jax.kernels.triton_util import next_pow2


def add_rms_norm_reference(x_BD, delta_BD, w_D, *, eps: float, **unused_tuning):
  """(h, normed): h = x + delta in x's dtype (h = x when delta is None), normed = RMSNorm(h) * w with the
  statistics in float32, the normalised row rounded to h's dtype before the scale, the product in
  result_type(w, h)."""
  del unused_tuning
  h = x_BD if delta_BD is None else x_BD + delta_BD
  hf = h.astype(jnp.float32)
  hf = hf * lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
  return h, w_D * hf.astype(h.dtype)


def _add_rms_norm_kernel(
    # inputs
    x_ref,  # [D]
    delta_ref,  # [D], or None (h = x)
    w_ref,  # [D]
    # outputs
    h_ref,  # [D], or None (delta is None: h is x)
    normed_ref,  # [D]
    *,
    eps: float,
):
  D = x_ref.shape[0]
  Dp = next_pow2(D)
  ok = None if Dp == D else jnp.arange(Dp) < D  # no mask at all when D is a power of two
  row = pl.ds(0, Dp)
  other = None if ok is None else 0
  load = lambda ref: pltriton.load(ref.at[row], mask=ok, other=other).astype(jnp.float32)  # noqa: E731
  hf = load(x_ref)
  if delta_ref is not None:
    # The float32 sum of two bf16 (or f32) values rounded once to x's dtype is XLA's correctly rounded add.
    h = (hf + load(delta_ref)).astype(x_ref.dtype)
    pltriton.store(h_ref.at[row], h, mask=ok)
    hf = h.astype(jnp.float32)
  # Pads are 0 and add nothing to the sum; the mean divides by the real D.
  inv_rms = lax.rsqrt(jnp.sum(hf * hf) / D + eps)
  # Rounded to h's dtype first, as the model's rms_norm; w * that product is exact in float32 for bf16
  # operands, so one rounding to the output dtype matches XLA's multiply.
  normed = load(w_ref) * (hf * inv_rms).astype(x_ref.dtype).astype(jnp.float32)
  pltriton.store(normed_ref.at[row], normed.astype(normed_ref.dtype), mask=ok)


def _check_args(x_BD, delta_BD, w_D, eps):
  if x_BD.ndim != 2:
    raise ValueError(f"x_BD.shape={x_BD.shape} must be 2-D (B, D)")
  B, D = x_BD.shape
  if B < 1 or D < 1:
    raise ValueError(f"x_BD.shape={x_BD.shape} must have B >= 1 and D >= 1")
  check_dtype("x_BD", x_BD.dtype, FLOAT_DTYPES)
  if delta_BD is not None:
    if delta_BD.shape != x_BD.shape:
      raise ValueError(f"delta_BD.shape={delta_BD.shape} must equal x_BD.shape={x_BD.shape}")
    if delta_BD.dtype != x_BD.dtype:
      raise ValueError(f"delta_BD.dtype={delta_BD.dtype} must equal x_BD.dtype={x_BD.dtype}")
  if w_D.shape != (D,):
    raise ValueError(f"w_D.shape={w_D.shape} must be ({D},)")
  check_dtype("w_D", w_D.dtype, FLOAT_DTYPES)
  if not eps > 0:
    raise ValueError(f"eps={eps} must be > 0")


@functools.partial(jax.jit, static_argnames=["eps", "interpret"])
def add_rms_norm(x_BD, delta_BD, w_D, *, eps: float, interpret: bool = False):
  """Returns (h_BD, normed_BD): the residual stream h = x + delta (in x's dtype) and RMSNorm(h) scaled by
  w (in result_type(w, x)), equal to `add_rms_norm_reference` up to the order of the row's float32 sum.
  With delta_BD None, h is x itself (nothing is written for it)."""
  _check_args(x_BD, delta_BD, w_D, eps)
  B, D = x_BD.shape
  row_spec = pl.BlockSpec((None, D), lambda b: (b, 0))
  w_spec = pl.BlockSpec((D,), lambda b: (0,))
  normed_shape = jax.ShapeDtypeStruct((B, D), jnp.result_type(w_D.dtype, x_BD.dtype))
  kernel = functools.partial(_add_rms_norm_kernel, eps=float(eps))
  if delta_BD is None:
    def body(x_ref, w_ref, normed_ref):
      kernel(x_ref, None, w_ref, None, normed_ref)
    in_specs, args = [row_spec, w_spec], (x_BD, w_D)
    out_specs, out_shape = [row_spec], [normed_shape]
  else:
    body = kernel
    in_specs, args = [row_spec, row_spec, w_spec], (x_BD, delta_BD, w_D)
    out_specs, out_shape = [row_spec, row_spec], [jax.ShapeDtypeStruct((B, D), x_BD.dtype), normed_shape]
  outs = pl.pallas_call(
      body,
      grid=(B,),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="rocketkv_add_rms_norm" if delta_BD is not None else "rocketkv_rms_norm",
  )(*args)
  return (x_BD, outs[0]) if delta_BD is None else tuple(outs)
