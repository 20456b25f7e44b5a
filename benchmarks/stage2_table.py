"""The per-layer RocketKV stage-2 table (issue 15) from benchmarks/kernels.py and benchmarks/tune_hsa.py JSON lines.

One row per batch: each stage-2 kernel as the decode path runs it (the token append, the HSA selection: scores
plus page top-k, the sparse attention), its device time against its bytes at the copy bandwidth of the same run,
the sum of the three against the sum of their floors, and the whole layer step where the inputs hold it.

  python -m benchmarks.stage2_table OLD.jsonl NEW.jsonl ... --out PREFIX   # writes PREFIX.md, prints it

Where several inputs hold the same (kernel, batch), the later input on the command line wins; the records it
overrides are listed under the table.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.kernels import G, H, K_HEADS, rocketkv_config
from rocketkv_jax.kernels import hsa_scores

KERNELS = (("append", "append"), ("select", "HSA selection"), ("attn", "sparse attention"))
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@functools.cache
def decode_tuning(B: int, L: int = 32768, t: int = 256) -> hsa_scores.Tuning:
  """The scoring kernel's launch parameters on the decode path at batch B, context L and budget t: the kernel's
  own heuristic (`hsa_scores.pick_tuning`) at RocketKV's plan (its KT pages and top-r), on this device (the
  H200's SM count where no GPU is visible)."""
  cfg = rocketkv_config(L, t, "xla")
  return hsa_scores.pick_tuning(B, K_HEADS, cfg.num_kt_pages, cfg.topr)


def is_decode_scoring(r, B: int) -> bool:
  """Whether r is an HSA scoring record at the decode path's launch parameters (`decode_tuning`): kernels.py's
  records at its split (their channel choice by the row_channels kernel), tune_hsa.py's at all of them. The
  in-kernel "rank" layout, removed in issue 38, is never the decode path's."""
  tuning = decode_tuning(B, r["L"], r["t"])
  if r.get("kind") == "hsa_scores":
    m = re.fullmatch(r"pallas gather split_pages=(True|False)", r.get("impl", ""))
    return bool(m) and (m[1] == "True") == tuning.split_pages
  if r.get("kind") in (None, "scores") and r.get("layout") == "gather":  # tune_hsa.py (older records: no kind)
    return ((bool(r.get("split")), r.get("block_p"), r.get("warps"), r.get("stages")) ==
            (tuning.split_pages, tuning.block_p, tuning.num_warps, tuning.num_stages))
  return False


MATCH = {
    "append": lambda r, B: r.get("kind") == "append" and r.get("impl") == "pallas",
    "select": lambda r, B: r.get("kind") == "hsa_select" and r.get("impl") == "pallas two-kernel",
    "scores": is_decode_scoring,
    "attn": lambda r, B: r.get("kind") == "sparse_attn" and r.get("impl") == "pallas default",
    "layer": lambda r, B: r.get("kind") == "layer_step" and r.get("impl") == "pallas",
}


class Source:
  """One input file: its records, footnote letter and the facts of its run."""

  def __init__(self, path: str, letter: str):
    self.path, self.letter = path, letter
    self.records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    ceiling = next((r for r in self.records if r.get("kind") == "ceiling"), {})
    self.copy_GBps = ceiling.get("copy_GBps")
    first = lambda key: next((r[key] for r in self.records if r.get(key)), None)  # noqa: E731
    self.device, self.command = first("device"), first("command")
    m = re.search(r"\d{4}-\d{2}-\d{2}", Path(path).as_posix())
    self.date = first("date") or (m[0] if m else None)
    m = re.search(r"_([0-9a-f]{7,40})(?:/|$)", Path(path).parent.as_posix() + "/")
    self.measured_at = first("commit") or (m[1] if m else None)
    self.committed_in = added_in(path)

  def legend(self) -> str:
    facts = [f"`{self.path}`", self.date or "date unknown"]
    if self.measured_at:
      facts.append(f"measured at {self.measured_at}")
    if self.committed_in:
      facts.append(f"committed in {self.committed_in}")
    if self.copy_GBps:
      facts.append(f"copy {self.copy_GBps:.0f} GB/s")
    if self.command:
      facts.append(f"`{self.command}`")
    return f"({self.letter}) " + ", ".join(facts)


