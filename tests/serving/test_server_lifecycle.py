"""The server's lifecycle end to end, beside `test_server.py` (split from it so the suite's workers share the
load): overload (429), disconnects, the API key, shutdown, `rocketkv serve` as a command, generation defaults, the
warm-up (the server listens while it warms up; /health says when it is ready; an early request waits) and
ready-means-compiled with the full warm-up (nothing compiles on live traffic after it)."""

import concurrent.futures
import http.client
import json
import logging
import socket
import threading
import time
import warnings

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tests.helpers.server import (MODEL, PROMPTS, QUESTIONS, Served, chat, complete, error_of,  # noqa: E402
                                  closed_by_server, free_port, health_on, http_request, serving)

pytestmark = pytest.mark.xla_opt  # many decode steps: run with XLA's default optimization (conftest)

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

# --- overload, disconnect, shutdown: one slot, a queue of one -------------------------------------------------------
TINY_KEY = "sk-tiny-test-key"


@pytest.fixture(scope="module")
def tiny(smollm2_lite):
  """One slot, a queue of one, and an API key (so every call here also proves the key is accepted)."""
  model, tok = smollm2_lite
  s = Served(model, tok, drain_s=0.2, server_kw=dict(api_key=TINY_KEY), method="rocketkv", token_budget=64,
             max_slots=1, max_prompt_tokens=128, max_new_tokens=64, steps_per_call=1, max_queue=1)
  try:
    yield s
  finally:
    if s.thread.is_alive():
      s.stop()


def _first_chunk(client, max_tokens=64):
  stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=max_tokens, temperature=0,
                                     stream=True)
  it = iter(stream)
  next(it)
  return stream, it


def test_overload_429_and_disconnect_frees_the_slot(tiny):
  c = tiny.client
  stream, _ = _first_chunk(c)                  # holds the one slot
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 1)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    queued = pool.submit(complete, c, PROMPTS[0], 2, False)    # waits in the queue of one
    tiny.wait_metric("rocketkv_queue_depth", lambda v: v == 1)
    with pytest.raises(openai.RateLimitError) as e:
      c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    gen_before = tiny.metrics()["rocketkv_tokens_generated_total"]
    stream.close()                             # the client goes away mid-stream
    text, finish, usage = queued.result(timeout=120)  # the freed slot serves the queued request at once
    assert finish == "length" and usage.completion_tokens == 2
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 0)
  tiny.wait_metric("rocketkv_in_flight", lambda v: v == 0)
  # the abandoned request stopped well short of its 64 tokens
  assert tiny.metrics()["rocketkv_tokens_generated_total"] - gen_before < 40


def test_disconnect_while_waiting_for_a_whole_answer(tiny):
  """A non-streaming client that goes away is noticed too (the server watches the connection)."""
  gen_before = tiny.metrics()["rocketkv_tokens_generated_total"]
  conn = http.client.HTTPConnection("127.0.0.1", tiny.port, timeout=60)
  body = json.dumps(dict(model=MODEL, prompt=PROMPTS[3], max_tokens=64, temperature=0))
  conn.request("POST", "/v1/completions", body=body, headers=tiny.headers())
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 1)
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 0)
  assert tiny.metrics()["rocketkv_tokens_generated_total"] - gen_before < 40


def test_disconnect_aborts_all_n_samples(tiny):
  """n = 2 on one slot: sample 0 decodes, sample 1 waits in the queue; a client gone mid-stream frees both."""
  gen_before = tiny.metrics()["rocketkv_tokens_generated_total"]
  stream = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=64, temperature=1.0, n=2,
                                          stream=True)
  next(iter(stream))
  tiny.wait_metric("rocketkv_queue_depth", lambda v: v == 1)
  stream.close()
  tiny.wait_metric("rocketkv_in_flight", lambda v: v == 0)
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 0)
  assert tiny.metrics()["rocketkv_tokens_generated_total"] - gen_before < 64


def test_api_key_guards_all_but_health(tiny):
  port = tiny.port
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TINY_KEY}):
    for path in ("/v1/models", "/metrics", "/tokenize"):
      status, err = error_of(*http_request(port, "GET", path, headers=headers)[::2])
      assert status == 401 and err["code"] == "invalid_api_key", (path, headers)
  for path in ("/health", "/version", "/docs", "/openapi.json"):  # the schema is public: no secret in it
    assert http_request(port, "GET", path)[0] == 200, path
  ok = {"Authorization": f"Bearer {TINY_KEY}"}
  assert http_request(port, "GET", "/v1/models", headers=ok)[0] == 200
  assert http_request(port, "GET", "/metrics", headers=ok)[0] == 200
  wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0, timeout=60)
  with pytest.raises(openai.AuthenticationError):
    wrong.models.list()
  assert [m.id for m in tiny.client.models.list().data] == [MODEL]


