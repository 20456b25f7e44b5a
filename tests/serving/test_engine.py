"""The serving engine on a tiny random Llama: continuous batching (requests inserted while others decode, slots
freed and reused), each request's tokens equal to the same request alone (greedy and seeded sampling) and to
`generate` with the same plan, finish reasons (stop id, stop string, length, abort), bounded compiles, and the
validation errors. One short SmolLM2 run checks text and the chat stop id."""

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from rocketkv_jax.models import generate
from rocketkv_jax.serving import Engine, EngineConfig, QueueFull, Request, SamplingParams, default_buckets
from tests.helpers.engine import KW, Tok, collect, prompt, run, tiny_engine_model

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring event of one XLA compile
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # one executable read from the persistent cache (no compile event)
COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: COMPILES.append(event) if event == BACKEND_COMPILE else None)
jax.monitoring.register_event_listener(lambda event, **kw: COMPILES.append(event) if event == CACHE_HIT else None)


@pytest.fixture(scope="module")
def model():
  return tiny_engine_model()


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model, Tok(), EngineConfig(**KW))


def text_of(ids):
  return "".join(f"<{t}>" for t in ids)


SAMPLINGS = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3),
             SamplingParams(max_tokens=9), SamplingParams(max_tokens=17, temperature=1.0, top_k=5, seed=11),
             SamplingParams(max_tokens=24, temperature=0.7, seed=5), SamplingParams(max_tokens=13)]
# each request planned from its own length and max_tokens (t=32): stage 1 keeps 5 / 72 / 49 / 88 / 20 / 63 prompt
# tokens, so four prompts are evicted from; page sizes 1 and 2, top-r 8 to 16
LENGTHS = [5, 150, 64, 190, 20, 100]


def requests(tag):
  return [Request(f"{tag}{i}", prompt(n, i), s) for i, (n, s) in enumerate(zip(LENGTHS, SAMPLINGS))]


@pytest.fixture(scope="module")
def alone(engine):
  """Each request alone in the engine."""
  return {r.request_id[1:]: run(engine, {0: [r]})[0][r.request_id] for r in requests("a")}


def test_continuous_batching_equals_each_request_alone(engine, alone):
  """Six requests over four slots, submitted at different steps: the late ones are inserted while others are
  mid-decode and into slots that finished requests freed; every request's tokens and text equal its run alone
  (greedy and seeded sampling)."""
  reqs = requests("b")
  out, seen = run(engine, {0: reqs[:2], 2: reqs[2:4], 3: reqs[4:]})
  for r in reqs:
    want, got = alone[r.request_id[1:]], out[r.request_id]
    assert got["tokens"] == want["tokens"], r.request_id
    assert got["text"] == want["text"] == text_of(got["tokens"]) and got["reason"] == want["reason"]
    assert len(got["tokens"]) <= r.sampling.max_tokens
  # b2 joined at step 2 while b0 and b1 were decoding (the engine is pipelined: a call's tokens arrive with the
  # next step, so b2's first event is at step 3 and b0's at step 1); b4/b5 waited for slots that finished
  # requests freed
  assert seen["b2"][0] == 3 and seen["b0"][0] == 1 and seen["b0"][-1] > 3
  assert min(seen["b5"]) > min(seen[f"b{i}"][-1] for i in range(4))
  # sampling really sampled: the sampled requests differ from greedy runs of the same prompts
  greedy = run(engine, {0: [dataclasses.replace(r, request_id="g" + r.request_id, sampling=SamplingParams(
      max_tokens=r.sampling.max_tokens)) for r in (reqs[1], reqs[4])]})[0]
  assert greedy["gb1"]["tokens"] != out["b1"]["tokens"] or greedy["gb4"]["tokens"] != out["b4"]["tokens"]
  # free rows (length 0 at start-up, or finished) stay harmless: every row's carried logits are finite
  assert np.isfinite(np.asarray(engine.decode_state[0])).all()
  assert engine.stats()["tokens_generated"] > 0


