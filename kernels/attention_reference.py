"""The semantics of exact masked decode attention: `dense_decode_attention_reference` and
`sparse_decode_attention_reference` are this over the slots they attend."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def masked_attention_reference(q_BKGH, k_BKMH, v_BKMH, valid_BKM):
  """Exact softmax attention (scale 1/sqrt(H), f32, full precision) of each query head of a KV group over
  the rows where `valid`; rows that are not valid never enter (NaN there is safe); no valid row gives 0."""
  H = q_BKGH.shape[-1]
  mask = valid_BKM[:, :, None, :]
  k = jnp.where(valid_BKM[..., None], k_BKMH.astype(jnp.float32), 0.0)
  v = jnp.where(valid_BKM[..., None], v_BKMH.astype(jnp.float32), 0.0)
  s = jnp.einsum("BKGH,BKMH->BKGM", q_BKGH.astype(jnp.float32), k,
                 precision=lax.Precision.HIGHEST) / math.sqrt(H)
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("BKGM,BKMH->BKGH", p, v, precision=lax.Precision.HIGHEST)
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return o.astype(q_BKGH.dtype)
