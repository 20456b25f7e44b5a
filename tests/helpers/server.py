"""Running-server helpers: a real uvicorn server on 127.0.0.1 (a free port) around an engine, as the
OpenAI-compatible server tests (`Served`, `serving`) and the connection-limit tests (`limited_server`) start it,
the prompts they send, and requests made as a user makes them (`complete`, `chat`, raw `http_request`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # uvicorn (which connections imports) is needed only once a server starts
  from rocketkv_jax.serving.connections import ConnectionLimits

MODEL = "smollm2"
# Prompts of mixed lengths (a few to ~90 tokens), some past the token budget so compression is engaged.
STORY = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
         "once or twice she had peeped into the book her sister was reading, but it had no pictures or "
         "conversations in it, and what is the use of a book, thought Alice, without pictures or conversations? ")
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", STORY + "The book had no", "Once upon a time",
           STORY * 2 + "Alice thought", "The colour of the sky is", "def add(a, b):\n    return",
           "Water boils at a temperature of"]
QUESTIONS = ["What is 2 + 2?", "Name a fruit.", STORY + "\nWhat was Alice tired of?", "Say hello."]


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Served:
  """A running server: its URL, engine and runner, an `openai` client, and raw HTTP for malformed input. It is
  running once the socket is bound (a warm-up may still run: /health says when it is done). prepare(engine): called
  before the server starts (a test's hook into the engine)."""

  def __init__(self, model, tok, *, limits: ConnectionLimits | None = None, drain_s=5.0, server_kw=None,
               prepare=None, **engine_kw):
    import openai

    from rocketkv_jax.serving import Engine, EngineConfig
    from rocketkv_jax.serving.connections import uvicorn_config
    from rocketkv_jax.serving.server import ServerConfig, UvicornServer, create_app
    self.engine = Engine(model, tok, EngineConfig(**engine_kw))
    if prepare is not None:
      prepare(self.engine)
    self.api_key = (server_kw or {}).get("api_key")
    self.app = create_app(self.engine, model, tok, ServerConfig(model_name=MODEL, drain_s=drain_s, **(server_kw or {})))
    self.runner = self.app.state.runner
    self.port = free_port()
    # As `rocketkv serve` builds it: the connection limits (keep-alive, request deadline, connection cap), the
    # product's defaults unless `limits`.
    config = uvicorn_config(self.app, host="127.0.0.1", port=self.port, limits=limits, log_level="warning",
                            timeout_graceful_shutdown=drain_s + 5)
    self.server = UvicornServer(config, self.runner, drain_s=drain_s)
    self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
    self.thread.start()
    t0 = time.monotonic()
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() - t0 > 600:
        raise RuntimeError("the server did not start")
      time.sleep(0.02)
    self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.api_key or "none",
                                max_retries=0, timeout=300)

  def stop(self, timeout=120.0) -> None:
    self.server.should_exit = True
    self.thread.join(timeout)
    assert not self.thread.is_alive(), "the server did not stop"

  def open_connections(self) -> int:
    return len(self.server.server_state.connections)

  def headers(self, **extra) -> dict:
    """A JSON request's headers (with the API key when the server has one), plus `extra`."""
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
    return h | {k.replace("_", "-"): v for k, v in extra.items()}

  def http(self, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
    try:
      conn.request(method, path, body=body, headers=self.headers() if headers is None else headers)
      r = conn.getresponse()
      data = r.read().decode()
      return r.status, data
    finally:
      conn.close()

  def metrics(self) -> dict:
    status, text = self.http("GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
      if line and not line.startswith("#"):
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out

  def wait_ready(self, timeout=600.0) -> dict:
    """Polls /health until it answers 200 (the warm-up is done); returns the last 503's warm-up progress seen."""
    t0, seen = time.monotonic(), {}
    while True:
      status, body = self.http("GET", "/health")
      if status == 200:
        return seen
      assert status == 503 and json.loads(body)["status"] == "warming up", (status, body)
      seen = json.loads(body)["warmup"]
      if time.monotonic() - t0 > timeout:
        raise AssertionError(f"not ready after {timeout}s: {body}")
      time.sleep(0.05)

  def wait_metric(self, name, pred, timeout=30.0):
    t0 = time.monotonic()
    while True:
      v = self.metrics().get(name)
      if v is not None and pred(v):
        return v
      if time.monotonic() - t0 > timeout:
        raise AssertionError(f"{name}={v} after {timeout}s")
      time.sleep(0.05)


# The SmolLM2 server the tests talk to (test_lm_eval.py starts one with longer answers); the engine's default
# steps_per_call (1: a stream's chunks carry one token each), as `rocketkv serve` runs it.
SERVED = dict(method="rocketkv", token_budget=64, max_slots=4, max_prompt_tokens=512, max_new_tokens=16,
              max_queue=64)


@contextlib.contextmanager
def serving(model, tok, **overrides):
  """A running `Served` with SERVED's engine settings (and `overrides`), always stopped."""
  s = Served(model, tok, **dict(SERVED, **overrides))
  try:
    yield s
  finally:
    s.stop()


# Connection limits (`serving.connections`): the engine settings of a `limited_server`.
LIMITED_ENGINE = dict(method="rocketkv", token_budget=64, max_slots=4, max_prompt_tokens=512, max_new_tokens=64,
                      steps_per_call=4, max_queue=512)


@contextlib.contextmanager
def limited_server(model, tok, limits, **kw):
  """A running `Served` with connection limits `limits` and LIMITED_ENGINE's settings (and `kw`), always
  stopped."""
  with serving(model, tok, limits=limits, **dict(LIMITED_ENGINE, **kw)) as s:
    yield s


# --- requests as a user makes them -----------------------------------------------------------------------------


def complete(client, prompt, max_tokens, stream, **kw):
  """(text, finish_reason, usage) of a greedy completion, streamed or not."""
  if not stream:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage
  text, finish, usage = "", None, None
  for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, **kw):
    if chunk.choices:
      text += chunk.choices[0].text
      finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
      usage = chunk.usage
  return text, finish, usage


def chat(client, question, max_tokens, stream, **kw):
  """(text, finish_reason, usage) of a greedy one-turn chat, streamed or not; the only role sent is assistant."""
  msgs = [{"role": "user", "content": question}]
  if not stream:
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0, **kw)
    assert r.choices[0].message.role == "assistant"
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
  text, finish, usage, roles = "", None, None, []
  for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0,
                                              stream=True, stream_options={"include_usage": True}, **kw):
    if chunk.choices:
      d = chunk.choices[0].delta
      roles += [d.role] if d.role else []
      text += d.content or ""
      finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
      usage = chunk.usage
  assert roles == ["assistant"]
  return text, finish, usage


def error_of(status, body) -> tuple[int, dict]:
  """(status, the OpenAI error object) of an error answer, checked to have its four fields and a message."""
  err = json.loads(body)["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"], err
  return status, err


def health_on(sock) -> bytes:
  """GET /health on an open (keep-alive) socket: the whole answer, checked to be 200 and to leave the connection
  open (the server closing it first fails with what had arrived)."""
  sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
  answer = b""
  while not answer.endswith(b"}"):
    chunk = sock.recv(65536)
    assert chunk, f"the server closed the connection after {answer!r}"
    answer += chunk
  assert answer.startswith(b"HTTP/1.1 200"), answer
  return answer


def closed_by_server(sock, wait: float) -> bool:
  """Whether the server closed `sock` within `wait` seconds (recv gives b"" or a reset)."""
  sock.settimeout(wait)
  try:
    return sock.recv(1024) == b""
  except socket.timeout:
    return False
  except ConnectionResetError:
    return True


def http_request(port, method, path, body=None, headers=None):
  """(status, headers, body) through http.client, which sends the Host header we give, if any."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  try:
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
  finally:
    conn.close()
