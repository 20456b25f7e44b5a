"""HSA page scores (RocketKV stage 2, ALGORITHM.md section 3) with a Pallas Triton kernel.

KT pages are channel-major [B, K, H, P]. The grid is (B, K, page blocks) (or (B, K, 1) with a loop over the
row's page blocks: `Tuning.split_pages`). The channels are chosen once per (b, k) row before the scoring: by the
append kernel in the decode step (`cache_append`'s choose_q), else by a small Pallas kernel (`row_channels`:
sort-free ranks from [H, RANK_CHUNK] compares, ties toward the lower channel, each chosen channel stored at its
slot; its reference in XLA is `row_channels_reference`: lax.top_k, same ties). Each scoring program gets the
group's query on the chosen channels [G, Rp], their row indices and signs, and 1 / tau, and gathers only the
chosen rows, top-r rounded up to 16 rows in power-of-two pieces ([64 + 16, block_p] at 67).

Each chosen row is read from the min or the max page summary only (by that sign): R * block_p
values per program. It writes each head's scaled page scores s/tau and a partial softmax (max,
weighted sum) over its pages (`hsa_page_partials`). `hsa_page_scores` normalises them in XLA (per head over
all pages, then the group mean); the decode path hands them to `page_topk.hsa_page_topk` instead, which
normalises and selects in one kernel.

Per-row plans: `page_size_B` and `topr_B` ([B] int32, optional) give each row its own page size (at most the
static `page_size`) and top-r (at most the static `topr`, which sets the shapes). Each program reads its row's
values as scalars; row b's page p covers slots [p * ps_b, (p + 1) * ps_b), and its channels past r_b are pads
that load nothing. A row's result is what the row gives alone with static page_size = ps_b and topr = r_b.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.checks import FLOAT_DTYPES, check_dtype, check_kt_pages, check_row_values
from rocketkv_jax.kernels.triton_util import (MASK_VALUE, MIN_DOT_DIM, cdiv, dot_precision, load_query_group,
                                              masked_scatter, next_pow2, page_slots, pow2_pieces, row_blocks,
                                              sm_count, with_absent_refs)


def _temperature(qr_GR, qf_GH):
  """tau[g] = sqrt(H * |q_g[channels]|_1 / |q_g|_1); 1 where that is not a positive number. qr holds q on
  the chosen channels (gathered, or zero elsewhere); one head's [H] rows give a scalar."""
  H = qf_GH.shape[-1]
  num = jnp.abs(qr_GR).sum(-1)
  den = jnp.abs(qf_GH).sum(-1)
  tau = jnp.sqrt(H * num / jnp.where(den > 0, den, 1.0))
  return jnp.where(tau > 0, tau, 1.0)


def hsa_page_scores_reference(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr: int, page_size: int,
                              page_size_B=None, topr_B=None, **unused_tuning):
  """Group-mean softmax page probabilities (float32); -inf for pages with no valid slot. The group's
  channels are lax.top_k of sum_g |q_g| (stable: ties toward the lower channel). page_size_B, topr_B: each
  row's page size and top-r (`hsa_page_partials`); None: page_size and topr for every row."""
  del unused_tuning
  P = kt_min_BKHP.shape[-1]

  def one(q_GH, kmin_HP, kmax_HP, length, ps, r):
    qf = q_GH.astype(jnp.float32)
    _, ch_R = lax.top_k(jnp.abs(qf).sum(0), topr)
    qr = qf[:, ch_R]  # [G, R]
    rep_max, rep_min = kmax_HP[ch_R].astype(jnp.float32), kmin_HP[ch_R].astype(jnp.float32)  # [R, P]
    if r is not None:  # the row's top-r: the ranks past it are pads, out of the scores and of tau
      rank_ok = jnp.arange(topr) < r
      qr = jnp.where(rank_ok[None, :], qr, 0.0)
      rep_max, rep_min = (jnp.where(rank_ok[:, None], x, 0.0) for x in (rep_max, rep_min))
    sigma = qr.sum(0) > 0  # [R]; zero counts as negative
    rep = jnp.where(sigma[:, None], rep_max, rep_min)  # [R, P]
    n = page_slots(length, jnp.arange(P), page_size if ps is None else ps)
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

  rows = (length_B, page_size_B, topr_B)  # per row (None: the static value, captured above)
  return jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, None, None)))(q_BKGH, kt_min_BKHP, kt_max_BKHP, *rows)


