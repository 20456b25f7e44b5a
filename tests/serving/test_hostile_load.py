"""The server under load with a hostile client beside it (issue 39's judging test): a real server as `rocketkv
serve` builds it (embedded SmolLM2, connection limits), 200 concurrent well-formed requests (completions and
chat, greedy, varied prompts, a third streamed), and at the same time one client sending a body over the limit,
out-of-range values (top_k=10**12, temperature=-1, a raw JSON NaN), malformed and 100,000-deep JSON, silent
connections, and streams it drops mid-answer. Every well-formed request must get 200 and exactly the text it
gets alone; every hostile one a 4xx (or, for the drops, only its own connection closed); /health ok at the end."""

import concurrent.futures
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")

from rocketkv_jax.serving.connections import ConnectionLimits  # noqa: E402
from tests.helpers.server import MODEL, limited_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xla_opt]

CONCURRENT = 200
MAX_TOKENS = 4
BODY_LIMIT = 256 * 1024
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def add(a, b):\n    return",
           "Water boils at a temperature of", "The quick brown fox", "In the beginning",
           "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
           "do: once or twice she had peeped into the book her sister was reading, but it had no pictures. She"]
QUESTIONS = ["What is 2 + 2?", "Name a fruit.", "Say hello.", "What is the capital of Italy?"]
HOSTILE_ROUNDS = 2


def post(port, path, body: bytes, headers=None, timeout=300.0) -> tuple[int, bytes]:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
  try:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, r.read()
  finally:
    conn.close()


