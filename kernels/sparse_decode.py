"""Sparse (top-k) GQA decode attention: gathers the selected K/V rows by index inside a Pallas
Triton kernel.

The grid is (B, K, splits of M): each program walks its split of the index list in blocks of
`block_m`, gathers those K/V rows of its KV head, and runs an online softmax for the whole query
group (padded to 16 rows for Triton's dot). Partials (o, m, l) are merged by the same XLA epilogue
as the dense kernel; with one split (num_splits=1) the kernel normalises and writes the output itself.
(One split per row at M = 128 measured no faster in the 8B decode step on an H200: 5.4 against 4.7 us per
layer with the merge, as 8 programs gather too little in parallel.) Invalid entries are masked before anything touches
them, so the slots they point at may hold NaN.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.attention_reference import masked_attention_reference
from rocketkv_jax.kernels.checks import check_qkv
from rocketkv_jax.kernels.splitk import (finish_split_outputs, init_partials, online_softmax_update, scale_inputs,
                                         scale_values, split_grid, split_outputs, splits_for, store_split_outputs)
from rocketkv_jax.kernels.triton_util import MIN_DOT_DIM, dot_precision, load_query_group, sm_count


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The kernel's launch parameters; a field left None is `pick_tuning`'s."""
  block_m: int | None = None  # index entries per inner-loop block (a power of two >= 16)
  num_splits: int | None = None  # grid splits of M per (b, k) row (at most its blocks; 1: no XLA merge)
  num_warps: int | None = None
  num_stages: int | None = None


def pick_tuning(B: int, K: int, M: int, given: Tuning | None = None) -> Tuning:
  """The launch parameters at this shape on this device, the fields `given` sets kept: block_m 32 up to M = 256
  (64 above), splits for about 2 programs per SM of the device (`sm_count`; a rule of thumb, no A/B recorded),
  4 warps, 2 stages."""
  given = given or Tuning()
  return Tuning(block_m=(32 if M <= 256 else 64) if given.block_m is None else given.block_m,
                num_splits=splits_for(2 * sm_count(), B * K) if given.num_splits is None else given.num_splits,
                num_warps=4 if given.num_warps is None else given.num_warps,
                num_stages=2 if given.num_stages is None else given.num_stages)


def sparse_decode_attention_reference(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, k_scale_BK=None, v_scale_BK=None,
                                      **unused_tuning):
  """Exact attention (scale 1/sqrt(H)) over the slots idx[b,k,m] with valid[b,k,m]; 0 if none. With scales,
  over the FP8 cache's values as `kv_quant.dequantize` reads them."""
  del unused_tuning
  take = jax.vmap(jax.vmap(lambda x_SH, i_M: x_SH[i_M]))
  return masked_attention_reference(q_BKGH, take(k_BKSH, idx_BKM), take(v_BKSH, idx_BKM), valid_BKM, k_scale_BK,
                                    v_scale_BK)


def _sparse_decode_kernel(
    # inputs
    q_ref,  # [G, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H]
    idx_ref,  # [M] int32
    valid_ref,  # [M] bool
    k_scale_ref,  # [] float32 (an FP8 cache), or None
    v_scale_ref,  # [] float32, or None
    # outputs (`split_outputs`): o [G, H] float32 unnormalised, m [G], l [G]; or one split: out [G, H]
    *out_refs,
    block_m: int,
    split_m: int,
    sm_scale: float,
):
  H = q_ref.shape[1]
  S = k_ref.shape[0]
  M = idx_ref.shape[0]
  start = pl.program_id(2) * split_m
  end = jnp.minimum(start + split_m, M)
  q, row_ok = load_query_group(q_ref)
  prec = dot_precision(q.dtype)
  # An FP8 cache: exact conversion to q's dtype, the scales in registers (as the dense kernel's).
  logit_scale = sm_scale if k_scale_ref is None else sm_scale * k_scale_ref[...]
  zero = 0 if k_scale_ref is None else 0.0  # (the Triton lowering casts a masked load's fill to FP8 from a float)

  def body(i, carry):
    base = start + i * block_m
    in_range = base + jnp.arange(block_m) < end
    idx = pltriton.load(idx_ref.at[pl.ds(base, block_m)], mask=in_range, other=0)
    ok = pltriton.load(valid_ref.at[pl.ds(base, block_m)], mask=in_range, other=False)
    ok = ok & in_range
    rows, cols = jnp.clip(idx, 0, S - 1)[:, None], jnp.arange(H)[None, :]
    # Invalid rows are not fetched. Two broadcasting index arrays rather than `k_ref.at[idx, :]`: the same
    # Triton gather, and one that interpret mode can mask (it cannot mix an index array with a slice).
    k = pltriton.load(k_ref.at[rows, cols], mask=ok[:, None], other=zero).astype(q.dtype)
    v = pltriton.load(v_ref.at[rows, cols], mask=ok[:, None], other=zero).astype(q.dtype)
    k = jnp.where(ok[:, None], k, jnp.zeros_like(k))
    v = jnp.where(ok[:, None], v, jnp.zeros_like(v))
    return online_softmax_update(carry, q, k, v, ok, logit_scale, prec)

  num_blocks = jnp.maximum(end - start + block_m - 1, 0) // block_m
  partials = lax.fori_loop(0, num_blocks, body, init_partials(row_ok.shape[0], H))
  store_split_outputs(out_refs, scale_values(partials, v_scale_ref), row_ok)


