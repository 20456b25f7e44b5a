"""Hugging Face checkpoint directories (safetensors, sharded or not; model_type llama, mistral, qwen2): the
config.json reader (`_hf_config`) and `stream_hf_dir`, which streams the tensors from the memory-mapped files to
the device, cast there, so host memory stays near one tensor.
"""

from __future__ import annotations

import glob
import json
import math
import os

from .checkpoint import CheckpointError, layer_tensors
from .llama import MODEL_TYPES, LlamaConfig
from .tokenizer import tokenizer_from_hf_dir


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

  from .llama import Llama
  from .params import unflatten_params
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
