"""Dense flash-decoding kernel against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (CASES, GPU_CASES, lower_for_h200, needs_gpu, poison_past_length,
                      ragged_lengths, rel_err, tol)
from rocketkv_jax.kernels.dense_decode import Tuning, dense_decode_attention, dense_decode_attention_reference
from tests.helpers.data import keys, normal


def make_inputs(c, seed):
  rng = np.random.default_rng(seed)
  ks = keys(seed, 3)
  B, K, G, H, S, dt = c["B"], c["K"], c["G"], c["H"], c["S"], c["dtype"]
  q = normal(ks[0], (B, K, G, H), dt)
  k = normal(ks[1], (B, K, S, H), dt)
  v = normal(ks[2], (B, K, S, H), dt)
  length = ragged_lengths(rng, B, S)
  return q, poison_past_length(k, length), poison_past_length(v, length), length


def check(c, seed, interpret, **tuning):
  q, k, v, length = make_inputs(c, seed)
  out = dense_decode_attention(q, k, v, length, interpret=interpret, tuning=Tuning(**tuning))
  ref = dense_decode_attention_reference(q, k, v, length)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert rel_err(out, ref) < tol(c["dtype"])


@pytest.mark.parametrize("num_splits", [3, 1])  # 1: the kernel normalises itself (no XLA epilogue)
@pytest.mark.parametrize("c", CASES)
def test_matches_reference_interpret(c, num_splits):
  check(c, seed=1, interpret=True, block_k=16, num_splits=num_splits)


def test_ragged_batch_equals_each_sequence_alone():
  c = dict(B=3, K=1, G=4, H=64, S=45, dtype=jnp.float32)
  q, k, v, length = make_inputs(c, seed=2)
  out = dense_decode_attention(q, k, v, length, interpret=True, tuning=Tuning(block_k=16))
  for b in range(3):
    one = dense_decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], length[b:b + 1],
                                 interpret=True, tuning=Tuning(block_k=16))
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(out[b]), rtol=1e-5, atol=1e-6)


def test_rejects_bad_shapes():
  q = jnp.ones((1, 2, 4, 64))
  kv = jnp.ones((1, 2, 10, 64))
  with pytest.raises(ValueError, match="k_BKSH.shape"):
    dense_decode_attention(q, jnp.ones((1, 3, 10, 64)), kv, jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="length_B.shape"):
    dense_decode_attention(q, kv, kv, jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="block_k=24"):
    dense_decode_attention(q, kv, kv, jnp.ones((1,), jnp.int32), tuning=Tuning(block_k=24))


@pytest.mark.parametrize("H,G,dtype", [(64, 1, jnp.float32), (128, 4, jnp.bfloat16),
                                       (128, 8, jnp.bfloat16), (64, 3, jnp.bfloat16)])
def test_lowers_for_h200_through_triton(H, G, dtype):
  q = jax.ShapeDtypeStruct((2, 2, G, H), dtype)
  kv = jax.ShapeDtypeStruct((2, 2, 1000, H), dtype)
  length = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = lower_for_h200(lambda *a: dense_decode_attention(*a), q, kv, kv, length)
  assert "rocketkv_dense_decode" in text


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES)
def test_matches_reference_gpu(c):
  needs_gpu()
  check(c, seed=3, interpret=False)
  check(c, seed=4, interpret=False, block_k=32, num_splits=5)
  check(c, seed=5, interpret=False, block_k=32, num_splits=1)


def test_zero_length_gives_zero_and_long_length_is_clipped():
  c = dict(B=2, K=1, G=4, H=64, S=33, dtype=jnp.float32)
  q, k, v, _ = make_inputs(c, seed=6)
  k = jnp.where(jnp.isnan(k), 0.5, k)
  v = jnp.where(jnp.isnan(v), 0.5, v)
  out = dense_decode_attention(q, k, v, jnp.array([0, 99], jnp.int32), interpret=True, tuning=Tuning(block_k=16))
  assert not np.asarray(out[0]).any()
  negative = dense_decode_attention(q, k, v, jnp.array([-5, 99], jnp.int32), interpret=True,
                                    tuning=Tuning(block_k=16, num_splits=1))
  assert not np.asarray(negative[0]).any()
  np.testing.assert_allclose(np.asarray(negative[1]), np.asarray(out[1]), rtol=1e-6)
  ref = dense_decode_attention_reference(q[1:], k[1:], v[1:], jnp.array([33], jnp.int32))
  assert rel_err(out[1:], ref) < 1e-5
