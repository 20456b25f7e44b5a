"""`rocketkv generate` end to end on a tiny GGUF written by the loader tests."""

import json

from rocketkv_jax.serving.cli import main

from tests.models.test_loaders import write_gguf


def test_generate_json(tmp_path, capsys):
  path = write_gguf(str(tmp_path / "tiny.gguf"))
  args = ["generate", "--model", path, "--method", "rocketkv", "--token-budget", "64", "--max-new-tokens", "5",
          "--prompt", "the cat sat on the mat and then the cat sat again", "--json", "--no-cache"]
  assert main(args) == 0
  out = json.loads(capsys.readouterr().out)
  assert set(out) == {"text", "token_ids", "stats"}
  assert 1 <= len(out["token_ids"]) <= 5
  assert out["stats"]["method"] == "rocketkv" and out["stats"]["kv_bytes"] > 0


def test_generate_reports_missing_model(tmp_path, capsys):
  assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 1
  assert "not found" in capsys.readouterr().err


def test_generate_reads_the_prompt_from_stdin(tmp_path, capsys, monkeypatch):
  import io
  path = write_gguf(str(tmp_path / "tiny.gguf"))
  prompt = "the cat sat on the mat and then the cat sat again"
  monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
  common = ["generate", "--model", path, "--method", "full", "--max-new-tokens", "3", "--json", "--no-cache"]
  assert main(common + ["--prompt-file", "-"]) == 0
  from_stdin = json.loads(capsys.readouterr().out)
  assert main(common + ["--prompt", prompt]) == 0
  assert json.loads(capsys.readouterr().out)["token_ids"] == from_stdin["token_ids"]
  assert from_stdin["stats"]["prompt_tokens"][0] > 5
