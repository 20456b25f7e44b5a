"""Merges benchmarks/decode.py result files into one current grid: a later file's point replaces an earlier
point of the same method, token budget, context and batch spec (its run is newer code); each kept point stays
after its own run's header, and a run whose points were all replaced is dropped. Render the result with
`benchmarks.render_decode` (its table numbers each point's run).

  python -m benchmarks.merge_decode OUT.jsonl OLD.jsonl NEWER.jsonl@a31fc97 ...

FILE@CODE sets `code` on that file's headers that carry none.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def point_key(r) -> tuple:
  return r["method"], r.get("token_budget"), r["context"], r.get("batch_spec", str(r.get("batch")))


def merge(sources: list[str]) -> list[dict]:
  """Runs ([header, points...]) of every source in order, the superseded points removed."""
  runs = []
  for spec in sources:
    path, _, code = spec.partition("@")
    run = None
    for line in Path(path).read_text().splitlines():
      if not line.strip():
        continue
      r = json.loads(line)
      if r["kind"] == "header":
        if code and not r.get("code"):
          r["code"] = code
        run = [r]
        runs.append(run)
      elif run is None:
        raise ValueError(f"{path}: a {r['kind']!r} record before any header")
      else:
        run.append(r)
  latest = {}
  for i, run in enumerate(runs):
    for r in run[1:]:
      if r["kind"] == "point":
        latest[point_key(r)] = i
  out = []
  for i, run in enumerate(runs):
    kept = [r for r in run[1:] if r["kind"] != "point" or latest[point_key(r)] == i]
    if kept:
      out += [run[0], *kept]
  return out


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    raise SystemExit("usage: python -m benchmarks.merge_decode OUT.jsonl FILE[@CODE] ...")
  recs = merge(argv[1:])
  Path(argv[0]).write_text("".join(json.dumps(r) + "\n" for r in recs))
  print(f"{argv[0]}: {sum(r['kind'] == 'header' for r in recs)} runs, "
        f"{sum(r['kind'] == 'point' for r in recs)} points")


if __name__ == "__main__":
  main(sys.argv[1:])
