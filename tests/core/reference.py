"""A plain, per-sequence, per-KV-head NumPy (float64) model of every method, written straight from
ALGORITHM.md, for the tests. Slow and obvious on purpose; shares no code with the package."""
from __future__ import annotations

import math

import numpy as np


def softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max())
  return e / e.sum()


def top_sorted(scores, n):
  """Indices of the n largest scores, ties toward the lower index (stable)."""
  order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
  return order[:n]


def attend(q_GH, k_MH, v_MH):
  h = q_GH.shape[-1]
  out = []
  for q in q_GH:
    p = softmax(k_MH @ q / math.sqrt(h))
    out.append(p @ v_MH)
  return np.stack(out)


def snapkv_keep(q_TNH, k_TKH, L, kh, *, prompt_budget, window_size, kernel_size, sink_tokens=0):
  """Positions KV head kh keeps (ascending, window last)."""
  if L <= prompt_budget:
    return list(range(L))
  n, h = q_TNH.shape[1:]
  g = n // k_TKH.shape[1]
  w = window_size
  votes = np.zeros(L - w)
  for i in range(w):
    qpos = L - w + i
    for gi in range(g):
      logits = k_TKH[: qpos + 1, kh] @ q_TNH[qpos, kh * g + gi] / math.sqrt(h)
      votes += softmax(logits)[: L - w]
  half = kernel_size // 2
  pooled = [votes[max(0, t - half): t + half + 1].max() for t in range(L - w)]
  for t in range(min(sink_tokens, L - w)):
    pooled[t] = np.inf
  top = sorted(top_sorted(pooled, prompt_budget - w))
  return top + list(range(L - w, L))


