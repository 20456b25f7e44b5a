"""The continuous-batching engine: a fixed number of slots, static-shape caches, one decode loop.

The JetStream shape: `prefill(request)` runs one request's prompt through the model and the method's stage 1
(its compressed cache, batch 1), `insert(prefilled, slot)` writes that cache into slot i of the engine's
batched caches while the other slots keep their state, and `generate()` advances every slot by
`steps_per_call` tokens with ONE call of the one decode loop (`rocketkv_jax.models.loop.decode_loop_jit`, per-row
sampling as arrays, the last token fed and its logits carried to the next call). `step()` = admit queued
requests into free slots (prefill + insert each), then `generate()`; finished slots are freed at once.

What the plan depends on: ONE method config for the whole engine, made once at start-up by
`make_config(method, token_budget, prompt_len=max_prompt_tokens, max_new_tokens=max_new_tokens,
head_dim, max_len=the model's max_len, **method_overrides)`. It never depends on the requests, so every slot
has the same static shapes (one decode compile) and a request's tokens never depend on the other requests:
the core gives each row of a batch what it would get alone, rows are sampled with their own key
(fold_in(key(seed), token index)), and the decode batch is always `max_slots` rows. A request's output is
therefore a function of (its prompt, its sampling, the engine config, the model) only.

Compiles: one prefill per bucket of padded prompt length (`prefill_buckets`, default powers of two from 64 up to
max_prompt_tokens, plus max_prompt_tokens), one decode loop, one insert; `stats()["compiles"]` counts them.

Free slots: their rows hold whatever they last held (zeros of length 0 at start-up, or a finished request's
cache); they are marked finished in the loop (they emit -1), their compute is wasted but harmless (rows never
mix, a step past capacity writes nothing), and `insert` overwrites every leaf of the row, length and position
included. A length-0 row is fine in decode: the step appends its token before attending.

Stops: the model's EOS and the chat end-of-turn ids, plus each request's `stop_ids`, are checked on the host
after each call, as are `stop_strings` (on the detokenized text; the string and what follows are cut) and
`max_tokens`; tokens a row generated past its stop within the call are discarded.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rocketkv_jax import cache_nbytes, get_method, make_config
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int
from rocketkv_jax.models.generate import stop_ids as default_stop_ids
from rocketkv_jax.models.llama import prefill_jit
from rocketkv_jax.models.loop import LoopConfig, RowSampling, decode_loop_jit

__all__ = ["Engine", "EngineConfig", "Prefilled", "QueueFull", "Request", "SamplingParams", "TokenEvent",
           "default_buckets", "insert_jit"]

MIN_BUCKET = 64  # the smallest padded prompt length of the default buckets
MAX_SEED = 2**32 - 1  # seeds are uint32 (jax.random.key)


class QueueFull(RuntimeError):
  """The engine's queue holds max_queue requests: try later (a server answers 429)."""


def default_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  """Powers of two from 64 below max_prompt_tokens, then max_prompt_tokens itself."""
  out, b = [], MIN_BUCKET
  while b < max_prompt_tokens:
    out.append(b)
    b *= 2
  return tuple(out) + (max_prompt_tokens,)


