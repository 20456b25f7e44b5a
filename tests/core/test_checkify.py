"""Inside a caller's jit the value checks cannot raise on the host; traced inside `rk.in_jit_checks()` and run
under `checkify.checkify` they are reported; outside `in_jit_checks()` nothing is added to the trace at all
(api.py's module doc)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import rocketkv_jax as rk
from rocketkv_jax.cache import cache_leaves
from tests.helpers.data import keys, normal

B, T, N, K, H = 2, 32, 4, 2, 16


def _qkv(t=T, seed=0):
  ks = keys(seed, 3)
  return (normal(ks[0], (B, t, N, H)), normal(ks[1], (B, t, K, H)),
          normal(ks[2], (B, t, K, H)))


@pytest.fixture(autouse=True)
def _checks(request):
  """Every test traces inside in_jit_checks(), except those about the default (no checks)."""
  if "without" in request.node.name or "default" in request.node.name:
    yield
    return
  with rk.in_jit_checks():
    yield


def _cfg(method, **kw):
  return rk.make_config(method, token_budget=64, prompt_len=T, max_new_tokens=2, head_dim=H, impl="xla", **kw)


@pytest.mark.parametrize("method", ["full", "rocketkv", "hsa"])
def test_decode_past_capacity_in_jit_is_reported_under_checkify(method):
  q, k, v = _qkv()
  cfg = _cfg(method)
  cache = rk.prefill_compress(q, k, v, jnp.array([T, T]), config=cfg)
  step = lambda c: rk.decode_step(c, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  checked = jax.jit(checkify.checkify(step, errors=checkify.user_checks))
  for _ in range(cfg.capacity - int(np.max(cache.length))):  # fill the cache: no error
    err, (_, cache) = checked(cache)
    assert err.get() is None
  err, (out, cache) = checked(cache)
  assert err.get() is not None and f"has reached capacity={cfg.capacity}" in err.get() and method in err.get()
  with pytest.raises(checkify.JaxRuntimeError, match=rf"cache.length=\[{cfg.capacity} {cfg.capacity}\]"):
    err.throw()
  assert np.isfinite(np.asarray(out)).all()


def test_evicting_method_never_reports_capacity():
  q, k, v = _qkv()
  cfg = _cfg("streaming_llm")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, T]), config=cfg)
  checked = jax.jit(checkify.checkify(lambda c: rk.decode_step(c, q[:, 0], k[:, 0], v[:, 0], config=cfg)))
  for _ in range(3):
    err, (_, cache) = checked(cache)
    assert err.get() is None


@pytest.mark.parametrize("lengths", [[0, 5], [T + 1, 5], [-3, 5]])
@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_prefill_lengths_out_of_range_in_jit_are_reported(lengths, method):
  q, k, v = _qkv()
  cfg = _cfg(method, window_size=8) if method == "snapkv" else _cfg(method)
  f = checkify.checkify(jax.jit(lambda lengths: rk.prefill_compress(q, k, v, lengths, config=cfg)))
  err, _ = f(jnp.array(lengths, jnp.int32))
  assert err.get() is not None and f"must all lie in [1, T={T}]" in err.get()
  assert str(lengths[0]) in err.get()
  err, _ = f(jnp.array([T, 1], jnp.int32))
  assert err.get() is None


def test_hand_edited_length_in_jit_is_reported():
  q, k, v = _qkv()
  cfg = _cfg("streaming_llm")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, T]), config=cfg)
  bad = cache.__class__(**{**{f: getattr(cache, f) for f in ("k", "v", "pos", "spec")},
                           "length": jnp.array([-1, 3], jnp.int32)})
  err, _ = checkify.checkify(jax.jit(lambda c: rk.decode_step(c, q[:, 0], k[:, 0], v[:, 0], config=cfg)))(bad)
  assert "cache.length=[-1  3] must lie in [0, capacity=64]" in err.get()


def test_without_checkify_results_are_unchanged():
  """Plain jit: no trace-time error, the same outputs as eager decoding, the token past capacity dropped."""
  q, k, v = _qkv()
  cfg = _cfg("rocketkv")
  lengths = jnp.array([T, 20])
  eager = rk.prefill_compress(q, k, v, lengths, config=cfg)
  jitted = jax.jit(lambda q, k, v, l: rk.prefill_compress(q, k, v, l, config=cfg))(q, k, v, lengths)
  eager_leaves, jitted_leaves = cache_leaves(eager), cache_leaves(jitted)
  for name in ("k", "v", "length", "pos", "state.kt_min", "state.kt_max"):
    np.testing.assert_array_equal(np.asarray(eager_leaves[name]), np.asarray(jitted_leaves[name]))
  step = jax.jit(lambda c, i: rk.decode_step(c, q[:, i], k[:, i], v[:, i], config=cfg))
  for i in range(cfg.max_new_tokens):
    want, eager = rk.decode_step(eager, q[:, i], k[:, i], v[:, i], config=cfg)
    got, jitted = step(jitted, i)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  before = np.asarray(jitted.k)
  _, jitted = step(jitted, 5)  # sequence 0 is full: its token is dropped, nothing raised
  assert np.asarray(jitted.length).tolist()[0] == cfg.capacity
  np.testing.assert_array_equal(np.asarray(jitted.k)[0], before[0])


@pytest.mark.parametrize("method", ["full", "rocketkv", "h2o"])
def test_default_traces_carry_no_checks(method):
  """Outside in_jit_checks() a trace has no check at all; inside it, the checks are there."""
  q, k, v = _qkv()
  cfg = _cfg(method)
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 20]), config=cfg)

  def fn(cache, q, k, v, lengths):
    c2 = rk.prefill_compress(q, k, v, lengths, config=cfg)
    out, cache = rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
    return out, cache, c2

  args = (cache, q, k, v, jnp.array([T, 20]))
  assert "check[debug=True]" not in str(jax.make_jaxpr(fn)(*args))
  with rk.in_jit_checks():  # a new function: make_jaxpr (like jit) would reuse fn's cached trace
    assert "check[debug=True]" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
