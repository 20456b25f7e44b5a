"""Each method's prefill (what it keeps) and decode step (append, select, attend), in XLA plus the
`impl`-switched hot path of attention.py. Shapes follow rocketkv_jax.shapes.

prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B, config) -> KVCache
decode(cache, q_BKGH, k_new_BKH, v_new_BKH, config) -> (out_BKGH, cache)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import attention
from rocketkv_jax.config import _NoEvictionConfig
from rocketkv_jax.cache import (KVCache, build_kt_pages, kt_dtype, slot_valid)
from rocketkv_jax.select import group_channels, sparq_temperature, topk_tokens
from rocketkv_jax.snapkv import h2o_prefill_scores, snapkv_keep

# ---------------------------------------------------------------- building caches


def _gather(x_BTKH, keep_BKM):
  """x at the kept positions: [B, K, M, H]."""
  return jnp.take_along_axis(x_BTKH.transpose(0, 2, 1, 3), keep_BKM[..., None], axis=2)


def _place(x_BKMH, count_B, capacity):
  """A [B, K, capacity, H] buffer: the first count slots from x, zeros after (junk)."""
  m = x_BKMH.shape[2]
  valid = slot_valid(count_B, m)[:, None, :, None]
  x = jnp.where(valid, x_BKMH, jnp.zeros((), x_BKMH.dtype))
  return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - m), (0, 0)))


def _kept_cache(k_BTKH, v_BTKH, keep_BKM, count_B, lengths_B, capacity, **aux) -> KVCache:
  return KVCache(k=_place(_gather(k_BTKH, keep_BKM), count_B, capacity),
                 v=_place(_gather(v_BTKH, keep_BKM), count_B, capacity),
                 length=count_B.astype(jnp.int32), pos=lengths_B.astype(jnp.int32), **aux)


def _prefix_keep(k_BTKH, n):
  b, t, n_kv, _ = k_BTKH.shape
  return jnp.broadcast_to(jnp.arange(min(n, t), dtype=jnp.int32), (b, n_kv, min(n, t)))


def _with_kt_pages(cache: KVCache, config) -> KVCache:
  kt_min, kt_max = build_kt_pages(cache.k, cache.length, config.page_size, kt_dtype(config, cache.k.dtype))
  return KVCache(k=cache.k, v=cache.v, length=cache.length, pos=cache.pos, kt_min=kt_min, kt_max=kt_max)


def prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B, config) -> KVCache:
  method = config.method
  cap = config.capacity
  lengths_B = lengths_B.astype(jnp.int32)
  if isinstance(config, _NoEvictionConfig):
    cache = _kept_cache(k_BTKH, v_BTKH, _prefix_keep(k_BTKH, cap), lengths_B, lengths_B, cap)
    if method == "sparq":
      valid = slot_valid(cache.length, cap)[:, None, :, None]
      v_sum = jnp.where(valid, cache.v.astype(jnp.float32), 0.0).sum(axis=2)
      cache = KVCache(k=cache.k, v=cache.v, length=cache.length, pos=cache.pos, v_sum=v_sum)
    return _with_kt_pages(cache, config) if config.uses_kt_pages else cache
  if method in ("snapkv", "rocketkv"):
    keep, count = snapkv_keep(q_BTNH, k_BTKH, lengths_B, prompt_budget=config.prompt_budget,
                              window_size=config.window_size, kernel_size=config.kernel_size,
                              sink_tokens=config.sink_tokens)
    cache = _kept_cache(k_BTKH, v_BTKH, keep, count, lengths_B, cap)
    return _with_kt_pages(cache, config) if config.uses_kt_pages else cache
  if method == "streaming_llm":
    return _kept_cache(k_BTKH, v_BTKH, _streaming_keep(k_BTKH, lengths_B, config), jnp.minimum(lengths_B, cap),
                       lengths_B, cap)
  if method == "h2o":
    return _h2o_prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B, config)
  raise ValueError(f"unknown method {method!r}")


def _streaming_slot(pos_B, config):
  """Slot of the token at absolute position `pos`: sinks first, then a ring over the recent tokens."""
  sink, ring = config.sink_tokens, config.capacity - config.sink_tokens
  return jnp.where(pos_B < sink, pos_B, sink + (pos_B - sink) % ring).astype(jnp.int32)


def _streaming_keep(k_BTKH, lengths_B, config):
  """Position held by each slot after the prompt: slot = _streaming_slot(position)."""
  b, t, n_kv, _ = k_BTKH.shape
  cap, sink = config.capacity, config.sink_tokens
  ring = cap - sink
  j = jnp.arange(cap, dtype=jnp.int32)[None, :]
  base = (lengths_B - ring)[:, None]  # first recent position kept
  first_slot = sink + (base - sink) % ring
  recent_pos = base + (j - first_slot) % ring
  keep = jnp.where((j < sink) | (lengths_B[:, None] <= cap), j, recent_pos)
  keep = jnp.clip(keep, 0, t - 1)[:, None, :]
  return jnp.broadcast_to(keep, (b, n_kv, cap)).astype(jnp.int32)


def _h2o_prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B, config) -> KVCache:
  cap, recent = config.capacity, config.recent_tokens
  b, t, n_kv, _ = k_BTKH.shape
  acc_BKT = h2o_prefill_scores(q_BTNH, k_BTKH, lengths_B)
  m = min(cap, t)
  if t <= cap:
    keep = _prefix_keep(k_BTKH, cap)
  else:
    heavy, _ = topk_tokens(acc_BKT, lengths_B - recent, cap - recent)
    window = (lengths_B - recent)[:, None, None] + jnp.arange(recent, dtype=jnp.int32)
    evict_keep = jnp.concatenate([jnp.sort(heavy, -1), jnp.broadcast_to(window, (b, n_kv, recent))], -1)
    keep = jnp.where((lengths_B > cap)[:, None, None], evict_keep, jnp.arange(m, dtype=jnp.int32))
  count = jnp.minimum(lengths_B, cap)
  valid = slot_valid(count, m)[:, None, :]
  scores = jnp.where(valid, jnp.take_along_axis(acc_BKT, keep, axis=-1), 0.0)
  positions = jnp.where(valid, keep, 0)
  pad = ((0, 0), (0, 0), (0, cap - m))
  return _kept_cache(k_BTKH, v_BTKH, keep, count, lengths_B, cap, scores=jnp.pad(scores, pad),
                     positions=jnp.pad(positions, pad))


# ---------------------------------------------------------------- decode


def _append(cache: KVCache, k_new_BKH, v_new_BKH, slot, config, **replace) -> KVCache:
  """The cache with the new token at `slot` ([B], or [B, K] per KV head): K/V rows and (methods with KT
  pages) its KT page, in one `attention.append_token`; length and pos advance; `replace` sets the method's other leaves."""
  if config.uses_kt_pages:
    k, v, kt_min, kt_max = attention.append_token(cache.k, cache.v, k_new_BKH, v_new_BKH, slot, cache.kt_min,
                                                  cache.kt_max, page_size=config.page_size, impl=config.impl)
  else:
    k, v = attention.append_token(cache.k, cache.v, k_new_BKH, v_new_BKH, slot, page_size=1, impl=config.impl)
    kt_min, kt_max = cache.kt_min, cache.kt_max
  fields = dict(k=k, v=v, length=jnp.minimum(cache.length + 1, cache.capacity).astype(jnp.int32),
                pos=cache.pos + 1, kt_min=kt_min, kt_max=kt_max, scores=cache.scores, positions=cache.positions,
                v_sum=cache.v_sum)
  fields.update(replace)
  return KVCache(**fields)


