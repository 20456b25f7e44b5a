"""The fused residual add + RMSNorm against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200, needs_gpu, rel_err
from rocketkv_jax.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from tests.helpers.data import keys, normal

EPS = 1e-5

# D = 96 and 576 (SmolLM2's width) are not powers of two: the padded block's pads must stay out of the sum.
CASES = [
    pytest.param(dict(B=1, D=64, dtype=jnp.float32), id="B1D64-f32"),
    pytest.param(dict(B=5, D=96, dtype=jnp.bfloat16), id="B5D96-bf16"),
    pytest.param(dict(B=3, D=576, dtype=jnp.float32), id="B3D576-f32"),
    pytest.param(dict(B=2, D=4096, dtype=jnp.bfloat16), id="B2D4096-bf16"),
]

GPU_CASES = [
    pytest.param(dict(B=1, D=4096, dtype=jnp.bfloat16), id="B1D4096-bf16"),
    pytest.param(dict(B=8, D=4096, dtype=jnp.bfloat16), id="B8D4096-bf16"),
    pytest.param(dict(B=7, D=576, dtype=jnp.float32), id="B7D576-f32"),
    pytest.param(dict(B=3, D=576, dtype=jnp.bfloat16), id="B3D576-bf16"),
]

# The row's float32 sum may add in another order than XLA's; bf16 outputs may then differ by one ulp.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 5e-3}


def make_inputs(B, D, dtype, w_dtype=None, seed=0):
  """A residual stream of varying scale per row, a delta and weights around 1."""
  ks = keys(seed, 4)
  scale = jnp.exp(normal(ks[3], (B, 1)))
  x = (normal(ks[0], (B, D)) * scale).astype(dtype)
  delta = (normal(ks[1], (B, D)) * 0.5).astype(dtype)
  w = (1 + 0.2 * normal(ks[2], (D,))).astype(w_dtype or dtype)
  return x, delta, w


def check(x, delta, w, interpret):
  h, normed = add_rms_norm(x, delta, w, eps=EPS, interpret=interpret)
  h_ref, normed_ref = add_rms_norm_reference(x, delta, w, eps=EPS)
  assert h.shape == h_ref.shape and h.dtype == h_ref.dtype
  assert normed.shape == normed_ref.shape and normed.dtype == normed_ref.dtype
  # The add is one correctly rounded operation: exact.
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
  assert rel_err(normed.astype(jnp.float32), normed_ref.astype(jnp.float32)) < TOL[jnp.dtype(normed.dtype)]


@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_interpret(case, with_delta):
  x, delta, w = make_inputs(**case)
  check(x, delta if with_delta else None, w, interpret=True)


def test_plain_norm_equals_adding_zero_interpret():
  x, _, w = make_inputs(3, 96, jnp.bfloat16)
  h, normed = add_rms_norm(x, None, w, eps=EPS, interpret=True)
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(x, np.float32))
  np.testing.assert_array_equal(np.asarray(normed, np.float32),
                                np.asarray(add_rms_norm(x, jnp.zeros_like(x), w, eps=EPS, interpret=True)[1],
                                           np.float32))


@pytest.mark.parametrize("x_dtype, w_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_mixed_weight_dtype_interpret(x_dtype, w_dtype):
  """normed takes result_type(w, x), h stays in x's dtype, as in the model's `w * xf.astype(x.dtype)`."""
  x, delta, w = make_inputs(5, 96, x_dtype, w_dtype=w_dtype, seed=1)
  check(x, delta, w, interpret=True)
  assert add_rms_norm(x, delta, w, eps=EPS, interpret=True)[1].dtype == jnp.float32


def test_rows_are_independent_interpret():
  """A NaN row poisons only itself."""
  x, delta, w = make_inputs(5, 96, jnp.float32, seed=2)
  x_bad = x.at[2].set(jnp.nan)
  h, normed = add_rms_norm(x_bad, delta, w, eps=EPS, interpret=True)
  h_ref, normed_ref = add_rms_norm(x, delta, w, eps=EPS, interpret=True)
  keep = np.array([0, 1, 3, 4])
  np.testing.assert_array_equal(np.asarray(h)[keep], np.asarray(h_ref)[keep])
  np.testing.assert_array_equal(np.asarray(normed)[keep], np.asarray(normed_ref)[keep])
  assert np.isnan(np.asarray(normed)[2]).all()


def test_rejects_bad_args():
  x = jnp.ones((2, 8))
  w = jnp.ones((8,))
  with pytest.raises(ValueError, match="x_BD.shape"):
    add_rms_norm(jnp.ones((2, 1, 8)), None, w, eps=EPS)
  with pytest.raises(ValueError, match="delta_BD.shape"):
    add_rms_norm(x, jnp.ones((2, 4)), w, eps=EPS)
  with pytest.raises(ValueError, match="delta_BD.dtype"):
    add_rms_norm(x, jnp.ones((2, 8), jnp.bfloat16), w, eps=EPS)
  with pytest.raises(ValueError, match="w_D.shape"):
    add_rms_norm(x, x, jnp.ones((4,)), eps=EPS)
  with pytest.raises(ValueError, match="w_D.dtype"):
    add_rms_norm(x, x, jnp.ones((8,), jnp.int32), eps=EPS)
  with pytest.raises(ValueError, match="x_BD.dtype"):
    add_rms_norm(jnp.ones((2, 8), jnp.int32), None, w, eps=EPS)
  with pytest.raises(ValueError, match="eps=0"):
    add_rms_norm(x, x, w, eps=0.0)


def _sd(B, D, dtype, with_delta=True, w_dtype=None):
  sd = jax.ShapeDtypeStruct
  return [sd((B, D), dtype)] + ([sd((B, D), dtype)] if with_delta else []) + [sd((D,), w_dtype or dtype)]


@pytest.mark.parametrize("B", [1, 8])
def test_lowers_for_h200_through_triton(B):
  text = lower_for_h200(lambda x, d, w: add_rms_norm(x, d, w, eps=EPS), *_sd(B, 4096, jnp.bfloat16))
  assert "rocketkv_add_rms_norm" in text
  text = lower_for_h200(lambda x, w: add_rms_norm(x, None, w, eps=EPS), *_sd(B, 4096, jnp.bfloat16, False))
  assert "rocketkv_rms_norm" in text


def test_lowers_for_h200_padded_row():
  text = lower_for_h200(lambda x, d, w: add_rms_norm(x, d, w, eps=EPS),
                        *_sd(3, 576, jnp.bfloat16, w_dtype=jnp.float32))
  assert "rocketkv_add_rms_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_matches_reference_gpu(case):
  needs_gpu()
  x, delta, w = make_inputs(**case)
  check(x, delta, w, interpret=False)
  check(x, None, w, interpret=False)
