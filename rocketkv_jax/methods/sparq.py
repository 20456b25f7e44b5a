"""sparq: no eviction; the group's top-r query channels approximate every token's score, exact attention
over the top-k tokens, and SparQ's mean-value correction for the mass left out."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax import ops
from rocketkv_jax.cache import kv_scales, read_values
from rocketkv_jax.kernels.cache_append import stored_row
from rocketkv_jax.kernels.kv_quant import dequantize
from rocketkv_jax.methods.base import KeepAll, MethodConfig, TopK, check_budget, kv_itemsize, seq_len, valid_slots
from rocketkv_jax.select import topk_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SparQState:
  """SparQ's cache state (KVCache.state), kept by its selector (`SparQSelector`).

  v_sum: [B, K, H] float32 sum of the valid values, as the cache holds them (an FP8 cache's dequantized
    values): the mean value of SparQ's correction for the attention mass left out of the top-k.
  row_topr: [B] int32, the channels each sequence scores (its own plan; at most the config's static `topr`,
    the batch's maximum; `MethodConfig.row_leaves`).
  """

  v_sum: jax.Array
  row_topr: jax.Array


@dataclasses.dataclass(frozen=True)
class SparQSelector(TopK):
  """SparQ's stage 2: the group's top-`topr` channels of sum |q| score every token, exact attention over the top
  `topk` tokens, plus SparQ's mean-value correction. Keeps a `SparQState` (the sum of the valid values, each
  sequence's top-r), which its append updates."""

  scores_channels: ClassVar[bool] = True
  state_class: ClassVar[type] = SparQState

  def state_shapes(self, config, batch, n_kv_heads, head_dim):
    return {"state.v_sum": (batch, n_kv_heads, head_dim)}

  def init_state(self, config, cache, **leaves):
    """The state of a prefill's cache: `leaves` (row_topr) and the sum of its valid values as it holds them."""
    v_sum = jnp.where(valid_slots(cache)[:, None, :, None], read_values(cache).astype(jnp.float32), 0.0).sum(axis=2)
    return SparQState(v_sum=v_sum, **leaves)

  def append(self, config, cache, k_new_BKH, v_new_BKH):
    v_held = v_new_BKH if cache.v_scale is None else dequantize(
        stored_row(v_new_BKH, cache.v_scale, cache.v.dtype), cache.v_scale[..., None])  # as the cache will hold it
    state = dataclasses.replace(cache.state, v_sum=cache.state.v_sum + v_held.astype(jnp.float32))
    cache = dataclasses.replace(cache, state=state)
    return config.policy.append(config, cache, k_new_BKH, v_new_BKH)

  def approx_probs(self, config, cache, q_BKGH):
    """SparQ's approximate per-head attention [B, K, G, S]: the group's top-r channels (each sequence's
    cache.state.row_topr; ties toward the lower channel), temperature tau_g = sqrt(H * |q_g[channels]|_1 / |q_g|_1)."""
    r = min(config.topr, q_BKGH.shape[-1])
    qf = q_BKGH.astype(jnp.float32)
    _, channels_BKR = lax.top_k(jnp.abs(qf).sum(axis=2), r)  # stable: ties keep channel order
    qr = jnp.take_along_axis(qf, channels_BKR[:, :, None, :], axis=-1)  # [B, K, G, R]
    # each sequence's own top-r (cache.state.row_topr <= r): its first channels by rank, the rest count for nothing
    qr = jnp.where((jnp.arange(r) < cache.state.row_topr[:, None])[:, None, None, :], qr, 0.0)
    k_r = jnp.take_along_axis(cache.k, channels_BKR[:, :, None, :], axis=-1).astype(jnp.float32)  # [B, K, S, R]
    if cache.k_scale is not None:  # an FP8 cache: the chosen channels' values, the key mean added back
      k_r = (dequantize(k_r, cache.k_scale[:, :, None, None])
             + jnp.take_along_axis(cache.k_mean, channels_BKR, axis=-1)[:, :, None, :])
    s = jnp.einsum("BKGR,BKSR->BKGS", qr, k_r, precision="highest")
    tau = jnp.sqrt(q_BKGH.shape[-1] * jnp.abs(qr).sum(-1) / jnp.abs(qf).sum(-1))  # [B, K, G]
    valid_S = valid_slots(cache)[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid_S, s / tau[..., None], -jnp.inf), axis=-1, where=valid_S)
    return jnp.where(valid_S, p, 0.0)

  def select(self, config, cache, q_BKGH):
    return topk_tokens(self.approx_probs(config, cache, q_BKGH).mean(axis=2), cache.length, config.topk)

  def attend(self, config, cache, q_BKGH):
    """Exact attention over the top-k, blended with the mean value by the approximate mass they hold."""
    p = self.approx_probs(config, cache, q_BKGH)
    idx, valid = topk_tokens(p.mean(axis=2), cache.length, config.topk)
    out = ops.sparse_decode_attention(q_BKGH, cache.k, cache.v, idx, valid, impl=config.impl, **kv_scales(cache))
    alpha = jnp.where(valid[:, :, None, :], jnp.take_along_axis(p, idx[:, :, None, :], axis=-1), 0.0).sum(-1)
    v_mean = cache.state.v_sum / cache.length[:, None, None]  # [B, K, H]
    out = alpha[..., None] * out.astype(jnp.float32) + (1 - alpha[..., None]) * v_mean[:, :, None, :]
    return out.astype(q_BKGH.dtype)

  def score_read_bytes(self, config, length, *, head_dim, itemsize):
    return length * config.topr * kv_itemsize(config, itemsize)  # the chosen channels of every key


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparQConfig(MethodConfig):
  """SparQ: no eviction; the group's top-`topr` channels of sum |q| score every token, exact attention over
  the top `topk` tokens, plus SparQ's mean-value correction. The cache's state: `SparQState` (the sum of the
  valid values, each sequence's top-r)."""

  method: ClassVar[str] = "sparq"
  policy: ClassVar[KeepAll] = KeepAll()
  selector: ClassVar[SparQSelector] = SparQSelector()
  row_fields: ClassVar[tuple[str, ...]] = ("topr",)
  size_fields: ClassVar[tuple[str, ...]] = ("max_len",)
  max_len: int
  topr: int
  topk: int

  @classmethod
  def from_budget(cls, token_budget, prompt_len, max_new_tokens, head_dim, *, max_len=None, **kw):
    check_budget(token_budget)
    s = seq_len(prompt_len, max_new_tokens, max_len)
    topr = min(head_dim, max(1, int(token_budget * head_dim / s)))
    return cls(**{"max_len": s, "topr": topr, "topk": token_budget // 2, **kw})
