"""`rocketkv` end to end on a tiny GGUF written by the loader tests: generate's output (JSON, chat template by
default, the stop token, warnings), every bad flag refused before the model loads, the persistent compilation
cache, --version. In-process calls pass --no-compile-cache so that this process's JAX config is left alone."""

import importlib
import json
import os
import subprocess
import sys
import time

import pytest

from rocketkv_jax.serving.cli import build_parser, kv_report, main, parse_dtype, parse_kv_dtype

from tests.helpers.checkpoints import write_gguf

PROMPT = "the cat sat on the mat and then the cat sat again"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  return write_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def run_json(capsys, args):
  assert main(args + ["--json", "--no-cache", "--no-compile-cache"]) == 0
  captured = capsys.readouterr()
  return json.loads(captured.out), captured.err


def test_generate_json(tiny_gguf, capsys):
  out, _ = run_json(capsys, ["generate", "--model", tiny_gguf, "--method", "rocketkv", "--token-budget", "64",
                             "--max-new-tokens", "5", "--prompt", PROMPT])
  assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
  assert out["finish_reason"] in ("stop", "length")
  assert 1 <= len(out["token_ids"]) <= 5
  s = out["stats"]
  assert s["method"] == "rocketkv" and s["kv_bytes"] > 0
  assert s["compression_ratio"] == round(s["compression_ratio"], 4) and s["prefill_s"] == round(s["prefill_s"], 3)


def test_generate_with_an_fp8_kv_cache(tiny_gguf, capsys):
  """--kv-cache-dtype fp8 stores K/V in float8_e4m3fn: the cache the run reports holds fewer bytes than the same
  run's in the model's dtype (float32 here), and it still generates."""
  args = ["generate", "--model", tiny_gguf, "--method", "rocketkv", "--token-budget", "16", "--max-new-tokens", "4",
          "--prompt", PROMPT * 6]
  plain, _ = run_json(capsys, args)
  fp8, _ = run_json(capsys, args + ["--kv-cache-dtype", "fp8"])
  assert 1 <= len(fp8["token_ids"]) <= 4
  # K and V go from 4 bytes per element to 1, plus one float32 scale each per (sequence, layer, KV head) and the
  # key mean (head_dim float32 per (sequence, layer, KV head)); the lengths and plan leaves are unchanged
  from tests.helpers.checkpoints import CFG
  kv_elements = 2 * CFG.n_layers * CFG.n_kv_heads * plain["stats"]["capacity"] * CFG.head_dim
  scales = 2 * CFG.n_layers * CFG.n_kv_heads * 4 + CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
  assert fp8["stats"]["capacity"] == plain["stats"]["capacity"]
  # and the KT pages (2 x layers x KV heads x head_dim x some P pages) from the keys' 4 bytes to float8_e5m2's 1
  # (the FP8 default, `MethodConfig.kt_storage`)
  kt_saved = plain["stats"]["kv_bytes"] - fp8["stats"]["kv_bytes"] - (3 * kv_elements - scales)
  page_column = 3 * 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim
  assert kt_saved > 0 and kt_saved % page_column == 0
  assert fp8["stats"]["full_kv_bytes"] == plain["stats"]["full_kv_bytes"]  # full is counted in the model's dtype


def test_kv_dtype_spellings():
  assert all(parse_kv_dtype(s) == "float8_e4m3fn" for s in ("fp8", "FP8", "e4m3", "float8_e4m3fn"))
  assert parse_kv_dtype("e5m2") == "float8_e5m2" and parse_kv_dtype("bf16") == "bfloat16"
  assert parse_kv_dtype("auto") is None
  assert build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "float8_e4m3fn"
  assert build_parser().parse_args(["serve"]).kv_cache_dtype is None


def test_generate_reports_missing_model(tmp_path, capsys):
  assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 1
  assert "not found" in capsys.readouterr().err


def test_generate_reads_the_prompt_from_stdin(tiny_gguf, capsys, monkeypatch):
  import io
  monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
  common = ["generate", "--model", tiny_gguf, "--method", "full", "--max-new-tokens", "3"]
  from_stdin, _ = run_json(capsys, common + ["--prompt-file", "-"])
  assert run_json(capsys, common + ["--prompt", PROMPT])[0]["token_ids"] == from_stdin["token_ids"]
  assert from_stdin["stats"]["prompt_tokens"][0] > 5


