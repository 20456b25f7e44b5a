"""Serving benchmark: the continuous-batching engine (`rocketkv_jax.serving.Engine`) at Llama-3.1-8B scale
(random bf16 weights; speed does not depend on values), against the plain decode loop of `benchmarks/decode.py`.

For each method and slot count: an Engine (one method config, `prefill_buckets=(prompt,)`), warmed up (prefill,
insert and one decode call compiled and run), then `--requests` requests of random-token prompts of exactly
`--prompt` tokens, all submitted at once, and `engine.step()` until every one has finished. Every request sets
`ignore_eos` and asks for `--max-new-tokens` tokens, so every request runs its full length (random weights' stand-in
tokenizer has no stop ids anyway; `--model` serves a real checkpoint with its tokenizer). Reported per point:

- tokens/s over the run (first submit to last event) and steady-state tokens/s (steps that began with every
  slot busy: no admission, the step is one generate() call);
- TPOT p50 / p99 (ms per output token: the time since the request's previous event divided by the event's
  tokens, one sample per token; the tokens of a request's first event count in neither figure) and TTFT
  p50 / p99 (submit to the first event with tokens);
- the engine's decode step: median generate() time of the steady steps / steps_per_call; and, measured in
  the same process after the engine is freed, the decode benchmark's step (`benchmarks.decode.time_decode`,
  chunks of steps_per_call steps) on caches of the same batch, method config and prompt, with its bandwidth
  floor (weights + `step_read_bytes` at the copy bandwidth), so that engine overhead shows as their ratio.

Admission: `step` prefills every request inside `engine.step()`; `shared` prefills one prompt once and inserts
that prefill into every free slot before each step (the engine's JetStream primitives), so that large slot
counts (RocketKV fits hundreds of 32k requests on an H200, at ~1.4 s of prefill each) measure the decode side
in minutes; its TTFT then excludes prefill. `auto` (default) is `step` unless the point's prefills alone
(requests x the warm prefill time) would take over `--prefill-budget-s`; each record names the one used.

  python -m benchmarks.serve --out benchmarks/results/serve_h200.jsonl                      # 32k, slots 1,8,32,max
  python -m benchmarks.serve --tiny --prompt 256 --slots 1,2 --requests 4 --max-new-tokens 8  # CPU smoke test
  python -m benchmarks.serve --model smollm2 --methods rocketkv --prompt 256 --slots 8 --requests 16 \
      --max-new-tokens 64 --decode-reps 0 --steps-per-call 1   # the CPU streaming figure (and --steps-per-call 4)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rocketkv_jax as rk
from benchmarks.decode import (LLAMA_31_8B, TINY, build_model, copy_bandwidth, kv_bytes_needed, parse_tokens,
                               time_decode, weight_bytes)
from rocketkv_jax.serving import Engine, EngineConfig, Prefilled, Request, SamplingParams
from rocketkv_jax.serving.engine import device_free_bytes, fit_slots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchTokenizer:
  """What the engine asks of a tokenizer, for random weights: no EOS and no end-of-turn id (so
  `models.generate.stop_ids` gives the model's EOS only, None in both configs here) and a trivial `decode`
  (the engine decodes each request's tokens after every call for its text deltas)."""

  bos_id = None
  eos_id = None
  chat_eos_id = None

  def decode(self, ids, *, skip_special: bool = True) -> str:
    return ""


# ---------------------------------------------------------------------------------------------- the run's facts

def git_commit() -> str | None:
  """HEAD of the checkout this file is in, "+dirty" when the tree has changes; without git (a copied tree),
  $GIT_COMMIT or None."""
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"]
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10)
    if head.returncode:
      return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return None


def is_oom(e: Exception) -> bool:
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


def percentile_ms(xs, q) -> float | None:
  return round(float(np.percentile(xs, q)) * 1e3, 3) if len(xs) else None


# ---------------------------------------------------------------------------------------------- engine set-up

def method_overrides(args) -> dict:
  """The method config fields the flags set: impl (unless auto) and kv_cache_dtype (unless the model's)."""
  out = {} if args.impl == "auto" else {"impl": args.impl}
  if args.kv_cache_dtype:
    out["kv_cache_dtype"] = args.kv_cache_dtype
  return out


def engine_config(args, method: str, slots: int) -> EngineConfig:
  overrides = method_overrides(args)
  return EngineConfig(method, token_budget=args.token_budget, max_slots=slots, max_prompt_tokens=args.prompt,
                      max_new_tokens=args.max_new_tokens, steps_per_call=args.steps_per_call,
                      prefill_buckets=(args.prompt,), max_queue=max(1, args.requests_for(slots)),
                      method_overrides=overrides, prefill_chunk_tokens=args.prefill_chunk_tokens)


def most_slots(model, args, method: str) -> int:
  """'max': the engine's own sizing (`fit_slots`, what `rocketkv serve --max-slots auto` uses), --reserve-gb kept
  for temporaries; 8 where the backend gives no memory statistics (CPU)."""
  if device_free_bytes(jax.local_devices()[:1]) is None:
    return 8
  return fit_slots(model, engine_config(args, method, 1), reserve_bytes=int(args.reserve_gb * (1 << 30)))


def random_prompt(rng, vocab: int, n: int) -> list[int]:
  return rng.integers(0, vocab, n, dtype=np.int64).tolist()


def warm_up(engine: Engine, prompt_ids: list[int], steps_per_call: int) -> dict:
  """Compiles and runs prefill, insert and one decode call with one request of the benchmark's prompt length
  (max_tokens = steps_per_call, so it finishes in that call and frees its slot), then times one warm prefill
  and returns it for reuse: dict(compile_*_s (first call, compile included), prefill_s, compiles, prefilled)."""
  timings = {}
  n = min(steps_per_call, engine.config.max_new_tokens)
  req = Request("warm-up", prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True))
  t = time.perf_counter()
  p = engine.prefill(req)
  jax.block_until_ready(tuple(p))
  timings["compile_prefill_s"] = time.perf_counter() - t
  t = time.perf_counter()
  engine.insert(p, engine.free_slots()[0])
  jax.block_until_ready(engine.decode_state)
  timings["compile_insert_s"] = time.perf_counter() - t
  t = time.perf_counter()
  events = engine.generate()  # launches the call (pipelined: its tokens are read by the next generate)
  events += engine.generate()  # reads them back: synchronous
  timings["compile_decode_s"] = time.perf_counter() - t
  if not (events and events[-1].finished) or engine.stats()["active_slots"]:
    raise RuntimeError(f"the warm-up request did not finish in one decode call: {events}")
  if engine.config.prefill_chunk_tokens:  # the chunked prefill's executables (chunk, last chunk) through step()
    engine.submit(Request("warm-up-chunked", prompt_ids, SamplingParams(max_tokens=n)))
    t = time.perf_counter()
    while engine.has_work():
      engine.step()
    timings["compile_chunked_s"] = time.perf_counter() - t
  compiles = engine.stats()["compiles"]
  # one warm prefill, timed; kept as the shared prefill and as the seed of the decode benchmark's caches
  t = time.perf_counter()
  p = engine.prefill(Request("warm-prefill", prompt_ids, SamplingParams(max_tokens=n)))
  jax.block_until_ready(tuple(p))
  timings["prefill_s"] = time.perf_counter() - t
  return dict(timings, compiles=compiles, prefilled=p)


