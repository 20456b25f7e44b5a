"""Small helpers shared by the Pallas kernels (no dependency on the rocketkv_jax core)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Scores of masked entries before the softmax. A large finite negative keeps exp() at exactly 0
# without producing inf - inf = NaN in the online-softmax correction.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's dot needs every dimension >= 16.
MIN_DOT_DIM = 16

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_dtype(name: str, dtype, allowed) -> None:
  if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in allowed):
    raise ValueError(f"{name}.dtype={jnp.dtype(dtype)} must be one of {[str(jnp.dtype(d)) for d in allowed]}")


def dot_precision(dtype):
  """float32 operands: full precision (no TF32); bf16: the native tensor-core path."""
  return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def partial_specs(G: int, H: int):
  """Block specs of a split-K decode kernel's per-split partials (o [G, H], running max m [G], sum l [G])
  on a (B, K, splits) grid."""
  return [pl.BlockSpec((None, None, None, G, H), lambda b, k, s: (b, k, s, 0, 0)),
          pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0)),
          pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0))]


def partial_shapes(B: int, K: int, num_splits: int, G: int, H: int):
  return [jax.ShapeDtypeStruct((B, K, num_splits, G, H), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_splits, G), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_splits, G), jnp.float32)]


def combine_partials(o_BKNGH, m_BKNG, l_BKNG, dtype):
  """Merges per-split (o, m, l) partials; a head with no valid slot at all gets 0."""
  m = m_BKNG.max(axis=2, keepdims=True)
  alpha = jnp.exp(m_BKNG - m)
  l = (l_BKNG * alpha).sum(axis=2)
  o = (o_BKNGH * alpha[..., None]).sum(axis=2)
  out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.astype(dtype)


def init_partials(Gp: int, H: int):
  """(o, m, l) of an online softmax over no slot yet, for Gp query rows."""
  return (jnp.zeros((Gp, H), jnp.float32), jnp.full((Gp,), MASK_VALUE, jnp.float32),
          jnp.zeros((Gp,), jnp.float32))


def online_softmax_update(carry, q, k, v, ok, sm_scale: float, prec):
  """Folds one block of keys/values (rows where `ok` is False are ignored) into the running (o, m, l)."""
  o, m, l = carry
  s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * sm_scale
  s = jnp.where(ok[None, :], s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=-1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
  l = alpha * l + p.sum(axis=-1)
  o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
  return o, m_new, l


def store_partials(o_ref, m_ref, l_ref, partials, row_ok):
  """Writes the real (unpadded) query rows of (o, m, l)."""
  o, m, l = partials
  gp = row_ok.shape[0]
  pltriton.store(o_ref.at[pl.ds(0, gp), :], o, mask=row_ok[:, None])
  pltriton.store(m_ref.at[pl.ds(0, gp)], m, mask=row_ok)
  pltriton.store(l_ref.at[pl.ds(0, gp)], l, mask=row_ok)
