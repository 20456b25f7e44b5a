"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (each with `stream: true` as server-sent events), `/health`, `/metrics`, and vLLM's
`/version`, `/tokenize` (`{"prompt": str}` or `{"messages": [...]}` -> `{"tokens", "count", "max_model_len"}`) and
`/detokenize` (`{"tokens": [...]}` -> `{"prompt": str}`).

Text exists only here and in the engine's detokenizer: a request is parsed and checked, its prompt encoded
(chat through the tokenizer's chat template), and handed to the engine thread (`runner.py`) as token ids;
events come back through an asyncio queue per HTTP request.

OpenAI semantics kept: `temperature` and `top_p` default to 1 (unless the checkpoint's generation_config.json
sets them: then its values, as vLLM does), `n` must be 1, `stop` is a string or a list,
errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx status (429 when the engine's queue
is full, 503 while shutting down). Extensions: `top_k` (0 or -1 = off, at most the vocabulary size) and
`stop_token_ids`. Departure: `seed` defaults to 0, so the same request gets the same answer (OpenAI draws a
fresh seed); pass a seed to vary samples.

Nothing that changes sampling is ignored: every such field (OpenAI's and vLLM's, `UNSUPPORTED`) is accepted only
at its neutral value, else 400 `unsupported_parameter` naming it; other unknown fields are accepted. Every value
is range-checked in one place (`SamplingParams` and `Engine.validate`, run when the request is submitted) so a
bad value fails its own request with a 400, never the engine step shared with others. A body that is not JSON,
nests too deep or has a wrong type anywhere is a 400; one over `max_body_bytes` a 413; a POST whose Content-Type
is not `application/json` a 415 (this refuses the browsers' CORS "simple requests"). No CORS headers are sent.

Access: with `api_key` set, every route but `/health` and `/version` needs `Authorization: Bearer KEY` (else 401).
A request that arrives on a loopback address (a server bound to 127.0.0.1, the default) must name a loopback
host in `Host` (localhost, 127.0.0.1, [::1], any port, or one of `allowed_hosts`), and its `Origin`, when sent,
must be one too: else 403 (a defence against DNS rebinding and cross-site requests from a browser).
Prompts are tokenized in a worker thread, so a large prompt does not stall `/health` or the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import time
import urllib.parse
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rocketkv_jax.models.generate import stop_ids as model_stop_ids

from .engine import QueueFull, Request, SamplingParams
from .runner import Aborted, EngineRunner, Failed, ShuttingDown

__all__ = ["APIError", "ServerConfig", "UvicornServer", "create_app", "request_sampling", "warm_up"]

log = logging.getLogger("rocketkv_jax.serving")

DEFAULT_SEED = 0               # see the module docstring
COMPLETIONS_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
# Fields we accept only at their neutral value (anything else is a 400 naming the field).
UNSUPPORTED = {
    # OpenAI
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]),
    # vLLM's sampling extensions
    "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0), "min_p": (None, 0, 0.0),
    "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False), "early_stopping": (None, False),
    "ignore_eos": (None, False), "bad_words": (None, []), "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "prompt_logprobs": (None,), "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "typical_p": (None, 1, 1.0),
    "echo_prompt": (None, False), "continue_final_message": (None, False), "add_generation_prompt": (None, True),
}
MAX_BODY_BYTES = 8 * 2**20
LOOPBACK_NAMES = ("localhost",)


