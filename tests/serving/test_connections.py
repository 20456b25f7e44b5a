"""Connection limits (`serving.connections`): a real uvicorn server on a free port, built as `rocketkv serve`
builds it (`uvicorn_config`), with short limits so that each test takes seconds. Silent and slow (slowloris)
clients are disconnected at the request deadline, idle connections never lock a new client out (the oldest idle
one is closed to make room), the excess over a server whose connections are all busy gets 503 at once, and a
long answer is never cut by the deadline."""

import contextlib
import json
import socket
import time
import warnings

import pytest

uvicorn = pytest.importorskip("uvicorn")

from rocketkv_jax.serving.connections import ConnectionLimits  # noqa: E402
from tests.helpers.server import MODEL, closed_by_server, health_on, limited_server  # noqa: E402

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

def raw_request(port, request: bytes, timeout=10.0) -> tuple[int, bytes]:
  """(status, whole answer) of raw bytes sent on a new connection (read until the server closes it or the
  answer's Content-Length is in)."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
    sock.sendall(request)
    data = b""
    while True:
      if b"\r\n\r\n" in data:
        head, body = data.split(b"\r\n\r\n", 1)
        length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")]
        if length and len(body) >= length[0]:
          break
      chunk = sock.recv(65536)
      if not chunk:
        break
      data += chunk
  return int(data.split(b" ", 2)[1]), data


def health(port) -> int:
  return raw_request(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0]


@pytest.fixture(scope="module")
def fast_limits(smollm2_lite):
  """A server with a 1 s request deadline, 1 s keep-alive and 20 connections at most."""
  with limited_server(*smollm2_lite, ConnectionLimits(max_connections=20, keep_alive_s=1, request_timeout_s=1.0,
                                                  max_header_bytes=8192)) as s:
    yield s


def test_limits_are_validated():
  for kw, shown in ((dict(max_connections=0), "max_connections=0"), (dict(keep_alive_s=0.5), "keep_alive_s=0.5"),
                    (dict(request_timeout_s=float("inf")), "request_timeout_s=inf"),
                    (dict(max_header_bytes=10), "max_header_bytes=10")):
    with pytest.raises(ValueError, match=shown):
      ConnectionLimits(**kw)


def test_silent_and_slowloris_clients_are_closed_at_the_request_deadline(fast_limits):
  """uvicorn alone kept a connection that sends nothing open for ever, and one that trickles its headers too."""
  port = fast_limits.port
  silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
  slow = socket.create_connection(("127.0.0.1", port))
  slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
  t0 = time.monotonic()
  closed_slow = False
  try:
    while time.monotonic() - t0 < 4:  # a header byte every 0.2 s: never done, never silent
      slow.sendall(b"X")
      time.sleep(0.2)
  except (BrokenPipeError, ConnectionResetError):
    closed_slow = True
  try:
    assert closed_slow or closed_by_server(slow, 1.0), "the slowloris connection is still open"
    assert time.monotonic() - t0 < 4.5
    assert all(closed_by_server(s, 1.0) for s in silent)
    assert health(port) == 200
  finally:
    for s in silent + [slow]:
      s.close()


def test_a_body_trickled_past_the_deadline_is_cut(fast_limits):
  """Headers whole, the body a byte at a time: the request deadline covers the body too."""
  body = json.dumps(dict(model=MODEL, prompt="hi", max_tokens=1)).encode()
  with socket.create_connection(("127.0.0.1", fast_limits.port), timeout=10) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    t0 = time.monotonic()
    cut = False
    try:
      for b in body[:-1]:
        sock.sendall(bytes([b]))
        time.sleep(0.2)
        if time.monotonic() - t0 > 4:
          break
    except (BrokenPipeError, ConnectionResetError):
      cut = True
    assert cut or closed_by_server(sock, 1.0)
    assert time.monotonic() - t0 < 4.5
  assert health(fast_limits.port) == 200


def test_idle_keep_alive_connections_close_after_keep_alive_s(fast_limits):
  with socket.create_connection(("127.0.0.1", fast_limits.port), timeout=10) as sock:
    health_on(sock)
    t0 = time.monotonic()
    assert closed_by_server(sock, 3.0)
    assert 0.5 < time.monotonic() - t0 < 2.5


def test_headers_past_the_limit_get_400(fast_limits):
  """h11 buffers at most max_header_bytes of a request's unfinished line and headers (those arriving in one read
  are parsed whole: the read size bounds them)."""
  with socket.create_connection(("127.0.0.1", fast_limits.port), timeout=10) as sock:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
    answer = b""
    try:
      for _ in range(100):  # 1 MB of one header, in 10 kB pieces
        sock.sendall(b"a" * 10_000)
        time.sleep(0.001)
    except (BrokenPipeError, ConnectionResetError):
      pass
    with contextlib.suppress(ConnectionResetError):
      answer = sock.recv(65536)
  assert answer.startswith(b"HTTP/1.1 400"), answer[:100]


def test_idle_connections_never_lock_a_new_client_out(smollm2_lite):
  """40 silent connections against a cap of 20 (and a deadline long past the test): the oldest idle ones are
  closed to make room, so a normal request is answered at once. uvicorn's limit_concurrency alone answered
  every new request 503 until the idle ones went away."""
  limits = ConnectionLimits(max_connections=20, request_timeout_s=600.0)
  with limited_server(*smollm2_lite, limits) as s:
    idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(40)]
    try:
      time.sleep(0.5)
      assert s.open_connections() <= 20
      t0 = time.monotonic()
      assert health(s.port) == 200
      assert time.monotonic() - t0 < 2
      closed = sum(closed_by_server(c, 0.05) for c in idle)
      assert 20 <= closed <= 21, closed  # the oldest ones (and one more for the health request)
      assert not any(closed_by_server(c, 0.01) for c in idle[-15:])  # the newest are still open
    finally:
      for c in idle:
        c.close()


def test_the_excess_over_busy_connections_gets_503_at_once(smollm2_lite):
  """Every open connection has a request in flight (its body still coming): a new one is refused with 503 at
  once, not left hanging, and none of the busy ones is closed to make room."""
  limits = ConnectionLimits(max_connections=3, request_timeout_s=600.0)
  with limited_server(*smollm2_lite, limits) as s:
    body = json.dumps(dict(model=MODEL, prompt="hi", max_tokens=1)).encode()
    busy = []
    try:
      for _ in range(3):
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:3])
        busy.append(c)
      time.sleep(0.5)
      t0 = time.monotonic()
      status, answer = raw_request(s.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
      assert status == 503 and b"connection limit" in answer and time.monotonic() - t0 < 2
      for c in busy:  # the busy requests finish normally
        c.sendall(body[3:])
        assert c.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
      for c in busy:
        c.close()
    assert health(s.port) == 200


def test_a_long_answer_is_not_cut_by_the_request_deadline(smollm2_lite):
  """The deadline is on receiving the request: a stream that runs for seconds past it finishes whole."""
  limits = ConnectionLimits(max_connections=20, request_timeout_s=0.5)
  with limited_server(*smollm2_lite, limits) as s:
    body = json.dumps(dict(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0, stream=True)).encode()
    t0 = time.monotonic()
    status, answer = raw_request(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                                 % len(body) + body, timeout=300)
    assert time.monotonic() - t0 > 1.0  # (the first request compiles: seconds)
    assert status == 200 and b"data: [DONE]" in answer and answer.endswith(b"\r\n0\r\n\r\n"), answer[-300:]
    assert answer.count(b'"text_completion"') >= 10  # tokens streamed the while
