"""hsa: RocketKV's stage 2 (hybrid sparse attention) alone, over the full cache."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax import ops, stage2
from rocketkv_jax.budget import stage2_pages
from rocketkv_jax.cache import PageState, kv_scales
from rocketkv_jax.methods.base import (KeepAllConfig, SelectingMixin, append_at, append_choosing_at, check_budget,
                                       kt_itemsize, seq_len)


class HSAStage2Mixin:
  """What the methods whose stage 2 is HSA (hsa, rocketkv, rocketkv_plus) share: the selection (`stage2.select`),
  its read bytes, and the decode step: append, select, attend in one function, each one op (api -> method ->
  ops -> kernel, one visit each). With kernels the append's kernel also makes the channel choice that the
  selection then takes; with XLA the selection's reference makes the same choice itself."""

  def select(self, cache, q_BKGH, choice=None):
    return stage2.select(self, cache, q_BKGH, choice=choice)

  def score_read_bytes(self, length, *, head_dim, itemsize):
    return stage2.score_read_bytes(self, length, kt_itemsize=kt_itemsize(self, itemsize))

  def decode(self, cache, q_BKGH, k_new_BKH, v_new_BKH):
    """The step of `MethodConfig.decode` with `SelectingMixin.attend` (append at cache.length, exact attention
    over the selection), the same ops in the same order, written out so a step enters this module once."""
    # With kernels, the choice kernel's launch is folded into the append's, and the scoring takes the gather
    # layout at every batch: the same selection as append-then-select (tests/core/test_methods.py). H200, 32k,
    # t=256, RocketKV's decode step at batch 8 5.054 / 5.098 ms against 5.133 / 5.187 with the scoring's own
    # choice in two runs, batch 1 4.814 / 4.932 against 4.813 / 5.099 (benchmarks/results/stage2_h200_2026-12-02d/).
    slot = cache.length  # `next_slot`: these methods never evict
    if ops.uses_kernels(self.impl):
      cache, choice = append_choosing_at(cache, k_new_BKH, v_new_BKH, slot, self, q_BKGH, stage2.topr(self, q_BKGH))
    else:  # the reference makes the choice inside `ops.hsa_select`
      cache, choice = append_at(cache, k_new_BKH, v_new_BKH, slot, self), None
    idx, valid = stage2.select(self, cache, q_BKGH, choice=choice)
    out = ops.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=self.impl, **kv_scales(cache))
    return out, cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSAConfig(HSAStage2Mixin, SelectingMixin, KeepAllConfig):
  """Hybrid sparse attention (RocketKV's stage 2) alone, over the full cache."""

  method: ClassVar[str] = "hsa"
  uses_kt_pages: ClassVar[bool] = True
  scores_channels: ClassVar[bool] = True
  # rocketkv's forced pages (fields there) are not an option of hsa: none, declared so the selection reads them
  hsa_sink_tokens: ClassVar[int] = 0
  hsa_recent_tokens: ClassVar[int] = 0
  row_fields: ClassVar[tuple[str, ...]] = ("topr", "page_size")
  state_class: ClassVar[type] = PageState
  page_size: int
  topr: int
  topk: int
  kt_cache_dtype: str | None = None
  kt_pages: int | None = None

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    check_budget(token_budget)
    s = seq_len(prompt_len, max_new_tokens, max_len)
    page_size, topr = stage2_pages(max(1.0, s / token_budget), head_dim)  # no stage-1 share: c2 = c
    return cls(**{"max_len": s, "page_size": page_size, "topr": topr, "topk": token_budget // 2, **kw})
