"""Top-k tokens from page scores (RocketKV stage 2's token selection) with a Pallas Triton kernel.

Every valid slot of page p scores page_scores[p]; the step attends the m = min(k, length) best slots,
ties toward the lower slot (what `lax.top_k` over the per-slot scores gives). XLA's top_k sorts the
whole row (about 16 us per layer on an H200 at any size); this kernel needs no sort. One program
per (b, k) row holds the row's page scores and:

1. maps each score to an int32 key with the same order (sign-magnitude flip of the float bits);
2. finds the m-th best slot key tau by bisection over the key bits (32 masked sums of the pages'
   valid-slot counts);
3. takes every slot of pages with key > tau and, of pages with key == tau, the lowest slots until m
   are taken (an exclusive cumsum over those pages);
4. writes the taken slots in ascending slot order: page p's slots go to positions
   offset[p] + j (an exclusive cumsum of the per-page take), a masked scatter of page_size stores.

Output idx [B, K, M], M = min(k, num_slots): the first min(m, M) entries are the chosen slots in
ascending order, the rest 0. `page_topk_reference` gives the same array with lax.top_k and a sort.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels._common import next_pow2, page_slots

# A row's page scores live in registers: up to this many pages per row (4096 pages of 3 slots is a
# 12k-token cache, above RocketKV's capacity at t = 2048).
MAX_PAGES = 4096
_INT_MIN = -(2 ** 31)


def page_topk_reference(scores_BKP, length_B, *, page_size: int, k: int, num_slots: int,
                        **unused_tuning):
  """Same arguments and output as `page_topk`, with lax.top_k over the per-slot scores."""
  del unused_tuning
  m = min(k, num_slots)
  length = jnp.clip(length_B.astype(jnp.int32), 0, num_slots)
  slot_scores = jnp.repeat(scores_BKP.astype(jnp.float32), page_size, axis=-1)[..., :num_slots]
  valid = (jnp.arange(num_slots)[None, :] < length[:, None])[:, None, :]
  _, idx = lax.top_k(jnp.where(valid, slot_scores, -jnp.inf), m)  # stable: ties keep slot order
  taken = jnp.arange(m)[None, None, :] < length[:, None, None]  # valid slots come first
  idx = jnp.sort(jnp.where(taken, idx, num_slots), axis=-1)
  return jnp.where(taken, idx, 0).astype(jnp.int32)


def _order_key(x):
  """int32 keys ordered as the float32 values (-0 just below +0); NaN is not expected."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _page_topk_kernel(scores_ref, length_ref, idx_ref, *, page_size: int, k: int, num_pages: int,
                      masked_scatter: bool):
  Pp = next_pow2(num_pages)
  Mp = idx_ref.shape[0] - 1  # the last entry is a dump slot for interpret mode's unmasked scatter
  M = min(k, Mp)
  page = jnp.arange(Pp, dtype=jnp.int32)
  length = length_ref[...]
  cnt = jnp.where(page < num_pages, page_slots(length, page, page_size), 0)
  s = pltriton.load(scores_ref.at[pl.ds(0, Pp)], mask=page < num_pages, other=0.0) if masked_scatter \
      else scores_ref[pl.ds(0, Pp)]
  key = _order_key(s.astype(jnp.float32))
  m = jnp.minimum(length, M)

  def weight_at_least(t):
    return jnp.sum(jnp.where(key >= t, cnt, 0))

  # tau = the largest t with weight(key >= t) >= m: the sign bit first, then bits 30..0.
  tau = jnp.where(weight_at_least(jnp.int32(0)) >= m, jnp.int32(0), jnp.int32(_INT_MIN))

  def bit_step(i, t):
    cand = t | lax.shift_left(jnp.int32(1), jnp.int32(30) - i)
    return jnp.where(weight_at_least(cand) >= m, cand, t)

  tau = lax.fori_loop(0, 31, bit_step, tau)
  gt = key > tau
  eq_w = jnp.where(key == tau, cnt, 0)
  need = m - jnp.sum(jnp.where(gt, cnt, 0))
  eq_before = jnp.cumsum(eq_w) - eq_w
  take = jnp.where(gt, cnt, jnp.clip(need - eq_before, 0, eq_w))
  offset = jnp.cumsum(take) - take

  if masked_scatter:  # zeros past m: disjoint from the scatter below, so no ordering is needed
    pltriton.store(idx_ref.at[pl.ds(0, Mp)], jnp.zeros((Mp,), jnp.int32), mask=jnp.arange(Mp) >= m)
  else:
    idx_ref[pl.ds(0, Mp)] = jnp.zeros((Mp,), jnp.int32)
  for j in range(page_size):
    ok = j < take
    slot = page * page_size + j
    if masked_scatter:
      pltriton.store(idx_ref.at[offset + j], slot, mask=ok)
    else:  # interpret mode cannot mask a scatter: send the untaken lanes to the dump slot
      idx_ref[jnp.where(ok, offset + j, Mp)] = slot


@functools.partial(jax.jit, static_argnames=["page_size", "k", "num_slots", "interpret", "num_warps"])
def page_topk(scores_BKP, length_B, *, page_size: int, k: int, num_slots: int, interpret: bool = False,
              num_warps: int = 4):
  """The top-k slots per (b, k) when every valid slot of page p scores scores_BKP[..., p].

  Args:
    scores_BKP: page scores (float32 or bfloat16); pages with no valid slot may hold anything.
    length_B: int32 valid slots per sequence (clipped to [0, num_slots]).
    page_size: slots per page; num_slots: cache slots (P = ceil(num_slots / page_size)).
    k: tokens to select.
  Returns:
    idx_BKM int32, M = min(k, num_slots): the min(k, length) chosen slots in ascending order, then 0s.
  """
  if scores_BKP.ndim != 3:
    raise ValueError(f"scores_BKP.shape={scores_BKP.shape} must be (B, K, P)")
  B, K, P = scores_BKP.shape
  if page_size < 1 or k < 1 or num_slots < 1:
    raise ValueError(f"page_size={page_size}, k={k} and num_slots={num_slots} must be >= 1")
  if P != -(-num_slots // page_size):
    raise ValueError(f"P={P} pages must be ceil(num_slots={num_slots} / page_size={page_size})")
  if P > MAX_PAGES:
    raise ValueError(f"P={P} pages is above this kernel's MAX_PAGES={MAX_PAGES}; use the XLA top-k")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  if jnp.dtype(scores_BKP.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"scores_BKP.dtype={scores_BKP.dtype} must be float32 or bfloat16")
  M = min(k, num_slots)
  Mp = next_pow2(M)
  Pp = next_pow2(P)
  scores = scores_BKP.astype(jnp.float32)
  if interpret:  # interpret mode reads whole power-of-two blocks: pad instead of masking
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, Pp - P)))
  length = jnp.clip(length_B.astype(jnp.int32), 0, num_slots)
  kernel = functools.partial(_page_topk_kernel, page_size=page_size, k=k, num_pages=P,
                             masked_scatter=not interpret)
  idx = pl.pallas_call(
      kernel,
      grid=(B, K),
      in_specs=[pl.BlockSpec((None, None, scores.shape[-1]), lambda b, h: (b, h, 0)),
                pl.BlockSpec((None,), lambda b, h: (b,))],
      out_specs=pl.BlockSpec((None, None, Mp + 1), lambda b, h: (b, h, 0)),
      out_shape=jax.ShapeDtypeStruct((B, K, Mp + 1), jnp.int32),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rocketkv_page_topk",
  )(scores, length)
  return idx[..., :M]
