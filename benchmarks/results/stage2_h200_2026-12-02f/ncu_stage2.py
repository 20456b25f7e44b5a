"""ncu probe: one layer's stage-2 kernels once each at batch B (32k, t=256)."""
import sys
import jax, jax.numpy as jnp
from benchmarks.kernels import G, H, K_HEADS, random_cache, rocketkv_config
from rocketkv_jax import ops
from rocketkv_jax.kernels.cache_append import cache_append
from rocketkv_jax.kernels.hsa_scores import hsa_page_partials
from rocketkv_jax.kernels.page_topk import hsa_page_topk

B = int(sys.argv[1])
cfg = rocketkv_config(32768, 256, "pallas")
R, ps = cfg.topr, cfg.page_size
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(ks[0], (B, K_HEADS, G, H), jnp.bfloat16)
c = random_cache(ks[1], B, cfg)
k_new = jax.random.normal(ks[2], (B, K_HEADS, H), jnp.bfloat16)
v_new = jax.random.normal(ks[3], (B, K_HEADS, H), jnp.bfloat16)
jax.block_until_ready((q, c, k_new, v_new))
app = jax.jit(lambda k, v, kn, vn, s, a, b, q: cache_append(k, v, kn, vn, s, a, b, page_size=ps, choose_q=q, topr=R))
k, v, kmin, kmax, *choice = app(c.k, c.v, k_new, v_new, c.length, c.kt_min, c.kt_max, q)
length = c.length + 1
parts = jax.jit(lambda q, a, b, n, ch: hsa_page_partials(q, a, b, n, topr=R, page_size=ps, choice=ch))(
    q, kmin, kmax, length, tuple(choice))
idx = jax.jit(lambda s, m, l, n: hsa_page_topk(s, m, l, n, page_size=ps, k=cfg.topk, num_slots=cfg.capacity))(
    *parts, length)
valid = ops.prefix_valid(idx, length)
out = jax.jit(lambda q, k, v, i, va: ops.sparse_decode_attention(q, k, v, i, va, impl="pallas"))(q, k, v, idx, valid)
jax.block_until_ready(out)
print("done", B, R, ps, kmin.shape, [x.shape for x in parts], idx.shape)