class APIError(Exception):
  """An error the client gets as OpenAI's error object."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
    self.headers = headers

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
  """model_name: the id `/v1/models` lists and requests must name. drain_s: on shutdown, how long requests in
  flight may run to their end before they are aborted. warmup: before accepting requests, compile every
  prefill bucket and decode kind so no client waits for a compile (`warm_up`). history_dir: where the engine's prompt
  histories (sessions) are loaded from at start-up, when there, and saved to atomically every
  `--sessions-save-s` seconds (on the engine thread) and at shutdown (needs an engine with history; a file saved
  for another model, or one whose segment table does not match its arrays, is refused at start-up). api_key: when set, the bearer token every
  route but /health and /version needs. max_body_bytes: larger request bodies get 413. allowed_hosts: host
  names accepted in Host / Origin on a loopback connection besides the loopback ones (a local reverse proxy's)."""

  model_name: str
  drain_s: float = 10.0
  warmup: bool = False
  history_dir: str | None = None
  api_key: str | None = None
  max_body_bytes: int = MAX_BODY_BYTES
  allowed_hosts: tuple[str, ...] = ()


def warm_up(engine, log=None) -> float:
  """Compiles every piece a request can reach before serving, so no client waits for a compile: one 1-token
  request per prefill bucket (a prompt of the bucket's length: its prefill and the insert), then one request
  per decode kind (greedy; sampling; sampling with top-p / top-k cuts), each long enough for a decode call. The
  history it made is cleared and the engine's counters zeroed, so /metrics counts client traffic only. Not
  compiled ahead: a history's extend prefill (one per history/question length pair, with sessions) and a
  context's feed lengths (library `contexts`, not served). Call before the engine thread starts. Returns the
  seconds taken."""
  t0 = time.perf_counter()

  def run(request_id, prompt, sampling, what):
    engine.submit(Request(request_id=request_id, prompt_ids=prompt, sampling=sampling))
    while engine.has_work():
      engine.step()
    if log:
      log(f"warm-up: {what} compiled ({time.perf_counter() - t0:.1f}s)")

  buckets = getattr(engine.config, "prefill_buckets", None) or (1,)
  for i, b in enumerate(buckets):  # prompts with distinct first tokens: none reuses another's history
    run(f"warmup-{b}", [i] * b, SamplingParams(max_tokens=1), f"prompt bucket {b}")
  n = getattr(engine.config, "steps_per_call", 1) + 1  # the first token comes from the prefill
  kinds = (("greedy", SamplingParams(max_tokens=n)), ("sampling", SamplingParams(max_tokens=n, temperature=1.0)),
           ("top-p / top-k cuts", SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9)))
  for j, (what, sampling) in enumerate(kinds):
    run(f"warmup-decode-{j}", [len(buckets) + j] * buckets[0], sampling, f"decode ({what})")
  if getattr(engine, "history", None) is not None:
    engine.history.clear()
  engine.reset_counters()
  return time.perf_counter() - t0


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("rocketkv-jax")
  except PackageNotFoundError:
    return "unknown"


# --- parsing -------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _field(body: dict, name: str, kind: str, default):
  v = body.get(name)
  if v is None:
    return default
  ok = {"int": _is_int, "num": _is_num, "bool": lambda x: isinstance(x, bool)}[kind](v)
  if not ok:
    want = {"int": "an integer", "num": "a number", "bool": "a boolean"}[kind]
    raise APIError(400, f"{name}={v!r} must be {want}", param=name, code="invalid_type")
  return v


def _too_big(max_bytes: int) -> APIError:
  return APIError(413, f"the request body exceeds {max_bytes} bytes (--max-body-mb)", code="request_too_large")


async def _read_body(request: HttpRequest, max_bytes: int) -> bytes:
  """The body of a JSON POST: 415 unless the Content-Type is application/json, 413 past max_bytes (from
  Content-Length, before reading, and while reading)."""
  ctype = request.headers.get("content-type", "")
  if ctype.split(";")[0].strip().lower() != "application/json":
    raise APIError(415, f"Content-Type must be application/json, not {ctype!r}", code="unsupported_media_type")
  length = request.headers.get("content-length")
  if length is not None:
    if not length.isdigit():
      raise APIError(400, f"Content-Length={length!r} is not a byte count", code="invalid_request")
    if int(length) > max_bytes:
      raise _too_big(max_bytes)
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > max_bytes:
      raise _too_big(max_bytes)
    chunks.append(chunk)
  return b"".join(chunks)


def _parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except RecursionError:
    raise APIError(400, "malformed JSON in the request body: nested too deep", code="invalid_json") from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
    raise APIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
  return body


async def _json_body(request: HttpRequest, max_bytes: int) -> dict:
  raw = await _read_body(request, max_bytes)
  return await asyncio.to_thread(_parse_json, raw)


def _host_name(host: str) -> str:
  """`Host` or an origin's host without port or brackets, lower case: '[::1]:80' -> '::1'."""
  host = host.strip().lower()
  if host.startswith("["):
    return host[1:host.find("]")] if "]" in host else host
  if host.count(":") == 1:
    host = host.split(":")[0]
  return host.rstrip(".")


def _is_loopback(host: str) -> bool:
  if host in LOOPBACK_NAMES:
    return True
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    return False
  ip = getattr(ip, "ipv4_mapped", None) or ip
  return ip.is_loopback


