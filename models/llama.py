"""Flax NNX Llama (RMSNorm, SwiGLU, GQA, rotate-half RoPE with Llama-3 scaling) wired to the KV core.

Shape letters follow `rocketkv_jax.shapes`: B batch, T tokens, N query heads, K KV heads, G = N/K,
H head dim, D model dim, F MLP hidden, V vocab, S cache slots, L layers.

Every layer owns separate weight buffers and the layer loop is a Python loop, unrolled under jit:
stacking layers and scanning made a whole decode step ~3x slower on an H200 (PLATFORM.md).

Public functions:
  logits_BV, caches = prefill(model, tokens_BT, lengths_B, config)
  logits_BV, caches = decode(model, tokens_B, caches, config)          # one step; caches donated
  logits_BTV = forward_full(model, tokens_BT)
  logits_BV, layer_qkv = prefill_dense(model, tokens_BT, lengths_B)
  caches = compress_layers(layer_qkv, lengths_B, config)
  prefill_jit / prefill_dense_jit: the jitted forms over nnx.split(model), for AOT lowering.
The decode step's pieces, which `decode_body` composes (and the accuracy suite's diagnostic reuses):
  x_BD = embed_tokens(model, tokens_B)
  step = decode_layer(blk, cfg, x_B1D, delta_B1D, cache, config)      # one layer: LayerStep
  logits_BV = final_logits(model, x_B1D, delta_B1D, impl)
The one multi-token decode loop (sampling, stop ids, teacher forcing) is `models/loop.py`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rocketkv_jax import decode_step, ops, prefill_compress

from . import layer_ops
from .sharding import WHOLE, active_mesh, constrain_cache, per_shard

__all__ = [
    "LlamaConfig", "Llama", "LayerStep", "prefill", "prefill_jit", "prefill_layer", "decode", "decode_body", "forward_full",
    "prefill_dense", "prefill_dense_jit", "compress_layers", "embed_tokens", "decode_layer", "final_logits",
    "add_norm", "rope_heads", "prefill_qkv", "over_token_chunks", "rope_inv_freq", "apply_rope", "rms_norm",
    "causal_attention", "blocked_causal_attention", "prefill_extend",
    "prefill_extend_layer_jit", "extend_attention", "place_rows", "PromptScores", "score_tokens", "prefill_chunk",
    "prefill_chunk_layer_jit", "offset_attention",
]

# The checkpoint families this model runs: Llama 2/3.x, Mistral (the same layers) and Qwen2 / Qwen2.5 (q/k/v biases).
MODEL_TYPES = ("llama", "mistral", "qwen2")

# Prompts longer than this use the query-block (flash-style) path on CPU, so no [T, T] scores.
DENSE_ATTENTION_MAX_T = 1024
ATTENTION_BLOCK = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Architecture of a Llama checkpoint; frozen and hashable so it can be a static jit argument.

  `rope_scaling` is None or a sorted tuple of (key, value) pairs of the HF `rope_scaling` dict
  (types "llama3" and "linear" are supported). `qkv_bias`: the q/k/v projections have biases (Qwen2).
  `model_type`: the checkpoint's family ("llama", "mistral", "qwen2"), recorded for messages.
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_len: int = 8192
  bos_id: int | None = None
  eos_id: int | None = None
  qkv_bias: bool = False
  model_type: str = "llama"

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                 "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    for name in ("rope_theta", "norm_eps"):
      value = getattr(self, name)
      if not _is_positive_real(value):
        raise ValueError(f"{name}={value!r} must be a positive finite number")
    for name in ("tie_embeddings", "qkv_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model_type={self.model_type!r} is not supported: one of {MODEL_TYPES}")
    for name in ("bos_id", "eos_id"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name}={value!r} must be None or a token id (an int >= 0)")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
    if self.rope_scaling is not None:
      self._check_rope_scaling()

  def _check_rope_scaling(self):
    try:
      s = dict(self.rope_scaling)
    except (TypeError, ValueError):
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None, a dict or a tuple of (key, value) "
                       "pairs") from None
    kind = s.get("rope_type", s.get("type"))
    if kind not in ("llama3", "linear", "default", "factors"):
      raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear, factors, default)")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind, ())
    for key in need:
      if key not in s:
        raise ValueError(f"rope_scaling of type {kind!r} needs the key {key!r} (given {sorted(s)})")
      if not _is_positive_real(s[key]):
        raise ValueError(f"rope_scaling[{key!r}]={s[key]!r} must be a positive finite number")
    if kind == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
      raise ValueError(f"rope_scaling: high_freq_factor={s['high_freq_factor']!r} must be greater than "
                       f"low_freq_factor={s['low_freq_factor']!r}")
    if kind == "factors":
      factors = s.get("factors")
      if (not isinstance(factors, (tuple, list)) or len(factors) != self.head_dim // 2
          or not all(_is_positive_real(f) for f in factors)):
        raise ValueError(f"rope_scaling['factors'] must be {self.head_dim // 2} (head_dim / 2) positive numbers, "
                         f"got {str(factors)[:80]}")

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
    return json.dumps(d)

  @classmethod
  def from_json(cls, text: str) -> "LlamaConfig":
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"LlamaConfig JSON is malformed: {e}") from e
    if not isinstance(d, dict):
      raise ValueError(f"LlamaConfig JSON must be an object, got {type(d).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    if set(d) - fields:
      raise ValueError(f"LlamaConfig JSON has unknown keys {sorted(set(d) - fields)}")
    try:
      return cls(**d)
    except TypeError as e:  # a required field is missing
      raise ValueError(f"LlamaConfig JSON: {e}") from e


def _is_positive_real(v) -> bool:
  return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
          and math.isfinite(v) and v > 0)


def _freeze(d: dict) -> tuple:
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
  """Inverse frequencies [H/2] (float64 numpy, a trace-time constant), with HF's Llama-3 scaling."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv
  s = dict(scaling)
  kind = s.get("rope_type", s.get("type"))
  if kind == "linear":
    return inv / s["factor"]
  if kind == "factors":  # GGUF rope_freqs: per-frequency divisors (llama.cpp's Llama-3.1 form)
    return inv / np.asarray(s["factors"], np.float64)
  if kind == "llama3":
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)
  return inv