def test_chat_template_is_the_default(tiny_gguf, capsys):
  common = ["generate", "--model", tiny_gguf, "--method", "full", "--max-new-tokens", "2", "--prompt", PROMPT]
  chat, err = run_json(capsys, common)
  assert "chat template" in err
  assert run_json(capsys, common + ["--chat"])[0]["stats"]["prompt_tokens"] == chat["stats"]["prompt_tokens"]
  raw, _ = run_json(capsys, common + ["--no-chat"])
  assert run_json(capsys, common + ["--raw"])[0]["stats"]["prompt_tokens"] == raw["stats"]["prompt_tokens"]
  assert raw["stats"]["prompt_tokens"][0] < chat["stats"]["prompt_tokens"][0]


def test_stop_token_is_in_neither_text_nor_token_ids(tiny_gguf, capsys, monkeypatch):
  gen = importlib.import_module("rocketkv_jax.models.generate")  # (the package's `generate` is the function)
  common = ["generate", "--model", tiny_gguf, "--method", "full", "--max-new-tokens", "6", "--prompt", PROMPT]
  first, _ = run_json(capsys, common)
  assert first["finish_reason"] == "length" and len(first["token_ids"]) == 6
  stop = first["token_ids"][2]
  monkeypatch.setattr(gen, "stop_ids", lambda model, tok, chat: (stop,))  # make the 3rd token a stop token
  out, _ = run_json(capsys, common)
  k = first["token_ids"].index(stop)
  assert out["finish_reason"] == "stop" and out["token_ids"] == first["token_ids"][:k]
  assert out["stats"]["new_tokens"] == [k + 1]  # stats count the stop token


def test_one_token_has_no_rate_and_empty_output_warns(tiny_gguf, capsys, monkeypatch):
  import dataclasses
  gen = importlib.import_module("rocketkv_jax.models.generate")
  out, _ = run_json(capsys, ["generate", "--model", tiny_gguf, "--max-new-tokens", "1", "--prompt", PROMPT])
  assert out["stats"]["new_tokens"] == [1] and out["stats"]["tokens_per_s"] is None
  real = gen.generate
  monkeypatch.setattr(gen, "generate", lambda *a, **k: dataclasses.replace(real(*a, **k), texts=[" "]))
  assert main(["generate", "--model", tiny_gguf, "--max-new-tokens", "2", "--prompt", PROMPT, "--no-chat",
               "--no-cache", "--no-compile-cache"]) == 0
  err = capsys.readouterr().err
  assert "empty output" in err and "drop --no-chat" in err


def test_a_short_prompt_is_kept_whole_never_larger_than_full(tiny_gguf, capsys):
  """A prompt the budget covers used to hold several times full's KV (KT pages, a bucket's slots): it is now kept
  whole, full's cache, and the report says so."""
  assert main(["generate", "--model", tiny_gguf, "--method", "rocketkv", "--token-budget", "256",
               "--max-new-tokens", "4", "--prompt", PROMPT, "--no-cache", "--no-compile-cache"]) == 0
  err = capsys.readouterr().err
  assert "compression ratio" in err and "kvpress" in err and "kept whole" in err
  assert "MORE KV than full" not in err and "about the same" in err


def test_kv_report_warns_when_the_cache_holds_more_than_full():
  from rocketkv_jax.models.generate import GenerateStats
  s = GenerateStats(method="rocketkv", token_budget=64, batch=1, prompt_tokens=[100], new_tokens=[8],
                    kv_bytes=2000, full_kv_bytes=1000, compression=0.5, compression_ratio=-1.0, capacity=108,
                    prefill_s=1.0, decode_s=1.0, decode_steps=7, tokens_per_s=7.0, compile_s=0.0)
  line, warning = kv_report(s, 8)
  assert "MORE KV than full" in warning and "not the cache size" in warning and "LARGER" in line


def test_kv_report_without_warning():
  from rocketkv_jax.models.generate import GenerateStats
  s = GenerateStats(method="rocketkv", token_budget=64, batch=1, prompt_tokens=[1000], new_tokens=[8],
                    kv_bytes=250, full_kv_bytes=1000, compression=4.0, compression_ratio=0.75, capacity=200,
                    prefill_s=1.0, decode_s=1.0, decode_steps=7, tokens_per_s=7.0, compile_s=0.0)
  line, warning = kv_report(s, 8)
  assert warning is None and "4.00x smaller" in line and "0.750" in line and "1008" in line