class _Guard:
  """ASGI middleware, before routing: on a loopback connection, Host and Origin must be loopback (403); with an
  API key, every route but /health and /version needs it (401). Pure ASGI: streams and disconnects pass as is."""

  OPEN = ("/health", "/version")

  def __init__(self, app, *, api_key: str | None, allowed_hosts: tuple[str, ...], counters: "_Metrics"):
    self.app, self.counters = app, counters
    self.api_key = api_key.encode() if api_key else None
    self.allowed = {_host_name(h) for h in allowed_hosts}

  def _ok_host(self, host: str) -> bool:
    name = _host_name(host)
    return _is_loopback(name) or name in self.allowed

  def check(self, scope) -> APIError | None:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
    server = scope.get("server")
    if server and _is_loopback(_host_name(str(server[0]))):
      host = headers.get("host", "")
      if not self._ok_host(host):
        return APIError(403, f"Host {host!r} is not allowed: this server is bound to a loopback address "
                        f"(allow a name with --allowed-host)", type="permission_error", code="host_not_allowed")
      origin = headers.get("origin")
      if origin is not None and not self._ok_host(urllib.parse.urlsplit(origin).netloc or origin):
        return APIError(403, f"Origin {origin!r} is not allowed: cross-site requests are refused",
                        type="permission_error", code="origin_not_allowed")
    if self.api_key is not None and scope.get("path") not in self.OPEN:
      auth = headers.get("authorization", "").encode("latin-1")
      if not hmac.compare_digest(auth, b"Bearer " + self.api_key):
        return APIError(401, "a valid API key is required: send `Authorization: Bearer KEY`",
                        type="invalid_request_error", code="invalid_api_key")
    return None

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      err = self.check(scope)
      if err is not None:
        self.counters.error(err.status)
        return await err.response()(scope, receive, send)
    await self.app(scope, receive, send)


def _param_of(message: str, prompt_param: str) -> str | None:
  """The request field an engine ValueError names (its messages start with `name=` or mention it)."""
  if message.startswith("stop_ids"):
    return "stop_token_ids"
  for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_strings", "stop"):
    if name in message:
      return "stop" if name.startswith("stop") else name
  return prompt_param if "prompt" in message else None


