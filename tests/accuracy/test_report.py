"""Merging accuracy runs: duplicate prompts count once, and a method is compared with full KV on its own prompts."""
from rocketkv_jax.eval.report import markdown, merge


def _run(method, budget, seeds, scores, full_scores, budgets=(256,), note=None):
  grid = dict(methods=["full", method], budgets=list(budgets), contexts=[4096], samples=len(seeds),
              tasks=["passkey"], fid_samples=0, fid_tail=0, max_new=8, chat="off", dtype="float32")
  meta = dict(model="m", date="d", command=f"run {method}", grid=grid, seconds=60.0,
              machine=dict(backend="cpu", devices=["cpu"], cpu_count=2, host="h", jax="0"))
  if note:
    meta["note"] = note
  tasks = [dict(context=4096, method="full", budget=None, task="passkey", seed=s, score=v)
           for s, v in zip(seeds, full_scores)]
  tasks += [dict(context=4096, method=method, budget=budget, task="passkey", seed=s, score=v)
            for s, v in zip(seeds, scores)]
  return dict(meta=meta, tasks=tasks, fidelity=[], skipped=[])


def test_merge_counts_shared_prompts_once_and_compares_on_the_same_prompts():
  # Run A: 8 prompts, full solves 0-3 only; run B: prompts 0-3 again (full recomputed), another method.
  a = _run("snapkv", 256, list(range(8)), [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0])
  b = _run("rocketkv", 512, list(range(4)), [1, 1, 1, 0], [1, 1, 1, 1], budgets=(512,), note="from B")
  res = merge([a, b])
  rows = {(r["method"], r["budget"]): r for r in res["summary"]["rows"]}
  assert len([t for t in res["tasks"] if t["method"] == "full"]) == 8  # B's repeat of prompts 0-3 dropped
  assert rows[("full", None)]["accuracy"] == 0.5
  assert rows[("snapkv", 256)]["relative_accuracy"] == 0.125 / 0.5
  # rocketkv ran prompts 0-3 only, where full scores 1.0: 75% of full, not 0.75 / 0.5.
  assert rows[("rocketkv", 512)]["relative_accuracy"] == 0.75
  assert res["meta"]["grid"]["methods"] == ["full", "snapkv", "rocketkv"]
  assert res["meta"]["grid"]["budgets"] == [256, 512]
  assert "from B" in markdown(res)


# ----------------------------------------------------------------------------- confidence intervals

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rocketkv_jax.eval.cells import CellLog, read_cells, task_key  # noqa: E402
from rocketkv_jax.eval.report import from_cells, mean_ci, summarize, task_ci  # noqa: E402
from rocketkv_jax.eval.runner import cell_status, select  # noqa: E402


def test_task_ci_known_cases():
  # no spread: the interval is the value
  assert task_ci({"passkey": [1.0] * 10}) == (1.0, 1.0)
  # 50 of 100 solved: the bootstrap interval of a proportion, ~ 0.5 +- 1.96 * sqrt(0.25 / 100) = [0.40, 0.60]
  lo, hi = task_ci({"passkey": [0.0, 1.0] * 50})
  assert lo == pytest.approx(0.40, abs=0.015) and hi == pytest.approx(0.60, abs=0.015)
  # stratified: a task without spread adds none, and the accuracy is the mean over tasks
  lo2, hi2 = task_ci({"passkey": [0.0, 1.0] * 50, "multikey": [1.0] * 100})
  assert lo2 == pytest.approx((lo + 1) / 2, abs=0.01) and hi2 == pytest.approx((hi + 1) / 2, abs=0.01)
  # deterministic (fixed seed)
  assert task_ci({"passkey": [0.0, 1.0] * 50}) == (lo, hi)


def test_relative_ci_is_paired():
  s = [0.0, 1.0] * 20
  # the method scores exactly what full KV scores, prompt by prompt: every paired resample gives 1
  assert task_ci({"passkey": s}, {"passkey": s}) == (1.0, 1.0)
  # the method loses exactly one of full's 20 successes: the ratio stays within [~0.87, 1]
  m = list(s)
  m[1] = 0.0
  lo, hi = task_ci({"passkey": m}, {"passkey": s})
  assert 0.8 < lo < 0.95 and hi == 1.0
  # resamples where full KV solves nothing are dropped, not infinite
  lo, hi = task_ci({"passkey": [1.0, 0.0]}, {"passkey": [1.0, 0.0]})
  assert (lo, hi) == (1.0, 1.0)


