"""Batched text generation with any KV method of the core: text only at the edges.

generate = encode -> one jitted prefill (compressing each layer) -> the one decode loop (`loop.py`) -> decode
the tokens to text. Compilation is timed apart from prefill and decode.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rocketkv_jax import cache_nbytes, get_method, plan_limits, plan_rows, plan_static
from rocketkv_jax.methods import whole_overrides

from .llama import Llama, prefill_jit
from .sharding import DATA, MODEL, default_impl, host_readable, resolve_mesh, shard_batch, to_host, using
from .executables import SHARED
from .loop import LoopConfig, LoopOutput, RowSampling, check_loop_args, decode_loop_jit, uniform_rows
from .tokenizer import TextTokenizer

__all__ = ["GenerateResult", "GenerateStats", "Prefilled", "check_sampling", "check_token_ids", "decode_prefilled",
           "encode_prompts", "finish_reason", "generate", "plan_bucket", "plan_batch", "stop_ids"]

MIN_PLAN_BUCKET = 64  # the smallest prompt-length bucket a batch's static plan is made for


def plan_bucket(prompt_len: int, max_new_tokens: int, max_len: int) -> int:
  """The prompt-length bucket a batch whose longest prompt has `prompt_len` tokens compiles for: the next power of
  two from 64, at most max_len - max_new_tokens. One compile per bucket (and batch size); the cache is sized for
  the longest plan of a prompt up to the bucket, at most about twice the batch's own."""
  b = MIN_PLAN_BUCKET
  while b < prompt_len:
    b *= 2
  return max(prompt_len, min(b, max_len - max_new_tokens))


def plan_batch(method: str, prompt_lens: Sequence[int], *, token_budget: int, max_new_tokens: int, head_dim: int,
               n_kv_heads: int, model_dtype, max_len: int, keep_whole: bool = True, **overrides):
  """`generate`'s plans (`rocketkv_jax.BatchPlan`): each prompt the paper's plan for its own length
  (`rocketkv_jax.plan_rows`), run under the static config of its length bucket (`plan_bucket`,
  `rocketkv_jax.plan_static`), so a prompt's plan and answer are the same alone and in any batch. When the method's
  cache for the bucket would hold at least `full`'s bytes, the batch is kept whole: the plan is `full`'s
  (`plan.config.method == "full"`); keep_whole=False plans the method whatever it holds."""
  bucket = plan_bucket(max(prompt_lens), max_new_tokens, max_len)
  # full's cache holds exactly the batch's tokens (its prefill compiles per length anyway)
  exact = max(prompt_lens)
  static = plan_static(method, token_budget=token_budget,
                       max_prompt_len=bucket if get_method(method).budgeted else exact,
                       max_new_tokens=max_new_tokens, head_dim=head_dim, n_kv_heads=n_kv_heads,
                       model_dtype=model_dtype, max_len=max_len, whole_prompt_len=exact, **overrides)
  if not keep_whole and static.method != method:
    static = plan_limits(method, token_budget=token_budget, max_prompt_len=bucket, max_new_tokens=max_new_tokens,
                         head_dim=head_dim, max_len=max_len, **overrides)
  if static.method != method:
    overrides = whole_overrides(overrides)
  return plan_rows(static.method, token_budget=token_budget, prompt_lens=prompt_lens, max_new_tokens=max_new_tokens,
                   head_dim=head_dim, max_len=max_len, config=static, **overrides)


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
  compression_ratio: float      # kvpress-style: 1 - kv_bytes / full_kv_bytes, the fraction of full's bytes not
                                # held (0.75 = a quarter held; negative when the cache holds more than full would)
  capacity: int                 # cache slots per KV head per layer
  prefill_s: float
  decode_s: float
  decode_steps: int             # batched decode steps run (the loop stops when all sequences end)
  tokens_per_s: float           # batch * decode_steps / decode_s (0.0 when no step ran: every row stopped at once)
  compile_s: float
  kept_whole: list[bool] = dataclasses.field(default_factory=list)  # per sequence: its method's cache would have
                                # held at least full's bytes, so it ran full's (every token kept, dense attention:
                                # `rocketkv_jax.plan_static`)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateResult:
  """texts: without the stop id. token_ids: every generated id, the stop id included when one ended the row.
  finish_reasons: per row, "stop" (a stop id ended it) or "length" (max_new_tokens reached)."""

  texts: list[str]
  token_ids: list[list[int]]
  stats: GenerateStats
  finish_reasons: list[str] = dataclasses.field(default_factory=list)


