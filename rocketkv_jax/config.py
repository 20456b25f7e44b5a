"""One frozen, hashable config per method (ALGORITHM.md §5). Pass them to jit as static arguments.

Every config can be built from one token budget `t` (`make_config` / `<Config>.from_budget`) with the
budget convention of ALGORITHM.md §5: `t` KV pairs' worth of memory traffic per KV head, per layer,
per decode step, for every method. Field names for the RocketKV knobs follow TensorRT-LLM's
`RocketSparseAttentionConfig` (`window_size`, `kernel_size`, `prompt_budget`, `topk`, `topr`,
`page_size`, `kt_cache_dtype`), except that `topk` counts tokens here (TensorRT-LLM's counts pages:
use `RocketKVConfig.from_tensorrt_llm`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from rocketkv_jax.budget import MIN_TOKEN_BUDGET, plan_budget, stage2_pages

IMPLS = ("auto", "xla", "pallas", "interpret")
KT_CACHE_DTYPES = (None, "float32", "bfloat16", "float8_e5m2")


def _check_int(name: str, value, low: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be an int")
  if value < low:
    raise ValueError(f"{name}={value} must be >= {low}")


def _seq_len(prompt_len: int, max_new_tokens: int, max_len: int | None) -> int:
  _check_int("prompt_len", prompt_len, 1)
  _check_int("max_new_tokens", max_new_tokens, 0)
  seq_len = prompt_len + max_new_tokens
  return seq_len if max_len is None else min(seq_len, max_len)


def _check_budget(token_budget: int) -> None:
  _check_int("token_budget", token_budget, MIN_TOKEN_BUDGET)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodConfig:
  """Base of all configs. `impl` picks the decode hot path: "xla", "pallas" (GPU kernels), "interpret"
  (the Pallas kernels in interpret mode, for CPU tests) or "auto" (Pallas on GPU, XLA elsewhere)."""

  method: ClassVar[str]
  uses_kt_pages: ClassVar[bool] = False  # the cache keeps per-page key min/max (methods that score pages)
  impl: str = "auto"

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}")

  @property
  def capacity(self) -> int:
    """Cache slots per KV head (static)."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NoEvictionConfig(MethodConfig):
  """Methods that keep every token: the cache holds `max_len` tokens (prompt + generated)."""

  max_len: int

  def __post_init__(self):
    super().__post_init__()
    _check_int("max_len", self.max_len)
    if hasattr(self, "topk"):
      _check_sparse(self)

  @property
  def capacity(self) -> int:
    return self.max_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullConfig(_NoEvictionConfig):
  """Full KV cache, dense attention. `max_len`: prompt + generated tokens the cache can hold."""

  method: ClassVar[str] = "full"

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    del token_budget, head_dim  # full reads everything
    return cls(max_len=_seq_len(prompt_len, max_new_tokens, max_len), **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FixedCacheConfig(MethodConfig):
  """Methods whose cache never holds more than `token_budget` tokens: they evict during decode."""

  token_budget: int

  def __post_init__(self):
    super().__post_init__()
    _check_budget(self.token_budget)

  @property
  def capacity(self) -> int:
    return self.token_budget

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _seq_len(prompt_len, max_new_tokens, max_len)
    return cls(token_budget=token_budget, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLMConfig(_FixedCacheConfig):
  """The first `sink_tokens` tokens plus the most recent `token_budget - sink_tokens` (new token included)."""

  method: ClassVar[str] = "streaming_llm"
  sink_tokens: int = 4

  def __post_init__(self):
    super().__post_init__()
    _check_int("sink_tokens", self.sink_tokens, 0)
    if self.sink_tokens >= self.token_budget:
      raise ValueError(f"sink_tokens={self.sink_tokens} must be < token_budget={self.token_budget}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2OConfig(_FixedCacheConfig):
  """Heavy hitters by accumulated attention plus the `recent` most recent tokens; cache of `token_budget`
  slots, evicting one token per decode step once full. `recent` defaults to token_budget // 2."""

  method: ClassVar[str] = "h2o"
  recent: int | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.recent is not None:
      _check_int("recent", self.recent, 1)
      if self.recent >= self.token_budget:
        raise ValueError(f"recent={self.recent} must be < token_budget={self.token_budget}")

  @property
  def recent_tokens(self) -> int:
    return self.token_budget // 2 if self.recent is None else self.recent


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
    _check_stage1(self)

  @property
  def capacity(self) -> int:
    return self.prompt_budget + self.max_new_tokens

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _check_budget(token_budget)
    _seq_len(prompt_len, max_new_tokens, max_len)
    return cls(prompt_budget=token_budget, max_new_tokens=max_new_tokens, **kw)


def _check_stage1(c) -> None:
  _check_int("prompt_budget", c.prompt_budget)
  _check_int("max_new_tokens", c.max_new_tokens, 0)
  _check_int("window_size", c.window_size)
  _check_int("kernel_size", c.kernel_size)
  _check_int("sink_tokens", c.sink_tokens, 0)
  if c.kernel_size % 2 == 0:
    raise ValueError(f"kernel_size={c.kernel_size} must be odd (same-length max-pool)")
  if c.prompt_budget < c.window_size:
    raise ValueError(f"prompt_budget={c.prompt_budget} must be >= window_size={c.window_size}")
  if c.sink_tokens > c.prompt_budget - c.window_size:
    raise ValueError(f"sink_tokens={c.sink_tokens} must be <= prompt_budget - window_size = "
                     f"{c.prompt_budget - c.window_size}")


def _check_sparse(c) -> None:
  _check_int("topk", c.topk)
  if hasattr(c, "page_size"):
    _check_int("page_size", c.page_size)
  if hasattr(c, "topr"):
    _check_int("topr", c.topr)
  if getattr(c, "kt_cache_dtype", None) not in KT_CACHE_DTYPES:
    raise ValueError(f"kt_cache_dtype={c.kt_cache_dtype!r} must be one of {KT_CACHE_DTYPES} "
                     "(None: the keys' dtype)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuestConfig(_NoEvictionConfig):
  """Quest: no eviction; pages of `page_size` slots scored by the upper bound over all channels of the
  page key min/max, summed over the query heads of a KV group; exact attention over the top `topk` tokens
  of the best pages."""

  method: ClassVar[str] = "quest"
  uses_kt_pages: ClassVar[bool] = True
  page_size: int
  topk: int
  kt_cache_dtype: str | None = None

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _check_budget(token_budget)
    s = _seq_len(prompt_len, max_new_tokens, max_len)
    # One page's min+max costs one KV pair of traffic: S / P pages read = half the budget.
    return cls(max_len=s, page_size=math.ceil(2 * s / token_budget), topk=token_budget // 2, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparQConfig(_NoEvictionConfig):
  """SparQ: no eviction; the group's top-`topr` channels of sum |q| score every token, exact attention over
  the top `topk` tokens, plus SparQ's mean-value correction."""

  method: ClassVar[str] = "sparq"
  topr: int
  topk: int

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _check_budget(token_budget)
    s = _seq_len(prompt_len, max_new_tokens, max_len)
    topr = min(head_dim, max(1, int(token_budget * head_dim / s)))
    return cls(max_len=s, topr=topr, topk=token_budget // 2, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSAConfig(_NoEvictionConfig):
  """Hybrid sparse attention (RocketKV's stage 2) alone, over the full cache."""

  method: ClassVar[str] = "hsa"
  uses_kt_pages: ClassVar[bool] = True
  page_size: int
  topr: int
  topk: int
  kt_cache_dtype: str | None = None

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _check_budget(token_budget)
    s = _seq_len(prompt_len, max_new_tokens, max_len)
    page_size, topr = stage2_pages(max(1.0, s / token_budget), head_dim)  # no stage-1 share: c2 = c
    return cls(max_len=s, page_size=page_size, topr=topr, topk=token_budget // 2, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactTopKConfig(_NoEvictionConfig):
  """Oracle: exact attention scores (group mean of per-head softmax), exact attention over the top `topk`."""

  method: ClassVar[str] = "exact_topk"
  topk: int

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    _check_budget(token_budget)
    return cls(max_len=_seq_len(prompt_len, max_new_tokens, max_len), topk=token_budget, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RocketKVConfig(MethodConfig):
  """RocketKV: stage 1 keeps `prompt_budget` prompt tokens per KV head (SnapKV, window `window_size`,
  max-pool `kernel_size`, optional `sink_tokens` forced in); stage 2 (HSA) attends to the top `topk`
  tokens per step, scored from page min/max (`page_size` slots per page) over the top `topr` channels.
  `kt_cache_dtype`: None (the keys' dtype), "bfloat16", "float8_e5m2" or "float32"."""

  method: ClassVar[str] = "rocketkv"
  uses_kt_pages: ClassVar[bool] = True
  prompt_budget: int
  max_new_tokens: int
  topk: int
  topr: int
  page_size: int
  window_size: int = 32
  kernel_size: int = 63
  kt_cache_dtype: str | None = None
  sink_tokens: int = 0

  def __post_init__(self):
    super().__post_init__()
    _check_stage1(self)
    _check_sparse(self)

  @property
  def capacity(self) -> int:
    return self.prompt_budget + self.max_new_tokens

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None,
                  window_size=32, **kw):
    plan = plan_budget(token_budget, prompt_len, max_new_tokens, head_dim, max_len=max_len,
                       window_size=window_size)
    return cls(prompt_budget=plan.prompt_budget, max_new_tokens=max_new_tokens, topk=plan.top_k,
               topr=plan.top_r, page_size=plan.page_size, window_size=window_size, **kw)

  @classmethod
  def from_tensorrt_llm(cls, *, prompt_budget, topk, topr, page_size, max_new_tokens, window_size=32,
                        kernel_size=63, kt_cache_dtype="float8_e5m2", **kw):
    """TensorRT-LLM's `topk` counts pages of `page_size` tokens; ours counts tokens (topk * page_size)."""
    return cls(prompt_budget=prompt_budget, max_new_tokens=max_new_tokens, topk=topk * page_size,
               topr=topr, page_size=page_size, window_size=window_size, kernel_size=kernel_size,
               kt_cache_dtype=kt_cache_dtype, **kw)


CONFIGS = {c.method: c for c in (FullConfig, StreamingLLMConfig, H2OConfig, SnapKVConfig, QuestConfig,
                                  SparQConfig, HSAConfig, ExactTopKConfig, RocketKVConfig)}
METHODS = tuple(CONFIGS)


def make_config(method: str, *, token_budget: int, prompt_len: int, max_new_tokens: int, head_dim: int,
                max_len: int | None = None, **overrides) -> MethodConfig:
  """The config of `method` for one token budget (ALGORITHM.md §5), then `overrides` (e.g. impl="xla")."""
  if method not in CONFIGS:
    raise ValueError(f"method={method!r} must be one of {METHODS}")
  _check_int("head_dim", head_dim)
  _check_budget(token_budget)
  cls = CONFIGS[method]
  plan_kw = {"window_size": overrides.pop("window_size")} if method == "rocketkv" and "window_size" in overrides else {}
  config = cls.from_budget(token_budget, prompt_len, max_new_tokens, head_dim, max_len=max_len, **plan_kw)
  unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
  if unknown:
    raise ValueError(f"{sorted(unknown)} are not fields of {cls.__name__}")
  return dataclasses.replace(config, **overrides)
