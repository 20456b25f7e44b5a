"""Markdown tables and matplotlib plots of an accuracy run (results dict of runner.run)."""
from __future__ import annotations

import json
import os

import numpy as np

from benchmarks.plot_style import method_color, method_width, model_label, tokens_label


def summarize(res) -> dict:
  """Per (context, method, budget): task accuracy (mean over tasks of the mean sample score), its ratio to
  full KV's on the same prompts (same tasks and seeds: merged runs may hold more samples of full than of a
  method), and the fidelity figures. Full KV's records are those with budget None (the method the budget
  does not change)."""
  acc: dict = {}
  seeds: dict = {}
  full_score = {}
  for r in res["tasks"]:
    key = (r["context"], r["method"], r["budget"])
    acc.setdefault(key, {}).setdefault(r["task"], []).append(r["score"])
    seeds.setdefault(key, {}).setdefault(r["task"], []).append(r["seed"])
    if r["budget"] is None:
      full_score[(r["context"], r["task"], r["seed"])] = r["score"]
  out = []
  full = {c: np.mean([np.mean(v) for v in t.values()]) for (c, m, b), t in acc.items() if b is None}

  def full_on_same_prompts(c, task_seeds):
    per_task = [[full_score.get((c, t, s_)) for s_ in ss] for t, ss in task_seeds.items()]
    if any(v is None for vs in per_task for v in vs):
      return None
    return float(np.mean([np.mean(vs) for vs in per_task]))

  full_task = {(c, k): np.mean(v) for (c, m, b), t in acc.items() if b is None for k, v in t.items()}
  fid = {(r["context"], r["method"], r["budget"]): r for r in res["fidelity"]}
  keys = sorted(set(acc) | set(fid), key=lambda k: (k[0], k[1], k[2] or 0))
  for k in keys:
    c, m, b = k
    row = {"context": c, "method": m, "budget": b}
    if k in acc:
      per_task = {t: float(np.mean(v)) for t, v in acc[k].items()}
      row["per_task"] = per_task
      row["accuracy"] = float(np.mean(list(per_task.values())))
      base = full_on_same_prompts(c, seeds[k])
      if base:
        row["relative_accuracy"] = row["accuracy"] / base
      row["accuracy_on_full_solved"] = _on_solved(res, c, m, b)
    if k in fid:
      for f in ("top1", "top1_confident", "kl", "nll", "mass", "oracle"):
        if f in fid[k]:
          row[f] = fid[k][f]
    out.append(row)
  return {"rows": out, "full_accuracy": {str(c): float(v) for c, v in full.items()},
          "full_per_task": {f"{c}/{t}": float(v) for (c, t), v in full_task.items()}}


def _on_solved(res, c, m, b):
  """Mean score of the method on the samples that full KV solved completely (None when there are none):
  the share of full KV's successes that the method keeps."""
  solved = {(r["task"], r["seed"]) for r in res["tasks"] if r["context"] == c and r["budget"] is None
            and r["score"] == 1.0}
  s = [r["score"] for r in res["tasks"] if r["context"] == c and r["method"] == m and r["budget"] == b
       and (r["task"], r["seed"]) in solved]
  return float(np.mean(s)) if s else None


def _reference_methods(rows) -> set:
  """Methods run without a budget (full KV): the reference of every comparison."""
  return {r["method"] for r in rows if r["budget"] is None}


def _fmt(x, pct=False, digits=3):
  if x is None:
    return "-"
  return f"{100 * x:.0f}%" if pct else f"{x:.{digits}f}"


