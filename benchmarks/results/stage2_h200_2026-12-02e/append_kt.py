"""Scratch: the token append at large batch with and without its KT page writes (where its time goes)."""
import json, sys, time, functools
import jax, jax.numpy as jnp, numpy as np
import rocketkv_jax.kernels.cache_append as ca
from rocketkv_jax.kernels.cache_append import cache_append
from rocketkv_jax.kernels.checks import kt_num_pages

K, G, H, S, PS, R = 8, 4, 128, 1617, 3, 60
out = []
for B in [int(b) for b in sys.argv[1].split(",")]:
  P = kt_num_pages(S, PS)
  key = jax.random.PRNGKey(0)
  k = jax.random.normal(key, (B, K, S, H), jnp.bfloat16)
  v = jax.random.normal(key, (B, K, S, H), jnp.bfloat16)
  kmin = jnp.zeros((B, K, H, P), jnp.bfloat16); kmax = jnp.zeros((B, K, H, P), jnp.bfloat16)
  kn = jax.random.normal(key, (B, K, H), jnp.bfloat16); vn = kn
  q = jax.random.normal(key, (B, K, G, H), jnp.bfloat16)
  N = 48
  def make(variant):
    def loop(k, v, kmin, kmax, start):
      def body(i, c):
        k, v, kmin, kmax = c
        slot = jnp.full((B,), start + i, jnp.int32)
        if variant == "nokt":
          k, v = cache_append(k, v, kn, vn, slot)
        elif variant == "choice":
          k, v, kmin, kmax, *_ = cache_append(k, v, kn, vn, slot, kmin, kmax, page_size=PS, choose_q=q, topr=R)
        else:
          k, v, kmin, kmax = cache_append(k, v, kn, vn, slot, kmin, kmax, page_size=PS, kt_update=variant)
        return k, v, kmin, kmax
      return jax.lax.fori_loop(0, N, body, (k, v, kmin, kmax))
    return jax.jit(loop, donate_argnums=(0, 1, 2, 3))
  for variant, tile in [("rows", 0), ("rows", 1), ("nokt", 0), ("choice", 0), ("choice", 1), ("fold", 0), ("fold", 1), ("rows", 0), ("rows", 1)]:
    ca.KT_TILE_STORE = bool(tile); cache_append.clear_cache()
    f = make(variant)
    c = f(k, v, kmin, kmax, 100); jax.block_until_ready(c)
    ts = []
    for r in range(5):
      t0 = time.perf_counter(); c = f(*c, 100 + 50 * r); jax.block_until_ready(c); ts.append(time.perf_counter() - t0)
    k, v, kmin, kmax = c
    rec = dict(B=B, variant=variant, tile=tile, us_per_append=round(1e6 * float(np.median(ts)) / N, 2))
    print(rec, flush=True); out.append(rec)
import os
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/append_kt.json", "w"), indent=1)
