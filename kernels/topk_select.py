"""Sort-free top-m selection inside a kernel (Triton has no in-kernel sort): order-preserving int32 keys and
a bisection over their bits. Used by `page_topk`."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_INT_MIN = -(2 ** 31)


def order_key(x):
  """int32 keys ordered as the float32 values x (-0 just below +0); NaN is not expected."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def best_units_take(keys, weights, m):
  """Sort-free top-m inside a kernel. Entry i of the row holds weight[i] >= 0 units that all score key[i] (an
  `order_key`); the m best units are taken, best key first, ties toward the lower index. The row may come as
  consecutive chunks (`keys`, `weights`: lists of arrays, the row in order), so that no chunk is padded far
  past the row. Returns take per chunk, take[i] in [0, weight[i]], with sum(take) = min(m, sum(weight)).

  The m-th best key tau (the largest t with weight(key >= t) >= m) is found by bisection over the key
  bits (the sign bit, then bits 30..0: 32 masked sums); every unit above tau is taken, and of the units
  at tau the lowest entries, by an exclusive cumsum, until m are taken.
  """
  def weight_at_least(t):
    return sum(jnp.sum(jnp.where(key >= t, weight, 0)) for key, weight in zip(keys, weights))

  tau = jnp.where(weight_at_least(jnp.int32(0)) >= m, jnp.int32(0), jnp.int32(_INT_MIN))

  def bit_step(i, t):
    cand = t | lax.shift_left(jnp.int32(1), jnp.int32(30) - i)
    return jnp.where(weight_at_least(cand) >= m, cand, t)

  tau = lax.fori_loop(0, 31, bit_step, tau)
  need = m - sum(jnp.sum(jnp.where(key > tau, weight, 0)) for key, weight in zip(keys, weights))
  takes, tied_before = [], 0  # units at tau in the chunks before this one
  for key, weight in zip(keys, weights):
    eq_w = jnp.where(key == tau, weight, 0)
    eq_before = jnp.cumsum(eq_w) - eq_w + tied_before
    takes.append(jnp.where(key > tau, weight, jnp.clip(need - eq_before, 0, eq_w)))
    tied_before = tied_before + jnp.sum(eq_w)
  return takes
