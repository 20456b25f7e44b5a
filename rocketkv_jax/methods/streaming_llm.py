"""streaming_llm: the first `sink_tokens` tokens plus a ring of the most recent ones, dense attention."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from rocketkv_jax.cache import kept_cache
from rocketkv_jax.methods.base import FixedCacheConfig, check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLMConfig(FixedCacheConfig):
  """The first `sink_tokens` tokens plus the most recent `token_budget - sink_tokens` (new token included)."""

  method: ClassVar[str] = "streaming_llm"
  sink_tokens: int = 4

  def __post_init__(self):
    super().__post_init__()
    check_int("sink_tokens", self.sink_tokens, 0)
    if self.sink_tokens >= self.token_budget:
      raise ValueError(f"sink_tokens={self.sink_tokens} must be < token_budget={self.token_budget}")

  def slot_of(self, pos_B):
    """Slot of the token at absolute position `pos`: sinks first, then a ring over the recent tokens."""
    sink, ring = self.sink_tokens, self.capacity - self.sink_tokens
    return jnp.where(pos_B < sink, pos_B, sink + (pos_B - sink) % ring).astype(jnp.int32)

  def prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None):
    del q_BTNH
    keep = self.kept_positions(None, None, k_BTKH, lengths_B)
    return kept_cache(self, k_BTKH, v_BTKH, keep, jnp.minimum(lengths_B, self.capacity), lengths_B, rows)

  def kept_positions(self, cache, q_BTNH, k_BTKH, lengths_B):
    """Position held by each slot after the prompt: slot = slot_of(position)."""
    del cache, q_BTNH
    b, t, n_kv, _ = k_BTKH.shape
    cap, sink = self.capacity, self.sink_tokens
    ring = cap - sink
    j = jnp.arange(cap, dtype=jnp.int32)[None, :]
    base = (lengths_B - ring)[:, None]  # first recent position kept
    first_slot = sink + (base - sink) % ring
    recent_pos = base + (j - first_slot) % ring
    keep = jnp.where((j < sink) | (lengths_B[:, None] <= cap), j, recent_pos)
    keep = jnp.clip(keep, 0, t - 1)[:, None, :]
    return jnp.broadcast_to(keep, (b, n_kv, cap)).astype(jnp.int32)

  def next_slot(self, cache):
    return self.slot_of(cache.pos)
