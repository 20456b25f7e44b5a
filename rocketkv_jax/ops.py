"""The one dispatch table: every op of the KV core's decode hot path, with its semantics and its kernel.

Each op's semantics is its kernel module's `*_reference` (plain jnp, f32 accumulation). `impl` chooses:
  "xla"        the reference (or a named faster XLA variant below, tested against the same reference),
  "pallas"     the Pallas Triton kernel (GPU),
  "interpret"  the same kernel in Pallas interpret mode (CPU tests run the GPU's kernel bodies),
  "auto"       "pallas" on a GPU, "xla" elsewhere.
Every wrapper below takes the kernel's arguments with `impl` instead of `interpret`. The model's own ops (RMSNorm,
RoPE) keep their table with the model (`rocketkv_jax.models.layer_ops`), dispatched by the same rule (`run`).

Layouts: q [B, K, G, H] (query heads grouped by KV head), k/v [B, K, S, H], KT pages [B, K, H, P].

Per-row stage-2 plans: the HSA ops take `page_size_B` / `topr_B` ([B] int32, or None), row b's page size and
top-r, at most the static `page_size` / `topr` (the largest, which set loop bounds and shapes). A row's result
is what it gives alone with page_size = ps_b and topr = r_b; its page p covers slots [p * ps_b, (p + 1) * ps_b)
of the KT arrays' P pages (the caller keeps length_b <= P * ps_b).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rocketkv_jax.kernels import cache_append as cache_append_kernel
from rocketkv_jax.kernels import dense_decode, hsa_scores, page_topk as page_topk_kernel, sparse_decode, topk_select

IMPLS = ("auto", "xla", "pallas", "interpret")

# Up to this many cache slots the XLA page top-k is the reference (one top_k over the broadcast slot
# scores); above it, `page_topk_best_pages` expands only the best pages (same output, less work on long
# full caches: hsa alone at 128k has 5.7k pages, past the kernel's MAX_PAGES; CPU, B=1 K=8 S=131072
# page 23, k=128: 2.83 ms for the reference, 0.11 ms for the best pages).
DIRECT_TOPK_MAX_SLOTS = 16384


def resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


def uses_kernels(impl: str) -> bool:
  """Whether `impl` runs the Pallas kernels: "pallas", "interpret", or "auto" on a GPU."""
  return resolve_impl(impl) in ("pallas", "interpret")


# ----------------------------------------------------------------------------- faster XLA variants


def cache_append_scatter(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP=None, kt_max_BKHP=None, *,
                         page_size: int = 1, choose_q=None, topr: int = 0, page_size_B=None, topr_B=None,
                         k_scale_BK=None, v_scale_BK=None):
  """`cache_append_reference` as XLA scatters (in place under donation). The reference rewrites every slot
  with a select, reading and writing the whole cache per token and layer; this touches one row each
  (CPU, B=8 K=3 S=8192 H=64 f32, 64 appends in a loop: 0.13 ms per append against 0.0005 ms).
  A slot outside [0, S) changes nothing (a negative one must not wrap, as `.at[]` would). choose_q, page_size_B,
  topr_B, k_scale_BK, v_scale_BK: as the reference's (the channel choice after the outputs)."""
  return (_scatter_append(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP,
                          page_size=page_size, page_size_B=page_size_B, k_scale_BK=k_scale_BK,
                          v_scale_BK=v_scale_BK) +
          cache_append_kernel.append_choice(choose_q, topr, kt_min_BKHP, topr_B))


