"""Fused KT page update against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200, needs_gpu
from rocketkv_jax.kernels.kt_update import kt_update, kt_update_reference

KT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e5m2]


def check(B, K, H, P, page_size, kt_dtype, k_dtype, interpret, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  a = jax.random.normal(ks[0], (B, K, H, P))
  b = jax.random.normal(ks[1], (B, K, H, P))
  kt_min = jnp.minimum(a, b).astype(kt_dtype)
  kt_max = jnp.maximum(a, b).astype(kt_dtype)
  k = jax.random.normal(ks[2], (B, K, H), jnp.float32).astype(k_dtype)
  # A fresh page start, a mid-page slot, the last slot and one past it (no change), cycling over the batch.
  choices = np.array([0, page_size * (P // 2) + page_size // 2, P * page_size - 1, P * page_size + 1])
  slot = jnp.asarray(choices[np.arange(B) % len(choices)], jnp.int32)
  ref_min, ref_max = kt_update_reference(kt_min, kt_max, k, slot, page_size=page_size)
  out_min, out_max = kt_update(jnp.copy(kt_min), jnp.copy(kt_max), k, slot, page_size=page_size,
                               interpret=interpret)
  f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
  np.testing.assert_array_equal(f32(out_min), f32(ref_min))
  np.testing.assert_array_equal(f32(out_max), f32(ref_max))


@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
def test_matches_reference_interpret(kt_dtype):
  check(B=4, K=2, H=64, P=7, page_size=3, kt_dtype=kt_dtype, k_dtype=jnp.bfloat16,
        interpret=True)


def test_rejects_bad_shapes():
  kt = jnp.ones((1, 2, 64, 5))
  with pytest.raises(ValueError, match="k_new_BKH.shape"):
    kt_update(kt, jnp.ones((1, 2, 64, 5)), jnp.ones((1, 2, 32)), jnp.zeros((1,), jnp.int32),
              page_size=2)


@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
def test_lowers_for_h200_through_triton(kt_dtype):
  sd = jax.ShapeDtypeStruct
  text = lower_for_h200(lambda *a: kt_update(*a, page_size=3), sd((2, 8, 128, 555), kt_dtype),
                        sd((2, 8, 128, 555), kt_dtype), sd((2, 8, 128), jnp.bfloat16),
                        sd((2,), jnp.int32))
  assert "rocketkv_kt_update" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
def test_matches_reference_gpu(kt_dtype):
  needs_gpu()
  check(B=5, K=8, H=128, P=541, page_size=3, kt_dtype=kt_dtype, k_dtype=jnp.bfloat16,
        interpret=False)
