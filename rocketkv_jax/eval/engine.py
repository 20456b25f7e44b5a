"""Compress one dense prefill many ways, then decode it with the one decode loop (greedy, teacher-forced, or
query-agnostic: the question fed through the method's decode steps after compression, then greedy).

The prefill is dense and shared: `models.prefill_dense` returns every layer's post-RoPE (q, k, v), which do
not depend on the method (stage 1 only evicts after a layer's attention), and the core's `prefill_compress`
turns them into each method's cache, layer by layer. Decoding is `models.decode_loop`, the whole model in one
jit: the code `generate` runs and `benchmarks/decode.py` times, with the fused norm/RoPE kernels when the
config's impl runs kernels. Greedy generation stops at the stop ids; teacher forcing feeds the sequence's
own tokens and returns the log-probs of every step.

Compile cost: the loop unrolls every layer, so each method config compiles a whole-model loop (greedy,
teacher-forced and the agnostic mode's feed-then-greedy pair are separate executables), plus its per-layer
compression. For SmolLM2-135M (30 layers) on a 2-core CPU that is 3-15 s per config and mode, ~93% of it XLA
compilation (which releases the GIL) and ~7% tracing; `Runner.precompile` compiles them in a thread pool while the
device runs the configs already compiled (README.md, "Where the time goes").

Selection diagnostic (`diag=True`): a second pass over the same forced tokens, one jitted layer step at a
time (the model's public `decode_layer`, the same code the loop's step composes), recomputes after every
step and layer which cache slots the method attends (`config.attended_slots`: all valid slots for a dense
method, the top-k selection otherwise), maps slots to absolute positions (`config.kept_positions` after the
prefill, then `config.write_slot` each step), and sums the *exact* attention probabilities of the step's
query over the whole uncompressed sequence (every prompt key + every generated key of this run) at those
positions. `mass` is that share (mean over query heads); `oracle` is the share the best possible set of the
same size per KV head would capture (top-M positions by the group-mean exact probability, which is how
exact_topk ranks tokens). The query and generated keys are the method's own (teacher forcing keeps the input
tokens identical; hidden states may drift), so the diagnostic measures the selector, not the drift.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rocketkv_jax
from rocketkv_jax.models import LoopConfig, prefill_dense
from rocketkv_jax.models.executables import Executables
from rocketkv_jax.models.loop import check_loop_args, decode_loop_jit
from rocketkv_jax.models.llama import decode_layer, embed_tokens
from rocketkv_jax.select import attention_probs


def make_config(method: str, budget: int, prompt_len: int, max_new: int, model_cfg, **overrides):
  """The config of a cell's prompts, by the one planning rule (`rocketkv_jax.plan_rows`): every prompt of a cell
  has exactly `prompt_len` tokens, so this is each prompt's own plan."""
  return rocketkv_jax.plan_rows(method, token_budget=budget, prompt_lens=[prompt_len], max_new_tokens=max_new,
                                head_dim=model_cfg.head_dim, max_len=model_cfg.max_len, **overrides).config


# ----------------------------------------------------------------------------- the diagnostic's pieces


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed_j(graphdef, state, tokens_B):
  return embed_tokens(nnx.merge(graphdef, state), tokens_B)[:, None, :]


@functools.partial(jax.jit, static_argnames=("config",))
def _kept_positions_j(cache, q, k, lengths_B, *, config):
  return config.kept_positions(cache, q, k, lengths_B)


def _selection_stats(q_BNH, cache, slot_pos_BKS, fullk_BKTH, pos_B, config):
  """(mass [B, K], oracle [B, K], n_selected [B, K]) of one layer at one step; see the module doc."""
  b, n_kv, s, h = cache.k.shape
  q = q_BNH.reshape(b, n_kv, -1, h)
  idx, valid = config.attended_slots(cache, q)
  probs = attention_probs(q, fullk_BKTH, pos_B + 1)  # [B, K, G, T]: every token up to the new one
  pos_sel = jnp.take_along_axis(slot_pos_BKS, idx, axis=-1)  # absolute positions attended
  pos_sel = jnp.where(valid, pos_sel, -1)
  t = fullk_BKTH.shape[2]
  hit = jnp.zeros((b, n_kv, t), bool)
  bi, ki = np.indices((b, n_kv), sparse=True)
  hit = hit.at[bi[..., None], ki[..., None], jnp.clip(pos_sel, 0, t - 1)].max(pos_sel >= 0)
  mass = jnp.where(hit[:, :, None, :], probs, 0.0).sum(-1).mean(-1)
  n_sel = hit.sum(-1)
  gm = probs.mean(axis=2)  # [B, K, T] group-mean exact probability
  # the top-M set by group mean (ties toward the lower position), scored per head like `mass`
  rank_of = jnp.argsort(jnp.argsort(-gm, axis=-1, stable=True), axis=-1)
  top_m = rank_of < n_sel[..., None]
  oracle = jnp.where(top_m[:, :, None, :], probs, 0.0).sum(-1).mean(-1)
  return mass, oracle, n_sel


