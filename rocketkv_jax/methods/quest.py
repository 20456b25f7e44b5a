"""quest: no eviction; pages scored by the upper bound of q.k over their key min/max, top-k tokens attended."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from rocketkv_jax import ops
from rocketkv_jax.cache import PageState
from rocketkv_jax.methods.base import KeepAll, MethodConfig, TopK, check_budget, kt_itemsize, seq_len


@dataclasses.dataclass(frozen=True)
class QuestSelector(TopK):
  """Quest's stage 2: pages of `page_size` slots scored by the upper bound over all channels of the page key
  min/max, summed over the query heads of a KV group; the top `topk` tokens of the best pages. Keeps the pages in
  a `PageState` (row_topr None: every channel scores)."""

  uses_kt_pages: ClassVar[bool] = True
  state_class: ClassVar[type] = PageState

  def page_scores(self, config, cache, q_BKGH):
    """Quest's upper bound per page, sum_c max(q_c k_min_c, q_c k_max_c), summed over the group's heads."""
    del config
    qf = q_BKGH.astype(jnp.float32)[..., None]  # [B, K, G, H, 1]
    lo = cache.state.kt_min.astype(jnp.float32)[:, :, None]
    hi = cache.state.kt_max.astype(jnp.float32)[:, :, None]
    return jnp.maximum(qf * lo, qf * hi).sum(axis=(2, 3))  # [B, K, P]

  def select(self, config, cache, q_BKGH):
    idx = ops.page_topk(self.page_scores(config, cache, q_BKGH), cache.length, page_size=config.page_size,
                        k=config.topk, num_slots=cache.capacity, impl=config.impl,
                        page_size_B=cache.state.row_page_size)
    return idx, ops.prefix_valid(idx, cache.length)

  def score_read_bytes(self, config, length, *, head_dim, itemsize):
    return math.ceil(length / config.page_size) * 2 * head_dim * kt_itemsize(config, itemsize)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuestConfig(MethodConfig):
  """Quest: no eviction; pages of `page_size` slots scored by the upper bound over all channels of the
  page key min/max, summed over the query heads of a KV group; exact attention over the top `topk` tokens
  of the best pages."""

  method: ClassVar[str] = "quest"
  policy: ClassVar[KeepAll] = KeepAll()
  selector: ClassVar[QuestSelector] = QuestSelector()
  row_fields: ClassVar[tuple[str, ...]] = ("page_size",)
  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int
  page_size: int
  topk: int
  kt_cache_dtype: str | None = None
  kt_pages: int | None = None

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    check_budget(token_budget)
    s = seq_len(prompt_len, max_new_tokens, max_len)
    # One page's min+max costs one KV pair of traffic: S / P pages read = half the budget.
    return cls(**{"max_len": s, "page_size": math.ceil(2 * s / token_budget), "topk": token_budget // 2, **kw})