def apply_rope(x_BTXH: jax.Array, pos_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotate-half RoPE (HF convention): pairs channel i with channel i + H/2 (`layer_ops.rope`, the
  semantics the decode step's fused `qkv_rope` kernel computes)."""
  return layer_ops.rope(x_BTXH, pos_BT, jnp.asarray(inv_freq, jnp.float32))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm(x) * w over the last axis (`layer_ops.rms_norm`: `add_rms_norm`'s semantics)."""
  return layer_ops.rms_norm(x, w, eps=eps)


class Block(nnx.Module):
  """One decoder layer; weights stored [in, out] (HF Linear weights transposed).

  The q/k/v projections are one fused kernel `wqkv` [D, (N + 2K) * H] (q heads, then k heads, then
  v heads) and gate/up one `w_gate_up` [D, 2F] (gate, then up): in batch-1 decode on an H200 the
  separate small k and v matvecs ran as slow reduce fusions, one wider GEMM runs near bandwidth.
  """

  def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    D, N, K, H, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    init = nnx.initializers.normal(0.02)
    self.attn_norm = nnx.Param(jnp.ones((D,), dtype))
    self.wqkv = nnx.Param(init(rngs.params(), (D, (N + 2 * K) * H), dtype))
    if cfg.qkv_bias:  # Qwen2: q, k, v biases, fused like the kernels
      self.bqkv = nnx.Param(jnp.zeros(((N + 2 * K) * H,), dtype))
    self.wo = nnx.Param(init(rngs.params(), (N * H, D), dtype))
    self.mlp_norm = nnx.Param(jnp.ones((D,), dtype))
    self.w_gate_up = nnx.Param(init(rngs.params(), (D, 2 * F), dtype))
    self.w_down = nnx.Param(init(rngs.params(), (F, D), dtype))


class Llama(nnx.Module):
  """Llama decoder. `config` is a static LlamaConfig; `layers` are separate per-layer buffers."""

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, config.dim), dtype))
    self.layers = nnx.List([Block(config, dtype=dtype, rngs=rngs) for _ in range(config.n_layers)])
    self.norm = nnx.Param(jnp.ones((config.dim,), dtype))
    if not config.tie_embeddings:
      self.lm_head = nnx.Param(init(rngs.params(), (config.dim, config.vocab_size), dtype))

  @property
  def dtype(self):
    return self.embed[...].dtype


# ----------------------------------------------------------------------------- layer pieces


def embed_tokens(model: Llama, tokens) -> jax.Array:
  """The embedding rows of `tokens` (any shape): [..., D] in the model's dtype."""
  return jnp.take(model.embed[...], tokens, axis=0)


def add_norm(x, delta, w, eps: float, impl: str = "xla"):
  """(h, normed) [..., D]: the residual h = x + delta (h = x when delta is None) and rms_norm(h, w, eps),
  through `layer_ops.add_rms_norm`. With kernels (`ops.uses_kernels(impl)`) one kernel runs over the
  rows; otherwise the op's reference runs on the arrays' own shapes (the decode step's [B, 1, D]: in bf16,
  XLA's excess-precision rewrites depend on the shapes, and the XLA path keeps the numbers it always had)."""
  if ops.uses_kernels(impl):
    rows = lambda a: None if a is None else a.reshape(-1, a.shape[-1])  # noqa: E731
    h, normed = layer_ops.add_rms_norm(rows(x), rows(delta), w, eps=eps, impl=impl)
    return h.reshape(x.shape), normed.reshape(x.shape)
  return layer_ops.add_rms_norm(x, delta, w, eps=eps, impl="xla")


def _logits(model: Llama, normed_BD: jax.Array) -> jax.Array:
  cfg = model.config
  w = model.embed[...].T if cfg.tie_embeddings else model.lm_head[...]
  return jnp.dot(normed_BD, w, preferred_element_type=jnp.float32)


def _head(model: Llama, x_BD: jax.Array) -> jax.Array:
  return _logits(model, rms_norm(x_BD, model.norm[...], model.config.norm_eps))


def rope_heads(cfg: LlamaConfig, qkv_BTX, pos_BT):
  """The fused projection [B, T, (N + 2K) * H] split into q [B, T, N, H], k and v [B, T, K, H], q and k
  rotated (XLA)."""
  B, T, _ = qkv_BTX.shape
  inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  q, k, v = jnp.split(qkv_BTX, [nq, nq + nk], axis=-1)
  q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
  k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
  v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
  return apply_rope(q, pos_BT, inv), apply_rope(k, pos_BT, inv), v


def _qkv_projection(blk: Block, cfg: LlamaConfig, normed):
  """The fused q/k/v projection [..., (N + 2K) * H] of normed inputs, with the biases where the model has them."""
  qkv = normed @ blk.wqkv[...]
  return qkv + blk.bqkv[...] if cfg.qkv_bias else qkv


def prefill_qkv(blk: Block, cfg: LlamaConfig, x_BTD, pos_BT):
  """q [B, T, N, H], k and v [B, T, K, H] of a layer's input x [B, T, D] at positions pos [B, T] (XLA)."""
  h = rms_norm(x_BTD, blk.attn_norm[...], cfg.norm_eps)
  return rope_heads(cfg, _qkv_projection(blk, cfg, h), pos_BT)


def _decode_qkv(blk: Block, cfg: LlamaConfig, normed_B1D, pos_B, impl: str):
  """q [B, N, H], k and v [B, K, H] of one token per row from the attention-normed input [B, 1, D]: the
  projection, then `layer_ops.qkv_rope` (one kernel with kernels; else its reference, which computes
  exactly `rope_heads`' numbers: tests/models/test_decode_kernels.py)."""
  return _rope_split(cfg, _qkv_projection(blk, cfg, normed_B1D)[:, 0], pos_B, impl)