def decode(cache: KVCache, q_BKGH, k_new_BKH, v_new_BKH, config):
  method = config.method
  impl = config.impl
  if method == "h2o":
    return _h2o_decode(cache, q_BKGH, k_new_BKH, v_new_BKH, config)
  if method == "streaming_llm":
    slot = _streaming_slot(cache.pos, config)
  else:
    slot = cache.length
  replace = {}
  if method == "sparq":
    replace["v_sum"] = cache.v_sum + v_new_BKH.astype(jnp.float32)
  cache = _append(cache, k_new_BKH, v_new_BKH, slot, config, **replace)
  if method in ("full", "snapkv", "streaming_llm"):
    return attention.dense_decode_attention(q_BKGH, cache.k, cache.v, cache.length, impl=impl), cache
  if method == "sparq":
    return _sparq_attend(cache, q_BKGH, config), cache
  idx, valid = select(cache, q_BKGH, config)
  out = attention.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=impl)
  return out, cache


def select(cache: KVCache, q_BKGH, config):
  """The slots a top-k method attends at this step, the new token already appended: idx [B, K, M] int32
  and valid [B, K, M] (hsa, rocketkv, quest, sparq, exact_topk)."""
  method = config.method
  if method in ("hsa", "rocketkv"):
    return attention.hsa_select(q_BKGH, cache.kt_min, cache.kt_max, cache.length,
                                topr=min(config.topr, q_BKGH.shape[-1]), page_size=config.page_size,
                                k=config.topk, num_slots=cache.capacity, impl=config.impl)
  if method == "quest":
    return attention.page_topk(_quest_page_scores(q_BKGH, cache), cache.length, page_size=config.page_size,
                               k=config.topk, num_slots=cache.capacity, impl=config.impl)
  if method == "exact_topk":
    probs = attention.dense_attention_probs(q_BKGH, cache.k, cache.length)
    return topk_tokens(probs.mean(axis=2), cache.length, config.topk)
  if method == "sparq":
    return topk_tokens(_sparq_probs(cache, q_BKGH, config).mean(axis=2), cache.length, config.topk)
  raise ValueError(f"{method!r} attends densely: it has no top-k selection")


