"""Sizing on paper, from the code's own accounting: how many sequences of Llama-3.1-8B, -70B and -405B fit on
an H200 and on an 8-GPU host, with a full KV cache and with RocketKV, and the tensor-parallel degree each needs.

Nothing is allocated: the model is built abstractly (`nnx.eval_shape`), and each cell's caches are the output
shapes of the real prefill (`jax.eval_shape` of `llama.prefill_jit` for one prompt of the context's length,
under the plan `generate` and the engine run for it: `generate.plan_batch`). Bytes per sequence are
`rocketkv_jax.cache_nbytes` of those caches (K/V plus every page, score and index a method keeps); weight bytes
are the abstract parameters' (bf16). What one GPU holds under tensor parallelism of degree TP is read from the
placement rules themselves (`models.sharding.param_spec` / `cache_spec` on a (data=1, model=TP) mesh: the
projections and the KV heads split TP ways, norms replicated).

Assumptions, stated in the printed table: an H200 holds 141 GB (141e9 bytes, NVIDIA's figure); 10% of it
(14.1 GB) is kept back for activations (one layer of a 128k prefill), compiled programs and the allocator's
slack; each sequence is a prompt of the context's length plus 1,024 generated tokens; weights and KV in bf16.
TP is the smallest degree in 1, 2, 4, 8 (the KV heads, 8, must divide) at which the weights plus one sequence
fit; a replica is TP GPUs; a host holds 8 / TP replicas.

  python -m benchmarks.sizing                 # prints the markdown table
  python -m benchmarks.sizing --write-doc  # and writes it into docs/GUIDE.md between the sizing markers
  python -m benchmarks.sizing --json          # the rows as JSON lines
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

import rocketkv_jax as rk
from rocketkv_jax.models import llama, shapes
from rocketkv_jax.models.generate import plan_batch
from rocketkv_jax.models.sharding import DATA, MODEL, cache_spec, param_spec

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
CONTEXTS = (32768, 131072)
CELLS = (("full", None), ("rocketkv", 256), ("rocketkv", 1024))
NEW_TOKENS = 1024
HBM = 141e9                  # bytes per H200 (NVIDIA's 141 GB)
RESERVE = 0.10 * HBM         # kept back: activations, compiled programs, allocator slack
GPUS_PER_HOST = 8
TP_DEGREES = (1, 2, 4, 8)
DTYPE = jnp.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "GUIDE.md")
BEGIN, END = "<!-- sizing:begin (python -m benchmarks.sizing --write-doc) -->", "<!-- sizing:end -->"


def _mesh(tp: int):
  return AbstractMesh((1, tp), (DATA, MODEL))


def abstract_model(name: str):
  """(graphdef, abstract state) of the named shape in bf16: shapes only, nothing allocated."""
  cfg = shapes.shape(name)
  model = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=DTYPE, rngs=nnx.Rngs(0)))
  return nnx.split(model)


def weight_bytes(state, tp: int = 1) -> int:
  """Parameter bytes one GPU holds at tensor-parallel degree tp (`param_spec`); tp=1: all of them."""
  mesh, total = _mesh(tp), 0
  for path, var in nnx.to_flat_state(state):
    x = var.get_value() if hasattr(var, "get_value") else var.value
    name = "/".join(str(p) for p in path)
    split = math.prod(mesh.shape[a] for a in param_spec(name, x.shape, mesh) if a is not None)
    total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // split
  return total


@functools.lru_cache(maxsize=None)
def sequence_caches(name: str, context: int, method: str, budget: int | None, *, every_layer: bool = False):
  """The caches (shapes) the real prefill makes for one prompt of `context` tokens under the plan generate runs
  for it (`plan_batch`, NEW_TOKENS to generate): one per layer. Every layer's cache has the same shapes, so the
  prefill is traced over one layer of the shape and that layer's cache stands for each of the model's layers
  (every_layer=True traces them all: the same caches, tested, 30x slower for the 405B)."""
  cfg = shapes.shape(name)
  traced = cfg if every_layer else dataclasses.replace(cfg, n_layers=1)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: llama.Llama(traced, dtype=DTYPE, rngs=nnx.Rngs(0))))
  plan = plan_batch(method, [context], token_budget=budget or 256, max_new_tokens=NEW_TOKENS, head_dim=cfg.head_dim,
                    n_kv_heads=cfg.n_kv_heads, model_dtype=DTYPE, max_len=cfg.max_len)
  _, caches = jax.eval_shape(
      lambda s, t, n: llama.prefill_jit(graphdef, s, t, n, plan.rows, config=plan.config), state,
      jax.ShapeDtypeStruct((1, context), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
  return tuple(caches) if every_layer else tuple(caches) * cfg.n_layers


def cache_bytes_per_gpu(caches, tp: int) -> int:
  """Bytes of `caches` one GPU holds at tensor-parallel degree tp (`cache_spec`: KV heads, axis 1, split)."""
  mesh, total = _mesh(tp), 0
  for x in jax.tree.leaves(caches):
    spec = cache_spec(x.shape, mesh, 1 if x.ndim >= 2 else None)
    split = math.prod(mesh.shape[a] for a in spec if a is not None)
    total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // split
  return total


def rows() -> list[dict]:
  """One dict per (model, context, method): the table's numbers."""
  usable = HBM - RESERVE
  out = []
  for name in MODELS:
    _, state = abstract_model(name)
    w = {tp: weight_bytes(state, tp) for tp in TP_DEGREES}
    for context in CONTEXTS:
      for method, budget in CELLS:
        caches = sequence_caches(name, context, method, budget)
        kv = rk.cache_nbytes(caches)
        kv_gpu = {tp: cache_bytes_per_gpu(caches, tp) for tp in TP_DEGREES}
        tp = next((t for t in TP_DEGREES if w[t] + kv_gpu[t] <= usable), None)
        per_replica = None if tp is None else int((usable - w[tp]) // kv_gpu[tp])
        out.append(dict(model=name, context=context, new_tokens=NEW_TOKENS, method=method, token_budget=budget,
                        kv_bytes=kv, weight_bytes=w[1], tp=tp,
                        weight_bytes_per_gpu=None if tp is None else w[tp],
                        kv_bytes_per_gpu=None if tp is None else kv_gpu[tp],
                        seqs_per_replica=per_replica,
                        seqs_per_gpu=None if tp is None else per_replica / tp,
                        seqs_per_host=None if tp is None else per_replica * (GPUS_PER_HOST // tp)))
  return out


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def _per_gpu(x: float) -> str:
  return f"{int(x):,}" if x == int(x) else f"{x:,.1f}"


def _k(n: int) -> str:
  return f"{n // 1024}k"


def markdown(table: list[dict]) -> str:
  """The guide's scaling table (docs/GUIDE.md, "What fits"; and the assumptions it rests on)."""
  intro = (f"Per sequence: a prompt of the context's length plus {NEW_TOKENS:,} generated tokens, bf16. An H200 "
           f"holds {HBM / 1e9:.0f} GB, of which {RESERVE / 1e9:.1f} GB (10%) is kept back for activations, compiled "
           f"programs and allocator slack. TP: the smallest tensor-parallel degree (GPUs per replica) at which the "
           f"weights and one sequence fit; each GPU of a replica holds 1 / TP of the weights and of every "
           f"sequence's KV, so sequences per H200 is a replica's / TP; a host of {GPUS_PER_HOST} GPUs holds "
           f"{GPUS_PER_HOST} / TP replicas. Generated by `python -m benchmarks.sizing` from "
           "`rocketkv_jax.cache_nbytes` over the caches the real prefill makes (`jax.eval_shape`, nothing "
           "allocated) and from the placement rules of `models/sharding.py`.")
  lines = textwrap.wrap(intro, 115, break_on_hyphens=False) + [
      "",
      "| model (bf16 weights) | context | method | KV per sequence | TP | weights per GPU | sequences per H200 | "
      "per replica | per 8-GPU host |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in table:
    method = r["method"] if r["token_budget"] is None else f"RocketKV t={r['token_budget']}"
    model = f"{r['model'].replace('llama', 'Llama').replace('b', 'B')} ({_gb(r['weight_bytes'])})"
    if r["tp"] is None:
      lines.append(f"| {model} | {_k(r['context'])} | {method} | {_gb(r['kv_bytes'])} | > {TP_DEGREES[-1]} | "
                   "| | | |")
      continue
    lines.append(f"| {model} | {_k(r['context'])} | {method} | {_gb(r['kv_bytes'])} | {r['tp']} | "
                 f"{_gb(r['weight_bytes_per_gpu'])} | {_per_gpu(r['seqs_per_gpu'])} | {r['seqs_per_replica']:,} | "
                 f"{r['seqs_per_host']:,} |")
  return "\n".join(lines) + "\n"


def doc_table(text: str) -> str:
  """The part of the guide's text between the sizing markers (ValueError when they are missing)."""
  if BEGIN not in text or END not in text:
    raise ValueError(f"docs/GUIDE.md lacks the sizing markers {BEGIN!r} ... {END!r}")
  return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_doc(table_md: str, path: str = DOC) -> None:
  with open(path) as f:
    text = f.read()
  doc_table(text)
  head, rest = text.split(BEGIN, 1)
  tail = rest.split(END, 1)[1]
  with open(path, "w") as f:
    f.write(f"{head}{BEGIN}\n{table_md}{END}{tail}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--write-doc", action="store_true", help="write the table into docs/GUIDE.md between the markers")
  ap.add_argument("--json", action="store_true", help="print the rows as JSON lines instead of the table")
  args = ap.parse_args(argv)
  table = rows()
  if args.json:
    for r in table:
      print(json.dumps(r))
  else:
    sys.stdout.write(markdown(table))
  if args.write_doc:
    write_doc(markdown(table))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