def check_sampling(*, temperature=0.0, top_p=1.0, seed=0) -> None:
  """ValueError naming the value unless temperature is a finite number >= 0, top_p a finite number in (0, 1] and
  seed an int in [0, 2**32)."""
  for name, value in (("temperature", temperature), ("top_p", top_p)):
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
      raise ValueError(f"{name}={value!r} must be a number")
    if not math.isfinite(value):
      raise ValueError(f"{name}={value!r} must be finite")
  if temperature < 0:
    raise ValueError(f"temperature={temperature!r} must be >= 0 (0 is greedy)")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
  if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
    raise ValueError(f"seed={seed!r} must be an int")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed!r} must be in [0, 2**32)")


def check_token_ids(ids: Sequence[Sequence[int]], vocab_size: int) -> None:
  """ValueError naming the prompt, position and id unless every id is an int in [0, vocab_size)."""
  for i, row in enumerate(ids):
    for j, t in enumerate(row):
      if not isinstance(t, numbers.Integral) or isinstance(t, bool):
        raise ValueError(f"prompt {i}, position {j}: token id {t!r} must be an int")
      if not 0 <= t < vocab_size:
        raise ValueError(f"prompt {i}, position {j}: token id {int(t)} is outside the model's vocabulary "
                         f"[0, {vocab_size})")


def finish_reason(row: Sequence[int], stop: Sequence[int]) -> str:
  """"stop" when the row's last id is a stop id, else "length"."""
  return "stop" if row and row[-1] in stop else "length"


def sampling_defaults(tokenizer: TextTokenizer, temperature=None, top_p=None) -> tuple:
  """(temperature, top_p): the values given, else the checkpoint's generation defaults, else greedy (0) and 1."""
  gen = getattr(tokenizer, "generation", None) or {}
  return (gen.get("temperature", 0.0) if temperature is None else temperature,
          gen.get("top_p", 1.0) if top_p is None else top_p)


def stop_ids(model: Llama, tokenizer: TextTokenizer, chat: bool) -> tuple[int, ...]:
  """Ids that end a sequence: the model's EOS, plus the end-of-turn token for chat."""
  ids = (model.config.eos_id, tokenizer.eos_id, tokenizer.chat_eos_id if chat else None,
         *(getattr(tokenizer, "generation", None) or {}).get("eos_ids", ()))
  return tuple(sorted({i for i in ids if i is not None}))


def is_conversation(prompt) -> bool:
  """Whether a prompt is a conversation: a list of {"role": ..., "content": ...} messages."""
  return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def encode_prompts(tokenizer: TextTokenizer, prompts, chat: bool | None) -> list[list[int]]:
  """Ids of each prompt: a string (raw text, or one user turn through the chat template when chat=True), a
  conversation (a list of {"role", "content"} messages, through the chat template; refused with chat=False) or a
  list of token ids (as given)."""
  if isinstance(prompts, str):
    raise TypeError("prompts must be a list of strings, conversations or token id lists, not one string")
  prompts, ids = list(prompts), []
  if not prompts:
    raise ValueError("prompts is empty: give at least one prompt")
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      ids.append(tokenizer.encode(p, chat=bool(chat)))
    elif is_conversation(p):
      if chat is False:
        raise ValueError(f"prompt {i} is a conversation (a list of messages), but chat=False: conversations go "
                         "through the chat template (chat=None or True)")
      for j, m in enumerate(p):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
          raise ValueError(f"prompt {i}, message {j} ({m!r:.80}) must have a string 'role' and 'content'")
      ids.append(tokenizer.encode(tokenizer.apply_chat(list(p)), chat=False))
    else:
      try:
        row = None if isinstance(p, bytes) else np.asarray(p)
      except ValueError:  # ragged nesting
        row = None
      if row is None or row.ndim != 1:
        raise TypeError(f"prompt {i} is {p!r}: prompts must be a list of strings, conversations (lists of "
                        "messages) or token id lists (one id list is [ids])")
      if row.size and not np.issubdtype(row.dtype, np.integer):
        raise ValueError(f"prompt {i}: token ids must be ints, got dtype {row.dtype} ({p!r:.80})")
      ids.append(row.astype(np.int64).tolist())
  for i, x in enumerate(ids):
    if not x:
      raise ValueError(f"prompt {i} encodes to no tokens")
  return ids


@dataclasses.dataclass(kw_only=True)
class Prefilled:
  """A batch after prefill, where the decode loop starts: the last valid token's logits [B, V], the per-layer
  caches (the loop donates them), the prompt lengths, and the prefill's run and compile seconds."""

  logits_BV: jax.Array
  caches: tuple
  lengths: list[int]
  prefill_s: float = 0.0
  compile_s: float = 0.0


