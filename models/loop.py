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

One sampler: without a `RowSampling` every row takes its argmax (greedy); with one, each row samples under its own
temperature, top-p, top-k and seed (`sample_rows`): the engine's requests, and `generate`'s batch through
`uniform_rows` (every row the same values and seed).

Per-row processing (`RowProcessing`, the engine's requests with penalties, logit bias, min_tokens or logprobs):
before a row samples, its logits get its logit bias added, its stop ids masked while it has produced fewer than
min_tokens tokens, then vLLM's penalties (repetition over the prompt's and the output's tokens, then frequency
and presence over the output's), all per row as arrays, so a value never recompiles. The loop then carries the
rows' output token counts [B, V]. With `LoopConfig.top_logprobs`, it also returns each sampled token's
log-probability and the most likely tokens under the model's raw distribution (log_softmax of the logits
before any processing or temperature), computed in the step that samples the token, not by a second pass.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .llama import Llama, decode_body

__all__ = ["LoopConfig", "LoopOutput", "RowProcessing", "RowSampling", "check_loop_args", "decode_loop",
           "decode_loop_jit", "process_logits", "sample_rows", "uniform_rows"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
  """What the loop does; frozen and hashable (a static jit argument: a new value recompiles).

  max_new_tokens: tokens produced per row (the first from the prefill logits), so max_new_tokens - 1 steps.
  stop_ids: token ids that end a row (EOS, end of turn); () runs every step.
  return_logprobs: also return log_softmax of each token's logits [B, max_new_tokens, V] (float32).
  carry_logits: also feed the last token (one more model step: max_new_tokens steps in all) and return the
    logits it gives (`LoopOutput.logits_BV`), so that a next call continues from them.
  cut_rows: with per-row sampling (`RowSampling`), apply the rows' top-p / top-k cuts; False when no row asks
    for one (the caller knows), which skips sorting the vocabulary each step. The loop has no data-dependent
    branch: on a GPU an XLA conditional reads its predicate back to the host, a sync per step.
  top_logprobs: None, or k >= 0: also return each sampled token's log-probability and the k most likely tokens'
    (`LoopOutput.token_logprobs`, `top_ids`, `top_logprobs`), under the raw distribution (module doc).
  """

  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  return_logprobs: bool = False
  carry_logits: bool = False
  cut_rows: bool = True
  top_logprobs: int | None = None

  def __post_init__(self):
    n = self.max_new_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"max_new_tokens={n!r} must be an int >= 1")
    stop = tuple(int(i) for i in self.stop_ids)
    if any(i < 0 for i in stop):
      raise ValueError(f"stop_ids={stop} must be token ids >= 0")
    object.__setattr__(self, "stop_ids", tuple(sorted(set(stop))))
    k = self.top_logprobs
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
      raise ValueError(f"top_logprobs={k!r} must be None or an int >= 0")


class LoopOutput(NamedTuple):
  """tokens: [B, max_new_tokens] int32, -1 after a row's stop id. steps: [] int32, decode steps run (model
  calls; the first token needs none). caches: the final per-layer caches. logprobs: [B, max_new_tokens, V]
  float32 with return_logprobs, else None; rows that ended hold their logits' log-probs all the same.
  logits_BV: with carry_logits, the logits [B, V] after the last token was fed (where the next call starts).
  With LoopConfig.top_logprobs = k: token_logprobs [B, max_new_tokens] float32, each token's log-probability
  (where a row emitted -1: that of token 0, meaningless); top_ids [B, max_new_tokens, k] int32 and top_logprobs
  [B, max_new_tokens, k] float32, the k most likely tokens, most likely first. counts: with `RowProcessing`,
  the rows' output token counts [B, V] after the call (the next call's `RowProcessing.counts`)."""

  tokens: jax.Array
  steps: jax.Array
  caches: tuple
  logprobs: jax.Array | None
  logits_BV: jax.Array | None = None
  token_logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None
  counts: jax.Array | None = None


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