# Channels per step of `_choose_channels`' rank loop: each step compares all H channels with RANK_CHUNK of them
# ([H, RANK_CHUNK] compares), so the program holds H * RANK_CHUNK values, not H * H. With the whole [H, H] at
# once the append kernel (which makes the choice) took 214 registers per thread at 2 warps: 12.5% occupancy
# (ncu, H200, 391 x 8 rows); with 32 it takes 168. Decode step A/B in one process, 32k, t=256, ms: batch 391
# chunks of 128 17.33, 32 17.03, 16 17.89; batch 1 4.92 / 4.90 / 4.93; batch 8 5.14 / 5.09 / 5.15. Against the
# one-block code before it (17.01 at batch 391 in another process) the step is unchanged within run-to-run noise
# (benchmarks/results/stage2_h200_2026-12-02f).
RANK_CHUNK = 32


def _abs_group_sum(q_ref, cols):
  """sum_g |q_g| over the group's rows of q_ref [G, H] at columns `cols` (a pl.ds), in float32, the rows added
  in order: the same bits for a channel whichever columns are loaded with it."""
  a = jnp.abs(q_ref[0, cols].astype(jnp.float32))
  for g in range(1, q_ref.shape[0]):
    a = a + jnp.abs(q_ref[g, cols].astype(jnp.float32))
  return a


def _choose_channels(q_ref, q_GH, topr):
  """(use_max, use_min) [H] bool and a slot [H] int32 per channel: the group's top-r channels of sum_g |q_g|,
  ties toward the lower channel, split by the sign of the group's summed query (q_GH: the group's rows as
  loaded, pad rows 0; zero counts as negative). The slot is the channel's rank: the channels that beat it,
  counted RANK_CHUNK channels at a time ([H, RANK_CHUNK] compares per step of an H / RANK_CHUNK-step loop), so
  the chosen channels' slots are 0..r-1. topr: an int, or the row's top-r as a scalar (the ranks are all
  computed either way; only the cut moves)."""
  H = q_ref.shape[1]
  chunk = min(H, RANK_CHUNK)
  a_i = _abs_group_sum(q_ref, pl.ds(0, H))[:, None]  # [H, 1]
  c_i = jnp.arange(H)[:, None]

  def count(j, slot):
    j0 = j * chunk
    a_j = _abs_group_sum(q_ref, pl.ds(j0, chunk))[None, :]  # [1, chunk]
    c_j = j0 + jnp.arange(chunk)[None, :]
    beats = (a_j > a_i) | ((a_j == a_i) & (c_j < c_i))  # channel c_j ranks before channel c_i
    return slot + jnp.sum(beats.astype(jnp.int32), axis=1)

  slot = lax.fori_loop(0, H // chunk, count, jnp.zeros((H,), jnp.int32))  # a permutation of 0..H-1
  chosen = slot < topr
  use_max = chosen & (q_GH.sum(axis=0) > 0)
  return use_max, chosen & ~use_max, slot


def _chosen_rows(kt_min_ref, kt_max_ref, rows, page, use_max, use_min, page_ok, dot_dtype):
  """A tile of the chosen channels' page summaries, [len(rows), len(page)] in dot_dtype: tile row i is KT row
  rows[i] of kt_max where use_max[i], of kt_min where use_min[i], 0 where neither (a channel not chosen, a
  pad); the pages where page_ok is False are read from neither array and are 0. Every masked-off lane loads 0,
  so a row is the sum of its two loads, one of them 0: no selects. The scoring's tile. H200, decode step
  A/B in one process against the selects it replaced (32k, t=256): batch 391 16.96 -> 16.52 ms, batch 1 5.08 ->
  5.06, batch 8 5.23 -> 5.22 (benchmarks/results/stage2_h200_2026-12-02g)."""
  zero = jnp.zeros((), kt_max_ref.dtype)
  rows, cols, ok = rows[:, None], page[None, :], page_ok[None, :]
  rep_max = pltriton.load(kt_max_ref.at[rows, cols], mask=use_max[:, None] & ok, other=zero)
  rep_min = pltriton.load(kt_min_ref.at[rows, cols], mask=use_min[:, None] & ok, other=zero)
  return rep_max.astype(dot_dtype) + rep_min.astype(dot_dtype)


def _score_dot(q_GR, rep_RB, prec):
  """q . rep [G, block] with float32 accumulation (bf16 operands multiply exactly; float32 operands at full
  precision). rep must be 0 on the rows of channels not chosen; the column of an empty page may hold anything
  (junk, NaN): the dot keeps it to that page's scores, which `_block_partials` masks."""
  return jnp.dot(q_GR, rep_RB, precision=prec, preferred_element_type=jnp.float32)


def _block_partials(dot_GB, inv_tau_G, n_B, p_ok_B):
  """One page block's scaled scores s = dot / tau [G, block] (MASK_VALUE on empty pages) and its softmax
  partials: m [G] the max over the block's non-empty pages, l [G] the sum over them of n[p] * exp(s - m)."""
  s = jnp.where(p_ok_B[None, :], dot_GB * inv_tau_G[:, None], MASK_VALUE)
  m = s.max(axis=-1)
  e = jnp.where(p_ok_B[None, :], jnp.exp(s - m[:, None]), 0.0)
  return s, m, (e * n_B[None, :].astype(jnp.float32)).sum(axis=-1)


def _store_block_partials(s_ref, m_ref, l_ref, row_ok, block: int, slot, s, m, l) -> None:
  """Writes a block's (s, m, l) of the real query rows: s to columns [slot * block, +block), m and l to
  column `slot`."""
  Gp = row_ok.shape[0]
  pltriton.store(s_ref.at[pl.ds(0, Gp), pl.ds(slot * block, block)], s, mask=row_ok[:, None])
  pltriton.store(m_ref.at[pl.ds(0, Gp), slot], m, mask=row_ok)
  pltriton.store(l_ref.at[pl.ds(0, Gp), slot], l, mask=row_ok)


def choice_dot_dtype(q_dtype, kt_dtype):
  """The dtype of the scoring dot (and of the chosen query): bf16 queries against bf16 or
  float8 pages multiply exactly in a bf16 dot; anything float32: float32."""
  exact_in_bf16 = (jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16) and
                   jnp.dtype(kt_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e5m2)))
  return jnp.bfloat16 if exact_in_bf16 else jnp.float32