def generate(model: Llama, tokenizer: TextTokenizer, prompts: Sequence, *, method: str = "full",
             token_budget: int = 256, max_new_tokens: int = 64, temperature: float | None = None,
             top_p: float | None = None, seed: int = 0, chat: bool | None = None, keep_whole: bool = True,
             progress: Callable[[str], None] | None = None, mesh=None, data_axis=DATA, model_axis=MODEL,
             **config_overrides) -> GenerateResult:
  """Generates for a batch of prompts of different lengths: strings, conversations or token-id lists.

  chat: None (the default) takes each prompt as it is given, as transformers' and vLLM's `generate` take a string
  and their chat pipelines / `LLM.chat` a conversation: a string is raw text to continue, a conversation (a list of
  {"role": ..., "content": ...} messages) goes through the model's chat template, ending in the assistant's turn.
  chat=True puts each string in one user turn of the template (what an instruct model expects); chat=False refuses
  conversations. A warning (UserWarning) says when a raw string got an empty answer from a model with a chat template.
  keep_whole: False runs the method even where its cache would hold more than full's (below), as an engine does
  for a short request in slots sized for its limits.

  method/token_budget pick the KV cache (any method of the core; "full" ignores the budget).
  temperature 0 is greedy; otherwise temperature + top_p sampling, every prompt keyed by `seed` (`uniform_rows`: a
  prompt samples the same tokens alone or in any batch, and the server's for the same seed). Unset (None), they are the
  checkpoint's own defaults (its generation_config.json, `tokenizer.generation`), else greedy and 1.0. Each
  sequence stops at its EOS (the chat end-of-turn token with chat=True, the generation config's eos ids) or after
  max_new_tokens.

  Each prompt runs the paper's plan for its own length (ALGORITHM.md §1: S = min(its length + max_new_tokens,
  max_len); what stage 1 keeps, stage 2's top-r and page size), never its companions', so a prompt's greedy
  answer is the same alone or next to any others (`plan_batch`). The batch compiles for its length bucket
  (`plan_bucket`), and its caches are sized from the plans of prompts up to the bucket, not from max_len. A method
  never holds more than `full`: when its cache for the bucket would hold at least full's bytes (short prompts), the
  batch is kept whole, full's cache and dense attention (`stats.kept_whole`; `rocketkv_jax.plan_static`); full's
  cache holds exactly the batch's longest prompt + max_new_tokens (`stats.full_kv_bytes`). Each prompt is kept whole
  or not as it would be alone (a batch mixing both runs as two, one after the other), so its answer never depends
  on its companions.
  mesh: any `jax.sharding.Mesh` (`jax.make_mesh`, explicit or auto axes); data_axis / model_axis name its batch
  and tensor-parallel axes (`sharding.normalize_mesh`). The batch is split over the data axis; the model's
  parameters are where `load(mesh=)` / `shard_model` put them (pass the same mesh and axis names). No mesh: the one set
  with `jax.set_mesh` around the call, if any.
  config_overrides: fields of the method's config (e.g. impl="xla"); any other keyword is a TypeError that
  lists generate's own parameters and the config's fields.
  Raises ValueError naming the value for a sampling value out of range (`check_sampling`) or a token id outside
  the model's vocabulary.
  """
  _check_overrides(method, config_overrides)
  mesh = resolve_mesh(mesh, data_axis, model_axis)
  temperature, top_p = sampling_defaults(tokenizer, temperature, top_p)
  check_sampling(temperature=temperature, top_p=top_p, seed=seed)
  progress = progress or (lambda msg: None)
  cfg = model.config
  ids = encode_prompts(tokenizer, prompts, chat)
  chats = [bool(chat) if isinstance(p, str) else is_conversation(p) for p in prompts]
  loop = LoopConfig(max_new_tokens=max_new_tokens, stop_ids=stop_ids(model, tokenizer, any(chats)), cut_rows=top_p < 1)
  check_token_ids(ids, cfg.vocab_size)
  T = max(len(x) for x in ids)
  if T + max_new_tokens > cfg.max_len:
    raise ValueError(f"prompt of {T} tokens + {max_new_tokens=} exceeds the model's max_len={cfg.max_len}")
  if default_impl(mesh):
    config_overrides.setdefault("impl", default_impl(mesh))
  plan = functools.partial(plan_batch, method, keep_whole=keep_whole, token_budget=token_budget, max_new_tokens=max_new_tokens,
                           head_dim=cfg.head_dim, n_kv_heads=cfg.n_kv_heads, model_dtype=model.dtype,
                           max_len=cfg.max_len, **config_overrides)
  # each prompt kept whole or not as it would be alone, so its answer never depends on its companions
  whole = [keep_whole and plan([len(x)]).config.method != method for x in ids]
  groups = [[i for i in range(len(ids)) if whole[i] == w] for w in (True, False)]
  parts = []
  for group in (g for g in groups if g):
    sub = [ids[i] for i in group]
    if whole[group[0]]:
      progress(f"{method}'s cache would hold at least a full cache's bytes for {len(group)} prompt(s) of up to "
               f"{max(map(len, sub))} tokens + {max_new_tokens} new: kept whole (full's cache, dense attention)")
    with using(mesh):
      parts.append((group, _run_batch(model, tokenizer, sub, plan([len(x) for x in sub]), loop, mesh=mesh,
                                      token_budget=token_budget, progress=progress, method=method,
                                      rows=uniform_rows(len(sub), temperature, top_p, seed))))
  result = parts[0][1] if len(parts) == 1 else _merge(parts, len(ids))
  empty = [i for i, p in enumerate(prompts) if isinstance(p, str) and not chats[i] and not result.texts[i].strip()]
  if empty and tokenizer.chat_template:
    warnings.warn(f"prompt(s) {empty} went to the model as raw text and got an empty answer; this model has a chat "
                  "template, and an instruct model usually needs it: pass chat=True, or each prompt as a list of "
                  "messages", UserWarning, stacklevel=2)
  return result


