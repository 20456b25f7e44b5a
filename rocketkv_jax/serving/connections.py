"""Connection limits of `rocketkv serve`: idle, slow and too many connections cannot exhaust the server.

uvicorn on its own (0.54) keeps a connection that sends nothing open for ever: its keep-alive timer starts only
after a first response, the first byte of a request cancels it, and nothing bounds how long a request's headers
or body may take (a slowloris client sends a header byte every few seconds). Its `limit_concurrency` answers
503 to a request once that many connections are open, so 20,000 idle connections locked every new client out
until they closed (issue 39). `ConnectionLimits` and `GuardedH11Protocol` (the h11 protocol with two additions)
bound all of it:

- request_timeout_s: a request's headers and body must all arrive within this many seconds of the connection
  opening (or of the previous response's end on a keep-alive connection); else the connection is closed. This is
  the limit on slow headers (slowloris) and slow bodies. A request whose body has arrived is never cut: its
  answer (a running stream included) takes as long as it takes.
- keep_alive_s: an idle keep-alive connection is closed this long after its last response (uvicorn's
  `timeout_keep_alive`). It must outlast the idle time of the clients' pools (httpx, under the `openai` client:
  5 s; aiohttp: 15 s; a load balancer's often 60 s). At equal limits a client checks that its pooled connection
  is fresh, then sends on it: on a loaded machine the send can come after the server's timer closed the
  connection, and the request fails with "Server disconnected without sending a response" (seen in CI, the
  concurrent-requests server test, at 5 s against httpx's 5 s). The default, 75 s (nginx's), leaves every common
  client a wide margin; idle connections never lock a new client out (max_connections).
- max_connections: at most this many open connections. One past it closes the oldest connection that is waiting
  for a request (idle, or still sending its headers); when every open connection has a request in flight, the
  new one is answered 503 at once and closed. Idle connections therefore never lock a new client out, and
  running requests are never cut to make room.
- max_header_bytes: a request's line and headers at most this many bytes (h11's `max_incomplete_event_size`);
  past it the request gets 400.

`uvicorn_config` builds the uvicorn.Config with them (`rocketkv serve` and the tests use it).
"""
from __future__ import annotations

import dataclasses
import itertools

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 1024
KEEP_ALIVE_S = 75
REQUEST_TIMEOUT_S = 30.0
MAX_HEADER_BYTES = 32 * 1024
# The order connections were opened in (the event loop's time is cached per turn under uvloop: many connections
# accepted in one turn would tie).
_OPENED = itertools.count()


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
  """The limits of the module doc."""

  max_connections: int = MAX_CONNECTIONS
  keep_alive_s: int = KEEP_ALIVE_S
  request_timeout_s: float = REQUEST_TIMEOUT_S
  max_header_bytes: int = MAX_HEADER_BYTES

  def __post_init__(self):
    if not isinstance(self.max_connections, int) or isinstance(self.max_connections, bool) or \
        self.max_connections < 1:
      raise ValueError(f"max_connections={self.max_connections!r} must be an int >= 1")
    if not isinstance(self.keep_alive_s, int) or isinstance(self.keep_alive_s, bool) or self.keep_alive_s < 1:
      raise ValueError(f"keep_alive_s={self.keep_alive_s!r} must be an int >= 1 (seconds)")
    if not isinstance(self.request_timeout_s, (int, float)) or isinstance(self.request_timeout_s, bool) or \
        not 0 < self.request_timeout_s < float("inf"):
      raise ValueError(f"request_timeout_s={self.request_timeout_s!r} must be a number of seconds > 0")
    if not isinstance(self.max_header_bytes, int) or isinstance(self.max_header_bytes, bool) or \
        self.max_header_bytes < 1024:
      raise ValueError(f"max_header_bytes={self.max_header_bytes!r} must be an int >= 1024")


class GuardedH11Protocol(H11Protocol):
  """uvicorn's h11 protocol with the request deadline and the connection cap of the module doc. uvicorn builds
  one per connection; the limits come from the subclass `protocol_class` makes."""

  limits: ConnectionLimits = ConnectionLimits()
  request_deadline = None  # the armed deadline's timer handle (None: none; before connection_made too)

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self.opened = next(_OPENED)
    self.request_deadline = None
    self._arm_request_deadline()
    if len(self.connections) > self.limits.max_connections:
      self._make_room()

  def connection_lost(self, exc) -> None:
    self._disarm_request_deadline()
    super().connection_lost(exc)

  def on_response_complete(self) -> None:
    super().on_response_complete()
    if not self.transport.is_closing():  # a keep-alive connection: the next request has the same deadline
      self._arm_request_deadline()

  def waiting_for_request(self) -> bool:
    """No request in flight: idle, or the client is still sending a request's line and headers."""
    return (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is h11.IDLE

  def _arm_request_deadline(self) -> None:
    self._disarm_request_deadline()
    self.request_deadline = self.loop.call_later(self.limits.request_timeout_s, self._request_timed_out)

  def _disarm_request_deadline(self) -> None:
    if self.request_deadline is not None:
      self.request_deadline.cancel()
      self.request_deadline = None

  def _request_timed_out(self) -> None:
    """Closes the connection unless its request has arrived whole (then the answer runs to its end)."""
    self.request_deadline = None
    if self.transport.is_closing():
      return
    if self.waiting_for_request() or self.conn.their_state is h11.SEND_BODY:
      self.logger.info("%s: request not received within %ss: connection closed", self._peer(),
                       self.limits.request_timeout_s)
      self.transport.close()

  def _make_room(self) -> None:
    """One connection past max_connections: close the oldest one waiting for a request, else refuse this one."""
    idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and
            not c.transport.is_closing() and c.waiting_for_request()]
    if idle:
      oldest = min(idle, key=lambda c: c.opened)
      self.logger.info("%d connections open (max %d): closed the oldest idle one, %s", len(self.connections),
                       self.limits.max_connections, oldest._peer())
      oldest.transport.close()
      # Counted out now: its connection_lost (which does the same) may come after this connection's first
      # request, whose uvicorn limit_concurrency check would count it still.
      self.connections.discard(oldest)
      return
    self.logger.warning("%d connections open (max %d), every one with a request in flight: refused %s with 503",
                        len(self.connections), self.limits.max_connections, self._peer())
    body = b"Too many connections: the server is at its connection limit; retry shortly.\n"
    self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                         b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    self.transport.close()

  def _peer(self) -> str:
    return "%s:%d" % self.client if self.client else "a client"


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
  """The protocol class uvicorn instantiates per connection, carrying `limits`."""
  return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app, *, host: str, port: int, limits: ConnectionLimits | None = None, **kw) -> uvicorn.Config:
  """uvicorn.Config for `app` with the connection limits (`kw`: any other uvicorn.Config argument). uvicorn's own
  `limit_concurrency` (503 once that many connections or requests are open, counting the one asking) is kept one
  above max_connections as a backstop: the cap itself is `GuardedH11Protocol`'s, which closes idle connections
  first."""
  limits = limits or ConnectionLimits()
  return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits),
                        limit_concurrency=limits.max_connections + 1, timeout_keep_alive=limits.keep_alive_s,
                        h11_max_incomplete_event_size=limits.max_header_bytes, **kw)