def added_in(path: str):
  """The short hash of the commit that added the file, or None outside git."""
  p = Path(path).resolve()
  try:
    out = subprocess.run(["git", "-C", str(p.parent), "log", "--diff-filter=A", "--format=%h", "-1", "--", p.name],
                         capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


class Point:
  """One record's figures: device us without the memcpy kernels among its top kernels (kernels.py's timed loops
  copy their non-donated cache; the decode path donates it), bytes, floor us (the record's, else bytes at the
  file's copy bandwidth)."""

  def __init__(self, rec, src: Source):
    self.rec, self.src = rec, src
    self.copy_us = sum(us for name, us in rec.get("top_kernels", []) if name.startswith("memcpy"))
    self.us = rec.get("device_us", rec.get("dev_us"))
    if self.us is not None:
      self.us -= self.copy_us
    self.bytes = rec.get("bytes", rec["MB"] * 1e6 if rec.get("MB") is not None else None)
    self.floor = rec.get("floor_us")
    if self.floor is None and self.bytes is not None and src.copy_GBps:
      self.floor = self.bytes / src.copy_GBps / 1e3
    self.x = self.us / self.floor if self.us is not None and self.floor else None


def candidates(sources, key: str, B: int, L: int, t: int):
  """Every matching point for (key, B), in input order (the last one wins)."""
  return [Point(r, s) for s in sources for r in s.records
          if r.get("B") == B and r.get("L") == L and r.get("t") == t and MATCH[key](r, B)]


def build(sources, L: int, t: int, batches=None):
  """{B: {key: (chosen Point or None, overridden Points)}} for each kernel, the scoring kernel alone and the layer."""
  if batches is None:
    batches = sorted({r["B"] for s in sources for r in s.records
                      if r.get("L") == L and r.get("t") == t and isinstance(r.get("B"), int)})
  table = {}
  for B in batches:
    row = {}
    for key in MATCH:
      pts = candidates(sources, key, B, L, t)
      row[key] = (pts[-1] if pts else None, pts[:-1])
    row["hsa_fallback"] = row["select"][0] is None and row["scores"][0] is not None
    if row["hsa_fallback"]:
      row["select"] = row["scores"]
    table[B] = row
  return table


def fmt(v, spec: str = ".1f", suffix: str = "") -> str:
  return "-" if v is None else f"{v:{spec}}{suffix}"


def num(v) -> str:
  """Two decimals, or three significant digits below 1 (floors of a few ns stay readable)."""
  return "-" if v is None else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


def cells(p, mark: str = ""):
  """us (with its source letter), MB, floor us, x floor; '-' where unknown."""
  if p is None:
    return ["-"] * 4
  us = "-" if p.us is None else f"{p.us:.1f} ({p.src.letter}){mark}"
  return [us, num(None if p.bytes is None else p.bytes / 1e6), num(p.floor), fmt(p.x, ".1f", "x")]


def stage2_sum(row):
  """(sum of device us, sum of floors, letters) over the three kernels, or Nones when one is missing."""
  pts = [row[k][0] for k, _ in KERNELS]
  if any(p is None or p.us is None or p.floor is None for p in pts):
    return None, None, ""
  return sum(p.us for p in pts), sum(p.floor for p in pts), ",".join(sorted({p.src.letter for p in pts}))


def table_lines(table):
  head = ["B", "rows"]
  for _, name in KERNELS:
    head += [f"{name} us", "MB", "floor us", "x"]
  head += ["stage 2 us", "floor us", "x", "layer step us", "floor us", "x"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for B, row in table.items():
    out = [str(B), str(B * K_HEADS)]
    for key, _ in KERNELS:
      out += cells(row[key][0], "*" if key == "select" and row["hsa_fallback"] else "")
    us, floor, letters = stage2_sum(row)
    out += ["-" if us is None else f"{us:.1f} ({letters})", num(floor),
            fmt(None if us is None else us / floor, ".1f", "x")]
    layer = cells(row["layer"][0])
    out += [layer[0], layer[2], layer[3]]
    lines.append("| " + " | ".join(out) + " |")
  return lines


def scores_lines(table, L: int, t: int):
  lines = ["| B | rows | grid (pick_tuning) | us | floor us | x |", "|---|---|---|---|---|---|"]
  for B, row in table.items():
    tuning = decode_tuning(B, L, t)
    c = cells(row["scores"][0])
    lines.append(f"| {B} | {B * K_HEADS} | {'page blocks' if tuning.split_pages else 'row programs'}, "
                 f"block_p {tuning.block_p} | {c[0]} | {c[2]} | {c[3]} |")
  return lines


def notes_lines(table):
  """The overridden records (same kernel and batch in an earlier input) and the copies inside timed loops."""
  names = dict(KERNELS, scores="HSA scores alone", layer="layer step")
  lines = []
  for B, row in table.items():
    for key, name in names.items():
      chosen, lost = row[key]
      for p in lost:
        lines.append(f"- {name}, B={B}: {fmt(chosen.us)} us ({chosen.src.letter}) used over {fmt(p.us)} us "
                     f"({p.src.letter}, {p.x and f'{p.x:.1f}x floor' or 'floor unknown'}).")
  for key in ("append", "layer"):
    copies = [f"B={B} {p.copy_us:.1f} us ({p.src.letter})" for B, row in table.items()
              if (p := row[key][0]) is not None and p.copy_us]
    if copies:
      lines.append(f"- {names[key]}: left out of the times above, memcpy kernels (the benchmark loop's copy of "
                   f"its non-donated cache) of " + ", ".join(copies) + ".")
  return lines


def plan_line(sources, L: int, t: int) -> str:
  """The shape and the RocketKV plan, from the first record that states it."""
  for s in sources:
    for r in s.records:
      if r.get("L") == L and r.get("t") == t and r.get("capacity"):
        P = math.ceil(r["capacity"] / r["page_size"])
        return (f"capacity {r['capacity']} slots, {P} pages of {r['page_size']}, top_r {r['top_r']}, "
                f"top_k {r['top_k']} tokens")
  return "plan not in the inputs"


def render(sources, L: int = 32768, t: int = 256, batches=None, command: str = "") -> str:
  table = build(sources, L, t, batches)
  devices = sorted({s.device for s in sources if s.device})
  parts = [
      f"# RocketKV stage 2 per layer, {', '.join(devices) or 'device unknown'}",
      "",
      f"Regenerate (from the repository root): `{command}`",
      "",
      f"Shape: Llama-3.1-8B attention, K={K_HEADS} KV heads, G={G}, H={H}, bf16; {L} context, t={t}: "
      f"{plan_line(sources, L, t)}. rows = B * {K_HEADS} KV heads.",
      "",
      "Per layer, microseconds of GPU kernels per call from a profiler trace (dispatch excluded; the benchmark "
      "loop's copies of its non-donated cache too, listed in the notes). Kernels as the "
      "decode path runs them: append = `cache_append` (impl pallas, per step of a 16-step loop); HSA selection = "
      "the two-kernel path (scores on the grid hsa_scores.pick_tuning picks, then page top-k); sparse attention = "
      "the default "
      "split grid. floor = the point's bytes (what it must move: the chosen KT rows, the selected K/V rows, the "
      "appended rows and KT page) at the device-to-device copy bandwidth measured in the same run; x = us / "
      "floor. stage 2 = the three kernels summed against their floors summed; layer step = the whole decode step "
      "of one layer (impl pallas, 16-step loop, per step).",
      "",
      "Sources (a later one wins where two hold the same kernel and batch): "
      + "; ".join(f"({s.letter}) `{Path(s.path).name}`" for s in sources) + ".",
      "",
      *table_lines(table),
      "",
  ]
  if any(row["hsa_fallback"] for row in table.values()):
    parts += ["\\* no two-kernel selection record: the scoring kernel alone (top-k not included).", ""]
  parts += ["HSA scoring kernel alone, on the grid `hsa_scores.pick_tuning` picks:", "", *scores_lines(table, L, t),
            ""]
  notes = notes_lines(table)
  if notes:
    parts += ["Notes:", "", *notes, ""]
  parts += ["Sources:", "", *(f"- {s.legend()}" for s in sources), ""]
  return "\n".join(parts)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("inputs", nargs="+", help="JSON lines, oldest first (a later file wins)")
  ap.add_argument("--out", required=True, help="writes OUT.md")
  ap.add_argument("--length", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--batches", default="", help="comma-separated; default: every batch in the inputs")
  argv = sys.argv[1:] if argv is None else list(argv)
  a = ap.parse_args(argv)
  if len(a.inputs) > len(LETTERS):
    ap.error(f"at most {len(LETTERS)} inputs")
  sources = [Source(p, LETTERS[i]) for i, p in enumerate(a.inputs)]
  batches = [int(b) for b in a.batches.split(",")] if a.batches else None
  text = render(sources, a.length, a.budget, batches, " ".join(["python -m benchmarks.stage2_table", *argv]))
  Path(a.out + ".md").write_text(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
