"""FP8 K/V storage: the one definition of how a cache's keys and values are quantized and read back.

A quantized cache holds K and V in an FP8 dtype with one float32 scale per (sequence, KV head) each
(`k_scale`, `v_scale` [B, K]), and the keys centred on their prompt mean per channel (`k_mean` [B, K, H]).
Exactly, for V (and for K with x replaced by x - k_mean):

  k_mean   = mean of the finite keys over the prompt's valid tokens of that (sequence, KV head), per channel
             (0 where there is none)
  scale    = amax / FP8_MAX  over the finite |x| of the prompt's valid tokens of that (sequence, KV head), or 1
             where that amax is 0 (FP8_MAX: 448 for float8_e4m3fn, 57344 for float8_e5m2, the largest finite
             values)
  stored   = clip(x.astype(f32) / scale, -FP8_MAX, FP8_MAX).astype(fp8)   (round to nearest even; NaN stays NaN,
             +-inf and decode tokens past the prompt's range saturate to +-FP8_MAX: never inf)
  read     = stored.astype(f32) * scale   (+ k_mean for keys)

Since the scale is one per (sequence, KV head), the kernels never form `read` element by element: an FP8 value
converts exactly to bf16 / f32, the dot runs on the raw values, and the scale multiplies the logits (k) and the
output (v) in registers. The key mean is never read by attention: it adds q . k_mean to every logit of a query,
which the softmax cancels exactly; a page's key min/max shifts by it alike, so the KT pages (built from the centred
keys) rank pages as before. Why centre the keys, and why per head and not per key channel: the measurements in
docs/ALGORITHM.md ("FP8 K/V").
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


def key_mean(x_BKSH, valid_BKS):
  """[B, K, H] float32: the mean of the finite x over the valid slots of each (sequence, KV head), per channel; 0
  where no valid slot is finite. Junk (invalid slots, NaN, inf) never enters."""
  x = x_BKSH.astype(jnp.float32)
  keep = valid_BKS[..., None] & jnp.isfinite(x)
  n = keep.sum(axis=2)
  return jnp.where(n > 0, jnp.where(keep, x, 0.0).sum(axis=2) / jnp.maximum(n, 1), 0.0)


def quantize(x, scale, dtype):
  """x (any float) stored in `dtype` at `scale` (float32, broadcasting against x: [B, K, 1, 1] for a cache
  [B, K, S, H], [B, K, 1] for a token [B, K, H]): clip(x / scale) to the dtype's finite range, rounded to
  nearest even."""
  m = fp8_max(dtype)
  return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def dequantize(x, scale):
  """x as float32 values: x.astype(f32) * scale (scale broadcasting as `quantize`'s)."""
  return x.astype(jnp.float32) * scale
