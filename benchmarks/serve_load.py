"""Load benchmark of `rocketkv serve` as its clients see it: an asynchronous HTTP client (aiohttp, from the
`bench` / `test` extras' lm-eval[api]) sends streamed OpenAI requests with Poisson or burst arrivals and reports
TTFT / TPOT / end-to-end latency percentiles, request and token throughput, and goodput at an SLO (requests/s
that met both the TTFT and the TPOT bound), as `vllm bench serve` and JetStream's `benchmark_serving` do.

Workloads (`--workload`, comma-separated; lengths times `--scale`, or tiny ones with `--tiny`):

  long-gen       8k-token prompt, 2k-token answer: decode-bound, where a compressed cache pays.
  doc-qa         many different questions over one 32k-token document (prompt = document + question): the
                 server's prefix reuse (`cached_tokens`) serves the document from its history after a priming
                 request (the document alone, 1 token, untimed; `--no-prime` leaves it to the first question).
  chat           multi-turn sessions through /v1/chat/completions: each turn's messages are the whole
                 conversation so far (the earlier answers included) and a new user message (a passage and a
                 question), 8 turns of 4k new tokens growing past 32k. `--rate` is sessions/s here; a session
                 sends its next turn when the previous answer has arrived (`--think-s` later).
  prefill-heavy  32k-token prompt, 128-token answer: prefill-bound, the honest case where compression cannot
                 help much.

Prompts are real text: Chapter I of "Alice's Adventures in Wonderland" (public domain, the demo's document,
models/data/alice_chapter1.txt), repeated with part markers to the length needed, tokenized by the server's
`/tokenize`, so completions prompts are token ids of exactly the wanted length (chat prompts are text; their
counts come from `usage`). Every request sets `ignore_eos` (vLLM's: the model's end tokens do not stop
it), so every answer has exactly the wanted length (`--no-ignore-eos` lets answers stop early), and
`temperature: 0`. long-gen and prefill-heavy send a distinct `cache_salt` per request, so no prompt is served
from another's history; doc-qa and chat share one salt per (workload, rate), so each point starts cold.

Per request (streamed, `stream_options.include_usage`): TTFT (send to the first chunk with text), TPOT
((last chunk - first text chunk) / (output tokens - 1)), end-to-end latency, the longest gap between two text
chunks (`max_gap_s`: a decode stalled by another request's prefill shows here), prompt / output / cached tokens
from `usage`. Per (workload, rate): p50 / p90 / p99 and mean of each, request throughput, output tokens/s,
goodput (`--slo-ttft` s, `--slo-tpot` s), the server's engine stats from /metrics (and their change over the
point), /version and /v1/models, and the method (from `--launch`'s flags, else `--label`): one JSON line each to
`--out`. A warm-up pass (one request, or one session / the priming and two questions, at another salt) runs
before each workload's first point so compiles of new prompt shapes (the history's extend prefill is not
compiled at start-up) do not land in the measurement (`--no-warmup-pass` skips it).

Methods are compared by serving each in turn: `--launch` (repeatable) starts `rocketkv serve ARGS` on a free
port, waits for /health, runs every workload and rate, and stops it (always). `--table FILE.jsonl` prints the
records of a file side by side (goodput of each method and rocketkv's ratio to full per workload and rate);
`--plot FILE.png` draws latency percentiles and goodput against offered load (from `--out`'s whole file, so
both methods' lines meet in one figure).

  # CPU smoke run (under a minute): the embedded SmolLM2
  python -m benchmarks.serve_load --tiny --workload doc-qa,chat --requests 3 --rate 4 \\
      --launch "--model smollm2 --max-prompt-tokens 512 --max-slots 4 --max-new-tokens 16 --token-budget 64"
  # full against rocketkv on a GPU, one file, then the side-by-side table and the plot
  for m in full rocketkv; do python -m benchmarks.serve_load --workload long-gen,doc-qa,chat,prefill-heavy \\
      --rates 0.25,0.5,1 --requests 16 --out load.jsonl --launch "--model M --method $m --max-prompt-tokens 36864"
  done; python -m benchmarks.serve_load --table load.jsonl --plot load.png
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENT = os.path.join(ROOT, "models", "data", "alice_chapter1.txt")

QUESTIONS = (
    "Why did Alice follow the White Rabbit?", "What did the Rabbit take out of its waistcoat-pocket?",
    "What was written on the jar Alice took from a shelf?", "What did Alice think about falling down stairs?",
    "What did Alice find on the little three-legged table?", "How tall was the little door Alice found?",
    "What was written on the little bottle?", "Why did Alice check the bottle for the word 'poison'?",
    "What did the bottle taste like?", "How tall did Alice become after drinking from the bottle?",
    "What did Alice find in the little glass box?", "What was written on the cake?",
    "What happened when Alice ate the cake?", "Who is Dinah?", "What did Alice wonder about cats and bats?",
    "Describe the hall with the long row of lamps.", "What did Alice see through the little door?",
    "Why could Alice not get through the door?", "What did Alice say about the Antipodes?",
    "What was the long passage like?", "How does the chapter describe the well?",
    "What does Alice do when she is too small to reach the key?", "Summarise the chapter in three sentences.",
    "What is the tone of the chapter?", "List every object Alice finds in the hall.",
    "What does the chapter say about Alice's sister?", "Why was Alice bored at the start?",
    "What does 'Curiouser and curiouser' mean here?", "Which animals are mentioned in the chapter?",
    "What would you ask the White Rabbit?", "How long did Alice fall?", "What did Alice do with the empty jar?",
)
CHAT_ASKS = ("Summarise this passage.", "Who appears in this passage, and what do they do?",
             "What is the most surprising thing in this passage?", "Continue the story for a few sentences.",
             "What does Alice feel here, and why?", "Rewrite the first sentence of this passage plainly.",
             "What question would you ask the author about this passage?", "List the objects named in it.")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A named workload's lengths (tokens). kind: 'single' (independent completions: prompt_tokens, output_tokens),
  'doc' (a doc_tokens document + a question), 'chat' (turns: a first user message of first_tokens, then
  turn_tokens per turn, output_tokens per answer)."""

  name: str
  kind: str
  output_tokens: int
  prompt_tokens: int = 0
  doc_tokens: int = 0
  turns: int = 0
  first_tokens: int = 0
  turn_tokens: int = 0

  def scaled(self, scale: float) -> "Workload":
    s = lambda n: max(1, int(round(n * scale))) if n else 0  # noqa: E731
    return dataclasses.replace(self, output_tokens=s(self.output_tokens), prompt_tokens=s(self.prompt_tokens),
                               doc_tokens=s(self.doc_tokens), first_tokens=s(self.first_tokens),
                               turn_tokens=s(self.turn_tokens))

  def max_prompt(self) -> int:
    """The longest prompt this workload sends (chat: an estimate, with 32 tokens of template per turn)."""
    if self.kind == "single":
      return self.prompt_tokens
    if self.kind == "doc":
      return self.doc_tokens + 64
    return self.first_tokens + (self.turns - 1) * (self.turn_tokens + self.output_tokens) + 32 * self.turns + 64

  def spec(self) -> dict:
    return {k: v for k, v in dataclasses.asdict(self).items() if v}


