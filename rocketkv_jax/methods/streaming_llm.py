"""streaming_llm: the first `sink_tokens` tokens plus a ring of the most recent ones, dense attention."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from rocketkv_jax.cache import kept_cache
from rocketkv_jax.methods.base import Dense, FixedCache, MethodConfig, check_int, seq_len


@dataclasses.dataclass(frozen=True)
class StreamingLLMPolicy(FixedCache):
  """The first `sink_tokens` tokens plus a ring of the most recent `token_budget - sink_tokens` (new token
  included): a token's slot is a function of its position (`slot_of`)."""

  def check(self, config):
    super().check(config)
    check_int("sink_tokens", config.sink_tokens, 0)
    if config.sink_tokens >= config.token_budget:
      raise ValueError(f"sink_tokens={config.sink_tokens} must be < token_budget={config.token_budget}")

  def slot_of(self, config, pos_B):
    """Slot of the token at absolute position `pos`: sinks first, then a ring over the recent tokens."""
    sink, ring = config.sink_tokens, config.capacity - config.sink_tokens
    return jnp.where(pos_B < sink, pos_B, sink + (pos_B - sink) % ring).astype(jnp.int32)

  def prefill(self, config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None):
    del q_BTNH
    keep = self.kept_positions(config, None, None, k_BTKH, lengths_B)
    return kept_cache(config, k_BTKH, v_BTKH, keep, jnp.minimum(lengths_B, config.capacity), lengths_B, rows)

  def kept_positions(self, config, cache, q_BTNH, k_BTKH, lengths_B, rows=None):
    """Position held by each slot after the prompt: slot = slot_of(position)."""
    del cache, q_BTNH, rows
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

  def next_slot(self, config, cache):
    return self.slot_of(config, cache.pos)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLMConfig(MethodConfig):
  """The first `sink_tokens` tokens plus the most recent `token_budget - sink_tokens` (new token included)."""

  method: ClassVar[str] = "streaming_llm"
  policy: ClassVar[StreamingLLMPolicy] = StreamingLLMPolicy()
  selector: ClassVar[Dense] = Dense()
  token_budget: int
  sink_tokens: int = 4

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    seq_len(prompt_len, max_new_tokens, max_len)
    return cls(**{"token_budget": token_budget, **kw})
