"""Inputs a new user gets wrong: each gives the right answer or a ValueError naming the value (and, for the
plan, what would help)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.cache import cache_leaves, replace_leaves
from tests.helpers.data import keys, normal

B, T, N, K, H = 2, 64, 4, 2, 16


def _qkv(t=T, dtype=jnp.float32):
  ks = keys(0, 3)
  return (normal(ks[0], (B, t, N, H), dtype), normal(ks[1], (B, t, K, H), dtype),
          normal(ks[2], (B, t, K, H), dtype))


def _mk(method, **kw):
  return rk.make_config(method, **{**dict(token_budget=64, prompt_len=T, max_new_tokens=4, head_dim=H,
                                          impl="xla"), **kw})


# ---------------------------------------------------------------------------------------------- make_config


def test_overrides_are_applied_before_the_one_validation():
  """snapkv at budgets 16-31 is possible with a smaller window (the default 32 used to be validated first)."""
  for t in (16, 24, 31):
    c = _mk("snapkv", token_budget=t, window_size=8)
    assert (c.prompt_budget, c.window_size) == (t, 8)
  c = _mk("rocketkv", token_budget=16, prompt_len=40, max_new_tokens=10, window_size=8)
  assert c.window_size == 8 and c.prompt_budget >= 8


@pytest.mark.parametrize("method", rk.METHODS)
def test_every_method_takes_overrides_of_planned_fields(method):
  planned = _mk(method)
  # (token_budget, max_new_tokens and max_len are make_config's own arguments, not overrides)
  fields = {f.name for f in dataclasses.fields(planned)} - {"impl", "token_budget", "max_new_tokens", "max_len"}
  for name in sorted(fields):
    value = getattr(planned, name)
    if not isinstance(value, int) or isinstance(value, bool):
      continue
    new = value + 2  # (an odd kernel_size stays odd)
    try:
      c = _mk(method, **{name: new})
    except ValueError as e:  # an override may make the config invalid: then the error names it
      assert name in str(e) or str(new) in str(e), str(e)
      continue
    assert getattr(c, name) == new, name


@pytest.mark.parametrize("method", ["snapkv", "rocketkv"])
def test_an_invalid_override_names_itself(method):
  with pytest.raises(ValueError, match="kernel_size=8"):
    _mk(method, kernel_size=8)
  with pytest.raises(ValueError, match=r"window_size=0 must be >= 1"):
    _mk(method, window_size=0)


def test_snapkv_budget_under_the_window_says_what_helps():
  with pytest.raises(ValueError, match=r"token_budget=16 .* window_size=32: use token_budget >= 32 or "
                                       r"window_size <= 16"):
    _mk("snapkv", token_budget=16)


@pytest.mark.parametrize("args,kw,helps,not_helps", [
    ((16, 40, 10, 128), {}, ["token_budget >= 26", "window_size <= 25"], ["no token_budget can help"]),
    ((1024, 40, 4, 16), dict(window_size=64), ["no token_budget can help", "window_size <= 40"],
     ["token_budget >="]),
    ((1024, 4000, 100, 128), dict(max_len=120), ["no token_budget can help", "window_size <= 20",
                                                 "max_len >= prompt_len + max_new_tokens = 4100",
                                                 "max_new_tokens <= 88"], ["token_budget >="]),
])
def test_plan_error_names_what_actually_helps(args, kw, helps, not_helps):
  with pytest.raises(ValueError) as e:
    rk.plan_budget(*args, **kw)
  msg = str(e.value)
  for h in helps:
    assert h in msg, msg
  for h in not_helps:
    assert h not in msg, msg
  # and each suggested value does help
  t, p, new, d = args
  if "token_budget >= 26" in helps:
    rk.plan_budget(26, p, new, d, **kw)
    with pytest.raises(ValueError):
      rk.plan_budget(25, p, new, d, **kw)
  if "max_new_tokens <= 88" in helps:
    rk.plan_budget(t, p, 88, d, **kw)
    rk.plan_budget(t, p, new, d, max_len=None)


@pytest.mark.parametrize("bad", [["full"], 3, None])
def test_get_method_of_a_non_string(bad):
  with pytest.raises(ValueError, match="must be one of"):
    rk.get_method(bad)


def test_plan_budget_rejects_bool_max_len():
  with pytest.raises(ValueError, match="max_len=True must be an int"):
    rk.plan_budget(64, 100, 4, 16, max_len=True)


def test_prompt_past_capacity_says_what_to_plan():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"T=64 exceeds full capacity=14: plan the config for at least 64 tokens"):
    rk.prefill_compress(q, k, v, jnp.array([T, 3]), config=_mk("full", prompt_len=10))


# ---------------------------------------------------------------------------------------------- decode_step


def _leaves(method):
  q, k, v = _qkv()
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=_mk(method))
  return [name for name, x in cache_leaves(cache).items() if x is not None]


@pytest.mark.parametrize("method,leaf", [(m, leaf) for m in rk.METHODS for leaf in _leaves(m)])
@pytest.mark.parametrize("jit", [False, True])
def test_missing_leaf_names_the_leaf_and_the_method(method, leaf, jit):
  q, k, v = _qkv()
  cfg = _mk(method)
  cache = replace_leaves(rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg), **{leaf: None})
  step = lambda c: rk.decode_step(c, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  with pytest.raises(ValueError, match=rf"cache.{leaf} is .*None.* but {method} needs"):
    (jax.jit(step) if jit else step)(cache)


@pytest.mark.parametrize("cache_dtype,arg,match", [
    (jnp.bfloat16, "q", r"q.dtype=float32 must equal cache.k.dtype=bfloat16"),
    (jnp.float32, "q", r"q.dtype=bfloat16 must equal cache.k.dtype=float32"),
    (jnp.float32, "k_new", r"k_new.dtype=bfloat16 must equal cache.k.dtype=float32"),
    (jnp.float32, "v_new", r"v_new.dtype=bfloat16 must equal cache.k.dtype=float32"),
])
def test_dtype_errors_name_the_right_arrays(cache_dtype, arg, match):
  q, k, v = _qkv(dtype=cache_dtype)
  cfg = _mk("rocketkv")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  new = dict(q=q[:, 0], k_new=k[:, 0], v_new=v[:, 0])
  if cache_dtype == jnp.bfloat16:
    new = {n: x.astype(jnp.float32) for n, x in new.items()}
  else:
    new[arg] = new[arg].astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    rk.decode_step(cache, new["q"], new["k_new"], new["v_new"], config=cfg)


def test_int_cache_is_named_as_such():
  q, k, v = _qkv()
  cfg = _mk("full")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  cache = dataclasses.replace(cache, k=cache.k.astype(jnp.int32), v=cache.v.astype(jnp.int32))
  with pytest.raises(ValueError, match=r"cache.k.dtype=int32 must be one of float32"):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)


@pytest.mark.parametrize("method", ["streaming_llm", "h2o", "full"])
@pytest.mark.parametrize("length,pos,match", [
    ([-1, 30], None, r"cache.length=\[-1, 30\] must lie in \[0, capacity="),
    ([10**6, 30], [10**6, 30], r"cache.length=\[1000000, 30\] must lie in \[0, capacity="),
    (None, [3, 30], r"cache.pos=\[3, 30\] must be >= cache.length="),
])
def test_hand_edited_length_or_pos(method, length, pos, match):
  q, k, v = _qkv()
  cfg = _mk(method)
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  edits = {n: jnp.array(x, jnp.int32) for n, x in (("length", length), ("pos", pos)) if x is not None}
  with pytest.raises(ValueError, match=match):
    rk.decode_step(dataclasses.replace(cache, **edits), q[:, 0], k[:, 0], v[:, 0], config=cfg)


def test_a_donated_cache_is_named_as_such():
  q, k, v = _qkv()
  cfg = _mk("rocketkv")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  with pytest.raises(ValueError, match=r"cache.k has been deleted: the cache was donated"):
    rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)


# ---------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("lengths,match", [
    (np.array([2**32 + 64, 40], np.int64), r"lengths=\[4294967360, 40\] must all lie in \[1, T=64\]"),
    ([2**40, 3], r"lengths=\[1099511627776, 3\]"),
    (np.array([True, True]), r"dtype=bool"),
    ([64.0, 3.0], r"dtype=float64"),
])
def test_lengths_are_checked_before_the_cast_to_int32(lengths, match):
  """int64 lengths used to wrap to int32 (2**32 + 64 -> 64) and pass."""
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    rk.prefill_compress(q, k, v, lengths, config=_mk("full"))


@pytest.mark.parametrize("shape,match", [((B, 0, N, H), r"T=0"), ((B, T, N, 0), r"H=0"),
                                         ((B, T, 0, H), r"N=0 must be a positive multiple")])
def test_empty_axes(shape, match):
  q = jnp.zeros(shape)
  kv = jnp.zeros((shape[0], shape[1], K, shape[3]))
  with pytest.raises(ValueError, match=match):
    rk.prefill_compress(q, kv, kv, jnp.array([1, 1]), config=_mk("full"))


def test_numpy_int64_lengths_work():
  q, k, v = _qkv()
  cache = rk.prefill_compress(q, k, v, np.array([T, 7], np.int64), config=_mk("full"))
  assert cache.length.dtype == jnp.int32 and np.asarray(cache.length).tolist() == [T, 7]


# ---------------------------------------------------------------------------------------------- concat_caches


def test_concat_caches_rejects_what_is_not_a_list_of_caches():
  q, k, v = _qkv()
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=_mk("full"))
  with pytest.raises(ValueError, match="got one KVCache: pass \\[cache, ...\\]"):
    rk.concat_caches(cache)
  with pytest.raises(ValueError, match=r"caches\[1\] must be a KVCache .* got int"):
    rk.concat_caches([cache, 3])
  with pytest.raises(ValueError, match=r"caches\[0\] must be a KVCache .* got tuple"):
    rk.concat_caches([(), ()])
  assert rk.concat_caches([(cache, cache), (cache, cache)])[1].k.shape[0] == 2 * B


def test_pallas_without_a_gpu_is_named():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"config.impl='pallas' runs the compiled GPU kernels, but the backend is"):
    rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=_mk("full", impl="pallas"))


@pytest.mark.parametrize("method", ["full", "streaming_llm"])
def test_a_donated_cache_is_named_by_the_room_check_of_every_decode_loop(method):
  """`check_room` (decode_step's and the models' decode loops', `check_loop_args`) used to read the deleted
  length and raise jax's RuntimeError; an evicting method skipped the check and failed deeper."""
  q, k, v = _qkv()
  cfg = _mk(method)
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  with pytest.raises(ValueError, match=r"cache.k has been deleted: the cache was donated to an earlier call"):
    cfg.check_room(cache, 4)


def test_a_donated_cache_given_to_concat_caches_is_named_as_such():
  """It used to raise jax's RuntimeError from inside jnp.concatenate."""
  q, k, v = _qkv()
  cfg = _mk("full")
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg)
  rk.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=cfg)
  with pytest.raises(ValueError, match=r"caches\[1\]\.k has been deleted: the cache was donated to an earlier call"):
    rk.concat_caches([rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=cfg), cache])