@functools.partial(jax.jit, static_argnames=("graphdef", "model_cfg", "config"), donate_argnums=(4, 5))
def _diag_layer_step(graphdef, state, x_B1D, delta_B1D, cache, track, *, model_cfg, config):
  """One layer of one decode step (`decode_layer`) and its selection stats. track = (slot_pos [B, K, S]: the
  absolute position each slot holds, fullk [B, K, T, H]: every key of the sequence so far)."""
  slot_BK = config.write_slot(cache)  # where this step's token goes, before the append moves it
  pos_B = cache.pos
  step = decode_layer(nnx.merge(graphdef, state), model_cfg, x_B1D, delta_B1D, cache, config)
  slot_pos, fullk = track
  bi, ki = np.indices(slot_BK.shape, sparse=True)
  slot_pos = slot_pos.at[bi, ki, slot_BK].set(jnp.broadcast_to(pos_B[:, None], slot_BK.shape), mode="drop")
  fullk = fullk.at[jnp.arange(fullk.shape[0]), :, pos_B].set(step.k.astype(fullk.dtype))
  stats = _selection_stats(step.q, step.cache, slot_pos, fullk, pos_B, config)
  return step.x, step.delta, step.cache, (slot_pos, fullk), stats


# ----------------------------------------------------------------------------- the runner


@functools.partial(jax.jit, static_argnames=("config",))
def _compress_layer_j(q, k, v, lengths_B, *, config):
  """One layer's cache from its dense (q, k, v): the core's `prefill_compress` in a jit of our own, so that it can
  be compiled ahead of time (`Runner.precompile`); every layer has the same shapes, so one executable serves all."""
  return rocketkv_jax.prefill_compress(q, k, v, lengths_B, config=config)


def _spec(x):
  return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)


