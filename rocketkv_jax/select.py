"""Selection primitives shared by every method: top-k tokens, top-k tokens from page scores, the group's
top-r channels and SparQ/HSA's temperature. Ties always break toward the lower slot (or channel) index."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax.cache import slot_valid

# Up to this many cache slots, top-k over pages runs as one top_k over the broadcast slot scores; above it,
# over the best pages only (same result, less work on long full caches).
DIRECT_TOPK_MAX_SLOTS = 16384


def topk_tokens(scores_BKS: jax.Array, length_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The `k` valid slots with the highest score per (sequence, KV head); ties toward the lower slot.

  Returns idx [B, K, M] int32 and valid [B, K, M] with M = min(k, S); entries past the valid count are
  marked invalid (their idx points at some slot and must be ignored).
  """
  num_slots = scores_BKS.shape[-1]
  m = min(k, num_slots)
  valid_BS = slot_valid(length_B, num_slots)
  masked = jnp.where(valid_BS[:, None, :], scores_BKS.astype(jnp.float32), -jnp.inf)
  _, idx = lax.top_k(masked, m)  # lax.top_k is stable: equal values keep index order.
  valid = idx < length_B[:, None, None]
  return idx.astype(jnp.int32), valid


def topk_tokens_from_pages(page_scores_BKP: jax.Array, length_B: jax.Array, page_size: int, k: int,
                           num_slots: int) -> tuple[jax.Array, jax.Array]:
  """Top `k` tokens when every slot of a page scores its page's score; ties toward the lower slot.

  Equal to `topk_tokens` on the broadcast per-slot scores, but it only expands the best
  ceil(k / page_size) + 1 pages: valid slots are a prefix, so at most one chosen page is partial.
  """
  num_pages = page_scores_BKP.shape[-1]
  m = min(k, num_slots)
  if num_slots <= DIRECT_TOPK_MAX_SLOTS:  # fewer kernels: broadcast to slots, one top_k
    slot_scores = jnp.repeat(page_scores_BKP, page_size, axis=-1)[..., :num_slots]
    return topk_tokens(slot_scores, length_B, m)
  n_pages = min(num_pages, -(-m // page_size) + 1)
  page_valid = jnp.arange(num_pages)[None, :] * page_size < length_B[:, None]
  page_scores = jnp.where(page_valid[:, None, :], page_scores_BKP.astype(jnp.float32), -jnp.inf)
  _, pages = lax.top_k(page_scores, n_pages)
  pages = jnp.sort(pages, axis=-1)  # candidates in ascending slot order keep the lower-slot tie-break
  cand_scores = jnp.take_along_axis(page_scores, pages, axis=-1)
  slots = (pages[..., None] * page_size + jnp.arange(page_size)).reshape(*pages.shape[:2], -1)
  cand = jnp.repeat(cand_scores, page_size, axis=-1)
  in_range = slots < jnp.minimum(length_B, num_slots)[:, None, None]
  cand = jnp.where(in_range, cand, -jnp.inf)
  _, j = lax.top_k(cand, min(m, cand.shape[-1]))
  idx = jnp.take_along_axis(slots, j, axis=-1)
  valid = jnp.take_along_axis(in_range, j, axis=-1)
  idx = jnp.where(valid, idx, 0)
  return idx.astype(jnp.int32), valid


def group_channels(q_BKGH: jax.Array, r: int) -> jax.Array:
  """The group's top-r channels of sum_g |q_g| (ties toward the lower channel): [B, K, R] int32, best first.

  Equal to lax.top_k, without its sort (a sort costs about 16 us per layer on an H200 whatever its
  size): each channel's rank counts the channels that beat it, and position j takes the channel of
  rank j. Two small fusions over [B, K, H, H].
  """
  # The barrier makes both sides of the comparison read one materialised `a`. Without it the ranks came out
  # wrong inside a jitted step on the GPU (not eagerly, not on CPU); likely XLA recomputing the reduction in
  # each consumer fusion with different rounding. benchmarks/diag_gpu.py --api checks it.
  a = jax.lax.optimization_barrier(jnp.abs(q_BKGH.astype(jnp.float32)).sum(axis=2))  # [B, K, H]
  c = jnp.arange(a.shape[-1], dtype=jnp.int32)
  a_i, a_j = a[..., :, None], a[..., None, :]
  beats = (a_j > a_i) | ((a_j == a_i) & (c[None, :] < c[:, None]))  # channel j ranks before channel i
  rank = beats.sum(axis=-1, dtype=jnp.int32)  # [B, K, H], a permutation of 0..H-1
  at = rank[..., :, None] == jnp.arange(r, dtype=jnp.int32)  # [B, K, H, R]
  return jnp.where(at, c[:, None], 0).sum(axis=-2, dtype=jnp.int32)


def sparq_temperature(q_BKGH: jax.Array, channels_BKR: jax.Array) -> jax.Array:
  """tau_g = sqrt(d * |q_g[channels]|_1 / |q_g|_1) per query head: [B, K, G] float32."""
  qa = jnp.abs(q_BKGH.astype(jnp.float32))
  sel = jnp.take_along_axis(qa, channels_BKR[:, :, None, :], axis=-1).sum(-1)
  return jnp.sqrt(q_BKGH.shape[-1] * sel / qa.sum(-1))
