"""`rocketkv demo`: a question about a real public-domain chapter, answered with full KV and RocketKV.

The document is Chapter I of Lewis Carroll's "Alice's Adventures in Wonderland" (Project Gutenberg
EBook #11, public domain; see data/SOURCES.txt), about 2,900 tokens. One sentence with a number is
planted in it so the answer cannot come from the model's memory of the book. The prompt is
prefilled once (dense), then each method compresses that prefill its own way (`compress_layers`)
and decodes from its own cache, so the comparison isolates the KV cache.
"""

from __future__ import annotations

import importlib.resources
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rocketkv_jax import METHODS, plan_rows
from rocketkv_jax.budget import MIN_TOKEN_BUDGET, check_int

from .executables import SHARED
from .generate import Prefilled, decode_prefilled, stop_ids
from .llama import compress_layers, prefill_dense_jit
from .loop import LoopConfig
from .weights import load

DOCUMENT = "alice_chapter1.txt"
PLANT_BEFORE = "Alice opened the door"
PLANTED = "The number engraved on the golden key was 4817. Remember it: the key's number is 4817.\n\n"
QUESTION = "What number was engraved on the golden key?"
ANSWER = "4817"


def document_text() -> str:
  return (importlib.resources.files("rocketkv_jax.models") / "data" / DOCUMENT).read_text(encoding="utf-8")


def demo_prompt() -> str:
  doc = document_text()
  i = doc.index(PLANT_BEFORE)
  return f"{doc[:i]}{PLANTED}{doc[i:]}\n\n{QUESTION}"


DEFAULT_MAX_NEW_TOKENS = 24


def check_demo_args(methods, token_budget: int, max_new_tokens: int) -> tuple[str, ...]:
  """The methods as a tuple, after ValueErrors naming the value for an empty or unknown method list (a repeated
  method is dropped), a token budget under MIN_TOKEN_BUDGET or max_new_tokens < 1; needs no model."""
  if isinstance(methods, str):
    raise ValueError(f"methods={methods!r} must be a sequence of method names, not one string")
  methods = tuple(dict.fromkeys(methods))
  if not methods:
    raise ValueError(f"methods is empty: name at least one of {', '.join(METHODS)}")
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}: choose from {', '.join(METHODS)}")
  check_int("token_budget", token_budget, MIN_TOKEN_BUDGET)
  check_int("max_new_tokens", max_new_tokens, 1)
  return methods


def run_demo(*, model: str = "smollm2", methods=("full", "rocketkv"), token_budget: int = 256,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, log=print, cache_dir=None, dtype=None,
             use_cache: bool = True) -> dict:
  """Runs the demo; returns {"prompt_tokens", "prefill_s", "results": {method: GenerateResult}}. The arguments
  are checked (`check_demo_args`) before the model loads."""
  methods = check_demo_args(methods, token_budget, max_new_tokens)
  t_start = time.perf_counter()
  llm, tok = load(model, cache_dir=cache_dir, log=log, dtype=dtype, use_cache=use_cache)
  ids = tok.encode(demo_prompt(), chat=True)
  T = len(ids)
  log(f"document: Alice's Adventures in Wonderland, ch. I (Project Gutenberg #11) + 1 planted fact; "
      f"prompt {T} tokens")
  tokens = jnp.asarray([ids], jnp.int32)
  lengths = jnp.asarray([T], jnp.int32)
  graphdef, state = nnx.split(llm)
  t0 = time.perf_counter()
  log("compiling prefill")
  pre = SHARED.for_args(prefill_dense_jit, graphdef, state, tokens, lengths)
  t1 = time.perf_counter()
  log(f"prefill {T} tokens (dense attention; each method then compresses it)")
  logits, layer_qkv = pre(state, tokens, lengths)
  jax.block_until_ready((logits, layer_qkv))
  prefill_s = time.perf_counter() - t1
  loop = LoopConfig(max_new_tokens=max_new_tokens, stop_ids=stop_ids(llm, tok, chat=True))
  results = {}
  for method in methods:
    config = plan_rows(method, token_budget=token_budget, prompt_lens=[T], max_new_tokens=max_new_tokens,
                       head_dim=llm.config.head_dim, max_len=llm.config.max_len).config  # the prompt's own plan
    log(f"{method}: compress the prefill KV (budget {token_budget}) and decode")
    prefilled = Prefilled(logits_BV=logits, caches=compress_layers(layer_qkv, lengths, config), lengths=[T],
                          prefill_s=prefill_s, compile_s=t1 - t0)
    results[method] = decode_prefilled(llm, tok, prefilled, config, loop, token_budget=token_budget, progress=log)
  return dict(prompt_tokens=T, prefill_s=prefill_s, results=results, question=QUESTION, answer=ANSWER,
              wall_s=time.perf_counter() - t_start)
