"""The device engine: the model on the device, and the JetStream surface over an explicit decode state.

`DeviceEngine` holds the model's state, the method config the slots are sized for, and the compiled
executables; it knows no request, queue, slot owner, tokenizer or history. Its calls are the three of
JetStream's engine, each over arrays the caller passes in:

- `prefill(prompt_ids, rows)`: one prompt (batch 1) at its padded bucket, under its own plan `rows`, to a
  `Prefilled` (its logits [1, V] and per-layer caches, batch 1); `prefill_chunked`: the same over the K/V of
  the prompt's first tokens (a stored history, given as per-layer arrays: `history.py`'s view), in chunks of
  `prefill_chunk_tokens` (a generator: one chunk per next(), so the caller can decode between chunks), built of
  `prefill_chunk` and `prefill_extend`; `feed`: tokens appended to a batch-1 cache through decode steps (a
  compressed context's continuation).
- `insert(state, prefilled, slot)`: a `DecodeState` whose row `slot` is the prefilled request's.
- `generate(state, finished, sampling, process)`: ONE call of the one decode loop
  (`rocketkv_jax.models.loop.decode_loop_jit`: every row advances by `steps_per_call` tokens, per-row sampling as
  arrays, the last token fed and its logits carried to the next call); it returns the next `DecodeState` and the
  call's tokens as device arrays without waiting for them, so a caller can queue call k before it reads call k - 1.

The scheduler (`scheduler.py`, the `Engine` callers construct) owns the decode state and the requests. Apart
from its compile cache the device engine keeps nothing across calls: each insert / generate donates the state it
is given and returns the next one.

What the plan depends on: every request runs the paper's plan for its OWN length, the one rule of
`rocketkv_jax.plan_rows` (as `generate` does): prompt_len = its prompt's tokens, max_new_tokens = its max_tokens
(a compressed context is planned for the engine's max_new_tokens, since its questions come later). The slots'
static shapes come from the engine's limits, `plan_limits(method, token_budget, max_prompt_tokens,
max_new_tokens, head_dim, max_len, **method_overrides)`: the maxima of every plan a request within them can
get (`DeviceEngine.plan_summary()` says what that sizes). A request's plan rides in its cache rows as data, so
every slot has the same shapes (one decode compile) and a request's tokens never depend on the other requests:
the core gives each row what it would get alone, rows are sampled with their own key (fold_in(key(seed), token
index)), and the decode batch is always `max_slots` rows. A request's output is therefore a function of (its
prompt, its sampling, the engine config, the model) only, and equals `generate`'s for the same prompt.

Compiles: one prefill per bucket of padded prompt length (`prefill_buckets`, default powers of two from 64 up to
max_prompt_tokens, plus max_prompt_tokens), one insert, and one decode loop per sampling kind in use (every row
greedy; sampling; sampling with top-p / top-k cuts; any row processed: four at most, chosen in `generate` from
the rows' arrays); with a history, one extend prefill per (whole prompt, new tokens) bucket pair instead of the
prefills; with chunked prefill, one chunk executable per (prompt bucket, chunk length); with contexts, one feed
per power of two up to the longest question; with prompt logprobs, one scoring prefill per bucket; with
processed rows, one row reset. `DeviceEngine.compiles` counts them, `program_name` names them (by their cache key), and
`DeviceEngine.compile_log`, when set, is told of each compile as it starts and ends (the server's warm-up and
first-use log lines).

Processed rows (penalties, logit bias, min_tokens or logprobs: `SamplingParams.processed`): the loop's
processing kind (`models/loop.RowProcessing`; neutral values for the other rows, whose tokens it does not
change) reads each row's output token counts and prompt tokens [max_slots, V] from `DecodeState.processing`
(made by the first insert of such a row) and returns MAX_LOGPROBS logprobs per token.

Free rows: they hold whatever they last held (zeros of length 0 at start-up, or a finished request's cache);
the caller marks them finished (they emit -1), their compute is wasted but harmless (rows never mix, a step
past capacity writes nothing), and `insert` overwrites every leaf of the row, length and position included. A
length-0 row is fine in decode: the step appends its token before attending.

This module also defines what a request is (`Request`, `SamplingParams`, `Context`) and the engine's limits
(`EngineConfig`): the types the scheduler, the protocol models and the server share. Sampling is validated in
one place: `SamplingParams.__post_init__` (values on their own), then `check_limits` (against the engine's limits
and vocabulary: run by `Engine.validate`, and by the server to name the HTTP field).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rocketkv_jax import cache_nbytes, get_method, plan_rows, plan_static
from rocketkv_jax.methods import whole_overrides
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int
from rocketkv_jax.models import llama
from rocketkv_jax.models.executables import Executables
from rocketkv_jax.models.loop import LoopConfig, RowProcessing, RowSampling, decode_loop_jit
from rocketkv_jax.models.params import fingerprint
from rocketkv_jax.models.sharding import DATA, MODEL, cache_spec, default_impl, resolve_mesh

__all__ = ["Context", "DecodeState", "DeviceEngine", "EngineConfig", "LimitError", "MAX_LOGIT_BIAS", "MAX_LOGPROBS",
           "Prefilled", "Request", "SamplingParams", "check_limits", "chunk_sizes", "default_buckets", "insert_jit",
           "program_name"]

MIN_BUCKET = 64  # the smallest padded prompt length of the default buckets
CHUNK_ALIGN = 64  # chunked prefill's chunk sizes are multiples of this (`DeviceEngine.chunks`)
MAX_SEED = 2**32 - 1  # seeds are uint32 (jax.random.key)
MAX_INT32 = 2**31 - 1  # top_k and token counts are int32 on the device
MIN_TEMPERATURE = 1e-5  # a positive temperature below this is greedy (vLLM's sampling epsilon): float32 overflows
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_LOGPROBS = 20  # most likely tokens returned per position (OpenAI's top_logprobs limit, vLLM's default)
MAX_STOP_IDS = 64  # a request's own stop ids
MAX_CACHE_SALT = 256  # characters of a client's cache_salt (a Request's may be longer: the server tags the tenant)


def chunk_sizes(cfg: llama.LlamaConfig, c: int, q: int | None, m: int, start: int = 0) -> list[int]:
  """Sizes of the chunks m new prompt tokens (at positions start ..) are prefilled in, with prefill_chunk_tokens c
  and a method that reads the last q prompt queries (`MethodConfig.prompt_queries`). One chunk when chunking is off
  (c = 0), when m <= c or when the method reads every query (q None: H2O). Else the chunks but the last follow one
  grid of positions (`chunk_slot`), whose every chunk costs at most what c tokens at position 0 cost by
  `llama.prefill_flops` (linear layers plus attention over the chunk's prefix): chunks shrink along a long prompt
  instead of taking longer (8B shape, c = 1024: about 450 tokens by 32k), and every chunk runs at its grid slot's
  size, a multiple of CHUNK_ALIGN (padded where the prompt's start or end cuts it): one executable per slot size,
  the same for every prompt and history length. The last chunk is the prompt's last max(q, 1) tokens alone: it
  runs `prefill_extend`, which also compresses the whole prompt, so it carries no more new tokens than stage 1's
  window needs."""
  if not c or q is None or m <= c:
    return [m]
  tail = max(q, 1)
  sizes, p, end = [], start, start + m - tail
  while p < end:
    g, n = chunk_slot(cfg, c, p)
    sizes.append(min(g + n, end) - p)
    p += sizes[-1]
  return sizes + [tail]


def chunk_slot(cfg: llama.LlamaConfig, c: int, p: int) -> tuple[int, int]:
  """(start, size) of the grid slot that holds position p: slots from position 0 on, each the largest multiple of
  CHUNK_ALIGN, at most c and at least CHUNK_ALIGN, whose `llama.prefill_flops` at its start is at most that of c
  tokens at position 0. A chunk from p to the slot's end costs no more than the whole slot (fewer tokens, none
  of them further along)."""
  grid = _chunk_grid(cfg, c)
  i = bisect.bisect_right(grid, p) - 1
  if i + 1 >= len(grid):
    raise ValueError(f"position {p} is past the model's max_len={cfg.max_len}")
  return grid[i], grid[i + 1] - grid[i]


@functools.lru_cache(maxsize=16)
def _chunk_grid(cfg: llama.LlamaConfig, c: int) -> list[int]:
  budget = llama.prefill_flops(cfg, c)
  grid = [0]
  while grid[-1] < cfg.max_len:
    g, n = grid[-1], c
    while n > CHUNK_ALIGN and llama.prefill_flops(cfg, n, g) > budget:
      n -= CHUNK_ALIGN
    grid.append(g + n)
  return grid


_PROGRAMS = {  # a DeviceEngine executable's cache key (its kind, then its shape) -> what it is, in words
    "prefill": "prefill bucket {}",
    "prefill_scored": "prefill bucket {} with prompt logprobs",
    "extend": "prefill over a history (bucket {}, {} new tokens)",
    "chunk": "prefill chunk (bucket {}, {} tokens)",
    "feed": "context feed of {} tokens",
    "insert": "insert",
    "reset_row": "processing row reset",
    "decode": "decode ({})",
}


def program_name(key: tuple) -> str:
  """What the device engine's executable cached under `key` is, in words: ("prefill", 64) -> 'prefill bucket 64'."""
  return _PROGRAMS[key[0]].format(*key[1:])


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
  method they fix the plan (module doc); a request may have max_prompt_tokens + max_new_tokens tokens in all
  (`DeviceEngine.max_model_len`; how many new ones after a given prompt: `DeviceEngine.max_tokens_for`).
  steps_per_call: tokens every active slot advances per decode call; 1 (the default) gives a streamed answer one
  token per event, and the scheduler's pipelining (call k queued before call k - 1's tokens are read) keeps the
  device as busy as longer calls do (measured on CPU with SmolLM2, 8 slots: equal tokens/s at 1 and 4,
  `benchmarks/serve.py --model smollm2`); more tokens per call arrive in bursts.
  prefill_buckets: padded prompt lengths that prefill compiles for (sorted; max_prompt_tokens is added when
  missing); None for the default (`default_buckets`). max_queue: requests that may wait for a slot.
  method_overrides: fields of the method config (e.g. impl="xla"), given as extra keywords or as a dict.
  history_device_bytes: of the history, the most recent segments' K/V kept on the device (no copy to or from the
  host for a next turn over them; `history.py`), at most this many bytes. prefill_chunk_tokens: 0 prefills each
  admitted prompt whole inside one step; n > 0 prefills a prompt longer than n in chunks, one per step (chunked
  prefill, `scheduler.py`), each costing about what n tokens at the prompt's start cost (`DeviceEngine.chunks`),
  so decoding slots never wait for a whole long prefill.
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
               max_prompt_tokens: int = 2048, max_new_tokens: int = 256, steps_per_call: int = 1,
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

  max_tokens: new tokens at most (finish "length"); 0: the prompt is prefilled (and scored, with prompt_logprobs)
  and the request ends at once, finish "length", no token generated and no slot taken (vLLM's echo with
  max_tokens=0, lm-eval's log-likelihood scoring). temperature: in [0, MAX_TEMPERATURE], 0 is greedy (and so is
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
    check_int("max_tokens", self.max_tokens, 0)
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



class LimitError(ValueError):
  """A sampling value outside this engine's limits (`check_limits`, `Engine.check_length`); `field`: the
  SamplingParams field; `code`: OpenAI's error code for it ("context_length_exceeded": prompt + max_tokens past
  max_model_len)."""

  def __init__(self, message: str, field: str, code: str = "invalid_value"):
    super().__init__(message)
    self.field, self.code = field, code


def check_limits(s: SamplingParams, *, vocab: int) -> None:
  """LimitError naming the value unless sampling `s` fits a vocabulary of `vocab` token ids: what `SamplingParams`
  cannot check on its own (max_tokens against the prompt's length: `Engine.check_length`). The one copy of these
  checks: `Engine.validate` runs it on every request, and the server before submitting, so that its 400 names the
  HTTP field."""
  if s.top_k > vocab:
    raise LimitError(f"top_k={s.top_k} exceeds the vocabulary size {vocab} (0 is off)", "top_k")
  bad = [i for i in s.stop_ids if i >= vocab]
  if bad:
    raise LimitError(f"stop_ids {bad[:4]} are not token ids in [0, {vocab})", "stop_ids")
  bad = [i for i, _ in s.logit_bias if i >= vocab]
  if bad:
    raise LimitError(f"logit_bias token ids {bad[:4]} are not token ids in [0, {vocab})", "logit_bias")

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
  """(logits_1V, caches_1) of one prefill, where its decode starts. `.request`: the request it answers (None
  from the device engine, which knows no request; the scheduler attaches it), `.cached`: the prompt tokens it
  did not prefill (history or context), `.scores`: the prompt's `PromptScores` (batch 1, on the device) from a
  scoring prefill."""

  def __new__(cls, logits_1V, caches, request: Request | None = None, cached: int = 0, scores=None):
    self = super().__new__(cls, (logits_1V, caches))
    self.request, self.cached, self.scores = request, cached, scores
    return self


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeState:
  """Where the next decode call starts, on the device, one row per slot (B = max_slots).

  logits_BV: each row's next-token logits [B, V]. caches: the per-layer batched caches. processing: None until
  the first processed row is inserted, then (counts [B, V] int32: each row's output tokens so far, prompt_mask
  [B, V] bool: its prompt's tokens), what the loop's processing kind reads. `DeviceEngine.insert` and `generate`
  donate the state they are given: only the one they return is valid."""

  logits_BV: jax.Array
  caches: tuple
  processing: tuple | None = None


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


# Of the device memory free beside the weights and the reserve, the share `slots_for_memory` leaves unused:
# allocator fragmentation and the executables' own buffers, which memory statistics do not show before the first
# compile (the serving benchmark's 'max' has kept 10% aside since 2026-12-01; it can retry with fewer slots after an
# out-of-memory error, a server cannot).
SLOT_MEMORY_SLACK = 0.1


def slots_for_memory(slot_bytes: int, free_bytes: int, reserve_bytes: int) -> int:
  """The most slots of slot_bytes each that fit in free_bytes of one device beside reserve_bytes (prefill's and the
  decode loop's temporaries) and two more slots' worth (a prefilled request's caches and its insert's output),
  SLOT_MEMORY_SLACK of the rest kept aside. ValueError naming the values when not one slot fits."""
  n = int((free_bytes - reserve_bytes - 2 * slot_bytes) * (1 - SLOT_MEMORY_SLACK) // slot_bytes)
  if n < 1:
    raise ValueError(f"not one slot of {slot_bytes / 2**30:.2f} GiB fits: {free_bytes / 2**30:.2f} GiB are free "
                     f"beside the weights and {reserve_bytes / 2**30:.2f} GiB are reserved (lower max_prompt_tokens, "
                     f"max_new_tokens or the reserve)")
  return n


def device_free_bytes(devices) -> int | None:
  """The fewest bytes any of `devices` can still allocate (None when the backend gives no memory statistics, as
  JAX's CPU backend does)."""
  free = []
  for d in devices:
    stats = d.memory_stats() or {}
    if not stats.get("bytes_limit"):
      return None
    free.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
  return min(free)


def slot_memory(mesh=None) -> int:
  """`device_free_bytes` of the devices slots live on (the mesh's, else the first local device), or a ValueError
  naming the backend when it gives no memory statistics (the CLI calls it before the model loads, to refuse
  --max-slots auto at once)."""
  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
  free = device_free_bytes(devices)
  if free is None:
    raise ValueError(f"max_slots='auto' needs the device's memory statistics, which JAX's {devices[0].platform} "
                     f"backend does not give: give a number of slots")
  return free


def fit_slots(model, config: EngineConfig, *, reserve_bytes: int, mesh=None, data_axis=DATA,
              model_axis=MODEL) -> int:
  """The most slots (config.max_slots is ignored) whose caches fit in the device memory free now, beside the loaded
  model: `slots_for_memory` on the device with least free memory, each device holding its share of a slot (KV heads
  split over model_axis) and its data_axis share of the slots (a multiple of that axis's size); the history's device
  tier (config.history_device_bytes) counts as reserved. Nothing is allocated: a slot's bytes come from shapes.
  ValueError when the backend gives no memory statistics, or not one slot fits."""
  mesh = resolve_mesh(mesh, data_axis, model_axis)
  free = slot_memory(mesh)
  dp, tp = (mesh.shape[DATA], mesh.shape[MODEL]) if mesh is not None else (1, 1)  # (resolved: the axes renamed)
  probe = DeviceEngine(model, dataclasses.replace(config, max_slots=dp), mesh=mesh)
  return dp * slots_for_memory(-(-probe.slot_bytes() // tp), free, reserve_bytes + config.history_device_bytes)


class DeviceEngine:
  """The model, the method config and the compiled executables (module doc): prefill, insert and generate over
  arrays the caller passes in. No request, queue, lock or tokenizer; nothing kept across calls but the compile
  cache. Called from one thread (the scheduler's)."""

  def __init__(self, model, config: EngineConfig, *, mesh=None, data_axis=DATA, model_axis=MODEL):
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
    self.model, self.config, self.mesh = model, config, mesh
    overrides = dict(config.method_overrides)
    if default_impl(mesh):
      overrides.setdefault("impl", default_impl(mesh))
    self._max_tokens: dict[int, int] = {}  # max_tokens_for's answers, per prompt length
    # a method whose slots would hold at least full's bytes keeps every request whole (`plan_static`)
    self.method_config = plan_static(config.method, token_budget=config.token_budget,
                                     max_prompt_len=config.max_prompt_tokens, max_new_tokens=config.max_new_tokens,
                                     head_dim=cfg.head_dim, n_kv_heads=cfg.n_kv_heads, model_dtype=model.dtype,
                                     max_len=cfg.max_len, **overrides)
    if self.kept_whole:
      overrides = whole_overrides(overrides)
    self._overrides = overrides
    self.loop = LoopConfig(max_new_tokens=config.steps_per_call, carry_logits=True)
    self.model_id = fingerprint(model)
    self._graphdef, self._state = nnx.split(model)
    self._layers = llama.split_layers(model)  # what the per-layer prefills run, split once
    self._executables = Executables(mesh=mesh)
    # called with a line as each compile starts and ends ('compiling decode (greedy)', then '... (12.3s)'): the
    # server sets it (its warm-up and first-use log lines); None: silent
    self.compile_log = None
    # one request's (logits, caches): the shapes of a batch-1 prefill, the same for every bucket (a saved
    # context must match them; a slot's row has them)
    T = config.prefill_buckets[0]
    self.prefill_shapes = jax.eval_shape(
        lambda s, t, n: llama.prefill_jit(self._graphdef, s, t, n, config=self.method_config),
        self._state, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    self._placement = None
    if mesh is not None:  # where the batched logits and caches live (`init_state`)
      B = config.max_slots
      logits, caches = self.prefill_shapes
      self._placement = (self._sharding((B,) + logits.shape[1:], batch=True),
                         jax.tree.map(lambda s: self._sharding((B,) + s.shape[1:], batch=True,
                                                               heads=len(s.shape) >= 2), caches))

  @property
  def compiles(self) -> int:
    """Executables compiled so far (module doc lists which)."""
    return len(self._executables)

  def init_state(self) -> DecodeState:
    """The decode state at start-up: max_slots rows of zeros with length 0 (every row free)."""
    B = self.config.max_slots
    logits, caches = self.prefill_shapes
    caches = jax.tree.map(
        lambda s: self.place(jnp.zeros((B,) + s.shape[1:], s.dtype), batch=True, heads=len(s.shape) >= 2), caches)
    logits = self.place(jnp.zeros((B,) + logits.shape[1:], logits.dtype), batch=True)
    return DecodeState(logits_BV=logits, caches=caches)

  def plan_summary(self) -> str:
    """What the slots are sized for (the start-up line of `rocketkv serve`)."""
    c, cfg = self.method_config, self.config
    per_slot = cache_nbytes(self.prefill_shapes[1])
    head = (f"{cfg.max_slots} slots of {c.capacity} cache slots per KV head and layer ({per_slot / 2**20:.1f} MiB "
            f"each), the largest plan of a request up to max_prompt_tokens={cfg.max_prompt_tokens} and "
            f"max_new_tokens={cfg.max_new_tokens}: ")
    if self.kept_whole:
      return head + (f"every request kept whole ({cfg.method} at budget {cfg.token_budget} would hold at least "
                     f"full's bytes for such a request), attended densely: {c.cache_spec()}")
    return head + f"{c.cache_spec()}; each request runs the plan of its own length"

  @property
  def kept_whole(self) -> bool:
    """Whether the slots keep every request whole (`plan_static`: the method's largest plan would hold at least
    full's bytes), so `method_config` is full's."""
    return self.method_config.method != self.config.method

  def slot_bytes(self) -> int:
    """Device bytes one slot holds: its cache rows and its logits row (from shapes: nothing is allocated)."""
    logits, caches = self.prefill_shapes
    return cache_nbytes(caches) + math.prod(logits.shape) * np.dtype(logits.dtype).itemsize

  def plan(self, n_prompt: int, max_tokens: int):
    """The `RowPlan` (batch 1) of a request of n_prompt tokens and max_tokens new ones under the engine's
    config. Raises ValueError naming the value when the paper's plan for that length is invalid."""
    return plan_rows(self.method_config.method, token_budget=self.config.token_budget, prompt_lens=[n_prompt],
                     max_new_tokens=max_tokens, head_dim=self.model.config.head_dim,
                     max_len=self.model.config.max_len, config=self.method_config, **self._overrides).rows

  @property
  def max_model_len(self) -> int:
    """The most prompt + new tokens a request may have (vLLM's max_model_len, what the server's /v1/models
    advertises): max_prompt_tokens + max_new_tokens, which a prompt of max_prompt_tokens reaches with
    max_new_tokens new tokens."""
    return self.config.max_prompt_tokens + self.config.max_new_tokens

  def max_tokens_for(self, n_prompt: int) -> int:
    """The most new tokens a prompt of n_prompt tokens (1 .. max_prompt_tokens) may ask for: max_model_len -
    n_prompt when the plan of that request fits the slots, else the most whose plan fits, at least max_new_tokens
    (what the slots are planned for). A method whose cache grows with the sequence (full, hsa, quest, exact_topk:
    slots of max_model_len tokens) takes max_model_len - n_prompt after any prompt; one that keeps a budget of the
    prompt plus room for new tokens (snapkv, rocketkv: `prompt_budget + max_new_tokens` slots) takes
    max_new_tokens. Found by bisection over `plan` (fits or raises), once per prompt length; safe from any thread
    (a function of the config)."""
    got = self._max_tokens.get(n_prompt)
    if got is not None:
      return got

    def fits(m: int) -> bool:
      try:
        self.plan(n_prompt, m)
      except ValueError:
        return False
      return True

    lo, hi = min(self.config.max_new_tokens, self.max_model_len - n_prompt), self.max_model_len - n_prompt
    if fits(hi):
      lo = hi
    while hi - lo > 1:  # lo fits (the slots' own limits), hi does not
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    self._max_tokens[n_prompt] = lo
    return lo

  def bucket(self, n_tokens: int) -> int:
    """The padded prompt length a prompt of n_tokens is prefilled at."""
    for b in self.config.prefill_buckets:
      if b >= n_tokens:
        return b
    raise ValueError(f"prompt of {n_tokens} tokens exceeds max_prompt_tokens={self.config.max_prompt_tokens}")

  def chunks(self, m: int, start: int = 0) -> list[int]:
    """Sizes of the chunks m new prompt tokens (at positions start ..) are prefilled in (`chunk_sizes`)."""
    return chunk_sizes(self.model.config, self.config.prefill_chunk_tokens, self.method_config.prompt_queries, m,
                       start)

  def chunk_slot(self, p: int) -> tuple[int, int]:
    """(start, size) of the chunk grid's slot that holds position p (`chunk_slot`)."""
    return chunk_slot(self.model.config, self.config.prefill_chunk_tokens, p)

  # ------------------------------------------------------------------ placement and compiled pieces

  def _sharding(self, shape, batch: bool = False, heads: bool = False) -> NamedSharding:
    spec = cache_spec(shape, self.mesh, 1 if heads else None) if batch else PartitionSpec()
    return NamedSharding(self.mesh, spec)

  def place(self, x, batch: bool = False, heads: bool = False):
    """x on the engine's mesh (`cache_spec`): slot rows over "data" (`batch`), KV heads (axis 1) over "model"
    (`heads`), else replicated; unchanged without a mesh."""
    if self.mesh is None:
      return x
    return jax.device_put(x, self._sharding(x.shape, batch, heads))

  def place_rows(self, tree):
    """A pytree of per-row host arrays [max_slots, ...] on the device, rows split as the slots are."""
    return jax.tree.map(lambda x: self.place(jnp.asarray(x), batch=True), tree)

  def _keep_placement(self, logits, caches):
    """The batched logits and caches put back where the engine keeps them (with a mesh, XLA may return a call's
    outputs partitioned otherwise than its inputs, and every executable expects the engine's placement)."""
    if self.mesh is None:
      return logits, caches
    return jax.tree.map(lambda x, s: x if x.sharding == s else jax.device_put(x, s), (logits, caches),
                        self._placement)

  def _compiled(self, key, lower):
    say = self.compile_log
    if say is None or key in self._executables:
      return self._executables.get(key, lower)
    name = program_name(key)
    say(f"compiling {name}")
    t0 = time.perf_counter()
    exe = self._executables.get(key, lower)
    say(f"compiled {name} ({time.perf_counter() - t0:.1f}s)")
    return exe

  # ------------------------------------------------------------------ prefill (batch 1)

  def prefill(self, prompt_ids: Sequence[int], rows, *, scored: bool = False) -> Prefilled:
    """A plain prefill of a prompt at its bucket (no history read or written), under its plan `rows`
    (`plan`); scored: the scoring prefill (its own executable per bucket), whose `.scores` hold MAX_LOGPROBS
    tokens per position."""
    n = len(prompt_ids)
    T = self.bucket(n)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = prompt_ids
    lengths = np.array([n], np.int32)
    tokens, lengths = self.place(jnp.asarray(tokens)), self.place(jnp.asarray(lengths))
    score = MAX_LOGPROBS if scored else None
    exe = self._compiled(("prefill", T) if score is None else ("prefill_scored", T), lambda: llama.prefill_jit.lower(
        self._graphdef, self._state, tokens, lengths, rows, config=self.method_config, score=score))
    out = exe(self._state, tokens, lengths, rows)
    return Prefilled(out[0], out[1], scores=out[2] if scored else None)

  def buffers(self, view, S: int) -> list:
    """The per-layer (K, V) buffers [1, S, K, H] on the device that a chunked prefill writes into: a stored
    history's view (`HistoryStore.view`; None for a layer it does not hold) copied once, zeros elsewhere."""
    cfg = self.model.config
    zeros = lambda: self.place(jnp.zeros((1, S, cfg.n_kv_heads, cfg.head_dim), self.model.dtype))  # noqa: E731
    return [tuple(jax.device_put(x) for x in h) if h is not None else (zeros(), zeros()) for h in view]

  def prefill_chunk(self, chunk_ids: Sequence[int], buffers: list, start: int, size: int | None = None) -> list:
    """`buffers` (`buffers`, [1, S, K, H] per layer) with the K/V of chunk_ids, the prompt's tokens from
    position `start`, written in (`models.llama.prefill_chunk`); one executable per (S, chunk length). size: the
    chunk length to run at (>= len(chunk_ids); default that): the padding's K/V land past the chunk, where the
    next chunk writes (and past the prompt, the lengths mask them)."""
    cfg, C = self.model.config, size or len(chunk_ids)
    S = buffers[0][0].shape[1]

    def run_chunk(graphdef, state, *args):
      exe = self._compiled(("chunk", S, C), lambda: llama.prefill_chunk_layer_jit.lower(graphdef, state, *args,
                                                                                          cfg=cfg))
      return exe(state, *args)

    tokens = np.zeros((1, C), np.int32)
    tokens[0, :len(chunk_ids)] = chunk_ids
    return llama.prefill_chunk(self.model, tokens, buffers, np.array([start], np.int32), run_layer=run_chunk,
                               layers=self._layers)

  def prefill_extend(self, new_ids: Sequence[int], history: list, start: int, S: int, rows, *,
                     after_chunks: bool = False):
    """The prompt's last new_ids (from position `start`) prefilled over the K/V before them (`history`: a
    stored history's view or chunk `buffers`, per layer), then the whole prompt compressed under its plan
    `rows` (`models.llama.prefill_extend`): (its Prefilled, the new tokens' per-layer (K, V) [1, T, K, H]).
    S: the whole prompt's bucket. The new tokens are padded to their bucket, or after chunks (at most
    prefill_chunk_tokens + prompt_queries of them) to a power of two >= MIN_BUCKET: a 32k bucket would prefill
    the padding."""
    m, cfg = len(new_ids), self.model.config
    T = min(S, max(MIN_BUCKET, 1 << (m - 1).bit_length())) if after_chunks else self.bucket(m)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :m] = new_ids

    def run_layer(graphdef, state, *args):
      exe = self._compiled(("extend", S, T), lambda: llama.prefill_extend_layer_jit.lower(
          graphdef, state, *args, cfg=cfg, config=self.method_config))
      return exe(state, *args)

    logits, caches, new_kv = llama.prefill_extend(self.model, tokens, np.array([m], np.int32), history,
                                                  np.array([start], np.int32), self.method_config, seq_len=S,
                                                  run_layer=run_layer, rows=rows, layers=self._layers)
    return Prefilled(logits, caches), new_kv

  def prefill_chunked(self, prompt_ids: Sequence[int], view: list, start: int, rows, *, keep_kv: bool = True):
    """A prompt's prefill over the K/V of its first `start` tokens (`view`: per layer (K, V) [1, S, K, H] with S
    the prompt's bucket, as `HistoryStore.view` gives them, or None per layer when start is 0), in `chunks`: a
    generator that yields (tokens the chunk prefilled, None) after each chunk but the last (each chunk writes its
    K/V into the `buffers`), then (the last chunk's tokens, (Prefilled, new_kv)): the last chunk runs
    `prefill_extend` over the buffers, which compresses the whole prompt under its plan `rows`. new_kv: per layer
    (K, V) [1, >= n - start, K, H], the K/V of the prompt's tokens from `start` on (what a history stores), when
    keep_kv."""
    ids = list(prompt_ids)
    n = len(ids)
    S = self.bucket(n)
    chunks, done = self.chunks(n - start, start), start
    history = view
    if len(chunks) > 1:  # the stored history on the device once, then each chunk written into it
      history = self.buffers(view, S)
      for c in chunks[:-1]:  # each at its grid slot's size (one executable per size: `chunk_sizes`)
        history = self.prefill_chunk(ids[done:done + c], history, done, size=self.chunk_slot(done)[1])
        done += c
        yield c, None
    m = n - done
    p, new_kv = self.prefill_extend(ids[done:], history, done, S, rows, after_chunks=done > start)
    if keep_kv and done > start:  # the chunks' K/V are in the buffers, the last chunk's in new_kv
      new_kv = [tuple(jnp.concatenate([h[:, start:done], x[:, :m]], axis=1) for h, x in zip(hist, kv))
                for hist, kv in zip(history, new_kv)]
    yield m, (p, new_kv if keep_kv else None)

  def feed(self, logits_1V, caches, tokens: Sequence[int]):
    """(logits, caches) after feeding `tokens` through decode steps (batch 1; the one decode loop with teacher
    forcing, in calls of power-of-two lengths: one compile per length used). The caches are donated."""
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
      n = 1 << ((len(tokens) - i).bit_length() - 1)
      forced = np.asarray([tokens[i:i + n]], np.int32)
      loop = LoopConfig(max_new_tokens=n, carry_logits=True)
      args = (self._state, logits_1V, caches, forced, None, None)
      exe = self._compiled(("feed", n), lambda: decode_loop_jit.lower(
          self._graphdef, *args, config=self.method_config, loop=loop))
      out = exe(*args)
      logits_1V, caches = out.logits_BV, out.caches
      i += n
    return logits_1V, caches

  # ------------------------------------------------------------------ insert and generate (the batch)

  def insert(self, state: DecodeState, prefilled, slot: int, *, prompt_ids: Sequence[int] | None = None
             ) -> DecodeState:
    """`state` (donated) with row `slot` replaced by a prefill's (logits, caches). prompt_ids: for a processed
    row, the tokens its repetition penalty counts as its prompt (a context's included): its processing row is
    restarted (no output tokens counted, those tokens marked); the processing state is made on first use."""
    logits, caches = prefilled[0], prefilled[1]
    slot_j = np.int32(slot)
    exe = self._compiled(("insert",), lambda: insert_jit.lower(state.caches, state.logits_BV, caches, logits, slot_j))
    new_caches, new_logits = exe(state.caches, state.logits_BV, caches, logits, slot_j)
    new_logits, new_caches = self._keep_placement(new_logits, new_caches)
    processing = state.processing
    if prompt_ids is not None:
      B, V = self.config.max_slots, self.model.config.vocab_size
      if processing is None:
        processing = (self.place(jnp.zeros((B, V), jnp.int32), batch=True),
                      self.place(jnp.zeros((B, V), bool), batch=True))
      mask = np.zeros((1, V), bool)
      mask[0, list(prompt_ids)] = True
      mask = self.place(jnp.asarray(mask), batch=True)
      exe = self._compiled(("reset_row",), lambda: reset_row_jit.lower(*processing, mask, slot_j))
      processing = exe(*processing, mask, slot_j)
    return DecodeState(logits_BV=new_logits, caches=new_caches, processing=processing)

  def generate(self, state: DecodeState, finished_B, sampling: RowSampling, process: RowProcessing | None = None):
    """Queues one decode call (every row not `finished_B` advances by steps_per_call tokens) and returns at once:
    (the next DecodeState, the call's tokens [B, steps_per_call] (-1 for finished rows), and (token_logprobs,
    top_ids, top_logprobs) of the processing kind or None), on the device; `state` is donated.

    sampling: every row's `RowSampling` as host arrays [B]. process: the rows' `RowProcessing` (`place_rows`;
    its counts and prompt_mask are ignored: the state's are used), or None when no row is processed. The
    executable is chosen here from them, on the host (the loop has no data-dependent branch): every row greedy
    (the plain argmax loop), sampling without cuts, sampling with top-p / top-k cuts, or any row processed
    (cuts, processing and MAX_LOGPROBS logprobs per token)."""
    temperature, top_p, top_k = (np.asarray(x) for x in (sampling.temperature, sampling.top_p, sampling.top_k))
    rows = sampling
    if process is not None:
      counts, mask = state.processing
      process = process._replace(counts=counts, prompt_mask=mask)
      loop, kind = dataclasses.replace(self.loop, top_logprobs=MAX_LOGPROBS), "processed"
    elif not (temperature > 0).any():
      rows, loop, kind = None, self.loop, "greedy"
    else:
      cut = bool(((temperature > 0) & ((top_p < 1) | (top_k > 0))).any())
      loop, kind = dataclasses.replace(self.loop, cut_rows=cut), ("cut" if cut else "sample")
    args = (self._state, state.logits_BV, state.caches, None, finished_B, rows, process)
    exe = self._compiled(("decode", kind), lambda: decode_loop_jit.lower(
        self._graphdef, *args, config=self.method_config, loop=loop))
    out = exe(*args)
    logits, caches = self._keep_placement(out.logits_BV, out.caches)
    if process is None:
      return DecodeState(logits_BV=logits, caches=caches, processing=state.processing), out.tokens, None
    processing = (out.counts, state.processing[1])
    return (DecodeState(logits_BV=logits, caches=caches, processing=processing), out.tokens,
            (out.token_logprobs, out.top_ids, out.top_logprobs))
