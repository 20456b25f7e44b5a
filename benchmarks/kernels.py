"""Kernel benchmark (issue 4): dense decode and the RocketKV sparse path at Llama-3.1-8B shapes.

One layer of decode attention: 32 query heads, 8 KV heads (G=4), head dim 128, bf16.
  dense:  Pallas flash-decoding vs XLA einsum/softmax vs jax's Pallas decode_attention.gqa,
          batch {1, 8, 32} x cache {4k, 32k, 128k} (points that do not fit are reported, not run).
  sparse: the library's own RocketKV stage-2 path (rocketkv_jax.methods) for the plans of
          ALGORITHM.md section 1 (max_new_tokens=256) at token budgets t in {256, 1024}, with
          impl="pallas" (HSA scores, page top-k and sparse attention kernels) vs impl="xla":
          - sparse_step: top-r channels + page scores + top-k tokens + attention for one layer;
          - layer_step: the whole decode step of one layer (append K/V, KT page update, then the
            above), 16 steps in one jitted fori_loop with the cache as carry (updated in place),
            reported per step;
          - append: the token append alone (K/V rows and KT page: the `cache_append` kernel vs
            XLA's two scatters and KT gather/scatter), 16 appends in a fori_loop, per append.

Every point is checked against a reference first, then timed two ways: device time per call
summed over the GPU kernels of a jax.profiler trace (dispatch excluded), and wall time per call
over many back-to-back calls (dispatch overlaps the device; this is what a decode loop sees).
Inputs rotate over enough copies to defeat the 50 MB L2. Bandwidth figures are against a
device-to-device copy measured in the same run (bytes read + written).

  python3 benchmarks/kernels.py --out results.jsonl        # on the GPU
  python3 benchmarks/kernels.py --smoke                    # tiny shapes, interpret mode, CPU
  python3 benchmarks/kernels.py --only select --lengths 32768 --budgets 256 --batches 1,8,32
      # the HSA selection alone: the two kernels (scores + top-k) the decode path runs
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)

import rocketkv_jax as rk  # noqa: E402
from rocketkv_jax import ops  # noqa: E402
from rocketkv_jax.cache import KVCache, PageState, build_kt_pages  # noqa: E402
from rocketkv_jax.kernels.hsa_scores import Tuning as ScoresTuning, hsa_page_partials  # noqa: E402
from rocketkv_jax.kernels.page_topk import hsa_page_topk  # noqa: E402
from rocketkv_jax.kernels.sparse_decode import Tuning as SparseTuning, sparse_decode_attention  # noqa: E402
from rocketkv_jax.kernels.dense_decode import (dense_decode_attention,  # noqa: E402
                                               dense_decode_attention_reference)

K_HEADS, G, H = 8, 4, 128  # Llama-3.1-8B attention
DT = jnp.bfloat16
MAX_NEW = 256
L2_DEFEAT_BYTES = 256 << 20
MEM_LIMIT_BYTES = 120 << 30  # leave headroom on the 139 GiB H200


def rocketkv_config(S: int, t: int, impl: str):
  """The library's RocketKV config for a prompt of S tokens (ALGORITHM.md section 1)."""
  return rk.plan_rows("rocketkv", token_budget=t, prompt_lens=[S], max_new_tokens=MAX_NEW, head_dim=H,
                      impl=impl).config


# ----------------------------------------------------------------------------- implementations

