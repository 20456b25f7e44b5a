"""The static-shape, per-layer KV cache pytree and the updates every method shares.

Slots at or past `length` are junk: nothing may depend on their contents. Every leaf's shape is fixed by
the config, so a decode step never grows anything or recompiles.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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

  @property
  def capacity(self) -> int:
    return self.k.shape[2]


def cache_nbytes(cache) -> int:
  """Bytes a cache (or a tuple of per-layer caches) holds: KV plus every auxiliary page, score and index."""
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def slot_valid(length_B: jax.Array, num_slots: int) -> jax.Array:
  """[B, S] bool: slot s of sequence b holds a token."""
  return jnp.arange(num_slots)[None, :] < length_B[:, None]


def write_slot(x_BKSX: jax.Array, new_BKX: jax.Array, slot_BK: jax.Array) -> jax.Array:
  """x[b, k, slot[b, k]] = new[b, k], in place under donation (one scatter).

  A slot outside [0, S) (past the capacity: possible only when a caller's jit decodes past capacity, which
  the eager `decode_step` refuses) is dropped, never written out of range; a negative slot does not wrap
  (as in the Pallas `cache_append`)."""
  b, k = np.indices(slot_BK.shape, sparse=True)
  slot_BK = jnp.where(slot_BK < 0, x_BKSX.shape[2], slot_BK)  # .at[] would wrap a negative index
  # The barrier keeps XLA from fusing the producer of `new` (the K/V projection matmul) into the scatter:
  # on an H200 that fusion ran each projection as one thread per output element (77 us per layer).
  new_BKX = jax.lax.optimization_barrier(new_BKX.astype(x_BKSX.dtype))
  return x_BKSX.at[b, k, slot_BK].set(new_BKX, mode="drop")


def kt_dtype(config, k_dtype) -> jnp.dtype:
  return jnp.dtype(k_dtype if config.kt_cache_dtype is None else config.kt_cache_dtype)


def build_kt_pages(k_BKSH: jax.Array, length_B: jax.Array, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
  """Per-page key min/max, channel-major [B, K, H, P]; junk slots never enter, empty pages hold 0."""
  b, n_kv, s, h = k_BKSH.shape
  num_pages = -(-s // page_size)
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


def append_kt_pages(kt_min_BKHP, kt_max_BKHP, k_new_BKH, slot_B, page_size: int, num_slots: int):
  """Folds the key appended at slot `slot` into page slot // page_size; a page starts fresh at its first slot.
  A slot outside [0, num_slots) (dropped by write_slot) touches no page."""
  num_pages = kt_min_BKHP.shape[-1]
  page_B = jnp.where((slot_B >= 0) & (slot_B < num_slots), slot_B // page_size, num_pages)
  fresh_B = (slot_B % page_size == 0)[:, None, None]
  b = jnp.arange(slot_B.shape[0])
  kf = jax.lax.optimization_barrier(k_new_BKH).astype(jnp.float32)  # see write_slot
  old_min = kt_min_BKHP[b, :, :, page_B].astype(jnp.float32)  # [B, K, H]
  old_max = kt_max_BKHP[b, :, :, page_B].astype(jnp.float32)
  new_min = jnp.where(fresh_B, kf, jnp.minimum(old_min, kf))
  new_max = jnp.where(fresh_B, kf, jnp.maximum(old_max, kf))
  kt_min = kt_min_BKHP.at[b, :, :, page_B].set(new_min.astype(kt_min_BKHP.dtype), mode="drop")
  kt_max = kt_max_BKHP.at[b, :, :, page_B].set(new_max.astype(kt_max_BKHP.dtype), mode="drop")
  return kt_min, kt_max


def concat_caches(caches):
  """Joins caches of sub-batches (each a KVCache or a tuple of per-layer KVCaches) along the batch axis.

  This is how a server prefills prompts in sub-batches and decodes them as one batch: each sub-batch is
  compressed on its own (prefill_compress is per sequence), then the compressed caches are assembled.
  All parts must come from the same config (same capacity, leaves and dtypes).
  """
  caches = list(caches)
  if not caches:
    raise ValueError("concat_caches needs at least one cache")
  ref = jax.tree.structure(caches[0])
  ref_shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(caches[0])]
  for i, c in enumerate(caches[1:], 1):
    if jax.tree.structure(c) != ref or [(x.shape[1:], x.dtype) for x in jax.tree.leaves(c)] != ref_shapes:
      raise ValueError(f"caches[{i}] does not match caches[0] (different config, capacity or dtype)")
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches)