def headline(res, budget: int = 256) -> str:
  """One table at one budget: every method x context, accuracy relative to full KV and fidelity."""
  g, rows = res["meta"]["grid"], res["summary"]["rows"]
  by = {(r["context"], r["method"], r["budget"]): r for r in rows}
  reference = _reference_methods(rows)
  if budget not in g["budgets"]:
    budget = g["budgets"][len(g["budgets"]) // 2]
  out = [f"## Headline at t={budget}", "",
         "| context | method | task acc. (rel. to full) | on full's solved | top-1 | top-1 (confident) | KL | mass / oracle |",
         "|---|---|---|---|---|---|---|---|"]
  for c in g["contexts"]:
    for m in g["methods"]:
      r = by.get((c, m, None if m in reference else budget))
      if r is None:
        continue
      acc = f"{_fmt(r.get('accuracy'), True)} ({_fmt(r.get('relative_accuracy'), True)})" if "accuracy" in r else "-"
      mass = f"{_fmt(r.get('mass'))} / {_fmt(r.get('oracle'))}" if r.get("mass") is not None else "-"
      out.append(f"| {c} | {m} | {acc} | {_fmt(r.get('accuracy_on_full_solved'), True)} | {_fmt(r.get('top1'), True)} "
                 f"| {_fmt(r.get('top1_confident'), True)} | {_fmt(r.get('kl'))} | {mass} |")
  return "\n".join(out)


def markdown(res) -> str:
  meta, rows = res["meta"], res["summary"]["rows"]
  g = meta["grid"]
  lines = [f"# Accuracy and fidelity: {meta['model']}", "",
           f"- date: {meta['date']}; machine: {meta['machine']['backend']} "
           f"({', '.join(sorted(set(meta['machine']['devices'])))}), {meta['machine']['cpu_count']} cores, "
           f"host {meta['machine']['host']}; jax {meta['machine']['jax']}",
           f"- command: `{meta['command']}`", f"- runtime: {meta.get('seconds', 0) / 60:.1f} min",
           f"- grid: contexts {g['contexts']}, budgets {g['budgets']}, {g['samples']} sample(s) per task "
           f"({', '.join(g['tasks'])}), fidelity {g['fid_samples']} sequence(s) x {g['fid_tail']} teacher-forced "
           f"tokens, max_new {g['max_new']}, chat template {g['chat']}, {g['dtype']}", ""]
  if meta.get("note"):
    lines[-1:-1] = [f"- note: {meta['note']}"]
  budgets = list(g["budgets"])
  reference = _reference_methods(rows)
  methods = [m for m in g["methods"] if m not in reference]
  by = {(r["context"], r["method"], r["budget"]): r for r in rows}
  full_by_context = {r["context"]: r for r in rows if r["budget"] is None}
  lines += headline(res), ""
  for c in g["contexts"]:
    full = full_by_context.get(c, {})
    lines += [f"## Context {c} tokens", ""]
    if "accuracy" in full:
      pt = ", ".join(f"{t} {_fmt(v, True)}" for t, v in full.get("per_task", {}).items())
      lines += [f"Full KV task accuracy: **{_fmt(full['accuracy'], True)}** ({pt}); full-KV NLL of the "
                f"teacher-forced tail: {_fmt(full.get('nll'))}.", ""]
    sections = [
        ("Task accuracy (mean over tasks; in brackets: relative to full KV)", "accuracy",
         lambda r: f"{_fmt(r.get('accuracy'), True)} ({_fmt(r.get('relative_accuracy'), True)})"
         if r.get("accuracy") is not None else "-"),
        ("Score on the samples full KV solves", "accuracy_on_full_solved",
         lambda r: _fmt(r.get("accuracy_on_full_solved"), True)),
        ("Top-1 agreement with full KV (teacher-forced)", "top1", lambda r: _fmt(r.get("top1"), True)),
        ("Top-1 agreement where full KV's top-1 probability is >= 0.5", "top1_confident",
         lambda r: _fmt(r.get("top1_confident"), True)),
        ("Mean KL(full || method), nats per token", "kl", lambda r: _fmt(r.get("kl"))),
        ("Attention mass captured (all layers) / exact top-M oracle of the same size", "mass",
         lambda r: f"{_fmt(r.get('mass'))} / {_fmt(r.get('oracle'))}" if r.get("mass") is not None else "-"),
    ]
    for title, key, cell in sections:
      if not any(by.get((c, m, b), {}).get(key) is not None for m in methods for b in budgets):
        continue
      lines += [f"### {title}", "", "| method | " + " | ".join(f"t={b}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
      for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(by.get((c, m, b), {})) for b in budgets) + " |")
      lines.append("")
  if res.get("skipped"):
    lines += ["## Skipped configurations", ""] + [f"- {s['method']} t={s['budget']} at {s['context']}: {s['why']}"
                                                  for s in res["skipped"]] + [""]
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
  """One PNG per measure (tasks, top1, kl, mass, mass_per_layer), a panel per context. Colours are
  benchmarks/plot_style.py's method -> colour map, the same in every benchmark plot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta = res["meta"]
  g = meta["grid"]
  rows = res["summary"]["rows"]
  by = {(r["context"], r["method"], r["budget"]): r for r in rows}
  reference = _reference_methods(rows)
  methods = [m for m in g["methods"] if m not in reference]
  full_by_context = {r["context"]: r for r in rows if r["budget"] is None}
  budgets = list(g["budgets"])
  contexts = list(g["contexts"])
  paths = []

  def panel(key, ylabel, fname, title, ylim=None, floor=None):
    """floor: a log y axis from `floor` up; values below it are drawn at it (the label says so)."""
    if not any(by.get((c, m, b), {}).get(key) is not None for c in contexts for m in methods for b in budgets):
      return
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.6 * len(contexts), 4.0), squeeze=False)
    for ax, c in zip(axes[0], contexts):
      for m in methods:
        ys = [by.get((c, m, b), {}).get(key) for b in budgets]
        if any(y is not None for y in ys):
          ys = [np.nan if y is None else (max(y, floor) if floor else y) for y in ys]
          ax.plot(budgets, ys, "o-", color=method_color(m), label=m, lw=method_width(m))
      ref = full_by_context.get(c, {}).get(key)
      if ref is not None and not (floor and ref < floor):
        ax.axhline(ref, color=method_color("full"), ls="--", lw=1, label=f"full KV ({ref:.2f})")
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

  panel("accuracy", "task accuracy", "tasks", "Task accuracy vs budget (dashed: full KV)", (-0.05, 1.05))
  panel("top1", "top-1 agreement with full", "top1", "Teacher-forced top-1 agreement with full KV", (0, 1.02))
  panel("kl", f"KL(full || method), nats\n(log axis from {KL_FLOOR:g}; lower drawn at it)", "kl",
        "Teacher-forced KL to full KV (lower is better; full KV's own KL is 0)", floor=KL_FLOOR)
  panel("mass", "exact attention mass captured", "mass", "Attention mass of the attended tokens", (0, 1.02))
  # per-layer mass at each budget, one panel per context (the largest budget <= 256 if present)
  fid = [r for r in res["fidelity"] if r.get("mass_per_layer")]
  if fid:
    b_show = max([b for b in budgets if b <= 256] or budgets[:1])
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


def write_outputs(res, prefix) -> list[str]:
  d = os.path.dirname(prefix)
  if d:
    os.makedirs(d, exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump(res, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
  md = markdown(res)
  with open(prefix + ".md", "w") as f:
    f.write(md)
  return [prefix + ".json", prefix + ".md"] + plots(res, prefix)


def merge(results: list[dict], note: str | None = None) -> dict:
  """One results dict from several runs (other contexts, methods or budgets; same settings otherwise). A record
  that an earlier input already holds (same context, method, budget, task and seed; for fidelity, same
  context, method and budget) is dropped, so runs that each recomputed `full` on the same prompts count once."""
  first = results[0]
  out = {"meta": json.loads(json.dumps(first["meta"])), "tasks": [], "fidelity": [], "skipped": []}
  out["meta"]["command"] = " && ".join(r["meta"]["command"] for r in results)
  out["meta"]["seconds"] = sum(r["meta"].get("seconds", 0) for r in results)
  out["meta"]["date"] = ", ".join(r["meta"]["date"] for r in results)
  grid = out["meta"]["grid"]
  grid["contexts"] = list(dict.fromkeys(c for r in results for c in r["meta"]["grid"]["contexts"]))
  grid["methods"] = list(dict.fromkeys(m for r in results for m in r["meta"]["grid"]["methods"]))
  grid["budgets"] = sorted({b for r in results for b in r["meta"]["grid"]["budgets"]})
  grid["samples"] = max(r["meta"]["grid"]["samples"] for r in results)

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
  notes = [r["meta"]["note"] for r in results if r["meta"].get("note")]
  if note:
    notes.insert(0, note)
  if notes:
    out["meta"]["note"] = " | ".join(dict.fromkeys(notes))
  seen = set()
  for r in results:
    for rec in r.get("tasks", []):
      key = ("task", rec["context"], rec["method"], rec["budget"], rec["task"], rec["seed"])
      if key not in seen:
        seen.add(key)
        out["tasks"].append(rec)
    for rec in r.get("fidelity", []):
      key = ("fid", rec["context"], rec["method"], rec["budget"])
      if key not in seen:
        seen.add(key)
        out["fidelity"].append(rec)
    out["skipped"] += r.get("skipped", [])
  out["summary"] = summarize(out)
  return out


def main(argv=None):
  """python -m benchmarks.accuracy.report RESULT.json [RESULT.json ...] --out PREFIX: merge and re-render.
  python -m benchmarks.accuracy.report --plots-only RESULT.json ...: redraw RESULT_*.png from the JSON alone
  (the committed plots: --plots-only benchmarks/results/accuracy_{cpu,cpu_4k,cpu_4k8k,cpu_4k_32prompts,
  4k8k_all,h200_partial}.json), leaving the JSON and the markdown as they are."""
  import argparse

  p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy.report")
  p.add_argument("inputs", nargs="+")
  p.add_argument("--out", default=None)
  p.add_argument("--plots-only", action="store_true", help="redraw each input's plots beside it; write nothing else")
  p.add_argument("--note", default=None, help="what the merged table is made of, shown first in its notes")
  a = p.parse_args(argv)
  if a.plots_only:
    for x in a.inputs:
      for path in plots(json.load(open(x)), os.path.splitext(x)[0]):
        print(f"wrote {path}")
    return
  if not a.out:
    p.error("--out is required (or --plots-only)")
  res = merge([json.load(open(x)) for x in a.inputs], note=a.note)
  for path in write_outputs(res, a.out):
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
