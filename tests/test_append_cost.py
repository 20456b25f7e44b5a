"""benchmarks/append_cost.py on its toy shape (Pallas interpret mode): every variant of the append is timed, and bad
arguments are refused before any work. (That the appends it times write what the reference writes is
tests/kernels/test_cache_append.py's and tests/core/test_kv_fp8.py's.)"""
import json

import pytest

from benchmarks import append_cost


def test_append_cost_tiny(tmp_path):
  out = tmp_path / "a.jsonl"
  append_cost.main(["--tiny", "--batches", "1,2", "--steps", "2", "--reps", "1", "--out", str(out)])
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert recs[0]["kind"] == "header" and recs[0]["shape"] == "tiny"
  variants = [("cache_append", dt, c) for dt in append_cost.KV_DTYPES for c in (False, True)]
  variants.append(("row_channels", None, True))
  assert [(p["batch"], p["part"], p["kv_cache_dtype"], p["choice"]) for p in recs[1:]] == [
      (b, *v) for b in (1, 2) for v in variants]
  assert all(p["us_per_append"] > 0 and p["rows"] == p["batch"] * 2 for p in recs[1:])
  with pytest.raises(SystemExit, match="--steps=40 must be in"):
    append_cost.main(["--tiny", "--steps", "40"])
