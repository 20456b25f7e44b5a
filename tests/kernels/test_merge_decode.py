"""The decode-grid merge (benchmarks/merge_decode.py) and the renderer's run column on tiny synthetic files: a
later file's point replaces the earlier one of the same method, budget, context and batch spec; a run left
with no points is dropped; FILE@CODE fills a header's missing code; the table names each point's run."""
import json

import pytest

from benchmarks import merge_decode, render_decode


def header(cmd, code=None):
  return dict(kind="header", date="2026-12-02T00:00:00+00:00", device="NVIDIA H200", jax="0.11.2", command=cmd,
              model="m", copy_bandwidth_GBps=3000.0, weight_bytes=15e9, **({"code": code} if code else {}))


def point(method, budget, context, batch, ms, spec=None):
  return dict(kind="point", method=method, token_budget=budget, context=context, batch=batch,
              batch_spec=spec or str(batch), status="ok", ms_per_step=ms, floor_ms=4.0, ratio_to_floor=ms / 4.0,
              tokens_per_s=batch / ms * 1e3, cache_bytes=1e9, prefill_s=1.0, capacity=100)


def write(path, recs):
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  return str(path)


def test_later_points_win_and_empty_runs_go(tmp_path):
  old = write(tmp_path / "old.jsonl", [
      header("old a", code="aaa"), point("full", None, 32768, 1, 5.5), point("rocketkv", 256, 32768, 1, 5.2),
      header("old b", code="bbb"), point("rocketkv", 256, 32768, 391, 40.0, spec="max")])
  new = write(tmp_path / "new.jsonl", [
      header("new"), point("rocketkv", 256, 32768, 1, 4.8), point("rocketkv", 256, 32768, 394, 18.4, spec="max")])
  recs = merge_decode.merge([old, new + "@ccc"])
  assert [r["command"] for r in recs if r["kind"] == "header"] == ["old a", "new"]  # "old b" lost its only point
  assert [r.get("code") for r in recs if r["kind"] == "header"] == ["aaa", "ccc"]
  pts = {(r["method"], r["batch_spec"]): r["ms_per_step"] for r in recs if r["kind"] == "point"}
  assert pts == {("full", "1"): 5.5, ("rocketkv", "1"): 4.8, ("rocketkv", "max"): 18.4}
  out = tmp_path / "merged.jsonl"
  merge_decode.main([str(out), old, new])
  md = render_decode.render(str(out))
  assert "run 1: command: `old a`" in md and "run 2: command: `new`" in md
  rows = [line for line in md.splitlines() if line.startswith("| rocketkv")]
  assert rows[0].endswith("| 2 |") and "4.80" in rows[0]  # batch 1, from run 2
  # Prefill against dense only within a run: run 2 has no full point, so none (not another run's prefill).
  assert rows[0].endswith("| None | 2 |")
  assert any(line.startswith("| full") and line.endswith("| 1 |") for line in md.splitlines())


def test_a_point_before_any_header_is_an_error(tmp_path):
  bad = write(tmp_path / "bad.jsonl", [point("full", None, 32768, 1, 5.5)])
  with pytest.raises(ValueError, match="before any header"):
    merge_decode.merge([bad])
