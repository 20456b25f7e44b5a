"""The scheduler: requests in, `TokenEvent`s out, over the device engine (`engine.py`). `Engine` is what callers
construct (`Engine(model, tokenizer, EngineConfig(...))`): it owns a `DeviceEngine` and the decode state, and
keeps everything about requests: the queue, the slots (a `RequestState` per slot), admission with chunked
prefill, abort, the events still to emit, arrival times, the history and contexts (session reuse), and stats.

Continuous batching over `config.max_slots` slots: `step()` = admit queued requests into free slots (prefill +
insert each), then `generate()`: one decode call of every active slot, whose tokens the output processor
(`output.advance`: stop ids and strings, incremental detokenization, logprobs) turns into events on the host;
finished slots are freed at once. Pipelined: `generate()` queues decode call k on the device before it reads call
k - 1's tokens, so the device never idles while the host checks stops, detokenizes and admits requests; the
scheduler holds the call in flight. So one token per call (steps_per_call=1, the default: a stream's events carry
one token each) costs no throughput while the host's work per call is shorter than the device's.

Limits (`check_length`, vLLM's): a request may have max_model_len = max_prompt_tokens + max_new_tokens tokens in
all, and after a prompt of n tokens at most `max_tokens_for(n)` new ones (max_model_len - n where the slots hold
it; a method that keeps a budget of the prompt plans its slots for max_new_tokens new tokens).

Chunked prefill (`EngineConfig.prefill_chunk_tokens`): the prefills of one step stop once they have taken that
many prompt tokens or one chunk of a long prompt (`DeviceEngine.chunks`: each about the cost of that many tokens
at position 0; the last, which compresses the prompt, counts as a whole step too), so a long prompt is
prefilled one chunk per step between decode calls (one prompt at a time, in arrival order) and decoding slots
never wait for a whole long prefill.

Session reuse: with `history_bytes`, every prefilled prompt's dense K/V joins the history (`history.py`), and a
later prompt that starts with a stored one prefills only the rest over it; a stored history is reused only by
requests with the same `Request.cache_salt` (the tenant). How much is reused is `reusable`: the stored prefix
less the last `prompt_queries` tokens, whose queries stage 1 reads and which are not stored. A compressed
`Context` (`compress_context`) is query-agnostic reuse: requests continue copies of its cache. Prompt logprobs
need a scoring prefill of the whole prompt: such a request neither reuses nor adds to the history.

The history's host copy: a new prompt's K/V reaches host memory off its path to the first token. Admission starts
the device-to-host copy and inserts the request; one worker thread waits for the copy and adds it to the history
while the slots decode (measured on an H100: 2.55 s per 32k prompt, which every such request's first token waited
for). Only one store is in flight: the next admission waits for it, without stalling the decode calls, so a next
turn always finds the previous one stored and the device never holds two prompts' K/V waiting for the host.

Failures: a request whose prefill raises ends alone (finish_reason "error", `TokenEvent.error`); the decode call
is shared, so an error there is the runner's to report to every request in flight.

Concurrency: one thread owns an `Engine` (the server's `runner.EngineRunner`: every submit, abort and step
travels to that thread), as JetStream's and vLLM's engine cores are driven by one loop. Nothing here is
thread-safe, by design: there is no lock (the history's store worker touches only the `HistoryStore`, which has
its own). The device engine under it keeps nothing across calls but its compile
cache; the decode state it reads and returns is held here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import cache_nbytes
from rocketkv_jax.models.generate import stop_ids as default_stop_ids
from rocketkv_jax.models.loop import RowProcessing, RowSampling
from rocketkv_jax.models.sharding import DATA, MODEL

from . import saved
from .engine import (MAX_LOGIT_BIAS, MAX_STOP_IDS, Context, DeviceEngine, EngineConfig, LimitError, Prefilled,
                     Request, SamplingParams, check_limits)
from .history import MAX_SALT, HistoryStore, own_rows
from .output import RequestState, TokenEvent, advance, prompt_logprobs

__all__ = ["Engine", "QueueFull", "prompt_tokens"]

log = logging.getLogger("rocketkv_jax.serving")


class QueueFull(RuntimeError):
  """The engine's queue holds max_queue requests: try later (a server answers 429)."""


