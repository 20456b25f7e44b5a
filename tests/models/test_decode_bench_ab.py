"""`benchmarks/decode.py --ab MODULE.FLAG=V1,V2`: each point compiled once per value of a flag read while
tracing, the variants timed in alternating rounds within one process; bad specs are refused before any work."""
import json

import pytest

from benchmarks import decode
from rocketkv_jax.kernels import cache_append


def test_ab_times_each_variant_of_a_tracing_flag(tmp_path):
  out = tmp_path / "ab.jsonl"
  decode.main(["--tiny", "--contexts", "256", "--methods", "rocketkv", "--budgets", "64", "--batches", "1",
               "--steps", "8", "--chunk", "2", "--impl", "interpret", "--ab-rounds", "2",
               "--ab", "rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,0", "--out", str(out)])
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert recs[0]["kind"] == "header" and recs[0]["ab"] == "rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,0"
  points = [r for r in recs if r["kind"] == "point"]
  assert [p["ab_value"] for p in points] == ["16", "0"]
  for p in points:
    assert p["status"] == "ok" and p["ms_per_step"] > 0 and p["steps_timed"] == 8 and len(p["ab_round_ms"]) == 2
  # The flag changed the compiled step (the trace caches were cleared between the variants) ...
  assert points[0]["hlo_hash"] != points[1]["hlo_hash"]
  # ... and is back to its value after.
  assert cache_append.ROWS_MAX_PAGE_SIZE == 16


@pytest.mark.parametrize("spec,match", [
    ("ROWS_MAX_PAGE_SIZE=16,0", "must be MODULE.FLAG=V1,V2"),
    ("rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE", "must be MODULE.FLAG=V1,V2"),
    ("rocketkv_jax.nope.FLAG=1,2", "cannot import 'rocketkv_jax.nope'"),
    ("rocketkv_jax.stage2.NOPE=1,2", "has no attribute 'NOPE'"),
    ("rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16", "at least two distinct values"),
    ("rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,16", "at least two distinct values"),
    ("rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=yes,no", "must be Python literals"),
])
def test_ab_rejects_bad_specs(spec, match):
  with pytest.raises(SystemExit, match=match):
    decode.main(["--tiny", "--contexts", "256", "--ab", spec])


def test_ab_refuses_more_steps_than_the_caches_hold_and_a_profile():
  with pytest.raises(SystemExit, match="decodes 528 steps per point; the caches hold 256"):
    decode.main(["--tiny", "--contexts", "256", "--steps", "256", "--chunk", "8",
                 "--ab", "rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,0"])
  with pytest.raises(SystemExit, match="--ab and --profile run apart"):
    decode.main(["--tiny", "--contexts", "256", "--profile", "/tmp/x",
                 "--ab", "rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,0"])


def test_profile_groups_a_steps_ops():
  from benchmarks.profile_util import op_group
  names = {"gemm_fusion_dot_228": "matmul", "cublas_gemm.3": "matmul",
           "nvjet_sm90_tst_128x200_64x5_4x2_h_bz_coopA_NNT": "matmul",
           "void cublasLt::splitKreduce_kernel<32, 16, int, float>(...)": "matmul", "loop_multiply_fusion_97": "other",
           "input_scatter_fusion_63": "other", "memcpy32_post": "copy", "copy.12": "copy",
           "rocketkv_hsa_scores_gather": "rocketkv_hsa_scores_gather"}
  assert {n: op_group(n) for n in names} == names


def test_profiled_point_records_its_op_groups(tmp_path):
  out = tmp_path / "prof.jsonl"
  decode.main(["--tiny", "--contexts", "256", "--methods", "rocketkv", "--budgets", "64", "--batches", "1",
               "--steps", "4", "--chunk", "2", "--profile", str(tmp_path / "trace"), "--profile-batches", "1",
               "--out", str(out)])
  point = [json.loads(line) for line in out.read_text().splitlines()][-1]
  groups = point["op_groups"]
  assert point["status"] == "ok" and point["top_ops"] and groups["total"] > 0
  assert abs(sum(v for k, v in groups.items() if k != "total") - groups["total"]) < 0.1 * len(groups)


def test_ab_values_holding_commas_are_separated_by_bars():
  module, attr, values = decode.parse_ab("rocketkv_jax.kernels.hsa_scores.ROW_PROGRAM_WARPS_STAGES=(2, 2)|(4,2)")
  assert attr == "ROW_PROGRAM_WARPS_STAGES" and values == [(2, 2), (4, 2)]
  assert decode.parse_ab("rocketkv_jax.kernels.cache_append.ROWS_MAX_PAGE_SIZE=16,0")[2] == [16, 0]
