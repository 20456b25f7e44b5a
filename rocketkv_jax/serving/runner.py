"""The engine's one thread: owns the `Engine` (the scheduler, `scheduler.py`, and through it the device engine),
loops `engine.step()` while there is work, and hands each request's events to its consumer (an asyncio queue of
the server, through `loop.call_soon_threadsafe`).

The concurrency model of serving, in one place: the scheduler is not thread-safe by design (no lock), so this
thread is the only one that touches it; submit, abort and shutdown travel to it through a command queue, and
`stats()` reads a snapshot the thread refreshes after every command and step. Periodic work that reads the
engine's state (saving sessions) runs on this thread too, between steps (`every`). The HTTP layer's event loop
only parses, encodes, submits and awaits events. The server's warm-up runs on this thread too, first
(`warm_up_first`): the thread takes no command until it is done, so requests submitted meanwhile wait in order
(none is refused), while the HTTP layer already answers /health. The one exception is start-up and shutdown:
session loading runs before this thread starts, and the last session save after it has stopped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("rocketkv_jax.serving")

# What a consumer receives: the engine's TokenEvent, or one of these when the request ends without one.
Sink = Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class Aborted:
  """The request was aborted by the server (shutdown), not by its client; no more events follow."""

  request_id: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Failed:
  """engine.step() raised; the request cannot go on. No more events follow."""

  request_id: str
  error: BaseException


class ShuttingDown(RuntimeError):
  """The runner no longer accepts requests (draining or stopped)."""


# How long the idle thread sleeps on the command queue before it looks again (a command wakes it at once).
_IDLE_WAIT_S = 0.5
# Window of the tokens/s gauge.
_RATE_WINDOW_S = 10.0


class EngineRunner:
  """Runs `engine` on a daemon thread. `submit` / `abort` are safe from any thread (the server's event loop);
  consumers are called on the engine thread and must only hand the event on (`call_soon_threadsafe`)."""

  def __init__(self, engine):
    self.engine = engine
    self._cmds: queue.Queue = queue.Queue()
    self._sinks: dict[str, Sink] = {}         # engine thread only
    self._stats: dict = {}
    self._stats_lock = threading.Lock()
    self._accepting = True
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None  # the last step failure
    self._rate = collections.deque()          # (time, tokens_generated), engine thread only
    self._periodic: list = []                 # [every_s, fn, next due (monotonic)]
    self._warmup = None                       # fn(stopping) run first on the engine thread
    self._warming = False
    self._stopping = threading.Event()        # shutdown asked: a warm-up stops early

  # --- any thread -------------------------------------------------------------------------------

  def every(self, seconds: float, fn: Callable[[], object]) -> "EngineRunner":
    """Calls fn() on the engine thread between steps, every `seconds` (0: never), first `seconds` after start.
    Register before start(). fn's exceptions are logged; the thread goes on."""
    if seconds > 0:
      self._periodic.append([float(seconds), fn, None])
    return self

  def warm_up_first(self, fn: Callable[[Callable[[], bool]], object]) -> "EngineRunner":
    """Calls fn(stopping) on the engine thread when it starts, before it takes any command: commands sent meanwhile
    (submits, aborts) wait in order and run after it. stopping() turns true once shutdown is asked: fn should
    then return soon. `warming` is true until fn returns; an exception it raises is logged and the thread goes on.
    Register before start()."""
    self._warmup, self._warming = fn, True
    return self

  def start(self) -> "EngineRunner":
    if self._thread is None:
      self._refresh_stats()
      self._thread = threading.Thread(target=self._run, name="rocketkv-engine", daemon=True)
      self._thread.start()
    return self

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  @property
  def accepting(self) -> bool:
    return self._accepting and self.alive

  @property
  def warming(self) -> bool:
    """True while the warm-up (`warm_up_first`) has not returned: submitted requests wait for it."""
    return self._warming

  def submit(self, request, sink: Sink) -> concurrent.futures.Future:
    """Validates and submits on the engine thread. The future resolves to None once the engine holds the
    request, or to the engine's ValueError / QueueFull, or ShuttingDown."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if not self.accepting:
      fut.set_exception(ShuttingDown("the server is shutting down"))
    else:
      self._cmds.put(("submit", request, sink, fut))
    return fut

  def abort(self, request_id: str) -> None:
    """Frees the request's slot (or queue place) on the engine thread's next turn; no more events for it."""
    self._cmds.put(("abort", request_id))

  def in_flight(self) -> int:
    with self._stats_lock:
      return self._stats.get("in_flight", 0)

  def stats(self) -> dict:
    """The engine's stats as of the thread's last turn, plus `in_flight`, `tokens_per_s` and `alive`."""
    with self._stats_lock:
      return dict(self._stats, alive=self.alive)

  def stop_accepting(self) -> None:
    self._accepting = False

  def shutdown(self, reason: str = "server shutdown", timeout: float = 30.0) -> None:
    """Stops accepting, aborts every request still in flight (each consumer gets `Aborted`) and ends the
    thread. Idempotent."""
    self._accepting = False
    self._stopping.set()
    if self._thread is None:
      return
    self._cmds.put(("stop", reason))
    self._thread.join(timeout)

  # --- engine thread ----------------------------------------------------------------------------

  def _run(self) -> None:
    if self._warmup is not None:
      try:
        self._warmup(self._stopping.is_set)
      except Exception:  # noqa: BLE001 - what it did not compile compiles on first use
        log.exception("the warm-up failed; serving without it")
      finally:
        self._warming = False
      self._refresh_stats()
    stop_reason = None
    while stop_reason is None:
      busy = self._has_work()
      try:
        cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=_IDLE_WAIT_S)
      except queue.Empty:
        cmd = None
      while cmd is not None:
        stop_reason = self._handle(cmd) or stop_reason
        try:
          cmd = self._cmds.get_nowait()
        except queue.Empty:
          cmd = None
      if stop_reason is None and self._has_work():
        self._step()
      self._run_periodic()
      self._refresh_stats()
    self._abort_all(stop_reason)
    self._refresh_stats()

  def _run_periodic(self) -> None:
    now = time.monotonic()
    for p in self._periodic:
      if p[2] is None:
        p[2] = now + p[0]
      elif now >= p[2]:
        try:
          p[1]()
        except Exception:  # noqa: BLE001
          log.exception("periodic engine-thread task failed")
        p[2] = time.monotonic() + p[0]

  def _has_work(self) -> bool:
    try:
      return bool(self.engine.has_work())
    except Exception:  # noqa: BLE001 - a broken engine has no work we can do
      log.exception("engine.has_work() failed")
      return False

  def _handle(self, cmd) -> str | None:
    kind = cmd[0]
    if kind == "submit":
      _, request, sink, fut = cmd
      if not fut.set_running_or_notify_cancel():
        return None
      try:
        self.engine.submit(request)  # validates (the one check against the engine's limits)
      except BaseException as e:  # noqa: BLE001 - ValueError / QueueFull go back to the caller
        fut.set_exception(e)
        return None
      self._sinks[request.request_id] = sink
      fut.set_result(None)
    elif kind == "abort":
      rid = cmd[1]
      self._sinks.pop(rid, None)
      try:
        self.engine.abort(rid)
      except Exception:  # noqa: BLE001 - an unknown or finished id is not an error here
        log.debug("engine.abort(%s) failed", rid, exc_info=True)
    elif kind == "stop":
      return cmd[1]
    return None

  def _step(self) -> None:
    try:
      events = self.engine.step()
    except Exception as e:  # noqa: BLE001 - every request in flight learns of it, the thread goes on
      log.exception("engine.step() failed; failing the requests in flight")
      self._error = e
      for rid, sink in list(self._sinks.items()):
        self._deliver(sink, Failed(rid, e))
        try:
          self.engine.abort(rid)
        except Exception:  # noqa: BLE001
          pass
      self._sinks.clear()
      return
    out = []
    for ev in events:
      sink = self._sinks.get(ev.request_id)
      if ev.finished:
        self._sinks.pop(ev.request_id, None)
      if sink is not None:
        # a request that failed alone (finish_reason "error") reaches its client as a failure; the rest go on
        out.append((sink, Failed(ev.request_id, RuntimeError(ev.error)) if ev.finish_reason == "error" else ev))
    # the snapshot before the events: a client that reads /metrics on its answer sees the step that made it
    self._refresh_stats()
    for sink, item in out:
      self._deliver(sink, item)

  def _abort_all(self, reason: str) -> None:
    for rid, sink in list(self._sinks.items()):
      try:
        self.engine.abort(rid)
      except Exception:  # noqa: BLE001
        pass
      self._deliver(sink, Aborted(rid, reason))
    self._sinks.clear()
    # Submissions that raced the stop: refuse them.
    while True:
      try:
        cmd = self._cmds.get_nowait()
      except queue.Empty:
        break
      if cmd[0] == "submit" and cmd[3].set_running_or_notify_cancel():
        cmd[3].set_exception(ShuttingDown("the server is shutting down"))

  @staticmethod
  def _deliver(sink: Sink, item) -> None:
    try:
      sink(item)
    except Exception:  # noqa: BLE001 - a consumer whose loop is gone
      log.debug("dropping an event for a gone consumer", exc_info=True)

  def _refresh_stats(self) -> None:
    try:
      s = dict(self.engine.stats())
    except Exception:  # noqa: BLE001
      s = {}
    now = time.monotonic()
    gen = s.get("tokens_generated")
    if gen is not None:
      self._rate.append((now, gen))
      while len(self._rate) > 2 and now - self._rate[0][0] > _RATE_WINDOW_S:
        self._rate.popleft()
      t0, g0 = self._rate[0]
      s["tokens_per_s"] = (gen - g0) / (now - t0) if now > t0 else 0.0
    s["in_flight"] = len(self._sinks)
    with self._stats_lock:
      self._stats = s
