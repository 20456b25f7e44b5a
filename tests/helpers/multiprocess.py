"""The cases two processes run sharded (tests/models/multiprocess_run.py) and the test that started them
checks against one process unsharded: the meshes, the prompts, the tiny model and the tiny HF checkpoint."""

import os

import numpy as np

HF_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "data", "hf_tiny",
                       "llama")
CASES = (("rocketkv", 4, 2), ("rocketkv", 2, 4), ("full", 8, 1))  # (method, data, model)


def prompts():
  """The eight prompts every case generates from (lengths 10 to 190)."""
  rng = np.random.default_rng(0)
  return [rng.integers(3, 128, n).tolist() for n in (150, 90, 190, 20, 120, 64, 180, 10)]


def tiny_model():
  """The tiny random Llama with 4 query and 2 KV heads, so that a model axis of 2 or 4 splits them."""
  from rocketkv_jax.models.params import from_params
  from tests.models.conftest import tiny_config, tiny_params
  cfg = tiny_config(n_heads=4, n_kv_heads=2)
  return from_params(cfg, tiny_params(cfg))
