"""Load benchmark of `rocketkv serve` as its clients see it, with guidellm (the `bench` extra) driving the traffic:
its client, arrivals (`--profile` synchronous, concurrent, constant, poisson, throughput), synthetic prompts of
exact token counts, TTFT / ITL / end-to-end percentiles and throughput. This script adds what guidellm lacks: it
starts a server per method (`--launch`, repeatable: each started on a free port, waited for, always stopped), hands
guidellm a Hugging Face tokenizer folder written from the project's own tokenizer of the served model
(`TextTokenizer.save_hf`; no hub), gives each point its own `cache_salt`, records the server's /metrics before and
after each point (`engine_delta`), counts goodput at an SLO from guidellm's per-request results, and prints the
methods side by side against `full` (`--table`).

Workloads (`--workload`, comma-separated; lengths times `--scale`, or tiny ones with `--tiny`), as guidellm's
synthetic_text data (`--data KEY=VALUE,...` adds or overrides any of its fields):

  long-gen       8k-token prompt, 2k-token answer: decode-bound, where a compressed cache pays.
  doc-qa         questions (40 tokens) over one shared 32k-token document (guidellm's prefix_tokens with
                 prefix_count=1): the server's prefix reuse (`cached_tokens`) serves the document from its history
                 after a priming request (one untimed request at the point's salt; `--no-prime` skips it).
  chat           8-turn conversations through /v1/chat/completions: each turn sends the conversation so far (the
                 earlier answers included) and 4k new tokens, growing past 32k. guidellm's rate counts
                 conversations; a turn is sent when the previous answer has arrived.
  prefill-heavy  32k-token prompt, 128-token answer: prefill-bound, where compression cannot help much.

Every request sets `ignore_eos` (guidellm does, for a known answer length) and `temperature: 0`. cache_salt:
guidellm sends the same extra body fields with every request, so the salt is per (method, workload, point), not
per request; each synthetic prompt starts with a marker of its own (guidellm's), so no two requests share more
than a token or two of prefix, and each point starts cold. A warm-up pass (one request; doc-qa two, chat one
conversation; at its own salt) runs before each workload's first point, so compiles of new prompt shapes land
outside the measurement (`--no-warmup-pass` skips it).

TPOT here is guidellm's inter-token latency (the first token excluded: vLLM's TPOT, the SLO's bound); goodput is
requests/s over the point's duration that met TTFT <= --slo-ttft and TPOT <= --slo-tpot (a one-token answer: its
TTFT alone). One JSON line per (server, workload, point) goes to `--out`, with guidellm's own report beside it
(`--reports DIR`, default a temp folder; `guidellm`'s own tools read it).

  # CPU smoke run (a few minutes): the embedded SmolLM2, three requests one after the other
  python -m benchmarks.serve_load --tiny --workload long-gen --profile synchronous --requests 3 \\
      --launch "--model smollm2 --max-prompt-tokens 512 --max-slots 4 --max-new-tokens 16 --token-budget 64"
  # full against rocketkv on a GPU, one file, then the side-by-side table
  for m in full rocketkv; do python -m benchmarks.serve_load --workload long-gen,doc-qa,chat,prefill-heavy \\
      --rates 0.25,0.5,1 --requests 16 --out load.jsonl --launch "--model M --method $m --max-prompt-tokens 36864"
  done; python -m benchmarks.serve_load --table load.jsonl
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("synchronous", "concurrent", "constant", "poisson", "throughput")  # guidellm's; rates: --rates


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """One workload as guidellm's synthetic_text data, lengths in the served model's tokens: prompts of
  prompt_tokens after a shared prefix of prefix_tokens (one document every request asks about), answers of
  output_tokens, `turns` per conversation (a turn's prompt: the conversation so far and prompt_tokens new, the
  first turn first_prompt_tokens), sent to /v1/chat/completions if chat, else /v1/completions."""

  name: str
  prompt_tokens: int
  output_tokens: int
  prefix_tokens: int = 0
  turns: int = 1
  first_prompt_tokens: int = 0
  chat: bool = False

  @property
  def endpoint(self) -> str:
    return "/v1/chat/completions" if self.chat else "/v1/completions"

  def data(self, extra: dict | None = None) -> dict:
    """guidellm's data spec (synthetic_text), extra's fields over it."""
    d = dict(kind="synthetic_text", prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens)
    if self.prefix_tokens:
      d |= dict(prefix_tokens=self.prefix_tokens, prefix_count=1)
    if self.turns > 1:
      d["turns"] = self.turns
    if self.first_prompt_tokens:
      d["first_prompt_tokens"] = self.first_prompt_tokens
    return d | (extra or {})

  def scaled(self, scale: float) -> "Workload":
    s = lambda n: max(1, round(n * scale)) if n else 0  # noqa: E731
    return dataclasses.replace(self, prompt_tokens=s(self.prompt_tokens), output_tokens=s(self.output_tokens),
                               prefix_tokens=s(self.prefix_tokens), first_prompt_tokens=s(self.first_prompt_tokens))

  def max_prompt(self) -> int:
    """The longest prompt this workload sends (chat: an estimate, 32 tokens of template per turn)."""
    first = self.first_prompt_tokens or self.prompt_tokens
    return (self.prefix_tokens + first + (self.turns - 1) * (self.prompt_tokens + self.output_tokens)
            + (32 * self.turns if self.chat else 0))


WORKLOADS = {
    "long-gen": Workload(name="long-gen", prompt_tokens=8192, output_tokens=2048),
    "doc-qa": Workload(name="doc-qa", prefix_tokens=32768, prompt_tokens=40, output_tokens=128),
    "chat": Workload(name="chat", turns=8, first_prompt_tokens=4096, prompt_tokens=4096, output_tokens=256,
                     chat=True),
    "prefill-heavy": Workload(name="prefill-heavy", prompt_tokens=32768, output_tokens=128),
}
TINY = {
    "long-gen": Workload(name="long-gen", prompt_tokens=256, output_tokens=16),
    "doc-qa": Workload(name="doc-qa", prefix_tokens=320, prompt_tokens=16, output_tokens=8),
    "chat": Workload(name="chat", turns=3, first_prompt_tokens=96, prompt_tokens=48, output_tokens=8, chat=True),
    "prefill-heavy": Workload(name="prefill-heavy", prompt_tokens=384, output_tokens=8),
}


# --- the server ------------------------------------------------------------------------------------------------


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_args(text: str) -> list[str]:
  """`rocketkv serve`'s flags from --launch's string ('rocketkv serve' / 'serve' in front are dropped)."""
  args = shlex.split(text)
  for word in ("rocketkv", "serve"):  # the CLI's name, then the subcommand
    if args[:1] == [word]:
      args = args[1:]
  return args


def flag(args: list[str] | None, name: str, default=None):
  """The value of `--name V` or `--name=V` in args (the last one), else default."""
  value = default
  for i, a in enumerate(args or ()):
    if a == name and i + 1 < len(args):
      value = args[i + 1]
    elif a.startswith(name + "="):
      value = a.split("=", 1)[1]
  return value


def http_get(url: str, path: str, api_key: str | None = None, timeout_s: float = 60.0):
  """GET url+path: the JSON body (/metrics: the text)."""
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=timeout_s) as r:
    body = r.read().decode()
  return body if path == "/metrics" else json.loads(body)


class Launched:
  """`rocketkv serve ARGS --port P` as a child process, its output in a log file; `stop()` sends SIGINT (the
  server drains and exits 0), then kills it after `grace_s`."""

  def __init__(self, args: list[str], log_path: str | None, console):
    self.args = list(args)
    if flag(self.args, "--port") is None:
      self.args += ["--port", str(free_port())]
    if flag(self.args, "--host") is None:
      self.args += ["--host", "127.0.0.1"]
    self.url = f"http://127.0.0.1:{flag(self.args, '--port')}"
    self.log_path = log_path or tempfile.NamedTemporaryFile(prefix="serve_load_", suffix=".log", delete=False).name
    console.log(f"launching: rocketkv serve {shlex.join(self.args)} (log: {self.log_path})")
    self.log = open(self.log_path, "ab")
    self.proc = subprocess.Popen([sys.executable, "-m", "rocketkv_jax.serving.cli", "serve", *self.args],
                                 stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=dict(os.environ, COLUMNS="200", PYTHONUNBUFFERED="1"))

  def tail(self, n: int = 30) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
    except OSError:
      return ""

  def wait_ready(self, timeout_s: float) -> None:
    t0 = time.monotonic()
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                           + self.tail())
      try:
        http_get(self.url, "/health", timeout_s=5)
        return
      except (urllib.error.URLError, OSError, ValueError):
        pass
      if time.monotonic() - t0 > timeout_s:
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n" + self.tail())
      time.sleep(0.25)

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
    name = name[len("rocketkv_"):].removesuffix("_total")
    try:
      v = float(value)
    except ValueError:
      continue
    out[name] = int(v) if v.is_integer() else v
  return out


def engine_stats(url: str, api_key: str | None) -> dict:
  try:
    return parse_metrics(http_get(url, "/metrics", api_key))
  except (urllib.error.URLError, OSError, ValueError):  # metrics are optional (another server)
    return {}


DELTA_KEYS = ("tokens_generated", "prompt_tokens_reused", "prompt_tokens_prefilled", "compiles",
              "history_store_seconds")


def _delta(before: dict, after: dict) -> dict:
  return {k: after[k] - before[k] for k in DELTA_KEYS if k in before and k in after}


# --- guidellm --------------------------------------------------------------------------------------------------


def guidellm_command(given: str | None) -> list[str]:
  """guidellm's CLI: --guidellm's command, else the one beside this Python, else the one on PATH."""
  if given:
    return shlex.split(given)
  beside = os.path.join(os.path.dirname(sys.executable), "guidellm")
  found = beside if os.path.exists(beside) else shutil.which("guidellm")
  if found is None:
    raise RuntimeError("guidellm not found: pip install -c constraints.txt -e '.[bench]' (or --guidellm CMD)")
  return [found]


def processor_dir(source: str, dest: str) -> str:
  """A tokenizer folder transformers loads offline: `source` itself where it holds tokenizer.json (a HF
  checkpoint), else one written to dest from the project's tokenizer of model source `source`
  (`weights.load_tokenizer`: "smollm2", "random:<shape>", a .gguf, a catalog alias, a hub id)."""
  if os.path.isfile(os.path.join(os.path.expanduser(source), "tokenizer.json")):
    return os.path.expanduser(source)
  from rocketkv_jax.models.weights import load_tokenizer
  return load_tokenizer(source).save_hf(dest)


def scenario(w: Workload, *, url: str, model: str, processor: str, profile: str, rate: float | None,
             requests: int | None, duration: float | None, salt: str, seed: int, report: str, args) -> dict:
  """guidellm's run config (`guidellm run --scenario FILE`) for one point."""
  prof = {"kind": profile}
  if profile == "concurrent":
    prof["streams"] = [int(rate)]
  elif profile in ("constant", "poisson"):
    prof["rate"] = [rate]
  if args.max_concurrency and profile in ("constant", "poisson", "throughput"):
    prof["max_concurrency"] = args.max_concurrency
  constraints = []
  if requests:
    constraints.append({"kind": "max_requests", "count": requests * w.turns})  # guidellm counts turns
  if duration:
    constraints.append({"kind": "max_duration", "seconds": duration})
  backend = {"kind": "openai_http", "target": url, "model": model, "request_format": w.endpoint,
             "timeout": args.request_timeout_s, "extras": {"body": {"cache_salt": salt, "temperature": 0.0}}}
  if args.api_key:
    backend["api_key"] = args.api_key
  return {"spec": {
      "backend": backend, "profile": prof, "constraints": constraints,
      "tokenizer": {"kind": "huggingface_auto", "model": processor}, "data": [w.data(args.data)],
      "seed": {"kind": "static", "value": seed}, "outputs": [{"kind": "json", "path": report}],
      # sample_size 0: every request's timings and counts, not its prompt (32k-token prompts add up to GBs)
      "metrics": {"kind": "generative", "sample_size": 0,
                  "slo": {"ttft_ms": args.slo_ttft * 1e3, "tpot_ms": args.slo_tpot * 1e3}}}}