@functools.partial(jax.jit, static_argnames=["interpret", "tuning"])
def sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, k_scale_BK=None, v_scale_BK=None, *,
                            interpret: bool = False, tuning: Tuning | None = None):
  """Exact attention of q[b,k,g] over the K/V slots idx[b,k,m] where valid[b,k,m].

  Args:
    q_BKGH: queries, bf16 or f32. k_BKSH, v_BKSH: cache in q's dtype, or FP8 with k_scale_BK / v_scale_BK
      ([B, K] float32, `kv_quant`); any slot may hold junk unless a valid entry selects it.
    idx_BKM: int32 slot ids in [0, S) (clipped if not). Duplicates count twice.
    valid_BKM: bool; invalid entries are ignored. All invalid: output 0.
    tuning: launch parameters (`Tuning`); None, or its None fields: `pick_tuning`'s.
  Returns:
    out_BKGH in q's dtype.
  """
  B, K, G, H, S = check_qkv(q_BKGH, k_BKSH, v_BKSH, k_scale_BK, v_scale_BK)
  if idx_BKM.ndim != 3 or idx_BKM.shape[:2] != (B, K) or valid_BKM.shape != idx_BKM.shape:
    raise ValueError(f"idx_BKM.shape={idx_BKM.shape} and valid_BKM.shape={valid_BKM.shape} must "
                     f"both be (B, K, M) = ({B}, {K}, M)")
  M = idx_BKM.shape[2]
  if M < 1:
    raise ValueError(f"selected tokens M={M} must be >= 1")
  if not jnp.issubdtype(idx_BKM.dtype, jnp.integer):
    raise ValueError(f"idx_BKM.dtype={idx_BKM.dtype} must be an integer type")
  if valid_BKM.dtype != jnp.bool_:
    raise ValueError(f"valid_BKM.dtype={valid_BKM.dtype} must be bool")
  tuning = pick_tuning(B, K, M, tuning)
  block_m = tuning.block_m
  if block_m < MIN_DOT_DIM or block_m & (block_m - 1):
    raise ValueError(f"block_m={block_m} must be a power of two >= {MIN_DOT_DIM}")
  split_m, num_splits = split_grid(M, block_m, tuning.num_splits)

  kernel = functools.partial(_sparse_decode_kernel, block_m=block_m, split_m=split_m,
                             sm_scale=1.0 / math.sqrt(H))
  scales, scale_specs, kernel = scale_inputs(kernel, 5, k_scale_BK, v_scale_BK)
  out_specs, out_shape = split_outputs(B, K, num_splits, G, H, q_BKGH.dtype)
  outs = pl.pallas_call(
      kernel,
      grid=(B, K, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, G, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, M), lambda b, k, s: (b, k, 0)),
          pl.BlockSpec((None, None, M), lambda b, k, s: (b, k, 0)),
      ] + scale_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
      interpret=interpret,
      name="rocketkv_sparse_decode",
  )(q_BKGH, k_BKSH, v_BKSH, idx_BKM.astype(jnp.int32), valid_BKM, *scales)
  return finish_split_outputs(outs, q_BKGH.dtype)