def _rope_split(cfg: LlamaConfig, qkv_BX, pos_B, impl: str):
  inv = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), jnp.float32)
  return layer_ops.qkv_rope(qkv_BX, pos_B, inv, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                            head_dim=cfg.head_dim, impl=impl)


def _attn_out(blk: Block, attn_XNH, dtype):
  """The attention output [..., N, H] projected back to the residual stream [..., D] in its dtype."""
  return attn_XNH.reshape(*attn_XNH.shape[:-2], -1).astype(dtype) @ blk.wo[...]


def _mlp(blk: Block, normed):
  gate, up = jnp.split(normed @ blk.w_gate_up[...], 2, axis=-1)
  return (jax.nn.silu(gate) * up) @ blk.w_down[...]


def _finish(blk: Block, cfg: LlamaConfig, x_BTD, attn_BTNH):
  x, h = add_norm(x_BTD, _attn_out(blk, attn_BTNH, x_BTD.dtype), blk.mlp_norm[...], cfg.norm_eps)
  return x + _mlp(blk, h)


def prefill_flops(cfg: LlamaConfig, T: int, start: int = 0) -> float:
  """Model FLOPs of prefilling T tokens at positions start .. start + T - 1 over the K/V of the tokens before
  them: the linear layers (2 per weight per token), the attention (2 per multiply-add of q.k and p.v over each
  token's prefix, causal among the T counted as T^2 / 2 pairs) and the head for one token. At start=0 the
  usual count of a whole prefill (benchmarks/prefill_flops.py); the serving engine sizes prefill chunks by it."""
  D, N, K, H, F, L = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.n_layers
  per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F
  return 2.0 * T * per_layer * L + 2.0 * T * (T + 2 * start) * N * H * L + 2.0 * D * cfg.vocab_size


# Long prompts run a layer's MLP block (wo, residuals, norm, gate/up, down) over chunks of about this many
# tokens, one after another: at 128k tokens the fused gate/up output alone is 7.5 GB for an 8B model, a
# chunk's is 0.5 GB. The chunks are a Python loop, not lax.map: on an H200, XLA kept every layer's while-loop
# buffers alive (prefill temp memory grew 1.1-2.7 GB per layer), while the unrolled loop's stays flat
# (5.5 GB against 13.6 GB unchunked at 128k; benchmarks/prefill_memory.py).
PREFILL_CHUNK_TOKENS = 8192


def over_token_chunks(fn, *xs_BT):
  """fn(*xs) for arrays [B, T, ...] whose rows are independent tokens, computed over slices of the T axis
  (B * slice about PREFILL_CHUNK_TOKENS tokens) and joined back; equal to fn(*xs)."""
  B, T = xs_BT[0].shape[:2]
  c = max(1, PREFILL_CHUNK_TOKENS // B)
  if T <= c:
    return fn(*xs_BT)
  outs = [fn(*(x[:, i:i + c] for x in xs_BT)) for i in range(0, T, c)]
  return jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=1), *outs)


# ----------------------------------------------------------------------------- attention