WORKLOADS = {
    "long-gen": Workload("long-gen", "single", prompt_tokens=8192, output_tokens=2048),
    "doc-qa": Workload("doc-qa", "doc", doc_tokens=32768, output_tokens=128),
    "chat": Workload("chat", "chat", turns=8, first_tokens=4096, turn_tokens=4096, output_tokens=256),
    "prefill-heavy": Workload("prefill-heavy", "single", prompt_tokens=32768, output_tokens=128),
}
TINY = {
    "long-gen": Workload("long-gen", "single", prompt_tokens=256, output_tokens=16),
    "doc-qa": Workload("doc-qa", "doc", doc_tokens=320, output_tokens=8),
    "chat": Workload("chat", "chat", turns=3, first_tokens=96, turn_tokens=48, output_tokens=8),
    "prefill-heavy": Workload("prefill-heavy", "single", prompt_tokens=384, output_tokens=8),
}


# --- statistics ------------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
  """The q-th percentile (0..100) by linear interpolation (numpy's default); None for no values."""
  v = sorted(values)
  if not v:
    return None
  k = (len(v) - 1) * q / 100.0
  lo, hi = math.floor(k), math.ceil(k)
  return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _stats(prefix: str, values, scale: float = 1.0, digits: int = 4) -> dict:
  out = {}
  for q in (50, 90, 99):
    p = percentile(values, q)
    out[f"{prefix}_p{q}"] = None if p is None else round(p * scale, digits)
  out[f"{prefix}_mean"] = round(sum(values) / len(values) * scale, digits) if values else None
  return out


def summarize(results: list[dict], wall_s: float, slo_ttft: float, slo_tpot: float) -> dict:
  """The point's aggregate figures from its per-request results."""
  ok = [r for r in results if r["ok"]]
  ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
  tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
  e2e = [r["e2e_s"] for r in ok]
  out_tokens = sum(r["output_tokens"] or 0 for r in ok)
  good = [r for r in ok if r["ttft_s"] is not None and r["ttft_s"] <= slo_ttft
          and (r["tpot_s"] is None or r["tpot_s"] <= slo_tpot)]
  wall = max(wall_s, 1e-9)
  errors = {}
  for r in results:
    if not r["ok"]:
      errors[r["error"]] = errors.get(r["error"], 0) + 1
  expected = [r for r in ok if r.get("expected_tokens")]
  rec = dict(requests=len(results), requests_ok=len(ok), requests_failed=len(results) - len(ok),
             errors=dict(list(errors.items())[:8]), wall_s=round(wall_s, 3),
             request_throughput=round(len(ok) / wall, 4), output_tokens_per_s=round(out_tokens / wall, 2),
             total_tokens_per_s=round((out_tokens + sum(r["prompt_tokens"] or 0 for r in ok)) / wall, 2),
             goodput=round(len(good) / wall, 4), good_requests=len(good),
             good_fraction=round(len(good) / len(results), 4) if results else None,
             prompt_tokens_mean=round(sum(r["prompt_tokens"] or 0 for r in ok) / len(ok), 1) if ok else None,
             prompt_tokens_max=max((r["prompt_tokens"] or 0 for r in ok), default=None),
             output_tokens_total=out_tokens,
             output_tokens_exact=all(r["output_tokens"] == r["expected_tokens"] for r in expected) if expected
             else None,
             cached_tokens_mean=round(sum(r["cached_tokens"] or 0 for r in ok) / len(ok), 1) if ok else None,
             cached_fraction=(round(sum(r["cached_tokens"] or 0 for r in ok)
                                    / max(1, sum(r["prompt_tokens"] or 0 for r in ok)), 4) if ok else None))
  rec |= _stats("ttft_s", ttft) | _stats("tpot_ms", tpot, 1e3, 3) | _stats("e2e_s", e2e)
  rec |= _stats("max_gap_s", [r["max_gap_s"] for r in ok if r.get("max_gap_s") is not None])
  rec["tpot_p99_over_p50"] = (round(rec["tpot_ms_p99"] / rec["tpot_ms_p50"], 3) if rec["tpot_ms_p50"] else None)
  return rec


