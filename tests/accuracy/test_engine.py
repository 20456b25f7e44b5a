"""The layer-by-layer engine against the model's dense forward, the diagnostic's bounds, a tiny end-to-end run."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax.eval.engine import Runner, make_config
from rocketkv_jax.eval.report import write_outputs
from rocketkv_jax.eval.runner import parse_args, run
from rocketkv_jax.models import forward_full


def _seq(model, t, seed=0):
  return np.random.default_rng(seed).integers(3, model.config.vocab_size, size=(2, t)).astype(np.int32)


def test_full_teacher_forced_equals_dense_forward(tiny_model):
  r = Runner(tiny_model)
  ids = _seq(tiny_model, 96)
  prefix = 80
  logits, qkv = r.prefill_dense(ids, np.full(2, prefix))
  cfg = make_config("full", 64, prefix, 16, tiny_model.config)
  lp, d = r.teacher_forced(qkv, logits, ids, prefix, cfg, diag=True)
  ref = np.asarray(jnp.asarray(forward_full(tiny_model, ids)))[:, prefix - 1:-1]
  ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
  np.testing.assert_allclose(lp, ref, atol=2e-4)
  np.testing.assert_allclose(d["mass"], 1.0, atol=1e-5)  # full attends everything


# one method per distinct slot-mapping / selection path (snapkv and hsa reuse rocketkv's two halves);
# exact_topk selects by the exact scores, so it captures what the same-size oracle does
@pytest.mark.parametrize("method, is_oracle", [("rocketkv", False), ("quest", False), ("sparq", False),
                                               ("streaming_llm", False), ("h2o", False), ("exact_topk", True)])
def test_mass_diagnostic_bounds(tiny_model, method, is_oracle):
  r = Runner(tiny_model)
  ids = _seq(tiny_model, 200, seed=1)
  prefix = 192
  logits, qkv = r.prefill_dense(ids, np.full(2, prefix))
  cfg = make_config(method, 64, prefix, 8, tiny_model.config)
  lp, d = r.teacher_forced(qkv, logits, ids, prefix, cfg, diag=True)
  assert lp.shape == (2, 8, tiny_model.config.vocab_size) and np.isfinite(lp).all()
  mass, oracle = d["mass"], d["oracle"]
  assert mass.shape == (7, 2, 2, 2)
  assert (mass > 0).all() and (mass <= oracle + 1e-5).all() and (oracle <= 1 + 1e-5).all()
  assert (d["n_sel"] <= 64 + 8).all()  # never more than the budget's tokens (+ generated ones)
  if is_oracle:
    np.testing.assert_allclose(mass, oracle, atol=1e-5)


def test_tiny_end_to_end(tiny_model, tiny_tokenizer, tmp_path):
  args = parse_args(["--contexts", "512", "--budgets", "64", "--samples", "1", "--methods",
                     "full,rocketkv", "--tasks", "passkey,multivalue", "--fid-samples", "1",
                     "--fid-tail", "8", "--max-new", "4", "--out", str(tmp_path / "acc")])
  args.model = (tiny_model, tiny_tokenizer)
  res = run(args, log=lambda m: None)
  paths = write_outputs(res, args.out)
  assert {os.path.basename(p) for p in paths} >= {"acc.json", "acc.md", "acc_tasks.png", "acc_top1.png"}
  data = json.load(open(tmp_path / "acc.json"))
  assert len(data["tasks"]) == 2 * 2 * (1 + 1)  # 2 prompts x 2 modes x (full + rocketkv at one budget)
  rows = {(r["mode"], r["method"], r["budget"]): r for r in data["summary"]["rows"]}
  assert rows[("aware", "full", None)]["top1"] == 1.0 and rows[("aware", "full", None)]["kl"] == pytest.approx(0, abs=1e-6)
  assert 0 <= rows[("agnostic", "rocketkv", 64)]["top1"] <= 1 and len(rows[("agnostic", "rocketkv", 64)]["per_task"]) == 2
  # full KV attends everything: compressing before the question changes nothing
  out = {(r["mode"], r["method"], r["task"]): r["output"] for r in data["tasks"]}
  assert all(out[("aware", "full", t)] == out[("agnostic", "full", t)] for t in ("passkey", "multivalue"))
  split = max(r["question_tokens"] for r in data["tasks"])
  assert {r["compressed"] for r in data["tasks"] if r["mode"] == "agnostic"} == {512 - split}
  assert all(r["needles_after"] == 0 for r in data["tasks"] if r["mode"] == "aware")
  # every executable of the grid was compiled ahead of time, none while running
  assert data["meta"]["timing"]["512"]["late_compiles"] == 0
  md = open(tmp_path / "acc.md").read()
  assert "| rocketkv |" in md and "t=64 agnostic" in md and "[" in md


def test_small_grid_flags():
  a = parse_args(["--small"])
  assert a.contexts == (1024,) and a.budgets == (128, 256)
  b = parse_args(["--contexts", "1k,2k", "--budgets", "64,512"])
  assert b.contexts == (1024, 2048) and b.budgets == (64, 512)


def test_decoding_past_capacity_is_refused(tiny_model):
  r = Runner(tiny_model)
  ids = _seq(tiny_model, 160)
  logits, qkv = r.prefill_dense(ids, np.full(2, 128))
  cfg = make_config("snapkv", 64, 128, 4, tiny_model.config)  # room for 4 new tokens only
  with pytest.raises(ValueError, match="capacity"):
    r.teacher_forced(qkv, logits, ids, 128, cfg, diag=False)
