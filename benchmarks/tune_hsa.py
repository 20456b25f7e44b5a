"""Tuning sweep of the HSA scoring kernel's layouts at one shape (RocketKV stage 2, 32k context): device time
per call from the profiler against the chosen rows' bytes at copy bandwidth. GPU only.

python -m benchmarks.tune_hsa --batches 108,391 --out tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from benchmarks.kernels import (G, H, K_HEADS, copy_bandwidth, random_cache, rocketkv_config, time_fn)
from rocketkv_jax.kernels.hsa_scores import hsa_page_partials


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="108,391")
  ap.add_argument("--length", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--out", default="tune_hsa.jsonl")
  ap.add_argument("--layouts", default="gather,rank")
  ap.add_argument("--block-p", default="64,128,256")
  ap.add_argument("--warps", default="4,8")
  ap.add_argument("--stages", default="1,2")
  a = ap.parse_args()
  bw = copy_bandwidth(True)[0]
  cfg = rocketkv_config(a.length, a.budget, "pallas")
  R, ps = cfg.topr, cfg.page_size
  P = -(-cfg.capacity // ps)
  out = open(a.out, "w")
  for B in [int(x) for x in a.batches.split(",")]:
    ks = jax.random.split(jax.random.PRNGKey(B), 2)
    sets = [(jax.random.normal(ks[0], (B, K_HEADS, G, H), jnp.bfloat16), random_cache(ks[1], B, cfg))]
    nbytes = B * K_HEADS * R * P * sets[0][1].kt_min.dtype.itemsize
    ints = lambda x: [int(v) for v in x.split(",")]  # noqa: E731
    grid = itertools.product(a.layouts.split(","), (False, True), ints(a.block_p), ints(a.warps), ints(a.stages))
    for layout, split, block_p, warps, stages in grid:
      if layout == "rank" and (block_p > 64 or stages > 1):
        continue
      f = jax.jit(lambda q, c: hsa_page_partials(q, c.kt_min, c.kt_max, c.length, topr=R, page_size=ps,
                                                 split_pages=split, layout=layout, block_p=block_p,
                                                 num_warps=warps, num_stages=stages))
      try:
        dev, wall, top = time_fn(f, sets, 30, True)
      except Exception as e:  # noqa: BLE001 - a config Triton rejects is reported, not fatal
        print(json.dumps(dict(B=B, layout=layout, split=split, block_p=block_p, warps=warps, stages=stages,
                              error=repr(e)[:200])), flush=True)
        continue
      rec = dict(B=B, L=a.length, t=a.budget, R=R, P=P, layout=layout, split=split, block_p=block_p,
                 warps=warps, stages=stages, device_us=dev, floor_us=nbytes / bw * 1e6,
                 x_floor=None if dev is None else dev / (nbytes / bw * 1e6), top=top[:2])
      out.write(json.dumps(rec) + "\n")
      out.flush()
      print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
