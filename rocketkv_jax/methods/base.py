"""What a method is: a frozen, hashable config that also carries the method's behaviour.

A method module (`methods/<name>.py`) defines one config class. Its fields are the method's knobs (static
under jit); its methods are what the rest of the code asks of a method:

  prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B) -> KVCache     what it keeps of a layer's prompt (stage 1)
  decode(cache, q_BKGH, k_new_BKH, v_new_BKH) -> (out, cache)  append, select, attend (stage 2)
  capacity, evicts, budgeted, uses_kt_pages, scores_channels  static facts (the capabilities: ClassVars, never probed
                                                             with hasattr)
  state_class, init_state(cache, **leaves), cache_shapes     the method's own cache state (KVCache.state)
  row_fields, for_rows(configs)                              what each row of a batch plans for itself (data),
                                                             and the static config a batch of plans compiles for
  step_read_bytes(length, head_dim=, itemsize=)              the bytes a decode step must read (the floor)
  write_slot / attended_slots / kept_positions               what the accuracy diagnostic inspects
  cache_spec()                                               the spec a cache carries (KVCache.spec)

The base classes below hold the behaviour most methods share; a method overrides only what differs.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import ops
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int, check_seq_len, check_tokens
from rocketkv_jax.cache import CacheSpec, KVCache, RowPlan, check_alive, kept_cache, kv_scales, slot_valid
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.kv_quant import is_quantized

KT_CACHE_DTYPES = (None, "float32", "bfloat16", "float8_e5m2")
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


def append_at(cache: KVCache, k_new_BKH, v_new_BKH, slot, config) -> KVCache:
  """The cache with the new token at `slot` ([B], or [B, K] per KV head): K/V rows and (methods with KT pages)
  its KT page, in one `ops.cache_append`; length (up to the capacity) and pos advance. A slot outside
  [0, S) writes nothing."""
  return _append(cache, k_new_BKH, v_new_BKH, slot, config)[0]


def append_choosing_at(cache: KVCache, k_new_BKH, v_new_BKH, slot, config, q_BKGH, topr: int):
  """`append_at` whose append op also makes HSA's channel choice of the step's query q [B, K, G, H] (with
  kernels, inside the append's launch): (cache, choice), the choice as `ops.hsa_select` takes it."""
  return _append(cache, k_new_BKH, v_new_BKH, slot, config, choose_q=q_BKGH, topr=topr)


def _append(cache, k_new_BKH, v_new_BKH, slot, config, **choose):
  state = cache.state  # a PageState when the method keeps KT pages
  pages = (state.kt_min, state.kt_max) if config.uses_kt_pages else ()
  if choose:
    choose["topr_B"] = state.row_topr
  new = ops.cache_append(cache.k, cache.v, k_new_BKH, v_new_BKH, slot, *pages,
                         page_size=config.page_size if pages else 1,
                         page_size_B=state.row_page_size if pages else None, impl=config.impl, **choose,
                         **kv_scales(cache))
  new, choice = (new[:-4], new[-4:]) if choose else (new, None)
  if pages:
    k, v, kt_min, kt_max = new
    state = dataclasses.replace(state, kt_min=kt_min, kt_max=kt_max)
  else:
    k, v = new
  return dataclasses.replace(cache, k=k, v=v, state=state, pos=cache.pos + 1,
                             length=jnp.minimum(cache.length + 1, cache.capacity).astype(jnp.int32)), choice


def kt_itemsize(config, itemsize: int) -> int:
  return itemsize if config.kt_cache_dtype is None else jnp.dtype(config.kt_cache_dtype).itemsize


def kv_itemsize(config, itemsize: int) -> int:
  """Bytes per stored K or V element: the FP8 dtype's 1, else the model's `itemsize`."""
  return jnp.dtype(config.kv_cache_dtype).itemsize if config.kv_scaled else itemsize


def kv_scale_bytes(config) -> int:
  """Bytes of the scales a step reads per KV head, sequence and layer: k_scale and v_scale (float32) when FP8."""
  return 8 if config.kv_scaled else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodConfig:
  """Base of all methods. `impl` picks the decode hot path (`ops`): "xla", "pallas" (GPU kernels),
  "interpret" (the kernels in Pallas interpret mode, for CPU tests) or "auto" (Pallas on GPU, XLA
  elsewhere).

  kv_cache_dtype: how the cache stores K and V (`KV_CACHE_DTYPES`): None (the model's dtype), "bfloat16" (the
  same, asserted: a model of another dtype is refused), "float8_e4m3fn" or "float8_e5m2" (quantized with one
  float32 scale per sequence, KV head and K or V, from the full-precision prompt; `kernels/kv_quant.py`). Stage-1
  selection and the KT pages are computed from the full-precision keys either way."""

  method: ClassVar[str]
  evicts: ClassVar[bool] = False  # the cache never runs out of slots: a decode step may overwrite a token
  budgeted: ClassVar[bool] = True  # the token budget changes the method (False: full)
  uses_kt_pages: ClassVar[bool] = False  # the cache keeps per-page key min/max (methods that score pages): the
  # config has page_size, kt_cache_dtype and kt_pages
  scores_channels: ClassVar[bool] = False  # it scores the group's top-`topr` query channels: the config has topr
  plan_fields: ClassVar[tuple[str, ...]] = ()  # fields `from_budget` takes as inputs of the plan (documentation)
  # Fields the plan sets from each sequence's own length, run per row as data (`RowPlan`): a batch config holds
  # their maxima (`for_rows`). Of them, "topr" and "page_size" are also leaves of the cache's state (row_topr,
  # row_page_size: `row_leaves`).
  row_fields: ClassVar[tuple[str, ...]] = ()
  # The class of the cache's `state` (KVCache.state): a registered dataclass pytree holding the leaves only this
  # method keeps, or None when it keeps none (`init_state` builds it).
  state_class: ClassVar[type | None] = None
  # Fields that only size the cache: a batch config holds their maxima (every other field must agree).
  size_fields: ClassVar[tuple[str, ...]] = ()
  impl: str = "auto"
  kv_cache_dtype: str | None = None

  def __post_init__(self):
    if self.impl not in ops.IMPLS:
      raise ValueError(f"impl={self.impl!r} must be one of {ops.IMPLS}")
    if not any(self.kv_cache_dtype == d and type(self.kv_cache_dtype) is type(d) for d in KV_CACHE_DTYPES):
      raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES} (None: the model's "
                       "dtype)")

  @property
  def kv_scaled(self) -> bool:
    """Whether K/V are stored in FP8 with scales (the cache's k_scale / v_scale leaves)."""
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
    """Cache slots per KV head (static)."""
    raise NotImplementedError

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
    the longest request, needs only that one."""
    return [(max_prompt_len, max_new_tokens)]

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
    """The cache's `state` (an instance of `state_class`, or None) from `leaves`, its fields by name. `cache` is
    the cache a prefill keeps (K/V stored, state None), for methods whose state is computed from it."""
    if self.state_class is None:
      if leaves:
        raise ValueError(f"{self.method} keeps no cache state, but was given {sorted(leaves)}")
      return None
    return self.state_class(**leaves)

  def cache_shapes(self, batch: int, n_kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """The shape of every array leaf this method's cache holds, named as `cache.cache_leaves` names them (the
    state's as "state.<field>"; leaves not named here are None)."""
    s = self.capacity
    shapes = dict(k=(batch, n_kv_heads, s, head_dim), v=(batch, n_kv_heads, s, head_dim), length=(batch,),
                  pos=(batch,))
    if self.uses_kt_pages:
      shapes["state.kt_min"] = shapes["state.kt_max"] = (batch, n_kv_heads, head_dim, self.num_kt_pages)
    for name in self.row_leaves(batch, None):
      shapes["state." + name] = (batch,)
    if self.kv_scaled:
      shapes["k_scale"] = shapes["v_scale"] = (batch, n_kv_heads)
    return shapes

  @property
  def prompt_queries(self) -> int | None:
    """How many of the prompt's last queries `prefill` reads: 0 (none: it keeps by position, or keeps all),
    n (the last n: SnapKV's observation window) or None (every one: H2O). A prefill that continues a K/V
    history (`models.llama.prefill_extend`, the engine's sessions) recomputes at least this many tokens,
    since the history keeps keys and values, not queries."""
    return 0

  def kt_dtype(self, key_dtype) -> jnp.dtype:
    """dtype of the KT pages (methods with `uses_kt_pages`): kt_cache_dtype, or the keys' dtype."""
    return jnp.dtype(key_dtype if self.kt_cache_dtype is None else self.kt_cache_dtype)

  def cache_spec(self) -> CacheSpec:
    return CacheSpec(self.method, tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                                        if f.name != "impl"))

  # ------------------------------------------------------------------ checks (before any device work)

  def check_shapes(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Method-specific checks of the model's head shape."""

  def check_prompt(self, prompt_len: int) -> None:
    """Method-specific checks of a prefill's padded prompt length T."""

  def check_room(self, cache: KVCache, steps: int = 1) -> None:
    """Raises ValueError when `steps` more decode steps would not fit (concrete lengths only: skipped
    inside a caller's jit, where a step past capacity drops its token instead). A cache donated to an earlier
    step (its arrays deleted) is named as such first: every decode entry point (decode_step, the models' decode
    loops) checks its room here."""
    check_alive("cache", cache)
    if self.evicts or isinstance(cache.length, jax.core.Tracer):
      return
    length = np.asarray(cache.length)
    if (length + steps > self.capacity).any():
      raise ValueError(f"cache.length={length.tolist()} has reached capacity={self.capacity} for {self.method}: "
                       f"no slot left for {steps} more token(s) (plan a larger max_new_tokens / max_len)")

  # ------------------------------------------------------------------ prefill

  def prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, rows: RowPlan | None = None) -> KVCache:
    """Keeps the whole prompt (methods that evict override this). rows: each sequence's own plan (`RowPlan`)."""
    del q_BTNH
    return kept_cache(self, k_BTKH, v_BTKH, prefix_keep(k_BTKH, self.capacity), lengths_B, lengths_B, rows)

  def kept_positions(self, cache: KVCache, q_BTNH, k_BTKH, lengths_B):
    """[B, K, S] int32: the absolute position each slot holds right after `prefill` (junk past length)."""
    del q_BTNH, lengths_B
    b, _, n_kv, _ = k_BTKH.shape
    return jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32), (b, n_kv, cache.capacity))

  # ------------------------------------------------------------------ decode

  def next_slot(self, cache: KVCache):
    """Slot the next token is written to: [B] (the same for every KV head) or [B, K]."""
    return cache.length

  def write_slot(self, cache: KVCache):
    """[B, K] int32: `next_slot` for every KV head."""
    slot = self.next_slot(cache)
    return jnp.broadcast_to(slot[:, None], cache.k.shape[:2]) if slot.ndim == 1 else slot

  def append(self, cache: KVCache, k_new_BKH, v_new_BKH) -> KVCache:
    return append_at(cache, k_new_BKH, v_new_BKH, self.next_slot(cache), self)

  def attend(self, cache: KVCache, q_BKGH):
    """Dense attention over the valid slots (methods that select override this)."""
    return ops.dense_decode_attention(q_BKGH, cache.k, cache.v, cache.length, impl=self.impl, **kv_scales(cache))

  def decode(self, cache: KVCache, q_BKGH, k_new_BKH, v_new_BKH):
    cache = self.append(cache, k_new_BKH, v_new_BKH)
    return self.attend(cache, q_BKGH), cache

  def attended_slots(self, cache: KVCache, q_BKGH):
    """(idx, valid) [B, K, M]: the slots a step attends, its token already appended."""
    del q_BKGH
    b, n_kv, s, _ = cache.k.shape
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, n_kv, s))
    return idx, idx < cache.length[:, None, None]

  def step_read_bytes(self, length: int, *, head_dim: int, itemsize: int) -> int:
    """Bytes one decode step must read per KV head, sequence and layer at `length` valid slots (K, V, KT
    pages, indices, an FP8 cache's scales; ALGORITHM.md §3, §5), for a model of `itemsize` bytes per element:
    every held K/V pair for a dense method."""
    return min(length, self.capacity) * 2 * head_dim * kv_itemsize(self, itemsize) + kv_scale_bytes(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeepAllConfig(MethodConfig):
  """Methods that keep every token: the cache holds `max_len` tokens (prompt + generated)."""

  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int

  def __post_init__(self):
    super().__post_init__()
    check_tokens("max_len", self.max_len)

  @property
  def capacity(self) -> int:
    return self.max_len

  @classmethod
  def limit_rows(cls, max_prompt_len, max_new_tokens, max_len):
    """The plan depends on S = min(prompt_len + max_new_tokens, max_len) alone: one row per S."""
    if not cls.row_fields:
      return super().limit_rows(max_prompt_len, max_new_tokens, max_len)
    s_max = max_prompt_len + max_new_tokens if max_len is None else min(max_len, max_prompt_len + max_new_tokens)
    return [(s - 1, 1) for s in range(2, s_max + 1)]

  def check_prompt(self, prompt_len: int) -> None:
    if prompt_len > self.capacity:
      raise ValueError(f"prompt length T={prompt_len} exceeds {self.method} capacity={self.capacity}: plan the "
                       f"config for at least {prompt_len} tokens (make_config's prompt_len + max_new_tokens and "
                       f"max_len, or max_len={prompt_len} or more)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedCacheConfig(MethodConfig):
  """Methods whose cache never holds more than `token_budget` tokens: they evict during decode."""

  evicts: ClassVar[bool] = True
  token_budget: int

  def __post_init__(self):
    super().__post_init__()
    check_budget(self.token_budget)

  @property
  def capacity(self) -> int:
    return self.token_budget

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    seq_len(prompt_len, max_new_tokens, max_len)
    return cls(**{"token_budget": token_budget, **kw})


class SelectingMixin:
  """Methods that attend exactly to a top-k selection: `select(cache, q)` -> (idx, valid) [B, K, M]. Checks
  their top-k knobs (`check_sparse`) and, where they score channels, topr against the head dim."""

  def __post_init__(self):
    super().__post_init__()
    check_sparse(self)

  def check_shapes(self, n_heads, n_kv_heads, head_dim):
    if self.scores_channels and self.topr > head_dim:
      raise ValueError(f"config.topr={self.topr} must be <= head_dim={head_dim}")

  def select(self, cache: KVCache, q_BKGH):
    raise NotImplementedError

  def attend(self, cache: KVCache, q_BKGH, **select_kw):
    """Exact attention over `select`'s slots (select_kw: options of the method's select)."""
    idx, valid = self.select(cache, q_BKGH, **select_kw)
    return ops.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=self.impl, **kv_scales(cache))

  def attended_slots(self, cache: KVCache, q_BKGH):
    return self.select(cache, q_BKGH)

  def step_read_bytes(self, length: int, *, head_dim: int, itemsize: int) -> int:
    """The scoring reads (`score_read_bytes`) plus K, V and an int32 index per attended token (and an FP8
    cache's scales)."""
    attend = min(self.topk, length) * (2 * head_dim * kv_itemsize(self, itemsize) + 4) + kv_scale_bytes(self)
    return self.score_read_bytes(length, head_dim=head_dim, itemsize=itemsize) + attend

  def score_read_bytes(self, length: int, *, head_dim: int, itemsize: int) -> int:
    raise NotImplementedError


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


def valid_slots(cache: KVCache):
  """[B, S] bool: the cache's valid slots."""
  return slot_valid(cache.length, cache.capacity)
