"""exact_topk: the oracle. Exact attention scores pick the top-k tokens, then exact attention over them."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from rocketkv_jax.cache import read_keys
from rocketkv_jax.methods.base import KeepAll, MethodConfig, TopK, check_budget, kv_itemsize, seq_len
from rocketkv_jax.select import attention_probs, topk_tokens


@dataclasses.dataclass(frozen=True)
class ExactTopKSelector(TopK):
  """Stage 2 of the oracle: the top `topk` slots by exact attention probability."""

  def select(self, config, cache, q_BKGH):
    """The top `topk` slots by the group's mean attention probability. A key holding NaN makes every
    probability of its heads NaN (the softmax's sum); its slot is ranked first (NaN, which lax.top_k puts above
    every number) and the others' NaN taken as 0, so the step attends it and gives NaN, as exact attention
    over every key would (`jax.nn.dot_product_attention`), not an output of the first slots alone."""
    scores = attention_probs(q_BKGH, read_keys(cache), cache.length).mean(axis=2)
    nan_key = jnp.isnan(cache.k).any(axis=-1)  # [B, K, S]
    scores = jnp.where(jnp.isnan(scores) & ~nan_key, 0.0, scores)
    return topk_tokens(scores, cache.length, config.topk)

  def score_read_bytes(self, config, length, *, head_dim, itemsize):
    return length * head_dim * kv_itemsize(config, itemsize)  # every key


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactTopKConfig(MethodConfig):
  """Oracle: exact attention scores (group mean of per-head softmax), exact attention over the top `topk`."""

  method: ClassVar[str] = "exact_topk"
  policy: ClassVar[KeepAll] = KeepAll()
  selector: ClassVar[ExactTopKSelector] = ExactTopKSelector()
  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int
  topk: int

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    check_budget(token_budget)
    return cls(**{"max_len": seq_len(prompt_len, max_new_tokens, max_len), "topk": token_budget, **kw})
