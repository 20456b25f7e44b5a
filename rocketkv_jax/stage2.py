"""Stage 2: hybrid sparse attention's selection (ALGORITHM.md §3), what `methods/hsa.py`'s `HSASelector` runs
(the stage 2 of hsa, rocketkv and rocketkv_plus).

Per decode step, per KV head: the group's top-r channels of sum_g |q_g|; each page of the cache is scored
from its key min or max on those channels (max where the group's summed q is positive), per query head
s_g[p] / tau_g with SparQ's temperature; a softmax over the valid slots (each slot scores its page), the
group mean; the top-k tokens of the best pages. The scoring and the selection are ops
(`ops.hsa_select`: the reference in XLA, two kernels back to back with Pallas); attention over the
selected tokens is exact (`ops.sparse_decode_attention`).

Forced pages (rocketkv's `hsa_sink_tokens` / `hsa_recent_tokens`, this project's extension): the pages
holding the first sink slots and the last recent valid slots score above any probability, so they are always
among the top-k; the rest of the top-k is the paper's rule. The selection kernel raises them itself
(`page_topk.hsa_page_topk`), so the option runs the same two kernels as the paper's rule.
"""
from __future__ import annotations

import math

from rocketkv_jax import ops
from rocketkv_jax.budget import check_int
from rocketkv_jax.cache import KVCache


def select(config, cache: KVCache, q_BKGH, choice=None):
  """(idx, valid) [B, K, M]: the top-k slots of the step, the new token already appended, ties toward the
  lower slot; the first min(length, M) entries are valid. Each sequence scores with its own plan: its
  cache.state.row_topr channels and cache.state.row_page_size pages (at most the config's, the batch's maxima;
  the cache's state is a `PageState`). choice: the channel choice already made (`ops.cache_append`'s choose_q)."""
  state = cache.state
  idx = ops.hsa_select(q_BKGH, state.kt_min, state.kt_max, cache.length, topr=topr(config, q_BKGH),
                       page_size=config.page_size, k=config.topk, num_slots=cache.capacity,
                       sink=config.hsa_sink_tokens, recent=config.hsa_recent_tokens,
                       impl=config.impl, choice=choice, page_size_B=state.row_page_size, topr_B=state.row_topr)
  return idx, ops.prefix_valid(idx, cache.length)


def topr(config, q_BKGH) -> int:
  """The channels scored: config.topr, at most the head dim."""
  return min(config.topr, q_BKGH.shape[-1])


def forced_slots_max(page_size: int, sink: int, recent: int) -> int:
  """The most slots the forced pages can hold: the sink's pages (from slot 0) plus the most pages that `recent`
  consecutive slots can touch."""
  recent_pages = -(-(recent - 1) // page_size) + 1 if recent else 0
  return (-(-sink // page_size) + recent_pages) * page_size


def check_forced(config) -> None:
  """Checks hsa_sink_tokens / hsa_recent_tokens: ints >= 0 whose pages fit in topk with room for a chosen page."""
  sink, recent = config.hsa_sink_tokens, config.hsa_recent_tokens
  check_int("hsa_sink_tokens", sink, 0)
  check_int("hsa_recent_tokens", recent, 0)
  n = forced_slots_max(config.page_size, sink, recent)
  if n and n + config.page_size > config.topk:
    raise ValueError(f"hsa_sink_tokens={sink} and hsa_recent_tokens={recent} force up to {n} slots (pages of "
                     f"page_size={config.page_size}), which leaves no page of topk={config.topk} to choose: "
                     f"they must force at most topk - page_size = {config.topk - config.page_size}")


def score_read_bytes(config, length: int, *, kt_itemsize: int) -> int:
  """Bytes HSA scoring reads per KV head: the chosen channels' row of every used page's min or max."""
  return math.ceil(length / config.page_size) * config.topr * kt_itemsize
