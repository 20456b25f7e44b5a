"""The two public entry points, the same for every method: `prefill_compress` and `decode_step`.

Both validate their inputs (shapes, dtypes, budgets, lengths against capacity) before any device work and
raise ValueError naming the offending value. Value checks on `lengths` / `cache.length` run when the
arrays are concrete (eager calls); inside a caller's jit they are skipped, and the caller (e.g.
`models.generate`) checks lengths statically instead.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.cache import KVCache
from rocketkv_jax.methods import MethodConfig

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _as_array(x):
  """NumPy arrays and lists are accepted; jax arrays and tracers pass through untouched."""
  return x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x)


def _check_config(config) -> None:
  if not isinstance(config, MethodConfig):
    raise ValueError(f"config={config!r} must be a MethodConfig (see rocketkv_jax.make_config)")


def _check_float(name, x, dtype=None) -> None:
  if x.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{name}.dtype={x.dtype} must be one of float32, bfloat16, float16")
  if dtype is not None and x.dtype != dtype:
    raise ValueError(f"{name}.dtype={x.dtype} must equal q.dtype={dtype}")


def _check_heads(config, n: int, n_kv: int, h: int) -> None:
  if n_kv < 1 or n % n_kv:
    raise ValueError(f"query heads N={n} must be a positive multiple of KV heads K={n_kv}")
  config.check_shapes(n, n_kv, h)


def _validate_prefill(q, k, v, lengths, config) -> None:
  _check_config(config)
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, T, N, H], [B, T, K, H], [B, T, K, H]; got q.shape={q.shape}, "
                     f"k.shape={k.shape}, v.shape={v.shape}")
  b, t, n, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be [B={b}, T={t}, K, H={h}] "
                     f"to match q.shape={q.shape}")
  _check_heads(config, n, k.shape[2], h)
  _check_float("q", q)
  _check_float("k", k, q.dtype)
  _check_float("v", v, q.dtype)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an int array of shape (B,)=({b},); got shape={lengths.shape}, "
                     f"dtype={lengths.dtype}")
  config.check_prompt(t)
  if _is_concrete(lengths):
    host = np.asarray(lengths)
    if (host < 1).any() or (host > t).any():
      raise ValueError(f"lengths={host.tolist()} must all lie in [1, T={t}]")


def _check_leaves(cache, shapes, config) -> None:
  """Every leaf the method keeps is there with its shape and dtype, and no other leaf is set."""
  for f in dataclasses.fields(cache):
    x = getattr(cache, f.name)
    if f.name == "spec" or (x is None and f.name not in shapes):
      continue
    if f.name not in shapes:
      raise ValueError(f"cache.{f.name} is set, but {config.method} keeps no {f.name}")
    if x is None or tuple(x.shape) != shapes[f.name]:
      got = None if x is None else tuple(x.shape)
      raise ValueError(f"cache.{f.name}.shape={got} must be {shapes[f.name]} for {config.cache_spec()}")
  int_leaves = [n for n in ("length", "pos", "positions") if n in shapes]
  for name in int_leaves:
    if getattr(cache, name).dtype != jnp.int32:
      raise ValueError(f"cache.{name}.dtype={getattr(cache, name).dtype} must be int32")
  if cache.v.dtype != cache.k.dtype:
    raise ValueError(f"cache.v.dtype={cache.v.dtype} must equal cache.k.dtype={cache.k.dtype}")
  if config.uses_kt_pages:
    want = config.kt_dtype(cache.k.dtype)
    for name in ("kt_min", "kt_max"):
      if getattr(cache, name).dtype != want:
        raise ValueError(f"cache.{name}.dtype={getattr(cache, name).dtype} must be {want} (kt_cache_dtype="
                         f"{config.kt_cache_dtype!r}, keys {cache.k.dtype})")


def _validate_decode(cache, q, k_new, v_new, config) -> None:
  _check_config(config)
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a KVCache from prefill_compress; got {type(cache).__name__}")
  if cache.spec != config.cache_spec():
    raise ValueError(f"the cache was built by {cache.spec} but config is {config.cache_spec()}: decode a cache "
                     "with the config that built it")
  b, n_kv, s, h = cache.k.shape
  if s != config.capacity:
    raise ValueError(f"cache capacity S={s} does not match config.capacity={config.capacity} "
                     f"({config.method}); was the cache built with this config?")
  _check_leaves(cache, config.cache_shapes(b, n_kv, h), config)
  if q.ndim != 3 or q.shape[0] != b or q.shape[2] != h:
    raise ValueError(f"q.shape={q.shape} must be [B={b}, N, H={h}]")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, n_kv, h):
      raise ValueError(f"{name}.shape={x.shape} must be [B, K, H]=({b}, {n_kv}, {h})")
  _check_heads(config, q.shape[1], n_kv, h)
  _check_float("q", q)
  _check_float("k_new", k_new, cache.k.dtype)
  _check_float("v_new", v_new, cache.k.dtype)
  if q.dtype != cache.k.dtype:
    raise ValueError(f"q.dtype={q.dtype} must equal the cache dtype {cache.k.dtype}")
  config.check_room(cache)


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill_jit(q, k, v, lengths, *, config):
  return config.prefill(q, k, v, lengths)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(0,))
def _decode_jit(cache, q, k_new, v_new, *, config):
  b, n, h = q.shape
  n_kv = k_new.shape[1]
  out, cache = config.decode(cache, q.reshape(b, n_kv, n // n_kv, h), k_new, v_new)
  return out.reshape(b, n, h), cache


def prefill_compress(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     config: MethodConfig) -> KVCache:
  """One layer's prompt (post-RoPE projections, right-padded) -> the method's compressed cache.

  q: [B, T, N, H]; k, v: [B, T, K, H]; lengths: [B] int32 in [1, T]. Query head n belongs to KV head
  n // (N // K). Stage 1 (or the baseline's eviction) happens here: the cache holds only what the method
  keeps, at the config's static capacity; every sequence of a ragged batch gets what it would get alone.
  """
  q, k, v, lengths = (_as_array(x) for x in (q, k, v, lengths))
  _validate_prefill(q, k, v, lengths, config)
  return _prefill_jit(q, k, v, jnp.asarray(lengths, jnp.int32), config=config)


def decode_step(cache: KVCache, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *,
                config: MethodConfig) -> tuple[jax.Array, KVCache]:
  """Appends the new token (q: [B, N, H]; k_new, v_new: [B, K, H], post-RoPE) at slot `length` (or the
  method's eviction slot), updates the method's pages/scores, selects, attends; returns out [B, N, H] and
  the new cache. The input cache is donated: do not reuse it."""
  q, k_new, v_new = (_as_array(x) for x in (q, k_new, v_new))
  _validate_decode(cache, q, k_new, v_new, config)
  return _decode_jit(cache, q, k_new, v_new, config=config)
