"""The fused token append (K/V rows and KT page) against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200, needs_gpu
from rocketkv_jax.kernels.cache_append import cache_append, cache_append_reference
from rocketkv_jax.kernels.checks import kt_num_pages
from tests.helpers.data import key, keys, normal

KT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e5m2]


def make_inputs(B, K, S, H, page_size, dtype, kt_dtype, slot_BK, seed=0):
  """A cache whose slots past each (b, k)'s slot are NaN junk (a slot out of range poisons nothing), its KT
  pages, and fresh keys/values. With kt_dtype None, no KT pages."""
  ks = keys(seed, 6)
  k = normal(ks[0], (B, K, S, H), dtype)
  v = normal(ks[1], (B, K, S, H), dtype)
  junk = (jnp.arange(S)[None, None, :] > slot_BK[..., None]) & (slot_BK < S)[..., None]
  k = jnp.where(junk[..., None], jnp.nan, k)
  v = jnp.where(junk[..., None], jnp.nan, v)
  k_new = normal(ks[2], (B, K, H), dtype)
  v_new = normal(ks[3], (B, K, H), dtype)
  if kt_dtype is None:
    return (k, v, k_new, v_new, slot_BK)
  P = kt_num_pages(S, page_size)
  a = normal(ks[4], (B, K, H, P))
  b = normal(ks[5], (B, K, H, P))
  return (k, v, k_new, v_new, slot_BK, jnp.minimum(a, b).astype(kt_dtype), jnp.maximum(a, b).astype(kt_dtype))


def slots(B, K, S, page_size, per_head):
  """A fresh page start, a mid-page slot, the last slot, one past it and a negative one (no change), cycling
  over the batch; per_head shifts the choice by the KV head (h2o's per-head slots)."""
  mid = min(S - 1, page_size * ((S // page_size) // 2) + page_size // 2)
  choices = np.array([0, mid, S - 1, S, -1, page_size * (S // (2 * page_size))])
  i = np.arange(B)[:, None] + (np.arange(K)[None, :] if per_head else np.zeros((1, K), int))
  return jnp.asarray(choices[i % len(choices)], jnp.int32)


def assert_same(out, ref):
  assert len(out) == len(ref)
  for o, r in zip(out, ref):
    assert o.shape == r.shape and o.dtype == r.dtype
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)))


def check_choose(args, H, kw, interpret, num_warps=None, G=4, topr=21):
  """With choose_q: the same cache outputs, then the channel choice of `row_channels_reference`
  (inv_tau up to float32 summation order); ties of |q| sums (twin channels) and a zero group included."""
  B, K = args[0].shape[:2]
  q = normal(key(B + H), (B, K, G, H), jnp.float32)
  q = q.at[0, 0].set(q[0, 0].at[:, 1::2].set(q[0, 0][:, 0::2]))  # ties
  if K > 1:
    q = q.at[0, 1].set(0.0)
  q = q.astype(args[2].dtype)
  ref = cache_append_reference(*args, choose_q=q, topr=topr, **kw)
  assert_same(ref[:-4], cache_append_reference(*args, **kw))
  out = cache_append(*[jnp.copy(x) for x in args], interpret=interpret, num_warps=num_warps, choose_q=q,
                     topr=topr, **kw)
  assert_same(out[:-1], ref[:-1])
  np.testing.assert_allclose(np.asarray(out[-1]), np.asarray(ref[-1]), rtol=1e-6)


def check(B, K, S, H, page_size, dtype, kt_dtype, interpret, per_head=False, seed=0, num_warps=1, fold=False):
  """The kernel against the reference (kt_update "auto": the kernel's rule, "rows" for keys of the cache's dtype
  on pages up to ROWS_MAX_PAGE_SIZE). fold: float32 keys into the (bf16) cache, which take the "fold"."""
  slot = slots(B, K, S, page_size, per_head)
  args = make_inputs(B, K, S, H, page_size, dtype, kt_dtype, slot, seed)
  if fold:
    args = args[:2] + tuple(x.astype(jnp.float32) for x in args[2:4]) + args[4:]
  kw = dict(page_size=page_size)
  ref = cache_append_reference(*args, **kw)
  out = cache_append(*[jnp.copy(x) for x in args], interpret=interpret, num_warps=num_warps, **kw)
  assert_same(out, ref)
  if kt_dtype is not None:
    check_choose(args, H, kw, interpret)
  if not per_head:  # one [B] slot for every KV head: the same result
    args_B = args[:4] + (slot[:, 0],) + args[5:]
    assert_same(cache_append(*[jnp.copy(x) for x in args_B], interpret=interpret, **kw), ref)
    assert_same(cache_append_reference(*args_B, **kw), ref)
  k, v = out[:2]
  b, h = np.indices(slot.shape)
  ok = np.asarray((slot >= 0) & (slot < S))
  s = np.clip(np.asarray(slot), 0, S - 1)
  written_k = np.asarray(k.astype(jnp.float32))[b, h, s][ok]
  np.testing.assert_array_equal(written_k, np.asarray(args[2].astype(dtype).astype(jnp.float32))[ok])
  np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32))[b, h, s][ok],
                                np.asarray(args[3].astype(dtype).astype(jnp.float32))[ok])
  # Out of range: nothing changed, the poisoned junk included.
  for o, x in zip(out, args[:2] + args[5:]):
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32))[~ok], np.asarray(x.astype(jnp.float32))[~ok])
  if kt_dtype is not None:
    for page in out[2:]:
      assert np.isfinite(np.asarray(page.astype(jnp.float32))).all(), "junk leaked into the KT pages"


