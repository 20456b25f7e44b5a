"""HSA page scores (RocketKV stage 2, ALGORITHM.md section 3) with a Pallas Triton kernel.

KT pages are channel-major [B, K, H, P]. For each (b, k) the kernel reads only the R selected
channel rows, and of each row only the min or the max page summary (by the sign of the group's
summed query on that channel): R * P values per KV head. The tiny per-(b, k) terms (q on the selected
channels, their signs, the temperatures) are computed in XLA. The grid is (B, K, page blocks); each
program writes its per-head scaled page scores s/tau and a partial softmax (max, weighted sum)
over its pages. A small XLA epilogue normalises per head over all pages and averages the group.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels._common import (FLOAT_DTYPES, MASK_VALUE, MIN_DOT_DIM, cdiv, check_dtype,
                                          check_kt_pages, next_pow2, page_slots)

_TARGET_PROGRAMS = 2 * 132


def _temperature(qr_GR, qf_GH):
  """tau[g] = sqrt(H * |q_g[channels]|_1 / |q_g|_1); 1 where that is not a positive number."""
  H = qf_GH.shape[-1]
  num = jnp.abs(qr_GR).sum(-1)
  den = jnp.abs(qf_GH).sum(-1)
  tau = jnp.sqrt(H * num / jnp.where(den > 0, den, 1.0))
  return jnp.where(tau > 0, tau, 1.0)


def hsa_page_scores_reference(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B, *,
                              page_size: int, **unused_tuning):
  """Group-mean softmax page probabilities (float32); -inf for pages with no valid slot."""
  del unused_tuning
  P = kt_min_BKHP.shape[-1]

  def one(q_GH, kmin_HP, kmax_HP, ch_R, length):
    qf = q_GH.astype(jnp.float32)
    qr = qf[:, ch_R]  # [G, R]
    sigma = qr.sum(0) > 0  # [R]; zero counts as negative
    rep = jnp.where(sigma[:, None], kmax_HP[ch_R].astype(jnp.float32),
                    kmin_HP[ch_R].astype(jnp.float32))  # [R, P]
    n = page_slots(length, jnp.arange(P), page_size)
    ok = n > 0
    rep = jnp.where(ok[None, :], rep, 0.0)  # empty pages may hold junk
    s = jnp.einsum("GR,RP->GP", qr, rep, precision=lax.Precision.HIGHEST)
    s = s / _temperature(qr, qf)[:, None]
    s = jnp.where(ok[None, :], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(ok[None, :], jnp.exp(s - m), 0.0)
    prob = e / (e * n[None, :]).sum(-1, keepdims=True)
    return jnp.where(ok, prob.mean(0), -jnp.inf)

  return jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, 0, None)))(
      q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B)


def _hsa_scores_kernel(
    # inputs
    qr_ref,  # [G, R] float32: q[g, channels]
    inv_tau_ref,  # [G] float32: 1 / tau[g]
    kt_min_ref,  # [H, P]
    kt_max_ref,  # [H, P]
    ch_ref,  # [R] int32
    use_max_ref,  # [R] bool: sum_g qr[g, r] > 0
    length_ref,  # []
    # outputs
    s_ref,  # [G, block_p] float32: s/tau of each head, MASK_VALUE on empty pages
    m_ref,  # [G] float32: max of s/tau over this block's non-empty pages
    l_ref,  # [G] float32: sum over those pages of n[p] * exp(s/tau - m)
    *,
    block_p: int,
    page_size: int,
    masked_gather: bool,
):
  G, R = qr_ref.shape
  Gp = next_pow2(G)
  Rp = next_pow2(R)
  P = kt_min_ref.shape[1]
  rows = jnp.arange(Gp)
  row_ok = rows < G
  r_ok = jnp.arange(Rp) < R
  ch = pltriton.load(ch_ref.at[pl.ds(0, Rp)], mask=r_ok, other=0)
  use_max = pltriton.load(use_max_ref.at[pl.ds(0, Rp)], mask=r_ok, other=False) & r_ok
  use_min = (~use_max) & r_ok
  inv_tau = pltriton.load(inv_tau_ref.at[pl.ds(0, Gp)], mask=row_ok, other=1.0)

  p0 = pl.program_id(2) * block_p
  page = p0 + jnp.arange(block_p)
  n = page_slots(length_ref[...], page, page_size)
  p_ok = (n > 0) & (page < P)
  if masked_gather:
    # Each selected channel row is fetched from exactly one of kt_min / kt_max.
    # No `other=`: Triton cannot cast an int fill to float8; masked lanes are dropped by where.
    rows_R, cols = ch[:, None], page[None, :]
    rep_max = pltriton.load(kt_max_ref.at[rows_R, cols], mask=use_max[:, None] & p_ok[None, :])
    rep_min = pltriton.load(kt_min_ref.at[rows_R, cols], mask=use_min[:, None] & p_ok[None, :])
    rep = jnp.where(use_max[:, None], rep_max.astype(jnp.float32), rep_min.astype(jnp.float32))
  else:  # interpret mode cannot mask a gather: load both and select
    rep_max = kt_max_ref[ch, pl.ds(p0, block_p)].astype(jnp.float32)
    rep_min = kt_min_ref[ch, pl.ds(p0, block_p)].astype(jnp.float32)
    rep = jnp.where(use_max[:, None], rep_max, rep_min)
  rep = jnp.where(r_ok[:, None] & p_ok[None, :], rep, 0.0)  # [Rp, block_p]
  # s[g, p] = sum_r qr[g, r] * rep[r, p] in exact float32 (no TF32 dot), one head at a time.
  s = jnp.zeros((Gp, block_p), jnp.float32)
  for g in range(G):
    qg = pltriton.load(qr_ref.at[jnp.int32(g), pl.ds(0, Rp)], mask=r_ok, other=0.0)  # [Rp]
    s_g = (qg[:, None] * rep).sum(axis=0)  # [block_p]
    s = jnp.where((rows == g)[:, None], s_g[None, :], s)
  s = s * inv_tau[:, None]
  s = jnp.where(p_ok[None, :], s, MASK_VALUE)
  m = s.max(axis=-1)
  e = jnp.where(p_ok[None, :], jnp.exp(s - m[:, None]), 0.0)
  l = (e * n[None, :].astype(jnp.float32)).sum(axis=-1)
  pltriton.store(s_ref.at[pl.ds(0, Gp), :], s, mask=row_ok[:, None])
  pltriton.store(m_ref.at[pl.ds(0, Gp)], m, mask=row_ok)
  pltriton.store(l_ref.at[pl.ds(0, Gp)], l, mask=row_ok)


@functools.partial(jax.jit, static_argnames=["page_size", "interpret", "block_p", "num_warps",
                                             "num_stages"])
def hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B, *, page_size: int,
                    interpret: bool = False, block_p: int | None = None, num_warps: int = 4,
                    num_stages: int = 1):
  """HSA group page scores: mean over the group of each head's softmax over valid slots.

  Args:
    q_BKGH: queries (bf16 or f32), the new token already appended to the cache.
    kt_min_BKHP, kt_max_BKHP: per-page element-wise key min / max, channel-major, P =
      ceil(S / page_size) pages, dtype f32, bf16 or float8_e5m2 (upcast to f32). Pages with no
      valid slot may hold junk.
    channels_BKR: int32 top-r channel ids per (b, k) (clipped to [0, H)).
    length_B: int32 valid slots per sequence.
    page_size: slots per page.
  Returns:
    scores_BKP float32: a probability per page (each of the page's n[p] valid slots gets it;
    sum_p n[p] * scores[p] == 1), -inf on pages with no valid slot.
  """
  if q_BKGH.ndim != 4:
    raise ValueError(f"q_BKGH.shape={q_BKGH.shape} must be 4-D")
  B, K, G, H = q_BKGH.shape
  if check_kt_pages(kt_min_BKHP, kt_max_BKHP)[:3] != (B, K, H):
    raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} must be (B, K, H, P) = ({B}, {K}, {H}, P)")
  P = kt_min_BKHP.shape[-1]
  if channels_BKR.ndim != 3 or channels_BKR.shape[:2] != (B, K):
    raise ValueError(f"channels_BKR.shape={channels_BKR.shape} must be (B, K, R) = ({B}, {K}, R)")
  R = channels_BKR.shape[2]
  if not 1 <= R <= H:
    raise ValueError(f"top_r R={R} must be in [1, H={H}]")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  if page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1")
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  if block_p is None:
    # Enough page blocks to fill the GPU, between 32 and 128 pages per program.
    want = cdiv(P, max(1, cdiv(_TARGET_PROGRAMS, B * K)))
    block_p = min(128, max(32, next_pow2(want)))
  if block_p < MIN_DOT_DIM or block_p & (block_p - 1):
    raise ValueError(f"block_p={block_p} must be a power of two >= {MIN_DOT_DIM}")
  num_blocks = cdiv(P, block_p)
  P_pad = num_blocks * block_p

  # The per-(b, k) selection terms are tiny ([G, R]); XLA computes them once instead of every
  # page-block program redoing them.
  channels = jnp.clip(channels_BKR.astype(jnp.int32), 0, H - 1)
  qf_BKGH = q_BKGH.astype(jnp.float32)
  qr_BKGR = jnp.take_along_axis(qf_BKGH, channels[:, :, None, :], axis=-1)
  use_max_BKR = qr_BKGR.sum(axis=2) > 0  # zero counts as negative
  inv_tau_BKG = 1.0 / _temperature(qr_BKGR, qf_BKGH)

  kernel = functools.partial(_hsa_scores_kernel, block_p=block_p, page_size=page_size,
                             masked_gather=not interpret)
  length = jnp.clip(length_B.astype(jnp.int32), 0, P * page_size)
  s_BKGP, m_BKNG, l_BKNG = pl.pallas_call(
      kernel,
      grid=(B, K, num_blocks),
      in_specs=[
          pl.BlockSpec((None, None, G, R), lambda b, k, j: (b, k, 0, 0)),
          pl.BlockSpec((None, None, G), lambda b, k, j: (b, k, 0)),
          pl.BlockSpec((None, None, H, P), lambda b, k, j: (b, k, 0, 0)),
          pl.BlockSpec((None, None, H, P), lambda b, k, j: (b, k, 0, 0)),
          pl.BlockSpec((None, None, R), lambda b, k, j: (b, k, 0)),
          pl.BlockSpec((None, None, R), lambda b, k, j: (b, k, 0)),
          pl.BlockSpec((None,), lambda b, k, j: (b,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, G, block_p), lambda b, k, j: (b, k, 0, j)),
          pl.BlockSpec((None, None, None, G), lambda b, k, j: (b, k, j, 0)),
          pl.BlockSpec((None, None, None, G), lambda b, k, j: (b, k, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((B, K, G, P_pad), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_blocks, G), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_blocks, G), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="rocketkv_hsa_scores",
  )(qr_BKGR, inv_tau_BKG, kt_min_BKHP, kt_max_BKHP, channels, use_max_BKR, length)

  # Epilogue: per-head normaliser over all pages, then the group mean.
  m_BKG = m_BKNG.max(axis=2)
  l_BKG = (l_BKNG * jnp.exp(m_BKNG - m_BKG[:, :, None])).sum(axis=2)
  inv_l = jnp.where(l_BKG > 0, 1.0 / jnp.where(l_BKG > 0, l_BKG, 1.0), 0.0)
  prob_BKGP = jnp.exp(s_BKGP[..., :P] - m_BKG[..., None]) * inv_l[..., None]
  n_BP = page_slots(length[:, None], jnp.arange(P)[None, :], page_size)
  return jnp.where(n_BP[:, None, :] > 0, prob_BKGP.mean(axis=2), -jnp.inf)
