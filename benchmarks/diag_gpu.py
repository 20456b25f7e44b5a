"""GPU diagnostic of the RocketKV stage-2 pieces, Pallas vs XLA vs jnp references, on one method-level case.

Each piece gets the same inputs in both paths, so a mismatch names the piece:
  python3 benchmarks/diag_gpu.py [--T 1000] [--H 32] [--N 8] [--K 2]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import rocketkv_jax as rk
from rocketkv_jax import attention, cache as cache_lib, methods
from rocketkv_jax.kernels import hsa_scores, page_topk, sparse_decode
from rocketkv_jax.select import group_channels, topk_tokens_from_pages


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--T", type=int, default=1000)
  ap.add_argument("--H", type=int, default=32)
  ap.add_argument("--N", type=int, default=8)
  ap.add_argument("--K", type=int, default=2)
  ap.add_argument("--budget", type=int, default=128)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--impl", default="pallas", help="the path under test (interpret: a CPU dry run)")
  ap.add_argument("--api", action="store_true", help="the method-level test's scenario through the jitted api")
  a = ap.parse_args()
  if a.api:
    return api_scenario(a)
  dt = getattr(jnp, a.dtype)
  lengths = jnp.asarray([a.T, 301, 77], jnp.int32)
  B, G = 3, a.N // a.K
  cfg = rk.make_config("rocketkv", token_budget=a.budget, prompt_len=a.T, max_new_tokens=3, head_dim=a.H, impl="xla")
  print(jax.devices()[0].device_kind, cfg)
  ks = jax.random.split(jax.random.PRNGKey(13), 6)
  q = jax.random.normal(ks[0], (B, a.T, a.N, a.H), dt)
  k = jax.random.normal(ks[1], (B, a.T, a.K, a.H), dt)
  v = jax.random.normal(ks[2], (B, a.T, a.K, a.H), dt)
  with jax.default_matmul_precision("highest"):
    c = rk.prefill_compress(q, k, v, lengths, config=cfg)
    q1 = jax.random.normal(ks[3], (B, a.K, G, a.H), dt)
    kn = jax.random.normal(ks[4], (B, a.K, a.H), dt)
    vn = jax.random.normal(ks[5], (B, a.K, a.H), dt)
    slot = c.length
    slot_BK = jnp.broadcast_to(slot[:, None], (B, a.K))
    ref = attention.append_token(c.k, c.v, kn, vn, slot_BK, c.kt_min, c.kt_max, page_size=cfg.page_size, impl="xla")
    ker = attention.append_token(c.k, c.v, kn, vn, slot_BK, c.kt_min, c.kt_max, page_size=cfg.page_size,
                                 impl="pallas")
    print("cache_append (k, v, kt_min, kt_max) max |diff|:",
          [float(jnp.abs(r.astype(jnp.float32) - o.astype(jnp.float32)).max()) for r, o in zip(ref, ker)])
    ref_min, ref_max = ref[2:]
    length = c.length + 1
    R = min(cfg.topr, a.H)
    ch = group_channels(q1, R)
    ch_ref = jax.lax.top_k(jnp.abs(q1.astype(jnp.float32)).sum(2), R)[1]
    print("group_channels == lax.top_k:", bool((ch == ch_ref).all()))
    s_x = attention.hsa_page_scores_xla(q1, ref_min, ref_max, ch, length, page_size=cfg.page_size)
    s_r = hsa_scores.hsa_page_scores_reference(q1, ref_min, ref_max, length, topr=R, page_size=cfg.page_size)
    s_k = hsa_scores.hsa_page_scores(q1, ref_min, ref_max, length, topr=R, page_size=cfg.page_size)
    live = np.isfinite(np.asarray(s_r))
    for name, s in (("xla", s_x), ("kernel", s_k)):
      diff = np.abs(np.where(live, np.asarray(s), 0) - np.where(live, np.asarray(s_r), 0))
      d = diff / np.abs(np.asarray(s_r)[live]).max()
      print(f"hsa scores {name} vs reference, max rel diff per (b, k):\n", d.max(-1).round(7))
    for name, s in (("xla scores", s_x), ("kernel scores", s_k)):
      i_x, v_x = topk_tokens_from_pages(s, length, cfg.page_size, cfg.topk, c.capacity)
      i_k = page_topk.page_topk(s, length, page_size=cfg.page_size, k=cfg.topk, num_slots=c.capacity)
      i_r = page_topk.page_topk_reference(s, length, page_size=cfg.page_size, k=cfg.topk, num_slots=c.capacity)
      same = [[set(np.asarray(i_x)[b, h][np.asarray(v_x)[b, h]].tolist()) ==
               set(np.asarray(i_k)[b, h][: min(cfg.topk, int(length[b]))].tolist()) for h in range(a.K)]
              for b in range(B)]
      print(f"{name}: page_topk == xla top-k per (b, k): {same}; kernel == its reference: "
            f"{bool((i_k == i_r).all())}")
    i_x, v_x = topk_tokens_from_pages(s_x, length, cfg.page_size, cfg.topk, c.capacity)
    kk = cache_lib.write_slot(c.k, kn, jnp.broadcast_to(slot[:, None], (B, a.K)))
    vv = cache_lib.write_slot(c.v, vn, jnp.broadcast_to(slot[:, None], (B, a.K)))
    o_x = attention.sparse_decode_attention_xla(q1, kk, vv, i_x, v_x)
    o_k = sparse_decode.sparse_decode_attention(q1, kk, vv, i_x, v_x)
    print("sparse attention max |diff| per (b, k):\n", np.abs(np.asarray(o_x, np.float32) - np.asarray(o_k, np.float32)).max(axis=(2, 3)).round(5))
    import dataclasses
    o_full_x, _ = methods.decode(c, q1, kn, vn, cfg)
    o_full_p, _ = methods.decode(c, q1, kn, vn, dataclasses.replace(cfg, impl="pallas"))
    d = np.abs(np.asarray(o_full_x, np.float32) - np.asarray(o_full_p, np.float32)).max(axis=(2, 3))
    print("methods.decode pallas vs xla max |diff| per (b, k):\n", d.round(5))
    ok = bool(d.max() < (1e-3 if a.dtype == "float32" else 3e-2))
    print("DIAG_OK" if ok else "DIAG_MISMATCH", f"H={a.H} N={a.N} K={a.K} dtype={a.dtype}")
    raise SystemExit(0 if ok else 1)


def api_scenario(a):
  """tests/core/test_methods.py::test_pallas_impl_matches_xla_gpu, piece by piece: is the prefill the same for
  both configs, does the jitted decode step differ on one shared cache, and is each path repeatable?"""
  import dataclasses
  lengths = jnp.asarray([a.T, min(301, a.T), 77], jnp.int32)
  B, G = 3, a.N // a.K
  ks = jax.random.split(jax.random.PRNGKey(13), 3)
  q = jax.random.normal(ks[0], (B, a.T, a.N, a.H))
  k = jax.random.normal(ks[1], (B, a.T, a.K, a.H))
  v = jax.random.normal(ks[2], (B, a.T, a.K, a.H))
  ks = jax.random.split(jax.random.PRNGKey(13 + 1000), 3)
  qs = jax.random.normal(ks[0], (B, a.N, a.H))
  kn = jax.random.normal(ks[1], (B, a.K, a.H))
  vn = jax.random.normal(ks[2], (B, a.K, a.H))
  ok = True
  for method in ("rocketkv", "hsa", "quest"):
    x = rk.make_config(method, token_budget=a.budget, prompt_len=a.T, max_new_tokens=3, head_dim=a.H, impl="xla")
    p = dataclasses.replace(x, impl=a.impl)
    with jax.default_matmul_precision("highest"):
      cx = rk.prefill_compress(q, k, v, lengths, config=x)
      cp = rk.prefill_compress(q, k, v, lengths, config=p)
      same = {f: bool(jnp.array_equal(getattr(cx, f), getattr(cp, f), equal_nan=True))
              for f in ("k", "v", "length", "kt_min", "kt_max") if getattr(cx, f) is not None}
      copy = lambda c: jax.tree.map(jnp.copy, c)  # noqa: E731 - decode_step donates
      ox, _ = rk.decode_step(copy(cx), qs, kn, vn, config=x)
      ox2, _ = rk.decode_step(copy(cx), qs, kn, vn, config=x)
      op, _ = rk.decode_step(copy(cx), qs, kn, vn, config=p)
      op2, _ = rk.decode_step(copy(cx), qs, kn, vn, config=p)
      ox_eager, _ = methods.decode(copy(cx), qs.reshape(B, a.K, G, a.H), kn, vn, x)
    f = lambda u, w: float(np.abs(np.asarray(u, np.float32) - np.asarray(w, np.float32).reshape(np.shape(u))).max())  # noqa: E731
    print(f"{method}: prefill caches equal {same}; step on one cache: xla vs pallas {f(ox, op):.2e}, "
          f"xla twice {f(ox, ox2):.2e}, pallas twice {f(op, op2):.2e}, jitted xla vs eager xla {f(ox, ox_eager):.2e}")
    ok &= f(ox, op) < 1e-3
  print("API_OK" if ok else "API_MISMATCH")


if __name__ == "__main__":
  main()