def blocked_causal_attention(q_BTNH, k_BTKH, v_BTKH, block: int):
  """Flash-style causal attention: a loop over query blocks, each an online-softmax loop over the
  key blocks at or before it. Holds [B, N, block, block] scores at a time, never [T, T]."""
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  G = N // K
  nb = -(-T // block)
  pad = nb * block - T
  padt = lambda a: jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))
  q = padt(q_BTNH).reshape(B, nb, block, K, G, H).astype(jnp.float32) / math.sqrt(H)
  k = padt(k_BTKH).reshape(B, nb, block, K, H).astype(jnp.float32)
  v = padt(v_BTKH).reshape(B, nb, block, K, H).astype(jnp.float32)
  ar = jnp.arange(block)

  def query_block(i):
    q_i = jax.lax.dynamic_index_in_dim(q, i, axis=1, keepdims=False)  # [B,C,K,G,H]

    def key_block(j, carry):
      m, l, acc = carry
      k_j = jax.lax.dynamic_index_in_dim(k, j, axis=1, keepdims=False)  # [B,C,K,H]
      v_j = jax.lax.dynamic_index_in_dim(v, j, axis=1, keepdims=False)
      s = jnp.einsum("BCKGH,BSKH->BKGCS", q_i, k_j)
      visible = (j * block + ar)[None, :] <= (i * block + ar)[:, None]  # [C,S]
      s = jnp.where(visible, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("BKGCS,BSKH->BKGCH", p, v_j)
      return m_new, l, acc

    init = (jnp.full((B, K, G, block), -jnp.inf, jnp.float32),
            jnp.zeros((B, K, G, block), jnp.float32),
            jnp.zeros((B, K, G, block, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    return acc / l[..., None]  # [B,K,G,C,H]

  out = jax.lax.map(query_block, jnp.arange(nb))  # [nb,B,K,G,C,H]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, nb * block, N, H)
  return out[:, :T].astype(q_BTNH.dtype)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, *, impl: str = "auto"):
  """Causal GQA attention for right-padded prompts (valid queries only see valid keys).

  impl: "dense" (jax.nn.dot_product_attention, XLA or cuDNN as it chooses), "blocked"
  (query-block flash-style loop), or "auto": dense for short prompts and for bf16/fp16 on GPU
  (cuDNN flash attention), blocked otherwise so long prompts never build [T, T] scores.
  """
  T = q_BTNH.shape[1]
  if impl == "auto":
    on_gpu = jax.default_backend() == "gpu"
    half = q_BTNH.dtype in (jnp.bfloat16, jnp.float16)
    impl = "dense" if (T <= DENSE_ATTENTION_MAX_T or (on_gpu and half)) else "blocked"
  if impl == "dense":
    # implementation=None means XLA's attention, which materializes [T, T] and runs out of memory at 32k
    # on an H200; cuDNN's flash attention handles GQA and bf16/fp16 (PLATFORM.md).
    cudnn = jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                        implementation="cudnn" if cudnn else None)
  if impl == "blocked":
    return blocked_causal_attention(q_BTNH, k_BTKH, v_BTKH, min(ATTENTION_BLOCK, T))
  raise ValueError(f"{impl=} must be 'auto', 'dense' or 'blocked'")


# ----------------------------------------------------------------------------- prefill


# Prompt scoring (`prefill(..., score=k)`) computes logits over chunks of this many tokens: a chunk's float32
# logits are [B, 1024, V] (0.5 GB at a 128k vocabulary), never the whole prompt's.
SCORE_CHUNK_TOKENS = 1024


class PromptScores(NamedTuple):
  """Log-probabilities of a prompt's tokens under the model's raw distribution (log_softmax of its logits).

  Entry t scores token t + 1 from the logits at position t (so a prompt of n tokens has n - 1 meaningful
  entries; the last entry of a row and its padding are meaningless): token_logprobs [B, T] float32,
  top_ids [B, T, k] int32 and top_logprobs [B, T, k] float32 (the k most likely, most likely first)."""

  token_logprobs: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def score_tokens(model: Llama, x_BTD, tokens_BT, k: int) -> PromptScores:
  """`PromptScores` from the last layer's residual stream x [B, T, D] (before the final norm), one chunk of
  SCORE_CHUNK_TOKENS tokens at a time: a sequential `lax.map`, so only one chunk's [B, chunk, V] logits are alive
  (independent unrolled chunks let XLA keep every chunk's logits at once: 33 GiB at 32k tokens and a 128k
  vocabulary, which no memory plan reserves)."""
  B, T, D = x_BTD.shape
  c = min(SCORE_CHUNK_TOKENS, T)
  n = -(-T // c)
  nxt = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((B, n * c - T + 1), tokens_BT.dtype)], axis=1)
  x = jnp.pad(x_BTD, ((0, 0), (0, n * c - T), (0, 0)))

  def chunk(xs):
    x_BCD, nxt_BC = xs
    lp = jax.nn.log_softmax(_head(model, x_BCD), axis=-1)
    chosen = jnp.take_along_axis(lp, nxt_BC[..., None], axis=-1)[..., 0]
    top_v, top_i = jax.lax.top_k(lp, max(k, 1))
    return chosen, top_i[..., :k].astype(jnp.int32), top_v[..., :k]

  outs = jax.lax.map(chunk, (x.reshape(B, n, c, D).swapaxes(0, 1), nxt.reshape(B, n, c).swapaxes(0, 1)))
  return PromptScores(*(o.swapaxes(0, 1).reshape(B, n * c, *o.shape[3:])[:, :T] for o in outs))


def prefill_layer(blk: Block, cfg: LlamaConfig, x_BTD, pos_BT, attend):
  """The one prefill layer (a whole prompt, a chunk of one, new tokens over a history, the dense forward): q/k/v
  with RoPE at positions pos [B, T], then attend(q, k, v) -> (attention output [B, T, N, H], anything the caller
  keeps: a compressed cache, updated buffers), then the residual, norm and MLP over token chunks. Returns (the
  layer's output [B, T, D], what attend kept). The decode step's layer is `decode_layer` (one token per row, the
  fused norm and RoPE kernels)."""
  q, k, v = prefill_qkv(blk, cfg, x_BTD, pos_BT)
  o, kept = attend(q, k, v)
  return over_token_chunks(functools.partial(_finish, blk, cfg), x_BTD, o), kept


def _layers_prefill(model: Llama, tokens_BT, lengths_B, on_layer, impl="auto", score: int | None = None):
  """Runs the prompt through every layer (`prefill_layer`); on_layer(q, k, v) is called right after the layer's
  attention, so a compressing callback leaves only one layer's full KV alive. Returns (logits [B, V] of each last
  valid token, the callbacks' outputs per layer, the last layer's residual stream [B, T, D]) and with score = k
  also the prompt's `PromptScores`."""
  B, T = tokens_BT.shape
  x = embed_tokens(model, tokens_BT)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  def attend(q, k, v):
    o = causal_attention(q, k, v, impl=impl)
    # The barrier makes the next layer wait for this layer's compression, so XLA cannot postpone it
    # and keep every layer's full q/k/v alive (on an H200 at 128k that raised the peak by ~20 GB).
    return jax.lax.optimization_barrier((o, on_layer(q, k, v)))

  outs = []
  for blk in model.layers:
    x, kept = prefill_layer(blk, model.config, x, pos, attend)
    outs.append(kept)
  logits = _head(model, x[jnp.arange(B), lengths_B - 1])
  scores = () if score is None else (score_tokens(model, x, tokens_BT, score),)
  return (logits, tuple(outs), x) + scores


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "score"))
def prefill_jit(graphdef, state, tokens_BT, lengths_B, rows=None, *, config, score: int | None = None):
  """`prefill` over nnx.split(model): lower and compile it to time compilation apart."""
  model = nnx.merge(graphdef, state)
  lengths_B = lengths_B.astype(jnp.int32)
  logits, caches, _, *scores = _layers_prefill(
      model, tokens_BT, lengths_B,
      lambda q, k, v: constrain_cache(prefill_compress(q, k, v, lengths_B, config=config, rows=rows)),
      score=score)
  return (logits, caches, *scores)


def prefill(model: Llama, tokens_BT, lengths_B, config, rows=None, score: int | None = None):
  """Prefill + per-layer compression. Returns (logits [B, V] of each last valid token, caches), and with
  score = k (static: a second executable) also the prompt's `PromptScores` with the k most likely tokens per
  position (vLLM's prompt logprobs; costs the logits of every prompt position). rows: each sequence's own plan
  (`rocketkv_jax.plan_rows`; config is then the batch's)."""
  graphdef, state = nnx.split(model)
  return prefill_jit(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), jnp.asarray(lengths_B, jnp.int32),
                     rows, config=config, score=score)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def prefill_dense_jit(graphdef, state, tokens_BT, lengths_B):
  """`prefill_dense` over nnx.split(model)."""
  model = nnx.merge(graphdef, state)
  return _layers_prefill(model, tokens_BT, lengths_B.astype(jnp.int32), lambda q, k, v: (q, k, v))[:2]


