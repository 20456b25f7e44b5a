"""The accuracy suite's grid and its one driver, `evaluate`: task accuracy (query-aware and query-agnostic) and
fidelity over method specs x budgets x contexts. Front ends: `rocketkv eval`, `python -m rocketkv_jax.eval` (this
module's `main`) and, in a checkout, `python -m benchmarks.accuracy`.

One dense prefill per batch of samples is shared by every method, budget and mode (see engine.py); a context's
executables compile in a thread pool while the configs already compiled run. Every row is appended to
<out>.cells.jsonl as it is measured (the same command again skips what is there); then <out>.json (everything,
outputs included), <out>.md (tables with 95% CIs) and <out>_*.png (plots) are written.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import os
import platform
import re
import shlex
import sys
import time

import numpy as np

import rocketkv_jax
from . import tasks as T
from .cells import (MODES, CellLog, fidelity_key, is_reference, read_cells, resume_settings, skip_key,
                    task_key)
from .engine import Runner, make_config
from .report import can_plot, from_cells, summarize, write_outputs

DEFAULT_METHODS = ("full", "rocketkv", "rocketkv_plus", "snapkv", "quest", "sparq", "streaming_llm", "h2o", "hsa",
                   "exact_topk")
GRIDS = {
    # the default grid for SmolLM2: 8000, not 8192, because context + max_new must stay within the
    # model's max_len 8192. 32 samples per task = 128 prompts per context and mode, in batches of 64 (the
    # dense prefill keeps every layer's q, k, v: ~115 KB per token in float32, 59 GB at 64 x 8000 tokens).
    # The attention-mass diagnostic runs one jitted layer at a time (30 dispatches per token): at t=256 only.
    "default": dict(contexts=(1024, 2048, 4096, 8000), budgets=(64, 128, 256, 512), samples=32, fid_samples=4,
                    fid_tail=64, batch=64, diag_budgets=(256,)),
    # CPU-quick: one context, two budgets, one sample per task
    "small": dict(contexts=(1024,), budgets=(128, 256), samples=1, fid_samples=1, fid_tail=64, batch=8,
                  diag_budgets=None),
}


def split_specs(text: str) -> list[str]:
  """Comma-separated method specs, commas inside [...] kept: 'full,rocketkv[topr=16,page_size=4]' -> 2 specs."""
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch == "[") - (ch == "]")
    if ch == "," and depth == 0:
      out.append(cur)
      cur = ""
    else:
      cur += ch
  out.append(cur)
  return [x.strip() for x in out if x.strip()]


def _value(text: str):
  """An override's value: int, then float, then true/false/none, else the string (quotes stripped)."""
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def parse_method(spec: str) -> tuple[str, dict]:
  """'rocketkv[topr=16,page_size=4]' -> ('rocketkv', {'topr': 16, 'page_size': 4}): the registered method and
  the overrides its config gets (`rocketkv_jax.make_config(..., **overrides)`). Raises ValueError naming a
  method that is not registered, a malformed pair, a repeated key or a key that is not a field of the method's
  config. The whole spec string is the method's label in rows, tables and plots."""
  m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*(?:\[(.*)\])?\s*", spec, re.S)
  if not m:
    raise ValueError(f"method spec {spec!r} is not NAME or NAME[key=value,...]")
  name, body = m.group(1), m.group(2)
  if name not in rocketkv_jax.METHODS:
    raise ValueError(f"method spec {spec!r}: unknown method {name!r}; choose from {', '.join(rocketkv_jax.METHODS)}")
  fields = {f.name for f in dataclasses.fields(rocketkv_jax.get_method(name))}
  overrides: dict = {}
  for pair in split_specs(body or ""):
    key, eq, val = pair.partition("=")
    key, val = key.strip(), val.strip()
    if not eq or not key or not val:
      raise ValueError(f"method spec {spec!r}: {pair!r} is not key=value")
    if key in overrides:
      raise ValueError(f"method spec {spec!r}: {key!r} is given twice")
    if key not in fields:
      raise ValueError(f"method spec {spec!r}: {key!r} is not an option of {name} (its config's fields: "
                       f"{', '.join(sorted(fields))})")
    overrides[key] = _value(val)
  if body is not None and not overrides:
    raise ValueError(f"method spec {spec!r}: empty brackets")
  return name, overrides


def method_name(spec: str) -> str:
  """The registered method a spec runs ('rocketkv' for 'rocketkv[topr=16]')."""
  return parse_method(spec)[0]


