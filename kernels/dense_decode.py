"""Dense (full-cache) GQA decode attention: flash-decoding with a Pallas Triton kernel.

The grid is (B, K, splits): each program streams one contiguous split of one KV head's cache in
blocks of `block_k` slots with an online softmax, for all G query heads of the group at once (the
group is padded to 16 rows for Triton's dot), and writes unnormalised partials (o, m, l). A small
XLA epilogue combines the splits. Slots at or past `length[b]` are never read (masked loads), so
they may hold anything, NaN included.
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
  block_k: int | None = None  # slots per inner-loop block (a power of two >= 16)
  num_splits: int | None = None  # grid splits of S per (b, k) row (at most its blocks)
  num_warps: int | None = None
  num_stages: int | None = None


def pick_tuning(B: int, K: int, H: int, given: Tuning | None = None) -> Tuning:
  """The launch parameters at this shape on this device, the fields `given` sets kept: block_k 64 at H = 128
  (128 below), splits for about 4 programs per SM of the device (`sm_count`: a few waves; a rule of thumb, no
  A/B recorded), 4 warps, 2 stages."""
  given = given or Tuning()
  return Tuning(block_k=(64 if H == 128 else 128) if given.block_k is None else given.block_k,
                num_splits=splits_for(4 * sm_count(), B * K) if given.num_splits is None else given.num_splits,
                num_warps=4 if given.num_warps is None else given.num_warps,
                num_stages=2 if given.num_stages is None else given.num_stages)


def dense_decode_attention_reference(q_BKGH, k_BKSH, v_BKSH, length_B, k_scale_BK=None, v_scale_BK=None,
                                     **unused_tuning):
  """Exact softmax attention (scale 1/sqrt(H)) of each query head over slots [0, length[b]); with scales, over
  the FP8 cache's values as `kv_quant.dequantize` reads them."""
  del unused_tuning
  B, K, S, _ = k_BKSH.shape
  valid_BKS = jnp.broadcast_to((jnp.arange(S)[None, :] < length_B[:, None])[:, None, :], (B, K, S))
  return masked_attention_reference(q_BKGH, k_BKSH, v_BKSH, valid_BKS, k_scale_BK, v_scale_BK)


def _dense_decode_kernel(
    # inputs
    q_ref,  # [G, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H]
    length_ref,  # [] (any int: clipped to [0, S] here)
    k_scale_ref,  # [] float32 (an FP8 cache), or None
    v_scale_ref,  # [] float32, or None
    # outputs (`split_outputs`): o [G, H] float32 unnormalised, m [G] running max of the scaled logits,
    # l [G] softmax denominator relative to m; or with one split the normalised out [G, H]
    *out_refs,
    block_k: int,
    split_len: int,
    sm_scale: float,
):
  H = q_ref.shape[1]
  S = k_ref.shape[0]
  split = pl.program_id(2)
  start = split * split_len
  end = jnp.minimum(jnp.minimum(start + split_len, length_ref[...]), S)
  q, row_ok = load_query_group(q_ref)
  prec = dot_precision(q.dtype)
  # An FP8 cache: the raw values convert exactly to q's dtype; the head's key scale joins the logits' scale
  # and its value scale multiplies the partial output (`kv_quant`).
  logit_scale = sm_scale if k_scale_ref is None else sm_scale * k_scale_ref[...]
  zero = 0 if k_scale_ref is None else 0.0  # (the Triton lowering casts a masked load's fill to FP8 from a float)

  def body(i, carry):
    base = start + i * block_k
    valid = base + jnp.arange(block_k) < end
    k = pltriton.load(k_ref.at[pl.ds(base, block_k), :], mask=valid[:, None], other=zero).astype(q.dtype)
    v = pltriton.load(v_ref.at[pl.ds(base, block_k), :], mask=valid[:, None], other=zero).astype(q.dtype)
    return online_softmax_update(carry, q, k, v, valid, logit_scale, prec)

  num_blocks = jnp.maximum(end - start + block_k - 1, 0) // block_k
  partials = lax.fori_loop(0, num_blocks, body, init_partials(row_ok.shape[0], H))
  store_split_outputs(out_refs, scale_values(partials, v_scale_ref), row_ok)


@functools.partial(jax.jit, static_argnames=["interpret", "tuning"])
def dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, k_scale_BK=None, v_scale_BK=None, *,
                           interpret: bool = False, tuning: Tuning | None = None):
  """Flash-decoding attention of q[b,k,g] over k/v[b,k, :length[b]], scale 1/sqrt(H).

  Args:
    q_BKGH: queries, bf16 or f32; G query heads share KV head k.
    k_BKSH, v_BKSH: cache, same dtype as q, or FP8 with k_scale_BK / v_scale_BK ([B, K] float32, `kv_quant`:
      read as dequantize gives them). Slots >= length[b] may hold junk (NaN/inf).
    length_B: int32 valid slots per sequence; values are clipped to [0, S]. A sequence with
      length 0 gets output 0.
    tuning: launch parameters (`Tuning`); None, or its None fields: `pick_tuning`'s.
  Returns:
    out_BKGH in q's dtype.
  """
  B, K, G, H, S = check_qkv(q_BKGH, k_BKSH, v_BKSH, k_scale_BK, v_scale_BK)
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  tuning = pick_tuning(B, K, H, tuning)
  block_k = tuning.block_k
  if block_k < MIN_DOT_DIM or block_k & (block_k - 1):
    raise ValueError(f"block_k={block_k} must be a power of two >= {MIN_DOT_DIM}")
  split_len, num_splits = split_grid(S, block_k, tuning.num_splits)

  kernel = functools.partial(_dense_decode_kernel, block_k=block_k,
                             split_len=split_len, sm_scale=1.0 / math.sqrt(H))
  scales, scale_specs, kernel = scale_inputs(kernel, 4, k_scale_BK, v_scale_BK)
  out_specs, out_shape = split_outputs(B, K, num_splits, G, H, q_BKGH.dtype)
  outs = pl.pallas_call(
      kernel,
      grid=(B, K, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, G, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None,), lambda b, k, s: (b,)),
      ] + scale_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
      interpret=interpret,
      name="rocketkv_dense_decode",
  )(q_BKGH, k_BKSH, v_BKSH, length_B.astype(jnp.int32), *scales)
  return finish_split_outputs(outs, q_BKGH.dtype)
