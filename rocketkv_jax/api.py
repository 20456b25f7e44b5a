"""The two public entry points, the same for every method: `prefill_compress` and `decode_step`.

Both validate their inputs (shapes, dtypes, budgets, the cache's leaves, lengths against capacity) before any
device work and raise ValueError naming the offending value.

Value checks on `lengths` / `cache.length` need the values. Called eagerly (concrete arrays) they run on the
host and raise ValueError. Inside a caller's `jit` (or scan, ...) the values are traced: there, by default,
nothing is checked, a decode step past the capacity of a non-evicting method drops its token (the cache is not
written, `length` stays at the capacity) and prefill lengths outside [1, T] are accepted. To get a signal
there, trace the caller's function inside `rocketkv_jax.in_jit_checks()` and wrap it with
`jax.experimental.checkify`:

    from jax.experimental import checkify
    with rocketkv_jax.in_jit_checks():  # while the function is traced (its first call)
      step = jax.jit(checkify.checkify(my_step, errors=checkify.user_checks))  # or checkify.checkify(jax.jit(..))
      err, out = step(cache, ...)
    err.throw()  # or err.get(): None, or the message naming the value (e.g. "... has reached capacity=68 ...")

The checks are `checkify.debug_check`s, added to the trace only inside `in_jit_checks()` and reported only
under `checkify.checkify` (any `errors` set that includes `user_checks`, the default). They are opt-in: outside
`in_jit_checks()` nothing is added to a trace at all (on the H200, a decode step traced with them, even without
checkify, measured 9% slower at batch 1 in one A/B run, with the same kernel times). What they report:
- prefill_compress: lengths outside [1, T];
- decode_step: cache.length outside [0, capacity] or cache.pos < cache.length; and, for a method that does not
  evict (`config.evicts` False), a step on a sequence whose cache is full (its token would be dropped).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from rocketkv_jax.cache import KVCache, RowPlan, cache_leaves
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
  if config.impl == "pallas" and jax.default_backend() != "gpu":
    raise ValueError(f"config.impl='pallas' runs the compiled GPU kernels, but the backend is "
                     f"{jax.default_backend()!r}: use impl='auto' (Pallas on GPU, XLA elsewhere), 'xla' or 'interpret'")


def _check_float(name, x, other=None, dtype=None) -> None:
  """x is a float array; with `other`, its dtype equals `dtype` (the dtype of the array named `other`)."""
  if x.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{name}.dtype={x.dtype} must be one of float32, bfloat16, float16")
  if other is not None and x.dtype != dtype:
    raise ValueError(f"{name}.dtype={x.dtype} must equal {other}.dtype={dtype}")


def _check_heads(config, n: int, n_kv: int, h: int) -> None:
  if n_kv < 1 or n < 1 or n % n_kv:
    raise ValueError(f"query heads N={n} must be a positive multiple of KV heads K={n_kv}")
  if h < 1:
    raise ValueError(f"head dim H={h} must be >= 1")
  config.check_shapes(n, n_kv, h)


def _host_lengths(lengths):
  """The lengths' values on the host when they are known now (not a tracer), before any cast to int32 (so a
  value that int32 cannot hold is reported, not wrapped); else None."""
  if isinstance(lengths, jax.core.Tracer):
    return None
  return np.asarray(lengths)


def _validate_prefill(q, k, v, lengths, host, config, rows=None) -> None:
  _check_config(config)
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, T, N, H], [B, T, K, H], [B, T, K, H]; got q.shape={q.shape}, "
                     f"k.shape={k.shape}, v.shape={v.shape}")
  b, t, n, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be [B={b}, T={t}, K, H={h}] "
                     f"to match q.shape={q.shape}")
  if t < 1:
    raise ValueError(f"the prompt length T={t} (q.shape={q.shape}) must be >= 1")
  _check_heads(config, n, k.shape[2], h)
  _check_float("q", q)
  _check_float("k", k, "q", q.dtype)
  _check_float("v", v, "q", q.dtype)
  config.check_kv_dtype(k.dtype)
  shape, dtype = (lengths.shape, lengths.dtype) if host is None else (host.shape, host.dtype)
  if shape != (b,) or not np.issubdtype(dtype, np.integer):
    raise ValueError(f"lengths must be an int array of shape (B,)=({b},); got shape={shape}, dtype={dtype}")
  config.check_prompt(t)
  config.check_rows(rows, b)
  if host is not None and ((host < 1).any() or (host > t).any()):
    raise ValueError(f"lengths={host.tolist()} must all lie in [1, T={t}]")


def _check_state_class(cache, config) -> None:
  """cache.state is of the class the method keeps (`config.state_class`), or None when it keeps none."""
  want, got = config.state_class, cache.state
  if want is None and got is not None:
    raise ValueError(f"cache.state is {type(got).__name__}, but {config.method} keeps no state (None)")
  if want is not None and got is None:
    raise ValueError(f"cache.state is missing (None), but {config.method} needs a {want.__name__} for "
                     f"{config.cache_spec()}: build the cache with prefill_compress")
  if want is not None and type(got) is not want:
    raise ValueError(f"cache.state is {type(got).__name__}, but {config.method} keeps {want.__name__}")


def _check_leaves(cache, config, model_dtype, n_heads: int | None = None) -> tuple[int, int, int, int]:
  """The method's state is of its class, and every leaf the method keeps (`config.cache_shapes`, named as
  `cache_leaves` names them: "state.kt_min"...) is there, alive, with its shape and dtype (K/V
  `config.kv_dtype(model_dtype)`), and no other leaf is set. Returns the cache's (B, K, S, H)."""
  for name in ("k", "v"):
    x = getattr(cache, name)
    if x is None or getattr(x, "ndim", None) != 4:
      got = None if x is None else getattr(x, "shape", type(x).__name__)
      raise ValueError(f"cache.{name} is {got}, but {config.method} needs cache.{name} [B, K, S, H]: build the "
                       "cache with prefill_compress")
  b, n_kv, s, h = cache.k.shape
  shapes = config.cache_shapes(b, n_kv, h, n_heads)
  _check_state_class(cache, config)
  leaves = cache_leaves(cache)
  for name, x in leaves.items():
    if x is None and name not in shapes:
      continue
    if name not in shapes:
      raise ValueError(f"cache.{name} is set, but {config.method} keeps no {name}")
    if x is None:
      raise ValueError(f"cache.{name} is missing (None), but {config.method} needs it: shape {shapes[name]} "
                       f"for {config.cache_spec()}")
    if tuple(getattr(x, "shape", ())) != shapes[name]:
      raise ValueError(f"cache.{name}.shape={tuple(getattr(x, 'shape', ()))} must be {shapes[name]} for "
                       f"{config.cache_spec()}")
    if not isinstance(x, jax.core.Tracer) and getattr(x, "is_deleted", lambda: False)():
      raise ValueError(f"cache.{name} has been deleted: the cache was donated to an earlier decode_step; pass "
                       "the cache that call returned")
  if config.kv_scaled:
    if cache.k.dtype != config.kv_dtype(model_dtype):
      raise ValueError(f"cache.k.dtype={cache.k.dtype} must be {config.kv_cache_dtype} (kv_cache_dtype)")
  else:
    _check_float("cache.k", cache.k)
  for name in ("length", "pos", "state.positions", "state.row_topr", "state.row_page_size"):
    if name in shapes and leaves[name].dtype != jnp.int32:
      raise ValueError(f"cache.{name}.dtype={leaves[name].dtype} must be int32")
  for name in ("state.scores", "state.v_sum", "k_scale", "v_scale", "k_mean"):
    if name in shapes and leaves[name].dtype != jnp.float32:
      raise ValueError(f"cache.{name}.dtype={leaves[name].dtype} must be float32")
  if cache.v.dtype != cache.k.dtype:
    raise ValueError(f"cache.v.dtype={cache.v.dtype} must equal cache.k.dtype={cache.k.dtype}")
  if config.uses_kt_pages:
    want = config.kt_dtype(model_dtype)
    for name in ("state.kt_min", "state.kt_max"):
      if leaves[name].dtype != want:
        raise ValueError(f"cache.{name}.dtype={leaves[name].dtype} must be {want} (kt_cache_dtype="
                         f"{config.kt_cache_dtype!r}, keys {jnp.dtype(model_dtype)})")
  return b, n_kv, s, h


