"""Stage 1: SnapKV with group-wise selection (ALGORITHM.md §2), what `methods/snapkv.py`'s `SnapKVPolicy` runs
(the stage 1 of snapkv, rocketkv and rocketkv_plus).

Per (sequence, KV head): which prompt positions to keep, in ascending position order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rocketkv_jax.budget import check_int, check_tokens
from rocketkv_jax.cache import KVCache, kept_cache
from rocketkv_jax.select import topk_tokens


def snapkv_scores(q_BTNH: jax.Array, k_BTKH: jax.Array, lengths_B: jax.Array, *, window_size: int,
                  kernel_size: int) -> jax.Array:
  """Max-pooled SnapKV votes [B, K, T] float32 for the prefix [0, L - W); -inf elsewhere.

  The last W prompt queries of every query head attend (causally inside the window, softmax over all L
  prompt keys in float32); the prefix columns are summed over the W queries and the G heads of each KV
  head, then max-pooled (kernel `kernel_size`, stride 1, same length, padding never wins). A prefix key holding
  NaN votes NaN (ranked first by `topk_tokens`), and the other votes it made NaN count as 0.
  """
  b, t, n, h = q_BTNH.shape
  n_kv = k_BTKH.shape[2]
  w = window_size
  qpos_BW = lengths_B[:, None] - w + jnp.arange(w)[None, :]
  q_obs = jnp.take_along_axis(q_BTNH, jnp.clip(qpos_BW, 0, t - 1)[:, :, None, None], axis=1)  # [B, W, N, H]
  q_obs = q_obs.reshape(b, w, n_kv, n // n_kv, h)
  logits = jnp.einsum("BWKGH,BTKH->BKGWT", q_obs, k_BTKH, preferred_element_type=jnp.float32)
  logits = logits / np.sqrt(h)
  key_pos = jnp.arange(t)
  causal = key_pos[None, None, :] <= qpos_BW[:, :, None]  # [B, W, T]; implies key < L
  causal = causal[:, None, None]
  probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1, where=causal)
  votes = probs.sum(axis=(2, 3))  # [B, K, T]
  # A key holding NaN makes every vote of its KV head NaN (the softmax's sum): its position keeps NaN, which
  # ranks first (lax.top_k puts NaN above every number), and the others' NaN count as 0, so the cache keeps
  # it and decode gives NaN, as attention over the whole prompt would (not a cache of the first positions).
  nan_key = jnp.isnan(k_BTKH).any(axis=-1).transpose(0, 2, 1)  # [B, K, T]
  votes = jnp.where(jnp.isnan(votes) & ~nan_key, 0.0, votes)
  prefix = key_pos[None, :] < (lengths_B - w)[:, None]  # [B, T]
  votes = jnp.where(prefix[:, None, :], votes, -jnp.inf)
  pad = kernel_size // 2
  return lax.reduce_window(votes, -jnp.inf, lax.max, (1, 1, kernel_size), (1, 1, 1),
                           ((0, 0), (0, 0), (pad, pad)))


def snapkv_keep(q_BTNH, k_BTKH, lengths_B, *, prompt_budget: int, window_size: int, kernel_size: int,
                sink_tokens: int = 0, prompt_budget_B=None) -> tuple[jax.Array, jax.Array]:
  """Prompt positions each KV head keeps: keep [B, K, min(prompt_budget, T)] int32 and the kept count [B].

  A sequence of L <= its budget keeps all of them (slots [0, L), rest junk). A longer one keeps its top
  budget - W prefix tokens by pooled vote (ties toward the lower position; the first `sink_tokens` forced in), in
  ascending order, then the W window tokens. prompt_budget_B [B] int32: each sequence's own budget (at most
  `prompt_budget`, the keep width); None: `prompt_budget` for every sequence. A sequence's selection does not
  depend on the width: its top budget - W are the first of the top prompt_budget - W.
  """
  b, t = q_BTNH.shape[:2]
  n_kv = k_BTKH.shape[2]
  m = min(prompt_budget, t)
  w = window_size
  budget_B = jnp.full((b,), prompt_budget, jnp.int32) if prompt_budget_B is None else \
      jnp.asarray(prompt_budget_B, jnp.int32)
  count = jnp.minimum(lengths_B, budget_B).astype(jnp.int32)
  if t <= prompt_budget and prompt_budget_B is None:  # no sequence can exceed the budget: nothing to evict
    keep = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, n_kv, m))
    return keep, count
  votes = snapkv_scores(q_BTNH, k_BTKH, lengths_B, window_size=w, kernel_size=kernel_size)
  if sink_tokens:
    sink = jnp.arange(t)[None, None, :] < sink_tokens
    votes = jnp.where(sink & jnp.isfinite(votes), jnp.inf, votes)
  prefix_len = lengths_B - w
  top, _ = topk_tokens(votes, prefix_len, max(m - w, 0))  # [B, K, m - W], best first
  # Each sequence's own top budget - W, in ascending position order (the rest pushed past them, then dropped).
  n_top_B = budget_B - w
  j = jnp.arange(top.shape[-1], dtype=jnp.int32)
  top = jnp.sort(jnp.where(j[None, None, :] < n_top_B[:, None, None], top, t), axis=-1)
  # Slot j holds: the j-th kept prefix token below n_top, then the window, then junk (0).
  j = jnp.arange(m, dtype=jnp.int32)[None, None, :]
  n_top = n_top_B[:, None, None]
  window = (lengths_B - w)[:, None, None] + (j - n_top)
  from_top = jnp.take_along_axis(top, jnp.clip(j, 0, max(top.shape[-1] - 1, 0)), axis=-1) if top.shape[-1] \
      else jnp.zeros_like(j)
  snap = jnp.where(j < n_top, from_top, jnp.where(j < n_top + w, window, 0))
  evict = (lengths_B > budget_B)[:, None, None]
  keep = jnp.where(evict, snap, jnp.broadcast_to(j, snap.shape))
  return jnp.broadcast_to(keep, (b, n_kv, m)).astype(jnp.int32), count


# ----------------------------------------------------------------------------- the policy's steps (`SnapKVPolicy`)


def check_config(c) -> None:
  """Checks the stage-1 knobs (prompt_budget, max_new_tokens, window_size, kernel_size, sink_tokens)."""
  check_tokens("prompt_budget", c.prompt_budget)
  check_tokens("max_new_tokens", c.max_new_tokens, 0)
  check_int("window_size", c.window_size)
  check_int("kernel_size", c.kernel_size)
  check_int("sink_tokens", c.sink_tokens, 0)
  if c.kernel_size % 2 == 0:
    raise ValueError(f"kernel_size={c.kernel_size} must be odd (same-length max-pool)")
  if c.prompt_budget < c.window_size:
    raise ValueError(f"prompt_budget={c.prompt_budget} must be >= window_size={c.window_size}")
  if c.sink_tokens > c.prompt_budget - c.window_size:
    raise ValueError(f"sink_tokens={c.sink_tokens} must be <= prompt_budget - window_size = "
                     f"{c.prompt_budget - c.window_size}")


def keep_for(c, q_BTNH, k_BTKH, lengths_B, rows=None):
  """(keep [B, K, M], count [B]): the prompt positions stage 1 keeps with config c's knobs, each sequence at its
  own prompt budget where `rows` (a `RowPlan`) gives one (the keep width is then the capacity: a row planned
  for fewer new tokens keeps more of its prompt)."""
  budget_B = None if rows is None else rows.prompt_budget
  width = c.prompt_budget if budget_B is None else c.capacity
  return snapkv_keep(q_BTNH, k_BTKH, lengths_B.astype(jnp.int32), prompt_budget=width,
                     window_size=c.window_size, kernel_size=c.kernel_size, sink_tokens=c.sink_tokens,
                     prompt_budget_B=budget_B)


def prefill(c, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None) -> KVCache:
  keep, count = keep_for(c, q_BTNH, k_BTKH, lengths_B, rows)
  return kept_cache(c, k_BTKH, v_BTKH, keep, count, lengths_B, rows)


def kept_positions(c, cache, q_BTNH, k_BTKH, lengths_B, rows=None):
  keep, _ = keep_for(c, q_BTNH, k_BTKH, lengths_B, rows)
  return jnp.pad(keep, ((0, 0), (0, 0), (0, cache.capacity - keep.shape[-1])))
