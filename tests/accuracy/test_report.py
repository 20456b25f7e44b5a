"""Merging accuracy runs: duplicate prompts count once, and a method is compared with full KV on its own prompts."""
from benchmarks.accuracy.report import markdown, merge


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