def _check_cache_values(cache, config) -> None:
  """A concrete cache's length lies in [0, capacity] and pos >= length (a cache edited by hand can break
  either, and every method would then read or write the wrong slots)."""
  length, pos = np.asarray(cache.length), np.asarray(cache.pos)
  if (length < 0).any() or (length > config.capacity).any():
    raise ValueError(f"cache.length={length.tolist()} must lie in [0, capacity={config.capacity}]")
  if (pos < length).any():
    raise ValueError(f"cache.pos={pos.tolist()} must be >= cache.length={length.tolist()} (tokens seen >= "
                     "tokens kept)")


def _validate_decode(cache, q, k_new, v_new, config) -> None:
  _check_config(config)
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a KVCache from prefill_compress; got {type(cache).__name__}")
  if cache.spec != config.cache_spec():
    raise ValueError(f"the cache was built by {cache.spec} but config is {config.cache_spec()}: decode a cache "
                     "with the config that built it")
  # the model's dtype: q's with an FP8 cache, else the cache's (a missing cache.k is reported by _check_leaves)
  b, n_kv, s, h = _check_leaves(cache, config, q.dtype if config.kv_scaled else getattr(cache.k, "dtype", q.dtype),
                                q.shape[1] if q.ndim == 3 else None)
  if s != config.capacity:
    raise ValueError(f"cache capacity S={s} does not match config.capacity={config.capacity} "
                     f"({config.method}); was the cache built with this config?")
  if q.ndim != 3 or q.shape[0] != b or q.shape[2] != h:
    raise ValueError(f"q.shape={q.shape} must be [B={b}, N, H={h}]")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, n_kv, h):
      raise ValueError(f"{name}.shape={x.shape} must be [B, K, H]=({b}, {n_kv}, {h})")
  _check_heads(config, q.shape[1], n_kv, h)
  if config.kv_scaled:  # an FP8 cache: the step's q, k_new, v_new share the model's dtype
    _check_float("q", q)
    _check_float("k_new", k_new, "q", q.dtype)
    _check_float("v_new", v_new, "q", q.dtype)
  else:
    _check_float("q", q, "cache.k", cache.k.dtype)
    _check_float("k_new", k_new, "cache.k", cache.k.dtype)
    _check_float("v_new", v_new, "cache.k", cache.k.dtype)
  if _is_concrete(cache.length) and _is_concrete(cache.pos):
    _check_cache_values(cache, config)
  config.check_room(cache)