# --- the server ------------------------------------------------------------------------------------------------


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


LAUNCH_PREFIX = ("rocketkv", "serve")


def launch_args(text: str) -> list[str]:
  """`rocketkv serve`'s flags from --launch's string ('rocketkv serve' / 'serve' in front are dropped)."""
  args = shlex.split(text)
  for word in LAUNCH_PREFIX:  # the CLI's name, then the subcommand
    if args[:1] == [word]:
      args = args[1:]
  return args


def flag(args: list[str], name: str, default=None):
  """The value of `--name V` or `--name=V` in args (the last one), else default."""
  value = default
  for i, a in enumerate(args):
    if a == name and i + 1 < len(args):
      value = args[i + 1]
    elif a.startswith(name + "="):
      value = a.split("=", 1)[1]
  return value


class Launched:
  """`rocketkv serve ARGS --port P` as a child process, its output in a log file; `stop()` sends SIGINT (the
  server drains and exits 0), then kills it after `grace_s`."""

  def __init__(self, args: list[str], log_path: str | None, console):
    self.args = list(args)
    if flag(self.args, "--port") is None:
      self.args += ["--port", str(free_port())]
    if flag(self.args, "--host") is None:
      self.args += ["--host", "127.0.0.1"]
    self.port = int(flag(self.args, "--port"))
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = log_path or tempfile.NamedTemporaryFile(prefix="serve_load_", suffix=".log", delete=False).name
    self.cmd = [sys.executable, "-m", "rocketkv_jax.serving.cli", "serve", *self.args]
    console.log(f"launching: rocketkv serve {shlex.join(self.args)} (log: {self.log_path})")
    self.log = open(self.log_path, "ab")
    env = dict(os.environ, COLUMNS="200", PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                 stdin=subprocess.DEVNULL)

  def tail(self, n: int = 30) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
    except OSError:
      return ""

  async def wait_ready(self, timeout_s: float) -> None:
    import aiohttp
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
      while True:
        if self.proc.poll() is not None:
          raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                             + self.tail())
        try:
          async with s.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status == 200:
              return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
          pass
        if time.monotonic() - t0 > timeout_s:
          raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n" + self.tail())
        await asyncio.sleep(0.25)

  def stop(self, grace_s: float = 60.0) -> int | None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGINT)
      try:
        self.proc.wait(grace_s)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(10)
    self.log.close()
    return self.proc.returncode


def parse_metrics(text: str) -> dict:
  """The server's engine stats from /metrics: `rocketkv_NAME VALUE` lines without labels (counters' `_total`
  suffix and `_created` samples dropped)."""
  out = {}
  for line in text.splitlines():
    if not line or line.startswith("#") or "{" in line:
      continue
    name, _, value = line.rpartition(" ")
    if not name.startswith("rocketkv_") or name.endswith("_created"):
      continue
    name = name[len("rocketkv_"):]
    name = name[:-len("_total")] if name.endswith("_total") else name
    try:
      v = float(value)
    except ValueError:
      continue
    out[name] = int(v) if v.is_integer() else v
  return out