def parse_methods(text) -> tuple[str, ...]:
  """Method specs from '--methods' text (or a sequence of specs), whitespace removed, duplicates dropped, each
  checked by `parse_method` (ValueError before any work)."""
  specs = split_specs(text) if isinstance(text, str) else [str(x).strip() for x in text]
  specs = tuple(dict.fromkeys(re.sub(r"\s+", "", x) for x in specs if x.strip()))
  if not specs:
    raise ValueError(f"no method named in {text!r}")
  for x in specs:
    parse_method(x)
  return specs


def _ints(s: str) -> tuple[int, ...]:
  out = []
  for x in s.split(","):
    x = x.strip().lower()
    if x:
      out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
  return tuple(out)


def parse_args(argv=None, prog: str = "python -m rocketkv_jax.eval"):
  p = argparse.ArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF Llama directory")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                 help="method specs: NAME or NAME[key=value,...] (config overrides), e.g. "
                      "'full,rocketkv,rocketkv[topr=16,page_size=4]'; the spec is the label")
  p.add_argument("--budgets", default=None, help="token budgets, e.g. 64,128,256,512")
  p.add_argument("--contexts", default=None, help="context lengths in tokens, e.g. 1k,2k,4k,8000")
  p.add_argument("--samples", type=int, default=None, help="samples per task and context")
  p.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack")
  p.add_argument("--fid-samples", type=int, default=None, help="prose sequences per context for fidelity (0: off)")
  p.add_argument("--fid-tail", type=int, default=None, help="teacher-forced tokens after the compressed prefix")
  p.add_argument("--no-diag", action="store_true", help="skip the per-layer attention-mass diagnostic")
  p.add_argument("--diag-budgets", default=None,
                 help="budgets that get the diagnostic, e.g. 256 (default: the grid's; 'all' = every budget)")
  p.add_argument("--modes", default=",".join(MODES),
                 help="task modes: aware (the question is in the compressed prompt), agnostic (the context is "
                      "compressed first, the question fed after it); default both")
  p.add_argument("--max-new", type=int, default=24, help="greedy tokens generated per task prompt")
  p.add_argument("--batch", type=int, default=None, help="prompts per prefill/decode batch (default: the grid's)")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="threads that compile a context's configs ahead of running them (default min(16, cores))")
  p.add_argument("--chat", choices=("on", "off"), default="off", help="wrap task prompts in the chat template")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--impl", default="auto", choices=("auto", "xla", "pallas"),
                 help="the core's hot path: auto = Pallas kernels on GPU, XLA elsewhere")
  p.add_argument("--small", action="store_true", help="CPU-quick grid (defaults of flags left unset)")
  p.add_argument("--out", default="benchmarks/results/accuracy", help="output path prefix")
  p.add_argument("--cells", default=None, help="the resumable cells file (default <out>.cells.jsonl)")
  p.add_argument("--no-render", action="store_true", help="write only the cells file (no JSON, markdown, plots)")
  a = p.parse_args(argv)
  grid = GRIDS["small" if a.small else "default"]
  a.budgets = _ints(a.budgets) if a.budgets else None
  a.contexts = _ints(a.contexts) if a.contexts else None
  try:
    complete_args(a, grid)
  except ValueError as e:
    p.error(str(e))
  if a.diag_budgets is None:
    a.diag_budgets = grid["diag_budgets"]
  elif a.diag_budgets.strip().lower() == "all":
    a.diag_budgets = None
  else:
    a.diag_budgets = _ints(a.diag_budgets)
  return a


