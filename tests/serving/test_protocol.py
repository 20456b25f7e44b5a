"""The server's protocol surface (issue 36): the pydantic request models (`/openapi.json`, 400s naming the field)
and the fields they implement: penalties, logit_bias, min_tokens, logprobs / top_logprobs / echo, n, cache_salt,
`/tokenizer_info`, `--chat-template`. A real server on 127.0.0.1 (`tests.helpers.server.serving`), the embedded SmolLM2,
the official `openai` client where it fits and raw HTTP where the point is the bytes."""

import dataclasses
import json
import math

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tests.helpers.server import MODEL, PROMPTS, QUESTIONS, serving  # noqa: E402

pytestmark = pytest.mark.xla_opt  # many decode steps: run with XLA's default optimization (conftest)


@pytest.fixture(scope="module")
def served(smollm2_lite):
  with serving(*smollm2_lite, history_bytes=2**28) as s:  # with a prompt history: cache_salt has something to separate
    yield s


def _post(served, path, body) -> tuple[int, dict]:
  status, text = served.http("POST", path, json.dumps(body))
  return status, json.loads(text)


def _complete(served, **kw):
  return served.client.completions.create(model=MODEL, **kw)


# --- the schema ---------------------------------------------------------------------------------------------------


def test_openapi_shows_the_request_bodies(served):
  status, text = served.http("GET", "/openapi.json")
  assert status == 200
  schema = json.loads(text)
  components = schema["components"]["schemas"]
  for path, name, fields in (("/v1/completions", "CompletionRequest", {"prompt", "logprobs", "echo", "n"}),
                             ("/v1/chat/completions", "ChatCompletionRequest", {"messages", "top_logprobs"}),
                             ("/tokenize", "TokenizeRequest", {"prompt", "messages"}),
                             ("/detokenize", "DetokenizeRequest", {"tokens"})):
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{name}"}, body
    props = components[name]["properties"]
    assert fields <= set(props), (name, sorted(props))
    assert "model" in props and components[name].get("additionalProperties") is True
  # every $ref in the document resolves
  refs = set()

  def walk(x):
    if isinstance(x, dict):
      refs.update(v for k, v in x.items() if k == "$ref")
      for v in x.values():
        walk(v)
    elif isinstance(x, list):
      for v in x:
        walk(v)

  walk(schema)
  assert refs and all(r.rsplit("/", 1)[1] in components for r in refs), refs - {f"#/components/schemas/{c}"
                                                                               for c in components}
  ok = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
  assert ok["$ref"].endswith("/CompletionResponse")
  status, page = served.http("GET", "/docs")
  assert status == 200 and "swagger" in page.lower()


# --- 400s naming the field ----------------------------------------------------------------------------------------


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"repetition_penalty": float("nan")}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 17}, "min_tokens"),         # over the default max_tokens (16)
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
    ("/v1/completions", {"logit_bias": [[5, 1]]}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"cache_salt": "x" * 257}, "cache_salt"),
    ("/v1/completions", {"cache_salt": 5}, "cache_salt"),
    ("/v1/completions", {"max_tokens": 17}, "max_tokens"),        # over the server's --max-new-tokens (16)
    ("/v1/chat/completions", dict(CHAT, logprobs=2), "logprobs"),
    ("/v1/chat/completions", dict(CHAT, top_logprobs=21, logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", dict(CHAT, top_logprobs=2), "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", dict(CHAT, echo=True), "echo"),      # vLLM's chat echo: not implemented
    ("/v1/chat/completions", dict(CHAT, reasoning_effort="high"), "reasoning_effort"),
    ("/v1/chat/completions", dict(CHAT, chat_template="{{ 1 }}"), "chat_template"),  # per request: not implemented
    ("/v1/completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", dict(CHAT, max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "messages": CHAT["messages"]}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
])
def test_bad_values_get_400_naming_the_field(served, path, fields, param):
  body = {"model": MODEL, **({"prompt": "hello"} if path == "/v1/completions" else {}), **fields}
  status, got = _post(served, path, body)
  assert status == 400, got
  err = got["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
  assert err["param"] == param and err["message"], err


def test_validation_errors_are_400_never_422(served):
  """Even FastAPI's own validation (a path or query parameter) answers with OpenAI's error object."""
  for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/completions", {"model": MODEL}),
                     ("/v1/chat/completions", {"model": MODEL}), ("/detokenize", {})):
    status, got = _post(served, path, body)
    assert status == 400 and got["error"]["code"] == "missing_required_parameter", (path, got)


def test_the_new_fields_accepted_by_the_openai_client(served):
  """Each new field, sent as a user sends it, is a 200 with a well-formed answer."""
  for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=-0.5), dict(logit_bias={"21285": 5}),
             dict(extra_body={"repetition_penalty": 1.2}), dict(extra_body={"min_tokens": 2}),
             dict(logprobs=0), dict(echo=True), dict(n=2), dict(extra_body={"cache_salt": "tenant-a"})):
    r = _complete(served, prompt=PROMPTS[0], max_tokens=4, temperature=0, **kw)
    assert r.choices and all(c.finish_reason in ("stop", "length") for c in r.choices), (kw, r)


