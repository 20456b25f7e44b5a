"""Makes tests/models/data/hf_tiny/<name>/: tiny random HF checkpoints and their transformers reference outputs.

Each folder is a HF model directory (config.json, generation_config.json, model.safetensors in float32, a toy
tokenizer.json) plus reference.npz, so the loader (models/safetensors_hf.py) can be tested per model family against an
independent implementation (HF transformers, PyTorch, CPU, float32, eager attention):

  llama              LlamaForCausalLM, default RoPE (theta 10000), untied lm_head
  llama_rope_llama3  LlamaForCausalLM, rope_scaling llama3 (theta 500000, factor 8,
                     original_max_position_embeddings 64 so the scaling changes this head_dim's
                     frequencies: some are divided by the factor, one is smoothed), tied embeddings
  qwen2_tied         Qwen2ForCausalLM (bias on q/k/v), tie_word_embeddings=True, theta 1e6
  qwen2_untied       Qwen2ForCausalLM (bias on q/k/v), tie_word_embeddings=False, theta 1e6
  mistral            MistralForCausalLM, sliding_window=None (no sliding window at all; even a window
                     >= prompt + new tokens = 44 would change nothing here), theta 1e6

Every model: vocab 192, hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16, intermediate 96,
max_position_embeddings 512. Weights are drawn from a seeded torch.Generator (not the HF init, which zeroes
biases and sets norms to 1): matrices and embeddings N(0, 0.2^2), RMSNorm weights 1 + N(0, 0.2^2) (the final
norm 3x that, for larger logits), q/k/v biases N(0, 0.2^2), so a loader that drops a bias, a norm or swaps a projection fails clearly, and greedy
choices are decisive (the script prints each model's smallest top-1/top-2 logit gap along the greedy paths).
bos/eos/pad ids are None, so generation never stops early: every greedy row has exactly 20 tokens.

config.json is written in the layout of checkpoints on the Hugging Face Hub (Llama-3.x, Qwen2.5, Mistral):
top-level "rope_theta" and "rope_scaling" (null without scaling). transformers >= 5 save_pretrained writes a
"rope_parameters" dict instead (rope_theta inside it, no top-level keys); that file is kept beside it as
config.transformers5.json (same weights, same reference) so a test can also check a loader on that layout.
The script checks that transformers loads both layouts back to identical logits.

tokenizer.json is a toy word-level tokenizer (token i is the word "t<i>"), only because the loader needs one;
the references are in token ids.

reference.npz:
  input_ids      int32 [2, 24]      two prompts (fixed seed), no padding, no BOS
  logits         float32 [2, 24, V] full-sequence logits of model(input_ids)
  greedy         int32 [2, 20]      model.generate(prompt, do_sample=False, max_new_tokens=20), one prompt at a time
  greedy_logits  float32 [2, 20, V] the logits each greedy token was chosen from (generate's output_logits)

Runs in its own venv outside the repo (torch and transformers are not project dependencies; Python 3.11
because the CPU torch wheel used is cp311):
    python3.11 -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0        # the CPU wheel (torch-2.13.0+cpu); not a CUDA build
    /tmp/hfref/bin/pip install transformers safetensors numpy
    /tmp/hfref/bin/python tests/models/data/make_hf_references.py
It rewrites every folder and hf_tiny/versions.json (transformers/torch/numpy/safetensors/python versions used).
Made with transformers 5.24.0 and torch 2.13.0+cpu; other versions may give other weights from the same seeds.
"""

import json
import os
import platform
import shutil
import sys
import tempfile

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "hf_tiny")

VOCAB = 192
PROMPT_LEN = 24
N_PROMPTS = 2
NEW_TOKENS = 20
STD = 0.2
FINAL_NORM = 3.0

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=512, hidden_act="silu", initializer_range=STD,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name: (config class, model class, config kwargs, seed)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 1),
    "llama_rope_llama3": (LlamaConfig, LlamaForCausalLM, dict(
        head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 2),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 3),
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM, dict(
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 4),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 5),
}


