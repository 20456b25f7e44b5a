"""`rocketkv` command line (installed as `rocketkv_jax.models.cli`): generate text with a compressed KV cache,
or run the demo.

  rocketkv generate --model smollm2 --method rocketkv --token-budget 256 --max-new-tokens 64 \
      (--prompt TEXT | --prompt-file FILE) [--chat] [--json]
  rocketkv demo [--token-budget 256] [--methods full,rocketkv]

Results go to stdout; progress (loading, prefill, decode) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings


def _console(stderr: bool):
  from rich.console import Console
  c = Console(stderr=stderr, highlight=False, log_path=False)
  if not c.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    c = Console(stderr=stderr, highlight=False, log_path=False, width=120)
  return c


def _mb(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


def _cmd_generate(args) -> int:
  from rocketkv_jax.models import generate, load
  err = _console(True)
  log = lambda msg: err.log(msg)  # noqa: E731
  if args.prompt_file:
    try:
      if args.prompt_file == "-":
        prompt = sys.stdin.read()
      else:
        with open(args.prompt_file, encoding="utf-8") as f:
          prompt = f.read()
    except OSError as e:
      err.print(f"[red]cannot read --prompt-file {args.prompt_file!r}: {e}[/red]")
      return 2
  else:
    prompt = args.prompt
  log(f"loading {args.model}")
  model, tok = load(args.model, cache_dir=args.cache, use_cache=not args.no_cache, log=log,
                    dtype=args.dtype)
  res = generate(model, tok, [prompt], method=args.method, token_budget=args.token_budget,
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 seed=args.seed, chat=args.chat, progress=log)
  s = res.stats
  if args.json:
    print(json.dumps(dict(text=res.texts[0], token_ids=res.token_ids[0], stats=s.as_dict())))
  else:
    out = _console(False)
    out.print(res.texts[0], markup=False)
    err.print(f"[dim]{args.method} (budget {args.token_budget}): prompt {s.prompt_tokens[0]} tokens, "
              f"{s.new_tokens[0]} new; KV held {_mb(s.kv_bytes)} vs full {_mb(s.full_kv_bytes)} "
              f"({s.compression:.1f}x); prefill {s.prefill_s:.2f}s, decode {s.decode_s:.2f}s "
              f"({s.tokens_per_s:.1f} tok/s), compile {s.compile_s:.1f}s[/dim]")
  return 0


def _cmd_demo(args) -> int:
  from rich.table import Table

  from rocketkv_jax.models.demo import run_demo
  err, out = _console(True), _console(False)
  t0 = time.perf_counter()
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  r = run_demo(model=args.model, methods=methods, token_budget=args.token_budget,
               max_new_tokens=args.max_new_tokens, log=lambda msg: err.log(msg), cache_dir=args.cache)
  out.print(f"\n[bold]Question[/bold] (about {r['prompt_tokens']} tokens of Alice's Adventures in "
            f"Wonderland, ch. I, with one planted fact): {r['question']}   expected: {r['answer']}")
  table = Table(title=f"token budget {args.token_budget}; prefill {r['prefill_s']:.1f}s (shared)")
  for col in ("method", "answer", "correct", "KV held", "full KV", "saved", "decode tok/s"):
    table.add_column(col, overflow="fold")
  for method, res in r["results"].items():
    s = res.stats
    ok = r["answer"] in res.texts[0]
    table.add_row(method, res.texts[0].strip(), "yes" if ok else "no", _mb(s.kv_bytes), _mb(s.full_kv_bytes),
                  f"{s.compression:.1f}x", f"{s.tokens_per_s:.1f}")
  out.print(table)
  out.print(f"total wall time {time.perf_counter() - t0:.1f}s (CPU; includes loading and compilation)")
  return 0


def build_parser() -> argparse.ArgumentParser:
  from rocketkv_jax import METHODS
  p = argparse.ArgumentParser(prog="rocketkv", description="RocketKV KV-cache compression for JAX Llama models")
  sub = p.add_subparsers(dest="command", required=True)

  def common(sp):
    sp.add_argument("--model", default="smollm2",
                    help="'smollm2' (embedded SmolLM2-135M-Instruct GGUF), a .gguf path or a HF Llama dir")
    sp.add_argument("--token-budget", type=int, default=256,
                    help="RocketKV token budget t: sets the kept prompt tokens and the per-step top-k (default 256)")
    sp.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    sp.add_argument("--cache", default=None, help="converted-weight cache dir (default ~/.cache/rocketkv_jax)")

  g = sub.add_parser("generate", help="generate text for one prompt")
  common(g)
  g.add_argument("--method", default="rocketkv", choices=list(METHODS), help="KV-cache method (default rocketkv)")
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="the prompt text")
  src.add_argument("--prompt-file", help="read the prompt from this file (- for stdin)")
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
  g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
  g.add_argument("--dtype", default=None, help="parameter dtype (default float32)")
  g.add_argument("--no-cache", action="store_true", help="do not read or write the converted-weight cache")
  g.set_defaults(func=_cmd_generate)

  d = sub.add_parser("demo", help="long-document question with full KV and RocketKV side by side")
  common(d)
  d.add_argument("--methods", default="full,rocketkv", help="comma-separated methods to compare")
  d.set_defaults(func=_cmd_demo, max_new_tokens=24)
  return p


def main(argv=None) -> int:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
    _console(True).print(f"error: {e}", style="red", markup=False)
    return 1


if __name__ == "__main__":
  sys.exit(main())