def test_docs_load_nothing_from_outside(tiny):
  """/docs used FastAPI's CDN links (a blank page offline): now every file it names is this server's, public like
  /docs itself (no key sent here, the server has one), and nothing outside the server is named."""
  import re
  status, _, page = http_request(tiny.port, "GET", "/docs")
  assert status == 200 and "SwaggerUIBundle" in page
  assert not re.findall(r"https?://|//[\w.-]+\.\w", page), page
  assets = re.findall(r'(?:src|href)="([^"]+)"', page)
  assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets), assets
  for path in assets:  # bytes, not text (the favicon)
    conn = http.client.HTTPConnection("127.0.0.1", tiny.port, timeout=60)
    try:
      conn.request("GET", path)
      r = conn.getresponse()
      status, kind, body = r.status, r.getheader("content-type", ""), r.read()
    finally:
      conn.close()
    assert status == 200 and body, path
    assert kind.split(";")[0] in ("text/javascript", "text/css", "image/png"), (path, kind)
  for path in ("/docs/static/../metrics", "/docs/static/nope.js"):  # the open prefix opens no other route
    assert http_request(tiny.port, "GET", path)[0] in (401, 404), path


def test_shutdown_aborts_in_flight_cleanly(tiny):
  stream, it = _first_chunk(tiny.client)
  tiny.wait_metric("rocketkv_active_slots", lambda v: v == 1)
  stopper = threading.Thread(target=tiny.stop)
  stopper.start()
  with pytest.raises(openai.APIError) as e:   # the stream ends with an error event, not a cut connection
    for _ in it:
      pass
  assert "aborted" in str(e.value)
  stopper.join(120)
  assert not tiny.thread.is_alive() and not tiny.runner.alive
  assert tiny.runner.stats()["active_slots"] == 0


def test_rocketkv_serve_command(smollm2, tmp_path):
  """`rocketkv serve` as a user starts it: answers, closes an idle keep-alive connection after its `--keep-alive-s`,
  then stops cleanly on Ctrl-C (SIGINT)."""
  import os
  import signal
  import subprocess
  import sys
  port = free_port()
  cmd = [sys.executable, "-m", "rocketkv_jax.serving.cli", "serve", "--model", "smollm2", "--method", "rocketkv",
         "--token-budget", "64", "--port", str(port), "--max-slots", "2", "--max-prompt-tokens", "128",
         "--max-new-tokens", "8", "--keep-alive-s", "1", "--log-level", "warning"]
  log = open(tmp_path / "serve.log", "w+")
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, COLUMNS="200"))
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    t0 = time.monotonic()
    while True:  # it listens before it is ready: /health is 503 with the warm-up's progress, then 200
      try:
        status, body = http_request(port, "GET", "/health")[::2]
        if status == 200:
          break
        assert status == 503 and json.loads(body)["status"] == "warming up", (status, body)
      except OSError:
        pass
      assert proc.poll() is None, open(tmp_path / "serve.log").read()
      assert time.monotonic() - t0 < 400, "the server did not come up"
      time.sleep(0.2)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 4
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
      health_on(sock)
      assert closed_by_server(sock, 4.0), "the idle keep-alive connection stayed open"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, open(tmp_path / "serve.log").read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(10)
    log.close()


def test_sampling_defaults_come_from_the_generation_config():
  """A field the request leaves out takes the checkpoint's generation default, else OpenAI's; given ones win."""
  from rocketkv_jax.serving.protocol import CompletionRequest
  from rocketkv_jax.serving.server import request_sampling
  gen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
  body = lambda **kw: CompletionRequest(model=MODEL, prompt="a", **kw)  # noqa: E731
  s = request_sampling(body(), default_max_tokens=8, stop_ids=(1,), defaults=gen)
  assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.8, 20)
  s = request_sampling(body(temperature=0, top_k=-1), default_max_tokens=8, stop_ids=(1,), defaults=gen)
  assert (s.temperature, s.top_p, s.top_k) == (0, 0.8, 0)
  s = request_sampling(body(), default_max_tokens=8, stop_ids=(1,), defaults=None)
  assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)


