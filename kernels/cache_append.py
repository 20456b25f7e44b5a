"""Appends one decode token to a KV cache in one launch: the K and V rows, and (methods with KT pages) the
fold of the new key into its min/max page (ALGORITHM.md section 3).

Row slot[b, k] of k[b, k] / v[b, k] becomes k_new[b, k] / v_new[b, k]. With KT pages (channel-major
[B, K, H, P]), page p = slot // page_size: when slot % page_size == 0 the page starts fresh (min = max =
k_new), otherwise min/max take the element-wise min/max with k_new. One program per (b, k) writes one K row
and one V row, and the values of one page column of kt_min and kt_max that change, in place
(input_output_aliases), so nothing else of the cache moves. The page's old min/max come from its K rows
before the slot (contiguous), or from the KT column itself (`resolve_kt_update`). This replaces two XLA scatters and a
separate KT kernel, three launch-bound launches per layer on the H200, by one. Given the step's query and top_r
(`choose_q`, `topr`), each program also makes HSA's channel choice for its row (`hsa_scores.row_channels_body`):
the stage-2 scoring's choice kernel folded into this launch.

Per-row plans (`page_size_B`, `topr_B`: [B] int32, optional): row b's pages hold ps_b slots (at most the static
page_size, the loop bound of the "rows" rebuild) and its choice takes r_b channels (at most the static topr,
which sets the choice's shapes); each program reads its row's values as scalars.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.checks import (FLOAT_DTYPES, check_dtype, check_kt_pages, check_kv_scales, check_row_values,
                                         kt_num_pages)
from rocketkv_jax.kernels.hsa_scores import (choice_dot_dtype, choice_shapes, row_channels_body,
                                             row_channels_reference, row_channels_warps)
from rocketkv_jax.kernels.kv_quant import is_quantized, quantize
from rocketkv_jax.kernels.triton_util import next_pow2, row_blocks


def cache_append_reference(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP=None, kt_max_BKHP=None,
                           *, page_size: int = 1, kt_update: str = "auto", choose_q=None, topr: int = 0,
                           page_size_B=None, topr_B=None, k_scale_BK=None, v_scale_BK=None, **unused_tuning):
  """(k, v) with the new token at slot_BK ([B, K], or [B]: one slot for every KV head), plus (kt_min, kt_max)
  with its page updated when KT pages are given, plus `append_choice(choose_q, topr, kt dtype, topr_B)` when
  `choose_q` is given. A slot outside [0, S) changes nothing. page_size_B: see `cache_append`. kt_update: how the
  page's old min/max is taken, "fold", "rows" or "auto" (`resolve_kt_update`: the kernel's rule); the two agree
  on pages that hold their rows' min/max (`cache_append`). k_scale_BK, v_scale_BK: an FP8 cache's scales; the
  new rows are stored as `kv_quant.quantize` gives them, the KT pages fold the full-precision key."""
  del unused_tuning
  return (_append_reference(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP,
                            page_size=page_size, kt_update=kt_update, page_size_B=page_size_B,
                            k_scale_BK=k_scale_BK, v_scale_BK=v_scale_BK) +
          append_choice(choose_q, topr, kt_min_BKHP, topr_B))


def append_choice(choose_q, topr: int, kt_min_BKHP, topr_B=None) -> tuple:
  """HSA's channel choice of the step's query q [B, K, G, H] (`hsa_scores.row_channels_reference`, in the dot
  dtype of q against the KT pages' dtype; topr_B: each row's top-r, or None: topr); () for choose_q None."""
  if choose_q is None:
    return ()
  return row_channels_reference(choose_q, topr, choice_dot_dtype(choose_q.dtype, kt_min_BKHP.dtype), topr_B)


def stored_row(x_new_BKH, scale_BK, dtype):
  """The new K or V row as a cache of `dtype` holds it: quantized at its head's scale (FP8, scale_BK [B, K]) or
  cast (scale_BK None)."""
  if scale_BK is None:
    return x_new_BKH.astype(dtype)
  return quantize(x_new_BKH, scale_BK[..., None], dtype)


def _append_reference(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP, *, page_size,
                      kt_update, page_size_B=None, k_scale_BK=None, v_scale_BK=None):
  kt_update = resolve_kt_update(kt_update, k_BKSH, k_new_BKH, page_size)
  # [B, 1] against the [B, K] slots: each row's page size (a page past its P pages matches no page below)
  ps = page_size if page_size_B is None else page_size_B.astype(jnp.int32)[:, None]
  S = k_BKSH.shape[2]
  slot_BK = jnp.broadcast_to(slot_BK[:, None], k_BKSH.shape[:2]) if slot_BK.ndim == 1 else slot_BK
  in_range_BK = (slot_BK >= 0) & (slot_BK < S)
  at_BKS = (jnp.arange(S)[None, None, :] == slot_BK[..., None]) & in_range_BK[..., None]
  at_BKSH = at_BKS[..., None]
  k = jnp.where(at_BKSH, stored_row(k_new_BKH, k_scale_BK, k_BKSH.dtype)[:, :, None, :], k_BKSH)
  v = jnp.where(at_BKSH, stored_row(v_new_BKH, v_scale_BK, v_BKSH.dtype)[:, :, None, :], v_BKSH)
  if kt_min_BKHP is None and kt_max_BKHP is None:
    return k, v
  P = kt_min_BKHP.shape[-1]
  at_BKP = (jnp.arange(P)[None, None, :] == (slot_BK // ps)[..., None]) & in_range_BK[..., None]
  fresh = ((slot_BK % ps) == 0)[..., None, None]
  at = at_BKP[:, :, None, :]
  if kt_update == "fold":
    kf = k_new_BKH.astype(jnp.float32)[..., None]  # [B, K, H, 1]
    new_min = jnp.where(fresh, kf, jnp.minimum(kt_min_BKHP.astype(jnp.float32), kf))
    new_max = jnp.where(fresh, kf, jnp.maximum(kt_max_BKHP.astype(jnp.float32), kf))
    return (k, v, jnp.where(at, new_min.astype(kt_min_BKHP.dtype), kt_min_BKHP),
            jnp.where(at, new_max.astype(kt_max_BKHP.dtype), kt_max_BKHP))
  # "rows": the page's rows up to the slot, as the cache now holds them; a value is stored where it differs
  # from the min/max of the rows before the slot (which the page holds already, when it is consistent)
  s = jnp.arange(S)[None, None, :, None]
  start = (slot_BK // ps * ps)[..., None, None]
  kc = k.astype(jnp.float32)
  kt = []
  for old_BKHP, fill, reduce in ((kt_min_BKHP, jnp.inf, jnp.min), (kt_max_BKHP, -jnp.inf, jnp.max)):
    before = reduce(jnp.where((s >= start) & (s < slot_BK[..., None, None]), kc, fill), axis=2)[..., None]
    new = reduce(jnp.where((s >= start) & (s <= slot_BK[..., None, None]), kc, fill), axis=2)[..., None]
    new, before = new.astype(old_BKHP.dtype), before.astype(old_BKHP.dtype)
    changed = fresh | (new.astype(jnp.float32) != before.astype(jnp.float32))  # [B, K, H, 1]
    kt.append(jnp.where(at & changed, new, old_BKHP))
  return (k, v, *kt)


# The largest page for which the kernel (kt_update "auto") rebuilds the page from its K rows: the program holds
# next_pow2(page_size) rows of H channels in registers (one warp), so above this the column fold is taken.
# Quest's pages are far larger (2 * S / t slots: 257 at 32k and t=256), and with "rows" for every page size
# its 32k decode step went from 5.17 ms to 9.60 ms on the H200 (benchmarks/results/stage2_h200_2026-12-02d/);
# with this bound it is 4.84 ms (batch 1; stage2_h200_2026-12-02e/).
ROWS_MAX_PAGE_SIZE = 16


def resolve_kt_update(kt_update: str, k_BKSH, k_new_BKH, page_size: int) -> str:
  """"auto": "rows" when k_new has the cache's dtype (then equal to "fold") and page_size is at most
  ROWS_MAX_PAGE_SIZE, else "fold". An FP8 cache is always "fold": its pages hold the full-precision keys' min/max,
  which its K rows no longer do."""
  if kt_update == "rows" and is_quantized(k_BKSH.dtype):
    raise ValueError(f"kt_update='rows' rebuilds pages from the K rows, but the cache is {k_BKSH.dtype}: use 'fold'")
  if kt_update == "auto":
    same = jnp.dtype(k_new_BKH.dtype) == jnp.dtype(k_BKSH.dtype)
    return "rows" if same and page_size <= ROWS_MAX_PAGE_SIZE else "fold"
  if kt_update not in ("fold", "rows"):
    raise ValueError(f"kt_update={kt_update!r} must be 'fold', 'rows' or 'auto'")
  return kt_update


def _cache_append_kernel(
    # inputs
    k_ref,  # [S, H] (aliased to k_out_ref)
    v_ref,  # [S, H] (aliased to v_out_ref)
    k_new_ref,  # [H]
    v_new_ref,  # [H]
    slot_ref,  # []
    kt_min_ref,  # [H, P] (aliased to kt_min_out_ref), or None
    kt_max_ref,  # [H, P] (aliased to kt_max_out_ref), or None
    q_ref,  # [G, H] the step's query (the channel choice), or None
    page_size_ref,  # [] the row's page size, or None: page_size
    topr_ref,  # [] the row's top-r (the choice's), or None: topr
    k_scale_ref,  # [] float32 the head's key scale (an FP8 cache), or None
    v_scale_ref,  # [] float32, or None
    # outputs
    k_out_ref,  # [S, H]
    v_out_ref,  # [S, H]
    kt_min_out_ref,  # [H, P], or None
    kt_max_out_ref,  # [H, P], or None
    q_out_ref,  # [G, Rp] the choice (`hsa_scores.row_channels_body`), or None
    ch_ref,  # [Rp], or None
    use_max_ref,  # [Rp], or None
    inv_tau_ref,  # [G], or None
    *,
    page_size: int,
    kt_update: str,
    topr: int,
    interpret: bool,
):
  S, H = k_ref.shape
  slot = slot_ref[...]
  # Out of range: every store below is masked off, so nothing changes. All loads come first: the stores
  # wait on nothing but them, so one memory round trip is exposed, not one per array.
  in_range = (slot >= 0) & (slot < S)
  row = jnp.clip(slot, 0, S - 1)
  chans = jnp.arange(H)
  write = jnp.zeros((H,), jnp.bool_) | in_range
  rows = jnp.zeros((H,), jnp.int32) + row
  k_new = k_new_ref[...]
  v_new = v_new_ref[...]
  if kt_min_ref is not None:
    # The page's min/max before this token, in float32 (an f8/bf16 page value round-trips it exactly): +inf /
    # -inf on a page that starts at this slot, so the fold below gives k_new there.
    write_kt = write
    if page_size_ref is None:
      ps = page_size
      page = row // page_size  # < P, as P >= cdiv(S, page_size)
    else:  # one division per program, of the row's page size
      ps = page_size_ref[...]
      P = kt_min_ref.shape[1]
      page = row // ps
      write_kt = write & (page < P)  # a slot past the row's P * ps slots has no page: K/V only
      page = jnp.minimum(page, P - 1)
    fresh = (slot % ps) == 0
    cols = jnp.zeros((H,), jnp.int32) + page
    if kt_update == "rows":  # the page's rows before the slot (contiguous), not the strided KT column
      # To the static page_size; j < ps holds wherever `before` does (the slot is inside the row's page).
      j = jnp.arange(max(2, next_pow2(page_size)))
      before = page * ps + j < row
      prev = pltriton.load(k_ref.at[jnp.minimum(page * ps + j, S - 1)[:, None], chans[None, :]],
                           mask=before[:, None])
      prev = prev.astype(jnp.float32)
      old_min = jnp.min(jnp.where(before[:, None], prev, jnp.inf), axis=0)
      old_max = jnp.max(jnp.where(before[:, None], prev, -jnp.inf), axis=0)
    else:
      old_min = jnp.where(fresh, jnp.inf, kt_min_ref[chans, cols].astype(jnp.float32))
      old_max = jnp.where(fresh, -jnp.inf, kt_max_ref[chans, cols].astype(jnp.float32))
  k_row = stored_row(k_new, None if k_scale_ref is None else k_scale_ref[...], k_out_ref.dtype)
  v_row = stored_row(v_new, None if v_scale_ref is None else v_scale_ref[...], v_out_ref.dtype)
  pltriton.store(k_out_ref.at[rows, chans], k_row, mask=write)
  pltriton.store(v_out_ref.at[rows, chans], v_row, mask=write)
  if q_ref is not None:
    row_channels_body(q_ref, q_out_ref, ch_ref, use_max_ref, inv_tau_ref, topr=topr, interpret=interpret,
                      topr_ref=topr_ref)
  if kt_min_ref is None:
    return
  # "rows": the key as the cache holds it (with the rows above, the page's min/max over its stored keys)
  k = k_new.astype(k_out_ref.dtype if kt_update == "rows" else jnp.float32).astype(jnp.float32)
  # Only the values that change are stored (a page's first slot stores all): each value is its own write
  # transaction (a sector of the channel-major row). On a 3-slot page of random keys that is 2, 1 and 2/3 of
  # each channel's two values at its three slots. H200, 32k, t=256, decode step A/B in one process: batch 391
  # 17.53 -> 17.01 ms, batch 8 5.22 -> 5.18 (benchmarks/results/stage2_h200_2026-12-02f).
  for old, new, out_ref in ((old_min, jnp.minimum(old_min, k), kt_min_out_ref),
                            (old_max, jnp.maximum(old_max, k), kt_max_out_ref)):
    new, old = new.astype(out_ref.dtype), old.astype(out_ref.dtype)
    changed = fresh | (new.astype(jnp.float32) != old.astype(jnp.float32))
    pltriton.store(out_ref.at[chans, cols], new, mask=write_kt & changed)


def _check_args(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP, page_size, choose_q=None,
                topr=0, page_size_B=None, topr_B=None, k_scale_BK=None, v_scale_BK=None):
  if k_BKSH.ndim != 4 or v_BKSH.shape != k_BKSH.shape:
    raise ValueError(f"k_BKSH.shape={k_BKSH.shape} and v_BKSH.shape={v_BKSH.shape} must be equal (B, K, S, H)")
  B, K, S, H = k_BKSH.shape
  if H & (H - 1):
    raise ValueError(f"head dim H={H} must be a power of two (64 or 128 supported)")
  if S < 1:
    raise ValueError(f"cache slots S={S} must be >= 1")
  if not check_kv_scales(k_BKSH, v_BKSH, k_scale_BK, v_scale_BK):
    check_dtype("k_BKSH", k_BKSH.dtype, FLOAT_DTYPES)
    check_dtype("v_BKSH", v_BKSH.dtype, FLOAT_DTYPES)
  for name, x in (("k_new_BKH", k_new_BKH), ("v_new_BKH", v_new_BKH)):
    if x.shape != (B, K, H):
      raise ValueError(f"{name}.shape={x.shape} must be ({B}, {K}, {H})")
    check_dtype(name, x.dtype, FLOAT_DTYPES)
  if slot_BK.shape not in ((B, K), (B,)):
    raise ValueError(f"slot_BK.shape={slot_BK.shape} must be ({B}, {K}) or ({B},)")
  if not jnp.issubdtype(slot_BK.dtype, jnp.integer):
    raise ValueError(f"slot_BK.dtype={slot_BK.dtype} must be an integer dtype")
  if page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1")
  if (kt_min_BKHP is None) != (kt_max_BKHP is None):
    raise ValueError("kt_min_BKHP and kt_max_BKHP must be given together (or neither)")
  check_row_values("page_size_B", page_size_B, B)
  check_row_values("topr_B", topr_B, B)
  if kt_min_BKHP is not None:
    pages = check_kt_pages(kt_min_BKHP, kt_max_BKHP)
    want = (B, K, H, kt_num_pages(S, page_size))
    if page_size_B is not None:  # rows of smaller pages use more of them: any P that covers S at page_size
      if pages[:3] != want[:3] or pages[3] < -(-S // page_size):
        raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} must be ({B}, {K}, {H}, P) with P >= "
                         f"ceil(S={S} / page_size={page_size}) (page_size: the largest page size of any row)")
    elif pages != want:
      raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} must be {want}: the pages of S={S} slots "
                       f"at page_size={page_size} (kt_num_pages)")
  if choose_q is not None:
    if kt_min_BKHP is None:
      raise ValueError("choose_q needs the KT pages (the choice's dot dtype is the query's against theirs)")
    if choose_q.ndim != 4 or choose_q.shape[:2] != (B, K) or choose_q.shape[3] != H:
      raise ValueError(f"choose_q.shape={choose_q.shape} must be ({B}, {K}, G, {H})")
    check_dtype("choose_q", choose_q.dtype, FLOAT_DTYPES)
    if not (isinstance(topr, int) and 1 <= topr <= H):
      raise ValueError(f"topr={topr!r} must be an int in [1, H={H}] with choose_q")


@functools.partial(jax.jit, static_argnames=["page_size", "interpret", "num_warps", "topr"])
def cache_append(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP=None, kt_max_BKHP=None, *,
                 page_size: int = 1, interpret: bool = False, num_warps: int | None = None, choose_q=None,
                 topr: int = 0, page_size_B=None, topr_B=None, k_scale_BK=None, v_scale_BK=None):
  """Writes the new token's key and value k_new[b, k] / v_new[b, k] (cast to the cache dtype) at cache slot
  slot[b, k] (slot_BK [B, K]; or [B], slot[b] for every KV head, which saves XLA a broadcast) and, when KT
  pages are given, folds k_new (in float32, stored in the KT dtype) into page slot // page_size, which starts
  fresh at its first slot. Returns (k, v), or (k, v, kt_min, kt_max); with choose_q (the step's query
  [B, K, G, H]; KT pages required) and topr, followed by HSA's channel choice of each row (q_BKGR, ch_BKR,
  use_max_BKR, inv_tau_BKG: `hsa_scores.row_channels`' outputs, which the scoring takes as `choice=`).
  num_warps None: 1, or with choose_q `row_channels`' (`hsa_scores.row_channels_warps`).

  page_size_B: None (every row's page size is page_size) or [B] int32, row b's page size ps_b in [1, page_size]
  (page_size the largest: the "rows" rebuild loops to it, masked): its slot s goes to page s // ps_b, fresh
  when s % ps_b == 0; a slot whose page is past the P KT pages (s >= P * ps_b; the caller keeps lengths
  below) writes K/V and no page. The KT arrays may then have any P >= ceil(S / page_size). topr_B: None (topr
  for every row) or [B] int32, row b's top-r r_b in [1, topr] for the choice (`row_channels_reference`'s
  topr_B: ranks from r_b on are pads); used with choose_q only. A row's outputs are what the row gives alone
  with page_size = ps_b and topr = r_b.

  A slot outside [0, S) changes nothing at all, neither K/V nor KT (as `write_slot`'s mode="drop"): this is
  how a decode past capacity inside a caller's jit is dropped instead of written out of range. The KT pages
  take each (b, k)'s own slot; the methods with KT pages use one slot per sequence.

  The page's old min/max (`resolve_kt_update`): when k_new has the cache's dtype and page_size <=
  ROWS_MAX_PAGE_SIZE, recomputed from its K rows up to the slot, as the cache holds them ("rows": at most
  page_size - 1 contiguous K rows instead of the KT column; a value is stored only where it differs from the
  min/max of the rows before the slot, or at the page's first slot, so a page that does not hold its rows'
  min/max keeps its other values); else the page's KT column folded with k_new in float32 ("fold": strided by
  the row of P pages, each value its own memory sector). The two agree when k_new has the cache's dtype and the
  KT page holds the min/max of its rows (as `cache.build_kt_pages` and every append keep it): rounding to the
  KT dtype commutes with min and max. H200, 32k context, t=256 (539 pages of 3), us per layer: 391 x 8 rows fold
  73, rows 51; 108 x 8 fold 8.5, rows 5.6 (benchmarks/results/stage2_h200_2026-12-02b).

  k_scale_BK, v_scale_BK: an FP8 cache (k/v in `kv_quant.KV_CACHE_DTYPES`): [B, K] float32 scales, each program's
  two scalars; the new rows are stored as `kv_quant.quantize` gives them (saturating, never inf), and the KT
  pages fold the full-precision key ("fold").

  The outputs alias the cache inputs (input_output_aliases): inside a jitted step whose cache is donated (or
  a loop carry) the update is in place; called eagerly, XLA copies the inputs first and they stay valid.
  """
  _check_args(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP, page_size, choose_q,
              topr, page_size_B, topr_B, k_scale_BK, v_scale_BK)
  kt_update = resolve_kt_update("auto", k_BKSH, k_new_BKH, page_size)
  B, K = k_BKSH.shape[:2]
  if num_warps is None:
    num_warps = 1 if choose_q is None else row_channels_warps(B * K)
  slot = slot_BK.astype(jnp.int32)
  slot_spec = pl.BlockSpec((None,), lambda b, k: (b,)) if slot.ndim == 1 else row_blocks([slot])[0]
  # Inputs: k, v, k_new, v_new, slot, then optionally (kt_min, kt_max), each taken per (b, k) row; the
  # outputs are k, v and the KT pages, each aliased to its input.
  rows = [k_BKSH, v_BKSH, k_new_BKH, v_new_BKH]
  inputs = list(zip(rows, row_blocks(rows))) + [(slot, slot_spec)]
  outputs = [0, 1]  # indices into inputs
  pages = kt_min_BKHP is not None
  if pages:
    inputs += zip([kt_min_BKHP, kt_max_BKHP], row_blocks([kt_min_BKHP, kt_max_BKHP]))
    outputs += [len(inputs) - 2, len(inputs) - 1]
  # The channel choice: one more input and four outputs of their own (not aliased).
  choice = []
  if choose_q is not None:
    inputs += zip([choose_q], row_blocks([choose_q]))
    choice = choice_shapes(B, K, choose_q.shape[2], topr, choice_dot_dtype(choose_q.dtype, kt_min_BKHP.dtype))
  # The per-row values that are used (a page size with pages, a top-r with the choice): one scalar per program.
  row_spec = pl.BlockSpec((None,), lambda b, k: (b,))
  row_ps = pages and page_size_B is not None
  row_topr = bool(choice) and topr_B is not None
  inputs += [(x.astype(jnp.int32), row_spec) for x, used in ((page_size_B, row_ps), (topr_B, row_topr)) if used]
  scaled = k_scale_BK is not None  # an FP8 cache: each program's head scales, two scalars
  if scaled:
    inputs += zip([k_scale_BK, v_scale_BK], row_blocks([k_scale_BK, v_scale_BK]))
  kernel = functools.partial(_cache_append_kernel, page_size=page_size, kt_update=kt_update, topr=topr,
                             interpret=interpret)

  def body(*refs):
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    ins = take(5) + (take(2) if pages else [None, None])
    ins += take(1) if choice else [None]
    ins += (take(1) if row_ps else [None]) + (take(1) if row_topr else [None])
    ins += take(2) if scaled else [None, None]
    outs = take(2) + (take(2) if pages else [None, None])
    outs += take(4) if choice else [None] * 4
    kernel(*ins, *outs)

  return tuple(pl.pallas_call(
      body,
      grid=(B, K),
      in_specs=[spec for _, spec in inputs],
      out_specs=[inputs[i][1] for i in outputs] + row_blocks(choice),
      out_shape=[jax.ShapeDtypeStruct(inputs[i][0].shape, inputs[i][0].dtype) for i in outputs] + choice,
      input_output_aliases={i: o for o, i in enumerate(outputs)},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rocketkv_cache_append",
  )(*[x for x, _ in inputs]))