def complete_args(a, grid: dict):
  """Checks a front end's grid flags and fills in what is unset from `grid` (one of GRIDS), in place: method
  specs parsed (`parse_methods`; none given: DEFAULT_METHODS), modes and tasks split and checked, budgets,
  contexts, samples, fid_samples, fid_tail and batch defaulted. Shared by `rocketkv eval` and this module's CLI;
  raises ValueError naming the flag, before any model loads."""
  try:
    a.methods = parse_methods(a.methods) if a.methods else DEFAULT_METHODS
  except ValueError as e:
    raise ValueError(f"--methods: {e}") from None
  a.modes = tuple(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
  if not a.modes or set(a.modes) - set(MODES):
    raise ValueError(f"--modes {','.join(a.modes) or '(none)'}: choose from {','.join(MODES)}")
  a.tasks = tuple(dict.fromkeys(t.strip() for t in a.tasks.split(",") if t.strip()))
  unknown = [t for t in a.tasks if t not in T.TASKS]
  if unknown or not a.tasks:
    raise ValueError(f"--tasks: unknown task(s) {', '.join(map(repr, unknown)) or 'none given'}: choose from "
                     f"{', '.join(T.TASKS)}")
  a.budgets = tuple(a.budgets or grid["budgets"])
  a.contexts = tuple(a.contexts or grid["contexts"])
  for k in ("samples", "fid_samples", "fid_tail", "batch"):
    if getattr(a, k, None) is None:
      setattr(a, k, grid[k])
  if not a.samples and not a.fid_samples:
    raise ValueError("--samples 0 and --fid-samples 0: nothing to measure")
  if a.fid_samples and a.fid_tail >= min(a.contexts):
    raise ValueError(f"--fid-tail {a.fid_tail} must be shorter than every context (the shortest is "
                     f"{min(a.contexts)}): it is the teacher-forced end of a context-long sequence")
  return a


def machine() -> dict:
  """Where the run ran: host, platform, python, jax, backend, devices."""
  import jax
  return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [d.device_kind for d in jax.devices()], "cpu_count": os.cpu_count()}


def prefill_bytes_per_prompt(context: int, model_cfg, itemsize: int = 4) -> int:
  """Device bytes one prompt of the shared dense prefill needs at its peak: every layer's post-RoPE (q, k, v)
  kept (`models.prefill_dense`), plus one layer's [heads, T, T] float32 attention scores where the prefill's
  attention is dense (T <= llama.DENSE_ATTENTION_MAX_T; blocked above)."""
  from rocketkv_jax.models import llama
  c = model_cfg
  kept = context * c.n_layers * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * itemsize
  scores = c.n_heads * context * context * 4 * 2 if context <= llama.DENSE_ATTENTION_MAX_T else 0
  return kept + scores