def test_health_while_warming_and_an_early_request(smollm2_lite, caplog):
  """The server listens while it warms up (on the engine thread): /health answers 503 with the progress, then 200. A
  request sent during the warm-up waits and gets the answer the same request gets after it, and needs no program
  the warm-up did not compile; one that needs more (a larger bucket with prompt logprobs) compiles it on first use,
  with a log line saying so. The engine settings of `test_ready_means_compiled`: no new shapes."""
  model, tok = smollm2_lite
  gate = threading.Event()

  def hold(engine):  # the warm-up's first engine step waits for the test, which so sees the server warming up
    step = engine.step
    engine.step = lambda: (gate.wait(120), step())[1]

  with serving(model, tok, max_prompt_tokens=256, server_kw=dict(warmup=True), prepare=hold) as s, \
      concurrent.futures.ThreadPoolExecutor(1) as pool:
    status, body = s.http("GET", "/health")
    assert status == 503, (status, body)
    w = json.loads(body)
    assert w["status"] == "warming up" and w["warmup"]["compiled"] == [] and w["warmup"]["done"] == 0
    assert w["warmup"]["compiling"] == "prompt bucket 64" and len(w["warmup"]["remaining"]) == w["warmup"]["total"]
    assert s.http("GET", "/v1/models")[0] == 200  # every other route answers at once
    early = pool.submit(complete, s.client, PROMPTS[0], 4, False)
    time.sleep(0.3)
    assert not early.done()  # it waits for the warm-up, neither refused nor answered before
    gate.set()
    seen = s.wait_ready()
    assert early.result(timeout=300)[0]
    m = s.metrics()
    compiles = m["rocketkv_compiles_total"]
    assert m["rocketkv_tokens_generated_total"] == 4  # the early request's; the warm-up's are not counted
    assert early.result() == complete(s.client, PROMPTS[0], 4, False)
    assert s.metrics()["rocketkv_compiles_total"] == compiles, seen
    with caplog.at_level(logging.INFO, logger="rocketkv_jax.serving"):
      r = s.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2, temperature=0, echo=True,
                                      logprobs=0)
    assert r.choices[0].logprobs.token_logprobs[0] is None and r.usage.completion_tokens == 2
    assert s.metrics()["rocketkv_compiles_total"] > compiles
    lines = [rec.getMessage() for rec in caplog.records]
    assert any(x.startswith("compiling prefill bucket 128 with prompt logprobs on first use") for x in lines), lines


def test_ready_means_compiled(smollm2_lite):
  """With the full warm-up, nothing compiles on live traffic: a mixed stream (prompt lengths in every bucket, greedy,
  sampled, top-p and top-k cut, penalties, logit bias, min_tokens, logprobs, echo with logprobs (the scored
  prefill), n > 1, completions and chat, streaming or not) leaves the compile count where start-up left it, and
  /metrics starts at zero tokens (warm-up traffic is not counted)."""
  model, tok = smollm2_lite
  with serving(model, tok, max_prompt_tokens=256, server_kw=dict(warmup=True, warmup_full=True)) as s:
    s.wait_ready()
    m = s.metrics()
    compiles = m["rocketkv_compiles_total"]
    assert compiles > 0 and m["rocketkv_tokens_generated_total"] == 0
    words = "the quick brown fox jumps over a lazy dog while " * 30
    jobs = []
    for i, n_words in enumerate((1, 5, 30, 90, 150)):
      for j, extra in enumerate(({}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9},
                                 {"temperature": 0.8, "top_k": 5}, {"logprobs": 2, "echo": True},
                                 {"logprobs": 0, "echo": True, "temperature": 0.8},
                                 {"presence_penalty": 0.5, "frequency_penalty": 0.3},
                                 {"repetition_penalty": 1.3, "temperature": 0.8, "top_p": 0.9},
                                 {"logit_bias": {"17": 5.0}, "min_tokens": 3, "n": 2}, {"logprobs": 5})):
        jobs.append((" ".join(words.split()[:n_words]), dict(extra, seed=i * 10 + j), (i + j) % 2 == 0))

    def run(job):
      prompt, extra, stream = job
      r = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=stream, extra_body=extra,
                                      **({"temperature": extra["temperature"]} if "temperature" in extra else {}))
      return list(r) if stream else r

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      list(pool.map(run, jobs))
    chat(s.client, QUESTIONS[0], 4, stream=True)
    chat(s.client, QUESTIONS[1], 4, stream=False, logprobs=True, top_logprobs=3, n=2)
    m = s.metrics()
    assert m["rocketkv_compiles_total"] == compiles, (compiles, m["rocketkv_compiles_total"])
    assert m["rocketkv_tokens_generated_total"] > 0
