"""How much FP8 K/V storage perturbs a real model's attention, per storage scheme (issue 40; docs/ALGORITHM.md,
"FP8 K/V").

One real prompt (a seeded multikey task of `--context` tokens) goes through the model's dense prefill on the
default device; for every layer, the last `--queries` queries attend causally over the layer's post-RoPE K/V held
five ways, against float32:

  bf16            K and V rounded to bfloat16 (what a bf16 cache holds)
  head            FP8, one scale per KV head, keys as they are (this project before 2026-12-06)
  channel         FP8, one key scale per (KV head, channel), keys as they are (KIVI-style per-channel keys)
  centred         FP8, keys centred on their prompt mean per channel, one scale per KV head: `kernels/kv_quant`
                  as the cache stores them (the mean cancels in the softmax)
  centred+channel centred keys with per-channel scales

Per scheme: the attention output's relative error (Frobenius, per layer; mean and worst layer) and the logits'
RMS error (mean and worst layer). Values always use one scale per KV head. A CPU run takes about a minute at 2k
tokens for Qwen2.5-1.5B:

  python -m benchmarks.kv_quant_error --model qwen2.5-1.5b --context 2048 --out OUT.json
  python -m benchmarks.kv_quant_error --model smollm2 --context 1024 --dtype float8_e5m2
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.eval import tasks
from rocketkv_jax.kernels.kv_quant import dequantize, fp8_max, key_mean, kv_scale, quantize
from rocketkv_jax.models import llama, weights


def _fp8(x_KSH, dtype, per_channel: bool):
  """x as an FP8 cache of scale per KV head (or per (KV head, channel)) reads it back, float32."""
  if per_channel:
    amax = jnp.abs(x_KSH).max(axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / fp8_max(dtype), 1.0)
  else:
    valid = jnp.ones(x_KSH.shape[:2], bool)[None]
    scale = kv_scale(x_KSH[None], valid, dtype)[0][:, None, None]
  return dequantize(quantize(x_KSH, scale, dtype), scale)


def _centred(k_KSH, dtype, per_channel: bool):
  mean = key_mean(k_KSH[None], jnp.ones(k_KSH.shape[:2], bool)[None])[0][:, None, :]
  return _fp8(k_KSH - mean, dtype, per_channel) + mean


def schemes(dtype):
  """name -> (k [K, S, H], v) -> (k, v) as held, float32."""
  bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
  return {
      "bf16": lambda k, v: (bf16(k), bf16(v)),
      "head": lambda k, v: (_fp8(k, dtype, False), _fp8(v, dtype, False)),
      "channel": lambda k, v: (_fp8(k, dtype, True), _fp8(v, dtype, False)),
      "centred": lambda k, v: (_centred(k, dtype, False), _fp8(v, dtype, False)),
      "centred+channel": lambda k, v: (_centred(k, dtype, True), _fp8(v, dtype, False)),
  }


def attend(q_TNH, k_KSH, v_KSH):
  """The last T queries (positions S-T .. S-1) attending causally: (output [T, N, H], logits [T, N, S])."""
  t, n, h = q_TNH.shape
  kv, s, _ = k_KSH.shape
  q = q_TNH.reshape(t, kv, n // kv, h)
  logits = jnp.einsum("tkgh,ksh->tkgs", q, k_KSH, precision="highest") / np.sqrt(h)
  causal = jnp.arange(s)[None, :] <= (s - t + jnp.arange(t))[:, None]
  logits = jnp.where(causal[:, None, None, :], logits, -jnp.inf)
  out = jnp.einsum("tkgs,ksh->tkgh", jax.nn.softmax(logits, axis=-1), v_KSH, precision="highest")
  return out.reshape(t, n, h), logits.reshape(t, n, s)


def measure(layers, n_queries: int, dtype) -> dict:
  """Per scheme, per layer: (output relative error, logit RMS error); and each layer's key offset (mean |channel
  mean| / channel std)."""
  out = {name: {"out_rel_err": [], "logit_rms_err": []} for name in schemes(dtype)}
  offsets = []
  for q, k, v in layers:
    q = q[0, -n_queries:].astype(jnp.float32)
    k, v = (x[0].transpose(1, 0, 2).astype(jnp.float32) for x in (k, v))  # [K, S, H]
    offsets.append(float((jnp.abs(k.mean(axis=1)) / (k.std(axis=1) + 1e-6)).mean()))
    ref, ref_logits = attend(q, k, v)
    seen = jnp.isfinite(ref_logits)
    for name, hold in schemes(dtype).items():
      o, logits = attend(q, *hold(k, v))
      out[name]["out_rel_err"].append(float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)))
      sq = jnp.where(seen, logits - ref_logits, 0.0) ** 2
      out[name]["logit_rms_err"].append(float(jnp.sqrt(sq.sum() / seen.sum())))
  return {"per_layer": out, "key_offset_per_layer": offsets}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2", help="anything `models.weights.load` takes (default smollm2)")
  p.add_argument("--context", type=int, default=1024, help="prompt tokens (default 1024)")
  p.add_argument("--queries", type=int, default=32, help="last queries that attend (default 32)")
  p.add_argument("--dtype", default="float8_e4m3fn", choices=["float8_e4m3fn", "float8_e5m2"])
  p.add_argument("--out", help="write the figures as JSON here")
  args = p.parse_args(argv)
  t0 = time.time()
  model, tokenizer = weights.load(args.model, dtype=jnp.float32)
  sample = tasks.make_multikey(tokenizer, args.context, 0, chat=True)
  _, layers = llama.prefill_dense(model, jnp.asarray([sample.ids], jnp.int32), jnp.asarray([args.context]))
  result = measure(layers, args.queries, jnp.dtype(args.dtype))
  print(f"{args.model}, {args.context} tokens, last {args.queries} queries, {args.dtype}, {len(layers)} layers "
        f"({time.time() - t0:.0f} s); key offset (mean |channel mean| / std): first layer "
        f"{result['key_offset_per_layer'][0]:.1f}, median {np.median(result['key_offset_per_layer']):.1f}")
  print(f"{'scheme':16s} {'out rel err mean':>17s} {'worst':>7s} {'logit rms mean':>15s} {'worst':>7s}")
  summary = {}
  for name, r in result["per_layer"].items():
    o, lg = np.asarray(r["out_rel_err"]), np.asarray(r["logit_rms_err"])
    summary[name] = dict(out_rel_err_mean=float(o.mean()), out_rel_err_worst=float(o.max()),
                         logit_rms_err_mean=float(lg.mean()), logit_rms_err_worst=float(lg.max()))
    print(f"{name:16s} {o.mean():17.4f} {o.max():7.4f} {lg.mean():15.4f} {lg.max():7.4f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(vars(args), summary=summary, **result, device=str(jax.devices()[0])), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
