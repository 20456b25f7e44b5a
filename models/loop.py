"""The one decode loop: tokens in, tokens out, in one jit (caches donated, no host round trip per token).

From the prefill's last logits [B, V] and the per-layer caches, `decode_loop` samples the first new token,
then runs the model's decode step (`llama.decode_body`) once per further token. `generate`, the demo, the
decode benchmark (`benchmarks/decode.py`: n greedy steps, no stop ids) and the accuracy suite (greedy
generation and teacher-forced log-probs) all run this loop, so every figure measures the code users run,
fused kernels included.

Per row: out[b, 0] is sampled from the prefill logits; out[b, i] from the logits of step i, whose input is
out[b, i - 1] (or forced[b, i - 1] when teacher-forced). A row ends after it emits a stop id (the stop id is
kept); later entries are -1. With stop ids the loop is a while loop that ends once every row has ended; without
them it always runs max_new_tokens - 1 steps (a loop of static trip count, which XLA runs without reading a
predicate back per step).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .llama import Llama, decode_body

__all__ = ["LoopConfig", "LoopOutput", "RowSampling", "check_loop_args", "compile_once", "decode_loop",
           "decode_loop_jit", "sample_rows", "sample_token"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
  """What the loop does; frozen and hashable (a static jit argument: a new value recompiles).

  max_new_tokens: tokens produced per row (the first from the prefill logits), so max_new_tokens - 1 steps.
  temperature: 0 is greedy (argmax); else softmax(logits / temperature) sampling, cut to the nucleus top_p.
  stop_ids: token ids that end a row (EOS, end of turn); () runs every step.
  return_logprobs: also return log_softmax of each token's logits [B, max_new_tokens, V] (float32).
  carry_logits: also feed the last token (one more model step: max_new_tokens steps in all) and return the
    logits it gives (`LoopOutput.logits_BV`), so that a next call continues from them.
  cut_rows: with per-row sampling (`RowSampling`), apply the rows' top-p / top-k cuts; False when no row asks
    for one (the caller knows), which skips sorting the vocabulary each step. The loop has no data-dependent
    branch: on a GPU an XLA conditional reads its predicate back to the host, a sync per step.
  """

  max_new_tokens: int
  temperature: float = 0.0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = ()
  return_logprobs: bool = False
  carry_logits: bool = False
  cut_rows: bool = True

  def __post_init__(self):
    n = self.max_new_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"max_new_tokens={n!r} must be an int >= 1")
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature!r} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    stop = tuple(int(i) for i in self.stop_ids)
    if any(i < 0 for i in stop):
      raise ValueError(f"stop_ids={stop} must be token ids >= 0")
    object.__setattr__(self, "stop_ids", tuple(sorted(set(stop))))


class LoopOutput(NamedTuple):
  """tokens: [B, max_new_tokens] int32, -1 after a row's stop id. steps: [] int32, decode steps run (model
  calls; the first token needs none). caches: the final per-layer caches. logprobs: [B, max_new_tokens, V]
  float32 with return_logprobs, else None; rows that ended hold their logits' log-probs all the same.
  logits_BV: with carry_logits, the logits [B, V] after the last token was fed (where the next call starts)."""

  tokens: jax.Array
  steps: jax.Array
  caches: tuple
  logprobs: jax.Array | None
  logits_BV: jax.Array | None = None


class RowSampling(NamedTuple):
  """Per-row sampling, every field an array [B] (values never recompile).

  temperature: float32, 0 is greedy (argmax). top_p: float32 in (0, 1], 1 is off. top_k: int32, 0 is off.
  seed: uint32, the row's key is jax.random.key(seed). index: int32, the row's token index of out[:, 0]: token j
  of the call is sampled with fold_in(key, index + j), so a row's samples depend only on its own seed, logits
  and token index.
  """

  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  seed: jax.Array
  index: jax.Array


def sample_token(logits_BV, key, temperature: float, top_p: float):
  """Greedy when temperature == 0; else temperature + nucleus (top_p) sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits = logits_BV.astype(jnp.float32) / temperature
  if top_p < 1.0:
    B = logits.shape[0]
    cutoff = cut_off_logit(logits, jnp.full((B,), top_p, jnp.float32), jnp.zeros((B,), jnp.int32))
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def cut_off_logit(logits_BV, top_p_B, top_k_B):
  """[B, 1]: each row's smallest kept logit: the last of the smallest prefix (by descending logit) whose
  probability mass reaches top_p, shortened to top_k tokens where top_k > 0; at least one token."""
  sorted_ = -jnp.sort(-logits_BV, axis=-1)  # descending
  probs = jax.nn.softmax(sorted_, axis=-1)
  cum = jnp.cumsum(probs, axis=-1)
  n_keep = jnp.sum(cum - probs < top_p_B[:, None], axis=-1)
  n_keep = jnp.where(top_k_B > 0, jnp.minimum(n_keep, top_k_B), n_keep)
  n_keep = jnp.clip(n_keep, 1, logits_BV.shape[-1])
  return jnp.take_along_axis(sorted_, n_keep[:, None] - 1, axis=-1)