class Runner:
  """Holds a model; `prefill_dense` once, then `compress` + `greedy` / `teacher_forced` / `agnostic` for any
  method config.

  Every jitted piece (the decode loops, the per-layer compression) runs from an executable cached here by
  (function, static arguments, argument shapes). `precompile` builds many of them at once in a thread pool:
  tracing holds the GIL but XLA's compilation releases it, so a many-core host compiles a context's whole grid
  of configs in parallel, while the device runs those already compiled (measured in README.md). `stats`
  counts compiles, their seconds (trace and XLA compile, summed over threads) and the compiles that happened
  outside `precompile` ("late")."""

  def __init__(self, model):
    self.model = model
    self.cfg = model.config
    self.graphdef, self.state = nnx.split(model)
    self.layers = [nnx.split(blk) for blk in model.layers]
    # compiles, seconds tracing and compiling (summed over threads), compiles outside `precompile`'s threads
    self.executables = Executables(on_compile=self._count_late)
    self.stats = self.executables.stats
    self.stats["late"] = 0

  # -- executables

  def _count_late(self, lower_s, compile_s):
    self.stats["late"] += not threading.current_thread().name.startswith("precompile")

  def _exe(self, fn, static: dict, args: tuple, lead: tuple = ()):
    """fn (a jax.jit function) compiled for these arguments' shapes (arrays or ShapeDtypeStructs) and static
    arguments (keyword `static`, and `lead`: static positional arguments before `args`), from the runner's
    `Executables`. Called with `args`."""
    return self.executables.for_args(fn, *lead, *args, **static)

  def _loop_args(self, logits_BV, caches, forced_BT, config, loop):
    # decode_loop_jit(graphdef, state, logits, caches, forced, finished, rows); graphdef is static
    return {"config": config, "loop": loop}, (self.state, logits_BV, caches, forced_BT, None, None)

  def _run_loop(self, logits_BV, caches, config, loop, forced_BT=None):
    """`models.decode_loop` (the one decode loop) from a cached executable; the caches are donated."""
    check_loop_args(logits_BV, caches, config, loop, forced_BT)
    forced_BT = None if forced_BT is None else jnp.asarray(forced_BT, jnp.int32)
    static, args = self._loop_args(logits_BV, tuple(caches), forced_BT, config, loop)
    exe = self._exe(decode_loop_jit, static, args, (self.graphdef,))
    return exe(*args)

  def dense_shapes(self, batch: int, length: int):
    """(logits, per-layer (q, k, v)) of `prefill_dense` for a [batch, length] prompt, as ShapeDtypeStructs."""
    tok = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return jax.eval_shape(lambda t, n: prefill_dense(self.model, t, n), tok, lens)

  def precompile(self, jobs, eos_ids: Sequence[int] = (), workers: int = 16, wait: bool = True):
    """Compile ahead of time, in a pool of `workers` threads, what running `jobs` will need. A job is a tuple
    (kind, config, batch, length, prefix, new): "greedy" (compress `prefix` positions of a [batch, length]
    dense prefill, greedy `new` tokens with `eos_ids` as stop ids), "forced" (compress `prefix`, teacher-force
    `new` tokens with log-probs: fidelity) or "agnostic" (compress `prefix`, feed length - prefix tokens keeping
    the logits, then greedy `new`). Returns one future per job, done when its executables are; with
    wait=False it returns at once, so the caller runs job i as soon as its future is done while later jobs
    still compile (the device works while the host compiles). Jobs run in the order given."""
    dense = {}
    for _, _, batch, length, *_ in jobs:
      if (batch, length) not in dense:
        dense[batch, length] = self.dense_shapes(batch, length)
    pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="precompile")
    futures = [pool.submit(self._compile_job, job, dense[job[2], job[3]], tuple(eos_ids)) for job in jobs]
    pool.shutdown(wait=wait)
    if wait:
      for f in futures:
        f.result()
    return futures

  def _compile_job(self, job, dense, eos_ids):
    kind, config, batch, length, prefix, new = job
    logits, qkv = dense
    q, k, v = (jax.ShapeDtypeStruct((batch, prefix) + x.shape[2:], x.dtype) for x in qkv[0])
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    exe = self._exe(_compress_layer_j, {"config": config}, (q, k, v, lens))
    cache = jax.tree.map(_spec, exe.out_info)
    caches = (cache,) * len(qkv)
    for loop, forced in self._loops(kind, batch, length, prefix, new, eos_ids):
      static, args = self._loop_args(logits, caches, forced, config, loop)
      out = self._exe(decode_loop_jit, static, args, (self.graphdef,))
      if loop.carry_logits:  # the greedy loop after it starts from these logits and caches
        logits = _spec(out.out_info.logits_BV)
        caches = jax.tree.map(_spec, out.out_info.caches)

  @staticmethod
  def _loops(kind, batch, length, prefix, new, eos_ids, forced=None):
    """The decode loops a job runs: [(LoopConfig, forced ids or their ShapeDtypeStruct)]."""
    fed = length - prefix
    if kind == "greedy":
      return [(LoopConfig(max_new_tokens=new, stop_ids=tuple(eos_ids)), None)]
    if kind == "forced":
      f = forced if forced is not None else jax.ShapeDtypeStruct((batch, fed), jnp.int32)
      return [(LoopConfig(max_new_tokens=new, return_logprobs=True), f)]
    if kind == "agnostic":
      f = forced if forced is not None else jax.ShapeDtypeStruct((batch, fed), jnp.int32)
      return [(LoopConfig(max_new_tokens=fed, carry_logits=True), f),
              (LoopConfig(max_new_tokens=new, stop_ids=tuple(eos_ids)), None)]
    raise ValueError(f"{kind=} must be 'greedy', 'forced' or 'agnostic'")

  # -- the pieces

  def prefill_dense(self, tokens_BT, lengths_B):
    return prefill_dense(self.model, np.asarray(tokens_BT, np.int32), np.asarray(lengths_B, np.int32))

  def compress(self, layer_qkv, lengths_B, config, *, prefix: int | None = None):
    """Per-layer caches from the shared dense prefill; `prefix` keeps only the first `prefix` positions. One
    layer at a time through the core's `prefill_compress` (every layer has the same shapes: one executable per
    config and prefix)."""
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    caches = []
    for q, k, v in layer_qkv:
      if prefix is not None:
        q, k, v = q[:, :prefix], k[:, :prefix], v[:, :prefix]
      caches.append(self._exe(_compress_layer_j, {"config": config}, (q, k, v, lengths_B))(q, k, v, lengths_B))
    return tuple(caches)

  def greedy(self, first_logits_BV, caches, config, max_new: int, eos_ids: Sequence[int]):
    """Greedy generation from the prefill's last logits (caches donated): [B, max_new] ids, -1 after a row's
    stop id."""
    loop = LoopConfig(max_new_tokens=max_new, stop_ids=tuple(eos_ids))
    return np.asarray(self._run_loop(first_logits_BV, caches, config, loop).tokens)

  def agnostic(self, layer_qkv, logits_BV, tokens_BT, prefix: int, config, max_new: int,
               eos_ids: Sequence[int]):
    """Query-agnostic generation: compress the first `prefix` positions (stage 1 sees only them: its
    observation window is their tail), feed tokens[prefix:] (the question and answer prefix, and any haystack
    between) through the method's own decode steps, keeping the logits after the last one, then greedy
    `max_new` tokens from the same cache. `logits_BV` only fills the loop's unused first sample. Returns
    [B, max_new] ids, -1 after a row's stop id. `config` must be planned for a prompt of `prefix` tokens and
    len - prefix + max_new new ones."""
    tokens_BT = np.asarray(tokens_BT, np.int32)
    b, t = tokens_BT.shape
    caches = self.compress(layer_qkv, np.full((b,), prefix, np.int32), config, prefix=prefix)
    (feed, forced), (gen, _) = self._loops("agnostic", b, t, prefix, max_new, eos_ids, tokens_BT[:, prefix:])
    out = self._run_loop(logits_BV, caches, config, feed, forced)
    return np.asarray(self._run_loop(out.logits_BV, out.caches, config, gen).tokens)

  def teacher_forced(self, layer_qkv, prefix_logits_BV, tokens_BT, prefix: int, config, *, diag: bool):
    """Compress the first `prefix` positions, then feed tokens[prefix:] one by one.

    Returns log-probs [B, F, V] predicting tokens[prefix .. T-1] (the first from the prefill) and, with
    diag, per-step per-layer arrays mass/oracle/n_sel of shape [F - 1, L, B, K] (decode steps only).
    """
    tokens_BT = np.asarray(tokens_BT, np.int32)
    b, t = tokens_BT.shape
    lengths = np.full((b,), prefix, np.int32)
    caches = self.compress(layer_qkv, lengths, config, prefix=prefix)
    config.check_room(caches[0], t - 1 - prefix)
    stats = self._diagnose(layer_qkv, lengths, jax.tree.map(jnp.copy, caches), tokens_BT, prefix, config) \
        if diag else None
    (loop, forced), = self._loops("forced", b, t, prefix, t - prefix, (), tokens_BT[:, prefix:])
    out = self._run_loop(prefix_logits_BV, caches, config, loop, forced)
    return np.asarray(out.logprobs), stats

  def _diagnose(self, layer_qkv, lengths, caches, tokens_BT, prefix, config):
    """The selection diagnostic (module doc) over the forced tokens[prefix:-1]; the caches are donated."""
    t = tokens_BT.shape[1]
    tracks = []
    for (q, k, _), cache in zip(layer_qkv, caches):
      qp, kp = q[:, :prefix], k[:, :prefix]
      slot_pos = _kept_positions_j(cache, qp, kp, jnp.asarray(lengths), config=config)
      fullk = jnp.zeros((k.shape[0], k.shape[2], t, k.shape[3]), k.dtype)
      tracks.append((slot_pos, fullk.at[:, :, :prefix].set(kp.transpose(0, 2, 1, 3))))
    caches = list(caches)
    per_step = []
    for j in range(prefix, t - 1):
      x = _embed_j(self.graphdef, self.state, jnp.asarray(tokens_BT[:, j]))
      delta = None
      stats = []
      for i, (gd, st) in enumerate(self.layers):
        x, delta, caches[i], tracks[i], s = _diag_layer_step(gd, st, x, delta, caches[i], tracks[i],
                                                              model_cfg=self.cfg, config=config)
        stats.append(jnp.stack([a.astype(jnp.float32) for a in s]))  # on the device: no sync per layer
      per_step.append(jnp.stack(stats))
    arr = np.asarray(jnp.stack(per_step), dtype=np.float64).reshape(t - 1 - prefix, len(self.layers), 3, *lengths.shape, -1)
    return {"mass": arr[:, :, 0], "oracle": arr[:, :, 1], "n_sel": arr[:, :, 2]}