def test_greedy_engine_equals_generate_with_the_same_plan(model, alone):
  """The engine plans each request from its own length and max_tokens, the rule generate follows, and samples as
  generate does: greedy tokens agree with generate's for the same prompt and max_new_tokens, alone and in a batch
  of mixed lengths, sampled ones for the same seed (generate's list ends with its stop id, the engine's does
  not). (generate with keep_whole=False: the engine's slots are sized for its limits, so a short request runs the
  method's plan where generate alone would keep it whole.)"""
  greedy = [i for i in range(len(LENGTHS)) if SAMPLINGS[i].temperature == 0]
  for i in greedy:
    res = generate(model, Tok(), [prompt(LENGTHS[i], i)], method="rocketkv", token_budget=32, keep_whole=False,
                   max_new_tokens=SAMPLINGS[i].max_tokens)
    got = res.token_ids[0]
    if got and got[-1] == 2:
      got = got[:-1]
    assert got == alone[str(i)]["tokens"], i
  # one sampler: a sampled request (temperature, top-p, seed) gets generate's tokens for the same seed
  for i in (1, 4):
    s = SAMPLINGS[i]
    res = generate(model, Tok(), [prompt(LENGTHS[i], i)], method="rocketkv", token_budget=32, keep_whole=False,
                   max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed)
    got = res.token_ids[0]
    if got and got[-1] == 2:
      got = got[:-1]
    assert got == alone[str(i)]["tokens"], i
  # one generate batch of every greedy prompt (lengths 5 to 150, three plans) with the same max_new_tokens
  n = 13
  batch = generate(model, Tok(), [prompt(LENGTHS[i], i) for i in greedy], method="rocketkv", token_budget=32,
                   keep_whole=False,
                   max_new_tokens=n)
  for i, got in zip(greedy, batch.token_ids):
    one = generate(model, Tok(), [prompt(LENGTHS[i], i)], method="rocketkv", token_budget=32, keep_whole=False,
                   max_new_tokens=n)
    assert got == one.token_ids[0], i


def test_finish_reasons(engine, alone):
  base = alone["0"]["tokens"]  # greedy, 20 tokens, no stop id
  p = prompt(LENGTHS[0], 0)
  stop_tok = base[6]
  k = base.index(stop_tok)
  stop_str = text_of(base[5:7])
  j = next(j for j in range(len(base) + 1) if stop_str in text_of(base[:j]))  # the token completing it
  never = text_of(base[3:4]) + "<999>"  # starts where the first call ends (token 3), never completes
  reqs = [Request("sid", p, SamplingParams(max_tokens=20, stop_ids=(stop_tok,))),
          Request("sstr", p, SamplingParams(max_tokens=20, stop_strings=("zzz", stop_str))),
          Request("len", p, SamplingParams(max_tokens=7, stop_strings=(never,))),
          Request("ab", p, SamplingParams(max_tokens=20)),
          Request("abq", p, SamplingParams(max_tokens=20))]
  for r in reqs:
    engine.submit(r)
  out, seen = {}, {}
  collect(out, seen, 0, engine.step())  # 4 slots: abq waits
  assert engine.stats()["queue_depth"] == 1 and engine.stats()["active_slots"] == 4
  assert engine.abort("ab") and engine.abort("abq") and not engine.abort("nope")
  assert engine.stats()["active_slots"] == 3 and engine.stats()["queue_depth"] == 0  # freed at once
  run(engine, {0: []}, out)
  assert out["sid"]["tokens"] == base[:k] and out["sid"]["reason"] == "stop"
  assert out["sid"]["completion"] == k + 1  # the stop id counts as generated
  full_text = text_of(base)
  assert out["sstr"]["text"] == full_text[:full_text.index(stop_str)] and out["sstr"]["reason"] == "stop"
  assert out["sstr"]["tokens"] == base[:j]  # up to the token that completed the stop string, none after
  assert out["len"]["tokens"] == base[:7] and out["len"]["reason"] == "length" and out["len"]["completion"] == 7
  # the first call ended on token 3, which may start `never`: its text was held back to the next event
  assert out["len"]["deltas"][0] == text_of(base[:3]) and out["len"]["text"] == text_of(base[:7])
  # the first call's tokens were still in flight when "ab" was aborted (the engine reads a call's tokens at the
  # next step): they are dropped, and the abort is its only event
  assert out["ab"]["reason"] == "abort" and out["ab"]["tokens"] == [] and out["ab"]["completion"] == 0
  assert out["abq"]["reason"] == "abort" and out["abq"]["completion"] == 0
  assert not engine.has_work()


