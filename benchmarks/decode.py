"""Whole-model decode benchmark at Llama-3.1-8B scale (random bf16 weights; speed does not depend on values).

For each method, token budget, context and batch: a real prefill of random-token prompts (sub-batches,
compressed per layer, assembled with `concat_caches`), then timed decode of the whole model: one jitted
chunk of `--chunk` greedy steps through the one decode loop (`models.loop`, the loop `generate` and the
accuracy suite run; no stop ids, so a loop of static trip count; caches donated, per-layer buffers,
unrolled layers), median over `--reps` chunks. Each point is reported against its bandwidth floor: the
weight bytes plus the KV / KT / index bytes the method must read per step (its `step_read_bytes`), at the
device-to-device copy bandwidth measured in the same run. Peak device memory (`memory_stats()` peak over prefill + decode, batch 1) is measured in a fresh
subprocess per point, since the peak counter cannot be reset.

  python -m benchmarks.decode --out benchmarks/results/decode_h200.jsonl            # default grid
  python -m benchmarks.decode --tiny --contexts 256 --batches 1,2 --steps 4          # CPU smoke test

Mixed lengths (`--mixed 4k,8k,16k,32k,...`: one row per listed context): each row prefilled alone at the paper's
plan for its own length (`rocketkv_jax.plan_rows`, the rule `generate` and the engine use), the batch decoded
under the maxima of the rows' plans; then the same batch size of the longest row's plan alone, timed in the same
process, so a mixed batch can be held against its longest row:

  python -m benchmarks.decode --methods rocketkv --budgets 256 --mixed 4k,8k,16k,32k,4k,8k,16k,32k
  python -m benchmarks.decode --methods rocketkv --budgets 256 --mixed '32k*391' --limits 32k   # an engine's shapes

A/B in one process (`--ab MODULE.FLAG=V1,V2`): each point is compiled once per value of a module flag that the
decode step reads while tracing, and the variants are timed in alternating rounds on the same caches, so the
comparison does not carry the 0.1-0.3 ms that the same code's step moves between processes on the H200:

  python -m benchmarks.decode --contexts 32k --methods quest --ab rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,512
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rocketkv_jax as rk
from rocketkv_jax.kernels import triton_util
from rocketkv_jax.models import llama, shapes
from rocketkv_jax.models.loop import LoopConfig, decode_loop_jit
from rocketkv_jax.models.sharding import default_impl, make_mesh, shard_batch, shard_model, using

# the shapes live in the package (`models/shapes.py`: also `rocketkv serve --model random:llama-3.1-8b`)
LLAMA_31_8B, LLAMA_31_70B, TINY = shapes.LLAMA_31_8B, shapes.LLAMA_31_70B, shapes.TINY
SHAPES = {"8b": LLAMA_31_8B, "70b": LLAMA_31_70B}
NEW_TOKENS = 256  # max_new_tokens every plan is made for (capacity holds warm-up + timed steps)


def parse_tokens(s: str) -> int:
  s = s.strip().lower()
  return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def _median_seconds(f, x, reps: int = 10) -> float:
  f(x).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def copy_bandwidth(nbytes: int = 4 << 30, rounds: int = 3) -> tuple[float, list[float]]:
  """Device-to-device copy bandwidth, bytes read + written per second: the best of `rounds` medians of 10
  (the best, so that the floor is never made easy by one slow round), and every round's figure."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  per_round = [2 * nbytes / _median_seconds(f, x) for _ in range(rounds)]
  del x
  return max(per_round), per_round


def weight_bytes(model) -> int:
  """Bytes one decode step must read: every parameter except the embedding table (B rows only)."""
  state = nnx.state(model)
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  return int(total - model.embed[...].nbytes)


