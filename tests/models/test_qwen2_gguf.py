"""Qwen2 GGUF files against Hugging Face transformers loading the very same file (its own dequantization, name
mapping and GGUF tokenizer): two tiny random Qwen2 GGUFs with 128-dim heads whose matrices are Q4_K, Q5_K, Q6_K,
Q5_0, Q8_0, F16 and F32 (tests/models/data/gguf_tiny/, made by tests/models/data/make_gguf_references.py), and,
when it has been fetched (`rocketkv fetch qwen2.5-1.5b`), the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M."""

import os
import unicodedata

import numpy as np
import pytest

from rocketkv_jax.models import catalog, generate, llama, load
from rocketkv_jax.models.gguf import read_gguf
from rocketkv_jax.models.weights import CheckpointError

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf_tiny")
REAL_REF = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_5_coder_1_5b_reference.npz")
TINY = ["qwen2_kquants", "qwen2_kquants_tied"]


def _ragged(ref, ids, offsets):
  flat, off = ref[ids], ref[offsets]
  return [flat[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def _check_tokenizer(tok, ref):
  # Qwen2's tokenizer NFC-normalizes (its tokenizer.json); transformers' GGUF tokenizer does not, so the
  # reference carries both: ours must equal the NFC one, and differ from the other only where NFC changes the text
  want = _ragged(ref, "tok_ids_nfc", "tok_offsets_nfc")
  got = [tok.encode(str(t)) for t in ref["tok_texts"]]
  assert got == want
  assert [tok.decode(ids, skip_special=False) for ids in got] == [unicodedata.normalize("NFC", str(t)) for t in ref["tok_texts"]]


@pytest.mark.parametrize("name", TINY)
def test_tiny_qwen2_gguf_matches_transformers(name):
  model, tok = load(os.path.join(DATA, f"{name}.gguf"), use_cache=False)
  cfg = model.config
  assert (cfg.model_type, cfg.qkv_bias, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads) == ("qwen2", True, 128, 2, 1)
  assert cfg.tie_embeddings == name.endswith("_tied") and cfg.rope_theta == 1e6
  ref = np.load(os.path.join(DATA, f"{name}_reference.npz"))
  logits = np.asarray(llama.forward_full(model, ref["input_ids"]))
  np.testing.assert_allclose(logits, ref["logits"], atol=1e-3, rtol=1e-4)  # logits up to ~40 in float32
  ids = [row.tolist() for row in ref["input_ids"]]
  res = generate(model, tok, ids, method="full", max_new_tokens=20)
  assert [t[:20] for t in res.token_ids] == ref["greedy"].tolist()
  res = generate(model, tok, ids, method="rocketkv", token_budget=64, max_new_tokens=20)
  assert [t[0] for t in res.token_ids] == ref["greedy"][:, 0].tolist()  # from the dense prefill's logits
  _check_tokenizer(tok, ref)
  for text, want in zip(ref["chat_texts"], _ragged(ref, "chat_ids", "chat_offsets")):
    assert tok.encode(str(text)) == want  # special tokens (<|im_start|>, ...) as single ids


def test_qwen2_layout_is_not_permuted():
  """llama.cpp permutes Q/K rows for 'llama' files only: the Q projection read from a qwen2 file is the file's
  rows as they are (transformers' reference passing above could not tell a permutation of both Q and K apart
  from none only if RoPE were absent; this pins the rule directly)."""
  import gguf
  path = os.path.join(DATA, "qwen2_kquants.gguf")
  _, params, _ = read_gguf(path)
  t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
  rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(256, 256)
  np.testing.assert_array_equal(params["layers/0/wq"], rows.T)


def test_unsupported_architecture_is_named(tmp_path):
  import gguf
  path = str(tmp_path / "phi.gguf")
  w = gguf.GGUFWriter(path, "phi3")
  w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match=r"general.architecture='phi3' is not supported: one of \['llama', 'qwen2'\]"):
    load(path, use_cache=False)


def _real_path():
  path = os.environ.get("ROCKETKV_QWEN_GGUF")
  if path:
    return path
  try:
    return catalog.resolve("qwen2.5-1.5b")
  except catalog.ModelNotFetched:
    pytest.skip("the real Qwen2.5-Coder-1.5B GGUF is not fetched (rocketkv fetch qwen2.5-1.5b)")


def test_real_qwen2_5_coder_1_5b_matches_transformers():
  """Greedy tokens equal to transformers on the real file (float32), up to the first near-tie of the reference,
  the top-1 token at every prompt position, and the real tokenizer."""
  path = _real_path()
  ref = np.load(REAL_REF)
  model, tok = load(path)
  cfg = model.config
  assert (cfg.head_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.qkv_bias) == (128, 28, 12, 2, True)
  prompts = _ragged(ref, "input_ids", "input_offsets")
  assert tok.encode(str(ref["prompts"][0])) == prompts[0]
  _check_tokenizer(tok, ref)
  offsets = ref["input_offsets"]
  for i, ids in enumerate(prompts):
    logits = np.asarray(llama.forward_full(model, np.asarray([ids], np.int32)))[0]
    top = ref["prompt_top_logits"][offsets[i]:offsets[i + 1]]
    decisive = top[:, 0] - top[:, 1] > 0.05
    assert (logits.argmax(-1)[decisive] == ref["prompt_top_ids"][offsets[i]:offsets[i + 1], 0][decisive]).all()
    res = generate(model, tok, [ids], method="full", max_new_tokens=24)
    got = res.token_ids[0]
    n = int(np.argmax(ref["greedy_gap"][i] < 0.05)) if (ref["greedy_gap"][i] < 0.05).any() else 24
    assert got[:n] == ref["greedy"][i, :n].tolist(), (i, n)
