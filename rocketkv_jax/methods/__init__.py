"""The methods, one module each, and the registry that maps names to them.

A method is its config class (`methods/base.py` says what every method provides). To add or change a
method, edit its module; nothing outside this package tests a method's name.
"""
from __future__ import annotations

import dataclasses

from rocketkv_jax.budget import check_int
from rocketkv_jax.methods.base import MethodConfig, check_budget
from rocketkv_jax.methods.exact_topk import ExactTopKConfig
from rocketkv_jax.methods.full import FullConfig
from rocketkv_jax.methods.h2o import H2OConfig
from rocketkv_jax.methods.hsa import HSAConfig
from rocketkv_jax.methods.quest import QuestConfig
from rocketkv_jax.methods.rocketkv import RocketKVConfig, RocketKVPlusConfig
from rocketkv_jax.methods.snapkv import SnapKVConfig
from rocketkv_jax.methods.sparq import SparQConfig
from rocketkv_jax.methods.streaming_llm import StreamingLLMConfig

REGISTRY: dict[str, type[MethodConfig]] = {
    c.method: c for c in (FullConfig, StreamingLLMConfig, H2OConfig, SnapKVConfig, QuestConfig, SparQConfig,
                          HSAConfig, ExactTopKConfig, RocketKVConfig, RocketKVPlusConfig)}
METHODS = tuple(REGISTRY)


def get_method(name: str) -> type[MethodConfig]:
  """The config class (the method) registered as `name`."""
  if not isinstance(name, str) or name not in REGISTRY:
    raise ValueError(f"method={name!r} must be one of {METHODS}")
  return REGISTRY[name]


def make_config(method: str, *, token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int,
                max_len: int | None = None, **overrides) -> MethodConfig:
  """The config of `method` for one token budget (ALGORITHM.md §5), with `overrides` (e.g. impl="xla",
  window_size=8) in place of the planned or default values, validated once, as a whole: an override can make a
  budget valid that the defaults would not allow (snapkv at token_budget=16 with window_size=8). Overrides that
  the budget plan itself uses (RocketKV's window_size) are inputs of the plan."""
  cls = get_method(method)
  check_int("head_dim", head_dim)
  check_budget(token_budget)
  unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
  if unknown:
    raise ValueError(f"{sorted(unknown)} are not fields of {cls.__name__}")
  return cls.from_budget(token_budget, prompt_len, max_new_tokens, head_dim, max_len=max_len, **overrides)


__all__ = ["REGISTRY", "METHODS", "MethodConfig", "get_method", "make_config", "ExactTopKConfig", "FullConfig",
           "H2OConfig", "HSAConfig", "QuestConfig", "RocketKVConfig", "RocketKVPlusConfig", "SnapKVConfig",
           "SparQConfig", "StreamingLLMConfig"]