def _stop(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  items = [stop] if isinstance(stop, str) else stop
  if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
    raise APIError(400, f"stop={stop!r} must be a string or a list of strings", param="stop", code="invalid_type")
  if len(items) > MAX_STOP_STRINGS:
    raise APIError(400, f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}", param="stop")
  if any(not s for s in items):
    raise APIError(400, "stop strings must not be empty", param="stop")
  return tuple(items)


def _unsupported(body: dict) -> None:
  for name, neutral in UNSUPPORTED.items():
    v = body.get(name)
    if v is not None and not any(v == x and type(v) is type(x) for x in neutral if x is not None):
      raise APIError(400, f"{name}={v!r} is not supported by this server", param=name, code="unsupported_parameter")
  n = body.get("n")
  if n is not None and (not _is_int(n) or n != 1):
    raise APIError(400, f"n={n!r} is not supported: only n=1", param="n", code="unsupported_parameter")


def request_sampling(body: dict, *, default_max_tokens: int, stop_ids: tuple[int, ...], chat: bool,
              defaults: dict | None = None) -> SamplingParams:
  """The request's sampling; a field it leaves out takes the checkpoint's generation default (`defaults`:
  generation_config.json's temperature / top_p / top_k, as vLLM does), else OpenAI's (1, 1, off)."""
  _unsupported(body)
  defaults = defaults or {}
  max_tokens = _field(body, "max_completion_tokens", "int", None) if chat else None
  if max_tokens is None:
    max_tokens = _field(body, "max_tokens", "int", default_max_tokens)
  if max_tokens <= 0:
    raise APIError(400, f"max_tokens={max_tokens} must be >= 1", param="max_tokens", code="invalid_value")
  temperature = _field(body, "temperature", "num", defaults.get("temperature", 1.0))
  top_p = _field(body, "top_p", "num", defaults.get("top_p", 1.0))
  top_k = _field(body, "top_k", "int", defaults.get("top_k", 0))
  seed = _field(body, "seed", "int", DEFAULT_SEED)
  if top_k == -1:  # vLLM's off
    top_k = 0
  extra = body.get("stop_token_ids") or []
  if not isinstance(extra, list) or not all(_is_int(t) for t in extra):
    raise APIError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids", code="invalid_type")
  # ranges are checked by SamplingParams here and Engine.validate at submission: one place, not two copies
  try:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop_ids=tuple(stop_ids) + tuple(extra), stop_strings=_stop(body))
  except (ValueError, TypeError) as e:
    raise APIError(400, str(e), param=_param_of(str(e), "prompt"), code="invalid_value") from None


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
  """`prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists."""
  p = body.get("prompt")
  bad = APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                 param="prompt", code="invalid_type")
  if isinstance(p, str):
    prompts = [p]
  elif isinstance(p, list) and p and all(_is_int(t) for t in p):
    prompts = [p]
  elif isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and all(_is_int(t) for t in x))
                                         for x in p):
    prompts = p
  else:
    raise bad
  out = []
  for x in prompts:
    ids = tokenizer.encode(x) if isinstance(x, str) else list(x)
    if not ids:
      raise APIError(400, "prompt encodes to no tokens", param="prompt", code="invalid_value")
    if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
      raise APIError(400, f"prompt token ids must lie in [0, {tokenizer.vocab_size})", param="prompt",
                     code="invalid_value")
    out.append(ids)
  return out


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_prompt(body: dict, tokenizer) -> list[int]:
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise APIError(400, "messages must be a non-empty list", param="messages", code="invalid_type")
  rendered = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in _ROLES:
      raise APIError(400, f"messages[{i}] must be an object with role one of {sorted(_ROLES)}",
                     param=f"messages[{i}]", code="invalid_value")
    content = m.get("content")
    if content is None:
      content = ""
    elif isinstance(content, list):  # content parts: text only
      if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
        raise APIError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content",
                       code="invalid_value")
      content = "".join(c["text"] for c in content)
    elif not isinstance(content, str):
      raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                     param=f"messages[{i}].content", code="invalid_type")
    rendered.append({"role": _ROLES[m["role"]], "content": content})
  ids = tokenizer.encode(tokenizer.apply_chat(rendered))
  if not ids:
    raise APIError(400, "messages encode to no tokens", param="messages", code="invalid_value")
  return ids


class _ClientGone(Exception):
  """The client of a non-streaming request disconnected; its requests are aborted."""


class _EventStream(StreamingResponse):
  """Server-sent events that call `on_close` when the response ends for any reason, including a client
  that left before the first chunk (the body generator never started, so its `finally` never runs)."""

  media_type = "text/event-stream"

  def __init__(self, content, *, on_close):
    super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self.on_close = on_close

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.on_close()


# --- the app -------------------------------------------------------------------------------------------------


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


# name: (type, help) for the engine's stats; other numeric stats are exported as untyped gauges.
_METRICS = {
    "queue_depth": ("gauge", "Requests waiting for a slot."),
    "active_slots": ("gauge", "Slots decoding a request."),
    "max_slots": ("gauge", "Slots of the engine."),
    "in_flight": ("gauge", "Requests held by the engine (queued or decoding)."),
    "tokens_generated": ("counter", "Tokens generated since start-up (warm-up excluded)."),
    "tokens_per_s": ("gauge", "Generated tokens per second over the last 10 s."),
    "kv_bytes_device": ("gauge", "Bytes of KV cache held on the device."),
    "kv_bytes_host": ("gauge", "Bytes of KV history (sessions) held in host memory."),
    "kv_bytes_disk": ("gauge", "Bytes of KV history spilled to disk."),
    "history_segments": ("gauge", "Stored prompt histories (prefix-tree segments)."),
    "prompt_tokens_reused": ("counter", "Prompt tokens taken from the history or a context, not prefilled."),
    "prompt_tokens_prefilled": ("counter", "Prompt tokens prefilled."),
    "compiles": ("counter", "XLA compilations the engine has run (warm-up included)."),
}
# latency histograms' bucket bounds (seconds), as vLLM's
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)


