"""Compile-only check of prefill's device memory: XLA's temp buffer size (memory_analysis) for the
Llama-3.1-8B shape at a long context with 2 and 4 layers, so the per-layer growth shows, for the ways of
running the per-token parts of a layer: whole; chunks through lax.map (the MLP block, or it and the q/k/v
projections); the MLP block over an unrolled loop of token slices (what models/llama.py does). Nothing is
allocated or run. On the H200 (results/prefill_memory_h200_2026-12-01.txt) lax.map grew 1.1-2.7 GB per
layer; the unrolled loop stays flat.

  python3 benchmarks/prefill_memory.py --context 128k
"""
from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import rocketkv_jax as rk
from benchmarks.decode import LLAMA_31_8B, parse_tokens
from rocketkv_jax.models import llama

_MODULE_CHUNKS = llama.over_token_chunks  # what models/llama.py does: the MLP block over unrolled slices


def _lax_map_chunks(fn, *xs):
  """The first design (commit 7a2bdf2): flattened tokens in chunks through lax.map (a while loop)."""
  B, T = xs[0].shape[:2]
  n, c = B * T, llama.PREFILL_CHUNK_TOKENS
  if n <= c:
    return fn(*xs)
  num = -(-n // c)
  split = lambda x: jnp.pad(x.reshape(n, *x.shape[2:]), ((0, num * c - n),) + ((0, 0),) * (x.ndim - 2)) \
      .reshape(num, 1, c, *x.shape[2:])  # noqa: E731
  out = jax.lax.map(lambda args: fn(*args), tuple(split(x) for x in xs))
  return jax.tree.map(lambda y: y.reshape(num * c, *y.shape[3:])[:n].reshape(B, T, *y.shape[3:]), out)


def _qkv_too(chunks):
  """A variant that also runs the q/k/v projections (and RoPE) over chunks."""
  def patched_qkv(blk, cfg, x, pos):
    return chunks(functools.partial(_ORIG_QKV, blk, cfg), x, pos)
  return patched_qkv


_ORIG_QKV = llama.prefill_qkv
# name: (how the MLP block is chunked, whether q/k/v are chunked the same way)
VARIANTS = {"whole": (lambda fn, *xs: fn(*xs), False), "chunk_all": (_lax_map_chunks, True),
            "chunk_mlp": (_lax_map_chunks, False), "unrolled_mlp": (_MODULE_CHUNKS, False)}


def temp_bytes(n_layers: int, context: int, variant: str) -> int:
  cfg = dataclasses.replace(LLAMA_31_8B, n_layers=n_layers)
  chunks, qkv_too = VARIANTS[variant]
  llama.over_token_chunks = chunks
  llama.prefill_qkv = _qkv_too(chunks) if qkv_too else _ORIG_QKV
  jax.clear_caches()  # the jitted prefill would otherwise reuse the last variant's trace
  try:
    model = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    config = rk.plan_rows("rocketkv", token_budget=256, prompt_lens=[context], max_new_tokens=256, head_dim=128).config
    tokens = jax.ShapeDtypeStruct((1, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = llama.prefill_jit.lower(graphdef, state, tokens, lengths, config=config).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  finally:
    llama.over_token_chunks, llama.prefill_qkv = _MODULE_CHUNKS, _ORIG_QKV


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--context", default="128k")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  a = ap.parse_args()
  context = parse_tokens(a.context)
  for v in a.variants.split(","):
    t2, t4 = temp_bytes(2, context, v), temp_bytes(4, context, v)
    print(f"PREFILL_MEM {v}: temp {t2 / 1e9:.2f} GB at 2 layers, {t4 / 1e9:.2f} GB at 4 layers, "
          f"{(t4 - t2) / 2e9:.2f} GB more per layer", flush=True)


if __name__ == "__main__":
  main()
