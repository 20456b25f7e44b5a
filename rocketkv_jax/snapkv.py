"""Stage 1: SnapKV with group-wise selection (ALGORITHM.md §2), and H2O's prefill scores.

Both return, per (sequence, KV head), which prompt positions to keep, in ascending position order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


def h2o_prefill_scores(q_BTNH, k_BTKH, lengths_B, *, block: int = 256) -> jax.Array:
  """Accumulated causal attention [B, K, T] float32 each prompt key received from every prompt query of its
  KV head's group. Query blocks are scanned, so [T, T] scores are never materialized."""
  b, t, n, h = q_BTNH.shape
  n_kv = k_BTKH.shape[2]
  g = n // n_kv
  nb = -(-t // block)
  qp = jnp.pad(q_BTNH, ((0, 0), (0, nb * block - t), (0, 0), (0, 0)))
  qp = qp.reshape(b, nb, block, n_kv, g, h).transpose(1, 0, 2, 3, 4, 5)
  key_pos = jnp.arange(t)

  def body(acc, xs):
    i, q_blk = xs
    qpos = i * block + jnp.arange(block)
    s = jnp.einsum("BQKGH,BTKH->BKGQT", q_blk, k_BTKH, preferred_element_type=jnp.float32) / np.sqrt(h)
    mask = (key_pos[None, :] <= qpos[:, None])[None] & (qpos[None, :, None] < lengths_B[:, None, None])
    mask = mask[:, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1, where=mask)
    return acc + jnp.where(mask, p, 0.0).sum(axis=(2, 3)), None

  acc, _ = lax.scan(body, jnp.zeros((b, n_kv, t), jnp.float32), (jnp.arange(nb), qp))
  return acc
