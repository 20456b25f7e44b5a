"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (each with `stream: true` as server-sent events), `/health`, `/metrics`, the API's schema
(`/docs`, `/openapi.json`), and vLLM's `/version`, `/tokenize` (`{"prompt": str}` or `{"messages": [...]}` ->
`{"tokens", "count", "max_model_len"}`), `/detokenize` (`{"tokens": [...]}` -> `{"prompt": str}`) and
`/tokenizer_info` (special tokens and chat template: lm-eval's `tokenizer_backend=remote`).

Text exists only here and in the engine's detokenizer: a request is parsed and checked, its prompt encoded
(chat through the tokenizer's chat template), and handed to the engine thread (`runner.py`) as token ids;
events come back through an asyncio queue per HTTP request.

Start-up: the server listens as soon as the model is loaded (and the sessions, if any); the warm-up
(`ServerConfig.warmup`, `Warmup`) then runs on the engine thread. `/health` answers 503 `{"status": "warming up",
"warmup": {"compiled", "compiling", "remaining", "done", "total", "elapsed_s"}}` (Retry-After: 5) until it is done,
then 200 `{"status": "ok"}`; 503 `{"status": "shutting down"}` once shutdown began and `{"status": "engine
stopped"}` if the engine thread is gone. A request sent during the warm-up is not refused: it waits (requests are
taken in arrival order once the warm-up is done; those past the queue's `max_queue` then get the usual 429) and is
answered as it would be later, its own programs compiled on first use if the warm-up does not compile them (a log
line says so). Every other route answers at once.

Requests are parsed by the pydantic models of `protocol.py` (strict JSON types, the engine's own bounds), which
`/docs` and `/openapi.json` show. OpenAI semantics kept: `temperature` and `top_p` default to 1 (unless the
checkpoint's generation_config.json sets them: then its values, as vLLM does), `stop` is a string or a list,
errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx status naming the field in `param` (a
validation failure is a 400, never FastAPI's 422; 429 when the engine's queue is full, 503 while shutting down).
Implemented: `presence_penalty` / `frequency_penalty` ([-2, 2]), `logit_bias` (token id -> [-100, 100]),
`logprobs` (completions: 0..20 alternatives, OpenAI's legacy format; chat: `logprobs: true` + `top_logprobs`),
`echo` (completions: the text starts with the prompt; with `logprobs`, the prompt's positions come first, the first
one None, as lm-eval's log-likelihood requests need; with `max_tokens: 0`, vLLM's scoring idiom, the answer is the
prompt and its logprobs alone, no token generated, `finish_reason` "length", `completion_tokens` 0), `seed` (the
same seed gives the same samples; without one, every request draws a fresh random seed, as OpenAI and vLLM do), and
`n` (1..16 samples per prompt: sample i uses seed + i, so greedy gives n equal answers; choices are indexed
prompt * n + i; usage counts each prompt once). Extensions (vLLM's): `top_k` (0 or -1 = off, at most the vocabulary
size), `stop_token_ids`, `repetition_penalty`, `min_tokens`, `cache_salt`, `/tokenizer_info`.

Lengths, as vLLM defines them: `max_model_len` (`/v1/models`, `/tokenize`, `/tokenizer_info`'s model_max_length) is
the most prompt + new tokens a request may have, --max-prompt-tokens + --max-new-tokens. A prompt over
--max-prompt-tokens is a 400 `context_length_exceeded` (param `prompt` / `messages`); prompt + `max_tokens` (chat:
`max_completion_tokens`, which wins) over max_model_len a 400 `context_length_exceeded` naming both numbers (param
`max_tokens`); within it, `max_tokens` over what the slots hold after that prompt (`Engine.max_tokens_for`:
max_model_len - prompt for a method whose cache grows with the sequence, --max-new-tokens for one that keeps a
budget of the prompt, rocketkv and snapkv) a 400 `invalid_value` naming that number. Without `max_tokens`: chat
gets all the prompt leaves (max_model_len - prompt tokens), completions OpenAI's 16, either at most what the slots
hold after the prompt.

Streaming (`stream: true`): one server-sent event per engine event, which carries one token with the engine's
default steps_per_call=1 (`--steps-per-call`; text that may begin a stop string or an incomplete UTF-8 character
waits for the next token), so a client's inter-token latency measures tokens, not chunks of them.

Nothing that changes sampling is ignored: every field this server does not implement (OpenAI's and vLLM's,
`protocol.REFUSED`) is accepted only at its neutral value, else 400 `unsupported_parameter` naming it; other
unknown fields are accepted. Every value is range-checked once, by the protocol models with the engine's bounds,
and against the engine's limits (max_tokens, vocabulary) before submission, so a bad value fails its own request
with a 400, never the engine step shared with others. A body that is not JSON, nests too deep or has a wrong type
anywhere is a 400; one over `max_body_bytes` a 413; a POST whose Content-Type is not `application/json` a 415
(this refuses the browsers' CORS "simple requests"). No CORS headers are sent.

Prefix reuse: a prompt's stored K/V history (`usage.prompt_tokens_details.cached_tokens`) is reused only by
requests of the same tenant and the same `cache_salt` (default ""; the engine enforces it). A tenant is an API key:
with several keys (`--api-key` repeated), each key's requests reuse only that key's prompts, so no client learns
from `cached_tokens` (or from timing) whether another key's prompts began with some text. Without keys every client
is one tenant: clients that must not share prefixes send distinct salts. `usage.prompt_tokens_details`
(`cached_tokens`) is reported only to a request with a tenant (an API key or a cache_salt): an anonymous request,
whose history every anonymous client shares, gets usage without it (vLLM leaves it out by default too).

Access: with `api_key` set (one key or several), every route but `/health`, `/version`, `/docs` (with its Swagger UI
files under `/docs/static/`, served from the fastapi-offline package: no CDN) and `/openapi.json` needs
`Authorization: Bearer KEY` (else 401), `/metrics` included: a choice, since its reuse counters (prompt tokens
reused vs prefilled) tell about other clients' prompts. The rule planned for /metrics (another issue): with a key
set it needs the key; without one it exposes no per-reuse counters. A request that arrives on a loopback address
(a server bound to 127.0.0.1, the default) must name a loopback host in `Host` (localhost, 127.0.0.1, [::1], any
port, or one of `allowed_hosts`), and its `Origin`, when sent, must be one too: else 403 (a defence against DNS
rebinding and cross-site requests from a browser).
Prompts are tokenized in a worker thread, so a large prompt does not stall `/health` or the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import time
import urllib.parse
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi_offline import FastAPIOffline
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rocketkv_jax.models.generate import stop_ids as model_stop_ids

from . import protocol
from .engine import LimitError, Request, SamplingParams, check_limits
from .runner import Aborted, EngineRunner, Failed, ShuttingDown
from .scheduler import QueueFull

__all__ = ["APIError", "ServerConfig", "UvicornServer", "Warmup", "create_app", "request_sampling",
           "sample_sampling", "warm_up"]

log = logging.getLogger("rocketkv_jax.serving")

COMPLETIONS_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
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
  flight may run to their end before they are aborted. warmup: compile what a default request needs (`Warmup`: the
  smallest prefill bucket, the insert, greedy decode and the default sampling's decode) on the engine thread before it
  takes requests, while the server already listens: /health answers 503 with the progress until then, and requests
  sent meanwhile wait; everything else compiles on first use. warmup_full (with warmup): also every other prefill
  bucket, each again with prompt logprobs, and every decode kind, so nothing compiles on live traffic (ready later).
  history_dir: where the engine's prompt
  histories (sessions) are loaded from at start-up, when there, and saved to atomically every
  `--sessions-save-s` seconds (on the engine thread) and at shutdown (needs an engine with history; a file saved
  for another model, or one whose segment table does not match its arrays, is refused at start-up). api_key: when set, the bearer token every
  route but /health, /version and the schema needs; several keys (a tuple) are several tenants, whose requests
  never reuse each other's prompt histories. max_body_bytes: larger request bodies get 413. allowed_hosts: host
  names accepted in Host / Origin on a loopback connection besides the loopback ones (a local reverse proxy's)."""

  model_name: str
  drain_s: float = 10.0
  warmup: bool = False
  warmup_full: bool = False
  history_dir: str | None = None
  api_key: str | tuple[str, ...] | None = None
  max_body_bytes: int = MAX_BODY_BYTES
  allowed_hosts: tuple[str, ...] = ()


class Warmup:
  """The server's warm-up: one small request per program to compile, run on the engine thread before it takes any
  client request (`EngineRunner.warm_up_first`), while the server already answers /health (503 with `status()`
  until done). Which programs (`plan`): a 1-token prompt of the smallest prefill bucket (its prefill, through the
  history when the engine keeps one, the insert and the greedy decode), then a request decoded as a request that
  sets no sampling field is (the checkpoint's generation defaults, else OpenAI's temperature 1: the sampling kind),
  unless that is greedy. With `full`, also every other prefill bucket, every bucket again with prompt logprobs (`echo`
  + `logprobs`: the scored prefill), and every decode kind (greedy; sampling; sampling with top-p / top-k cuts; the
  processed kind: penalties, bias, min_tokens and logprobs). Anything else compiles on first use (the engine's
  `compile_log` says so): without `full`, the larger buckets, prompt logprobs and the other decode kinds; always, a
  history's extend prefill for a reused prefix (one per history/question length pair) and a context's feed lengths
  (library `contexts`, not served).

  Its requests carry their own cache_salt (`SALT`), so they never reuse a loaded session's history, and the history
  they leave is dropped at the end; the engine's counters are zeroed, so /metrics counts client traffic only
  (compiles excepted). Not thread-safe but `status()`: it runs on the engine thread."""

  SALT = "\x00rocketkv-warm-up"  # no client's salt: a client's is behind its tenant tag or printable JSON text

  def __init__(self, engine, *, full: bool = False, default_sampling: SamplingParams | None = None, log=None):
    """default_sampling: how a request that sets no sampling field is sampled (`request_sampling`'s defaults);
    None: OpenAI's (temperature 1). log: called with each progress line."""
    self.engine, self.full, self.log = engine, full, log
    self.items = self.plan(engine.config, full=full, default_sampling=default_sampling)
    self.compiled: list[str] = []
    self.failed: list[str] = []
    self.t0 = self.seconds = None

  @staticmethod
  def plan(config, *, full: bool, default_sampling: SamplingParams | None = None
           ) -> list[tuple[str, int, SamplingParams]]:
    """(what it compiles, prompt length, sampling) of each warm-up request, in order (class doc)."""
    buckets = config.prefill_buckets
    first = buckets[0]
    n = config.steps_per_call + 1  # the first token comes from the prefill: these reach a decode call
    out = [(f"prompt bucket {first}", first, SamplingParams(max_tokens=1))]
    sampled = SamplingParams(max_tokens=n, temperature=1.0)
    cut = SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9)
    if full:
      out += [(f"prompt bucket {b}", b, SamplingParams(max_tokens=1)) for b in buckets[1:]]
      out += [(f"prompt bucket {b} with prompt logprobs", b, SamplingParams(max_tokens=1, prompt_logprobs=0))
              for b in buckets]
      kinds = [("greedy", SamplingParams(max_tokens=n)), ("sampling", sampled), ("top-p / top-k cuts", cut),
               ("processed: penalties, bias, logprobs",
                SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, logprobs=1, repetition_penalty=1.1))]
    else:
      d = default_sampling or sampled
      kinds = []
      if d.temperature > 0:  # greedy is compiled by the first request already
        d = SamplingParams(max_tokens=n, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
        kinds = [("top-p / top-k cuts" if d.top_p < 1 or d.top_k > 0 else "sampling", d)]
    return out + [(f"decode ({what})", first, sampling) for what, sampling in kinds]

  def status(self) -> dict:
    """The progress /health reports: what is compiled, what is compiling now, what remains (any thread)."""
    names = [what for what, _, _ in self.items]
    done = len(self.compiled) + len(self.failed)
    out = {"compiled": list(self.compiled), "compiling": names[done] if done < len(names) else None,
           "remaining": names[done:], "done": done, "total": len(names),
           "elapsed_s": round(time.perf_counter() - self.t0, 1) if self.t0 is not None else 0.0}
    if self.failed:
      out["failed"] = list(self.failed)
    return out

  def __call__(self, stopping=lambda: False) -> float:
    """Runs the warm-up on the calling thread (the engine's only one); stops early once stopping() is true.
    Returns the seconds taken."""
    engine, self.t0 = self.engine, time.perf_counter()
    say = self.log or (lambda msg: None)
    for i, (what, length, sampling) in enumerate(self.items):
      if stopping():
        break
      rid = f"warmup-{i}"  # distinct first tokens: no warm-up prompt reuses another's history
      try:
        engine.submit(Request(request_id=rid, prompt_ids=[i] * length, sampling=sampling, cache_salt=self.SALT))
        while engine.has_work() and not stopping():
          engine.step()
      except Exception:  # noqa: BLE001 - the requests that need it fail alone, or compile it on first use
        log.exception(f"warm-up: {what} failed")
        self.failed.append(what)
        engine.abort(rid)
        while engine.has_work():
          engine.step()
        continue
      if stopping():  # shutting down: the thread stops next
        engine.abort(rid)
        break
      self.compiled.append(what)
      say(f"warm-up: {what} compiled ({time.perf_counter() - self.t0:.1f}s, {i + 1} of {len(self.items)})")
    if engine.history is not None:
      engine.history.drop_salt(self.SALT)
    engine.reset_counters()
    self.seconds = time.perf_counter() - self.t0
    if not stopping():
      rest = ("nothing compiles on live traffic" if self.full else
              "other prompt buckets, prompt logprobs and decode kinds compile on first use")
      failed = f"; failed: {', '.join(self.failed)}" if self.failed else ""
      say(f"ready: warm-up done in {self.seconds:.1f}s ({', '.join(self.compiled)}{failed}); {rest}")
    return self.seconds


def warm_up(engine, log=None, *, full: bool = True) -> float:
  """`Warmup(engine, full=full, log=log)()` on the calling thread (before the engine thread starts): with `full`,
  every prefill bucket and decode kind is compiled. Returns the seconds taken."""
  return Warmup(engine, full=full, log=log)()


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("rocketkv-jax")
  except PackageNotFoundError:
    return "unknown"


# --- parsing -------------------------------------------------------------------------------------------------


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


def api_keys(api_key) -> tuple[str, ...]:
  """ServerConfig.api_key as a tuple of keys: None or "" -> (), a string -> (it,), a sequence -> its keys."""
  if not api_key:
    return ()
  keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
  if not all(isinstance(k, str) and k for k in keys):
    raise ValueError(f"api_key={api_key!r} must be a non-empty string or a list of them")
  return keys


def tenant_tag(key: bytes) -> str:
  """The prefix a key's requests put before their cache_salt: a hash (a saved session never holds a key)."""
  return "t" + hashlib.sha256(key).hexdigest()[:16] + "/"


# Where /docs's Swagger UI files (script, stylesheet, favicon) are served: public, like /docs itself.
DOCS_STATIC = "/docs/static/"


class _Guard:
  """ASGI middleware, before routing: on a loopback connection, Host and Origin must be loopback (403); with an
  API key, every route but /health, /version and the API's schema (/docs, /openapi.json) needs it (401). Pure ASGI: streams and disconnects pass as is."""

  OPEN = ("/health", "/version", "/docs", "/openapi.json")  # and the files of /docs, under DOCS_STATIC

  def __init__(self, app, *, api_key, allowed_hosts: tuple[str, ...], counters: "_Metrics"):
    self.app, self.counters = app, counters
    self.keys = [k.encode() for k in api_keys(api_key)]
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
    path = scope.get("path", "")
    if self.keys and path not in self.OPEN and not path.startswith(DOCS_STATIC):
      auth = headers.get("authorization", "").encode("latin-1")
      match = [hmac.compare_digest(auth, b"Bearer " + k) for k in self.keys]  # every key compared: no timing hint
      if not any(match):
        return APIError(401, "a valid API key is required: send `Authorization: Bearer KEY`",
                        type="invalid_request_error", code="invalid_api_key")
      scope.setdefault("state", {})["tenant"] = tenant_tag(self.keys[match.index(True)])
    return None

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      err = self.check(scope)
      if err is not None:
        self.counters.error(err.status)
        return await err.response()(scope, receive, send)
    await self.app(scope, receive, send)


def request_sampling(req: protocol.CompletionRequest | protocol.ChatCompletionRequest, *, default_max_tokens: int,
                     stop_ids: tuple[int, ...], defaults: dict | None = None) -> SamplingParams:
  """The sampling of a parsed request (sample 0 of n: sample i uses seed + i). A field it leaves out takes the
  checkpoint's generation default (`defaults`: generation_config.json's temperature / top_p / top_k, as vLLM
  does), else OpenAI's (1, 1, off); max_tokens default_max_tokens; no seed draws a fresh random one (OpenAI's and
  vLLM's: two such requests sample independently). The request's fields were range-checked by the protocol models with the
  engine's own bounds, so SamplingParams refusing one is a server bug, not the client's 400."""
  defaults = defaults or {}
  chat = isinstance(req, protocol.ChatCompletionRequest)
  given = given_max_tokens(req)
  max_tokens = default_max_tokens if given is None else given  # 0 is given (echo only: `protocol`)
  if (req.min_tokens or 0) > max_tokens:
    raise APIError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens",
                   code="invalid_value")
  pick = lambda v, default: default if v is None else v  # noqa: E731
  top_k = pick(req.top_k, defaults.get("top_k", 0))
  if chat:
    logprobs, prompt_logprobs = ((req.top_logprobs or 0) if req.logprobs else None), None
  else:  # echo with logprobs: the prompt's logprobs too, scored in the prefill
    logprobs = req.logprobs
    prompt_logprobs = logprobs if req.echo and logprobs is not None else None
  return SamplingParams(
      max_tokens=max_tokens, temperature=pick(req.temperature, defaults.get("temperature", 1.0)),
      top_p=pick(req.top_p, defaults.get("top_p", 1.0)), top_k=0 if top_k == -1 else top_k,  # -1: vLLM's off
      seed=secrets.randbits(32) if req.seed is None else req.seed, ignore_eos=bool(req.ignore_eos),
      stop_ids=(() if req.ignore_eos else tuple(stop_ids)) + tuple(req.stop_token_ids or ()),
      stop_strings=req.stop_strings(), presence_penalty=req.presence_penalty or 0.0,
      frequency_penalty=req.frequency_penalty or 0.0, repetition_penalty=pick(req.repetition_penalty, 1.0),
      min_tokens=req.min_tokens or 0, logit_bias=req.bias_pairs(), logprobs=logprobs,
      prompt_logprobs=prompt_logprobs)


def given_max_tokens(req) -> int | None:
  """The max_tokens a request asks for (chat's max_completion_tokens wins over max_tokens), None when it sets none."""
  if isinstance(req, protocol.ChatCompletionRequest) and req.max_completion_tokens is not None:
    return req.max_completion_tokens
  return req.max_tokens


def sample_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
  """Sample i of a request's n: its seed + i (mod 2**32), so the n samples differ (unless greedy)."""
  return sampling if i == 0 else dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32)


def _check_token_ids(ids, vocab: int, param: str, what: str) -> None:
  if any(not 0 <= t < vocab for t in ids):
    raise APIError(400, f"{what} must lie in [0, {vocab})", param=param, code="invalid_value")


def _completion_prompts(req: protocol.CompletionRequest, tokenizer, vocab: int) -> list[list[int]]:
  """`prompt`: a string, a list of token ids, or a list of strings / token-id lists: each as token ids."""
  out = []
  for x in req.prompts():
    ids = tokenizer.encode(x) if isinstance(x, str) else list(x)
    if not ids:
      raise APIError(400, "prompt encodes to no tokens", param="prompt", code="invalid_value")
    _check_token_ids(ids, vocab, "prompt", "prompt token ids")
    out.append(ids)
  return out


def _chat_messages(messages: list[protocol.ChatMessage]) -> list[dict]:
  return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def _chat_prompt(req: protocol.ChatCompletionRequest, tokenizer) -> list[int]:
  ids = tokenizer.encode(tokenizer.apply_chat(_chat_messages(req.messages)))
  if not ids:
    raise APIError(400, "messages encode to no tokens", param="messages", code="invalid_value")
  return ids


def _parsed(model, body: dict):
  """The protocol model of a body; its refusal as OpenAI's 400 naming the field."""
  try:
    return protocol.parse(model, body)
  except protocol.RequestError as e:
    raise APIError(400, e.message, param=e.param, code=e.code) from None


def _doc(request_model, response_model) -> dict:
  """A POST route's OpenAPI: its JSON body (the component `openapi()` adds) and its answers."""
  body = {"required": True, "content": {"application/json": {
      "schema": {"$ref": f"#/components/schemas/{request_model.__name__}"}}}}
  return {"openapi_extra": {"requestBody": body},
          "responses": {200: {"model": response_model}, 400: {"model": protocol.ErrorResponse}}}


def _token_name(tokenizer, token_id: int | None) -> str | None:
  from tokenizers import Tokenizer
  inner = getattr(tokenizer, "tokenizer", None)  # a TextTokenizer's `tokenizers.Tokenizer`; a test's stand-in has none
  if token_id is None or not isinstance(inner, Tokenizer):
    return None
  return inner.id_to_token(token_id)


_MIN_LOGPROB = -9999.0  # what -inf (and NaN) become: JSON has no infinity (vLLM's floor)


def _lp(x) -> float:
  x = float(x)
  return x if x >= _MIN_LOGPROB else _MIN_LOGPROB


def _has_tokens(logprobs: dict | None) -> bool:
  return bool(logprobs) and bool(logprobs.get("content") or logprobs.get("tokens"))


class _Choice:
  """One choice of a response, fed its engine request's events (`add`): its text, finish reason and token
  counts, and its logprobs in the response's format, from the events' TokenLogprob entries:

  completions (OpenAI's legacy format): {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
  "text_offset": [int]}; top_logprobs holds the k most likely tokens and the token itself (so up to k + 1, as
  OpenAI and vLLM); with echo, the prompt's positions come first, the first one's logprob and top None.
  chat (OpenAI's): {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
  A token's string is the tokenizer's decode of that one id (special tokens kept), as vLLM does; text_offset
  counts these strings' characters from the start of the choice's text."""

  def __init__(self, prompt_ids, prompt_text: str, *, echo: bool, logprobs: bool, chat: bool, token_text):
    self.prompt_ids, self.prompt_text, self.echo, self.want, self.chat = prompt_ids, prompt_text, echo, logprobs, chat
    self.token_text, self.offset, self.first = token_text, 0, True
    self.text, self.finish_reason = "", None
    self.prompt_tokens = self.completion_tokens = self.cached = 0
    self.logprobs = (({"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                    "text_offset": []}) if logprobs else None)

  def add(self, ev) -> tuple[str, dict | None]:
    """Takes one event; returns its new text and logprobs (the prompt's first, with echo, on the first)."""
    text, items = ev.text, []
    if self.first:
      self.first = False
      if self.echo:
        text = self.prompt_text + text
        if self.want:
          scored = ev.prompt_logprobs or [None] * len(self.prompt_ids)
          items += list(zip(self.prompt_ids, scored))
    if self.want and ev.logprobs:  # each entry names its token: a stop id's logprob, if sent, is kept
      items += [(e.token_id, e) for e in ev.logprobs]
    self.text += text
    self.prompt_tokens, self.completion_tokens, self.cached = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
    if ev.finished:
      self.finish_reason = ev.finish_reason
    if not self.want:
      return text, None
    part = self._format(items)
    for key, values in part.items():
      self.logprobs[key] += values
    return text, part

  def _format(self, items) -> dict:
    if self.chat:
      return {"content": [dict(self._entry(t, e.logprob), top_logprobs=[self._entry(u, lp) for u, lp in e.top])
                          for t, e in items if e is not None]}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in items:
      token = self.token_text(t)
      out["tokens"].append(token)
      out["text_offset"].append(self.offset)
      self.offset += len(token)
      if e is None:
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        continue
      top = {self.token_text(u): _lp(lp) for u, lp in e.top}
      top.setdefault(token, _lp(e.logprob))
      out["token_logprobs"].append(_lp(e.logprob))
      out["top_logprobs"].append(top)
    return out

  def _entry(self, token_id: int, logprob: float) -> dict:
    token = self.token_text(token_id)
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


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


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = 0) -> dict:
  """OpenAI's usage object; cached None leaves out prompt_tokens_details (an anonymous request: module doc)."""
  out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
  if cached is not None:
    out["prompt_tokens_details"] = {"cached_tokens": cached}
  return out


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
    "history_store_seconds": ("counter", "Seconds the history's store worker spent copying new prompt K/V into "
                              "host memory (off the requests' path to their first token)."),
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
  thread (which runs the warm-up first, with config.warmup, while the server listens: `Warmup`) and, on shutdown,
  aborts whatever is still in flight and stops the thread. Sessions: `sessions`, an opened `sessions.SessionsDir`
  (the CLI's), else one opened on config.history_dir (locked, loaded at start-up before the server listens, saved
  every 60 s on the engine thread and at shutdown, released at shutdown)."""
  runner = runner or EngineRunner(engine)
  counters = _Metrics(config.model_name, runner.stats)
  created = int(time.time())
  eng_cfg = getattr(engine, "config", None)
  max_prompt = getattr(eng_cfg, "max_prompt_tokens", None)
  max_total = engine.max_model_len  # vLLM's max_model_len: prompt + new tokens (`Engine.check_length`)
  stops = {False: model_stop_ids(model, tokenizer, False), True: model_stop_ids(model, tokenizer, True)}
  vocab = model.config.vocab_size  # the engine's bound on sampled / stop / biased token ids
  token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special=False))

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

  # --- warm-up: on the engine thread, first; compiles after it are logged as first use ---
  warmup = None
  if config.warmup:
    default = request_sampling(_parsed(protocol.CompletionRequest, {"model": config.model_name, "prompt": "."}),
                               default_max_tokens=1, stop_ids=(), defaults=getattr(tokenizer, "generation", None))
    warmup = Warmup(engine, full=config.warmup_full, default_sampling=default, log=log.info)
    runner.warm_up_first(warmup)

  def compile_log(msg: str) -> None:  # the device engine's 'compiling X' and 'compiled X (12.3s)'
    if runner.warming:
      if not msg.startswith("compiling"):
        log.info(f"warm-up: {msg}")
    elif msg.startswith("compiling"):
      log.info(f"{msg} on first use: the requests that need it wait for it")
    else:
      log.info(f"first use: {msg}")

  device = getattr(engine, "device", None)
  if device is not None:
    device.compile_log = compile_log

  @contextlib.asynccontextmanager
  async def lifespan(app):
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

  # /docs is Swagger UI served from fastapi-offline's copy of its files (under DOCS_STATIC), not FastAPI's default
  # CDN links: a server without internet access showed a blank page.
  app = FastAPIOffline(title="rocketkv-jax", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                       openapi_url="/openapi.json", static_url=DOCS_STATIC.rstrip("/"))
  app.add_middleware(_Guard, api_key=config.api_key, allowed_hosts=config.allowed_hosts, counters=counters)
  app.state.runner = runner
  app.state.warmup = warmup
  app.state.sessions = app_sessions
  app.state.counters = counters

  @app.exception_handler(APIError)
  async def _api_error(request, exc: APIError):
    counters.error(exc.status)
    return exc.response()

  @app.exception_handler(RequestValidationError)
  async def _validation_error(request, exc: RequestValidationError):  # FastAPI's own 422, as OpenAI's 400
    counters.error(400)
    err = exc.errors()[0] if exc.errors() else {}
    loc = tuple(p for p in err.get("loc", ()) if p not in ("body", "query", "path"))
    return APIError(400, f"{'.'.join(map(str, loc)) or 'request'}: {err.get('msg', 'invalid')}",
                    param=protocol.param_of(loc), code="invalid_value").response()

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

  def check_model(name: str | None) -> None:
    if name is not None and name != config.model_name:
      raise APIError(404, f"The model `{name}` does not exist; this server serves `{config.model_name}`",
                     param="model", code="model_not_found")

  def check_prompt(ids: list[int], param: str) -> None:
    if max_prompt is not None and len(ids) > max_prompt:
      raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {max_prompt} "
                     f"(--max-prompt-tokens)", param=param, code="context_length_exceeded")

  def check_sampling(req, sampling: SamplingParams) -> None:
    """The engine's own check of its limits (`check_limits`, which it runs again at submission), run here first
    so the 400 names the HTTP field (what is left for the engine to refuse is about the prompt: its length and
    plan)."""
    try:
      check_limits(sampling, vocab=vocab)
    except LimitError as e:
      param = {"stop_ids": "stop_token_ids"}.get(e.field, e.field)
      raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None

  def prompt_sampling(req, sampling: SamplingParams, n_prompt: int, chat: bool) -> SamplingParams:
    """The sampling of one prompt of n_prompt tokens: without max_tokens in the request, all the prompt leaves
    (chat: max_model_len - its tokens, as vLLM gives; completions: OpenAI's 16), at most what the slots hold
    after it (`Engine.max_tokens_for`); then the engine's length check (`Engine.check_length`, which it runs again
    at submission) as a 400 naming the numbers."""
    if given_max_tokens(req) is None:
      most = engine.max_tokens_for(n_prompt)
      sampling = dataclasses.replace(sampling, max_tokens=most if chat else min(COMPLETIONS_MAX_TOKENS, most))
      if sampling.min_tokens > sampling.max_tokens:
        raise APIError(400, f"min_tokens={sampling.min_tokens} exceeds the {sampling.max_tokens} new tokens a request "
                       f"may have after a prompt of {n_prompt} tokens", param="min_tokens", code="invalid_value")
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    try:
      engine.check_length(n_prompt, sampling.max_tokens)
    except LimitError as e:
      hint = "" if e.code == "context_length_exceeded" else " (this server's --max-new-tokens)"
      raise APIError(400, f"{e}{hint}", param=param, code=e.code) from None
    return sampling

  async def submit_all(requests: list[Request], prompt_param: str):
    """Submits each request; on a refusal aborts the ones already in and raises the APIError."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    done = []
    for i, r in enumerate(requests):
      sink = lambda item, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, item))  # noqa: E731
      try:
        await asyncio.wrap_future(runner.submit(r, sink))
      except BaseException as e:
        for rid in done:
          runner.abort(rid)
        if isinstance(e, QueueFull):
          raise APIError(429, f"the server is at capacity ({e or 'queue full'}); retry later",
                         type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        if isinstance(e, ShuttingDown):
          raise APIError(503, str(e), type="server_error", code="server_shutting_down") from None
        if isinstance(e, ValueError):  # the sampling fields were checked above: what is left is the prompt's
          raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None
        raise
      done.append(r.request_id)
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
    """(request, prompts as token ids, each prompt's sampling) of a request body; runs in a worker thread
    (tokenization)."""
    req = _parsed(protocol.ChatCompletionRequest if chat else protocol.CompletionRequest, body)
    check_model(req.model)
    # without max_tokens: the most any prompt may get here (chat), each prompt's own below (`prompt_sampling`)
    sampling = request_sampling(req, default_max_tokens=max_total if chat else COMPLETIONS_MAX_TOKENS,
                                stop_ids=stops[chat], defaults=getattr(tokenizer, "generation", None))
    check_sampling(req, sampling)
    prompts = [_chat_prompt(req, tokenizer)] if chat else _completion_prompts(req, tokenizer, tokenizer.vocab_size)
    for ids in prompts:
      check_prompt(ids, "messages" if chat else "prompt")
    return req, prompts, [prompt_sampling(req, sampling, len(ids), chat) for ids in prompts]

  async def parse_off_loop(fn, *args):
    """fn(*args) in a worker thread; a malformed value it trips over is the client's 400, never a 500."""
    try:
      return await asyncio.to_thread(fn, *args)
    except APIError:
      raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
      raise APIError(400, f"invalid request: {type(e).__name__}: {e}", code="invalid_value") from None

  def choices_of(req, prompts, sampling, chat: bool) -> list[_Choice]:
    """One `_Choice` per engine request: prompt p's sample i is choice p * n + i (vLLM's order)."""
    n = req.n or 1
    echo = not chat and bool(req.echo)
    out = []
    for p, ids in enumerate(prompts):
      text = ""
      if echo:  # the prompt as given, or its ids decoded
        given = req.prompts()[p]
        text = given if isinstance(given, str) else tokenizer.decode(ids, skip_special=False)
      out += [_Choice(ids, text, echo=echo, logprobs=sampling.logprobs is not None, chat=chat,
                      token_text=token_text) for _ in range(n)]
    return out

  def usage_of(choices: list[_Choice], n: int, scoped: bool = True) -> dict:
    """Prompt tokens (and cached ones) counted once per prompt, as OpenAI counts them with n > 1; cached tokens
    only for a request with a tenant (`scoped`: module doc)."""
    firsts = choices[::n]
    return _usage(sum(c.prompt_tokens for c in firsts), sum(c.completion_tokens for c in choices),
                  sum(c.cached for c in firsts) if scoped else None)

  async def run(request: HttpRequest, body: dict, *, chat: bool):
    timer = counters.timer()  # from arrival
    req, prompts, samplings = await parse_off_loop(parse, body, chat)
    n = req.n or 1
    choices = choices_of(req, prompts, samplings[0], chat)
    base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    request_ids = [base] if len(choices) == 1 else [f"{base}-{j}" for j in range(len(choices))]
    requests = [Request(request_id=rid, prompt_ids=prompts[j // n], sampling=sample_sampling(samplings[j // n], j % n),
                        cache_salt=request.scope.get("state", {}).get("tenant", "") + (req.cache_salt or ""))
                for j, rid in enumerate(request_ids)]
    # cached_tokens tells a client whether a stored prompt began like its own: only said to a request with a
    # tenant (an API key or a cache_salt), never in the history every anonymous client shares
    scoped = bool(requests[0].cache_salt)
    q = await submit_all(requests, "messages" if chat else "prompt")
    now = int(time.time())
    head = {"id": base, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
            "model": config.model_name}
    finished: set = set()
    if req.stream:
      def close():  # the response ended, however: free what did not finish (a client gone before the first chunk)
        for rid in request_ids:
          if rid not in finished:
            runner.abort(rid)
      include_usage = bool(req.stream_options and req.stream_options.include_usage)
      return _EventStream(stream_events(q, request_ids, finished, head, chat, include_usage, timer, choices, n,
                                        scoped),
                          on_close=close)
    watcher = asyncio.create_task(watch_disconnect(request, q, request_ids, finished))
    try:
      async for j, ev in events(q, len(choices)):
        timer.seen(j, ev)
        choices[j].add(ev)
        if ev.finished:
          log_turn(request_ids[j], ev)
          finished.add(request_ids[j])
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
    usage = usage_of(choices, n, scoped)
    if chat:
      out = [{"index": j, "message": {"role": "assistant", "content": c.text}, "logprobs": c.logprobs,
              "finish_reason": c.finish_reason} for j, c in enumerate(choices)]
      return {"id": base, "object": "chat.completion", "created": now, "model": config.model_name,
              "choices": out, "usage": usage}
    out = [{"index": j, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
           for j, c in enumerate(choices)]
    return {"id": base, "object": "text_completion", "created": now, "model": config.model_name,
            "choices": out, "usage": usage}

  async def stream_events(q, request_ids, finished: set, head, chat, include_usage, timer, choices, n, scoped):
    total = len(request_ids)
    ended = False

    def chunk(j, text=None, finish=None, role=False, logprobs=None):
      if chat:
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
        c = {"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
      else:
        c = {"index": j, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
      return dict(head, choices=[c], usage=None) if include_usage else dict(head, choices=[c])

    try:
      if chat:
        for j in range(total):
          yield _sse(chunk(j, role=True))
      async for j, ev in events(q, total):
        timer.seen(j, ev)
        text, logprobs = choices[j].add(ev)
        if ev.finished:
          finished.add(request_ids[j])
          log_turn(request_ids[j], ev)
          c = chunk(j, text, ev.finish_reason, logprobs=logprobs)
          if not include_usage and len(finished) == total:  # usage on the last chunk, as vLLM does
            c["usage"] = usage_of(choices, n, scoped)
          yield _sse(c)
        elif text or _has_tokens(logprobs):
          yield _sse(chunk(j, text, logprobs=logprobs))
      if include_usage:
        yield _sse(dict(head, choices=[], usage=usage_of(choices, n, scoped)))
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

  @app.get("/v1/models/{name:path}")
  async def get_model(name: str):
    if name != config.model_name:
      raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
    return model_card()

  def model_card():
    card = {"id": config.model_name, "object": "model", "created": created, "owned_by": "rocketkv-jax"}
    card["max_model_len"] = max_total  # the most prompt + new tokens a request may have (`Engine.check_length`)
    return card

  async def body_of(request: HttpRequest) -> dict:
    return await _json_body(request, config.max_body_bytes)

  @app.post("/v1/completions", **_doc(protocol.CompletionRequest, protocol.CompletionResponse))
  async def completions(request: HttpRequest):
    """OpenAI's completions; `stream: true` answers with server-sent events."""
    return await run(request, await body_of(request), chat=False)

  @app.post("/v1/chat/completions", **_doc(protocol.ChatCompletionRequest, protocol.ChatCompletionResponse))
  async def chat_completions(request: HttpRequest):
    """OpenAI's chat completions, the prompt rendered by the model's chat template; `stream: true` answers with
    server-sent events."""
    return await run(request, await body_of(request), chat=True)

  def tokenize(body: dict) -> dict:
    req = _parsed(protocol.TokenizeRequest, body)
    check_model(req.model)
    if req.messages is not None:
      messages = _chat_messages(req.messages)
      text = (tokenizer.apply_chat(messages) if req.add_generation_prompt
              else tokenizer.apply_chat(messages, add_generation_prompt=False))
    else:
      text = req.prompt
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    if not req.add_special_tokens and getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
      ids = ids[1:]
    return {"tokens": ids, "count": len(ids), "max_model_len": model_card().get("max_model_len")}

  def detokenize(body: dict) -> dict:
    req = _parsed(protocol.DetokenizeRequest, body)
    check_model(req.model)
    _check_token_ids(req.tokens, tokenizer.vocab_size, "tokens", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special=False)}

  @app.post("/tokenize", **_doc(protocol.TokenizeRequest, protocol.TokenizeResponse))
  async def tokenize_route(request: HttpRequest):
    """vLLM's: the token ids of a prompt, or of messages rendered by the chat template."""
    return await parse_off_loop(tokenize, await body_of(request))

  @app.post("/detokenize", **_doc(protocol.DetokenizeRequest, protocol.DetokenizeResponse))
  async def detokenize_route(request: HttpRequest):
    """vLLM's: the text of token ids (special tokens kept)."""
    return await parse_off_loop(detokenize, await body_of(request))

  @app.get("/tokenizer_info", responses={200: {"model": protocol.TokenizerInfo}})
  async def tokenizer_info():
    """vLLM's: the tokenizer's special tokens and chat template (lm-eval's `tokenizer_backend=remote`)."""
    return {"eos_token": _token_name(tokenizer, getattr(tokenizer, "eos_id", None)),
            "bos_token": _token_name(tokenizer, getattr(tokenizer, "bos_id", None)), "pad_token": None,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": model_card().get("max_model_len"), "vocab_size": tokenizer.vocab_size}

  @app.get("/version")
  async def version():
    return {"version": _version()}

  @app.get("/health")
  async def health():
    if not runner.alive:
      return JSONResponse({"status": "engine stopped"}, status_code=503)
    if not runner.accepting:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    if runner.warming:  # requests sent now wait for the warm-up: 503 tells a load balancer not to route yet
      return JSONResponse({"status": "warming up", "warmup": warmup.status() if warmup is not None else None},
                          status_code=503, headers={"Retry-After": "5"})
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(counters.text(), media_type=CONTENT_TYPE_LATEST)

  def openapi() -> dict:
    """FastAPI's schema, with the request models the routes parse themselves (they read the body by hand: 413,
    415 and deep nesting are answered before pydantic sees it) added as components."""
    if app.openapi_schema is None:
      from fastapi.openapi.utils import get_openapi
      schema = get_openapi(title=app.title, version=_version(), routes=app.routes,
                           description="OpenAI-compatible API over a RocketKV-compressed KV cache")
      components = schema.setdefault("components", {}).setdefault("schemas", {})
      for m in (protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeRequest,
                protocol.DetokenizeRequest):
        s = m.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(s.pop("$defs", {}))
        components[m.__name__] = s
      app.openapi_schema = schema
    return app.openapi_schema

  app.openapi = openapi

  return app


try:
  import uvicorn
except ImportError:  # pragma: no cover - fastapi without uvicorn
  uvicorn = None


if uvicorn is not None:
  class UvicornServer(uvicorn.Server):
    """uvicorn.Server that drains the engine before closing connections: on shutdown it stops accepting,
    lets requests in flight run up to `drain_s`, then aborts the rest, so each client gets a definite end
    (a finished answer, or an error object / 503) instead of a cut connection. on_listening(url): called once the
    socket is bound (the URL of its real port: --port 0 picks one), while the warm-up may still run."""

    def __init__(self, config: "uvicorn.Config", runner: EngineRunner, drain_s: float, on_listening=None):
      super().__init__(config)
      self.runner, self.drain_s, self.on_listening = runner, drain_s, on_listening

    async def startup(self, sockets=None) -> None:
      await super().startup(sockets)
      if self.started and self.on_listening is not None and self.servers:
        port, host = self.servers[0].sockets[0].getsockname()[1], self.config.host
        self.on_listening(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1")

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
