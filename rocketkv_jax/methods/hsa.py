"""hsa: RocketKV's stage 2 (hybrid sparse attention) alone, over the full cache. Its selector, `HSASelector`, is
also rocketkv's and rocketkv_plus's stage 2."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax import ops, stage2
from rocketkv_jax.budget import stage2_pages
from rocketkv_jax.cache import PageState, append_at, append_choosing_at, kv_scales
from rocketkv_jax.methods.base import KeepAll, MethodConfig, TopK, check_budget, kt_itemsize, seq_len


@dataclasses.dataclass(frozen=True)
class HSASelector(TopK):
  """Hybrid sparse attention (ALGORITHM.md §3): the selection (`stage2.select`: pages scored from their key
  min/max over the group's top-`topr` channels, the top `topk` tokens of the best pages, rocketkv's forced pages),
  its read bytes, and the decode step: append, select, attend in one function, each one op (api -> method ->
  ops -> kernel, one visit each). With kernels the append's kernel also makes the channel choice that the
  selection then takes; with XLA the selection's reference makes the same choice itself. Keeps the pages in a
  `PageState`. Only for policies that never evict (the step appends at cache.length)."""

  uses_kt_pages: ClassVar[bool] = True
  scores_channels: ClassVar[bool] = True
  state_class: ClassVar[type] = PageState

  def check(self, config):
    """The top-k knobs, then the forced pages (`stage2.check_forced`: none unless the config has the options)."""
    super().check(config)
    stage2.check_forced(config)

  def select(self, config, cache, q_BKGH, choice=None):
    return stage2.select(config, cache, q_BKGH, choice=choice)

  def score_read_bytes(self, config, length, *, head_dim, itemsize):
    return stage2.score_read_bytes(config, length, kt_itemsize=kt_itemsize(config, itemsize))

  def decode(self, config, cache, q_BKGH, k_new_BKH, v_new_BKH):
    """The step of `Selector.decode` with `TopK.attend` (append at cache.length, exact attention over the
    selection), the same ops in the same order, written out so a step enters this module once."""
    # With kernels, the choice kernel's launch is folded into the append's, and the scoring takes the gather
    # layout at every batch: the same selection as append-then-select (tests/core/test_methods.py). H200, 32k,
    # t=256, RocketKV's decode step at batch 8 5.054 / 5.098 ms against 5.133 / 5.187 with the scoring's own
    # choice in two runs, batch 1 4.814 / 4.932 against 4.813 / 5.099 (benchmarks/results/stage2_h200_2026-12-02d/).
    slot = cache.length  # `Policy.next_slot`: these methods never evict
    if ops.uses_kernels(config.impl):
      cache, choice = append_choosing_at(cache, k_new_BKH, v_new_BKH, slot, config, q_BKGH,
                                         stage2.topr(config, q_BKGH))
    else:  # the reference makes the choice inside `ops.hsa_select`
      cache, choice = append_at(cache, k_new_BKH, v_new_BKH, slot, config), None
    idx, valid = stage2.select(config, cache, q_BKGH, choice=choice)
    out = ops.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=config.impl, **kv_scales(cache))
    return out, cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSAConfig(MethodConfig):
  """Hybrid sparse attention (RocketKV's stage 2) alone, over the full cache."""

  method: ClassVar[str] = "hsa"
  policy: ClassVar[KeepAll] = KeepAll()
  selector: ClassVar[HSASelector] = HSASelector()
  # rocketkv's forced pages (fields there) are not an option of hsa: none, declared so the selection reads them
  hsa_sink_tokens: ClassVar[int] = 0
  hsa_recent_tokens: ClassVar[int] = 0
  row_fields: ClassVar[tuple[str, ...]] = ("topr", "page_size")
  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int
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
