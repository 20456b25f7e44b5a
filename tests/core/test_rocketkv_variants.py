"""RocketKV's variant options (docs/ALGORITHM.md, this project's extension): forced sink/recent pages in stage 2,
and other stage-2 splits at the paper plan's decode traffic. Defaults must stay the paper's method."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax import ops
from rocketkv_jax.budget import plan_budget, stage2_replan
from rocketkv_jax.select import attention_probs, topk_tokens
from tests.helpers.data import key, keys, normal

N, K, H = 6, 2, 32


def _qkv(seed, b, t):
  ks = keys(seed, 4)
  return (normal(ks[0], (b, t, N, H)), normal(ks[1], (b, t, K, H)),
          normal(ks[2], (b, t, K, H)), normal(ks[3], (b, K, N // K, H)))


def _cache(config, q, k, v, lengths):
  return rk.prefill_compress(q, k, v, jnp.asarray(lengths, jnp.int32), config=config)


def _rocket(**kw):
  base = dict(prompt_budget=40, max_new_tokens=8, topk=16, topr=8, page_size=2, window_size=8, kernel_size=7,
              impl="xla")
  return rk.RocketKVConfig(**{**base, **kw})


def _sets(idx, valid):
  idx, valid = np.asarray(idx), np.asarray(valid)
  return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(idx.shape[1])] for b in range(idx.shape[0])]


# ----------------------------------------------------------------------------- defaults are the paper's method


def test_default_options_are_the_paper_plan_and_selection():
  c = rk.make_config("rocketkv", token_budget=256, prompt_len=4096, max_new_tokens=24, head_dim=64)
  plan = plan_budget(256, 4096, 24, 64)
  assert (c.page_size, c.topr, c.topk) == (plan.page_size, plan.top_r, plan.top_k) == (3, 40, 128)
  assert (c.hsa_sink_tokens, c.hsa_recent_tokens, c.plan_page_size, c.plan_topk) == (0, 0, None, None)
  assert stage2_replan(plan) == (plan.page_size, plan.top_r, plan.top_k)
  cfg = _rocket()
  q, k, v, q1 = _qkv(0, 2, 64)
  cache = _cache(cfg, q, k, v, [64, 50])
  idx, valid = cfg.select(cache, q1)
  want = ops.hsa_select(q1, cache.state.kt_min, cache.state.kt_max, cache.length, topr=cfg.topr,
                        page_size=cfg.page_size, k=cfg.topk, num_slots=cache.capacity, impl="xla")
  np.testing.assert_array_equal(idx, want)
  np.testing.assert_array_equal(valid, ops.prefix_valid(want, cache.length))


# ----------------------------------------------------------------------------- forced sink / recent pages


@pytest.mark.parametrize("impl,page_size,sink,recent", [("xla", 2, 4, 6), ("interpret", 2, 4, 6), ("xla", 3, 1, 4),
                                                        ("xla", 1, 2, 3)])
def test_forced_pages_always_selected(impl, page_size, sink, recent):
  """Keys built so that the sink and recent slots score lowest: the paper's rule drops them, the variant keeps
  the pages holding them, and fills the rest of the top-k as the paper's rule ranks the other pages."""
  paper = _rocket(page_size=page_size, impl=impl)
  variant = dataclasses.replace(paper, hsa_sink_tokens=sink, hsa_recent_tokens=recent)
  q, k, v, q1 = _qkv(1, 2, 64)
  q1 = jnp.abs(q1)  # every head positive on every channel: a key's score falls with its values
  lengths = [64, 45]
  cache = _cache(paper, q, k, v, lengths)
  length = np.asarray(cache.length)
  low = np.zeros(cache.k.shape[:3], bool)
  for b, n in enumerate(length):
    low[b, :, :sink] = True
    low[b, :, n - recent:n] = True
  kk = jnp.where(jnp.asarray(low)[..., None], -5.0, cache.k)  # sink and recent keys score lowest
  from rocketkv_jax.cache import build_kt_pages
  kt_min, kt_max = build_kt_pages(kk, cache.length, page_size, cache.state.kt_min.dtype)
  cache = dataclasses.replace(cache, k=kk, state=dataclasses.replace(cache.state, kt_min=kt_min, kt_max=kt_max))
  base = _sets(*paper.select(cache, q1))
  got = _sets(*jax.jit(variant.select)(cache, q1))
  from rocketkv_jax.kernels.hsa_scores import hsa_page_scores_reference
  scores = np.asarray(hsa_page_scores_reference(q1, kt_min, kt_max, cache.length, topr=paper.topr,
                                                page_size=page_size))
  for b, n in enumerate(length):
    forced = {s for s in range(n) if s < sink or s >= n - recent}
    forced_pages = {s // page_size for s in forced}
    forced_slots = {s for s in range(n) if s // page_size in forced_pages}
    pure = {s for s in forced_slots if all(x in forced for x in range(s - s % page_size,
                                                                       min(n, s - s % page_size + page_size)))}
    assert pure
    for h in range(K):
      assert not pure & base[b][h]  # the crafted case: the paper's rule drops the all-low pages
      assert forced_slots <= got[b][h]
      assert len(got[b][h]) == min(paper.topk, n)
      # the rest: the paper's ranking of the other pages (ties toward the lower slot)
      order = sorted((p for p in range(-(-n // page_size)) if p not in forced_pages),
                     key=lambda p: (-scores[b, h, p], p))
      rest, want = paper.topk - len(forced_slots), set()
      for p in order:
        for s in range(p * page_size, min(n, (p + 1) * page_size)):
          if len(want) < rest:
            want.add(s)
      assert got[b][h] - forced_slots == want


def test_forced_pages_decode_jit_xla_equals_interpret():
  cfg = _rocket(hsa_sink_tokens=2, hsa_recent_tokens=4)
  q, k, v, _ = _qkv(2, 2, 64)
  steps = normal(key(7), (3, 2, N + 2 * K, H))
  outs = {}
  for impl in ("xla", "interpret"):
    c = dataclasses.replace(cfg, impl=impl)
    cache = _cache(c, q, k, v, [64, 50])
    res = []
    for s in steps:
      out, cache = rk.decode_step(cache, s[:, :N], s[:, N:N + K], s[:, N + K:], config=c)
      res.append(np.asarray(out))
    outs[impl] = np.stack(res)
  assert np.isfinite(outs["xla"]).all()
  np.testing.assert_allclose(outs["interpret"], outs["xla"], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- other stage-2 splits, same traffic


@pytest.mark.parametrize("t,prompt_len", [(128, 2048), (256, 2048), (128, 4096), (256, 4096), (512, 16384)])
@pytest.mark.parametrize("page_size,topk_frac", [(1, None), (2, None), (1, 0.625), (4, 0.625), (None, 0.375)])
def test_replanned_split_keeps_the_paper_traffic(t, prompt_len, page_size, topk_frac):
  kw = {}
  if page_size is not None:
    kw["plan_page_size"] = page_size
  if topk_frac is not None:
    kw["plan_topk"] = int(t * topk_frac)
  make = lambda **o: rk.make_config("rocketkv", token_budget=t, prompt_len=prompt_len, max_new_tokens=24,
                                    head_dim=64, **o)
  paper, variant = make(), make(**kw)
  assert variant.page_size == (page_size or paper.page_size)
  assert variant.topk == kw.get("plan_topk", paper.topk)
  assert variant.prompt_budget == paper.prompt_budget and variant.capacity == paper.capacity
  # topr: the most channels whose step at a full cache reads no more than the paper's (bf16)
  read = lambda c, n, item: c.step_read_bytes(n, head_dim=64, itemsize=item)
  assert read(variant, variant.capacity, 2) <= read(paper, paper.capacity, 2)
  if variant.topr < 64:
    more = dataclasses.replace(variant, topr=variant.topr + 1)
    assert read(more, variant.capacity, 2) > read(paper, paper.capacity, 2)
  for n in (paper.prompt_budget, (paper.prompt_budget + paper.capacity) // 2, paper.capacity):
    for item in (2, 4):
      assert read(variant, n, item) <= 1.005 * read(paper, n, item) + 4 * variant.topr * item


def test_page_size_one_with_all_channels_is_the_exact_ranking():
  """plan_page_size=1 scores single tokens: with every channel, HSA's score is each head's exact softmax and the
  selection is exact_topk's ranking over the kept slots."""
  cfg = _rocket(page_size=1, topr=H, topk=16)
  q, k, v, q1 = _qkv(3, 2, 64)
  cache = _cache(cfg, q, k, v, [64, 50])
  got = _sets(*cfg.select(cache, q1))
  want = _sets(*topk_tokens(attention_probs(q1, cache.k, cache.length).mean(axis=2), cache.length, cfg.topk))
  assert got == want


def test_replanned_split_selects_tokens_not_pages():
  c = rk.make_config("rocketkv", token_budget=64, prompt_len=300, max_new_tokens=8, head_dim=H, impl="xla",
                     window_size=8, plan_page_size=1)
  assert c.page_size == 1 and c.plan_page_size == 1
  paper = rk.make_config("rocketkv", token_budget=64, prompt_len=300, max_new_tokens=8, head_dim=H, window_size=8)
  assert paper.page_size > 1 and c.topr < paper.topr  # fewer channels pay for single-token pages
  q, k, v, q1 = _qkv(4, 1, 300)
  cache = _cache(c, q, k, v, [300])
  idx, valid = c.select(cache, q1)
  assert valid.all() and idx.shape[-1] == c.topk
  assert len(set(np.asarray(idx[0, 0]).tolist())) == c.topk


# ----------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("kw,match", [
    (dict(hsa_sink_tokens=-1), "hsa_sink_tokens=-1"),
    (dict(hsa_recent_tokens="4"), "hsa_recent_tokens='4'"),
    (dict(hsa_recent_tokens=True), "hsa_recent_tokens=True"),
    (dict(hsa_sink_tokens=8, hsa_recent_tokens=6), "hsa_sink_tokens=8 and hsa_recent_tokens=6"),
    (dict(plan_page_size=0), "plan_page_size=0"),
    (dict(plan_topk=2.5), "plan_topk=2.5"),
])
def test_bad_option_values_raise(kw, match):
  with pytest.raises(ValueError, match=match):
    _rocket(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(plan_topk=256), "top_k=256 must be < token_budget=256"),
    (dict(plan_topk=255, plan_page_size=1), "top_k=255 with page_size=1 leaves no scoring channel"),
    (dict(plan_page_size=-2), "plan_page_size=-2"),
])
def test_bad_plan_values_raise(kw, match):
  with pytest.raises(ValueError, match=match):
    rk.make_config("rocketkv", token_budget=256, prompt_len=4096, max_new_tokens=24, head_dim=64, **kw)


# ----------------------------------------------------------------------------- the registered variant


@pytest.mark.parametrize("budget,prompt_len,head_dim", [(24, 4096, 64), (64, 1024, 64), (256, 4096, 64),
                                                        (512, 8000, 64), (256, 32768, 128), (1024, 131072, 128)])
def test_rocketkv_plus_is_the_measured_option_pair(budget, prompt_len, head_dim):
  """rocketkv_plus is exactly rocketkv[plan_page_size=2,hsa_recent_tokens=8], the spec the accuracy grid ran."""
  kw = dict(token_budget=budget, prompt_len=prompt_len, max_new_tokens=24, head_dim=head_dim)
  plus = rk.make_config("rocketkv_plus", **kw)
  spec = rk.make_config("rocketkv", plan_page_size=2, hsa_recent_tokens=8, **kw)
  assert isinstance(plus, rk.RocketKVConfig) and plus.method == "rocketkv_plus"
  assert dataclasses.asdict(plus) == dataclasses.asdict(spec)
  paper = rk.make_config("rocketkv", **kw)
  assert plus.page_size == 2 and plus.topk == paper.topk and plus.prompt_budget == paper.prompt_budget
  assert plus.step_read_bytes(plus.capacity, head_dim=head_dim, itemsize=2) <= \
      paper.step_read_bytes(paper.capacity, head_dim=head_dim, itemsize=2)


def test_rocketkv_plus_overrides_back_to_the_paper_plan():
  kw = dict(token_budget=256, prompt_len=4096, max_new_tokens=24, head_dim=64)
  back = rk.make_config("rocketkv_plus", plan_page_size=None, hsa_recent_tokens=0, **kw)
  assert dataclasses.asdict(back) == dataclasses.asdict(rk.make_config("rocketkv", **kw))


def test_rocketkv_plus_refuses_a_budget_with_no_page_to_choose():
  with pytest.raises(ValueError, match=r"hsa_recent_tokens=8 force up to 10 slots.*topk=8"):
    rk.make_config("rocketkv_plus", token_budget=16, prompt_len=4096, max_new_tokens=24, head_dim=64)


def test_rocketkv_plus_decodes_like_the_option_pair():
  kw = dict(token_budget=32, prompt_len=64, max_new_tokens=8, head_dim=H, impl="xla", window_size=8)
  q, k, v, q1 = _qkv(3, 2, 64)
  lengths = jnp.asarray([64, 50], jnp.int32)
  outs = []
  for cfg in (rk.make_config("rocketkv_plus", **kw),
              rk.make_config("rocketkv", plan_page_size=2, hsa_recent_tokens=8, **kw)):
    cache = rk.prefill_compress(q, k, v, lengths, config=cfg)
    out, cache = rk.decode_step(cache, q1.reshape(2, N, H), k[:, -1], v[:, -1], config=cfg)
    outs.append((np.asarray(out), np.asarray(cache.k)))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_sinks_alone_do_not_force_the_last_partial_page():
  from rocketkv_jax.kernels.page_topk import force_pages
  scores = jnp.zeros((1, 1, 4))  # 4 pages of 3 slots; 10 valid slots: the last page is partial
  forced = np.asarray(force_pages(scores, jnp.asarray([10]), page_size=3, sink=2, recent=0))[0, 0]
  np.testing.assert_array_equal(forced > 1, [True, False, False, False])
  forced = np.asarray(force_pages(scores, jnp.asarray([10]), page_size=3, sink=0, recent=1))[0, 0]
  np.testing.assert_array_equal(forced > 1, [False, False, False, True])