def run_guidellm(cmd: list[str], config: dict, stem: str) -> dict:
  """Runs guidellm on config (written to stem.scenario.json, its output to stem.log); its one benchmark."""
  with open(stem + ".scenario.json", "w") as f:
    json.dump(config, f, indent=1)
  env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the tokenizer folder is local
  with open(stem + ".log", "w") as log:
    rc = subprocess.run([*cmd, "run", "--scenario", stem + ".scenario.json", "--disable-console-interactive"],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
  report = config["spec"]["outputs"][0]["path"]
  if rc != 0 or not os.path.exists(report):
    with open(stem + ".log", errors="replace") as f:
      raise RuntimeError(f"guidellm exited {rc} ({stem}.log):\n" + "".join(f.readlines()[-20:]))
  with open(report) as f:
    return json.load(f)["benchmarks"][0]


def _dist(metrics: dict, key: str, scale: float, digits: int, name: str) -> dict:
  """guidellm's p50 / p90 / p99 / mean of a metric over the successful requests, scaled; None without any."""
  d = (metrics.get(key) or {}).get("successful") or {}
  have = bool(d.get("count"))
  out = {f"{name}_p{q}": round(d["percentiles"][f"p{q}"] * scale, digits) if have else None for q in (50, 90, 99)}
  return out | {f"{name}_mean": round(d["mean"] * scale, digits) if have else None}


def summarize(bench: dict, slo_ttft: float, slo_tpot: float, expected_tokens: int | None) -> dict:
  """One point's figures from guidellm's benchmark: its percentiles and throughput, and goodput (requests/s
  over its duration that met both bounds) counted from its per-request results."""
  per = []
  for status, key in (("ok", "successful"), ("errored", "errored"), ("incomplete", "incomplete")):
    for q in bench["requests"].get(key) or ():  # incomplete: cut off by --duration's end
      info, itl = q["info"], q.get("inter_token_latency_ms")
      per.append(dict(ok=status == "ok", status=status, error=info.get("error"),
                      conversation=info["conversation_id"][:8], turn=info.get("turn_index"),
                      ttft_s=_s(q.get("time_to_first_token_ms"), 1e-3),
                      tpot_s=_s(itl, 1e-3), e2e_s=_s(q.get("request_latency"), 1.0),
                      prompt_tokens=q.get("prompt_tokens"), output_tokens=q.get("output_tokens"),
                      cached_tokens=q.get("cached_tokens"), start_s=_s(q.get("request_start_time"), 1.0)))
  t0 = min((q["start_s"] for q in per if q["start_s"] is not None), default=0.0)
  for q in per:
    q["start_s"] = None if q["start_s"] is None else round(q["start_s"] - t0, 4)
  good = [q for q in per if q["ok"] and q["ttft_s"] is not None and q["ttft_s"] <= slo_ttft
          and (q["tpot_s"] is None or q["tpot_s"] <= slo_tpot)]
  duration = max(bench["duration"], 1e-9)
  errors = collections.Counter(str(q["error"])[:200] for q in per if q["status"] == "errored")
  m = bench["metrics"]
  rate = lambda k: round(((m.get(k) or {}).get("successful") or {}).get("mean") or 0.0, 4)  # noqa: E731
  okq = [q for q in per if q["ok"]]
  prompt = sum(q["prompt_tokens"] or 0 for q in okq)
  failed = sum(q["status"] == "errored" for q in per)
  rec = dict(requests=len(per), requests_ok=len(okq), requests_failed=failed,
             requests_incomplete=len(per) - len(okq) - failed,
             errors=dict(errors.most_common(8)), wall_s=round(duration, 3),
             request_throughput=rate("requests_per_second"), output_tokens_per_s=rate("output_tokens_per_second"),
             goodput=round(len(good) / duration, 4), good_requests=len(good),
             good_fraction=round(len(good) / len(per), 4) if per else None,
             guidellm_slo_attainment=m.get("slo_attainment"),
             prompt_tokens_mean=round(prompt / len(okq), 1) if okq else None,
             prompt_tokens_max=max((q["prompt_tokens"] or 0 for q in okq), default=None),
             output_tokens_total=sum(q["output_tokens"] or 0 for q in okq),
             output_tokens_exact=(all(q["output_tokens"] == expected_tokens for q in okq)
                                  if okq and expected_tokens else None),
             cached_fraction=round(sum(q["cached_tokens"] or 0 for q in okq) / max(1, prompt), 4) if okq else None)
  # guidellm 0.8.1 at times leaves the last request out of its report (created 3, the server served 3, reported
  # 2: seen on the CPU, 1 point of 8): its own count of the requests it made says so
  rec["requests_created"] = (bench.get("scheduler_state") or {}).get("created_requests")
  rec |= (_dist(m, "time_to_first_token_ms", 1e-3, 4, "ttft_s") | _dist(m, "inter_token_latency_ms", 1.0, 3, "tpot_ms")
          | _dist(m, "request_latency", 1.0, 4, "e2e_s"))
  rec["tpot_p99_over_p50"] = round(rec["tpot_ms_p99"] / rec["tpot_ms_p50"], 3) if rec["tpot_ms_p50"] else None
  return rec | dict(per_request=per)


def _s(v, scale: float):
  return None if v is None else round(v * scale, 6)


# --- the run ---------------------------------------------------------------------------------------------------


def _git_commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def run_server(url: str, launch: list[str] | None, args, workloads: list[Workload], rates, console, emit) -> None:
  """Every workload and point against one server."""
  models = http_get(url, "/v1/models", args.api_key)
  model = args.model or models["data"][0]["id"]
  try:
    version = http_get(url, "/version", args.api_key)
  except (urllib.error.URLError, OSError, ValueError):
    version = None
  card = next((m for m in models["data"] if m["id"] == model), models["data"][0])
  for w in workloads:
    if card.get("max_model_len") and w.max_prompt() + w.output_tokens > card["max_model_len"]:
      console.log(f"[yellow]warning: {w.name} needs prompts up to ~{w.max_prompt()} tokens + {w.output_tokens} "
                  f"new; the server's max_model_len is {card['max_model_len']} (raise --max-prompt-tokens)")
  cmd = guidellm_command(args.guidellm)
  reports = args.reports or tempfile.mkdtemp(prefix="serve_load_reports_")
  os.makedirs(reports, exist_ok=True)
  source = args.processor or (flag(launch, "--model", "smollm2") if launch is not None else model)
  processor = processor_dir(source, os.path.join(reports, "tokenizer"))
  run_id = uuid.uuid4().hex[:8]
  method = flag(launch, "--method", "rocketkv") if launch is not None else args.label
  budget = flag(launch, "--token-budget", "256") if launch is not None else None
  kv_dtype = flag(launch, "--kv-cache-dtype")
  if kv_dtype is not None:  # the config's name for the server's spelling ("fp8" -> "float8_e4m3fn"; "auto": None)
    from rocketkv_jax.serving.cli import parse_kv_dtype
    kv_dtype = parse_kv_dtype(kv_dtype)
  spec = f"{method}[kv_cache_dtype={kv_dtype}]" if kv_dtype else method  # the accuracy suite's method spec
  base = dict(kind="serve_load", driver="guidellm", method=method, label=args.label or spec, kv_cache_dtype=kv_dtype,
              token_budget=int(budget) if budget and budget.isdigit() else budget,
              model=flag(launch, "--model", "smollm2") if launch is not None else model, served_model=model,
              url=url, launch=shlex.join(launch) if launch is not None else None, server_version=version,
              server_models=models, git_commit=_git_commit(), processor=processor,
              command=shlex.join([os.path.basename(sys.executable), "-m", "benchmarks.serve_load", *sys.argv[1:]]),
              tiny=args.tiny, scale=args.scale, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
              max_concurrency=args.max_concurrency, seed=args.seed)

  def guide(w, profile, rate, requests, duration, salt, name):
    stem = os.path.join(reports, f"{run_id}_{method}_{w.name}_{name}")
    cfg = scenario(w, url=url, model=model, processor=processor, profile=profile, rate=rate, requests=requests,
                   duration=duration, salt=salt, seed=args.seed, report=stem + ".json", args=args)
    return run_guidellm(cmd, cfg, stem), stem + ".json"

  for w in workloads:
    if not args.no_warmup_pass:  # compiles outside the measurement, at a salt of its own
      t0 = time.perf_counter()
      guide(dataclasses.replace(w, output_tokens=min(w.output_tokens, 16)), "synchronous", None,
            2 if w.prefix_tokens else 1, None, f"serve_load-{run_id}-{w.name}-warmup", "warmup")
      console.log(f"{w.name}: warm-up pass {time.perf_counter() - t0:.1f} s")
    for rate in rates:
      point = args.profile if rate is None else f"{args.profile}@{rate:g}"
      salt = f"serve_load-{run_id}-{w.name}-{point}-{args.seed}"
      prime = None
      if w.prefix_tokens and not args.no_prime:  # the document, stored under this point's salt
        bench, _ = guide(dataclasses.replace(w, output_tokens=1), "synchronous", None, 1, None, salt,
                         point.replace("@", "_") + "_prime")
        prime = summarize(bench, args.slo_ttft, args.slo_tpot, None)["per_request"]
      before = engine_stats(url, args.api_key)
      bench, report = guide(w, args.profile, rate, args.requests, args.duration, salt, point.replace("@", "_"))
      after = engine_stats(url, args.api_key)
      rec = dict(base, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 workload=w.name, workload_spec=w.data(args.data), endpoint=w.endpoint, profile=args.profile,
                 arrival=args.profile, rate=rate, rate_unit=("streams" if args.profile == "concurrent" else
                                                             "sessions/s" if w.turns > 1 else "requests/s"),
                 planned=args.requests, duration_limit_s=args.duration, cache_salt=salt, guidellm_report=report,
                 prime=prime[0] if prime else None)
      rec |= summarize(bench, args.slo_ttft, args.slo_tpot, (args.data or {}).get("output_tokens", w.output_tokens))
      emit(rec | dict(engine_stats=after, engine_delta=_delta(before, after)))


def _rate(r: dict) -> str:
  """A point's offered load as the tables show it: the rate, N streams, or the profile (old files: burst)."""
  if r.get("rate") is None:
    return r.get("profile") or "burst"
  return f"{r['rate']:g} streams" if r.get("profile") == "concurrent" else f"{r['rate']:g}"


def print_table(records: list[dict], console, title: str = "serve_load") -> None:
  from rich.table import Table
  t = Table(title=title)
  for col in ("method", "slots", "workload", "rate", "ok", "req/s", "goodput", "out tok/s", "TTFT p50/p99 s",
              "TPOT p50/p99 ms", "E2E p50/p99 s", "cached", "prompt"):
    t.add_column(col, justify="left" if col in ("method", "workload") else "right")
  f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
  for r in records:
    slots = (r.get("engine_stats") or {}).get("max_slots")
    t.add_row(str(r.get("label") or r.get("method")), "-" if slots is None else f"{slots:g}", r["workload"],
              _rate(r), f"{r['requests_ok']}/{r['requests']}", f(r["request_throughput"], 3), f(r["goodput"], 3),
              f(r["output_tokens_per_s"], 1), f"{f(r['ttft_s_p50'])}/{f(r['ttft_s_p99'])}",
              f"{f(r['tpot_ms_p50'], 1)}/{f(r['tpot_ms_p99'], 1)}", f"{f(r['e2e_s_p50'])}/{f(r['e2e_s_p99'])}",
              f(r.get("cached_fraction"), 2), f(r.get("prompt_tokens_mean"), 0))
  console.print(t)


def read_records(path: str) -> list[dict]:
  with open(path) as f:
    return [r for r in (json.loads(line) for line in f if line.strip()) if r.get("kind") == "serve_load"]


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "-")


