"""benchmarks/sizing.py: the scaling table's numbers are `cache_nbytes` of the caches the real prefill makes
(checked against a trace of every layer, and against the closed form of a full cache), its arithmetic holds,
and docs/GUIDE.md's table is what the script writes."""
import math

import jax
import pytest

import rocketkv_jax as rk
from benchmarks import sizing
from rocketkv_jax.models import shapes


@pytest.fixture(scope="module")
def table():
  return sizing.rows()


def test_table_lists_every_model_context_and_method(table):
  cells = {(r["model"], r["context"], r["method"], r["token_budget"]) for r in table}
  assert cells == {(m, c, meth, t) for m in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
                   for c in (32768, 131072) for meth, t in (("full", None), ("rocketkv", 256), ("rocketkv", 1024))}


def test_bytes_per_sequence_are_cache_nbytes(table):
  for r in table:
    cfg = shapes.shape(r["model"])
    caches = sizing.sequence_caches(r["model"], r["context"], r["method"], r["token_budget"])
    assert len(caches) == cfg.n_layers and r["kv_bytes"] == rk.cache_nbytes(caches), r
    if r["method"] == "full":  # K and V of every token, bf16, plus the cache's int32 bookkeeping
      kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * (r["context"] + r["new_tokens"])
      assert kv <= r["kv_bytes"] <= kv * 1.001, r
    else:  # RocketKV holds a fixed number of tokens, whatever the context
      assert r["kv_bytes"] < 0.3 * next(x["kv_bytes"] for x in table if x["model"] == r["model"]
                                         and x["context"] == r["context"] and x["method"] == "full")
  # one layer's trace stands for every layer's: the same as tracing the whole model
  r = next(x for x in table if x["model"] == "llama-3.1-8b" and x["method"] == "rocketkv")
  every = sizing.sequence_caches(r["model"], r["context"], r["method"], r["token_budget"], every_layer=True)
  assert rk.cache_nbytes(every) == r["kv_bytes"]
  assert jax.tree.map(lambda x: (x.shape, x.dtype), every) == jax.tree.map(
      lambda x: (x.shape, x.dtype), sizing.sequence_caches(r["model"], r["context"], r["method"], r["token_budget"]))


def test_fit_arithmetic(table):
  usable = sizing.HBM - sizing.RESERVE
  states = {m: sizing.abstract_model(m)[1] for m in {r["model"] for r in table}}
  for r in table:
    assert r["weight_bytes"] == sizing.weight_bytes(states[r["model"]])
    tp, n = r["tp"], r["seqs_per_replica"]
    assert tp is not None, r
    w, kv = r["weight_bytes_per_gpu"], r["kv_bytes_per_gpu"]
    assert w + n * kv <= usable < w + (n + 1) * kv, r
    assert r["weight_bytes"] / tp <= w <= r["weight_bytes"] / tp * 1.01, r  # (norms are whole on every GPU)
    assert r["kv_bytes"] / tp <= kv <= r["kv_bytes"] / tp * 1.001, r  # (the lengths too)
    assert r["seqs_per_host"] == n * (8 // tp) and math.isclose(r["seqs_per_gpu"], n / tp), r
    smaller = [t for t in sizing.TP_DEGREES if t < tp]
    caches = sizing.sequence_caches(r["model"], r["context"], r["method"], r["token_budget"]) if smaller else None
    for t in smaller:  # no smaller degree holds the weights and one sequence
      assert sizing.weight_bytes(states[r["model"]], t) + sizing.cache_bytes_per_gpu(caches, t) > usable, (r, t)
  tps = {r["model"]: r["tp"] for r in table if r["context"] == 131072 and r["method"] == "full"}
  assert tps == {"llama-3.1-8b": 1, "llama-3.1-70b": 2, "llama-3.1-405b": 8}


def test_guide_table_is_the_scripts(table, tmp_path):
  with open(sizing.DOC) as f:
    text = f.read()
  assert sizing.doc_table(text) == sizing.markdown(table)
  copy = tmp_path / "GUIDE.md"
  copy.write_text(text.replace(sizing.doc_table(text), "stale\n"))
  sizing.write_doc(sizing.markdown(table), str(copy))
  assert copy.read_text() == text
