"""Per-request plans (`plan_rows`, `plan_limits`): each row of a batch runs the paper's plan for its own length, as
data under the batch's static maxima, and gets exactly what it gets alone."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.kernels.checks import kt_num_pages
from tests.helpers.data import keys, normal

N, K, H = 4, 2, 32
NEW = 12
# t=64, d=32: prompts of 40 / 200 / 900 tokens plan page sizes 1 / 2 / 3, top-r 32 / 27 / 21, stage 1 keeps 40 / 135 / 278
LENS = [200, 40, 900, 333]


def _inputs(seed, b, t):
  ks = keys(seed, 3)
  return (normal(ks[0], (b, t, N, H)), normal(ks[1], (b, t, K, H)),
          normal(ks[2], (b, t, K, H)))


def _steps(seed, b, n):
  ks = keys(seed + 1, 3)
  return (normal(ks[0], (n, b, N, H)), normal(ks[1], (n, b, K, H)),
          normal(ks[2], (n, b, K, H)))


def _decode(config, cache, steps):
  outs = []
  for q, k, v in zip(*steps):
    out, cache = rk.decode_step(cache, q, k, v, config=config)
    outs.append(np.asarray(out, np.float64))
  return np.stack(outs, 1)


def test_rows_get_their_own_length_plan():
  bp = rk.plan_rows("rocketkv", token_budget=64, prompt_lens=LENS, max_new_tokens=NEW, head_dim=H)
  for n, c in zip(LENS, bp.row_configs):
    assert c == rk.make_config("rocketkv", token_budget=64, prompt_len=n, max_new_tokens=NEW, head_dim=H)
  rows = bp.rows
  assert rows.page_size.tolist() == [c.page_size for c in bp.row_configs]
  assert len(set(rows.page_size.tolist())) == 3 and len(set(rows.topr.tolist())) == 3
  assert rows.prompt_budget.tolist() == [c.prompt_budget for c in bp.row_configs]
  c = bp.config
  assert c.capacity == max(r.capacity for r in bp.row_configs)
  assert c.topr == max(rows.topr) and c.page_size == max(rows.page_size)
  assert c.num_kt_pages == max(kt_num_pages(r.capacity, r.page_size) for r in bp.row_configs)
  # a batch of one length is that length's plan, unchanged
  one = rk.plan_rows("rocketkv", token_budget=64, prompt_lens=[900] * 3, max_new_tokens=NEW, head_dim=H)
  assert one.config == rk.make_config("rocketkv", token_budget=64, prompt_len=900, max_new_tokens=NEW, head_dim=H)


def test_plan_errors_name_the_row():
  with pytest.raises(ValueError, match=r"row 1 \(prompt of 40 tokens, max_new_tokens=20\): prompt_budget=20"):
    rk.plan_rows("rocketkv", token_budget=16, prompt_lens=[100, 40], max_new_tokens=20, head_dim=H)
  small = rk.plan_limits("rocketkv", token_budget=64, max_prompt_len=256, max_new_tokens=NEW, head_dim=H)
  with pytest.raises(ValueError, match="does not fit"):
    rk.plan_rows("rocketkv", token_budget=64, prompt_lens=[900], max_new_tokens=NEW, head_dim=H, config=small)
  cfg = rk.make_config("rocketkv", token_budget=64, prompt_len=900, max_new_tokens=NEW, head_dim=H)
  q, k, v = _inputs(0, 2, 50)
  with pytest.raises(ValueError, match=r"rows.topr=\[99, 3\] must lie in \[1, 21\]"):
    rk.prefill_compress(q, k, v, jnp.array([50, 50]), config=cfg,
                        rows=rk.RowPlan(topr=np.array([99, 3], np.int32)))
  with pytest.raises(ValueError, match="plans"):
    rk.prefill_compress(q, k, v, jnp.array([50, 50]), config=rk.make_config(
        "snapkv", token_budget=64, prompt_len=900, max_new_tokens=NEW, head_dim=H),
        rows=rk.RowPlan(topr=np.array([3, 3], np.int32)))


@pytest.mark.parametrize("method", ["rocketkv", "rocketkv_plus", "hsa", "quest", "sparq"])
def test_limits_cover_every_request(method):
  """Every request within an engine's limits (random prompt lengths and max_tokens) fits the limits' config."""
  limits = rk.plan_limits(method, token_budget=64, max_prompt_len=1500, max_new_tokens=40, head_dim=H)
  rng = np.random.default_rng(0)
  for _ in range(40):
    n, m = int(rng.integers(1, 1501)), int(rng.integers(1, 41))
    try:
      rk.plan_rows(method, token_budget=64, prompt_lens=[n], max_new_tokens=m, head_dim=H)
    except ValueError:
      continue  # that length's plan is invalid alone (refused the same way by an engine)
    rk.plan_rows(method, token_budget=64, prompt_lens=[n], max_new_tokens=m, head_dim=H, config=limits)


def test_limits_are_planned_once_per_set_of_limits():
  """`generate` asks for its bucket's limits on every call: the second ask is the first's answer (a 128k limit
  plans about 130k lengths, seconds of Python), and other limits or overrides get their own."""
  kw = dict(token_budget=64, max_prompt_len=1500, max_new_tokens=40, head_dim=H)
  first = rk.plan_limits("rocketkv", **kw)
  assert rk.plan_limits("rocketkv", **kw) is first
  assert rk.plan_limits("rocketkv", **kw, window_size=8) != first
  assert rk.plan_limits("rocketkv", **dict(kw, max_prompt_len=3000)).capacity > first.capacity


# the kernels in interpret mode once: rocketkv runs every per-row kernel path (stage-1 budget, top-r, page size) that
# hsa and rocketkv_plus run (rocketkv_plus's forced pages per row: tests/kernels/test_row_plans.py)
CASES = [("rocketkv", "xla"), ("rocketkv", "interpret"), ("rocketkv_plus", "xla"), ("hsa", "xla"), ("quest", "xla"),
         ("sparq", "xla"), ("snapkv", "xla"), ("full", "xla"), ("h2o", "xla"), ("streaming_llm", "xla"),
         ("exact_topk", "xla")]


@pytest.mark.parametrize("method,impl", CASES)
def test_mixed_batch_rows_equal_each_row_alone(method, impl):
  """A batch of four prompt lengths (three page sizes, three top-r, four stage-1 budgets): prefill + decode steps
  give every row the outputs it gets alone, prefilled and decoded under its own length's config."""
  lens = LENS if impl == "xla" else LENS[:2] + [420]
  T = max(lens)
  q, k, v = _inputs(1, len(lens), T)
  steps = _steps(1, len(lens), 4)
  bp = rk.plan_rows(method, token_budget=64, prompt_lens=lens, max_new_tokens=NEW, head_dim=H, impl=impl)
  cache = rk.prefill_compress(q, k, v, jnp.asarray(lens, jnp.int32), config=bp.config, rows=bp.rows)
  got = _decode(bp.config, cache, steps)
  for i, (n, c) in enumerate(zip(lens, bp.row_configs)):
    one = rk.prefill_compress(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], jnp.array([n], jnp.int32), config=c)
    want = _decode(c, one, tuple(x[:, i:i + 1] for x in steps))
    np.testing.assert_allclose(got[i:i + 1], want, rtol=2e-5, atol=2e-5, err_msg=f"{method} row {i} ({n} tokens)")


