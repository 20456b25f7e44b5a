"""full: every token kept, dense attention (the reference every method is measured against)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from rocketkv_jax.methods.base import Dense, KeepAll, MethodConfig, seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullConfig(MethodConfig):
  """Full KV cache, dense attention. `max_len`: prompt + generated tokens the cache can hold."""

  method: ClassVar[str] = "full"
  policy: ClassVar[KeepAll] = KeepAll()
  selector: ClassVar[Dense] = Dense()
  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    del token_budget, head_dim  # full reads everything
    return cls(**{"max_len": seq_len(prompt_len, max_new_tokens, max_len), **kw})