def prefill_dense(model: Llama, tokens_BT, lengths_B):
  """Dense prefill that keeps every layer's post-RoPE (q, k, v); pair with compress_layers to
  compress one prefill several ways (costs all layers' full KV in memory)."""
  graphdef, state = nnx.split(model)
  return prefill_dense_jit(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), jnp.asarray(lengths_B, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config",))
def compress_layers(layer_qkv, lengths_B, config):
  """Per-layer prefill_compress over prefill_dense's (q, k, v) tuple -> tuple of caches."""
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  return tuple(prefill_compress(q, k, v, lengths_B, config=config) for q, k, v in layer_qkv)


# ----------------------------------------------------------------------------- prefill that continues a K/V history

# prefill_extend copies this many layers' history to the device ahead of the layer that runs (worker threads).
PREFETCH_LAYERS = 6

# extend_attention computes the scores of query chunks of at most this many elements (float32: 512 MB).
EXTEND_SCORES_MAX = 1 << 27


def extend_attention(q_BTNH, k_BSKH, v_BSKH, start_B):
  """GQA attention of T new queries at positions start + i over a sequence of S keys: query i sees keys
  [0, start + i]. Dense and masked (XLA), one chunk of queries at a time (lax.map: chunks of a power of two,
  scores under EXTEND_SCORES_MAX elements), so the [T, S] scores never exist at once."""
  B, T, N, H = q_BTNH.shape
  S = k_BSKH.shape[1]
  c = 1 << max(0, (max(1, EXTEND_SCORES_MAX // (B * N * S))).bit_length() - 1)
  c = min(c, 1 << (T - 1).bit_length())
  nc = -(-T // c)
  q = jnp.pad(q_BTNH, ((0, 0), (0, nc * c - T), (0, 0), (0, 0))).reshape(B, nc, c, N, H).transpose(1, 0, 2, 3, 4)

  def chunk(args):
    i, q_c = args
    qpos = start_B[:, None] + i * c + jnp.arange(c, dtype=jnp.int32)[None, :]  # [B, c]
    mask = jnp.arange(S)[None, None, :] <= qpos[:, :, None]  # [B, c, S]
    return jax.nn.dot_product_attention(q_c, k_BSKH, v_BSKH, mask=mask[:, None])

  out = jax.lax.map(chunk, (jnp.arange(nc, dtype=jnp.int32), q))  # [nc, B, c, N, H]
  return out.transpose(1, 0, 2, 3, 4).reshape(B, nc * c, N, H)[:, :T]


# offset_attention's sentinel key: its score (the log of its softmax weight), and the channels added to each head
# (one carries the sentinel; cuDNN wants head dims that are multiples of 8). Chosen so that a part's normaliser Z
# is resolved (Z / e^SENTINEL >~ 0.01) and its reciprocal stays a normal bf16 (Z <~ e^(SENTINEL + 83)): every
# attention row whose largest score lies in about [SENTINEL + 5, SENTINEL + 72] = [-11, 56].
SENTINEL_SCORE = -16.0
SENTINEL_CHANNELS = 8


def history_parts(B: int, T: int, N: int, S: int) -> int:
  """How many parts offset_attention's cuDNN path splits a history of S keys into. Flash attention runs one block
  per (row, head, 64 queries), each walking all its keys: a 40-token question over a 33k document is 64 blocks
  on an H100's 132 SMs (0.39 ms per layer's call, 25 of the question's 60 ms on the device). P parts (extra
  batch rows, merged by their normalisers as the new tokens' part is) multiply the blocks by P, each walking S / P
  keys: the power of two up to 8 that reaches 512 blocks, parts of at least 2,048 keys."""
  blocks, P = B * N * -(-T // 64), 1
  while P < 8 and blocks * P < 512 and S // (2 * P) >= 2048:
    P *= 2
  return P


def offset_attention(q_BTNH, hist_k_BSKH, hist_v_BSKH, k_BTKH, v_BTKH, start_B, *, impl: str = "auto",
                     parts: int | None = None):
  """GQA attention of T new tokens at positions start + i over a K/V history valid in [0, start) (positions past
  it are ignored) and over themselves, causally: query i sees history [0, start) and new keys [0, i]. The prefill
  of a chunk after earlier chunks and of a new turn after a stored history.

  impl "masked": `extend_attention` over the history with the new keys written in (XLA; exact). "cudnn": two
  cuDNN flash attentions, the history's (no mask, its length) and the new tokens' own (causal), merged by their
  softmax normalisers: cuDNN returns none, so each part gets a sentinel key of known score SENTINEL_SCORE whose
  value is 1 in an added channel, and that channel of the part's output, 1 / (1 + Z / e^SENTINEL), gives its
  normaliser Z (bf16 precision: the merge's error is that of bf16 attention itself). "auto": cudnn for bf16 /
  fp16 on a GPU (cuDNN aligns a causal mask top-left, so one call cannot offset it), else masked. parts: the
  history's split on the cudnn path (`history_parts` by default), each part with its own sentinel."""
  if impl == "auto":
    impl = "cudnn" if (jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16)) else "masked"
  if impl == "masked":
    return extend_attention(q_BTNH, place_rows(hist_k_BSKH, k_BTKH, start_B), place_rows(hist_v_BSKH, v_BTKH, start_B),
                            start_B)
  if impl not in ("cudnn", "sentinel-xla"):
    raise ValueError(f"{impl=} must be 'auto', 'masked' or 'cudnn'")
  implementation = "cudnn" if impl == "cudnn" else "xla"  # "sentinel-xla": the same merge on any backend (tests)
  B, T, N, H = q_BTNH.shape
  S, K = hist_k_BSKH.shape[1], hist_k_BSKH.shape[2]
  dt, E = q_BTNH.dtype, SENTINEL_CHANNELS
  P = history_parts(B, T, N, S) if parts is None else parts
  L = -(-S // P)  # each part's keys; its buffer holds them, then room for its sentinel
  Lp = -(-(L + 1) // 128) * 128
  scale = 1.0 / math.sqrt(H)
  unit = jnp.zeros((H + E,), dt).at[H].set(1)  # the queries' added channel; the sentinel's value
  sent_k = jnp.zeros((H + E,), dt).at[H].set(SENTINEL_SCORE / scale)  # its key: score q.k * scale = SENTINEL
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, E)))  # noqa: E731
  q = pad(q_BTNH) + unit
  # the history in P parts of L keys, part p holding positions [p L, p L + L), of which `valid` lie before start;
  # each part's sentinel takes the row after its valid keys (a part wholly past start holds only its sentinel)
  valid = jnp.clip(start_B[:, None] - jnp.arange(P)[None, :] * L, 0, L)  # [B, P]
  pos, vp = jnp.arange(Lp)[None, None, :, None, None], valid[:, :, None, None, None]

  def parted(x, sentinel):
    x = jnp.pad(pad(x.astype(dt)), ((0, 0), (0, P * L - S), (0, 0), (0, 0))).reshape(B, P, L, K, H + E)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, Lp - L), (0, 0), (0, 0)))
    return jnp.where(pos < vp, x, jnp.where(pos == vp, sentinel, 0)).reshape(B * P, Lp, K, H + E)

  q_parts = jnp.broadcast_to(q[:, None], (B, P, T, N, H + E)).reshape(B * P, T, N, H + E)
  o_h = jax.nn.dot_product_attention(q_parts, parted(hist_k_BSKH, sent_k), parted(hist_v_BSKH, unit), scale=scale,
                                     implementation=implementation,
                                     query_seq_lengths=jnp.full((B * P,), T, jnp.int32),
                                     key_value_seq_lengths=(valid + 1).reshape(B * P).astype(jnp.int32))
  o_h = o_h.reshape(B, P, T, N, H + E)
  # the new tokens' own part: a dummy first query, the sentinel as key 0, so that with the top-left causal mask
  # query i + 1 (new token i) sees the sentinel and new keys [0, i]
  q_own = jnp.concatenate([jnp.zeros((B, 1, N, H + E), dt), q], 1)
  k_own = jnp.concatenate([jnp.broadcast_to(sent_k, (B, 1, K, H + E)), pad(k_BTKH.astype(dt))], 1)
  v_own = jnp.concatenate([jnp.broadcast_to(unit, (B, 1, K, H + E)), pad(v_BTKH.astype(dt))], 1)
  o_n = jax.nn.dot_product_attention(q_own, k_own, v_own, scale=scale, is_causal=True,
                                     implementation=implementation)[:, 1:]
  # part p's output is (U_p + w e) / (Z_p + w), w = e^SENTINEL: a_p = -log(channel H) = log(1 + Z_p / w); the
  # merge (sum of U_p) / (sum of Z_p) over the P history parts and the new tokens' part, scaled by e^-max(a)
  # against overflow
  a_h = -jnp.log(jnp.maximum(o_h[..., H].astype(jnp.float32), 1e-38))  # [B, P, T, N]
  a_n = -jnp.log(jnp.maximum(o_n[..., H].astype(jnp.float32), 1e-38))
  m = jnp.maximum(a_h.max(axis=1), a_n)
  w_h, w_n = jnp.exp(a_h - m[:, None]), jnp.exp(a_n - m)
  den = w_h.sum(axis=1) + w_n - (P + 1) * jnp.exp(-m)
  out = ((o_h[..., :H].astype(jnp.float32) * w_h[..., None]).sum(axis=1)
         + o_n[..., :H].astype(jnp.float32) * w_n[..., None])
  return (out / den[..., None]).astype(dt)


def place_rows(buf_BSX, new_BTX, start_B):
  """buf [B, S, ...] with new [B, T, ...] written at [start, start + T) of each row (what falls past S is
  dropped; dynamic_update_slice alone would move the write back to fit)."""
  B, S = buf_BSX.shape[:2]
  T = new_BTX.shape[1]
  padded = jnp.concatenate([buf_BSX, jnp.zeros((B, T) + buf_BSX.shape[2:], buf_BSX.dtype)], axis=1)
  put = jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))
  return put(padded, new_BTX.astype(buf_BSX.dtype), start_B)[:, :S]


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "config"))
def prefill_extend_layer_jit(graphdef, state, x_BTD, hist_k_BSKH, hist_v_BSKH, start_B, new_len_B, rows=None, *,
                             cfg, config):
  """One layer of `prefill_extend` (graphdef, state = nnx.split(block); every layer shares one compile).

  Returns (the layer's output [B, T, D], its compressed cache over history + new tokens, the new tokens'
  k and v [B, T, K, H]). The method sees the whole sequence [B, S] (history, then the new tokens at
  [start, start + new_len)); queries exist only for the new tokens (zeros before), which is all a method
  reads when at least `config.prompt_queries` tokens are new."""
  blk = nnx.merge(graphdef, state)
  T = x_BTD.shape[1]
  pos = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  S = hist_k_BSKH.shape[1]

  def attend(q, k, v):
    k_all = place_rows(hist_k_BSKH, k, start_B)
    v_all = place_rows(hist_v_BSKH, v, start_B)
    q_all = place_rows(jnp.zeros((q.shape[0], S) + q.shape[2:], q.dtype), q, start_B)
    if 2 * T >= S:  # mostly new tokens (a first turn): causal attention over the whole sequence (flash on GPU),
      # history rows computed needlessly, then the new tokens' rows taken out
      o_all = jnp.pad(causal_attention(q_all, k_all, v_all), ((0, 0), (0, T), (0, 0), (0, 0)))
      o = jax.vmap(lambda o_, s_: jax.lax.dynamic_slice_in_dim(o_, s_, T, axis=0))(o_all, start_B)
    else:  # a few new tokens over a long history: only their rows of the scores
      o = offset_attention(q, hist_k_BSKH, hist_v_BSKH, k, v, start_B)
    o, cache = jax.lax.optimization_barrier((o, prefill_compress(q_all, k_all, v_all, start_B + new_len_B,
                                                                 config=config, rows=rows)))
    return o, (cache, k, v)

  x, (cache, k, v) = prefill_layer(blk, cfg, x_BTD, pos, attend)
  return x, cache, k, v


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("buf_k_BSKH", "buf_v_BSKH"))
def prefill_chunk_layer_jit(graphdef, state, x_BTD, buf_k_BSKH, buf_v_BSKH, start_B, *, cfg):
  """One layer of one chunk of a prompt prefilled in chunks (the serving engine's chunked prefill): the chunk's
  T tokens at positions start + i write their k / v into the prompt's buffers [B, S, K, H] (donated: updated in
  place) and attend over [0, start + i] of them (`offset_attention`). No compression: the last chunk runs
  `prefill_extend_layer_jit` over the buffers, which compresses the whole prompt. Returns (the layer's output
  [B, T, D], buf_k, buf_v)."""
  blk = nnx.merge(graphdef, state)
  T = x_BTD.shape[1]
  pos = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

  def attend(q, k, v):
    o = offset_attention(q, buf_k_BSKH, buf_v_BSKH, k, v, start_B)
    return o, (place_rows(buf_k_BSKH, k, start_B), place_rows(buf_v_BSKH, v, start_B))

  x, (buf_k, buf_v) = prefill_layer(blk, cfg, x_BTD, pos, attend)
  return x, buf_k, buf_v