class RowProcessing(NamedTuple):
  """Per-row logit processing (module doc), arrays whose values never recompile; V: the vocabulary size.

  presence, frequency: float32 [B], 0 is off; repetition: float32 [B] > 0, 1 is off (vLLM's semantics: a
  positive logit of a seen token is divided by it, a negative one multiplied). min_tokens: int32 [B]: while a
  row's token index (`RowSampling.index` + step) is below it, its `stop_ids` cannot be sampled. bias_ids
  int32 [B, L] with bias float32 [B, L]: added to those logits (ids >= V are padding). stop_ids: int32 [B, S]
  (ids >= V are padding). counts: int32 [B, V], each row's output tokens so far (the loop adds the tokens it
  samples). prompt_mask: bool [B, V], the tokens of each row's prompt (repetition penalty only).
  """

  presence: jax.Array
  frequency: jax.Array
  repetition: jax.Array
  min_tokens: jax.Array
  bias_ids: jax.Array
  bias: jax.Array
  stop_ids: jax.Array
  counts: jax.Array
  prompt_mask: jax.Array


def process_logits(logits_BV, proc: RowProcessing, counts_BV, index_B):
  """The logits [B, V] float32 each row samples from after its processing (`RowProcessing`), before
  temperature. index_B: each row's token index (tokens it produced before this one)."""
  B = logits_BV.shape[0]
  b = jnp.arange(B)[:, None]
  x = logits_BV.astype(jnp.float32)
  x = x.at[b, proc.bias_ids].add(proc.bias, mode="drop")
  early = (index_B < proc.min_tokens)[:, None]
  x = x.at[b, proc.stop_ids].add(jnp.where(early, -jnp.inf, 0.0), mode="drop")
  seen = proc.prompt_mask | (counts_BV > 0)
  r = proc.repetition[:, None]
  x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
  x = x - proc.frequency[:, None] * counts_BV - proc.presence[:, None] * (counts_BV > 0)
  return x


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


def uniform_rows(batch: int, temperature: float, top_p: float = 1.0, seed: int = 0) -> RowSampling | None:
  """The `RowSampling` of `batch` rows that all sample alike (generate's): temperature and top_p, each row keyed by
  `seed` from token index 0, so a row's tokens depend on its own prompt and the seed only, never on its
  companions (and equal the serving engine's for the same request and seed). None when greedy (temperature 0):
  the loop's argmax path."""
  if temperature == 0:
    return None
  full = lambda v, dtype: jnp.full((batch,), v, dtype)  # noqa: E731
  return RowSampling(temperature=full(temperature, jnp.float32), top_p=full(top_p, jnp.float32),
                     top_k=full(0, jnp.int32), seed=full(seed, jnp.uint32), index=full(0, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "loop"), donate_argnames=("caches",))