@pytest.mark.parametrize("args, shown", [
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature: must be a finite number"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: must be > 0 and <= 1"),
    (["generate", "--prompt", "x", "--top-p", "inf"], "--top-p: must be a finite number"),
    (["generate", "--prompt", "x", "--seed", "-1"], "--seed: must be >= 0"),
    (["generate", "--prompt", "x", "--seed", str(2**32)], "< 2**32"),
    (["generate", "--prompt", "x", "--token-budget", "8"], "--token-budget: must be >= 16"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["generate", "--prompt", "x", "--dtype", "bogus"], "bf16"),
    (["generate", "--prompt", "x", "--method", "bogus"], "invalid choice"),
    (["generate", "--prompt", ""], "the prompt is empty"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/m.gguf"], "not found"),
    (["demo", "--methods", ""], "no method named"),
    (["demo", "--methods", "full,bogus"], "'bogus'"),
    (["demo", "--token-budget", "8"], "--token-budget: must be >= 16"),
    (["serve", "--token-budget", "8"], "--token-budget: must be >= 16"),
    (["serve", "--port", "70000"], "--port: must be"),
    (["serve", "--history-gb", "nan"], "--history-gb: must be a finite number"),
    (["serve", "--drain-s", "-1"], "--drain-s: must be >= 0"),
    (["serve", "--prefill-buckets", "a,b"], "comma-separated integers"),
    (["serve", "--max-prompt-tokens", "64", "--prefill-buckets", "128"], "must not exceed max_prompt_tokens"),
    (["serve", "--sessions-dir", "/dev/null/x"], "--sessions-dir='/dev/null/x': cannot use /dev/null/x"),
    (["serve", "--history-spill-dir", "/dev/null/x"], "--history-spill-dir='/dev/null/x': cannot use"),
    (["serve", "--sessions-save-s", "-1"], "--sessions-save-s: must be >= 0"),
    (["serve", "--max-prompt-tokens", str(2**40)], "--max-prompt-tokens: must be >= 1 and <= 2**31 - 1"),
    (["serve", "--max-new-tokens", str(2**31)], "--max-new-tokens: must be >= 1 and <= 2**31 - 1"),
    (["generate", "--prompt", "x", "--max-new-tokens", str(2**40)], "--max-new-tokens: must be >= 1 and <= 2**31"),
    (["serve", "--token-budget", str(2**40)], "--token-budget: must be >= 16 and <= 2**31 - 1"),
    (["serve", "--host", "999.1.1.1"], "--host='999.1.1.1' is not an address or a name this machine resolves"),
    (["serve", "--host", "exa mple"], "--host='exa mple' is not an address"),
    (["serve", "--max-connections", "0"], "--max-connections: must be >= 1"),
    (["serve", "--request-timeout-s", "0"], "--request-timeout-s: must be > 0"),
    (["serve", "--keep-alive-s", "0"], "--keep-alive-s: must be >= 1"),
    (["serve", "--request-timeout-s", "inf"], "--request-timeout-s: must be a finite number"),
    (["generate", "--prompt", "x", "--kv-cache-dtype", "int4"], "unknown K/V cache dtype 'int4'"),
    (["serve", "--kv-cache-dtype", "fp4"], "unknown K/V cache dtype 'fp4'"),
])
def test_bad_flags_fail_fast_without_loading_the_model(args, shown, capsys, monkeypatch):
  import rocketkv_jax.models as models
  import rocketkv_jax.models.demo as demo

  def no_load(*a, **k):
    raise AssertionError("the model was loaded")
  monkeypatch.setattr(models, "load", no_load)
  monkeypatch.setattr(demo, "load", no_load)
  t0 = time.perf_counter()
  try:
    rc = main(args + ["--no-compile-cache"])
  except SystemExit as e:  # argparse's usage errors
    rc = e.code
  assert time.perf_counter() - t0 < 10
  assert rc not in (0, None)
  assert shown in capsys.readouterr().err


def _serve_flags_checked(monkeypatch, capsys, args):
  """(exit status, stderr) of `rocketkv serve ARGS` stopped where the model would load (a ValueError there)."""
  import rocketkv_jax.models as models

  def no_load(*a, **k):
    raise ValueError("stopped before the model load")
  monkeypatch.setattr(models, "load", no_load)
  rc = main(["serve", *args, "--no-compile-cache"])
  return rc, " ".join(capsys.readouterr().err.split())  # (the console wraps long lines)


