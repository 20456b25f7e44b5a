"""Top-k tokens from page scores (RocketKV stage 2's token selection) with a Pallas Triton kernel.

Every valid slot of page p scores page_scores[p]; the step attends the m = min(k, length) best slots,
ties toward the lower slot (what `lax.top_k` over the per-slot scores gives). XLA's top_k sorts the
whole row (about 16 us per layer on an H200 at any size); this kernel needs no sort. One program
per (b, k) row holds the row's page scores and:

1. maps each score to an int32 key with the same order (sign-magnitude flip of the float bits);
2.-3. takes the m best slots with `topk_select.best_units_take` (each page holds its valid-slot count of
   units at its key: bisection over the key bits for the m-th best key, then the lowest tied pages);
4. writes the taken slots in ascending slot order: page p's slots go to positions
   offset[p] + j (an exclusive cumsum of the per-page take), page_size masked scatters
   (`triton_util.masked_scatter`).

Output idx [B, K, M], M = min(k, num_slots): the first min(m, M) entries are the chosen slots in
ascending order, the rest 0. `page_topk_reference` gives the same array with lax.top_k and a sort.

Per-row page sizes (`page_size_B`, [B] int32, optional): row b's page p covers slots [p * ps_b, (p + 1) *
ps_b), ps_b at most the static page_size (step 4's loop bound), read as one scalar per program; the row's
valid slots are clipped to its P pages' P * ps_b. A row's idx is what the row gives alone with
page_size = ps_b.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.checks import check_page_count, check_row_values
from rocketkv_jax.kernels.hsa_scores import normalize_partials
from rocketkv_jax.kernels.topk_select import best_units_take, order_key
from rocketkv_jax.kernels.triton_util import (MASK_VALUE, masked_scatter, next_pow2, page_slots, pow2_pieces,
                                              row_blocks)

# A row's page scores live in registers: up to this many pages per row (4096 pages of 3 slots is a
# 12k-token cache, above RocketKV's capacity at t = 2048).
MAX_PAGES = 4096
# Above any page probability (each is at most 1): the score of a forced page (RocketKV's hsa_sink_tokens /
# hsa_recent_tokens, this project's extension), so it is always among the top-k.
FORCED_SCORE = 2.0


def forced_pages(page, length, *, page_size, sink: int, recent: int):
  """Whether each page (an int array, broadcast against `length`) holds one of the first `sink` slots or one of
  the last `recent` valid slots [length - recent, length), and a valid slot at all. page_size: an int, or the
  rows' own page sizes (an int array broadcast like `length`). Plain jnp: used in the kernel and in XLA
  alike."""
  first = page * page_size
  forced = first < sink
  if recent:  # (with recent = 0 the test below would still hold for a partial last page)
    forced = forced | (first + page_size > length - recent)
  return forced & (first < length)


def force_pages(scores_BKP, length_B, *, page_size: int, sink: int, recent: int, page_size_B=None):
  """Page scores [B, K, P] with the forced pages (`forced_pages`) raised to FORCED_SCORE. page_size_B: each
  row's page size, or None: page_size."""
  if not (sink or recent):
    return scores_BKP
  page = jnp.arange(scores_BKP.shape[-1])[None, :]
  ps = page_size if page_size_B is None else page_size_B[:, None]
  forced_BP = forced_pages(page, length_B[:, None], page_size=ps, sink=sink, recent=recent)
  return jnp.where(forced_BP[:, None, :], FORCED_SCORE, scores_BKP)


def row_length(length, num_slots: int, num_pages: int, page_size=None):
  """A row's valid slots: length clipped to [0, num_slots] and, with a row's own page size (a scalar or an
  array like length; None: the static pages cover num_slots), to the num_pages * page_size slots of its pages."""
  if page_size is None:
    return jnp.clip(length, 0, num_slots)
  return jnp.clip(length, 0, jnp.minimum(num_slots, num_pages * page_size))


