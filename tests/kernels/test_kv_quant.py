"""FP8 K/V (`kv_quant`): the decode kernels read an FP8 cache and the append kernel quantizes into it as their
references do (interpret mode on CPU, compiled on a GPU), junk slots poisoned with NaN; the Triton lowering."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CASES, GPU_CASES, lower_for_h200, needs_gpu, poison_past_length, ragged_lengths, rel_err, tol
from rocketkv_jax import ops
from rocketkv_jax.kernels.cache_append import cache_append, cache_append_reference
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.dense_decode import Tuning, dense_decode_attention, dense_decode_attention_reference
from rocketkv_jax.kernels.kv_quant import dequantize, fp8_max, kv_scale, quantize
from rocketkv_jax.kernels.sparse_decode import Tuning as SparseTuning
from rocketkv_jax.kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference
from tests.helpers.fp8 import one_fp8_step
from tests.helpers.data import keys, normal

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def fp8_cache(c, seed, kv_dtype):
  """q [B, K, G, H] in c's dtype, an FP8 cache k/v [B, K, S, H] with NaN past each length, scales, lengths."""
  rng = np.random.default_rng(seed)
  ks = keys(seed, 3)
  B, K, G, H, S = c["B"], c["K"], c["G"], c["H"], c["S"]
  q = normal(ks[0], (B, K, G, H), c["dtype"])
  k = 3 * normal(ks[1], (B, K, S, H), jnp.float32)
  v = 0.1 * normal(ks[2], (B, K, S, H), jnp.float32)
  length = ragged_lengths(rng, B, S)
  valid = jnp.broadcast_to((jnp.arange(S)[None, :] < length[:, None])[:, None], (B, K, S))
  k_scale, v_scale = kv_scale(k, valid, kv_dtype), kv_scale(v, valid, kv_dtype)
  k8 = quantize(poison_past_length(k, length), k_scale[:, :, None, None], kv_dtype)
  v8 = quantize(poison_past_length(v, length), v_scale[:, :, None, None], kv_dtype)
  return q, k8, v8, k_scale, v_scale, length


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("num_splits", [3, 1])
@pytest.mark.parametrize("c", CASES)
def test_dense_fp8_matches_reference_interpret(c, num_splits, kv_dtype):
  q, k, v, ks, vs, length = fp8_cache(c, 1, kv_dtype)
  out = dense_decode_attention(q, k, v, length, ks, vs, interpret=True,
                               tuning=Tuning(block_k=16, num_splits=num_splits))
  ref = dense_decode_attention_reference(q, k, v, length, ks, vs)
  assert out.dtype == q.dtype and rel_err(out, ref) < tol(c["dtype"])
  # the reference reads the dequantized values
  valid = jnp.arange(k.shape[2])[None, :] < length[:, None]
  kd, vd = (jnp.where(valid[:, None, :, None], dequantize(x, s[:, :, None, None]), 0.0) for x, s in ((k, ks), (v, vs)))
  ref32 = dense_decode_attention_reference(q.astype(jnp.float32), kd, vd, length)
  assert rel_err(ref, ref32) < tol(c["dtype"])


def sparse_indices(rng, B, K, S, M, length):
  idx = rng.integers(0, S, size=(B, K, M)).astype(np.int32)
  valid = (idx < np.asarray(length)[:, None, None]) & (rng.random((B, K, M)) < 0.8)
  return jnp.asarray(idx), jnp.asarray(valid)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("c", CASES)
def test_sparse_fp8_matches_reference_interpret(c, kv_dtype):
  q, k, v, ks, vs, length = fp8_cache(c, 2, kv_dtype)
  idx, valid = sparse_indices(np.random.default_rng(2), c["B"], c["K"], c["S"], 40, length)
  out = sparse_decode_attention(q, k, v, idx, valid, ks, vs, interpret=True,
                                tuning=SparseTuning(block_m=16, num_splits=2))
  ref = sparse_decode_attention_reference(q, k, v, idx, valid, ks, vs)
  assert rel_err(out, ref) < tol(c["dtype"])
  xla = ops.sparse_decode_attention(q, k, v, idx, valid, impl="xla", k_scale_BK=ks, v_scale_BK=vs)
  np.testing.assert_array_equal(np.asarray(xla), np.asarray(ref))