def prompt_tokens(request: Request) -> int:
  """The tokens a request's answer follows: its context's and its prompt's."""
  return len(request.prompt_ids) + (len(request.context.prompt_ids) if request.context is not None else 0)


class Engine:
  """Continuous batching over `config.max_slots` slots (module doc). Not thread-safe: one thread owns it."""

  def __init__(self, model, tokenizer, config: EngineConfig, *, mesh=None, data_axis=DATA, model_axis=MODEL):
    """mesh, data_axis, model_axis: `DeviceEngine`'s (slots split over the data axis, KV heads over the model
    axis)."""
    self.device = DeviceEngine(model, config, mesh=mesh, data_axis=data_axis, model_axis=model_axis)
    self.model, self.tokenizer, self.config, self.mesh = model, tokenizer, config, self.device.mesh
    self.method_config, self.model_id = self.device.method_config, self.device.model_id
    self.stop_ids = default_stop_ids(model, tokenizer, chat=True)
    self._decode = self.device.init_state()
    # the slots' cache bytes: static shapes, the same after every call (summing them each step cost the engine
    # thread ~1 ms, twice per decode call through the runner's stats: as much as the rest of a call's host work)
    self._kv_bytes_device = cache_nbytes(self._decode.caches)
    self._queue: collections.deque[Request] = collections.deque()
    self._slots: list[RequestState | None] = [None] * config.max_slots
    self._pending: list[TokenEvent] = []  # abort and error events, emitted by the next step
    self._inflight = None  # (tokens of the last decode call, not read yet; [(row, RequestState)] it decoded)
    self._scored: list = []  # (Prefilled, seconds queued) of max_tokens=0 requests, answered by the next generate()
    self._tokens_generated = 0
    self._arrived: dict[str, float] = {}  # request id -> submit time (monotonic), while queued
    self._process_rows = None  # (the active rows it was built for, their RowProcessing on the device)
    self._inserts = itertools.count(1)
    # (request, its prefill's generator, seconds it queued, whether it took a chunk yet): a prompt being prefilled
    self._filling = None
    self._reused = self._prefilled = 0  # prompt tokens taken from history / context, and prefilled
    self._store_s = 0.0  # seconds the store worker spent copying new prompts' K/V into the host history
    self._store_pool = None  # that worker (made on first use): one thread, so one store in flight
    self._storing = None  # the store in flight (a Future of its seconds), or None
    self.history = None
    if config.history_bytes:
      cfg = model.config
      self.history = HistoryStore(cfg.n_layers, (cfg.n_kv_heads, cfg.head_dim), np.dtype(model.dtype),
                                  max_bytes=config.history_bytes, spill_dir=config.history_spill_dir,
                                  max_device_bytes=config.history_device_bytes,
                                  max_disk_bytes=config.history_disk_bytes)

  @property
  def kept_whole(self) -> bool:
    """Whether every request is kept whole (`DeviceEngine.kept_whole`)."""
    return self.device.kept_whole

  def plan_summary(self) -> str:
    """What the slots are sized for (the start-up line of `rocketkv serve`)."""
    return self.device.plan_summary()

  def plan(self, n_prompt: int, max_tokens: int):
    """`DeviceEngine.plan`: the `RowPlan` of a request of n_prompt tokens and max_tokens new ones."""
    return self.device.plan(n_prompt, max_tokens)

  @property
  def max_model_len(self) -> int:
    """`DeviceEngine.max_model_len`: the most prompt + new tokens a request may have."""
    return self.device.max_model_len

  def max_tokens_for(self, n_prompt: int) -> int:
    """`DeviceEngine.max_tokens_for`: the most new tokens a prompt of n_prompt tokens may ask for."""
    return self.device.max_tokens_for(n_prompt)

  def check_length(self, n_prompt: int, max_tokens: int) -> None:
    """LimitError naming the numbers unless a prompt of n_prompt tokens (at most max_prompt_tokens) may ask for
    max_tokens new ones: refused when n_prompt + max_tokens exceeds max_model_len (vLLM's rule and words, code
    context_length_exceeded), or, within it, when the slots hold fewer new tokens after such a prompt
    (`max_tokens_for`: a method that keeps a budget of the prompt has room for max_new_tokens)."""
    total, most = self.max_model_len, self.max_tokens_for(n_prompt)
    if n_prompt + max_tokens > total:
      raise LimitError(f"This model's maximum context length is {total} tokens. However, you requested "
                       f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). "
                       f"Please reduce the length of the prompt or completion.", "max_tokens",
                       "context_length_exceeded")
    if max_tokens > most:
      raise LimitError(f"max_tokens={max_tokens} exceeds the {most} new tokens a request may have after a prompt of "
                       f"{n_prompt} tokens: the {self.config.method} slots are planned for "
                       f"max_new_tokens={self.config.max_new_tokens} new tokens (max_model_len={total} counts "
                       f"prompt + new tokens)", "max_tokens")

  @property
  def decode_state(self):
    """(logits [max_slots, V], per-layer batched caches): where the next decode call starts (read only)."""
    return self._decode.logits_BV, self._decode.caches

  # ------------------------------------------------------------------ requests

  def validate(self, request: Request) -> None:
    """ValueError naming the value unless the request fits this engine: what `SamplingParams` cannot check on
    its own (the engine's limits, the vocabulary, the plan for the prompt's length)."""
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
    check_limits(s, vocab=vocab)
    if not isinstance(request.cache_salt, str) or len(request.cache_salt) > MAX_SALT:
      raise ValueError(f"cache_salt={str(request.cache_salt)[:40]!r} must be a string of at most {MAX_SALT} "
                       f"characters")
    if s.prompt_logprobs is not None and request.context is not None:
      raise ValueError("prompt_logprobs needs the prompt prefilled in full: not with a compressed context")
    if request.context is not None:
      if not isinstance(request.context, Context):
        raise ValueError(f"context={request.context!r} must be a Context (Engine.compress_context)")
      if len(ids) + s.max_tokens > c.max_new_tokens:
        raise ValueError(f"a prompt after a compressed context goes where new tokens go: prompt of {len(ids)} "
                         f"tokens + max_tokens={s.max_tokens} exceeds the engine's max_new_tokens="
                         f"{c.max_new_tokens}")
    else:
      self.check_length(len(ids), s.max_tokens)
      self.plan(len(ids), s.max_tokens)  # the paper's plan for this length is valid (ValueError names why not)

  def submit(self, request: Request) -> None:
    """Validates and queues a request. Raises ValueError (bad request, duplicate id) or QueueFull."""
    self.validate(request)
    rid = request.request_id
    if (any(r.request_id == rid for r in self._queue) or any(a and a.request.request_id == rid for a in self._slots)
        or (self._filling is not None and self._filling[0].request_id == rid)):
      raise ValueError(f"request_id={rid!r} is already queued or running")
    if len(self._queue) >= self.config.max_queue:
      raise QueueFull(f"the queue holds max_queue={self.config.max_queue} requests")
    self._queue.append(request)
    self._arrived[rid] = time.monotonic()

  def abort(self, request_id: str) -> bool:
    """Drops a queued or running request (its slot is freed at once); the next step() emits its final event
    (finish_reason "abort"). False when no such request is queued or running."""
    for r in self._queue:
      if r.request_id == request_id:
        self._queue.remove(r)
        self._arrived.pop(request_id, None)
        self._pending.append(TokenEvent(request_id, [], "", True, "abort", prompt_tokens(r), 0))
        return True
    for p in self._scored:
      if p[0].request.request_id == request_id:
        self._scored.remove(p)
        self._pending.append(TokenEvent(request_id, [], "", True, "abort", prompt_tokens(p[0].request), 0,
                                        p[0].cached))
        return True
    if self._filling is not None and self._filling[0].request_id == request_id:
      r = self._filling[0]
      self._filling[1].close()
      self._filling = None
      self._pending.append(TokenEvent(request_id, [], "", True, "abort", prompt_tokens(r), 0))
      return True
    for i, a in enumerate(self._slots):
      if a is not None and a.request.request_id == request_id:
        self._slots[i], a.done = None, True
        self._pending.append(TokenEvent(request_id, [], "", True, "abort", prompt_tokens(a.request),
                                        a.completion, a.cached))
        return True
    return False

  def has_work(self) -> bool:
    return bool(self._queue or self._pending or self._scored or self._inflight is not None or
                self._filling is not None or self._storing is not None or any(a is not None for a in self._slots))

  def stats(self) -> dict:
    h = self.history
    return dict(queue_depth=len(self._queue), active_slots=sum(a is not None for a in self._slots),
                max_slots=self.config.max_slots, tokens_generated=self._tokens_generated,
                kv_bytes_device=self._kv_bytes_device, compiles=self.device.compiles,
                kv_bytes_host=h.host_bytes() if h else 0, kv_bytes_disk=h.disk_bytes() if h else 0,
                kv_bytes_history_device=h.device_bytes() if h else 0,
                history_segments=len(h.segments) if h else 0, prompt_tokens_reused=self._reused,
                prompt_tokens_prefilled=self._prefilled, history_store_seconds=round(self._store_s, 6))

  def reset_counters(self) -> None:
    """Zeroes the counters `stats()` reports (tokens generated, prompt tokens reused and prefilled): after a
    warm-up, so /metrics counts client traffic only. Compiled pieces and the history are kept."""
    self._tokens_generated = self._reused = self._prefilled = 0
    self._store_s = 0.0

  def free_slots(self) -> list[int]:
    return [i for i, a in enumerate(self._slots) if a is None]

  # ------------------------------------------------------------------ prefill of one request

  def prefill(self, request: Request) -> Prefilled:
    """One request's prefill: (logits [1, V], its per-layer caches, batch 1), where its decode starts.

    With a context: a copy of the context's cache, the prompt fed through decode steps. With a history store:
    the prompt's stored prefix is reused and the rest prefilled over it (`prefill_extend`), and the new
    tokens' K/V join the history. Otherwise a plain prefill at the prompt's bucket."""
    self.validate(request)
    if request.context is not None:
      return self._continue_context(request)
    if self.history is not None and request.sampling.prompt_logprobs is None:
      return self._prefill_over_history(request)
    return self._prefill_alone(request)

  def _prefill_alone(self, request: Request) -> Prefilled:
    """A plain prefill at the prompt's bucket (no history read or written), planned for its own length; with
    prompt logprobs, the scoring prefill."""
    n = len(request.prompt_ids)
    p = self.device.prefill(request.prompt_ids, self.plan(n, request.sampling.max_tokens),
                            scored=request.sampling.prompt_logprobs is not None)
    self._prefilled += n
    return Prefilled(*p, request, scores=p.scores)

  def reusable(self, prompt_ids, cache_salt: str = "") -> int:
    """Prompt tokens whose K/V the history holds and a prefill would reuse: the longest stored prefix (of the
    same cache_salt), less the last `prompt_queries` tokens of the prompt (the method reads their queries,
    which are not stored; all of it for H2O), and at least the last token (its logits start the decode)."""
    if self.history is None:
      return 0
    self._settle()
    _, common = self.history.match(prompt_ids, cache_salt)
    return self._reuse(len(prompt_ids), common)

  def _reuse(self, n: int, common: int) -> int:
    """`reusable` of a prompt of n tokens whose longest stored prefix has `common` tokens."""
    q = self.method_config.prompt_queries
    return 0 if q is None else max(0, min(common, n - max(q, 1)))

  def remember(self, prompt_ids, cache_salt: str = "") -> int:
    """Prefills a prompt into the history without answering it (a document that questions will follow:
    question-in-window reuse, where each question's prompt starts with it and stage 1's window is on the
    question), for requests of this cache_salt. Returns the prompt tokens the history now holds for it."""
    if self.history is None:
      raise ValueError("this engine keeps no history (EngineConfig.history_bytes=0)")
    request = Request("remember", list(prompt_ids), SamplingParams(max_tokens=1), cache_salt=cache_salt)
    self.validate(request)
    self._prefill_over_history(request)
    seg, n = self.history.match(request.prompt_ids, cache_salt)
    return n

  def _prefill_over_history(self, request: Request) -> Prefilled:
    """The whole of `_fill` at once (chunks, if any, back to back), its K/V in the history on return."""
    for _, prefilled in self._fill(request):
      if prefilled is not None:
        self._settle()
        return prefilled

  def _store(self, ids, new_kv, reused: int, salt: str) -> None:
    """Starts a prompt's K/V on its way to the host history (module doc): every layer's device-to-host copy
    starts now; the worker waits for the prefill, then for the copies, and adds them."""
    self._settle()
    for kv in new_kv:
      for x in kv:
        x.copy_to_host_async()

    def store() -> float:
      jax.block_until_ready(new_kv)
      t0 = time.perf_counter()
      m, dtype = len(ids) - reused, self.history.dtype  # the prompt's rows, copied out of the padded buffers here:
      rows = [[own_rows(np.asarray(x)[0], 0, m, dtype) for x in kv] for kv in new_kv]  # not under the store's lock
      self.history.add(ids, [k for k, _ in rows], [v for _, v in rows], reused, salt)
      return time.perf_counter() - t0

    if self._store_pool is None:
      self._store_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rocketkv-history-store")
    self._storing = self._store_pool.submit(store)

  def _settle(self) -> None:
    """Waits for the store in flight, if any (its seconds join history_store_seconds). A store that failed loses
    only that prompt's history (logged): its request was answered."""
    storing, self._storing = self._storing, None
    if storing is None:
      return
    try:
      self._store_s += storing.result()
    except Exception:  # noqa: BLE001 - the request is served; a later prompt prefills what was not kept
      log.exception("copying a prompt's K/V into the history failed; it is not kept")

  def _fill(self, request: Request):
    """A request's prefill over its reusable history (when kept; else over nothing): the device engine's
    `prefill_chunked` generator, yielding (tokens the chunk prefilled, None) after each chunk but the last, then
    (its tokens, the Prefilled); the new tokens' K/V then join the history."""
    ids = list(request.prompt_ids)
    n = len(ids)
    self._settle()  # the previous prompt's K/V in the history first: this one may continue it
    seg, common = self.history.match(ids, request.cache_salt) if self.history is not None else (None, 0)
    r = self._reuse(n, common) if self.history is not None else 0
    if self.history is not None:
      view = self.history.view(seg, r, self.device.bucket(n))
    else:
      view = [None] * self.model.config.n_layers
    fill = self.device.prefill_chunked(ids, view, r, self.plan(n, request.sampling.max_tokens),
                                       keep_kv=self.history is not None)
    for tokens, out in fill:
      self._prefilled += tokens
      if out is None:
        yield tokens, None
        continue
      p, new_kv = out
      self._reused += r
      if self.history is not None:
        if self.history.max_device_bytes:  # the device tier keeps them where they are (it moves old ones out)
          self.history.add(ids, [k for k, _ in new_kv], [v for _, v in new_kv], r, request.cache_salt)
        else:  # off the request's path to its first token (module doc)
          self._store(ids, new_kv, r, request.cache_salt)
      yield tokens, Prefilled(*p, request, cached=r)

  def _admission(self, request: Request):
    """The generator of (prompt tokens prefilled, Prefilled or None) that admits a request: `_fill`'s chunks
    when the request is prefilled over the history or chunked, else its whole prefill at once."""
    whole = request.context is not None or request.sampling.prompt_logprobs is not None
    if not whole and (self.history is not None or len(self.device.chunks(len(request.prompt_ids))) > 1):
      self.validate(request)
      return self._fill(request)
    return iter([(len(request.prompt_ids), self.prefill(request))])

  # ------------------------------------------------------------------ contexts (query-agnostic reuse)

  def compress_context(self, prompt_ids) -> Context:
    """Prefills and compresses a context once (stage 1's window on its own tail: query-agnostic), planned for
    its length and the engine's max_new_tokens (its questions and answers come later); requests
    with `context=` then continue copies of its cache. Never stored in or taken from the history."""
    probe = Request("context", list(prompt_ids), SamplingParams(max_tokens=self.config.max_new_tokens))
    self.validate(probe)
    logits, caches = self._prefill_alone(probe)
    return Context(list(prompt_ids), logits, caches)

  def _continue_context(self, request: Request) -> Prefilled:
    ctx = request.context
    caches = jax.tree.map(jnp.copy, ctx.caches)  # the decode loop donates its caches
    logits, caches = self.device.feed(ctx.logits, caches, list(request.prompt_ids))
    self._reused += len(ctx.prompt_ids)
    self._prefilled += len(request.prompt_ids)
    return Prefilled(logits, caches, request, cached=len(ctx.prompt_ids))

  def _stamp(self, kind: str, with_method: bool) -> dict:
    cfg = self.model.config
    stamp = dict(kind=kind, model=self.model_id, dtype=str(np.dtype(self.model.dtype)),
                 kv_layout=[cfg.n_layers, cfg.n_kv_heads, cfg.head_dim])
    if with_method:
      stamp["method"] = str(self.method_config.cache_spec())
    return stamp

  def save_context(self, context: Context, path) -> None:
    """Writes a compressed context with orbax, stamped with the model and the method's cache spec."""
    if not isinstance(context, Context):
      raise ValueError(f"context={context!r} must be a Context")
    tree = dict(prompt_ids=np.asarray(context.prompt_ids, np.int32), logits=np.asarray(context.logits),
                caches=[np.asarray(x) for x in jax.tree.leaves(context.caches)])
    saved.save(path, tree, stamp=self._stamp("context", with_method=True))

  def load_context(self, path) -> Context:
    """A context saved by `save_context` (SavedFileError when saved for another model or method, or damaged)."""
    tree, _ = saved.load(path, stamp=self._stamp("context", with_method=True))
    logits_shape, cache_shapes = self.device.prefill_shapes
    leaves, treedef = jax.tree.flatten(cache_shapes)
    got = tree["caches"]
    want = [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
    if [(tuple(x.shape), x.dtype) for x in got] != want or tree["logits"].shape != logits_shape.shape:
      raise saved.SavedFileError(f"{path}: the cache's arrays do not have this engine's shapes")
    caches = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in got])
    return Context([int(i) for i in tree["prompt_ids"]], jnp.asarray(tree["logits"]), caches)

  # ------------------------------------------------------------------ sessions' history on disk

  def save_history(self, path) -> int:
    """Writes every stored prompt history with orbax (stamped with the model; returns the segment count).
    A history is the model's dense K/V, the same for every method: it loads under any method."""
    if self.history is None:
      raise ValueError("this engine keeps no history (EngineConfig.history_bytes=0)")
    self._settle()
    return self.history.save(path, stamp=self._stamp("history", with_method=False))

  def load_history(self, path) -> int:
    """Adds the histories saved at `path` (SavedFileError for another model or a damaged file)."""
    if self.history is None:
      raise ValueError("this engine keeps no history (EngineConfig.history_bytes=0)")
    self._settle()
    return self.history.load(path, stamp=self._stamp("history", with_method=False))

  # ------------------------------------------------------------------ slots and decode

  def insert(self, prefilled: Prefilled, slot: int) -> None:
    """Writes a prefilled request (`.request` set) into a free slot; it decodes from the next generate()."""
    if not 0 <= slot < self.config.max_slots or self._slots[slot] is not None:
      raise ValueError(f"slot={slot} is not a free slot (free: {self.free_slots()})")
    req = prefilled.request
    marked = None
    if req.sampling.processed:  # the tokens its repetition penalty counts as its prompt
      marked = list(req.prompt_ids) + (list(req.context.prompt_ids) if req.context is not None else [])
    self._decode = self.device.insert(self._decode, prefilled, slot, prompt_ids=marked)
    self._slots[slot] = RequestState(
        request=req, prompt_tokens=prompt_tokens(req),
        stops=frozenset(() if req.sampling.ignore_eos else self.stop_ids) | frozenset(req.sampling.stop_ids),
        cached=getattr(prefilled, "cached", 0), scores=getattr(prefilled, "scores", None), serial=next(self._inserts))

  def generate(self) -> list[TokenEvent]:
    """Launches one call of the decode loop (every active slot advances by steps_per_call tokens), then reads the
    PREVIOUS call's tokens and returns their events (pending abort events first), freeing finished slots.

    Pipelined (module doc): a request's tokens arrive one generate() after they were computed, and a row that
    finishes on a stop keeps decoding for one more call (its tokens are dropped). A row whose calls already hold
    its max_tokens is left out of the next call (it ends when the last one is read: every token the device returns
    for a row it decodes is real, so the host ends it by length or an earlier stop), and no call is launched when
    every active row is such a row: a request of max_tokens <= steps_per_call (lm-eval's log-likelihood requests
    ask for one token) costs one decode call, not two. Once no slot is active, generate() only reads the last
    call. A request of max_tokens=0 (echo scoring) never takes a slot: its one event (the prompt's logprobs, finish
    "length") comes from the generate() after its prefill, read once that call's decode is queued."""
    events, self._pending = self._pending, []
    previous, self._inflight = self._inflight, None
    active = [(i, a) for i, a in enumerate(self._slots)
              if a is not None and a.sampled < a.request.sampling.max_tokens]
    if active:
      self._inflight = (self._launch(active), active)
    scored, self._scored = self._scored, []
    for p, waited in scored:  # max_tokens=0: the prompt (and its logprobs) only, read after the launch
      r = p.request
      events.append(TokenEvent(r.request_id, [], "", True, "length", prompt_tokens(r), 0, p.cached, waited,
                               logprobs=[] if r.sampling.logprobs is not None else None,
                               prompt_logprobs=prompt_logprobs(r, p.scores)))
    if previous is not None:
      (tokens, scores), rows = previous
      tokens = np.asarray(tokens)
      scores = None if scores is None else [np.asarray(x) for x in scores]
      for i, a in rows:
        if a.done:  # finished in an earlier call or aborted
          continue
        event = advance(self.tokenizer, a, tokens[i].tolist(), None if scores is None else [x[i] for x in scores])
        if event is not None:
          events.append(event)
          self._tokens_generated += len(event.token_ids)
          if event.finished:
            a.done = True
            if self._slots[i] is a:
              self._slots[i] = None
    return events

  def _launch(self, active):
    """Queues one decode call for the active rows (asynchronous); returns (its tokens [B, steps_per_call], its
    (token_logprobs, top_ids, top_logprobs) or None)."""
    B = self.config.max_slots
    temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
    top_k, index, seed = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.uint32)
    finished = np.ones(B, bool)
    for i, a in active:
      s = a.request.sampling
      temperature[i], top_p[i], top_k[i], seed[i], index[i] = s.temperature, s.top_p, s.top_k, s.seed, a.sampled
      finished[i] = False
      a.sampled += self.config.steps_per_call
    rows = RowSampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, index=index)
    process = self._row_processing(active) if any(a.request.sampling.processed for _, a in active) else None
    self._decode, tokens, scores = self.device.generate(self._decode, finished, rows, process)
    return tokens, scores

  def _row_processing(self, active) -> RowProcessing:
    """The active rows' `RowProcessing` (built on the host when the set of active requests changes, then kept
    on the device; its counts and prompt mask are the decode state's)."""
    key = tuple(a.serial for _, a in active)
    if self._process_rows is None or self._process_rows[0] != key:
      B, V = self.config.max_slots, self.model.config.vocab_size
      S = MAX_STOP_IDS + len(self.stop_ids)
      presence, frequency = np.zeros(B, np.float32), np.zeros(B, np.float32)
      repetition, min_tokens = np.ones(B, np.float32), np.zeros(B, np.int32)
      bias_ids, bias = np.full((B, MAX_LOGIT_BIAS), V, np.int32), np.zeros((B, MAX_LOGIT_BIAS), np.float32)
      stop_ids = np.full((B, S), V, np.int32)
      for i, a in active:
        s = a.request.sampling
        presence[i], frequency[i], repetition[i] = s.presence_penalty, s.frequency_penalty, s.repetition_penalty
        min_tokens[i] = s.min_tokens
        for j, (t, b) in enumerate(s.logit_bias):
          bias_ids[i, j], bias[i, j] = t, b
        if s.min_tokens:
          ids = sorted(a.stops)
          stop_ids[i, :len(ids)] = ids
      rows = RowProcessing(presence=presence, frequency=frequency, repetition=repetition, min_tokens=min_tokens,
                           bias_ids=bias_ids, bias=bias, stop_ids=stop_ids, counts=None, prompt_mask=None)
      self._process_rows = (key, self.device.place_rows(rows))
    return self._process_rows[1]

  def step(self) -> list[TokenEvent]:
    """Admits queued requests into free slots (prefill + insert each), then one generate(). With
    prefill_chunk_tokens, the prefills of one step stop once they have taken that many prompt tokens or any piece
    of a chunked prompt (module doc): a long prompt is prefilled one chunk per step, between decode calls (one
    prompt at a time, in arrival order)."""
    budget, spent = self.config.prefill_chunk_tokens, 0
    while not (budget and spent >= budget):
      if self._filling is None:
        if not (self._queue and None in self._slots):
          break
        if (self._storing is not None and not self._storing.done()
            and (self._inflight is not None or any(a is not None for a in self._slots))):
          break  # the next admission waits for the store in flight (module doc); the slots decode meanwhile
        req = self._queue.popleft()
        arrived = self._arrived.pop(req.request_id, None)
        waited = time.monotonic() - arrived if arrived is not None else 0.0
        self._filling = (req, None, waited, False)
      req, fill, waited, chunked = self._filling
      try:
        if fill is None:
          fill = self._admission(req)
          self._filling = (req, fill, waited, False)
        n, prefilled = next(fill)
        # a chunk of a long prompt, and its last piece (which compresses the prompt), fill the step
        spent += budget if (prefilled is None or chunked) else n
        if prefilled is None:
          self._filling = (req, fill, waited, True)
        elif req.sampling.max_tokens == 0:  # nothing to decode: answered by generate(), no slot taken
          self._filling = None
          self._scored.append((prefilled, waited))
        else:
          self._filling = None
          slot = self._slots.index(None)
          self.insert(prefilled, slot)
          self._slots[slot].queued_s = waited
      except Exception as e:  # noqa: BLE001 - this request fails alone; the others decode on
        log.exception("request %s failed in its prefill", req.request_id)
        self._filling = None
        self._pending.append(TokenEvent(req.request_id, [], "", True, "error", prompt_tokens(req), 0,
                                        error=f"{type(e).__name__}: {e}"))
    events = self.generate()
    if not (self._queue or self._inflight is not None or self._filling is not None
            or any(a is not None for a in self._slots)):
      self._settle()  # nothing else to do: the store in flight ends this step
    return events
