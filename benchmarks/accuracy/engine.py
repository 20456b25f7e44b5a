"""Compress one dense prefill many ways, then decode (greedy or teacher-forced) layer by layer.

Why a layer-by-layer loop instead of `models.generate`: every layer of a Llama has the same shapes, so
jitting one layer's decode step (q/k/v projection, the core's `decode_step`, output projection, MLP)
compiles once per method config instead of once per unrolled 30-layer model; on a CPU the grid of
methods x budgets x contexts is then dominated by compute, not compilation. The same code runs on a
GPU unchanged (the core picks its Pallas kernels there through impl="auto").

The prefill is dense and shared: `models.prefill_dense` returns every layer's post-RoPE (q, k, v), which
do not depend on the method (stage 1 only evicts after a layer's attention), and the core's
`prefill_compress` turns them into each method's cache, layer by layer.

Selection diagnostic (`diag=True`): at every decode step and layer we recompute, from the updated cache
and with the core's own selection pieces, which cache slots the method attends (all valid slots for
full / snapkv / streaming_llm / h2o; the top-k selection for hsa / rocketkv / quest / sparq /
exact_topk), map slots to absolute positions, and sum the *exact* attention probabilities of the step's
query over the whole uncompressed sequence (every prompt key + every generated key of this run) at those
positions. `mass` is that share (mean over query heads); `oracle` is the share the best possible set of
the same size per KV head would capture (top-M positions by the group-mean exact probability, which is
how exact_topk ranks tokens). The query and generated keys are the method's own (teacher forcing keeps
the input tokens identical; hidden states may drift), so the diagnostic measures the selector, not the
drift.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rocketkv_jax
from rocketkv_jax import attention as core_attention
from rocketkv_jax import methods as core_methods
from rocketkv_jax.snapkv import snapkv_keep

from rocketkv_jax.models import llama as _llama

_SELECTING = ("hsa", "rocketkv", "quest", "sparq", "exact_topk")


def make_config(method: str, budget: int, prompt_len: int, max_new: int, model_cfg, **overrides):
  return rocketkv_jax.make_config(method, token_budget=budget, prompt_len=prompt_len, max_new_tokens=max_new,
                                  head_dim=model_cfg.head_dim, max_len=model_cfg.max_len, **overrides)


# ----------------------------------------------------------------------------- jitted pieces


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed_j(graphdef, state, tokens_B):
  return _llama._embed(nnx.merge(graphdef, state), tokens_B)[:, None, :]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _head_j(graphdef, state, x_B1D):
  return _llama._head(nnx.merge(graphdef, state), x_B1D[:, 0])


@functools.partial(jax.jit, static_argnames=("config",))
def _compress_j(q, k, v, lengths_B, config):
  return rocketkv_jax.prefill_compress(q, k, v, lengths_B, config=config)


def _selected_slots(cache, q_BKGH, config):
  """Slots the method attends after this step's append: idx [B, K, M], valid [B, K, M] (the core's own
  `methods.select` for top-k methods; every valid slot for the dense ones)."""
  if config.method in _SELECTING:
    return core_methods.select(cache, q_BKGH, config)
  b, n_kv, s, _ = cache.k.shape
  idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, n_kv, s))
  return idx, idx < cache.length[:, None, None]


def _new_slot(cache, config):
  """Slot the core writes the next token to (before the append), per (sequence, KV head)."""
  b, n_kv = cache.k.shape[:2]
  if config.method == "streaming_llm":
    slot = core_methods._streaming_slot(cache.pos, config)
  elif config.method == "h2o":
    return None  # h2o keeps its own `positions` leaf
  else:
    slot = cache.length
  return jnp.broadcast_to(slot[:, None], (b, n_kv))


def _diag(q_BNH, cache, slot_pos_BKS, fullk_BKTH, pos_B, config):
  """(mass [B, K], oracle [B, K], n_selected [B, K]) of one layer at one step; see the module doc."""
  b, n_kv, s, h = cache.k.shape
  q = q_BNH.reshape(b, n_kv, -1, h)
  idx, valid = _selected_slots(cache, q, config)
  length_full = pos_B + 1  # every token up to and including the new one
  probs = core_attention.dense_attention_probs(q, fullk_BKTH, length_full)  # [B, K, G, T]
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


@functools.partial(jax.jit, static_argnames=("graphdef", "model_cfg", "config", "diag"), donate_argnums=(3,))
def _layer_step(graphdef, state, x_B1D, cache, extra, *, model_cfg, config, diag: bool):
  """One layer of one decode step. extra = (slot_pos [B,K,S], fullk [B,K,T,H]) when diag, else None."""
  blk = nnx.merge(graphdef, state)
  pos_B = cache.pos
  q, k, v = _llama._qkv(blk, model_cfg, x_B1D, pos_B[:, None])
  new_slot = _new_slot(cache, config) if diag else None
  o, cache = rocketkv_jax.decode_step(cache, q[:, 0], k[:, 0], v[:, 0], config=config)
  x = _llama._finish(blk, model_cfg, x_B1D, o[:, None])
  if not diag:
    return x, cache, extra, None
  slot_pos, fullk = extra
  if config.method == "h2o":
    slot_pos = cache.positions
  else:
    bi, ki = np.indices(new_slot.shape, sparse=True)
    slot_pos = slot_pos.at[bi, ki, new_slot].set(jnp.broadcast_to(pos_B[:, None], new_slot.shape))
  bi = jnp.arange(fullk.shape[0])
  fullk = fullk.at[bi, :, pos_B].set(k[:, 0].astype(fullk.dtype))
  stats = _diag(q[:, 0], cache, slot_pos, fullk, pos_B, config)
  return x, cache, (slot_pos, fullk), stats


# ----------------------------------------------------------------------------- public helpers


def _initial_slot_pos(q, k, lengths_B, cache, config):
  """[B, K, S] absolute position held by each slot right after prefill_compress (junk past length)."""
  b, t, n_kv, _ = k.shape
  s = cache.capacity
  m = config.method
  if m in ("snapkv", "rocketkv"):
    keep, _ = snapkv_keep(q, k, lengths_B, prompt_budget=config.prompt_budget, window_size=config.window_size,
                          kernel_size=config.kernel_size, sink_tokens=config.sink_tokens)
    return jnp.pad(keep, ((0, 0), (0, 0), (0, s - keep.shape[-1])))
  if m == "streaming_llm":
    return core_methods._streaming_keep(k, lengths_B, config)
  if m == "h2o":
    return cache.positions
  return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, n_kv, s))


_initial_slot_pos_j = jax.jit(_initial_slot_pos, static_argnames=("config",))


class Runner:
  """Holds a model split per layer; `compress` + `decode` for any method config."""

  def __init__(self, model):
    self.model = model
    self.cfg = model.config
    self.graphdef, self.state = nnx.split(model)
    self.layers = [nnx.split(blk) for blk in model.layers]

  def prefill_dense(self, tokens_BT, lengths_B):
    return _llama.prefill_dense(self.model, np.asarray(tokens_BT, np.int32), np.asarray(lengths_B, np.int32))

  def compress(self, layer_qkv, lengths_B, config, *, prefix: int | None = None):
    """Per-layer caches from the shared dense prefill; `prefix` keeps only the first `prefix` positions."""
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    caches = []
    for q, k, v in layer_qkv:
      if prefix is not None:
        q, k, v = q[:, :prefix], k[:, :prefix], v[:, :prefix]
      caches.append(_compress_j(q, k, v, lengths_B, config))
    return caches

  def _diag_state(self, layer_qkv, lengths_B, caches, config, prefix, total):
    out = []
    for (q, k, _), cache in zip(layer_qkv, caches):
      qp, kp = q[:, :prefix], k[:, :prefix]
      slot_pos = _initial_slot_pos_j(qp, kp, jnp.asarray(lengths_B, jnp.int32), cache, config)
      fullk = jnp.zeros((k.shape[0], k.shape[2], total, k.shape[3]), k.dtype)
      fullk = fullk.at[:, :, :prefix].set(kp.transpose(0, 2, 1, 3))
      out.append((slot_pos, fullk))
    return out

  @staticmethod
  def check_room(caches, config, steps: int) -> None:
    """Inside a jit the core cannot check that a cache has a free slot (api.py), and writing past
    capacity silently corrupts the cache, so check on the host before decoding `steps` tokens."""
    if config.method in ("streaming_llm", "h2o"):  # these evict, so they never run out of slots
      return
    need = int(np.max(np.asarray(caches[0].length))) + steps
    if need > config.capacity:
      raise ValueError(f"{config.method}: {steps} decode steps need {need} slots > capacity {config.capacity}; "
                       "plan the config with max_new_tokens >= steps")

  def step(self, tokens_B, caches, config, extras=None, diag=False):
    """One decode step over all layers -> (logits [B, V], caches, extras, per-layer stats or None)."""
    x = _embed_j(self.graphdef, self.state, jnp.asarray(tokens_B, jnp.int32))
    new_caches, new_extras, stats = [], [], []
    for i, (gd, st) in enumerate(self.layers):
      ex = extras[i] if extras is not None else None
      x, c, ex, s = _layer_step(gd, st, x, caches[i], ex, model_cfg=self.cfg, config=config, diag=diag)
      new_caches.append(c)
      new_extras.append(ex)
      stats.append(s)
    return _head_j(self.graphdef, self.state, x), new_caches, (new_extras if diag else None), (stats if diag else None)

  def greedy(self, first_logits_BV, caches, config, max_new: int, eos_ids: Sequence[int]):
    """Greedy generation from the prefill's last logits; returns [B, <=max_new] ids (-1 after EOS)."""
    tok = np.asarray(jnp.argmax(first_logits_BV, -1))
    b = tok.shape[0]
    out = np.full((b, max_new), -1, np.int64)
    done = np.zeros(b, bool)
    eos = np.asarray(list(eos_ids) or [-2])
    self.check_room(caches, config, max_new - 1)
    for i in range(max_new):
      out[:, i] = np.where(done, -1, tok)
      done |= np.isin(tok, eos)
      if done.all() or i == max_new - 1:
        break
      logits, caches, _, _ = self.step(np.maximum(tok, 0), caches, config)
      tok = np.asarray(jnp.argmax(logits, -1))
    return out

  def teacher_forced(self, layer_qkv, prefix_logits_BV, tokens_BT, prefix: int, config, *, diag: bool):
    """Compress the first `prefix` positions, then feed tokens[prefix:] one by one.

    Returns log-probs [B, F, V] predicting tokens[prefix .. T-1] (the first from the prefill) and, with
    diag, per-step per-layer arrays mass/oracle/n_sel of shape [F - 1, L, B, K] (decode steps only).
    """
    tokens_BT = np.asarray(tokens_BT)
    b, t = tokens_BT.shape
    lengths = np.full((b,), prefix, np.int32)
    caches = self.compress(layer_qkv, lengths, config, prefix=prefix)
    self.check_room(caches, config, t - 1 - prefix)
    extras = self._diag_state(layer_qkv, lengths, caches, config, prefix, t) if diag else None
    logps = [np.asarray(jax.nn.log_softmax(prefix_logits_BV.astype(jnp.float32), -1))]
    per_step = []
    for j in range(prefix, t - 1):
      logits, caches, extras, stats = self.step(tokens_BT[:, j], caches, config, extras, diag)
      logps.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1)))
      if diag:
        per_step.append([tuple(np.asarray(a) for a in s) for s in stats])
    lp = np.stack(logps, 1)
    if not diag:
      return lp, None
    arr = np.asarray(per_step, dtype=np.float64)  # [F-1, L, 3, B, K]
    return lp, {"mass": arr[:, :, 0], "oracle": arr[:, :, 1], "n_sel": arr[:, :, 2]}