# each cache dtype (the page rebuilt from its rows / the column fold) with each KT dtype once, over two head shapes
@pytest.mark.parametrize("H, page_size, dtype, kt_dtype", [
    (64, 3, jnp.float32, jnp.float32), (128, 1, jnp.float32, jnp.bfloat16), (64, 3, jnp.float32, jnp.float8_e5m2),
    (128, 1, jnp.bfloat16, jnp.float32), (64, 3, jnp.bfloat16, jnp.bfloat16), (128, 1, jnp.bfloat16, jnp.float8_e5m2)])
def test_matches_reference_interpret(H, page_size, dtype, kt_dtype):
  """A float32 cache with float32 keys: the page rebuilt from its rows; a bf16 cache with float32 keys: the
  column fold."""
  check(B=6, K=2, S=23, H=H, page_size=page_size, dtype=dtype, kt_dtype=kt_dtype, interpret=True,
        fold=dtype == jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("H", [64, 128])
def test_no_kt_pages_per_head_slots_interpret(H, dtype):
  check(B=6, K=3, S=19, H=H, page_size=1, dtype=dtype, kt_dtype=None, interpret=True, per_head=True)


@pytest.mark.parametrize("H, page_size, per_head, kt_dtype", [
    (64, 3, False, jnp.float32), (128, 4, True, jnp.bfloat16), (64, 1, False, jnp.float8_e5m2),
    (64, 3, False, jnp.bfloat16), (128, 4, True, jnp.float8_e5m2)])
def test_kt_from_rows_matches_reference_interpret(H, page_size, per_head, kt_dtype):
  """The decode path's append (bf16 keys into a bf16 cache, small pages): the page's min/max from its K rows up
  to the slot (the rows after it are NaN junk and must not be read), the same K/V writes and out-of-range
  behaviour."""
  check(B=5, K=2, S=29, H=H, page_size=page_size, dtype=jnp.bfloat16, kt_dtype=kt_dtype, interpret=True,
        per_head=per_head)


@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
def test_kt_from_rows_equals_the_fold_on_a_consistent_cache(kt_dtype):
  """On pages that hold their rows' min/max (as stage 1 builds them) and a new key in the cache's dtype, both
  updates give the same pages: fresh pages, partly filled ones, the last slot."""
  from rocketkv_jax.cache import build_kt_pages
  B, K, S, H, page_size = 4, 2, 31, 64, 3
  ks = keys(5, 4)
  k, v = (normal(x, (B, K, S, H), jnp.bfloat16) for x in ks[:2])
  k_new, v_new = (normal(x, (B, K, H), jnp.bfloat16) for x in ks[2:])
  slot = jnp.array([0, 7, 11, S - 1], jnp.int32)
  kt = build_kt_pages(k, slot, page_size, kt_dtype)
  fold = cache_append_reference(k, v, k_new, v_new, slot, *kt, page_size=page_size, kt_update="fold")
  rows = cache_append_reference(k, v, k_new, v_new, slot, *kt, page_size=page_size, kt_update="rows")
  assert_same(rows, fold)
  # the kernel: rows, as k_new has the cache's dtype
  assert_same(cache_append(k, v, k_new, v_new, slot, *kt, page_size=page_size, interpret=True), fold)


@pytest.mark.parametrize("page_size,kt_dtype", [(3, jnp.bfloat16), (1, jnp.float8_e5m2), (5, jnp.float32),
                                                (17, jnp.bfloat16)])  # 17: past ROWS_MAX_PAGE_SIZE, the fold
def test_appends_in_a_row_keep_every_page_its_rows_min_max_interpret(page_size, kt_dtype):
  """The kernel stores only the KT values that change: over a run of appends from stage 1's pages, with keys
  repeated (so that many values do not change) and a page filled from its first slot, every page stays
  `build_kt_pages` of the rows the cache then holds, exactly."""
  from rocketkv_jax.cache import build_kt_pages
  B, K, S, H, steps = 2, 2, 23, 64, 9
  ks = keys(page_size, 3)
  k, v = (normal(x, (B, K, S, H), jnp.bfloat16) for x in ks[:2])
  new = normal(ks[2], (steps, B, K, H), jnp.bfloat16)
  new = new.at[1::2].set(new[0::2][:new[1::2].shape[0]])  # every other key repeats the one before it
  length = jnp.array([5, 12], jnp.int32)
  kt = build_kt_pages(k, length, page_size, kt_dtype)
  for i in range(steps):
    k, v, *kt = cache_append(k, v, new[i], new[i], length + i, *kt, page_size=page_size, interpret=True)
  want = build_kt_pages(k, length + steps, page_size, kt_dtype)
  used = np.arange(kt[0].shape[-1]) * page_size < np.asarray(length + steps)[:, None, None, None]
  for got, ref in zip(kt, want):
    np.testing.assert_array_equal(np.where(used, np.asarray(got.astype(jnp.float32)), 0),
                                  np.where(used, np.asarray(ref.astype(jnp.float32)), 0))


def test_kt_update_auto_folds_a_key_finer_than_the_cache():
  """A float32 k_new into a bf16 cache: "auto" folds the float32 key (rows would see it rounded); pages above
  ROWS_MAX_PAGE_SIZE are folded too (their rows would not fit the program's registers); a bad value is
  refused."""
  from rocketkv_jax.kernels.cache_append import ROWS_MAX_PAGE_SIZE, resolve_kt_update
  k = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
  assert resolve_kt_update("auto", k, jnp.zeros((1, 1, 64), jnp.float32), 3) == "fold"
  assert resolve_kt_update("auto", k, jnp.zeros((1, 1, 64), jnp.bfloat16), 3) == "rows"
  assert resolve_kt_update("auto", k, jnp.zeros((1, 1, 64), jnp.bfloat16), ROWS_MAX_PAGE_SIZE) == "rows"
  assert resolve_kt_update("auto", k, jnp.zeros((1, 1, 64), jnp.bfloat16), ROWS_MAX_PAGE_SIZE + 1) == "fold"
  with pytest.raises(ValueError, match="kt_update='nope'"):
    resolve_kt_update("nope", k, k[:, :, 0], 3)


def test_per_head_slots_with_kt_pages_interpret():
  check(B=6, K=3, S=20, H=64, page_size=3, dtype=jnp.bfloat16, kt_dtype=jnp.bfloat16, interpret=True,
        per_head=True)


def test_casts_new_rows_to_the_cache_dtype_interpret():
  slot = jnp.array([[2, 5]], jnp.int32)
  k, v, _, _, _, kt_min, kt_max = make_inputs(1, 2, 9, 64, 3, jnp.bfloat16, jnp.float32, slot)
  k_new = normal(key(7), (1, 2, 64), jnp.float32)
  v_new = normal(key(8), (1, 2, 64), jnp.float32)
  args = (k, v, k_new, v_new, slot, kt_min, kt_max)
  assert_same(cache_append(*args, page_size=3, interpret=True), cache_append_reference(*args, page_size=3))


def test_donated_jit_is_in_place_interpret():
  """Every output is its donated input's buffer."""
  slot = slots(4, 2, 17, 3, per_head=False)
  args = make_inputs(4, 2, 17, 64, 3, jnp.bfloat16, jnp.float8_e5m2, slot)
  ref = cache_append_reference(*args, page_size=3)
  step = jax.jit(lambda *a: cache_append(*a, page_size=3, interpret=True), donate_argnums=(0, 1, 5, 6))
  donated = [jnp.copy(x) for x in args]
  kept = (0, 1, 5, 6)
  pointers = [donated[i].unsafe_buffer_pointer() for i in kept]
  out = step(*donated)
  assert_same(out, ref)
  assert all(donated[i].is_deleted() for i in kept)
  assert [o.unsafe_buffer_pointer() for o in out] == pointers


def test_rejects_bad_args():
  kv = jnp.ones((1, 2, 10, 64))
  new = jnp.ones((1, 2, 64))
  slot = jnp.zeros((1, 2), jnp.int32)
  kt = jnp.ones((1, 2, 64, 4))
  with pytest.raises(ValueError, match="k_new_BKH.shape"):
    cache_append(kv, kv, jnp.ones((1, 2, 32)), new, slot)
  with pytest.raises(ValueError, match="v_BKSH.shape"):
    cache_append(kv, jnp.ones((1, 2, 11, 64)), new, new, slot)
  with pytest.raises(ValueError, match="slot_BK.shape"):
    cache_append(kv, kv, new, new, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="slot_BK.dtype"):
    cache_append(kv, kv, new, new, jnp.zeros((1, 2), jnp.float32))
  with pytest.raises(ValueError, match="v_new_BKH.dtype"):
    cache_append(kv, kv, new, jnp.ones((1, 2, 64), jnp.int32), slot)
  with pytest.raises(ValueError, match="given together"):
    cache_append(kv, kv, new, new, slot, kt, None, page_size=3)
  with pytest.raises(ValueError, match="page_size=2"):
    cache_append(kv, kv, new, new, slot, kt, kt, page_size=2)  # 10 slots make 5 pages of 2, not 4
  with pytest.raises(ValueError, match="kt_min_BKHP.dtype"):
    cache_append(kv, kv, new, new, slot, kt.astype(jnp.int8), kt.astype(jnp.int8), page_size=3)
  q = jnp.ones((1, 2, 4, 64))
  with pytest.raises(ValueError, match="choose_q needs the KT pages"):
    cache_append(kv, kv, new, new, slot, choose_q=q, topr=8)
  kt = jnp.ones((1, 2, 64, kt_num_pages(10, 3)))
  with pytest.raises(ValueError, match="choose_q.shape"):
    cache_append(kv, kv, new, new, slot, kt, kt, page_size=3, choose_q=q[..., :32], topr=8)
  with pytest.raises(ValueError, match="topr=65"):
    cache_append(kv, kv, new, new, slot, kt, kt, page_size=3, choose_q=q, topr=65)


def _sd(B, K, S, H, P, dtype, kt_dtype, slot_shape=None):
  sd = jax.ShapeDtypeStruct
  args = [sd((B, K, S, H), dtype), sd((B, K, S, H), dtype), sd((B, K, H), dtype), sd((B, K, H), dtype),
          sd(slot_shape or (B, K), jnp.int32)]
  return args + ([] if kt_dtype is None else [sd((B, K, H, P), kt_dtype), sd((B, K, H, P), kt_dtype)])


@pytest.mark.parametrize("kt_dtype", KT_DTYPES + [None])
def test_lowers_for_h200_through_triton(kt_dtype):
  text = lower_for_h200(lambda *a: cache_append(*a, page_size=3), *_sd(2, 8, 1617, 128, 544, jnp.bfloat16, kt_dtype))
  assert "rocketkv_cache_append" in text
  # In place: every cache output aliases its input (k, v and, with KT pages, operands 5 and 6).
  assert text.count("stablehlo.output_operand_alias<") == (2 if kt_dtype is None else 4)
  if kt_dtype is not None:
    assert "operand_index = 6" in text


def test_lowers_for_h200_with_the_channel_choice():
  q = jax.ShapeDtypeStruct((8, 8, 4, 128), jnp.bfloat16)
  text = lower_for_h200(lambda *a: cache_append(*a[:-1], page_size=3, choose_q=a[-1], topr=60),
                        *_sd(8, 8, 1617, 128, 544, jnp.bfloat16, jnp.bfloat16, slot_shape=(8,)), q)
  assert "rocketkv_cache_append" in text
  assert text.count("stablehlo.output_operand_alias<") == 4  # the choice's four outputs are new buffers


def test_lowers_for_h200_one_slot_per_sequence():
  text = lower_for_h200(lambda *a: cache_append(*a, page_size=3),
                        *_sd(8, 8, 1617, 128, 544, jnp.bfloat16, jnp.bfloat16, slot_shape=(8,)))
  assert "rocketkv_cache_append" in text


def test_lowers_for_h200_f32_cache_h64():
  text = lower_for_h200(lambda *a: cache_append(*a, page_size=1), *_sd(3, 2, 70, 64, 80, jnp.float32, jnp.float32))
  assert "rocketkv_cache_append" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kt_dtype", KT_DTYPES + [None])
def test_matches_reference_gpu(kt_dtype):
  needs_gpu()
  check(B=6, K=8, S=1621, H=128, page_size=3, dtype=jnp.bfloat16, kt_dtype=kt_dtype, interpret=False)
  check(B=5, K=2, S=70, H=64, page_size=1, dtype=jnp.float32, kt_dtype=kt_dtype, interpret=False, per_head=True)
  check(B=6, K=8, S=1621, H=128, page_size=3, dtype=jnp.bfloat16, kt_dtype=kt_dtype, interpret=False, num_warps=4)
  if kt_dtype is not None:
    check(B=6, K=8, S=1621, H=128, page_size=3, dtype=jnp.bfloat16, kt_dtype=kt_dtype, interpret=False, fold=True)
