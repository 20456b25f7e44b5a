"""snapkv: stage 1 alone (SnapKV with group-wise selection keeps `prompt_budget` prompt tokens per KV head),
then dense attention over them plus every generated token. Its policy, `SnapKVPolicy`, is also rocketkv's and
rocketkv_plus's stage 1."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax import stage1
from rocketkv_jax.methods.base import Dense, MethodConfig, Policy, check_budget, seq_len

DEFAULT_WINDOW = 32  # SnapKV's observation window (its original setting)


@dataclasses.dataclass(frozen=True)
class SnapKVPolicy(Policy):
  """SnapKV with group-wise selection (`stage1`, ALGORITHM.md §2): prefill keeps the config's `prompt_budget`
  prompt tokens per KV head (the observation window's `window_size` last ones included; votes max-pooled with
  `kernel_size`; `sink_tokens` first ones forced in), and the cache has room for `max_new_tokens` more, or with a
  decode budget for its region at most (`decode_room`)."""

  bounds_decode: ClassVar[bool] = True

  def check(self, config):
    stage1.check_config(config)

  def capacity(self, config):
    return config.prompt_budget + decode_room(config)

  def prompt_queries(self, config):
    return config.window_size

  def prefill(self, config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None):
    return stage1.prefill(config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows)

  def kept_positions(self, config, cache, q_BTNH, k_BTKH, lengths_B, rows=None):
    return stage1.kept_positions(config, cache, q_BTNH, k_BTKH, lengths_B, rows)


def decode_room(config) -> int:
  """Slots after the prompt set that a row's generated tokens fill: max_new_tokens, or with a decode budget at most
  its region, decode_budget + decode_buffer (an output shorter than the region never fills it: never compacted)."""
  if config.decode_budget is None:
    return config.max_new_tokens
  return min(config.max_new_tokens, config.decode_budget + config.decode_buffer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKVConfig(MethodConfig):
  """SnapKV alone: keeps `prompt_budget` prompt tokens per KV head (window included), then dense attention
  over them plus every generated token. Original settings: window 32, pool kernel 7."""

  method: ClassVar[str] = "snapkv"
  policy: ClassVar[SnapKVPolicy] = SnapKVPolicy()
  selector: ClassVar[Dense] = Dense()
  size_fields: ClassVar[tuple[str, ...]] = ("max_new_tokens",)
  prompt_budget: int
  max_new_tokens: int
  window_size: int = DEFAULT_WINDOW
  kernel_size: int = 7
  sink_tokens: int = 0

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    """prompt_budget = token_budget: the cache holds t prompt tokens (window included) plus the new ones."""
    check_budget(token_budget)
    seq_len(prompt_len, max_new_tokens, max_len)
    window = kw.get("window_size", DEFAULT_WINDOW)
    if "prompt_budget" not in kw and isinstance(window, int) and token_budget < window:
      raise ValueError(f"snapkv keeps token_budget={token_budget} prompt tokens (its prompt_budget, window included), "
                       f"fewer than window_size={window}: use token_budget >= {window} or window_size <= "
                       f"{token_budget}")
    return cls(**{"prompt_budget": token_budget, "max_new_tokens": max_new_tokens, **kw})
