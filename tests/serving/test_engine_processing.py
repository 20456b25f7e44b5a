"""The engine's processed requests (penalties, logit bias, min_tokens, logprobs), prompt logprobs, cache salts
and per-request failures, on a tiny random Llama: logprobs equal the dense model's, a processed request beside
plain ones changes none of theirs, tenants do not share history, and a request that fails alone fails alone."""

import numpy as np
import pytest

from rocketkv_jax.models import forward_full
from rocketkv_jax.serving import Engine, EngineConfig, Request, SamplingParams
from tests.helpers.engine import KW, Tok, prompt, tiny_engine_model

V = 128


@pytest.fixture(scope="module")
def model():
  return tiny_engine_model()


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def full_engine(model):
  """`full` keeps every token, so the engine's logprobs must equal the dense forward's."""
  return Engine(model, Tok(), EngineConfig(**dict(KW, method="full")))


def _events(engine, requests, steps=None):
  out = {}
  for r in requests:
    engine.submit(r)
  while engine.has_work():
    for ev in engine.step():
      out.setdefault(ev.request_id, []).append(ev)
  return out


def _tokens(events):
  return [t for ev in events for t in ev.token_ids]


def test_logprobs_and_prompt_logprobs_equal_the_dense_model(model, full_engine):
  ids = prompt(40, 1)
  s = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2)
  ev = _events(full_engine, [Request("a", ids, s)])["a"]
  toks = _tokens(ev)
  plain = _tokens(_events(full_engine, [Request("b", ids, SamplingParams(max_tokens=6))])["b"])
  assert toks == plain  # logprobs change no token
  lp = _log_softmax(forward_full(model, np.asarray([ids + toks], np.int32))[0])
  got = [x for e in ev for x in e.logprobs]
  assert [x.token_id for x in got] == toks
  for j, x in enumerate(got):
    row = lp[len(ids) - 1 + j]
    assert x.logprob == pytest.approx(row[toks[j]], abs=2e-4)
    assert [i for i, _ in x.top] == np.argsort(-row)[:3].tolist()
    np.testing.assert_allclose([v for _, v in x.top], np.sort(row)[::-1][:3], atol=2e-4)
  pl = ev[0].prompt_logprobs
  assert all(e.prompt_logprobs is None for e in ev[1:])
  assert len(pl) == len(ids) and pl[0] is None
  for t in range(1, len(ids)):
    assert pl[t].token_id == ids[t] and len(pl[t].top) == 2
    assert pl[t].logprob == pytest.approx(lp[t - 1, ids[t]], abs=2e-4)
    assert pl[t].top[0][0] == int(lp[t - 1].argmax())


def test_processed_request_beside_plain_ones(engine_rk):
  """A processed request decodes in its own executable kind; every row of that call gets exactly what it gets
  alone, the processed row included."""
  a = Request("a", prompt(100, 2), SamplingParams(max_tokens=9))
  b = Request("b", prompt(150, 3), SamplingParams(max_tokens=9, temperature=0.8, seed=4))
  p = Request("p", prompt(100, 2), SamplingParams(max_tokens=9, repetition_penalty=2.0, presence_penalty=1.5,
                                                  frequency_penalty=0.5, logprobs=0))
  alone = {r.request_id: _tokens(_events(engine_rk, [r])[r.request_id]) for r in (a, b, p)}
  together = {k: _tokens(v) for k, v in _events(engine_rk, [a, b, p]).items()}
  assert together == alone
  assert alone["p"] != alone["a"]  # same prompt: the penalties changed the answer


