"""Tiny random Llama: every method with a budget covering the whole sequence generates exactly what
full generates; a ragged batch equals each prompt alone; prefill+decode equal the dense forward;
blocked (flash-style) prefill attention equals dense attention; seeded sampling is reproducible."""

import jax
import numpy as np
import pytest

from rocketkv_jax import METHODS
from rocketkv_jax.models import decode, forward_full, generate, prefill
from rocketkv_jax import make_config
from rocketkv_jax.models.llama import blocked_causal_attention, causal_attention
from rocketkv_jax.models.tokenizer import TextTokenizer
from tests.helpers.data import keys, normal


class IdTokenizer(TextTokenizer):
  """Token ids are the text: prompts are passed as id lists, decode prints the ids."""

  def __init__(self):
    super().__init__(tokenizer=None, bos_id=1, eos_id=2)

  def decode(self, ids, *, skip_special=True):
    return " ".join(map(str, ids))


def prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 128, n).tolist() for n in lengths]


@pytest.mark.parametrize("impl_T", [(8, 37), (128, 300)])
def test_blocked_attention_equals_dense(impl_T):
  block, T = impl_T
  ks = keys(0, 3)
  q = normal(ks[0], (2, T, 4, 16))
  k = normal(ks[1], (2, T, 2, 16))
  v = normal(ks[2], (2, T, 2, 16))
  want = causal_attention(q, k, v, impl="dense")
  got = blocked_causal_attention(q, k, v, block)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_prefill_decode_equal_dense_forward(tiny_model):
  toks = np.array(prompts([24, 24], seed=1), np.int32)
  full = np.asarray(forward_full(tiny_model, toks))
  config = make_config("full", token_budget=64, prompt_len=16, max_new_tokens=8, head_dim=16)
  logits, caches = prefill(tiny_model, toks[:, :16], np.array([16, 16]), config)
  np.testing.assert_allclose(np.asarray(logits), full[:, 15], atol=1e-4, rtol=1e-4)
  for t in range(16, 23):
    logits, caches = decode(tiny_model, toks[:, t], caches, config)
    np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-4, rtol=1e-4)


def test_generate_matches_teacher_forcing(tiny_model):
  p = prompts([20], seed=2)[0]
  res = generate(tiny_model, IdTokenizer(), [p], method="full", max_new_tokens=12)
  seq = p + res.token_ids[0]
  logits = np.asarray(forward_full(tiny_model, np.array([seq], np.int32)))[0]
  n = len(res.token_ids[0])
  np.testing.assert_array_equal(logits[len(p) - 1:len(p) - 1 + n].argmax(-1), res.token_ids[0])


COVER_PROMPTS = prompts([40, 23, 33], seed=3)
COVER_KW = dict(max_new_tokens=16, token_budget=256)


@pytest.fixture(scope="module")
def full_cover(tiny_model):
  return generate(tiny_model, IdTokenizer(), COVER_PROMPTS, method="full", **COVER_KW)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "full"])
def test_covering_budget_equals_full(tiny_model, full_cover, method):
  got = generate(tiny_model, IdTokenizer(), COVER_PROMPTS, method=method, **COVER_KW)
  assert got.token_ids == full_cover.token_ids


@pytest.mark.parametrize("method", ["full", "rocketkv"])
def test_ragged_batch_equals_each_alone(tiny_model, method):
  """generate plans each prompt from its own length, never from its companions, so a prompt's greedy answer is
  the same alone or next to prompts of other lengths (other plans: rocketkv's 37 / 12 / 300-token prompts keep
  37 / 12 / 85 of their tokens, page sizes 2 / 1 / 3), also where stage 1 evicts (the 300-token prompt)."""
  ps = prompts([37, 12, 300], seed=4)
  kw = dict(method=method, token_budget=32, max_new_tokens=10)
  batch = generate(tiny_model, IdTokenizer(), ps, **kw)
  pair = generate(tiny_model, IdTokenizer(), ps[:2], **kw)
  for i, p in enumerate(ps):
    alone = generate(tiny_model, IdTokenizer(), [p], **kw)
    assert batch.token_ids[i] == alone.token_ids[0], i
    if i < 2:
      assert pair.token_ids[i] == alone.token_ids[0], i


@pytest.mark.parametrize("method", ["full", "rocketkv", "snapkv", "quest"])
def test_cache_sized_to_the_prompt(tiny_model, method):
  """A 45-token prompt's caches hold at most twice what its own plan needs (the batch compiles for its length
  bucket, 64 tokens), not a plan for the model's max_len."""
  import rocketkv_jax as rk
  kw = dict(method=method, token_budget=32, max_new_tokens=20)
  res = generate(tiny_model, IdTokenizer(), prompts([45], seed=8), **kw)
  cfg = tiny_model.config
  own = rk.plan_rows(method, token_budget=32, prompt_lens=[45], max_new_tokens=20, head_dim=cfg.head_dim,
                     max_len=cfg.max_len).config
  shapes = own.cache_shapes(1, cfg.n_kv_heads, cfg.head_dim)
  need = cfg.n_layers * sum(int(np.prod(v)) * 4 for v in shapes.values())  # float32 model: every leaf 4 bytes
  assert res.stats.kv_bytes <= 2 * need, (res.stats.kv_bytes, need)