def kv_bytes_needed(config, cfg: llama.LlamaConfig, length: int, batch: int, itemsize: int = 2) -> int:
  """KV, KT-page and index bytes a step must read at `length` valid slots, all layers: the method's
  `step_read_bytes` (ALGORITHM.md §3, §5) for every KV head, sequence and layer."""
  per_head = config.step_read_bytes(length, head_dim=cfg.head_dim, itemsize=itemsize)
  return int(per_head * cfg.n_kv_heads * batch * cfg.n_layers)


def chunk_loop(chunk: int) -> LoopConfig:
  """`chunk` greedy decode steps per call: the loop's first token comes from the given logits (no step),
  so it makes chunk + 1 tokens."""
  return LoopConfig(max_new_tokens=chunk + 1)


def decode_chunk(model, logits_BV, caches, config, *, n):
  """n greedy decode steps of the whole model through the decode loop (caches donated): LoopOutput."""
  graphdef, state = nnx.split(model)
  return decode_loop_jit(graphdef, state, logits_BV, caches, None, None, config=config,
                         loop=chunk_loop(n))


def build_model(cfg, seed=0):
  return llama.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def prefill_caches(model, config, context: int, batch: int, sub_batch: int, seed: int, mesh=None,
                   reps: int = 1):
  """Prefills `batch` random prompts of `context` tokens in sub-batches, each compressed per layer, and
  assembles the caches. Returns (caches, seconds of one sub-batch prefill, compile excluded: the median of
  `reps` runs of the compiled prefill; a single first run varied by +-6% at 16k on the H200).

  Only the first sub-batch is really distinct prompts; further sub-batches reuse its compressed cache
  (decode time does not depend on values), which keeps prefill device time bounded at large batch."""
  graphdef, state = nnx.split(model)
  vocab = model.config.vocab_size
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (sub_batch, context), 0, vocab, jnp.int32)
  lengths = jnp.full((sub_batch,), context, jnp.int32)
  if mesh is not None:
    tokens, lengths = shard_batch(tokens, mesh), shard_batch(lengths, mesh)
  with using(mesh):
    compiled = llama.prefill_jit.lower(graphdef, state, tokens, lengths, config=config).compile()
  times = []
  for _ in range(max(1, reps)):
    caches = None  # the previous run's caches are freed before the next run allocates its own
    t0 = time.perf_counter()
    logits, caches = compiled(state, tokens, lengths)
    jax.block_until_ready((logits, caches))
    times.append(time.perf_counter() - t0)
  seconds = float(np.median(times))
  if batch == sub_batch:
    return caches, seconds
  parts = [caches] * (batch // sub_batch)
  assembled = rk.concat_caches(parts)
  del caches, parts
  return assembled, seconds


def compile_decode(model, config, caches, chunk: int):
  """(run, compiled): `chunk`-step calls of the decode loop compiled for these caches; run(caches) -> the
  loop's output. Each call starts from the same logits (the values do not change the speed) and carries the
  caches on (donated), so the cache keeps growing."""
  graphdef, state = nnx.split(model)
  b = caches[0].k.shape[0]
  logits = jnp.zeros((b, model.config.vocab_size), jnp.float32)
  compiled = decode_loop_jit.lower(graphdef, state, logits, caches, None, None, config=config,
                                   loop=chunk_loop(chunk)).compile()
  return (lambda caches: compiled(state, logits, caches, None, None)), compiled


def timed_calls(run, caches, *, chunk: int, reps: int):
  """(seconds per step of each of `reps` calls, the caches after them)."""
  per_step = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = run(caches)
    out.tokens.block_until_ready()
    per_step.append((time.perf_counter() - t0) / chunk)
    caches = out.caches
  return per_step, caches


def time_decode(model, config, caches, *, chunk: int, reps: int, profile_dir: str | None = None):
  """Median seconds per step of `chunk`-step calls of the decode loop (`compile_decode`), after one warm-up
  call; with profile_dir, one more call traced there and its top ops and op groups (`profile_util`) returned."""
  run, compiled = compile_decode(model, config, caches, chunk)
  out = run(caches)  # warm-up
  out.tokens.block_until_ready()
  per_step, caches = timed_calls(run, out.caches, chunk=chunk, reps=reps)
  top = None
  if profile_dir:
    from benchmarks.profile_util import op_groups, top_ops
    os.makedirs(profile_dir, exist_ok=True)
    with open(os.path.join(profile_dir, "decode_chunk.hlo.txt"), "w") as f:  # names the ops of the trace
      f.write(compiled.as_text())
    with jax.profiler.trace(profile_dir):
      out = run(caches)
      out.tokens.block_until_ready()
      caches = out.caches
    top = dict(top_ops=top_ops(profile_dir, 40, steps=chunk), op_groups=op_groups(profile_dir, steps=chunk))
  length = int(np.asarray(caches[0].length).max())
  del caches, out
  return float(np.median(per_step)), per_step, length, top


def parse_ab(spec: str):
  """(module, attribute name, values) of `--ab MODULE.FLAG=V1,V2,...` (values as Python literals; separated by
  "|" instead where they hold commas, `FLAG=(2, 2)|(4, 2)`), checked
  before any work: the module imports, it has the flag, at least two distinct values."""
  name, sep, vals = spec.partition("=")
  mod_name, _, attr = name.rpartition(".")
  if not (sep and mod_name and attr):
    raise SystemExit(f"--ab={spec!r} must be MODULE.FLAG=V1,V2 (e.g. "
                     "rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,512)")
  try:
    module = importlib.import_module(mod_name)
  except ImportError as e:
    raise SystemExit(f"--ab={spec!r}: cannot import {mod_name!r} ({e})") from None
  if not hasattr(module, attr):
    raise SystemExit(f"--ab={spec!r}: module {mod_name!r} has no attribute {attr!r}")
  try:
    # "|" separates values that hold commas themselves (tuples: FLAG=(2,2)|(4,2))
    values = [ast.literal_eval(v.strip()) for v in vals.split("|" if "|" in vals else ",")]
  except (ValueError, SyntaxError):
    raise SystemExit(f"--ab={spec!r}: the values {vals!r} must be Python literals, separated by ',' (or '|' where "
                     "they hold commas)") from None
  if len(values) < 2 or len(set(map(repr, values))) != len(values):
    raise SystemExit(f"--ab={spec!r}: give at least two distinct values")
  return module, attr, values


def ab_decode(model, config, caches, *, chunk: int, reps: int, rounds: int, module, attr: str, values):
  """The decode loop compiled once per value of module.attr (read while tracing: the trace caches are cleared
  before each compile, and the flag is restored after), one warm-up call each, then `rounds` rounds in which
  every variant in turn runs ceil(reps / rounds) timed calls on the same caches (they carry on from variant
  to variant). Returns ([seconds per step of each timed call] per variant, [round medians] per variant,
  [hash of the compiled HLO] per variant, final length)."""
  saved = getattr(module, attr)
  runs, hashes = [], []
  try:
    for v in values:
      setattr(module, attr, v)
      jax.clear_caches()
      run, compiled = compile_decode(model, config, caches, chunk)
      runs.append(run)
      hashes.append(hashlib.sha1(compiled.as_text().encode()).hexdigest()[:12])
  finally:
    setattr(module, attr, saved)
    jax.clear_caches()
  for run in runs:  # warm-up
    out = run(caches)
    out.tokens.block_until_ready()
    caches = out.caches
  per_round = -(-reps // rounds)
  steps = [[] for _ in values]
  round_ms = [[] for _ in values]
  for _ in range(rounds):
    for i, run in enumerate(runs):
      times, caches = timed_calls(run, caches, chunk=chunk, reps=per_round)
      steps[i] += times
      round_ms[i].append(round(float(np.median(times)) * 1e3, 3))
  length = int(np.asarray(caches[0].length).max())
  del caches
  return steps, round_ms, hashes, length


def _is_oom(e: Exception) -> bool:
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


def plan(method, budget, contexts, cfg, impl, kv_cache_dtype=None, kt_cache_dtype=None, *, output_at: int = 0,
         decode_budget: int | None = None) -> rk.BatchPlan:
  """The plans of a batch of prompts of these lengths (`rocketkv_jax.plan_rows`, each row its own length's), for
  output_at + NEW_TOKENS new tokens, K/V stored as `kv_cache_dtype` (the config field; None: the model's dtype), the
  page summaries as `kt_cache_dtype` where the method keeps them (None: the keys' dtype; other methods ignore it),
  and a decode budget where given (docs/ALGORITHM.md §4b)."""
  kt = {"kt_cache_dtype": kt_cache_dtype} if kt_cache_dtype and rk.get_method(method).uses_kt_pages else {}
  if decode_budget is not None:
    kt["decode_budget"] = decode_budget
  return rk.plan_rows(method, token_budget=budget, prompt_lens=contexts, max_new_tokens=NEW_TOKENS + output_at,
                      head_dim=cfg.head_dim, impl=impl, kv_cache_dtype=kv_cache_dtype, **kt)


def fast_forward(caches, config, n: int):
  """Each layer's cache as it is after n generated tokens (`--output-at`): its length and position advanced, the
  generated tokens' slots left as the prefill's padding (decode time does not depend on values). With a decode
  budget the region holds what n tokens leave in it: n, or after the first compaction decode_budget plus the
  tokens since the last one, so the timed steps compact as often as a real long generation does."""
  out = []
  for c in caches:
    if config.decode_budget is None:
      length = jnp.minimum(c.length + n, config.capacity)
    else:
      r, buf = config.decode_budget + config.decode_buffer, config.decode_buffer
      filled = n if n <= r else config.decode_budget + (n - r - 1) % buf + 1
      length = c.decode_start + filled
    out.append(dataclasses.replace(c, length=length.astype(jnp.int32), pos=(c.pos + n).astype(jnp.int32)))
  return tuple(out)


def prefill_rows(model, batch_plan: rk.BatchPlan, contexts, seed: int):
  """The caches of a batch whose row i is a random prompt of contexts[i] tokens, each prefilled alone (batch 1,
  its own plan as data under the batch's config) and assembled with `concat_caches`; one prefill per distinct
  length (rows of one length share its cache: decode time does not depend on values)."""
  graphdef, state = nnx.split(model)
  config, rows = batch_plan.config, batch_plan.rows
  one = {}
  for i, n in enumerate(contexts):
    if n in one:
      continue
    tokens = jax.random.randint(jax.random.PRNGKey(seed + n), (1, n), 0, model.config.vocab_size, jnp.int32)
    row = jax.tree.map(lambda x: x[i:i + 1], rows)
    _, caches = llama.prefill_jit(graphdef, state, tokens, jnp.array([n], jnp.int32), row, config=config)
    one[n] = caches
  return rk.concat_caches([one[n] for n in contexts])


def mixed_points(model, cfg, method, budget, contexts, args, bw, wbytes, emit):
  """The mixed-length batch (`--mixed`) and the same batch size at its longest row's plan alone, each timed like
  a grid point; the floor of the mixed batch sums each row's own step bytes. With `--limits N`, the mixed batch
  runs under an engine's static config (`plan_limits`: every request up to N prompt tokens)."""
  reps = max(1, -(-args.steps // args.chunk))
  longest = max(contexts)
  for label, lens in (("mixed", list(contexts)), ("longest alone", [longest] * len(contexts))):
    bp = plan(method, budget, lens, cfg, args.impl, args.kv_cache_dtype)
    if args.limits and label == "mixed":
      label = f"mixed, engine limits {args.limits}"
      bp = rk.plan_rows(method, token_budget=budget, prompt_lens=lens, max_new_tokens=NEW_TOKENS,
                        head_dim=cfg.head_dim, impl=args.impl, kv_cache_dtype=args.kv_cache_dtype,
                        config=rk.plan_limits(
                            method, token_budget=budget, max_prompt_len=parse_tokens(args.limits),
                            max_new_tokens=NEW_TOKENS, head_dim=cfg.head_dim, max_len=cfg.max_len, impl=args.impl,
                            kv_cache_dtype=args.kv_cache_dtype))
    caches = prefill_rows(model, bp, lens, seed=1)
    kept = np.asarray(caches[0].length)
    ms, per_step, _, _ = time_decode(model, bp.config, caches, chunk=args.chunk, reps=reps)
    end = kept + args.chunk * (reps + 1)  # each row's length after the warm-up and timed steps
    kv = sum(kv_bytes_needed(c, cfg, int(n), 1) for c, n in zip(bp.row_configs, end))
    floor = (wbytes + kv) / bw
    emit(dict(kind="mixed", label=label, method=method, token_budget=budget, contexts=lens, batch=len(lens),
              config=str(bp.config.cache_spec()), capacity=bp.config.capacity, ms_per_step=round(ms * 1e3, 3),
              floor_ms=round(floor * 1e3, 3), ratio_to_floor=round(ms / floor, 3),
              step_ms_min=round(min(per_step) * 1e3, 3), step_ms_max=round(max(per_step) * 1e3, 3),
              tokens_per_s=round(len(lens) / ms, 1)))
    del caches


def peak_point(cfg, method, budget, context, steps, impl, kv_cache_dtype=None):
  """Batch-1 prefill + `steps` decode steps in this (fresh) process; prints the peak device memory."""
  model = build_model(cfg)
  config = plan(method, budget, [context], cfg, impl, kv_cache_dtype).config
  before = jax.devices()[0].memory_stats() or {}
  caches, _ = prefill_caches(model, config, context, 1, 1, seed=1)
  out = decode_chunk(model, jnp.zeros((1, cfg.vocab_size), jnp.float32), caches, config, n=steps)
  out.tokens.block_until_ready()
  stats = jax.devices()[0].memory_stats() or {}
  print(json.dumps(dict(kind="peak", method=method, token_budget=budget, context=context,
                        peak_bytes=stats.get("peak_bytes_in_use"), weights_bytes=before.get("bytes_in_use"),
                        cache_bytes=rk.cache_nbytes(out.caches))), flush=True)


def _free_bytes() -> int | None:
  """Device bytes the allocator can still hand out (None where the backend has no memory stats)."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return None if not limit else int(limit - stats.get("bytes_in_use", 0))


def _max_batch(per_seq_bytes: int, reserve: int) -> int:
  free = _free_bytes()
  if free is None:
    return 8
  return max(1, int((free - reserve) * 0.9 // per_seq_bytes))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--methods", default="full,snapkv,quest,rocketkv")
  ap.add_argument("--budgets", default="256,1024")
  ap.add_argument("--contexts", default="16k,32k,64k,128k")
  ap.add_argument("--batches", default="1,8,32,max", help="comma list; 'max' = largest batch that fits")
  ap.add_argument("--chunk", type=int, default=8, help="decode steps per jitted chunk")
  ap.add_argument("--steps", type=int, default=64, help="timed decode steps (>= 64 for the reported medians)")
  ap.add_argument("--impl", default="auto")
  ap.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16", "float8_e4m3fn", "float8_e5m2"],
                  help="how the caches store K/V (the configs' kv_cache_dtype; default: the model's dtype)")
  ap.add_argument("--kt-cache-dtype", default=None, choices=["float32", "bfloat16", "float8_e5m2"],
                  help="how page-scoring methods store their per-page key min/max (the configs' kt_cache_dtype; "
                       "default: the keys' dtype)")
  ap.add_argument("--prefill-reps", type=int, default=3,
                  help="batch-1 prefill timed this many times (median), for prefill_vs_dense")
  ap.add_argument("--peak", default="", help="points 'method:budget:context,...' for batch-1 peak memory")
  ap.add_argument("--peak-point", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--profile", default=None,
                  help="write a jax.profiler trace of one decode chunk per point of --profile-batches here, "
                       "print its top ops")
  ap.add_argument("--profile-batches", default="1", help="comma list of batch sizes that --profile traces")
  ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  ap.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="model shape (default 8b: Llama-3.1-8B)")
  ap.add_argument("--mesh", default=None,
                  help="DP,TP: a mesh of DP x TP devices (batch over DP, tensor parallel over TP); floors are "
                       "per device. The kernels are not partitioned yet: a mesh of more than one device runs "
                       "the XLA path")
  ap.add_argument("--ab", default=None,
                  help="MODULE.FLAG=V1,V2: time each point once per value of a flag read while tracing, the "
                       "variants alternating in rounds within this process (one record per variant); values that "
                       "hold commas are separated by '|': FLAG=(2,2)|(4,2)")
  ap.add_argument("--ab-rounds", type=int, default=4, help="alternating rounds of --ab (timed steps split over them)")
  ap.add_argument("--mixed", default=None,
                  help="contexts of one mixed-length batch (one row each), timed against its longest row alone; "
                       "with it, --contexts and --batches are not run")
  ap.add_argument("--limits", default=None,
                  help="with --mixed: run the mixed batch under an engine's static config for prompts up to this many "
                       "tokens (plan_limits)")
  ap.add_argument("--output-at", type=parse_tokens, default=0, metavar="N",
                  help="time the step after N generated tokens (long outputs: each cache advanced by N, "
                       "`fast_forward`; plans made for N + 256 new tokens)")
  ap.add_argument("--decode-budgets", default="",
                  help="comma list of decode budgets (docs/ALGORITHM.md §4b) to run besides none, for the methods "
                       "that take one (snapkv, rocketkv, rocketkv_plus)")
  ap.add_argument("--out", default=None, help="append JSON lines here")
  args = ap.parse_args(argv)
  ab = parse_ab(args.ab) if args.ab else None
  if ab:
    if args.profile:
      raise SystemExit("--ab and --profile run apart: profile each variant in its own run")
    if args.ab_rounds < 1:
      raise SystemExit(f"--ab-rounds={args.ab_rounds} must be >= 1")
    # warm-up and timed steps of every variant share one cache, planned for NEW_TOKENS steps
    need = len(ab[2]) * (args.chunk + args.ab_rounds * -(-max(1, -(-args.steps // args.chunk)) // args.ab_rounds)
                         * args.chunk)
    if need > NEW_TOKENS:
      raise SystemExit(f"--ab with {len(ab[2])} variants, --steps {args.steps}, --chunk {args.chunk} and "
                       f"--ab-rounds {args.ab_rounds} decodes {need} steps per point; the caches hold "
                       f"{NEW_TOKENS}: lower --steps")
  cfg = TINY if args.tiny else SHAPES[args.shape]
  mesh = None
  if args.mesh:
    try:
      dp, tp = (int(x) for x in args.mesh.split(","))
    except ValueError:
      raise SystemExit(f"--mesh={args.mesh!r} must be DP,TP (two integers)") from None
    mesh = make_mesh(dp, tp)
    if args.impl == "auto":
      args.impl = default_impl(mesh) or args.impl

  if args.peak_point:
    m, t, c = args.peak_point.split(":")
    peak_point(cfg, m, int(t), parse_tokens(c), args.chunk, args.impl, args.kv_cache_dtype)
    return

  points = [p for p in args.peak.split(",") if p]
  if points and not args.contexts:  # peak-only: leave the device to the subprocesses
    for point in points:
      _peak_subprocess(point, args, lambda rec: print(json.dumps(rec), flush=True) or (
          open(args.out, "a").write(json.dumps(rec) + "\n") if args.out else None))
    return

  out = open(args.out, "a") if args.out else None
  dev = jax.devices()[0]
  header = dict(kind="header", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.device_kind, jax=jax.__version__, command="python -m benchmarks.decode " + " ".join(
                    sys.argv[1:] if argv is None else argv), model="tiny" if args.tiny else "llama-3.1-8b-shape",
                xla_flags=os.environ.get("XLA_FLAGS", ""), mesh=args.mesh,
                shape="tiny" if args.tiny else args.shape,
                sm_count=triton_util.sm_count(), ab=args.ab,
                ab_rounds=args.ab_rounds if args.ab else None)

  def emit(rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()

  bw, rounds = copy_bandwidth(1 << 26 if args.tiny else 4 << 30)
  header["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
  header["copy_bandwidth_rounds_GBps"] = [round(r / 1e9, 1) for r in rounds]
  model = build_model(cfg)
  if mesh is not None:
    model = shard_model(model, mesh)
  wbytes = weight_bytes(model)
  n_dev, tp = (1, 1) if mesh is None else (mesh.devices.size, mesh.shape["model"])
  kv_split = n_dev if mesh is None or cfg.n_kv_heads % tp == 0 else n_dev // tp  # KV heads split only if tp divides
  header["weight_bytes"] = wbytes
  emit(header)
  reps = max(1, -(-args.steps // args.chunk))
  methods = args.methods.split(",")
  budgets = [int(b) for b in args.budgets.split(",")]
  contexts = [parse_tokens(c) for c in args.contexts.split(",") if c]
  batches = args.batches.split(",")
  if args.mixed:
    for method in methods:
      for budget in (budgets if rk.get_method(method).budgeted else budgets[:1]):
        lens = [parse_tokens(c.partition("*")[0]) for c in args.mixed.split(",")
                for _ in range(int(c.partition("*")[2] or 1))]  # "32k*8": eight rows of 32k
        mixed_points(model, cfg, method, budget, lens, args, bw, wbytes, emit)
    return
  dense_prefill_s = {}
  for context in contexts:
    for method in methods:
      budgeted = rk.get_method(method).budgeted  # full: the budget changes nothing, run once
      bounds = rk.get_method(method).policy.bounds_decode
      dbs = [None] + ([int(x) for x in args.decode_budgets.split(",") if x] if bounds else [])
      for budget, db in ((b, d) for b in (budgets if budgeted else budgets[:1]) for d in dbs):
        config = plan(method, budget, [context], cfg, args.impl, args.kv_cache_dtype, args.kt_cache_dtype,
                      output_at=args.output_at, decode_budget=db).config
        base = dict(kind="point", method=method, token_budget=budget if budgeted else None,
                    context=context, capacity=config.capacity, kv_cache_dtype=config.kv_cache_dtype,
                    kt_cache_dtype=config.kt_cache_dtype if config.uses_kt_pages else None,
                    output_at=args.output_at, decode_budget=db)
        try:
          caches1, prefill_s = prefill_caches(model, config, context, 1, 1, seed=context, mesh=mesh,
                                              reps=args.prefill_reps)
          if args.output_at:
            caches1 = fast_forward(caches1, config, args.output_at)
        except Exception as e:  # noqa: BLE001 - reported, not dropped
          emit(dict(base, batch=1, status="OOM in prefill" if _is_oom(e) else "error in prefill",
                    error=f"{type(e).__name__}: {str(e)[:400]}"))
          continue
        if not budgeted:  # keeps the whole prompt: its prefill is the dense one
          dense_prefill_s[context] = prefill_s
        per_seq = rk.cache_nbytes(caches1)
        for bspec in batches:
          batch = _max_batch(per_seq, reserve=2 << 30) if bspec == "max" else int(bspec)
          rec = dict(base, batch=batch, batch_spec=bspec, cache_bytes=per_seq * batch, prefill_s=round(prefill_s, 4),
                     prefill_vs_dense=(round(prefill_s / dense_prefill_s[context], 3)
                                       if context in dense_prefill_s else None))
          free = _free_bytes()
          if bspec != "max" and free is not None and per_seq * batch > free:  # reported at once, not retried
            rec.update(status="OOM", error=f"does not fit: the caches alone need {per_seq * batch / 1e9:.1f} GB, "
                                           f"{free / 1e9:.1f} GB free")
            emit(rec)
            continue
          for attempt in range(4):
            try:
              caches = caches1 if batch == 1 else rk.concat_caches([caches1] * batch)
              if batch == 1:  # decode donates: keep caches1 for the next batch size
                caches = jax.tree.map(jnp.copy, caches1)
              prof = (os.path.join(args.profile, f"{method}_{budget}_{context}_{batch}")
                      if args.profile and bspec in args.profile_batches.split(",") else None)
              if ab:
                steps, round_ms, hashes, length = ab_decode(
                    model, config, caches, chunk=args.chunk, reps=reps, rounds=args.ab_rounds, module=ab[0],
                    attr=ab[1], values=ab[2])
                top = None
              else:
                ms, per_step, length, top = time_decode(model, config, caches, chunk=args.chunk, reps=reps,
                                                        profile_dir=prof)
                steps, round_ms, hashes = [per_step], [None], [None]
              del caches
              kv_bytes = kv_bytes_needed(config, cfg, length, batch)
              # per device: its share of the weights (split over the model axis) and of the KV
              floor = (wbytes / tp + kv_bytes / kv_split) / bw
              variants = []
              for i, per_step in enumerate(steps):
                ms = float(np.median(per_step))
                var = dict(rec, status="ok", ms_per_step=round(ms * 1e3, 3), floor_ms=round(floor * 1e3, 3),
                           ratio_to_floor=round(ms / floor, 3), tokens_per_s=round(batch / ms, 1),
                           step_ms_min=round(min(per_step) * 1e3, 3), step_ms_max=round(max(per_step) * 1e3, 3),
                           steps_timed=len(per_step) * args.chunk, kv_bytes_needed=kv_bytes)
                if ab:
                  var.update(ab_value=repr(ab[2][i]), ab_round_ms=round_ms[i], hlo_hash=hashes[i])
                variants.append(var)
              if top:
                variants[0].update(top)
              break
            except Exception as e:  # noqa: BLE001 - every failure is reported with its point
              caches = None  # frees the failed attempt's caches before a retry allocates its own (pyflakes: unused)
              if not _is_oom(e):
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
                break
              if bspec != "max" or attempt == 3:
                rec.update(status="OOM")
                break
              batch = max(1, int(batch * 0.8))
              rec.update(batch=batch, cache_bytes=per_seq * batch)
          for var in variants if rec.get("status") is None else [rec]:
            emit(var)
        del caches1
  if points:
    raise SystemExit("--peak runs alone (without --contexts) so that this process holds no device memory")


def _peak_subprocess(point, args, emit):
  cmd = [sys.executable, "-m", "benchmarks.decode", "--peak-point", point, "--impl", args.impl] + (
      ["--tiny"] if args.tiny else []) + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else [])
  res = subprocess.run(cmd, capture_output=True, text=True)
  lines = [l for l in res.stdout.splitlines() if l.startswith("{")]
  if lines:
    emit(json.loads(lines[-1]))
  else:
    err = [l for l in res.stderr.splitlines() if "Error" in l or "RESOURCE_EXHAUSTED" in l]
    emit(dict(kind="peak", point=point, status="OOM" if "RESOURCE_EXHAUSTED" in res.stderr else "failed",
              error=" | ".join(err[-3:])[:600]))


if __name__ == "__main__":
  main()