# ---------------------------------------------------------------------------------------------- measurements

def measure_turn1(engine: Engine, requests: list[Request], shared: Prefilled | None, arrival_s: float = 0.0) -> dict:
  """Runs `requests` (all submitted at t0, or request i at t0 + i * arrival_s) through `engine.step()` until every
  one has finished; returns the per-run figures (module doc). `shared`: a prefill inserted into each free slot for
  the next request before each step (admission `shared`), else None (the engine prefills every request inside
  step())."""
  spc = engine.config.steps_per_call
  submit_t, first_t, last_t = {}, {}, {}
  tokens_of = collections.Counter()
  tpot, steady_s, steady_tokens, admit_s = [], [], 0, 0.0
  pending = collections.deque(requests)
  t0 = time.perf_counter()
  arrivals = collections.deque((t0 + i * arrival_s, r) for i, r in enumerate(requests)) if shared is None else None
  if shared is None:
    pending.clear()
  else:
    submit_t = {r.request_id: t0 for r in requests}
  calls, prev_busy, trace = 0, False, []
  while pending or arrivals or engine.has_work():
    while arrivals and arrivals[0][0] <= time.perf_counter():
      _, r = arrivals.popleft()
      submit_t[r.request_id] = time.perf_counter()
      engine.submit(r)
    if shared is None and not engine.has_work():  # nothing to run before the next arrival
      time.sleep(max(0.0, arrivals[0][0] - time.perf_counter()))
      continue
    if shared is not None:
      t = time.perf_counter()
      for slot in engine.free_slots():
        if not pending:
          break
        engine.insert(Prefilled(shared[0], shared[1], pending.popleft()), slot)
      admit_s += time.perf_counter() - t
    # no free slot now and none at the step before: step() admits nothing and is one generate(), and no
    # admission's device work is still queued ahead of it (the engine is pipelined: a call's prefill and insert
    # are waited for by the NEXT step's token read)
    busy_now = not engine.free_slots()
    busy, prev_busy = busy_now and prev_busy, busy_now
    t = time.perf_counter()
    events = engine.step()
    now = time.perf_counter()
    calls += 1
    n = 0
    for e in events:
      if not e.token_ids:
        continue
      k, rid = len(e.token_ids), e.request_id
      n += k
      if rid in first_t:  # one TPOT sample per token: the time since the request's last event / k
        tpot.extend([(now - last_t[rid]) / k] * k)
      else:  # TTFT; the tokens that came with the first one are in neither figure
        first_t[rid] = now
      last_t[rid] = now
      tokens_of[rid] += k
    trace.append([round((now - t) * 1e3, 2), n, int(busy)])
    if busy:
      steady_s.append(now - t)
      steady_tokens += n
  run_s = time.perf_counter() - t0
  ttft = [first_t[r] - submit_t[r] for r in first_t]
  total = sum(tokens_of.values())
  want = [r.sampling.max_tokens for r in requests]
  return dict(
      run_s=round(run_s, 4), decode_calls=calls, output_tokens=total,
      all_full_length=[tokens_of[r.request_id] for r in requests] == want,
      tokens_per_s=round(total / run_s, 2),
      steady_calls=len(steady_s),
      steady_tokens_per_s=round(steady_tokens / sum(steady_s), 2) if steady_s else None,
      engine_step_ms=round(float(np.median(steady_s)) / spc * 1e3, 4) if steady_s else None,
      engine_step_ms_mean=round(float(np.mean(steady_s)) / spc * 1e3, 4) if steady_s else None,
      tpot_ms_p50=percentile_ms(tpot, 50), tpot_ms_p99=percentile_ms(tpot, 99),
      ttft_ms_p50=percentile_ms(ttft, 50), ttft_ms_p99=percentile_ms(ttft, 99),
      admit_s=round(admit_s, 4) if shared is not None else None,
      steps=trace)  # per step: (ms, tokens delivered, steady)