def _run_batch(model: Llama, tokenizer: TextTokenizer, ids, plan, loop: LoopConfig, *, mesh, token_budget: int,
               progress, method: str, rows: RowSampling) -> GenerateResult:
  """One batch of token-id prompts under one plan (`plan_batch`): prefill, then the decode loop."""
  B, lengths = len(ids), np.array([len(x) for x in ids], np.int32)
  T = int(lengths.max())
  tokens = np.zeros((B, T), np.int32)
  for b, x in enumerate(ids):
    tokens[b, :len(x)] = x
  config = plan.config
  graphdef, state = nnx.split(model)
  tokens_j, lengths_j = jnp.asarray(tokens), jnp.asarray(lengths)
  if mesh is not None:  # the batch split over the data axis; the model's placement is load(mesh=)'s
    tokens_j, lengths_j = shard_batch(tokens_j, mesh), shard_batch(lengths_j, mesh)
  t0 = time.perf_counter()
  progress(f"compiling prefill ({B} x {T} tokens, {config.method})")
  pre = SHARED.for_args(prefill_jit, graphdef, state, tokens_j, lengths_j, plan.rows, config=config)
  t1 = time.perf_counter()
  progress(f"prefill {B} x {T} tokens ({config.method}, budget {token_budget})")
  logits, caches = pre(state, tokens_j, lengths_j, plan.rows)
  jax.block_until_ready((logits, caches))
  prefilled = Prefilled(logits_BV=logits, caches=caches, lengths=lengths.tolist(),
                        prefill_s=time.perf_counter() - t1, compile_s=t1 - t0)
  return decode_prefilled(model, tokenizer, prefilled, config, loop, token_budget=token_budget, rows=rows,
                          progress=progress, method=method)


def _merge(parts, n: int) -> GenerateResult:
  """One result from the batches of `generate`'s groups ((row indices, result) pairs), rows in prompt order; the
  groups ran one after the other, so their times and bytes add up."""
  order = [None] * n
  for group, res in parts:
    for j, i in enumerate(group):
      order[i] = (res, j)
  pick = lambda f: [f(r)[j] for r, j in order]  # noqa: E731
  stats = [r.stats for _, r in parts]
  kv, full = sum(s.kv_bytes for s in stats), sum(s.full_kv_bytes for s in stats)
  decode_s = sum(s.decode_s for s in stats)
  merged = GenerateStats(
      method=stats[0].method, token_budget=stats[0].token_budget, batch=n,
      prompt_tokens=pick(lambda r: r.stats.prompt_tokens), new_tokens=pick(lambda r: r.stats.new_tokens),
      kv_bytes=kv, full_kv_bytes=full, compression=full / max(kv, 1), compression_ratio=1 - kv / max(full, 1),
      capacity=max(s.capacity for s in stats), prefill_s=sum(s.prefill_s for s in stats), decode_s=decode_s,
      decode_steps=sum(s.decode_steps for s in stats),
      tokens_per_s=sum(s.batch * s.decode_steps for s in stats) / decode_s if decode_s > 0 else 0.0,
      compile_s=sum(s.compile_s for s in stats), kept_whole=pick(lambda r: r.stats.kept_whole))
  return GenerateResult(texts=pick(lambda r: r.texts), token_ids=pick(lambda r: r.token_ids), stats=merged,
                        finish_reasons=pick(lambda r: r.finish_reasons))