# ---------------------------------------------------------------------------------------------- cache_nbytes


@pytest.mark.parametrize("bad,match", [("abc", r"got str 'abc'"), (None, r"got NoneType"), (3, r"got int"),
                                       ([("x",)], r"cache\[0\]\[0\] must be a KVCache .* got str")])
def test_cache_nbytes_of_what_is_not_a_cache(bad, match):
  """cache_nbytes('abc') used to raise AttributeError ('str' object has no attribute 'shape')."""
  with pytest.raises(ValueError, match=match):
    rk.cache_nbytes(bad)


def test_cache_nbytes_of_caches_and_tuples_of_them():
  q, k, v = _qkv()
  cache = rk.prefill_compress(q, k, v, jnp.array([T, 30]), config=_mk("full"))
  one = rk.cache_nbytes(cache)
  assert one == sum(x.nbytes for x in jax.tree.leaves(cache))
  assert rk.cache_nbytes((cache, cache)) == rk.cache_nbytes([cache, (cache,)]) == 2 * one


# ---------------------------------------------------------------------------------------------- sizes past int32


@pytest.mark.parametrize("method", rk.METHODS)
def test_a_prompt_len_past_int32_is_refused_by_name(method):
  """prompt_len=2**40 used to be planned (a capacity of 2**40 slots) and fail only when XLA ran out of memory."""
  with pytest.raises(ValueError, match=r"prompt_len=1099511627776 must be <= 2147483647"):
    _mk(method, prompt_len=2**40)
  with pytest.raises(ValueError, match=r"prompt_len \+ max_new_tokens = 2147483647 \+ 4 = 2147483651 must be <="):
    _mk(method, prompt_len=2**31 - 1)
  with pytest.raises(ValueError, match=r"max_len=1099511627776 must be <= 2147483647"):
    _mk(method, max_len=2**40)