def test_logit_bias_and_min_tokens(engine_rk):
  ids = prompt(100, 5)
  forced = _events(engine_rk, [Request("f", ids, SamplingParams(max_tokens=5, logit_bias={7: 100.0}))])["f"]
  assert _tokens(forced) == [7] * 5
  # EOS (2) pushed to the top: it ends the answer at once, unless min_tokens holds it back
  eos = SamplingParams(max_tokens=8, logit_bias={2: 100.0})
  ev = _events(engine_rk, [Request("e", ids, eos)])["e"]
  assert _tokens(ev) == [] and ev[-1].finish_reason == "stop" and ev[-1].completion_tokens == 1
  held = SamplingParams(max_tokens=8, logit_bias={2: 100.0}, min_tokens=3)
  ev = _events(engine_rk, [Request("m", ids, held)])["m"]
  assert len(_tokens(ev)) == 3 and 2 not in _tokens(ev)
  assert ev[-1].finish_reason == "stop" and ev[-1].completion_tokens == 4
  # a request's own stop id is held back too
  own = SamplingParams(max_tokens=8, logit_bias={9: 100.0}, stop_ids=(9,), min_tokens=2)
  ev = _events(engine_rk, [Request("o", ids, own)])["o"]
  assert ev[-1].finish_reason == "stop" and ev[-1].completion_tokens == 3


@pytest.fixture(scope="module")
def engine_rk(model):
  return Engine(model, Tok(), EngineConfig(**KW))


def test_cache_salt_separates_tenants(model):
  engine = Engine(model, Tok(), EngineConfig(**dict(KW, history_bytes=2**24)))
  doc = prompt(120, 6)
  first = _events(engine, [Request("a1", doc + [5, 6, 7], SamplingParams(max_tokens=2), cache_salt="alice")])
  assert first["a1"][-1].cached_tokens == 0
  other = _events(engine, [Request("b1", doc + [8, 9, 10], SamplingParams(max_tokens=2), cache_salt="bob")])
  assert other["b1"][-1].cached_tokens == 0  # bob learns nothing of alice's prompt
  again = _events(engine, [Request("a2", doc + [8, 9, 10], SamplingParams(max_tokens=2), cache_salt="alice")])
  assert again["a2"][-1].cached_tokens > 80
  assert engine.reusable(doc + [1], "alice") > 80 and engine.reusable(doc + [1], "eve") == 0
  assert engine.reusable(doc + [1]) == 0  # no salt is a tenant of its own
  with pytest.raises(ValueError, match="cache_salt"):
    engine.submit(Request("x", doc, SamplingParams(max_tokens=2), cache_salt="s" * 400))


def test_a_failing_prefill_fails_its_request_only(engine_rk, monkeypatch):
  good = [Request(f"g{i}", prompt((5, 20, 100)[i], 10 + i), SamplingParams(max_tokens=6)) for i in range(3)]
  alone = {r.request_id: _tokens(_events(engine_rk, [r])[r.request_id]) for r in good}
  real = engine_rk.prefill

  def prefill(request):
    if request.request_id == "bad":
      raise RuntimeError("out of memory (simulated)")
    return real(request)

  monkeypatch.setattr(engine_rk, "prefill", prefill)
  out = _events(engine_rk, good[:2] + [Request("bad", prompt(64, 1), SamplingParams(max_tokens=6))] + good[2:])
  assert out["bad"][-1].finish_reason == "error" and "out of memory" in out["bad"][-1].error
  assert {k: _tokens(v) for k, v in out.items() if k != "bad"} == alone
  assert all(v[-1].finish_reason == "length" for k, v in out.items() if k != "bad")


