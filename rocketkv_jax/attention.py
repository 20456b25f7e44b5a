"""The decode hot path behind the `impl` switch: dense decode attention, sparse (top-k) decode attention,
HSA page scoring, the top-k tokens from page scores and the KT page update. `impl="xla"` is plain XLA (below); `impl="pallas"` calls the Pallas Triton kernels of
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
from rocketkv_jax.select import topk_tokens_from_pages


def resolve_impl(impl: str) -> str:
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


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
  if resolve_impl(impl) in ("pallas", "interpret"):
    from rocketkv_jax.kernels import dense_decode
    return dense_decode.dense_decode_attention(q_BKGH, k_BKSH, v_BKSH, length_B, interpret=impl == "interpret")
  return dense_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, length_B)


def sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM, *, impl):
  if resolve_impl(impl) in ("pallas", "interpret"):
    from rocketkv_jax.kernels import sparse_decode
    return sparse_decode.sparse_decode_attention(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM,
                                                 interpret=impl == "interpret")
  return sparse_decode_attention_xla(q_BKGH, k_BKSH, v_BKSH, idx_BKM, valid_BKM)


def hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B, *, page_size, impl):
  if resolve_impl(impl) in ("pallas", "interpret"):
    from rocketkv_jax.kernels import hsa_scores
    return hsa_scores.hsa_page_scores(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B,
                                      page_size=page_size, interpret=impl == "interpret")
  return hsa_page_scores_xla(q_BKGH, kt_min_BKHP, kt_max_BKHP, channels_BKR, length_B, page_size=page_size)


def page_topk(page_scores_BKP, length_B, *, page_size, k, num_slots, impl):
  """Top-k slots from page scores: idx [B, K, M] and valid [B, K, M] as `topk_tokens_from_pages`. The
  Pallas kernel returns the same set of slots in ascending order (no sort); above its page limit, XLA."""
  from rocketkv_jax.kernels import page_topk as kernel
  if resolve_impl(impl) in ("pallas", "interpret") and page_scores_BKP.shape[-1] <= kernel.MAX_PAGES:
    idx = kernel.page_topk(page_scores_BKP, length_B, page_size=page_size, k=k, num_slots=num_slots,
                           interpret=impl == "interpret")
    return idx, jnp.broadcast_to(slot_valid(length_B, idx.shape[-1])[:, None, :], idx.shape)
  return topk_tokens_from_pages(page_scores_BKP, length_B, page_size, k, num_slots)


def append_kt_pages(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B, *, page_size, num_slots, impl):
  """`cache.append_kt_pages` (fold the appended key into its page; a slot past num_slots changes nothing);
  with Pallas, one in-place kernel instead of XLA's gathers and scatters."""
  if resolve_impl(impl) in ("pallas", "interpret"):
    from rocketkv_jax.kernels import kt_update
    past = kt_min_BKHP.shape[-1] * page_size  # the kernel leaves slots from here on alone
    slot = jnp.where(slot_B < num_slots, slot_B, past).astype(jnp.int32)
    return kt_update.kt_update(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot, page_size=page_size,
                               interpret=impl == "interpret")
  return cache_lib.append_kt_pages(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B, page_size, num_slots)
