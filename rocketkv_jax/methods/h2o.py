"""h2o: heavy hitters by accumulated attention plus a recent window, evicting one token per step once full."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rocketkv_jax.cache import KVCache, append_at, kept_cache, read_keys, read_values, slot_valid
from rocketkv_jax.methods.base import Dense, FixedCache, MethodConfig, check_int, prefix_keep, seq_len
from rocketkv_jax.select import attention_probs, topk_tokens


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class H2OState:
  """H2O's cache state (KVCache.state), kept by its policy (`H2OPolicy`): what its eviction reads.

  scores: [B, K, S] float32 attention each slot's token has accumulated (prompt queries at prefill, then every
    step's, summed over the KV group's query heads); a new token starts at 0.
  positions: [B, K, S] int32 absolute position of each slot's token (the recent window is protected by it).
  """

  scores: jax.Array
  positions: jax.Array


@dataclasses.dataclass(frozen=True)
class H2OPolicy(FixedCache):
  """H2O's stage 1: prefill keeps the heavy hitters by accumulated attention plus the config's `recent_tokens`
  most recent tokens; once the cache is full, each step's token overwrites the lowest accumulated score outside
  the recent window. Keeps an `H2OState`, whose scores its selector (`H2OSelector`) accumulates."""

  state_class: ClassVar[type] = H2OState

  def check(self, config):
    super().check(config)
    if config.recent is not None:
      check_int("recent", config.recent, 1)
      if config.recent >= config.token_budget:
        raise ValueError(f"recent={config.recent} must be < token_budget={config.token_budget}")

  def state_shapes(self, config, batch, n_kv_heads, head_dim):
    return {"state.scores": (batch, n_kv_heads, config.capacity), "state.positions": (batch, n_kv_heads,
                                                                                       config.capacity)}

  def prompt_queries(self, config):
    return None  # accumulated attention of every prompt query

  def prefill(self, config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None) -> KVCache:
    cap, recent = config.capacity, config.recent_tokens
    b, t, n_kv, _ = k_BTKH.shape
    acc_BKT = h2o_prefill_scores(q_BTNH, k_BTKH, lengths_B)
    m = min(cap, t)
    if t <= cap:
      keep = prefix_keep(k_BTKH, cap)
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
    return kept_cache(config, k_BTKH, v_BTKH, keep, count, lengths_B, rows, scores=jnp.pad(scores, pad),
                      positions=jnp.pad(positions, pad))

  def kept_positions(self, config, cache, q_BTNH, k_BTKH, lengths_B, rows=None):
    del q_BTNH, k_BTKH, lengths_B, rows
    return cache.state.positions

  def next_slot(self, config, cache):
    """Once full, the lowest accumulated score outside the recent window (first minimum: the lower slot);
    before that, slot `length`. Per KV head: [B, K]."""
    full = (cache.length >= config.capacity)[:, None]
    state = cache.state
    protected = state.positions > (cache.pos - config.recent_tokens)[:, None, None]  # among the `recent` newest
    victim = jnp.argmin(jnp.where(protected, jnp.inf, state.scores), axis=-1).astype(jnp.int32)
    return jnp.where(full, victim, cache.length[:, None]).astype(jnp.int32)

  def append(self, config, cache, k_new_BKH, v_new_BKH):
    """Evict (once full): the slot's token gives way to the new one, whose score starts at 0."""
    slot_BK = self.next_slot(config, cache)
    b, k = np.indices(slot_BK.shape, sparse=True)
    old = cache.state
    new_pos = jnp.broadcast_to(cache.pos[:, None], slot_BK.shape)
    state = H2OState(positions=old.positions.at[b, k, slot_BK].set(new_pos),
                     scores=old.scores.at[b, k, slot_BK].set(0.0))
    cache = dataclasses.replace(cache, state=state)
    return append_at(cache, k_new_BKH, v_new_BKH, slot_BK, config)


@dataclasses.dataclass(frozen=True)
class H2OSelector(Dense):
  """H2O's stage 2: dense attention (in XLA: the step needs its probabilities), whose probabilities, summed over
  the group, the step adds to the policy's accumulated scores (`H2OState.scores`)."""

  def decode(self, config, cache, q_BKGH, k_new_BKH, v_new_BKH):
    """Evict (once full), write the new token there, attend densely, and add this step's probabilities
    (summed over the group) to the scores."""
    cache = self.append(config, cache, k_new_BKH, v_new_BKH)
    probs = attention_probs(q_BKGH, read_keys(cache), cache.length)  # [B, K, G, S]
    valid = slot_valid(cache.length, cache.capacity)[:, None, :, None]
    v = read_values(cache)
    v = jnp.where(valid, v, jnp.zeros((), v.dtype))
    out = jnp.einsum("BKGS,BKSH->BKGH", probs, v.astype(jnp.float32), precision="highest").astype(q_BKGH.dtype)
    state = dataclasses.replace(cache.state, scores=cache.state.scores + probs.sum(2))
    return out, dataclasses.replace(cache, state=state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2OConfig(MethodConfig):
  """Heavy hitters by accumulated attention plus the `recent` most recent tokens; cache of `token_budget`
  slots, evicting one token per decode step once full. `recent` defaults to token_budget // 2.

  The cache's state: `H2OState` (accumulated attention and each slot's absolute position)."""

  method: ClassVar[str] = "h2o"
  policy: ClassVar[H2OPolicy] = H2OPolicy()
  selector: ClassVar[H2OSelector] = H2OSelector()
  token_budget: int
  recent: int | None = None

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    seq_len(prompt_len, max_new_tokens, max_len)
    return cls(**{"token_budget": token_budget, **kw})

  @property
  def recent_tokens(self) -> int:
    return self.token_budget // 2 if self.recent is None else self.recent
