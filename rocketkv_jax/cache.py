"""The static-shape, per-layer KV cache pytree, its spec, and how a prefill's kept positions become one.

Slots at or past `length` are junk: nothing may depend on their contents. Every leaf's shape is fixed by
the config, so a decode step never grows anything or recompiles. How a step updates a cache is the
method's business (`methods/`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.kernels.checks import kt_num_pages


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
class KVCache:
  """One layer's cache. Unused method-specific leaves are None.

  k, v: [B, K, S, H] post-RoPE keys and values at the method's capacity S. Each KV head holds its own
    token set; slots [0, length) are valid.
  length: [B] int32, valid slots (the same for every KV head of a sequence).
  pos: [B] int32, absolute position of the next token = tokens seen so far, kept or evicted.
  kt_min, kt_max: [B, K, H, P] per-page element-wise key min / max, channel-major (HSA, RocketKV, Quest).
    Pages with no valid slot hold zeros; the last page's junk slots never enter min/max.
  scores: [B, K, S] float32 accumulated attention (H2O).
  positions: [B, K, S] int32 absolute position of each slot's token (H2O).
  v_sum: [B, K, H] float32 sum of the valid values (SparQ's mean-value correction).
  spec: static (not a leaf): the method and config fields that built the cache; `decode_step` refuses a
    config whose spec differs.
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  pos: jax.Array
  kt_min: jax.Array | None = None
  kt_max: jax.Array | None = None
  scores: jax.Array | None = None
  positions: jax.Array | None = None
  v_sum: jax.Array | None = None
  spec: CacheSpec = dataclasses.field(metadata=dict(static=True))

  @property
  def capacity(self) -> int:
    return self.k.shape[2]


def cache_nbytes(cache) -> int:
  """Bytes a cache (or a tuple of per-layer caches) holds: KV plus every auxiliary page, score and index."""
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def slot_valid(length_B: jax.Array, num_slots: int) -> jax.Array:
  """[B, S] bool: slot s of sequence b holds a token."""
  return jnp.arange(num_slots)[None, :] < length_B[:, None]


def build_kt_pages(k_BKSH: jax.Array, length_B: jax.Array, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
  """Per-page key min/max, channel-major [B, K, H, P] (P = `kt_num_pages`: padded with empty pages); junk slots
  never enter, empty pages hold 0."""
  b, n_kv, s, h = k_BKSH.shape
  num_pages = kt_num_pages(s, page_size)
  pad = num_pages * page_size - s
  kf = jnp.pad(k_BKSH.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
  valid = slot_valid(length_B, num_pages * page_size)[:, None, :, None]
  kf = kf.reshape(b, n_kv, num_pages, page_size, h)
  valid = valid.reshape(b, 1, num_pages, page_size, 1)
  k_min = jnp.min(jnp.where(valid, kf, jnp.inf), axis=3)
  k_max = jnp.max(jnp.where(valid, kf, -jnp.inf), axis=3)
  page_used = valid.any(axis=3)
  k_min = jnp.where(page_used, k_min, 0.0)
  k_max = jnp.where(page_used, k_max, 0.0)
  return (k_min.transpose(0, 1, 3, 2).astype(dtype), k_max.transpose(0, 1, 3, 2).astype(dtype))


def kept_cache(config, k_BTKH, v_BTKH, keep_BKM, count_B, lengths_B, **extras) -> KVCache:
  """The cache holding, per KV head, the prompt positions keep[b, k, :count[b]] in slots [0, count) (junk
  after), at the config's capacity, with KT pages when the method keeps them; `extras` sets other leaves."""
  capacity = config.capacity
  m = keep_BKM.shape[-1]
  valid = slot_valid(count_B, m)[:, None, :, None]

  def place(x_BTKH):
    x = jnp.take_along_axis(x_BTKH.transpose(0, 2, 1, 3), keep_BKM[..., None], axis=2)  # [B, K, M, H]
    x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - m), (0, 0)))

  k = place(k_BTKH)
  length = count_B.astype(jnp.int32)
  if config.uses_kt_pages:
    extras["kt_min"], extras["kt_max"] = build_kt_pages(k, length, config.page_size, config.kt_dtype(k.dtype))
  return KVCache(k=k, v=place(v_BTKH), length=length, pos=lengths_B.astype(jnp.int32),
                 spec=config.cache_spec(), **extras)


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
  ref = jax.tree.structure(caches[0])
  ref_shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(caches[0])]
  for i, c in enumerate(caches[1:], 1):
    if jax.tree.structure(c) != ref or [(x.shape[1:], x.dtype) for x in jax.tree.leaves(c)] != ref_shapes:
      raise ValueError(f"caches[{i}] does not match caches[0] (different config, capacity or dtype)")
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches)
