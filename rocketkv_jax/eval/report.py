"""Markdown tables and matplotlib plots of an accuracy run (results dict of runner.run), with 95% confidence
intervals, and the CLI that merges runs (result JSON or cells files) and renders them."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np

from .cells import MODES, is_reference, read_cells, task_key
from .plot_style import method_color, method_width, model_label, tokens_label

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95


# ----------------------------------------------------------------------------- confidence intervals


def _percentiles(x) -> tuple[float, float] | None:
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  if not x.size:
    return None
  lo, hi = np.percentile(x, [50 * (1 - CI_LEVEL), 50 * (1 + CI_LEVEL)])
  return float(lo), float(hi)


def _task_resamples(scores: dict, others: tuple = (), *, resamples: int, seed: int) -> list[np.ndarray]:
  """Bootstrap task accuracies of `scores` and of each dict in `others` (same tasks, prompts in the same order):
  each resample draws every task's prompts with replacement (stratified: the tasks' weights stay equal, as in
  the accuracy), one draw shared by all (paired). Returns one array of `resamples` accuracies per input."""
  rng = np.random.default_rng(seed)
  sums = [np.zeros(resamples) for _ in range(1 + len(others))]
  for task in sorted(scores):
    s = np.asarray(scores[task], np.float64)
    idx = rng.integers(0, len(s), size=(resamples, len(s)))
    for acc, d in zip(sums, (scores,) + tuple(others)):
      x = np.asarray(d[task], np.float64)
      if x.shape != s.shape:
        raise ValueError(f"task {task!r}: {len(x)} paired scores for {len(s)} scores")
      acc += x[idx].mean(axis=1)
  return [a / len(scores) for a in sums]


def task_ci(scores: dict, reference: dict | None = None, *, resamples: int = BOOTSTRAP_RESAMPLES,
            seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
  """95% percentile-bootstrap interval of the task accuracy: the mean over tasks of each task's mean score.

  scores: task -> the scores of its prompts; resampled stratified by task (_task_resamples). With `reference`
  (task -> full KV's scores on the same prompts, in the same order) the interval is of the ratio accuracy /
  reference accuracy, and the bootstrap is paired: one draw of prompts serves both, so what the method and full
  KV share cancels. Resamples whose reference accuracy is 0 (ratio undefined) are dropped. Fixed seed: the same
  rows give the same interval. None when there is nothing to resample."""
  if not scores:
    return None
  if reference is None:
    return _percentiles(_task_resamples(scores, resamples=resamples, seed=seed)[0])
  num, den = _task_resamples(scores, (reference,), resamples=resamples, seed=seed)
  with np.errstate(divide="ignore", invalid="ignore"):
    return _percentiles(np.where(den > 0, num / np.where(den > 0, den, 1), np.nan))


def difference_ci(scores: dict, base: dict, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                  ) -> tuple[float, float] | None:
  """95% paired-bootstrap interval of task accuracy(scores) - task accuracy(base), both task -> the scores of the
  same prompts in the same order (a variant against its base method). None when there is nothing to resample."""
  if not scores:
    return None
  a, b = _task_resamples(scores, (base,), resamples=resamples, seed=seed)
  return _percentiles(a - b)


def mean_ci(values, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
            ) -> tuple[float, float] | None:
  """95% percentile-bootstrap interval of a mean (fidelity: over the teacher-forced positions; positions of one
  sequence are correlated, so this is narrower than a bootstrap over sequences would be)."""
  v = np.asarray(values, np.float64)
  if not v.size:
    return None
  rng = np.random.default_rng(seed)
  return _percentiles(v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1))


# ----------------------------------------------------------------------------- summary


def _mode(r) -> str:
  return r.get("mode", "aware")


def _mode_order(mode) -> int:
  """Sort key of a mode: MODES' order, anything else last."""
  return MODES.index(mode) if mode in MODES else len(MODES)


def modes_of(res) -> list[str]:
  """The run's task modes: its grid's, else those its rows hold (rows without a mode are query-aware)."""
  g = res["meta"]["grid"].get("modes")
  if g:
    return list(g)
  have = {_mode(r) for r in res["tasks"]}
  return [m for m in MODES if m in have] or ["aware"]


def summarize(res) -> dict:
  """Per (context, mode, method, budget): task accuracy (mean over tasks of the mean sample score) and its 95%
  CI, its ratio to full KV's on the same prompts in the same mode (same tasks and seeds: merged runs may hold
  more samples of full than of a method) with a paired-bootstrap 95% CI, the score on the prompts full KV
  solves; and the fidelity figures of (context, method, budget) with their CIs, which do not depend on the mode
  (fidelity always compresses a prefix and teacher-forces the rest). Full KV's records are those with budget
  None (the method the budget does not change). A (context, method, budget) with fidelity but no task rows gets
  one row with mode None."""
  scores: dict = {}
  full_score = {}
  for r in res["tasks"]:
    key = (r["context"], _mode(r), r["method"], r["budget"])
    scores.setdefault(key, {}).setdefault(r["task"], {})[r["seed"]] = r["score"]
    if is_reference(r["method"], r["budget"]):
      full_score[(r["context"], _mode(r), r["task"], r["seed"])] = r["score"]
  fid = {(r["context"], r["method"], r["budget"]): r for r in res["fidelity"]}
  out = []
  full = {}
  full_task = {}
  for k in sorted(scores, key=lambda k: (k[0], _mode_order(k[1]), k[2], k[3] or 0)):
    c, mode, m, b = k
    by_task = {t: [v for _, v in sorted(ss.items())] for t, ss in scores[k].items()}
    row = {"context": c, "mode": mode, "method": m, "budget": b,
           "per_task": {t: float(np.mean(v)) for t, v in by_task.items()}}
    row["accuracy"] = float(np.mean(list(row["per_task"].values())))
    row["accuracy_ci"] = task_ci(by_task)
    row["prompts"] = sum(len(v) for v in by_task.values())
    if is_reference(m, b):
      full[f"{c}/{mode}"] = row["accuracy"]
      full_task.update({f"{c}/{mode}/{t}": v for t, v in row["per_task"].items()})
    ref = {t: [full_score.get((c, mode, t, s_)) for s_ in sorted(ss)] for t, ss in scores[k].items()}
    if all(v is not None for vs in ref.values() for v in vs):
      base = float(np.mean([np.mean(v) for v in ref.values()]))
      if base:
        row["relative_accuracy"] = row["accuracy"] / base
        row["relative_ci"] = task_ci(by_task, ref)
      solved = [(t, i) for t, vs in ref.items() for i, v in enumerate(vs) if v == 1.0]
      if solved:
        row["accuracy_on_full_solved"] = float(np.mean([by_task[t][i] for t, i in solved]))
    out.append(row)
  with_tasks = {(r["context"], r["method"], r["budget"]) for r in out}
  out += [{"context": c, "mode": None, "method": m, "budget": b} for (c, m, b) in sorted(
      set(fid) - with_tasks, key=lambda k: (k[0], k[1], k[2] or 0))]
  for row in out:
    f = fid.get((row["context"], row["method"], row["budget"]))
    if f is None:
      continue
    for name in ("top1", "top1_confident", "kl", "nll", "mass", "oracle"):
      if f.get(name) is not None:
        row[name] = f[name]
    if f.get("top1_pos"):
      row["top1_ci"] = mean_ci(f["top1_pos"])
      row["kl_ci"] = mean_ci(f["kl_pos"])
  return {"rows": out, "full_accuracy": full, "full_per_task": full_task, "variants": _variants(scores, out),
          "ci": f"{int(100 * CI_LEVEL)}% percentile bootstrap, {BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}"}


# registered extensions, compared against the method they extend like a variant with overrides
EXTENSION_OF = {"rocketkv_plus": "rocketkv"}


def base_method(spec: str) -> str:
  """'rocketkv[hsa_recent_tokens=8]' -> 'rocketkv' (runner.parse_methods' spec syntax); a registered extension ->
  the method it extends ('rocketkv_plus' -> 'rocketkv'); any other plain name -> itself."""
  name = spec.split("[", 1)[0]
  return name if name != spec else EXTENSION_OF.get(spec, spec)


def _variants(scores: dict, rows: list) -> list[dict]:
  """Each method spec with overrides against its base method, cell by cell (context, mode, budget) on the same
  prompts: the accuracy difference with its paired-bootstrap 95% CI (`difference_ci`), and whether the two
  methods' own accuracy intervals overlap. A cell is a win when the difference's interval lies above 0, a loss
  when it lies below 0 (beyond noise), else a tie."""
  acc = {(r["context"], r["mode"], r["method"], r["budget"]): r for r in rows if "accuracy" in r}
  out = []
  for (c, mode, m, b) in sorted(scores, key=lambda k: (k[2], k[0], _mode_order(k[1]), k[3] or 0)):
    base = base_method(m)
    if base == m or (c, mode, base, b) not in scores:
      continue
    mine, theirs = scores[(c, mode, m, b)], scores[(c, mode, base, b)]
    seeds = {t: sorted(set(mine[t]) & set(theirs.get(t, {}))) for t in mine}
    if not all(seeds.values()):
      continue
    a = {t: [mine[t][x] for x in ss] for t, ss in seeds.items()}
    ref = {t: [theirs[t][x] for x in ss] for t, ss in seeds.items()}
    diff = float(np.mean([np.mean(v) for v in a.values()]) - np.mean([np.mean(v) for v in ref.values()]))
    ci = difference_ci(a, ref)
    ci_m, ci_b = acc[(c, mode, m, b)].get("accuracy_ci"), acc[(c, mode, base, b)].get("accuracy_ci")
    apart = bool(ci_m and ci_b and (ci_m[0] > ci_b[1] or ci_m[1] < ci_b[0]))
    verdict = "win" if ci and ci[0] > 0 else "loss" if ci and ci[1] < 0 else "tie"
    out.append({"method": m, "base": base, "context": c, "mode": mode, "budget": b, "difference": diff,
                "difference_ci": ci, "intervals_apart": apart, "verdict": verdict,
                "prompts": sum(len(v) for v in a.values())})
  return out


def variant_verdicts(variants: list[dict]) -> dict:
  """Per variant: its wins, losses and ties over the cells compared, the wins whose accuracy intervals do not
  overlap the base's, and the project's registration rule (docs/ALGORITHM.md, "Extension: stage-2 options"):
  a win with intervals apart somewhere, no loss anywhere, and cells of both modes compared."""
  out = {}
  for v in variants:
    d = out.setdefault(v["method"], {"base": v["base"], "cells": 0, "win": 0, "loss": 0, "tie": 0, "wins_apart": 0,
                                     "modes": set()})
    d["cells"] += 1
    d[v["verdict"]] += 1
    d["wins_apart"] += v["verdict"] == "win" and v["intervals_apart"]
    d["modes"].add(v["mode"])
  for d in out.values():
    d["rule_met"] = bool(d["wins_apart"] and not d["loss"] and set(MODES) <= d["modes"])
    d["modes"] = sorted(d["modes"], key=_mode_order)
  return out


def _reference_methods(rows) -> set:
  """Methods run without a budget (full KV, plain or with overrides): their rows have budget None."""
  return {r["method"] for r in rows if r["budget"] is None}


def _fmt(x, pct=False, digits=3):
  if x is None:
    return "-"
  return f"{100 * x:.0f}%" if pct else f"{x:.{digits}f}"


def _fmt_ci(x, ci, pct=False, digits=3):
  """'41% [33, 49]' (pct) or '0.052 [0.041, 0.063]'."""
  if x is None:
    return "-"
  if not ci:
    return _fmt(x, pct, digits)
  lo, hi = ci
  return f"{100 * x:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]" if pct else f"{x:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _index(rows) -> dict:
  """(context, mode, method, budget) -> row, and (context, None, method, budget) -> a row with the fidelity."""
  by = {}
  for r in rows:
    by[(r["context"], r["mode"], r["method"], r["budget"])] = r
    by.setdefault((r["context"], None, r["method"], r["budget"]), r)
  return by


def headline(res, budget: int = 256) -> str:
  """One table at one budget: every method x context, accuracy (and relative to full KV) per mode, fidelity."""
  g, rows = res["meta"]["grid"], res["summary"]["rows"]
  by = _index(rows)
  reference = _reference_methods(rows)
  modes = modes_of(res)
  if budget not in g["budgets"]:
    budget = g["budgets"][len(g["budgets"]) // 2]
  head = "| context | method | " + " | ".join(f"task acc. {m} | rel. to full {m}" for m in modes) + \
         " | top-1 | top-1 (confident) | KL | mass / oracle |"
  out = [f"## Headline at t={budget} (95% CIs in brackets)", "", head, "|---|---|" + "---|---|" * len(modes) + "---|---|---|---|"]
  for c in g["contexts"]:
    for m in g["methods"]:
      b = None if m in reference else budget
      cells = []
      for mode in modes:
        r = by.get((c, mode, m, b), {})
        cells += [_fmt_ci(r.get("accuracy"), r.get("accuracy_ci"), True),
                  _fmt_ci(r.get("relative_accuracy"), r.get("relative_ci"), True)]
      f = by.get((c, None, m, b), {})
      if not f and all(x == "-" for x in cells):
        continue
      mass = f"{_fmt(f.get('mass'))} / {_fmt(f.get('oracle'))}" if f.get("mass") is not None else "-"
      out.append(f"| {c} | {m} | " + " | ".join(cells) + f" | {_fmt_ci(f.get('top1'), f.get('top1_ci'), True)} "
                 f"| {_fmt(f.get('top1_confident'), True)} | {_fmt_ci(f.get('kl'), f.get('kl_ci'))} | {mass} |")
  return "\n".join(out)


def variants_markdown(res) -> list[str]:
  """The variants against their base method: a verdict line each, then every compared cell (lines; [] if none)."""
  variants = res["summary"].get("variants") or []
  if not variants:
    return []
  lines = ["## Variants against their base method (same prompts, paired)", "",
           "Difference in task accuracy (variant - base) with its paired-bootstrap 95% CI. *win*: the interval lies "
           "above 0; *loss*: below 0; *apart*: the two methods' own accuracy intervals do not overlap. Registration "
           "rule: a win with intervals apart somewhere, no loss anywhere, in both modes.", ""]
  for m, d in variant_verdicts(variants).items():
    lines.append(f"- **{m}** against {d['base']}: {d['win']} win(s) ({d['wins_apart']} with intervals apart), "
                 f"{d['loss']} loss(es), {d['tie']} tie(s) over {d['cells']} cells ({', '.join(d['modes'])}); "
                 f"rule {'met' if d['rule_met'] else 'not met'}.")
  lines += ["", "| variant | context | mode | t | variant - base [95% CI] | verdict |", "|---|---|---|---|---|---|"]
  for v in variants:
    ci = v["difference_ci"]
    cell = f"{100 * v['difference']:+.0f} pts" + (f" [{100 * ci[0]:+.0f}, {100 * ci[1]:+.0f}]" if ci else "")
    verdict = v["verdict"] + (", apart" if v["intervals_apart"] else "")
    lines.append(f"| {v['method']} | {v['context']} | {v['mode']} | {v['budget']} | {cell} | {verdict} |")
  return lines + [""]


def markdown(res) -> str:
  meta, rows = res["meta"], res["summary"]["rows"]
  g = meta["grid"]
  modes = modes_of(res)
  model = model_label(meta["model"]) + (f" (run as `{meta['model_path']}`)" if meta.get("model_path") else "")
  lines = [f"# Accuracy and fidelity: {model}", "",
           f"- date: {meta['date']}; machine: {meta['machine']['backend']} "
           f"({', '.join(sorted(set(meta['machine']['devices'])))}), {meta['machine']['cpu_count']} cores, "
           f"host {meta['machine']['host']}; jax {meta['machine']['jax']}",
           f"- command: `{meta['command']}`", f"- runtime: {meta.get('seconds', 0) / 60:.1f} min",
           f"- grid: contexts {g['contexts']}, budgets {g['budgets']}, {g['samples']} sample(s) per task "
           f"({', '.join(g['tasks'])}), modes {', '.join(modes)}, fidelity {g['fid_samples']} sequence(s) x "
           f"{g['fid_tail']} teacher-forced tokens, max_new {g['max_new']}, chat template {g['chat']}, {g['dtype']}",
           f"- intervals: {res['summary'].get('ci', '')}; task accuracy over prompts (stratified by task), relative "
           "accuracy paired with full KV on the same prompts, fidelity over teacher-forced positions", ""]
  if meta.get("note"):
    lines[-1:-1] = [f"- note: {meta['note']}"]
  budgets = list(g["budgets"])
  reference = _reference_methods(rows)
  methods = [m for m in g["methods"] if m not in reference]
  by = _index(rows)
  lines += headline(res), ""
  lines += variants_markdown(res)
  for c in g["contexts"]:
    lines += [f"## Context {c} tokens", ""]
    for mode in modes:
      full = next((r for r in rows if r["context"] == c and r["mode"] == mode and is_reference(r["method"], r["budget"])),
                  {})
      if "accuracy" in full:
        pt = ", ".join(f"{t} {_fmt(v, True)}" for t, v in full.get("per_task", {}).items())
        lines += [f"Full KV task accuracy, {mode}: **{_fmt_ci(full['accuracy'], full.get('accuracy_ci'), True)}** "
                  f"({pt}; {full.get('prompts')} prompts).", ""]
    fnll = next((by[k].get("nll") for k in [(c, None, r_, None) for r_ in reference if is_reference(r_, None)]
                 if k in by), None)
    if fnll is not None:
      lines += [f"Full-KV NLL of the teacher-forced tail: {_fmt(fnll)}.", ""]
    per_mode = [
        ("Task accuracy (mean over tasks), 95% CI", "accuracy",
         lambda r: _fmt_ci(r.get("accuracy"), r.get("accuracy_ci"), True)),
        ("Task accuracy relative to full KV on the same prompts, paired-bootstrap 95% CI", "relative_accuracy",
         lambda r: _fmt_ci(r.get("relative_accuracy"), r.get("relative_ci"), True)),
        ("Score on the samples full KV solves", "accuracy_on_full_solved",
         lambda r: _fmt(r.get("accuracy_on_full_solved"), True)),
    ]
    for title, key, cell in per_mode:
      if not any(by.get((c, mode, m, b), {}).get(key) is not None for mode in modes for m in methods for b in budgets):
        continue
      lines += [f"### {title}", "", "| method | " + " | ".join(f"t={b} {mode}" for b in budgets for mode in modes) + " |",
                "|---|" + "---|" * (len(budgets) * len(modes))]
      for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(by.get((c, mode, m, b), {})) for b in budgets for mode in modes) + " |")
      lines.append("")
    fidelity = [
        ("Top-1 agreement with full KV (teacher-forced), 95% CI", "top1",
         lambda r: _fmt_ci(r.get("top1"), r.get("top1_ci"), True)),
        ("Top-1 agreement where full KV's top-1 probability is >= 0.5", "top1_confident",
         lambda r: _fmt(r.get("top1_confident"), True)),
        ("Mean KL(full || method), nats per token, 95% CI", "kl", lambda r: _fmt_ci(r.get("kl"), r.get("kl_ci"))),
        ("Attention mass captured (all layers) / exact top-M oracle of the same size", "mass",
         lambda r: f"{_fmt(r.get('mass'))} / {_fmt(r.get('oracle'))}" if r.get("mass") is not None else "-"),
    ]
    for title, key, cell in fidelity:
      if not any(by.get((c, None, m, b), {}).get(key) is not None for m in methods for b in budgets):
        continue
      lines += [f"### {title}", "", "| method | " + " | ".join(f"t={b}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
      for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(by.get((c, None, m, b), {})) for b in budgets) + " |")
      lines.append("")
  if res.get("skipped"):
    lines += ["## Skipped configurations", ""] + [
        f"- {s['method']} t={s['budget']} at {s['context']}{' (' + s['mode'] + ')' if s.get('mode') else ''}: {s['why']}"
        for s in res["skipped"]] + [""]
  if meta.get("errors"):
    lines += ["## Errors (no rows; a re-run with the same cells file retries them)", ""] + [
        f"- {e['method']} t={e['budget']} at {e['context']} ({e['mode']}): {e['error'][:300]}" for e in meta["errors"]] + [""]
  if meta.get("timing"):
    lines += ["## Where the time went", "", "| context | configs | compile (wall) | trace (sum) | XLA compile (sum) | total |",
              "|---|---|---|---|---|---|"]
    for c, t in meta["timing"].items():
      lines.append(f"| {c} | {t.get('configs', '-')} | {t.get('compile_wall_s', '-')} s | {t.get('trace_s', '-')} s "
                   f"| {t.get('xla_compile_s', '-')} s | {t.get('total_s', '-')} s |")
    lines.append("")
  return "\n".join(lines)


