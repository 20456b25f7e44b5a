"""FP8 K/V storage: the one definition of how a cache's keys and values are quantized and read back.

A quantized cache holds K and V in an FP8 dtype with one float32 scale per (sequence, KV head) each
(`k_scale`, `v_scale` [B, K]). Exactly:

  scale    = amax / FP8_MAX  over the finite |x| of the prompt's valid tokens of that (sequence, KV head), or 1
             where that amax is 0 (FP8_MAX: 448 for float8_e4m3fn, 57344 for float8_e5m2, the largest finite
             values)
  stored   = clip(x.astype(f32) / scale, -FP8_MAX, FP8_MAX).astype(fp8)   (round to nearest even; NaN stays NaN,
             +-inf and decode tokens past the prompt's range saturate to +-FP8_MAX: never inf)
  read     = stored.astype(f32) * scale

Since the scale is one per (sequence, KV head), the kernels never form `read` element by element: an FP8 value
converts exactly to bf16 / f32, the dot runs on the raw values, and the scale multiplies the logits (k) and the
output (v) in registers. Why per head and not per key channel: the measurement in docs/ALGORITHM.md ("FP8 K/V").
"""
from __future__ import annotations

import jax.numpy as jnp

KV_CACHE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_quantized(dtype) -> bool:
  """Whether a cache of this K/V dtype is quantized (holds scales)."""
  return jnp.dtype(dtype) in KV_CACHE_DTYPES


def fp8_max(dtype) -> float:
  """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
  return float(jnp.finfo(dtype).max)


def kv_scale(x_BKSH, valid_BKS, dtype):
  """[B, K] float32: amax of the finite |x| over the valid slots of each (sequence, KV head) / fp8_max(dtype); 1
  where that amax is 0 (a head of zeros, or no valid slot). Junk (invalid slots, NaN, inf) never enters."""
  a = jnp.abs(x_BKSH.astype(jnp.float32))
  a = jnp.where(valid_BKS[..., None] & jnp.isfinite(a), a, 0.0)
  amax = a.max(axis=(2, 3))
  return jnp.where(amax > 0, amax / fp8_max(dtype), 1.0).astype(jnp.float32)


def quantize(x, scale, dtype):
  """x (any float) stored in `dtype` at `scale` (float32, broadcasting against x: [B, K, 1, 1] for a cache
  [B, K, S, H], [B, K, 1] for a token [B, K, H]): clip(x / scale) to the dtype's finite range, rounded to
  nearest even."""
  m = fp8_max(dtype)
  return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def dequantize(x, scale):
  """x as float32 values: x.astype(f32) * scale (scale broadcasting as `quantize`'s)."""
  return x.astype(jnp.float32) * scale
