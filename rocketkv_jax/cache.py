"""The static-shape, per-layer KV cache pytree, its spec, and how a prefill's kept positions become one.

Slots at or past `length` are junk: nothing may depend on their contents. Every leaf's shape is fixed by
the config, so a decode step never grows anything or recompiles. Which slot a step writes, and what else it
updates, is the method's business (`methods/`); writing the token there is `append_at`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import ops
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.kv_quant import dequantize, key_mean, kv_scale, quantize


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """What built a cache: the method's name and every config field that decides what the cache holds and how
  a step updates it (all but `impl`). Hashable, so it is static pytree metadata."""

  method: str
  fields: tuple[tuple[str, object], ...]

  def __str__(self) -> str:
    return f"{self.method}({', '.join(f'{k}={v!r}' for k, v in self.fields)})"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PageState:
  """The cache state of the stage-2 selectors that score pages of keys (`QuestSelector`: quest; `HSASelector`:
  hsa, rocketkv, rocketkv_plus), shared by both: each page's key summary and each sequence's own stage-2 plan.

  kt_min, kt_max: [B, K, H, P] per-page element-wise key min / max, channel-major (`build_kt_pages`). Pages
    with no valid slot hold zeros; the last page's junk slots never enter min/max.
  row_topr: [B] int32, the channels each sequence scores (at most the config's static `topr`, the batch's
    maximum); None for quest, which scores every channel.
  row_page_size: [B] int32, each sequence's page size (at most the config's `page_size`). A sequence planned
    alone holds the config's values (`MethodConfig.row_leaves`).
  (row_topr comes before row_page_size so that the leaves flatten in the order of the former KVCache fields.)
  """

  kt_min: jax.Array
  kt_max: jax.Array
  row_topr: jax.Array | None = None
  row_page_size: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
  """One layer's cache: what every method keeps, plus the method's own `state`.

  k, v: [B, K, S, H] post-RoPE keys and values at the method's capacity S. Each KV head holds its own
    token set; slots [0, length) are valid. In the model's dtype, or FP8 (`kv_cache_dtype`), read with:
  k_scale, v_scale: [B, K] float32, an FP8 cache's scale per (sequence, KV head), and
  k_mean: [B, K, H] float32, its keys' prompt mean per channel (`kernels/kv_quant.py`: a key reads as
    k.astype(f32) * k_scale + k_mean, a value as v.astype(f32) * v_scale); None when K/V are not quantized (any
    method may store FP8).
  length: [B] int32, valid slots (the same for every KV head of a sequence).
  pos: [B] int32, absolute position of the next token = tokens seen so far, kept or evicted.
  state: the method's extra leaves, a registered dataclass pytree of the class its config names
    (`MethodConfig.state_class`, from the stage-1 policy or stage-2 selector that keeps it): `PageState` (the
    page selectors: quest, hsa, rocketkv, rocketkv_plus), `SparQState` (`methods/sparq.py`), `H2OState`
    (`methods/h2o.py`); None for the methods that keep nothing more (full,
    snapkv, streaming_llm, exact_topk). `cache_leaves` names its leaves "state.<field>".
  decode_start: [B] int32, where a row's decode region starts (its kept prompt tokens), and
  q_recent: [B, α, N, H], the ring of its last `decode_window` decode queries: a config with a decode budget only
    (`rocketkv_jax/decode_region.py`); None otherwise.
  spec: static (not a leaf): the method and config fields that built the cache; `decode_step` refuses a
    config whose spec differs.

  The fields are in the order k, v, length, pos, state, k_scale, v_scale, k_mean (then the decode region's), so the flattened leaves keep
  the order they had when every method's leaves were fields of KVCache itself.
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  pos: jax.Array
  state: object | None = None
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  k_mean: jax.Array | None = None
  decode_start: jax.Array | None = None
  q_recent: jax.Array | None = None
  spec: CacheSpec = dataclasses.field(metadata=dict(static=True))

  @property
  def capacity(self) -> int:
    return self.k.shape[2]


def cache_leaves(cache: KVCache) -> dict:
  """Every array field of `cache` by name, None where unset, in pytree order: the shared ones (k, v, length,
  pos, k_scale, v_scale, k_mean) and each field of the method's state as "state.<field>" (no entry for a None
  state).
  These are the names `MethodConfig.cache_shapes` uses and the checks' messages say."""
  out = {}
  for f in dataclasses.fields(cache):
    x = getattr(cache, f.name)
    if f.name == "state":
      if x is not None:
        out.update({f"state.{g.name}": getattr(x, g.name) for g in dataclasses.fields(x)})
    elif f.name != "spec":
      out[f.name] = x
  return out


def replace_leaves(cache: KVCache, **leaves) -> KVCache:
  """`cache` with the leaves named as `cache_leaves` names them replaced ("k", "state.kt_min"...): how a tool or
  test edits any leaf, the method's state's included, by one name."""
  state = {n.removeprefix("state."): x for n, x in leaves.items() if n.startswith("state.")}
  shared = {n: x for n, x in leaves.items() if not n.startswith("state.")}
  if state:
    shared["state"] = dataclasses.replace(cache.state, **state)
  return dataclasses.replace(cache, **shared)


def cache_nbytes(cache) -> int:
  """Bytes a cache (or a tuple / list of per-layer caches, nested as deep as one likes) holds: KV plus every
  leaf of the methods' states (pages, scores, indices). Only the shapes are read (a donated cache's size is
  still known). Raises ValueError naming the type of anything that is not such a cache (a string once reached
  `.shape`)."""
  _check_caches("cache", cache)
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def _check_caches(name: str, x) -> None:
  """ValueError naming the first part of `x` that is neither a KVCache nor a tuple / list of them."""
  if isinstance(x, KVCache):
    return
  if not isinstance(x, (tuple, list)):
    raise ValueError(f"{name} must be a KVCache or a tuple / list of per-layer KVCaches; got {type(x).__name__}"
                     + ("" if x is None else f" {str(x)[:60]!r}"))
  for i, part in enumerate(x):
    _check_caches(f"{name}[{i}]", part)


def check_alive(name: str, cache) -> None:
  """ValueError naming the leaf when a leaf of `cache` (a KVCache or a tuple of them) was donated: decode_step
  and the decode loops donate their input cache, whose arrays are then deleted."""
  layers = cache if isinstance(cache, (tuple, list)) else (cache,)
  for i, layer in enumerate(layers):
    for leaf, x in cache_leaves(layer).items():
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
        where = f"{name}.{leaf}" if layer is cache else f"{name}[{i}].{leaf}"
        raise ValueError(f"{where} has been deleted: the cache was donated to an earlier call (decode_step or "
                         "a decode loop), which returned the cache to use next")


def read_keys(cache: KVCache) -> jax.Array:
  """cache.k as its values: dequantized to float32 and the key mean added back for an FP8 cache, as stored
  otherwise."""
  if cache.k_scale is None:
    return cache.k
  return dequantize(cache.k, cache.k_scale[:, :, None, None]) + cache.k_mean[:, :, None, :]


def read_values(cache: KVCache) -> jax.Array:
  """cache.v as its values (`read_keys`)."""
  return cache.v if cache.v_scale is None else dequantize(cache.v, cache.v_scale[:, :, None, None])


def kv_scales(cache: KVCache) -> dict:
  """The scale keywords the decode ops take (`ops.dense_decode_attention`...): {} unless the cache is FP8."""
  return {} if cache.k_scale is None else dict(k_scale_BK=cache.k_scale, v_scale_BK=cache.v_scale)


def slot_valid(length_B: jax.Array, num_slots: int) -> jax.Array:
  """[B, S] bool: slot s of sequence b holds a token."""
  return jnp.arange(num_slots)[None, :] < length_B[:, None]


def build_kt_pages(k_BKSH: jax.Array, length_B: jax.Array, page_size: int, dtype, *, num_pages: int | None = None,
                   page_size_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-page key min/max, channel-major [B, K, H, P] (P = num_pages, default `kt_num_pages`: padded with empty
  pages); junk slots never enter, empty pages hold 0. page_size_B [B]: each sequence's own page size (at most
  `page_size`): its page p covers slots [p * page_size_B[b], +page_size_B[b])."""
  b, n_kv, s, h = k_BKSH.shape
  if num_pages is None:
    num_pages = kt_num_pages(s, page_size)
  if page_size_B is None:
    page_size_B = jnp.full((b,), page_size, jnp.int32)
  # Segment min / max of the valid slots by page; junk slots go to a page past the end, which is dropped.
  page_size_B = page_size_B.astype(jnp.int32)
  page_BS = jnp.arange(s)[None, :] // page_size_B[:, None]
  page_BS = jnp.where(slot_valid(length_B, s) & (page_BS < num_pages), page_BS, num_pages)
  kf = k_BKSH.astype(jnp.float32)

  def segment(op, fill):
    def one(k_KSH, page_S):
      out = jnp.full((n_kv, num_pages + 1, h), fill, jnp.float32)
      return getattr(out.at[:, page_S, :], op)(k_KSH)[:, :num_pages]
    return jax.vmap(one)(kf, page_BS)

  k_min, k_max = segment("min", jnp.inf), segment("max", -jnp.inf)
  page_used = (jnp.arange(num_pages)[None, :] * page_size_B[:, None] < length_B[:, None])[:, None, :, None]
  k_min = jnp.where(page_used, k_min, 0.0)
  k_max = jnp.where(page_used, k_max, 0.0)
  return (k_min.transpose(0, 1, 3, 2).astype(dtype), k_max.transpose(0, 1, 3, 2).astype(dtype))


def kept_cache(config, k_BTKH, v_BTKH, keep_BKM, count_B, lengths_B, rows=None, **extras) -> KVCache:
  """The cache holding, per KV head, the prompt positions keep[b, k, :count[b]] in slots [0, count) (junk
  after), at the config's capacity, with the method's state (`config.init_state`) from its leaves: KT pages
  when the method keeps them, each sequence's own plan (`rows`, a `RowPlan`; None: every sequence the
  config's) where the method plans per row, and `extras` (other leaves of the state, by field name). With an
  FP8 `kv_cache_dtype`, the keys are centred on their full-precision prompt mean (`kv_quant.key_mean`), and K
  and V are stored quantized at scales from the full-precision prompt (every valid token of it, kept or not:
  `kv_quant.kv_scale`); the KT pages are the full-precision centred keys'."""
  capacity = config.capacity
  m = keep_BKM.shape[-1]
  valid = slot_valid(count_B, m)[:, None, :, None]

  def place(x_BTKH):
    x = jnp.take_along_axis(x_BTKH.transpose(0, 2, 1, 3), keep_BKM[..., None], axis=2)  # [B, K, M, H]
    x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - m), (0, 0)))

  model_dtype, scales = k_BTKH.dtype, {}
  if config.kv_scaled:
    b, t, n_kv, _ = k_BTKH.shape
    prompt_BKT = jnp.broadcast_to(slot_valid(lengths_B, t)[:, None, :], (b, n_kv, t))
    scales["k_mean"] = key_mean(k_BTKH.transpose(0, 2, 1, 3), prompt_BKT)
    k_BTKH = k_BTKH.astype(jnp.float32) - scales["k_mean"][:, None]  # centred: the kept keys, pages and scale
  k, v = place(k_BTKH), place(v_BTKH)
  length = count_B.astype(jnp.int32)
  leaves = dict(config.row_leaves(k.shape[0], rows), **extras)
  if config.uses_kt_pages:
    leaves["kt_min"], leaves["kt_max"] = build_kt_pages(
        k, length, config.page_size, config.kt_dtype(model_dtype), num_pages=config.num_kt_pages,
        page_size_B=leaves.get("row_page_size"))
  if config.kv_scaled:
    dtype = config.kv_dtype(model_dtype)
    scales["k_scale"] = kv_scale(k_BTKH.transpose(0, 2, 1, 3), prompt_BKT, dtype)
    scales["v_scale"] = kv_scale(v_BTKH.transpose(0, 2, 1, 3), prompt_BKT, dtype)
    k = quantize(k, scales["k_scale"][:, :, None, None], dtype)
    v = quantize(v, scales["v_scale"][:, :, None, None], dtype)
  cache = KVCache(k=k, v=v, length=length, pos=lengths_B.astype(jnp.int32), spec=config.cache_spec(), **scales)
  return dataclasses.replace(cache, state=config.init_state(cache, **leaves))


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
  if cache.k_mean is not None:  # an FP8 cache holds (and its KT pages fold) the centred key
    k_new_BKH = (k_new_BKH.astype(jnp.float32) - cache.k_mean).astype(k_new_BKH.dtype)
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPlan:
  """Each sequence's own plan, as data: [B] int32 arrays (None where the method plans no such field per row).

  A batch is compiled for the maxima of its rows' plans (`rocketkv_jax.plan_rows`), and each row runs its own:
  prompt_budget: prompt tokens stage 1 keeps (window included); topr: channels stage 2 scores; page_size: its
  HSA / Quest page size. What a row gets never depends on the other rows.
  """

  prompt_budget: jax.Array | None = None
  topr: jax.Array | None = None
  page_size: jax.Array | None = None


