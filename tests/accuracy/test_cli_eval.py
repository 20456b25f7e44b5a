"""`rocketkv eval` end to end on CPU: a tiny random HF checkpoint written here (a BPE tokenizer trained on the
haystack, so every task tokenizes), a 2 methods x 1 budget x 1 context x 1 task x 1 sample run, the same command
again (every cell done: the model is not even loaded), a run whose last cell was lost (only it is redone), and
bad flags that exit 2 before any loading."""
import json
import os

import pytest
from safetensors.numpy import save_file

import rocketkv_jax.models
from rocketkv_jax.serving.cli import main
from tests.models.conftest import tiny_config, tiny_params
from tests.helpers.checkpoints import hf_tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer):
  d = tmp_path_factory.mktemp("hf_eval")
  cfg = tiny_config(vocab_size=tiny_tokenizer.vocab_size, max_len=1024, bos_id=None, eos_id=0)
  json.dump(dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
                 num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.ffn_dim,
                 rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                 max_position_embeddings=cfg.max_len, eos_token_id=0), open(d / "config.json", "w"))
  save_file(hf_tensors(cfg, tiny_params(cfg, seed=3)), str(d / "model.safetensors"))
  tiny_tokenizer.tokenizer.save(str(d / "tokenizer.json"))
  json.dump({"eos_token": "<|endoftext|>"}, open(d / "tokenizer_config.json", "w"))
  return str(d)


def _no_load(*a, **k):
  raise AssertionError("the model was loaded")


