"""`masked_scatter`, the one helper whose interpret-mode form differs from the compiled one; `sm_count`, the one
place the kernels' launch heuristics read the device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from rocketkv_jax.kernels import triton_util
from rocketkv_jax.kernels.triton_util import masked_scatter


def _scatter(idx, value, mask, *, n: int, interpret: bool):
  def kernel(idx_ref, value_ref, mask_ref, out_ref):
    out_ref[...] = jnp.full((n,), -1, jnp.int32)
    masked_scatter(out_ref, idx_ref[...], value_ref[...], mask_ref[...], interpret=interpret)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
                        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
                        interpret=interpret)(idx, value, mask)


def test_masked_lanes_write_nothing_interpret():
  # Lane 1 is masked and shares index 2 with the written lane 0 before it (interpret mode's plain masked
  # store writes the old value back there, and the later lane wins); lane 3 is masked and out of range.
  idx = jnp.array([2, 2, 5, 9, 5, 0, 7, 7], jnp.int32)
  mask = jnp.array([True, False, False, False, True, True, False, True])
  value = jnp.arange(10, 18, dtype=jnp.int32)
  out = _scatter(idx, value, mask, n=8, interpret=True)
  np.testing.assert_array_equal(out, [15, -1, 10, -1, -1, 14, -1, 17])


@pytest.mark.parametrize("seed", range(3))
def test_matches_numpy_interpret(seed):
  """Written lanes hit distinct in-range indices; masked lanes point anywhere (in range, colliding with
  written lanes, or out of range), in random lane order."""
  rng = np.random.default_rng(seed)
  n, lanes, written = 16, 32, 10
  idx = np.concatenate([rng.permutation(n)[:written], rng.integers(-4, n + 8, lanes - written)]).astype(np.int32)
  mask = np.arange(lanes) < written
  order = rng.permutation(lanes)
  idx, mask = idx[order], mask[order]
  value = rng.integers(0, 1000, lanes).astype(np.int32)
  want = np.full(n, -1, np.int32)
  want[idx[mask]] = value[mask]
  out = _scatter(jnp.asarray(idx), jnp.asarray(value), jnp.asarray(mask), n=n, interpret=True)
  np.testing.assert_array_equal(out, want)


def test_lowers_for_h200_through_triton():
  sd = jax.ShapeDtypeStruct
  text = lower_for_h200(lambda i, v, m: _scatter(i, v, m, n=8, interpret=False),
                        sd((8,), jnp.int32), sd((8,), jnp.int32), sd((8,), jnp.bool_))
  assert "__gpu$xla.gpu.triton" in text


def test_sm_count_reads_the_gpu_and_falls_back_to_the_h200(monkeypatch):
  """A GPU's core_count (its SMs); DEFAULT_SM_COUNT (the H200's 132) on CPU or where a GPU gives none. The
  kernels hold no SM count of their own: their grids follow `sm_count` (dense: 4 programs per SM)."""
  from rocketkv_jax.kernels import dense_decode, sparse_decode

  class Device:
    def __init__(self, platform, **kw):
      self.platform = platform
      self.__dict__.update(kw)

  for device, want in ((Device("gpu", core_count=78), 78), (Device("gpu"), 132), (Device("cpu", core_count=2), 132)):
    monkeypatch.setattr(jax, "devices", lambda device=device: [device])
    assert triton_util.sm_count() == want
  monkeypatch.setattr(jax, "devices", lambda: [Device("gpu", core_count=66)])
  assert dense_decode.pick_tuning(1, 8, 128).num_splits == 33  # 4 * 66 programs over 8 rows
  assert sparse_decode.pick_tuning(1, 8, 128).num_splits == 17  # 2 * 66 over 8