def dense_xla(q, k, v, length):
  """The XLA baseline: bf16 einsums with f32 accumulation, masked softmax."""
  S = k.shape[2]
  s = jnp.einsum("BKGH,BKSH->BKGS", q, k, preferred_element_type=jnp.float32) / math.sqrt(H)
  s = jnp.where((jnp.arange(S)[None, :] < length[:, None])[:, None, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("BKGS,BKSH->BKGH", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


def make_dense_gqa():
  from jax.experimental.pallas.ops.gpu import decode_attention as da

  def run(q, k_t, v_t, length):  # k_t: [B, S, K, H] (that op's layout)
    B = q.shape[0]
    out = da.gqa(q.reshape(B, K_HEADS * G, H), k_t, v_t, kv_seq_len=length)
    return out.reshape(B, K_HEADS, G, H)
  return run


def sparse_step(q, cache, *, config):
  """One layer's stage 2 on a filled cache: top-r channels, page scores, top-k tokens, attention."""
  idx, valid = config.select(cache, q)
  return ops.sparse_decode_attention(q, cache.k, cache.v, idx, valid, impl=config.impl)


LAYER_STEPS = 16


def layer_steps(q, k_new, v_new, cache, *, config):
  """LAYER_STEPS whole decode steps of one layer (append, KT update, select, attend); each step's
  output is the next step's query so nothing is dead code. The cache is the loop carry."""
  def body(_, carry):
    q, cache = carry
    out, cache = config.decode(cache, q, k_new, v_new)
    return out, cache
  return jax.lax.fori_loop(0, LAYER_STEPS, body, (q, cache))


def append_steps(k_new, v_new, cache, *, config):
  """LAYER_STEPS token appends (K/V rows and KT page) at the next slots, the cache arrays as the loop
  carry (updated in place after one copy of the non-donated inputs)."""
  def body(i, carry):
    slot = jnp.broadcast_to((cache.length + i)[:, None], k_new.shape[:2])
    k, v, kt_min, kt_max = carry
    return ops.cache_append(k, v, k_new, v_new, slot, kt_min, kt_max, page_size=config.page_size,
                            impl=config.impl)
  return jax.lax.fori_loop(0, LAYER_STEPS, body, (cache.k, cache.v, cache.state.kt_min, cache.state.kt_max))


def random_cache(key, B: int, config) -> KVCache:
  """A RocketKV cache as stage 1 leaves it, LAYER_STEPS + 1 slots short of capacity (bf16 K/V/KT)."""
  cap, ps = config.capacity, config.page_size
  ks = jax.random.split(key, 2)
  k = jax.random.normal(ks[0], (B, K_HEADS, cap, H), DT)
  v = jax.random.normal(ks[1], (B, K_HEADS, cap, H), DT)
  length = jnp.full((B,), cap - LAYER_STEPS - 1, jnp.int32)
  kt_min, kt_max = build_kt_pages(k, length, ps, DT)
  return KVCache(k=k, v=v, length=length, pos=length + 100_000, spec=config.cache_spec(),
                 state=PageState(kt_min=kt_min, kt_max=kt_max, **config.row_leaves(B, None)))


# ----------------------------------------------------------------------------- timing

def _gpu_kernel_ns(trace_dir: str):
  """Total duration of GPU kernel events in the trace, and a per-name breakdown."""
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return None, {}
  pd = ProfileData.from_file(max(files, key=os.path.getmtime))
  total, by_name = 0.0, {}
  for plane in pd.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    lines = list(plane.lines)
    stream_lines = [ln for ln in lines if ln.name.startswith("Stream")]
    use = stream_lines or [ln for ln in lines if ln.name == "XLA Ops"]
    for line in use:
      for ev in line.events:
        total += ev.duration_ns
        by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.duration_ns
  return (total if by_name else None), by_name


def time_fn(fn, arg_sets, iters: int, profile: bool):
  """(device us per call from the profile or None, wall us per call, top kernels)."""
  for a in arg_sets:
    jax.block_until_ready(fn(*a))
  n = len(arg_sets)
  walls = []
  for _ in range(3):
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*arg_sets[i % n])
    jax.block_until_ready(out)
    walls.append((time.perf_counter() - t0) / iters * 1e6)
  device_us, top = None, []
  if profile:
    d = tempfile.mkdtemp(prefix="kbench_")
    try:
      jax.profiler.start_trace(d)
      out = None
      for i in range(iters):
        out = fn(*arg_sets[i % n])
      jax.block_until_ready(out)
      jax.profiler.stop_trace()
      total, by_name = _gpu_kernel_ns(d)
      if total is not None:
        device_us = total / iters / 1e3
        top = sorted(((k_, v_ / iters / 1e3) for k_, v_ in by_name.items()), key=lambda x: -x[1])[:4]
    except Exception as e:  # noqa: BLE001 - a broken trace must not lose the wall figures
      print(f"  profile failed: {e!r}", file=sys.stderr)
    finally:
      shutil.rmtree(d, ignore_errors=True)
  return device_us, float(np.median(walls)), [(k_[:60], round(v_, 2)) for k_, v_ in top]


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def copy_bandwidth(profile: bool, nbytes: int = 2 << 30):
  x = jnp.ones((nbytes // 2,), jnp.bfloat16) * 1.5
  f = jax.jit(lambda x: x * 2)
  dev, wall, _ = time_fn(f, [(x,)], iters=20, profile=profile)
  t = dev if dev else wall
  return 2 * nbytes / (t * 1e-6), dev, wall


def tiny_launch(profile: bool):
  x = jnp.ones((1024,), jnp.float32)
  dev, wall, _ = time_fn(jax.jit(lambda x: x + 1), [(x,)], iters=200, profile=profile)
  return dev, wall


# ----------------------------------------------------------------------------- main

def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="kernels_bench.jsonl")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--only", default="", help="dense|sparse|select (select: the sparse points' HSA selection only)")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--lengths", default="4096,32768,131072")
  ap.add_argument("--budgets", default="256,1024")
  args = ap.parse_args()
  on_gpu = any(d.platform == "gpu" for d in jax.devices())
  interpret = not on_gpu
  profile = on_gpu
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=str(jax.devices()[0].device_kind), jax=jax.__version__,
              command=" ".join([os.path.basename(sys.executable)] + sys.argv))
  if args.smoke:
    batches, lengths, budgets, iters = [2], [700], [64], 2
  else:
    ints = lambda x: [int(v) for v in x.split(",")]  # noqa: E731
    batches, lengths, budgets = ints(args.batches), ints(args.lengths), ints(args.budgets)
    iters = args.iters
  rows = []
  fout = open(args.out, "w")

  def emit(rec):
    rec = {**meta, **rec}
    rows.append(rec)
    fout.write(json.dumps(rec) + "\n")
    fout.flush()
    print(json.dumps(rec), flush=True)

  bw, bw_dev, bw_wall = copy_bandwidth(profile) if on_gpu else (1e12, None, None)
  launch_dev, launch_wall = tiny_launch(profile) if on_gpu else (None, None)
  emit(dict(kind="ceiling", copy_GBps=bw / 1e9, copy_device_us=bw_dev, copy_wall_us=bw_wall,
            tiny_kernel_device_us=launch_dev, tiny_call_wall_us=launch_wall))
  key = jax.random.PRNGKey(0)

  def run_point(kind, impl, fn, arg_sets, nbytes, extra):
    dev, wall, top = time_fn(fn, arg_sets, iters, profile)
    t = dev if dev is not None else wall
    emit(dict(kind=kind, impl=impl, **extra, bytes=nbytes, device_us=dev, wall_us=wall,
              GBps=nbytes / (t * 1e-6) / 1e9, frac_copy_bw=nbytes / (t * 1e-6) / bw,
              floor_us=nbytes / bw * 1e6, top_kernels=top))

  # ---------------- dense
  if args.only in ("", "dense"):
    gqa = make_dense_gqa() if on_gpu else None
    for L in lengths:
      for B in batches:
        kv_bytes = 2 * B * K_HEADS * L * H * 2
        extra = dict(B=B, L=L)
        if 2 * kv_bytes > MEM_LIMIT_BYTES:  # the cache plus gqa's transposed copy
          emit(dict(kind="dense", impl="skipped", **extra, bytes=kv_bytes,
                    reason=f"KV {kv_bytes / 2**30:.0f} GiB (x2 with the gqa layout copy) does "
                           f"not fit {MEM_LIMIT_BYTES / 2**30:.0f} GiB"))
          continue
        n_rot = max(1, min(8, -(-L2_DEFEAT_BYTES // kv_bytes)))
        sets = []
        for r in range(n_rot):
          ks = jax.random.split(jax.random.fold_in(key, 1000 * L + 10 * B + r), 3)
          q = jax.random.normal(ks[0], (B, K_HEADS, G, H), DT)
          k = jax.random.normal(ks[1], (B, K_HEADS, L, H), DT)
          v = jax.random.normal(ks[2], (B, K_HEADS, L, H), DT)
          sets.append((q, k, v, jnp.full((B,), L, jnp.int32)))
        pallas = jax.jit(lambda q, k, v, l: dense_decode_attention(q, k, v, l, interpret=interpret))
        xla = jax.jit(dense_xla)
        q, k, v, length = sets[0]
        out_p = pallas(q, k, v, length)
        out_x = xla(q, k, v, length)
        err = dict(err_pallas_vs_xla=rel_err(out_p, out_x))
        if kv_bytes <= (2 << 30):
          ref = dense_decode_attention_reference(q, k, v, length)
          err.update(err_pallas_vs_ref=rel_err(out_p, ref), err_xla_vs_ref=rel_err(out_x, ref))
        extra.update(err)
        if err["err_pallas_vs_xla"] > 2e-2:
          print(f"WARNING dense B={B} L={L}: pallas vs xla error {err}", flush=True)
        run_point("dense", "pallas", pallas, sets, kv_bytes, extra)
        run_point("dense", "xla", xla, sets, kv_bytes, extra)
        if gqa is not None:
          tsets = [(q_, jnp.swapaxes(k_, 1, 2), jnp.swapaxes(v_, 1, 2), l_) for q_, k_, v_, l_ in sets]
          del sets
          g = jax.jit(gqa)
          e = rel_err(g(*tsets[0]), out_x)
          run_point("dense", "jax_pallas_gqa", g, tsets, kv_bytes, {**extra, "err_vs_xla": e})
          del tsets
        else:
          del sets

  # ---------------- sparse (RocketKV stage 2 of one layer, the library's own path)
  if args.only in ("", "sparse", "select"):
    pallas_impl = "interpret" if interpret else "pallas"
    for t in budgets:
      for L in lengths:
        cfg_p = rocketkv_config(L if not args.smoke else 4 * L, t, pallas_impl)
        cfg_x = rocketkv_config(L if not args.smoke else 4 * L, t, "xla")
        cap, ps, R, topk = cfg_p.capacity, cfg_p.page_size, cfg_p.topr, cfg_p.topk
        P = -(-cap // ps)
        plan = dict(capacity=cap, page_size=ps, top_r=R, top_k=topk)
        for B in batches:
          # Needed bytes per layer: the R chosen KT rows (min or max, bf16) and top_k K/V rows.
          nbytes = B * K_HEADS * (R * P * 2 + 2 * topk * H * 2)
          cache_bytes = B * K_HEADS * (2 * cap * H * 2 + 2 * H * P * 2)
          n_rot = max(1, min(16, -(-L2_DEFEAT_BYTES // cache_bytes)))
          sets = []
          for r in range(n_rot):
            ks = jax.random.split(jax.random.fold_in(key, 7 + 1000 * L + 10 * B + r + t), 4)
            q = jax.random.normal(ks[0], (B, K_HEADS, G, H), DT)
            sets.append((q, jax.random.normal(ks[1], (B, K_HEADS, H), DT),
                         jax.random.normal(ks[2], (B, K_HEADS, H), DT), random_cache(ks[3], B, cfg_p)))
          # The HSA selection of one layer (scores + top-k): the two kernels back to back, as the decode path.
          two = jax.jit(lambda q, kn, vn, c: hsa_page_topk(
              *hsa_page_partials(q, c.state.kt_min, c.state.kt_max, c.length, topr=R, page_size=ps,
                                 interpret=interpret),
              c.length, page_size=ps, k=topk, num_slots=cap, interpret=interpret))
          q, kn, vn, c = sets[0]
          sel_bytes = B * K_HEADS * R * P * c.state.kt_min.dtype.itemsize
          sel_extra = dict(B=B, L=L, t=t, **plan, rows=B * K_HEADS)
          run_point("hsa_select", "pallas two-kernel", two, sets, sel_bytes, sel_extra)
          if args.only == "select":
            del sets
            continue
          step_p = jax.jit(lambda q, kn, vn, c: sparse_step(q, c, config=cfg_p))
          step_x = jax.jit(lambda q, kn, vn, c: sparse_step(q, c, config=cfg_x))
          q, kn, vn, c = sets[0]
          out_p, out_x = step_p(q, kn, vn, c), step_x(q, kn, vn, c)
          # Same kernels on identical selections (near-ties may select differently across paths).
          idx, valid = cfg_x.select(c, q)
          err_a = rel_err(ops.sparse_decode_attention(q, c.k, c.v, idx, valid, impl=pallas_impl),
                          ops.sparse_decode_attention(q, c.k, c.v, idx, valid, impl="xla"))
          extra = dict(B=B, L=L, t=t, **plan, M=topk, err_step=rel_err(out_p, out_x),
                       err_attention=err_a)
          run_point("sparse_step", "pallas", step_p, sets, nbytes, extra)
          run_point("sparse_step", "xla", step_x, sets, nbytes, extra)
          # The scoring kernel alone, its channel choice (the row_channels kernel) inside the timed call: one
          # program per page block or one per (b, k) row walking its blocks (`hsa_scores.pick_tuning` picks by
          # rows). The impl names keep the "gather" of the records from before the rank layout's removal.
          for split in (True, False):
            score = jax.jit(lambda q, kn, vn, c, split=split: hsa_page_partials(
                q, c.state.kt_min, c.state.kt_max, c.length, topr=R, page_size=ps, interpret=interpret,
                tuning=ScoresTuning(split_pages=split)))
            run_point("hsa_scores", f"pallas gather split_pages={split}", score, sets,
                      B * K_HEADS * R * P * c.state.kt_min.dtype.itemsize, extra)
          # The sparse attention kernel alone on one fixed selection: the default split grid (partials merged
          # by an XLA epilogue) against one block per (b, k) row that normalises itself.
          idx_s, valid_s = cfg_p.select(c, q)
          for name, tune in (("default", None), ("num_splits=1 block_m=128", SparseTuning(num_splits=1, block_m=128))):
            attend = jax.jit(lambda q, kn, vn, c, tune=tune: sparse_decode_attention(
                q, c.k, c.v, idx_s, valid_s, interpret=interpret, tuning=tune))
            run_point("sparse_attn", f"pallas {name}", attend, sets, B * K_HEADS * 2 * topk * H * 2,
                      dict(extra, err_vs_xla=rel_err(attend(*sets[0]), ops.sparse_decode_attention(
                          q, c.k, c.v, idx_s, valid_s, impl="xla"))))

          def time_loop(kind, impl_fns, total_bytes, err):
            """Times jitted loops of LAYER_STEPS steps; reports per step against the bytes-moved floor."""
            for impl, fn in impl_fns:
              dev, wall, top = time_fn(fn, sets, max(2, iters // LAYER_STEPS), profile)
              t_us = (dev if dev is not None else wall) / LAYER_STEPS
              step_bytes = total_bytes / LAYER_STEPS
              emit(dict(kind=kind, impl=impl, B=B, L=L, t=t, **plan, steps_per_call=LAYER_STEPS,
                        bytes=int(step_bytes), device_us=None if dev is None else dev / LAYER_STEPS,
                        wall_us=wall / LAYER_STEPS, GBps=step_bytes / (t_us * 1e-6) / 1e9,
                        frac_copy_bw=step_bytes / (t_us * 1e-6) / bw, floor_us=step_bytes / bw * 1e6,
                        err_vs_xla=err, top_kernels=[(n, round(v / LAYER_STEPS, 2)) for n, v in top]))

          # Whole layer step: + the appended K/V row and the KT page column read and written.
          lbytes = (nbytes + B * K_HEADS * (2 * H * 2 + 4 * H * 2)) * LAYER_STEPS
          loop_p = jax.jit(lambda q, kn, vn, c: layer_steps(q, kn, vn, c, config=cfg_p))
          loop_x = jax.jit(lambda q, kn, vn, c: layer_steps(q, kn, vn, c, config=cfg_x))
          # One step (a loop feeds each output back as the query, so near-ties compound).
          err_l = rel_err(cfg_p.decode(c, q, kn, vn)[0], cfg_x.decode(c, q, kn, vn)[0])
          time_loop("layer_step", (("pallas", loop_p), ("xla", loop_x)), lbytes, err_l)
          # The append alone: K/V rows written, the KT page column read and written.
          abytes = B * K_HEADS * (2 * H * 2 + 4 * H * 2) * LAYER_STEPS
          app_p = jax.jit(lambda q, kn, vn, c: append_steps(kn, vn, c, config=cfg_p))
          app_x = jax.jit(lambda q, kn, vn, c: append_steps(kn, vn, c, config=cfg_x))
          err_app = max(rel_err(a_.astype(jnp.float32), b_.astype(jnp.float32))
                        for a_, b_ in zip(app_p(q, kn, vn, c), app_x(q, kn, vn, c)))
          time_loop("append", (("pallas", app_p), ("xla", app_x)), abytes, err_app)
          del sets

  fout.close()
  print_table(rows)


def print_table(rows):
  print("\n" + "-" * 118)
  print(f"{'kind':12s} {'impl':15s} {'B':>3s} {'L':>7s} {'t':>5s} {'MB':>9s} {'dev_us':>9s} "
        f"{'wall_us':>9s} {'floor_us':>9s} {'GB/s':>8s} {'%copy':>6s}  err")
  for r in rows:
    if r["kind"] == "ceiling":
      print(f"copy bandwidth {r['copy_GBps']:.0f} GB/s; tiny kernel {r['tiny_kernel_device_us']} "
            f"us device, {r['tiny_call_wall_us']:.1f} us wall" if r["tiny_call_wall_us"] else
            "no GPU: ceilings not measured")
      continue
    if r.get("impl") == "skipped":
      print(f"{r['kind']:12s} {'skipped':15s} {r['B']:3d} {r['L']:7d} {'':>5s} "
            f"{r['bytes'] / 1e6:9.1f}  {r['reason']}")
      continue
    errs = {k: v for k, v in r.items() if k.startswith("err")}
    dev = f"{r['device_us']:9.1f}" if r["device_us"] is not None else f"{'-':>9s}"
    print(f"{r['kind']:12s} {r['impl']:15s} {r['B']:3d} {r['L']:7d} {r.get('t', ''):>5} "
          f"{r['bytes'] / 1e6:9.2f} {dev} {r['wall_us']:9.1f} {r['floor_us']:9.2f} "
          f"{r['GBps']:8.0f} {100 * r['frac_copy_bw']:6.1f}  "
          + " ".join(f"{k[4:]}={v:.1e}" for k, v in errs.items()))


if __name__ == "__main__":
  main()
