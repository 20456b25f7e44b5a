"""What a method is: a stage-1 policy plus a stage-2 selector, composed by a frozen, hashable config.

A method module (`methods/<name>.py`) defines one config class. Its fields are the method's knobs (static under
jit); two ClassVars name its parts, small frozen objects that hold no data and take the config first:

  policy: Policy       stage 1, what the cache keeps: prefill's keep (keep-all, SnapKV, StreamingLLM's sink +
                       recent, H2O's heavy hitters), the capacity, and the slot each decode step writes
  selector: Selector   stage 2, what each decode step attends: dense, an exact top-k (exact_topk), Quest's
                       pages, SparQ's channels, HSA's pages (hsa, rocketkv, rocketkv_plus)

Each part declares its capabilities as documented ClassVars (`Policy.evicts`, `Selector.uses_kt_pages`...), and
the config's capabilities derive from them when the class is made (`MethodConfig.__init_subclass__`): evicts,
budgeted, uses_kt_pages, scores_channels, state_class are plain class attributes of every config, never probed
with hasattr. A part that keeps extra cache state owns its class (`state_class`: `PageState` the page selectors',
`SparQState` SparQ's selector's, `H2OState` H2O's policy's) and builds it (`init_state`, `state_shapes`).

What the rest of the code asks of a method, all on the config (which hands it to its part):

  prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B) -> KVCache     what it keeps of a layer's prompt (policy)
  decode(cache, q_BKGH, k_new_BKH, v_new_BKH) -> (out, cache)  append, select, attend (selector; the policy
                                                             gives the slot)
  capacity, evicts, budgeted, uses_kt_pages, scores_channels  static facts (derived from the parts)
  state_class, init_state(cache, **leaves), cache_shapes     the method's own cache state (KVCache.state)
  row_fields, for_rows(configs)                              what each row of a batch plans for itself (data),
                                                             and the static config a batch of plans compiles for
  step_read_bytes(length, head_dim=, itemsize=)              the bytes a decode step must read (the floor)
  write_slot / attended_slots / kept_positions               what the accuracy diagnostic inspects
  cache_spec()                                               the spec a cache carries (KVCache.spec)

This module holds the config's base, the two parts' interfaces, and the parts several methods share: `KeepAll`
(keep every token), `FixedCache` (a cache of `token_budget` slots that evicts), `Dense` (attend every valid slot)
and `TopK` (exact attention over a selection). A method's own parts live in its module (`SnapKVPolicy` in
snapkv.py, `HSASelector` in hsa.py, ...); rocketkv composes snapkv's stage 1 with hsa's stage 2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import decode_region, ops
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int, check_seq_len, check_tokens
from rocketkv_jax.cache import CacheSpec, KVCache, RowPlan, append_at, check_alive, kept_cache, kv_scales, slot_valid
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.kv_quant import is_quantized

KT_CACHE_DTYPES = (None, "float32", "bfloat16", "float8_e5m2")
FP8_KT_CACHE_DTYPE = "float8_e5m2"  # the KT pages of an FP8 K/V cache when kt_cache_dtype is None (`kt_storage`)
# None: K/V in the model's dtype; "bfloat16": the same, for a bf16 model (prefill refuses another); the FP8
# dtypes: quantized with per-(sequence, KV head) scales (kernels/kv_quant.py).
KV_CACHE_DTYPES = (None, "bfloat16", "float8_e4m3fn", "float8_e5m2")


def check_budget(token_budget: int) -> None:
  check_tokens("token_budget", token_budget, MIN_TOKEN_BUDGET)


def seq_len(prompt_len: int, max_new_tokens: int, max_len: int | None) -> int:
  """Tokens a sequence can reach: prompt + generated, capped at max_len."""
  check_tokens("prompt_len", prompt_len, 1)
  check_tokens("max_new_tokens", max_new_tokens, 0)
  if max_len is not None:
    check_tokens("max_len", max_len)
  check_seq_len(prompt_len, max_new_tokens)
  n = prompt_len + max_new_tokens
  return n if max_len is None else min(n, max_len)


def prefix_keep(k_BTKH, n: int):
  """keep [B, K, min(n, T)]: the first positions, in order."""
  b, t, n_kv, _ = k_BTKH.shape
  return jnp.broadcast_to(jnp.arange(min(n, t), dtype=jnp.int32), (b, n_kv, min(n, t)))


def kt_itemsize(config, itemsize: int) -> int:
  """Bytes of one KT page value for keys of `itemsize` bytes (`MethodConfig.kt_storage`)."""
  return itemsize if config.kt_storage is None else jnp.dtype(config.kt_storage).itemsize


def kv_itemsize(config, itemsize: int) -> int:
  """Bytes per stored K or V element: the FP8 dtype's 1, else the model's `itemsize`."""
  return jnp.dtype(config.kv_cache_dtype).itemsize if config.kv_scaled else itemsize


def kv_scale_bytes(config, head_dim: int) -> int:
  """Bytes of the scales a step reads per KV head, sequence and layer when FP8: k_scale and v_scale (float32),
  and the key mean (float32 per channel) the new key is centred on."""
  return 8 + 4 * head_dim if config.kv_scaled else 0


def valid_slots(cache: KVCache):
  """[B, S] bool: the cache's valid slots."""
  return slot_valid(cache.length, cache.capacity)


