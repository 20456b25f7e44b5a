"""Every bad input raises ValueError naming the value, before any device work."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.cache import cache_leaves, replace_leaves
from rocketkv_jax.methods.h2o import H2OState
from rocketkv_jax.kernels.checks import kt_num_pages
from tests.helpers.data import key, keys, normal

B, T, N, K, H = 2, 64, 4, 2, 16


def _cfg(method="rocketkv", **kw):
  return rk.make_config(method, token_budget=64, prompt_len=T, max_new_tokens=2, head_dim=H, impl="xla", **kw)


def _qkv(t=T, n=N, n_kv=K, h=H, dtype=jnp.float32):
  x = normal(key(0), (B, t, n, h), dtype)
  y = normal(key(1), (B, t, n_kv, h), dtype)
  return x, y, y


LEN = jnp.array([T, 40], jnp.int32)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v, l: (q[0], k, v, l), r"q.shape=\(64, 4, 16\)"),
    (lambda q, k, v, l: (q, k[:, :10], v, l), r"k.shape=\(2, 10, 2, 16\)"),
    (lambda q, k, v, l: (q, k, v[..., :8], l), r"v.shape=\(2, 64, 2, 8\)"),
    (lambda q, k, v, l: (q[:, :, :3], k, v, l), r"N=3 must be a positive multiple of KV heads K=2"),
    (lambda q, k, v, l: (q, k.astype(jnp.bfloat16), v, l), r"k.dtype=bfloat16"),
    (lambda q, k, v, l: (q.astype(jnp.int32), k, v, l), r"q.dtype=int32"),
    (lambda q, k, v, l: (q, k, v, l[:1]), r"lengths must be an int array of shape \(B,\)=\(2,\)"),
    (lambda q, k, v, l: (q, k, v, l.astype(jnp.float32)), r"dtype=float32"),
    (lambda q, k, v, l: (q, k, v, jnp.array([0, 5])), r"lengths=\[0, 5\] must all lie in \[1, T=64\]"),
    (lambda q, k, v, l: (q, k, v, jnp.array([65, 5])), r"lengths=\[65, 5\]"),
])
def test_prefill_rejects(mutate, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    rk.prefill_compress(*mutate(q, k, v, LEN), config=_cfg())


def test_prompt_past_capacity():
  q, k, v = _qkv()
  cfg = rk.FullConfig(max_len=32)
  with pytest.raises(ValueError, match=r"T=64 exceeds full capacity=32"):
    rk.prefill_compress(q, k, v, LEN, config=cfg)


def test_topr_larger_than_head_dim():
  q, k, v = _qkv()
  cfg = rk.RocketKVConfig(prompt_budget=40, max_new_tokens=2, topk=8, topr=32, page_size=2)
  with pytest.raises(ValueError, match=r"topr=32 must be <= head_dim=16"):
    rk.prefill_compress(q, k, v, LEN, config=cfg)


def test_not_a_config():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="must be a MethodConfig"):
    rk.prefill_compress(q, k, v, LEN, config="rocketkv")


@pytest.mark.parametrize("method", ["full", "rocketkv", "snapkv", "hsa"])
def test_decode_past_capacity(method):
  q, k, v = _qkv()
  cfg = _cfg(method)
  cache = rk.prefill_compress(q, k, v, LEN, config=cfg)
  steps = cfg.capacity - int(np.max(cache.length))
  for _ in range(steps):
    _, cache = rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  with pytest.raises(ValueError, match=rf"has reached capacity={cfg.capacity}"):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[:, :, :8], k, v), r"q.shape=\(2, 4, 8\)"),
    (lambda q, k, v: (q, k[:1], v), r"k_new.shape=\(1, 2, 16\)"),
    (lambda q, k, v: (q, k, v[:, :1]), r"v_new.shape=\(2, 1, 16\)"),
    (lambda q, k, v: (q.astype(jnp.bfloat16), k, v), r"dtype"),
    (lambda q, k, v: (q, k.astype(jnp.float16), v), r"k_new.dtype=float16"),
])
def test_decode_rejects(mutate, match):
  q, k, v = _qkv()
  cfg = _cfg()
  cache = rk.prefill_compress(q, k, v, LEN, config=cfg)
  with pytest.raises(ValueError, match=match):
    rk.decode_step(cache, *mutate(q[:, 0], k[:, 0], v[:, 0]), config=cfg)


def test_decode_with_other_config():
  q, k, v = _qkv()
  cache = rk.prefill_compress(q, k, v, LEN, config=_cfg())
  with pytest.raises(ValueError, match=r"built by rocketkv\(.*but config is full\("):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=_cfg("full"))


def _same_capacity_pairs():
  """(built-by, decoded-with) config pairs whose caches have the same capacity and leaves' shapes (so no shape
  check can catch them) but differ in method or in a field that decides what the cache holds."""
  base = dict(prompt_budget=40, max_new_tokens=8, topk=16, topr=8, page_size=4, window_size=8, kernel_size=7,
              impl="xla")
  rocket = rk.RocketKVConfig(**base)
  snap = rk.SnapKVConfig(prompt_budget=40, max_new_tokens=8, window_size=8, kernel_size=7, impl="xla")
  full = rk.FullConfig(max_len=48, impl="xla")
  hsa = rk.HSAConfig(max_len=48, page_size=4, topr=8, topk=16, impl="xla")
  quest = rk.QuestConfig(max_len=48, page_size=4, topk=16, impl="xla")
  stream = rk.StreamingLLMConfig(token_budget=48, impl="xla")
  h2o = rk.H2OConfig(token_budget=48, impl="xla")
  return [
      (rocket, snap), (snap, rocket), (full, hsa), (hsa, full), (hsa, quest), (quest, hsa), (full, stream),
      (stream, full), (h2o, stream), (stream, h2o), (full, rk.ExactTopKConfig(max_len=48, topk=16, impl="xla")),
      (rocket, dataclasses.replace(rocket, page_size=2)),  # KT pages of another size
      (rocket, dataclasses.replace(rocket, page_size=3)),  # same page count (16), other page boundaries
      (rocket, dataclasses.replace(rocket, prompt_budget=44, max_new_tokens=4)),  # same capacity, other plan
      (rocket, dataclasses.replace(rocket, kt_cache_dtype="bfloat16")),
      (rocket, dataclasses.replace(rocket, window_size=16)),
      (stream, dataclasses.replace(stream, sink_tokens=8)),  # the same ring, other slots
      (h2o, dataclasses.replace(h2o, recent=10)),
      (hsa, dataclasses.replace(hsa, topr=4)),
  ]


@pytest.mark.parametrize("built,used", _same_capacity_pairs(), ids=lambda c: str(c.cache_spec()))
def test_decode_refuses_a_cache_of_another_spec(built, used):
  q, k, v = _qkv()
  cache = rk.prefill_compress(q[:, :40], k[:, :40], v[:, :40], jnp.array([40, 30]), config=built)
  with pytest.raises(ValueError, match=r"the cache was built by .* but config is "):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=used)


@pytest.mark.parametrize("edit,match", [
    (lambda c: replace_leaves(c, **{"state.kt_min": None}),
     r"cache\.state\.kt_min is missing \(None\), but rocketkv needs it"),
    (lambda c: replace_leaves(c, **{"state.kt_max": c.state.kt_max[..., :-1]}),
     r"cache\.state\.kt_max\.shape=\(2, 2, 16, \d+\) must be"),
    (lambda c: dataclasses.replace(c, state=H2OState(scores=jnp.zeros(c.k.shape[:3]),
                                                     positions=jnp.zeros(c.k.shape[:3], jnp.int32))),
     r"cache\.state is H2OState, but rocketkv keeps PageState"),
    (lambda c: dataclasses.replace(c, state=None),
     r"cache\.state is missing \(None\), but rocketkv needs a PageState"),
    (lambda c: replace_leaves(c, **{"state.kt_min": c.state.kt_min.astype(jnp.bfloat16),
                                    "state.kt_max": c.state.kt_max.astype(jnp.bfloat16)}),
     r"cache\.state\.kt_min\.dtype=bfloat16 must be float32"),
    (lambda c: dataclasses.replace(c, length=c.length.astype(jnp.int16)), r"cache.length.dtype=int16"),
    (lambda c: dataclasses.replace(c, v=c.v.astype(jnp.bfloat16)), r"cache.v.dtype=bfloat16"),
])
def test_decode_refuses_a_cache_of_another_layout(edit, match):
  """A cache whose leaves do not match its spec (edited by hand) is refused before any work."""
  q, k, v = _qkv()
  cfg = _cfg()
  cache = edit(rk.prefill_compress(q, k, v, LEN, config=cfg))
  with pytest.raises(ValueError, match=match):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)


def test_decode_accepts_the_same_spec_with_another_impl():
  q, k, v = _qkv()
  cfg = _cfg()
  cache = rk.prefill_compress(q, k, v, LEN, config=cfg)
  out, _ = rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=dataclasses.replace(cfg, impl="interpret"))
  assert np.isfinite(np.asarray(out)).all()


def test_decode_past_capacity_inside_jit_never_writes_out_of_range():
  """Inside a caller's jit the host check cannot run; the write past capacity is dropped, in bounds."""
  q, k, v = _qkv()
  cfg = rk.HSAConfig(max_len=T, page_size=3, topr=8, topk=16, impl="xla")  # 64 slots: last page partial
  cache = rk.prefill_compress(q, k, v, jnp.array([T, T]), config=cfg)
  before = jax.tree.map(np.asarray, cache)
  step = jax.jit(lambda c: rk.decode_step(c, q[:, 0] * 3, k[:, 0] * 3, v[:, 0] * 3, config=cfg))
  out, cache = step(cache)
  assert np.isfinite(np.asarray(out)).all()
  for name in ("k", "v", "state.kt_min", "state.kt_max"):
    np.testing.assert_array_equal(np.asarray(cache_leaves(cache)[name]), cache_leaves(before)[name], err_msg=name)
  assert np.asarray(cache.length).tolist() == [T, T]


