"""`best_units_take` (plain jnp, no kernel) against a numpy greedy top-m, the row whole or in chunks. (A radix
search, 2 or 4 key bits per step, took the same units but ran 1.1-2x slower in the page top-k kernel on an
H200 at every batch: benchmarks/results/stage2_h200_2026-12-02c/tune_topk_radix.jsonl; removed.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax.kernels.topk_select import best_units_take, order_key

SPLITS = [(544,), (512, 32), (24,), (16, 8)]


def reference_take(x, w, m):
  """Units greedily from the best value down (-0.0 just below +0.0), ties toward the lower index."""
  order = np.lexsort((np.arange(x.size), np.signbit(x), -x.astype(np.float64)))
  take, left = np.zeros_like(w), m
  for i in order:
    take[i] = min(w[i], max(left, 0))
    left -= take[i]
  return take


def make_rows(seed, n):
  """Rows x [R, n] float32 and weights w [R, n] int32 in [0, 3], plus m per row: wide-range values of both
  signs, few distinct values with -0.0 / +0.0 (many ties), all-equal rows, +-inf and subnormals; all-zero
  and all-one weights; m = 0, 1, random, total, past the total."""
  rng = np.random.default_rng(seed)
  kinds = [rng.standard_normal(n) * 10.0 ** rng.integers(-38, 38, n),
           rng.choice([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0], n),
           np.full(n, 1.5), np.full(n, -0.0),
           rng.choice([np.inf, -np.inf, 1e-45, -1e-45, 3e38, -3e38, 0.0, -0.0], n)]
  weights = [rng.integers(0, 4, n), np.zeros(n, np.int64), np.ones(n, np.int64), rng.integers(0, 2, n) * 3]
  xs, ws, ms = [], [], []
  for x in kinds:
    for w in weights:
      total = int(w.sum())
      for m in sorted({0, 1, int(rng.integers(0, total + 1)), total // 2, total, total + 1, total + 7}):
        xs.append(x), ws.append(w), ms.append(m)
  return (np.asarray(xs, np.float32), np.asarray(ws, np.int32), np.asarray(ms, np.int32))


def split(row, sizes):
  return list(jnp.split(row, np.cumsum(sizes)[:-1]))


def takes_fn(sizes):
  def f(x, w, m):
    return jnp.concatenate(best_units_take([order_key(c) for c in split(x, sizes)], split(w, sizes), m))
  return f


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_matches_reference(sizes):
  x, w, m = make_rows(sum(sizes), sum(sizes))
  want = np.stack([reference_take(*row) for row in zip(x, w, m)])
  got = np.asarray(jax.jit(jax.vmap(takes_fn(sizes)))(x, w, m))
  np.testing.assert_array_equal(got, want)
  assert (got.sum(1) == np.minimum(m, w.sum(1))).all()


def test_eager_and_jit_match_reference():
  """One call eagerly, one under jax.jit with m traced."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.choice([-3.0, -0.0, 0.0, 0.5, 0.5, 2.0], 24).astype(np.float32))
  w = jnp.asarray(rng.integers(0, 4, 24).astype(np.int32))
  m = int(w.sum()) // 3
  want = reference_take(np.asarray(x), np.asarray(w), m)
  np.testing.assert_array_equal(takes_fn((16, 8))(x, w, m), want)
  np.testing.assert_array_equal(jax.jit(takes_fn((16, 8)))(x, w, jnp.int32(m)), want)
