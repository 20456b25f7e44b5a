"""Batched text generation with any KV method of the core: one jitted prefill, one jitted decode loop.

The decode loop is a `lax.while_loop` over tokens inside one jit (caches donated, per-sequence EOS,
no host round-trip per token); it stops early once every sequence has ended.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .llama import Llama, _prefill_jit, cache_nbytes, decode_body, make_config
from .tokenizer import TextTokenizer
from .weights import load

__all__ = ["GenerateResult", "GenerateStats", "decode_to_result", "generate", "load", "sample_token",
           "stop_ids"]


@dataclasses.dataclass
class GenerateStats:
  """What one generate() call held and took. Times exclude compilation (reported apart)."""

  method: str
  token_budget: int
  batch: int
  prompt_tokens: list[int]      # per sequence
  new_tokens: list[int]         # per sequence, EOS included when generated
  kv_bytes: int                 # bytes all layers' caches hold (KV + aux pages/indices), whole batch
  full_kv_bytes: int            # bytes a full KV cache holds for the same batch and tokens
  compression: float            # full_kv_bytes / kv_bytes
  capacity: int                 # cache slots per KV head per layer
  prefill_s: float
  decode_s: float
  decode_steps: int             # batched decode steps run (the loop stops when all sequences end)
  tokens_per_s: float           # generated tokens of the batch / decode_s
  compile_s: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateResult:
  texts: list[str]
  token_ids: list[list[int]]
  stats: GenerateStats


def sample_token(logits_BV, key, temperature: float, top_p: float):
  """Greedy when temperature == 0; else temperature + nucleus (top_p) sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits = logits_BV.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_ = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # the smallest prefix whose mass reaches top_p; its last logit is the cut-off
    n_keep = jnp.sum(cum - probs < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_, n_keep - 1, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _loop_fn(graphdef, state, logits_BV, caches, key, eos_E, *, config, max_new: int, temperature: float,
             top_p: float):
  """Samples the first token from the prefill logits, then decodes until max_new or all ended.
  Returns out [B, max_new] (-1 after a sequence's EOS), the number of batched decode steps and the
  final caches (returned so the donated input buffers are reused in place by the loop)."""
  model = nnx.merge(graphdef, state)
  B = logits_BV.shape[0]
  key, sub = jax.random.split(key)
  tok = sample_token(logits_BV, sub, temperature, top_p)
  out = jnp.full((B, max_new), -1, jnp.int32).at[:, 0].set(tok)
  done = jnp.isin(tok, eos_E)

  def cond(c):
    i, _, _, done, _, _ = c
    return (i < max_new) & ~jnp.all(done)

  def body(c):
    i, tok, caches, done, out, key = c
    logits, caches = decode_body(model, tok, caches, config)
    key, sub = jax.random.split(key)
    nxt = jnp.where(done, -1, sample_token(logits, sub, temperature, top_p))
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    done = done | jnp.isin(nxt, eos_E)
    return i + 1, jnp.maximum(nxt, 0), caches, done, out, key

  i, _, caches, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, caches, done, out, key))
  return out, i - 1, caches


_loop_jit = jax.jit(_loop_fn, static_argnames=("graphdef", "config", "max_new", "temperature", "top_p"),
                    donate_argnames=("caches",))
_COMPILED: dict = {}


def _compiled(name, fn, *args, **static):
  """AOT-compiles fn for these shapes once (so compile time can be reported apart)."""
  key = (name, args[0], jax.tree.structure(args[1:]), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args[1:])),
         tuple(sorted(static.items())))
  if key not in _COMPILED:
    if len(_COMPILED) >= 64:  # many distinct prompt shapes: drop old executables
      _COMPILED.clear()
    _COMPILED[key] = fn.lower(*args, **static).compile()
  return _COMPILED[key]


def stop_ids(model: Llama, tokenizer: TextTokenizer, chat: bool) -> list[int]:
  """Ids that end a sequence: the model's EOS, plus the end-of-turn token for chat."""
  ids = (model.config.eos_id, tokenizer.eos_id, tokenizer.chat_eos_id if chat else None)
  return sorted({i for i in ids if i is not None})


def encode_prompts(tokenizer: TextTokenizer, prompts, chat: bool) -> list[list[int]]:
  if isinstance(prompts, str):
    raise TypeError("prompts must be a list of strings (or of token id lists), not one string")
  ids = [list(p) if not isinstance(p, str) else tokenizer.encode(p, chat=chat) for p in prompts]
  for i, x in enumerate(ids):
    if not x:
      raise ValueError(f"prompt {i} encodes to no tokens")
  return ids


