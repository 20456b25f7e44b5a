"""What the decode step's token append costs per layer, by part (issue 40): the `cache_append` kernel with a bf16
and an FP8 cache, each without and with HSA's channel choice folded in, and the choice's own kernel
(`hsa_scores.row_channels`) alone, at RocketKV's 32k shape (t=256: 1,617 slots, 544 KT pages of 3, top-r 60,
K=8 KV heads of G=4 queries, H=128).

A bf16 cache rebuilds the open page's min/max from its K rows (contiguous); an FP8 cache folds the new key into the
page's strided KT column, as `cache_append.resolve_kt_update` picks: the difference of the two "no choice" rows is
that fold's cost. Each figure is wall-clock microseconds per append: `--steps` appends in one jitted `fori_loop`
(the cache its donated carry), the median of `--reps` calls, divided by `--steps` (launch gaps included, as in a
decode step).

  python -m benchmarks.append_cost --batches 389,194 --out append_cost.jsonl      # one GPU
  python -m benchmarks.append_cost --tiny --batches 1 --steps 2 --reps 2           # CPU smoke test (interpret)
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.kernels.cache_append import cache_append
from rocketkv_jax.kernels.hsa_scores import row_channels

# (K, G, H, slots, KT pages, page size, top-r): RocketKV at 32k and t=256 on Llama-3.1-8B's attention; --tiny a toy.
SHAPES = {"32k": (8, 4, 128, 1617, 544, 3, 60), "tiny": (2, 2, 64, 40, 16, 3, 8)}
KV_DTYPES = ("bfloat16", "float8_e4m3fn")


def _median_us(fn, carry, *, steps: int, reps: int):
  f = jax.jit(fn, donate_argnums=0)
  carry = jax.block_until_ready(f(carry))  # compiles
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    carry = jax.block_until_ready(f(carry))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) / steps * 1e6


def measure(B: int, shape, *, steps: int, reps: int, interpret: bool) -> list[dict]:
  """One record per variant at batch B: {"part", "kv_cache_dtype", "choice", "rows", "us_per_append"}."""
  K, G, H, S, P, ps, topr = shape
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, K, G, H), jnp.bfloat16)
  k_new = jax.random.normal(ks[1], (B, K, H), jnp.bfloat16)
  v_new = jax.random.normal(ks[2], (B, K, H), jnp.bfloat16)
  scale = jnp.full((B, K), 0.01, jnp.float32)
  first = S - steps - 1  # the appends' first slot: the cache as a long prompt leaves it
  recs = []
  for dt in KV_DTYPES:
    fp8 = dt != "bfloat16"
    for choice in (False, True):
      def run(carry, choice=choice, fp8=fp8):
        def body(i, carry):
          k, v, kt_min, kt_max, acc = carry
          out = cache_append(k, v, k_new, v_new, jnp.full((B,), first + i, jnp.int32), kt_min, kt_max,
                             page_size=ps, choose_q=q if choice else None, topr=topr if choice else 0,
                             k_scale_BK=scale if fp8 else None, v_scale_BK=scale if fp8 else None,
                             interpret=interpret)
          if choice:  # the choice is used, so it is not dead code
            acc = acc + out[4][:, :, 0, 0].astype(jnp.float32).sum()
          return (*out[:4], acc)
        return jax.lax.fori_loop(0, steps, body, carry)
      carry = (jnp.zeros((B, K, S, H), dt), jnp.zeros((B, K, S, H), dt), jnp.zeros((B, K, H, P), jnp.float8_e5m2),
               jnp.zeros((B, K, H, P), jnp.float8_e5m2), jnp.zeros((), jnp.float32))
      recs.append(dict(part="cache_append", kv_cache_dtype=dt, choice=choice, rows=B * K,
                       us_per_append=round(_median_us(run, carry, steps=steps, reps=reps), 2)))
      del carry

  def choose(acc):
    def body(i, acc):
      return acc + row_channels(q + acc.astype(q.dtype), topr, jnp.bfloat16, interpret=interpret)[0][0, 0, 0, 0]
    return jax.lax.fori_loop(0, steps, body, acc.astype(jnp.float32))
  recs.append(dict(part="row_channels", kv_cache_dtype=None, choice=True, rows=B * K,
                   us_per_append=round(_median_us(choose, jnp.zeros((), jnp.float32), steps=steps, reps=reps), 2)))
  return recs


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", default="389", help="comma list of batch sizes (rows = batch x 8 KV heads)")
  ap.add_argument("--steps", type=int, default=16, help="appends per jitted call")
  ap.add_argument("--reps", type=int, default=15, help="timed calls (median)")
  ap.add_argument("--tiny", action="store_true", help="a toy shape in Pallas interpret mode (CPU smoke test)")
  ap.add_argument("--out", default=None, help="append JSON lines here")
  args = ap.parse_args(argv)
  shape = SHAPES["tiny" if args.tiny else "32k"]
  if not 1 <= args.steps < shape[3]:
    raise SystemExit(f"--steps={args.steps} must be in [1, {shape[3] - 1}] (the cache's slots)")
  batches = [int(b) for b in args.batches.split(",")]
  dev = jax.devices()[0]
  header = dict(kind="header", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.device_kind, jax=jax.__version__, shape="tiny" if args.tiny else "32k",
                command="python -m benchmarks.append_cost " + " ".join(sys.argv[1:] if argv is None else argv))
  lines = [header]
  print(json.dumps(header), flush=True)
  for B in batches:
    for rec in measure(B, shape, steps=args.steps, reps=args.reps, interpret=args.tiny):
      rec = dict(kind="point", batch=B, **rec)
      lines.append(rec)
      print(json.dumps(rec), flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.writelines(json.dumps(x) + "\n" for x in lines)


if __name__ == "__main__":
  main()