def test_one_length_limit_and_max_tokens_0(model, full_engine, engine_rk):
  """max_model_len = max_prompt_tokens + max_new_tokens is the most prompt + new tokens a request may have. full's
  slots hold that many tokens, so a short prompt may ask for more than max_new_tokens and gets them (issue 60:
  max_tokens=257 was refused while max_model_len said 2304); rocketkv's slots hold a budget of the prompt plus
  max_new_tokens, and its refusal names that number; past max_model_len, vLLM's context_length_exceeded. A request
  of max_tokens=0 is prefilled and scored, takes no slot and ends at once with the prompt's logprobs."""
  from rocketkv_jax.serving.engine import LimitError
  L, M = KW["max_prompt_tokens"] + KW["max_new_tokens"], KW["max_new_tokens"]
  assert full_engine.max_model_len == engine_rk.max_model_len == L
  assert [full_engine.max_tokens_for(n) for n in (5, 100, 200)] == [L - 5, L - 100, M]
  assert [engine_rk.max_tokens_for(n) for n in (5, 200)] == [M, M]
  ids = prompt(5, 3)
  got = _events(full_engine, [Request("long", ids, SamplingParams(max_tokens=M + 40, ignore_eos=True)),
                              Request("score", prompt(20, 4), SamplingParams(max_tokens=0, prompt_logprobs=1)),
                              Request("one", prompt(20, 4), SamplingParams(max_tokens=1, prompt_logprobs=1))])
  toks = _tokens(got["long"])
  assert len(toks) == M + 40 and got["long"][-1].finish_reason == "length"
  lp = _log_softmax(np.asarray(forward_full(model, np.asarray([ids + toks], np.int32)))[0])
  for i, t in enumerate(toks):  # greedy over every kept token: the dense model's most likely, past max_new_tokens too
    assert lp[len(ids) - 1 + i, t] >= lp[len(ids) - 1 + i].max() - 1e-4, i
  (score,) = got["score"]
  assert (score.token_ids, score.finished, score.finish_reason, score.completion_tokens) == ([], True, "length", 0)
  assert score.prompt_logprobs == got["one"][0].prompt_logprobs and len(score.prompt_logprobs) == 20
  for engine, n, m, code, match in (
      (full_engine, 200, M + 1, "context_length_exceeded", rf"maximum context length is {L} tokens\. However, you "
                                                           rf"requested {201 + M} tokens \(200 in the prompt"),
      (engine_rk, 5, M + 1, "invalid_value", rf"max_tokens={M + 1} exceeds the {M} new tokens .* prompt of 5 tokens")):
    with pytest.raises(LimitError, match=match) as e:
      engine.submit(Request("x", prompt(n, 5), SamplingParams(max_tokens=m)))
    assert e.value.code == code and e.value.field == "max_tokens"


def test_validation(engine_rk):
  ids = prompt(10, 1)
  with pytest.raises(ValueError, match=r"logit_bias token ids \[500\]"):
    engine_rk.validate(Request("x", ids, SamplingParams(max_tokens=2, logit_bias={500: 1.0})))
  for kw, match in ((dict(repetition_penalty=0), "repetition_penalty=0"), (dict(presence_penalty=2.5), "presence"),
                    (dict(min_tokens=70), "min_tokens=70"), (dict(logprobs=21), "logprobs=21"),
                    (dict(logit_bias={1: 101}), r"logit_bias\[1\]=101"),
                    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
                    (dict(stop_ids=tuple(range(65))), "at most 64")):
    with pytest.raises(ValueError, match=match):
      SamplingParams(**kw)
  ctx = engine_rk.compress_context(prompt(150, 2))
  with pytest.raises(ValueError, match="prompt_logprobs needs the prompt prefilled in full"):
    engine_rk.validate(Request("c", ids, SamplingParams(max_tokens=2, prompt_logprobs=0), context=ctx))