def measure_turn2(model, tokenizer, args, method: str, news: list[int]) -> list[dict]:
  """Multi-turn prefill cost: a first turn of `--prompt` tokens, then second turns that add N new tokens.

  One engine with a history store (sessions: the first turn's K/V kept in host memory) and one without. For
  each N: the second turn's prefill (`Engine.prefill`, the JetStream primitive: logits ready, the new K/V
  copied to the host history) over the stored history, against prefilling the whole second-turn prompt from
  scratch. Each is timed on its second run (the first compiles), with fresh random new tokens each time.
  Prefill over the history should cost in proportion to N, plus the history's host-to-device copy."""
  cfg = model.config
  rng = np.random.default_rng(17)
  top = args.prompt + max(news)
  buckets = tuple(sorted(set(news) | {args.prompt, top}))
  overrides = method_overrides(args)
  kw = dict(method=method, token_budget=args.token_budget, max_slots=1, max_prompt_tokens=top,
            max_new_tokens=args.max_new_tokens, steps_per_call=args.steps_per_call, prefill_buckets=buckets,
            method_overrides=overrides)
  hist = Engine(model, tokenizer, EngineConfig(**kw, history_bytes=int(args.history_gb * 2**30),
                                               history_device_bytes=int(args.history_device_gb * 2**30)))
  first = random_prompt(rng, cfg.vocab_size, args.prompt)

  def timed(engine, ids, rid):
    t = time.perf_counter()
    p = engine.prefill(Request(rid, ids, SamplingParams(max_tokens=1)))
    p[0].block_until_ready()
    return time.perf_counter() - t, p.cached

  t1_compile, _ = timed(hist, first, "t1")
  hist.history.clear()
  t1, _ = timed(hist, first, "t1")
  rows = []
  for n in news:
    timed(hist, first + random_prompt(rng, cfg.vocab_size, n), f"w{n}")  # compiles this (whole, new) pair
    t2, cached = timed(hist, first + random_prompt(rng, cfg.vocab_size, n), f"t2-{n}")
    rows.append(dict(new_tokens=n, turn2_prefill_s=round(t2, 4), cached_tokens=cached,
                     prefilled_tokens=args.prompt + n - cached, ms_per_new_token=round(t2 / n * 1e3, 4)))
  host = hist.stats()["kv_bytes_host"]
  del hist
  gc.collect()
  plain = Engine(model, tokenizer, EngineConfig(**kw))
  for row in rows:
    n = row["new_tokens"]
    timed(plain, random_prompt(rng, cfg.vocab_size, args.prompt + n), f"c{n}")
    row["reprefill_s"] = round(timed(plain, random_prompt(rng, cfg.vocab_size, args.prompt + n), f"f{n}")[0], 4)
    row["speedup"] = round(row["reprefill_s"] / row["turn2_prefill_s"], 2)
  del plain
  gc.collect()
  return [dict(part="turn2", turn1_prefill_s=round(t1, 4), turn1_first_call_s=round(t1_compile, 4),
               history_bytes_host_end=host, **row) for row in rows]


