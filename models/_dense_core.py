"""A minimal full-KV stand-in for the core API, used only while `rocketkv_jax` lacks it.

It mirrors the core's signatures (`make_config`, `prefill_compress`, `decode_step`,
`cache_nbytes`) for method "full" so the model code does not change when the core lands.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseConfig:
  method: str
  token_budget: int
  prompt_len: int
  max_new_tokens: int
  head_dim: int
  max_len: int | None = None

  def __post_init__(self):
    if self.method != "full":
      raise NotImplementedError(
          f"{self.method=} needs the rocketkv_jax core; this fallback only does 'full'")

  @property
  def capacity(self) -> int:
    return self.prompt_len + self.max_new_tokens


def make_config(method, *, token_budget, prompt_len, max_new_tokens, head_dim, max_len=None):
  return DenseConfig(method=method, token_budget=token_budget, prompt_len=prompt_len,
                     max_new_tokens=max_new_tokens, head_dim=head_dim, max_len=max_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseKVCache:
  k: jax.Array       # [B, S, K, H]; slots >= length are junk
  v: jax.Array       # [B, S, K, H]
  length: jax.Array  # [B] int32
  pos: jax.Array     # [B] int32


def prefill_compress(q, k, v, lengths, *, config):
  del q
  B, T, K, H = k.shape
  pad = config.capacity - T
  k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
  v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
  lengths = jnp.asarray(lengths, jnp.int32)
  return DenseKVCache(k=k, v=v, length=lengths, pos=lengths)


def decode_step(cache, q, k_new, v_new, *, config):
  del config
  B, S, K, H = cache.k.shape
  N = q.shape[1]
  G = N // K
  b = jnp.arange(B)
  k = cache.k.at[b, cache.length].set(k_new.astype(cache.k.dtype))
  v = cache.v.at[b, cache.length].set(v_new.astype(cache.v.dtype))
  length = cache.length + 1
  q_BKGH = q.reshape(B, K, G, H).astype(jnp.float32)
  s_BKGS = jnp.einsum("BKGH,BSKH->BKGS", q_BKGH, k.astype(jnp.float32)) / math.sqrt(H)
  valid_BS = jnp.arange(S)[None, :] < length[:, None]
  s_BKGS = jnp.where(valid_BS[:, None, None, :], s_BKGS, -jnp.inf)
  p = jax.nn.softmax(s_BKGS, axis=-1)
  out = jnp.einsum("BKGS,BSKH->BKGH", p, v.astype(jnp.float32)).reshape(B, N, H)
  return out.astype(q.dtype), DenseKVCache(k=k, v=v, length=length, pos=cache.pos + 1)


def cache_nbytes(cache) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
