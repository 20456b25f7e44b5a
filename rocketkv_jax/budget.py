"""Budget planning (ALGORITHM.md §1, paper §3.6): one token budget sets every RocketKV knob."""
from __future__ import annotations

import dataclasses
import math

MIN_TOKEN_BUDGET = 16


def check_int(name: str, value, low: int = 1) -> None:
  """ValueError naming the value unless it is an int (not a bool) >= low."""
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be an int")
  if value < low:
    raise ValueError(f"{name}={value} must be >= {low}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetPlan:
  """RocketKV's split of a token budget `t` between stage 1 (SnapKV) and stage 2 (HSA).

  `t` counts KV pairs' worth of memory traffic per KV head, per layer, per decode step; scoring and
  exact attention each get about half of it.
  """

  token_budget: int  # t
  seq_len: int  # S = prompt_len + max_new_tokens, capped at max_len
  max_new_tokens: int
  head_dim: int  # d
  window_size: int  # W, kept inside prompt_budget
  compression_ratio: float  # c = max(1, S / t)
  split_r: float  # r: stage 1 compresses by c**r, stage 2 by c**(1-r)
  capacity: int  # cache slots per KV head: prompt_budget + max_new_tokens
  prompt_budget: int  # prompt tokens stage 1 keeps per KV head, window included
  stage2_ratio: float  # c2 = max(1, capacity / t)
  page_size: int  # P
  top_r: int  # head-dim channels used for page scoring
  top_k: int  # tokens attended exactly per step: t // 2


def stage2_pages(c2: float, head_dim: int) -> tuple[int, int]:
  """HSA's page size P and top-r channels for a stage-2 compression ratio c2 (ALGORITHM.md §1): P = ceil(sqrt(c2))
  (1 if that exceeds c2), top_r = int(d * P / c2), never 0 channels."""
  page_size = math.ceil(math.sqrt(c2))
  if page_size > c2:
    page_size = 1
  return page_size, max(1, int(head_dim * page_size / c2))


def plan_budget(token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int, *,
                max_len: int | None = None, window_size: int = 32) -> BudgetPlan:
  """Plans RocketKV for one request, exactly by the formula of ALGORITHM.md §1.

  Raises ValueError for a budget under 16 tokens or a prompt budget smaller than the window.
  """
  for name, value, low in (("token_budget", token_budget, MIN_TOKEN_BUDGET), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 0), ("head_dim", head_dim, 1),
                           ("window_size", window_size, 1)):
    check_int(name, value, low)
  if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
    raise ValueError(f"max_len={max_len!r} must be a positive int or None")
  t, d = token_budget, head_dim
  seq_len = prompt_len + max_new_tokens
  if max_len is not None:
    seq_len = min(seq_len, max_len)
  c = max(1.0, seq_len / t)
  r = min(0.2 + 0.06 * math.log2(c), 0.8)
  capacity = int(seq_len / c**r)
  capacity = max(capacity, min(2 * max_new_tokens, seq_len))
  prompt_budget = capacity - max_new_tokens
  if prompt_budget < window_size:
    raise ValueError(
        f"prompt_budget={prompt_budget} (capacity={capacity} - max_new_tokens={max_new_tokens}) is smaller "
        f"than window_size={window_size}: raise token_budget={t} or lower max_new_tokens")
  top_k = t // 2
  c2 = max(1.0, capacity / t)
  page_size, top_r = stage2_pages(c2, d)
  return BudgetPlan(token_budget=t, seq_len=seq_len, max_new_tokens=max_new_tokens, head_dim=d,
                    window_size=window_size, compression_ratio=c, split_r=r, capacity=capacity,
                    prompt_budget=prompt_budget, stage2_ratio=c2, page_size=page_size,
                    top_r=top_r, top_k=top_k)
