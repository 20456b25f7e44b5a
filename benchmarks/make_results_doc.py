"""Writes docs/RESULTS.md, the project's current figures, from the current result files under benchmarks/results/.

  python -m benchmarks.make_results_doc            # rewrite docs/RESULTS.md
  python -m benchmarks.make_results_doc --check    # exit 1 when docs/RESULTS.md differs from what this writes

Every table is read from one result file (JSON lines written by benchmarks/decode.py and benchmarks/serve.py, or the
markdown that benchmarks/accuracy/report.py and benchmarks/stage2_table.py render from their cells), and each
section names that file, with the date, the device and the command the file records. Which files are current, and
what replaced the archived ones, is benchmarks/results/README.md. To publish a new run: put its file under
benchmarks/results/, point SOURCES below at it, run this module, and commit both (tests/test_results_doc.py fails
while docs/RESULTS.md and the files disagree). Standard library only, no JAX: it runs in well under a second.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import sys

__all__ = ["ROOT", "OUT", "SOURCES", "render", "main"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "RESULTS.md"
RESULTS = "benchmarks/results"

# The current file of every figure (paths relative to the repository root).
SOURCES = {
  "decode": f"{RESULTS}/decode_h200_2026-12-02.jsonl",
  "decode_md": f"{RESULTS}/decode_h200_2026-12-02.md",
  "engine_shapes": f"{RESULTS}/plans_h200_2026-12-03/engine_shapes.jsonl",
  "stage2": f"{RESULTS}/stage2_per_layer_h200_2026-12-02g.md",
  "serve": f"{RESULTS}/serve_h200_2026-12-01/serve_final_c3a6f19.jsonl",
  "turn2": f"{RESULTS}/serve_h200_2026-12-01/serve_1_8_turn2_8d47ebb.jsonl",
  "acc_qwen": f"{RESULTS}/accuracy_qwen_h200_2026-12-04/qwen15.md",
  "acc_smol_same_grid": f"{RESULTS}/accuracy_qwen_h200_2026-12-04/smollm2.md",
  "acc_smol_grid": f"{RESULTS}/accuracy_h200_2026-12-01.md",
  "load_memory": f"{RESULTS}/load_memory_cpu_2026-12-01.jsonl",
  "prefill_memory": f"{RESULTS}/prefill_memory_h200_2026-12-01.txt",
  "fp8_decode": f"{RESULTS}/h200_2026-12-05/decode_fp8_32k.jsonl",
  "serve_max": f"{RESULTS}/h200_2026-12-05/serve32max.jsonl",
  "turn2_device": f"{RESULTS}/h200_2026-12-05/serve_turn2dev_arrive.jsonl",
  "prefill_flops": f"{RESULTS}/h200_2026-12-05/prefill_flops.jsonl",
  "fp8_accuracy": f"{RESULTS}/fp8_centred_qwen_h100_2026-12-06/qwen_fp8c.md",
  "fp8_accuracy_smol": f"{RESULTS}/fp8_centred_cpu_2026-12-06/smol_fp8c_2k.md",
  "h100_fp8kt": f"{RESULTS}/h100_2026-12-05/decode_fp8kt_32k.jsonl",
  "h100_arrive": f"{RESULTS}/h100_2026-12-05/serve_arrive_cost_chunks.jsonl",
  "h100_arrive_uniform": f"{RESULTS}/h100_2026-12-05/serve_arrive_uniform_chunks_33bc5aa.jsonl",
  "h100_serve_max": f"{RESULTS}/h100_2026-12-05/serve32max_fp8kt_bf16.jsonl",
  "serve_load": f"{RESULTS}/serve_load_h100_2026-12-06/serve_load.jsonl",
  # the later run: doc-qa with the history's device tier and a 128 bucket, chat (serve_load_section reads both)
  "serve_load_b": f"{RESULTS}/serve_load_h100_2026-12-06b/serve_load.jsonl",
  # the third: doc-qa and chat after a question's admission was made 2.6x cheaper (a38c9ac), and that admission
  # itself before and after (benchmarks/admission.py)
  "serve_load_c": f"{RESULTS}/serve_load_h100_2026-12-06c/serve_load.jsonl",
  "admission": f"{RESULTS}/serve_load_h100_2026-12-06c/admission.jsonl",
  "admission_before": f"{RESULTS}/serve_load_h100_2026-12-06c/admission_before.jsonl",
  # where a decode step's time goes, bf16 against FP8 K/V (run 2 of that folder), and the append's parts
  "step_profile_bf16": f"{RESULTS}/fp8_profile_h100_2026-12-06/prof_bf16_run2.jsonl",
  "step_profile_fp8": f"{RESULTS}/fp8_profile_h100_2026-12-06/prof_fp8_run2.jsonl",
  "append_cost": f"{RESULTS}/fp8_profile_h100_2026-12-06/append_cost.jsonl",
}

METHOD_ORDER = ("full", "rocketkv", "rocketkv_plus", "snapkv", "quest", "sparq", "streaming_llm", "h2o", "hsa",
                "exact_topk")
# How a method's spec reads in a table; the 2026-12-01 grid ran rocketkv_plus as its spec (the same config).
ACC_LABELS = {
  "full": "full KV", "rocketkv": "RocketKV (the paper's)", "rocketkv_plus": "rocketkv_plus",
  "rocketkv[plan_page_size=2,hsa_recent_tokens=8]": "rocketkv_plus",
  "rocketkv[hsa_recent_tokens=8]": "RocketKV + recent 8 only", "snapkv": "SnapKV", "quest": "Quest",
  "sparq": "SparQ", "streaming_llm": "StreamingLLM", "h2o": "H2O", "hsa": "HSA (stage 2 alone)",
  "exact_topk": "Exact-TopK (oracle)",
}
ACC_ROW_ORDER = ("full", "rocketkv", "rocketkv_plus", "rocketkv[plan_page_size=2,hsa_recent_tokens=8]",
                 "rocketkv[hsa_recent_tokens=8]", "exact_topk", "snapkv", "quest", "sparq", "streaming_llm", "h2o",
                 "hsa")


def _read(rel: str) -> str:
  return (ROOT / rel).read_text()


def _jsonl(rel: str) -> list[dict]:
  return [json.loads(line) for line in _read(rel).splitlines() if line.strip()]


def _link(rel: str) -> str:
  """A link from docs/RESULTS.md to a file under the repository root."""
  return f"[`{rel}`](../{rel})"


def _ctx(n: int) -> str:
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  out += ["| " + " | ".join(r) + " |" for r in rows]
  return out


# ---------------------------------------------------------------------------------------------------- decode


def _decode_runs(rel: str):
  """(headers, points, peaks): each point carries the index of the run (header) it follows in the file."""
  headers, points, peaks = [], [], []
  for rec in _jsonl(rel):
    if rec["kind"] == "header":
      headers.append(rec)
    elif rec["kind"] == "point":
      points.append(dict(rec, run=len(headers)))
    elif rec["kind"] == "peak":
      peaks.append(dict(rec, run=len(headers)))
  return headers, points, peaks


def _plot(rel: str, what: str) -> str:
  """The plot benchmarks/render_decode.py draws beside a result file (checked to exist)."""
  path = rel.rsplit(".", 1)[0] + f"_{what}.png"
  if not (ROOT / path).is_file():
    raise FileNotFoundError(path)
  return path


def _decode_label(p) -> str:
  return p["method"] if p["token_budget"] is None else f"{p['method']} t={p['token_budget']}"


def _decode_key(label: str):
  m, _, t = label.partition(" t=")
  return (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, int(t or 0))


def decode_section() -> list[str]:
  rel = SOURCES["decode"]
  headers, points, peaks = _decode_runs(rel)
  contexts = sorted({p["context"] for p in points})
  labels = sorted({_decode_label(p) for p in points}, key=_decode_key)
  by = {(_decode_label(p), p["context"], p["batch_spec"]): p for p in points}
  codes = sorted({h.get("code", "?") for h in headers})
  bws = [h["copy_bandwidth_GBps"] for h in headers]
  out = [
    "## Decode speed: Llama-3.1-8B shape on one H200",
    "",
    f"Source: {_link(rel)} (rendered with its plots as {_link(SOURCES['decode_md'])} by "
    f"`python -m benchmarks.render_decode {rel}`). Device: {headers[0]['device']}, jax {headers[0]['jax']}; "
    f"{len(headers)} runs, code {', '.join(f'`{c}`' for c in codes)}; copy bandwidth {min(bws):.0f}-{max(bws):.0f} GB/s "
    "across the runs.",
    "",
    "Random bf16 weights, a real prefill of random-token prompts, then the whole model's decode step timed as "
    "jitted chunks of 8 greedy steps (median over 64 steps). Floor = (weight bytes + the KV/KT/index bytes the "
    "method must read) / the device-to-device copy bandwidth measured in the same run; a ratio moves with its "
    "run's bandwidth, the ms are the firmer figure.",
    "",
    "Runs (one per header record of the file):",
    "",
  ]
  for i, h in enumerate(headers, 1):
    note = f"; {h['note']}" if h.get("note") else ""
    out.append(f"{i}. {h['date']}, code `{h.get('code', '?')}`, copy {h['copy_bandwidth_GBps']} GB/s: "
               f"`{h['command']}`{note}")
  out.append("")

  def cell(label, ctx, spec, largest=False):
    p = by.get((label, ctx, spec))
    if p is None:
      return "-"
    if p["status"] != "ok":
      return f"does not fit ({p['cache_bytes'] / 1e9:.0f} GB of caches)"
    if largest:
      return f"{p['batch']}, {p['ms_per_step']:.2f} ({p['ratio_to_floor']:.2f}x), {p['tokens_per_s']:,.0f}"
    return f"{p['ms_per_step']:.2f} ({p['ratio_to_floor']:.2f}x)"

  for spec, title in (("1", "batch 1, ms/step (x floor)"), ("8", "batch 8, ms/step (x floor)"),
                      ("32", "batch 32, ms/step (x floor)"),
                      ("max", "largest batch that fits: batch, ms/step (x floor), tokens/s")):
    rows = [[label] + [cell(label, c, spec, spec == "max") for c in contexts] for label in labels]
    full, rk = by, "rocketkv t=256"
    ratio = []
    for c in contexts:
      f, r = full.get(("full", c, spec)), full.get((rk, c, spec))
      if f and r and f["status"] == r["status"] == "ok":
        ratio.append(f"{f['ms_per_step'] / r['ms_per_step']:.2f}x" if spec != "max"
                     else f"{r['tokens_per_s'] / f['tokens_per_s']:.1f}x")
      else:
        ratio.append("-")
    rows.insert(labels.index(rk) + 1, ["RocketKV t=256 over full" + (" (tokens/s)" if spec == "max" else "")] + ratio)
    out += _table([title] + [_ctx(c) for c in contexts], rows) + [""]
    if spec == "1":
      out += [f"![decode latency](../{_plot(rel, 'latency')})", ""]
    if spec == "max":
      out += [f"![decode throughput](../{_plot(rel, 'throughput')})", ""]

  if peaks:
    out += ["Peak device memory over prefill + decode, batch 1, each point in a fresh process (`--peak`):", ""]
    rows = []
    unbudgeted = {p["method"] for p in points if p["token_budget"] is None}  # their peak records carry a t anyway
    for p in sorted(peaks, key=lambda p: _decode_key(p["method"])):
      h = headers[p["run"] - 1]
      rows.append([p["method"] if p["method"] in unbudgeted else f"{p['method']} t={p['token_budget']}", _ctx(p["context"]),
                   f"{p['peak_bytes'] / 1e9:.1f}", f"{p['weights_bytes'] / 1e9:.1f}", f"{p['cache_bytes'] / 1e9:.2f}",
                   f"{p['run']} (`{h.get('code', '?')}`)"])
    out += _table(["method", "context", "peak GB", "weights GB", "cache GB", "run"], rows)
    by_method = {p["method"]: p for p in peaks}
    full, rk = by_method.get("full"), by_method.get("rocketkv")
    if full and rk:
      out += ["", f"RocketKV's peak is {100 * (1 - rk['peak_bytes'] / full['peak_bytes']):.1f}% lower than full KV's."]
    out.append("")
  return out


def engine_shapes_section() -> list[str]:
  rel = SOURCES["engine_shapes"]
  recs = _jsonl(rel)
  h = next(r for r in recs if r["kind"] == "header")
  rows = [[r["label"], str(r["batch"]), f"{r['ms_per_step']:.3f}", f"{r['ratio_to_floor']:.2f}x",
           f"{r['tokens_per_s']:,.0f}", re.search(r"topr=(\d+)", r["config"]).group(1), str(r["capacity"])]
          for r in recs if r["kind"] == "mixed"]
  return [
    "### Per-request plans under an engine's static config",
    "",
    f"Source: {_link(rel)}. {h['device']}, jax {h['jax']}, {h['date']}, copy {h['copy_bandwidth_GBps']} GB/s; "
    f"`{h['command']}`. Each row runs the 32k plan as data; the engine compiles for the maxima of every plan its "
    "limits allow (`plan_limits`), so its static top-r is 128 where a 32k request uses 60 channels.",
    "",
    *_table(["rocketkv t=256, 32k rows", "batch", "ms/step", "x floor", "tokens/s", "static top-r", "capacity"], rows),
    "",
  ]


# ---------------------------------------------------------------------------------------------------- markdown


def _md_section(text: str, heading: str) -> list[str]:
  """The lines under `heading` (exact line) up to the next heading of the same or a higher level."""
  lines = text.splitlines()
  start = lines.index(heading)
  level = len(heading) - len(heading.lstrip("#"))
  out = []
  for line in lines[start + 1:]:
    m = re.match(r"(#+) ", line)
    if m and len(m.group(1)) <= level:
      break
    out.append(line)
  while out and not out[-1].strip():
    out.pop()
  while out and not out[0].strip():
    out.pop(0)
  return out


def _tables_in(lines: list[str]) -> list[list[str]]:
  tables, cur = [], []
  for line in lines + [""]:
    if line.startswith("|"):
      cur.append(line)
    elif cur:
      tables.append(cur)
      cur = []
  return tables


def _split_row(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def stage2_section() -> list[str]:
  rel = SOURCES["stage2"]
  text = _read(rel)
  lines = text.splitlines()
  regen = next(line for line in lines if line.startswith("Regenerate"))
  shape = next(line for line in lines if line.startswith("Shape:"))
  tables = _tables_in(lines)
  # The table's own input (named in its Regenerate line) records the run's date, device and command.
  src = re.search(r"stage2_table (\S+\.jsonl)", regen).group(1)
  run = next(r for r in _jsonl(src) if r.get("kind") == "ceiling")
  return [
    "### RocketKV's stage 2 per layer against its bytes (32k, t=256)",
    "",
    f"Source: {_link(rel)}, from {_link(src)} ({run['device']}, jax {run['jax']}, {run['date']}, copy "
    f"{run['copy_GBps']:.0f} GB/s: `{run['command']}`). {regen} {shape} Per layer, microseconds of GPU kernels per "
    "call from a profiler trace; floor = the bytes the kernel must move at the copy bandwidth measured in the same "
    "run; x = us / floor.",
    "",
    *tables[0],
    "",
    "The HSA scoring kernel alone, in the layout `auto` picks:",
    "",
    *tables[1],
    "",
  ]


# ---------------------------------------------------------------------------------------------------- serving


def serve_section() -> list[str]:
  rel, rel2 = SOURCES["serve"], SOURCES["turn2"]
  recs = [r for r in _jsonl(rel) if r.get("kind") == "serve" and r.get("status") == "ok" and "slots" in r]
  runs = []
  for r in recs:
    key = (r["date"], " ".join(r["argv"]))
    if key not in runs:
      runs.append(key)
  rows = []
  for r in sorted(recs, key=lambda r: (METHOD_ORDER.index(r["method"]), r["slots"])):
    slots = f"{r['slots']} (most that fit)" if r["slots_spec"] == "max" else str(r["slots"])
    rows.append([r["method"], slots, f"{r['steady_tokens_per_s']:,.0f}",
                 f"{r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f}", f"{r['engine_step_ms']:.2f}",
                 f"{r['decode_step_ms']:.2f}", f"{r['floor_ms']:.2f}", f"{r['ttft_ms_p50'] / 1000:.2f}",
                 r["admission"]])
  t2 = [r for r in _jsonl(rel2) if r.get("part") == "turn2"]
  now = next(r for r in _jsonl(SOURCES["serve_max"]) if r.get("status") == "ok" and not r.get("kv_cache_dtype"))
  first = recs[0]
  out = [
    "## Serving on one H200 (Llama-3.1-8B shape, 32k-token prompts, 128 new tokens, t=256)",
    "",
    f"Source: {_link(rel)} ({first['device']}, jax {first['jax']}; the file's `commit` field is the device copy's "
    "stale `.git`: the code is `c3a6f19`, named in the file name). Runs:",
    "",
  ]
  out += [f"- {date}: `{argv}`" for date, argv in runs]
  out += [
    "",
    "Steady = decode steps with every slot busy; engine step = a steady step's wall time per token; "
    "decode-benchmark step = `benchmarks/decode.py`'s loop on the same caches in the same process (it waits for "
    "each chunk; the pipelined engine does not). `admission: shared` admits the largest batch's requests by "
    "inserting one shared prefill. The RocketKV row at the most slots predates the stage-2 kernels of 2026-12-02: "
    f"the current one ({now['steady_tokens_per_s']:,.0f} tokens/s at {now['slots']} slots) is in the FP8 section "
    "below.",
    "",
    *_table(["method", "slots", "steady tokens/s", "TPOT p50 / p99 (ms)", "engine step (ms)",
             "decode-benchmark step (ms)", "floor (ms)", "TTFT p50 (s)", "admission"], rows),
    "",
    f"Second turn over the stored history (rocketkv, 32k first turn): {_link(rel2)}, {t2[0]['date']}, "
    f"`{' '.join(t2[0]['argv'])}` (code `8d47ebb`). The first turn's prefill took {t2[0]['turn1_prefill_s']:.2f} s "
    "(its K/V copied to host memory).",
    "",
    *_table(["new tokens", "second-turn prefill (s)", "re-prefill of the whole prompt (s)", "speed-up"],
            [[f"{r['new_tokens']:,}", f"{r['turn2_prefill_s']:.2f}", f"{r['reprefill_s']:.2f}", f"{r['speedup']:.2f}x"]
             for r in t2]),
    "",
  ]
  return out


# ---------------------------------------------------------------------------------------------------- accuracy


def _parse_accuracy_md(rel: str):
  """(meta lines, {context: {"full": {mode: cell}, "acc": {method: {column: cell}}, "rel": {...}}}, variant bullets)."""
  text = _read(rel)
  lines = text.splitlines()
  meta = [line for line in lines[:12] if line.startswith("- ")]
  contexts = {}
  for line in lines:
    m = re.match(r"## Context (\d+) tokens$", line)
    if not m:
      continue
    sec = _md_section(text, line)
    full = {}
    for s in sec:
      f = re.match(r"Full KV task accuracy, (\w+): \*\*(.+?)\*\*", s)
      if f:
        full[f.group(1)] = f.group(2)
    got = {"full": full}
    for key, heading in (("acc", "### Task accuracy (mean over tasks), 95% CI"),
                         ("rel", "### Task accuracy relative to full KV on the same prompts, paired-bootstrap 95% CI")):
      table = _tables_in(_md_section("\n".join(sec), heading))[0]
      cols = _split_row(table[0])[1:]
      got[key] = {r[0]: dict(zip(cols, r[1:])) for r in map(_split_row, table[2:])}
    contexts[int(m.group(1))] = got
  variants = [line for line in _md_section(text, "## Variants against their base method (same prompts, paired)")
              if line.startswith("- **")]
  return meta, contexts, variants


def _accuracy_pivot(contexts, t: int, mode: str, title: str) -> list[str]:
  col = f"t={t} {mode}"
  ctxs = sorted(contexts)
  methods = {m for c in ctxs for m in contexts[c]["acc"]}
  rows = [["full KV"] + [contexts[c]["full"].get(mode, "-") for c in ctxs]]
  for m in sorted(methods, key=lambda m: ACC_ROW_ORDER.index(m) if m in ACC_ROW_ORDER else 99):
    cells = []
    for c in ctxs:
      acc = contexts[c]["acc"].get(m, {}).get(col, "-")
      rel = contexts[c]["rel"].get(m, {}).get(col, "")
      cells.append(f"{acc} ({rel.split(' ')[0]})" if rel else acc)
    rows.append([ACC_LABELS.get(m, m)] + cells)
  return _table([f"{title}, t={t}, {mode}: accuracy [95% CI] (rel. to full)"] + [_ctx(c) for c in ctxs], rows)


def _meta_lines(meta: list[str]) -> list[str]:
  return [line for line in meta if not line.startswith("- intervals")]


def accuracy_section() -> list[str]:
  out = [
    "## Accuracy",
    "",
    "The accuracy suite (`benchmarks/accuracy/`, also `rocketkv eval`): RULER-style retrieval tasks (passkey, "
    "multi-key with distractors, multi-value, variable tracking; exact match) over public-domain prose, in two "
    "modes: *aware* (the question inside stage 1's window, as in the paper's benchmarks) and *agnostic* (the "
    "context compressed before the question is known, the question fed through the method's decode steps). "
    "95% percentile bootstrap intervals; relative accuracy is paired with full KV on the same prompts. Per-task "
    "tables, fidelity (top-1, KL), attention mass and plots are in each source file.",
    "",
  ]
  for key, title, short, budgets in (
      ("acc_qwen", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (head_dim 128), one H200, 2026-12-04", "Qwen2.5-Coder-1.5B",
       ((256, "aware"), (128, "aware"), (256, "agnostic"))),
      ("acc_smol_same_grid", "SmolLM2-135M (head_dim 64) on the same grid and code, one H200, 2026-12-04",
       "SmolLM2-135M", ((256, "aware"), (128, "aware"))),
      ("acc_smol_grid", "SmolLM2-135M: the full grid, every method, t = 64-512, one H200, 2026-12-01",
       "SmolLM2-135M", ((256, "aware"), (256, "agnostic"), (128, "aware"), (64, "aware"), (512, "aware")))):
    rel = SOURCES[key]
    meta, contexts, variants = _parse_accuracy_md(rel)
    out += [f"### {title}", "", f"Source: {_link(rel)}.", ""] + _meta_lines(meta) + [""]
    tasks_png = rel[:-3] + "_tasks.png"
    if (ROOT / tasks_png).is_file():
      out += [f"![task accuracy](../{tasks_png})", ""]
    for t, mode in budgets:
      out += _accuracy_pivot(contexts, t, mode, short) + [""]
    if variants:
      out += ["Registered variants against their base method on the same prompts (paired bootstrap; the "
              "registration rule is in docs/ALGORITHM.md, \"Extension\"):", ""] + variants + [""]
  return out


# ---------------------------------------------------------------------------------------------------- memory


def memory_section() -> list[str]:
  rel, rel2 = SOURCES["load_memory"], SOURCES["prefill_memory"]
  rows = []
  for r in _jsonl(rel):
    rows.append([r["device"], str(r["layers"]), r["dtype"], f"{r['checkpoint_bytes'] / 2**30:.1f}",
                 f"{r['peak_rss'] / 2**30:.1f}", f"{r['overhead_bytes'] / 2**30:.2f}",
                 f"{r['largest_tensor_bytes'] / 2**30:.2f}", f"{r['load_s']:.0f}"])
  r0 = _jsonl(rel)[0]
  pm = _read(rel2).splitlines()
  return [
    "## Memory",
    "",
    "### Loading a Llama-3.1-8B-shaped bf16 safetensors checkpoint (host memory)",
    "",
    f"Source: {_link(rel)}, {r0['date']}: `{' '.join(r0['argv'])}`. Safetensors stream tensor by tensor to the "
    "device in the target dtype; on a CPU the weights themselves live in host memory.",
    "",
    *_table(["device", "layers", "dtype", "checkpoint GiB", "peak RSS GiB", "beyond the weights GiB",
             "largest tensor GiB", "load s"], rows),
    "",
    "### Prefill's temporary memory at 128k, compile-only (why prefill runs each layer's MLP in unrolled chunks)",
    "",
    f"Source: {_link(rel2)}.",
    "",
    "```",
    *pm,
    "```",
    "",
  ]


# ---------------------------------------------------------------------------------------------------- page


# ---------------------------------------------------------------------------------------------------- FP8 K/V


def _dtype(rec) -> str:
  return rec.get("kv_cache_dtype") or "bf16"


def fp8_section() -> list[str]:
  rel, rel_s = SOURCES["fp8_decode"], SOURCES["serve_max"]
  _, points, _ = _decode_runs(rel)
  ok = [p for p in points if p["status"] == "ok"]
  by = {(p["method"], p["batch_spec"], _dtype(p)): p for p in ok}
  rows = []
  for method in sorted({p["method"] for p in ok}, key=METHOD_ORDER.index):
    for spec in ("1", "8", "32", "max"):
      pair = [by.get((method, spec, d)) for d in ("bf16", "float8_e4m3fn")]
      if None in pair:
        continue
      b, f = pair
      label = "largest" if spec == "max" else spec
      batches = f"{b['batch']} / {f['batch']}"
      rows.append([method, label, batches, f"{b['ms_per_step']:.3f}", f"{f['ms_per_step']:.3f}",
                   f"{b['tokens_per_s']:,.0f}", f"{f['tokens_per_s']:,.0f}",
                   f"{b['cache_bytes'] / b['batch'] / 1e6:,.0f} / {f['cache_bytes'] / f['batch'] / 1e6:,.0f}"])
  serve = [r for r in _jsonl(rel_s) if r.get("kind") == "serve" and r.get("status") == "ok"]
  srows = [[_dtype(r), str(r["slots"]), f"{r['steady_tokens_per_s']:,.0f}",
            f"{r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f}", f"{r['engine_step_ms']:.2f}",
            f"{r['decode_step_ms']:.2f}", f"{r['engine_vs_decode']:.3f}"] for r in serve]
  out = [
    "## FP8 K/V and serving at the most slots: one H200, 32k, t=256 (2026-12-05)",
    "",
    f"Source: {_link(rel)} and {_link(rel_s)} (commands, code and the reading against issue 40's targets: "
    f"{_link(rel.rsplit('/', 1)[0] + '/README.md')}). K/V stored as `float8_e4m3fn` with per-(sequence, KV head) "
    "scales (docs/ALGORITHM.md, \"Extension: FP8 K/V storage\") against the model's bf16.",
    "",
    *_table(["method", "batch", "batch bf16 / FP8", "bf16 ms / step", "FP8 ms / step", "bf16 tokens/s",
             "FP8 tokens/s", "cache MB per sequence bf16 / FP8"], rows),
    "",
    "The serving engine at the most slots that fit (RocketKV, one shared 32k prefill, 128 new tokens); the engine "
    "step against `benchmarks/decode.py`'s on the same caches in the same process:",
    "",
    *_table(["K/V", "slots", "steady tokens/s", "TPOT p50 / p99 (ms)", "engine step (ms)",
             "decode-benchmark step (ms)", "engine / decode"], srows),
    "",
  ]
  return out


def fp8_accuracy_section() -> list[str]:
  title = "Accuracy with FP8 K/V, keys centred: Qwen2.5-Coder-1.5B (one H100) and SmolLM2-135M (CPU), 2026-12-06"
  out = [f"## {title}",
         "", "K/V in float8_e4m3fn with the keys centred on their prompt mean (docs/ALGORITHM.md, \"Extension: FP8 "
         "K/V storage\") against the model's dtype, on the same prompts; the variants' paired differences are in "
         "each source's \"Variants against their base method\".", ""]
  for key, name in (("fp8_accuracy", "Qwen2.5-Coder-1.5B-Instruct, bf16 weights, one H100"),
                    ("fp8_accuracy_smol", "SmolLM2-135M-Instruct, float32, CPU")):
    rel = SOURCES[key]
    lines = _read(rel).splitlines()
    meta = [line for line in lines if line.startswith("- ")][:4]
    heading = next(line for line in lines if line.startswith("## Headline"))
    out += [f"### {name}", "", f"Source: {_link(rel)}.", "", *_meta_lines(meta), "",
            *_md_section(_read(rel), heading), ""]
  return out


# ---------------------------------------------------------------------------------------------------- issue 37


def turn2_prefill_section() -> list[str]:
  rel, rel_p = SOURCES["turn2_device"], SOURCES["prefill_flops"]
  recs = _jsonl(rel)
  t2 = [r for r in recs if r.get("part") == "turn2"]
  arrive = [r for r in recs if r.get("arrival_s")]
  pf = [r for r in _jsonl(rel_p) if r.get("kind") == "prefill_flops" and r.get("status") == "ok"]
  return [
    "## Second turns, arrivals and prefill FLOP/s: one H200 (2026-12-05)",
    "",
    f"Source: {_link(rel)} and {_link(rel_p)} (commands: {_link(rel.rsplit('/', 1)[0] + '/README.md')}). "
    f"Second turn over a stored 32k history with the history's device tier "
    f"(`python -m benchmarks.serve {shlex.join(t2[0]['argv'][5:])}`):",
    "",
    *_table(["new tokens", "second-turn prefill (s)", "re-prefill of the whole prompt (s)", "speed-up"],
            [[f"{r['new_tokens']:,}", f"{r['turn2_prefill_s']:.3f}", f"{r['reprefill_s']:.2f}",
              f"{r['speedup']:.2f}x"] for r in t2]),
    "",
    f"New 32k prompts arriving every {arrive[0]['arrival_s']} s at {arrive[0]['slots']} slots "
    f"({arrive[0]['requests']} requests, {arrive[0]['max_new_tokens']} new tokens each, RocketKV):",
    "",
    *_table(["prefill chunk tokens (0: whole)", "tokens/s", "TPOT p50 / p99 (ms)", "TTFT p50 / p99 (s)"],
            [[str(r["prefill_chunk_tokens"]), f"{r['tokens_per_s']:.0f}",
              f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
              f"{r['ttft_ms_p50'] / 1000:.2f} / {r['ttft_ms_p99'] / 1000:.2f}"] for r in arrive]),
    "",
    f"Prefill FLOP/s against a bf16 matmul measured in the same process ({pf[0]['matmul_tflops']:.1f} TFLOP/s):",
    "",
    *_table(["context", "prefill (s)", "TFLOP/s", "of the matmul", f"chunks of {pf[0]['chunk_tokens']}: s",
             "chunked / whole"],
            [[_ctx(r["context"]), f"{r['prefill_s']:.3f}", f"{r['tflops']:.0f}", f"{r['of_matmul']:.2f}",
              f"{r['chunked_prefill_s']:.3f}", f"{r['chunked_of_whole']:.2f}"] for r in pf]),
    "",
  ]


# ---------------------------------------------------------------------------------------------------- H100


def h100_section() -> list[str]:
  rel, rel_a, rel_u, rel_s = (SOURCES[k] for k in ("h100_fp8kt", "h100_arrive", "h100_arrive_uniform",
                                                   "h100_serve_max"))
  _, points, _ = _decode_runs(rel)
  ok = [p for p in points if p["status"] == "ok"]
  storage = lambda p: (p.get("kv_cache_dtype") or "", p.get("kt_cache_dtype") or "")  # noqa: E731
  rows = []
  for method, key in sorted({(p["method"], storage(p)) for p in ok}, key=lambda mk: (METHOD_ORDER.index(mk[0]), mk[1])):
    pts = [p for p in ok if p["method"] == method and storage(p) == key]
    big = max(pts, key=lambda p: (p["batch_spec"] == "max", p["batch"]))
    small = {p["batch_spec"]: p for p in pts if p["batch_spec"] in ("1", "8")}
    kt = "" if big.get("token_budget") is None else key[1] or "keys' dtype (bf16)"
    rows.append([method, key[0] or "bf16", kt, f"{big['cache_bytes'] / big['batch'] / 1e6:.1f}",
                 *[f"{small[b]['ms_per_step']:.3f}" if b in small else "" for b in ("1", "8")],
                 str(big["batch"]), f"{big['ms_per_step']:.3f}", f"{big['tokens_per_s']:,.0f}"])
  arrive = [("by cost (`chunk_sizes`)", r) for r in _jsonl(rel_a)] + [("uniform (earlier code)", r)
                                                                       for r in _jsonl(rel_u)]
  arows = [[how if r["prefill_chunk_tokens"] else "whole prefills", str(r["prefill_chunk_tokens"]),
            f"{r['tokens_per_s']:.1f}", f"{r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f}",
            f"{r['tpot_ms_p99'] / r['tpot_ms_p50']:.2f}",
            f"{r['ttft_ms_p50'] / 1000:.2f} / {r['ttft_ms_p99'] / 1000:.2f}"] for how, r in arrive]
  serve = [r for r in _jsonl(rel_s) if r.get("kind") == "serve" and r.get("status") == "ok"]
  srows = [[_dtype(r), str(r["slots"]), f"{r['steady_tokens_per_s']:,.0f}", f"{r['engine_step_ms']:.2f}",
            f"{r['decode_step_ms']:.2f}", f"{r['engine_vs_decode']:.3f}"] for r in serve]
  a0 = arrive[0][1]
  return [
    "## One H100 (2026-12-05): FP8 K/V with FP8 page summaries, chunked prefill under arrivals",
    "",
    f"Sources: {_link(rel)}, {_link(rel_a)}, {_link(rel_u)}, {_link(rel_s)} (commands and code: "
    f"{_link(rel.rsplit('/', 1)[0] + '/README.md')}). The device tool lent an H100 80GB, not an H200: every "
    "baseline here was rerun on it; compare within this section only. 32k, t=256 (decode grid):",
    "",
    *_table(["method", "K/V", "KT pages", "MB per sequence", "batch 1 ms", "batch 8 ms", "largest batch", "its ms / step",
             "tokens/s"], rows),
    "",
    f"New 32k prompts arriving every {a0['arrival_s']} s at {a0['slots']} slots ({a0['requests']} requests, "
    f"{a0['max_new_tokens']} new tokens each), by how a long prompt's prefill is chunked:",
    "",
    *_table(["chunks", "prefill chunk tokens", "tokens/s", "TPOT p50 / p99 (ms)", "p99 / p50",
             "TTFT p50 / p99 (s)"], arows),
    "",
    "The serving engine at the most slots that fit (one shared 32k prefill, 128 new tokens; FP8 K/V with its page "
    "summaries in float8_e5m2, the FP8 default since this run):",
    "",
    *_table(["K/V", "slots", "steady tokens/s", "engine step (ms)", "decode-benchmark step (ms)",
             "engine / decode"], srows),
    "",
  ]


# The step profile's columns: the op groups (`benchmarks.profile_util.op_group`) shown apart, the rest summed.
STEP_GROUPS = (("matmuls", "matmul"), ("HSA scoring", "rocketkv_hsa_scores_gather"),
               ("page top-k", "rocketkv_hsa_page_topk"), ("sparse attention", "rocketkv_sparse_decode"),
               ("append + choice", "rocketkv_cache_append"))


STEP_LAYERS = 32  # the Llama-3.1-8B shape's layers (the decode benchmark's default shape)


def step_profile_section() -> list[str]:
  from benchmarks.profile_util import group_times
  rels = [SOURCES["step_profile_bf16"], SOURCES["step_profile_fp8"]]
  rows = []
  for rel in rels:
    for p in _jsonl(rel):
      if p.get("kind") != "point" or not p.get("top_ops"):
        continue
      groups = group_times((op["op"], op["us_per_step"]) for op in p["top_ops"])
      total, matmul = groups.pop("total"), groups.get("matmul", 0.0)
      shown = [groups.get(g, 0.0) for _, g in STEP_GROUPS]
      rows.append([_dtype(p), str(p["batch"]), f"{p['ms_per_step']:.2f}", f"{p['tokens_per_s']:,.0f}",
                   *[f"{x / STEP_LAYERS:.1f}" for x in shown], f"{(total - sum(shown)) / STEP_LAYERS:.1f}",
                   f"{matmul / p['batch']:.1f}", f"{(total - matmul) / p['batch']:.1f}"])
  rel_a = SOURCES["append_cost"]
  cost = {(r["batch"], r["part"], r["kv_cache_dtype"], r["choice"]): r["us_per_append"]
          for r in _jsonl(rel_a) if r.get("kind") == "point"}
  arows = [[f"{b} ({b * 8:,})", *[f"{cost[(b, 'cache_append', dt, c)]:.1f}" for dt in ("bfloat16", "float8_e4m3fn")
                                  for c in (False, True)], f"{cost[(b, 'row_channels', None, True)]:.1f}"]
           for b in sorted({k[0] for k in cost}, reverse=True)]
  return [
    "## Where a decode step's time goes, bf16 against FP8 K/V (one H100, 2026-12-06)",
    "",
    f"Sources: {_link(rels[0])}, {_link(rels[1])}, {_link(rel_a)} (commands, code and reading: "
    f"{_link(rels[0].rsplit('/', 1)[0] + '/README.md')}). RocketKV, 32k, t=256; device microseconds per layer "
    "(a profiled step's top ops / 32) by op group, and per generated token (a step / batch):",
    "",
    *_table(["K/V", "batch", "ms / step", "tokens/s", *[name for name, _ in STEP_GROUPS], "rest",
             "matmul us / token", "rest of step us / token"], rows),
    "",
    "The token append by part, wall-clock microseconds per append (rows = batch x 8 KV heads):",
    "",
    *_table(["batch (rows)", "bf16 cache", "bf16 + choice", "FP8 cache", "FP8 + choice (the decode step's)",
             "the choice's own kernel"], arows),
    "",
  ]


LOAD_PAIR = ("rocketkv", "full")  # the load section's two methods, side by side


def serve_load_section() -> list[str]:
  """Each workload's rows from the latest run (SOURCES serve_load, serve_load_b, serve_load_c) that measured both
  methods on it, then the admission of one question over a stored document (SOURCES admission, before and after)."""
  from benchmarks.serve_load import WORKLOADS
  runs = [(rel, [r for r in _jsonl(rel) if r.get("kind") == "serve_load"])
          for rel in (SOURCES["serve_load"], SOURCES["serve_load_b"], SOURCES["serve_load_c"])]
  latest = {}  # workload -> (the run's file, its records of the workload)
  for rel, recs in runs:
    for wl in dict.fromkeys(r["workload"] for r in recs):
      mine = [r for r in recs if r["workload"] == wl]
      if all(m in {r["method"] for r in mine} for m in LOAD_PAIR):
        latest[wl] = (rel, mine)
  recs = [r for wl in WORKLOADS if wl in latest for r in latest[wl][1]]
  cells = {(r["workload"], r["rate"], r["method"]): r for r in recs}
  points = list(dict.fromkeys((r["workload"], r["rate"]) for r in recs))
  r0 = recs[0]
  missing = [w for w in WORKLOADS if w not in latest]
  where = {w: _link(latest[w][0]) for w in latest}

  def cell(r):
    return [str(r["engine_stats"]["max_slots"]), f"{r['goodput']:.3f} ({r['good_requests']}/{r['requests']})",
            f"{r['ttft_s_p50']:.2f} / {r['ttft_s_p99']:.2f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}"]

  rows = []
  for wl, rate in points:
    a, b = (cells.get((wl, rate, m)) for m in LOAD_PAIR)
    if a is None or b is None:
      continue
    ratio = f"{a['goodput'] / b['goodput']:.2f}x" if b["goodput"] > 0 else "-"
    rows.append([wl, f"{rate:g}", f"{a['duration_limit_s']:g}", *cell(a), *cell(b), ratio])
  readmes = ", ".join(_link(rel.rsplit("/", 1)[0] + "/README.md") for rel, _ in runs)
  return [
    "## Serving under load, as clients see it (one H100, 2026-12-06)",
    "",
    "Sources: " + "; ".join(f"{w}: {where[w]}" for w in where) + f" (commands, server flags, workloads and what "
    f"each point means: {readmes}). `benchmarks/serve_load.py` against `rocketkv serve` "
    f"({r0['model']}, t={r0['token_budget']}, the slots `--max-slots auto` fits), Poisson arrivals for the "
    f"window given; goodput = requests meeting TTFT <= {r0['slo_ttft_s']:g} s and TPOT <= "
    f"{r0['slo_tpot_s'] * 1e3:g} ms over the point's wall time (arrivals and the tail). An H100 80GB, not an H200"
    + (f"; not measured: {', '.join(missing)}." if missing else "."),
    "",
    *_table(["workload", "rate (req/s; chat: sessions/s)", "window (s)", "rocketkv slots",
             "rocketkv goodput (good/sent)",
             "rocketkv TTFT p50 / p99 (s)", "rocketkv TPOT p50 / p99 (ms)", "full slots",
             "full goodput (good/sent)", "full TTFT p50 / p99 (s)", "full TPOT p50 / p99 (ms)",
             "goodput rocketkv / full"], rows),
    "",
    *admission_rows(),
  ]


def admission_rows() -> list[str]:
  """One question's admission over a stored 32k document, before and after a38c9ac (`benchmarks/admission.py`)."""
  before = {r["method"]: r for r in _jsonl(SOURCES["admission_before"])}
  after = {r["method"]: r for r in _jsonl(SOURCES["admission"])}
  r0 = next(iter(after.values()))
  rows = [[m, f"{before[m]['admission_s_p50']:.3f}", f"{r['admission_s_p50']:.3f}",
           f"{before[m]['device_busy_s'] * 1e3:.1f} / {r['device_busy_s'] * 1e3:.1f}"] for m, r in after.items()]
  return [
    f"What a doc-qa question costs the engine ({_link(SOURCES['admission'])}, code `a38c9ac`; before it: "
    f"{_link(SOURCES['admission_before'])}; {r0['device']}, `python -m benchmarks.admission`): a "
    f"{r0['question_tokens']}-token question over a stored {r0['doc_tokens']:,}-token document (the history's "
    f"device tier, buckets {r0['buckets']}), prefilled, compressed under its own plan and inserted, median of "
    f"{r0['argv'][r0['argv'].index('--questions') + 1]} questions:",
    "",
    *_table(["method", "admission before (s)", "after (s)", "device busy per question, before / after (ms)"], rows),
    "",
  ]


