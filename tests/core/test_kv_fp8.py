"""FP8 K/V storage (`kv_cache_dtype`): every method's FP8 step is its step over the values the cache holds
(`kernels/kv_quant.py`), stage 1 and the KT pages come from the full-precision prompt, bf16 is unchanged, and a
decode token past the prompt's range saturates instead of overflowing."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.cache import cache_leaves, read_keys, read_values, replace_leaves
from rocketkv_jax.kernels.kv_quant import dequantize, fp8_max, quantize
from tests.core.test_methods import CASES, H, K, N, decode_steps, plan_config, run_steps
from tests.helpers.fp8 import one_fp8_step
from tests.helpers.data import keys, normal


E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
# Relative error (Frobenius) of a whole decode's outputs against dense float32 attention with e4m3 / e5m2 K and
# V on unit-normal data: measured 0.037 / 0.080 (this file's full-budget test, every method); bounds with margin.
FP8_TOLERANCE = {E4M3: 0.06, E5M2: 0.12}


def _inputs(seed, b, t, dtype=jnp.float32):
  ks = keys(seed, 3)
  return (normal(ks[0], (b, t, N, H), dtype), normal(ks[1], (b, t, K, H), dtype),
          normal(ks[2], (b, t, K, H), dtype))


def _steps(seed, b, n_steps):
  ks = keys(seed + 1000, 3)
  return (normal(ks[0], (n_steps, b, N, H)), normal(ks[1], (n_steps, b, K, H)),
          normal(ks[2], (n_steps, b, K, H)))


def _poison_cache(cache):
  """NaN in every K/V slot at or past length (an FP8 NaN) and in every KT page with no valid slot."""
  s = cache.k.shape[2]
  junk = ~(np.arange(s)[None, :] < np.asarray(cache.length)[:, None])
  leaves, fields = cache_leaves(cache), {}
  for name in ("k", "v"):
    x = np.array(leaves[name].astype(jnp.float32))
    x[np.broadcast_to(junk[:, None, :, None], x.shape)] = np.nan
    fields[name] = jnp.asarray(x).astype(leaves[name].dtype)
  if "state.kt_min" in leaves:
    p = leaves["state.kt_min"].shape[-1]
    page_size = -(-s // p)
    for name in ("state.kt_min", "state.kt_max"):
      x = np.array(leaves[name].astype(jnp.float32))
      empty = np.arange(p)[None, :] * page_size >= np.asarray(cache.length)[:, None]
      x[np.broadcast_to(empty[:, None, None, :], x.shape)] = np.nan
      fields[name] = jnp.asarray(x).astype(leaves[name].dtype)
  return replace_leaves(cache, **fields)


def _assert_pages_shifted(kt8, kt32, k_mean):
  """An FP8 cache's KT pages (min / max of the centred keys) are the full-precision cache's shifted by the key
  mean; empty pages hold 0 in both."""
  kt8, kt32 = np.asarray(kt8), np.asarray(kt32)
  shifted = kt8 + np.asarray(k_mean)[..., None]
  np.testing.assert_allclose(np.where(kt8 == 0, kt32, shifted), kt32, rtol=1e-6, atol=1e-6)


def _error_against_dense(config, t, lengths, inputs, steps):
  """(relative error of the config's decode outputs against dense float32 attention, the config's final cache)."""
  ours, cache = run_steps(config, *inputs, lengths, steps)
  dense, _ = run_steps(plan_config("full", t, inputs[0].shape[1], len(steps[0])), *inputs, lengths, steps)
  return np.linalg.norm(ours - dense) / np.linalg.norm(dense), cache


def _on_grid(x_BKH, scale_BK, dtype):
  """x rounded to the values an FP8 cache of these scales can hold (quantizing it again is exact)."""
  return dequantize(quantize(x_BKH, scale_BK[..., None], dtype), scale_BK[..., None])


def test_invalid_dtype_is_refused():
  with pytest.raises(ValueError, match="kv_cache_dtype='float8'"):
    plan_config("rocketkv", 64, 200, 4, kv_cache_dtype="float8")
  with pytest.raises(ValueError, match="kv_cache_dtype=<class"):
    plan_config("full", 64, 200, 4, kv_cache_dtype=jnp.float8_e4m3fn)
  config = plan_config("full", 64, 100, 2, kv_cache_dtype="bfloat16")
  q, k, v = _inputs(0, 1, 100)  # float32
  with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16'.*float32"):
    rk.prefill_compress(q, k, v, jnp.array([100]), config=config)


def test_bfloat16_is_unchanged():
  """None and "bfloat16" store the bf16 model's K/V as they are: no scales, the same outputs."""
  T, lengths, n = 150, [150, 77], 2
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(1, 2, T))
  steps = tuple(x.astype(jnp.bfloat16) for x in _steps(1, 2, n))
  base = plan_config("rocketkv", 64, T, n)
  a, ca = run_steps(base, q, k, v, lengths, steps)
  b, cb = run_steps(dataclasses.replace(base, kv_cache_dtype="bfloat16"), q, k, v, lengths, steps)
  np.testing.assert_array_equal(a, b)
  assert ca.k.dtype == jnp.bfloat16 and ca.k_scale is None and cb.k_scale is None
  assert rk.cache_nbytes(ca) == rk.cache_nbytes(cb)


