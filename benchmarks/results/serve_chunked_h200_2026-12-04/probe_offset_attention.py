import os, time, jax, jax.numpy as jnp, numpy as np
IMPL = os.environ.get("IMPL", "cudnn")
E = 8  # extra channels: one for the sentinel's value, padding to a multiple of 8

SENTINEL = -16.0  # the sentinel key's score (log of its weight)

def offset_attention_cudnn(q, k_hist, v_hist, k_new, v_new, start):
  """q/k_new/v_new [B, C, *, H] the chunk at positions start + i; k_hist/v_hist [B, S, K, H] valid in [0, start)."""
  B, C, N, H = q.shape
  S, K = k_hist.shape[1], k_hist.shape[2]
  dt = q.dtype
  scale = 1.0 / np.sqrt(H)
  ks = jnp.asarray(SENTINEL / scale, dt)           # the sentinel key's extra channel (its score: ks * scale)
  unit = jnp.zeros((H + E,), dt).at[H].set(1)      # q's extra channel / the sentinel value
  sent_k = jnp.zeros((H + E,), dt).at[H].set(ks)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, E)))
  qx = pad(q) + unit                                # every query: 1 in channel H
  pos = jnp.arange(S)[None, :, None, None]
  st = start[:, None, None, None]
  kh = jnp.where(pos < st, pad(k_hist), jnp.where(pos == st, sent_k, 0))
  vh = jnp.where(pos < st, pad(v_hist), jnp.where(pos == st, unit, 0))
  oh = jax.nn.dot_product_attention(qx, kh, vh, scale=scale, implementation=IMPL,
                                    key_value_seq_lengths=start + 1, query_seq_lengths=jnp.full((B,), C, jnp.int32))
  ql = jnp.concatenate([jnp.zeros((B, 1, N, H + E), dt), qx], 1)
  kl = jnp.concatenate([jnp.broadcast_to(sent_k, (B, 1, K, H + E)), pad(k_new)], 1)
  vl = jnp.concatenate([jnp.broadcast_to(unit, (B, 1, K, H + E)), pad(v_new)], 1)
  ol = jax.nn.dot_product_attention(ql, kl, vl, scale=scale, is_causal=True, implementation=IMPL)[:, 1:]
  xh = jnp.maximum(oh[..., H].astype(jnp.float32), 1e-38)
  xl = jnp.maximum(ol[..., H].astype(jnp.float32), 1e-38)
  a, b = -jnp.log(xh), -jnp.log(xl)   # log(1 + Z / w)
  m = jnp.maximum(a, b)
  wa, wb = jnp.exp(a - m), jnp.exp(b - m)
  den = wa + wb - 2 * jnp.exp(-m)
  out = (oh[..., :H].astype(jnp.float32) * wa[..., None] + ol[..., :H].astype(jnp.float32) * wb[..., None]) / den[..., None]
  return out.astype(q.dtype)

def reference(q, k_hist, v_hist, k_new, v_new, start):
  B, C, N, H = q.shape
  S = k_hist.shape[1]
  k = jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, 0))(jnp.concatenate([k_hist, jnp.zeros_like(k_new)], 1), k_new, start)
  v = jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, 0))(jnp.concatenate([v_hist, jnp.zeros_like(v_new)], 1), v_new, start)
  qpos = start[:, None] + jnp.arange(C)[None]
  mask = jnp.arange(S + C)[None, None, :] <= qpos[:, :, None]
  return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask=mask[:, None])

r = np.random.default_rng(0)
for (C, S, st, N, K, H, sc) in [(128, 1024, 300, 8, 2, 128, 2), (128, 1024, 0, 8, 2, 128, 2), (256, 4096, 3000, 32, 8, 128, 2), (128, 1024, 500, 8, 2, 64, 2), (128, 1024, 300, 8, 2, 128, 0.3), (128, 1024, 300, 8, 2, 128, 6)]:
  q = jnp.asarray(r.standard_normal((1, C, N, H)) * sc, jnp.bfloat16)
  kh = jnp.asarray(r.standard_normal((1, S, K, H)) * 2, jnp.bfloat16)
  vh = jnp.asarray(r.standard_normal((1, S, K, H)), jnp.bfloat16)
  kn = jnp.asarray(r.standard_normal((1, C, K, H)) * 2, jnp.bfloat16)
  vn = jnp.asarray(r.standard_normal((1, C, K, H)), jnp.bfloat16)
  start = jnp.array([st], jnp.int32)
  kh = jnp.where(jnp.arange(S)[None, :, None, None] < st, kh, 0)
  got = jax.jit(offset_attention_cudnn)(q, kh, vh, kn, vn, start).astype(jnp.float32)
  want = reference(q, kh, vh, kn, vn, start)
  dense = jax.nn.dot_product_attention(q, jnp.concatenate([kh[:, :st], kn], 1), jnp.concatenate([vh[:, :st], vn], 1), is_causal=False, implementation="cudnn") if False else None
  base = jax.nn.dot_product_attention(q, jnp.concatenate([kh[:, :st], kn], 1), jnp.concatenate([vh[:, :st], vn], 1), mask=(jnp.arange(st + C)[None, :] <= st + jnp.arange(C)[:, None])[None, None]).astype(jnp.float32)
  print("  bf16 baseline maxdiff", float(jnp.abs(base - want).max()), "mean", float(jnp.abs(base - want).mean()))
  print(C, S, st, H, sc, "maxdiff", float(jnp.abs(got - want).max()), "mean", float(jnp.abs(got - want).mean()), "ref scale", float(jnp.abs(want).mean()))
# bf16 rounding baseline: reference computed in bf16 cudnn causal full (start=0 case compare)
# speed at 8B shape
N, K, H = 32, 8, 128
if IMPL != "cudnn": raise SystemExit
for C, S, st in [(2048, 32768, 16384), (2048, 32768, 30720), (512, 33280, 32768), (4096, 32768, 28672)]:
  q = jnp.asarray(r.standard_normal((1, C, N, H)), jnp.bfloat16)
  kh = jnp.asarray(r.standard_normal((1, S, K, H)), jnp.bfloat16)
  vh = jnp.asarray(r.standard_normal((1, S, K, H)), jnp.bfloat16)
  kn = jnp.asarray(r.standard_normal((1, C, K, H)), jnp.bfloat16)
  vn = jnp.asarray(r.standard_normal((1, C, K, H)), jnp.bfloat16)
  start = jnp.array([st], jnp.int32)
  f = jax.jit(offset_attention_cudnn)
  f(q, kh, vh, kn, vn, start).block_until_ready()
  t = time.perf_counter()
  for _ in range(10): o = f(q, kh, vh, kn, vn, start)
  o.block_until_ready()
  ms = (time.perf_counter() - t) / 10 * 1e3
  flops = 4 * C * (st + C / 2) * N * H
  print(f"C={C} S={S} start={st}: {ms:.3f} ms/layer, {flops / ms / 1e9:.0f} TFLOP/s")
