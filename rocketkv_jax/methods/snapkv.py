"""snapkv: stage 1 alone (SnapKV with group-wise selection keeps `prompt_budget` prompt tokens per KV head),
then dense attention over them plus every generated token."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax import stage1
from rocketkv_jax.methods.base import MethodConfig, check_budget, seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKVConfig(MethodConfig):
  """SnapKV alone: keeps `prompt_budget` prompt tokens per KV head (window included), then dense attention
  over them plus every generated token. Original settings: window 32, pool kernel 7."""

  method: ClassVar[str] = "snapkv"
  prompt_budget: int
  max_new_tokens: int
  window_size: int = 32
  kernel_size: int = 7
  sink_tokens: int = 0

  def __post_init__(self):
    super().__post_init__()
    stage1.check_config(self)

  @property
  def capacity(self) -> int:
    return self.prompt_budget + self.max_new_tokens

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    check_budget(token_budget)
    seq_len(prompt_len, max_new_tokens, max_len)
    return cls(prompt_budget=token_budget, max_new_tokens=max_new_tokens, **kw)

  @property
  def prompt_queries(self):
    return self.window_size

  def prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B):
    return stage1.prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B)

  def kept_positions(self, cache, q_BTNH, k_BTKH, lengths_B):
    return stage1.kept_positions(self, cache, q_BTNH, k_BTKH, lengths_B)
