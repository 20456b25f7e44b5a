"""Fused KT page update for the token just appended at `slot[b]` (ALGORITHM.md section 3).

Page p = slot // page_size of the channel-major KT cache [B, K, H, P]: when slot % page_size == 0
the page starts fresh (min = max = k), otherwise min/max take the element-wise min/max with k.
One program per (b, k) reads the new key and one page column of each of kt_min and kt_max and
writes that column back in place (input_output_aliases), so nothing else of the KT cache moves.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels._common import FLOAT_DTYPES, check_dtype, check_kt_pages


def kt_update_reference(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B, *, page_size: int,
                        **unused_tuning):
  """Returns (kt_min, kt_max) with page slot // page_size updated by k_new."""
  del unused_tuning
  P = kt_min_BKHP.shape[-1]
  page_B = slot_B // page_size
  fresh_B = (slot_B % page_size) == 0
  at_BP = jnp.arange(P)[None, :] == page_B[:, None]
  k = k_new_BKH.astype(jnp.float32)[..., None]  # [B, K, H, 1]
  fresh = fresh_B[:, None, None, None]
  new_min = jnp.where(fresh, k, jnp.minimum(kt_min_BKHP.astype(jnp.float32), k))
  new_max = jnp.where(fresh, k, jnp.maximum(kt_max_BKHP.astype(jnp.float32), k))
  at = at_BP[:, None, None, :]
  return (jnp.where(at, new_min.astype(kt_min_BKHP.dtype), kt_min_BKHP),
          jnp.where(at, new_max.astype(kt_max_BKHP.dtype), kt_max_BKHP))


def _kt_update_kernel(
    # inputs
    kt_min_ref,  # [H, P] (aliased to the first output)
    kt_max_ref,  # [H, P] (aliased to the second output)
    k_ref,  # [H]
    slot_ref,  # []
    # outputs
    kt_min_out_ref,  # [H, P]
    kt_max_out_ref,  # [H, P]
    *,
    page_size: int,
):
  H, P = kt_min_ref.shape
  slot = slot_ref[...]
  in_range = (slot >= 0) & (slot < P * page_size)  # a slot past the last page touches nothing
  page = jnp.clip(slot // page_size, 0, P - 1)
  fresh = (slot % page_size) == 0
  rows = jnp.arange(H)
  cols = jnp.zeros((H,), jnp.int32) + page
  k = k_ref[...].astype(jnp.float32)
  old_min = kt_min_ref[rows, cols].astype(jnp.float32)
  old_max = kt_max_ref[rows, cols].astype(jnp.float32)
  new_min = jnp.where(fresh & in_range, k, jnp.minimum(old_min, jnp.where(in_range, k, jnp.inf)))
  new_max = jnp.where(fresh & in_range, k, jnp.maximum(old_max, jnp.where(in_range, k, -jnp.inf)))
  kt_min_out_ref[rows, cols] = new_min.astype(kt_min_out_ref.dtype)
  kt_max_out_ref[rows, cols] = new_max.astype(kt_max_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=["page_size", "interpret", "num_warps"])
def kt_update(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B, *, page_size: int,
              interpret: bool = False, num_warps: int = 1):
  """Folds the new key k_new[b, k] (written at cache slot slot[b]) into its KT page, in place. A slot
  at or past P * page_size changes nothing.

  The outputs alias the KT inputs (input_output_aliases): inside a jitted step whose cache is donated (or
  a loop carry) the update is in place; called eagerly, XLA copies the inputs first and they stay valid.
  """
  B, K, H, P = check_kt_pages(kt_min_BKHP, kt_max_BKHP)
  if k_new_BKH.shape != (B, K, H):
    raise ValueError(f"k_new_BKH.shape={k_new_BKH.shape} must be ({B}, {K}, {H})")
  if slot_B.shape != (B,):
    raise ValueError(f"slot_B.shape={slot_B.shape} must be ({B},)")
  if page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1")
  check_dtype("k_new_BKH", k_new_BKH.dtype, FLOAT_DTYPES)
  kt_spec = pl.BlockSpec((None, None, H, P), lambda b, k: (b, k, 0, 0))
  return pl.pallas_call(
      functools.partial(_kt_update_kernel, page_size=page_size),
      grid=(B, K),
      in_specs=[kt_spec, kt_spec, pl.BlockSpec((None, None, H), lambda b, k: (b, k, 0)),
                pl.BlockSpec((None,), lambda b, k: (b,))],
      out_specs=[kt_spec, kt_spec],
      out_shape=[jax.ShapeDtypeStruct(kt_min_BKHP.shape, kt_min_BKHP.dtype),
                 jax.ShapeDtypeStruct(kt_max_BKHP.shape, kt_max_BKHP.dtype)],
      input_output_aliases={0: 0, 1: 1},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rocketkv_kt_update",
  )(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B.astype(jnp.int32))