def test_mean_ci():
  assert mean_ci([0.25] * 7) == (0.25, 0.25)
  lo, hi = mean_ci(np.r_[np.zeros(128), np.ones(128)])
  assert lo == pytest.approx(0.5 - 1.96 * np.sqrt(0.25 / 256), abs=0.02) and hi == pytest.approx(
      0.5 + 1.96 * np.sqrt(0.25 / 256), abs=0.02)
  assert mean_ci([]) is None


def test_summary_carries_intervals_per_mode_and_fidelity():
  res = _run("snapkv", 256, list(range(8)), [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0])
  res["tasks"] += [dict(t, mode="agnostic", score=0.0) for t in res["tasks"] if t["method"] == "snapkv"]
  res["tasks"] += [dict(t, mode="agnostic") for t in res["tasks"] if t["method"] == "full"]
  res["fidelity"] = [dict(context=4096, method="snapkv", budget=256, sequences=2, tail=2, top1=0.75, kl=0.1,
                          top1_pos=[1, 1, 0, 1], kl_pos=[0.0, 0.1, 0.3, 0.0])]
  rows = {(r["mode"], r["method"], r["budget"]): r for r in summarize(res)["rows"]}
  aware, agn = rows[("aware", "snapkv", 256)], rows[("agnostic", "snapkv", 256)]
  assert aware["accuracy"] == 0.125 and aware["accuracy_ci"][0] <= 0.125 <= aware["accuracy_ci"][1]
  assert aware["relative_accuracy"] == 0.25 and aware["relative_ci"][0] <= 0.25 <= aware["relative_ci"][1]
  assert agn["accuracy"] == 0 and agn["relative_accuracy"] == 0 and agn["relative_ci"] == (0.0, 0.0)
  assert aware["top1"] == agn["top1"] == 0.75 and aware["top1_ci"][0] <= 0.75 <= aware["top1_ci"][1]
  assert aware["kl_ci"] is not None
  res["summary"] = summarize(res)
  md = markdown(res)
  assert "t=256 aware | t=256 agnostic" in md and "12% [0, 38]" in md


# ----------------------------------------------------------------------------- modes in the cells file


def test_rows_without_a_mode_are_aware_and_cells_count_modes(tmp_path):
  class A:  # the grid
    contexts, methods, budgets, tasks, samples, fid_samples, fid_tail = (4096,), ("full",), (256,), ("passkey",), 1, 0, 0
    modes = ("aware", "agnostic")

  old = dict(context=4096, method="full", budget=None, task="passkey", seed=0, score=1.0)  # before the modes
  assert task_key(old) == (4096, "aware", "full", None, "passkey", 0)
  path = str(tmp_path / "x.cells.jsonl")
  log = CellLog(path, {"model": "m"})
  log.write("run", {"date": "d", "command": "c", "grid": {"contexts": [4096], "modes": ["aware", "agnostic"]}})
  log.write("tasks", old)
  log.close()
  rows = select(read_cells(path), A)
  assert len(rows["tasks"]) == 1 and cell_status(A, rows) == (1, 2)  # the aware cell is done, the agnostic not
  A.modes = ("agnostic",)
  assert select(read_cells(path), A)["tasks"] == [] and cell_status(A, select(read_cells(path), A)) == (0, 1)
  log = CellLog(path, {"model": "m"})
  log.write("tasks", dict(old, mode="agnostic", score=0.0))
  log.close()
  A.modes = ("aware", "agnostic")
  assert cell_status(A, select(read_cells(path), A)) == (2, 2)
  # a cells file renders like a result JSON: both modes, each compared with its own full KV
  res = merge([from_cells(path)])
  assert res["meta"]["grid"]["modes"] == ["aware", "agnostic"]
  assert {(r["mode"], r["accuracy"]) for r in res["summary"]["rows"]} == {("aware", 1.0), ("agnostic", 0.0)}
  json.dumps(res)


# ----------------------------------------------------------------------------- variants against their base method


