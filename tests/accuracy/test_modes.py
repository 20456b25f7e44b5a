"""The query-agnostic mode: the context is compressed before the question exists, the question is fed through the
method's own decode steps, and with full KV (nothing evicted) that changes no output."""
import jax
import numpy as np
import pytest

from rocketkv_jax.eval import tasks as T
from rocketkv_jax.eval.engine import Runner, make_config
from rocketkv_jax.eval.runner import question_split
from rocketkv_jax.models.generate import stop_ids

C, MAX_NEW = 512, 6


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
  samples = [T.GENERATORS[t](tiny_tokenizer, C, s) for t in ("passkey", "multikey", "vartrack") for s in (0, 1)]
  split = question_split(samples)
  r = Runner(tiny_model)
  ids = np.array([s.ids for s in samples], np.int32)
  logits, qkv = r.prefill_dense(ids, np.full(len(samples), C))
  return r, samples, split, ids, logits, qkv


def test_agnostic_with_full_kv_equals_aware(batch, tiny_model, tiny_tokenizer):
  r, samples, split, ids, logits, qkv = batch
  eos = stop_ids(tiny_model, tiny_tokenizer, False)
  aware_cfg = make_config("full", 64, C, MAX_NEW, tiny_model.config)
  agnostic_cfg = make_config("full", 64, C - split, split + MAX_NEW, tiny_model.config)
  aware = r.greedy(logits, r.compress(qkv, np.full(len(samples), C), aware_cfg), aware_cfg, MAX_NEW, eos)
  agnostic = r.agnostic(qkv, logits, ids, C - split, agnostic_cfg, MAX_NEW, eos)
  assert aware.shape == agnostic.shape == (len(samples), MAX_NEW)
  np.testing.assert_array_equal(aware, agnostic)


def test_question_comes_after_the_compression_point(batch, tiny_model, tiny_tokenizer, monkeypatch):
  r, samples, split, ids, logits, qkv = batch
  # every row's question + answer prefix lies past the common compression point
  assert split == max(s.meta["question_tokens"] for s in samples) and split < C
  for s in samples:
    tail = tiny_tokenizer.decode(list(s.ids[C - s.meta["question_tokens"]:]))
    assert s.question in tail and C - s.meta["question_tokens"] >= C - split
  seen = []
  compress = Runner.compress

  def spy(self, layer_qkv, lengths, config, *, prefix=None):
    caches = compress(self, layer_qkv, lengths, config, prefix=prefix)
    seen.append((prefix, np.asarray(caches[0].pos).tolist(), int(np.asarray(caches[0].length).max())))
    return caches

  monkeypatch.setattr(Runner, "compress", spy)
  cfg = make_config("rocketkv", 64, C - split, split + MAX_NEW, tiny_model.config)
  out = r.agnostic(qkv, logits, ids, C - split, cfg, MAX_NEW, stop_ids(tiny_model, tiny_tokenizer, False))
  assert out.shape == (len(samples), MAX_NEW)
  (prefix, pos, kept), = seen
  # stage 1 saw the first C - split positions only (its window is their tail), and kept fewer
  assert prefix == C - split and pos == [C - split] * len(samples) and kept < C - split


def test_precompile_covers_what_runs(batch, tiny_model, tiny_tokenizer):
  r, samples, split, ids, logits, qkv = batch
  eos = stop_ids(tiny_model, tiny_tokenizer, False)
  cfg = make_config("streaming_llm", 64, C - split, split + MAX_NEW, tiny_model.config)
  r.precompile([("agnostic", cfg, len(samples), C, C - split, MAX_NEW)], eos, workers=2)
  before = r.stats["compiles"]
  jax.block_until_ready(r.agnostic(qkv, logits, ids, C - split, cfg, MAX_NEW, eos))
  assert r.stats["compiles"] == before
