"""The methods, one module each, and the registry that maps names to them.

A method is its config class, which composes a stage-1 policy and a stage-2 selector (`methods/base.py` says
what every method provides). To add or change a method, edit its module; nothing outside this package tests a
method's name.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from rocketkv_jax.budget import check_int, check_tokens
from rocketkv_jax.cache import RowPlan
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


@functools.lru_cache(maxsize=200_000)
def _planned(method: str, token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int, max_len, overrides):
  return make_config(method, token_budget=token_budget, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                     head_dim=head_dim, max_len=max_len, **dict(overrides))


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """A batch's plans: `config` (static, what the batch compiles for: the maxima of the rows' plans), `rows` (each
  row's own plan as data, for `prefill_compress(..., rows=)`) and `row_configs` (each row's config as planned
  alone)."""

  config: MethodConfig
  rows: RowPlan
  row_configs: tuple


def plan_rows(method: str, *, token_budget: int, prompt_lens: Sequence[int], max_new_tokens, head_dim: int,
              max_len: int | None = None, config: MethodConfig | None = None, **overrides) -> BatchPlan:
  """THE rule by which every caller (generate, the engine and server, the accuracy suite, the benchmarks) plans:
  each row gets the paper's plan for its own length, `make_config(method, token_budget, prompt_len=its prompt
  length, max_new_tokens=its own, head_dim, max_len, **overrides)` (ALGORITHM.md §1: S = min(prompt_len +
  max_new_tokens, max_len)); the batch compiles for their maxima (`MethodConfig.for_rows`), and each row runs its
  own stage-1 keep count, top-r and page size as data, so what a row gets never depends on its companions.

  max_new_tokens: one int for every row, or one per row. config: a static config to run the rows under
  (e.g. an engine's `plan_limits`) instead of the rows' maxima; every row's plan must fit in it.
  Raises ValueError naming the row (index and length) whose plan is invalid, or that does not fit `config`.
  """
  lens = [int(n) for n in prompt_lens]
  news = [max_new_tokens] * len(lens) if isinstance(max_new_tokens, int) else list(max_new_tokens)
  if not lens or len(news) != len(lens):
    raise ValueError(f"prompt_lens ({len(lens)}) and max_new_tokens ({len(news)}) must name the same rows, at "
                     "least one")
  get_method(method)
  frozen = tuple(sorted(overrides.items()))
  configs = []
  for i, (n, m) in enumerate(zip(lens, news)):
    try:
      configs.append(_planned(method, token_budget, n, m, head_dim, max_len, frozen))
    except ValueError as e:
      raise ValueError(f"row {i} (prompt of {n} tokens, max_new_tokens={m}): {e}") from None
  batch = type(configs[0]).for_rows(configs)
  if config is not None:
    _check_fits(config, batch, lens)
    batch = config
  return BatchPlan(config=batch, rows=batch.row_plan(configs), row_configs=tuple(configs))


def _check_fits(config: MethodConfig, batch: MethodConfig, lens) -> None:
  """ValueError unless the rows' merged plan `batch` fits the static `config` (same options, no larger maxima)."""
  if type(batch) is not type(config):
    raise ValueError(f"the rows are planned as {batch.method}, but config is {config.method}")
  if type(config).for_rows([config, batch]) != config:
    raise ValueError(f"prompts of {lens} tokens are planned as {batch.cache_spec()} (capacity {batch.capacity}), "
                     f"which does not fit {config.cache_spec()} (capacity {config.capacity}): plan the config for "
                     "these lengths (plan_limits)")


def plan_limits(method: str, *, token_budget: int, max_prompt_len: int, max_new_tokens: int, head_dim: int,
                max_len: int | None = None, **overrides) -> MethodConfig:
  """The static config every request within these limits fits (an engine's slots): the maxima of the plans
  (`plan_rows`) of every prompt length up to max_prompt_len with up to max_new_tokens new tokens. Requests are
  then planned from their own lengths, `plan_rows(..., config=this)`."""
  check_tokens("max_prompt_len", max_prompt_len)
  check_tokens("max_new_tokens", max_new_tokens, 1)
  return _limits(method, token_budget, max_prompt_len, max_new_tokens, head_dim, max_len,
                 tuple(sorted(overrides.items())))


# Overrides every method takes: they carry over when a request is kept whole (`plan_static`).
COMMON_FIELDS = ("impl", "kv_cache_dtype")


def plan_static(method: str, *, token_budget: int, max_prompt_len: int, max_new_tokens: int, head_dim: int,
                n_kv_heads: int, model_dtype, max_len: int | None = None, whole_prompt_len: int | None = None,
                **overrides) -> MethodConfig:
  """The static config a batch or an engine's slots run under: `plan_limits`, unless the method's cache would hold
  at least the bytes of `full`'s (short sequences: the KT pages and per-row plan leaves cost more than the tokens
  evicted save; when the budget covers the whole sequence nothing is evicted at all). Then it is `full`'s config for
  `whole_prompt_len` prompt tokens (default max_prompt_len; `generate` gives its batch's longest prompt, since its
  method plans for a length bucket), with the method's impl and kv_cache_dtype: every token is kept and attended
  densely, exactly. So a method never holds more than `full` (docs/ALGORITHM.md, "Kept whole"). The caller plans
  rows with the returned config's method (`config.method`)."""
  static = plan_limits(method, token_budget=token_budget, max_prompt_len=max_prompt_len,
                       max_new_tokens=max_new_tokens, head_dim=head_dim, max_len=max_len, **overrides)
  if not static.budgeted:
    return static
  full = plan_limits("full", token_budget=token_budget, max_prompt_len=whole_prompt_len or max_prompt_len,
                     max_new_tokens=max_new_tokens, head_dim=head_dim, max_len=max_len, **whole_overrides(overrides))
  if static.cache_bytes(1, n_kv_heads, head_dim, model_dtype) >= full.cache_bytes(1, n_kv_heads, head_dim,
                                                                                  model_dtype):
    return full
  return static


def whole_overrides(overrides: dict) -> dict:
  """The overrides of a method's config that `full`'s takes when a sequence is kept whole (`plan_static`)."""
  return {k: v for k, v in overrides.items() if k in COMMON_FIELDS}


@functools.lru_cache(maxsize=256)
def _limits(method: str, token_budget: int, max_prompt_len: int, max_new_tokens: int, head_dim: int, max_len,
            overrides) -> MethodConfig:
  """`plan_limits`, computed once per set of limits: it plans every S up to the limit (a 128k limit is about
  130k plans, 6 s of Python), and `generate` asks for it on every call."""
  cls = get_method(method)
  configs = []
  for n, m in cls.limit_rows(max_prompt_len, max_new_tokens, max_len):
    try:
      configs.append(_planned(method, token_budget, n, m, head_dim, max_len, overrides))
    except ValueError:  # such a request is refused with this error when it comes
      continue
  if not configs:  # no request fits: the longest one's error says why
    _planned(method, token_budget, max_prompt_len, max_new_tokens, head_dim, max_len, overrides)
  return cls.for_rows(configs)


__all__ = ["REGISTRY", "METHODS", "BatchPlan", "MethodConfig", "get_method", "make_config", "plan_limits",
           "plan_rows", "plan_static", "whole_overrides", "ExactTopKConfig", "FullConfig",
           "H2OConfig", "HSAConfig", "QuestConfig", "RocketKVConfig", "RocketKVPlusConfig", "SnapKVConfig",
           "SparQConfig", "StreamingLLMConfig"]
