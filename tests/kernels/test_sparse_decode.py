"""Sparse (index-gather) decode kernel against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CASES, GPU_CASES, lower_for_h200, needs_gpu, rel_err, tol
from rocketkv_jax.kernels.dense_decode import dense_decode_attention_reference
from rocketkv_jax.kernels.sparse_decode import (Tuning, sparse_decode_attention,
                                                sparse_decode_attention_reference)
from tests.helpers.data import keys, normal, randint, uniform


def make_inputs(c, seed, M):
  ks = keys(seed, 5)
  B, K, G, H, S, dt = c["B"], c["K"], c["G"], c["H"], c["S"], c["dtype"]
  q = normal(ks[0], (B, K, G, H), dt)
  k = normal(ks[1], (B, K, S, H), dt)
  v = normal(ks[2], (B, K, S, H), dt)
  idx = randint(ks[3], (B, K, M), 0, S, jnp.int32)
  valid = uniform(ks[4], (B, K, M)) < 0.7
  valid = valid.at[-1, -1].set(False)  # one group with nothing valid: output 0
  # Poison every slot that no valid entry selects (invalid entries point at NaN).
  used = jax.vmap(jax.vmap(lambda i, ok: jnp.zeros((S,), bool).at[i].max(ok)))(idx, valid)
  k = jnp.where(used[..., None], k, jnp.nan)
  v = jnp.where(used[..., None], v, jnp.nan)
  return q, k, v, idx, valid


def check(c, seed, M, interpret, **tuning):
  q, k, v, idx, valid = make_inputs(c, seed, M)
  out = sparse_decode_attention(q, k, v, idx, valid, interpret=interpret, tuning=Tuning(**tuning))
  ref = sparse_decode_attention_reference(q, k, v, idx, valid)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert rel_err(out, ref) < tol(c["dtype"])
  assert not np.asarray(out[-1, -1], np.float32).any(), "no valid entry must give 0"


@pytest.mark.parametrize("num_splits", [2, 1])  # 1: the kernel normalises itself (no XLA epilogue)
@pytest.mark.parametrize("c", CASES)
def test_matches_reference_interpret(c, num_splits):
  check(c, seed=1, M=45, interpret=True, block_m=16, num_splits=num_splits)


def test_full_selection_equals_dense():
  B, K, G, H, S = 2, 2, 4, 64, 40
  ks = keys(5, 3)
  q = normal(ks[0], (B, K, G, H))
  k = normal(ks[1], (B, K, S, H))
  v = normal(ks[2], (B, K, S, H))
  length = jnp.array([40, 23], jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, K, S))
  valid = idx < length[:, None, None]
  out = sparse_decode_attention(q, k, v, idx, valid, interpret=True, tuning=Tuning(block_m=16))
  ref = dense_decode_attention_reference(q, k, v, length)
  assert rel_err(out, ref) < 1e-5


def test_rejects_bad_shapes():
  q = jnp.ones((1, 2, 4, 64))
  kv = jnp.ones((1, 2, 10, 64))
  idx = jnp.zeros((1, 2, 5), jnp.int32)
  with pytest.raises(ValueError, match="valid_BKM.shape"):
    sparse_decode_attention(q, kv, kv, idx, jnp.ones((1, 2, 6), bool))
  with pytest.raises(ValueError, match="valid_BKM.dtype"):
    sparse_decode_attention(q, kv, kv, idx, jnp.ones((1, 2, 5), jnp.int32))


@pytest.mark.parametrize("H,G,dtype", [(64, 1, jnp.float32), (128, 4, jnp.bfloat16),
                                       (128, 8, jnp.bfloat16)])
def test_lowers_for_h200_through_triton(H, G, dtype):
  q = jax.ShapeDtypeStruct((2, 2, G, H), dtype)
  kv = jax.ShapeDtypeStruct((2, 2, 1000, H), dtype)
  idx = jax.ShapeDtypeStruct((2, 2, 300), jnp.int32)
  valid = jax.ShapeDtypeStruct((2, 2, 300), jnp.bool_)
  text = lower_for_h200(lambda *a: sparse_decode_attention(*a), q, kv, kv, idx, valid)
  assert "rocketkv_sparse_decode" in text
  text = lower_for_h200(lambda *a: sparse_decode_attention(*a, tuning=Tuning(num_splits=1, block_m=64)), q, kv, kv,
                        idx, valid)
  assert "rocketkv_sparse_decode" in text


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES)
def test_matches_reference_gpu(c):
  needs_gpu()
  check(c, seed=3, M=min(300, c["S"] + 7), interpret=False)
  check(c, seed=4, M=45, interpret=False, block_m=16, num_splits=2)
  check(c, seed=5, M=128, interpret=False, block_m=128, num_splits=1)
  check(c, seed=6, M=45, interpret=False, block_m=16, num_splits=1)