@pytest.mark.parametrize("method", ["rocketkv", "quest"])
def test_fp8_kt_default(method):
  """Under FP8 K/V, KT pages left unset are stored in float8_e5m2 (half of bf16's bytes); kt_cache_dtype set
  keeps them as asked; with K/V in the model's dtype they are in the keys' dtype."""
  T, lengths = 150, [150, 77]
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(3, 2, T))
  base = plan_config(method, 64, T, 2)
  sizes = {}
  for name, kv, kt, want in (("bf16", None, None, jnp.bfloat16), ("fp8", E4M3, None, jnp.float8_e5m2),
                             ("fp8_kt_bf16", E4M3, "bfloat16", jnp.bfloat16)):
    config = dataclasses.replace(base, kv_cache_dtype=kv, kt_cache_dtype=kt)
    cache = rk.prefill_compress(q, k, v, jnp.asarray(lengths), config=config)
    assert cache.state.kt_min.dtype == want and cache.state.kt_max.dtype == want, name
    sizes[name] = rk.cache_nbytes(cache)
  kt_bytes = 2 * cache.state.kt_min.size  # two bf16 page arrays against two FP8 ones
  assert sizes["fp8_kt_bf16"] - sizes["fp8"] == kt_bytes


@pytest.mark.parametrize("method,t,T,lengths", CASES[:9] + CASES[10:11])
def test_fp8_is_the_step_over_the_held_values(method, t, T, lengths):
  """An FP8 cache decodes as the same method over a full-precision cache holding the dequantized values: the same
  stage-1 keep, KT pages (both from the full-precision prompt; the FP8 cache's from the keys centred on their
  mean, so each page is shifted by it), scores and outputs. The decode tokens are put on the FP8 grid, so that
  storing them is exact and the two caches stay equal."""
  n_steps = 4
  c32 = plan_config(method, t, T, n_steps)
  # The KT pages in the keys' dtype in both (under FP8 K/V they default to float8_e5m2: test_fp8_kt_default)
  c8 = dataclasses.replace(c32, kv_cache_dtype=E4M3, **({"kt_cache_dtype": "float32"} if c32.uses_kt_pages else {}))
  q, k, v = _inputs(7, len(lengths), T)
  lengths = jnp.asarray(lengths, jnp.int32)
  cache8 = rk.prefill_compress(q, k, v, lengths, config=c8)
  cache32 = rk.prefill_compress(q, k, v, lengths, config=c32)
  assert cache8.k.dtype == jnp.float8_e4m3fn and cache8.k_scale.shape == (len(lengths), k.shape[2])
  leaves8, leaves32 = cache_leaves(cache8), cache_leaves(cache32)
  assert type(cache8.state) is type(cache32.state) and set(leaves8) == set(leaves32)
  assert leaves32["k_mean"] is None and cache8.k_mean.shape == (len(lengths), k.shape[2], H)
  pages = {"state.kt_min", "state.kt_max"} & set(leaves8)
  for name in pages:
    _assert_pages_shifted(leaves8[name], leaves32[name], cache8.k_mean)
  for name in set(leaves8) - {"k", "v", "k_scale", "v_scale", "k_mean", "state.v_sum"} - pages:
    a, b = leaves8[name], leaves32[name]
    assert (a is None) == (b is None), name
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  held = dataclasses.replace(cache32, k=read_keys(cache8), v=read_values(cache8))
  if "state.v_sum" in leaves8:  # (each cache is donated to its own steps)
    held = replace_leaves(held, **{"state.v_sum": jnp.copy(leaves8["state.v_sum"])})
  qs, ks, vs = _steps(7, len(lengths), n_steps)
  ks = jnp.stack([_on_grid(x - cache8.k_mean, cache8.k_scale, cache8.k.dtype) + cache8.k_mean for x in ks])
  vs = jnp.stack([_on_grid(x, cache8.v_scale, cache8.v.dtype) for x in vs])
  got, end8 = decode_steps(c8, cache8, (qs, ks, vs))
  want, end32 = decode_steps(c32, held, (qs, ks, vs))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(read_keys(end8)), np.asarray(end32.k))
  if pages:
    _assert_pages_shifted(end8.state.kt_min, end32.state.kt_min, end8.k_mean)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("method", rk.METHODS)