def compare_table(records: list[dict], console, base: str = "full", target: str = "rocketkv") -> None:
  """Every method side by side per (workload, point): goodput, TTFT / TPOT p99 and output tokens/s, and target's
  goodput over base's (the latest record of each wins); then each method's best goodput per workload."""
  from rich.table import Table
  name = lambda r: r.get("label") or r.get("method") or "?"  # noqa: E731
  methods = list(dict.fromkeys(map(name, records)))
  cells = {(r["workload"], _rate(r), name(r)): r for r in records}
  points = list(dict.fromkeys((r["workload"], _rate(r)) for r in records))
  t = Table(title=f"goodput (requests/s meeting the SLO) and latency per method; ratio = {target} / {base}")
  t.add_column("workload")
  t.add_column("rate", justify="right")
  for m in methods:
    t.add_column(f"{m} goodput", justify="right")
    t.add_column(f"{m} TTFT p99 s / TPOT p99 ms / tok/s", justify="right")
  t.add_column(f"{target}/{base}", justify="right")
  f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
  for wl, rate in points:
    row = [wl, rate]
    for m in methods:
      r = cells.get((wl, rate, m))
      row += ["", ""] if r is None else [f"{f(r['goodput'], 3)} ({r['good_requests']}/{r['requests']})",
                                         f"{f(r['ttft_s_p99'])} / {f(r['tpot_ms_p99'], 1)} / "
                                         f"{f(r['output_tokens_per_s'], 0)}"]
    a, b = cells.get((wl, rate, target)), cells.get((wl, rate, base))
    t.add_row(*row, "-" if a is None or b is None else _ratio(a["goodput"], b["goodput"]))
  console.print(t)
  best = Table(title=f"best goodput over the offered loads, per workload; ratio = {target} / {base}")
  best.add_column("workload")
  for m in methods:
    best.add_column(f"{m} (at rate)", justify="right")
  best.add_column(f"{target}/{base}", justify="right")
  for wl in dict.fromkeys(w for w, _ in points):
    row, got = [wl], {}
    for m in methods:
      rs = [r for (w, _, mm), r in cells.items() if w == wl and mm == m]
      r = max(rs, key=lambda r: r["goodput"]) if rs else None
      row.append("" if r is None else f"{r['goodput']:.3f} ({_rate(r)})")
      if r is not None:
        got[m] = r["goodput"]
    best.add_row(*row, _ratio(got[target], got[base]) if target in got and base in got else "-")
  console.print(best)