def test_serve_checks_host_and_port_by_binding_before_the_model_loads(monkeypatch, capsys):
  """A bad --host (or a port in use) used to fail only after the model loaded, without naming the flag."""
  import socket
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    rc, err = _serve_flags_checked(monkeypatch, capsys, ["--port", str(port)])
    assert rc == 2 and f"--host='127.0.0.1' --port={port}: cannot bind 127.0.0.1 port {port}" in err, err
  rc, err = _serve_flags_checked(monkeypatch, capsys, ["--host", "999.1.1.1", "--port", str(port)])
  assert rc == 2 and "--host='999.1.1.1'" in err, err
  for host in ("127.0.0.1", "localhost", ""):  # "": every interface, as uvicorn takes it
    rc, err = _serve_flags_checked(monkeypatch, capsys, ["--host", host, "--port", "0"])
    assert rc == 1 and "stopped before the model load" in err and "--host" not in err, (host, err)


def test_serve_creates_the_spill_dir_and_refuses_one_it_cannot_write(monkeypatch, capsys, tmp_path):
  spill = tmp_path / "a" / "spill"
  rc, err = _serve_flags_checked(monkeypatch, capsys, ["--history-spill-dir", str(spill), "--port", "0"])
  assert rc == 1 and "stopped before the model load" in err and spill.is_dir(), err
  (tmp_path / "file").write_text("x")
  for bad, shown in ((tmp_path / "file", "exists and is not a folder"), (tmp_path / "file" / "sub", "cannot use")):
    rc, err = _serve_flags_checked(monkeypatch, capsys, ["--history-spill-dir", str(bad), "--port", "0"])
    assert rc == 2 and f"--history-spill-dir={str(bad)!r}" in err and shown in err, err


def test_a_bad_flag_exits_fast_in_a_fresh_process():
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, "-m", "rocketkv_jax.serving.cli", "generate", "--prompt", "x",
                      "--token-budget", "8"], capture_output=True, text=True, timeout=60)
  assert time.perf_counter() - t0 < 10
  assert p.returncode == 2 and "--token-budget: must be >= 16" in p.stderr


def test_dtype_spellings():
  for spellings, name in ((("float32", "f32", "FP32"), "float32"), (("bfloat16", "bf16"), "bfloat16"),
                          (("float16", "f16", "fp16"), "float16")):
    assert all(parse_dtype(s) == name for s in spellings)
  assert build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "bf16"]).dtype == "bfloat16"


def test_help_states_the_defaults_used(capsys):
  p = build_parser()
  for cmd, default in (("generate", 64), ("demo", 24), ("serve", 256)):
    args = p.parse_args([cmd] + (["--prompt", "x"] if cmd == "generate" else []))
    assert args.max_new_tokens == default
    with pytest.raises(SystemExit):
      p.parse_args([cmd, "--help"])
    assert f"(default {default})" in " ".join(capsys.readouterr().out.split())
  from rocketkv_jax.models.demo import DEFAULT_MAX_NEW_TOKENS
  assert DEFAULT_MAX_NEW_TOKENS == 24


def test_the_serving_log_prints_each_line_once():
  """Every server log line used to print twice: rich's, then plain text from the root logger's stderr handler that
  absl's first log call installs (`logging.basicConfig()`; orbax logs while the weight cache loads). A stand-in
  for that root handler here; the conftest fixture puts the serving logger back."""
  import io
  import logging

  from rich.console import Console

  from rocketkv_jax.serving.cli import serving_log_to
  root_text, console_text = io.StringIO(), io.StringIO()
  root_handler = logging.StreamHandler(root_text)
  logging.root.addHandler(root_handler)
  try:
    serving_log_to(Console(file=console_text, width=200))
    logging.getLogger("rocketkv_jax.serving").info("cmpl-1: prompt 2 tokens")
  finally:
    logging.root.removeHandler(root_handler)
  assert console_text.getvalue().count("cmpl-1: prompt 2 tokens") == 1 and root_text.getvalue() == ""


def test_version(capsys):
  from importlib.metadata import version
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0 and capsys.readouterr().out.strip() == f"rocketkv {version('rocketkv-jax')}"


