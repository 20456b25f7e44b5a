"""Small checkpoints written here: the tiny random Llama (`CFG`, `PARAMS`) as a HF safetensors directory
(single file or sharded, `write_hf_dir`) and as a GGUF with llama.cpp's permuted Q/K (`write_gguf`), with a
tiny byte-level BPE vocabulary and a ChatML template."""

import json
import os

import numpy as np
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers

from rocketkv_jax.models import gguf_permute
from rocketkv_jax.models.tokenizer import tokenizer_from_gguf_metadata
from tests.models.conftest import tiny_config, tiny_params

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_vocab(size=300):
  """(tokens, token types, merges) of a byte-level BPE vocabulary of `size` tokens, the specials first."""
  tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = []
  for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
               ("r", "e"), ("a", "t"), ("Ġ", "w"), ("in", "g"), ("Ġ", "c"), ("o", "r"), ("e", "n")]:
    if len(tokens) >= size:
      break
    merges.append(f"{a} {b}")
    tokens.append(a + b)
  while len(tokens) < size:
    tokens.append(f"<unused{len(tokens)}>")
  types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
  return tokens, types, merges


CFG = tiny_config(vocab_size=300)
PARAMS = tiny_params(CFG, seed=11)


def hf_tensors(cfg, p):
  """Our flat parameters `p` under their HF Llama names, matrices transposed to HF's (out, in) layout."""
  t = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"],
       "lm_head.weight": np.ascontiguousarray(p["lm_head"].T)}
  names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
           "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj",
           "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
  for i in range(cfg.n_layers):
    for ours, hf in names.items():
      w = p[f"layers/{i}/{ours}"]
      t[f"model.layers.{i}.{hf}.weight" if "norm" in ours else f"model.layers.{i}.{hf}.weight"] = (
          w if w.ndim == 1 else np.ascontiguousarray(w.T))
  return t


def write_hf_dir(d, sharded=False):
  """Writes CFG / PARAMS as a HF checkpoint directory `d` (config, safetensors, tokenizer); returns `d`."""
  os.makedirs(d, exist_ok=True)
  cfg = CFG
  json.dump(dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
                 num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                 intermediate_size=cfg.ffn_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                 tie_word_embeddings=False, max_position_embeddings=cfg.max_len, bos_token_id=1,
                 eos_token_id=2), open(os.path.join(d, "config.json"), "w"))
  tensors = hf_tensors(cfg, PARAMS)
  if sharded:
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fn, ns in shards.items():
      save_file({n: tensors[n] for n in ns}, os.path.join(d, fn))
    json.dump({"weight_map": {n: fn for fn, ns in shards.items() for n in ns}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
  else:
    save_file(tensors, os.path.join(d, "model.safetensors"))
  tokens, types, merges = tiny_vocab(cfg.vocab_size)
  tokenizer_from_gguf_metadata(tokens, types, merges, "default").save(os.path.join(d, "tokenizer.json"))
  json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
  return d


def write_gguf(path):
  """Writes CFG / PARAMS as a llama GGUF at `path` (Q/K permuted as llama.cpp does); returns `path`."""
  import gguf
  cfg, p = CFG, PARAMS
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.n_layers)
  w.add_context_length(cfg.max_len)
  w.add_embedding_length(cfg.dim)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  tokens, types, merges = tiny_vocab(cfg.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template(CHATML)
  w.add_tensor("token_embd.weight", p["embed"])
  w.add_tensor("output_norm.weight", p["norm"])
  w.add_tensor("output.weight", np.ascontiguousarray(p["lm_head"].T))
  for i in range(cfg.n_layers):
    g = lambda n: p[f"layers/{i}/{n}"]  # noqa: E731
    b = f"blk.{i}."
    w.add_tensor(b + "attn_norm.weight", g("attn_norm"))
    w.add_tensor(b + "attn_q.weight", gguf_permute(np.ascontiguousarray(g("wq").T), cfg.n_heads))
    w.add_tensor(b + "attn_k.weight", gguf_permute(np.ascontiguousarray(g("wk").T), cfg.n_kv_heads))
    w.add_tensor(b + "attn_v.weight", np.ascontiguousarray(g("wv").T))
    w.add_tensor(b + "attn_output.weight", np.ascontiguousarray(g("wo").T))
    w.add_tensor(b + "ffn_norm.weight", g("mlp_norm"))
    w.add_tensor(b + "ffn_gate.weight", np.ascontiguousarray(g("w_gate").T))
    w.add_tensor(b + "ffn_up.weight", np.ascontiguousarray(g("w_up").T))
    w.add_tensor(b + "ffn_down.weight", np.ascontiguousarray(g("w_down").T))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