@dataclasses.dataclass(frozen=True, init=False)
class EngineConfig:
  """The engine's capacity and method, fixed at start-up (frozen, hashable).

  method, token_budget: the KV method and its budget (any method of the core). max_slots: requests decoded at
  once. max_prompt_tokens / max_new_tokens: the longest prompt and answer a request may have; with the
  method they fix the plan (module doc). steps_per_call: tokens every active slot advances per decode call.
  prefill_buckets: padded prompt lengths that prefill compiles for (sorted; max_prompt_tokens is added when
  missing); None for the default (`default_buckets`). max_queue: requests that may wait for a slot.
  method_overrides: fields of the method config (e.g. impl="xla"), given as extra keywords or as a dict.
  """

  method: str
  token_budget: int
  max_slots: int
  max_prompt_tokens: int
  max_new_tokens: int
  steps_per_call: int
  prefill_buckets: tuple[int, ...]
  max_queue: int
  method_overrides: tuple[tuple[str, object], ...]

  def __init__(self, method: str = "rocketkv", token_budget: int = 256, max_slots: int = 8,
               max_prompt_tokens: int = 2048, max_new_tokens: int = 256, steps_per_call: int = 4,
               prefill_buckets: Sequence[int] | None = None, max_queue: int = 64,
               method_overrides: dict | Sequence[tuple[str, object]] | None = None, **overrides):
    get_method(method)  # ValueError naming an unknown method
    check_int("token_budget", token_budget, MIN_TOKEN_BUDGET)
    for name, value, low in (("max_slots", max_slots, 1), ("max_prompt_tokens", max_prompt_tokens, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("steps_per_call", steps_per_call, 1),
                             ("max_queue", max_queue, 0)):
      check_int(name, value, low)
    if prefill_buckets is None:
      buckets = default_buckets(max_prompt_tokens)
    else:
      buckets = tuple(prefill_buckets)
      for b in buckets:
        check_int("prefill_buckets entry", b, 1)
      if any(b > max_prompt_tokens for b in buckets):
        raise ValueError(f"prefill_buckets={buckets} must not exceed max_prompt_tokens={max_prompt_tokens}")
      buckets = tuple(sorted(set(buckets) | {max_prompt_tokens}))
    merged = dict(method_overrides or {})
    merged.update(overrides)
    fields = {f.name for f in dataclasses.fields(get_method(method))}
    unknown = sorted(set(merged) - fields)
    if unknown:
      raise ValueError(f"method overrides {unknown} are not fields of the {method!r} config ({sorted(fields)})")
    values = dict(method=method, token_budget=token_budget, max_slots=max_slots,
                  max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                  steps_per_call=steps_per_call, prefill_buckets=buckets, max_queue=max_queue,
                  method_overrides=tuple(sorted(merged.items())))
    for k, v in values.items():
      object.__setattr__(self, k, v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How one request samples and stops.

  max_tokens: new tokens at most (finish "length"). temperature: 0 is greedy. top_p in (0, 1] (1 is off),
  top_k >= 0 (0 is off). seed: in [0, 2**32): token j is sampled with fold_in(key(seed), j), so a request's
  samples are the same whatever runs next to it. stop_ids: token ids that end the answer (on top of the
  model's EOS and end-of-turn); stop_strings: texts that end it (the text is cut before them).
  """

  max_tokens: int = 64
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()

  def __post_init__(self):
    check_int("max_tokens", self.max_tokens, 1)
    for name in ("temperature", "top_p"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature!r} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
    check_int("top_k", self.top_k, 0)
    check_int("seed", self.seed, 0)
    if self.seed > MAX_SEED:
      raise ValueError(f"seed={self.seed} must be < 2**32")
    if isinstance(self.stop_ids, (str, bytes)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_ids):
      raise ValueError(f"stop_ids={self.stop_ids!r} must be token ids >= 0")
    if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
      raise ValueError(f"stop_strings={self.stop_strings!r} must be non-empty strings")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))


@dataclasses.dataclass
class Request:
  """One request: a unique id, its prompt's token ids and its sampling."""

  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)


@dataclasses.dataclass
class TokenEvent:
  """What one step produced for one request.

  token_ids: the new token ids (a stop id is not included; tokens past a stop are dropped). text: the new
  detokenized text (a stop string and what follows it are cut; text that may be the start of a stop string,
  or an incomplete UTF-8 character, is held back until it is known). finish_reason: None while running, else
  "stop" (a stop id or string), "length" (max_tokens) or "abort". prompt_tokens: the prompt's length.
  completion_tokens: tokens generated so far, a stop id included.
  """

  request_id: str
  token_ids: list[int]
  text: str
  finished: bool
  finish_reason: str | None
  prompt_tokens: int
  completion_tokens: int


class Prefilled(tuple):
  """(logits_1V, caches_1) of one request's prefill, where its decode starts; `.request` is the request."""

  def __new__(cls, logits_1V, caches, request: Request):
    self = super().__new__(cls, (logits_1V, caches))
    self.request = request
    return self


@functools.partial(jax.jit, donate_argnums=(0, 1))
def insert_jit(caches, logits_BV, one_caches, one_logits_1V, slot):
  """The batched caches and logits with row `slot` (a traced int32: one compile for every slot) replaced by one
  request's (batch 1). The batched ones are donated."""
  put = lambda big, one: jax.lax.dynamic_update_slice_in_dim(big, one.astype(big.dtype), slot, axis=0)  # noqa: E731
  return jax.tree.map(put, caches, one_caches), put(logits_BV, one_logits_1V)


@dataclasses.dataclass
class _Active:
  """Host state of a request in a slot."""

  request: Request
  stops: frozenset
  sampled: int = 0        # tokens the loop has sampled for it (its next token index)
  generated: list = dataclasses.field(default_factory=list)  # kept token ids (no stop id)
  completion: int = 0     # tokens generated, a stop id included
  sent: str = ""          # text already emitted


class Engine:
  """Continuous batching over `config.max_slots` slots (module doc). Thread-safe: submit / abort may be called
  while another thread runs step()."""

  def __init__(self, model, tokenizer, config: EngineConfig):
    if not isinstance(config, EngineConfig):
      raise ValueError(f"config={config!r} must be an EngineConfig")
    cfg = model.config
    if config.max_prompt_tokens + config.max_new_tokens > cfg.max_len:
      raise ValueError(f"max_prompt_tokens={config.max_prompt_tokens} + max_new_tokens={config.max_new_tokens} "
                       f"exceeds the model's max_len={cfg.max_len}")
    self.model, self.tokenizer, self.config = model, tokenizer, config
    self.method_config = make_config(config.method, token_budget=config.token_budget,
                                     prompt_len=config.max_prompt_tokens, max_new_tokens=config.max_new_tokens,
                                     head_dim=cfg.head_dim, max_len=cfg.max_len, **dict(config.method_overrides))
    self.stop_ids = default_stop_ids(model, tokenizer, chat=True)
    self.loop = LoopConfig(max_new_tokens=config.steps_per_call, carry_logits=True)
    self._graphdef, self._state = nnx.split(model)
    self._executables: dict = {}
    self._lock = threading.RLock()
    self._queue: collections.deque[Request] = collections.deque()
    self._slots: list[_Active | None] = [None] * config.max_slots
    self._pending: list[TokenEvent] = []  # abort events, emitted by the next step
    self._tokens_generated = 0
    self._key = jax.random.key(0)  # unused by per-row sampling; the loop's signature takes one
    # the batched caches: the shapes of a batch-1 prefill (the same for every bucket), max_slots rows of zeros
    # with length 0
    B, T = config.max_slots, config.prefill_buckets[0]
    shapes = jax.eval_shape(lambda s, t, n: prefill_jit(self._graphdef, s, t, n, config=self.method_config),
                            self._state, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    logits_shape, cache_shapes = shapes
    self._caches = jax.tree.map(lambda s: jnp.zeros((B,) + s.shape[1:], s.dtype), cache_shapes)
    self._logits = jnp.zeros((B,) + logits_shape.shape[1:], logits_shape.dtype)

  # ------------------------------------------------------------------ requests

  def validate(self, request: Request) -> None:
    """ValueError naming the value unless the request fits this engine."""
    if not isinstance(request, Request):
      raise ValueError(f"request={request!r} must be a Request")
    if not isinstance(request.request_id, str) or not request.request_id:
      raise ValueError(f"request_id={request.request_id!r} must be a non-empty string")
    ids, c = request.prompt_ids, self.config
    if not isinstance(ids, (list, tuple)):
      raise ValueError(f"prompt_ids must be a list of token ids, not {type(ids).__name__}")
    if not ids:
      raise ValueError("prompt_ids=[] is empty: a prompt needs at least one token")
    if len(ids) > c.max_prompt_tokens:
      raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_tokens={c.max_prompt_tokens}")
    vocab = self.model.config.vocab_size
    bad = [i for i in ids if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < vocab]
    if bad:
      raise ValueError(f"prompt_ids {bad[:4]} are not token ids in [0, {vocab})")
    s = request.sampling
    if not isinstance(s, SamplingParams):
      raise ValueError(f"sampling={s!r} must be SamplingParams")
    if s.max_tokens > c.max_new_tokens:
      raise ValueError(f"max_tokens={s.max_tokens} exceeds the engine's max_new_tokens={c.max_new_tokens}")

  def submit(self, request: Request) -> None:
    """Validates and queues a request. Raises ValueError (bad request, duplicate id) or QueueFull."""
    self.validate(request)
    with self._lock:
      rid = request.request_id
      if any(r.request_id == rid for r in self._queue) or any(a and a.request.request_id == rid for a in self._slots):
        raise ValueError(f"request_id={rid!r} is already queued or running")
      if len(self._queue) >= self.config.max_queue:
        raise QueueFull(f"the queue holds max_queue={self.config.max_queue} requests")
      self._queue.append(request)

  def abort(self, request_id: str) -> bool:
    """Drops a queued or running request (its slot is freed at once); the next step() emits its final event
    (finish_reason "abort"). False when no such request is queued or running."""
    with self._lock:
      for r in self._queue:
        if r.request_id == request_id:
          self._queue.remove(r)
          self._pending.append(TokenEvent(request_id, [], "", True, "abort", len(r.prompt_ids), 0))
          return True
      for i, a in enumerate(self._slots):
        if a is not None and a.request.request_id == request_id:
          self._slots[i] = None
          self._pending.append(TokenEvent(request_id, [], "", True, "abort", len(a.request.prompt_ids),
                                          a.completion))
          return True
    return False

  def has_work(self) -> bool:
    with self._lock:
      return bool(self._queue or self._pending or any(a is not None for a in self._slots))

  def stats(self) -> dict:
    with self._lock:
      return dict(queue_depth=len(self._queue), active_slots=sum(a is not None for a in self._slots),
                  max_slots=self.config.max_slots, tokens_generated=self._tokens_generated,
                  kv_bytes_device=cache_nbytes(self._caches), compiles=len(self._executables))

  def free_slots(self) -> list[int]:
    with self._lock:
      return [i for i, a in enumerate(self._slots) if a is None]

  @property
  def decode_state(self):
    """(logits [max_slots, V], per-layer batched caches): where the next decode call starts (read only)."""
    return self._logits, self._caches

  # ------------------------------------------------------------------ compiled pieces

  def _compiled(self, key, lower):
    exe = self._executables.get(key)
    if exe is None:
      exe = self._executables[key] = lower().compile()
    return exe

  def bucket(self, n_tokens: int) -> int:
    """The padded prompt length a prompt of n_tokens is prefilled at."""
    for b in self.config.prefill_buckets:
      if b >= n_tokens:
        return b
    raise ValueError(f"prompt of {n_tokens} tokens exceeds max_prompt_tokens={self.config.max_prompt_tokens}")

  # ------------------------------------------------------------------ JetStream-shaped primitives

  def prefill(self, request: Request) -> Prefilled:
    """One request's prefill at its bucket's padded length: (logits [1, V], its per-layer caches, batch 1)."""
    self.validate(request)
    n = len(request.prompt_ids)
    T = self.bucket(n)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = request.prompt_ids
    lengths = np.array([n], np.int32)
    exe = self._compiled(("prefill", T), lambda: prefill_jit.lower(
        self._graphdef, self._state, tokens, lengths, config=self.method_config))
    logits, caches = exe(self._state, tokens, lengths)
    return Prefilled(logits, caches, request)

  def insert(self, prefilled: Prefilled, slot: int) -> None:
    """Writes a prefilled request into a free slot; it decodes from the next generate()."""
    with self._lock:
      if not 0 <= slot < self.config.max_slots or self._slots[slot] is not None:
        raise ValueError(f"slot={slot} is not a free slot (free: {self.free_slots()})")
      logits, caches = prefilled
      slot_j = np.int32(slot)
      exe = self._compiled(("insert",), lambda: insert_jit.lower(self._caches, self._logits, caches, logits, slot_j))
      self._caches, self._logits = exe(self._caches, self._logits, caches, logits, slot_j)
      req = prefilled.request
      self._slots[slot] = _Active(request=req, stops=frozenset(self.stop_ids) | frozenset(req.sampling.stop_ids))

  def generate(self) -> list[TokenEvent]:
    """Advances every active slot by steps_per_call tokens with one call of the decode loop; returns the
    events (pending abort events first) and frees finished slots."""
    with self._lock:
      events, self._pending = self._pending, []
      active = [(i, a) for i, a in enumerate(self._slots) if a is not None]
      if not active:
        return events
      B = self.config.max_slots
      temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
      top_k, index, seed = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.uint32)
      finished = np.ones(B, bool)
      for i, a in active:
        s = a.request.sampling
        temperature[i], top_p[i], top_k[i], seed[i], index[i] = s.temperature, s.top_p, s.top_k, s.seed, a.sampled
        finished[i] = False
      rows = RowSampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, index=index)
      args = (self._state, self._logits, self._caches, self._key, None, finished, rows)
      exe = self._compiled(("decode",), lambda: decode_loop_jit.lower(
          self._graphdef, *args, config=self.method_config, loop=self.loop))
      out = exe(*args)
      self._caches, self._logits = out.caches, out.logits_BV
      tokens = np.asarray(out.tokens)
      for i, a in active:
        a.sampled += self.config.steps_per_call
        event = self._advance(a, tokens[i].tolist())
        if event is not None:
          events.append(event)
          self._tokens_generated += len(event.token_ids)
          if event.finished:
            self._slots[i] = None
      return events

  def step(self) -> list[TokenEvent]:
    """Admits queued requests into free slots (prefill + insert each), then one generate()."""
    with self._lock:
      while self._queue and None in self._slots:
        req = self._queue.popleft()
        self.insert(self.prefill(req), self._slots.index(None))
      return self.generate()

  # ------------------------------------------------------------------ host side of a step

  def _advance(self, a: _Active, row: list[int]) -> TokenEvent | None:
    """Takes a call's tokens for one request: stop ids, max_tokens, stop strings (checked after each token, so
    the tokens after the one that completes a stop string are dropped), then the text delta."""
    s = a.request.sampling
    new, reason, text = [], None, None
    start = max(0, len(a.sent) - max(map(len, s.stop_strings), default=0))
    for t in row:
      if t < 0:
        break
      a.completion += 1
      if t in a.stops:
        reason = "stop"
        break
      new.append(t)
      if s.stop_strings:
        text = self.tokenizer.decode(a.generated + new)
        hits = [k for k in (text.find(stop, start) for stop in s.stop_strings) if k >= 0]
        if hits:
          text, reason = text[:min(hits)], "stop"
          break
      if len(a.generated) + len(new) >= s.max_tokens:
        reason = "length"
        break
    a.generated.extend(new)
    if text is None:
      text = self.tokenizer.decode(a.generated)
    end = len(text)
    if reason is None:
      while end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 character: wait for its bytes
        end -= 1
      hold = 0
      for stop in s.stop_strings:  # a tail that may start a stop string: wait until it is known
        hold = max([hold] + [k for k in range(1, min(len(stop), end + 1)) if text[:end].endswith(stop[:k])])
      end -= hold
    delta = text[len(a.sent):end] if end > len(a.sent) and text.startswith(a.sent) else ""
    a.sent += delta
    if not new and not delta and reason is None:
      return None
    return TokenEvent(a.request.request_id, new, delta, reason is not None, reason, len(a.request.prompt_ids),
                      a.completion)
