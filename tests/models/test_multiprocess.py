"""More than one process: two processes of 4 fake CPU devices each join with `jax.distributed.initialize`
(coordinator on 127.0.0.1) and run sharded prefill and decode (`generate` over a mesh of all 8 devices, on the tiny
model and on a checkpoint `load` streams onto that mesh) with the tokens one process gives unsharded. The test
starts both processes itself and always stops them."""
import json
import os
import socket
import subprocess
import sys
import time

from tests.helpers.multiprocess import CASES, HF_TINY, prompts, tiny_model

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  here = os.path.dirname(os.path.abspath(__file__))
  port = _free_port()
  # The children set their own device count; the suite's other XLA flags (conftest's) pass on.
  env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                            if "device_count" not in f))
  logs = [(open(tmp_path / f"out{i}", "w+"), open(tmp_path / f"err{i}", "w+")) for i in (0, 1)]
  procs = [subprocess.Popen([sys.executable, os.path.join(here, "multiprocess_run.py"), str(i), str(port)],
                            stdout=out, stderr=err, text=True, env=env) for i, (out, err) in enumerate(logs)]
  try:  # until both end, one fails (the other would wait for it) or 600 s pass
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and \
        not any(p.poll() not in (None, 0) for p in procs):
      time.sleep(0.2)
  finally:
    for p in procs:  # always stopped, whatever happened above
      if p.poll() is None:
        p.kill()
        p.wait()
  outs = []
  for out, err in logs:
    out.seek(0), err.seek(0)
    outs.append((out.read(), err.read()))
    out.close(), err.close()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}: rc {p.returncode}: {err[-3000:]}"
  results = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
             for out, _ in outs]
  assert results[0] == results[1]

  from rocketkv_jax.models import generate
  from tests.helpers.engine import Tok
  model = tiny_model()
  for method in {m for m, _, _ in CASES}:
    ref = generate(model, Tok(), prompts(), method=method, token_budget=32, max_new_tokens=8, impl="xla").token_ids
    for m, dp, tp in CASES:
      if m == method:
        assert results[0][f"{m} {dp}x{tp}"] == ref, (m, dp, tp)
  from rocketkv_jax.models import load
  model, tok = load(HF_TINY)
  ref = generate(model, tok, prompts(), method="rocketkv", token_budget=32, max_new_tokens=8, impl="xla").token_ids
  assert results[0]["load rocketkv 4x2"] == ref
