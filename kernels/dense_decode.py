"""Dense (full-cache) GQA decode attention: flash-decoding with a Pallas Triton kernel.

The grid is (B, K, splits): each program streams one contiguous split of one KV head's cache in
blocks of `block_k` slots with an online softmax, for all G query heads of the group at once (the
group is padded to 16 rows for Triton's dot), and writes unnormalised partials (o, m, l). A small
XLA epilogue combines the splits. Slots at or past `length[b]` are never read (masked loads), so
they may hold anything, NaN included.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels._common import (FLOAT_DTYPES, MIN_DOT_DIM, cdiv, check_dtype, combine_partials,
                                          dot_precision, init_partials, next_pow2, online_softmax_update,
                                          partial_shapes, partial_specs, store_partials)

# Programs to aim for: a few waves over the H200's 132 SMs.
_TARGET_PROGRAMS = 4 * 132


def dense_decode_attention_reference(q_BKGH, k_BKSH, v_BKSH, length_B, **unused_tuning):
  """Exact softmax attention (scale 1/sqrt(H)) of each query head over slots [0, length[b])."""
  del unused_tuning
  H = q_BKGH.shape[-1]
  S = k_BKSH.shape[2]
  valid_BS = jnp.arange(S)[None, :] < length_B[:, None]
  valid_BKS = valid_BS[:, None, :]
  k = jnp.where(valid_BKS[..., None], k_BKSH.astype(jnp.float32), 0.0)
  v = jnp.where(valid_BKS[..., None], v_BKSH.astype(jnp.float32), 0.0)
  s_BKGS = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH.astype(jnp.float32), k,
                      precision=lax.Precision.HIGHEST) / math.sqrt(H)
  s_BKGS = jnp.where(valid_BKS[:, :, None, :], s_BKGS, -jnp.inf)
  m = jnp.max(s_BKGS, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid_BKS[:, :, None, :], jnp.exp(s_BKGS - m), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("BKGS,BKSH->BKGH", p, v, precision=lax.Precision.HIGHEST)
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return o.astype(q_BKGH.dtype)


def _dense_decode_kernel(
    # inputs
    q_ref,  # [G, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H]
    length_ref,  # []
    # outputs
    o_ref,  # [G, H] float32, unnormalised
    m_ref,  # [G] float32, running max of the scaled logits
    l_ref,  # [G] float32, softmax denominator relative to m
    *,
    block_k: int,
    split_len: int,
    sm_scale: float,
):
  G, H = q_ref.shape
  Gp = max(MIN_DOT_DIM, next_pow2(G))  # rows for Triton's dot; pads are masked on load/store
  S = k_ref.shape[0]
  split = pl.program_id(2)
  start = split * split_len
  end = jnp.minimum(jnp.minimum(start + split_len, length_ref[...]), S)
  row_ok = jnp.arange(Gp) < G
  q = pltriton.load(q_ref.at[pl.ds(0, Gp), :], mask=row_ok[:, None], other=0)
  prec = dot_precision(q.dtype)

  def body(i, carry):
    base = start + i * block_k
    valid = base + jnp.arange(block_k) < end
    k = pltriton.load(k_ref.at[pl.ds(base, block_k), :], mask=valid[:, None], other=0)
    v = pltriton.load(v_ref.at[pl.ds(base, block_k), :], mask=valid[:, None], other=0)
    return online_softmax_update(carry, q, k, v, valid, sm_scale, prec)

  num_blocks = jnp.maximum(end - start + block_k - 1, 0) // block_k
  partials = lax.fori_loop(0, num_blocks, body, init_partials(Gp, H))
  store_partials(o_ref, m_ref, l_ref, partials, row_ok)


@functools.partial(jax.jit, static_argnames=["interpret", "block_k", "num_splits", "num_warps",
                                             "num_stages"])
def dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, *, interpret: bool = False,
                           block_k: int | None = None, num_splits: int | None = None,
                           num_warps: int = 4, num_stages: int = 2):
  """Flash-decoding attention of q[b,k,g] over k/v[b,k, :length[b]], scale 1/sqrt(H).

  Args:
    q_BKGH: queries, bf16 or f32; G query heads share KV head k.
    k_BKSH, v_BKSH: cache, same dtype as q. Slots >= length[b] may hold junk (NaN/inf).
    length_B: int32 valid slots per sequence; values are clipped to [0, S]. A sequence with
      length 0 gets output 0.
    block_k: slots per inner-loop block (power of two >= 16). num_splits: grid splits of S.
  Returns:
    out_BKGH in q's dtype.
  """
  if q_BKGH.ndim != 4 or k_BKSH.ndim != 4:
    raise ValueError(f"q_BKGH.shape={q_BKGH.shape} and k_BKSH.shape={k_BKSH.shape} must be 4-D")
  B, K, G, H = q_BKGH.shape
  S = k_BKSH.shape[2]
  if k_BKSH.shape != (B, K, S, H) or v_BKSH.shape != k_BKSH.shape:
    raise ValueError(f"k_BKSH.shape={k_BKSH.shape} and v_BKSH.shape={v_BKSH.shape} must both be "
                     f"(B, K, S, H) = ({B}, {K}, S, {H}) to match q_BKGH.shape={q_BKGH.shape}")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  if H not in (64, 128) and H & (H - 1):
    raise ValueError(f"head dim H={H} must be a power of two (64 or 128 supported)")
  if S < 1:
    raise ValueError(f"cache slots S={S} must be >= 1")
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  if k_BKSH.dtype != q_BKGH.dtype or v_BKSH.dtype != q_BKGH.dtype:
    raise ValueError(f"k/v dtypes {k_BKSH.dtype}/{v_BKSH.dtype} must equal q dtype {q_BKGH.dtype}")
  if block_k is None:
    block_k = 64 if H == 128 else 128
  if block_k < MIN_DOT_DIM or block_k & (block_k - 1):
    raise ValueError(f"block_k={block_k} must be a power of two >= {MIN_DOT_DIM}")
  blocks = cdiv(S, block_k)
  if num_splits is None:
    num_splits = cdiv(_TARGET_PROGRAMS, B * K)
  num_splits = max(1, min(num_splits, blocks))
  split_len = cdiv(blocks, num_splits) * block_k
  num_splits = cdiv(S, split_len)

  kernel = functools.partial(_dense_decode_kernel, block_k=block_k,
                             split_len=split_len, sm_scale=1.0 / math.sqrt(H))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(B, K, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, G, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None,), lambda b, k, s: (b,)),
      ],
      out_specs=partial_specs(G, H),
      out_shape=partial_shapes(B, K, num_splits, G, H),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="rocketkv_dense_decode",
  )(q_BKGH, k_BKSH, v_BKSH, jnp.clip(length_B.astype(jnp.int32), 0, S))
  return combine_partials(o, m, l, q_BKGH.dtype)