def chosen_slots(topr: int) -> int:
  """Rp: the slots a row's channel choice is padded to (a power of two, at least Triton's dot minimum)."""
  return max(MIN_DOT_DIM, next_pow2(topr))


def choice_shapes(B: int, K: int, G: int, topr: int, dot_dtype) -> list:
  """The channel choice's arrays (q_BKGR, ch_BKR, use_max_BKR, inv_tau_BKG) as ShapeDtypeStructs."""
  Rp = chosen_slots(topr)
  return [jax.ShapeDtypeStruct((B, K, G, Rp), dot_dtype), jax.ShapeDtypeStruct((B, K, Rp), jnp.int32),
          jax.ShapeDtypeStruct((B, K, Rp), jnp.int32), jax.ShapeDtypeStruct((B, K, G), jnp.float32)]


def row_channels_warps(rows: int) -> int:
  """The channel choice's warps at `rows` (b, k) rows: 4 below ROW_CHANNELS_TWO_WARPS_MIN_ROWS, else 2."""
  return 4 if rows < ROW_CHANNELS_TWO_WARPS_MIN_ROWS else 2


def row_channels_reference(q_BKGH, topr: int, dot_dtype, topr_B=None):
  """The scoring's per-row channel choice, once per (b, k) row, in XLA: the group's top-r channels of
  sum_g |q_g| (lax.top_k: ties toward the lower channel, as the scores' reference), in rank order, padded to
  Rp = max(16, next_pow2(topr)) entries. Returns q_BKGR (the group's query on those channels, in `dot_dtype`,
  0 on pads), ch_BKR int32 (channel index, 0 on pads), use_max_BKR int32 (1: score against kt_max, the
  group's summed query is > 0 there; 0: kt_min; -1: a pad, read from neither) and inv_tau_BKG float32
  (1 / tau per head). topr_B ([B] int32 in [1, topr], or None: topr): row b's top-r; its ranks from r_b on
  are pads, and tau is of its r_b channels."""
  qf = q_BKGH.astype(jnp.float32)
  _, ch = lax.top_k(jnp.abs(qf).sum(axis=2), topr)  # [B, K, R]
  qr = jnp.take_along_axis(qf, ch[:, :, None, :], axis=-1)  # [B, K, G, R]
  use_max = (qr.sum(axis=2) > 0).astype(jnp.int32)
  if topr_B is not None:
    rank_ok = (jnp.arange(topr)[None, :] < topr_B[:, None])[:, None, :]  # [B, 1, R]
    qr = jnp.where(rank_ok[:, :, None, :], qr, 0.0)
    ch = jnp.where(rank_ok, ch, 0)
    use_max = jnp.where(rank_ok, use_max, -1)
  inv_tau = 1.0 / _temperature(qr, qf)
  pad = chosen_slots(topr) - topr
  if pad:
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, pad)))
    ch = jnp.pad(ch, ((0, 0), (0, 0), (0, pad)))
    use_max = jnp.pad(use_max, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
  return qr.astype(dot_dtype), ch.astype(jnp.int32), use_max, inv_tau


def row_channels_body(
    q_ref,  # [G, H]
    # outputs
    q_out_ref,  # [G, Rp] the group on the chosen channels, in rank order (0 on pads)
    ch_ref,  # [Rp] int32
    use_max_ref,  # [Rp] int32 1 / 0 / -1
    inv_tau_ref,  # [G] float32
    *,
    topr: int,
    interpret: bool,
    topr_ref=None,  # [] the row's top-r (at most topr), or None: topr
):
  """The row_channels kernel's body for one (b, k) row (also run inside `cache_append`'s kernel)."""
  H = q_ref.shape[1]
  Rp = ch_ref.shape[0]
  r_b = topr if topr_ref is None else topr_ref[...]
  q_in, row_ok = load_query_group(q_ref)  # [Gp, H], pad rows 0
  Gp = row_ok.shape[0]
  q = q_in.astype(jnp.float32)
  use_max_H, use_min_H, slot = _choose_channels(q_ref, q, r_b)
  # Each chosen channel is written to its slot (< topr; the slots are distinct), the pads (>= topr) apart:
  # disjoint stores. (A one-hot [H, Rp] compaction, three reductions and a dot, was 2.5-3.5x slower on the
  # H200: 64 rows 7.39 against 2.53 us, 3128 rows 71.7 against 23.0; results/stage2_h200_2026-12-02c.)
  chosen = use_max_H | use_min_H
  r = jnp.arange(Rp, dtype=jnp.int32)
  pad = r >= r_b
  pltriton.store(ch_ref.at[pl.ds(0, Rp)], jnp.zeros((Rp,), jnp.int32), mask=pad)
  pltriton.store(use_max_ref.at[pl.ds(0, Rp)], jnp.full((Rp,), -1, jnp.int32), mask=pad)
  masked_scatter(ch_ref, slot, jnp.arange(H, dtype=jnp.int32), chosen, interpret=interpret)
  masked_scatter(use_max_ref, slot, jnp.where(use_max_H, 1, 0).astype(jnp.int32), chosen, interpret=interpret)
  pltriton.store(q_out_ref.at[pl.ds(0, Gp), pl.ds(0, Rp)], jnp.zeros((Gp, Rp), q_out_ref.dtype),
                 mask=row_ok[:, None] & pad[None, :])
  masked_scatter(q_out_ref, (jnp.arange(Gp)[:, None], slot[None, :]), q_in.astype(q_out_ref.dtype),
                 row_ok[:, None] & chosen[None, :], interpret=interpret)
  inv_tau = 1.0 / _temperature(jnp.where(chosen[None, :], q, 0.0), q)
  pltriton.store(inv_tau_ref.at[pl.ds(0, Gp)], inv_tau, mask=row_ok)


@functools.partial(jax.jit, static_argnames=["topr", "dot_dtype", "interpret", "num_warps"])
def row_channels(q_BKGH, topr: int, dot_dtype, *, interpret: bool = False, num_warps: int | None = None,
                 topr_B=None):
  """`row_channels_reference` as one small Pallas kernel, a program per (b, k) row: sort-free ranks
  (`_choose_channels`), each chosen channel stored at its slot. The same outputs (inv_tau up to float32 summation
  order); replaces lax.top_k's sort and the XLA gathers, pads and reductions around it (faster at every row
  count timed: see ROW_CHANNELS_TWO_WARPS_MIN_ROWS). num_warps None: `row_channels_warps`. topr_B: as the
  reference's (each program loads its row's value)."""
  B, K, G, H = q_BKGH.shape
  check_row_values("topr_B", topr_B, B)
  if num_warps is None:
    num_warps = row_channels_warps(B * K)
  shapes = choice_shapes(B, K, G, topr, dot_dtype)
  inputs, in_specs = [q_BKGH], row_blocks([q_BKGH])
  if topr_B is not None:
    inputs.append(topr_B.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((None,), lambda b, k: (b,)))

  def body(q_ref, *refs):
    topr_ref, outs = (refs[0], refs[1:]) if topr_B is not None else (None, refs)
    row_channels_body(q_ref, *outs, topr=topr, interpret=interpret, topr_ref=topr_ref)

  return tuple(pl.pallas_call(
      body,
      grid=(B, K),
      in_specs=in_specs,
      out_specs=row_blocks(shapes),
      out_shape=shapes,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rocketkv_hsa_row_channels",
  )(*inputs))


def check_choice(choice, B: int, K: int, G: int, topr: int, dot_dtype) -> None:
  """Checks a channel choice (q_BKGR, ch_BKR, use_max_BKR, inv_tau_BKG) against the shapes it is used with."""
  want = [(x.shape, jnp.dtype(x.dtype)) for x in choice_shapes(B, K, G, topr, dot_dtype)]
  got = [(tuple(x.shape), jnp.dtype(x.dtype)) for x in choice]
  if got != want:
    raise ValueError(f"choice shapes/dtypes {got} must be {want} (row_channels' outputs for topr={topr})")


def _hsa_scores_gather_kernel(
    # inputs
    q_ref,  # [G, Rp] the group's query on the chosen channels (0 on pads), in the dot dtype
    ch_ref,  # [Rp] int32 chosen channel rows
    use_max_ref,  # [Rp] int32 1: the row's kt_max, 0: its kt_min, -1: a pad row (not read)
    inv_tau_ref,  # [G] float32
    kt_min_ref,  # [H, P]
    kt_max_ref,  # [H, P]
    length_ref,  # []
    page_size_ref,  # [] the row's page size, or None: page_size (its top-r is in the choice: pads past it)
    # outputs
    s_ref,  # [G, blocks_per_program * block_p] float32: s/tau of each head, MASK_VALUE on empty pages
    m_ref,  # [G, blocks_per_program] float32: per page block, max of s/tau over its non-empty pages
    l_ref,  # [G, blocks_per_program] float32: per page block, sum over those of n[p] * exp(s/tau - m)
    *,
    block_p: int,
    blocks_per_program: int,
    page_size: int,
    num_pages: int,
    pieces: tuple,
    dot_dtype,
):
  # The chosen slots as power-of-two pieces of the top-r rounded up to 16 (67 -> 64 + 16), not all Rp slots
  # (67 -> 128): one [size, block_p] tile and dot per piece, the dots summed. H200, decode step A/B in one
  # process against the Rp-row tile (block_p 32 both): 64k t=256 (top-r 65) batch 418 19.16 -> 18.80 ms,
  # batch 8 5.08 / 5.09; 32k t=1024 (top-r 67) batch 32 8.20 -> 8.02 (results/stage2_h200_2026-12-02h).
  per_piece = []
  for start, size in pieces:
    cols = pl.ds(start, size)
    q, row_ok = load_query_group(q_ref, cols)  # [Gp, size], pad rows 0
    use = use_max_ref[cols]
    per_piece.append((q, ch_ref[cols], use > 0, use == 0))
  inv_tau = pltriton.load(inv_tau_ref.at[pl.ds(0, row_ok.shape[0])], mask=row_ok, other=1.0)
  ps = page_size if page_size_ref is None else page_size_ref[...]
  length = jnp.clip(length_ref[...], 0, num_pages * ps)
  first_block = pl.program_id(2) * blocks_per_program
  prec = dot_precision(dot_dtype)

  def page_block(i, carry):
    p0 = (first_block + i) * block_p
    page = p0 + jnp.arange(block_p)
    n = page_slots(length, page, ps)
    p_ok = (n > 0) & (page < num_pages)
    # Only the chosen rows are addressed (a gather of whole row segments), each from kt_min or kt_max, every
    # page inside the array (junk pages too, see below): a mask constant along the pages, so that Triton
    # vectorises the loads when a KT row is a multiple of 16 bytes (`kt_num_pages` pads every cache's rows so).
    # H200, 391 x 8 rows: 544 pages about 2x faster than masking the loads to the valid pages; at 539 pages
    # (odd stride) 25-30% slower (results/stage2_h200_2026-12-02; the valid-pages mask was removed in issue 38).
    # The pages past the length inside the array are loaded, junk and all: the dot keeps each page's column
    # to itself, and `_block_partials` masks the score of every such page.
    ld_ok = page < num_pages
    dot = None
    for q, ch, use_max, use_min in per_piece:
      rep = _chosen_rows(kt_min_ref, kt_max_ref, ch, page, use_max, use_min, ld_ok, dot_dtype)
      piece_dot = _score_dot(q, rep, prec)
      dot = piece_dot if dot is None else dot + piece_dot
    _store_block_partials(s_ref, m_ref, l_ref, row_ok, block_p, i, *_block_partials(dot, inv_tau, n, p_ok))
    return carry

  lax.fori_loop(0, blocks_per_program, page_block, 0)


# Rows (B * K) from which the scoring runs one program per row rather than one per page block. H200, 32k
# context, t=256 (K=8), us per layer: B=108 78 (page blocks) / 84 (rows), B=391 251 / 223 (stage2_h200_2026-12-01);
# rechecked with the vectorised loads and the pieces, decode step A/B (results/stage2_h200_2026-12-02h): rows /
# page blocks, 32k batch 391 16.38 / 17.14 ms, 128k batch 489 19.23 / 20.85 ms. (The in-kernel "rank" layout for
# fewer than 16 rows, unused since the decode step's choice is made by the append kernel, was removed in issue 38:
# B=1 rank 5.35 us against 4.77 for a separate choice kernel plus this one, results/stage2_h200_2026-12-02c/.)
GATHER_ROW_PROGRAMS_MIN_ROWS = 2048
# (num_warps, num_stages) of the scoring, one program per row / per page block. 32k, t=256,
# 544 pages, vectorised loads, us per layer (tune_hsa, benchmarks/results/stage2_h200_2026-12-02/): rows at
# 391 x 8: 2 warps 2 stages 103, 2/1 114, 4/2 113, 4/1 125; page blocks at 108 x 8: 2/1 33.6, 4/1 35.5; at
# 32 x 8: 2/1 9.6, 4/1 10.3.
ROW_PROGRAM_WARPS_STAGES = (2, 2)
PAGE_BLOCK_WARPS_STAGES = (2, 1)
# The channel choice outside the decode step is the row_channels kernel at every row count: against XLA's top_k and its
# glue (`row_channels_reference`), us per layer (tune_hsa, results/stage2_h200_2026-12-02c): 864 rows kernel
# 8.6-9.5, XLA 17.0 (top_k 4.6, the rest gathers and pads; whole scoring 43.5 vs 51.4); 3128 rows kernel 23.0
# (2 warps; 27.7 at 4), XLA 29.4 (top_k 12.0; whole scoring with the kernel at 4 warps 129.5 vs 132.2).
# row_channels' warps: 4 below ROW_CHANNELS_TWO_WARPS_MIN_ROWS rows of B * K, 2 from there (scatter, us:
# 64 rows 4 warps 2.53, 2 warps 4.00; 256 rows 3.58 / 4.34; 864 rows 8.79 / 8.56; 3128 rows 27.0 / 23.0).
ROW_CHANNELS_TWO_WARPS_MIN_ROWS = 512
# Elements of a scoring program's [largest piece, block_p] tile: block_p = 64 when the top-r rounds to
# 64 rows or to 64 + 16. H200, decode step A/Bs in one process, ms (results/stage2_h200_2026-12-02h), the
# pieces on throughout: 32k t=256 (one piece of 64), tile of 2048 / 4096 / 8192 elements (block_p 32 / 64 /
# 128): batch 391 17.05 / 16.39-16.46 / 16.87, batch 8 5.12 / 5.11-5.16 / 5.18; 64k t=256 (64 + 16), block_p 32 /
# 64: batch 418 18.75-18.81 / 17.98-18.01 (64 then came from the 4096 elements / the largest piece, 32 from the
# 128 padded slots); 32k t=1024 (64 + 16) batch 32, block_p 32 / 64: 8.01 / 7.64.
_GATHER_TILE_ELEMS = 4096


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The scoring kernel's launch parameters; a field left None is `pick_tuning`'s."""
  block_p: int | None = None  # pages per block (a power of two >= 16)
  split_pages: bool | None = None  # one program per page block (True), or one per row walking its blocks
  num_warps: int | None = None
  num_stages: int | None = None


def pick_tuning(B: int, K: int, P: int, topr: int, given: Tuning | None = None) -> Tuning:
  """The launch parameters at this shape on this device, the fields `given` sets kept: one program per row from
  GATHER_ROW_PROGRAMS_MIN_ROWS rows of B * K, per page block below; block_p for enough page blocks to fill the
  device (about 2 programs per SM, `sm_count`), between 32 pages and a tile of _GATHER_TILE_ELEMS elements of
  the largest piece of the chosen rows; the warps and stages of ROW_PROGRAM_WARPS_STAGES /
  PAGE_BLOCK_WARPS_STAGES."""
  given = given or Tuning()
  split_pages = B * K < GATHER_ROW_PROGRAMS_MIN_ROWS if given.split_pages is None else given.split_pages
  block_p = given.block_p
  if block_p is None:
    want = cdiv(P, max(1, cdiv(2 * sm_count(), B * K)))
    largest_piece = pow2_pieces(topr, MIN_DOT_DIM)[0][1]
    block_p = min(max(32, _GATHER_TILE_ELEMS // largest_piece), max(32, next_pow2(want)))
  warps, stages = PAGE_BLOCK_WARPS_STAGES if split_pages else ROW_PROGRAM_WARPS_STAGES
  return Tuning(block_p=block_p, split_pages=split_pages,
                num_warps=warps if given.num_warps is None else given.num_warps,
                num_stages=stages if given.num_stages is None else given.num_stages)


@functools.partial(jax.jit, static_argnames=["topr", "page_size", "interpret", "tuning"])
def hsa_page_partials(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr: int, page_size: int,
                      interpret: bool = False, tuning: Tuning | None = None, choice=None, page_size_B=None,
                      topr_B=None):
  """The HSA kernel's per-page-block partials of each head's softmax over the valid slots: what
  `hsa_page_scores` normalises in XLA and `page_topk.hsa_page_topk` selects from directly.

  Args:
    q_BKGH: queries (bf16 or f32), the new token already appended to the cache.
    kt_min_BKHP, kt_max_BKHP: per-page element-wise key min / max, channel-major, P pages (a cache holds
      `checks.kt_num_pages`: ceil(S / page_size) rounded up to 16, so that the loads vectorise), dtype f32, bf16
      or float8_e5m2 (upcast to f32). Pages with no valid slot may hold junk.
    length_B: int32 valid slots per sequence (clipped to the P pages' slots).
    topr: channels scored, the group's top-r of sum_g |q_g| (ties toward the lower channel), in [1, H]; with
      topr_B, the largest (it sets the shapes).
    page_size: slots per page; with page_size_B, the largest.
    page_size_B: None (every row's page size is page_size) or [B] int32, row b's page size ps_b in
      [1, page_size]: its page p covers slots [p * ps_b, (p + 1) * ps_b), so a row of smaller pages uses more
      of the P pages (the caller keeps length_b <= P * ps_b).
    topr_B: None (every row scores topr channels) or [B] int32, row b's top-r r_b in [1, topr]: its channels
      ranked r_b and later are not read, nor in tau. With a choice given, the choice holds it (made with the
      same topr_B) and topr_B is not used here.
    A row's outputs are what the row gives alone with page_size = ps_b and topr = r_b, at the same P.
    tuning: launch parameters (`Tuning`); None, or its None fields: `pick_tuning`'s.
    choice: the per-row channel choice, already made (`row_channels`' four outputs, e.g. by `cache_append`'s
      kernel in the decode step); None: the `row_channels` kernel makes it first.
  Returns:
    s_BKGP float32 [B, K, G, P_pad]: each head's s/tau per page (MASK_VALUE on empty pages, P_pad the
      pages rounded up to whole blocks); m_BKGN, l_BKGN [B, K, G, num_blocks]: per page block, the max of
      s/tau over its non-empty pages and the sum of n[p] * exp(s/tau - max).
  """
  if q_BKGH.ndim != 4:
    raise ValueError(f"q_BKGH.shape={q_BKGH.shape} must be 4-D")
  B, K, G, H = q_BKGH.shape
  if check_kt_pages(kt_min_BKHP, kt_max_BKHP)[:3] != (B, K, H):
    raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} must be (B, K, H, P) = ({B}, {K}, {H}, P)")
  P = kt_min_BKHP.shape[-1]
  if not 1 <= topr <= H:
    raise ValueError(f"topr={topr} must be in [1, H={H}]")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  if page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1")
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  check_row_values("page_size_B", page_size_B, B)
  check_row_values("topr_B", topr_B, B)
  Rp = chosen_slots(topr)
  pieces = pow2_pieces(topr, MIN_DOT_DIM)  # (start, rows) of each tile, largest first
  tuning = pick_tuning(B, K, P, topr, tuning)
  block_p = tuning.block_p
  if block_p < MIN_DOT_DIM or block_p & (block_p - 1):
    raise ValueError(f"block_p={block_p} must be a power of two >= {MIN_DOT_DIM}")
  num_blocks = cdiv(P, block_p)
  P_pad = num_blocks * block_p
  bpp = 1 if tuning.split_pages else num_blocks
  dot_dtype = choice_dot_dtype(q_BKGH.dtype, kt_min_BKHP.dtype)
  kt_spec = pl.BlockSpec((None, None, H, P), lambda b, k, j: (b, k, 0, 0))
  length_spec = pl.BlockSpec((None,), lambda b, k, j: (b,))  # also the row's page size: one scalar per program
  if choice is None:
    choice = row_channels(q_BKGH, topr, dot_dtype, interpret=interpret, topr_B=topr_B)
  check_choice(choice, B, K, G, topr, dot_dtype)
  q_BKGR, ch_BKR, use_max_BKR, inv_tau_BKG = choice
  kernel = functools.partial(_hsa_scores_gather_kernel, block_p=block_p, blocks_per_program=bpp, pieces=pieces,
                             page_size=page_size, num_pages=P, dot_dtype=dot_dtype)
  rows = [] if page_size_B is None else [page_size_B.astype(jnp.int32)]  # topr_B is in the choice
  return pl.pallas_call(
      with_absent_refs(kernel, [True] * 7 + [page_size_B is not None] + [True] * 3),
      grid=(B, K, num_blocks // bpp),
      in_specs=[
          pl.BlockSpec((None, None, G, Rp), lambda b, k, j: (b, k, 0, 0)),
          pl.BlockSpec((None, None, Rp), lambda b, k, j: (b, k, 0)),
          pl.BlockSpec((None, None, Rp), lambda b, k, j: (b, k, 0)),
          pl.BlockSpec((None, None, G), lambda b, k, j: (b, k, 0)),
          kt_spec, kt_spec, length_spec,
      ] + [length_spec] * len(rows),
      out_specs=[
          pl.BlockSpec((None, None, G, bpp * block_p), lambda b, k, j: (b, k, 0, j)),
          pl.BlockSpec((None, None, G, bpp), lambda b, k, j: (b, k, 0, j)),
          pl.BlockSpec((None, None, G, bpp), lambda b, k, j: (b, k, 0, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((B, K, G, P_pad), jnp.float32),
          jax.ShapeDtypeStruct((B, K, G, num_blocks), jnp.float32),
          jax.ShapeDtypeStruct((B, K, G, num_blocks), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
      interpret=interpret,
      name="rocketkv_hsa_scores_gather",
  )(q_BKGR, ch_BKR, use_max_BKR, inv_tau_BKG, kt_min_BKHP, kt_max_BKHP, length_B.astype(jnp.int32), *rows)


def normalize_partials(s_BKGP, m_BKGN, l_BKGN, length_B, *, page_size: int, page_size_B=None):
  """The scores of `hsa_page_scores` from its kernel's partials: each head's softmax normaliser over all
  page blocks, then the group mean; -inf on pages with no valid slot. page_size_B: each row's page size, or
  None: page_size."""
  P = s_BKGP.shape[-1]
  m_BKG = m_BKGN.max(axis=-1)
  l_BKG = (l_BKGN * jnp.exp(m_BKGN - m_BKG[..., None])).sum(axis=-1)
  inv_l = jnp.where(l_BKG > 0, 1.0 / jnp.where(l_BKG > 0, l_BKG, 1.0), 0.0)
  prob_BKGP = jnp.exp(s_BKGP - m_BKG[..., None]) * inv_l[..., None]
  ps = page_size if page_size_B is None else page_size_B[:, None]
  n_BP = page_slots(length_B[:, None], jnp.arange(P)[None, :], ps)
  return jnp.where(n_BP[:, None, :] > 0, prob_BKGP.mean(axis=2), -jnp.inf)


def hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr: int, page_size: int, page_size_B=None,
                    topr_B=None, **kw):
  """HSA group page scores [B, K, P] float32: mean over the group of each head's softmax over valid
  slots; a probability per page (each of the page's n[p] valid slots gets it; sum_p n[p] * scores[p]
  == 1), -inf on pages with no valid slot. Arguments as `hsa_page_partials` (kw: interpret, tuning, choice)."""
  P = kt_min_BKHP.shape[-1]
  s, m, l = hsa_page_partials(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr, page_size=page_size,
                              page_size_B=page_size_B, topr_B=topr_B, **kw)
  if page_size_B is not None:
    page_size_B = page_size_B.astype(jnp.int32)
  length = jnp.clip(length_B.astype(jnp.int32), 0, P * (page_size if page_size_B is None else page_size_B))
  return normalize_partials(s[..., :P], m, l, length, page_size=page_size, page_size_B=page_size_B)