def split_layers(model: Llama) -> list:
  """Each layer's (graphdef, state) (`nnx.split`), which the per-layer prefills run: about 0.2-0.6 ms of Python
  per layer, so a caller that prefills often (the serving engine) splits once and passes them."""
  return [nnx.split(blk) for blk in model.layers]


def prefill_chunk(model: Llama, tokens_BT, buffers, start_B, *, run_layer=None, layers=None):
  """One chunk of a chunked prefill (`prefill_chunk_layer_jit` per layer): tokens [B, T] at positions start + i
  (right-padded: padding writes past the valid tokens, which the next chunk overwrites and the last one's
  lengths mask). buffers: per layer (k, v) [B, S, K, H] on the device, valid in [0, start); donated. Returns the
  per-layer buffers with the chunk written. run_layer: a stand-in taking (graphdef, state, x, buf_k, buf_v,
  start) (the engine passes compiled executables). layers: `split_layers(model)`, when the caller keeps it."""
  cfg = model.config
  if run_layer is None:
    run_layer = functools.partial(prefill_chunk_layer_jit, cfg=cfg)
  x = embed_tokens(model, jnp.asarray(tokens_BT, jnp.int32))
  start_B = jnp.asarray(start_B, jnp.int32)
  out = []
  for (graphdef, state), (k, v) in zip(layers or split_layers(model), buffers):
    x, k, v = run_layer(graphdef, state, x, k, v, start_B)
    out.append((k, v))
  return tuple(out)