KL_FLOOR = 1e-3  # bottom of the KL plots' log axis: full KV's own KL is 0 (~1e-17 in float32), not a value to plot


def _machine_label(machine: dict) -> str:
  """'NVIDIA H200', 'CPU', or both for a merged run."""
  devices = [("CPU" if d.lower() == "cpu" else d) for d in machine.get("devices", [])]
  return " + ".join(dict.fromkeys(devices)) or str(machine.get("backend", "?"))


def _plot_title(what: str, meta: dict) -> str:
  """What the plot shows, then the model (real weights: this suite runs a trained model) and the machine."""
  return f"{what}\n{model_label(meta.get('model', '?'))}, {meta['grid'].get('dtype', '')}, {_machine_label(meta['machine'])}"


def plots(res, prefix) -> list[str]:
  """One PNG per measure (tasks, relative, top1, kl, mass, mass_per_layer), a panel per context, 95% CIs as
  error bars. Task plots draw the query-aware mode solid and the query-agnostic mode dashed. Colours are
  plot_style.py's method -> colour map, the same in every benchmark plot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta = res["meta"]
  g = meta["grid"]
  rows = res["summary"]["rows"]
  by = _index(rows)
  reference = _reference_methods(rows)
  methods = [m for m in g["methods"] if m not in reference]
  modes = modes_of(res)
  budgets = list(g["budgets"])
  contexts = list(g["contexts"])
  styles = {"aware": "-", "agnostic": "--", None: "-"}
  paths = []

  def panel(key, ylabel, fname, title, ylim=None, floor=None, per_mode=False, ci_key=None, show_ref=True):
    """floor: a log y axis from `floor` up; values below it are drawn at it (the label says so)."""
    row_modes = modes if per_mode else [None]
    if not any(by.get((c, mo, m, b), {}).get(key) is not None for c in contexts for mo in row_modes
               for m in methods for b in budgets):
      return
    fig, axes = plt.subplots(1, len(contexts), figsize=(max(4.6 * len(contexts), 8.0), 4.0), squeeze=False)
    for ax, c in zip(axes[0], contexts):
      if not show_ref:  # a ratio to full KV: full KV is 1
        ax.axhline(1.0, color=method_color("full"), lw=1, label="full KV")
      for mo in row_modes:
        for j, m in enumerate(methods):
          rs = [by.get((c, mo, m, b), {}) for b in budgets]
          if not any(r.get(key) is not None for r in rs):
            continue
          clip = (lambda y: max(y, floor)) if floor else (lambda y: y)
          ys = np.array([np.nan if r.get(key) is None else clip(r[key]) for r in rs])
          # the methods' points spread a little along x, so that overlapping error bars stay readable
          n = len(methods) * len(row_modes)
          k = j * len(row_modes) + row_modes.index(mo)
          xs = np.array(budgets, float) * 2 ** (0.5 * (k - (n - 1) / 2) / max(n, 8))
          cis = [r.get(ci_key) if ci_key else None for r in rs]
          err = None
          if any(ci for ci in cis):
            lo = np.array([y - clip(ci[0]) if ci else 0 for y, ci in zip(ys, cis)])
            hi = np.array([clip(ci[1]) - y if ci else 0 for y, ci in zip(ys, cis)])
            err = np.nan_to_num(np.maximum(np.stack([lo, hi]), 0))
          label = m if mo in ("aware", None) or len(row_modes) == 1 else None
          ax.errorbar(xs, ys, yerr=err, fmt="o" + styles[mo], color=method_color(m), label=label,
                      lw=method_width(m), ms=3.5, capsize=2, elinewidth=0.8,
                      mfc="white" if mo == "agnostic" else method_color(m))  # agnostic: open markers
        if show_ref:
          ref = next((by[k].get(key) for k in [(c, mo, r_, None) for r_ in reference if is_reference(r_, None)]
                      if k in by), None)
          if ref is not None and not (floor and ref < floor):
            ax.axhline(ref, color=method_color("full"), ls=styles[mo], lw=1,
                       label=f"full KV{' ' + mo if per_mode else ''} ({ref:.2f})")
      ax.set_xscale("log", base=2)
      ax.set_xticks(budgets, [str(b) for b in budgets])
      ax.minorticks_off()
      if floor:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
      if ylim:
        ax.set_ylim(*ylim)
      ax.set_title(f"context {tokens_label(c)} tokens")
      ax.set_xlabel("token budget t")
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(_plot_title(title, meta), fontsize=11)
    fig.tight_layout()
    p = f"{prefix}_{fname}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

  both = ", ".join(f"{'solid' if styles[m] == '-' else 'dashed, open'}: {m}" for m in modes)
  panel("accuracy", "task accuracy", "tasks", f"Task accuracy, 95% CI ({both})", (-0.05, 1.05),
        per_mode=True, ci_key="accuracy_ci")
  panel("relative_accuracy", "accuracy / full KV's (same prompts)", "relative",
        f"Accuracy relative to full KV, paired 95% CI ({both})", per_mode=True,
        ci_key="relative_ci", show_ref=False)
  panel("top1", "top-1 agreement with full", "top1", "Top-1 agreement with full KV, 95% CI",
        (0, 1.02), ci_key="top1_ci")
  panel("kl", f"KL(full || method), nats\n(log axis from {KL_FLOOR:g}; lower drawn at it)", "kl",
        "KL(full || method), 95% CI (lower is better)", floor=KL_FLOOR,
        ci_key="kl_ci")
  panel("mass", "exact attention mass captured", "mass", "Attention mass of the attended tokens", (0, 1.02))
  # per-layer mass at each budget, one panel per context (the largest budget <= 256 if present)
  fid = [r for r in res["fidelity"] if r.get("mass_per_layer")]
  if fid:
    have = sorted({r["budget"] for r in fid})
    b_show = max([b for b in have if b <= 256] or have[:1])
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.6 * len(contexts), 4.0), squeeze=False)
    for ax, c in zip(axes[0], contexts):
      for r in fid:
        if r["context"] == c and r["budget"] == b_show:
          color = method_color(r["method"])
          ax.plot(r["mass_per_layer"], "-", color=color, label=r["method"], lw=method_width(r["method"]))
          ax.plot(r["oracle_per_layer"], ":", color=color, lw=0.8)
      ax.set_title(f"context {tokens_label(c)}, t={b_show}; dotted: same-size oracle", fontsize=9)
      ax.set_xlabel("layer")
      ax.set_ylabel("attention mass captured")
      ax.set_ylim(0, 1.02)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(_plot_title("Attention mass per layer", meta), fontsize=11)
    fig.tight_layout()
    p = f"{prefix}_mass_per_layer.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
  return paths


def can_plot() -> bool:
  """Whether matplotlib is installed (the `eval` extra): without it the suite writes its JSON and markdown only."""
  return importlib.util.find_spec("matplotlib") is not None


def write_outputs(res, prefix) -> list[str]:
  """Writes <prefix>.json, <prefix>.md and, when matplotlib is installed, the plots; returns their paths."""
  d = os.path.dirname(prefix)
  if d:
    os.makedirs(d, exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump(res, f, indent=1, default=lambda o: o.tolist() if isinstance(o, (np.ndarray, np.generic)) else str(o))
  md = markdown(res)
  with open(prefix + ".md", "w") as f:
    f.write(md)
  return [prefix + ".json", prefix + ".md"] + (plots(res, prefix) if can_plot() else [])


def merge(results: list[dict], note: str | None = None) -> dict:
  """One results dict from several runs (other contexts, methods, budgets or modes; same settings otherwise). A
  record that an earlier input already holds (same context, mode, method, budget, task and seed; for fidelity,
  same context, method and budget) is dropped, so runs that each recomputed `full` on the same prompts count
  once."""
  first = results[0]
  out = {"meta": json.loads(json.dumps(first["meta"])), "tasks": [], "fidelity": [], "skipped": []}
  out["meta"]["command"] = " && ".join(dict.fromkeys(r["meta"]["command"] for r in results))
  out["meta"]["seconds"] = sum(r["meta"].get("seconds", 0) for r in results)
  out["meta"]["date"] = ", ".join(dict.fromkeys(r["meta"]["date"] for r in results))
  grid = out["meta"]["grid"]
  grid["contexts"] = sorted({c for r in results for c in r["meta"]["grid"]["contexts"]})
  grid["methods"] = list(dict.fromkeys(m for r in results for m in r["meta"]["grid"]["methods"]))
  grid["budgets"] = sorted({b for r in results for b in r["meta"]["grid"]["budgets"]})
  grid["samples"] = max(r["meta"]["grid"]["samples"] for r in results)
  grid["modes"] = [m for m in MODES if any(m in modes_of(r) for r in results)]

  def distinct(values):  # one value, or the runs' values joined ("4 / 8")
    vals = list(dict.fromkeys(str(v) for v in values))
    return vals[0] if len(vals) == 1 else " / ".join(vals)

  # Fidelity settings of the runs that contributed fidelity rows; the machines of all runs.
  fid_runs = [r for r in results if r.get("fidelity")] or results
  grid["fid_samples"] = distinct(r["meta"]["grid"]["fid_samples"] for r in fid_runs)
  grid["fid_tail"] = distinct(r["meta"]["grid"]["fid_tail"] for r in fid_runs)
  machines = [r["meta"]["machine"] for r in results]
  out["meta"]["machine"] = dict(backend=distinct(m["backend"] for m in machines),
                                devices=sorted({d for m in machines for d in m["devices"]}),
                                cpu_count=distinct(m["cpu_count"] for m in machines),
                                host=distinct(m["host"] for m in machines), jax=distinct(m["jax"] for m in machines))
  timing = {}
  for r in results:
    timing.update(r["meta"].get("timing") or {})
  if timing:
    out["meta"]["timing"] = timing
  errors = [e for r in results for e in r["meta"].get("errors", [])]
  if errors:
    out["meta"]["errors"] = errors
  notes = [r["meta"]["note"] for r in results if r["meta"].get("note")]
  if note:
    notes.insert(0, note)
  if notes:
    out["meta"]["note"] = " | ".join(dict.fromkeys(notes))
  seen = set()
  for r in results:
    for rec in r.get("tasks", []):
      key = ("task",) + task_key(rec)
      if key not in seen:
        seen.add(key)
        out["tasks"].append(rec)
    for rec in r.get("fidelity", []):
      key = ("fid", rec["context"], rec["method"], rec["budget"])
      if key not in seen:
        seen.add(key)
        out["fidelity"].append(rec)
    for rec in r.get("skipped", []):
      key = ("skip", rec["context"], rec.get("mode"), rec["method"], rec["budget"], rec["why"])
      if key not in seen:
        seen.add(key)
        out["skipped"].append(rec)
  out["summary"] = summarize(out)
  return out


def from_cells(path: str) -> dict:
  """A results dict (no summary) from a cells file (runner.py / `rocketkv eval`): its rows, and the meta of its
  runs (the last run's date, machine and command; the grids of all runs joined, widened to what the rows hold)."""
  cells = read_cells(path)
  if cells is None:
    raise FileNotFoundError(path)
  runs = cells["runs"] or [{}]
  last = runs[-1]
  settings = cells["settings"] or {}
  grids = [r.get("grid") or {} for r in runs]
  rows = cells["tasks"] + cells["fidelity"]
  grid = {k: settings.get(k) for k in ("max_new", "chat", "dtype", "impl", "fid_tail")}
  grid.update(
      contexts=sorted({c for g_ in grids for c in g_.get("contexts", [])} | {r["context"] for r in rows}),
      methods=list(dict.fromkeys([m for g_ in grids for m in g_.get("methods", [])] + [r["method"] for r in rows])),
      budgets=sorted({b for g_ in grids for b in g_.get("budgets", [])} | {r["budget"] for r in rows
                                                                           if r["budget"] is not None}),
      samples=max([g_.get("samples", 0) for g_ in grids] + [r["seed"] + 1 for r in cells["tasks"]]),
      tasks=list(dict.fromkeys([t for g_ in grids for t in g_.get("tasks", [])] + [r["task"] for r in cells["tasks"]])),
      modes=[m for m in MODES if m in {x for g_ in grids for x in g_.get("modes", [])} | {_mode(r) for r in cells["tasks"]}],
      fid_samples=max([g_.get("fid_samples", 0) for g_ in grids] + [r["sequences"] for r in cells["fidelity"]]))
  timing = dict(cells.get("timing") or {})
  meta = {"date": ", ".join(dict.fromkeys(r.get("date", "?") for r in runs)),
          "command": " && ".join(dict.fromkeys(r.get("command", "?") for r in runs)),
          "machine": last.get("machine") or {"backend": "?", "devices": [], "cpu_count": "?", "host": "?", "jax": "?"},
          "model": settings.get("model", "?"), "grid": grid,
          "seconds": sum(t.get("total_s", 0) for t in (cells.get("timing") or {}).values()),
          "cells": {"file": path, "runs": len(cells["runs"])}}
  if timing:
    meta["timing"] = timing
  if cells.get("errors"):
    meta["errors"] = cells["errors"]
  return {"meta": meta, "tasks": cells["tasks"], "fidelity": cells["fidelity"], "skipped": cells["skipped"]}


def load(path: str) -> dict:
  """A result JSON, or a cells file (*.jsonl)."""
  if path.endswith(".jsonl"):
    return from_cells(path)
  return json.load(open(path))


def main(argv=None, prog: str = "python -m rocketkv_jax.eval.report"):
  """python -m rocketkv_jax.eval.report (python -m benchmarks.accuracy.report in a checkout) INPUT [INPUT ...]
  --out PREFIX: merge and re-render; an INPUT is a result JSON or a cells file (*.cells.jsonl, what the runner and
  `rocketkv eval` append rows to).
  python -m rocketkv_jax.eval.report --plots-only RESULT.json ...: redraw RESULT_*.png from the JSON alone
  (the committed plots: --plots-only benchmarks/results/accuracy_{cpu,cpu_4k,cpu_4k8k,cpu_4k_32prompts,
  4k8k_all,h200_partial}.json), leaving the JSON and the markdown as they are."""
  import argparse

  p = argparse.ArgumentParser(prog=prog)
  p.add_argument("inputs", nargs="+")
  p.add_argument("--out", default=None)
  p.add_argument("--plots-only", action="store_true", help="redraw each input's plots beside it; write nothing else")
  p.add_argument("--note", default=None, help="what the merged table is made of, shown first in its notes")
  p.add_argument("--model", default=None,
                 help="the model's name in titles, when the runs' model path does not say it (e.g. a renamed GGUF "
                      "on another machine): smollm2, or any name")
  a = p.parse_args(argv)
  if a.plots_only:
    for x in a.inputs:
      res = load(x)
      res["summary"] = summarize(res)  # older files hold a summary without intervals
      for path in plots(res, os.path.splitext(x)[0]):
        print(f"wrote {path}")
    return
  if not a.out:
    p.error("--out is required (or --plots-only)")
  res = merge([load(x) for x in a.inputs], note=a.note)
  if a.model:
    res["meta"]["model_path"], res["meta"]["model"] = res["meta"]["model"], a.model
  for path in write_outputs(res, a.out):
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