class Client:
  """The HTTP side: JSON calls, the server's info, and one streamed request timed."""

  def __init__(self, session, url: str, model: str, api_key: str | None, timeout_s: float):
    url = url.rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url  # the server's root: /health, /tokenize and /v1/... below it
    self.s, self.url, self.model, self.timeout_s = session, url, model, timeout_s
    self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})

  async def get(self, path: str):
    import aiohttp
    async with self.s.get(self.url + path, headers=self.headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
      if r.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {r.status}: {(await r.text())[:300]}")
      return await (r.json() if path != "/metrics" else r.text())

  async def post(self, path: str, body: dict) -> dict:
    import aiohttp
    async with self.s.post(self.url + path, json=body, headers=self.headers,
                           timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
      if r.status != 200:
        raise RuntimeError(f"POST {path}: HTTP {r.status}: {(await r.text())[:300]}")
      return await r.json()

  async def metrics(self) -> dict:
    try:
      return parse_metrics(await self.get("/metrics"))
    except Exception:  # noqa: BLE001 - metrics are optional (another server)
      return {}

  async def tokenize(self, text: str, special: bool = True) -> list[int]:
    body = {"model": self.model, "prompt": text, "add_special_tokens": special}
    return (await self.post("/tokenize", body))["tokens"]

  async def detokenize(self, ids: list[int]) -> str:
    return (await self.post("/detokenize", {"model": self.model, "tokens": list(ids)}))["prompt"]

  async def stream(self, path: str, body: dict, chat: bool) -> dict:
    """Sends a streamed request; returns its timings, token counts and text (ok False with `error` on failure)."""
    import aiohttp
    body = dict(body, model=self.model, stream=True, stream_options={"include_usage": True})
    res = dict(ok=False, error=None, ttft_s=None, tpot_s=None, e2e_s=None, max_gap_s=None, prompt_tokens=None,
               output_tokens=None, cached_tokens=None, finish_reason=None, text="")
    t0 = time.perf_counter()
    first = last = None
    parts, usage, gap = [], None, 0.0
    try:
      async with self.s.post(self.url + path, json=body, headers=self.headers,
                             timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
        if r.status != 200:
          text = await r.text()
          try:
            err = json.loads(text)["error"]
            res["error"] = f"HTTP {r.status} {err.get('code') or err.get('type')}: {err.get('message', '')[:200]}"
          except (ValueError, KeyError, TypeError):
            res["error"] = f"HTTP {r.status}: {text[:200]}"
          return res
        buf = b""
        async for chunk in r.content.iter_any():
          buf += chunk
          while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
              if not line.startswith(b"data:"):
                continue
              data = line[5:].strip()
              if data == b"[DONE]":
                continue
              obj = json.loads(data)
              if "error" in obj:
                e = obj["error"]
                res["error"] = f"stream error {e.get('code') or e.get('type')}: {str(e.get('message'))[:200]}"
                return res
              now = time.perf_counter()
              for c in obj.get("choices") or ():
                text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if text:
                  parts.append(text)
                  if first is None:
                    first = now
                  else:
                    gap = max(gap, now - last)
                  last = now
                if c.get("finish_reason"):
                  res["finish_reason"] = c["finish_reason"]
                  last = now
              if obj.get("usage"):
                usage = obj["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
      res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      return res
    end = time.perf_counter()
    res["text"] = "".join(parts)
    if usage is None:
      res["error"] = "no usage in the stream"
      return res
    res["prompt_tokens"] = usage.get("prompt_tokens")
    res["output_tokens"] = n = usage.get("completion_tokens")
    res["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    res["e2e_s"] = round(end - t0, 6)
    res["max_gap_s"] = round(gap, 6)
    if first is not None:
      res["ttft_s"] = round(first - t0, 6)
      if n and n > 1:
        res["tpot_s"] = round((last - first) / (n - 1), 6)
    elif n:  # tokens without any text (all special / held back): the first token came with the end
      res["ttft_s"] = res["e2e_s"]
    res["ok"] = True
    return res


# --- prompts ---------------------------------------------------------------------------------------------------


class Text:
  """The document as token ids (tokenized once by the server), long enough for every workload: the chapter
  repeated, each copy headed by a part number."""

  def __init__(self, ids: list[int], bos: list[int]):
    self.ids, self.bos = ids, bos

  @classmethod
  async def build(cls, client: Client, need: int) -> "Text":
    with open(DOCUMENT, encoding="utf-8") as f:
      chapter = f.read()
    probe = await client.tokenize(chapter, special=False)
    copies = max(1, math.ceil((need + 64) / max(1, len(probe))) + 1)
    text = "".join(f"\n\n[Part {k + 1}]\n\n{chapter}" for k in range(copies))
    ids = await client.tokenize(text, special=False)
    with_special, plain = await client.tokenize("a", special=True), await client.tokenize("a", special=False)
    bos = with_special[:len(with_special) - len(plain)]  # the BOS the tokenizer adds, if any
    return cls(ids, bos)

  def slice(self, start: int, n: int) -> list[int]:
    start = start % max(1, len(self.ids) - n)
    return self.ids[start:start + n]


def _salt(*parts) -> str:
  return "serve_load-" + "-".join(str(p) for p in parts)


class Runner:
  """Builds a workload's requests and runs one (workload, rate) point."""

  def __init__(self, client: Client, text: Text, args, console):
    self.client, self.text, self.args, self.console = client, text, args, console
    self.run_id = uuid.uuid4().hex[:8]
    self.qcache: dict[str, list[int]] = {}

  def sampling(self, out: int) -> dict:
    body = {"max_tokens": out, "temperature": 0.0}
    if not self.args.no_ignore_eos:
      body["ignore_eos"] = True
    return body

  async def q_ids(self, text: str) -> list[int]:
    if text not in self.qcache:
      self.qcache[text] = await self.client.tokenize(text, special=False)
    return self.qcache[text]

  def single_prompt(self, w: Workload, i: int) -> list[int]:
    n = w.prompt_tokens - len(self.text.bos)
    return self.text.bos + self.text.slice(1009 * i, n)

  def doc_prompt(self, w: Workload) -> list[int]:
    return self.text.bos + self.text.ids[:w.doc_tokens - len(self.text.bos)]

  async def question(self, w: Workload, i: int) -> list[int]:
    q = QUESTIONS[i % len(QUESTIONS)] + (f" (Question {i + 1}.)" if i >= len(QUESTIONS) else "")
    return self.doc_prompt(w) + await self.q_ids(f"\n\nQuestion: {q}\nAnswer:")

  async def one(self, w: Workload, i: int, salt: str, sem, progress, record: list, *, session=None, turn=None,
                messages=None, prompt=None, t_sched=None) -> dict:
    body = self.sampling(w.output_tokens) | {"cache_salt": salt}
    async with sem:
      if messages is not None:
        res = await self.client.stream("/v1/chat/completions", body | {"messages": messages}, chat=True)
      else:
        res = await self.client.stream("/v1/completions", body | {"prompt": prompt}, chat=False)
    res |= dict(index=i, session=session, turn=turn, sent_s=None if t_sched is None else round(t_sched, 4),
                expected_tokens=None if self.args.no_ignore_eos else w.output_tokens)
    if record is not None:
      record.append(res)
    if progress is not None:
      progress()
    return res

  async def chat_session(self, w: Workload, s: int, salt: str, sem, progress, record, t_sched=None):
    stride = w.first_tokens + w.turns * w.turn_tokens
    offset = 7919 * s + s * stride
    passage = await self.client.detokenize(self.text.slice(offset, w.first_tokens))
    messages = [{"role": "user", "content": f"Session {s + 1}. Read this passage.\n\n{passage}\n\n{CHAT_ASKS[0]}"}]
    pos = offset + w.first_tokens
    for t in range(w.turns):
      res = await self.one(w, s * w.turns + t, salt, sem, progress, record, session=s, turn=t, messages=messages,
                           t_sched=t_sched if t == 0 else None)
      if not res["ok"]:
        for u in range(t + 1, w.turns):  # the rest of the session was never sent
          if record is not None:
            record.append(dict(ok=False, error="session ended by an earlier failure", ttft_s=None, tpot_s=None,
                               e2e_s=None, prompt_tokens=None, output_tokens=None, cached_tokens=None,
                               index=s * w.turns + u, session=s, turn=u, expected_tokens=None))
          if progress is not None:
            progress()
        return
      if t + 1 < w.turns:
        if self.args.think_s:
          await asyncio.sleep(self.args.think_s)
        more = await self.client.detokenize(self.text.slice(pos, w.turn_tokens))
        pos += w.turn_tokens
        messages = messages + [{"role": "assistant", "content": res["text"]},
                               {"role": "user", "content": f"{more}\n\n{CHAT_ASKS[(t + 1) % len(CHAT_ASKS)]}"}]

  async def warm(self, w: Workload) -> float:
    """Untimed: one request (doc-qa: the priming and two questions; chat: one session) at its own salt, so
    the shapes this workload reaches are compiled before the measurement."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(1 << 30)
    salt = _salt(self.run_id, w.name, "warmup")
    warm_w = dataclasses.replace(w, output_tokens=min(w.output_tokens, 16))
    out = []
    if w.kind == "single":
      out.append(await self.one(warm_w, 0, salt, sem, None, None, prompt=self.single_prompt(w, 99991)))
    elif w.kind == "doc":
      out.append(await self.one(dataclasses.replace(w, output_tokens=1), -1, salt, sem, None, None,
                                prompt=self.doc_prompt(w)))
      for i in range(2):
        out.append(await self.one(warm_w, i, salt, sem, None, None, prompt=await self.question(w, 1000 + i)))
    else:
      await self.chat_session(warm_w, 9973, salt, sem, None, out)
    bad = [r["error"] for r in out if not r["ok"]]
    if bad:
      raise RuntimeError(f"{w.name}: the warm-up request failed: {bad[0]}")
    return time.perf_counter() - t0

  async def point(self, w: Workload, rate: float | None, n: int | None, duration: float | None, progress_cb,
                  seed: int) -> tuple[list[dict], float, dict]:
    """Runs one point: arrivals at `rate` (None: all at once) until n requests (chat: sessions) were sent or
    `duration` s passed; returns (results, wall seconds, extra fields)."""
    rng = random.Random(seed)
    salt_shared = _salt(self.run_id, w.name, rate, seed)
    sem = asyncio.Semaphore(self.args.max_concurrency or (1 << 30))
    results: list[dict] = []
    extra = {}
    if w.kind == "doc" and not self.args.no_prime:
      prime = await self.one(dataclasses.replace(w, output_tokens=1), -1, salt_shared, sem, None, None,
                             prompt=self.doc_prompt(w))
      extra["prime"] = {k: prime[k] for k in ("ok", "error", "e2e_s", "prompt_tokens", "cached_tokens")}
      if not prime["ok"]:
        raise RuntimeError(f"{w.name}: the priming request failed: {prime['error']}")
    questions = [await self.question(w, i) for i in range(n or 0)] if w.kind == "doc" and n else None
    tasks = []
    t0 = time.perf_counter()
    t_next = 0.0
    i = 0
    while True:
      if n is not None and i >= n:
        break
      if duration is not None and t_next > duration:
        break
      delay = t0 + t_next - time.perf_counter()
      if delay > 0:
        await asyncio.sleep(delay)
      if w.kind == "chat":
        coro = self.chat_session(w, i, salt_shared, sem, progress_cb, results, t_sched=t_next)
      elif w.kind == "doc":
        prompt = questions[i] if questions else await self.question(w, i)
        coro = self.one(w, i, salt_shared, sem, progress_cb, results, prompt=prompt, t_sched=t_next)
      else:
        coro = self.one(w, i, _salt(self.run_id, w.name, rate, seed, i), sem, progress_cb, results,
                        prompt=self.single_prompt(w, i), t_sched=t_next)
      tasks.append(asyncio.create_task(coro))
      i += 1
      if rate is not None:
        t_next += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    extra["sent"] = i
    return sorted(results, key=lambda r: r["index"]), wall, extra


# --- the run ---------------------------------------------------------------------------------------------------


def _git_commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def _delta(before: dict, after: dict) -> dict:
  keys = ("tokens_generated", "prompt_tokens_reused", "prompt_tokens_prefilled", "compiles",
          "history_store_seconds")
  return {k: after[k] - before[k] for k in keys if k in before and k in after}


async def run_server(url: str, launch: list[str] | None, args, workloads: list[Workload], rates, console,
                     emit) -> None:
  import aiohttp
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  connector = aiohttp.TCPConnector(limit=0, force_close=False)
  async with aiohttp.ClientSession(connector=connector) as session:
    probe = Client(session, url, "", args.api_key, args.request_timeout_s)
    models = await probe.get("/v1/models")
    model = args.model or models["data"][0]["id"]
    client = Client(session, url, model, args.api_key, args.request_timeout_s)
    try:
      version = await client.get("/version")
    except Exception:  # noqa: BLE001
      version = None
    card = next((m for m in models["data"] if m["id"] == model), models["data"][0])
    max_len = card.get("max_model_len")
    for w in workloads:
      if max_len and w.max_prompt() + w.output_tokens > max_len:
        console.log(f"[yellow]warning: {w.name} needs prompts up to ~{w.max_prompt()} tokens + {w.output_tokens} "
                    f"new; the server's max_model_len is {max_len} (raise --max-prompt-tokens)")
    need = max(max(w.prompt_tokens, w.doc_tokens, w.first_tokens + w.turns * w.turn_tokens) for w in workloads)
    text = await Text.build(client, need)
    runner = Runner(client, text, args, console)
    method = flag(launch, "--method", "rocketkv") if launch is not None else args.label
    budget = flag(launch, "--token-budget", "256") if launch is not None else None
    kv_dtype = flag(launch, "--kv-cache-dtype") if launch is not None else None
    if kv_dtype is not None:  # the config's name for the server's spelling ("fp8" -> "float8_e4m3fn"; "auto": None)
      from rocketkv_jax.serving.cli import parse_kv_dtype
      kv_dtype = parse_kv_dtype(kv_dtype)
    spec = f"{method}[kv_cache_dtype={kv_dtype}]" if kv_dtype else method  # the accuracy suite's method spec
    base = dict(kind="serve_load", method=method, label=args.label or spec, kv_cache_dtype=kv_dtype,
                token_budget=int(budget) if budget and budget.isdigit() else budget,
                model=flag(launch, "--model", "smollm2") if launch is not None else model, served_model=model,
                url=url, launch=shlex.join(launch) if launch is not None else None, server_version=version,
                server_models=models, git_commit=_git_commit(),
                command=shlex.join([os.path.basename(sys.executable), "-m", "benchmarks.serve_load", *sys.argv[1:]]),
                tiny=args.tiny, scale=args.scale, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                ignore_eos=not args.no_ignore_eos, max_concurrency=args.max_concurrency)
    for w in workloads:
      if not args.no_warmup_pass:
        s = await runner.warm(w)
        console.log(f"{w.name}: warm-up pass {s:.1f} s")
      for rate in rates:
        before = await client.metrics()
        per = w.turns if w.kind == "chat" else 1
        total = (args.requests * per) if args.requests else None
        label = f"{method or '?'} {w.name} " + ("burst" if rate is None else f"{rate:g}/s")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=not console.is_terminal) as progress:
          task = progress.add_task(label, total=total)
          results, wall, extra = await runner.point(
              w, rate, args.requests, args.duration, lambda: progress.advance(task), args.seed)
        after = await client.metrics()
        rec = dict(base, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   workload=w.name, workload_spec=w.spec(), arrival="burst" if rate is None else "poisson",
                   rate=rate, rate_unit="sessions/s" if w.kind == "chat" else "requests/s",
                   planned=args.requests, duration_limit_s=args.duration)
        rec |= summarize(results, wall, args.slo_ttft, args.slo_tpot) | extra
        rec |= dict(engine_stats=after, engine_delta=_delta(before, after),
                    per_request=[{k: v for k, v in r.items() if k != "text"} for r in results])
        emit(rec)


def print_table(records: list[dict], console, title: str = "serve_load") -> None:
  from rich.table import Table
  t = Table(title=title)
  for col in ("method", "slots", "workload", "rate", "ok", "req/s", "goodput", "out tok/s", "TTFT p50/p99 s",
              "TPOT p50/p99 ms", "E2E p50/p99 s", "cached", "prompt"):
    t.add_column(col, justify="left" if col in ("method", "workload") else "right")
  f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
  for r in records:
    rate = "burst" if r.get("rate") is None else f"{r['rate']:g}"
    slots = (r.get("engine_stats") or {}).get("max_slots")
    t.add_row(str(r.get("label") or r.get("method")), "-" if slots is None else f"{slots:g}", r["workload"], rate, f"{r['requests_ok']}/{r['requests']}",
              f(r["request_throughput"], 3), f(r["goodput"], 3), f(r["output_tokens_per_s"], 1),
              f"{f(r['ttft_s_p50'])}/{f(r['ttft_s_p99'])}", f"{f(r['tpot_ms_p50'], 1)}/{f(r['tpot_ms_p99'], 1)}",
              f"{f(r['e2e_s_p50'])}/{f(r['e2e_s_p99'])}", f(r.get("cached_fraction"), 2),
              f(r.get("prompt_tokens_mean"), 0))
  console.print(t)


def read_records(path: str) -> list[dict]:
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        r = json.loads(line)
        if r.get("kind") == "serve_load":
          out.append(r)
  return out


def compare_table(records: list[dict], console, base: str = "full", target: str = "rocketkv") -> None:
  """Every record side by side per (workload, rate): each method's goodput, TTFT / TPOT p99 and output tokens/s,
  and target's goodput over base's (the latest record of each method wins)."""
  from rich.table import Table
  methods = list(dict.fromkeys(r.get("label") or r.get("method") or "?" for r in records))
  cells: dict = {}
  for r in records:
    cells[(r["workload"], r.get("rate"), r.get("label") or r.get("method") or "?")] = r
  points = list(dict.fromkeys((r["workload"], r.get("rate")) for r in records))
  t = Table(title=f"goodput (requests/s meeting the SLO) and latency per method; ratio = {target} / {base}")
  t.add_column("workload")
  t.add_column("rate", justify="right")
  for m in methods:
    t.add_column(f"{m} goodput", justify="right")
    t.add_column(f"{m} TTFT p99 s / TPOT p99 ms / tok/s", justify="right")
  t.add_column(f"{target}/{base}", justify="right")
  f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
  for wl, rate in points:
    row = [wl, "burst" if rate is None else f"{rate:g}"]
    for m in methods:
      r = cells.get((wl, rate, m))
      row += ["" , ""] if r is None else [f"{f(r['goodput'], 3)} ({r['good_requests']}/{r['requests']})",
                                         f"{f(r['ttft_s_p99'])} / {f(r['tpot_ms_p99'], 1)} / "
                                         f"{f(r['output_tokens_per_s'], 0)}"]
    a, b = cells.get((wl, rate, target)), cells.get((wl, rate, base))
    if a is None or b is None:
      row.append("-")
    elif b["goodput"] > 0:
      row.append(f"{a['goodput'] / b['goodput']:.2f}x")
    else:
      row.append("inf" if a["goodput"] > 0 else "-")
    t.add_row(*row)
  console.print(t)
  # per workload: each method's best goodput over the offered loads it was run at
  best = Table(title=f"best goodput over the offered loads, per workload; ratio = {target} / {base}")
  best.add_column("workload")
  for m in methods:
    best.add_column(f"{m} (at rate)", justify="right")
  best.add_column(f"{target}/{base}", justify="right")
  for wl in dict.fromkeys(w for w, _ in points):
    row, got = [wl], {}
    for m in methods:
      rs = [r for (w, _, mm), r in cells.items() if w == wl and mm == m]
      if not rs:
        row.append("")
        continue
      r = max(rs, key=lambda r: r["goodput"])
      got[m] = r["goodput"]
      row.append(f"{r['goodput']:.3f} ({'burst' if r.get('rate') is None else format(r['rate'], 'g')})")
    if target in got and base in got:
      row.append(f"{got[target] / got[base]:.2f}x" if got[base] > 0 else ("inf" if got[target] > 0 else "-"))
    else:
      row.append("-")
    best.add_row(*row)
  console.print(best)


def plot(records: list[dict], path: str) -> None:
  """Per workload (rows): TTFT p50/p99, TPOT p50/p99 and goodput (with throughput dashed) against offered load,
  one colour per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  try:
    from benchmarks.plot_style import method_color
  except ImportError:  # pragma: no cover
    method_color = lambda m: None  # noqa: E731
  workloads = list(dict.fromkeys(r["workload"] for r in records))
  fig, axes = plt.subplots(len(workloads), 3, figsize=(14, 3.6 * len(workloads)), squeeze=False)
  for row, wl in zip(axes, workloads):
    rs = [r for r in records if r["workload"] == wl]
    rates = sorted({r["rate"] for r in rs if r.get("rate") is not None})
    burst_x = (max(rates) * 2 if rates else 1.0)
    for m in dict.fromkeys(r.get("label") or r.get("method") or "?" for r in rs):
      pts = sorted((((burst_x if r.get("rate") is None else r["rate"]), r) for r in rs
                    if (r.get("label") or r.get("method") or "?") == m), key=lambda p: p[0])  # repeats: run order
      x = [p for p, _ in pts]
      c = method_color(str(m).split("[")[0])
      for ax, key, unit in ((row[0], "ttft_s", "s"), (row[1], "tpot_ms", "ms")):
        ax.plot(x, [r[f"{key}_p50"] for _, r in pts], "-o", color=c, label=f"{m} p50")
        ax.plot(x, [r[f"{key}_p99"] for _, r in pts], "--^", color=c, label=f"{m} p99")
        ax.set_ylabel(f"{key.split('_')[0].upper()} ({unit})")
      row[2].plot(x, [r["goodput"] for _, r in pts], "-o", color=c, label=f"{m} goodput")
      row[2].plot(x, [r["request_throughput"] for _, r in pts], ":x", color=c, label=f"{m} throughput")
      row[2].set_ylabel("requests/s")
    slo = rs[0]
    row[0].axhline(slo["slo_ttft_s"], color="gray", lw=0.8, ls=":")
    row[1].axhline(slo["slo_tpot_s"] * 1e3, color="gray", lw=0.8, ls=":")
    unit = rs[0].get("rate_unit", "requests/s")
    for ax in row:
      ax.set_ylim(bottom=0)
      if rates and max(rates) / min(rates) > 4:
        ax.set_xscale("log")
      ax.set_xlabel(f"offered load ({unit}{'; burst at the right' if any(r.get('rate') is None for r in rs) else ''})")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    row[0].set_title(f"{wl}: time to first token")
    row[1].set_title(f"{wl}: time per output token")
    row[2].set_title(f"{wl}: goodput (TTFT<={slo['slo_ttft_s']:g}s, TPOT<={slo['slo_tpot_s'] * 1e3:g}ms)",
                     fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_argument_group("server")
  src.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
  src.add_argument("--launch", action="append", default=None, metavar="ARGS",
                   help="start `rocketkv serve ARGS` on a free port, run everything, stop it (repeat to run several "
                        "servers one after the other, e.g. --method full, then --method rocketkv)")
  src.add_argument("--launch-timeout-s", type=float, default=1200.0, help="wait this long for /health (warm-up)")
  src.add_argument("--server-log", default=None, help="the launched server's log file (default: a temp file)")
  src.add_argument("--label", default=None, help="the method / label recorded (default: --launch's --method, "
                   "with its --kv-cache-dtype as the accuracy suite spells it: rocketkv[kv_cache_dtype=float8_e4m3fn])")
  src.add_argument("--model", default=None, help="the model id to request (default: the server's first)")
  src.add_argument("--api-key", default=os.environ.get("ROCKETKV_API_KEY"))
  wl = p.add_argument_group("workload")
  wl.add_argument("--workload", default="doc-qa", help=f"comma-separated: {', '.join(WORKLOADS)} or all")
  wl.add_argument("--tiny", action="store_true", help="tiny lengths for a CPU run against the embedded SmolLM2")
  wl.add_argument("--scale", type=float, default=1.0, help="multiply every length (prompts and answers)")
  arr = wl.add_mutually_exclusive_group()
  arr.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (chat: sessions)")
  arr.add_argument("--rates", default=None, help="comma-separated rates to sweep, e.g. 0.5,1,2,4 ('burst' allowed)")
  arr.add_argument("--burst", action="store_true", help="everything at once (the default)")
  wl.add_argument("--requests", type=int, default=None, help="requests per point (chat: sessions); default 16, "
                  "tiny 4")
  wl.add_argument("--duration", type=float, default=None, help="send arrivals for this many seconds instead")
  wl.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
  wl.add_argument("--think-s", type=float, default=0.0, help="chat: pause between an answer and the next turn")
  wl.add_argument("--no-ignore-eos", action="store_true", help="let answers stop at EOS (no ignore_eos)")
  wl.add_argument("--no-prime", action="store_true", help="doc-qa: no untimed priming request for the document")
  wl.add_argument("--no-warmup-pass", action="store_true", help="no untimed warm-up pass per workload")
  wl.add_argument("--seed", type=int, default=0)
  wl.add_argument("--request-timeout-s", type=float, default=3600.0)
  rep = p.add_argument_group("report")
  rep.add_argument("--slo-ttft", type=float, default=None,
                   help="goodput's TTFT bound in seconds (default 5; --tiny: 30, for a CPU)")
  rep.add_argument("--slo-tpot", type=float, default=None,
                   help="goodput's TPOT bound in seconds (default 0.05; --tiny: 1, for a CPU)")
  rep.add_argument("--out", default=None, help="append one JSON line per (server, workload, rate) here")
  rep.add_argument("--plot", default=None, help="PNG: latency and goodput vs offered load (--out's whole file)")
  rep.add_argument("--table", default=None, metavar="FILE.jsonl",
                   help="print FILE's records side by side per method (and --plot them), run nothing")
  rep.add_argument("--base", default="full", help="--table's ratio denominator method (default full)")
  rep.add_argument("--target", default="rocketkv", help="--table's ratio numerator method (default rocketkv)")
  args = p.parse_args(argv)
  if args.table is None and (args.url is None) == (args.launch is None):
    p.error("give --url or --launch (or --table FILE)")
  if args.duration is None and args.requests is None:
    args.requests = 4 if args.tiny else 16
  if args.slo_ttft is None:
    args.slo_ttft = 30.0 if args.tiny else 5.0
  if args.slo_tpot is None:
    args.slo_tpot = 1.0 if args.tiny else 0.05
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from rich.console import Console
  console = Console(stderr=True)
  out = Console()
  if not out.is_terminal:  # a log file: the tables whole
    out = Console(width=200)
  if args.table is not None:
    records = read_records(args.table)
    print_table(records, out)
    compare_table(records, out, args.base, args.target)
    if args.plot:
      plot(records, args.plot)
    return 0
  names = list(WORKLOADS) if args.workload == "all" else [w.strip() for w in args.workload.split(",") if w.strip()]
  unknown = [w for w in names if w not in WORKLOADS]
  if unknown:
    console.print(f"unknown workload(s) {unknown}: choose from {', '.join(WORKLOADS)}")
    return 2
  workloads = [(TINY if args.tiny else WORKLOADS)[w] for w in names]
  if args.scale != 1.0:
    workloads = [w.scaled(args.scale) for w in workloads]
  if args.rates:
    rates = [None if r.strip() == "burst" else float(r) for r in args.rates.split(",") if r.strip()]
  else:
    rates = [None if args.burst or args.rate is None else args.rate]
  if args.duration is not None and None in rates:
    console.print("--duration needs a rate (burst sends everything at once: give --requests)")
    return 2
  records: list[dict] = []

  def emit(rec: dict) -> None:
    records.append(rec)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    console.log(f"{rec['label']} {rec['workload']} rate={rec['rate']}: {rec['requests_ok']}/{rec['requests']} ok, "
                f"goodput {rec['goodput']:.3f}/s, TTFT p50 {rec['ttft_s_p50']} s, TPOT p50 {rec['tpot_ms_p50']} ms")

  def terminated(signum, frame):  # `timeout` and job control: unwind, so the launched server is stopped
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, terminated)
  servers = [(args.url, None)] if args.launch is None else [(None, launch_args(a)) for a in args.launch]
  status = 0
  for url, launch in servers:
    launched = None
    try:
      if launch is not None:
        launched = Launched(launch, args.server_log, console)
        asyncio.run(launched.wait_ready(args.launch_timeout_s))
        url = launched.url
      asyncio.run(run_server(url, launch, args, workloads, rates, console, emit))
    except KeyboardInterrupt:
      status = 130
      break
    except Exception as e:  # noqa: BLE001 - report, stop the server, go on with the next one
      console.print(f"[red]error: {type(e).__name__}: {e}")
      status = 1
    finally:
      if launched is not None:
        rc = launched.stop()
        console.log(f"server stopped (exit status {rc})")
  if records:
    print_table(records, out)
  if args.plot and records:
    plot(read_records(args.out) if args.out else records, args.plot)
    console.log(f"plot: {args.plot}")
  if any(r["requests_failed"] for r in records):
    status = status or 1
  return status


if __name__ == "__main__":
  sys.exit(main())
