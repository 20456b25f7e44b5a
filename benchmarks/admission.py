"""Admission cost: what one question over a stored document costs the serving engine (doc-qa's unit of work),
at Llama-3.1-8B scale (random bf16 weights).

For each method: an Engine with a history (its device tier holding the document's K/V), the document prefilled
into it once (`Engine.remember`), then `--questions` questions of `--question` random tokens each, every one a
prompt of document + question admitted as the scheduler admits it: `Engine.prefill` (the stored prefix reused,
the rest prefilled over it, the whole prompt compressed under the request's own plan, its new K/V added to the
history), then the insert into a slot. Each phase is timed to completion (block_until_ready), the first
questions (which compile) left out. With --profile DIR, `--profiled` further admissions run under
`jax.profiler` and the device ops with the most time per admission are reported, with the device's busy time
against the wall time (what the host adds).

  python -m benchmarks.admission --out /root/out/admission.jsonl --profile /root/out/trace   # GPU
  python -m benchmarks.admission --tiny --doc 300 --questions 3                             # CPU smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time

import jax
import numpy as np

from benchmarks.decode import LLAMA_31_8B, TINY, build_model, parse_tokens
from benchmarks.profile_util import device_op_times
from benchmarks.serve import BenchTokenizer, git_commit, random_prompt
from rocketkv_jax.serving import Engine, EngineConfig, Request, SamplingParams


def admit(engine: Engine, ids: list[int], rid: str, slot: int) -> dict:
  """One question's admission, each phase to completion: seconds of its prefill and of its insert."""
  t0 = time.perf_counter()
  p = engine.prefill(Request(rid, ids, SamplingParams(max_tokens=engine.config.max_new_tokens)))
  jax.block_until_ready(tuple(p))
  t1 = time.perf_counter()
  engine.insert(p, slot)
  jax.block_until_ready(engine.decode_state)
  t2 = time.perf_counter()
  engine._slots[slot] = None  # noqa: SLF001 - the slot is reused by the next question (nothing decodes here)
  return dict(prefill_s=t1 - t0, insert_s=t2 - t1, cached=p.cached)


def measure(model, args, method: str, rng) -> dict:
  cfg = model.config
  buckets = tuple(parse_tokens(b) for b in args.buckets.split(","))
  engine = Engine(model, BenchTokenizer(), EngineConfig(
      method, token_budget=args.token_budget, max_slots=args.slots,
      max_prompt_tokens=max(args.doc + args.question, *buckets), max_new_tokens=args.max_new_tokens,
      prefill_buckets=buckets,
      history_bytes=int(args.history_gb * 2**30), history_device_bytes=int(args.history_device_gb * 2**30)))
  doc = random_prompt(rng, cfg.vocab_size, args.doc)
  t = time.perf_counter()
  held = engine.remember(doc)
  remember_s = time.perf_counter() - t
  question = lambda: doc + random_prompt(rng, cfg.vocab_size, args.question)  # noqa: E731
  warm = [admit(engine, question(), f"warm{i}", 0) for i in range(2)]
  rows = [admit(engine, question(), f"q{i}", 0) for i in range(args.questions)]
  out = dict(method=method, doc_tokens=args.doc, question_tokens=args.question, remember_s=round(remember_s, 4),
             history_tokens=held, first_admission_s=round(warm[0]["prefill_s"] + warm[0]["insert_s"], 4),
             cached_tokens=rows[-1]["cached"])
  for k in ("prefill_s", "insert_s"):
    xs = [r[k] for r in rows]
    out[k + "_p50"], out[k + "_min"] = round(float(np.median(xs)), 5), round(float(min(xs)), 5)
  out["admission_s_p50"] = round(float(np.median([r["prefill_s"] + r["insert_s"] for r in rows])), 5)
  out["admissions_per_s"] = round(1.0 / out["admission_s_p50"], 2)
  if args.profile:
    trace = f"{args.profile}/{method}"
    with jax.profiler.trace(trace):
      t = time.perf_counter()
      for i in range(args.profiled):
        admit(engine, question(), f"p{i}", 0)
      wall = (time.perf_counter() - t) / args.profiled
    times = device_op_times(trace)
    busy = sum(us for us, _ in times.values()) / args.profiled / 1e6
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]
    out.update(profiled=args.profiled, profiled_wall_s=round(wall, 5), device_busy_s=round(busy, 5),
               top_ops=[dict(op=name[:120], ms=round(us / args.profiled / 1e3, 3), calls=round(c / args.profiled, 1))
                        for name, (us, c) in top])
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--methods", default="rocketkv,full")
  ap.add_argument("--token-budget", type=int, default=256)
  ap.add_argument("--doc", default="32768", help="document tokens (e.g. 32k)")
  ap.add_argument("--question", type=int, default=40, help="tokens of each question")
  ap.add_argument("--questions", type=int, default=8, help="timed questions per method")
  ap.add_argument("--buckets", default="128,1024,33792", help="the engine's prefill buckets (as run_h200.sh's doc-qa)")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--history-gb", type=float, default=16.0)
  ap.add_argument("--history-device-gb", type=float, default=8.0)
  ap.add_argument("--profile", default=None, help="a directory for jax.profiler traces of --profiled admissions")
  ap.add_argument("--profiled", type=int, default=4)
  ap.add_argument("--top", type=int, default=25, help="device ops reported from the profile")
  ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  ap.add_argument("--out", default=None, help="append JSON lines here")
  args = ap.parse_args(argv)
  args.doc = parse_tokens(args.doc)
  model = build_model(TINY if args.tiny else LLAMA_31_8B)
  base = dict(kind="admission", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=jax.devices()[0].device_kind, commit=git_commit(), argv=["python", "-m", "benchmarks.admission"]
              + argv, jax=jax.__version__, model="tiny" if args.tiny else "llama-3.1-8b-shape",
              token_budget=args.token_budget, buckets=args.buckets, history_device_gb=args.history_device_gb)
  rng = np.random.default_rng(3)
  with open(args.out, "a") if args.out else contextlib.nullcontext() as out:
    for method in args.methods.split(","):  # each method's record printed, and appended to --out, as it ends
      line = json.dumps(dict(base, **measure(model, args, method, rng)))
      for f in (sys.stdout, out) if out else (sys.stdout,):
        print(line, file=f, flush=True)


if __name__ == "__main__":
  main()
