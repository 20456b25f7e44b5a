"""Token-level selection primitives the methods share: top-k tokens by score (ties toward the lower slot) and
exact attention probabilities (the scores of H2O, exact_topk and the accuracy diagnostic). Page-level
selection is an op (`ops.page_topk`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rocketkv_jax.cache import slot_valid


def topk_tokens(scores_BKS: jax.Array, length_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The `k` valid slots with the highest score per (sequence, KV head); ties toward the lower slot.

  Returns idx [B, K, M] int32 and valid [B, K, M] with M = min(k, S); entries past the valid count are
  marked invalid (their idx points at some slot and must be ignored).
  """
  num_slots = scores_BKS.shape[-1]
  m = min(k, num_slots)
  valid_BS = slot_valid(length_B, num_slots)
  masked = jnp.where(valid_BS[:, None, :], scores_BKS.astype(jnp.float32), -jnp.inf)
  _, idx = lax.top_k(masked, m)  # lax.top_k is stable: equal values keep index order.
  valid = idx < length_B[:, None, None]
  return idx.astype(jnp.int32), valid


def attention_probs(q_BKGH: jax.Array, k_BKSH: jax.Array, length_B: jax.Array) -> jax.Array:
  """Exact per-head softmax probabilities [B, K, G, S] float32 over the valid slots (scale 1/sqrt(H))."""
  scale = 1.0 / np.sqrt(q_BKGH.shape[-1])
  s = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH, preferred_element_type=jnp.float32) * scale
  valid = slot_valid(length_B, k_BKSH.shape[2])[:, None, None, :]
  return jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1, where=valid)
