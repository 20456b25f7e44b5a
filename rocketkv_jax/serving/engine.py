"""The continuous-batching engine: a fixed number of slots, static-shape caches, one decode loop.

The JetStream shape: `prefill(request)` runs one request's prompt through the model and the method's stage 1
(its compressed cache, batch 1), `insert(prefilled, slot)` writes that cache into slot i of the engine's
batched caches while the other slots keep their state, and `generate()` advances every slot by
`steps_per_call` tokens with ONE call of the one decode loop (`rocketkv_jax.models.loop.decode_loop_jit`, per-row
sampling as arrays, the last token fed and its logits carried to the next call). `step()` = admit queued
requests into free slots (prefill + insert each), then `generate()`; finished slots are freed at once.

What the plan depends on: every request runs the paper's plan for its OWN length, the one rule of
`rocketkv_jax.plan_rows` (as `generate` does): prompt_len = its prompt's tokens, max_new_tokens = its max_tokens
(a compressed context is planned for the engine's max_new_tokens, since its questions come later). The slots'
static shapes come from the engine's limits, `plan_limits(method, token_budget, max_prompt_tokens,
max_new_tokens, head_dim, max_len, **method_overrides)`: the maxima of every plan a request within them can
get (`Engine.plan_summary()` says what that sizes). A request's plan rides in its cache rows as data, so every
slot has the same shapes (one decode compile) and a request's tokens never depend on the other requests: the
core gives each row what it would get alone, rows are sampled with their own key (fold_in(key(seed), token
index)), and the decode batch is always `max_slots` rows. A request's output is therefore a function of (its
prompt, its sampling, the engine config, the model) only, and equals `generate`'s for the same prompt.

Compiles: one prefill per bucket of padded prompt length (`prefill_buckets`, default powers of two from 64 up to
max_prompt_tokens, plus max_prompt_tokens), one insert, and one decode loop per sampling kind in use (every row
greedy; sampling; sampling with top-p / top-k cuts; any row processed: four at most); with a history, one extend
prefill per (whole prompt, new tokens) bucket pair instead of the prefills; with contexts, one feed per power of
two up to the longest question; with prompt logprobs, one scoring prefill per bucket; with processed requests, one
row reset. `stats()["compiles"]` counts them.

Processed requests (penalties, logit bias, min_tokens or logprobs: `SamplingParams.processed`): while one is
active, every decode call runs the loop's processing kind (`models/loop.RowProcessing`; neutral values for the
other rows, whose tokens it does not change), which keeps each row's output token counts and prompt tokens
[max_slots, V] on the device (made on the first such request) and returns MAX_LOGPROBS logprobs per token; a
request's `TokenEvent.logprobs` keep its own k. Prompt logprobs (`SamplingParams.prompt_logprobs`, what an echo
with logprobs needs) come from a scoring prefill of the whole prompt: such a request neither reuses nor adds to
the history.

Tenants: a stored history is reused only by requests with the same `Request.cache_salt` (`history.py`).
Failures: a request whose prefill raises ends alone (finish_reason "error", `TokenEvent.error`); the decode call
is shared, so an error there is the runner's to report to every request in flight.

Free slots: their rows hold whatever they last held (zeros of length 0 at start-up, or a finished request's
cache); they are marked finished in the loop (they emit -1), their compute is wasted but harmless (rows never
mix, a step past capacity writes nothing), and `insert` overwrites every leaf of the row, length and position
included. A length-0 row is fine in decode: the step appends its token before attending.

Stops, detokenization and logprobs are the output processor's (`output.py`), on the host after each call.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rocketkv_jax import cache_nbytes, get_method, plan_limits, plan_rows
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int
from rocketkv_jax.models.generate import stop_ids as default_stop_ids
from rocketkv_jax.models.llama import (fingerprint, prefill_chunk, prefill_chunk_layer_jit, prefill_extend,
                                       prefill_extend_layer_jit, prefill_jit)
from rocketkv_jax.models.loop import LoopConfig, RowProcessing, RowSampling, decode_loop_jit
from rocketkv_jax.models.sharding import DATA, MODEL, cache_spec, default_impl, resolve_mesh, using
from jax.sharding import NamedSharding, PartitionSpec

from . import saved
from .output import RequestState, TokenEvent, TokenLogprob, advance
from .history import MAX_SALT
from .history import HistoryStore

__all__ = ["Context", "Engine", "EngineConfig", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "Prefilled", "QueueFull", "Request",
           "SamplingParams", "TokenEvent", "TokenLogprob", "default_buckets", "insert_jit"]

log = logging.getLogger("rocketkv_jax.serving")

MIN_BUCKET = 64  # the smallest padded prompt length of the default buckets
MAX_SEED = 2**32 - 1  # seeds are uint32 (jax.random.key)
MAX_INT32 = 2**31 - 1  # top_k and token counts are int32 on the device
MIN_TEMPERATURE = 1e-5  # a positive temperature below this is greedy (vLLM's sampling epsilon): float32 overflows
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_LOGPROBS = 20  # most likely tokens returned per position (OpenAI's top_logprobs limit, vLLM's default)
MAX_STOP_IDS = 64  # a request's own stop ids
MAX_CACHE_SALT = 256  # characters of a client's cache_salt (a Request's may be longer: the server tags the tenant)


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
  history_device_bytes: of the history, the most recent segments' K/V kept on the device (no copy to or from the
  host for a next turn over them; `history.py`), at most this many bytes. prefill_chunk_tokens: 0 prefills each
  admitted prompt whole inside one step; n > 0 prefills at most about n
  prompt tokens per step (chunked prefill, module doc), so decoding slots never wait for a whole long prefill.
  """

  method: str
  token_budget: int
  max_slots: int
  max_prompt_tokens: int
  max_new_tokens: int
  steps_per_call: int
  prefill_buckets: tuple[int, ...]
  max_queue: int
  history_bytes: int
  history_spill_dir: str | None
  history_disk_bytes: int
  method_overrides: tuple[tuple[str, object], ...]
  prefill_chunk_tokens: int
  history_device_bytes: int

  def __init__(self, method: str = "rocketkv", token_budget: int = 256, max_slots: int = 8,
               max_prompt_tokens: int = 2048, max_new_tokens: int = 256, steps_per_call: int = 4,
               prefill_buckets: Sequence[int] | None = None, max_queue: int = 64, history_bytes: int = 0,
               history_spill_dir: str | None = None, history_disk_bytes: int = 0,
               method_overrides: dict | Sequence[tuple[str, object]] | None = None, prefill_chunk_tokens: int = 0,
               history_device_bytes: int = 0, **overrides):
    get_method(method)  # ValueError naming an unknown method
    check_int("token_budget", token_budget, MIN_TOKEN_BUDGET)
    for name, value, low in (("max_slots", max_slots, 1), ("max_prompt_tokens", max_prompt_tokens, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("steps_per_call", steps_per_call, 1),
                             ("max_queue", max_queue, 0), ("history_bytes", history_bytes, 0),
                             ("history_disk_bytes", history_disk_bytes, 0),
                             ("prefill_chunk_tokens", prefill_chunk_tokens, 0),
                             ("history_device_bytes", history_device_bytes, 0)):
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
    if history_spill_dir is not None and not isinstance(history_spill_dir, str):
      raise ValueError(f"history_spill_dir={history_spill_dir!r} must be a folder path or None")
    values = dict(method=method, token_budget=token_budget, max_slots=max_slots,
                  max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                  steps_per_call=steps_per_call, prefill_buckets=buckets, max_queue=max_queue,
                  history_bytes=history_bytes, history_spill_dir=history_spill_dir,
                  history_disk_bytes=history_disk_bytes, method_overrides=tuple(sorted(merged.items())),
                  prefill_chunk_tokens=prefill_chunk_tokens, history_device_bytes=history_device_bytes)
    for k, v in values.items():
      object.__setattr__(self, k, v)


def _finite(x) -> bool:
  try:
    return math.isfinite(x)
  except OverflowError:  # an int too large for a float
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How one request samples and stops.

  max_tokens: new tokens at most (finish "length"). temperature: in [0, MAX_TEMPERATURE], 0 is greedy (and so is
  anything below MIN_TEMPERATURE). top_p in (0, 1] (1 is off), top_k >= 0 (0 is off; `Engine.validate` also
  bounds it by the vocabulary). seed: in [0, 2**32): token j is sampled with fold_in(key(seed), j), so a request's
  samples are the same whatever runs next to it. stop_ids: token ids that end the answer (on top of the
  model's EOS and end-of-turn; at most MAX_STOP_IDS); stop_strings: texts that end it (the text is cut before
  them). vLLM's processing, applied to the logits in this order before temperature and cuts: logit_bias ((token
  id, bias in [-100, 100]) pairs or a dict, at most MAX_LOGIT_BIAS), min_tokens (no stop id, the model's or the
  request's, before that many tokens; a stop string may still end it), repetition_penalty in (0, 10] (1 is off;
  over prompt and output tokens), frequency_penalty and presence_penalty in [-2, 2] (over output tokens).
  logprobs: None, or k in [0, MAX_LOGPROBS]: each token's raw log-probability and the k most likely
  (`TokenLogprob`); prompt_logprobs: the same for the prompt's tokens. ignore_eos: the model's EOS and
  end-of-turn ids do not end the answer (vLLM's; the request's own stop_ids and stop_strings still do), so it
  runs to max_tokens (what load benchmarks ask for), without the processed kind min_tokens would need.
  """

  max_tokens: int = 64
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  logit_bias: tuple[tuple[int, float], ...] = ()
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  ignore_eos: bool = False

  @property
  def processed(self) -> bool:
    """Whether the logits are changed before sampling (penalties, bias, min_tokens) or logprobs are returned:
    such a request decodes in the loop's processing kind."""
    return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
            or self.min_tokens > 0 or bool(self.logit_bias) or self.logprobs is not None)

  def __post_init__(self):
    check_int("max_tokens", self.max_tokens, 1)
    if self.max_tokens > MAX_INT32:
      raise ValueError(f"max_tokens={self.max_tokens} must be < 2**31")
    for name in ("temperature", "top_p"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")
    if not 0 <= self.temperature <= MAX_TEMPERATURE:
      raise ValueError(f"temperature={self.temperature!r} must be in [0, {MAX_TEMPERATURE:g}]")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
    check_int("top_k", self.top_k, 0)
    if self.top_k > MAX_INT32:
      raise ValueError(f"top_k={self.top_k} must be < 2**31")
    check_int("seed", self.seed, 0)
    if self.seed > MAX_SEED:
      raise ValueError(f"seed={self.seed} must be < 2**32")
    if isinstance(self.stop_ids, (str, bytes)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_INT32 for i in self.stop_ids):
      raise ValueError(f"stop_ids={self.stop_ids!r} must be token ids in [0, 2**31)")
    if len(self.stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"stop_ids has {len(self.stop_ids)} ids: at most {MAX_STOP_IDS}")
    if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
      raise ValueError(f"stop_strings={self.stop_strings!r} must be non-empty strings")
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                            ("repetition_penalty", 0.0, MAX_REPETITION_PENALTY)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")
      if not (low < v if name == "repetition_penalty" else low <= v) or not v <= high:
        raise ValueError(f"{name}={v!r} must be in {'(' if name == 'repetition_penalty' else '['}{low:g}, {high:g}]")
      object.__setattr__(self, name, float(v))
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"ignore_eos={self.ignore_eos!r} must be true or false")
    check_int("min_tokens", self.min_tokens, 0)
    if self.min_tokens > self.max_tokens:
      raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
    bias = self.logit_bias
    if isinstance(bias, dict):
      bias = tuple(bias.items())
    if isinstance(bias, (str, bytes)) or not isinstance(bias, (tuple, list)) or not all(
        isinstance(p, (tuple, list)) and len(p) == 2 for p in bias):
      raise ValueError(f"logit_bias={self.logit_bias!r} must be (token id, bias) pairs")
    if len(bias) > MAX_LOGIT_BIAS:
      raise ValueError(f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS}")
    for i, b in bias:
      if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= MAX_INT32:
        raise ValueError(f"logit_bias token id {i!r} must be a token id in [0, 2**31)")
      if isinstance(b, bool) or not isinstance(b, (int, float)) or not _finite(b) or not -100 <= b <= 100:
        raise ValueError(f"logit_bias[{i}]={b!r} must be a number in [-100, 100]")
    object.__setattr__(self, "logit_bias", tuple(sorted((int(i), float(b)) for i, b in dict(bias).items())))
    for name in ("logprobs", "prompt_logprobs"):
      v = getattr(self, name)
      if v is not None:
        check_int(name, v, 0)
        if v > MAX_LOGPROBS:
          raise ValueError(f"{name}={v} must be at most {MAX_LOGPROBS}")
    t = float(self.temperature)
    object.__setattr__(self, "temperature", 0.0 if t < MIN_TEMPERATURE else t)
    object.__setattr__(self, "top_p", float(self.top_p))
    object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))


