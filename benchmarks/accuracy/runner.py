"""`python -m benchmarks.accuracy`: task accuracy and fidelity over methods x budgets x contexts.

One dense prefill per batch of samples is shared by every method and budget (see engine.py). Writes
<out>.json (everything, outputs included), <out>.md (tables) and <out>_*.png (plots).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

import numpy as np

import rocketkv_jax
from benchmarks.accuracy import tasks as T
from benchmarks.accuracy.engine import Runner, make_config
from benchmarks.accuracy.report import summarize, write_outputs

DEFAULT_METHODS = ("full", "rocketkv", "snapkv", "quest", "sparq", "streaming_llm", "h2o", "hsa", "exact_topk")
GRIDS = {
    # the default grid for SmolLM2 (8k = the model's max length, so 8k contexts are 8k - max_new)
    "default": dict(contexts=(1024, 2048, 4096, 8000), budgets=(64, 128, 256, 512), samples=10, fid_samples=4,
                    fid_tail=256),
    # CPU-quick: one context, two budgets, one sample per task
    "small": dict(contexts=(1024,), budgets=(128, 256), samples=1, fid_samples=1, fid_tail=64),
}


def _ints(s: str) -> tuple[int, ...]:
  out = []
  for x in s.split(","):
    x = x.strip().lower()
    if x:
      out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
  return tuple(out)


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF Llama directory")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
  p.add_argument("--budgets", default=None, help="token budgets, e.g. 64,128,256,512")
  p.add_argument("--contexts", default=None, help="context lengths in tokens, e.g. 1k,2k,4k,8000")
  p.add_argument("--samples", type=int, default=None, help="samples per task and context")
  p.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack")
  p.add_argument("--fid-samples", type=int, default=None, help="prose sequences per context for fidelity (0: off)")
  p.add_argument("--fid-tail", type=int, default=None, help="teacher-forced tokens after the compressed prefix")
  p.add_argument("--no-diag", action="store_true", help="skip the per-layer attention-mass diagnostic")
  p.add_argument("--max-new", type=int, default=24, help="greedy tokens generated per task prompt")
  p.add_argument("--batch", type=int, default=8, help="prompts per prefill/decode batch")
  p.add_argument("--chat", choices=("on", "off"), default="off", help="wrap task prompts in the chat template")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--impl", default="auto", choices=("auto", "xla", "pallas"),
                 help="the core's hot path: auto = Pallas kernels on GPU, XLA elsewhere")
  p.add_argument("--small", action="store_true", help="CPU-quick grid (defaults of flags left unset)")
  p.add_argument("--out", default="benchmarks/results/accuracy", help="output path prefix")
  a = p.parse_args(argv)
  grid = GRIDS["small" if a.small else "default"]
  a.methods = tuple(m.strip() for m in a.methods.split(",") if m.strip())
  a.tasks = tuple(t.strip() for t in a.tasks.split(",") if t.strip())
  a.budgets = _ints(a.budgets) if a.budgets else grid["budgets"]
  a.contexts = _ints(a.contexts) if a.contexts else grid["contexts"]
  for k in ("samples", "fid_samples", "fid_tail"):
    if getattr(a, k) is None:
      setattr(a, k, grid[k])
  return a


def machine() -> dict:
  """Where the run ran: host, platform, python, jax, backend, devices."""
  import jax
  return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [d.device_kind for d in jax.devices()], "cpu_count": os.cpu_count()}


def _configs(methods, budgets, context, max_new, model_cfg, impl="auto"):
  """(method, budget, config or error string); a method the budget does not change (full) runs once, with
  budget None: the reference every figure is compared with."""
  out = []
  for m in methods:
    for b in (budgets if rocketkv_jax.get_method(m).budgeted else [None]):
      try:
        out.append((m, b, make_config(m, b or max(budgets), context, max_new, model_cfg, impl=impl)))
      except ValueError as e:
        out.append((m, b, f"skipped: {e}"))
  return out


def task_key(r) -> tuple:
  """A task row's identity: (context, method, budget, task, seed)."""
  return (r["context"], r["method"], r["budget"], r["task"], r["seed"])


def fidelity_key(r) -> tuple:
  """A fidelity row's identity: (context, method, budget, sequences, tail)."""
  return (r["context"], r["method"], r["budget"], r["sequences"], r["tail"])


