"""How many slots fit (`rocketkv serve --max-slots auto`, the serving benchmark's 'max'): the arithmetic, a slot's
bytes against an engine's real caches, the device's free memory as the engine reads it, and the CLI's errors."""

import os
import subprocess
import sys

import pytest

from rocketkv_jax.serving import Engine, EngineConfig
from rocketkv_jax.serving import engine as engine_mod
from rocketkv_jax.serving.engine import DeviceEngine, fit_slots, slots_for_memory
from tests.helpers.engine import KW, Tok, tiny_engine_model

GiB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_slots_for_memory():
  # (20 - 4 reserved - 2 spare slots) GiB, 10% kept aside: 12.6 -> 12 slots of 1 GiB
  assert slots_for_memory(GiB, 20 * GiB, 4 * GiB) == 12
  assert slots_for_memory(GiB, 20 * GiB, 0) == 16
  assert slots_for_memory(3 * GiB, 10 * GiB, 0) == 1
  with pytest.raises(ValueError, match=r"not one slot of 3.00 GiB fits: 8.00 GiB are free .* 1.00 GiB are reserved"):
    slots_for_memory(3 * GiB, 8 * GiB, GiB)


@pytest.mark.parametrize("method,dtype", [("rocketkv", None), ("full", None), ("rocketkv", "float8_e4m3fn")])
def test_slot_bytes_are_an_engines_bytes_per_slot(method, dtype):
  model = tiny_engine_model()
  kw = dict(KW, method=method, max_slots=3) | ({"kv_cache_dtype": dtype} if dtype else {})
  engine = Engine(model, Tok(), EngineConfig(**kw))
  logits, _ = engine.decode_state
  held = engine.stats()["kv_bytes_device"] + logits.nbytes
  assert held == 3 * engine.device.slot_bytes() > 0


def test_fit_slots_reads_the_free_memory(monkeypatch):
  model = tiny_engine_model()
  config = EngineConfig(**KW)
  per_slot = DeviceEngine(model, config).slot_bytes()
  seen = []

  def free(devices):
    seen.append(list(devices))
    return 1000 * per_slot

  monkeypatch.setattr(engine_mod, "device_free_bytes", free)
  assert fit_slots(model, config, reserve_bytes=100 * per_slot) == int((1000 - 100 - 2) * 0.9)
  # the history's device tier is reserved too; max_slots is ignored
  cfg2 = EngineConfig(**(KW | dict(max_slots=1, history_bytes=2**20, history_device_bytes=50 * per_slot)))
  assert fit_slots(model, cfg2, reserve_bytes=100 * per_slot) == int((1000 - 150 - 2) * 0.9)
  assert len(seen[0]) == 1


def test_fit_slots_without_memory_statistics_names_the_backend():
  # JAX's CPU backend gives no memory statistics
  with pytest.raises(ValueError, match=r"max_slots='auto' needs the device's memory statistics, which JAX's cpu"):
    fit_slots(tiny_engine_model(), EngineConfig(**KW), reserve_bytes=0)


def test_serve_max_slots_flag(capsys, monkeypatch):
  from rocketkv_jax import models
  from rocketkv_jax.serving.cli import main

  def no_load(*a, **k):
    raise AssertionError("the model must not load")
  monkeypatch.setattr(models, "load", no_load)
  rc = main(["serve", "--max-slots", "auto", "--port", "0", "--no-compile-cache"])
  err = " ".join(capsys.readouterr().err.split())
  assert rc == 2 and "--max-slots auto: max_slots='auto' needs the device's memory statistics, which JAX's cpu backend" in err, err
  for bad, shown in (("0", "must be >= 1, got '0'"), ("many", "'many' is not an integer")):
    with pytest.raises(SystemExit) as e:
      main(["serve", "--max-slots", bad])
    assert e.value.code == 2 and shown in capsys.readouterr().err


AUTO_RUN = """
import sys
from rocketkv_jax.serving import cli, engine, server
engine.device_free_bytes = lambda devices: 64 * 2**20  # the CPU backend reports no free memory
def run(self):  # stop where the server would start listening
  print("slots", self.config.app.state.runner.engine.config.max_slots)
  raise KeyboardInterrupt
server.UvicornServer.run = run
sys.exit(cli.main(sys.argv[1:]))
"""


def test_serve_max_slots_auto_sizes_the_engine():
  """The whole start-up with a device that reports free memory (patched), in a fresh process (the serve command
  sets up uvicorn's logging, which pytest's capture does not survive)."""
  p = subprocess.run([sys.executable, "-c", AUTO_RUN, "serve", "--model", "random:tiny", "--max-slots", "auto",
                      "--slot-reserve-gb", "0.01", "--max-prompt-tokens", "256", "--max-new-tokens", "16",
                      "--port", "0", "--no-warmup", "--no-compile-cache"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT)
  err = " ".join(p.stderr.split())
  assert p.returncode == 1 and "the server did not start" in err, err  # stopped by the patched run
  n = int(p.stdout.split()[-1])
  assert n > 1 and f"--max-slots auto: {n} slots fit beside the weights (0.01 GiB reserved)" in err, err
  # 256 + 16 tokens at budget 256: rocketkv would evict nothing and add KT pages, so each slot is full's 272 tokens
  assert f"{n} slots of 272 cache slots per KV head and layer" in err, err
  assert "every request kept whole (rocketkv at budget 256 would hold at least full's bytes" in err, err
