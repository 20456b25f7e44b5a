"""Stage 1: SnapKV with group-wise selection (ALGORITHM.md §2), shared by the snapkv and rocketkv methods.

Per (sequence, KV head): which prompt positions to keep, in ascending position order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rocketkv_jax.budget import check_int
from rocketkv_jax.cache import KVCache, kept_cache
from rocketkv_jax.select import topk_tokens


def snapkv_scores(q_BTNH: jax.Array, k_BTKH: jax.Array, lengths_B: jax.Array, *, window_size: int,
                  kernel_size: int) -> jax.Array:
  """Max-pooled SnapKV votes [B, K, T] float32 for the prefix [0, L - W); -inf elsewhere.

  The last W prompt queries of every query head attend (causally inside the window, softmax over all L
  prompt keys in float32); the prefix columns are summed over the W queries and the G heads of each KV
  head, then max-pooled (kernel `kernel_size`, stride 1, same length, padding never wins).
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
  prefix = key_pos[None, :] < (lengths_B - w)[:, None]  # [B, T]
  votes = jnp.where(prefix[:, None, :], votes, -jnp.inf)
  pad = kernel_size // 2
  return lax.reduce_window(votes, -jnp.inf, lax.max, (1, 1, kernel_size), (1, 1, 1),
                           ((0, 0), (0, 0), (pad, pad)))


def snapkv_keep(q_BTNH, k_BTKH, lengths_B, *, prompt_budget: int, window_size: int, kernel_size: int,
                sink_tokens: int = 0) -> tuple[jax.Array, jax.Array]:
  """Prompt positions each KV head keeps: keep [B, K, prompt_budget] int32 and the kept count [B].

  A sequence of L <= prompt_budget tokens keeps all of them (slots [0, L), rest junk). A longer one keeps
  its top prompt_budget - W prefix tokens by pooled vote (ties toward the lower position; the first
  `sink_tokens` forced in), in ascending order, then the W window tokens.
  """
  b, t = q_BTNH.shape[:2]
  n_kv = k_BTKH.shape[2]
  m = min(prompt_budget, t)
  w = window_size
  if t <= prompt_budget:  # no sequence can exceed the budget: nothing to evict
    keep = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, n_kv, m))
    return keep, jnp.minimum(lengths_B, m).astype(jnp.int32)
  votes = snapkv_scores(q_BTNH, k_BTKH, lengths_B, window_size=w, kernel_size=kernel_size)
  if sink_tokens:
    sink = jnp.arange(t)[None, None, :] < sink_tokens
    votes = jnp.where(sink & jnp.isfinite(votes), jnp.inf, votes)
  prefix_len = lengths_B - w
  top, _ = topk_tokens(votes, prefix_len, m - w)
  top = jnp.sort(top, axis=-1)
  window = (lengths_B - w)[:, None, None] + jnp.arange(w, dtype=jnp.int32)
  snap = jnp.concatenate([top, jnp.broadcast_to(window, (b, n_kv, w))], axis=-1)
  evict = (lengths_B > prompt_budget)[:, None, None]
  keep = jnp.where(evict, snap, jnp.arange(m, dtype=jnp.int32))
  return keep.astype(jnp.int32), jnp.minimum(lengths_B, m).astype(jnp.int32)


# ----------------------------------------------------------------------------- the methods' stage 1 (snapkv, rocketkv)


def check_config(c) -> None:
  """Checks the stage-1 knobs (prompt_budget, max_new_tokens, window_size, kernel_size, sink_tokens)."""
  check_int("prompt_budget", c.prompt_budget)
  check_int("max_new_tokens", c.max_new_tokens, 0)
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


def keep_for(c, q_BTNH, k_BTKH, lengths_B):
  """(keep [B, K, M], count [B]): the prompt positions stage 1 keeps with config c's knobs."""
  return snapkv_keep(q_BTNH, k_BTKH, lengths_B.astype(jnp.int32), prompt_budget=c.prompt_budget,
                     window_size=c.window_size, kernel_size=c.kernel_size, sink_tokens=c.sink_tokens)


def prefill(c, q_BTNH, k_BTKH, v_BTKH, lengths_B) -> KVCache:
  keep, count = keep_for(c, q_BTNH, k_BTKH, lengths_B)
  return kept_cache(c, k_BTKH, v_BTKH, keep, count, lengths_B)


def kept_positions(c, cache, q_BTNH, k_BTKH, lengths_B):
  keep, _ = keep_for(c, q_BTNH, k_BTKH, lengths_B)
  return jnp.pad(keep, ((0, 0), (0, 0), (0, cache.capacity - keep.shape[-1])))