def test_row_plan_is_carried_by_the_cache():
  bp = rk.plan_rows("rocketkv", token_budget=64, prompt_lens=LENS, max_new_tokens=NEW, head_dim=H, impl="xla")
  q, k, v = _inputs(2, len(LENS), max(LENS))
  cache = rk.prefill_compress(q, k, v, jnp.asarray(LENS, jnp.int32), config=bp.config, rows=bp.rows)
  assert np.asarray(cache.state.row_topr).tolist() == bp.rows.topr.tolist()
  assert np.asarray(cache.state.row_page_size).tolist() == bp.rows.page_size.tolist()
  assert np.asarray(cache.length).tolist() == [min(n, c.prompt_budget) for n, c in zip(LENS, bp.row_configs)]
  # a cache without rows holds the config's own plan in every row
  plain = rk.prefill_compress(q, k, v, jnp.asarray(LENS, jnp.int32), config=bp.row_configs[2])
  assert np.asarray(plain.state.row_page_size).tolist() == [bp.row_configs[2].page_size] * len(LENS)
  assert dataclasses.replace(cache).spec == bp.config.cache_spec()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["rocketkv", "rocketkv_plus", "hsa", "quest"])
@pytest.mark.parametrize("batch", [4, 64])
def test_mixed_batch_rows_equal_each_row_alone_compiled(method, batch):
  """The compiled kernels (both scoring layouts: 4 x 2 rows rank in the kernel, 64 x 2 gather): every row of a
  mixed-length batch gets the outputs it gets alone under its own length's config."""
  if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("no GPU")
  lens = (LENS * (batch // len(LENS)))[:batch]
  q, k, v = _inputs(3, batch, max(lens))
  steps = _steps(3, batch, 4)
  bp = rk.plan_rows(method, token_budget=64, prompt_lens=lens, max_new_tokens=NEW, head_dim=H, impl="pallas")
  cache = rk.prefill_compress(q, k, v, jnp.asarray(lens, jnp.int32), config=bp.config, rows=bp.rows)
  got = _decode(bp.config, cache, steps)
  for i in range(len(LENS)):  # one row of each length (alone at batch 1: the rank layout)
    n, c = lens[i], bp.row_configs[i]
    one = rk.prefill_compress(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], jnp.array([n], jnp.int32), config=c)
    want = _decode(c, one, tuple(x[:, i:i + 1] for x in steps))
    np.testing.assert_allclose(got[i:i + 1], want, rtol=1e-4, atol=1e-4, err_msg=f"{method} row {i} ({n} tokens)")
