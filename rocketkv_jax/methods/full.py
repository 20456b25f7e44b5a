"""full: every token kept, dense attention (the reference every method is measured against)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax.methods.base import KeepAllConfig, seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullConfig(KeepAllConfig):
  """Full KV cache, dense attention. `max_len`: prompt + generated tokens the cache can hold."""

  method: ClassVar[str] = "full"
  budgeted: ClassVar[bool] = False

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    del token_budget, head_dim  # full reads everything
    return cls(**{"max_len": seq_len(prompt_len, max_new_tokens, max_len), **kw})
