"""Tuning sweep of RocketKV's stage-2 kernels at one shape (32k context by default): device time per call from
the profiler against the bytes the call must move at copy bandwidth. GPU only.

- scoring (`hsa_page_partials`, the channel choice made inside the timed call): every combination of --split,
  --block-p, --warps, --stages and --pad-pages (extra junk pages appended to the KT arrays; the caches' rows are
  already padded to a multiple of 16 pages, `kt_num_pages`); a value "auto" is `hsa_scores.pick_tuning`'s
  (what the decode path runs); floor: the chosen rows' bytes;
- the channel choice alone (`row_channels`, the Pallas kernel) at each of --row-channels-warps;
  floor: the query read and the choice written;
- selection (`hsa_page_topk` of the default scoring's partials) at each of --topk-warps; floor: the partials'
  bytes;
- token append (`cache_append`, 16 appends in a loop, per append) at each of --append-warps; floor: the rows
  and KT page columns written (each column value a 32-byte sector read and written).

python -m benchmarks.tune_hsa --batches 108,391 --out tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from benchmarks.kernels import (G, H, K_HEADS, LAYER_STEPS, copy_bandwidth, random_cache, rocketkv_config,
                                time_fn)
from rocketkv_jax.kernels.cache_append import cache_append
from rocketkv_jax.kernels.hsa_scores import Tuning, hsa_page_partials, pick_tuning, row_channels
from rocketkv_jax.kernels.page_topk import hsa_page_topk


def _ints(x: str) -> list[int]:
  return [int(v) for v in x.split(",") if v]


def _auto_ints(x: str) -> list[int | None]:
  """Comma-separated ints, "auto" as None (the heuristic's value)."""
  return [None if v == "auto" else int(v) for v in x.split(",") if v]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="108,391")
  ap.add_argument("--length", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--out", default="tune_hsa.jsonl")
  ap.add_argument("--split", default="auto", help="split_pages values: 0 one program per row, 1 per page block")
  ap.add_argument("--block-p", default="auto,64,128")
  ap.add_argument("--warps", default="auto")
  ap.add_argument("--stages", default="auto")
  ap.add_argument("--pad-pages", default="0")
  ap.add_argument("--row-channels-warps", default="", help="comma list: time row_channels at these warps")
  ap.add_argument("--topk-warps", default="", help="comma list: time hsa_page_topk at these warps")
  ap.add_argument("--append-warps", default="", help="comma list: time cache_append at these warps")
  a = ap.parse_args()
  bw = copy_bandwidth(True)[0]
  cfg = rocketkv_config(a.length, a.budget, "pallas")
  R, ps = cfg.topr, cfg.page_size
  P = -(-cfg.capacity // ps)
  out = open(a.out, "w")

  def emit(rec, dev, nbytes):
    rec.update(device_us=dev, floor_us=nbytes / bw * 1e6,
               x_floor=None if dev is None else dev / (nbytes / bw * 1e6))
    out.write(json.dumps(rec) + "\n")
    out.flush()
    print(json.dumps(rec), flush=True)

  def timed(rec, f, sets, nbytes, iters=30, kernel=None):
    """Times f; `kernel`: count only that kernel's time per LAYER_STEPS loop step (the rest is the loop's)."""
    try:
      dev, _, top = time_fn(f, sets, iters, True)
    except Exception as e:  # noqa: BLE001 - a config Triton rejects is reported, not fatal
      print(json.dumps(dict(rec, error=repr(e)[:300])), flush=True)
      return
    if kernel is not None:
      rec, kern = dict(rec, loop_us=dev), dict(top).get(kernel)
      dev = None if kern is None else kern / LAYER_STEPS
    emit(dict(rec, top=top[:4]), dev, nbytes)

  for B in _ints(a.batches):
    ks = jax.random.split(jax.random.PRNGKey(B), 4)
    q = jax.random.normal(ks[0], (B, K_HEADS, G, H), jnp.bfloat16)
    cache = random_cache(ks[1], B, cfg)
    base = dict(B=B, L=a.length, t=a.budget, R=R, P=P)
    nbytes = B * K_HEADS * R * P * cache.state.kt_min.dtype.itemsize
    grid = itertools.product(_auto_ints(a.split), _auto_ints(a.block_p), _auto_ints(a.warps),
                             _auto_ints(a.stages), _ints(a.pad_pages))
    for split, block_p, warps, stages, pad in grid:
      kt = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad))) for x in (cache.state.kt_min, cache.state.kt_max)]
      given = Tuning(block_p=block_p, split_pages=None if split is None else bool(split), num_warps=warps,
                     num_stages=stages)
      tuning = pick_tuning(B, K_HEADS, kt[0].shape[-1], R, given)
      f = jax.jit(lambda q, kmin, kmax, n, tuning=tuning: hsa_page_partials(q, kmin, kmax, n, topr=R, page_size=ps,
                                                                           tuning=tuning))
      timed(dict(base, kind="scores", layout="gather", split=tuning.split_pages, block_p=tuning.block_p,
                 warps=tuning.num_warps, stages=tuning.num_stages, pad_pages=pad), f, [(q, *kt, cache.length)], nbytes)
      del kt
    if a.row_channels_warps:
      dot_dtype = jnp.bfloat16  # bf16 queries and pages, as the decode path
      choice = jax.eval_shape(lambda q: row_channels(q, R, dot_dtype), q)
      choice_bytes = q.size * q.dtype.itemsize + sum(x.size * x.dtype.itemsize for x in choice)
      for warps in _ints(a.row_channels_warps):
        f = jax.jit(lambda q, warps=warps: row_channels(q, R, dot_dtype, num_warps=warps))
        timed(dict(base, kind="row_channels", warps=warps), f, [(q,)], choice_bytes)
    if a.topk_warps:
      parts = jax.jit(lambda q, c: hsa_page_partials(q, c.state.kt_min, c.state.kt_max, c.length, topr=R,
                                                     page_size=ps))(q, cache)
      part_bytes = sum(x.size * x.dtype.itemsize for x in parts)
      for warps in _ints(a.topk_warps):
        f = jax.jit(lambda s, m, l, n, warps=warps: hsa_page_topk(
            s, m, l, n, page_size=ps, k=cfg.topk, num_slots=cfg.capacity, num_warps=warps))
        timed(dict(base, kind="page_topk", warps=warps), f, [(*parts, cache.length)], part_bytes)
      del parts
    if a.append_warps:
      k_new = jax.random.normal(ks[2], (B, K_HEADS, H), jnp.bfloat16)
      v_new = jax.random.normal(ks[3], (B, K_HEADS, H), jnp.bfloat16)
      # per append: K and V rows written, two KT page columns of H values read ("fold") and written, each
      # value a 32-byte sector (the column is strided by P); the same floor for every variant
      append_bytes = B * K_HEADS * (2 * H * 2 + 2 * 2 * H * 32)
      for warps in _ints(a.append_warps):
        def steps(k_new, v_new, c, warps=warps):
          def body(i, carry):
            slot = jnp.broadcast_to((c.length + i)[:, None], k_new.shape[:2])
            return cache_append(*carry[:2], k_new, v_new, slot, *carry[2:], page_size=ps, num_warps=warps)
          return jax.lax.fori_loop(0, LAYER_STEPS, body, (c.k, c.v, c.state.kt_min, c.state.kt_max))
        # the loop's one copy of its non-donated cache is not the append's: only the kernel counts
        timed(dict(base, kind="append", warps=warps), jax.jit(steps), [(k_new, v_new, cache)],
              append_bytes, iters=10, kernel="rocketkv_cache_append")
    del cache


if __name__ == "__main__":
  main()