# --- the fields' effects ------------------------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(served, smollm2_lite):
  _, tok = smollm2_lite
  (banana,) = tok.encode(" banana")
  r = _complete(served, prompt=PROMPTS[0], max_tokens=4, temperature=0, logit_bias={str(banana): 100})
  assert r.choices[0].text == " banana" * 4
  plain = _complete(served, prompt=PROMPTS[0], max_tokens=1, temperature=0).choices[0].text
  (first,) = tok.encode(plain)
  r = _complete(served, prompt=PROMPTS[0], max_tokens=1, temperature=0, logit_bias={str(first): -100})
  assert r.choices[0].text != plain and r.choices[0].text


def test_min_tokens_holds_back_the_stop(served, smollm2_lite):
  _, tok = smollm2_lite
  first = _complete(served, prompt=PROMPTS[0], max_tokens=1, temperature=0).choices[0].text
  (first_id,) = tok.encode(first)
  stop = {"stop_token_ids": [first_id]}
  r = _complete(served, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=stop)
  assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1
  r = _complete(served, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=dict(stop, min_tokens=3))
  assert r.usage.completion_tokens >= 3 and r.choices[0].text


def test_ignore_eos_runs_to_max_tokens(served, smollm2_lite):
  """With the end-of-turn token pushed to the top, a chat answer ends at once; with ignore_eos (vLLM's field) it
  runs to max_tokens."""
  _, tok = smollm2_lite
  msgs = [{"role": "user", "content": "Say yes."}]
  bias = {"logit_bias": {str(tok.chat_eos_id): 100}}
  short = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                extra_body=bias)
  assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 1
  long_ = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                extra_body=dict(bias, ignore_eos=True))
  assert long_.choices[0].finish_reason == "length" and long_.usage.completion_tokens == 5
  with pytest.raises(openai.BadRequestError) as e:
    served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"ignore_eos": "yes"})
  assert e.value.body["param"] == "ignore_eos"


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_penalties_break_a_repetition(served, field):
  """Greedy, the model answers this prompt with a few tokens over and over; a strong penalty on repeated tokens
  makes it use more distinct ones."""
  prompt = "yes, yes, yes, yes, yes, yes,"

  def distinct(**kw):
    r = _complete(served, prompt=prompt, max_tokens=12, temperature=0, logprobs=0, **kw)
    return r.choices[0].logprobs.tokens

  plain = distinct()
  penalized = distinct(extra_body={field: 3.0 if field == "repetition_penalty" else 2.0})
  assert len(set(plain)) <= 6, plain
  assert len(set(penalized)) > len(set(plain)), (plain, penalized)


def test_n_samples(served):
  r = _complete(served, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, n=2, seed=5)
  assert [c.index for c in r.choices] == [0, 1]
  assert r.choices[0].text != r.choices[1].text  # seeds 5 and 6
  assert r.usage.prompt_tokens == _complete(served, prompt=PROMPTS[3], max_tokens=1).usage.prompt_tokens  # once
  assert r.usage.completion_tokens == 16
  # sample i is the request with seed + i
  one = _complete(served, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, seed=6)
  assert one.choices[0].text == r.choices[1].text
  # greedy: n equal answers
  g = _complete(served, prompt=PROMPTS[3], max_tokens=8, temperature=0, n=3)
  assert len({c.text for c in g.choices}) == 1 and len(g.choices) == 3
  # two prompts, n = 2: prompt p's sample i is choice 2p + i; streamed, the same texts per index
  r = _complete(served, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=4, temperature=1.0, n=2, seed=3)
  assert [c.index for c in r.choices] == [0, 1, 2, 3]
  texts = {}
  for chunk in _complete(served, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=4, temperature=1.0, n=2, seed=3,
                         stream=True):
    for c in chunk.choices:
      texts[c.index] = texts.get(c.index, "") + c.text
  assert texts == {c.index: c.text for c in r.choices}
  # chat
  msgs = [{"role": "user", "content": QUESTIONS[1]}]
  r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, n=2, seed=3)
  assert [c.index for c in r.choices] == [0, 1] and all(c.message.role == "assistant" for c in r.choices)
  roles, texts = {}, {}
  for chunk in served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, n=2,
                                                     seed=3, stream=True):
    for c in chunk.choices:
      roles[c.index] = roles.get(c.index) or c.delta.role
      texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
  assert roles == {0: "assistant", 1: "assistant"}
  assert texts == {c.index: c.message.content for c in r.choices}