def test_full_budget_fp8_is_close_to_dense(method, dtype):
  """With a budget covering the sequence, FP8 K/V is dense attention within FP8's error (FP8_TOLERANCE)."""
  T, lengths, n_steps = 90, [90, 61], 3
  t = 2 * (T + n_steps)
  config = plan_config(method, t, T, n_steps, kv_cache_dtype=dtype)
  err, cache = _error_against_dense(config, t, lengths, _inputs(3, 2, T), _steps(3, 2, n_steps))
  print(f"{method} {dtype} relative error {err:.4f}")
  assert err < FP8_TOLERANCE[dtype], (method, dtype, err)
  assert cache.k.dtype == jnp.dtype(dtype) and cache.k.nbytes == cache.k.size  # 1 byte per element


@pytest.mark.parametrize("method", ["full", "rocketkv", "sparq"])
def test_key_offsets_cost_nothing(method):
  """Keys with large per-channel offsets (as a k_proj bias gives: Qwen2's layer-0 keys sit ~24 standard deviations
  off zero) decode within FP8's usual error: the cache stores them centred on their prompt mean. Stored as they
  are, the offsets would set the scale and their rounding (~3% of 60 per element) would swamp the logits."""
  T, lengths, n_steps = 120, [120, 70], 3
  t = 2 * (T + n_steps)
  q, k, v = _inputs(13, 2, T)
  qs, ks, vs = _steps(13, 2, n_steps)
  offset = jnp.zeros(H).at[:4].set(jnp.array([60.0, -45.0, 30.0, 50.0]))
  k, ks = k + offset, ks + offset
  config = plan_config(method, t, T, n_steps, kv_cache_dtype=E4M3)
  err, _ = _error_against_dense(config, t, lengths, (q, k, v), (qs, ks, vs))
  assert err < FP8_TOLERANCE[E4M3], (method, err)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("method", ["full", "rocketkv", "sparq", "h2o"])
def test_decode_token_past_the_prompt_saturates(method, dtype):
  """A decode token 10x past the prompt's amax is stored at the dtype's largest value: finite outputs, no inf."""
  T, lengths, n_steps = 120, [120, 70], 2
  config = plan_config(method, 64, T, n_steps, kv_cache_dtype=dtype)
  q, k, v = _inputs(9, 2, T)
  qs, ks, vs = _steps(9, 2, n_steps)
  big = 10 * float(jnp.abs(k).max())
  ks, vs = ks.at[0, :, :, 0].set(big), vs.at[0, :, :, 1].set(-big)
  outs, cache = run_steps(config, q, k, v, lengths, (qs, ks, vs))
  assert np.isfinite(outs).all()
  m = fp8_max(cache.k.dtype)
  k_held = np.asarray(cache.k.astype(jnp.float32))
  assert np.isfinite(k_held).all() and np.abs(k_held).max() == m  # the big channel, clipped
  assert np.abs(np.asarray(cache.v.astype(jnp.float32))).max() == m