def test_no_call_once_every_row_holds_its_max_tokens(engine, alone, monkeypatch):
  """The decode calls a request costs: a row whose calls already hold its max_tokens gets no further call, so
  requests of max_tokens <= steps_per_call (4) cost one call together, and 9 tokens cost ceil(9 / 4) = 3 calls
  (one more each before: the pipelined engine launched the next call before it read the last); the tokens are
  the same greedy prefix of the longer answer."""
  calls = []
  launch = engine.device.generate
  monkeypatch.setattr(engine.device, "generate", lambda *a, **k: calls.append(1) or launch(*a, **k))
  base = alone["0"]["tokens"]  # greedy, 20 tokens
  p = prompt(LENGTHS[0], 0)
  out, _ = run(engine, {0: [Request("one", p, SamplingParams(max_tokens=1)),
                            Request("four", p, SamplingParams(max_tokens=4))]})
  assert len(calls) == 1
  assert out["one"]["tokens"] == base[:1] and out["four"]["tokens"] == base[:4]
  assert out["one"]["reason"] == out["four"]["reason"] == "length"
  calls.clear()
  out, _ = run(engine, {0: [Request("nine", p, SamplingParams(max_tokens=9))]})
  assert len(calls) == 3 and out["nine"]["tokens"] == base[:9] and out["nine"]["reason"] == "length"


def test_compiles_are_bounded(engine, alone):
  """Prefill compiles once per bucket, insert once, decode once per sampling kind in use (every row greedy,
  sampling, sampling with cuts: chosen on the host, so the loop has no data-dependent branch): once every
  bucket and kind was seen, new requests of new lengths and sampling compile nothing at all (counted by jax's
  own compile events)."""
  c = engine.config
  assert c.prefill_buckets == (64, 128, 200) == default_buckets(200)
  kinds = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, temperature=0.5),
           SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9)]
  for k, sp in enumerate(kinds):
    run(engine, {0: [Request(f"w{k}-{n}", prompt(n, n), sp) for n in (3, 100, 170)]})
  bound = len(c.prefill_buckets) + 1 + len(kinds)
  assert engine.stats()["compiles"] <= bound
  before = len(COMPILES)
  reqs = [Request(f"c{n}", prompt(n, n), SamplingParams(max_tokens=5 + n % 7, temperature=(n % 3) / 2, top_k=n % 4,
                                                        seed=n)) for n in (1, 17, 63, 64, 65, 129, 199, 200)]
  run(engine, {0: reqs[:3], 1: reqs[3:6], 4: reqs[6:]})
  assert len(COMPILES) == before
  assert engine.stats()["compiles"] == bound


