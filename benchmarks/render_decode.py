"""Renders benchmarks/decode.py JSON lines into a markdown table and plots.

  python -m benchmarks.render_decode benchmarks/results/decode_h200_2026-11-29.jsonl
writes <stem>.md and <stem>_latency.png, <stem>_throughput.png, <stem>_memory.png beside the input.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import rocketkv_jax as rk


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
  # Prefill against dense prefill of the same run (same process, same machine state); a run without a full
  # point at that context uses the median of the full prefills at that context over all runs.
  run, runs = -1, []
  for r in recs:
    run += r["kind"] == "header"
    runs.append(run)
  dense_run, dense_all = {}, defaultdict(list)
  for r, i in zip(recs, runs):
    if r["kind"] == "point" and not _budgeted(r) and r.get("prefill_s"):  # full KV
      dense_run.setdefault((i, r["context"]), r["prefill_s"])
      dense_all[r["context"]].append(r["prefill_s"])
  for r, i in zip(recs, runs):
    if r["kind"] == "point" and r.get("prefill_s"):
      alls = dense_all[r["context"]]
      ref = dense_run.get((i, r["context"])) or (statistics.median_high(alls) if alls else None)
      r["prefill_vs_dense"] = round(r["prefill_s"] / ref, 3) if ref else None
  headers = [r for r in recs if r["kind"] == "header"]
  lines = [f"# Decode benchmark: {header.get('model', '?')} on {header.get('device', '?')}", "",
           f"- date {header.get('date')}, jax {header.get('jax')}, copy bandwidth "
           f"{header.get('copy_bandwidth_GBps')} GB/s (read + write, measured in the same run), weights "
           f"{header.get('weight_bytes', 0) / 1e9:.2f} GB read per step",
           *[f"- command: `{h.get('command')}` ({h.get('date')}, copy {h.get('copy_bandwidth_GBps')} GB/s"
             + (f", code {h['code']}" if h.get("code") else "") + ")" + (f": {h['note']}" if h.get("note") else "")
             for h in headers], "",
           "| method | context | batch | ms/step | floor ms | x floor | tokens/s | cache GB | prefill s | prefill vs dense |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(points, key=_table_order):
    if r.get("status") != "ok":
      lines.append(f"| {_label(r)} | {r['context']} | {r.get('batch')} ({r.get('batch_spec', '')}) | "
                   f"{r.get('status')} | | | | | | |")
      continue
    lines.append(f"| {_label(r)} | {r['context']} | {r['batch']}{' (max)' if r.get('batch_spec') == 'max' else ''} "
                 f"| {r['ms_per_step']:.2f} | {r['floor_ms']:.2f} | {r['ratio_to_floor']:.2f} | {r['tokens_per_s']:.0f} "
                 f"| {r['cache_bytes'] / 1e9:.2f} | {r['prefill_s']:.2f} | {r.get('prefill_vs_dense')} |")
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
  _plots(points, peaks, stem)
  return md


def _plots(points, peaks, stem):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in points if r.get("status") == "ok"]
  fig, ax = plt.subplots(figsize=(6, 4))
  series = defaultdict(list)
  for r in ok:
    if r["batch"] == 1:
      series[_label(r)].append((r["context"], r["ms_per_step"]))
  for name, xy in sorted(series.items()):
    xy.sort()
    ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", label=name)
  ax.set(xscale="log", xlabel="context (tokens)", ylabel="ms per decode step (batch 1)", title="Decode latency")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(f"{stem}_latency.png", dpi=120)
  fig, ax = plt.subplots(figsize=(6, 4))
  series = defaultdict(list)
  ctx = max((r["context"] for r in ok if r["context"] <= 32768), default=None)
  for r in ok:
    if r["context"] == ctx:
      series[_label(r)].append((r["batch"], r["tokens_per_s"]))
  for name, xy in sorted(series.items()):
    xy.sort()
    ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", label=name)
  ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s", title=f"Throughput at {ctx} context")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(f"{stem}_throughput.png", dpi=120)
  good = [r for r in peaks if r.get("peak_bytes")]
  if good:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [f"{_label(r)}\n{r['context'] // 1024}k" for r in good]
    ax.bar(names, [r["peak_bytes"] / 1e9 for r in good])
    ax.set(ylabel="peak device memory (GB)", title="Peak memory, batch 1")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}_memory.png", dpi=120)
  plt.close("all")


if __name__ == "__main__":
  for p in sys.argv[1:]:
    print(render(p))
