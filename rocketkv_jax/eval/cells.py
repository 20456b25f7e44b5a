"""Row identities and the resumable cells file: what the runner appends as it measures, what the report and a
re-run read back. Its own module so that the runner (which writes cells and renders reports) and the report
(which reads cells) both import it, and neither imports the other."""
from __future__ import annotations

import json
import os

MODES = ("aware", "agnostic")  # question inside stage 1's window / fed after the context was compressed


def is_reference(method: str, budget) -> bool:
  """Full KV run plainly (no budget, no overrides): the reference every figure is compared with. A method the
  budget does not change but run with overrides (`full[kv_cache_dtype=float8_e4m3fn]`) is compared with it like
  any other method."""
  return budget is None and "[" not in method


def task_key(r) -> tuple:
  """A task row's identity: (context, mode, method, budget, task, seed); a row without a mode (written before
  the modes existed) is query-aware."""
  return (r["context"], r.get("mode", "aware"), r["method"], r["budget"], r["task"], r["seed"])


def fidelity_key(r) -> tuple:
  """A fidelity row's identity: (context, method, budget, sequences, tail). Fidelity has no mode: it always
  compresses a prefix and teacher-forces the rest."""
  return (r["context"], r["method"], r["budget"], r["sequences"], r["tail"])


def skip_key(r) -> tuple:
  """A skipped row's identity: (context, mode or None, method, budget, why)."""
  mode = r.get("mode", None if r["why"].startswith("fidelity") else "aware")
  return (r["context"], mode, r["method"], r["budget"], r["why"])


# ----------------------------------------------------------------------------- the cells file
#
# <out>.cells.jsonl, one JSON object a line, appended and flushed as each row is measured:
#   {"kind": "meta", "version": 1, "settings": {...}}   first line: what every row depends on (model, dtype,
#                                                       max_new, chat, fid_tail, no_diag, impl); a re-run
#                                                       with other settings is refused
#   {"kind": "run", "date": ..., "command": ..., "machine": {...}, "model_config": {...}}   each run that loaded the model
#   {"kind": "tasks", <a task row of the result JSON>}       one prompt x mode x method x budget
#   {"kind": "fidelity", <a fidelity row>}                    one context x method x budget
#   {"kind": "skipped", <a skipped row>}                      a config the budget/context cannot make
#   {"kind": "error", {context, mode, method, budget, error}}  a config that failed (compile or run); not a
#                                                             cell: a re-run tries it again
#   {"kind": "timing", "context": C, ...}                     where a context's time went (compile, total)
# A last line cut short by a kill is ignored (and dropped by the next run's writer). Cells: a task cell (context,
# mode, method, budget, task) is done when its rows for seeds 0 .. samples-1 are there (or its config is skipped);
# a fidelity cell (context, method, budget) when its row for these fid_samples and fid_tail is (runner.cell_status).

CELLS_VERSION = 1
RESUME_SETTINGS = ("model", "dtype", "max_new", "chat", "fid_tail", "no_diag", "impl")


def resume_settings(args) -> dict:
  return {k: getattr(args, k) for k in RESUME_SETTINGS}


def read_cells(path: str) -> dict | None:
  """The rows of a cells file: {"settings", "runs", "tasks", "fidelity", "skipped"}, or None when absent."""
  if not os.path.exists(path):
    return None
  out = {"settings": None, "runs": [], "tasks": [], "fidelity": [], "skipped": [], "errors": [], "timing": {}}
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
    elif kind == "error":
      out["errors"].append(rec)
    elif kind == "timing":
      out["timing"][str(rec.pop("context"))] = rec
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