def test_validation_errors(model, engine):
  for bad, match in ((dict(method="nope"), "method"), (dict(token_budget=8), "token_budget"),
                     (dict(max_slots=0), "max_slots"), (dict(steps_per_call=0), "steps_per_call"),
                     (dict(prefill_buckets=(64, 500)), "prefill_buckets"), (dict(topk_x=3), "topk_x"),
                     (dict(max_prompt_tokens="8"), "max_prompt_tokens")):
    with pytest.raises(ValueError, match=match):
      EngineConfig(**{**KW, **bad})
  assert EngineConfig(**KW, impl="xla").method_overrides == (("impl", "xla"),)
  assert EngineConfig(**KW, prefill_buckets=[100]).prefill_buckets == (100, 200)
  with pytest.raises(ValueError, match="max_len"):
    Engine(model, Tok(), EngineConfig(**{**KW, "max_prompt_tokens": 500}))
  for bad, match in ((dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                     (dict(seed=-1), "seed"), (dict(seed=2**32), "seed"), (dict(max_tokens=-1), "max_tokens"),
                     (dict(stop_ids=(-2,)), "stop_ids"), (dict(stop_strings=("",)), "stop_strings"),
                     # nothing that would overflow the device's int32 / float32 / uint32 (the server's 400s)
                     (dict(top_k=10**12), "top_k"), (dict(max_tokens=2**31), "max_tokens"),
                     (dict(temperature=1e6), "temperature"), (dict(temperature=10**400), "temperature"),
                     (dict(top_p=10**400), "top_p"), (dict(seed=2**64), "seed"), (dict(stop_ids=(2**40,)), "stop_ids")):
    with pytest.raises(ValueError, match=match):
      SamplingParams(**bad)
  assert SamplingParams(temperature=1e-9).temperature == 0.0  # below float32's reach: greedy, as vLLM does
  for req, match in ((Request("x", []), "prompt_ids"), (Request("x", [5] * 201), "max_prompt_tokens"),
                     (Request("x", [5, 999]), "token ids"), (Request("", [5]), "request_id"),
                     (Request("x", [5], SamplingParams(max_tokens=25)), "max_new_tokens"),
                     (Request("x", [5], SamplingParams(max_tokens=3, top_k=10**6)), "top_k=1000000 exceeds"),
                     (Request("x", [5], SamplingParams(max_tokens=3, stop_ids=(10**6,))), "stop_ids"),
                     # the paper's plan for 33 prompt tokens and 24 new ones at t=32 keeps fewer than its window
                     (Request("x", [5] * 33, SamplingParams(max_tokens=24)),
                      r"row 0 \(prompt of 33 tokens, max_new_tokens=24\): prompt_budget=25 .* window_size=32")):
    with pytest.raises(ValueError, match=match):
      engine.validate(req)
    with pytest.raises(ValueError, match=match):
      engine.submit(req)
  small = Engine(model, Tok(), EngineConfig(**{**KW, "max_queue": 1}))
  small.submit(Request("q1", [5, 6], SamplingParams(max_tokens=3)))
  with pytest.raises(ValueError, match="q1"):
    small.submit(Request("q1", [5, 6], SamplingParams(max_tokens=3)))
  with pytest.raises(QueueFull):
    small.submit(Request("q2", [5, 6], SamplingParams(max_tokens=3)))
  assert issubclass(QueueFull, RuntimeError)


def test_smollm2_chat_stops_at_end_of_turn(smollm2):
  """A real tokenizer: chat prompts end at <|im_end|> (finish "stop", not in the text); the streamed text deltas
  join to the decoded answer; the same request next to another gives the same answer."""
  model, tok = smollm2
  engine = Engine(model, tok, EngineConfig(method="rocketkv", token_budget=256, max_slots=2, max_prompt_tokens=128,
                                           max_new_tokens=32, steps_per_call=8))
  ids = tok.encode("What is the capital of France? Answer in one word.", chat=True)
  other = tok.encode("Write a long poem about the sea.", chat=True)
  alone, _ = run(engine, {0: [Request("a", ids, SamplingParams(max_tokens=32))]})
  both, _ = run(engine, {0: [Request("o", other, SamplingParams(max_tokens=32)),
                             Request("b", ids, SamplingParams(max_tokens=32))]})
  a = alone["a"]
  assert a["reason"] == "stop" and "Paris" in a["text"] and "<|im_end|>" not in a["text"]
  assert a["text"] == tok.decode(a["tokens"])
  assert both["b"]["tokens"] == a["tokens"] and both["b"]["text"] == a["text"]