def randomize(model, seed):
  """Every parameter from one seeded generator: layer norms 1 + N(0, STD^2), the final norm FINAL_NORM times
  that (larger logits: wider top-1/top-2 gaps), everything else N(0, STD^2)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():  # tied lm_head/embed is one parameter, listed once
      r = torch.randn(p.shape, generator=g, dtype=torch.float32) * STD
      if name == "model.norm.weight":
        p.copy_(FINAL_NORM * (1.0 + r))
      elif name.endswith("norm.weight"):
        p.copy_(1.0 + r)
      else:
        p.copy_(r)


def hub_layout(cfg: dict) -> dict:
  """transformers-5 config dict -> the Hub layout (top-level rope_theta, rope_scaling; no rope_parameters)."""
  cfg = dict(cfg)
  rope = dict(cfg.pop("rope_parameters"))
  cfg["rope_theta"] = rope.pop("rope_theta")
  cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
  return dict(sorted(cfg.items()))


def toy_tokenizer_json() -> str:
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return tok.to_str()


def full_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def load_back(model_cls, d):
  return model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()


def make(name, cfg_cls, model_cls, kwargs, seed):
  d = os.path.join(OUT, name)
  shutil.rmtree(d, ignore_errors=True)
  cfg = cfg_cls(**COMMON, **kwargs)
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = model_cls(cfg).eval()
  randomize(model, seed)
  model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = None
  model.save_pretrained(d, safe_serialization=True)
  os.chmod(os.path.join(d, "model.safetensors"), 0o644)  # save_pretrained leaves it 0600

  # config.json -> Hub layout; transformers-5's own file kept beside it.
  cfg_path = os.path.join(d, "config.json")
  os.replace(cfg_path, os.path.join(d, "config.transformers5.json"))
  with open(os.path.join(d, "config.transformers5.json")) as f:
    saved = json.load(f)
  with open(cfg_path, "w") as f:
    json.dump(hub_layout(saved), f, indent=2)
    f.write("\n")
  with open(os.path.join(d, "tokenizer.json"), "w") as f:
    f.write(toy_tokenizer_json())

  rng = np.random.default_rng(1000 + seed)
  input_ids = rng.integers(0, VOCAB, size=(N_PROMPTS, PROMPT_LEN)).astype(np.int32)

  # The reference comes from the model as loaded back from the folder (Hub-layout config.json).
  ref = load_back(model_cls, d)
  logits = full_logits(ref, input_ids)
  np.testing.assert_array_equal(logits, full_logits(model, input_ids))
  with tempfile.TemporaryDirectory() as tmp:  # the transformers-5 layout loads to the same model
    for fn in os.listdir(d):
      shutil.copy(os.path.join(d, fn), tmp)
    shutil.copy(os.path.join(d, "config.transformers5.json"), os.path.join(tmp, "config.json"))
    np.testing.assert_array_equal(logits, full_logits(load_back(model_cls, tmp), input_ids))

  greedy, greedy_logits = [], []
  for row in input_ids:  # one prompt at a time: no padding
    with torch.no_grad():
      out = ref.generate(torch.as_tensor(row[None], dtype=torch.long), do_sample=False, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    new = out.sequences[0, PROMPT_LEN:].numpy()
    assert new.shape == (NEW_TOKENS,), new.shape
    greedy.append(new.astype(np.int32))
    greedy_logits.append(torch.stack(out.logits, 1)[0].float().numpy())
  greedy, greedy_logits = np.stack(greedy), np.stack(greedy_logits)
  assert (greedy_logits.argmax(-1) == greedy).all()
  # Self-check: the full forward over prompt + greedy tokens predicts the same tokens.
  seq = np.concatenate([input_ids, greedy], 1)
  relogits = full_logits(ref, seq)[:, PROMPT_LEN - 1:-1]
  assert (relogits.argmax(-1) == greedy).all(), name
  np.testing.assert_allclose(relogits, greedy_logits, atol=1e-4, rtol=1e-4)

  np.savez_compressed(os.path.join(d, "reference.npz"), input_ids=input_ids, logits=logits.astype(np.float32),
                      greedy=greedy, greedy_logits=greedy_logits.astype(np.float32))

  top2 = np.sort(greedy_logits, -1)[..., -2:]
  gap = float((top2[..., 1] - top2[..., 0]).min())
  top2f = np.sort(logits, -1)[..., -2:]
  gapf = float((top2f[..., 1] - top2f[..., 0]).min())
  size = sum(os.path.getsize(os.path.join(d, fn)) for fn in os.listdir(d))
  print(f"{name:18s} {size / 1024:7.1f} KiB  |logits| max {np.abs(logits).max():6.2f}  "
        f"min top1-top2 gap: greedy {gap:.4f}, prompt positions {gapf:.4f}")
  assert size < 1 << 20, (name, size)
  assert gap > 1e-3, (name, gap)


def main():
  transformers.utils.logging.disable_progress_bar()
  torch.use_deterministic_algorithms(True)
  os.makedirs(OUT, exist_ok=True)
  for name, (cfg_cls, model_cls, kwargs, seed) in MODELS.items():
    make(name, cfg_cls, model_cls, kwargs, seed)
  versions = {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
              "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
              "python": platform.python_version()}
  with open(os.path.join(OUT, "versions.json"), "w") as f:
    json.dump(versions, f, indent=2)
    f.write("\n")
  print(json.dumps(versions), file=sys.stderr)


if __name__ == "__main__":
  main()