def ask(port, job) -> tuple[int, str]:
  """(status, text) of one greedy request: job = (chat, prompt, stream)."""
  chat, prompt, stream = job
  body = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
  if chat:
    body["messages"] = [{"role": "user", "content": prompt}]
  else:
    body["prompt"] = prompt
  status, data = post(port, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
  if status != 200:
    return status, data.decode(errors="replace")
  if not stream:
    choice = json.loads(data)["choices"][0]
    return status, choice["message"]["content"] if chat else choice["text"]
  text, done = "", False
  for line in data.decode().splitlines():
    if not line.startswith("data: "):
      continue
    if line == "data: [DONE]":
      done = True
      continue
    for choice in json.loads(line[6:]).get("choices", []):
      text += (choice["delta"].get("content") or "") if chat else choice["text"]
  assert done, data[-200:]
  return status, text


def drop_mid_stream(port) -> str:
  """Starts a streamed completion, reads its first bytes, and closes the connection: what the server did."""
  body = json.dumps(dict(model=MODEL, prompt="Tell me a long story about", max_tokens=MAX_TOKENS, temperature=0,
                         stream=True)).encode()
  with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    first = sock.recv(4096)
  return "dropped" if first.startswith(b"HTTP/1.1 200") else f"unexpected: {first[:80]!r}"


def raw_status(port, request: bytes, *, send_after: bytes = b"", timeout=60.0) -> int | str:
  """The status the server answers to raw bytes (`send_after`: more sent after, ignoring a closed socket)."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
    sock.sendall(request)
    try:
      sock.sendall(send_after)
    except (BrokenPipeError, ConnectionResetError):
      pass
    try:
      head = sock.recv(4096)
    except ConnectionResetError:
      return "reset"
  return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else f"no answer: {head[:60]!r}"


def hostile(port) -> list[tuple[str, object]]:
  """One client doing everything wrong, each case in turn, HOSTILE_ROUNDS times (while the load runs)."""
  ok = dict(model=MODEL, prompt="hello", max_tokens=2)
  completions = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
  deep = b"[" * 100_000 + b"]" * 100_000
  huge = json.dumps(dict(ok, prompt="x " * BODY_LIMIT)).encode()
  cases = [
      ("huge body", lambda: post(port, "/v1/completions", huge)[0]),
      ("huge declared body", lambda: raw_status(port, completions + b"Content-Length: %d\r\n\r\n{" % (50 * 2**20))),
      ("top_k=10**12", lambda: post(port, "/v1/completions", json.dumps(dict(ok, top_k=10**12, temperature=1))
                                    .encode())[0]),
      ("temperature=-1", lambda: post(port, "/v1/completions", json.dumps(dict(ok, temperature=-1)).encode())[0]),
      ("raw NaN", lambda: post(port, "/v1/completions",
                               b'{"model": "smollm2", "prompt": "hi", "max_tokens": 2, "temperature": NaN}')[0]),
      ("top_p=NaN chat", lambda: post(port, "/v1/chat/completions",
                                      b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
                                      b'"top_p": NaN}')[0]),
      ("max_tokens=10**30", lambda: post(port, "/v1/completions", json.dumps(dict(ok, max_tokens=10**30))
                                         .encode())[0]),
      ("malformed JSON", lambda: post(port, "/v1/completions", b'{"model": "smollm2", "prompt": ')[0]),
      ("not an object", lambda: post(port, "/v1/chat/completions", b'["a"]')[0]),
      ("deep nesting", lambda: post(port, "/v1/completions", b'{"model": "smollm2", "prompt": ' + deep + b"}")[0]),
      ("deep nesting bare", lambda: post(port, "/v1/chat/completions", deep)[0]),
      ("bad UTF-8", lambda: post(port, "/v1/completions", b'{"model": "smollm2", "prompt": "\xff\xfe"}')[0]),
      ("text/plain", lambda: post(port, "/v1/completions", json.dumps(ok).encode(), {"Content-Type": "text/plain"})[0]),
      ("drop mid-stream", lambda: drop_mid_stream(port)),
      ("silent connection", lambda: raw_status(port, b"", timeout=10.0)),
  ]
  return [(name, case()) for _ in range(HOSTILE_ROUNDS) for name, case in cases]


@pytest.fixture(scope="module")
def server(smollm2_lite):
  limits = ConnectionLimits(max_connections=512, request_timeout_s=3.0)
  with limited_server(*smollm2_lite, limits, server_kw=dict(max_body_bytes=BODY_LIMIT), max_slots=16, max_queue=1024,
                      max_new_tokens=16, prefill_buckets=(16, 64)) as s:
    yield s


def test_200_concurrent_requests_beside_a_hostile_client_answer_as_alone(server):
  port = server.port
  kinds = [(False, p) for p in PROMPTS] + [(True, q) for q in QUESTIONS]
  # Alone, one at a time: the texts every concurrent request must reproduce (streamed or not).
  t0 = time.monotonic()
  alone = {}
  for chat, prompt in kinds:
    status, alone[(chat, prompt)] = ask(port, (chat, prompt, False))
    assert status == 200, alone[(chat, prompt)]
  alone_s = time.monotonic() - t0
  jobs = [(*kinds[i % len(kinds)], i % 3 == 0) for i in range(CONCURRENT)]
  t0 = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(CONCURRENT + 1) as pool:
    futures = [pool.submit(ask, port, job) for job in jobs]
    bad = pool.submit(hostile, port)
    results = [f.result(timeout=600) for f in futures]
    hostile_results = bad.result(timeout=600)
  elapsed = time.monotonic() - t0
  wrong = [(job, got) for job, got in zip(jobs, results) if got != (200, alone[job[:2]])]
  assert not wrong, (len(wrong), wrong[:5])
  names = {name for name, _ in hostile_results}
  assert len(names) == 15, names
  for name, status in hostile_results:
    if name == "drop mid-stream":
      assert status == "dropped", (name, status)
    elif name == "silent connection":  # closed by the server at the request deadline (3 s): no answer at all
      assert status == "no answer: b''" or status == "reset", (name, status)
    else:
      assert isinstance(status, int) and 400 <= status < 500, (name, status)
  # the server is whole: /health, an answer as alone, and no slot left busy
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  conn.request("GET", "/health")
  assert conn.getresponse().status == 200
  conn.close()
  assert ask(port, (False, PROMPTS[0], True)) == (200, alone[(False, PROMPTS[0])])
  deadline = time.monotonic() + 30
  while server.app.state.runner.in_flight() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not server.app.state.runner.in_flight()
  print(f"alone: {len(kinds)} requests in {alone_s:.1f} s; {CONCURRENT} requests beside {len(hostile_results)} "
        f"hostile ones in {elapsed:.1f} s")