class RefSequence:
  """One sequence under one method: per KV head, the kept (position, k, v) and the method's extras."""

  def __init__(self, method, cfg, q_TNH, k_TKH, v_TKH, L):
    self.method, self.cfg = method, cfg
    q, k, v = (np.asarray(x, np.float64)[:L] for x in (q_TNH, k_TKH, v_TKH))
    self.n_kv, self.h = k.shape[1], k.shape[2]
    self.g = q.shape[1] // self.n_kv
    self.pos = L
    self.keep = []  # per head: list of positions, in slot order
    self.k = []
    self.v = []
    self.extra = []
    for kh in range(self.n_kv):
      keep, extra = self._prefill_keep(q, k, v, L, kh)
      self.keep.append(list(keep))
      self.k.append([k[p, kh] for p in keep])
      self.v.append([v[p, kh] for p in keep])
      self.extra.append(extra)
    self.v_all = [list(v[:L, kh]) for kh in range(self.n_kv)]  # SparQ's mean over every token seen
    # the decode budget (rocketkv_jax/decode_region.py): where each head's decode region starts, the last queries
    self.decode_budget = getattr(cfg, "decode_budget", None)
    self.start = [len(x) for x in self.keep]
    self.ring = []

  def _prefill_keep(self, q, k, v, L, kh):
    m, c = self.method, self.cfg
    if m in ("snapkv", "rocketkv", "rocketkv_plus"):
      return snapkv_keep(q, k, L, kh, prompt_budget=c.prompt_budget, window_size=c.window_size,
                         kernel_size=c.kernel_size, sink_tokens=c.sink_tokens), None
    if m == "streaming_llm":
      cap, sink = c.capacity, c.sink_tokens
      if L <= cap:
        return list(range(L)), None
      return list(range(sink)) + list(range(L - (cap - sink), L)), None
    if m == "h2o":
      acc = np.zeros(L)
      for t in range(L):
        for gi in range(self.g):
          acc[: t + 1] += softmax(k[: t + 1, kh] @ q[t, kh * self.g + gi] / math.sqrt(self.h))
      cap, recent = c.capacity, c.recent_tokens
      if L <= cap:
        keep = list(range(L))
      else:
        keep = sorted(top_sorted(acc[: L - recent], cap - recent)) + list(range(L - recent, L))
      return keep, {p: acc[p] for p in keep}
    return list(range(L)), None

  def step(self, q_NH, k_KH, v_KH):
    q_NH, k_KH, v_KH = (np.asarray(x, np.float64) for x in (q_NH, k_KH, v_KH))
    out = np.zeros_like(q_NH)
    if self.decode_budget is not None:
      self.ring = (self.ring + [q_NH])[-self.cfg.decode_window:]
    for kh in range(self.n_kv):
      if self.decode_budget is not None:
        self._compact_if_full(kh)
      qg = q_NH[kh * self.g:(kh + 1) * self.g]
      out[kh * self.g:(kh + 1) * self.g] = self._step_head(kh, qg, k_KH[kh], v_KH[kh])
    self.pos += 1
    return out

  def _compact_if_full(self, kh):
    """A full decode region (decode_budget + decode_buffer tokens) keeps its decode_window newest tokens and the
    best others by the ring queries' attention (softmax over every kept slot, summed over the queries and the
    group's heads), decode_budget in all, in slot order."""
    c, st = self.cfg, self.start[kh]
    r = c.decode_budget + c.decode_buffer
    if len(self.keep[kh]) - st < r:
      return
    K = np.stack(self.k[kh])
    mass = np.zeros(len(K))
    for q in self.ring:
      for qg in q[kh * self.g:(kh + 1) * self.g]:
        mass += softmax(K @ qg / math.sqrt(self.h))
    region = mass[st:]
    forced = np.arange(r) >= r - c.decode_window
    chosen = sorted(top_sorted(np.where(forced, np.inf, region), c.decode_budget))
    for lst in (self.keep[kh], self.k[kh], self.v[kh]):
      lst[st:] = [lst[st + i] for i in chosen]

  def _append(self, kh, kn, vn, slot=None):
    if slot is None:
      self.keep[kh].append(self.pos)
      self.k[kh].append(kn)
      self.v[kh].append(vn)
    else:
      self.keep[kh][slot], self.k[kh][slot], self.v[kh][slot] = self.pos, kn, vn

  def _step_head(self, kh, qg, kn, vn):
    m, c = self.method, self.cfg
    self.v_all[kh].append(vn)
    if m == "streaming_llm":
      if len(self.keep[kh]) >= c.capacity:  # drop the oldest non-sink token
        j = min(range(c.sink_tokens, len(self.keep[kh])), key=lambda i: self.keep[kh][i])
        for lst in (self.keep[kh], self.k[kh], self.v[kh]):
          del lst[j]
      self._append(kh, kn, vn)
      return attend(qg, np.stack(self.k[kh]), np.stack(self.v[kh]))
    if m == "h2o":
      scores = self.extra[kh]
      if len(self.keep[kh]) >= c.capacity:
        cands = [i for i, p in enumerate(self.keep[kh]) if p <= self.pos - c.recent_tokens]
        victim = min(cands, key=lambda i: (scores[self.keep[kh][i]], i))
        del scores[self.keep[kh][victim]]
        self._append(kh, kn, vn, slot=victim)
      else:
        self._append(kh, kn, vn)
      scores[self.pos] = 0.0
      K, V = np.stack(self.k[kh]), np.stack(self.v[kh])
      out = attend(qg, K, V)
      for q in qg:
        p = softmax(K @ q / math.sqrt(self.h))
        for i, pos in enumerate(self.keep[kh]):
          scores[pos] += p[i]
      return out
    self._append(kh, kn, vn)
    K, V = np.stack(self.k[kh]), np.stack(self.v[kh])
    if m in ("full", "snapkv"):
      return attend(qg, K, V)
    if m == "exact_topk":
      probs = np.mean([softmax(K @ q / math.sqrt(self.h)) for q in qg], axis=0)
      sel = top_sorted(probs, c.topk)
      return attend(qg, K[sel], V[sel])
    if m == "sparq":
      r = min(c.topr, self.h)
      ch = top_sorted(np.abs(qg).sum(0), r)
      ps = []
      for q in qg:
        tau = math.sqrt(self.h * np.abs(q[ch]).sum() / np.abs(q).sum())
        ps.append(softmax(K[:, ch] @ q[ch] / tau))
      sel = top_sorted(np.mean(ps, axis=0), c.topk)
      att = attend(qg, K[sel], V[sel])
      v_mean = np.mean(self.v_all[kh], axis=0)
      return np.stack([ps[i][sel].sum() * att[i] + (1 - ps[i][sel].sum()) * v_mean for i in range(len(qg))])
    if m == "quest":
      P = c.page_size
      n = len(K)
      pages = [range(p, min(p + P, n)) for p in range(0, n, P)]
      ub = [sum(np.maximum(q * K[list(pg)].min(0), q * K[list(pg)].max(0)).sum() for q in qg) for pg in pages]
      slot_scores = [ub[i // P] for i in range(n)]
      sel = top_sorted(slot_scores, c.topk)
      return attend(qg, K[sel], V[sel])
    if m in ("hsa", "rocketkv", "rocketkv_plus"):
      P = c.page_size
      n = len(K)
      kt_min = np.stack([K[p:p + P].min(0) for p in range(0, n, P)])
      kt_max = np.stack([K[p:p + P].max(0) for p in range(0, n, P)])
      r = min(c.topr, self.h)
      ch = top_sorted(np.abs(qg).sum(0), r)
      sigma = qg[:, ch].sum(0) > 0
      rep = np.where(sigma[None, :], kt_max[:, ch], kt_min[:, ch])  # [pages, R]
      ps = []
      for q in qg:
        tau = math.sqrt(self.h * np.abs(q[ch]).sum() / np.abs(q).sum())
        s_page = rep @ q[ch]
        ps.append(softmax(np.array([s_page[i // P] for i in range(n)]) / tau))
      slot_scores = np.mean(ps, axis=0)
      # this project's extension: the pages holding the first `sink` slots and the last `recent` slots are
      # always attended, inside the top-k (they outrank every probability)
      sink, recent = getattr(c, "hsa_sink_tokens", 0), getattr(c, "hsa_recent_tokens", 0)
      first = np.arange(n) // P * P  # the first slot of each slot's page
      forced = (first < sink) | ((recent > 0) & (first + P > n - recent))
      sel = top_sorted(np.where(forced, 2.0, slot_scores), c.topk)
      return attend(qg, K[sel], V[sel])
    raise ValueError(m)