def decode_loop_jit(graphdef, state, logits_BV, caches, forced_BT, finished_B, rows=None, process=None, *,
                    config, loop: LoopConfig) -> LoopOutput:
  """`decode_loop` over nnx.split(model), every argument given (forced_BT, finished_B, rows and process may be
  None): lower and compile it to time compilation apart. The caches are donated."""
  model = nnx.merge(graphdef, state)
  B = logits_BV.shape[0]
  n = loop.max_new_tokens
  stop_S = jnp.asarray(loop.stop_ids or (-1,), jnp.int32)  # -1 never matches a sampled token
  # with carry_logits, one more step feeds the last token; what it samples (column n) is dropped
  last = n + 1 if loop.carry_logits else n

  V = logits_BV.shape[-1]
  K = loop.top_logprobs

  def pick(logits, done, i, counts):
    """The next token of each row (-1 where the row has ended) and whether the row ends with it."""
    if rows is not None:
      x = logits if process is None else process_logits(logits, process, counts, rows.index + i)
      tok = sample_rows(x, rows, i, cut=loop.cut_rows)
    else:  # greedy: no key, no threefry kernel per step
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tok = jnp.where(done, -1, tok)
    return tok, done | jnp.isin(tok, stop_S)

  def logprobs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

  def count(counts, tok):
    """counts with each row's new token added (rows that emitted -1 add nothing)."""
    if counts is None:
      return None
    return counts.at[jnp.arange(B), jnp.where(tok >= 0, tok, V)].add(1, mode="drop")

  def scores(logits, tok, i, extra):
    """extra's token_logprobs / top_ids / top_logprobs with column i filled (unchanged without top_logprobs)."""
    if K is None:
      return extra
    tlp, tid, tv = extra
    lp_BV = logprobs(logits)
    chosen = jnp.take_along_axis(lp_BV, jnp.maximum(tok, 0)[:, None], axis=-1)
    top_v, top_i = jax.lax.top_k(lp_BV, max(K, 1))
    return (jax.lax.dynamic_update_slice(tlp, chosen, (0, i)),
            jax.lax.dynamic_update_slice(tid, top_i[:, None, :K].astype(jnp.int32), (0, i, 0)),
            jax.lax.dynamic_update_slice(tv, top_v[:, None, :K], (0, i, 0)))

  done = jnp.zeros((B,), bool) if finished_B is None else finished_B.astype(bool)
  counts = None if process is None else process.counts
  tok, done = pick(logits_BV, done, 0, counts)
  counts = count(counts, tok)
  out = jnp.full((B, last), -1, jnp.int32).at[:, 0].set(tok)
  lp = jnp.zeros((B, last, logits_BV.shape[-1]), jnp.float32).at[:, 0].set(logprobs(logits_BV)) \
      if loop.return_logprobs else None
  extra = None if K is None else (jnp.zeros((B, last), jnp.float32), jnp.zeros((B, last, K), jnp.int32),
                                  jnp.zeros((B, last, K), jnp.float32))
  extra = scores(logits_BV, tok, 0, extra)
  carried = logits_BV if loop.carry_logits else None

  def body(i, carry):
    tok, caches, done, out, lp, carried, counts, extra = carry
    fed = jnp.maximum(tok, 0) if forced_BT is None else forced_BT[:, i - 1]
    logits, caches = decode_body(model, fed, caches, config)
    tok, done = pick(logits, done, i, counts)
    out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
    if lp is not None:
      lp = jax.lax.dynamic_update_slice(lp, logprobs(logits)[:, None], (0, i, 0))
    return (tok, caches, done, out, lp, (logits if carried is not None else None), count(counts, tok),
            scores(logits, tok, i, extra))

  carry = (tok, caches, done, out, lp, carried, counts, extra)
  if loop.stop_ids:
    def cond(c):
      i, (_, _, done, *_) = c
      return (i < last) & ~jnp.all(done)

    i, carry = jax.lax.while_loop(cond, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(1), carry))
    steps = i - 1
  else:
    carry = jax.lax.fori_loop(1, last, body, carry)
    steps = jnp.int32(last - 1)
  _, caches, _, out, lp, carried, counts, extra = carry
  if loop.carry_logits:
    out = out[:, :n]
    lp = None if lp is None else lp[:, :n]
    extra = None if extra is None else tuple(x[:, :n] for x in extra)
  tlp, tid, tv = (None, None, None) if extra is None else extra
  return LoopOutput(tokens=out, steps=steps, caches=caches, logprobs=lp, logits_BV=carried, token_logprobs=tlp,
                    top_ids=tid, top_logprobs=tv, counts=counts)


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


def decode_loop(model: Llama, logits_BV, caches, config, loop: LoopConfig, *, forced_BT=None,
                finished_B=None, rows: RowSampling | None = None, process: RowProcessing | None = None) -> LoopOutput:
  """Runs the loop (module doc) from the prefill's last logits [B, V] and the per-layer caches (donated).

  config: the method config the caches were built with. forced_BT: [B, F >= max_new_tokens - 1] int32 teacher
  forcing: step i feeds forced[:, i - 1] instead of the row's last token (out[:, i] is still the model's own
  choice; pair with return_logprobs to score forced[:, :max_new_tokens] under the model); needs stop_ids=().
  finished_B: [B] bool rows that have already ended (padding rows of a batch): they emit -1 only. rows: per-row
  sampling (`RowSampling`, `uniform_rows`); None is greedy. process: per-row logit processing (`RowProcessing`;
  needs rows): the output's `counts` are the rows' counts after the call.
  """
  if process is not None and rows is None:
    raise ValueError("process (RowProcessing) needs rows (RowSampling): processing is per row")
  check_loop_args(logits_BV, caches, config, loop, forced_BT)
  forced_BT = None if forced_BT is None else jnp.asarray(forced_BT, jnp.int32)
  finished_B = None if finished_B is None else jnp.asarray(finished_B, bool)
  graphdef, state = nnx.split(model)
  return decode_loop_jit(graphdef, state, logits_BV, caches, forced_BT, finished_B, rows, process,
                         config=config, loop=loop)
