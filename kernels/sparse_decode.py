"""Sparse (top-k) GQA decode attention: gathers the selected K/V rows by index inside a Pallas
Triton kernel.

The grid is (B, K, splits of M): each program walks its split of the index list in blocks of
`block_m`, gathers those K/V rows of its KV head, and runs an online softmax for the whole query
group (padded to 16 rows for Triton's dot). Partials (o, m, l) are merged by the same XLA epilogue
as the dense kernel. Invalid entries are masked before anything touches them, so the slots they
point at may hold NaN.
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

_TARGET_PROGRAMS = 2 * 132


def sparse_decode_attention_reference(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, **unused_tuning):
  """Exact attention (scale 1/sqrt(H)) over the slots idx[b,k,m] with valid[b,k,m]; 0 if none."""
  del unused_tuning
  H = q_BKGH.shape[-1]
  take = jax.vmap(jax.vmap(lambda x_SH, i_M: x_SH[i_M]))
  k_BKMH = take(k_BKSH, idx_BKM).astype(jnp.float32)
  v_BKMH = take(v_BKSH, idx_BKM).astype(jnp.float32)
  k_BKMH = jnp.where(valid_BKM[..., None], k_BKMH, 0.0)
  v_BKMH = jnp.where(valid_BKM[..., None], v_BKMH, 0.0)
  s_BKGM = jnp.einsum("BKGH,BKMH->BKGM", q_BKGH.astype(jnp.float32), k_BKMH,
                      precision=lax.Precision.HIGHEST) / math.sqrt(H)
  mask = valid_BKM[:, :, None, :]
  s_BKGM = jnp.where(mask, s_BKGM, -jnp.inf)
  m = jnp.max(s_BKGM, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s_BKGM - m), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("BKGM,BKMH->BKGH", p, v_BKMH, precision=lax.Precision.HIGHEST)
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return o.astype(q_BKGH.dtype)


def _sparse_decode_kernel(
    # inputs
    q_ref,  # [G, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H]
    idx_ref,  # [M] int32
    valid_ref,  # [M] bool
    # outputs
    o_ref,  # [G, H] float32, unnormalised
    m_ref,  # [G] float32
    l_ref,  # [G] float32
    *,
    block_m: int,
    split_m: int,
    sm_scale: float,
    masked_gather: bool,
):
  G, H = q_ref.shape
  Gp = max(MIN_DOT_DIM, next_pow2(G))
  S = k_ref.shape[0]
  M = idx_ref.shape[0]
  start = pl.program_id(2) * split_m
  end = jnp.minimum(start + split_m, M)
  row_ok = jnp.arange(Gp) < G
  q = pltriton.load(q_ref.at[pl.ds(0, Gp), :], mask=row_ok[:, None], other=0)
  prec = dot_precision(q.dtype)

  def body(i, carry):
    base = start + i * block_m
    in_range = base + jnp.arange(block_m) < end
    idx = pltriton.load(idx_ref.at[pl.ds(base, block_m)], mask=in_range, other=0)
    ok = pltriton.load(valid_ref.at[pl.ds(base, block_m)], mask=in_range, other=False)
    ok = ok & in_range
    idx = jnp.clip(idx, 0, S - 1)
    if masked_gather:  # GPU: invalid rows are not fetched at all
      k = pltriton.load(k_ref.at[idx, :], mask=ok[:, None], other=0)
      v = pltriton.load(v_ref.at[idx, :], mask=ok[:, None], other=0)
    else:  # interpret mode cannot mask a gather; select after the (in-bounds) load instead
      k = k_ref[idx, :]
      v = v_ref[idx, :]
    k = jnp.where(ok[:, None], k, jnp.zeros_like(k))
    v = jnp.where(ok[:, None], v, jnp.zeros_like(v))
    return online_softmax_update(carry, q, k, v, ok, sm_scale, prec)

  num_blocks = jnp.maximum(end - start + block_m - 1, 0) // block_m
  partials = lax.fori_loop(0, num_blocks, body, init_partials(Gp, H))
  store_partials(o_ref, m_ref, l_ref, partials, row_ok)


@functools.partial(jax.jit, static_argnames=["interpret", "block_m", "num_splits", "num_warps",
                                             "num_stages"])
def sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, *,
                            interpret: bool = False, block_m: int | None = None,
                            num_splits: int | None = None, num_warps: int = 4,
                            num_stages: int = 2):
  """Exact attention of q[b,k,g] over the K/V slots idx[b,k,m] where valid[b,k,m].

  Args:
    q_BKGH: queries, bf16 or f32. k_BKSH, v_BKSH: cache in q's dtype; any slot may hold junk
      unless a valid entry selects it.
    idx_BKM: int32 slot ids in [0, S) (clipped if not). Duplicates count twice.
    valid_BKM: bool; invalid entries are ignored. All invalid: output 0.
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
  if idx_BKM.ndim != 3 or idx_BKM.shape[:2] != (B, K) or valid_BKM.shape != idx_BKM.shape:
    raise ValueError(f"idx_BKM.shape={idx_BKM.shape} and valid_BKM.shape={valid_BKM.shape} must "
                     f"both be (B, K, M) = ({B}, {K}, M)")
  M = idx_BKM.shape[2]
  if M < 1:
    raise ValueError(f"selected tokens M={M} must be >= 1")
  if H & (H - 1):
    raise ValueError(f"head dim H={H} must be a power of two (64 or 128 supported)")
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  if k_BKSH.dtype != q_BKGH.dtype or v_BKSH.dtype != q_BKGH.dtype:
    raise ValueError(f"k/v dtypes {k_BKSH.dtype}/{v_BKSH.dtype} must equal q dtype {q_BKGH.dtype}")
  if not jnp.issubdtype(idx_BKM.dtype, jnp.integer):
    raise ValueError(f"idx_BKM.dtype={idx_BKM.dtype} must be an integer type")
  if valid_BKM.dtype != jnp.bool_:
    raise ValueError(f"valid_BKM.dtype={valid_BKM.dtype} must be bool")
  if block_m is None:
    block_m = 32 if M <= 256 else 64
  if block_m < MIN_DOT_DIM or block_m & (block_m - 1):
    raise ValueError(f"block_m={block_m} must be a power of two >= {MIN_DOT_DIM}")
  blocks = cdiv(M, block_m)
  if num_splits is None:
    num_splits = cdiv(_TARGET_PROGRAMS, B * K)
  num_splits = max(1, min(num_splits, blocks))
  split_m = cdiv(blocks, num_splits) * block_m
  num_splits = cdiv(M, split_m)

  kernel = functools.partial(_sparse_decode_kernel, block_m=block_m, split_m=split_m,
                             sm_scale=1.0 / math.sqrt(H), masked_gather=not interpret)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(B, K, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, G, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, H), lambda b, k, s: (b, k, 0, 0)),
          pl.BlockSpec((None, None, M), lambda b, k, s: (b, k, 0)),
          pl.BlockSpec((None, None, M), lambda b, k, s: (b, k, 0)),
      ],
      out_specs=partial_specs(G, H),
      out_shape=partial_shapes(B, K, num_splits, G, H),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="rocketkv_sparse_decode",
  )(q_BKGH, k_BKSH, v_BKSH, idx_BKM.astype(jnp.int32), valid_BKM)
  return combine_partials(o, m, l, q_BKGH.dtype)
