"""Every method against the NumPy reference model, plus the properties every method must have."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.cache import cache_leaves, replace_leaves
from tests.core.reference import RefSequence
from tests.helpers.data import keys, normal

N, K, H = 8, 2, 32


def random_inputs(seed, b, t, n=N, n_kv=K, h=H, dtype=jnp.float32):
  ks = keys(seed, 3)
  q = normal(ks[0], (b, t, n, h), dtype)
  k = normal(ks[1], (b, t, n_kv, h), dtype)
  v = normal(ks[2], (b, t, n_kv, h), dtype)
  return q, k, v


def random_steps(seed, b, n_steps, n=N, n_kv=K, h=H, dtype=jnp.float32):
  ks = keys(seed + 1000, 3)
  return (normal(ks[0], (n_steps, b, n, h), dtype), normal(ks[1], (n_steps, b, n_kv, h), dtype),
          normal(ks[2], (n_steps, b, n_kv, h), dtype))


def decode_steps(config, cache, steps):
  """Decodes `steps` from `cache`: ([B, steps, N, H] float64 outputs, final cache)."""
  outs = []
  for qs, kn, vn in zip(*steps):
    out, cache = rk.decode_step(cache, qs, kn, vn, config=config)
    outs.append(np.asarray(out, np.float64))
  return np.stack(outs, 1), cache


def run_steps(config, q, k, v, lengths, steps):
  return decode_steps(config, rk.prefill_compress(q, k, v, jnp.asarray(lengths, jnp.int32), config=config), steps)


def plan_config(method, t, prompt_len, new_tokens, **kw):
  return rk.make_config(method, token_budget=t, prompt_len=prompt_len, max_new_tokens=new_tokens, head_dim=H,
                        impl="xla", **kw)


CASES = [  # (method, budget, prompt T, lengths)
    ("full", 32, 150, [150, 97]),
    ("streaming_llm", 48, 150, [150, 20]),
    ("h2o", 48, 120, [120, 77]),
    ("snapkv", 64, 200, [200, 141]),
    ("quest", 64, 200, [200, 141]),
    ("sparq", 64, 200, [200, 141]),
    ("hsa", 64, 200, [200, 141]),
    ("exact_topk", 32, 200, [200, 141]),
    ("rocketkv", 64, 300, [300, 187]),
    ("rocketkv", 128, 600, [600, 451]),
    ("rocketkv_plus", 64, 300, [300, 187]),
    ("rocketkv_plus", 128, 600, [600, 451]),
]


@pytest.mark.parametrize("method,t,T,lengths", CASES)
def test_matches_reference(method, t, T, lengths):
  n_steps = 6
  config = plan_config(method, t, T, n_steps)
  q, k, v = random_inputs(1, len(lengths), T)
  steps = random_steps(1, len(lengths), n_steps)
  ours, cache = run_steps(config, q, k, v, lengths, steps)
  for b, L in enumerate(lengths):
    ref = RefSequence(method, config, q[b], k[b], v[b], L)
    want = np.stack([ref.step(steps[0][i, b], steps[1][i, b], steps[2][i, b]) for i in range(n_steps)])
    np.testing.assert_allclose(ours[b], want, rtol=2e-4, atol=2e-4, err_msg=f"{method} sequence {b}")
    if method not in ("h2o", "streaming_llm"):  # slot order is ours to choose there
      for kh in range(K):
        n_kept = int(cache.length[b])
        np.testing.assert_allclose(np.asarray(cache.k[b, kh, :n_kept]), np.stack(ref.k[kh]), rtol=1e-6)


def test_rocketkv_sinks_and_fp8_pages():
  T, lengths, n_steps = 400, [400, 333], 4
  config = dataclasses.replace(plan_config("rocketkv", 64, T, n_steps), sink_tokens=4)
  q, k, v = random_inputs(2, 2, T)
  steps = random_steps(2, 2, n_steps)
  ours, cache = run_steps(config, q, k, v, lengths, steps)
  for b, L in enumerate(lengths):
    ref = RefSequence("rocketkv", config, q[b], k[b], v[b], L)
    assert all(ref.keep[kh][:4] == [0, 1, 2, 3] for kh in range(K))
    want = np.stack([ref.step(*(s[i, b] for s in steps)) for i in range(n_steps)])
    np.testing.assert_allclose(ours[b], want, rtol=2e-4, atol=2e-4)
  fp8 = dataclasses.replace(config, kt_cache_dtype="float8_e5m2")
  out8, cache8 = run_steps(fp8, q, k, v, lengths, steps)
  assert cache8.state.kt_min.dtype == jnp.float8_e5m2 and np.isfinite(out8).all()
  assert cache8.state.kt_min.nbytes * 4 == cache.state.kt_min.nbytes  # float32 keys -> 1-byte pages


@pytest.mark.parametrize("method", rk.METHODS)
def test_full_budget_is_dense(method):
  """A budget covering the whole sequence reproduces dense attention."""
  T, lengths, n_steps = 90, [90, 61], 3
  t = 2 * (T + n_steps)  # top_k = t // 2 covers every token; stage 1 keeps the whole prompt
  config = plan_config(method, t, T, n_steps)
  full = plan_config("full", t, T, n_steps)
  q, k, v = random_inputs(3, 2, T)
  steps = random_steps(3, 2, n_steps)
  ours, _ = run_steps(config, q, k, v, lengths, steps)
  dense, _ = run_steps(full, q, k, v, lengths, steps)
  np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", rk.METHODS)
def test_ragged_batch_equals_alone(method):
  T, lengths, n_steps = 260, [260, 130, 201], 3
  config = plan_config(method, 64, T, n_steps)
  q, k, v = random_inputs(4, 3, T)
  steps = random_steps(4, 3, n_steps)
  batch, _ = run_steps(config, q, k, v, lengths, steps)
  for b, L in enumerate(lengths):
    alone, _ = run_steps(config, q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], [L],
                    tuple(s[:, b:b + 1] for s in steps))
    np.testing.assert_allclose(batch[b], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"{method} seq {b}")


def poison_cache(cache):
  """NaN in every slot at or past length, and in every page with no valid slot."""
  s = cache.k.shape[2]
  junk = ~(np.arange(s)[None, :] < np.asarray(cache.length)[:, None])
  leaves, fields = cache_leaves(cache), {}
  for name in ("k", "v"):
    x = np.array(leaves[name], np.float32)
    x[junk[:, None, :, None].repeat(x.shape[1], 1).repeat(x.shape[3], 3)] = np.nan
    fields[name] = jnp.asarray(x, leaves[name].dtype)
  if "state.kt_min" in leaves:
    p = leaves["state.kt_min"].shape[-1]
    page_size = -(-s // p)
    for name in ("state.kt_min", "state.kt_max"):
      x = np.array(leaves[name], np.float32)
      empty = np.arange(p)[None, :] * page_size >= np.asarray(cache.length)[:, None]
      x[np.broadcast_to(empty[:, None, None, :], x.shape)] = np.nan
      fields[name] = jnp.asarray(x, leaves[name].dtype)
  return replace_leaves(cache, **fields)


@pytest.mark.parametrize("method", rk.METHODS)
def test_poisoned_junk_never_leaks(method):
  T, lengths, n_steps = 200, [200, 90], 3
  config = plan_config(method, 64, T, n_steps)
  q, k, v = random_inputs(5, 2, T)
  steps = random_steps(5, 2, n_steps)
  clean, _ = run_steps(config, q, k, v, lengths, steps)
  pad = np.arange(T)[None, :, None, None] >= np.asarray(lengths)[:, None, None, None]
  qp, kp, vp = (jnp.where(pad, jnp.nan, x) for x in (q, k, v))  # NaN in the prompt's padding
  cache = rk.prefill_compress(qp, kp, vp, jnp.asarray(lengths), config=config)
  if method not in ("streaming_llm", "h2o"):  # those are full after prefill: no junk slot to poison
    cache = poison_cache(cache)
  outs, _ = decode_steps(config, cache, steps)
  assert np.isfinite(outs).all()
  np.testing.assert_allclose(outs, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["full", "h2o", "rocketkv", "sparq", "quest"])
def test_jit_equals_eager(method):
  T, lengths, n_steps = 160, [160, 100], 2
  config = plan_config(method, 64, T, n_steps)
  q, k, v = random_inputs(6, 2, T)
  steps = random_steps(6, 2, n_steps)
  jitted, _ = run_steps(config, q, k, v, lengths, steps)
  with jax.disable_jit():
    eager, _ = run_steps(config, q, k, v, lengths, steps)
  np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)


def test_decode_inside_user_jit_loop():
  """decode_step traces inside a caller's jit (as the model's decode loop does) without host checks."""
  T, lengths, n_steps = 200, [200, 150], 4
  config = plan_config("rocketkv", 64, T, n_steps)
  q, k, v = random_inputs(7, 2, T)
  steps = random_steps(7, 2, n_steps)
  want, _ = run_steps(config, q, k, v, lengths, steps)
  cache = rk.prefill_compress(q, k, v, jnp.asarray(lengths), config=config)

  @jax.jit
  def loop(cache, steps):
    def body(cache, s):
      out, cache = rk.decode_step(cache, *s, config=config)
      return cache, out
    return jax.lax.scan(body, cache, steps)

  _, outs = loop(cache, steps)
  np.testing.assert_allclose(np.asarray(outs).transpose(1, 0, 2, 3), want, rtol=1e-5, atol=1e-5)


def test_kv_heads_keep_different_tokens():
  T, L = 400, 400
  config = plan_config("rocketkv", 64, T, 4)
  q, k, v = random_inputs(8, 1, T)
  cache = rk.prefill_compress(q, k, v, jnp.array([L]), config=config)
  n = int(cache.length[0])
  kc = np.asarray(cache.k[0, :, :n])
  keep = [sorted(np.where((np.asarray(k[0, :, kh])[:, None, :] == kc[kh][None]).all(-1))[0].tolist())
          for kh in range(K)]
  assert keep[0] != keep[1]
  assert keep[0][-config.window_size:] == list(range(L - config.window_size, L))


def test_bfloat16_matches_float32():
  T, lengths, n_steps = 200, [200, 120], 2
  config = plan_config("rocketkv", 256, T, n_steps)  # no eviction, top-k covers all: selection is stable
  q, k, v = random_inputs(9, 2, T)
  steps = random_steps(9, 2, n_steps)
  f32, _ = run_steps(config, q, k, v, lengths, steps)
  bf, cache = run_steps(config, *(x.astype(jnp.bfloat16) for x in (q, k, v)), lengths,
                   tuple(s.astype(jnp.bfloat16) for s in steps))
  assert cache.k.dtype == jnp.bfloat16 and cache.state.kt_min.dtype == jnp.bfloat16
  assert np.linalg.norm(bf - f32) / np.linalg.norm(f32) < 2e-2


def test_cache_is_static_and_donated():
  T, n_steps = 200, 3
  config = plan_config("rocketkv", 64, T, n_steps)
  q, k, v = random_inputs(10, 2, T)
  cache = rk.prefill_compress(q, k, v, jnp.array([200, 100]), config=config)
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), cache)
  steps = random_steps(10, 2, n_steps)
  for qs, kn, vn in zip(*steps):
    _, cache = rk.decode_step(cache, qs, kn, vn, config=config)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), cache) == shapes
  assert np.asarray(cache.length).tolist() == [min(200, config.prompt_budget) + 3, 100 + 3]
  assert np.asarray(cache.pos).tolist() == [203, 103]


@pytest.mark.parametrize("method", ["rocketkv", "h2o", "sparq"])
def test_sub_batches_assemble_into_one_batch(method):
  """Prefill in sub-batches, concat_caches, decode as one batch == prefill and decode all at once."""
  T, lengths, n_steps = 220, [220, 150, 199], 2
  config = plan_config(method, 64, T, n_steps)
  q, k, v = random_inputs(11, 3, T)
  steps = random_steps(11, 3, n_steps)
  want, _ = run_steps(config, q, k, v, lengths, steps)
  parts = [rk.prefill_compress(q[:1], k[:1], v[:1], jnp.array(lengths[:1]), config=config),
           rk.prefill_compress(q[1:], k[1:], v[1:], jnp.array(lengths[1:]), config=config)]
  got, _ = decode_steps(config, rk.concat_caches(parts), steps)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="does not match"):
    rk.concat_caches([parts[0], rk.prefill_compress(q, k, v, jnp.array(lengths), config=plan_config("full", 64, T, 2))])


# (hsa runs rocketkv's ops)
@pytest.mark.parametrize("method", ["full", "snapkv", "rocketkv", "quest", "sparq", "exact_topk"])
def test_pallas_impl_matches_xla(method):
  """The impl switch: the Pallas kernels (interpret mode on CPU) give what the XLA path gives."""
  T, lengths, n_steps = 150, [150, 77], 2
  xla = plan_config(method, 64, T, n_steps)
  pallas = dataclasses.replace(xla, impl="interpret")
  q, k, v = random_inputs(12, 2, T)
  steps = random_steps(12, 2, n_steps)
  want, _ = run_steps(xla, q, k, v, lengths, steps)
  got, _ = run_steps(pallas, q, k, v, lengths, steps)
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("method", ["rocketkv", "rocketkv_plus"])  # (hsa's step is rocketkv's without stage 1)
def test_choice_in_append_keeps_the_step(method):
  """With kernels the decode step has the append's kernel make the channel choice that the scoring takes; it
  gives the same outputs and caches as the step in its parts (append, then select with the scoring's own
  choice, then attend), over steps that run past the capacity (length stops at it)."""
  T, lengths, n_steps = 150, [150, 77], 4
  config = dataclasses.replace(plan_config(method, 64, T, 2), impl="interpret")  # capacity for 2 new tokens, 4 steps
  q, k, v = random_inputs(14, 2, T)
  steps = random_steps(14, 2, n_steps)
  cache = rk.prefill_compress(q, k, v, jnp.asarray(lengths, jnp.int32), config=config)

  def in_parts(c, q, k, v):
    b, n, h = q.shape
    c = config.append(c, k, v)
    return config.attend(c, q.reshape(b, k.shape[1], n // k.shape[1], h)).reshape(b, n, h), c

  def run(step):  # inside a jit, as a step past the capacity drops its token (eagerly it raises)
    step = jax.jit(step)
    outs, c = [], cache
    for qs, kn, vn in zip(*steps):
      out, c = step(c, qs, kn, vn)
      outs.append(np.asarray(out))
    return np.stack(outs), c

  want, want_cache = run(in_parts)
  got, got_cache = run(lambda c, q, k, v: rk.decode_step(c, q, k, v, config=config))
  np.testing.assert_array_equal(got, want)
  assert (np.asarray(got_cache.length) <= config.capacity).all()
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["full", "rocketkv", "quest", "hsa"])
def test_pallas_impl_matches_xla_gpu(method):
  """The compiled Pallas kernels (dense, HSA scores, page top-k, sparse attention, token append) give what the
  XLA path gives, method level, ragged batch, float32 (XLA's dots at full precision, no TF32)."""
  if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("needs a GPU")
  T, lengths, n_steps = 1000, [1000, 301, 77], 3
  xla = plan_config(method, 128, T, n_steps)
  pallas = dataclasses.replace(xla, impl="pallas")
  q, k, v = random_inputs(13, 3, T)
  steps = random_steps(13, 3, n_steps)
  with jax.default_matmul_precision("highest"):
    want, _ = run_steps(xla, q, k, v, lengths, steps)
    got, _ = run_steps(pallas, q, k, v, lengths, steps)
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