def check_sparse(c) -> None:
  """Checks the top-k knobs a selecting method has: topk; page_size and kt_cache_dtype (`uses_kt_pages`); topr
  (`scores_channels`)."""
  check_int("topk", c.topk)
  if c.uses_kt_pages:
    check_int("page_size", c.page_size)
    if c.kt_cache_dtype not in KT_CACHE_DTYPES:
      raise ValueError(f"kt_cache_dtype={c.kt_cache_dtype!r} must be one of {KT_CACHE_DTYPES} "
                       "(None: the keys' dtype)")
  if c.scores_channels:
    check_int("topr", c.topr)


# ----------------------------------------------------------------------------- the two parts' interfaces


@dataclasses.dataclass(frozen=True)
class Policy:
  """Stage 1 of a method: what its cache keeps (prefill), how many slots it has, and which slot each decode step
  writes. Holds no data: every method takes the method's config (its knobs) first.

  Capabilities (class-level facts; the config's attributes of the same names derive from them):
    evicts: the cache never runs out of slots: a decode step may overwrite a token (False: a step past the
      capacity has no slot, `MethodConfig.check_room`).
    budgeted: the token budget changes what it keeps (False: it keeps every token).
    state_class: the class of the cache state it keeps (KVCache.state), or None.
    bounds_decode: it takes a decode budget (`MethodConfig.decode_budget`): its generated tokens live in a region
      compacted when full (`rocketkv_jax/decode_region.py`).
  """

  evicts: ClassVar[bool] = False
  budgeted: ClassVar[bool] = True
  state_class: ClassVar[type | None] = None
  bounds_decode: ClassVar[bool] = False  # it takes a decode budget (`decode_region.py`): the region after its prompt set

  def check(self, config) -> None:
    """Checks its knobs (config fields) in the config's `__post_init__`: ValueError naming the value."""

  def capacity(self, config) -> int:
    """Cache slots per KV head (static)."""
    raise NotImplementedError

  def prompt_queries(self, config) -> int | None:
    """`MethodConfig.prompt_queries`: 0 unless the keep reads the prompt's queries."""
    return 0

  def check_prompt(self, config, prompt_len: int) -> None:
    """Checks a prefill's padded prompt length T."""

  def limit_rows(self, cls, max_prompt_len: int, max_new_tokens: int, max_len: int | None):
    """`MethodConfig.limit_rows` of config class `cls`: the longest request's plan alone (the capacity, largest
    there, is the only length-dependent field)."""
    return [(max_prompt_len, max_new_tokens)]

  def prefill(self, config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows: RowPlan | None = None) -> KVCache:
    raise NotImplementedError

  def kept_positions(self, config, cache: KVCache, q_BTNH, k_BTKH, lengths_B, rows: RowPlan | None = None):
    raise NotImplementedError

  def next_slot(self, config, cache: KVCache):
    """Slot the next token is written to: [B] (the same for every KV head) or [B, K]."""
    return cache.length

  def write_slot(self, config, cache: KVCache):
    """[B, K] int32: `next_slot` for every KV head."""
    slot = self.next_slot(config, cache)
    return jnp.broadcast_to(slot[:, None], cache.k.shape[:2]) if slot.ndim == 1 else slot

  def append(self, config, cache: KVCache, k_new_BKH, v_new_BKH) -> KVCache:
    """The cache with the step's token written at `next_slot` (and whatever else the policy updates there)."""
    return append_at(cache, k_new_BKH, v_new_BKH, self.next_slot(config, cache), config)

  def init_state(self, config, cache: KVCache, **leaves):
    """Its cache state (`state_class`) from `leaves`, its fields by name."""
    return self.state_class(**leaves)

  def state_shapes(self, config, batch: int, n_kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the state leaves it adds beyond those every config names (`MethodConfig.cache_shapes`)."""
    return {}


@dataclasses.dataclass(frozen=True)
class Selector:
  """Stage 2 of a method: what each decode step attends, and the step itself (append at the policy's slot,
  select, attend). Holds no data: every method takes the method's config (its knobs) first.

  Capabilities (class-level facts; the config's attributes of the same names derive from them):
    uses_kt_pages: the cache keeps per-page key min/max (`PageState`): the config has page_size,
      kt_cache_dtype and kt_pages.
    scores_channels: it scores the group's top-`topr` query channels: the config has topr.
    budgeted: the token budget changes what it attends (False: every valid slot).
    state_class: the class of the cache state it keeps (KVCache.state), or None.
  """

  uses_kt_pages: ClassVar[bool] = False
  scores_channels: ClassVar[bool] = False
  budgeted: ClassVar[bool] = True
  state_class: ClassVar[type | None] = None

  def check(self, config) -> None:
    """Checks its knobs (config fields) in the config's `__post_init__`, after the policy's."""

  def check_shapes(self, config, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Checks of the model's head shape."""

  def append(self, config, cache: KVCache, k_new_BKH, v_new_BKH) -> KVCache:
    """The step's append: the policy's (a selector with state of its own updates it too)."""
    return config.policy.append(config, cache, k_new_BKH, v_new_BKH)

  def attend(self, config, cache: KVCache, q_BKGH):
    """out [B, K, G, H]: the step's attention, its token already appended."""
    raise NotImplementedError

  def decode(self, config, cache: KVCache, q_BKGH, k_new_BKH, v_new_BKH):
    cache = self.append(config, cache, k_new_BKH, v_new_BKH)
    return self.attend(config, cache, q_BKGH), cache

  def attended_slots(self, config, cache: KVCache, q_BKGH):
    """(idx, valid) [B, K, M]: the slots a step attends, its token already appended."""
    raise NotImplementedError

  def step_read_bytes(self, config, length: int, *, head_dim: int, itemsize: int) -> int:
    raise NotImplementedError

  def init_state(self, config, cache: KVCache, **leaves):
    """Its cache state (`state_class`) from `leaves`, its fields by name."""
    return self.state_class(**leaves)

  def state_shapes(self, config, batch: int, n_kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the state leaves it adds beyond those every config names (`MethodConfig.cache_shapes`)."""
    return {}


# ----------------------------------------------------------------------------- the shared parts


@dataclasses.dataclass(frozen=True)
class KeepAll(Policy):
  """Keep every token (full, exact_topk, quest, sparq, hsa): the cache holds the config's `max_len` tokens
  (prompt + generated)."""

  budgeted: ClassVar[bool] = False

  def check(self, config):
    check_tokens("max_len", config.max_len)

  def capacity(self, config):
    return config.max_len

  def limit_rows(self, cls, max_prompt_len, max_new_tokens, max_len):
    """The plan depends on S = min(prompt_len + max_new_tokens, max_len) alone: one row per S (or, for a method
    that plans nothing per row, the longest request alone)."""
    if not cls.row_fields:
      return super().limit_rows(cls, max_prompt_len, max_new_tokens, max_len)
    s_max = max_prompt_len + max_new_tokens if max_len is None else min(max_len, max_prompt_len + max_new_tokens)
    return [(s - 1, 1) for s in range(2, s_max + 1)]

  def check_prompt(self, config, prompt_len):
    if prompt_len > config.capacity:
      raise ValueError(f"prompt length T={prompt_len} exceeds {config.method} capacity={config.capacity}: plan the "
                       f"config for at least {prompt_len} tokens (make_config's prompt_len + max_new_tokens and "
                       f"max_len, or max_len={prompt_len} or more)")

  def prefill(self, config, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows=None):
    """The whole prompt, in order."""
    del q_BTNH
    return kept_cache(config, k_BTKH, v_BTKH, prefix_keep(k_BTKH, config.capacity), lengths_B, lengths_B, rows)

  def kept_positions(self, config, cache, q_BTNH, k_BTKH, lengths_B, rows=None):
    del q_BTNH, lengths_B, rows
    b, _, n_kv, _ = k_BTKH.shape
    return jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32), (b, n_kv, cache.capacity))


@dataclasses.dataclass(frozen=True)
class FixedCache(Policy):
  """A cache that never holds more than the config's `token_budget` tokens: it evicts during decode
  (streaming_llm, h2o). Subclasses say what prefill keeps and which slot a step overwrites."""

  evicts: ClassVar[bool] = True

  def check(self, config):
    check_budget(config.token_budget)

  def capacity(self, config):
    return config.token_budget


@dataclasses.dataclass(frozen=True)
class Dense(Selector):
  """Attend every valid slot (full, snapkv, streaming_llm, h2o's step)."""

  budgeted: ClassVar[bool] = False

  def attend(self, config, cache, q_BKGH):
    """Dense attention over the valid slots."""
    return ops.dense_decode_attention(q_BKGH, cache.k, cache.v, cache.length, impl=config.impl, **kv_scales(cache))

  def attended_slots(self, config, cache, q_BKGH):
    del q_BKGH
    b, n_kv, s, _ = cache.k.shape
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, n_kv, s))
    return idx, idx < cache.length[:, None, None]

  def step_read_bytes(self, config, length, *, head_dim, itemsize):
    """Every held K/V pair (and an FP8 cache's scales; ALGORITHM.md §3, §5)."""
    held = min(length, config.capacity) * 2 * head_dim * kv_itemsize(config, itemsize)
    return held + kv_scale_bytes(config, head_dim)


@dataclasses.dataclass(frozen=True)
class TopK(Selector):
  """Exact attention over a top-k selection, `select(config, cache, q)` -> (idx, valid) [B, K, M] (exact_topk,
  quest, sparq, hsa, rocketkv). Checks the config's top-k knobs (`check_sparse`) and, where it scores channels,
  topr against the head dim."""

  def check(self, config):
    check_sparse(config)

  def check_shapes(self, config, n_heads, n_kv_heads, head_dim):
    if self.scores_channels and config.topr > head_dim:
      raise ValueError(f"config.topr={config.topr} must be <= head_dim={head_dim}")

  def select(self, config, cache: KVCache, q_BKGH):
    raise NotImplementedError

  def attend(self, config, cache, q_BKGH):
    """Exact attention over `select`'s slots."""
    idx, valid = self.select(config, cache, q_BKGH)
    return ops.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=config.impl, **kv_scales(cache))

  def attended_slots(self, config, cache, q_BKGH):
    return self.select(config, cache, q_BKGH)

  def step_read_bytes(self, config, length, *, head_dim, itemsize):
    """The scoring reads (`score_read_bytes`) plus K, V and an int32 index per attended token (and an FP8
    cache's scales)."""
    attend = (min(config.topk, length) * (2 * head_dim * kv_itemsize(config, itemsize) + 4)
              + kv_scale_bytes(config, head_dim))
    return self.score_read_bytes(config, length, head_dim=head_dim, itemsize=itemsize) + attend

  def score_read_bytes(self, config, length: int, *, head_dim: int, itemsize: int) -> int:
    raise NotImplementedError


# ----------------------------------------------------------------------------- the config


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodConfig:
  """Base of all methods: a stage-1 `policy` and a stage-2 `selector` (module doc), and the knobs they read.
  `impl` picks the decode hot path (`ops`): "xla", "pallas" (GPU kernels),
  "interpret" (the kernels in Pallas interpret mode, for CPU tests) or "auto" (Pallas on GPU, XLA
  elsewhere).

  kv_cache_dtype: how the cache stores K and V (`KV_CACHE_DTYPES`): None (the model's dtype), "bfloat16" (the
  same, asserted: a model of another dtype is refused), "float8_e4m3fn" or "float8_e5m2" (quantized with one
  float32 scale per sequence, KV head and K or V, from the full-precision prompt; `kernels/kv_quant.py`). Stage-1
  selection and the KT pages are computed from the full-precision keys either way.

  decode_budget, decode_buffer, decode_window (this project's extension, methods whose policy `bounds_decode`;
  None: off, the paper's method): generated tokens live in a region of decode_budget kept + decode_buffer fresh
  slots, compacted when full to its decode_budget best tokens by the attention of the last decode_window queries
  (`rocketkv_jax/decode_region.py`), so the capacity no longer grows with max_new_tokens."""

  method: ClassVar[str]
  policy: ClassVar[Policy]  # stage 1: what the cache keeps (every config class names one)
  selector: ClassVar[Selector]  # stage 2: what a decode step attends (every config class names one)
  # The capabilities, derived from the parts when the class is made (`__init_subclass__`; the parts document them):
  evicts: ClassVar[bool]  # the policy's: a decode step may overwrite a token
  budgeted: ClassVar[bool]  # the token budget changes the method: the policy's or the selector's (False: full)
  uses_kt_pages: ClassVar[bool]  # the selector's: the cache keeps per-page key min/max (page_size, kt_cache_dtype,
  # kt_pages are fields)
  scores_channels: ClassVar[bool]  # the selector's: it scores the group's top-`topr` query channels (topr is a field)
  plan_fields: ClassVar[tuple[str, ...]] = ()  # fields `from_budget` takes as inputs of the plan (documentation)
  # Fields the plan sets from each sequence's own length, run per row as data (`RowPlan`): a batch config holds
  # their maxima (`for_rows`). Of them, "topr" and "page_size" are also leaves of the cache's state (row_topr,
  # row_page_size: `row_leaves`).
  row_fields: ClassVar[tuple[str, ...]] = ()
  # The class of the cache's `state` (KVCache.state): a registered dataclass pytree holding the leaves only this
  # method keeps, or None when it keeps none (`init_state` builds it). Derived: the class of the part that keeps
  # state (at most one of the two does).
  state_class: ClassVar[type | None]
  # Fields that only size the cache: a batch config holds their maxima (every other field must agree).
  size_fields: ClassVar[tuple[str, ...]] = ()
  impl: str = "auto"
  kv_cache_dtype: str | None = None
  decode_budget: int | None = None
  decode_buffer: int = 128
  decode_window: int = 8

  def __init_subclass__(cls, **kw):
    """Derives the class's capabilities from its two parts (a class without both fails here, when it is made)."""
    super().__init_subclass__(**kw)
    policy, selector = cls.policy, cls.selector
    if not isinstance(policy, Policy) or not isinstance(selector, Selector):
      raise TypeError(f"{cls.__name__}.policy must be a Policy and .selector a Selector; got "
                      f"{type(policy).__name__}, {type(selector).__name__}")
    if policy.state_class is not None and selector.state_class is not None:
      raise TypeError(f"{cls.__name__}: both {type(policy).__name__} and {type(selector).__name__} keep cache state; "
                      "a cache holds one state")
    cls.evicts = policy.evicts
    cls.budgeted = policy.budgeted or selector.budgeted
    cls.uses_kt_pages = selector.uses_kt_pages
    cls.scores_channels = selector.scores_channels
    cls.state_class = selector.state_class if policy.state_class is None else policy.state_class

  def __post_init__(self):
    """Checks impl and kv_cache_dtype, then the policy's knobs, then the selector's."""
    if self.impl not in ops.IMPLS:
      raise ValueError(f"impl={self.impl!r} must be one of {ops.IMPLS}")
    if not any(self.kv_cache_dtype == d and type(self.kv_cache_dtype) is type(d) for d in KV_CACHE_DTYPES):
      raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES} (None: the model's "
                       "dtype)")
    self.policy.check(self)
    self.selector.check(self)
    self._check_decode_budget()

  def _check_decode_budget(self) -> None:
    """ValueError naming the value unless the decode budget is off (None) or this method's policy takes one, with
    decode_window <= decode_budget and decode_buffer >= 1."""
    check_int("decode_buffer", self.decode_buffer)
    check_int("decode_window", self.decode_window)
    if self.decode_budget is None:
      return
    if not self.policy.bounds_decode:
      raise ValueError(f"decode_budget={self.decode_budget!r}: {self.method} takes no decode budget (methods whose "
                       "stage 1 keeps a prompt set and every generated token do: snapkv, rocketkv, rocketkv_plus)")
    check_tokens("decode_budget", self.decode_budget, self.decode_window)

  @property
  def kv_scaled(self) -> bool:
    """Whether K/V are stored in FP8 with scales (the cache's k_scale / v_scale / k_mean leaves)."""
    return self.kv_cache_dtype is not None and is_quantized(self.kv_cache_dtype)

  def kv_dtype(self, model_dtype) -> jnp.dtype:
    """dtype of the cache's K and V for a model of `model_dtype`: the FP8 dtype, or the model's."""
    return jnp.dtype(self.kv_cache_dtype if self.kv_scaled else model_dtype)

  def check_kv_dtype(self, model_dtype) -> None:
    """ValueError naming both when kv_cache_dtype="bfloat16" but the model's K/V are not bfloat16."""
    if self.kv_cache_dtype == "bfloat16" and jnp.dtype(model_dtype) != jnp.bfloat16:
      raise ValueError(f"kv_cache_dtype='bfloat16' keeps K/V in the model's dtype, but the model's K/V are "
                       f"{jnp.dtype(model_dtype)}: use None, or an FP8 dtype to quantize")

  @property
  def capacity(self) -> int:
    """Cache slots per KV head (static): the policy's."""
    return self.policy.capacity(self)

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    """The config for one token budget (ALGORITHM.md §5). `kw` (any fields) take the place of the planned or
    default values before the one validation (`__post_init__`)."""
    raise NotImplementedError

  @classmethod
  def for_rows(cls, configs):
    """The static config a batch of sequences, each planned alone (`configs`, one per row), compiles for: the
    maxima of `row_fields` and `size_fields` (shapes, loop bounds), every other field as all rows have it.
    Each row then runs its own plan from its `RowPlan` (`row_plan`). Raises ValueError naming a field on which
    the rows disagree (a different method or option)."""
    configs = list(configs)
    if not configs or any(type(c) is not cls for c in configs):
      raise ValueError(f"for_rows needs one or more {cls.__name__}s; got {[type(c).__name__ for c in configs]}")
    if len(set(configs)) == 1:
      return configs[0]
    out = {}
    for f in dataclasses.fields(cls):
      values = [getattr(c, f.name) for c in configs]
      if f.name == "kt_pages":  # set by `_batch_of` from every row's page count
        out[f.name] = None
      elif f.name in cls.row_fields or f.name in cls.size_fields:
        out[f.name] = max(values)
      elif len(set(values)) > 1:
        raise ValueError(f"the rows' plans disagree on {f.name} ({sorted(set(map(repr, values)))}): only "
                         f"{cls.row_fields + cls.size_fields} may differ per row for {cls.method}")
      else:
        out[f.name] = values[0]
    return cls._batch_of(configs, out)

  @classmethod
  def limit_rows(cls, max_prompt_len: int, max_new_tokens: int, max_len: int | None):
    """(prompt_len, max_new_tokens) pairs whose plans cover every plan a request within these limits can get
    (`plan_limits` takes their maxima). A method whose only length-dependent field is the capacity, largest at
    the longest request, needs only that one. The policy's (`Policy.limit_rows`) unless the method plans more."""
    return cls.policy.limit_rows(cls, max_prompt_len, max_new_tokens, max_len)

  @classmethod
  def _batch_of(cls, configs, fields: dict):
    """The batch config from the merged fields (methods whose capacity is not one field adjust it first). With
    KT pages: as many pages as the row that needs the most (`kt_pages`; None when that is the batch config's
    own count)."""
    config = cls(**fields)
    if cls.uses_kt_pages:
      pages = max(c.num_kt_pages for c in configs)
      config = dataclasses.replace(config, kt_pages=None if pages == config.num_kt_pages else pages)
    return config

  def row_plan(self, configs) -> RowPlan:
    """The `RowPlan` of these rows' own configs (NumPy int32 [B]) under this batch config (`for_rows`)."""
    plan = {name: np.asarray([getattr(c, name) for c in configs], np.int32) for name in self.row_fields}
    return RowPlan(**plan)

  def check_rows(self, rows: RowPlan | None, batch: int) -> None:
    """ValueError naming the value unless `rows` is None or a `RowPlan` of this method's row fields, each an int
    array [batch] whose values (when concrete) lie in [1, the config's value]."""
    if rows is None:
      return
    if not isinstance(rows, RowPlan):
      raise ValueError(f"rows={type(rows).__name__} must be a RowPlan (rocketkv_jax.plan_rows) or None")
    for f in dataclasses.fields(RowPlan):
      x = getattr(rows, f.name)
      if x is None:
        continue
      if f.name not in self.row_fields:
        raise ValueError(f"rows.{f.name} is set, but {self.method} plans {list(self.row_fields) or 'nothing'} "
                         "per row")
      if tuple(getattr(x, "shape", ())) != (batch,) or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"rows.{f.name} must be an int array of shape ({batch},); got "
                         f"shape={tuple(getattr(x, 'shape', ()))}, dtype={getattr(x, 'dtype', None)}")
      if not isinstance(x, jax.core.Tracer):
        top = self.capacity if f.name == "prompt_budget" else getattr(self, f.name)
        values = np.asarray(x)
        if (values < 1).any() or (values > top).any():
          raise ValueError(f"rows.{f.name}={values.tolist()} must lie in [1, {top}] (the config's "
                           f"{'capacity' if f.name == 'prompt_budget' else f.name}: the batch's maximum)")

  def row_leaves(self, batch: int, rows: RowPlan | None) -> dict:
    """The per-row plan leaves the state of this method's cache holds (row_topr, row_page_size: fields of
    `state_class`), from `rows` or, where rows gives none, the config's own values for every row."""
    out = {}
    for name in ("topr", "page_size"):
      if name in self.row_fields:
        given = None if rows is None else getattr(rows, name)
        out["row_" + name] = (jnp.full((batch,), getattr(self, name), jnp.int32) if given is None
                              else jnp.asarray(given, jnp.int32))
    return out

  @property
  def num_kt_pages(self) -> int:
    """KT pages per (sequence, KV head) (methods with `uses_kt_pages`): `kt_pages` when a batch of plans set it
    (rows with smaller pages need more of them), else `kt_num_pages(capacity, page_size)`."""
    return self.kt_pages or kt_num_pages(self.capacity, self.page_size)

  def init_state(self, cache: KVCache, **leaves):
    """The cache's `state` (an instance of `state_class`, or None) from `leaves`, its fields by name, built by the
    part that keeps it. `cache` is the cache a prefill keeps (K/V stored, state None), for a state computed from
    it."""
    if self.state_class is None:
      if leaves:
        raise ValueError(f"{self.method} keeps no cache state, but was given {sorted(leaves)}")
      return None
    owner = self.selector if self.policy.state_class is None else self.policy
    return owner.init_state(self, cache, **leaves)

  def cache_shapes(self, batch: int, n_kv_heads: int, head_dim: int,
                   n_heads: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of every array leaf this method's cache holds, named as `cache.cache_leaves` names them (the
    state's as "state.<field>"; leaves not named here are None). With a decode budget, the query ring's shape
    needs the model's query heads (n_heads; default n_kv_heads, a lower bound of its bytes)."""
    s = self.capacity
    shapes = dict(k=(batch, n_kv_heads, s, head_dim), v=(batch, n_kv_heads, s, head_dim), length=(batch,),
                  pos=(batch,))
    if self.decode_budget is not None:
      shapes["decode_start"] = (batch,)
      shapes["q_recent"] = (batch, self.decode_window, n_heads or n_kv_heads, head_dim)
    if self.uses_kt_pages:
      shapes["state.kt_min"] = shapes["state.kt_max"] = (batch, n_kv_heads, head_dim, self.num_kt_pages)
    for name in self.row_leaves(batch, None):
      shapes["state." + name] = (batch,)
    if self.kv_scaled:
      shapes["k_scale"] = shapes["v_scale"] = (batch, n_kv_heads)
      shapes["k_mean"] = (batch, n_kv_heads, head_dim)
    shapes.update(self.policy.state_shapes(self, batch, n_kv_heads, head_dim))
    shapes.update(self.selector.state_shapes(self, batch, n_kv_heads, head_dim))
    return shapes

  def cache_bytes(self, batch: int, n_kv_heads: int, head_dim: int, model_dtype) -> int:
    """Bytes this method's cache of `batch` rows holds in one layer, from `cache_shapes` (nothing is allocated):
    K and V in `kv_dtype`, KT pages in `kt_dtype`, every other leaf (lengths, indices, scales, scores) 4 bytes."""
    kv, total = self.kv_dtype(model_dtype), 0
    for name, shape in self.cache_shapes(batch, n_kv_heads, head_dim).items():
      size = (kv.itemsize if name in ("k", "v") else self.kt_dtype(model_dtype).itemsize if name.startswith("state.kt_")
              else 4)
      total += math.prod(shape) * size
    return total

  @property
  def prompt_queries(self) -> int | None:
    """How many of the prompt's last queries `prefill` reads: 0 (none: it keeps by position, or keeps all),
    n (the last n: SnapKV's observation window) or None (every one: H2O). A prefill that continues a K/V
    history (`models.llama.prefill_extend`, the engine's sessions) recomputes at least this many tokens,
    since the history keeps keys and values, not queries. The policy's."""
    return self.policy.prompt_queries(self)

  @property
  def kt_storage(self) -> str | None:
    """How the KT pages are stored (methods with `uses_kt_pages`): kt_cache_dtype when set; else "float8_e5m2"
    when K/V are FP8 (`kv_scaled`), as TensorRT-LLM's RocketKV stores them: in bf16 they would be 2.2 of the 5.5
    MB per layer an FP8 32k sequence holds, and at 1 byte the largest 32k batch doubles bf16's (H100: 194 -> 390
    sequences, benchmarks/results/h100_2026-12-05/) with accuracy tied (fp8_accuracy_cpu_2026-12-05/smol_fp8_kt_2k.md);
    else None: the keys' dtype."""
    if self.kt_cache_dtype is not None:
      return self.kt_cache_dtype
    return FP8_KT_CACHE_DTYPE if self.kv_scaled else None

  def kt_dtype(self, key_dtype) -> jnp.dtype:
    """dtype of the KT pages (methods with `uses_kt_pages`): `kt_storage`, or the keys' dtype."""
    return jnp.dtype(key_dtype if self.kt_storage is None else self.kt_storage)

  def cache_spec(self) -> CacheSpec:
    return CacheSpec(self.method, tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                                        if f.name != "impl"))

  # ------------------------------------------------------------------ checks (before any device work)

  def check_shapes(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Method-specific checks of the model's head shape (the selector's)."""
    self.selector.check_shapes(self, n_heads, n_kv_heads, head_dim)

  def check_prompt(self, prompt_len: int) -> None:
    """Method-specific checks of a prefill's padded prompt length T (the policy's)."""
    self.policy.check_prompt(self, prompt_len)

  def check_room(self, cache: KVCache, steps: int = 1) -> None:
    """Raises ValueError when `steps` more decode steps would not fit (concrete lengths only: skipped
    inside a caller's jit, where a step past capacity drops its token instead). A cache donated to an earlier
    step (its arrays deleted) is named as such first: every decode entry point (decode_step, the models' decode
    loops) checks its room here."""
    check_alive("cache", cache)
    if self.evicts or self.decode_budget is not None or isinstance(cache.length, jax.core.Tracer):
      return
    length = np.asarray(cache.length)
    if (length + steps > self.capacity).any():
      raise ValueError(f"cache.length={length.tolist()} has reached capacity={self.capacity} for {self.method}: "
                       f"no slot left for {steps} more token(s) (plan a larger max_new_tokens / max_len)")

  # ------------------------------------------------------------------ prefill (the policy)

  def prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows: RowPlan | None = None) -> KVCache:
    """What the method keeps of a layer's prompt. rows: each sequence's own plan (`RowPlan`). With a decode budget,
    the cache also holds the decode region's leaves (`decode_region.init_leaves`)."""
    cache = self.policy.prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows)
    return cache if self.decode_budget is None else decode_region.init_leaves(self, cache, q_BTNH)

  def kept_positions(self, cache: KVCache, q_BTNH, k_BTKH, lengths_B, rows: RowPlan | None = None):
    """[B, K, S] int32: the absolute position each slot holds right after `prefill` (junk past length)."""
    return self.policy.kept_positions(self, cache, q_BTNH, k_BTKH, lengths_B, rows)

  def write_slot(self, cache: KVCache):
    """[B, K] int32: the slot the next token is written to, for every KV head."""
    return self.policy.write_slot(self, cache)

  # ------------------------------------------------------------------ decode (the selector)

  def append(self, cache: KVCache, k_new_BKH, v_new_BKH) -> KVCache:
    """The step's append alone (the policy's slot; the selector's state updated too)."""
    return self.selector.append(self, cache, k_new_BKH, v_new_BKH)

  def select(self, cache: KVCache, q_BKGH, **kw):
    """(idx, valid) [B, K, M]: the slots a step attends (selectors that select: `TopK`)."""
    return self.selector.select(self, cache, q_BKGH, **kw)

  def attend(self, cache: KVCache, q_BKGH):
    """The step's attention alone, its token already appended."""
    return self.selector.attend(self, cache, q_BKGH)

  def decode(self, cache: KVCache, q_BKGH, k_new_BKH, v_new_BKH):
    """Append, select, attend: (out [B, K, G, H], cache). With a decode budget, rows whose region is full are
    compacted first (`decode_region.before_append`)."""
    if self.decode_budget is not None:
      cache = decode_region.before_append(self, cache, q_BKGH)
    return self.selector.decode(self, cache, q_BKGH, k_new_BKH, v_new_BKH)

  def attended_slots(self, cache: KVCache, q_BKGH):
    """(idx, valid) [B, K, M]: the slots a step attends, its token already appended."""
    return self.selector.attended_slots(self, cache, q_BKGH)

  def step_read_bytes(self, length: int, *, head_dim: int, itemsize: int) -> int:
    """Bytes one decode step must read per KV head, sequence and layer at `length` valid slots (K, V, KT
    pages, indices, an FP8 cache's scales; ALGORITHM.md §3, §5), for a model of `itemsize` bytes per element."""
    return self.selector.step_read_bytes(self, length, head_dim=head_dim, itemsize=itemsize)
