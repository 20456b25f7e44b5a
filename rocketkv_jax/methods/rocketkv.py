"""rocketkv: stage 1 (SnapKV with group-wise selection, at prefill) then stage 2 (HSA, every decode step)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax.budget import check_int, decode_budget_plan, plan_budget, stage2_replan
from rocketkv_jax.methods.base import MethodConfig
from rocketkv_jax.methods.hsa import HSASelector
from rocketkv_jax.methods.snapkv import SnapKVPolicy, decode_room

DEFAULT_WINDOW = 32  # SnapKV's observation window (ALGORITHM.md §2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RocketKVConfig(MethodConfig):
  """RocketKV: snapkv's stage 1 (`SnapKVPolicy`) then hsa's stage 2 (`HSASelector`). Stage 1 keeps
  `prompt_budget` prompt tokens per KV head (SnapKV, window `window_size`, max-pool `kernel_size`, optional
  `sink_tokens` forced in); stage 2 (HSA) attends to the top `topk` tokens per step, scored from page min/max
  (`page_size` slots per page) over the top `topr` channels.
  `kt_cache_dtype`: None (the keys' dtype; "float8_e5m2" when K/V are FP8: `MethodConfig.kt_storage`),
  "bfloat16", "float8_e5m2" or "float32".

  Variant options (this project's extension, docs/ALGORITHM.md; the defaults are the paper's method):
    hsa_sink_tokens, hsa_recent_tokens: stage 2 always attends the pages holding the first `hsa_sink_tokens`
      slots and the last `hsa_recent_tokens` valid slots, inside `topk` (the same traffic: these pages are
      scored anyway). Slots, not positions: slot 0 holds position 0 only if stage 1 keeps it (`sink_tokens`).
    plan_page_size, plan_topk: inputs of `from_budget`'s plan. Stage 2 uses this page size and/or top-k, and
      top-r becomes the most channels whose step reads no more than the paper plan's (`budget.stage2_replan`).
      Ignored when the config is built directly (topk, topr, page_size are then as given).

  NaN: a step that attends a key holding NaN outputs NaN (its query heads'), as `jax.nn.dot_product_attention`
  does; stage 1 ranks a NaN key first, so it keeps it. Which tokens stage 2 attends once a NaN key is in the
  cache is unspecified: a page holding it has NaN min/max summaries, which make every HSA page score of its
  heads NaN, so when `topk` is below the cache's length the NaN key may or may not be attended (the output is
  then NaN or the attention over the tokens picked). full and exact_topk always attend it, snapkv whenever
  its stage 1 keeps it (any prompt budget above the window)."""

  method: ClassVar[str] = "rocketkv"
  policy: ClassVar[SnapKVPolicy] = SnapKVPolicy()
  selector: ClassVar[HSASelector] = HSASelector()
  plan_fields: ClassVar[tuple[str, ...]] = ("window_size", "plan_page_size", "plan_topk")
  row_fields: ClassVar[tuple[str, ...]] = ("prompt_budget", "topr", "page_size")
  # window_size: min(32, prompt length); a shorter window only ever belongs to a prompt that stage 1 keeps whole
  size_fields: ClassVar[tuple[str, ...]] = ("max_new_tokens", "window_size")
  prompt_budget: int
  max_new_tokens: int
  topk: int
  topr: int
  page_size: int
  window_size: int = DEFAULT_WINDOW
  kernel_size: int = 63
  kt_cache_dtype: str | None = None
  sink_tokens: int = 0
  hsa_sink_tokens: int = 0
  hsa_recent_tokens: int = 0
  plan_page_size: int | None = None
  plan_topk: int | None = None
  kt_pages: int | None = None

  def __post_init__(self):
    super().__post_init__()  # the policy's knobs (stage 1), then the selector's (top-k, forced pages)
    for name in ("plan_page_size", "plan_topk"):
      if getattr(self, name) is not None:
        check_int(name, getattr(self, name))

  @classmethod
  def limit_rows(cls, max_prompt_len, max_new_tokens, max_len):
    """The plan depends on the request only through its S (the stage-1 capacity int(S / c**r)), or through
    min(2 * max_new_tokens, S) where that is larger (ALGORITHM.md §1); its stage 2 depends on the capacity alone.
    So: one row per S with one new token (capacity int(S / c**r)), one per capacity up to 2 * max_new_tokens
    (S = that capacity, half of it new), and the longest request (the most new tokens)."""
    s_max = max_prompt_len + max_new_tokens if max_len is None else min(max_len, max_prompt_len + max_new_tokens)
    rows = [(s - 1, 1) for s in range(2, s_max + 1)]
    rows += [(c // 2, c - c // 2) for c in range(2, min(2 * max_new_tokens, s_max) + 1)]
    if max_new_tokens > 1:  # with a decode budget the plan depends on the prompt's length alone: each with the most
      rows += [(n, max_new_tokens) for n in range(1, max_prompt_len + 1)]  # new tokens
    return rows + [(max_prompt_len, max_new_tokens)]

  @classmethod
  def _batch_of(cls, configs, fields):
    """Slots for the row that needs the most (its prompt budget + its new tokens), not the largest prompt
    budget plus the most new tokens (rows planned for fewer new tokens keep more of their prompt)."""
    fields["prompt_budget"] = max(c.capacity for c in configs) - decode_room(cls(**fields))
    return super()._batch_of(configs, fields)

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, window_size=None,
                  **kw):
    """The plan of ALGORITHM.md §1. The window defaults to 32 tokens, or the whole prompt when it is shorter
    (the observation window cannot exceed the prompt). `kw` take the place of planned values; with an explicit
    prompt_budget the plan's own prompt budget is not checked against the window (the config checks yours)."""
    if window_size is None:
      window_size = min(DEFAULT_WINDOW, prompt_len) if isinstance(prompt_len, int) and prompt_len >= 1 \
          else DEFAULT_WINDOW
    if kw.get("decode_budget") is None:
      plan = plan_budget(token_budget, prompt_len, max_new_tokens, head_dim, max_len=max_len,
                         window_size=1 if "prompt_budget" in kw else window_size)
    else:  # the output no longer counts in the prompt's compression (docs/ALGORITHM.md §4b)
      plan = decode_budget_plan(token_budget, prompt_len, max_new_tokens, head_dim, max_len=max_len,
                                window_size=1 if "prompt_budget" in kw else window_size,
                                region=kw["decode_budget"] + kw.get("decode_buffer", cls.decode_buffer))
    page_size, topr, topk = plan.page_size, plan.top_r, plan.top_k
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # a subclass's defaults plan too
    plan_page_size = kw.get("plan_page_size", defaults["plan_page_size"])
    plan_topk = kw.get("plan_topk", defaults["plan_topk"])
    if plan_page_size is not None or plan_topk is not None:
      for name, value in (("plan_page_size", plan_page_size), ("plan_topk", plan_topk)):
        if value is not None:
          check_int(name, value)
      page_size, topr, topk = stage2_replan(plan, page_size=plan_page_size, top_k=plan_topk)
    planned = dict(prompt_budget=plan.prompt_budget, max_new_tokens=max_new_tokens, topk=topk, topr=topr,
                   page_size=page_size)
    return cls(**{**planned, **kw, "window_size": window_size})

  @classmethod
  def from_tensorrt_llm(cls, *, prompt_budget, topk, topr, page_size, max_new_tokens, window_size=32,
                        kernel_size=63, kt_cache_dtype="float8_e5m2", **kw):
    """TensorRT-LLM's `topk` counts pages of `page_size` tokens; ours counts tokens (topk * page_size)."""
    return cls(prompt_budget=prompt_budget, max_new_tokens=max_new_tokens, topk=topk * page_size,
               topr=topr, page_size=page_size, window_size=window_size, kernel_size=kernel_size,
               kt_cache_dtype=kt_cache_dtype, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RocketKVPlusConfig(RocketKVConfig):
  """rocketkv_plus: this project's extension of RocketKV (docs/ALGORITHM.md, "Extension: stage-2 options"), at
  the paper plan's decode traffic: stage 2 planned on 2-slot pages (`plan_page_size=2`, top_r refitted to the
  paper plan's bytes) and the pages of the last 8 valid slots always attended inside top_k
  (`hsa_recent_tokens=8`). Stage 1 is RocketKV's. Registered because it beat `rocketkv` on the whole accuracy
  grid with no loss (benchmarks/results/accuracy_h200_2026-12-01.md). Its KT cache is as large as K (the
  paper's 3-slot pages: two thirds of K). Token budgets below 24 leave no page to choose besides the forced
  ones and are refused (stage2.check_forced)."""

  method: ClassVar[str] = "rocketkv_plus"
  hsa_recent_tokens: int = 8
  plan_page_size: int | None = 2