def test_persistent_compile_cache_gives_the_same_tokens(tiny_gguf, tmp_path):
  """Two fresh processes: the first fills <cache>/xla, the second reads it; the tokens are the same (sampled, so
  the sampling path is covered too)."""
  def run(cache, *extra):
    p = subprocess.run([sys.executable, "-m", "rocketkv_jax.serving.cli", "generate", "--model", tiny_gguf,
                        "--method", "rocketkv", "--token-budget", "16", "--max-new-tokens", "6", "--temperature",
                        "0.8", "--seed", "3", "--prompt", PROMPT * 4, "--json", "--cache", str(cache), *extra],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
  first = run(tmp_path / "c")
  assert os.listdir(tmp_path / "c" / "xla")
  second = run(tmp_path / "c")
  assert second["token_ids"] == first["token_ids"] and second["text"] == first["text"]


def test_no_compile_cache_writes_no_cache(tiny_gguf, tmp_path, capsys):
  assert main(["generate", "--model", tiny_gguf, "--max-new-tokens", "2", "--prompt", PROMPT, "--cache",
               str(tmp_path), "--no-compile-cache"]) == 0
  assert not os.path.exists(tmp_path / "xla")


def test_a_sessions_dir_in_use_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
  from rocketkv_jax.serving.sessions import SessionsDir
  import rocketkv_jax.models as models
  monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
  held = SessionsDir(str(tmp_path / "s"))  # another server's, as far as the lock can tell
  try:
    assert main(["serve", "--sessions-dir", str(tmp_path / "s"), "--no-compile-cache"]) == 2
  finally:
    held.close()
  err = capsys.readouterr().err
  assert f"{tmp_path / 's'} is in use by another server (pid {os.getpid()})" in " ".join(err.split())


class _Serve:
  """A `rocketkv serve` process on the tiny GGUF with --sessions-dir; `up()` waits for its start-up to end."""

  def __init__(self, gguf, folder):
    import threading
    self.cmd = [sys.executable, "-m", "rocketkv_jax.serving.cli", "serve", "--model", gguf, "--port", "0",
                "--no-warmup", "--no-cache", "--no-compile-cache", "--sessions-dir", str(folder),
                "--max-prompt-tokens", "64", "--max-new-tokens", "8", "--log-level", "info"]
    self.env = dict(os.environ, COLUMNS="200")
    self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                 env=self.env)
    self.lines, self._up = [], threading.Event()
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.proc.stderr:
      self.lines.append(line)
      if "Application startup complete" in line:
        self._up.set()

  def up(self) -> bool:
    t0 = time.monotonic()
    while not self._up.is_set() and self.proc.poll() is None and time.monotonic() - t0 < 180:
      time.sleep(0.05)
    return self._up.is_set()

  def stop(self) -> int:
    import signal
    self.proc.send_signal(signal.SIGTERM)
    return self.wait()

  def wait(self) -> int:
    try:
      rc = self.proc.wait(120)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
    self.reader.join(10)
    return rc

  def text(self) -> str:
    return " ".join("".join(self.lines).split())


def test_serve_exits_non_zero_when_the_sessions_cannot_be_saved(tiny_gguf, tmp_path):
  """A real `rocketkv serve` process: a second one on its sessions folder is refused (status 2, naming the
  first one's pid); the first one's save at shutdown fails (its pointer file cannot be replaced) and the
  process exits 1, not 0."""
  folder = tmp_path / "s"
  first = _Serve(tiny_gguf, folder)
  try:
    assert first.up(), first.text()
    second = subprocess.run(first.cmd, capture_output=True, text=True, timeout=120, env=first.env)
    assert second.returncode == 2
    assert f"in use by another server (pid {first.proc.pid})" in " ".join(second.stderr.split())
    (folder / "CURRENT").mkdir()  # the save's last step, replacing the pointer, now fails
  finally:
    rc = first.stop()
  assert rc == 1, first.text()
  assert "FAILED to save" in first.text() and "IsADirectoryError" in first.text()
  assert "the sessions could not be saved" in first.text()


def test_serve_refuses_an_edited_sessions_file_at_start_up(tiny_gguf, tmp_path):
  """A saved session whose segment table was edited: the next server names the file and the field, does not
  start, and exits 1."""
  folder = tmp_path / "s"
  first = _Serve(tiny_gguf, folder)
  try:
    assert first.up(), first.text()
  finally:
    assert first.stop() == 0, first.text()
  meta = folder / (folder / "CURRENT").read_text().strip() / "meta.json"
  body = json.loads(meta.read_text())
  body["meta"]["segments"].append(dict(parent=None, start=0))  # a segment with no arrays
  meta.write_text(json.dumps(body))
  again = _Serve(tiny_gguf, folder)
  assert again.wait() == 1, again.text()
  assert f"{meta}: meta.segments lists 1 segments but the arrays hold" in again.text()
  assert "the server did not start" in again.text()
