"""Checkpoint loaders on small checkpoints written here: a tiny random Llama as a HF safetensors
directory (single file and sharded) and as a GGUF with llama.cpp's permuted Q/K; both must load to
the same model; the orbax cache round-trips; broken checkpoints raise clear errors."""

import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from rocketkv_jax.models import CheckpointError, forward_full, gguf_permute, gguf_unpermute, load
from rocketkv_jax.models.llama import apply_rope, rope_inv_freq
from rocketkv_jax.models.params import from_params, fuse_params
from tests.helpers.checkpoints import CFG, PARAMS, hf_tensors, write_gguf, write_hf_dir

def flat_params(model):
  out = {}

  def walk(d, pre):
    for k, v in d.items():
      if isinstance(v, dict):
        walk(v, pre + (str(k),))
      else:
        out["/".join(pre + (str(k),))] = np.asarray(v)
  walk(nnx.to_pure_dict(nnx.state(model)), ())
  return out


TOKS = np.array([[5, 77, 130, 260, 9, 31, 200, 4, 99, 123]], np.int32)


def test_gguf_permutation_inverse_and_rope_layout():
  rng = np.random.default_rng(0)
  n_head, hd, d_in = 3, 8, 5
  w = rng.standard_normal((n_head * hd, d_in)).astype(np.float32)
  # PLATFORM.md's forward permutation, literally.
  fwd = w.reshape(n_head, 2, hd // 2, d_in).swapaxes(1, 2).reshape(-1, d_in)
  np.testing.assert_array_equal(gguf_permute(w, n_head), fwd)
  np.testing.assert_array_equal(gguf_unpermute(gguf_permute(w, n_head), n_head), w)
  np.testing.assert_array_equal(gguf_permute(gguf_unpermute(w, n_head), n_head), w)
  # llama.cpp rotates adjacent pairs (2i, 2i+1) of the permuted rows with frequency i; un-permuting
  # that result must equal rotate-half RoPE on the original rows.
  x = rng.standard_normal(d_in).astype(np.float32)
  pos = 7
  inv = rope_inv_freq(hd, 10000.0, None)
  q_hf = np.asarray(apply_rope((w @ x).reshape(1, 1, n_head, hd), np.array([[pos]]), inv))[0, 0]
  q_cpp = (gguf_permute(w, n_head) @ x).reshape(n_head, hd // 2, 2)
  c, s = np.cos(pos * inv), np.sin(pos * inv)
  rot = np.stack([q_cpp[..., 0] * c - q_cpp[..., 1] * s, q_cpp[..., 0] * s + q_cpp[..., 1] * c], -1)
  back = gguf_unpermute(rot.reshape(n_head * hd, 1), n_head).reshape(n_head, hd)
  np.testing.assert_allclose(back, q_hf, atol=1e-5)


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_and_gguf_load_the_same_model(tmp_path, sharded):
  hf_model, hf_tok = load(write_hf_dir(str(tmp_path / "hf"), sharded=sharded), use_cache=False)
  gg_model, gg_tok = load(write_gguf(str(tmp_path / "tiny.gguf")), use_cache=False)
  assert hf_model.config == gg_model.config == CFG
  a, b = flat_params(hf_model), flat_params(gg_model)
  fused = fuse_params(CFG, PARAMS)
  assert a.keys() == b.keys() == fused.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    np.testing.assert_array_equal(a[k], fused[k], err_msg=k)
  np.testing.assert_array_equal(np.asarray(forward_full(hf_model, TOKS)), np.asarray(forward_full(gg_model, TOKS)))
  for text in ["the cat sat on the mat", "hello <|im_end|> world\n\n  12"]:
    assert hf_tok.encode(text) == gg_tok.encode(text)
  assert hf_tok.encode("hi", chat=True) == gg_tok.encode("hi", chat=True)
  assert gg_tok.chat_eos_id == 2


def test_orbax_cache_roundtrip(tmp_path):
  """GGUF conversion (dequantization) is cached; safetensors stream with no converted copy."""
  src = write_gguf(str(tmp_path / "tiny.gguf"))
  logs = []
  m1, t1 = load(src, cache_dir=str(tmp_path / "cache"), log=logs.append)
  assert any("saved converted weights" in m for m in logs), logs
  logs.clear()
  m2, t2 = load(src, cache_dir=str(tmp_path / "cache"), log=logs.append)
  assert any("loaded converted weights" in m for m in logs), logs
  assert m1.config == m2.config
  np.testing.assert_array_equal(np.asarray(forward_full(m1, TOKS)), np.asarray(forward_full(m2, TOKS)))
  assert t1.encode("the cat", chat=True) == t2.encode("the cat", chat=True)
  hf = write_hf_dir(str(tmp_path / "hf"))
  logs.clear()
  load(hf, cache_dir=str(tmp_path / "cache2"), log=logs.append)
  assert not os.path.exists(tmp_path / "cache2") and not any("converted" in m for m in logs), logs


def test_from_params_fuses_the_loader_layout():
  D, N, K, H, F = CFG.dim, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.ffn_dim
  model = from_params(CFG, PARAMS)
  got = flat_params(model)
  for i in range(CFG.n_layers):
    lp = f"layers/{i}/"
    assert got[lp + "wqkv"].shape == (D, (N + 2 * K) * H) and got[lp + "w_gate_up"].shape == (D, 2 * F)
    np.testing.assert_array_equal(got[lp + "wqkv"][:, :N * H], PARAMS[lp + "wq"])
    np.testing.assert_array_equal(got[lp + "wqkv"][:, N * H:(N + K) * H], PARAMS[lp + "wk"])
    np.testing.assert_array_equal(got[lp + "wqkv"][:, (N + K) * H:], PARAMS[lp + "wv"])
    np.testing.assert_array_equal(got[lp + "w_gate_up"][:, :F], PARAMS[lp + "w_gate"])
    np.testing.assert_array_equal(got[lp + "w_gate_up"][:, F:], PARAMS[lp + "w_up"])
  # an already fused dict (flat or nested) builds the same model
  again = from_params(CFG, got)
  for k, v in flat_params(again).items():
    np.testing.assert_array_equal(v, got[k], err_msg=k)
  np.testing.assert_array_equal(np.asarray(forward_full(model, TOKS)), np.asarray(forward_full(again, TOKS)))
  nested = from_params(CFG, nnx.to_pure_dict(nnx.state(model)))
  np.testing.assert_array_equal(np.asarray(forward_full(model, TOKS)), np.asarray(forward_full(nested, TOKS)))


def test_from_params_errors_name_the_layout_given():
  p = dict(PARAMS)
  del p["layers/1/wk"]
  with pytest.raises(ValueError, match=r"missing \['layers/1/wk'\]"):
    from_params(CFG, p)
  p = dict(PARAMS, **{"layers/0/w_up": PARAMS["layers/0/w_up"][:, :-1]})
  with pytest.raises(ValueError, match=r"layers/0/w_up: shape"):
    from_params(CFG, p)
  p = dict(PARAMS, **{"layers/0/wqkv": np.zeros((CFG.dim, 3))})
  with pytest.raises(ValueError, match=r"unexpected \['layers/0/wqkv'\]"):
    from_params(CFG, p)
  fused = fuse_params(CFG, PARAMS)
  with pytest.raises(ValueError, match=r"layers/1/w_gate_up: shape"):
    from_params(CFG, dict(fused, **{"layers/1/w_gate_up": fused["layers/1/w_gate_up"][:, 1:]}))
  del fused["layers/0/wqkv"]
  with pytest.raises(ValueError, match=r"missing \['layers/0/wqkv'\]"):
    from_params(CFG, fused)


def test_truncated_gguf_raises_clear_error(tmp_path):
  path = write_gguf(str(tmp_path / "tiny.gguf"))
  data = open(path, "rb").read()
  for cut in (len(data) // 2, 100):
    bad = str(tmp_path / f"cut{cut}.gguf")
    open(bad, "wb").write(data[:cut])
    with pytest.raises(CheckpointError, match="cut"):
      load(bad, use_cache=False)
  garbage = str(tmp_path / "garbage.gguf")
  open(garbage, "wb").write(b"not a gguf file at all" * 10)
  with pytest.raises(CheckpointError, match="garbage.gguf"):
    load(garbage, use_cache=False)


def test_broken_hf_dirs_raise_clear_errors(tmp_path):
  with pytest.raises(CheckpointError, match="not found"):
    load(str(tmp_path / "nope"), use_cache=False)
  d = write_hf_dir(str(tmp_path / "trunc"))
  f = os.path.join(d, "model.safetensors")
  data = open(f, "rb").read()
  open(f, "wb").write(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors"):
    load(d, use_cache=False)
  d = write_hf_dir(str(tmp_path / "noconfig"))
  os.remove(os.path.join(d, "config.json"))
  with pytest.raises(CheckpointError, match="config.json"):
    load(d, use_cache=False)
  d = write_hf_dir(str(tmp_path / "badjson"))
  open(os.path.join(d, "config.json"), "w").write("{not json")
  with pytest.raises(CheckpointError, match="malformed"):
    load(d, use_cache=False)
  d = write_hf_dir(str(tmp_path / "shard"), sharded=True)
  os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
  with pytest.raises(CheckpointError, match="model-00002-of-00002"):
    load(d, use_cache=False)
  d = write_hf_dir(str(tmp_path / "missing"))
  t = hf_tensors(CFG, PARAMS)
  del t["model.layers.1.mlp.up_proj.weight"]
  save_file(t, os.path.join(d, "model.safetensors"))
  with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
    load(d, use_cache=False)
  d = write_hf_dir(str(tmp_path / "notok"))
  os.remove(os.path.join(d, "tokenizer.json"))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load(d, use_cache=False)
