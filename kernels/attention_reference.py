"""The semantics of exact masked decode attention: `dense_decode_attention_reference` and
`sparse_decode_attention_reference` are this over the slots they attend."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from rocketkv_jax.kernels.kv_quant import dequantize


def masked_attention_reference(q_BKGH, k_BKMH, v_BKMH, valid_BKM, k_scale_BK=None, v_scale_BK=None):
  """Exact softmax attention of each query head of a KV group over the rows where `valid`: scores q.k in
  float32 (full precision) times 1/sqrt(H); the probabilities enter the value product in v's dtype, as in the
  kernels (float32 accumulation), and are normalised after it. Rows that are not valid never enter (NaN there
  is safe); no valid row gives 0. A NaN in a valid row's key or value gives NaN, as `jax.nn.dot_product_attention`
  does (the normaliser tests l == 0, which a NaN l fails, not l > 0, which would turn the NaN into 0).
  k_scale_BK, v_scale_BK: an FP8 cache's scales (`kv_quant`): k and v are read as `kv_quant.dequantize` gives
  them (float32), and the probabilities enter the value product in q's dtype (the kernels' dot dtype)."""
  scale = 1.0 / math.sqrt(q_BKGH.shape[-1])
  p_dtype = v_BKMH.dtype
  if k_scale_BK is not None:
    k_BKMH = dequantize(k_BKMH, k_scale_BK[:, :, None, None])
  if v_scale_BK is not None:
    v_BKMH, p_dtype = dequantize(v_BKMH, v_scale_BK[:, :, None, None]), q_BKGH.dtype
  mask = valid_BKM[:, :, None, :]
  k = jnp.where(valid_BKM[..., None], k_BKMH, jnp.zeros((), k_BKMH.dtype))
  v = jnp.where(valid_BKM[..., None], v_BKMH, jnp.zeros((), v_BKMH.dtype))
  s = jnp.einsum("BKGH,BKMH->BKGM", q_BKGH, k, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST) * scale
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("BKGM,BKMH->BKGH", p.astype(p_dtype), v, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST)
  o = jnp.where(l == 0, 0.0, o / jnp.where(l == 0, 1.0, l))
  return o.astype(q_BKGH.dtype)
