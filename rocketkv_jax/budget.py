"""Budget planning (ALGORITHM.md §1, paper §3.6): one token budget sets every RocketKV knob."""
from __future__ import annotations

import dataclasses
import math

MIN_TOKEN_BUDGET = 16
# The most tokens a length, position, slot or size can count: the caches hold them as int32. A larger value
# (prompt_len=2**40) is refused here, by name, before any array is sized from it (it used to be accepted until
# XLA ran out of memory).
MAX_TOKENS = 2**31 - 1


def check_int(name: str, value, low: int = 1, high: int | None = None) -> None:
  """ValueError naming the value unless it is an int (not a bool) in [low, high] (high None: no upper bound)."""
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be an int")
  if value < low:
    raise ValueError(f"{name}={value} must be >= {low}")
  if high is not None and value > high:
    raise ValueError(f"{name}={value} must be <= {high}" + (" (lengths and positions are int32)"
                                                             if high == MAX_TOKENS else ""))


def check_tokens(name: str, value, low: int = 1) -> None:
  """`check_int` of a token count (a length, budget or size): at most `MAX_TOKENS`."""
  check_int(name, value, low, MAX_TOKENS)


def check_seq_len(prompt_len: int, max_new_tokens: int) -> None:
  """ValueError naming both unless prompt_len + max_new_tokens fits int32 (`MAX_TOKENS`): the positions a
  sequence reaches."""
  if prompt_len + max_new_tokens > MAX_TOKENS:
    raise ValueError(f"prompt_len + max_new_tokens = {prompt_len} + {max_new_tokens} = "
                     f"{prompt_len + max_new_tokens} must be <= {MAX_TOKENS} (positions are int32)")


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


def _stage1_sizes(t: int, prompt_len: int, max_new_tokens: int, max_len: int | None) -> tuple[int, int, int]:
  """(S, capacity, prompt_budget) of the plan (ALGORITHM.md §1)."""
  seq_len = prompt_len + max_new_tokens
  if max_len is not None:
    seq_len = min(seq_len, max_len)
  c = max(1.0, seq_len / t)
  r = min(0.2 + 0.06 * math.log2(c), 0.8)
  capacity = max(int(seq_len / c**r), min(2 * max_new_tokens, seq_len))
  return seq_len, capacity, capacity - max_new_tokens


def _smallest(lo: int, hi: int, ok) -> int | None:
  """The smallest n in [lo, hi] with ok(n), for ok monotone (False then True); None if ok(hi) is False."""
  if lo > hi or not ok(hi):
    return None
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
  return lo


def _window_error(t: int, prompt_len: int, max_new_tokens: int, max_len: int | None, window_size: int) -> str:
  """Why the plan's prompt budget is under the window, and each change that would fix it, with its value."""
  seq_len, capacity, prompt_budget = _stage1_sizes(t, prompt_len, max_new_tokens, max_len)
  fits = lambda **kw: _stage1_sizes(**{**dict(t=t, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                                                max_len=max_len), **kw})[2] >= window_size
  fixes = []
  budget = _smallest(t + 1, max(t + 1, seq_len), lambda n: fits(t=n))  # prompt_budget grows with t, up to S - new
  if budget is not None:
    fixes.append(f"token_budget >= {budget}")
  if prompt_budget >= 1:
    fixes.append(f"window_size <= {prompt_budget}")
  if max_len is not None and max_len < prompt_len + max_new_tokens:
    if fits(max_len=None):  # (capacity is not monotone in S, so only the uncapped sequence is offered)
      fixes.append(f"max_len >= prompt_len + max_new_tokens = {prompt_len + max_new_tokens}")
  fewer = next((n for n in range(max_new_tokens - 1, max(-1, max_new_tokens - 100_000), -1)
                if fits(max_new_tokens=n)), None)
  if fewer is not None:
    fixes.append(f"max_new_tokens <= {fewer}")
  if budget is None:
    why = (f"; no token_budget can help: even keeping the whole sequence S={seq_len} leaves "
           f"S - max_new_tokens={seq_len - max_new_tokens} prompt tokens")
  else:
    why = ""
  return (f"prompt_budget={prompt_budget} (capacity={capacity} - max_new_tokens={max_new_tokens}, at "
          f"token_budget={t}, S={seq_len}) is smaller than window_size={window_size}{why}. What would help: "
          f"{' or '.join(fixes) if fixes else 'a longer prompt'}")