@pytest.mark.parametrize("history", [0, 2**24])
def test_chunked_prefill_equals_whole(model, history):
  """prefill_chunk_tokens: a long prompt is prefilled a chunk per step while another request decodes; every
  answer equals the whole-prefill engine's, the decoding request gets a token every step, and (with a history)
  the stored K/V lets a second turn reuse the chunked prompt."""
  kw = dict(KW, max_prompt_tokens=400, history_bytes=history)
  whole = Engine(model, Tok(), EngineConfig(**kw))
  chunked = Engine(model, Tok(), EngineConfig(**dict(kw, prefill_chunk_tokens=64)))
  chunks = chunked.device.chunks(300)
  q = chunked.method_config.prompt_queries
  # chunks of 64 (the smallest size: this toy model's attention outweighs its linear layers within 64 tokens),
  # then the rest, then the last holds stage 1's window alone
  assert chunks == [64] * 4 + [300 - 256 - q, q]
  short = Request("short", prompt(20, 1), SamplingParams(max_tokens=24))
  long_ = Request("long", prompt(300, 2), SamplingParams(max_tokens=8))
  want = {k: _tokens(v) for k, v in _events(whole, [short, long_]).items()}
  chunked.submit(short)
  chunked.step()  # short admitted and decoding
  chunked.submit(long_)
  out, steps_with_short = {}, 0
  k = 0
  while chunked.has_work():
    events = chunked.step()
    k += 1
    for ev in events:
      out.setdefault(ev.request_id, []).append(ev)
    if k <= len(chunks):  # the long prompt takes a step per chunk: short advances in every one of them
      steps_with_short += any(ev.request_id == "short" and ev.token_ids for ev in events)
  assert {k: _tokens(v) for k, v in out.items()} == want
  assert steps_with_short >= len(chunks) - 1
  assert out["long"][-1].prompt_tokens == 300
  if history:
    turn2 = Request("t2", prompt(300, 2) + [5, 6, 7] * 20, SamplingParams(max_tokens=4))
    ev = _events(chunked, [turn2])["t2"]
    assert ev[-1].cached_tokens > 250
    assert _tokens(ev) == _tokens(_events(whole, [turn2])["t2"])


@pytest.mark.parametrize("c", [256, 1024])
def test_chunks_cost_about_the_same(c):
  """chunk_sizes (the 8B shape): along a long prompt each chunk but the last costs at most what c tokens at
  position 0 cost (`llama.prefill_flops`), in multiples of CHUNK_ALIGN, as large as that allows and never growing;
  the last is stage 1's window; the sizes at a position do not depend on the prompt's length."""
  from benchmarks.decode import LLAMA_31_8B as cfg
  from rocketkv_jax.models.llama import prefill_flops
  from rocketkv_jax.serving.engine import CHUNK_ALIGN, chunk_sizes, chunk_slot
  q = 32
  assert chunk_sizes(cfg, c, q, c) == [c] and chunk_sizes(cfg, 0, q, 9000) == [9000]
  assert chunk_sizes(cfg, c, None, 9000) == [9000]  # a method reading every query (H2O) prefills whole
  for m in (32768, 20000):
    sizes = chunk_sizes(cfg, c, q, m)
    assert sum(sizes) == m and sizes[-1] == q
    p = 0
    for i, n in enumerate(sizes[:-1]):
      last_body = i == len(sizes) - 2
      assert n % CHUNK_ALIGN == 0 or last_body, (m, i, n)
      assert prefill_flops(cfg, n, p) <= prefill_flops(cfg, c) or n == CHUNK_ALIGN
      if not last_body and n < c:  # the next size up would cost more
        assert prefill_flops(cfg, n + CHUNK_ALIGN, p) > prefill_flops(cfg, c)
      p += n
    assert sizes[:-2] == sorted(sizes[:-2], reverse=True) and sizes[0] == c
  if c == 1024:  # about half by 32k (the last full-size chunk before the rest and the window)
    assert 0.4 * c <= chunk_sizes(cfg, c, q, 32768)[-3] <= 0.6 * c
  short, long_ = chunk_sizes(cfg, c, q, 20000), chunk_sizes(cfg, c, q, 32768)
  assert short[:-2] == long_[:len(short) - 2]
  # over a history: from the slot that holds the start, each chunk inside one slot of the same grid
  over = chunk_sizes(cfg, c, q, 4000, start=28000 + 7)
  p = 28000 + 7
  for n in over[:-1]:
    g, size = chunk_slot(cfg, c, p)
    assert g <= p and p + n <= g + size and size in long_ + [c]
    p += n
  assert sum(over) == 4000 and over[0] < c