def test_no_seed_samples_afresh_and_a_seed_repeats(served):
  """OpenAI's and vLLM's seed: a request without one draws a fresh random seed, so unseeded temperature-1 requests
  differ (issue 60: the default seed 0 gave every such request the same text); the same seed, the same text."""
  kw = dict(prompt=PROMPTS[3], max_tokens=8, temperature=1.0)
  unseeded = [_complete(served, **kw).choices[0].text for _ in range(3)]
  assert len(set(unseeded)) > 1, unseeded
  seeded = [_complete(served, seed=7, **kw).choices[0].text for _ in range(2)]
  assert seeded[0] == seeded[1]
  msgs = [{"role": "user", "content": QUESTIONS[1]}]
  chats = [served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0)
           .choices[0].message.content for _ in range(3)]
  assert len(set(chats)) > 1, chats


def test_a_stream_sends_one_token_per_chunk(served):
  """Every streamed chunk carries one token (the engine's default steps_per_call=1), so what a client measures
  between chunks is the time per token (issue 60: 4-5 tokens a chunk, and guidellm's ITL measured chunks)."""
  for stream in (_complete(served, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=0, stream=True,
                           extra_body={"ignore_eos": True}),
                 served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                       max_tokens=8, temperature=0, logprobs=True, stream=True,
                                                       extra_body={"ignore_eos": True})):
    per_chunk = []
    for chunk in stream:
      lp = chunk.choices[0].logprobs if chunk.choices else None
      if lp is not None:
        per_chunk.append(len(lp.content) if hasattr(lp, "content") and lp.content is not None else len(lp.tokens))
    assert per_chunk == [1] * 8, per_chunk


def test_cache_salt_separates_prefix_reuse(served):
  """The same long prompt again reuses its stored history only under the same salt."""
  prompt = PROMPTS[4]
  first = _complete(served, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": "alice"})
  again = _complete(served, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": "alice"})
  other = _complete(served, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": "bob"})
  cached = lambda r: r.usage.prompt_tokens_details.cached_tokens  # noqa: E731
  assert cached(other) == 0 and cached(again) > 0, (cached(first), cached(again), cached(other))
  assert first.choices[0].text == again.choices[0].text == other.choices[0].text
  # an anonymous request (no key, no salt) shares its history with every anonymous client: it is not told
  anonymous = [_complete(served, prompt=prompt, max_tokens=1, temperature=0) for _ in range(2)]
  assert all(r.usage.prompt_tokens_details is None and r.usage.prompt_tokens > 0 for r in anonymous)


# --- logprobs and echo --------------------------------------------------------------------------------------------


def _dense_logprobs(model, ids) -> np.ndarray:
  """log_softmax of the dense model's logits: [T, V] for a prompt of T tokens."""
  import jax
  from rocketkv_jax.models.llama import forward_full
  logits = forward_full(model, np.asarray([ids], np.int32))[0]
  return np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))


def test_echo_with_logprobs_on_token_ids_matches_the_dense_model(served, smollm2_lite):
  """lm-eval's log-likelihood request: token-id prompt, echo, logprobs=1, max_tokens=1, greedy. The prompt's
  logprobs are the dense model's, the first None; then the generated token's."""
  model, tok = smollm2_lite
  ids = tok.encode(PROMPTS[0] + " Paris, and the capital of Italy is")
  r = _complete(served, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
  choice = r.choices[0]
  lp = choice.logprobs
  n = len(ids) + r.usage.completion_tokens
  assert r.usage.completion_tokens == 1 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs[1:])
  assert choice.text.startswith(tok.decode(ids, skip_special=False))
  assert choice.text == tok.decode(ids, skip_special=False) + lp.tokens[-1]
  assert lp.tokens[:len(ids)] == [tok.decode([t], skip_special=False) for t in ids]
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  dense = _dense_logprobs(model, ids)
  want = dense[np.arange(len(ids) - 1), ids[1:]]
  np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-3)
  for pos, top in enumerate(lp.top_logprobs[1:], 1):  # the most likely token, and the token itself
    assert lp.tokens[pos] in top and 1 <= len(top) <= 2
    assert max(top.values()) >= lp.token_logprobs[pos] - 1e-6
  # the generated token: greedy, so the dense model's most likely next token, with its logprob
  assert lp.token_logprobs[-1] == pytest.approx(float(dense[-1].max()), abs=1e-3)
  assert lp.tokens[-1] == tok.decode([int(dense[-1].argmax())], skip_special=False)