def _braces(text: str) -> str:
  """Text safe inside a checkify message (which is str.format-ed with the traced values)."""
  return str(text).replace("{", "{{").replace("}", "}}")


_IN_JIT_CHECKS = contextvars.ContextVar("rocketkv_in_jit_checks", default=False)


@contextlib.contextmanager
def in_jit_checks(enabled: bool = True):
  """Within this block, prefill_compress and decode_step traced with traced lengths add the checkify checks of
  the module doc (reported under `checkify.checkify`). A function traced outside it has none: jit caches its
  trace, so enter the block before the first call of a new jit."""
  token = _IN_JIT_CHECKS.set(bool(enabled))
  try:
    yield
  finally:
    _IN_JIT_CHECKS.reset(token)


def _checkify_prefill(lengths, t: int) -> None:
  """Traced lengths: a check that `checkify.checkify` reports (a no-op otherwise; see the module doc)."""
  checkify.debug_check(jnp.all((lengths >= 1) & (lengths <= t)),
                       f"prefill_compress: lengths={{lengths}} must all lie in [1, T={t}]", lengths=lengths)


def _checkify_decode(cache, config) -> None:
  """Traced cache: checks that `checkify.checkify` reports (no-ops otherwise; see the module doc)."""
  cap, method = config.capacity, _braces(config.method)
  length = cache.length
  checkify.debug_check(jnp.all((length >= 0) & (length <= cap) & (cache.pos >= length)),
                       f"decode_step ({method}): cache.length={{length}} must lie in [0, capacity={cap}] and "
                       "cache.pos={pos} must be >= it", length=length, pos=cache.pos)
  if not config.evicts:
    checkify.debug_check(jnp.all(length < cap),
                         f"decode_step past capacity: cache.length={{length}} has reached capacity={cap} for "
                         f"{method}; this step's token is dropped (plan a larger max_new_tokens / max_len)",
                         length=length)


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill_jit(q, k, v, lengths, rows, *, config):
  return config.prefill(q, k, v, lengths, rows)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(0,))