def measure_decode_bench(model, config, prefilled_caches, slots: int, steps_per_call: int, reps: int) -> dict:
  """The decode benchmark's step on this engine's plan: `slots` copies of one request's prefill cache
  (assembled as benchmarks/decode.py does), then `time_decode` with chunks of steps_per_call steps."""
  caches = (jax.tree.map(jnp.copy, prefilled_caches) if slots == 1
            else rk.concat_caches([prefilled_caches] * slots))
  sec, per_step, length, _ = time_decode(model, config, caches, chunk=steps_per_call, reps=reps)
  del caches
  return dict(decode_step_ms=round(sec * 1e3, 4), decode_step_ms_min=round(min(per_step) * 1e3, 4),
              decode_steps_timed=reps * steps_per_call, decode_length=length)


# ---------------------------------------------------------------------------------------------- one point

def run_point(model, tokenizer, args, method: str, slots: int, facts: dict) -> dict:
  """One (method, slot count): engine, warm-up, the run, then (engine freed) the decode benchmark's step."""
  cfg = model.config
  rng = np.random.default_rng(slots * 7919 + len(method))
  n_req = args.requests_for(slots)
  engine = Engine(model, tokenizer, engine_config(args, method, slots))
  # every request sets ignore_eos: a real checkpoint's (--model) EOS and end-of-turn never end one early
  config = engine.method_config
  rec = dict(capacity=config.capacity, cache_bytes_per_slot=engine.stats()["kv_bytes_device"] // slots,
             kv_bytes_device=engine.stats()["kv_bytes_device"])
  warm_ids = random_prompt(rng, cfg.vocab_size, args.prompt)
  warm = warm_up(engine, warm_ids, args.steps_per_call)
  shared_p = warm.pop("prefilled")
  rec.update({k: round(v, 4) if isinstance(v, float) else v for k, v in warm.items()})
  rec["compiles_warmup"] = rec.pop("compiles")
  admission = args.admission
  if admission == "auto":  # real prefills unless they alone would take longer than --prefill-budget-s
    admission = "shared" if n_req * warm["prefill_s"] > args.prefill_budget_s else "step"
  rec["admission"] = admission
  if admission == "shared":  # every request is the warm-up prompt, whose prefill each insert reuses
    reqs = [Request(f"r{i}", warm_ids, SamplingParams(max_tokens=args.max_new_tokens, seed=i, ignore_eos=True))
            for i in range(n_req)]
  else:
    reqs = [Request(f"r{i}", random_prompt(rng, cfg.vocab_size, args.prompt),
                    SamplingParams(max_tokens=args.max_new_tokens, seed=i, ignore_eos=True)) for i in range(n_req)]
  rec.update(measure_turn1(engine, reqs, shared_p if admission == "shared" else None,
                           args.arrival_s if admission == "step" else 0.0))
  rec["compiles_after_run"] = engine.stats()["compiles"]
  del engine, reqs
  gc.collect()
  if args.decode_reps:
    # the decode benchmark starts at the prompt and runs (reps + 1) * steps_per_call steps: stay in the plan
    reps = max(1, min(args.decode_reps, args.max_new_tokens // args.steps_per_call - 1))
    one_caches = shared_p[1]
    del shared_p
    rec.update(measure_decode_bench(model, config, one_caches, slots, args.steps_per_call, reps))
    del one_caches
    gc.collect()
    if rec.get("engine_step_ms"):
      rec["engine_vs_decode"] = round(rec["engine_step_ms"] / rec["decode_step_ms"], 4)
    # the step's floor as benchmarks/decode.py counts it: the weights plus what the method reads at the cache's
    # valid length after the timed steps (the kept tokens, not the prompt's), under the requests' own plan
    row = rk.plan_rows(method, token_budget=args.token_budget, prompt_lens=[args.prompt],
                       max_new_tokens=args.max_new_tokens, head_dim=cfg.head_dim,
                       **method_overrides(args)).row_configs[0]
    kv = kv_bytes_needed(row, cfg, rec["decode_length"], slots)
    rec["floor_kv_bytes"] = int(kv)
    rec["floor_ms"] = round((facts["weight_bytes"] + kv) / facts["copy_bandwidth"] * 1e3, 4)
  return rec


# ---------------------------------------------------------------------------------------------- output

COLUMNS = [("method", "method"), ("slots", "slots"), ("requests", "reqs"), ("tokens_per_s", "tok/s"),
           ("steady_tokens_per_s", "steady tok/s"), ("tpot_ms_p50", "TPOT p50"), ("tpot_ms_p99", "TPOT p99"),
           ("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"), ("engine_step_ms", "engine ms/step"),
           ("decode_step_ms", "decode ms/step"), ("engine_vs_decode", "engine/decode"), ("floor_ms", "floor ms"),
           ("compiles_warmup", "compiles"), ("admission", "admission"), ("status", "status")]


TURN2_COLUMNS = [("method", "method"), ("prompt", "turn 1 tokens"), ("turn1_prefill_s", "turn 1 prefill s"),
                 ("new_tokens", "turn 2 new"), ("cached_tokens", "reused"), ("turn2_prefill_s", "turn 2 prefill s"),
                 ("ms_per_new_token", "ms/new token"), ("reprefill_s", "re-prefill s"), ("speedup", "speed-up"),
                 ("status", "status")]


def print_table(records, title: str, columns=COLUMNS) -> None:
  try:
    from rich.console import Console
    from rich.table import Table
  except ImportError:  # plain text where rich is missing
    print("\t".join(h for _, h in columns))
    for r in records:
      print("\t".join(str(r.get(k, "")) for k, _ in columns))
    return
  table = Table(title=title)
  for _, h in columns:
    table.add_column(h, justify="left" if h in ("method", "admission", "status") else "right")
  for r in records:
    table.add_row(*["" if r.get(k) is None else str(r.get(k)) for k, _ in columns])
  Console(width=200).print(table)


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--methods", default="full,rocketkv")
  ap.add_argument("--token-budget", type=int, default=256)
  ap.add_argument("--prompt", default="32k", help="prompt tokens of every request (e.g. 32k, 256)")
  ap.add_argument("--slots", default="1,8,32,max", help="comma list; 'max' = the most slots that fit")
  ap.add_argument("--steps-per-call", type=int, default=EngineConfig().steps_per_call,
                  help="tokens per slot per decode call (default: the engine's, one token per stream chunk; the "
                       "server's --steps-per-call)")
  ap.add_argument("--arrival-s", type=float, default=0.0,
                  help="with admission step: request i arrives at i * this many seconds (0: all at once)")
  ap.add_argument("--prefill-chunk-tokens", type=int, default=0,
                  help="the engine's chunked prefill: prompt tokens prefilled per step (0: whole prompts)")
  ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens every request generates")
  ap.add_argument("--requests", type=int, default=None, help="requests per point (default 2 * slots)")
  ap.add_argument("--admission", choices=("auto", "step", "shared"), default="auto",
                  help="step: every request prefilled in engine.step(); shared: one prefill inserted per request; "
                       "auto: step unless the requests' prefills would take over --prefill-budget-s")
  ap.add_argument("--prefill-budget-s", type=float, default=90.0,
                  help="auto admission: the prefill seconds per point above which admission is shared")
  ap.add_argument("--decode-reps", type=int, default=16,
                  help="chunks the decode-benchmark comparison times (0: skip it)")
  ap.add_argument("--reserve-gb", type=float, default=4.0,
                  help="device memory 'max' leaves for prefill and decode temporaries")
  ap.add_argument("--impl", default="auto")
  ap.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16", "float8_e4m3fn", "float8_e5m2"],
                  help="how the slots' caches store K/V (the configs' kv_cache_dtype; default: the model's dtype)")
  ap.add_argument("--compile-cache", default=None, help="a directory for JAX's persistent compilation cache")
  ap.add_argument("--turn2", default="",
                  help="comma list of new-token counts: also measure second-turn prefill over the stored history "
                       "against re-prefilling (e.g. 512,4096; '' skips it)")
  ap.add_argument("--history-gb", type=float, default=32.0, help="host memory of the --turn2 engine's history")
  ap.add_argument("--history-device-gb", type=float, default=0.0,
                  help="device tier of the --turn2 engine's history (recent sessions' K/V kept on the device)")
  ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  ap.add_argument("--model", default=None,
                  help="a checkpoint `rocketkv_jax.models.load` reads (e.g. smollm2) instead of random weights: its "
                       "real tokenizer detokenizes every event, as the server's engine does (requests ignore EOS)")
  ap.add_argument("--out", default=None, help="append JSON lines here")
  args = ap.parse_args(argv)
  args.prompt = parse_tokens(args.prompt)
  fixed = args.requests
  args.requests_for = lambda slots: fixed if fixed is not None else 2 * slots
  return args


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  if args.model:  # a real checkpoint and its tokenizer (detokenization included in the host work measured)
    from rocketkv_jax.models import load
    model, tokenizer = load(args.model)
    cfg = model.config
  else:
    cfg = TINY if args.tiny else LLAMA_31_8B
  if args.prompt + args.max_new_tokens > cfg.max_len:
    raise SystemExit(f"--prompt {args.prompt} + --max-new-tokens {args.max_new_tokens} exceeds max_len={cfg.max_len}")
  dev = jax.devices()[0]
  bw, _ = copy_bandwidth(1 << 26 if args.tiny or dev.platform == "cpu" else 4 << 30)
  if not args.model:
    model, tokenizer = build_model(cfg), BenchTokenizer()
  facts = dict(weight_bytes=weight_bytes(model), copy_bandwidth=bw)
  base = dict(kind="serve", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=dev.device_kind, commit=git_commit(), argv=["python", "-m", "benchmarks.serve"] + argv,
              jax=jax.__version__, model=args.model or ("tiny" if args.tiny else "llama-3.1-8b-shape"),
              xla_flags=os.environ.get("XLA_FLAGS", ""), copy_bandwidth_GBps=round(bw / 1e9, 1),
              weight_bytes=facts["weight_bytes"], token_budget=args.token_budget, prompt=args.prompt,
              max_new_tokens=args.max_new_tokens, steps_per_call=args.steps_per_call, admission=args.admission,
              prefill_chunk_tokens=args.prefill_chunk_tokens, arrival_s=args.arrival_s,
              history_device_gb=args.history_device_gb, kv_cache_dtype=args.kv_cache_dtype)
  out = open(args.out, "a") if args.out else None
  records = []

  def emit(rec):
    records.append(rec)
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()

  for method in args.methods.split(","):
    if args.turn2:
      point = dict(base, method=method, token_budget=args.token_budget if rk.get_method(method).budgeted else None)
      try:
        for row in measure_turn2(model, tokenizer, args, method, [parse_tokens(x) for x in args.turn2.split(",")]):
          emit(dict(point, **row, status="ok"))
      except Exception as e:  # noqa: BLE001 - reported with its point
        emit(dict(point, part="turn2", status="OOM" if is_oom(e) else "error", error=f"{type(e).__name__}: {str(e)[:400]}"))
      gc.collect()
    for spec in [x for x in args.slots.split(",") if x]:
      point = dict(base, method=method, slots_spec=spec,
                   token_budget=args.token_budget if rk.get_method(method).budgeted else None)
      slots = None
      for attempt in range(4):
        retry = False
        try:
          if slots is None:
            slots = most_slots(model, args, method) if spec == "max" else int(spec)
          rec = dict(point, slots=slots, requests=args.requests_for(slots), status="ok")
          rec.update(run_point(model, tokenizer, args, method, slots, facts))
        except Exception as e:  # noqa: BLE001 - every failure is reported with its point
          rec = dict(point, slots=slots, requests=args.requests_for(slots) if slots else None,
                     status="OOM" if is_oom(e) else "error", error=f"{type(e).__name__}: {str(e)[:400]}")
          retry = is_oom(e) and spec == "max" and slots is not None and slots > 1 and attempt < 3
        gc.collect()  # after the except block: its traceback no longer holds the failed point's buffers
        if not retry:
          break
        slots = max(1, int(slots * 0.8))  # 'max' overshot: fewer slots
      emit(rec)
  if out:
    out.close()
  points = [r for r in records if r.get("part") != "turn2"]
  if points:
    print_table(points, f"serve: {base['model']} on {base['device']}, prompt {args.prompt}, "
                        f"{args.max_new_tokens} new tokens, {args.steps_per_call} steps/call")
  turns = [r for r in records if r.get("part") == "turn2"]
  if turns:
    print_table(turns, f"second turn over the stored history vs re-prefill: {base['model']} on {base['device']}",
                TURN2_COLUMNS)
  return records


if __name__ == "__main__":
  main()