def test_echo_of_text_prompts_and_without_logprobs(served):
  r = _complete(served, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=3, temperature=0, echo=True)
  plain = _complete(served, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=3, temperature=0)
  assert [c.text for c in r.choices] == [p + c.text for p, c in zip(PROMPTS[:2], plain.choices)]
  assert all(c.logprobs is None for c in r.choices)


def test_echo_with_max_tokens_0_scores_the_prompt_only(served, smollm2_lite):
  """vLLM's scoring idiom (lm-eval's log-likelihood requests may send it): echo with max_tokens=0 answers the prompt
  and its logprobs, nothing generated, finish_reason "length" (it was a 400); the logprobs are those max_tokens=1
  gives the prompt. Without echo, and in chat, max_tokens=0 is still a 400."""
  _, tok = smollm2_lite
  ids = tok.encode(PROMPTS[0] + " Paris, and the capital of Spain is")
  one = _complete(served, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True).choices[0].logprobs
  r = _complete(served, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True)
  c = r.choices[0]
  assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
  assert c.text == tok.decode(ids, skip_special=False)
  assert c.logprobs.tokens == one.tokens[:len(ids)] and c.logprobs.text_offset == one.text_offset[:len(ids)]
  assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
  np.testing.assert_allclose(c.logprobs.token_logprobs[1:], one.token_logprobs[1:len(ids)], atol=1e-5)
  text, tokens, finish = "", [], None
  for chunk in _complete(served, prompt=ids, max_tokens=0, logprobs=1, echo=True, stream=True):
    text += chunk.choices[0].text
    tokens += chunk.choices[0].logprobs.tokens
    finish = chunk.choices[0].finish_reason or finish
  assert (text, tokens, finish) == (c.text, c.logprobs.tokens, "length")
  # text prompts, no logprobs (through the prompt history: nothing to decode either)
  r = _complete(served, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=0, echo=True)
  assert [c.text for c in r.choices] == PROMPTS[:2] and r.usage.completion_tokens == 0
  assert {c.finish_reason for c in r.choices} == {"length"} and all(c.logprobs is None for c in r.choices)
  for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
                     ("/v1/chat/completions", dict(CHAT, max_tokens=0))):
    status, got = _post(served, path, {"model": MODEL, **body})
    assert status == 400 and got["error"]["param"] == "max_tokens", got
  assert served.metrics()["rocketkv_active_slots"] == 0


def test_completion_logprobs_streamed_and_not(served):
  r = _complete(served, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
  lp = r.choices[0].logprobs
  assert len(lp.tokens) == r.usage.completion_tokens
  assert "".join(lp.tokens).startswith(r.choices[0].text) or r.choices[0].finish_reason == "stop"
  for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert 3 <= len(top) <= 4 and token in top and math.isfinite(logprob) and logprob <= 0
    assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the most likely
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  tokens, logprobs, offsets = [], [], []
  for chunk in _complete(served, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3, stream=True):
    if chunk.choices and chunk.choices[0].logprobs:
      tokens += chunk.choices[0].logprobs.tokens
      logprobs += chunk.choices[0].logprobs.token_logprobs
      offsets += chunk.choices[0].logprobs.text_offset
  assert tokens == lp.tokens and offsets == lp.text_offset
  np.testing.assert_allclose(logprobs, lp.token_logprobs, atol=1e-6)


def test_chat_logprobs(served):
  msgs = [{"role": "user", "content": QUESTIONS[0]}]
  r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3)
  content = r.choices[0].logprobs.content
  assert content and len(content) >= r.usage.completion_tokens - 1  # a stop token's entry may be left out
  for e in content:
    assert len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode("utf-8"))
    values = [t.logprob for t in e.top_logprobs]
    assert values == sorted(values, reverse=True) and all(math.isfinite(v) and v <= 0 for v in values)
    assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(values[0], abs=1e-5)
  assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
  # logprobs without top_logprobs: the tokens' own, no alternatives; streamed: the same entries
  r2 = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)
  assert [e.token for e in r2.choices[0].logprobs.content] == [e.token for e in content]
  assert all(e.top_logprobs == [] for e in r2.choices[0].logprobs.content)
  streamed = []
  for chunk in served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True):
    if chunk.choices and chunk.choices[0].logprobs:
      streamed += chunk.choices[0].logprobs.content
  assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
  # without logprobs: none
  r3 = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
  assert r3.choices[0].logprobs is None