def prefill_extend(model: Llama, tokens_BT, new_len_B, history, start_B, config, *, seq_len=None, run_layer=None,
                   rows=None, layers=None):
  """Prefill of new tokens that continue a K/V history, with the method's stage 1 over history + new tokens.

  tokens [B, T]: the new tokens, right-padded (new_len valid per row), at positions start + i.
  history: per layer (k, v) [B, S, K, H] post-RoPE, valid in [0, start), S >= start + new_len (the padded
    whole sequence); NumPy (host) or device arrays. Each layer's pair is put on the device while earlier
    layers run (PREFETCH_LAYERS ahead, by worker threads), so the device holds a few layers' history, never
    all of it. An entry may be None (nothing stored: zeros [B, seq_len, K, H] made on the device).
  The result equals `prefill` of the whole sequence (up to float rounding of a different attention
  reduction) when every row has at least `config.prompt_queries` new tokens: the history keeps keys and
  values, not queries. run_layer: a stand-in for `prefill_extend_layer_jit` taking its arguments
  (graphdef, state, x, hist_k, hist_v, start, new_len, rows) (the engine passes compiled executables). rows:
  each sequence's own plan (`rocketkv_jax.plan_rows`; config is then the batch's). layers: `split_layers(model)`,
  when the caller keeps it.
  Returns (logits [B, V] of each row's last new token, per-layer caches, per-layer (k, v) [B, T, K, H] of
  the new tokens, on the device).
  """
  cfg = model.config
  if len(history) != cfg.n_layers:
    raise ValueError(f"history has {len(history)} layers; the model has {cfg.n_layers}")
  tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
  new_len_B, start_B = jnp.asarray(new_len_B, jnp.int32), jnp.asarray(start_B, jnp.int32)
  if run_layer is None:
    run_layer = functools.partial(prefill_extend_layer_jit, cfg=cfg, config=config)
  x = embed_tokens(model, tokens_BT)
  zeros = None

  def fetch(i):
    """Layer i's history on the device (a worker thread: building a padded host array and copying it
    release the GIL, so later layers' copies overlap this layer's compute)."""
    h = history[i]
    return None if h is None else jax.device_put(h)

  caches, new_kv = [], []
  layers = layers or split_layers(model)
  with concurrent.futures.ThreadPoolExecutor(PREFETCH_LAYERS) as pool:
    ahead = collections.deque(pool.submit(fetch, i) for i in range(min(PREFETCH_LAYERS, cfg.n_layers)))
    for i, (graphdef, state) in enumerate(layers):
      hist = ahead.popleft().result()
      if i + PREFETCH_LAYERS < cfg.n_layers:
        ahead.append(pool.submit(fetch, i + PREFETCH_LAYERS))
      if hist is None:  # an empty history: zeros made on the device, nothing copied
        if seq_len is None:
          raise ValueError(f"history[{i}] is None: give seq_len, the padded length of the whole sequence")
        if zeros is None:
          zeros = jnp.zeros((tokens_BT.shape[0], seq_len, cfg.n_kv_heads, cfg.head_dim), x.dtype)
        hist = (zeros, zeros)
      x, cache, k, v = run_layer(graphdef, state, x, hist[0], hist[1], start_B, new_len_B, rows)
      caches.append(cache)
      new_kv.append((k, v))
  last = x[jnp.arange(x.shape[0]), new_len_B - 1]
  return _head(model, last), tuple(caches), tuple(new_kv)