@pytest.mark.parametrize("bad", [-1, -4, T, T + 5])
def test_append_outside_the_cache_changes_nothing_on_either_path(bad):
  """A slot outside [0, S) is dropped by the XLA scatters and by the Pallas kernel alike (no wrap-around of a
  negative slot), K/V and KT pages; the in-range row of the same call is written. The KT pages hold their rows'
  min/max up to each sequence's slot, as a cache's do (the kernel rebuilds the open page from its K rows, the
  XLA path folds the new key into it: equal on such pages); the out-of-range row's pages are random junk."""
  from rocketkv_jax import ops
  from rocketkv_jax.cache import build_kt_pages
  ks = keys(3, 6)
  k, v = (normal(x, (B, K, T, H)) for x in ks[:2])
  slot = jnp.array([bad, 7], jnp.int32)
  junk = (normal(x, (B, K, H, kt_num_pages(T, 3))) for x in ks[2:4])
  kt_min, kt_max = (jnp.where((slot >= 0)[:, None, None, None], built, j)
                    for built, j in zip(build_kt_pages(k, jnp.clip(slot, 0, T), 3, k.dtype), junk))
  k_new, v_new = (normal(x, (B, K, H)) for x in ks[4:])
  outs = {impl: ops.cache_append(k, v, k_new, v_new, slot, kt_min, kt_max, page_size=3, impl=impl)
          for impl in ("xla", "interpret")}
  for name, before, x, p in zip(("k", "v", "kt_min", "kt_max"), (k, v, kt_min, kt_max), outs["xla"],
                                outs["interpret"]):
    np.testing.assert_allclose(np.asarray(x), np.asarray(p), rtol=0, atol=0, err_msg=name)
    np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(before)[0], err_msg=f"{name}: row 0 changed")
  np.testing.assert_array_equal(np.asarray(outs["xla"][0])[1, :, 7], np.asarray(k_new)[1])


def test_numpy_and_list_inputs():
  q, k, v = (np.asarray(x) for x in _qkv())
  cfg = _cfg()
  cache = rk.prefill_compress(q, k, v, [T, 40], config=cfg)
  out, cache = rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  assert out.shape == (B, N, H) and np.asarray(cache.length).tolist() == [min(T, cfg.prompt_budget) + 1, 41]