def test_eval_runs_resumes_and_skips_done_cells(hf_dir, tmp_path, capsys, monkeypatch):
  out = str(tmp_path / "ev")
  argv = ["eval", "--model", hf_dir, "--contexts", "0.5k", "--methods", "full,rocketkv", "--budgets", "64",
          "--tasks", "passkey", "--samples", "1", "--fid-samples", "1", "--fid-tail", "8", "--max-new", "4",
          "--out", out, "--cache", str(tmp_path / "cache"), "--no-compile-cache"]
  assert main(argv) == 0
  err = " ".join(capsys.readouterr().err.split())
  assert "measured 4 task rows and 2 fidelity rows" in err  # both modes
  for suffix in (".json", ".md", "_tasks.png", "_top1.png", ".cells.jsonl"):
    assert os.path.exists(out + suffix), suffix
  res = json.load(open(out + ".json"))
  assert {(r["mode"], r["method"], r["budget"]) for r in res["tasks"]} == {
      (mode, m, b) for mode in ("aware", "agnostic") for m, b in (("full", None), ("rocketkv", 64))}
  assert len(res["fidelity"]) == 2 and res["meta"]["cells"] == {"file": out + ".cells.jsonl", "done_before": 0,
                                                                 "total": 6}
  lines = [json.loads(x) for x in open(out + ".cells.jsonl")]
  assert [x["kind"] for x in lines[:2]] == ["meta", "run"]
  assert sorted(x["kind"] for x in lines[2:]) == ["fidelity", "fidelity"] + ["tasks"] * 4 + ["timing"]

  # the same command: every cell is done, the model is not loaded, the report is rewritten from the cells
  monkeypatch.setattr(rocketkv_jax.models, "load", _no_load)
  os.remove(out + ".md")
  assert main(argv) == 0
  err = " ".join(capsys.readouterr().err.split())
  assert "6 of 6 cells already done; skipping them" in err and "not loading the model" in err
  assert os.path.exists(out + ".md")
  res2 = json.load(open(out + ".json"))
  assert res2["tasks"] == res["tasks"] and res2["fidelity"] == res["fidelity"]
  assert res2["summary"] == res["summary"]
  monkeypatch.undo()

  # a run killed while writing its last row (rocketkv's fidelity, cut mid-line): only that cell is measured again
  text = open(out + ".cells.jsonl").read().splitlines()
  last = max(i for i, x in enumerate(text) if '"kind": "fidelity"' in x and '"rocketkv"' in x)
  cut = text[:last] + text[last + 1:] + [text[last][:40]]
  open(out + ".cells.jsonl", "w").write("\n".join(cut))
  assert main(argv) == 0
  err = " ".join(capsys.readouterr().err.split())
  assert "5 of 6 cells already done" in err and "measured 0 task rows and 1 fidelity rows" in err
  res3 = json.load(open(out + ".json"))
  assert res3["tasks"] == res["tasks"]
  new = {r["method"]: r for r in res3["fidelity"]}["rocketkv"]
  old = {r["method"]: r for r in res["fidelity"]}["rocketkv"]
  assert new["kl"] == pytest.approx(old["kl"], rel=1e-4, abs=1e-6) and new["top1"] == old["top1"]
  assert all(json.loads(x) for x in open(out + ".cells.jsonl"))  # the cut line was dropped, not kept mid-file
  monkeypatch.setattr(rocketkv_jax.models, "load", _no_load)
  assert main(argv) == 0
  assert "6 of 6 cells already done" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags, message", [
    (["--contexts", "16q"], "'16q' is not a token count"),
    (["--contexts", "1k", "--budgets", "8"], "below the minimum 16"),
    (["--contexts", "1k", "--methods", "full,nope"], "unknown method 'nope'"),
    (["--contexts", "1k", "--methods", "rocketkv[bogus=1]"], "'bogus' is not an option of rocketkv"),
    (["--contexts", "1k", "--modes", "aware,blind"], "--modes aware,blind: choose from aware,agnostic"),
    (["--contexts", "1k", "--tasks", "passkey,riddles"], "unknown task(s) 'riddles'"),
    (["--contexts", "1k", "--samples", "0", "--fid-samples", "0"], "nothing to measure"),
    (["--contexts", "1k,256", "--fid-tail", "256"], "--fid-tail 256 must be shorter"),
])
def test_eval_bad_flags_exit_2_before_loading(flags, message, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(rocketkv_jax.models, "load", _no_load)
  try:
    rc = main(["eval", "--model", str(tmp_path / "no_such_model"), "--out", str(tmp_path / "x"), *flags])
  except SystemExit as e:  # argparse's usage errors
    rc = e.code
  assert rc == 2
  assert message in " ".join(capsys.readouterr().err.split())


def test_eval_refuses_cells_of_other_settings(hf_dir, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(rocketkv_jax.models, "load", _no_load)
  out = tmp_path / "ev"
  (out.parent / "ev.cells.jsonl").write_text(json.dumps({"kind": "meta", "version": 1, "settings": {
      "model": hf_dir, "dtype": "bfloat16", "max_new": 4, "chat": "off", "fid_tail": 8, "no_diag": False,
      "impl": "auto"}}) + "\n")
  rc = main(["eval", "--model", hf_dir, "--contexts", "512", "--max-new", "4", "--fid-tail", "8", "--out", str(out)])
  assert rc == 2
  assert "other settings (dtype: 'bfloat16' there, 'float32' now)" in " ".join(capsys.readouterr().err.split())


def test_eval_context_beyond_max_len_exits_2(hf_dir, tmp_path, capsys):
  rc = main(["eval", "--model", hf_dir, "--contexts", "1k", "--samples", "1", "--fid-samples", "0",
             "--out", str(tmp_path / "ev"), "--no-compile-cache"])
  assert rc == 2
  assert "exceed the model's max_len 1024" in " ".join(capsys.readouterr().err.split())
  assert not os.path.exists(tmp_path / "ev.cells.jsonl")


def test_eval_runs_the_suites_one_driver(tmp_path, monkeypatch):
  """`rocketkv eval` is the suite's own driver (runner.evaluate) with the CLI's flags, not a copy of it."""
  from rocketkv_jax.eval import runner
  seen = {}
  monkeypatch.setattr(runner, "evaluate", lambda args, out, **kw: seen.update(args=args, out=out, **kw))
  assert main(["eval", "--contexts", "1k", "--budgets", "64", "--out", str(tmp_path / "x")]) == 0
  assert seen["out"] == str(tmp_path / "x") and seen["command"].startswith("rocketkv eval --contexts 1k ")
  assert seen["args"].methods == runner.DEFAULT_METHODS and seen["args"].budgets == (64,)
  assert seen["args"].contexts == (1024,) and callable(seen["load_model"])
