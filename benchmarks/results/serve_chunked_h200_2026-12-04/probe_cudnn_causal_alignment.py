import jax, jax.numpy as jnp, numpy as np
print(jax.__version__, jax.devices())
B, T, S, N, K, H = 1, 128, 1024, 8, 2, 128
r = np.random.default_rng(0)
q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.bfloat16)
k = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.bfloat16)
v = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.bfloat16)
def ref(q, k, v, start, kvlen):
  qpos = start + jnp.arange(T)
  mask = (jnp.arange(S)[None, :] <= qpos[:, None]) & (jnp.arange(S)[None, :] < kvlen)
  return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask=mask[None, None])
for name, kw, start, kvlen in [
    ("causal T<S no lens", dict(is_causal=True), None, S),
    ("causal + kv len 640", dict(is_causal=True, key_value_seq_lengths=jnp.array([640], jnp.int32), query_seq_lengths=jnp.array([T], jnp.int32)), None, 640),
]:
  try:
    out = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw))(q, k, v)
  except Exception as e:
    print(name, "ERROR", type(e).__name__, str(e)[:300]); continue
  for align, st in (("top-left", 0), ("bottom-right", kvlen - T)):
    d = float(jnp.abs(out.astype(jnp.float32) - ref(q, k, v, st, kvlen)).max())
    print(name, align, "maxdiff", d)
# timing: chunk of 2048 over 32k keys, bottom right via kv len (if it works), Llama-8B heads
import time
B, T, S, N, K, H = 1, 2048, 32768, 32, 8, 128
q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.bfloat16)
k = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.bfloat16)
v = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.bfloat16)
for kvlen in (4096, 16384, 32768):
  f = jax.jit(lambda q, k, v, L: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True,
                                    key_value_seq_lengths=L, query_seq_lengths=jnp.array([T], jnp.int32)))
  L = jnp.array([kvlen], jnp.int32)
  f(q, k, v, L).block_until_ready()
  t = time.perf_counter()
  for _ in range(10): o = f(q, k, v, L)
  o.block_until_ready()
  print("cudnn kvlen", kvlen, "ms", (time.perf_counter() - t) / 10 * 1e3)
full = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True))
qq = jnp.asarray(r.standard_normal((B, S, N, H)), jnp.bfloat16)
full(qq, k, v).block_until_ready(); t = time.perf_counter()
for _ in range(5): o = full(qq, k, v)
o.block_until_ready(); print("cudnn full causal 32k ms", (time.perf_counter() - t) / 5 * 1e3)