def test_difference_ci_is_paired():
  from rocketkv_jax.eval.report import difference_ci
  s = [0.0, 1.0] * 20
  assert difference_ci({"passkey": s}, {"passkey": s}) == (0.0, 0.0)  # identical prompt by prompt: no noise
  better = [1.0] * 40  # solves every prompt the base fails: +0.5, the interval well above 0
  lo, hi = difference_ci({"passkey": better}, {"passkey": s})
  assert 0.3 < lo <= 0.5 <= hi < 0.7


def _variant_run(variant_scores_by_cell):
  """A run with full, rocketkv and rocketkv[x=1] at two budgets in both modes; rocketkv solves half."""
  tasks = []
  base = [0.0, 1.0] * 20
  for mode in ("aware", "agnostic"):
    for s, v in enumerate([1.0] * 40):
      tasks.append(dict(context=4096, mode=mode, method="full", budget=None, task="passkey", seed=s, score=v))
    for b in (128, 256):
      for s, v in enumerate(base):
        tasks.append(dict(context=4096, mode=mode, method="rocketkv", budget=b, task="passkey", seed=s, score=v))
      for s, v in enumerate(variant_scores_by_cell.get((mode, b), base)):
        tasks.append(dict(context=4096, mode=mode, method="rocketkv[x=1]", budget=b, task="passkey", seed=s,
                          score=v))
  res = _run("rocketkv", 256, [], [], [])
  res["meta"]["grid"].update(methods=["full", "rocketkv", "rocketkv[x=1]"], budgets=[128, 256],
                             modes=["aware", "agnostic"], samples=40)
  res["tasks"] = tasks
  return res


def test_variants_verdicts_and_the_registration_rule():
  from rocketkv_jax.eval.report import variant_verdicts
  win = _variant_run({("aware", 256): [1.0] * 40})
  v = summarize(win)["variants"]
  assert len(v) == 4 and {x["base"] for x in v} == {"rocketkv"}
  cell = next(x for x in v if (x["mode"], x["budget"]) == ("aware", 256))
  assert cell["verdict"] == "win" and cell["intervals_apart"] and cell["difference"] == 0.5
  assert sum(x["verdict"] == "tie" for x in v) == 3
  d = variant_verdicts(v)["rocketkv[x=1]"]
  assert (d["win"], d["loss"], d["wins_apart"], d["rule_met"]) == (1, 0, 1, True)
  win["summary"] = summarize(win)
  assert "rule met" in markdown(win) and "+50 pts" in markdown(win)
  # the same win with one loss beyond noise elsewhere: the rule is not met
  lose = _variant_run({("aware", 256): [1.0] * 40, ("agnostic", 128): [0.0] * 40})
  d = variant_verdicts(summarize(lose)["variants"])["rocketkv[x=1]"]
  assert (d["win"], d["loss"], d["rule_met"]) == (1, 1, False)


def test_registered_extension_is_compared_with_the_method_it_extends():
  from rocketkv_jax.eval.report import base_method
  assert base_method("rocketkv_plus") == "rocketkv"  # a registered extension: paired against the paper's method
  assert base_method("rocketkv_plus[hsa_recent_tokens=4]") == "rocketkv_plus"
  assert base_method("rocketkv[topr=16]") == "rocketkv" and base_method("snapkv") == "snapkv"


def test_full_with_overrides_is_compared_with_plain_full_not_taken_as_the_reference():
  """`full[kv_cache_dtype=...]` runs without a budget too: it must get its ratio to plain full, and plain full's
  accuracy stays the reference (before, whichever budget-None row came last replaced it)."""
  res = _run("snapkv", 256, list(range(4)), [1, 0, 0, 0], [1, 1, 0, 0])
  fp8 = "full[kv_cache_dtype=float8_e4m3fn]"
  res["tasks"] += [dict(context=4096, method=fp8, budget=None, task="passkey", seed=s, score=v)
                   for s, v in zip(range(4), [1, 0, 0, 0])]
  res["meta"]["grid"]["methods"].append(fp8)
  rows = {(r["method"], r["budget"]): r for r in summarize(res)["rows"]}
  assert rows[("full", None)]["accuracy"] == 0.5 and rows[("full", None)]["relative_accuracy"] == 1.0
  assert rows[(fp8, None)]["accuracy"] == 0.25 and rows[(fp8, None)]["relative_accuracy"] == 0.5
  assert rows[("snapkv", 256)]["relative_accuracy"] == 0.5
  res["summary"] = summarize(res)
  assert f"| 4096 | {fp8} |" in markdown(res)