def test_plan_functions_refuse_a_prompt_len_past_int32():
  with pytest.raises(ValueError, match=r"row 1 \(prompt of 1099511627776 tokens.*prompt_len=1099511627776 must be <="):
    rk.plan_rows("rocketkv", token_budget=64, prompt_lens=[T, 2**40], max_new_tokens=4, head_dim=H)
  with pytest.raises(ValueError, match=r"max_prompt_len=1099511627776 must be <= 2147483647"):
    rk.plan_limits("rocketkv", token_budget=64, max_prompt_len=2**40, max_new_tokens=4, head_dim=H)
  with pytest.raises(ValueError, match=r"prompt_len=1099511627776 must be <= 2147483647"):
    rk.plan_budget(64, 2**40, 4, H)
  with pytest.raises(ValueError, match=r"max_len=1099511627776 must be <= 2147483647"):
    rk.FullConfig(max_len=2**40)
  assert rk.make_config("full", token_budget=64, prompt_len=2**31 - 5, max_new_tokens=4, head_dim=H).max_len == 2**31 - 1


# ---------------------------------------------------------------------------------------------- NaN in, NaN out


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("method,budget,where", [
    ("full", 64, 20), ("full", 64, "new"),
    ("exact_topk", 32, 40), ("exact_topk", 32, "new"), ("exact_topk", 256, 20),
    ("snapkv", 48, 10), ("snapkv", 48, T - 3), ("snapkv", 48, "new"),
    ("rocketkv", 256, 20), ("rocketkv", 256, "new"),
])
def test_a_nan_key_among_the_attended_gives_nan_like_dot_product_attention(method, budget, where, impl):
  """NaN in, NaN out, as `jax.nn.dot_product_attention`: a NaN in an attended key used to give exactly 0.0 for
  full, exact_topk and snapkv (the normaliser tested l > 0, which a NaN l fails). exact_topk and stage 1 rank a
  NaN key's slot first (every score of its heads is NaN once the softmax normalises), so they attend it too;
  rocketkv's HSA pages are summaries, so it is checked where its budget attends every token (the method docs
  say which tokens it picks then is unspecified). The other sequence of the batch stays finite."""
  q, k, v = _qkv()
  cfg = _mk(method, token_budget=budget, impl=impl)
  k_new = k[:, 0]
  if where == "new":
    k_new = k_new.at[0, 1].set(jnp.nan)
  else:
    k = k.at[0, where, 1].set(jnp.nan)
  cache = rk.prefill_compress(q, k, v, jnp.array([T, T]), config=cfg)
  out, _ = rk.decode_step(cache, q[:, 0], k_new, v[:, 0], config=cfg)
  out = np.asarray(out)
  g = N // K  # query heads of KV head 1
  assert np.isnan(out[0, g:]).all(), out[0]
  assert np.isfinite(out[0, :g]).all() and np.isfinite(out[1]).all()
  # the reference it follows
  if method == "full":
    ks_all = jnp.concatenate([k, k_new[:, None]], axis=1)
    vals = jnp.concatenate([v, v[:, :1]], axis=1)
    ref = jax.nn.dot_product_attention(q[:, :1], ks_all, vals)[:, 0]
    assert np.isnan(np.asarray(ref)[0, g:]).all()
    np.testing.assert_allclose(out[1], np.asarray(ref)[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_no_valid_slot_still_gives_zero(impl):
  """The l == 0 test that lets NaN through still gives 0 where nothing is attended (a selection with no valid
  entry)."""
  from rocketkv_jax import ops
  q, k, v = _qkv()
  qg = q[:, 0].reshape(B, K, N // K, H)
  kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  idx = jnp.zeros((B, K, 16), jnp.int32)
  out = ops.sparse_decode_attention(qg, kk.at[:, :, 0].set(jnp.nan), vv, idx, jnp.zeros((B, K, 16), bool), impl=impl)
  assert (np.asarray(out) == 0).all()
  out = ops.dense_decode_attention(qg, kk, vv, jnp.array([0, 5]), impl=impl)
  assert (np.asarray(out)[0] == 0).all() and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_decode_kernels_split_partials_carry_nan(num_splits):
  """The split-K merge (`combine_partials`) as well as the one-split store: NaN in one split's key, NaN out."""
  from rocketkv_jax.kernels import dense_decode, sparse_decode
  q, k, v = _qkv()
  qg = q[:, 0].reshape(B, K, N // K, H)
  kk, vv = k.transpose(0, 2, 1, 3).at[0, 1, 50].set(jnp.nan), v.transpose(0, 2, 1, 3)
  out = np.asarray(dense_decode.dense_decode_attention(qg, kk, vv, jnp.array([T, T]), interpret=True,
                                                       tuning=dense_decode.Tuning(block_k=16, num_splits=num_splits)))
  assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all() and np.isfinite(out[1]).all()
  idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, K, T))
  out = np.asarray(sparse_decode.sparse_decode_attention(
      qg, kk, vv, idx, jnp.ones((B, K, T), bool), interpret=True,
      tuning=sparse_decode.Tuning(block_m=16, num_splits=num_splits)))
  assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all() and np.isfinite(out[1]).all()