def sample_rows(logits_BV, rows: RowSampling, offset, *, cut: bool = True):
  """Token [B] int32 of each row under its own sampling (`RowSampling`), for its token index rows.index + offset.

  A row with temperature 0 takes the argmax. Otherwise softmax(logits / temperature), cut to the top_k most
  likely tokens (top_k > 0) and to the smallest set whose mass reaches top_p (top_p < 1), both by the logit at
  the cut-off (ties with it are kept), then sampled with fold_in(key(seed), index + offset). What a row gets
  never depends on the other rows: the cut applies to rows that ask for it only, and greedy rows get their
  argmax whatever the others do. cut=False (static) skips the cut (and its vocabulary sort) for every row: only
  correct when no row asks for one. A batch of greedy rows only is cheaper as the loop's plain greedy path.
  """
  greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  hot = rows.temperature > 0
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(rows.seed, rows.index + offset)
  logits = logits_BV.astype(jnp.float32) / jnp.where(hot, rows.temperature, 1.0)[:, None]
  if cut:
    cut_B = hot & ((rows.top_p < 1) | (rows.top_k > 0))
    cutoff = cut_off_logit(logits, rows.top_p, rows.top_k)
    logits = jnp.where(cut_B[:, None] & (logits < cutoff), -jnp.inf, logits)
  tok = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
  return jnp.where(hot, tok, greedy)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "loop"), donate_argnames=("caches",))
def decode_loop_jit(graphdef, state, logits_BV, caches, key, forced_BT, finished_B, rows=None, *, config,
                    loop: LoopConfig) -> LoopOutput:
  """`decode_loop` over nnx.split(model), every argument given (forced_BT, finished_B and rows may be None):
  lower and compile it to time compilation apart. The caches are donated."""
  model = nnx.merge(graphdef, state)
  B = logits_BV.shape[0]
  n = loop.max_new_tokens
  stop_S = jnp.asarray(loop.stop_ids or (-1,), jnp.int32)  # -1 never matches a sampled token
  # with carry_logits, one more step feeds the last token; what it samples (column n) is dropped
  last = n + 1 if loop.carry_logits else n

  def pick(logits, key, done, i):
    """The next token of each row (-1 where the row has ended) and whether the row ends with it."""
    sub = None
    if rows is not None:
      tok = sample_rows(logits, rows, i, cut=loop.cut_rows)
    else:
      if loop.temperature > 0:  # greedy needs no key (and no threefry kernel per step)
        key, sub = jax.random.split(key)
      tok = sample_token(logits, sub, loop.temperature, loop.top_p)
    tok = jnp.where(done, -1, tok)
    return tok, done | jnp.isin(tok, stop_S), key

  def logprobs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

  done = jnp.zeros((B,), bool) if finished_B is None else finished_B.astype(bool)
  tok, done, key = pick(logits_BV, key, done, 0)
  out = jnp.full((B, last), -1, jnp.int32).at[:, 0].set(tok)
  lp = jnp.zeros((B, last, logits_BV.shape[-1]), jnp.float32).at[:, 0].set(logprobs(logits_BV)) \
      if loop.return_logprobs else None
  carried = logits_BV if loop.carry_logits else None

  def body(i, carry):
    tok, caches, done, out, lp, key, carried = carry
    fed = jnp.maximum(tok, 0) if forced_BT is None else forced_BT[:, i - 1]
    logits, caches = decode_body(model, fed, caches, config)
    tok, done, key = pick(logits, key, done, i)
    out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
    if lp is not None:
      lp = jax.lax.dynamic_update_slice(lp, logprobs(logits)[:, None], (0, i, 0))
    return tok, caches, done, out, lp, key, (logits if carried is not None else None)

  carry = (tok, caches, done, out, lp, key, carried)
  if loop.stop_ids:
    def cond(c):
      i, (_, _, done, *_) = c
      return (i < last) & ~jnp.all(done)

    i, carry = jax.lax.while_loop(cond, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(1), carry))
    steps = i - 1
  else:
    carry = jax.lax.fori_loop(1, last, body, carry)
    steps = jnp.int32(last - 1)
  _, caches, _, out, lp, _, carried = carry
  if loop.carry_logits:
    out = out[:, :n]
    lp = None if lp is None else lp[:, :n]
  return LoopOutput(tokens=out, steps=steps, caches=caches, logprobs=lp, logits_BV=carried)