@dataclasses.dataclass
class Context:
  """A context compressed once and reused by many requests (`Engine.compress_context`), query-agnostic:
  stage 1 ran over the context alone, its window on the context's own tail, before any question was known.
  A request with `context=` appends its prompt (the question) to a copy of this cache through decode steps.
  prompt_ids: the context's token ids. logits [1, V], caches: batch-1 per-layer caches, on the device."""

  prompt_ids: list[int]
  logits: jax.Array
  caches: tuple


@dataclasses.dataclass
class Request:
  """One request: a unique id, its prompt's token ids and its sampling.

  context: a compressed `Context` the prompt continues (query-agnostic reuse); None to prefill the prompt
  (whose K/V history, with `history_bytes` set, is reused from any stored prompt it starts with). cache_salt:
  the tenant: a stored history is reused only by requests with the same salt (vLLM's `cache_salt`), so a
  client cannot learn whether another tenant's prompt began with some text from its own `cached_tokens`."""

  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  context: Context | None = None
  cache_salt: str = ""


class Prefilled(tuple):
  """(logits_1V, caches_1) of one request's prefill, where its decode starts; `.request` is the request,
  `.cached` the prompt tokens it did not prefill (history or context), `.scores` the prompt's `PromptScores`
  (batch 1, on the device) when it asked for prompt logprobs."""

  def __new__(cls, logits_1V, caches, request: Request, cached: int = 0, scores=None):
    self = super().__new__(cls, (logits_1V, caches))
    self.request, self.cached, self.scores = request, cached, scores
    return self


