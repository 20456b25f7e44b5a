"""The decode step's fused kernels (residual add + RMSNorm, q/k/v split + RoPE) against the XLA path: the
kernel references (which the decode step's XLA path runs, through `rocketkv_jax.ops`) compute exactly the
model's own prefill expressions (`rms_norm`, `rope_heads`), eagerly and under jit, and a tiny random Llama
decodes the same with impl="interpret" as with impl="xla"."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax import make_config
from rocketkv_jax.kernels.qkv_rope import qkv_rope_reference
from rocketkv_jax.kernels.rms_norm import add_rms_norm_reference
from rocketkv_jax.models import decode, prefill
from rocketkv_jax.models.llama import add_norm, rms_norm, rope_heads, rope_inv_freq
from rocketkv_jax.models.params import from_params

from .conftest import tiny_config, tiny_params
from tests.helpers.data import keys, normal


def _model_add_norm(x, delta, w, eps):
  h = x + delta
  return h, rms_norm(h, w, eps)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_references_are_the_model_expressions(dtype, jit):
  cfg = tiny_config(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                  ("original_max_position_embeddings", 64), ("rope_type", "llama3")))
  ks = keys(0, 4)
  x = normal(ks[0], (3, cfg.dim)).astype(dtype)
  delta = normal(ks[1], (3, cfg.dim)).astype(dtype)
  w = (1 + 0.1 * normal(ks[2], (cfg.dim,))).astype(dtype)
  maybe_jit = jax.jit if jit else (lambda f: f)
  eps = cfg.norm_eps
  want = maybe_jit(lambda x, d, w: _model_add_norm(x, d, w, eps))(x, delta, w)
  for got in (maybe_jit(lambda x, d, w: add_rms_norm_reference(x, d, w, eps=eps))(x, delta, w),
              maybe_jit(lambda x, d, w: add_norm(x, d, w, eps))(x, delta, w),  # what decode_layer runs
              maybe_jit(lambda x, d, w: add_norm(x[:, None], d[:, None], w, eps))(x, delta, w)):
    for g, wt in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g, np.float32).reshape(wt.shape), np.asarray(wt, np.float32))
  N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  qkv = normal(ks[3], (3, (N + 2 * K) * H)).astype(dtype)
  pos = jnp.array([0, 17, 5000], jnp.int32)
  inv = jnp.asarray(rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling), jnp.float32)
  got = maybe_jit(lambda a, p: qkv_rope_reference(a, p, inv, n_heads=N, n_kv_heads=K, head_dim=H))(qkv, pos)
  want = maybe_jit(lambda a, p: [r[:, 0] for r in rope_heads(cfg, a[:, None], p[:, None])])(qkv, pos)
  for g, wt in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(wt, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_interpret_decode_equals_xla(dtype):
  """Ragged batch, three decode steps fed greedily; bf16 logits may differ by rounding (XLA may skip the
  rounding of the residual add inside a fusion, the kernel rounds it as written)."""
  cfg = tiny_config()
  model = from_params(cfg, tiny_params(cfg), dtype=dtype)
  toks = np.random.default_rng(0).integers(3, 128, (3, 20)).astype(np.int32)
  lengths = np.array([20, 13, 7])
  xla = make_config("full", token_budget=64, prompt_len=20, max_new_tokens=4, head_dim=cfg.head_dim, impl="xla")
  runs = {}
  for impl in ("xla", "interpret"):
    config = dataclasses.replace(xla, impl=impl)
    logits, caches = prefill(model, toks, lengths, config)
    tok = np.asarray(logits).argmax(-1)
    steps = []
    for _ in range(3):
      logits, caches = decode(model, tok, caches, config)
      steps.append(np.asarray(logits, np.float32))
      tok = steps[-1].argmax(-1)
    runs[impl] = np.stack(steps)
  if dtype == jnp.float32:
    np.testing.assert_allclose(runs["interpret"], runs["xla"], atol=1e-4, rtol=1e-4)
  else:
    err = np.linalg.norm(runs["interpret"] - runs["xla"]) / np.linalg.norm(runs["xla"])
    assert err < 1e-2, err
  np.testing.assert_array_equal(runs["interpret"].argmax(-1), runs["xla"].argmax(-1))