def check_loop_args(logits_BV, caches, config, loop: LoopConfig, forced_BT=None) -> None:
  """Host-side checks before a run (inside the jit a step past a cache's capacity would drop its token)."""
  B = logits_BV.shape[0]
  config.check_room(caches[0], loop.max_new_tokens - (0 if loop.carry_logits else 1))
  if forced_BT is not None:
    if loop.stop_ids:
      raise ValueError(f"teacher forcing runs every step: give no stop_ids (got {loop.stop_ids})")
    if forced_BT.ndim != 2 or forced_BT.shape[0] != B or forced_BT.shape[1] < loop.max_new_tokens - 1:
      raise ValueError(f"forced_BT.shape={tuple(forced_BT.shape)} must be ({B}, >= max_new_tokens - 1 = "
                       f"{loop.max_new_tokens - 1})")


def decode_loop(model: Llama, logits_BV, caches, config, loop: LoopConfig, *, key=None, forced_BT=None,
                finished_B=None, rows: RowSampling | None = None) -> LoopOutput:
  """Runs the loop (module doc) from the prefill's last logits [B, V] and the per-layer caches (donated).

  config: the method config the caches were built with. key: the sampling key (jax.random.key(0) when None;
  unused when greedy). forced_BT: [B, F >= max_new_tokens - 1] int32 teacher forcing: step i feeds
  forced[:, i - 1] instead of the row's last token (out[:, i] is still the model's own choice; pair with
  return_logprobs to score forced[:, :max_new_tokens] under the model); needs stop_ids=(). finished_B: [B]
  bool rows that have already ended (padding rows of a batch): they emit -1 only. rows: per-row sampling
  (`RowSampling`); when given it replaces loop.temperature / top_p and `key`.
  """
  check_loop_args(logits_BV, caches, config, loop, forced_BT)
  key = jax.random.key(0) if key is None else key
  forced_BT = None if forced_BT is None else jnp.asarray(forced_BT, jnp.int32)
  finished_B = None if finished_B is None else jnp.asarray(finished_B, bool)
  graphdef, state = nnx.split(model)
  return decode_loop_jit(graphdef, state, logits_BV, caches, key, forced_BT, finished_B, rows, config=config,
                         loop=loop)


_COMPILED: dict = {}


def compile_once(fn, *args, **static):
  """fn (a jax.jit function) AOT-compiled for these arguments' shapes, shardings and these static arguments (and
  the mesh set, if any), cached, so
  that compile time can be measured apart: call the result with the non-static arguments after the first
  (args[0] is the static graphdef)."""
  key = (fn, args[0], jax.tree.structure(args[1:]),
         tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in jax.tree.leaves(args[1:])),
         tuple(sorted(static.items())), jax.sharding.get_abstract_mesh())
  if key not in _COMPILED:
    if len(_COMPILED) >= 64:  # many distinct prompt shapes: drop old executables
      _COMPILED.clear()
    _COMPILED[key] = fn.lower(*args, **static).compile()
  return _COMPILED[key]