# ----------------------------------------------------------------------------- decode


class LayerStep(NamedTuple):
  """What one layer of a decode step returns.

  x, delta: [B, 1, D] the residual stream after the attention block and what the MLP adds to it (the add
    is left to the next layer, fused with its norm: `add_norm`).
  cache: the layer's updated cache.
  q: [B, N, H] the step's post-RoPE query; k: [B, K, H] its post-RoPE key (what the cache appended).
  """

  x: jax.Array
  delta: jax.Array
  cache: object
  q: jax.Array
  k: jax.Array


def decode_layer(blk: Block, cfg: LlamaConfig, x_B1D, delta_B1D, cache, config) -> LayerStep:
  """One layer of one decode step (traceable): the residual add of the previous layer's MLP (`delta`, None
  in the first layer) fused with attn_norm, q/k/v + RoPE at cache.pos, the core's `decode_step` (append,
  select, attend), the attention's residual add fused with mlp_norm, the MLP. With config.impl running
  kernels (`ops.uses_kernels`) each (add, norm) pair and the RoPE + head split are one kernel each."""
  impl, eps = config.impl, cfg.norm_eps
  kernels = ops.uses_kernels(impl) and active_mesh() is not None  # kernels run per device on a mesh
  x, h = _norm(x_B1D, delta_B1D, blk.attn_norm[...], eps, impl, kernels)
  if kernels:
    qkv = _qkv_projection(blk, cfg, h)[:, 0]
    q, k, v = per_shard(lambda qkv, pos: _rope_split(cfg, qkv, pos, impl), (qkv, cache.pos), (None, None),
                        (None, None, None))
    o, cache = per_shard(lambda c, q, k, v: decode_step(c, q, k, v, config=config), (cache, q, k, v),
                         (1, 1, 1, 1), (1, 1), heads=cfg.n_kv_heads)
  else:
    q, k, v = _decode_qkv(blk, cfg, h, cache.pos, impl)
    o, cache = decode_step(cache, q, k, v, config=config)
  x, h = _norm(x, _attn_out(blk, o[:, None], x.dtype), blk.mlp_norm[...], eps, impl, kernels)
  return LayerStep(x=x, delta=_mlp(blk, h), cache=cache, q=q, k=k)


def _norm(x, delta, w, eps, impl, per_device: bool):
  """add_norm, run per device (by batch) when its kernel runs on a mesh."""
  if not per_device:
    return add_norm(x, delta, w, eps, impl)
  if delta is None:
    return per_shard(lambda x, w: add_norm(x, None, w, eps, impl), (x, w), (None, WHOLE), (None, None))
  return per_shard(lambda x, d, w: add_norm(x, d, w, eps, impl), (x, delta, w), (None, None, WHOLE), (None, None))


def final_logits(model: Llama, x_B1D, delta_B1D, impl: str) -> jax.Array:
  """Logits [B, V] (float32) after the last layer: its residual add fused with the final norm, the head."""
  per_device = ops.uses_kernels(impl) and active_mesh() is not None
  _, h = _norm(x_B1D, delta_B1D, model.norm[...], model.config.norm_eps, impl, per_device)
  return _logits(model, h[:, 0])


def decode_body(model: Llama, tokens_B, caches, config):
  """One decode step of the whole model (traceable): new token at each sequence's cache.pos ->
  (logits [B, V], caches). The decode loop (`models/loop.py`) runs this.

  Each residual add is fused with the norm that follows it: the MLP's output with the next layer's
  attn_norm (the last layer's with the final norm), the attention's with mlp_norm. Activations stay
  [B, 1, D] (see `add_norm`).
  """
  x = embed_tokens(model, tokens_B)[:, None, :]  # [B, 1, D]
  delta = None  # what the previous layer's MLP adds to x
  new = []
  for blk, cache in zip(model.layers, caches):
    x, delta, cache, _, _ = decode_layer(blk, model.config, x, delta, cache, config)
    new.append(cache)
  return final_logits(model, x, delta, config.impl), tuple(new)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("caches",))
def _decode_jit(graphdef, state, tokens_B, caches, config):
  return decode_body(nnx.merge(graphdef, state), tokens_B, caches, config)


def decode(model: Llama, tokens_B, caches, config):
  """One decode step for a batch: (logits [B, V], caches). The input caches are donated."""
  graphdef, state = nnx.split(model)
  return _decode_jit(graphdef, state, jnp.asarray(tokens_B, jnp.int32), caches, config)


# ----------------------------------------------------------------------------- dense forward


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def _forward_full_jit(graphdef, state, tokens_BT, impl):
  model = nnx.merge(graphdef, state)
  B, T = tokens_BT.shape
  _, _, x = _layers_prefill(model, tokens_BT, jnp.full((B,), T, jnp.int32), lambda q, k, v: None, impl=impl)
  return _head(model, x)


def forward_full(model: Llama, tokens_BT, *, impl: str = "auto"):
  """Plain dense causal forward: logits [B, T, V] for every position (tests, teacher forcing)."""
  graphdef, state = nnx.split(model)
  return _forward_full_jit(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), impl)
