"""Compress one dense prefill many ways, then decode it with the one decode loop (greedy or teacher-forced).

The prefill is dense and shared: `models.prefill_dense` returns every layer's post-RoPE (q, k, v), which do
not depend on the method (stage 1 only evicts after a layer's attention), and the core's `prefill_compress`
turns them into each method's cache, layer by layer. Decoding is `models.decode_loop`, the whole model in one
jit: the code `generate` runs and `benchmarks/decode.py` times, with the fused norm/RoPE kernels when the
config's impl runs kernels. Greedy generation stops at the stop ids; teacher forcing feeds the sequence's
own tokens and returns the log-probs of every step.

Compile cost: the loop unrolls every layer, so each method config compiles a whole-model loop (greedy and
teacher-forced are two). For SmolLM2-135M (30 layers) on a 2-core CPU that is about 3-10 s per loop (see
the report of issue 13), against minutes of decoding per config at the suite's contexts.

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

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rocketkv_jax
from rocketkv_jax.models import LoopConfig, decode_loop, prefill_dense
from rocketkv_jax.models.llama import decode_layer, embed_tokens
from rocketkv_jax.select import attention_probs


def make_config(method: str, budget: int, prompt_len: int, max_new: int, model_cfg, **overrides):
  return rocketkv_jax.make_config(method, token_budget=budget, prompt_len=prompt_len, max_new_tokens=max_new,
                                  head_dim=model_cfg.head_dim, max_len=model_cfg.max_len, **overrides)


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


class Runner:
  """Holds a model; `prefill_dense` once, then `compress` + `greedy` / `teacher_forced` for any method config."""

  def __init__(self, model):
    self.model = model
    self.cfg = model.config
    self.graphdef, self.state = nnx.split(model)
    self.layers = [nnx.split(blk) for blk in model.layers]

  def prefill_dense(self, tokens_BT, lengths_B):
    return prefill_dense(self.model, np.asarray(tokens_BT, np.int32), np.asarray(lengths_B, np.int32))

  def compress(self, layer_qkv, lengths_B, config, *, prefix: int | None = None):
    """Per-layer caches from the shared dense prefill; `prefix` keeps only the first `prefix` positions. One
    layer at a time through the core's jitted `prefill_compress` (every layer has the same shapes, so it
    compiles once per config)."""
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    caches = []
    for q, k, v in layer_qkv:
      if prefix is not None:
        q, k, v = q[:, :prefix], k[:, :prefix], v[:, :prefix]
      caches.append(rocketkv_jax.prefill_compress(q, k, v, lengths_B, config=config))
    return tuple(caches)

  def greedy(self, first_logits_BV, caches, config, max_new: int, eos_ids: Sequence[int]):
    """Greedy generation from the prefill's last logits (caches donated): [B, max_new] ids, -1 after a row's
    stop id."""
    loop = LoopConfig(max_new_tokens=max_new, stop_ids=tuple(eos_ids))
    return np.asarray(decode_loop(self.model, first_logits_BV, tuple(caches), config, loop).tokens)

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
    loop = LoopConfig(max_new_tokens=t - prefix, return_logprobs=True)
    out = decode_loop(self.model, prefix_logits_BV, caches, config, loop, forced_BT=tokens_BT[:, prefix:])
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
        stats.append(tuple(np.asarray(a) for a in s))
      per_step.append(stats)
    arr = np.asarray(per_step, dtype=np.float64).reshape(t - 1 - prefix, len(self.layers), 3, *lengths.shape, -1)
    return {"mass": arr[:, :, 0], "oracle": arr[:, :, 1], "n_sel": arr[:, :, 2]}