def test_eos_stops_each_sequence(tiny_model):
  ps = prompts([15, 22], seed=5)
  res = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=12)
  # Make the 3rd generated token of sequence 0 an EOS: generation of it must stop right there.
  model_eos = tiny_model.config.eos_id
  assert model_eos == 2
  stop = res.token_ids[0][2]
  tok = IdTokenizer()
  tok.eos_id = stop
  res2 = generate(tiny_model, tok, ps, method="full", max_new_tokens=12)
  assert res2.token_ids[0] == res.token_ids[0][:3]
  k = res.token_ids[1].index(stop) + 1 if stop in res.token_ids[1] else None
  assert res2.token_ids[1] == res.token_ids[1][:k]


def test_sampling_is_seeded(tiny_model):
  ps = prompts([18, 9], seed=6)
  kw = dict(method="full", max_new_tokens=10, temperature=1.0, top_p=0.9)
  a = generate(tiny_model, IdTokenizer(), ps, seed=1, **kw)
  b = generate(tiny_model, IdTokenizer(), ps, seed=1, **kw)
  assert a.token_ids == b.token_ids
  greedy = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=10)
  tiny_p = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=10, temperature=0.7,
                    top_p=1e-6, seed=3)
  assert tiny_p.token_ids == greedy.token_ids  # top_p -> 0 keeps only the argmax
  # one sampler: every row is keyed by the seed alone, so a prompt samples the same tokens alone or in a batch
  alone = generate(tiny_model, IdTokenizer(), ps[1:], seed=1, **kw)
  assert alone.token_ids[0] == a.token_ids[1]
  assert generate(tiny_model, IdTokenizer(), ps, seed=2, **kw).token_ids != a.token_ids


def test_stats_report_compression(tiny_model):
  ps = prompts([300], seed=7)
  # full's cache holds exactly prompt + max_new_tokens (rocketkv's plan compiles for the 300-token prompt's bucket)
  full = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=8)
  rk = generate(tiny_model, IdTokenizer(), ps, method="rocketkv", token_budget=32, max_new_tokens=8)
  assert full.stats.capacity == 308 and full.stats.compression == pytest.approx(1.0, rel=0.001)
  # full's bytes are those of its own run; rocketkv's 151 slots (a 512 bucket's plan) plus KT pages hold 0.70x
  assert rk.stats.full_kv_bytes == pytest.approx(full.stats.kv_bytes, rel=1e-3)  # K/V (full adds lengths)
  assert rk.stats.kv_bytes < 0.75 * full.stats.kv_bytes and rk.stats.compression > 1.3
  assert rk.stats.compression == pytest.approx(full.stats.kv_bytes / rk.stats.kv_bytes, rel=1e-3)
  assert rk.stats.capacity < 308


@pytest.mark.parametrize("chunk", [14, 100])
def test_prefill_over_token_chunks_equals_whole(tiny_model, monkeypatch, chunk):
  """Long prompts run the MLP block over token chunks (a shorter last chunk when T is not a multiple): the
  same logits and caches as one pass over all tokens."""
  from rocketkv_jax.models import llama
  toks = np.array(prompts([100, 100], seed=5), np.int32)
  lengths = np.array([100, 77])
  config = make_config("rocketkv", token_budget=16, prompt_len=100, max_new_tokens=4, head_dim=16)
  whole_logits, whole_caches = prefill(tiny_model, toks, lengths, config)
  whole_full = np.asarray(forward_full(tiny_model, toks))
  monkeypatch.setattr(llama, "PREFILL_CHUNK_TOKENS", chunk)
  jax.clear_caches()
  logits, caches = prefill(tiny_model, toks, lengths, config)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(whole_logits), atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(whole_caches)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(forward_full(tiny_model, toks)), whole_full, atol=1e-5, rtol=1e-5)
  jax.clear_caches()


def test_decode_budget_bounds_a_long_generation(tiny_model):
  """With a decode budget the cache stays prompt set + region however long the output (up to 200 tokens into a
  region of 24: a compaction every 8 after the first 24); without one it has room for every token."""
  ps = prompts([300], seed=9)
  kw = dict(method="rocketkv", token_budget=32, max_new_tokens=200)
  bounded = generate(tiny_model, IdTokenizer(), ps, decode_budget=16, decode_buffer=8, **kw)
  plain = generate(tiny_model, IdTokenizer(), ps, **kw)
  assert bounded.stats.new_tokens == [200] or bounded.finish_reasons == ["stop"]  # (the tiny model may end early)
  assert bounded.stats.new_tokens[0] > 24  # past the first compactions
  assert plain.stats.capacity >= 200 and bounded.stats.capacity < 300 / 2 + 24
  assert bounded.stats.kv_bytes < plain.stats.kv_bytes / 2
