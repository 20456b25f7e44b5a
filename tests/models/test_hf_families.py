"""Checkpoint families against Hugging Face transformers: tiny random Llama (plain and llama3 RoPE scaling),
Qwen2 (q/k/v biases, tied and untied embeddings) and Mistral checkpoints in tests/models/data/hf_tiny/, with
the full-sequence logits and greedy tokens transformers gave (tests/models/data/make_hf_references.py makes
them). Loaded by path, by hub id from a fake Hugging Face cache, and from transformers 5's config layout."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax.models import generate, llama, load
from rocketkv_jax.models.weights import CheckpointError

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
FAMILIES = ["llama", "llama_rope_llama3", "qwen2_tied", "qwen2_untied", "mistral"]


def check_logits(model, name):
  ref = np.load(os.path.join(DATA, name, "reference.npz"))
  logits = np.asarray(llama.forward_full(model, ref["input_ids"]))
  np.testing.assert_allclose(logits, ref["logits"], atol=2e-4, rtol=1e-4)
  return ref


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name):
  model, tok = load(os.path.join(DATA, name), use_cache=False)
  assert model.config.model_type == name.split("_")[0]
  assert model.config.qkv_bias == name.startswith("qwen2")
  ref = check_logits(model, name)
  ids = [row.tolist() for row in ref["input_ids"]]
  res = generate(model, tok, ids, method="full", max_new_tokens=20)
  assert [t[:20] for t in res.token_ids] == ref["greedy"].tolist()  # the whole cache: transformers' tokens
  res = generate(model, tok, ids, method="rocketkv", token_budget=64, max_new_tokens=20)
  assert [t[0] for t in res.token_ids] == ref["greedy"][:, 0].tolist()  # from the dense prefill's logits


def test_transformers5_config_layout(tmp_path):
  """transformers 5 writes rope_theta / rope_scaling inside rope_parameters: read them there."""
  d = tmp_path / "llama3"
  shutil.copytree(os.path.join(DATA, "llama_rope_llama3"), d)
  shutil.copy(d / "config.transformers5.json", d / "config.json")
  model, _ = load(str(d), use_cache=False)
  assert model.config.rope_scaling is not None and model.config.rope_theta == 500000.0
  check_logits(model, "llama_rope_llama3")


def fake_hub(root, repo_id, name):
  """The layout huggingface_hub caches a repo in: models--org--name/{refs/main, snapshots/<hash>/files}."""
  base = root / ("models--" + repo_id.replace("/", "--"))
  snap = base / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
  shutil.copytree(os.path.join(DATA, name), snap)
  (base / "refs").mkdir()
  (base / "refs" / "main").write_text(snap.name)


def test_load_by_hub_id_from_the_local_cache(tmp_path, monkeypatch):
  fake_hub(tmp_path / "hub", "tiny-org/qwen2-tiny", "qwen2_untied")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  model, _ = load("tiny-org/qwen2-tiny", use_cache=False)
  check_logits(model, "qwen2_untied")
  with pytest.raises(CheckpointError, match=r"'tiny-org/absent' is not in the local Hugging Face cache "
                                            r"\(looked in .*hub\); download it first: `hf download tiny-org/absent`"):
    load("tiny-org/absent", use_cache=False)
  monkeypatch.delenv("HF_HUB_CACHE")
  monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
  model, _ = load("tiny-org/qwen2-tiny", use_cache=False)
  check_logits(model, "qwen2_untied")


def test_unsupported_family_and_dtype_auto(tmp_path):
  d = tmp_path / "m"
  shutil.copytree(os.path.join(DATA, "mistral"), d)
  cfg = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
  with pytest.raises(CheckpointError, match=r"model_type='gpt2' is not supported: one of \['llama', 'mistral', "
                                            r"'qwen2'\]"):
    load(str(d), use_cache=False)
  (d / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16")))
  model, _ = load(str(d), dtype="auto", use_cache=False)
  assert model.dtype == jnp.bfloat16
  (d / "config.json").write_text(json.dumps(dict(cfg, sliding_window=16)))
  model, _ = load(str(d), use_cache=False)
  assert model.config.max_len == 16  # attention over a window: sequences capped there


def test_generation_config_defaults(tmp_path):
  """generation_config.json's sampling values and eos ids become the defaults of generate (and the server, the
  CLI); values given explicitly win; do_sample: false means greedy."""
  import json
  from rocketkv_jax.models.generate import sampling_defaults, stop_ids
  d = tmp_path / "qwen2"
  shutil.copytree(os.path.join(DATA, "qwen2_tied"), d)
  (d / "generation_config.json").write_text(json.dumps(
      {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": [7, 9]}))
  model, tok = load(str(d), use_cache=False)
  assert tok.generation == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_ids": [7, 9]}
  assert sampling_defaults(tok) == (0.7, 0.8) and sampling_defaults(tok, 0.0, None) == (0.0, 0.8)
  assert {7, 9} <= set(stop_ids(model, tok, chat=False))
  ids = [[1, 2, 3, 4, 5]]
  sampled = generate(model, tok, ids, max_new_tokens=8, seed=3)
  assert sampled.token_ids == generate(model, tok, ids, max_new_tokens=8, seed=3, temperature=0.7, top_p=0.8).token_ids
  (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
  _, tok = load(str(d), use_cache=False)
  assert tok.generation == {"temperature": 0.0}
  (d / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
  with pytest.raises(ValueError, match="temperature='hot' must be a number"):
    load(str(d), use_cache=False)
