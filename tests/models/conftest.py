"""Shared fixtures for the model tests (the embedded SmolLM2 is in tests/conftest.py):
the HF-transformers reference fixture, and a tiny random Llama."""

import json
import os
import warnings

import numpy as np
import pytest

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_reference.npz")


@pytest.fixture(scope="session")
def reference():
  f = np.load(FIXTURE)
  meta = json.loads(bytes(f["meta_json"]).decode())
  return f, meta


def tiny_config(**kw):
  from rocketkv_jax.models import LlamaConfig
  base = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
              rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, max_len=512, bos_id=1, eos_id=2)
  base.update(kw)
  return LlamaConfig(**base)


def tiny_params(cfg, seed=0, scale=0.2):
  """Random weights in the loader layout (separate wq/wk/wv, w_gate/w_up; kernels [in, out]), which
  from_params fuses; a large scale makes greedy decisive."""
  rng = np.random.default_rng(seed)
  D, N, K, H, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
  r = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
  p = {"embed": r(V, D) * 5, "norm": 1 + r(D)}
  if not cfg.tie_embeddings:
    p["lm_head"] = r(D, V)
  for i in range(cfg.n_layers):
    lp = f"layers/{i}/"
    p.update({lp + "attn_norm": 1 + r(D), lp + "wq": r(D, N * H), lp + "wk": r(D, K * H), lp + "wv": r(D, K * H),
              lp + "wo": r(N * H, D), lp + "mlp_norm": 1 + r(D), lp + "w_gate": r(D, F), lp + "w_up": r(D, F),
              lp + "w_down": r(F, D)})
  return p


@pytest.fixture(scope="session")
def tiny_model():
  from rocketkv_jax.models.params import from_params
  cfg = tiny_config()
  return from_params(cfg, tiny_params(cfg))