def _quest_page_scores(q_BKGH, cache):
  """Quest's upper bound per page, sum_c max(q_c k_min_c, q_c k_max_c), summed over the group's heads."""
  qf = q_BKGH.astype(jnp.float32)[..., None]  # [B, K, G, H, 1]
  lo = cache.kt_min.astype(jnp.float32)[:, :, None]
  hi = cache.kt_max.astype(jnp.float32)[:, :, None]
  return jnp.maximum(qf * lo, qf * hi).sum(axis=(2, 3))  # [B, K, P]


def _sparq_probs(cache, q_BKGH, config):
  """SparQ's approximate per-head attention [B, K, G, S]: the group's top-r channels, temperature tau."""
  r = min(config.topr, q_BKGH.shape[-1])
  channels = group_channels(q_BKGH, r)
  qr = jnp.take_along_axis(q_BKGH.astype(jnp.float32), channels[:, :, None, :], axis=-1)  # [B, K, G, R]
  k_r = jnp.take_along_axis(cache.k, channels[:, :, None, :], axis=-1)  # [B, K, S, R]
  s = jnp.einsum("BKGR,BKSR->BKGS", qr, k_r.astype(jnp.float32), precision="highest")
  tau = sparq_temperature(q_BKGH, channels)
  valid_S = slot_valid(cache.length, cache.capacity)[:, None, None, :]
  p = jax.nn.softmax(jnp.where(valid_S, s / tau[..., None], -jnp.inf), axis=-1, where=valid_S)
  return jnp.where(valid_S, p, 0.0)


def _sparq_attend(cache, q_BKGH, config):
  """SparQ: approximate scores from the top-r channels, exact attention over the top-k, mean-value fix."""
  p = _sparq_probs(cache, q_BKGH, config)
  idx, valid = topk_tokens(p.mean(axis=2), cache.length, config.topk)
  out = attention.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=config.impl)
  alpha = jnp.where(valid[:, :, None, :], jnp.take_along_axis(p, idx[:, :, None, :], axis=-1), 0.0).sum(-1)
  v_mean = cache.v_sum / cache.length[:, None, None]  # [B, K, H]
  out = alpha[..., None] * out.astype(jnp.float32) + (1 - alpha[..., None]) * v_mean[:, :, None, :]
  return out.astype(q_BKGH.dtype)


def _h2o_decode(cache, q_BKGH, k_new_BKH, v_new_BKH, config):
  """Evict (once full) the lowest accumulated score outside the recent window, write the new token there,
  attend densely, and add this step's probabilities (summed over the group) to the scores."""
  cap, recent = config.capacity, config.recent_tokens
  full = (cache.length >= cap)[:, None]
  protected = cache.positions > (cache.pos - recent)[:, None, None]  # stays among the `recent` newest
  cand = jnp.where(protected, jnp.inf, cache.scores)
  victim = jnp.argmin(cand, axis=-1).astype(jnp.int32)  # first minimum: the lower slot
  slot_BK = jnp.where(full, victim, cache.length[:, None]).astype(jnp.int32)
  b, k = np.indices(slot_BK.shape, sparse=True)
  positions = cache.positions.at[b, k, slot_BK].set(jnp.broadcast_to(cache.pos[:, None], slot_BK.shape))
  scores = cache.scores.at[b, k, slot_BK].set(0.0)
  cache = _append(cache, k_new_BKH, v_new_BKH, slot_BK, config, positions=positions, scores=scores)
  probs = attention.dense_attention_probs(q_BKGH, cache.k, cache.length)  # [B, K, G, S]
  valid = slot_valid(cache.length, cap)[:, None, None, :]
  v = jnp.where(valid[:, :, 0, :, None], cache.v, jnp.zeros((), cache.v.dtype))
  out = jnp.einsum("BKGS,BKSH->BKGH", probs, v.astype(jnp.float32), precision="highest").astype(q_BKGH.dtype)
  cache = KVCache(k=cache.k, v=cache.v, length=cache.length, pos=cache.pos, scores=cache.scores + probs.sum(2),
                  positions=cache.positions)
  return out, cache