@pytest.mark.parametrize("method", ["full", "rocketkv", "quest"])
def test_poisoned_junk_never_leaks_fp8(method):
  T, lengths, n_steps = 200, [200, 90], 2
  config = plan_config(method, 64, T, n_steps, kv_cache_dtype=E4M3)
  q, k, v = _inputs(5, 2, T)
  steps = _steps(5, 2, n_steps)
  clean, _ = run_steps(config, q, k, v, lengths, steps)
  pad = np.arange(T)[None, :, None, None] >= np.asarray(lengths)[:, None, None, None]
  qp, kp, vp = (jnp.where(pad, jnp.nan, x) for x in (q, k, v))  # NaN in the prompt's padding: not in the scales
  cache = _poison_cache(rk.prefill_compress(qp, kp, vp, jnp.asarray(lengths), config=config))
  outs, _ = decode_steps(config, cache, steps)
  assert np.isfinite(outs).all()
  np.testing.assert_allclose(outs, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["full", "rocketkv", "sparq"])
def test_kernels_match_xla_fp8(method):
  """The Pallas kernels (interpret mode) read and append FP8 as the XLA path does, bf16 model."""
  T, lengths, n_steps = 150, [150, 77], 2
  xla = plan_config(method, 64, T, n_steps, kv_cache_dtype=E4M3)
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(12, 2, T))
  steps = tuple(x.astype(jnp.bfloat16) for x in _steps(12, 2, n_steps))
  want, cw = run_steps(xla, q, k, v, lengths, steps)
  got, cg = run_steps(dataclasses.replace(xla, impl="interpret"), q, k, v, lengths, steps)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  np.testing.assert_array_equal(np.asarray(cg.k.astype(jnp.float32)), np.asarray(cw.k.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(cg.v.astype(jnp.float32)), np.asarray(cw.v.astype(jnp.float32)))


def test_scales_come_from_the_whole_prompt():
  """k_mean = the mean key over the prompt's valid tokens (kept or evicted), per channel; k_scale = amax of the
  centred keys / 448, v_scale = amax of the values / 448; a zero head gets 1."""
  T, lengths = 200, [200, 120]
  config = plan_config("snapkv", 64, T, 2, kv_cache_dtype=E4M3)
  q, k, v = _inputs(4, 2, T)
  k = k.at[:, :, 1].set(0.0)  # KV head 1: all zeros
  cache = rk.prefill_compress(q, k, v, jnp.asarray(lengths), config=config)
  for b, L in enumerate(lengths):
    mean = k[b, :L, 0].mean(axis=0)
    np.testing.assert_allclose(np.asarray(cache.k_mean[b, 0]), np.asarray(mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(cache.k_scale[b, 0]), float(jnp.abs(k[b, :L, 0] - mean).max()) / 448,
                               rtol=1e-5)
    np.testing.assert_allclose(float(cache.v_scale[b, 1]), float(jnp.abs(v[b, :L, 1]).max()) / 448, rtol=1e-6)
    assert float(cache.k_scale[b, 1]) == 1.0 and not np.asarray(cache.k_mean[b, 1]).any()


def test_read_bytes_and_cache_bytes():
  c16 = plan_config("rocketkv", 256, 4000, 32)
  c8 = dataclasses.replace(c16, kv_cache_dtype=E4M3)
  # Each attended K and V element goes to 1 byte, plus the two float32 scales and the key mean (H float32) the new
  # key is centred on; the KT values the scoring reads
  # (ceil(3000 / page_size) pages x topr channels) go from the keys' 2 bytes to float8_e5m2's 1, unless
  # kt_cache_dtype keeps them
  m, kt_values = min(c16.topk, 3000), -(-3000 // c16.page_size) * c16.topr
  assert c8.step_read_bytes(3000, head_dim=H, itemsize=2) == \
      c16.step_read_bytes(3000, head_dim=H, itemsize=2) - m * 2 * H + 8 + 4 * H - kt_values
  c8_kt16 = dataclasses.replace(c8, kt_cache_dtype="bfloat16")
  assert c8_kt16.step_read_bytes(3000, head_dim=H, itemsize=2) == \
      c16.step_read_bytes(3000, head_dim=H, itemsize=2) - m * 2 * H + 8 + 4 * H
  full16, full8 = plan_config("full", 64, 100, 4), plan_config("full", 64, 100, 4, kv_cache_dtype=E5M2)
  assert full8.step_read_bytes(50, head_dim=H, itemsize=2) == 50 * 2 * H + 8 + 4 * H
  assert full16.step_read_bytes(50, head_dim=H, itemsize=2) == 50 * 2 * H * 2
  q, k, v = _inputs(0, 2, 100, jnp.bfloat16)
  a = rk.prefill_compress(q, k, v, jnp.array([100, 50]), config=full16)
  b = rk.prefill_compress(q, k, v, jnp.array([100, 50]), config=full8)
  assert rk.cache_nbytes(b) == \
      rk.cache_nbytes(a) - (a.k.nbytes + a.v.nbytes) // 2 + 2 * (2 * k.shape[2] * 4) + 2 * k.shape[2] * H * 4


def test_decode_checks_the_fp8_cache():
  T = 100
  config = plan_config("full", 64, T, 2, kv_cache_dtype=E4M3)
  q, k, v = _inputs(0, 1, T)
  cache = rk.prefill_compress(q, k, v, jnp.array([T]), config=config)
  with pytest.raises(ValueError, match="cache.k_scale is missing"):
    rk.decode_step(dataclasses.replace(cache, k_scale=None), q[:, 0], k[:, 0], v[:, 0], config=config)
  with pytest.raises(ValueError, match="was built by"):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=dataclasses.replace(config, kv_cache_dtype=E5M2))
  with pytest.raises(ValueError, match="k_new.dtype=bfloat16 must equal q.dtype=float32"):
    rk.decode_step(cache, q[:, 0], k[:, 0].astype(jnp.bfloat16), v[:, 0], config=config)


def test_accuracy_spec_names_the_dtype():
  from rocketkv_jax.eval.runner import parse_method
  assert parse_method("rocketkv[kv_cache_dtype=float8_e4m3fn]") == ("rocketkv", {"kv_cache_dtype": E4M3})
  config = rk.make_config("rocketkv", token_budget=64, prompt_len=300, max_new_tokens=4, head_dim=H,
                          **parse_method("rocketkv[kv_cache_dtype=float8_e4m3fn]")[1])
  assert config.kv_scaled and "kv_cache_dtype='float8_e4m3fn'" in str(config.cache_spec())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("method", ["full", "rocketkv", "quest", "sparq", "h2o"])
def test_pallas_fp8_matches_xla_gpu(method, dtype):
  """The compiled kernels read, append and attend an FP8 cache as the XLA path does (bf16 model, ragged)."""
  if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("needs a GPU")
  T, lengths, n_steps = 1000, [1000, 301, 77], 3
  xla = plan_config(method, 128, T, n_steps, kv_cache_dtype=dtype)
  q, k, v = _inputs(13, 3, T, jnp.bfloat16)
  steps = tuple(x.astype(jnp.bfloat16) for x in _steps(13, 3, n_steps))
  want, cw = run_steps(xla, q, k, v, lengths, steps)
  got, cg = run_steps(dataclasses.replace(xla, impl="pallas"), q, k, v, lengths, steps)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
  np.testing.assert_allclose(np.asarray(cg.k.astype(jnp.float32)), np.asarray(cw.k.astype(jnp.float32)),
                             **one_fp8_step(dtype))
