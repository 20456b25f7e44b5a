"""Prefill at the compute limit (issue 37): one prompt's prefill time at each context, its model FLOP/s, and the
device's measured bf16 matmul rate in the same run, so each prefill is reported as a fraction of what the device
can do.

Model FLOPs of a prefill of T tokens (the usual count, multiply-adds as 2): the linear layers 2 * T * P (P: the
parameters of every layer's projections and MLP; the embedding lookup is free and the LM head runs for the last
token only: 2 * D * V), and causal attention 2 * T^2 * N * H per layer (QK^T and PV over the causal half). The
method's stage 1 (SnapKV's scoring of the window over the prompt, its top-k) is counted as zero: whatever it
costs shows as a lower fraction. The matmul rate is the best of a few square bf16 products (8192^3, f32
accumulation), the ceiling XLA's GEMMs can reach on the device.

For each context: the whole prefill (`llama.prefill_jit`, the method's compression included) and, with
`--chunk-tokens`, the same prompt prefilled in chunks (`llama.prefill_chunk` per chunk, then the last chunk
through `prefill_extend`: what the serving engine's chunked prefill runs), each the median of `--reps` runs
after a compiling one.

  python -m benchmarks.prefill_flops --contexts 4k,8k,16k,32k,64k,128k --chunk-tokens 2048 --out OUT.jsonl
  python -m benchmarks.prefill_flops --tiny --contexts 256,512 --chunk-tokens 128      # CPU smoke test
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
from flax import nnx

import rocketkv_jax as rk
from benchmarks.decode import LLAMA_31_8B, TINY, build_model, parse_tokens
from rocketkv_jax.models import llama
from rocketkv_jax.models.llama import prefill_flops


def matmul_rate(n: int = 8192, reps: int = 10) -> float:
  """FLOP/s of a square bf16 matmul (f32 accumulation), the best median of three rounds."""
  a = jnp.ones((n, n), jnp.bfloat16)
  f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  best = 0.0
  for _ in range(3):
    f(a).block_until_ready()
    ts = []
    for _ in range(reps):
      t = time.perf_counter()
      f(a).block_until_ready()
      ts.append(time.perf_counter() - t)
    best = max(best, 2 * n ** 3 / float(np.median(ts)))
  return best


def _median(run, reps: int) -> float:
  jax.block_until_ready(run())  # compiles
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(run())
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def time_whole(model, config, tokens, reps: int) -> float:
  graphdef, state = nnx.split(model)
  lengths = jnp.full((1,), tokens.shape[1], jnp.int32)
  return _median(lambda: llama.prefill_jit(graphdef, state, tokens, lengths, config=config), reps)


def time_chunked(model, config, tokens, chunk: int, reps: int) -> float:
  """The engine's chunked prefill of one prompt: chunks into per-layer buffers, the last over them."""
  cfg = model.config
  T = tokens.shape[1]
  starts = list(range(0, T - chunk, chunk))
  last = T - (starts[-1] + chunk if starts else 0)

  def run():
    zeros = lambda: jnp.zeros((1, T, cfg.n_kv_heads, cfg.head_dim), model.dtype)  # noqa: E731
    buffers = tuple((zeros(), zeros()) for _ in range(cfg.n_layers))
    for s in starts:
      buffers = llama.prefill_chunk(model, tokens[:, s:s + chunk], buffers, np.array([s], np.int32))
    done = T - last
    logits, caches, _ = llama.prefill_extend(model, tokens[:, done:], np.array([last], np.int32), buffers,
                                             np.array([done], np.int32), config, seq_len=T)
    return logits, caches

  return _median(run, reps)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--contexts", default="4k,8k,16k,32k,64k,128k")
  ap.add_argument("--method", default="rocketkv")
  ap.add_argument("--token-budget", type=int, default=256)
  ap.add_argument("--chunk-tokens", type=int, default=0, help="also time the chunked prefill with this chunk")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  ap.add_argument("--out", default=None, help="append JSON lines here")
  args = ap.parse_args(argv)
  cfg = TINY if args.tiny else LLAMA_31_8B
  model = build_model(cfg)
  rate = matmul_rate(512 if args.tiny else 8192)
  dev = jax.devices()[0]
  base = dict(kind="prefill_flops", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=dev.device_kind, jax=jax.__version__, model="tiny" if args.tiny else "llama-3.1-8b-shape",
              method=args.method, token_budget=args.token_budget, matmul_tflops=round(rate / 1e12, 2),
              argv=["python", "-m", "benchmarks.prefill_flops"] + list(sys.argv[1:] if argv is None else argv))
  out = open(args.out, "a") if args.out else None
  print(f"{dev.device_kind}: bf16 matmul {rate / 1e12:.1f} TFLOP/s")
  for T in [parse_tokens(c) for c in args.contexts.split(",") if c]:
    rec = dict(base, context=T, model_tflop=round(prefill_flops(cfg, T) / 1e12, 3))
    try:
      config = rk.make_config(args.method, token_budget=args.token_budget, prompt_len=T, max_new_tokens=128,
                              head_dim=cfg.head_dim, max_len=cfg.max_len)
      tokens = jax.random.randint(jax.random.PRNGKey(T), (1, T), 0, cfg.vocab_size, jnp.int32)
      s = time_whole(model, config, tokens, args.reps)
      rec.update(prefill_s=round(s, 4), tflops=round(prefill_flops(cfg, T) / s / 1e12, 2),
                 of_matmul=round(prefill_flops(cfg, T) / s / rate, 3))
      if args.chunk_tokens and T > args.chunk_tokens:
        c = time_chunked(model, config, tokens, args.chunk_tokens, args.reps)
        rec.update(chunk_tokens=args.chunk_tokens, chunked_prefill_s=round(c, 4),
                   chunked_of_whole=round(c / s, 3))
      rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported with its point (e.g. out of memory at 128k)
      rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()


if __name__ == "__main__":
  main()