def page_topk_reference(scores_BKP, length_B, *, page_size: int, k: int, num_slots: int, page_size_B=None,
                        **unused_tuning):
  """Same arguments and output as `page_topk`, with lax.top_k over the per-slot scores."""
  del unused_tuning
  m = min(k, num_slots)
  if page_size_B is None:
    length = jnp.clip(length_B.astype(jnp.int32), 0, num_slots)
    slot_scores = jnp.repeat(scores_BKP.astype(jnp.float32), page_size, axis=-1)[..., :num_slots]
  else:  # slot s of row b scores its page s // ps_b (slots past the row's pages are not valid)
    B, K, P = scores_BKP.shape
    ps_B = page_size_B.astype(jnp.int32)
    length = row_length(length_B.astype(jnp.int32), num_slots, P, ps_B)
    page_BS = jnp.minimum(jnp.arange(num_slots)[None, :] // ps_B[:, None], P - 1)
    slot_scores = jnp.take_along_axis(scores_BKP.astype(jnp.float32),
                                      jnp.broadcast_to(page_BS[:, None, :], (B, K, num_slots)), axis=-1)
  valid = (jnp.arange(num_slots)[None, :] < length[:, None])[:, None, :]
  _, idx = lax.top_k(jnp.where(valid, slot_scores, -jnp.inf), m)  # stable: ties keep slot order
  taken = jnp.arange(m)[None, None, :] < length[:, None, None]  # valid slots come first
  idx = jnp.sort(jnp.where(taken, idx, num_slots), axis=-1)
  return jnp.where(taken, idx, 0).astype(jnp.int32)


def hsa_page_topk_reference(s_BKGP, m_BKGN, l_BKGN, length_B, *, page_size: int, k: int, num_slots: int,
                            sink: int = 0, recent: int = 0, page_size_B=None, num_pages: int | None = None,
                            **unused_tuning):
  """`page_topk_reference` of the scores that `hsa_scores.normalize_partials` makes from the partials, the
  forced pages (`force_pages`) raised. page_size_B, num_pages: as `hsa_page_topk`'s."""
  del unused_tuning
  P = selection_pages(s_BKGP.shape[-1], num_slots, page_size, page_size_B, num_pages)
  if page_size_B is not None:
    page_size_B = page_size_B.astype(jnp.int32)
  length = row_length(length_B.astype(jnp.int32), num_slots, P, page_size_B)
  scores = normalize_partials(s_BKGP[..., :P], m_BKGN, l_BKGN, length, page_size=page_size,
                              page_size_B=page_size_B)
  scores = force_pages(scores, length, page_size=page_size, sink=sink, recent=recent, page_size_B=page_size_B)
  return page_topk_reference(scores, length_B, page_size=page_size, k=k, num_slots=num_slots,
                             page_size_B=page_size_B)


def selection_pages(P_pad: int, num_slots: int, page_size: int, page_size_B, num_pages: int | None) -> int:
  """The pages `hsa_page_topk` selects from, of partials over P_pad pages: num_pages when given (the KT
  arrays' page count); else ceil(num_slots / page_size), or with per-row page sizes all P_pad (a row of small
  pages may use pages past ceil(num_slots / page_size); the scoring left those past the KT's without a valid
  slot)."""
  if num_pages is not None:
    return num_pages
  return -(-num_slots // page_size) if page_size_B is None else P_pad


def row_chunks(num_pages: int) -> tuple[tuple[int, int], ...]:
  """(first page, lanes) of each chunk of a row of num_pages pages, in order: the row is held as consecutive
  power-of-two chunks over num_pages rounded up to 32 lanes (539 pages: 512 + 32 lanes), not one vector of
  next_pow2 lanes (1024), so every vector op of the selection runs on about half the lanes. H200, 32k, t=256,
  us per layer of hsa_page_topk at its default warps (tune_hsa, results/stage2_h200_2026-12-02c): 64 rows
  5.99 against 6.11 for one vector, 256 rows 6.39 / 6.66, 864 rows 9.23 / 10.69, 3128 rows 21.8 / 26.1."""
  return pow2_pieces(num_pages, 32)


def _write_top_slots(keys, cnts, chunks, length, idx_ref, *, k: int, page_size: int, interpret: bool, ps=None):
  """Writes the m = min(k, length, M) best slots of the row idx_ref [M] (every valid slot of a page scores
  its page's key; keys / cnts per chunk of `chunks`) in ascending slot order, then 0s. ps: the row's page size
  (a scalar at most page_size), or None: page_size. A page's take is at most its page size, so the loop to
  the static page_size writes nothing past a row's smaller pages."""
  ps = page_size if ps is None else ps
  M = idx_ref.shape[0]
  m = jnp.minimum(length, min(k, M))
  takes = best_units_take(keys, cnts, m)
  # Zeros past m: disjoint from the scatters below, so no ordering is needed.
  pos = jnp.arange(next_pow2(M), dtype=jnp.int32)
  masked_scatter(idx_ref, pos, jnp.zeros(pos.shape, jnp.int32), (pos >= m) & (pos < M), interpret=interpret)
  taken_before = 0  # slots taken in the chunks before this one
  for (first, lanes), take in zip(chunks, takes):
    page = first + jnp.arange(lanes, dtype=jnp.int32)
    offset = jnp.cumsum(take) - take + taken_before
    for j in range(page_size):
      masked_scatter(idx_ref, offset + j, page * ps + j, j < take, interpret=interpret)
    taken_before = taken_before + jnp.sum(take)


def _load_chunk(ref, lead: tuple, first: int, page, num_pages: int, other):
  """ref[*lead, page] for a chunk's pages (`_page_counts`: first, first + 1, ...), those past num_pages
  masked (they load nothing). The first chunk is a pl.ds block; later ones are loaded by index, since a
  static slice past the row's end is refused at trace time."""
  cols = pl.ds(0, page.shape[0]) if first == 0 else page
  return pltriton.load(ref.at[lead + (cols,)], mask=page < num_pages, other=other)


def _page_counts(length, first: int, lanes: int, num_pages: int, page_size: int):
  page = first + jnp.arange(lanes, dtype=jnp.int32)
  return page, jnp.where(page < num_pages, page_slots(length, page, page_size), 0)


def _page_topk_kernel(
    # inputs
    scores_ref,  # [P] float32
    length_ref,  # []
    # outputs
    idx_ref,  # [M] int32
    *,
    page_size: int,
    k: int,
    num_pages: int,
    num_slots: int,
    interpret: bool,
    page_size_ref=None,  # [] the row's page size (an input after length_ref), or None: page_size
):
  chunks = row_chunks(num_pages)
  ps = None if page_size_ref is None else page_size_ref[...]
  length = row_length(length_ref[...], num_slots, num_pages, ps)
  keys, cnts = [], []
  for first, lanes in chunks:
    page, cnt = _page_counts(length, first, lanes, num_pages, page_size if ps is None else ps)
    keys.append(order_key(_load_chunk(scores_ref, (), first, page, num_pages, 0.0)))
    cnts.append(cnt)
  _write_top_slots(keys, cnts, chunks, length, idx_ref, k=k, page_size=page_size, interpret=interpret, ps=ps)


def hsa_page_topk_body(
    # inputs: the HSA kernel's partials (kernels/hsa_scores.py: hsa_page_partials)
    s_ref,  # [G, P_pad] float32: each head's s/tau per page
    m_ref,  # [G, NB] float32: per page block, max of s/tau
    l_ref,  # [G, NB] float32: per page block, sum of n[p] * exp(s/tau - max)
    length_ref,  # []
    # outputs
    idx_ref,  # [M] int32
    *,
    page_size: int,
    k: int,
    num_pages: int,
    num_slots: int,
    interpret: bool,
    sink: int = 0,
    recent: int = 0,
    page_size_ref=None,  # [] the row's page size (an input after length_ref), or None: page_size
):
  G, NB = m_ref.shape
  NBp = next_pow2(NB)
  chunks = row_chunks(num_pages)
  ps = None if page_size_ref is None else page_size_ref[...]
  length = row_length(length_ref[...], num_slots, num_pages, ps)
  blk_ok = jnp.arange(NBp) < NB
  # Each head's softmax normaliser over all page blocks: its max and 1 / (rescaled sum).
  norms = []
  for g in range(G):
    gi = jnp.int32(g)
    m_g = pltriton.load(m_ref.at[gi, pl.ds(0, NBp)], mask=blk_ok, other=MASK_VALUE)
    l_g = pltriton.load(l_ref.at[gi, pl.ds(0, NBp)], mask=blk_ok, other=0.0)
    top = m_g.max()
    denom = (l_g * jnp.exp(m_g - top)).sum()
    norms.append((top, jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)))
  row_ps = page_size if ps is None else ps
  keys, cnts = [], []
  for first, lanes in chunks:
    page, cnt = _page_counts(length, first, lanes, num_pages, row_ps)
    # The group mean of each head's softmax: normalised per head, then averaged.
    prob = jnp.zeros((lanes,), jnp.float32)
    for g, (top, inv) in enumerate(norms):
      s_g = _load_chunk(s_ref, (jnp.int32(g),), first, page, num_pages, MASK_VALUE)
      prob = prob + jnp.exp(s_g - top) * inv
    prob = prob / G
    if sink or recent:
      prob = jnp.where(forced_pages(page, length, page_size=row_ps, sink=sink, recent=recent), FORCED_SCORE,
                       prob)
    keys.append(order_key(prob))
    cnts.append(cnt)
  _write_top_slots(keys, cnts, chunks, length, idx_ref, k=k, page_size=page_size, interpret=interpret, ps=ps)


def _check(B, P, length_B, *, page_size: int, k: int, num_slots: int, page_size_B=None):
  if page_size < 1 or k < 1 or num_slots < 1:
    raise ValueError(f"page_size={page_size}, k={k} and num_slots={num_slots} must be >= 1")
  check_page_count(P, num_slots, page_size, row_page_sizes=page_size_B is not None)
  if P > MAX_PAGES:
    raise ValueError(f"P={P} pages is above this kernel's MAX_PAGES={MAX_PAGES}; use the XLA top-k")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  check_row_values("page_size_B", page_size_B, B)


def _call(kernel, inputs, length_B, B, K, M, interpret, num_warps, name, page_size_B=None):
  """The (B, K) grid, one program per row, over the per-row blocks of `inputs` [B, K, ...], length_B
  (clipped in the kernel) and page_size_B when given (the kernel's page_size_ref: one scalar per program);
  the output is exactly [B, K, M] (no XLA slice after)."""
  rows = [length_B.astype(jnp.int32)]
  if page_size_B is None:
    body = functools.partial(kernel, interpret=interpret)
  else:
    rows.append(page_size_B.astype(jnp.int32))

    def body(*refs):  # the row's page size is the input after length_ref, before the output
      kernel(*refs[:-2], refs[-1], interpret=interpret, page_size_ref=refs[-2])

  return pl.pallas_call(
      body,
      grid=(B, K),
      in_specs=row_blocks(inputs) + [pl.BlockSpec((None,), lambda b, h: (b,))] * len(rows),
      out_specs=pl.BlockSpec((None, None, M), lambda b, h: (b, h, 0)),
      out_shape=jax.ShapeDtypeStruct((B, K, M), jnp.int32),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=name,
  )(*inputs, *rows)


@functools.partial(jax.jit, static_argnames=["page_size", "k", "num_slots", "interpret"])
def page_topk(scores_BKP, length_B, *, page_size: int, k: int, num_slots: int, interpret: bool = False,
              page_size_B=None):
  """The top-k slots per (b, k) when every valid slot of page p scores scores_BKP[..., p].

  Args:
    scores_BKP: page scores (float32 or bfloat16); pages with no valid slot may hold anything.
    length_B: int32 valid slots per sequence (clipped to [0, num_slots], and with page_size_B to the row's
      P * ps_b).
    page_size: slots per page; num_slots: cache slots (P = ceil(num_slots / page_size), or up to
      `kt_num_pages`: pages past the slots score nothing). With page_size_B, the largest page size, and any
      P >= ceil(num_slots / page_size).
    k: tokens to select.
    page_size_B: None (every row's page size is page_size) or [B] int32, row b's page size ps_b in
      [1, page_size]: its page p holds slots [p * ps_b, (p + 1) * ps_b) (the caller keeps length_b <= P * ps_b).
      A row's idx is what it gives alone with page_size = ps_b.
  Returns:
    idx_BKM int32, M = min(k, num_slots): the min(k, length) chosen slots in ascending order, then 0s.
  """
  if scores_BKP.ndim != 3:
    raise ValueError(f"scores_BKP.shape={scores_BKP.shape} must be (B, K, P)")
  B, K, P = scores_BKP.shape
  _check(B, P, length_B, page_size=page_size, k=k, num_slots=num_slots, page_size_B=page_size_B)
  if jnp.dtype(scores_BKP.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"scores_BKP.dtype={scores_BKP.dtype} must be float32 or bfloat16")
  kernel = functools.partial(_page_topk_kernel, page_size=page_size, k=k, num_pages=P, num_slots=num_slots)
  return _call(kernel, (scores_BKP.astype(jnp.float32),), length_B, B, K, min(k, num_slots), interpret,
               4, "rocketkv_page_topk", page_size_B)


# Rows (B * K) from which `hsa_page_topk` runs one warp per row instead of two: its bisection's reductions then
# stay inside a warp. 32k, t=256, us per layer (tune_hsa, benchmarks/results/stage2_h200_2026-12-02/): 3128
# rows 1 warp 26.3, 2 32.8, 4 45.1; 864 rows 10.7 / 12.7 / 15.4; 256 rows 7.9 / 6.6 / 7.2; 64 rows 7.7 / 6.2 / 6.2.
ONE_WARP_MIN_ROWS = 512


@functools.partial(jax.jit, static_argnames=["page_size", "k", "num_slots", "sink", "recent", "interpret",
                                             "num_warps", "num_pages"])
def hsa_page_topk(s_BKGP, m_BKGN, l_BKGN, length_B, *, page_size: int, k: int, num_slots: int, sink: int = 0,
                  recent: int = 0, interpret: bool = False, num_warps: int | None = None, page_size_B=None,
                  num_pages: int | None = None):
  """`page_topk` of the HSA page scores, straight from the HSA kernel's partials (`hsa_page_partials`):
  this kernel normalises each head's softmax over all page blocks and averages the group itself, so no
  XLA op runs between scoring and selection. Same output as `page_topk`. sink, recent (>= 0): the pages
  holding the first `sink` slots and the last `recent` valid slots score FORCED_SCORE (`forced_pages`, at the
  row's page size), so they are always taken, inside k. num_warps None: 1 from ONE_WARP_MIN_ROWS rows of
  B * K, else 2.

  page_size_B: None, or each row's page size as `page_topk`'s (page_size the largest; the partials made with
  the same page_size_B). num_pages: the pages selected from, the scored KT arrays' P (pages past it are not
  read). None: ceil(num_slots / page_size), or with page_size_B all the partials' P_pad pages (those past the
  KT's hold no valid slot). With page_size_B pass the KT's P: a row of smaller pages uses pages past
  ceil(num_slots / page_size).
  """
  if not (isinstance(sink, int) and isinstance(recent, int) and sink >= 0 and recent >= 0):
    raise ValueError(f"sink={sink!r} and recent={recent!r} must be ints >= 0")
  if s_BKGP.ndim != 4 or m_BKGN.ndim != 4 or l_BKGN.shape != m_BKGN.shape or \
      s_BKGP.shape[:3] != m_BKGN.shape[:3]:
    raise ValueError(f"s_BKGP.shape={s_BKGP.shape}, m_BKGN.shape={m_BKGN.shape} and l_BKGN.shape="
                     f"{l_BKGN.shape} must be (B, K, G, P_pad), (B, K, G, NB), (B, K, G, NB)")
  B, K, G, P_pad = s_BKGP.shape
  NB = m_BKGN.shape[-1]
  P = selection_pages(P_pad, num_slots, page_size, page_size_B, num_pages)
  if not NB <= P <= P_pad:
    raise ValueError(f"pages P={P} (num_slots={num_slots}, page_size={page_size}, num_pages={num_pages}) must "
                     f"lie in [NB={NB}, P_pad={P_pad}]")
  _check(B, P, length_B, page_size=page_size, k=k, num_slots=num_slots, page_size_B=page_size_B)
  if num_warps is None:
    num_warps = 1 if B * K >= ONE_WARP_MIN_ROWS else 2
  kernel = functools.partial(hsa_page_topk_body, page_size=page_size, k=k, num_pages=P, num_slots=num_slots,
                             sink=sink, recent=recent)
  return _call(kernel, tuple(x.astype(jnp.float32) for x in (s_BKGP, m_BKGN, l_BKGN)), length_B, B, K,
               min(k, num_slots), interpret, num_warps, "rocketkv_hsa_page_topk", page_size_B)