def available_bytes() -> int | None:
  """Memory the prefill can use: the first device's limit on a GPU, the host's available memory on CPU."""
  import jax
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    return stats.get("bytes_limit")
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def fit_batch(batch: int, context: int, model_cfg, log=print, share: float = 0.5) -> int:
  """`batch`, or fewer prompts per prefill when `batch` would need more than `share` of the available memory
  (`prefill_bytes_per_prompt`), said in the log: a batch that does not fit is killed by the OS on a CPU host
  without a Python error, and on a GPU it is an out-of-memory error after minutes of compiling."""
  avail = available_bytes()
  if not avail:
    return batch
  per = prefill_bytes_per_prompt(context, model_cfg)
  fit = max(1, int(share * avail // per))
  if fit < batch:
    log(f"context {context}: --batch {batch} needs ~{batch * per / 2**30:.1f} GiB for the dense prefill, "
        f"{avail / 2**30:.1f} GiB available: prefilling {fit} prompts at a time")
    return fit
  return batch


def plan_configs(methods, budgets, context, max_new, model_cfg, impl="auto"):
  """(method, budget, config or error string); a method the budget does not change (full) runs once, with
  budget None: the reference every figure is compared with."""
  out = []
  for m in methods:
    name, overrides = parse_method(m)
    for b in (budgets if rocketkv_jax.get_method(name).budgeted else [None]):
      try:
        config = make_config(name, b or max(budgets), context, max_new, model_cfg, **{"impl": impl, **overrides})
        # an override the model's shapes refuse (topr > head_dim) is a skipped config, not a crash mid-run
        config.check_shapes(model_cfg.n_heads, model_cfg.n_kv_heads, model_cfg.head_dim)
        config.check_prompt(context)
        out.append((m, b, config))
      except ValueError as e:
        out.append((m, b, f"skipped: {e}"))
  return out


def modes_of(args) -> tuple[str, ...]:
  """The task modes a run measures (both when the caller's args do not say)."""
  return tuple(getattr(args, "modes", None) or MODES)


def question_split(samples) -> int:
  """Tokens the query-agnostic mode feeds after compression: the longest question + answer prefix of the
  context's samples (one compression point per context, so one config per method and budget; a row with a
  shorter question feeds a few haystack tokens first)."""
  return max(s.meta["question_tokens"] for s in samples)


def run(args, progress=None, log=print, checkpoint=None, done=None, record=None) -> dict:
  """The grid. `checkpoint(res)`, if given, is called after every prompt batch and fidelity pass, so a run
  stopped early (a time limit) keeps what it measured.

  Per context: the configs of every mode and of fidelity are compiled first, all at once in a thread pool
  (`Runner.precompile`, `--compile-workers`); then each batch of prompts gets one dense prefill, shared by
  every method, budget and mode.

  Resuming: `done` = {"tasks": [rows], "fidelity": [rows], "skipped": [rows]} of an earlier run with the same
  model, dtype, max_new, chat, fid_tail and diagnostic setting; those rows go into the result as they are and
  their work is not redone: a prompt batch whose every (mode, method, budget) row is done skips its prefill, a
  config runs only where a row is missing, a context's fidelity pass runs only for missing rows (plus the
  full-KV reference they are compared with). `record(kind, row)`, if given, gets every new row as soon as it
  exists (kind "tasks", "fidelity" or "skipped")."""
  import jax

  from rocketkv_jax.models import load
  from rocketkv_jax.models.generate import stop_ids

  args.methods = parse_methods(args.methods)  # a bad spec fails here, before the model loads
  modes = modes_of(args)
  bad = [m for m in modes if m not in MODES]
  if bad:
    raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
  t_start = time.time()
  model, tok = load(args.model, dtype=args.dtype, log=log) if isinstance(args.model, str) else args.model
  runner = Runner(model)
  cfg = model.config
  chat = args.chat == "on"
  eos = stop_ids(model, tok, chat)
  done = done or {}
  record = record or (lambda kind, row: None)
  impl = getattr(args, "impl", "auto")
  workers = getattr(args, "compile_workers", None) or min(16, os.cpu_count() or 1)
  res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": getattr(args, "command_line", None) or " ".join(shlex.quote(x) for x in sys.argv),
                  "machine": machine(),
                  "model": getattr(args, "model_name", None) or (args.model if isinstance(args.model, str) else "given"),
                  "model_config": {"layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                                   "head_dim": cfg.head_dim, "max_len": cfg.max_len},
                  "grid": grid_of(args)},
         "tasks": list(done.get("tasks", ())), "fidelity": list(done.get("fidelity", ())),
         "skipped": list(done.get("skipped", ()))}
  done_tasks = {task_key(r) for r in res["tasks"]}
  done_skips = {skip_key(r) for r in res["skipped"]}
  timing = res["meta"]["timing"] = {}

  def error(C, mode, m, b, e):
    row = {"context": C, "mode": mode, "method": m, "budget": b, "error": f"{type(e).__name__}: {e}"}
    res["meta"].setdefault("errors", []).append(row)
    record("error", row)
    log(f"error at {C} {mode} {m} t={b}: {row['error']}")

  def skip(row):
    if skip_key(row) not in done_skips:
      done_skips.add(skip_key(row))
      res["skipped"].append(row)
      record("skipped", row)
  res["meta"]["haystack"] = {"files": T.haystack_files(),
                             "sentences": len(T.haystack_sentences())}
  n_cfg = len(plan_configs(args.methods, args.budgets, min(args.contexts), args.max_new, cfg))
  n_batches = -(-(len(args.tasks) * args.samples) // max(1, args.batch))
  total = len(args.contexts) * n_cfg * (n_batches * len(modes) + (1 if args.fid_samples else 0))
  prog = progress(total) if progress else None

  for C in args.contexts:
    if C + max(args.max_new, 1) > cfg.max_len:
      raise ValueError(f"context {C} + max_new {args.max_new} exceeds the model's max_len {cfg.max_len}")
    t_ctx = time.time()
    samples = T.make_samples(tok, args.tasks, C, args.samples, chat=chat) if args.samples else []
    split = question_split(samples) if samples else 0
    # aware: the whole prompt is compressed; agnostic: its first C - split tokens, then `split` are fed
    plans = {"aware": (C, args.max_new), "agnostic": (C - split, split + args.max_new)}
    confs = [(mode, m, b, c) for mode in modes for m, b, c in plan_configs(args.methods, args.budgets, plans[mode][0],
                                                                        plans[mode][1], cfg, impl)] if samples else []
    for mode, m, b, c in confs:
      if isinstance(c, str):
        skip({"context": C, "mode": mode, "method": m, "budget": b, "why": c})
    B = fit_batch(min(args.batch, len(samples)) or 1, C, cfg, log)
    batches = [samples[i:i + B] for i in range(0, len(samples), B)]
    todo = [{(mode, m, b) for mode, m, b, c in confs if not isinstance(c, str)
             and any((C, mode, m, b, s.task, s.seed) not in done_tasks for s in chunk)} for chunk in batches]
    fid = _fidelity_plan(args, runner, tok, C, res, skip) if args.fid_samples else None
    # every executable the context needs, compiled in a thread pool in the order they run: config i runs as
    # soon as it is compiled, while later ones still compile
    job_ids = [(mode, m, b) for mode, m, b, c in confs if not isinstance(c, str) and any((mode, m, b) in t for t in todo)]
    jobs = [("greedy" if mode == "aware" else "agnostic", c, B, C, plans[mode][0], args.max_new)
            for mode, m, b, c in confs if (mode, m, b) in job_ids]
    if fid and fid["todo"]:
      job_ids += [("fidelity", m, b) for m, b, c in fid["run"]]
      jobs += [("forced", c, len(fid["seqs"]), C, fid["prefix"], args.fid_tail) for m, b, c in fid["run"]]
    stats0 = dict(runner.stats)
    t_compile = time.time()
    ready = dict(zip(job_ids, runner.precompile(jobs, eos, workers=workers, wait=False))) if jobs else {}
    compiled_at = []
    for f in ready.values():
      f.add_done_callback(lambda f: compiled_at.append(time.time()))
    if jobs:
      log(f"context {C}: compiling {len(jobs)} configs on {workers} threads while running them")
    for chunk, want in zip(batches, todo):
      if not want:  # every row of this batch was measured by an earlier run
        if prog: prog.describe(f"{C} tok: {len(chunk)} prompts already done")
        for _ in confs:
          if prog: prog.advance()
        continue
      padded = chunk + [chunk[-1]] * (B - len(chunk))  # one batch shape per context: one compile per config
      ids = np.array([s.ids for s in padded], np.int32)
      lengths = np.full((B,), C, np.int32)
      if prog: prog.describe(f"{C} tok: dense prefill of {len(chunk)} prompts")
      logits, qkv = runner.prefill_dense(ids, lengths)
      jax.block_until_ready(logits)
      for mode, m, b, config in confs:
        if isinstance(config, str) or (mode, m, b) not in want:
          if prog: prog.advance()
          continue
        if prog: prog.describe(f"{C} tok: tasks {mode} {m} t={b}")
        t0 = time.time()
        try:
          ready[mode, m, b].result()  # its executables (an error of this config's compile surfaces here)
          if mode == "aware":
            out = runner.greedy(logits, runner.compress(qkv, lengths, config), config, args.max_new, eos)
          else:
            out = runner.agnostic(qkv, logits, ids, plans[mode][0], config, args.max_new, eos)
        except Exception as e:  # one config's failure must not cost the rest of the grid; no row: a re-run retries
          error(C, mode, m, b, e)
          if prog: prog.advance()
          continue
        dt = time.time() - t0
        for s, row in zip(chunk, out):
          r = {"context": C, "mode": mode, "method": m, "budget": b, "task": s.task, "seed": s.seed,
               "compressed": plans[mode][0], "question_tokens": s.meta["question_tokens"],
               # needles that end past the compression point (agnostic: partly fed after it; rare, at 1k only)
               "needles_after": sum(e > plans[mode][0] for e in s.meta["needle_token_end"])}
          if task_key(r) in done_tasks:
            continue
          body = [int(x) for x in row if x >= 0 and x not in eos]
          text = tok.decode(body)
          r.update(answers=list(s.answers), output=text, score=T.score(text, s.answers), seconds=dt / len(chunk))
          res["tasks"].append(r)
          done_tasks.add(task_key(r))
          record("tasks", r)
        if prog: prog.advance()
      del qkv, logits
      if checkpoint: checkpoint(res)
    if fid is not None:
      _fidelity(args, runner, tok, C, fid, res, prog, record, ready, error)
      if checkpoint: checkpoint(res)
    concurrent.futures.wait(list(ready.values()))
    st = runner.stats
    timing[str(C)] = {"configs": len(jobs), "executables": st["compiles"] - stats0["compiles"],
                      # wall time from the start of compilation to its last executable, and the sums over threads
                      "compile_wall_s": round(max(compiled_at, default=t_compile) - t_compile, 2),
                      "trace_s": round(st["lower_s"] - stats0["lower_s"], 2),
                      "xla_compile_s": round(st["compile_s"] - stats0["compile_s"], 2),
                      "total_s": round(time.time() - t_ctx, 2)}
    # executables compiled while running rather than ahead of time (a shape the precompile did not foresee)
    timing[str(C)]["late_compiles"] = st["late"] - stats0["late"]
    if jobs:  # (a context resumed with nothing left to do keeps the timing of the run that measured it)
      record("timing", {"context": C, **timing[str(C)]})
    log(f"context {C}: {timing[str(C)]}")
  res["meta"]["seconds"] = time.time() - t_start
  res["summary"] = summarize(res)
  if prog: prog.close()
  return res


def _diag_budgets(args) -> set | None:
  """Budgets that get the attention-mass diagnostic (None: all); none with --no-diag."""
  if args.no_diag:
    return set()
  b = getattr(args, "diag_budgets", None)
  return None if b is None else set(b)


def _fidelity_plan(args, runner, tok, C, res, skip) -> dict:
  """What a context's fidelity pass runs: each method planned for what it decodes, a prompt of C - F tokens
  and F new ones (the task configs are planned for C + max_new and would overflow a non-evicting cache)."""
  F = args.fid_tail
  prefix = C - F
  confs = plan_configs(args.methods, args.budgets, prefix, F, runner.cfg, getattr(args, "impl", "auto"))
  for m, b, c in confs:
    if isinstance(c, str):
      skip({"context": C, "method": m, "budget": b, "why": f"fidelity {c}"})
  have = {fidelity_key(r) for r in res["fidelity"]}
  todo = {(m, b) for m, b, c in confs if not isinstance(c, str) and (C, m, b, args.fid_samples, F) not in have}
  # a done row is skipped, except the reference (budget None) when rows compared with it remain
  run_ = [(m, b, c) for m, b, c in sorted(confs, key=lambda x: not is_reference(x[0], x[1]))  # the reference first
          if not isinstance(c, str) and ((m, b) in todo or (is_reference(m, b) and todo))]
  return {"prefix": prefix, "confs": confs, "todo": todo, "run": run_,
          "seqs": [T.fidelity_text(tok, C, s)[0] for s in range(args.fid_samples)] if todo else []}


def _fidelity(args, runner, tok, C, plan, res, prog, record, ready, error):
  import jax

  F, prefix, todo = args.fid_tail, plan["prefix"], plan["todo"]
  if not todo:  # every row measured by an earlier run
    for _ in plan["confs"]:
      if prog: prog.advance()
    return
  ids = np.array(plan["seqs"], np.int32)
  if prog: prog.describe(f"{C} tok: dense prefill of {len(ids)} prose sequences")
  logits, qkv = runner.prefill_dense(ids, np.full((len(ids),), prefix, np.int32))
  jax.block_until_ready(logits)
  ref = None
  target = ids[:, prefix:]
  diag_at = _diag_budgets(args)
  for _ in range(len(plan["confs"]) - len(plan["run"])):
    if prog: prog.advance()
  for m, b, config in plan["run"]:
    if prog: prog.describe(f"{C} tok: fidelity {m} t={b}")
    t0 = time.time()
    # the reference attends everything (mass 1): no diagnostic
    diag = b is not None and (diag_at is None or b in diag_at)
    try:
      ready["fidelity", m, b].result()
      lp, d = runner.teacher_forced(qkv, logits, ids, prefix, config, diag=diag)
    except Exception as e:  # as for tasks: log it, keep going, no row
      error(C, "fidelity", m, b, e)
      if prog: prog.advance()
      continue
    if is_reference(m, b):
      ref = lp
    nll = float(-np.take_along_axis(lp, target[..., None], -1).mean())
    row = {"context": C, "method": m, "budget": b, "sequences": len(ids), "tail": F, "nll": nll,
           "seconds": time.time() - t0}
    if ref is not None:
      p_ref = np.exp(ref)
      agree = lp.argmax(-1) == ref.argmax(-1)  # [B, F]
      kl = (p_ref * (ref - lp)).sum(-1)  # [B, F]
      row["top1"] = float(agree.mean())
      row["kl"] = float(kl.mean())
      # per position, sequence-major: what the confidence intervals resample (report.py)
      row["top1_pos"] = agree.astype(int).ravel().tolist()
      row["kl_pos"] = np.round(np.maximum(kl, 0), 6).ravel().tolist()
      # agreement where full KV is confident (top-1 prob >= 0.5): flips among near-ties of a small
      # model's flat next-token distributions say little, flips of a confident prediction do
      confident = p_ref.max(-1) >= 0.5
      row["confident_share"] = float(confident.mean())
      row["top1_confident"] = float(agree[confident].mean()) if confident.any() else None
    if d is not None:
      mass, oracle = d["mass"], d["oracle"]  # [steps, L, B, K]
      row["mass_per_layer"] = mass.mean(axis=(0, 2, 3)).round(5).tolist()
      row["oracle_per_layer"] = oracle.mean(axis=(0, 2, 3)).round(5).tolist()
      row["mass"] = float(mass.mean())
      row["oracle"] = float(oracle.mean())
      row["selected_tokens"] = float(d["n_sel"].mean())
    if (m, b) in todo:
      res["fidelity"].append(row)
      record("fidelity", row)
    if prog: prog.advance()


# ----------------------------------------------------------------------------- resuming and the one driver


def select(rows: dict, args) -> dict:
  """The rows of `rows` (tasks / fidelity / skipped lists) inside this grid (a task row without a mode is
  query-aware)."""
  budgets = set(args.budgets) | {None}
  modes = modes_of(args)
  in_grid = lambda r: r["context"] in args.contexts and r["method"] in args.methods and r["budget"] in budgets
  return {"tasks": [r for r in rows["tasks"] if in_grid(r) and r.get("mode", "aware") in modes
                    and r["task"] in args.tasks and r["seed"] < args.samples],
          "fidelity": [r for r in rows["fidelity"] if in_grid(r) and args.fid_samples
                       and r["sequences"] == args.fid_samples and r["tail"] == args.fid_tail],
          "skipped": [r for r in rows["skipped"] if in_grid(r) and skip_key(r)[1] in modes + (None,)]}


def cell_status(args, rows: dict) -> tuple[int, int]:
  """(cells done, cells in the grid) of task and fidelity cells, from rows already measured (no model needed).
  A task cell is (context, mode, method, budget, task); a fidelity cell (context, method, budget)."""
  have_t = {task_key(r) for r in rows["tasks"]}
  have_f = {fidelity_key(r) for r in rows["fidelity"]}
  skipped = {skip_key(r)[:4] for r in rows["skipped"]}
  done = total = 0
  for C in args.contexts:
    for m in args.methods:
      for b in (args.budgets if rocketkv_jax.get_method(method_name(m)).budgeted else [None]):
        if args.samples:
          for mode in modes_of(args):
            for t in args.tasks:
              total += 1
              done += (C, mode, m, b) in skipped or all((C, mode, m, b, t, s) in have_t for s in range(args.samples))
        if args.fid_samples:
          total += 1
          done += (C, None, m, b) in skipped or (C, m, b, args.fid_samples, args.fid_tail) in have_f
  return done, total


class RichProgress:
  """The suite's progress bar on stderr (one plain line per unit when stderr is not a terminal)."""

  def __init__(self, total):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console)
    self.p.start()
    self.t = self.p.add_task("accuracy", total=total)
    self.plain = not console.is_terminal  # a log file gets one line per unit instead of a live bar
    self.total, self.done, self.t0 = total, 0, time.time()

  def describe(self, text):
    from rich.markup import escape
    self.p.update(self.t, description=escape(text))  # a method spec's [key=value] is not markup
    if self.plain:
      print(f"[{self.done}/{self.total} {time.time() - self.t0:.0f}s] {text}", file=sys.stderr, flush=True)

  def advance(self):
    self.p.advance(self.t)
    self.done += 1

  def close(self):
    self.p.stop()


class SettingsError(ValueError):
  """A grid this run cannot measure as asked, found before measuring anything: the cells file holds rows of other
  settings, or a context does not fit the model's max_len. The front ends exit with status 2."""


def evaluate(args, out: str, *, command: str, cells_path: str | None = None, load_model=None, log=print,
             render: bool = True) -> dict:
  """The suite's one driver, behind `rocketkv eval` and `python -m rocketkv_jax.eval` (`python -m
  benchmarks.accuracy` in a checkout): `args` is a completed grid (`complete_args`) plus model, dtype, max_new,
  chat, no_diag, impl (and optionally compile_workers). Every row is appended to the cells file (default
  <out>.cells.jsonl) as it is measured; the same grid again skips the cells already there, and does not even load
  the model when every cell is done. Then writes <out>.json, <out>.md and <out>_*.png (plots need matplotlib),
  unless `render` is False. `load_model()` returns (model, tokenizer); by default `models.load(args.model,
  dtype=args.dtype)`. `command` is what the result records as the command line. Raises SettingsError (see it)."""
  cells_path = cells_path or out + ".cells.jsonl"
  settings = resume_settings(args)
  prior = read_cells(cells_path)
  if prior is not None and prior["settings"] is not None and prior["settings"] != settings:
    diff = ", ".join(f"{k}: {prior['settings'].get(k)!r} there, {v!r} now" for k, v in settings.items()
                     if prior["settings"].get(k) != v)
    raise SettingsError(f"{cells_path} holds cells measured with other settings ({diff}): give another --out, or "
                        "delete that file to start afresh")
  rows = select(prior, args) if prior is not None else {"tasks": [], "fidelity": [], "skipped": []}
  runs = prior["runs"] if prior is not None else []
  n_done, n_cells = cell_status(args, rows)
  if n_done:
    log(f"{cells_path}: {n_done} of {n_cells} cells already done; skipping them")
  rendered_only = bool(runs) and n_done == n_cells  # nothing to measure: no model, no device time
  if rendered_only:
    log("every cell is done: not loading the model, only writing the report")
    res = {**from_cells(cells_path), **rows}  # the meta of the runs that measured it, the rows of this grid
    res["meta"]["grid"] = grid_of(args)
    res["meta"]["haystack"] = {"files": T.haystack_files(), "sentences": len(T.haystack_sentences())}
  else:
    if load_model is None:
      from rocketkv_jax.models import load
      load_model = lambda: load(args.model, dtype=args.dtype, log=log)  # noqa: E731
    model, tok = load_model()
    cfg = model.config
    too_long = [c for c in args.contexts if c + max(args.max_new, 1) > cfg.max_len]
    if too_long:
      raise SettingsError(f"context(s) {', '.join(map(str, too_long))} + --max-new {args.max_new} exceed the "
                          f"model's max_len {cfg.max_len}")
    this_run = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": command, "machine": machine(), "grid": grid_of(args),
                "model_config": {"layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                                 "head_dim": cfg.head_dim, "max_len": cfg.max_len}}
    cell_log = CellLog(cells_path, settings)
    cell_log.write("run", this_run)
    ran = {"tasks": 0, "fidelity": 0}

    def record(kind, row):
      cell_log.write(kind, row)
      ran[kind] = ran.get(kind, 0) + 1

    run_args = argparse.Namespace(**{**vars(args), "model": (model, tok), "model_name": args.model,
                                     "command_line": command})
    try:
      res = run(run_args, progress=RichProgress, log=log, done=rows, record=record)
    finally:
      cell_log.close()
    runs = runs + [this_run]
    log(f"measured {ran['tasks']} task rows and {ran['fidelity']} fidelity rows; {n_done} of {n_cells} cells "
        "came from earlier runs")
  res["meta"]["runs"] = runs
  res["meta"]["cells"] = {"file": cells_path, "done_before": n_done, "total": n_cells}
  if rendered_only:  # the runtime is the earlier runs'
    res["meta"]["note"] = f"rendered from {cells_path}: every cell measured by its {len(runs)} earlier run(s)"
  elif n_done:
    res["meta"]["note"] = (f"resumed: {n_done} of {n_cells} cells measured by earlier runs ({len(prior['runs'])} "
                           f"in {cells_path}); runtime counts this run only")
  if not render:
    log(f"wrote {cells_path}")
    return res
  res["summary"] = summarize(res)
  for p in write_outputs(res, out):
    log(f"wrote {p}")
  if not can_plot():
    # rocketkv-jax is not on a package index, so `rocketkv-jax[eval]` cannot be installed by name: say what works.
    log("no plots: matplotlib is not installed (pip install 'matplotlib>=3.8,<4'; "
        "from a checkout: pip install -e '.[eval]')")
  return res


def main(argv=None, prog: str = "python -m rocketkv_jax.eval"):
  """The CLI (`prog` names it in the help and in the recorded command): runs the grid through `evaluate`, so the
  same command again skips the cells already measured (a run stopped by a time limit continues); --no-render
  writes only the cells file (`python -m rocketkv_jax.eval.report CELLS ... --out PREFIX` renders it later)."""
  args = parse_args(argv, prog=prog)
  log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
  command = prog + " " + " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
  try:
    return evaluate(args, args.out, command=command, cells_path=args.cells, log=log, render=not args.no_render)
  except SettingsError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def grid_of(args) -> dict:
  """The grid's settings, as the result's meta records them."""
  given = vars(args)  # a grid read back from an older result may lack the later settings
  g = {k: given[k] for k in ("methods", "budgets", "contexts", "samples", "tasks", "fid_samples", "fid_tail",
                             "max_new", "chat", "dtype", "impl", "diag_budgets") if k in given}
  g["modes"] = list(modes_of(args))
  return {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}


if __name__ == "__main__":
  main()