def test_device_history_tier(model, tmp_path):
  """history_device_bytes: recent histories stay on the device (no host copy), a next turn over them equals the
  host-history engine's, older ones move to host memory past the limit, and a save holds both."""
  kw = dict(KW, max_prompt_tokens=400, history_bytes=2**24)
  host = Engine(model, Tok(), EngineConfig(**kw))
  dev = Engine(model, Tok(), EngineConfig(**dict(kw, history_device_bytes=2**24)))
  turn1 = [Request(f"a{i}", prompt(150, 20 + i), SamplingParams(max_tokens=4)) for i in range(2)]
  for e in (host, dev):
    _events(e, turn1)
  assert dev.stats()["kv_bytes_host"] == 0 and dev.stats()["kv_bytes_history_device"] > 0
  assert all(s.on_device for s in dev.history.segments)
  turn2 = [Request(f"b{i}", prompt(150, 20 + i) + [9, 8, 7] * 10, SamplingParams(max_tokens=6)) for i in range(2)]
  want = {k: (_tokens(v), v[-1].cached_tokens) for k, v in _events(host, turn2).items()}
  got = {k: (_tokens(v), v[-1].cached_tokens) for k, v in _events(dev, turn2).items()}
  assert got == want and all(c > 100 for _, c in got.values())
  # a limit of one segment's bytes: the older segments move to the host, their data unchanged
  seg_bytes = dev.history.segments[0].nbytes
  before = [np.asarray(x).copy() for x in dev.history.segments[0].k]
  dev.history.max_device_bytes = seg_bytes
  _events(dev, [Request("c", prompt(150, 40), SamplingParams(max_tokens=2))])  # adding one shrinks the tier
  assert dev.stats()["kv_bytes_history_device"] <= seg_bytes and dev.stats()["kv_bytes_host"] > 0
  assert not dev.history.segments[0].on_device
  for a, b in zip(before, dev.history.segments[0].k):
    np.testing.assert_array_equal(np.asarray(b), a)
  n = dev.save_history(tmp_path / "h")
  loaded = Engine(model, Tok(), EngineConfig(**kw))
  assert loaded.load_history(tmp_path / "h") == n
  again = {k: (_tokens(v), v[-1].cached_tokens) for k, v in _events(loaded, turn2).items()}
  assert again == want


def test_ignore_eos(engine_rk):
  """ignore_eos: the model's EOS no longer ends the answer (it is kept as a token), the request's own stop ids
  still do."""
  ids = prompt(100, 5)
  eos = engine_rk.stop_ids[0]
  ev = _events(engine_rk, [Request("i", ids, SamplingParams(max_tokens=5, logit_bias={eos: 100.0},
                                                            ignore_eos=True))])["i"]
  assert _tokens(ev) == [eos] * 5 and ev[-1].finish_reason == "length"
  ev = _events(engine_rk, [Request("j", ids, SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={9: 100.0},
                                                            stop_ids=(9,)))])["j"]
  assert _tokens(ev) == [] and ev[-1].finish_reason == "stop"
  with pytest.raises(ValueError, match="ignore_eos"):
    SamplingParams(ignore_eos=1)


def test_logprobs_keep_the_stop_id(engine_rk):
  """A request ended by a stop id gets that id's logprob after its tokens' (it is not in token_ids)."""
  ids = prompt(100, 5)
  eos = engine_rk.stop_ids[0]
  ev = _events(engine_rk, [Request("s", ids, SamplingParams(max_tokens=5, logit_bias={eos: 100.0}, min_tokens=2,
                                                            logprobs=1))])["s"]
  lps = [x for e in ev for x in e.logprobs]
  assert len(_tokens(ev)) == 2 and [x.token_id for x in lps] == _tokens(ev) + [eos]
  assert ev[-1].finish_reason == "stop" and lps[-1].logprob <= 0