def _decode_jit(cache, q, k_new, v_new, *, config):
  b, n, h = q.shape
  n_kv = k_new.shape[1]
  out, cache = config.decode(cache, q.reshape(b, n_kv, n // n_kv, h), k_new, v_new)
  return out.reshape(b, n, h), cache


def prefill_compress(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     config: MethodConfig, rows: RowPlan | None = None) -> KVCache:
  """One layer's prompt (post-RoPE projections, right-padded) -> the method's compressed cache.

  q: [B, T, N, H]; k, v: [B, T, K, H]; lengths: [B] int32 in [1, T]. Query head n belongs to KV head
  n // (N // K). Stage 1 (or the baseline's eviction) happens here: the cache holds only what the method
  keeps, at the config's static capacity; every sequence of a ragged batch gets what it would get alone.
  rows: each sequence's own plan (`rocketkv_jax.plan_rows`: config is then the batch's, the maxima of the rows'
  plans); the cache carries what decode needs of it. None: every sequence runs `config`'s plan.

  Raises ValueError (naming the value) for bad shapes, dtypes, a prompt longer than the config allows, and,
  when `lengths` is concrete, lengths outside [1, T] (checked before any cast to int32). With traced lengths
  (inside a caller's jit) the range is checked only inside `in_jit_checks()`, under `checkify.checkify` (module
  doc).
  """
  host = _host_lengths(lengths)
  q, k, v = (_as_array(x) for x in (q, k, v))
  _validate_prefill(q, k, v, lengths if host is None else host, host, config, rows)
  if host is None and _IN_JIT_CHECKS.get():
    _checkify_prefill(lengths, q.shape[1])
  return _prefill_jit(q, k, v, jnp.asarray(lengths if host is None else host, jnp.int32), rows, config=config)


def decode_step(cache: KVCache, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *,
                config: MethodConfig) -> tuple[jax.Array, KVCache]:
  """Appends the new token (q: [B, N, H]; k_new, v_new: [B, K, H], post-RoPE) at slot `length` (or the
  method's eviction slot), updates the method's pages/scores, selects, attends; returns out [B, N, H] and
  the new cache. The input cache is donated: do not reuse it (a deleted leaf is reported as such).

  Raises ValueError (naming the value) for a cache another config built, a missing, extra, deleted or
  mis-shaped leaf, dtypes that differ (q, k_new, v_new must have cache.k's dtype, or one float dtype with an
  FP8 cache), and, when the cache is
  concrete, cache.length outside [0, capacity], cache.pos < cache.length, or no slot left for this token (a
  method that does not evict). Inside a caller's jit the value checks run only when traced inside
  `in_jit_checks()` and run under `checkify.checkify` (module doc); otherwise a step past capacity drops its token.
  """
  q, k_new, v_new = (_as_array(x) for x in (q, k_new, v_new))
  _validate_decode(cache, q, k_new, v_new, config)
  if _IN_JIT_CHECKS.get() and not (_is_concrete(cache.length) and _is_concrete(cache.pos)):
    _checkify_decode(cache, config)
  return _decode_jit(cache, q, k_new, v_new, config=config)
