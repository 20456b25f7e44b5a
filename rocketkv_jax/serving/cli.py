"""`rocketkv` command line: generate text with a compressed KV cache, run the demo, or serve an
OpenAI-compatible API. It lives in the serving layer, the top one, since `serve` needs it.

  rocketkv generate --model smollm2 --method rocketkv --token-budget 256 --max-new-tokens 64 \
      (--prompt TEXT | --prompt-file FILE) [--chat] [--json]
  rocketkv demo [--token-budget 256] [--methods full,rocketkv]
  rocketkv serve --model smollm2 --method rocketkv --token-budget 256 --port 8000 --max-slots 8 \
      [--host 127.0.0.1] [--max-prompt-tokens 2048] [--max-new-tokens 256] [--max-queue 64] \
      [--history-gb 4] [--sessions-dir DIR]

Results go to stdout; progress (loading, prefill, decode) and the server's log go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
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
  ids = tok.encode(prompt, chat=args.chat)
  # one prompt, no companions: plan the cache for this prompt's own length (the tightest cache)
  res = generate(model, tok, [ids], method=args.method, token_budget=args.token_budget,
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 seed=args.seed, chat=args.chat, progress=log, plan_prompt_len=max(len(ids), 1))
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


def _cmd_serve(args) -> int:
  import uvicorn

  from rocketkv_jax.models import load

  from .engine import Engine, EngineConfig
  from .server import ServerConfig, UvicornServer, create_app
  err = _console(True)
  log = lambda msg: err.log(msg)  # noqa: E731
  buckets = None
  if args.prefill_buckets:
    try:
      buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
    except ValueError:
      raise ValueError(f"--prefill-buckets={args.prefill_buckets!r} must be comma-separated integers") from None
  engine_config = EngineConfig(method=args.method, token_budget=args.token_budget, max_slots=args.max_slots,
                               max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                               steps_per_call=args.steps_per_call, prefill_buckets=buckets, max_queue=args.max_queue,
                               history_bytes=int(args.history_gb * 2**30), history_spill_dir=args.history_spill_dir,
                               history_disk_bytes=int(args.history_disk_gb * 2**30))
  if args.sessions_dir is not None and not engine_config.history_bytes:
    raise ValueError("--sessions-dir needs a history: set --history-gb > 0")
  if args.sessions_dir is not None and os.path.exists(args.sessions_dir) and \
      not os.path.isfile(os.path.join(args.sessions_dir, "meta.json")):
    raise ValueError(f"--sessions-dir={args.sessions_dir!r} exists but holds no saved sessions (no meta.json)")
  from rich.logging import RichHandler
  serving_log = logging.getLogger("rocketkv_jax.serving")
  if not serving_log.handlers:
    serving_log.addHandler(RichHandler(console=err, show_path=False))
    serving_log.setLevel(logging.INFO)
  log(f"loading {args.model}")
  model, tok = load(args.model, cache_dir=args.cache, use_cache=not args.no_cache, log=log, dtype=args.dtype)
  engine = Engine(model, tok, engine_config)
  name = args.served_model_name or _model_name(args.model)
  app = create_app(engine, model, tok, ServerConfig(model_name=name, drain_s=args.drain_s, warmup=not args.no_warmup,
                                                    history_dir=args.sessions_dir))
  config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.drain_s + 5)
  server = UvicornServer(config, app.state.runner, drain_s=args.drain_s)
  if not args.no_warmup:
    log(f"warming up: compiling {len(engine_config.prefill_buckets)} prefill buckets and the decode step")
  log(f"serving {name!r} ({args.method}, budget {args.token_budget}, {args.max_slots} slots) "
      f"on http://{args.host}:{args.port}/v1")
  # uvicorn drains, shuts down, then re-raises the signal it caught: Ctrl-C and SIGTERM end here, exit 0.
  signal.signal(signal.SIGTERM, _interrupt)
  try:
    server.run()
  except KeyboardInterrupt:
    pass
  log("server stopped")
  return 0


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def _model_name(model: str) -> str:
  """The id clients name: 'smollm2', or a checkpoint's file / folder name."""
  base = os.path.basename(os.path.normpath(model))
  return base[:-5] if base.endswith(".gguf") else base


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

  s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
  common(s)
  s.add_argument("--method", default="rocketkv", choices=list(METHODS), help="KV-cache method (default rocketkv)")
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
  s.add_argument("--max-slots", type=int, default=8, help="requests decoded at once (default 8)")
  s.add_argument("--max-prompt-tokens", type=int, default=2048, help="longest prompt accepted (default 2048)")
  s.add_argument("--max-queue", type=int, default=64,
                 help="requests waiting for a slot before new ones get 429 (default 64)")
  s.add_argument("--steps-per-call", type=int, default=4, help="decode steps per engine call (default 4)")
  s.add_argument("--prefill-buckets", default=None,
                 help="comma-separated prefill lengths compiled at most (default: the engine's choice)")
  s.add_argument("--served-model-name", default=None, help="the model id clients use (default: from --model)")
  s.add_argument("--drain-s", type=float, default=10.0,
                 help="on shutdown, seconds requests in flight may finish before they are aborted (default 10)")
  s.add_argument("--no-warmup", action="store_true",
                 help="skip compiling every prefill bucket before accepting requests (the first ones then wait)")
  s.add_argument("--history-gb", type=float, default=4.0,
                 help="host memory for the K/V history of past prompts, so a conversation's next turn (or a new "
                      "question after a long context) prefills only its new tokens (default 4; 0 = off)")
  s.add_argument("--history-spill-dir", default=None,
                 help="move history that no longer fits in host memory to files here (default: drop it)")
  s.add_argument("--history-disk-gb", type=float, default=16.0, help="disk for spilled history (default 16)")
  s.add_argument("--sessions-dir", default=None,
                 help="load stored histories from here at start-up and save them here at shutdown (orbax)")
  s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
  s.add_argument("--dtype", default=None, help="parameter dtype (default float32)")
  s.add_argument("--no-cache", action="store_true", help="do not read or write the converted-weight cache")
  s.set_defaults(func=_cmd_serve, max_new_tokens=256)
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
