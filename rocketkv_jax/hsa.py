"""Stage 2: hybrid sparse attention's selection (ALGORITHM.md §3), shared by the hsa and rocketkv methods.

Per decode step, per KV head: the group's top-r channels of sum_g |q_g|; each page of the cache is scored
from its key min or max on those channels (max where the group's summed q is positive), per query head
s_g[p] / tau_g with SparQ's temperature; a softmax over the valid slots (each slot scores its page), the
group mean; the top-k tokens of the best pages. The scoring and the selection are ops
(`ops.hsa_select`: the reference in XLA, two kernels back to back with Pallas); attention over the
selected tokens is exact (`ops.sparse_decode_attention`).
"""
from __future__ import annotations

import math

from rocketkv_jax import ops
from rocketkv_jax.cache import KVCache


def select(config, cache: KVCache, q_BKGH):
  """(idx, valid) [B, K, M]: the top-k slots of the step, the new token already appended, ties toward the
  lower slot; the first min(length, M) entries are valid."""
  idx = ops.hsa_select(q_BKGH, cache.kt_min, cache.kt_max, cache.length, topr=min(config.topr, q_BKGH.shape[-1]),
                       page_size=config.page_size, k=config.topk, num_slots=cache.capacity, impl=config.impl)
  return idx, ops.prefix_valid(idx, cache.length)


def score_read_bytes(config, length: int, *, kt_itemsize: int) -> int:
  """Bytes HSA scoring reads per KV head: the chosen channels' row of every used page's min or max."""
  return math.ceil(length / config.page_size) * config.topr * kt_itemsize
