"""Meshes as a JAX user builds them (`jax.make_mesh`, explicit or auto axes; `jax.sharding.Mesh`; any axis
names, mapped with data_axis= / model_axis=) through `load`, `generate` and the serving `Engine`: sharded equals
unsharded on the tiny Llama, Qwen2 and Mistral checkpoints over 8 fake CPU devices (a fresh process:
`tests/models/jax_mesh_run.py`), and the `rocketkv serve --mesh DP,TP` flag."""
import json
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from rocketkv_jax.models.sharding import DATA, MODEL, normalize_mesh, resolve_mesh


def test_user_meshes_equal_unsharded():
  here = os.path.dirname(os.path.abspath(__file__))
  r = subprocess.run([sys.executable, os.path.join(here, "jax_mesh_run.py")], capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert len(result) == 18 and all(result.values()), {k: v for k, v in result.items() if not v}


def test_normalize_mesh_one_device():
  dev = np.array(jax.devices()[:1])
  m = normalize_mesh(jax.make_mesh((1, 1), ("data", "model")))
  assert m.axis_names == (DATA, MODEL) and all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  assert normalize_mesh(m) is m and normalize_mesh(None) is None and resolve_mesh(None) is None
  # axes of size 1 that are neither need no mapping; a default name the mesh lacks is an axis of size 1
  assert normalize_mesh(jax.sharding.Mesh(dev.reshape(1, 1, 1), ("x", "batch", "y")), data_axis="batch") == m
  with jax.set_mesh(jax.make_mesh((1, 1), ("data", "model"))):
    assert resolve_mesh(None) == m
  with pytest.raises(ValueError, match="data_axis=3 must be an axis name"):
    normalize_mesh(m, data_axis=3)
  with pytest.raises(ValueError, match="is not a jax.sharding.Mesh"):
    normalize_mesh("4,2")


def test_serve_mesh_flag_is_checked_before_the_model_loads(monkeypatch, capsys):
  import rocketkv_jax.models as models
  from rocketkv_jax.serving.cli import main

  def no_load(*a, **k):
    raise AssertionError("the model was loaded")
  monkeypatch.setattr(models, "load", no_load)
  for bad, shown in ((["--mesh", "4"], "'4' must be DP,TP"), (["--mesh", "0,2"], "'0,2' must be DP,TP"),
                     (["--mesh", "16,1"], "--mesh=16,1: a mesh of dp=16 x tp=1 needs 16 devices; 1 are visible")):
    try:
      rc = main(["serve", *bad, "--port", "0", "--no-compile-cache"])
    except SystemExit as e:  # argparse's usage errors
      rc = e.code
    assert rc == 2 and shown in " ".join(capsys.readouterr().err.split()), bad


def test_serve_on_a_mesh_answers_as_unsharded():
  """`rocketkv serve --mesh 4,2` over 8 fake CPU devices (history on: the second request reuses the first's K/V)
  answers greedy completions with the tokens `generate` gives unsharded."""
  import re
  import signal
  import threading
  import time
  import urllib.request

  from rocketkv_jax.models import generate, load
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.path.join(root, "tests", "models", "data", "hf_tiny", "llama")
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
             COLUMNS="200")
  cmd = [sys.executable, "-m", "rocketkv_jax.serving.cli", "serve", "--model", path, "--port", "0", "--no-warmup",
         "--no-cache", "--no-compile-cache", "--mesh", "4,2", "--token-budget", "32", "--max-prompt-tokens", "256",
         "--max-new-tokens", "16"]
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=root)
  lines, port = [], []

  def read():
    for line in proc.stderr:
      lines.append(line)
      m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
      if m:
        port.append(int(m.group(1)))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    t0 = time.monotonic()
    while not port and proc.poll() is None and time.monotonic() - t0 < 180:
      time.sleep(0.05)
    assert port, "".join(lines)[-3000:]
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 190, 150).tolist()
    prompts = [prompt, prompt + rng.integers(3, 190, 20).tolist()]  # the second extends the first: history

    def complete(ids):
      body = json.dumps({"model": path, "prompt": ids, "max_tokens": 8, "temperature": 0}).encode()
      req = urllib.request.Request(f"http://127.0.0.1:{port[0]}/v1/completions", body,
                                   {"Content-Type": "application/json"})
      with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]
    got = [complete(p) for p in prompts]
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(60)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    reader.join(10)
  model, tok = load(path)
  with warnings.catch_warnings():  # (the tiny prompts are not much longer than the budget)
    warnings.simplefilter("ignore", RuntimeWarning)
    want = [generate(model, tok, [p], method="rocketkv", token_budget=32, max_new_tokens=8, keep_whole=False,
                     temperature=0.0).texts[0] for p in prompts]
  assert got == want and all(got), ("".join(lines)[-3000:], got, want)