class _Metrics:
  """The server's Prometheus metrics (prometheus_client, one registry per app): request outcomes and HTTP errors
  (counters), time to first token, time per output token, end-to-end latency and queue time (histograms,
  labelled by model_name), and the engine's stats read at scrape time."""

  def __init__(self, model_name: str, stats):
    from prometheus_client import CollectorRegistry, Counter, Histogram
    self.registry = CollectorRegistry()
    self.model_name, self._stats = model_name, stats
    label = ["model_name"]
    self.requests = Counter("rocketkv_requests", "Finished requests by outcome.", ["outcome"], registry=self.registry)
    self.errors = Counter("rocketkv_http_errors", "Error responses by status.", ["status"], registry=self.registry)
    self.ttft = Histogram("rocketkv_time_to_first_token_seconds", "From arrival to the first generated token.",
                          label, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
    self.tpot = Histogram("rocketkv_time_per_output_token_seconds", "Mean time per output token after the first.",
                          label, buckets=_TPOT_BUCKETS, registry=self.registry).labels(model_name)
    self.e2e = Histogram("rocketkv_e2e_request_latency_seconds", "From arrival to the last token.", label,
                         buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
    self.queue = Histogram("rocketkv_request_queue_time_seconds", "Time a request waited for a slot.", label,
                           buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
    self.registry.register(self)  # the engine's stats, collected at scrape time

  def done(self, outcome: str) -> None:
    self.requests.labels(outcome).inc()

  def error(self, status: int) -> None:
    self.errors.labels(str(status)).inc()

  def timer(self):
    """A per-HTTP-request timer: `seen(i, event)` for every engine event of its i-th prompt."""
    return _Timer(self)

  def describe(self):
    return []

  def collect(self):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    stats = self._stats()
    for key, value in stats.items():
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      kind, help_ = _METRICS.get(key, ("gauge", f"engine stat {key}."))
      family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
      yield family(f"rocketkv_{key}", help_, value=value)
    yield GaugeMetricFamily("rocketkv_engine_alive", "1 while the engine thread runs.",
                            value=int(bool(stats.get("alive"))))

  def text(self) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(self.registry)


class _Timer:
  def __init__(self, metrics: _Metrics):
    self.m, self.t0, self.first = metrics, time.monotonic(), {}

  def seen(self, i: int, ev) -> None:
    now = time.monotonic()
    if i not in self.first and ev.completion_tokens > 0:
      self.first[i] = now
      self.m.ttft.observe(now - self.t0)
    if ev.finished and ev.finish_reason != "abort":
      self.m.e2e.observe(now - self.t0)
      self.m.queue.observe(ev.queued_s)
      if ev.completion_tokens > 1 and i in self.first:
        self.m.tpot.observe((now - self.first[i]) / (ev.completion_tokens - 1))


def create_app(engine, model, tokenizer, config: ServerConfig, *, runner: EngineRunner | None = None,
               sessions=None) -> FastAPI:
  """The FastAPI app serving `engine` (built over `model` and `tokenizer`). Its lifespan starts the engine
  thread and, on shutdown, aborts whatever is still in flight and stops the thread. Sessions: `sessions`, an
  opened `sessions.SessionsDir` (the CLI's), else one opened on config.history_dir (locked, loaded at start-up,
  saved every 60 s on the engine thread and at shutdown, released at shutdown)."""
  runner = runner or EngineRunner(engine)
  counters = _Metrics(config.model_name, runner.stats)
  created = int(time.time())
  eng_cfg = getattr(engine, "config", None)
  max_prompt = getattr(eng_cfg, "max_prompt_tokens", None)
  max_new = getattr(eng_cfg, "max_new_tokens", 256)
  stops = {False: model_stop_ids(model, tokenizer, False), True: model_stop_ids(model, tokenizer, True)}

  # --- sessions (sessions.py) ---
  history_dir = sessions.path if sessions is not None else config.history_dir
  if history_dir is not None and getattr(engine, "history", None) is None:
    raise ValueError(f"history_dir={history_dir!r} needs an engine that keeps history (EngineConfig.history_bytes)")
  own_sessions = sessions is None and history_dir is not None
  if own_sessions:
    from .sessions import SessionsDir
    sessions = SessionsDir(history_dir)
  if sessions is not None:  # on the engine thread, between steps: never racing the engine's own changes
    runner.every(sessions.save_every_s, lambda: sessions.save(engine))
  app_sessions = sessions
  # --- end sessions ---

  @contextlib.asynccontextmanager
  async def lifespan(app):
    if config.warmup:  # before the engine thread starts: this thread is the only one touching the engine
      await asyncio.to_thread(warm_up, engine, log.info)
    if app_sessions is not None:
      try:
        n = await asyncio.to_thread(app_sessions.load, engine)
      except BaseException:  # refused (sessions.py logged why): the app does not start
        if own_sessions:
          app_sessions.close()
        raise
      log.info(f"sessions: loaded {n} stored prompt histories from {app_sessions.path}")
    runner.start()
    try:
      yield
    finally:
      await asyncio.to_thread(runner.shutdown)
      if app_sessions is not None:  # the engine thread has stopped: nothing else touches the histories
        await asyncio.to_thread(app_sessions.save, engine)
        if own_sessions:
          app_sessions.close()

  app = FastAPI(title="rocketkv-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(_Guard, api_key=config.api_key, allowed_hosts=config.allowed_hosts, counters=counters)
  app.state.runner = runner
  app.state.sessions = app_sessions
  app.state.counters = counters

  @app.exception_handler(APIError)
  async def _api_error(request, exc: APIError):
    counters.error(exc.status)
    return exc.response()

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, exc: StarletteHTTPException):
    counters.error(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None).response()

  @app.exception_handler(Exception)
  async def _internal(request, exc: Exception):
    log.exception("unhandled error")
    counters.error(500)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

  def log_turn(request_id: str, ev) -> None:
    """The per-turn report: prompt tokens reused vs prefilled, KV bytes on the device (this request's slot)
    and on the host (every stored history)."""
    st = runner.stats()
    per_slot = st.get("kv_bytes_device", 0) // max(1, st.get("max_slots", 1))
    log.info(f"{request_id}: prompt {ev.prompt_tokens} tokens ({ev.cached_tokens} reused, "
             f"{ev.prompt_tokens - ev.cached_tokens} prefilled), {ev.completion_tokens} generated "
             f"({ev.finish_reason}); KV on device {per_slot / 2**20:.1f} MiB per slot, history on host "
             f"{st.get('kv_bytes_host', 0) / 2**20:.1f} MiB")

  def check_model(body: dict) -> None:
    name = body.get("model")
    if name is None:
      raise APIError(400, "model is required", param="model", code="missing_required_parameter")
    if not isinstance(name, str):
      raise APIError(400, f"model={name!r} must be a string", param="model", code="invalid_type")
    if name != config.model_name:
      raise APIError(404, f"The model `{name}` does not exist; this server serves `{config.model_name}`",
                     param="model", code="model_not_found")

  def check_prompt(ids: list[int], param: str) -> None:
    if max_prompt is not None and len(ids) > max_prompt:
      raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {max_prompt} "
                     f"(--max-prompt-tokens)", param=param, code="context_length_exceeded")

  async def submit_all(request_ids, prompts, sampling, prompt_param):
    """Submits each prompt; on a refusal aborts the ones already in and raises the APIError."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    done = []
    for i, (rid, ids) in enumerate(zip(request_ids, prompts)):
      sink = lambda item, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, item))  # noqa: E731
      try:
        await asyncio.wrap_future(runner.submit(Request(request_id=rid, prompt_ids=ids, sampling=sampling), sink))
      except BaseException as e:
        for r in done:
          runner.abort(r)
        if isinstance(e, QueueFull):
          raise APIError(429, f"the server is at capacity ({e or 'queue full'}); retry later",
                         type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        if isinstance(e, ShuttingDown):
          raise APIError(503, str(e), type="server_error", code="server_shutting_down") from None
        if isinstance(e, ValueError):
          raise APIError(400, str(e), param=_param_of(str(e), prompt_param), code="invalid_value") from None
        raise
      done.append(rid)
    return q

  async def events(q: asyncio.Queue, n: int):
    """(index, TokenEvent) until all n requests finish; Aborted / Failed end it with an APIError, the
    client's disconnect (None) with ClientGone."""
    left = n
    while left:
      i, item = await q.get()
      if item is None:
        raise _ClientGone()
      if isinstance(item, Aborted):
        raise APIError(503, f"request aborted: {item.reason}", type="server_error", code="request_aborted")
      if isinstance(item, Failed):
        raise APIError(500, f"the engine failed: {type(item.error).__name__}: {item.error}", type="server_error")
      left -= bool(item.finished)
      yield i, item

  async def watch_disconnect(request: HttpRequest, q: asyncio.Queue, request_ids, finished: set):
    """Aborts the unfinished requests when the client goes away (non-streaming requests)."""
    while True:
      message = await request.receive()
      if message["type"] == "http.disconnect":
        for rid in request_ids:
          if rid not in finished:
            runner.abort(rid)
        q.put_nowait((None, None))  # wake the handler: no more events will come
        return

  def parse(body: dict, chat: bool):
    """(prompts, sampling, stream, include_usage) of a request body; runs in a worker thread (tokenization)."""
    check_model(body)
    sampling = request_sampling(body, default_max_tokens=max_new if chat else min(COMPLETIONS_MAX_TOKENS, max_new),
                         stop_ids=stops[chat], chat=chat, defaults=getattr(tokenizer, "generation", None))
    stream = _field(body, "stream", "bool", False)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
      raise APIError(400, "stream_options must be an object", param="stream_options", code="invalid_type")
    include_usage = _field(opts, "include_usage", "bool", False)
    prompts = [_chat_prompt(body, tokenizer)] if chat else _completion_prompts(body, tokenizer)
    for ids in prompts:
      check_prompt(ids, "messages" if chat else "prompt")
    return prompts, sampling, stream, include_usage

  async def parse_off_loop(fn, *args):
    """fn(*args) in a worker thread; a malformed value it trips over is the client's 400, never a 500."""
    try:
      return await asyncio.to_thread(fn, *args)
    except APIError:
      raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
      raise APIError(400, f"invalid request: {type(e).__name__}: {e}", code="invalid_value") from None

  async def run(request: HttpRequest, body: dict, *, chat: bool):
    timer = counters.timer()  # from arrival
    prompts, sampling, stream, include_usage = await parse_off_loop(parse, body, chat)
    prompt_param = "messages" if chat else "prompt"
    base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    request_ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
    q = await submit_all(request_ids, prompts, sampling, prompt_param)
    now = int(time.time())
    head = {"id": base, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
            "model": config.model_name}
    finished: set = set()
    if stream:
      def close():  # the response ended, however: free what did not finish (a client gone before the first chunk)
        for rid in request_ids:
          if rid not in finished:
            runner.abort(rid)
      return _EventStream(stream_events(q, request_ids, finished, head, chat, include_usage, timer), on_close=close)
    watcher = asyncio.create_task(watch_disconnect(request, q, request_ids, finished))
    texts, reasons = [""] * len(prompts), [None] * len(prompts)
    prompt_tokens = [len(p) for p in prompts]
    completion_tokens, cached = [0] * len(prompts), [0] * len(prompts)
    try:
      async for i, ev in events(q, len(prompts)):
        timer.seen(i, ev)
        texts[i] += ev.text
        completion_tokens[i] = ev.completion_tokens
        prompt_tokens[i], cached[i] = ev.prompt_tokens, ev.cached_tokens
        if ev.finished:
          log_turn(request_ids[i], ev)
          reasons[i] = ev.finish_reason
          finished.add(request_ids[i])
    except _ClientGone:
      counters.done("disconnected")
      return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    except BaseException:
      for rid in request_ids:
        if rid not in finished:
          runner.abort(rid)
      counters.done("aborted")
      raise
    finally:
      watcher.cancel()
    counters.done("ok")
    usage = _usage(sum(prompt_tokens), sum(completion_tokens), sum(cached))
    if chat:
      choices = [{"index": 0, "message": {"role": "assistant", "content": texts[0]}, "logprobs": None,
                  "finish_reason": reasons[0]}]
      return {"id": base, "object": "chat.completion", "created": now, "model": config.model_name,
              "choices": choices, "usage": usage}
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": base, "object": "text_completion", "created": now, "model": config.model_name,
            "choices": choices, "usage": usage}

  async def stream_events(q, request_ids, finished: set, head, chat, include_usage, timer):
    n = len(request_ids)
    ended = False
    prompt_tokens, completion_tokens, cached = [0] * n, [0] * n, [0] * n

    def chunk(i, text=None, finish=None, role=False):
      if chat:
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
        c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
      else:
        c = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
      return dict(head, choices=[c], usage=None) if include_usage else dict(head, choices=[c])

    try:
      if chat:
        yield _sse(chunk(0, role=True))
      async for i, ev in events(q, n):
        timer.seen(i, ev)
        prompt_tokens[i], completion_tokens[i], cached[i] = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
        if ev.finished:
          finished.add(request_ids[i])
          log_turn(request_ids[i], ev)
          c = chunk(i, ev.text, ev.finish_reason)
          if not include_usage and len(finished) == n:  # usage on the last chunk, as vLLM does
            c["usage"] = _usage(sum(prompt_tokens), sum(completion_tokens), sum(cached))
          yield _sse(c)
        elif ev.text:
          yield _sse(chunk(i, ev.text))
      if include_usage:
        yield _sse(dict(head, choices=[], usage=_usage(sum(prompt_tokens), sum(completion_tokens), sum(cached))))
      ended = True
      counters.done("ok")
      yield "data: [DONE]\n\n"
    except APIError as e:  # aborted by shutdown, or the engine failed: say so, then end the stream
      ended = True
      counters.done("aborted")
      yield _sse(e.body())
      yield "data: [DONE]\n\n"
    finally:  # also when the client went away (the response task is cancelled): free the slots now
      for rid in request_ids:
        if rid not in finished:
          runner.abort(rid)
      if not ended:
        counters.done("disconnected")

  @app.get("/v1/models")
  async def list_models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{name}")
  async def get_model(name: str):
    if name != config.model_name:
      raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
    return model_card()

  def model_card():
    card = {"id": config.model_name, "object": "model", "created": created, "owned_by": "rocketkv-jax"}
    if max_prompt is not None:
      card["max_model_len"] = max_prompt + max_new
    return card

  async def body_of(request: HttpRequest) -> dict:
    return await _json_body(request, config.max_body_bytes)

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    return await run(request, await body_of(request), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HttpRequest):
    return await run(request, await body_of(request), chat=True)

  def tokenize(body: dict) -> dict:
    if body.get("model") is not None:
      check_model(body)
    if "messages" in body:
      ids = _chat_prompt(body, tokenizer)
    elif isinstance(body.get("prompt"), str):
      ids = tokenizer.encode(body["prompt"])
    else:
      raise APIError(400, "send {\"prompt\": str} or {\"messages\": [...]}", param="prompt", code="invalid_type")
    return {"tokens": ids, "count": len(ids), "max_model_len": model_card().get("max_model_len")}

  def detokenize(body: dict) -> dict:
    if body.get("model") is not None:
      check_model(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
      raise APIError(400, "tokens must be a list of token ids", param="tokens", code="invalid_type")
    if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
      raise APIError(400, f"tokens must lie in [0, {tokenizer.vocab_size})", param="tokens", code="invalid_value")
    return {"prompt": tokenizer.decode(ids, skip_special=False)}

  @app.post("/tokenize")
  async def tokenize_route(request: HttpRequest):
    return await parse_off_loop(tokenize, await body_of(request))

  @app.post("/detokenize")
  async def detokenize_route(request: HttpRequest):
    return await parse_off_loop(detokenize, await body_of(request))

  @app.get("/version")
  async def version():
    return {"version": _version()}

  @app.get("/health")
  async def health():
    if not runner.alive:
      return JSONResponse({"status": "engine stopped"}, status_code=503)
    if not runner.accepting:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(counters.text(), media_type=CONTENT_TYPE_LATEST)

  return app


try:
  import uvicorn
except ImportError:  # pragma: no cover - fastapi without uvicorn
  uvicorn = None


if uvicorn is not None:
  class UvicornServer(uvicorn.Server):
    """uvicorn.Server that drains the engine before closing connections: on shutdown it stops accepting,
    lets requests in flight run up to `drain_s`, then aborts the rest, so each client gets a definite end
    (a finished answer, or an error object / 503) instead of a cut connection."""

    def __init__(self, config: "uvicorn.Config", runner: EngineRunner, drain_s: float):
      super().__init__(config)
      self.runner, self.drain_s = runner, drain_s

    async def shutdown(self, sockets=None) -> None:
      self.runner.stop_accepting()
      deadline = time.monotonic() + self.drain_s
      while self.runner.in_flight() and time.monotonic() < deadline and not self.force_exit:
        await asyncio.sleep(0.05)
      await asyncio.to_thread(self.runner.shutdown)
      await asyncio.sleep(0.05)  # let handlers write their last chunk
      await super().shutdown(sockets)
else:  # pragma: no cover
  UvicornServer = None