def generate(model: Llama, tokenizer: TextTokenizer, prompts: Sequence, *, method: str = "full",
             token_budget: int = 256, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, chat: bool = False,
             progress: Callable[[str], None] | None = None, **config_overrides) -> GenerateResult:
  """Generates for a batch of prompts (strings or token-id lists) of different lengths.

  method/token_budget pick the KV cache (any method of the core; "full" ignores the budget).
  temperature 0 is greedy; otherwise temperature + top_p sampling from `seed`. Each sequence stops
  at its EOS (the chat end-of-turn token with chat=True) or after max_new_tokens.
  """
  progress = progress or (lambda msg: None)
  if max_new_tokens < 1:
    raise ValueError(f"{max_new_tokens=} must be >= 1")
  if temperature < 0 or not 0 < top_p <= 1:
    raise ValueError(f"{temperature=} must be >= 0 and {top_p=} in (0, 1]")
  cfg = model.config
  ids = encode_prompts(tokenizer, prompts, chat)
  B = len(ids)
  lengths = np.array([len(x) for x in ids], np.int32)
  T = int(lengths.max())
  if T + max_new_tokens > cfg.max_len:
    raise ValueError(f"prompt of {T} tokens + {max_new_tokens=} exceeds the model's max_len={cfg.max_len}")
  tokens = np.zeros((B, T), np.int32)
  for b, x in enumerate(ids):
    tokens[b, :len(x)] = x
  if method == "rocketkv" and "window_size" not in config_overrides and T < 32:
    # SnapKV's observation window cannot exceed the prompt; the plan rejects window > prompt budget.
    config_overrides["window_size"] = T
  config = make_config(method, token_budget=token_budget, prompt_len=T, max_new_tokens=max_new_tokens,
                       head_dim=cfg.head_dim, max_len=cfg.max_len, **config_overrides)
  eos = stop_ids(model, tokenizer, chat)

  graphdef, state = nnx.split(model)
  tokens_j, lengths_j = jnp.asarray(tokens), jnp.asarray(lengths)
  t0 = time.perf_counter()
  progress(f"compiling prefill ({B} x {T} tokens, {method})")
  pre = _compiled("prefill", _prefill_jit, graphdef, state, tokens_j, lengths_j, config=config)
  t1 = time.perf_counter()
  progress(f"prefill {B} x {T} tokens ({method}, budget {token_budget})")
  logits, caches = pre(state, tokens_j, lengths_j)
  jax.block_until_ready((logits, caches))
  prefill_s = time.perf_counter() - t1
  return decode_to_result(model, tokenizer, logits, caches, config, lengths=lengths.tolist(), eos=eos,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          prefill_s=prefill_s, compile_s=t1 - t0, token_budget=token_budget,
                          progress=progress)


def decode_to_result(model: Llama, tokenizer: TextTokenizer, logits_BV, caches, config, *, lengths, eos,
                     max_new_tokens, temperature=0.0, top_p=1.0, seed=0, prefill_s=0.0, compile_s=0.0,
                     token_budget=0, progress=None) -> GenerateResult:
  """Runs the jitted decode loop from prefill logits and caches (donated) and builds the result."""
  progress = progress or (lambda msg: None)
  cfg = model.config
  B = logits_BV.shape[0]
  graphdef, state = nnx.split(model)
  kv_bytes = cache_nbytes(caches)
  itemsize = caches[0].k.dtype.itemsize
  T = max(lengths)
  full_kv_bytes = 2 * cfg.n_layers * B * cfg.n_kv_heads * cfg.head_dim * (T + max_new_tokens) * itemsize
  eos_E = jnp.asarray(list(eos) or [-2], jnp.int32)
  key = jax.random.key(seed)
  static = dict(config=config, max_new=max_new_tokens, temperature=float(temperature), top_p=float(top_p))
  t2 = time.perf_counter()
  progress(f"compiling decode loop ({max_new_tokens} tokens, {config.method})")
  loop = _compiled("loop", _loop_jit, graphdef, state, logits_BV, caches, key, eos_E, **static)
  t3 = time.perf_counter()
  progress(f"decode up to {max_new_tokens} tokens ({config.method})")
  out, steps, caches = loop(state, logits_BV, caches, key, eos_E)
  del caches
  out = np.asarray(out)
  steps = int(steps)
  t4 = time.perf_counter()

  token_ids, texts = [], []
  for b in range(B):
    row = [int(t) for t in out[b] if t >= 0]
    token_ids.append(row)
    body = row[:-1] if row and row[-1] in eos else row
    texts.append(tokenizer.decode(body))
  decode_s = t4 - t3
  stats = GenerateStats(
      method=config.method, token_budget=token_budget, batch=B, prompt_tokens=list(lengths),
      new_tokens=[len(r) for r in token_ids], kv_bytes=kv_bytes, full_kv_bytes=full_kv_bytes,
      compression=full_kv_bytes / max(kv_bytes, 1), capacity=int(config.capacity),
      prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps,
      tokens_per_s=B * steps / decode_s if decode_s > 0 else 0.0, compile_s=compile_s + (t3 - t2))
  return GenerateResult(texts=texts, token_ids=token_ids, stats=stats)
