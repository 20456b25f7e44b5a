"""Compile-only check of prefill's device memory: XLA's temp buffer size (memory_analysis) for the
Llama-3.1-8B shape at a long context with 2 and 4 layers, so the per-layer growth shows, for the ways of
running the per-token parts of a layer (whole / over token chunks). Nothing is allocated or run.

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
from benchmarks.decode import LLAMA_31_8B, _parse_tokens
from rocketkv_jax.models import llama

_CHUNKED = llama._over_token_chunks


def _finish_only(fn, *xs):  # chunk the MLP block, run q/k/v projections whole
  if isinstance(fn, functools.partial) and fn.func is llama._qkv:
    return fn(*xs)
  return _CHUNKED(fn, *xs)


def _unrolled_mlp(fn, *xs):  # the MLP block over token slices in a Python loop (no while loop), joined
  if isinstance(fn, functools.partial) and fn.func is llama._qkv:
    return fn(*xs)
  c, T = llama.PREFILL_CHUNK_TOKENS, xs[0].shape[1]
  outs = [fn(*(x[:, i:i + c] for x in xs)) for i in range(0, T, c)]
  return jnp.concatenate(outs, axis=1)


VARIANTS = {"whole": None, "chunk_all": _CHUNKED, "chunk_mlp": _finish_only, "unrolled_mlp": _unrolled_mlp}


def temp_bytes(n_layers: int, context: int, variant: str) -> int:
  cfg = dataclasses.replace(LLAMA_31_8B, n_layers=n_layers)
  chunk = VARIANTS[variant]
  llama._over_token_chunks = chunk if chunk is not None else (lambda fn, *xs: fn(*xs))
  jax.clear_caches()  # the jitted prefill would otherwise reuse the last variant's trace
  try:
    model = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    config = rk.make_config("rocketkv", token_budget=256, prompt_len=context, max_new_tokens=256, head_dim=128)
    tokens = jax.ShapeDtypeStruct((1, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = llama._prefill_jit.lower(graphdef, state, tokens, lengths, config).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  finally:
    llama._over_token_chunks = _CHUNKED


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--context", default="128k")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  a = ap.parse_args()
  context = _parse_tokens(a.context)
  for v in a.variants.split(","):
    t2, t4 = temp_bytes(2, context, v), temp_bytes(4, context, v)
    print(f"PREFILL_MEM {v}: temp {t2 / 1e9:.2f} GB at 2 layers, {t4 / 1e9:.2f} GB at 4 layers, "
          f"{(t4 - t2) / 2e9:.2f} GB more per layer", flush=True)


if __name__ == "__main__":
  main()