def _check_overrides(method: str, overrides: dict) -> None:
  """TypeError naming the keywords that are neither generate's parameters nor fields of the method's config."""
  fields = sorted(f.name for f in dataclasses.fields(get_method(method)))
  unknown = sorted(set(overrides) - set(fields))
  if unknown:
    own = [n for n, p in inspect.signature(generate).parameters.items() if p.kind == p.KEYWORD_ONLY]
    raise TypeError(f"generate() got unknown keyword argument(s) {unknown}: generate's own keywords are {own}; "
                    f"other keywords must be fields of the {method!r} method's config ({fields})")


def decode_prefilled(model: Llama, tokenizer: TextTokenizer, prefilled: Prefilled, config, loop: LoopConfig, *,
                     token_budget: int, rows: RowSampling | None = None, progress=None,
                     method: str | None = None) -> GenerateResult:
  """Runs the decode loop from a prefilled batch (its caches are donated) and builds the result: texts without
  their stop id, and the stats (`token_budget` is reported as given). rows: the batch's sampling (`uniform_rows`);
  None is greedy. method: the method asked for, when the batch was kept whole (`config` is then full's)."""
  progress = progress or (lambda msg: None)
  cfg = model.config
  logits, caches = prefilled.logits_BV, host_readable(prefilled.caches)  # (several processes: lengths replicated)
  check_loop_args(logits, caches, config, loop)
  kv_bytes = cache_nbytes(caches)
  itemsize = jnp.dtype(model.dtype).itemsize  # a full cache in the model's dtype (an FP8 cache holds 1 byte)
  B = logits.shape[0]
  full_kv_bytes = (2 * cfg.n_layers * B * cfg.n_kv_heads * cfg.head_dim * (max(prefilled.lengths) + loop.max_new_tokens)
                   * itemsize)
  graphdef, state = nnx.split(model)
  t2 = time.perf_counter()
  progress(f"compiling decode loop ({loop.max_new_tokens} tokens, {config.method})")
  run = SHARED.for_args(decode_loop_jit, graphdef, state, logits, caches, None, None, rows, config=config, loop=loop)
  t3 = time.perf_counter()
  progress(f"decode up to {loop.max_new_tokens} tokens ({config.method})")
  out: LoopOutput = run(state, logits, caches, None, None, rows)
  tokens, steps = to_host(out.tokens), int(to_host(out.steps))
  decode_s = time.perf_counter() - t3
  del out

  token_ids = [[int(t) for t in row if t >= 0] for row in tokens]
  reasons = [finish_reason(row, loop.stop_ids) for row in token_ids]
  texts = [tokenizer.decode(row[:-1] if why == "stop" else row) for row, why in zip(token_ids, reasons)]
  stats = GenerateStats(
      method=method or config.method, token_budget=token_budget, batch=B, prompt_tokens=list(prefilled.lengths),
      new_tokens=[len(r) for r in token_ids], kv_bytes=kv_bytes, full_kv_bytes=full_kv_bytes,
      compression=full_kv_bytes / max(kv_bytes, 1), compression_ratio=1 - kv_bytes / max(full_kv_bytes, 1),
      capacity=int(config.capacity),
      prefill_s=prefilled.prefill_s, decode_s=decode_s, decode_steps=steps,
      tokens_per_s=B * steps / decode_s if decode_s > 0 else 0.0, compile_s=prefilled.compile_s + (t3 - t2),
      kept_whole=[method is not None and method != config.method] * B)
  if config.budgeted and kv_bytes > full_kv_bytes * 1.01:
    warnings.warn(f"{config.method} holds {kv_bytes / full_kv_bytes:.2f}x the KV a full cache would for these "
                  f"prompts ({kv_bytes / 2**20:.1f} MiB against {full_kv_bytes / 2**20:.1f} MiB): the token budget "
                  f"({token_budget}) counts the KV pairs a decode step reads, not the cache size; compression pays "
                  "off when prompts are several times longer than the budget", RuntimeWarning, stacklevel=3)
  return GenerateResult(texts=texts, token_ids=token_ids, stats=stats, finish_reasons=reasons)
