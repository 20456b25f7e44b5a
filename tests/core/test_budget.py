import math

import pytest

import rocketkv_jax as rk


def test_paper_example():
  """t=256, S=16384, d=128: c=64, r=0.56, capacity 1595, prompt_budget 1339, P=3, top_r=61, top_k=128."""
  p = rk.plan_budget(256, 16384 - 256, 256, 128)
  assert p.compression_ratio == 64 and math.isclose(p.split_r, 0.56)
  assert (p.capacity, p.prompt_budget, p.page_size, p.top_r, p.top_k) == (1595, 1339, 3, 61, 128)
  assert round(p.seq_len / p.capacity, 1) == 10.3 and round(p.stage2_ratio, 1) == 6.2


def _formula(t, prompt_len, new, d, max_len=None):
  s = prompt_len + new if max_len is None else min(prompt_len + new, max_len)
  c = max(1, s / t)
  r = min(0.2 + 0.06 * math.log2(c), 0.8)
  cap = max(int(s / c**r), min(2 * new, s))
  c2 = max(1, cap / t)
  p = math.ceil(math.sqrt(c2))
  p = 1 if p > c2 else p
  return cap, cap - new, p, int(d * p / c2), t // 2


@pytest.mark.parametrize("t", [16, 64, 256, 1000, 1024, 4096])
@pytest.mark.parametrize("prompt_len", [100, 4000, 16128, 32768, 131072])
@pytest.mark.parametrize("d", [64, 128])
def test_grid_matches_formula(t, prompt_len, d):
  new = 32
  cap, pb, page, top_r, top_k = _formula(t, prompt_len, new, d)
  if pb < 32:
    with pytest.raises(ValueError, match="prompt_budget"):
      rk.plan_budget(t, prompt_len, new, d)
    return
  p = rk.plan_budget(t, prompt_len, new, d)
  assert (p.capacity, p.prompt_budget, p.page_size, p.top_r, p.top_k) == (cap, pb, page, top_r, top_k)
  assert 1 <= p.top_r <= d and p.capacity <= p.seq_len


def test_max_len_caps_sequence():
  p = rk.plan_budget(256, 200_000, 256, 128, max_len=131072)
  assert p.seq_len == 131072


def test_small_sequence_is_uncompressed():
  p = rk.plan_budget(1024, 300, 100, 128)
  assert p.compression_ratio == 1 and p.capacity == 400 and p.prompt_budget == 300 and p.top_r == 128


@pytest.mark.parametrize("kwargs,match", [
    (dict(token_budget=15, prompt_len=1000, max_new_tokens=10, head_dim=128), "token_budget=15"),
    (dict(token_budget=16, prompt_len=40, max_new_tokens=10, head_dim=128), "prompt_budget=25"),
    (dict(token_budget=64, prompt_len=0, max_new_tokens=1, head_dim=128), "prompt_len=0"),
    (dict(token_budget=64.0, prompt_len=10, max_new_tokens=1, head_dim=128), "token_budget"),
])
def test_impossible_requests(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rk.plan_budget(**kwargs)


def test_configs_follow_budget_convention():
  t, T, new, d = 256, 16128, 256, 128
  mk = lambda m: rk.make_config(m, token_budget=t, prompt_len=T, max_new_tokens=new, head_dim=d)
  assert mk("full").capacity == 16384
  assert mk("streaming_llm").capacity == 256
  assert mk("h2o").capacity == 256 and mk("h2o").recent_tokens == 128
  assert mk("snapkv").prompt_budget == 256 and mk("snapkv").kernel_size == 7
  quest = mk("quest")
  assert quest.page_size == 128 and quest.topk == 128  # 16384 / 128 pages = t / 2 KV pairs of scoring
  assert mk("sparq").topr == 2 and mk("sparq").topk == 128
  hsa = mk("hsa")
  assert (hsa.page_size, hsa.topr, hsa.topk) == (8, 16, 128)  # c = 64: P = 8, r = 128 * 8 / 64
  assert mk("exact_topk").topk == 256
  r = mk("rocketkv")
  assert (r.prompt_budget, r.topk, r.topr, r.page_size, r.kernel_size, r.window_size) == (1339, 128, 61, 3, 63, 32)
  assert hash(r) == hash(mk("rocketkv"))


def test_tensorrt_llm_topk_counts_pages():
  c = rk.RocketKVConfig.from_tensorrt_llm(prompt_budget=2048, topk=64, topr=32, page_size=4, max_new_tokens=128)
  assert c.topk == 256 and c.kt_cache_dtype == "float8_e5m2" and c.capacity == 2176


@pytest.mark.parametrize("bad,match", [
    (dict(kt_cache_dtype="int8"), "kt_cache_dtype"),
    (dict(prompt_budget=16), "prompt_budget=16"),
    (dict(kernel_size=8), "kernel_size=8"),
    (dict(impl="cuda"), "impl"),
    (dict(topk=0), "topk=0"),
])
def test_bad_config_knobs(bad, match):
  base = dict(prompt_budget=512, max_new_tokens=64, topk=128, topr=32, page_size=4)
  with pytest.raises(ValueError, match=match):
    rk.RocketKVConfig(**{**base, **bad})


def test_unknown_method():
  with pytest.raises(ValueError, match="method='foo'"):
    rk.make_config("foo", token_budget=64, prompt_len=10, max_new_tokens=1, head_dim=64)


def test_rocketkv_window_shrinks_to_a_short_prompt():
  """SnapKV's observation window cannot exceed the prompt: the plan uses the whole prompt as the window when
  it is shorter than 32 tokens (generate used to special-case this); an explicit window_size is kept."""
  c = rk.make_config("rocketkv", token_budget=64, prompt_len=20, max_new_tokens=8, head_dim=64)
  assert c.window_size == 20 and c.prompt_budget >= 20
  assert rk.make_config("rocketkv", token_budget=64, prompt_len=500, max_new_tokens=8, head_dim=64).window_size == 32
  c = rk.make_config("rocketkv", token_budget=256, prompt_len=500, max_new_tokens=8, head_dim=64, window_size=16)
  assert c.window_size == 16
