"""Sharded over 8 fake CPU devices (a fresh process: `tests/models/sharded_run.py`): prefill, compression and
decode give the same tokens as unsharded, through `generate` (XLA path, and the Pallas kernels in interpret
mode under shard_map) and the serving engine, on meshes whose model axis does and does not divide the KV
heads."""
import json
import os
import subprocess
import sys

import pytest

from rocketkv_jax.models.sharding import make_mesh, param_spec


def test_sharded_runs_equal_unsharded():
  here = os.path.dirname(os.path.abspath(__file__))
  r = subprocess.run([sys.executable, os.path.join(here, "sharded_run.py")], capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert len(result) == 10 and all(result.values()), result


def test_mesh_and_placement_errors():
  with pytest.raises(ValueError, match=r"a mesh of dp=4 x tp=4 needs 16 devices; 1 are visible"):
    make_mesh(4, 4)
  with pytest.raises(ValueError, match="tp=0 must be an int >= 1"):
    make_mesh(1, 0)
  mesh = make_mesh(1, 1)
  assert param_spec("layers/0/wqkv", (64, 128), mesh) == param_spec("layers/0/wqkv", (64, 128), mesh)


def test_decode_benchmark_on_a_mesh(tmp_path):
  """`benchmarks/decode.py --mesh DP,TP` runs every point on 8 fake CPU devices (per-device floors)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "d.jsonl"
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
  r = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--tiny", "--contexts", "256", "--methods",
                      "rocketkv,full", "--budgets", "64", "--batches", "1,8", "--steps", "4", "--chunk", "2",
                      "--mesh", "4,2", "--out", str(out)], cwd=root, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert recs[0]["kind"] == "header" and recs[0]["mesh"] == "4,2"
  points = [x for x in recs if x["kind"] == "point"]
  assert len(points) == 4 and all(p["status"] == "ok" and p["floor_ms"] > 0 for p in points), points
