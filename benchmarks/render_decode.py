"""Renders benchmarks/decode.py JSON lines into a markdown table and plots.

  python -m benchmarks.render_decode benchmarks/results/decode_h200_2026-12-02.jsonl
writes <stem>.md and <stem>_latency.png, <stem>_throughput.png, <stem>_memory.png beside the input (run from
the repository root: benchmarks are not installed); each input given is rendered on its own. That command made
the committed table and plots (benchmarks/results/grid_h200_2026-12-03/README.md).
Colours are benchmarks/plot_style.py's method -> colour map (shared with the accuracy plots); line style and
marker tell the budgets apart; the latency plot draws each series' bandwidth floor (the points' floor_ms).
"""
from __future__ import annotations

import json
from pathlib import Path

import rocketkv_jax as rk
from benchmarks.plot_style import budget_style, method_color, method_width, model_label, tokens_label


def _budgeted(r) -> bool:
  """Whether the record's method has a token budget (full KV's does not: its points have token_budget None)."""
  return r.get("token_budget") is not None and rk.get_method(r["method"]).budgeted


def _label(r):
  return f'{r["method"]} t={r["token_budget"]}' if _budgeted(r) else r["method"]


_METHOD_ORDER = ("full", "rocketkv", "snapkv", "quest")


def _table_order(r):
  """Context, then batch (1, 8, 32, max), then the budget (full with the first), then the methods side by
  side (full first)."""
  batch = float("inf") if r.get("batch_spec") == "max" else r.get("batch", 0)
  m = r["method"]
  budget = r["token_budget"] if _budgeted(r) else 0
  rank = _METHOD_ORDER.index(m) if m in _METHOD_ORDER else len(_METHOD_ORDER)
  return r["context"], batch, budget, rank, m


