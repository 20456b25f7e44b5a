"""The decode budget (docs/ALGORITHM.md §4b, this project's extension): the tokens a sequence generates live in a
region of `decode_budget` kept + `decode_buffer` fresh slots after its stage-1 prompt set, and when a row's region
is full it is compacted in place, so a cache's capacity does not grow with the output.

A row's region starts at `cache.decode_start` (its kept prompt tokens) and holds R = decode_budget + decode_buffer
slots. Each decode step first records its query in the row's ring of the last `decode_window` (α) queries
(`cache.q_recent` [B, α, N, H], at slot pos % α); a row whose region holds R tokens when its next token comes is
compacted first: its region is scored SnapKV-style by the attention of the α ring queries (softmax over every
valid slot of the row, in float32; the region's columns summed over the α queries and the G query heads of each
KV head), the α newest region tokens are always kept (as SnapKV keeps its window), and of the rest the
decode_budget - α best per KV head, in slot order; they move to the region's first decode_budget slots (positions
kept: the keys carry their RoPE), the row's length drops to decode_start + decode_budget, and its KT pages are
rebuilt from the stored keys. Only rows that need it are compacted, one at a time in a `lax.while_loop`; a step
where no row is full costs a comparison. The prompt set is never touched, so prefix and session reuse hold.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rocketkv_jax.cache import KVCache, build_kt_pages


def init_leaves(config, cache: KVCache, q_BTNH) -> KVCache:
  """A prefill's cache with the decode region's leaves: decode_start (the kept prompt tokens) and an empty ring of
  the last `decode_window` queries, [B, α, N, H] in the queries' dtype."""
  b, _, n, h = q_BTNH.shape
  return dataclasses.replace(cache, decode_start=cache.length.astype(jnp.int32),
                             q_recent=jnp.zeros((b, config.decode_window, n, h), q_BTNH.dtype))


def before_append(config, cache: KVCache, q_BKGH) -> KVCache:
  """A decode step's work before its append: its query recorded in each row's ring, then every row whose region is
  full compacted (module doc)."""
  b, n_kv, g, h = q_BKGH.shape
  slot = cache.pos % config.decode_window
  q_recent = cache.q_recent.at[jnp.arange(b), slot].set(q_BKGH.reshape(b, n_kv * g, h).astype(cache.q_recent.dtype))
  cache = dataclasses.replace(cache, q_recent=q_recent)
  full = cache.length - cache.decode_start >= region_slots(config)

  def compact_all(c):
    def body(carry):
      c, todo = carry
      row = jnp.argmax(todo)
      return compact_row(config, c, row, g), todo.at[row].set(False)
    return jax.lax.while_loop(lambda carry: carry[1].any(), body, (c, full))[0]

  return jax.lax.cond(full.any(), compact_all, lambda c: c, cache)


def region_slots(config) -> int:
  """R: the slots of a row's decode region, kept + fresh."""
  return config.decode_budget + config.decode_buffer


def region_scores(config, q_AKGH, k_KSH, length, start, k_scale_K=None):
  """[K, R] float32: each region slot's attention mass from the ring's queries (module doc), the α newest region
  slots +inf (always kept)."""
  n_kv, s, h = k_KSH.shape
  keys = k_KSH.astype(jnp.float32)
  if k_scale_K is not None:  # an FP8 cache: centred keys (a per-query constant apart: the same softmax)
    keys = keys * k_scale_K[:, None, None]
  logits = jnp.einsum("akgh,ksh->akgs", q_AKGH.astype(jnp.float32), keys) / math.sqrt(h)
  logits = jnp.where(jnp.arange(s) < length, logits, -jnp.inf)
  mass_KS = jax.nn.softmax(logits, axis=-1).sum(axis=(0, 2))
  r = region_slots(config)
  mass_KR = jax.lax.dynamic_slice_in_dim(mass_KS, start, r, axis=1)
  return jnp.where(jnp.arange(r) >= r - config.decode_window, jnp.inf, mass_KR)


def compact_row(config, cache: KVCache, row, group: int) -> KVCache:
  """`cache` with row `row`'s full decode region compacted to its decode_budget best tokens per KV head."""
  r, keep = region_slots(config), config.decode_budget
  take = lambda x: jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=False)  # noqa: E731
  put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), row, 0)  # noqa: E731
  k_KSH, v_KSH, start, length = take(cache.k), take(cache.v), take(cache.decode_start), take(cache.length)
  n_kv, _, h = k_KSH.shape
  q_AKGH = take(cache.q_recent).reshape(config.decode_window, n_kv, group, h)
  scale = None if cache.k_scale is None else take(cache.k_scale)
  scores_KR = region_scores(config, q_AKGH, k_KSH, length, start, scale)
  idx_KM = jnp.sort(jax.lax.top_k(scores_KR, keep)[1], axis=-1)

  def compact(x_KSH):
    region = jax.lax.dynamic_slice_in_dim(x_KSH, start, r, axis=1)
    kept = jnp.take_along_axis(region, idx_KM[..., None], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(x_KSH, kept, start, axis=1)

  k_KSH, v_KSH = compact(k_KSH), compact(v_KSH)
  new_length = (start + keep).astype(jnp.int32)
  out = dataclasses.replace(cache, k=put(cache.k, k_KSH), v=put(cache.v, v_KSH),
                            length=put(cache.length, new_length))
  if config.uses_kt_pages:
    state = cache.state
    keys = k_KSH.astype(jnp.float32) if scale is None else k_KSH.astype(jnp.float32) * scale[:, None, None]
    kt_min, kt_max = build_kt_pages(keys[None], new_length[None], config.page_size, state.kt_min.dtype,
                                    num_pages=state.kt_min.shape[-1], page_size_B=take(state.row_page_size)[None])
    out = dataclasses.replace(out, state=dataclasses.replace(state, kt_min=put(state.kt_min, kt_min[0]),
                                                             kt_max=put(state.kt_max, kt_max[0])))
  return out