def render() -> str:
  out = [
    "# Current results",
    "",
    "<!-- Generated by `python -m benchmarks.make_results_doc` from the files named in each section; do not edit "
    "by hand. tests/test_results_doc.py fails when this page and the files disagree. -->",
    "",
    "Every figure below is read from the result file its section names. Which file is current for each figure, "
    "and what replaced the archived runs, is [`benchmarks/results/README.md`](../benchmarks/results/README.md); "
    "how the figures were reached is [`CHANGELOG.md`](../CHANGELOG.md).",
    "",
  ]
  for section in (decode_section, engine_shapes_section, stage2_section, serve_section, fp8_section,
                  h100_section, step_profile_section, serve_load_section, turn2_prefill_section, accuracy_section,
                  fp8_accuracy_section, memory_section):
    out += section()
  return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.make_results_doc", description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="exit 1 when docs/RESULTS.md is not what this writes")
  ap.add_argument("--out", default=str(OUT), help="where to write (default docs/RESULTS.md)")
  args = ap.parse_args(argv)
  text = render()
  out = pathlib.Path(args.out)
  if args.check:
    same = out.exists() and out.read_text() == text
    print(f"{out}: {'up to date' if same else 'differs: run python -m benchmarks.make_results_doc'}")
    return 0 if same else 1
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(text)
  print(f"wrote {out} ({len(text.splitlines())} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
