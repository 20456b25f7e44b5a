"""The decode hot path behind the `impl` switch: dense decode attention, sparse (top-k) decode attention,
HSA page scoring, the top-k tokens from page scores and the token append (K/V rows and KT page). `impl="xla"` is plain XLA (below); `impl="pallas"` calls the Pallas Triton kernels of
`rocketkv_jax.kernels` with the same arguments; `"interpret"` runs those kernels in Pallas interpret mode (CPU tests);
`"auto"` picks Pallas on GPU and XLA elsewhere.

Layouts: q [B, K, G, H] (query heads grouped by KV head), k/v [B, K, S, H], KT pages [B, K, H, P].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import cache as cache_lib
from rocketkv_jax.cache import slot_valid
from rocketkv_jax.select import group_channels, topk_tokens_from_pages


def resolve_impl(impl: str) -> str:
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


def uses_kernels(impl: str) -> bool:
  """Whether `impl` runs the Pallas kernels: "pallas", "interpret", or "auto" on a GPU."""
  return resolve_impl(impl) in ("pallas", "interpret")


def _prefix_valid(idx_BKM, length_B):
  """valid [B, K, M] of a top-k index list whose first min(length, M) entries are the chosen slots."""
  return jnp.broadcast_to(slot_valid(length_B, idx_BKM.shape[-1])[:, None, :], idx_BKM.shape)


def _masked_softmax_attention(q_BKGH, k_BKMH, v_BKMH, valid_BKM):
  """Exact attention over M candidate slots, scale 1/sqrt(H); invalid slots (even NaN) never leak."""
  scale = 1.0 / np.sqrt(q_BKGH.shape[-1])
  s = jnp.einsum("BKGH,BKMH->BKGM", q_BKGH, k_BKMH, preferred_element_type=jnp.float32) * scale
  s = jnp.where(valid_BKM[:, :, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  denom = p.sum(-1, keepdims=True)
  v = jnp.where(valid_BKM[..., None], v_BKMH, jnp.zeros((), v_BKMH.dtype))
  o = jnp.einsum("BKGM,BKMH->BKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  o = o / jnp.where(denom > 0, denom, 1.0)
  return o.astype(q_BKGH.dtype)


def dense_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, length_B):
  valid = slot_valid(length_B, k_BKSH.shape[2])[:, None, :]
  return _masked_softmax_attention(q_BKGH, k_BKSH, v_BKSH, jnp.broadcast_to(valid, k_BKSH.shape[:3]))


def dense_attention_probs(q_BKGH, k_BKSH, length_B):
  """Per-head softmax probabilities [B, K, G, S] float32 over the valid slots (exact scores)."""
  scale = 1.0 / np.sqrt(q_BKGH.shape[-1])
  s = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH, preferred_element_type=jnp.float32) * scale
  valid = slot_valid(length_B, k_BKSH.shape[2])[:, None, None, :]
  return jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1, where=valid)


def sparse_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM):
  k_sel = jnp.take_along_axis(k_BKSH, idx_BKM[..., None], axis=2)
  v_sel = jnp.take_along_axis(v_BKSH, idx_BKM[..., None], axis=2)
  return _masked_softmax_attention(q_BKGH, k_sel, v_sel, valid_BKM)


def hsa_page_scores_xla(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B, *, page_size):
  """HSA page scores [B, K, P] float32 (ALGORITHM.md §3, steps 2-6 up to top-k).

  Per query head: s_g[p] = sum over the group's top-r channels of q_g[c] * (k_max if sign > 0 else k_min),
  softmax of s_g / tau_g over valid slots (each page's score stands for each of its valid slots), then the
  group mean of the per-slot probabilities. Pages with no valid slot score -inf.
  """
  qf = q_BKGH.astype(jnp.float32)
  qr = jnp.take_along_axis(qf, channels_BKR[:, :, None, :], axis=-1)  # [B, K, G, R]
  sigma = qr.sum(axis=2) > 0  # [B, K, R]; zero counts as negative
  rows_min = jnp.take_along_axis(kt_min_BKHP, channels_BKR[..., None], axis=2)
  rows_max = jnp.take_along_axis(kt_max_BKHP, channels_BKR[..., None], axis=2)
  rep_BKRP = jnp.where(sigma[..., None], rows_max, rows_min).astype(jnp.float32)
  num_pages = kt_min_BKHP.shape[-1]
  count_BP = jnp.clip(length_B[:, None] - jnp.arange(num_pages)[None, :] * page_size, 0, page_size)
  used = (count_BP > 0)[:, None, None, :]  # [B, 1, 1, P]
  rep_BKRP = jnp.where(used, rep_BKRP, 0.0)  # empty pages may hold junk
  s = jnp.einsum("BKGR,BKRP->BKGP", qr, rep_BKRP, precision="highest")
  tau = jnp.sqrt(q_BKGH.shape[-1] * jnp.abs(qr).sum(-1) / jnp.abs(qf).sum(-1))  # [B, K, G]
  logits = jnp.where(used, s / tau[..., None], -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - m)
  z = (e * count_BP[:, None, None, :]).sum(-1, keepdims=True)
  prob = (e / z).mean(axis=2)
  return jnp.where(used[:, :, 0, :], prob, -jnp.inf)


def dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, *, impl):
  if uses_kernels(impl):
    from rocketkv_jax.kernels import dense_decode
    return dense_decode.dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, interpret=impl == "interpret")
  return dense_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, length_B)


def sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, *, impl):
  if uses_kernels(impl):
    from rocketkv_jax.kernels import sparse_decode
    return sparse_decode.sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM,
                                                 interpret=impl == "interpret")
  return sparse_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM)


def hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr, page_size, impl):
  """HSA page scores over the group's top-r channels (`select.group_channels`). The Pallas kernel chooses
  the channels, signs and temperatures itself, so nothing runs between the query and it."""
  if uses_kernels(impl):
    from rocketkv_jax.kernels import hsa_scores
    return hsa_scores.hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr,
                                      page_size=page_size, interpret=impl == "interpret")
  channels = group_channels(q_BKGH, topr)
  return hsa_page_scores_xla(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels, length_B, page_size=page_size)


def page_topk(page_scores_BKP, length_B, *, page_size, k, num_slots, impl):
  """Top-k slots from page scores: idx [B, K, M] and valid [B, K, M] as `topk_tokens_from_pages`. The
  Pallas kernel returns the same set of slots in ascending order (no sort); above its page limit, XLA."""
  from rocketkv_jax.kernels import page_topk as kernel
  if uses_kernels(impl) and page_scores_BKP.shape[-1] <= kernel.MAX_PAGES:
    idx = kernel.page_topk(page_scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                           interpret=impl == "interpret")
    return idx, _prefix_valid(idx, length_B)
  return topk_tokens_from_pages(page_scores_BKP, length_B, page_size, k, num_slots)


def hsa_select(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr, page_size, k, num_slots, impl):
  """HSA's top-k slots, idx and valid [B, K, M] as `page_topk`: page scores over the group's top-r channels,
  then the k best tokens. With Pallas, two kernels back to back and nothing between them: the scoring
  kernel's partials go straight to a selection kernel that normalises and picks (above the selection
  kernel's page limit, the scores are normalised in XLA and selected by XLA's top-k)."""
  from rocketkv_jax.kernels import page_topk as topk_kernel
  if uses_kernels(impl) and kt_min_BKHP.shape[-1] <= topk_kernel.MAX_PAGES:
    from rocketkv_jax.kernels import hsa_scores
    interpret = impl == "interpret"
    s, m, l = hsa_scores.hsa_page_partials(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr,
                                           page_size=page_size, interpret=interpret)
    idx = topk_kernel.hsa_page_topk(s, m, l, length_B, page_size=page_size, k=k, num_slots=num_slots,
                                    interpret=interpret)
    return idx, _prefix_valid(idx, length_B)
  scores = hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr, page_size=page_size,
                           impl=impl)
  return page_topk(scores, length_B, page_size=page_size, k=k, num_slots=num_slots, impl=impl)


def append_token(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot, kt_min_BKHP=None, kt_max_BKHP=None, *,
                 page_size, impl):
  """Writes the new token's K/V rows at `slot` ([B]: one slot per sequence; or [B, K]: per KV head) and, when
  KT pages are given, folds its key into its page: (k, v), or (k, v, kt_min, kt_max). A slot past the
  capacity changes nothing (a decode past capacity inside a caller's jit drops the token). With Pallas, one
  in-place kernel (`kernels.cache_append`) instead of XLA's two scatters and the KT gathers and scatters.

  KT pages take one slot per sequence, slot[:, 0] of a [B, K] slot on the XLA path: only streaming_llm and
  h2o have ring or per-head slots, and neither keeps KT pages."""
  if uses_kernels(impl):
    from rocketkv_jax.kernels import cache_append
    return cache_append.cache_append(k_BKSH, v_BKSH, k_new_BKH, v_new_BKH, slot, kt_min_BKHP, kt_max_BKHP,
                                     page_size=page_size, interpret=impl == "interpret")
  slot_BK = jnp.broadcast_to(slot[:, None], k_BKSH.shape[:2]) if slot.ndim == 1 else slot
  kv = (cache_lib.write_slot(k_BKSH, k_new_BKH, slot_BK), cache_lib.write_slot(v_BKSH, v_new_BKH, slot_BK))
  if kt_min_BKHP is None and kt_max_BKHP is None:
    return kv
  return kv + cache_lib.append_kt_pages(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_BK[:, 0], page_size,
                                        k_BKSH.shape[2])