def plan_budget(token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int, *,
                max_len: int | None = None, window_size: int = 32) -> BudgetPlan:
  """Plans RocketKV for one request, exactly by the formula of ALGORITHM.md §1.

  Raises ValueError for a budget under 16 tokens or a prompt budget smaller than the window; the latter
  names each change that would fix it (a larger token_budget where one exists, a smaller window_size, a larger
  max_len, fewer max_new_tokens), with its value.
  """
  for name, value, low in (("token_budget", token_budget, MIN_TOKEN_BUDGET), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 0), ("head_dim", head_dim, 1),
                           ("window_size", window_size, 1)):
    check_tokens(name, value, low)
  if max_len is not None:
    check_tokens("max_len", max_len)
  check_seq_len(prompt_len, max_new_tokens)
  t, d = token_budget, head_dim
  seq_len, capacity, prompt_budget = _stage1_sizes(t, prompt_len, max_new_tokens, max_len)
  if prompt_budget < window_size:
    raise ValueError(_window_error(t, prompt_len, max_new_tokens, max_len, window_size))
  c = max(1.0, seq_len / t)
  r = min(0.2 + 0.06 * math.log2(c), 0.8)
  top_k = t // 2
  c2 = max(1.0, capacity / t)
  page_size, top_r = stage2_pages(c2, d)
  return BudgetPlan(token_budget=t, seq_len=seq_len, max_new_tokens=max_new_tokens, head_dim=d,
                    window_size=window_size, compression_ratio=c, split_r=r, capacity=capacity,
                    prompt_budget=prompt_budget, stage2_ratio=c2, page_size=page_size,
                    top_r=top_r, top_k=top_k)


def decode_budget_plan(token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int, *, region: int,
                       max_len: int | None = None, window_size: int = 32) -> BudgetPlan:
  """The plan with a decode budget (docs/ALGORITHM.md §4b): stage 1 is planned for the prompt alone (S = prompt_len:
  the output no longer counts in the prompt's compression, since the cache holds at most `region` =
  decode_budget + decode_buffer generated tokens whatever max_new_tokens is), and stage 2 for the cache that holds,
  prompt_budget + min(max_new_tokens, region) slots."""
  base = plan_budget(token_budget, prompt_len, 0, head_dim, max_len=max_len, window_size=window_size)
  capacity = base.prompt_budget + min(max_new_tokens, region)
  c2 = max(1.0, capacity / token_budget)
  page_size, top_r = stage2_pages(c2, head_dim)
  return dataclasses.replace(base, max_new_tokens=max_new_tokens, capacity=capacity, stage2_ratio=c2,
                             page_size=page_size, top_r=top_r)


def stage2_step_bytes(capacity: int, page_size: int, top_r: int, top_k: int, head_dim: int, *,
                      itemsize: int = 2) -> int:
  """Bytes HSA's decode step reads per KV head at a full cache (`capacity` slots): one row of `top_r` KT values
  per page, then K, V and an int32 index per attended token (the methods' `step_read_bytes`, KT pages in the
  keys' dtype)."""
  return -(-capacity // page_size) * top_r * itemsize + top_k * (2 * head_dim * itemsize + 4)


def stage2_replan(plan: BudgetPlan, *, page_size: int | None = None, top_k: int | None = None,
                  itemsize: int = 2) -> tuple[int, int, int]:
  """(page_size, top_r, top_k) of a stage-2 split other than the paper's at the same decode traffic: the page
  size and/or top-k are given, and top_r is the most channels (at most d) whose step reads no more bytes than
  the paper plan's at a full cache (`stage2_step_bytes`, bf16 by default; in float32 the two differ by at most
  4 bytes per token of top-k difference, the index). More channels with fewer tokens, or the reverse.

  Raises ValueError naming the value when no channel fits (top_k too close to the token budget)."""
  p = plan.page_size if page_size is None else page_size
  k = plan.top_k if top_k is None else top_k
  check_int("page_size", p)
  check_int("top_k", k)
  d = plan.head_dim
  if k >= plan.token_budget:
    raise ValueError(f"top_k={k} must be < token_budget={plan.token_budget} (scoring needs a share of it)")
  paper = stage2_step_bytes(plan.capacity, plan.page_size, plan.top_r, plan.top_k, d, itemsize=itemsize)
  rows = -(-plan.capacity // p)
  top_r = min(d, (paper - k * (2 * d * itemsize + 4)) // (rows * itemsize))
  if top_r < 1:
    raise ValueError(f"top_k={k} with page_size={p} leaves no scoring channel at the paper plan's traffic "
                     f"({paper} bytes per step at capacity={plan.capacity}, token_budget={plan.token_budget}): "
                     f"use a smaller top_k or a larger page_size")
  return p, int(top_r), k