def concat_caches(caches):
  """Joins caches of sub-batches (each a KVCache or a tuple of per-layer KVCaches) along the batch axis.

  This is how a server prefills prompts in sub-batches and decodes them as one batch: each sub-batch is
  compressed on its own (prefill_compress is per sequence), then the compressed caches are assembled.
  All parts must come from the same config (same spec, leaves and dtypes).
  """
  if isinstance(caches, KVCache):
    raise ValueError("concat_caches takes a list of caches (or of tuples of per-layer caches); got one KVCache: "
                     "pass [cache, ...]")
  caches = list(caches)
  if not caches:
    raise ValueError("concat_caches needs at least one cache")
  for i, c in enumerate(caches):
    layers = c if isinstance(c, (tuple, list)) else (c,)
    if not layers or not all(isinstance(x, KVCache) for x in layers):
      raise ValueError(f"caches[{i}] must be a KVCache or a non-empty tuple of per-layer KVCaches; got "
                       f"{type(c).__name__}")
    check_alive(f"caches[{i}]", c)
  ref = jax.tree.structure(caches[0])
  ref_shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(caches[0])]
  for i, c in enumerate(caches[1:], 1):
    if jax.tree.structure(c) != ref or [(x.shape[1:], x.dtype) for x in jax.tree.leaves(c)] != ref_shapes:
      raise ValueError(f"caches[{i}] does not match caches[0] (different config, capacity or dtype)")
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches)