def run(args, progress=None, log=print, checkpoint=None, done=None, record=None) -> dict:
  """The grid. `checkpoint(res)`, if given, is called after every prompt batch and fidelity pass, so a run
  stopped early (a time limit) keeps what it measured.

  Resuming: `done` = {"tasks": [rows], "fidelity": [rows], "skipped": [rows]} of an earlier run with the same
  model, dtype, max_new, chat, fid_tail and diagnostic setting; those rows go into the result as they are and
  their work is not redone: a prompt batch whose every (method, budget) row is done skips its prefill, a
  config runs only where a row is missing, a context's fidelity pass runs only for missing rows (plus the
  full-KV reference they are compared with). `record(kind, row)`, if given, gets every new row as soon as it
  exists (kind "tasks", "fidelity" or "skipped")."""
  import jax
  import jax.numpy as jnp

  from rocketkv_jax.models import load
  from rocketkv_jax.models.generate import stop_ids

  t_start = time.time()
  model, tok = load(args.model, dtype=args.dtype, log=log) if isinstance(args.model, str) else args.model
  runner = Runner(model)
  cfg = model.config
  chat = args.chat == "on"
  eos = stop_ids(model, tok, chat)
  done = done or {}
  record = record or (lambda kind, row: None)
  res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": getattr(args, "command_line", None) or
                  "python -m benchmarks.accuracy " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                  "machine": machine(),
                  "model": getattr(args, "model_name", None) or (args.model if isinstance(args.model, str) else "given"),
                  "model_config": {"layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                                   "head_dim": cfg.head_dim, "max_len": cfg.max_len},
                  "grid": {k: getattr(args, k) for k in ("methods", "budgets", "contexts", "samples", "tasks",
                                                           "fid_samples", "fid_tail", "max_new", "chat", "dtype", "impl")
                           if hasattr(args, k)}},
         "tasks": list(done.get("tasks", ())), "fidelity": list(done.get("fidelity", ())),
         "skipped": list(done.get("skipped", ()))}
  done_tasks = {task_key(r) for r in res["tasks"]}
  done_skips = {(r["context"], r["method"], r["budget"], r["why"]) for r in res["skipped"]}

  def skip(row):
    if (row["context"], row["method"], row["budget"], row["why"]) not in done_skips:
      done_skips.add((row["context"], row["method"], row["budget"], row["why"]))
      res["skipped"].append(row)
      record("skipped", row)
  res["meta"]["haystack"] = {"files": sorted(n for n in os.listdir(T.DATA_DIR) if n.endswith(".txt")),
                             "sentences": len(T.haystack_sentences())}
  n_cfg = {c: len(_configs(args.methods, args.budgets, c, args.max_new, cfg)) for c in args.contexts}
  n_batches = lambda c: -(-(len(args.tasks) * args.samples) // args.batch)
  total = sum(n_cfg[c] * (n_batches(c) + (1 if args.fid_samples else 0)) for c in args.contexts)
  prog = progress(total) if progress else None

  for C in args.contexts:
    if C + max(args.max_new, 1) > cfg.max_len:
      raise ValueError(f"context {C} + max_new {args.max_new} exceeds the model's max_len {cfg.max_len}")
    samples = T.make_samples(tok, args.tasks, C, args.samples, chat=chat) if args.samples else []
    confs = _configs(args.methods, args.budgets, C, args.max_new, cfg, getattr(args, "impl", "auto"))
    for m, b, c in confs:
      if isinstance(c, str):
        skip({"context": C, "method": m, "budget": b, "why": c})
    for i0 in range(0, len(samples), args.batch):
      chunk = samples[i0:i0 + args.batch]
      todo = {(m, b) for m, b, c in confs if not isinstance(c, str)
              and any((C, m, b, s.task, s.seed) not in done_tasks for s in chunk)}
      if not todo:  # every row of this batch was measured by an earlier run
        if prog: prog.describe(f"{C} tok: {len(chunk)} prompts already done")
        for _ in confs:
          if prog: prog.advance()
        continue
      ids = np.array([s.ids for s in chunk], np.int32)
      lengths = np.full((len(chunk),), C, np.int32)
      if prog: prog.describe(f"{C} tok: dense prefill of {len(chunk)} prompts")
      logits, qkv = runner.prefill_dense(ids, lengths)
      jax.block_until_ready(logits)
      for m, b, config in confs:
        if isinstance(config, str) or (m, b) not in todo:
          if prog: prog.advance()
          continue
        if prog: prog.describe(f"{C} tok: tasks {m} t={b}")
        t0 = time.time()
        caches = runner.compress(qkv, lengths, config)
        out = runner.greedy(logits, caches, config, args.max_new, eos)
        dt = time.time() - t0
        for s, row in zip(chunk, out):
          if (C, m, b, s.task, s.seed) in done_tasks:
            continue
          body = [int(x) for x in row if x >= 0 and x not in eos]
          text = tok.decode(body)
          r = {"context": C, "method": m, "budget": b, "task": s.task, "seed": s.seed,
               "answers": list(s.answers), "output": text, "score": T.score(text, s.answers),
               "seconds": dt / len(chunk)}
          res["tasks"].append(r)
          done_tasks.add(task_key(r))
          record("tasks", r)
        if prog: prog.advance()
      del qkv, logits
      if checkpoint: checkpoint(res)
    if args.fid_samples:
      _fidelity(args, runner, tok, C, res, prog, skip, record)
      if checkpoint: checkpoint(res)
  res["meta"]["seconds"] = time.time() - t_start
  res["summary"] = summarize(res)
  if prog: prog.close()
  return res


def _fidelity(args, runner, tok, C, res, prog, skip, record):
  import jax

  F = args.fid_tail
  prefix = C - F
  # plan each method for what this run decodes: a prompt of `prefix` tokens and F - 1 new ones (the
  # task configs are planned for C + max_new and would overflow a non-evicting cache)
  confs = _configs(args.methods, args.budgets, prefix, F, runner.cfg, getattr(args, "impl", "auto"))
  for m, b, c in confs:
    if isinstance(c, str):
      skip({"context": C, "method": m, "budget": b, "why": f"fidelity {c}"})
  have = {fidelity_key(r) for r in res["fidelity"]}
  todo = {(m, b) for m, b, c in confs if not isinstance(c, str) and (C, m, b, args.fid_samples, F) not in have}
  if not todo:  # every row measured by an earlier run
    for _ in confs:
      if prog: prog.advance()
    return
  seqs = [T.fidelity_text(tok, C, s)[0] for s in range(args.fid_samples)]
  ids = np.array(seqs, np.int32)
  if prog: prog.describe(f"{C} tok: dense prefill of {len(seqs)} prose sequences")
  logits, qkv = runner.prefill_dense(ids, np.full((len(seqs),), prefix, np.int32))
  jax.block_until_ready(logits)
  order = sorted(confs, key=lambda x: x[1] is not None)  # the reference (budget None: full KV) first
  ref = None
  target = ids[:, prefix:]
  for m, b, config in order:
    # a done row is skipped, except the reference (budget None) when rows compared with it remain
    if isinstance(config, str) or ((m, b) not in todo and (b is not None or ref is not None)):
      if prog: prog.advance()
      continue
    if prog: prog.describe(f"{C} tok: fidelity {m} t={b}")
    t0 = time.time()
    diag = (not args.no_diag) and b is not None  # the reference attends everything: mass 1
    lp, d = runner.teacher_forced(qkv, logits, ids, prefix, config, diag=diag)
    if b is None:
      ref = lp
    nll = float(-np.take_along_axis(lp, target[..., None], -1).mean())
    row = {"context": C, "method": m, "budget": b, "sequences": len(seqs), "tail": F, "nll": nll,
           "seconds": time.time() - t0}
    if ref is not None:
      p_ref = np.exp(ref)
      agree = lp.argmax(-1) == ref.argmax(-1)
      row["top1"] = float(agree.mean())
      row["kl"] = float((p_ref * (ref - lp)).sum(-1).mean())
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


# ----------------------------------------------------------------------------- resumable runs (`rocketkv eval`)
#
# <out>.cells.jsonl, one JSON object a line, appended and flushed as each row is measured:
#   {"kind": "meta", "version": 1, "settings": {...}}   first line: what every row depends on (model, dtype,
#                                                       max_new, chat, fid_tail, no_diag, impl); a re-run
#                                                       with other settings is refused
#   {"kind": "run", "date": ..., "command": ..., "machine": {...}, "model_config": {...}}   each run that loaded the model
#   {"kind": "tasks", <a task row of the result JSON>}       one prompt x method x budget
#   {"kind": "fidelity", <a fidelity row>}                    one context x method x budget
#   {"kind": "skipped", <a skipped row>}                      a config the budget/context cannot make
# A last line cut short by a kill is ignored (and dropped by the next run's writer). Cells: a task cell (context, method, budget, task) is done when
# its rows for seeds 0 .. samples-1 are there (or its config is skipped); a fidelity cell (context, method,
# budget) when its row for these fid_samples and fid_tail is.

CELLS_VERSION = 1
RESUME_SETTINGS = ("model", "dtype", "max_new", "chat", "fid_tail", "no_diag", "impl")


def resume_settings(args) -> dict:
  return {k: getattr(args, k) for k in RESUME_SETTINGS}


def read_cells(path: str) -> dict | None:
  """The rows of a cells file: {"settings", "runs", "tasks", "fidelity", "skipped"}, or None when absent."""
  if not os.path.exists(path):
    return None
  out = {"settings": None, "runs": [], "tasks": [], "fidelity": [], "skipped": []}
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      if i >= len(lines) - 2:  # the last line, cut short by a kill
        continue
      raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    kind = rec.pop("kind", None)
    if kind == "meta":
      out["settings"] = rec.get("settings")
    elif kind == "run":
      out["runs"].append(rec)
    elif kind in ("tasks", "fidelity", "skipped"):
      out[kind].append(rec)
  return out


class CellLog:
  """Appends records to a cells file, one flushed line each (see above)."""

  def __init__(self, path: str, settings: dict):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    started = os.path.exists(path) and os.path.getsize(path) > 0
    if started:  # drop a last line cut short by a kill (read_cells ignores it), so the next record starts clean
      with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
          f.truncate(data.rfind(b"\n") + 1)
      started = os.path.getsize(path) > 0
    self.f = open(path, "a", encoding="utf-8")
    if not started:
      self.write("meta", {"version": CELLS_VERSION, "settings": settings})

  def write(self, kind: str, row: dict) -> None:
    self.f.write(json.dumps({"kind": kind, **row}, default=str) + "\n")
    self.f.flush()

  def close(self):
    self.f.close()


def select(rows: dict, args) -> dict:
  """The rows of `rows` (tasks / fidelity / skipped lists) inside this grid."""
  budgets = set(args.budgets) | {None}
  in_grid = lambda r: r["context"] in args.contexts and r["method"] in args.methods and r["budget"] in budgets
  return {"tasks": [r for r in rows["tasks"] if in_grid(r) and r["task"] in args.tasks and r["seed"] < args.samples],
          "fidelity": [r for r in rows["fidelity"] if in_grid(r) and args.fid_samples
                       and r["sequences"] == args.fid_samples and r["tail"] == args.fid_tail],
          "skipped": [r for r in rows["skipped"] if in_grid(r)]}


def cell_status(args, rows: dict) -> tuple[int, int]:
  """(cells done, cells in the grid) of task and fidelity cells, from rows already measured (no model needed)."""
  have_t = {task_key(r) for r in rows["tasks"]}
  have_f = {fidelity_key(r) for r in rows["fidelity"]}
  skipped_t = {(r["context"], r["method"], r["budget"]) for r in rows["skipped"] if not r["why"].startswith("fidelity")}
  skipped_f = {(r["context"], r["method"], r["budget"]) for r in rows["skipped"] if r["why"].startswith("fidelity")}
  done = total = 0
  for C in args.contexts:
    for m in args.methods:
      for b in (args.budgets if rocketkv_jax.get_method(m).budgeted else [None]):
        if args.samples:
          for t in args.tasks:
            total += 1
            done += (C, m, b) in skipped_t or all((C, m, b, t, s) in have_t for s in range(args.samples))
        if args.fid_samples:
          total += 1
          done += (C, m, b) in skipped_f or (C, m, b, args.fid_samples, args.fid_tail) in have_f
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
    self.p.update(self.t, description=text)
    if self.plain:
      print(f"[{self.done}/{self.total} {time.time() - self.t0:.0f}s] {text}", file=sys.stderr, flush=True)

  def advance(self):
    self.p.advance(self.t)
    self.done += 1

  def close(self):
    self.p.stop()


def main(argv=None):
  args = parse_args(argv)
  log = lambda msg: print(msg, file=sys.stderr)

  def checkpoint(res):  # partial JSON (no summary yet); report.py re-renders it
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".partial.json", "w") as f:
      json.dump(res, f, default=str)

  res = run(args, progress=RichProgress, log=log, checkpoint=checkpoint)
  if os.path.exists(args.out + ".partial.json"):
    os.remove(args.out + ".partial.json")
  paths = write_outputs(res, args.out)
  for p in paths:
    log(f"wrote {p}")
  return res


if __name__ == "__main__":
  main()