def _scatter_append(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot_BK, kt_min_BKHP, kt_max_BKHP, *, page_size,
                    page_size_B=None, k_scale_BK=None, v_scale_BK=None):
  S = k_BKSH.shape[2]
  slot_BK = jnp.broadcast_to(slot_BK[:, None], k_BKSH.shape[:2]) if slot_BK.ndim == 1 else slot_BK
  slot_BK = jnp.where((slot_BK < 0) | (slot_BK >= S), S, slot_BK).astype(jnp.int32)
  b, k = np.indices(slot_BK.shape, sparse=True)

  def write(x_BKSH, new_BKH, scale_BK):
    # The barrier keeps XLA from fusing the producer of `new` (the K/V projection matmul) into the scatter:
    # on an H200 that fusion ran each projection as one thread per output element (77 us per layer).
    new_BKH = lax.optimization_barrier(cache_append_kernel.stored_row(new_BKH, scale_BK, x_BKSH.dtype))
    return x_BKSH.at[b, k, slot_BK].set(new_BKH, mode="drop")

  kv = (write(k_BKSH, k_new_BKH, k_scale_BK), write(v_BKSH, v_new_BKH, v_scale_BK))
  if kt_min_BKHP is None:
    return kv
  P = kt_min_BKHP.shape[-1]
  ps = page_size if page_size_B is None else page_size_B.astype(jnp.int32)[:, None]  # [B, 1]: each row's own
  page_BK = jnp.where(slot_BK < S, slot_BK // ps, P)  # past P (a row's slot past its pages): dropped below
  fresh = (slot_BK % ps == 0)[..., None]  # [B, K, 1]: the page starts at this slot
  kf = lax.optimization_barrier(k_new_BKH).astype(jnp.float32)
  at = jnp.minimum(page_BK, P - 1)
  new_min = jnp.where(fresh, kf, jnp.minimum(kt_min_BKHP[b, k, :, at].astype(jnp.float32), kf))
  new_max = jnp.where(fresh, kf, jnp.maximum(kt_max_BKHP[b, k, :, at].astype(jnp.float32), kf))
  return kv + (kt_min_BKHP.at[b, k, :, page_BK].set(new_min.astype(kt_min_BKHP.dtype), mode="drop"),
               kt_max_BKHP.at[b, k, :, page_BK].set(new_max.astype(kt_max_BKHP.dtype), mode="drop"))


def page_topk_best_pages(scores_BKP, length_B, *, page_size: int, k: int, num_slots: int, page_size_B=None):
  """`page_topk_reference` expanding only the best ceil(k / page_size) + 1 pages to slots (valid slots are
  a prefix, so at most one chosen page is partial); the same idx [B, K, M], ascending then 0s. page_size_B:
  each row's page size (`page_topk_reference`'s), then the best min(k, S) + 1 pages (pages of 1 slot at worst)."""
  if page_size_B is not None:
    return _best_pages_per_row(scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                               page_size_B=page_size_B.astype(jnp.int32))
  num_pages = scores_BKP.shape[-1]
  m = min(k, num_slots)
  length_B = jnp.clip(length_B.astype(jnp.int32), 0, num_slots)
  n_pages = min(num_pages, -(-m // page_size) + 1)
  page_valid = jnp.arange(num_pages)[None, :] * page_size < length_B[:, None]
  scores = jnp.where(page_valid[:, None, :], scores_BKP.astype(jnp.float32), -jnp.inf)
  _, pages = lax.top_k(scores, n_pages)
  pages = jnp.sort(pages, axis=-1)  # candidates in ascending slot order keep the lower-slot tie-break
  cand_scores = jnp.take_along_axis(scores, pages, axis=-1)
  slots = (pages[..., None] * page_size + jnp.arange(page_size)).reshape(*pages.shape[:2], -1)
  in_range = slots < length_B[:, None, None]
  cand = jnp.where(in_range, jnp.repeat(cand_scores, page_size, axis=-1), -jnp.inf)
  _, j = lax.top_k(cand, min(m, cand.shape[-1]))
  idx = jnp.take_along_axis(slots, j, axis=-1)
  idx = jnp.pad(idx, ((0, 0), (0, 0), (0, m - idx.shape[-1])))
  taken = jnp.arange(m)[None, None, :] < length_B[:, None, None]
  idx = jnp.sort(jnp.where(taken, idx, num_slots), axis=-1)
  return jnp.where(taken, idx, 0).astype(jnp.int32)


def _best_pages_per_row(scores_BKP, length_B, *, page_size, k, num_slots, page_size_B):
  """`page_topk_best_pages` with each row's page size: candidates are the best min(m + 1, P) pages' slots at
  the static page_size, those past a row's page size (or its length) invalid. The candidates are ranked by
  int32 keys below every valid score's (`topk_select.order_key`), so a valid slot scoring -inf still comes
  before an invalid one whatever its place among the candidates."""
  B, K, num_pages = scores_BKP.shape
  m = min(k, num_slots)
  length_B = page_topk_kernel.row_length(length_B.astype(jnp.int32), num_slots, num_pages, page_size_B)
  page_valid = jnp.arange(num_pages)[None, :] * page_size_B[:, None] < length_B[:, None]
  scores = jnp.where(page_valid[:, None, :], scores_BKP.astype(jnp.float32), -jnp.inf)
  _, pages = lax.top_k(scores, min(num_pages, m + 1))
  pages = jnp.sort(pages, axis=-1)  # candidates in ascending slot order keep the lower-slot tie-break
  cand_keys = topk_select.order_key(jnp.take_along_axis(scores, pages, axis=-1))
  j = jnp.arange(page_size)
  slots = (pages[..., None] * page_size_B[:, None, None, None] + j).reshape(B, K, -1)
  in_range = ((j < page_size_B[:, None, None])[:, :, None, :] &
              (pages[..., None] * page_size_B[:, None, None, None] + j < length_B[:, None, None, None]))
  cand = jnp.where(in_range.reshape(B, K, -1), jnp.repeat(cand_keys, page_size, axis=-1), jnp.iinfo(jnp.int32).min)
  _, at = lax.top_k(cand, min(m, cand.shape[-1]))
  idx = jnp.take_along_axis(slots, at, axis=-1)
  idx = jnp.pad(idx, ((0, 0), (0, 0), (0, m - idx.shape[-1])))
  taken = jnp.arange(m)[None, None, :] < length_B[:, None, None]
  idx = jnp.sort(jnp.where(taken, idx, num_slots), axis=-1)
  return jnp.where(taken, idx, 0).astype(jnp.int32)


def _page_topk_xla(scores_BKP, length_B, *, page_size, k, num_slots, page_size_B=None):
  if num_slots <= DIRECT_TOPK_MAX_SLOTS:
    return page_topk_kernel.page_topk_reference(scores_BKP, length_B, page_size=page_size, k=k,
                                                num_slots=num_slots, page_size_B=page_size_B)
  return page_topk_best_pages(scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                              page_size_B=page_size_B)


def _page_topk_pallas(scores_BKP, length_B, *, page_size, k, num_slots, interpret, page_size_B=None):
  if scores_BKP.shape[-1] > page_topk_kernel.MAX_PAGES:  # a row's pages no longer fit in registers
    return _page_topk_xla(scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                          page_size_B=page_size_B)
  return page_topk_kernel.page_topk(scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                                    interpret=interpret, page_size_B=page_size_B)


def _select_pages_xla(scores_BKP, length_B, *, page_size, k, num_slots, sink, recent, page_size_B=None):
  """The XLA selection from HSA's page probabilities: the forced pages raised, then `page_topk`. With
  page_size_B, each row's pages are all P of scores_BKP (the KT arrays')."""
  if page_size_B is not None:
    page_size_B = page_size_B.astype(jnp.int32)
  length = page_topk_kernel.row_length(length_B.astype(jnp.int32), num_slots, scores_BKP.shape[-1], page_size_B)
  scores_BKP = page_topk_kernel.force_pages(scores_BKP, length, page_size=page_size, sink=sink, recent=recent,
                                            page_size_B=page_size_B)
  return _page_topk_xla(scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                        page_size_B=page_size_B)


def _hsa_select_xla(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr, page_size, k, num_slots, sink, recent,
                    choice=None, page_size_B=None, topr_B=None):
  del choice  # the reference chooses the channels itself (the same choice)
  scores = hsa_scores.hsa_page_scores_reference(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr,
                                                page_size=page_size, page_size_B=page_size_B, topr_B=topr_B)
  return _select_pages_xla(scores, length_B, page_size=page_size, k=k, num_slots=num_slots, sink=sink,
                           recent=recent, page_size_B=page_size_B)


def _hsa_select_pallas(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr, page_size, k, num_slots, sink, recent,
                       interpret, choice=None, page_size_B=None, topr_B=None):
  """Two kernels back to back and nothing between them: the scoring kernel's partials go straight to a
  selection kernel that normalises, raises the forced pages and picks. Above the selection kernel's page
  limit, the scores are normalised in XLA and selected in XLA. With page_size_B the selection takes all the
  KT arrays' P pages (a row of smaller pages uses pages past ceil(num_slots / page_size))."""
  args = (q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B)
  rows = dict(page_size_B=page_size_B, topr_B=topr_B)
  P = kt_min_BKHP.shape[-1]
  if P <= page_topk_kernel.MAX_PAGES:
    s, m, l = hsa_scores.hsa_page_partials(*args, topr=topr, page_size=page_size, interpret=interpret,
                                           choice=choice, **rows)
    pages = {} if page_size_B is None else dict(page_size_B=page_size_B, num_pages=P)
    return page_topk_kernel.hsa_page_topk(s, m, l, length_B, page_size=page_size, k=k, num_slots=num_slots,
                                          sink=sink, recent=recent, interpret=interpret, **pages)
  scores = hsa_scores.hsa_page_scores(*args, topr=topr, page_size=page_size, interpret=interpret, choice=choice,
                                      **rows)
  return _select_pages_xla(scores, length_B, page_size=page_size, k=k, num_slots=num_slots, sink=sink,
                           recent=recent, page_size_B=page_size_B)


# ----------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Op:
  xla: Callable  # the reference, or a named variant tested against it
  kernel: Callable  # takes interpret=


OPS = {
    "dense_decode_attention": Op(dense_decode.dense_decode_attention_reference, dense_decode.dense_decode_attention),
    "sparse_decode_attention": Op(sparse_decode.sparse_decode_attention_reference,
                                  sparse_decode.sparse_decode_attention),
    "page_topk": Op(_page_topk_xla, _page_topk_pallas),
    "hsa_select": Op(_hsa_select_xla, _hsa_select_pallas),
    "cache_append": Op(cache_append_scatter, cache_append_kernel.cache_append),
}


def run(op: Op, *args, impl: str, **kwargs):
  """Runs `op`'s XLA path or its kernel, the way `impl` asks (the one rule, for this table and the model's)."""
  impl = resolve_impl(impl)
  if impl == "xla":
    return op.xla(*args, **kwargs)
  return op.kernel(*args, interpret=impl == "interpret", **kwargs)


def call(op: str, *args, impl: str, **kwargs):
  """Runs this table's `op` the way `impl` asks."""
  return run(OPS[op], *args, impl=impl, **kwargs)


# ----------------------------------------------------------------------------- named entry points


def dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, *, impl, k_scale_BK=None, v_scale_BK=None):
  """Exact attention of each query head over its KV head's slots [0, length): out [B, K, G, H]. A NaN in an
  attended key or value gives NaN (`jax.nn.dot_product_attention`'s NaN in, NaN out); slots past length are never
  read; no valid slot gives 0. k_scale_BK, v_scale_BK: an FP8 cache's [B, K] float32 scales (`kv_quant`: the
  keys and values are read as dequantize gives them); None (a cache in q's dtype) adds nothing to the call."""
  scales = {} if k_scale_BK is None else dict(k_scale_BK=k_scale_BK, v_scale_BK=v_scale_BK)
  return call("dense_decode_attention", q_BKGH, k_BKSH, v_BKSH, length_B, impl=impl, **scales)


def sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, *, impl, k_scale_BK=None, v_scale_BK=None):
  """Exact attention over the slots idx[b, k, m] where valid: out [B, K, G, H]. NaN in an attended key or value
  gives NaN; invalid entries are never read; none valid gives 0. k_scale_BK, v_scale_BK: as
  `dense_decode_attention`'s."""
  scales = {} if k_scale_BK is None else dict(k_scale_BK=k_scale_BK, v_scale_BK=v_scale_BK)
  return call("sparse_decode_attention", q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, impl=impl, **scales)


def page_topk(scores_BKP, length_B, *, page_size, k, num_slots, impl, page_size_B=None):
  """The k best valid slots when each slot scores its page: idx [B, K, M] ascending, then 0s (M = min(k, S);
  the first min(length, M) entries are valid); ties toward the lower slot. page_size_B: None, or [B] int32, row
  b's page size in [1, page_size] (then any P >= ceil(S / page_size) pages; a row's valid slots are clipped to
  its P * ps_b)."""
  return call("page_topk", scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots, impl=impl,
              page_size_B=page_size_B)


def hsa_select(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr, page_size, k, num_slots, impl, sink=0,
               recent=0, choice=None, page_size_B=None, topr_B=None):
  """`page_topk` of HSA's group page probabilities (`hsa_scores.hsa_page_scores_reference`): idx [B, K, M] as
  page_topk. sink, recent: the pages holding the first `sink` slots and the last `recent` valid slots are
  always taken, inside k (RocketKV's hsa_sink_tokens / hsa_recent_tokens, this project's extension). choice:
  the channel choice already made (`cache_append`'s choose_q, with the same topr_B), which the kernels use as it
  is. page_size_B, topr_B: None, or [B] int32, row b's page size in [1, page_size] and top-r in [1, topr] (the
  static values the largest); with page_size_B the selection takes all the KT arrays' P pages."""
  return call("hsa_select", q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr, page_size=page_size, k=k,
              num_slots=num_slots, sink=sink, recent=recent, impl=impl, choice=choice, page_size_B=page_size_B,
              topr_B=topr_B)


def cache_append(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot, kt_min_BKHP=None, kt_max_BKHP=None, *, page_size,
                 impl, choose_q=None, topr=0, page_size_B=None, topr_B=None, k_scale_BK=None, v_scale_BK=None):
  """The new token's K/V rows at `slot` ([B], or [B, K] per KV head), its key folded into its KT page when
  pages are given: (k, v) or (k, v, kt_min, kt_max). A slot outside [0, S) changes nothing. With choose_q (the
  step's query) and topr, HSA's channel choice of each row follows (`hsa_select`'s choice=; the kernel makes it
  in the same launch). The kernel rebuilds the open page from its K rows when the new key has the cache's dtype
  and the page is small (`cache_append.resolve_kt_update`); the XLA path folds the key into the page: the
  same pages whenever each page holds its rows' min/max, as every cache's do. page_size_B, topr_B: None, or
  [B] int32, row b's page size in [1, page_size] (its slot s goes to page s // ps_b) and the choice's top-r in
  [1, topr] (`cache_append`'s). k_scale_BK, v_scale_BK: an FP8 cache's scales: the new rows are stored quantized
  at them (`kv_quant.quantize`, saturating), the KT pages fold the full-precision key."""
  scales = {} if k_scale_BK is None else dict(k_scale_BK=k_scale_BK, v_scale_BK=v_scale_BK)
  return call("cache_append", k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot, kt_min_BKHP, kt_max_BKHP,
              page_size=page_size, impl=impl, choose_q=choose_q, topr=topr, page_size_B=page_size_B, topr_B=topr_B,
              **scales)


def prefix_valid(idx_BKM, length_B):
  """valid [B, K, M] of an index list whose first min(length, M) entries are the chosen slots."""
  return jnp.broadcast_to((jnp.arange(idx_BKM.shape[-1])[None, :] < length_B[:, None])[:, None, :],
                          idx_BKM.shape)