def _kv(text: str) -> dict:
  """KEY=VALUE,... with JSON values where they parse (numbers, true), else strings."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    k, _, v = part.partition("=")
    try:
      out[k.strip()] = json.loads(v)
    except ValueError:
      out[k.strip()] = v
  return out


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
  gl = p.add_argument_group("guidellm")
  gl.add_argument("--guidellm", default=None, metavar="CMD", help="guidellm's command (default: beside this "
                  "Python, else on PATH; another venv's works: it runs as a child process)")
  gl.add_argument("--processor", default=None, help="guidellm's tokenizer: a folder with tokenizer.json, or a "
                  "model source whose tokenizer is written as one (default: --launch's --model, else the served id)")
  gl.add_argument("--reports", default=None, metavar="DIR", help="guidellm's configs, logs and reports (default: a "
                  "temp folder)")
  wl = p.add_argument_group("workload")
  wl.add_argument("--workload", default="doc-qa", help=f"comma-separated: {', '.join(WORKLOADS)} or all")
  wl.add_argument("--tiny", action="store_true", help="tiny lengths for a CPU run against the embedded SmolLM2")
  wl.add_argument("--scale", type=float, default=1.0, help="multiply every length (prompts and answers)")
  wl.add_argument("--data", type=_kv, default=None, metavar="KEY=VALUE,...",
                  help="guidellm synthetic_text fields over the workload's, e.g. prompt_tokens_stdev=64")
  wl.add_argument("--profile", choices=PROFILES, default="poisson",
                  help="guidellm's arrivals: one request at a time, N streams, constant or Poisson rates, or all "
                       "at once (throughput)")
  wl.add_argument("--rate", type=float, default=None, help="one rate: requests/s (chat: sessions/s); concurrent: "
                  "streams")
  wl.add_argument("--rates", default=None, help="comma-separated rates, one point each, e.g. 0.5,1,2,4")
  wl.add_argument("--requests", type=int, default=None, help="requests per point (chat: sessions); default 16, "
                  "tiny 4")
  wl.add_argument("--duration", type=float, default=None, help="stop a point after this many seconds")
  wl.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
  wl.add_argument("--no-prime", action="store_true", help="doc-qa: no untimed priming request for the document")
  wl.add_argument("--no-warmup-pass", action="store_true", help="no untimed warm-up pass per workload")
  wl.add_argument("--seed", type=int, default=0, help="guidellm's data seed")
  wl.add_argument("--request-timeout-s", type=float, default=3600.0)
  rep = p.add_argument_group("report")
  rep.add_argument("--slo-ttft", type=float, default=None,
                   help="goodput's TTFT bound in seconds (default 5; --tiny: 30, for a CPU)")
  rep.add_argument("--slo-tpot", type=float, default=None,
                   help="goodput's TPOT bound in seconds (default 0.05; --tiny: 1, for a CPU)")
  rep.add_argument("--out", default=None, help="append one JSON line per (server, workload, point) here")
  rep.add_argument("--table", default=None, metavar="FILE.jsonl",
                   help="print FILE's records side by side per method, run nothing")
  rep.add_argument("--base", default="full", help="--table's ratio denominator method (default full)")
  rep.add_argument("--target", default="rocketkv", help="--table's ratio numerator method (default rocketkv)")
  args = p.parse_args(argv)
  if args.table is not None:
    return args
  if (args.url is None) == (args.launch is None):
    p.error("give --url or --launch (or --table FILE)")
  if args.rate is not None and args.rates:
    p.error("give --rate or --rates, not both")
  rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else (
      [args.rate] if args.rate is not None else [])
  if args.profile in ("synchronous", "throughput"):
    if rates:
      p.error(f"--profile {args.profile} takes no rate")
    rates = [None]
  elif not rates:
    p.error(f"--profile {args.profile} needs --rate or --rates")
  args.rates = rates
  if args.duration is None and args.requests is None:
    args.requests = 4 if args.tiny else 16
  args.slo_ttft = args.slo_ttft if args.slo_ttft is not None else (30.0 if args.tiny else 5.0)
  args.slo_tpot = args.slo_tpot if args.slo_tpot is not None else (1.0 if args.tiny else 0.05)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from rich.console import Console
  console = Console(stderr=True)
  out = Console() if Console().is_terminal else Console(width=200)  # a log file: the tables whole
  if args.table is not None:
    records = read_records(args.table)
    print_table(records, out)
    compare_table(records, out, args.base, args.target)
    return 0
  names = list(WORKLOADS) if args.workload == "all" else [w.strip() for w in args.workload.split(",") if w.strip()]
  unknown = [w for w in names if w not in WORKLOADS]
  if unknown:
    console.print(f"unknown workload(s) {unknown}: choose from {', '.join(WORKLOADS)}")
    return 2
  workloads = [(TINY if args.tiny else WORKLOADS)[w].scaled(args.scale) for w in names]
  records: list[dict] = []

  def emit(rec: dict) -> None:
    records.append(rec)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    console.log(f"{rec['label']} {rec['workload']} {_rate(rec)}: {rec['requests_ok']}/{rec['requests']} ok, "
                f"goodput {rec['goodput']:.3f}/s, TTFT p50 {rec['ttft_s_p50']} s, TPOT p50 {rec['tpot_ms_p50']} ms")
    if (rec["requests_created"] or 0) > rec["requests"]:
      console.log(f"[yellow]warning: guidellm made {rec['requests_created']} requests and reported "
                  f"{rec['requests']} ({rec['guidellm_report']}); the server's count: {rec['engine_delta']}")

  def terminated(signum, frame):  # `timeout` and job control: unwind, so the launched server is stopped
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, terminated)
  servers = [(args.url.rstrip("/").removesuffix("/v1"), None)] if args.launch is None else [
      (None, launch_args(a)) for a in args.launch]
  status = 0
  for url, launch in servers:
    launched = None
    try:
      if launch is not None:
        launched = Launched(launch, args.server_log, console)
        launched.wait_ready(args.launch_timeout_s)
        url = launched.url
      run_server(url, launch, args, workloads, args.rates, console, emit)
    except KeyboardInterrupt:
      status = 130
      break
    except Exception as e:  # noqa: BLE001 - report, stop the server, go on with the next one
      console.print(f"[red]error: {type(e).__name__}: {e}")
      status = 1
    finally:
      if launched is not None:
        console.log(f"server stopped (exit status {launched.stop()})")
  if records:
    print_table(records, out)
  if any(r["requests_failed"] for r in records):
    status = status or 1
  return status


if __name__ == "__main__":
  sys.exit(main())
