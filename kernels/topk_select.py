"""Sort-free top-m selection inside a kernel (Triton has no in-kernel sort): order-preserving int32 keys and
a bisection (or radix search) over their bits. Used by `page_topk`."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_INT_MIN = -(2 ** 31)


def order_key(x):
  """int32 keys ordered as the float32 values x (-0 just below +0); NaN is not expected."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def best_units_take(keys, weights, m, *, bits: int = 1):
  """Sort-free top-m inside a kernel. Entry i of the row holds weight[i] >= 0 units that all score key[i] (an
  `order_key`); the m best units are taken, best key first, ties toward the lower index. The row may come as
  consecutive chunks (`keys`, `weights`: lists of arrays, the row in order), so that no chunk is padded far
  past the row. Returns take per chunk, take[i] in [0, weight[i]], with sum(take) = min(m, sum(weight)).

  The m-th best key tau (the largest t with weight(key >= t) >= m) is found over the key bits: the sign bit,
  then bits 30..0 `bits` (static) at a time. bits=1 is a bisection (31 dependent masked sums); bits=b > 1 a
  radix search: each step tries the 2**b - 1 next digits at once as one [2**b, lanes] masked sum (row 0, t
  itself, only pads the rows to a power of two) and keeps the largest passing digit, in ceil(31 / b) steps
  (the top step narrower where b does not divide 31). The same tau for every b. Then every unit above tau is
  taken, and of the units at tau the lowest entries, by an exclusive cumsum, until m are taken.
  """
  if bits < 1:
    raise ValueError(f"bits={bits} must be >= 1")

  def weight_at_least(t):
    return sum(jnp.sum(jnp.where(key >= t, weight, 0)) for key, weight in zip(keys, weights))

  def radix_step(t, shift, width):
    """t | d << shift for the largest d < 2**width with weight(key >= it) >= m (d = 0 if none); the weight
    is non-increasing in d, so d is the number of d > 0 that pass."""
    d = jnp.arange(2 ** width, dtype=jnp.int32)
    cand = t | lax.shift_left(d, shift)
    counts = sum(jnp.sum(jnp.where(key[None, :] >= cand[:, None], weight[None, :], 0), axis=1)
                 for key, weight in zip(keys, weights))
    return t | lax.shift_left(jnp.sum(jnp.where((d > 0) & (counts >= m), 1, 0)), shift)

  tau = jnp.where(weight_at_least(jnp.int32(0)) >= m, jnp.int32(0), jnp.int32(_INT_MIN))

  if bits == 1:
    def bit_step(i, t):
      cand = t | lax.shift_left(jnp.int32(1), jnp.int32(30) - i)
      return jnp.where(weight_at_least(cand) >= m, cand, t)

    tau = lax.fori_loop(0, 31, bit_step, tau)
  else:
    top = 31 % bits  # the leftover top bits, one narrower step
    if top:
      tau = radix_step(tau, jnp.int32(31 - top), top)

    def digit_step(i, t):
      return radix_step(t, jnp.int32(31 - top - bits) - bits * i, bits)

    tau = lax.fori_loop(0, 31 // bits, digit_step, tau)
  need = m - sum(jnp.sum(jnp.where(key > tau, weight, 0)) for key, weight in zip(keys, weights))
  takes, tied_before = [], 0  # units at tau in the chunks before this one
  for key, weight in zip(keys, weights):
    eq_w = jnp.where(key == tau, weight, 0)
    eq_before = jnp.cumsum(eq_w) - eq_w + tied_before
    takes.append(jnp.where(key > tau, weight, jnp.clip(need - eq_before, 0, eq_w)))
    tied_before = tied_before + jnp.sum(eq_w)
  return takes