def render(path: str) -> str:
  recs = [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
  header = next((r for r in recs if r["kind"] == "header"), {})
  points = [r for r in recs if r["kind"] == "point"]
  peaks = [r for r in recs if r["kind"] == "peak"]
  # Prefill against dense prefill of the same run (same process, same machine state) only: prefill times move
  # between processes by more than the compression costs (a cross-run median once gave RocketKV 0.77 of dense
  # at 16k), so a run without a full point at that context gets none.
  run, runs = -1, []
  for r in recs:
    run += r["kind"] == "header"
    runs.append(run)
  dense_run = {}
  for r, i in zip(recs, runs):
    if r["kind"] == "point" and not _budgeted(r) and r.get("prefill_s"):  # full KV
      dense_run.setdefault((i, r["context"]), r["prefill_s"])
  for r, i in zip(recs, runs):
    if r["kind"] == "point" and r.get("prefill_s"):
      ref = dense_run.get((i, r["context"]))
      r["prefill_vs_dense"] = round(r["prefill_s"] / ref, 3) if ref else None
  headers = [r for r in recs if r["kind"] == "header"]
  lines = [f"# Decode benchmark: {header.get('model', '?')} on {header.get('device', '?')}", "",
           f"- date {header.get('date')}, jax {header.get('jax')}, copy bandwidth "
           f"{header.get('copy_bandwidth_GBps')} GB/s (read + write, measured in the same run), weights "
           f"{header.get('weight_bytes', 0) / 1e9:.2f} GB read per step",
           *[f"- {'run ' + str(i + 1) + ': ' if len(headers) > 1 else ''}command: `{h.get('command')}` "
             f"({h.get('date')}, copy {h.get('copy_bandwidth_GBps')} GB/s"
             + (f", code {h['code']}" if h.get("code") else "") + ")" + (f": {h['note']}" if h.get("note") else "")
             for i, h in enumerate(headers)], "",
           "| method | context | batch | ms/step | floor ms | x floor | tokens/s | cache GB | prefill s | prefill vs dense |"
           + (" run |" if len(headers) > 1 else ""),
           "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if len(headers) > 1 else "")]
  run_of = {id(r): i + 1 for r, i in zip(recs, runs)}
  for r in sorted(points, key=_table_order):
    run_col = f" {run_of[id(r)]} |" if len(headers) > 1 else ""
    if r.get("status") != "ok":
      lines.append(f"| {_label(r)} | {r['context']} | {r.get('batch')} ({r.get('batch_spec', '')}) | "
                   f"{r.get('status')} | | | | | | |" + run_col)
      continue
    lines.append(f"| {_label(r)} | {r['context']} | {r['batch']}{' (max)' if r.get('batch_spec') == 'max' else ''} "
                 f"| {r['ms_per_step']:.2f} | {r['floor_ms']:.2f} | {r['ratio_to_floor']:.2f} | {r['tokens_per_s']:.0f} "
                 f"| {r['cache_bytes'] / 1e9:.2f} | {r['prefill_s']:.2f} | {r.get('prefill_vs_dense')} |" + run_col)
  if peaks:
    lines += ["", "Peak device memory over prefill + decode, batch 1 (fresh process per point):", "",
              "| method | context | peak GB | weights GB | cache GB |", "|---|---|---|---|---|"]
    for r in peaks:
      if r.get("peak_bytes"):
        lines.append(f"| {_label(r)} | {r['context']} | {r['peak_bytes'] / 1e9:.1f} | "
                     f"{(r.get('weights_bytes') or 0) / 1e9:.1f} | {r['cache_bytes'] / 1e9:.2f} |")
      else:
        lines.append(f"| {r['point'] if 'point' in r else _label(r)} | | {r.get('status')} | | |")
  md = "\n".join(lines) + "\n"
  stem = Path(path).with_suffix("")
  Path(f"{stem}.md").write_text(md)
  _plots(points, peaks, stem, header)
  return md


def _plot_title(what: str, header: dict) -> str:
  """What the plot shows, then the model, that its weights are random (benchmarks/decode.py always uses random
  bf16 weights: decode speed does not depend on their values) and the GPU."""
  return (f"{what}\n{model_label(header.get('model', '?'))} (random bf16 weights), "
          f"{header.get('device', '?')}")


def _series_style(r, budgets):
  """Colour by method (the one method -> colour map of every plot); line style and marker by budget."""
  ls, marker = budget_style(r["token_budget"] if _budgeted(r) else None, budgets)
  return dict(color=method_color(r["method"]), ls=ls, marker=marker, lw=method_width(r["method"]))


def _plots(points, peaks, stem, header=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D
  from matplotlib.ticker import NullFormatter, NullLocator
  header = header or {}
  ok = [r for r in points if r.get("status") == "ok"]
  budgets = [r["token_budget"] for r in ok if _budgeted(r)]

  def series_of(rows, x_key, y_key):
    """label -> (style, sorted [(x, y, floor ms)])."""
    series = {}
    for r in sorted(rows, key=_table_order):
      style, xy = series.setdefault(_label(r), (_series_style(r, budgets), []))
      xy.append((r[x_key], r[y_key], r.get("floor_ms")))
    return {k: (style, sorted(xy)) for k, (style, xy) in series.items()}

  def context_ticks(ax, xs):
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs, [tokens_label(x) for x in xs])

  # Latency at batch 1 over context, each series with its bandwidth floor (floor_ms of the same points).
  fig, ax = plt.subplots(figsize=(7, 4.6))
  batch1 = [r for r in ok if r["batch"] == 1]
  for name, (style, xy) in series_of(batch1, "context", "ms_per_step").items():
    xs = [x for x, _, _ in xy]
    ax.plot(xs, [y for _, y, _ in xy], label=name, **style)
    floors = [f for _, _, f in xy]
    if all(f is not None for f in floors):
      ax.plot(xs, floors, color=style["color"], ls=":", lw=1.0, alpha=0.8)
  ax.set_xscale("log", base=2)
  context_ticks(ax, sorted({r["context"] for r in batch1}))
  ax.set(xlabel="context (tokens)", ylabel="ms per decode step, batch 1",
         title=_plot_title("Decode latency, batch 1", header))
  handles, labels = ax.get_legend_handles_labels()
  handles.append(Line2D([], [], color="0.3", ls=":", lw=1.0))
  labels.append("bandwidth floor (dotted, series' colour)")
  ax.legend(handles, labels, fontsize=7, loc="upper left")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(f"{stem}_latency.png", dpi=120)

  # Throughput over batch at the largest context <= 32k.
  fig, ax = plt.subplots(figsize=(7, 4.6))
  ctx = max((r["context"] for r in ok if r["context"] <= 32768), default=None)
  at_ctx = [r for r in ok if r["context"] == ctx]
  for name, (style, xy) in series_of(at_ctx, "batch", "tokens_per_s").items():
    ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], label=name, **style)
  for r in at_ctx:  # the largest batch that fits, where the run searched for it
    if r.get("batch_spec") == "max":
      ax.annotate(f"max {r['batch']}", (r["batch"], r["tokens_per_s"]), textcoords="offset points", xytext=(4, -10),
                  fontsize=6, color=method_color(r["method"]))
  ax.set(xscale="log", yscale="log", xlabel="batch ('max': the largest batch that fits)",
         ylabel="decode tokens/s",
         title=_plot_title(f"Decode throughput at {tokens_label(ctx) if ctx else '?'} context", header))
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  fig.savefig(f"{stem}_throughput.png", dpi=120)

  good = [r for r in peaks if r.get("peak_bytes")]
  if good:
    fig, ax = plt.subplots(figsize=(6, 4.2))
    names = [f"{_label(r)}\n{tokens_label(r['context'])}" for r in good]
    ax.bar(names, [r["peak_bytes"] / 1e9 for r in good], color=[method_color(r["method"]) for r in good])
    ax.set(ylabel="peak device memory (GB)", title=_plot_title("Peak memory over prefill + decode, batch 1", header))
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}_memory.png", dpi=120)
  plt.close("all")


def main(argv=None):
  import argparse
  ap = argparse.ArgumentParser(prog="python -m benchmarks.render_decode", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("jsonl", nargs="+", help="benchmarks/decode.py output files, each rendered on its own")
  for p in ap.parse_args(argv).jsonl:
    print(render(p))


if __name__ == "__main__":
  main()