def append_inputs(kv_dtype, page_size=3, B=2, K=2, S=37, H=64, seed=3, dtype=jnp.bfloat16):
  ks = keys(seed, 4)
  k = normal(ks[0], (B, K, S, H), jnp.float32)
  v = normal(ks[1], (B, K, S, H), jnp.float32)
  valid = jnp.ones((B, K, S), bool)
  k_scale, v_scale = kv_scale(k, valid, kv_dtype), kv_scale(v, valid, kv_dtype)
  k8, v8 = quantize(k, k_scale[:, :, None, None], kv_dtype), quantize(v, v_scale[:, :, None, None], kv_dtype)
  P = kt_num_pages(S, page_size)
  kt_min = normal(ks[2], (B, K, H, P), dtype)
  kt_max = kt_min + 1
  k_new = (4 * normal(ks[3], (B, K, H))).astype(dtype)  # past the prompt's range: some saturate
  v_new = (-k_new).astype(dtype)
  return k8, v8, k_new, v_new, jnp.array([S - 1, 7], jnp.int32), kt_min, kt_max, k_scale, v_scale


@pytest.mark.parametrize("kv_dtype", FP8)
def test_append_fp8_matches_reference_interpret(kv_dtype):
  k8, v8, k_new, v_new, slot, kt_min, kt_max, ks, vs = append_inputs(kv_dtype)
  scales = dict(k_scale_BK=ks, v_scale_BK=vs)
  want = cache_append_reference(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, **scales)
  got = cache_append(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, interpret=True, **scales)
  xla = ops.cache_append(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, impl="xla", **scales)
  for a, b, x in zip(got, want, xla):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
  # the rows at the slots: the new token quantized (saturating: never inf), the KT fold of the full-precision key
  b_, k_ = np.indices((2, 2))
  row = np.asarray(got[0].astype(jnp.float32))[b_, k_, np.asarray(slot)[:, None]]
  m = fp8_max(kv_dtype)
  assert np.isfinite(row).all() and np.abs(row).max() == m
  np.testing.assert_array_equal(row, np.asarray(quantize(k_new, ks[..., None], kv_dtype).astype(jnp.float32)))


def test_append_fp8_refuses_rows_rebuild_and_unscaled_fp8():
  k8, v8, k_new, v_new, slot, kt_min, kt_max, ks, vs = append_inputs(jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="kt_update='rows'"):
    cache_append_reference(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, kt_update="rows",
                           k_scale_BK=ks, v_scale_BK=vs)
  with pytest.raises(ValueError, match="FP8: pass k_scale_BK"):
    cache_append(k8, v8, k_new, v_new, slot, interpret=True)
  with pytest.raises(ValueError, match="v_scale_BK must be float32"):
    cache_append(k8, v8, k_new, v_new, slot, interpret=True, k_scale_BK=ks, v_scale_BK=vs[:1])
  q = jnp.ones((2, 2, 4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="FP8: pass k_scale_BK"):
    dense_decode_attention(q, k8, v8, jnp.array([3, 3]), interpret=True)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_lowers_for_h200_through_triton(kv_dtype):
  c = dict(B=2, K=2, G=4, H=128, S=256, dtype=jnp.bfloat16)
  q, k, v, ks, vs, length = fp8_cache(c, 4, kv_dtype)
  lower_for_h200(lambda *a: dense_decode_attention(*a), q, k, v, length, ks, vs)
  idx, valid = sparse_indices(np.random.default_rng(4), 2, 2, 256, 64, length)
  lower_for_h200(lambda *a: sparse_decode_attention(*a), q, k, v, idx, valid, ks, vs)
  k8, v8, k_new, v_new, slot, kt_min, kt_max, ks, vs = append_inputs(kv_dtype)
  lower_for_h200(lambda *a: cache_append(*a[:7], page_size=3, k_scale_BK=a[7], v_scale_BK=a[8]),
                 k8, v8, k_new, v_new, slot, kt_min, kt_max, ks, vs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("c", GPU_CASES)
def test_fp8_kernels_match_reference_gpu(c, kv_dtype):
  needs_gpu()
  q, k, v, ks, vs, length = fp8_cache(c, 5, kv_dtype)
  out = dense_decode_attention(q, k, v, length, ks, vs)
  assert rel_err(out, dense_decode_attention_reference(q, k, v, length, ks, vs)) < tol(c["dtype"])
  idx, valid = sparse_indices(np.random.default_rng(5), c["B"], c["K"], c["S"], 128, length)
  out = sparse_decode_attention(q, k, v, idx, valid, ks, vs)
  assert rel_err(out, sparse_decode_attention_reference(q, k, v, idx, valid, ks, vs)) < tol(c["dtype"])
  k8, v8, k_new, v_new, slot, kt_min, kt_max, ks, vs = append_inputs(kv_dtype)
  scales = dict(k_scale_BK=ks, v_scale_BK=vs)
  got = cache_append(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, **scales)
  want = cache_append_reference(k8, v8, k_new, v_new, slot, kt_min, kt_max, page_size=3, **scales)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                               **one_fp8_step(kv_dtype))