# --- tokenizer routes and the chat template ----------------------------------------------------------------------


def test_tokenizer_info_and_tokenize_options(served, smollm2_lite):
  _, tok = smollm2_lite
  status, text = served.http("GET", "/tokenizer_info")
  info = json.loads(text)
  assert status == 200 and info["eos_token"] == tok.tokenizer.id_to_token(tok.eos_id)
  assert info["chat_template"] == tok.chat_template and info["vocab_size"] == tok.vocab_size
  status, got = _post(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
  assert status == 200 and got["tokens"] == [tok.eos_id]
  msgs = [{"role": "user", "content": "hi"}]
  status, with_prompt = _post(served, "/tokenize", {"messages": msgs})
  status, without = _post(served, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
  assert with_prompt["tokens"] == tok.encode(tok.apply_chat(msgs))
  assert without["tokens"] == tok.encode(tok.apply_chat(msgs, add_generation_prompt=False))
  assert len(without["tokens"]) < len(with_prompt["tokens"])


TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[bot]{% endif %}")


def test_a_chat_template_override_is_used(smollm2_lite, tmp_path):
  from rocketkv_jax.models.tokenizer import read_chat_template
  model, tok = smollm2_lite
  path = tmp_path / "t.jinja"
  path.write_text(TEMPLATE)
  custom = dataclasses.replace(tok, chat_template=read_chat_template(str(path)))
  with serving(model, custom, max_slots=1, max_queue=4) as s:
    status, got = _post(s, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and got["tokens"] == tok.encode("[user] hi\n[bot]")
    r = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode("[user] hi\n[bot]"))
  (tmp_path / "t.json").write_text(json.dumps({"chat_template": TEMPLATE}))
  assert read_chat_template(str(tmp_path / "t.json")) == TEMPLATE


@pytest.mark.parametrize("content, why", [(None, "No such file"), ("{% for m in messages %}", "does not parse"),
                                          ("", "is empty")])
def test_serve_refuses_a_bad_chat_template_before_loading(tmp_path, capsys, monkeypatch, content, why):
  import rocketkv_jax.models as models
  from rocketkv_jax.serving.cli import main
  monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
  path = tmp_path / "chat.jinja"
  if content is not None:
    path.write_text(content)
  assert main(["serve", "--chat-template", str(path), "--history-gb", "1", "--no-compile-cache"]) == 2
  err = " ".join(capsys.readouterr().err.split())
  assert "--chat-template" in err and str(path) in err and why in err, err


def test_serve_applies_the_chat_template_flag(tmp_path, monkeypatch, smollm2_lite):
  """A good --chat-template reaches the tokenizer the engine is built with."""
  import rocketkv_jax.models as models
  import rocketkv_jax.serving.scheduler as scheduler_module
  from rocketkv_jax.serving.cli import main
  model, tok = smollm2_lite
  custom = dataclasses.replace(tok)
  seen = []

  class Stop(Exception):
    pass

  def engine(model, tokenizer, config, **kw):  # serve also passes mesh= and its axis names
    seen.append(tokenizer.chat_template)
    raise Stop()

  monkeypatch.setattr(models, "load", lambda *a, **k: (model, custom))
  monkeypatch.setattr(scheduler_module, "Engine", engine)
  path = tmp_path / "chat.jinja"
  path.write_text(TEMPLATE)
  try:
    main(["serve", "--chat-template", str(path), "--history-gb", "1", "--no-compile-cache"])
  except Stop:
    pass
  assert seen == [TEMPLATE]


def test_echo_logprobs_keep_a_stop_token(served, smollm2_lite):
  """lm-eval scores a continuation with token_logprobs[ctxlen:-1]: the last entry must be the generated token's
  even when that token is a stop id (here the chat end-of-turn after an answer, made certain by a logit bias), as
  vLLM and OpenAI keep it; dropping it would silently drop the continuation's last token from the score."""
  _, tok = smollm2_lite
  msgs = [{"role": "user", "content": QUESTIONS[0]}]
  ids = tok.encode(tok.apply_chat(msgs)) + tok.encode("2 + 2 is 4.")
  r = _complete(served, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                logit_bias={str(tok.eos_id): 100})
  lp = r.choices[0].logprobs
  assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
  assert len(lp.token_logprobs) == len(ids) + 1, (len(lp.token_logprobs), len(ids))
  assert math.isfinite(lp.token_logprobs[-1]) and lp.token_logprobs[-1] <= 0