def prompt_tokens(request: Request) -> int:
  """The tokens a request's answer follows: its context's and its prompt's."""
  return len(request.prompt_ids) + (len(request.context.prompt_ids) if request.context is not None else 0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def reset_row_jit(counts_BV, prompt_mask_BV, mask_1V, slot):
  """The processing state with row `slot` restarted: no output tokens counted, its prompt's tokens marked."""
  counts = jax.lax.dynamic_update_slice_in_dim(counts_BV, jnp.zeros((1, counts_BV.shape[1]), counts_BV.dtype),
                                               slot, axis=0)
  return counts, jax.lax.dynamic_update_slice_in_dim(prompt_mask_BV, mask_1V, slot, axis=0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def insert_jit(caches, logits_BV, one_caches, one_logits_1V, slot):
  """The batched caches and logits with row `slot` (a traced int32: one compile for every slot) replaced by one
  request's (batch 1). The batched ones are donated."""
  put = lambda big, one: jax.lax.dynamic_update_slice_in_dim(big, one.astype(big.dtype), slot, axis=0)  # noqa: E731
  return jax.tree.map(put, caches, one_caches), put(logits_BV, one_logits_1V)


class Engine:
  """Continuous batching over `config.max_slots` slots (module doc). Not thread-safe: one thread owns it (the
  server's `runner.EngineRunner`: every submit, abort and step travels to that thread), as JetStream's and vLLM's
  engine cores are driven by one loop."""

  def __init__(self, model, tokenizer, config: EngineConfig, *, mesh=None, data_axis=DATA, model_axis=MODEL):
    """mesh: any `jax.sharding.Mesh` (`jax.make_mesh`, explicit or auto axes) whose batch and tensor-parallel
    axes are named data_axis / model_axis (`models.sharding.normalize_mesh`; the model placed on it by
    `load(mesh=)` with the same names): slots are split over the data axis, KV heads over the model axis."""
    if not isinstance(config, EngineConfig):
      raise ValueError(f"config={config!r} must be an EngineConfig")
    mesh = resolve_mesh(mesh, data_axis, model_axis)
    cfg = model.config
    if config.max_prompt_tokens + config.max_new_tokens > cfg.max_len:
      raise ValueError(f"max_prompt_tokens={config.max_prompt_tokens} + max_new_tokens={config.max_new_tokens} "
                       f"exceeds the model's max_len={cfg.max_len}")
    self.model, self.tokenizer, self.config, self.mesh = model, tokenizer, config, mesh
    overrides = dict(config.method_overrides)
    if default_impl(mesh):
      overrides.setdefault("impl", default_impl(mesh))
    self._overrides = overrides
    self.method_config = plan_limits(config.method, token_budget=config.token_budget,
                                     max_prompt_len=config.max_prompt_tokens, max_new_tokens=config.max_new_tokens,
                                     head_dim=cfg.head_dim, max_len=cfg.max_len, **overrides)
    self.stop_ids = default_stop_ids(model, tokenizer, chat=True)
    self.loop = LoopConfig(max_new_tokens=config.steps_per_call, carry_logits=True)
    self._graphdef, self._state = nnx.split(model)
    self._executables: dict = {}
    self._queue: collections.deque[Request] = collections.deque()
    self._slots: list[RequestState | None] = [None] * config.max_slots
    self._pending: list[TokenEvent] = []  # abort events, emitted by the next step
    self._inflight = None  # (tokens of the last decode call, not read yet; [(row, RequestState)] it decoded)
    self._tokens_generated = 0
    self._arrived: dict[str, float] = {}  # request id -> submit time (monotonic), while queued
    self._key = jax.random.key(0)  # unused by per-row sampling; the loop's signature takes one
    self._processing = None  # (counts [B, V] int32, prompt_mask [B, V] bool): made for the first processed request
    self._process_rows = None  # (the active rows it was built for, their RowProcessing arrays on the device)
    self._inserts = itertools.count(1)
    self._filling = None  # (request, its prefill's generator, seconds it queued): a prompt being prefilled
    # the batched caches: the shapes of a batch-1 prefill (the same for every bucket), max_slots rows of zeros
    # with length 0
    B, T = config.max_slots, config.prefill_buckets[0]
    shapes = jax.eval_shape(lambda s, t, n: prefill_jit(self._graphdef, s, t, n, config=self.method_config),
                            self._state, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    logits_shape, cache_shapes = shapes
    self._one_shapes = shapes  # (logits, caches) of one request: what a saved context must match
    self._caches = jax.tree.map(
        lambda s: self._place(jnp.zeros((B,) + s.shape[1:], s.dtype), batch=True, heads=len(s.shape) >= 2),
        cache_shapes)
    self._logits = self._place(jnp.zeros((B,) + logits_shape.shape[1:], logits_shape.dtype), batch=True)
    self._placement = jax.tree.map(lambda x: x.sharding, (self._logits, self._caches))
    self.model_id = fingerprint(model)
    self._reused = self._prefilled = 0  # prompt tokens taken from history / context, and prefilled
    self.history = None
    if config.history_bytes:
      self.history = HistoryStore(cfg.n_layers, (cfg.n_kv_heads, cfg.head_dim), np.dtype(model.dtype),
                                  max_bytes=config.history_bytes, spill_dir=config.history_spill_dir,
                                  max_device_bytes=config.history_device_bytes,
                                  max_disk_bytes=config.history_disk_bytes)

  def plan_summary(self) -> str:
    """What the slots are sized for (the start-up line of `rocketkv serve`)."""
    c, cfg = self.method_config, self.config
    per_slot = cache_nbytes(jax.tree.map(lambda x: x[:1], self._caches))
    return (f"{cfg.max_slots} slots of {c.capacity} cache slots per KV head and layer ({per_slot / 2**20:.1f} MiB "
            f"each), the largest plan of a request up to max_prompt_tokens={cfg.max_prompt_tokens} and "
            f"max_new_tokens={cfg.max_new_tokens}: {c.cache_spec()}; each request runs the plan of its own length")

  def plan(self, n_prompt: int, max_tokens: int):
    """The `RowPlan` (batch 1) of a request of n_prompt tokens and max_tokens new ones under the engine's
    config. Raises ValueError naming the value when the paper's plan for that length is invalid."""
    return plan_rows(self.config.method, token_budget=self.config.token_budget, prompt_lens=[n_prompt],
                     max_new_tokens=max_tokens, head_dim=self.model.config.head_dim,
                     max_len=self.model.config.max_len, config=self.method_config, **self._overrides).rows

  def _keep_placement(self, logits, caches):
    """The batched logits and caches put back where the engine keeps them (with a mesh, XLA may return a call's
    outputs partitioned otherwise than its inputs, and every executable expects the engine's placement)."""
    if self.mesh is None:
      return logits, caches
    return jax.tree.map(lambda x, s: x if x.sharding == s else jax.device_put(x, s), (logits, caches),
                        self._placement)

  def _place(self, x, batch: bool = False, heads: bool = False):
    """x on the engine's mesh (`cache_spec`): slot rows over "data" (`batch`), KV heads (axis 1) over "model"
    (`heads`), else replicated; unchanged without a mesh."""
    if self.mesh is None:
      return x
    spec = cache_spec(x.shape, self.mesh, 1 if heads else None) if batch else PartitionSpec()
    return jax.device_put(x, NamedSharding(self.mesh, spec))

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
    if s.top_k > vocab:
      raise ValueError(f"top_k={s.top_k} exceeds the vocabulary size {vocab} (0 is off)")
    bad = [i for i in s.stop_ids if i >= vocab]
    if bad:
      raise ValueError(f"stop_ids {bad[:4]} are not token ids in [0, {vocab})")
    bad = [i for i, _ in s.logit_bias if i >= vocab]
    if bad:
      raise ValueError(f"logit_bias token ids {bad[:4]} are not token ids in [0, {vocab})")
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
    return bool(self._queue or self._pending or self._inflight is not None or self._filling is not None or
                any(a is not None for a in self._slots))

  def stats(self) -> dict:
    h = self.history
    return dict(queue_depth=len(self._queue), active_slots=sum(a is not None for a in self._slots),
                max_slots=self.config.max_slots, tokens_generated=self._tokens_generated,
                kv_bytes_device=cache_nbytes(self._caches), compiles=len(self._executables),
                kv_bytes_host=h.host_bytes() if h else 0, kv_bytes_disk=h.disk_bytes() if h else 0,
                kv_bytes_history_device=h.device_bytes() if h else 0,
                history_segments=len(h.segments) if h else 0, prompt_tokens_reused=self._reused,
                prompt_tokens_prefilled=self._prefilled)

  def reset_counters(self) -> None:
    """Zeroes the counters `stats()` reports (tokens generated, prompt tokens reused and prefilled): after a
    warm-up, so /metrics counts client traffic only. Compiled pieces and the history are kept."""
    self._tokens_generated = self._reused = self._prefilled = 0

  def free_slots(self) -> list[int]:
    return [i for i, a in enumerate(self._slots) if a is None]

  @property
  def decode_state(self):
    """(logits [max_slots, V], per-layer batched caches): where the next decode call starts (read only)."""
    return self._logits, self._caches

  # ------------------------------------------------------------------ compiled pieces

  def _compiled(self, key, lower):
    exe = self._executables.get(key)
    if exe is None:
      with using(self.mesh):
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
    prompt logprobs, the scoring prefill (its own executable per bucket, MAX_LOGPROBS tokens per position)."""
    n = len(request.prompt_ids)
    T = self.bucket(n)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = request.prompt_ids
    lengths = np.array([n], np.int32)
    tokens, lengths = self._place(jnp.asarray(tokens)), self._place(jnp.asarray(lengths))
    rows = self.plan(n, request.sampling.max_tokens)
    score = MAX_LOGPROBS if request.sampling.prompt_logprobs is not None else None
    exe = self._compiled(("prefill", T) if score is None else ("prefill_scored", T), lambda: prefill_jit.lower(
        self._graphdef, self._state, tokens, lengths, rows, config=self.method_config, score=score))
    out = exe(self._state, tokens, lengths, rows)
    self._prefilled += n
    return Prefilled(out[0], out[1], request, scores=out[2] if score is not None else None)

  def reusable(self, prompt_ids, cache_salt: str = "") -> int:
    """Prompt tokens whose K/V the history holds and a prefill would reuse: the longest stored prefix (of the
    same cache_salt), less the last `prompt_queries` tokens of the prompt (the method reads their queries,
    which are not stored; all of it for H2O), and at least the last token (its logits start the decode)."""
    if self.history is None:
      return 0
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
    """The whole of `_fill` at once (chunks, if any, back to back)."""
    for _, prefilled in self._fill(request):
      if prefilled is not None:
        return prefilled

  def _chunks(self, m: int) -> list[int]:
    """Sizes of the chunks m new prompt tokens are prefilled in: prefill_chunk_tokens each, the last one at most
    that (longer, up to prefill_chunk_tokens + prompt_queries, only where it would otherwise not hold the queries
    stage 1 reads); one chunk when chunking is off or the method reads every query (H2O)."""
    c, q = self.config.prefill_chunk_tokens, self.method_config.prompt_queries
    if not c or q is None or m <= c:
      return [m]
    full = -(-m // c) - 1  # the last chunk is (0, c] tokens long ...
    if m - full * c < max(q, 1):  # ... unless that is shorter than the window: then the last two are one
      full -= 1
    return [c] * full + [m - full * c]

  def _fill(self, request: Request):
    """A request's prefill over the history (when kept; else over nothing), in `_chunks`: yields (tokens the
    chunk prefilled, None) after each chunk but the last, then (its tokens, the Prefilled). A chunk writes its
    K/V into per-layer buffers [1, S, K, H] on the device (`prefill_chunk`); the last runs `prefill_extend` over
    them, which compresses the whole prompt; the new tokens' K/V then join the history."""
    ids = list(request.prompt_ids)
    n = len(ids)
    seg, common = self.history.match(ids, request.cache_salt) if self.history is not None else (None, 0)
    r = self._reuse(n, common) if self.history is not None else 0
    S, cfg = self.bucket(n), self.model.config
    view = self.history.view(seg, r, S) if self.history is not None else [None] * cfg.n_layers
    chunks, done = self._chunks(n - r), r
    history = view
    if len(chunks) > 1:  # the stored history on the device once, then each chunk written into it
      zeros = lambda: self._place(jnp.zeros((1, S, cfg.n_kv_heads, cfg.head_dim), self.model.dtype))  # noqa: E731
      history = [tuple(jax.device_put(x) for x in h) if h is not None else (zeros(), zeros()) for h in view]
      C = chunks[0]  # every chunk but the last

      def run_chunk(graphdef, state, *args):
        exe = self._compiled(("chunk", S, C), lambda: prefill_chunk_layer_jit.lower(graphdef, state, *args, cfg=cfg))
        return exe(state, *args)

      for c in chunks[:-1]:
        tokens = np.asarray([ids[done:done + c]], np.int32)
        history = prefill_chunk(self.model, tokens, history, np.array([done], np.int32), run_layer=run_chunk)
        done += c
        self._prefilled += c
        yield c, None
    m = n - done
    # after chunks the last one is at most prefill_chunk_tokens + prompt_queries long: padded to a power of two
    # (>= MIN_BUCKET), not to the prompt buckets (a 32k bucket would prefill the padding)
    T = self.bucket(m) if done == r else min(S, max(MIN_BUCKET, 1 << (m - 1).bit_length()))
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :m] = ids[done:]

    def run_layer(graphdef, state, *args):
      exe = self._compiled(("extend", S, T), lambda: prefill_extend_layer_jit.lower(
          graphdef, state, *args, cfg=cfg, config=self.method_config))
      return exe(state, *args)

    logits, caches, new_kv = prefill_extend(self.model, tokens, np.array([m], np.int32), history,
                                            np.array([done], np.int32), self.method_config, seq_len=S,
                                            run_layer=run_layer, rows=self.plan(n, request.sampling.max_tokens))
    self._reused += r
    self._prefilled += m
    if self.history is not None:
      if done > r:  # the chunks' K/V are in the buffers, the last chunk's in new_kv
        new_kv = [tuple(jnp.concatenate([h[:, r:done], x[:, :m]], axis=1) for h, x in zip(hist, kv))
                  for hist, kv in zip(history, new_kv)]
      if self.history.max_device_bytes:  # the device tier keeps them where they are (it moves old ones out)
        self.history.add(ids, [k[0] for k, _ in new_kv], [v[0] for _, v in new_kv], r, request.cache_salt)
      else:
        for kv in new_kv:  # every layer's copy to the host starts now; np.asarray below waits for each
          for x in kv:
            x.copy_to_host_async()
        self.history.add(ids, [np.asarray(k)[0] for k, _ in new_kv], [np.asarray(v)[0] for _, v in new_kv], r,
                         request.cache_salt)
    yield m, Prefilled(logits, caches, request, cached=r)

  def _admission(self, request: Request):
    """The generator of (prompt tokens prefilled, Prefilled or None) that admits a request: `_fill`'s chunks
    when the request is prefilled over the history or chunked, else its whole prefill at once."""
    whole = request.context is not None or request.sampling.prompt_logprobs is not None
    if not whole and (self.history is not None or len(self._chunks(len(request.prompt_ids))) > 1):
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

  def _feed(self, logits, caches, tokens: list[int]):
    """(logits, caches) after feeding `tokens` through decode steps (batch 1; the one decode loop with teacher
    forcing, in calls of power-of-two lengths: one compile per length used)."""
    i = 0
    while i < len(tokens):
      n = 1 << ((len(tokens) - i).bit_length() - 1)
      forced = np.asarray([tokens[i:i + n]], np.int32)
      loop = LoopConfig(max_new_tokens=n, carry_logits=True)
      args = (self._state, logits, caches, self._key, forced, None, None)
      exe = self._compiled(("feed", n), lambda: decode_loop_jit.lower(
          self._graphdef, *args, config=self.method_config, loop=loop))
      out = exe(*args)
      logits, caches = out.logits_BV, out.caches
      i += n
    return logits, caches

  def _continue_context(self, request: Request) -> Prefilled:
    ctx = request.context
    caches = jax.tree.map(jnp.copy, ctx.caches)  # the decode loop donates its caches
    logits, caches = self._feed(ctx.logits, caches, list(request.prompt_ids))
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
    logits_shape, cache_shapes = self._one_shapes
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
    return self.history.save(path, stamp=self._stamp("history", with_method=False))

  def load_history(self, path) -> int:
    """Adds the histories saved at `path` (SavedFileError for another model or a damaged file)."""
    if self.history is None:
      raise ValueError("this engine keeps no history (EngineConfig.history_bytes=0)")
    return self.history.load(path, stamp=self._stamp("history", with_method=False))

  def insert(self, prefilled: Prefilled, slot: int) -> None:
    """Writes a prefilled request into a free slot; it decodes from the next generate()."""
    if not 0 <= slot < self.config.max_slots or self._slots[slot] is not None:
      raise ValueError(f"slot={slot} is not a free slot (free: {self.free_slots()})")
    logits, caches = prefilled
    slot_j = np.int32(slot)
    exe = self._compiled(("insert",), lambda: insert_jit.lower(self._caches, self._logits, caches, logits, slot_j))
    self._caches, self._logits = exe(self._caches, self._logits, caches, logits, slot_j)
    self._logits, self._caches = self._keep_placement(self._logits, self._caches)
    req = prefilled.request
    if req.sampling.processed:
      self._restart_processing(slot, req)
    self._slots[slot] = RequestState(
        request=req, prompt_tokens=prompt_tokens(req),
          stops=frozenset(() if req.sampling.ignore_eos else self.stop_ids) | frozenset(req.sampling.stop_ids),
        cached=getattr(prefilled, "cached", 0), scores=getattr(prefilled, "scores", None), serial=next(self._inserts))

  def _restart_processing(self, slot: int, req: Request) -> None:
    """Zeroes row `slot`'s output token counts and marks its prompt's tokens (context included), for the
    loop's processing kind; the state is made on first use (2 arrays [max_slots, V])."""
    B, V = self.config.max_slots, self.model.config.vocab_size
    if self._processing is None:
      self._processing = (self._place(jnp.zeros((B, V), jnp.int32), batch=True),
                          self._place(jnp.zeros((B, V), bool), batch=True))
    mask = np.zeros((1, V), bool)
    mask[0, req.prompt_ids] = True
    if req.context is not None:
      mask[0, req.context.prompt_ids] = True
    slot_j, mask = np.int32(slot), self._place(jnp.asarray(mask), batch=True)
    exe = self._compiled(("reset_row",), lambda: reset_row_jit.lower(*self._processing, mask, slot_j))
    self._processing = exe(*self._processing, mask, slot_j)

  def generate(self) -> list[TokenEvent]:
    """Launches one call of the decode loop (every active slot advances by steps_per_call tokens), then reads the
    PREVIOUS call's tokens and returns their events (pending abort events first), freeing finished slots.

    Pipelined: call k is queued on the device before the host waits for call k - 1's tokens, so the device
    never idles while the host checks stops, detokenizes and admits requests. A request's tokens therefore
    arrive one generate() after they were computed, and a row that finished keeps decoding for one more call
    (its tokens are dropped). Once no slot is active, generate() only reads the last call."""
    events, self._pending = self._pending, []
    previous, self._inflight = self._inflight, None
    active = [(i, a) for i, a in enumerate(self._slots) if a is not None]
    if active:
      self._inflight = (self._launch(active), active)
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
    # four decode executables at most, chosen on the host (the loop has no data-dependent branch): every row
    # greedy (the plain argmax loop), sampling without cuts, sampling with top-p / top-k cuts, and any row
    # processed (penalties, bias, min_tokens or logprobs: cuts, processing and MAX_LOGPROBS logprobs per token)
    process = None
    if any(a.request.sampling.processed for _, a in active):
      rows = RowSampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, index=index)
      process = self._row_processing(active)
      loop, kind = dataclasses.replace(self.loop, top_logprobs=MAX_LOGPROBS), "processed"
    elif not (temperature > 0).any():
      rows, loop, kind = None, self.loop, "greedy"
    else:
      cut = bool(((temperature > 0) & ((top_p < 1) | (top_k > 0))).any())
      rows = RowSampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, index=index)
      loop, kind = dataclasses.replace(self.loop, cut_rows=cut), ("cut" if cut else "sample")
    args = (self._state, self._logits, self._caches, self._key, None, finished, rows, process)
    exe = self._compiled(("decode", kind), lambda: decode_loop_jit.lower(
        self._graphdef, *args, config=self.method_config, loop=loop))
    out = exe(*args)
    self._logits, self._caches = self._keep_placement(out.logits_BV, out.caches)
    if process is None:
      return out.tokens, None
    self._processing = (out.counts, self._processing[1])
    return out.tokens, (out.token_logprobs, out.top_ids, out.top_logprobs)

  def _row_processing(self, active) -> RowProcessing:
    """The active rows' `RowProcessing` (built on the host when the set of active requests changes, then kept
    on the device) with the engine's processing state."""
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
      arrays = [self._place(jnp.asarray(x), batch=True)
                for x in (presence, frequency, repetition, min_tokens, bias_ids, bias, stop_ids)]
      self._process_rows = (key, arrays)
    counts, mask = self._processing
    return RowProcessing(*self._process_rows[1], counts=counts, prompt_mask=mask)

  def step(self) -> list[TokenEvent]:
    """Admits queued requests into free slots (prefill + insert each), then one generate(). With
    prefill_chunk_tokens, the prefills of one step stop once they have taken that many prompt tokens: a long
    prompt is prefilled one chunk per step, between decode calls (one prompt at a time, in arrival order)."""
    budget, spent = self.config.prefill_chunk_tokens, 0
    while not (budget and spent >= budget):
      if self._filling is None:
        if not (self._queue and None in self._slots):
          break
        req = self._queue.popleft()
        arrived = self._arrived.pop(req.request_id, None)
        waited = time.monotonic() - arrived if arrived is not None else 0.0
        self._filling = (req, None, waited)
      req, fill, waited = self._filling
      try:
        if fill is None:
          fill = self._admission(req)
          self._filling = (req, fill, waited)
        n, prefilled = next(fill)
        spent += n
        if prefilled is not None:
          self._filling = None
          slot = self._slots.index(None)
          self.insert(prefilled, slot)
          self._slots[slot].queued_s = waited
      except Exception as e:  # noqa: BLE001 - this request fails alone; the others decode on
        log.exception("request %s failed in its prefill", req.request_id)
        self._filling = None
        self._pending.append(TokenEvent(req.request_id, [], "", True, "error", prompt_tokens(req), 0,
                                        error=f"{type(e).__name__}: {e}"))
    return self.generate()


