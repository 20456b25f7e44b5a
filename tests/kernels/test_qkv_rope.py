"""The fused head split + rotate-half RoPE of the decode token's q/k/v against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200, needs_gpu, rel_err
from rocketkv_jax.kernels import qkv_rope as qkv_rope_module
from rocketkv_jax.kernels.qkv_rope import heads_per_program, qkv_rope, qkv_rope_reference
from tests.helpers.data import key, normal

# N = 9, K = 3 (SmolLM2's heads) are not powers of two; H = 16 is the tiny test model's head dim.
CASES = [
    pytest.param(dict(B=1, N=4, K=2, H=16, dtype=jnp.float32), id="B1N4K2H16-f32"),
    pytest.param(dict(B=5, N=9, K=3, H=64, dtype=jnp.bfloat16), id="B5N9K3H64-bf16"),
    pytest.param(dict(B=3, N=8, K=2, H=128, dtype=jnp.float32), id="B3N8K2H128-f32"),
]

GPU_CASES = [
    pytest.param(dict(B=1, N=32, K=8, H=128, dtype=jnp.bfloat16), id="B1N32K8H128-bf16"),
    pytest.param(dict(B=8, N=32, K=8, H=128, dtype=jnp.bfloat16), id="B8N32K8H128-bf16"),
    pytest.param(dict(B=7, N=9, K=3, H=64, dtype=jnp.float32), id="B7N9K3H64-f32"),
]

# cos/sin and multiply-adds in float32 may round differently from XLA's; bf16 outputs then by one ulp.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}


def inv_freq(H, theta=500000.0, scaled=True):
  """Rotate-half inverse frequencies [H/2]; `scaled` divides the low ones by 8 (Llama-3-like)."""
  inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
  if scaled:
    inv = np.where(np.arange(H // 2) >= H // 4, inv / 8, inv)
  return jnp.asarray(inv, jnp.float32)


def positions(B, seed=0):
  """0, a long-context position, then random ones."""
  rng = np.random.default_rng(seed)
  base = [0, 131071, 7]
  return jnp.asarray([base[i] if i < len(base) else int(rng.integers(0, 40000)) for i in range(B)], jnp.int32)


def make_inputs(B, N, K, H, dtype, seed=0):
  qkv = normal(key(seed), (B, (N + 2 * K) * H)).astype(dtype)
  return qkv, positions(B, seed), inv_freq(H)


def check(B, N, K, H, dtype, interpret, seed=0):
  qkv, pos, inv = make_inputs(B, N, K, H, dtype, seed)
  kw = dict(n_heads=N, n_kv_heads=K, head_dim=H)
  out = qkv_rope(qkv, pos, inv, interpret=interpret, **kw)
  ref = qkv_rope_reference(qkv, pos, inv, **kw)
  assert [o.shape for o in out] == [(B, N, H), (B, K, H), (B, K, H)]
  for o, r in zip(out, ref):
    assert o.shape == r.shape and o.dtype == r.dtype == dtype
  for o, r in zip(out[:2], ref[:2]):
    assert rel_err(o.astype(jnp.float32), r.astype(jnp.float32)) < TOL[jnp.dtype(dtype)]
  np.testing.assert_array_equal(np.asarray(out[2], np.float32), np.asarray(ref[2], np.float32))
  # Position 0 rotates by nothing: q and k are the input heads exactly.
  heads = np.asarray(qkv.reshape(B, N + 2 * K, H), np.float32)
  at0 = np.asarray(pos) == 0
  np.testing.assert_array_equal(np.asarray(out[0], np.float32)[at0], heads[at0, :N])
  np.testing.assert_array_equal(np.asarray(out[1], np.float32)[at0], heads[at0, N:N + K])


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_interpret(case):
  check(**case, interpret=True)


@pytest.fixture
def group_heads(monkeypatch):
  """qkv_rope with grouped heads at every batch (traces cleared around: the bound is read at trace time)."""
  monkeypatch.setattr(qkv_rope_module, "GROUP_HEADS_MIN_ROWS", 1)
  qkv_rope.clear_cache()
  yield
  qkv_rope.clear_cache()


GROUPED_CASES = CASES + [pytest.param(dict(B=2, N=8, K=4, H=32, dtype=jnp.bfloat16), id="B2N8K4H32-bf16")]


@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_heads_match_reference_interpret(group_heads, case):
  """hp heads per program (2 for N=8, K=2; 4 for N=8, K=4; 1 for SmolLM2's 9 and 3): the same outputs."""
  check(**case, interpret=True)


def test_heads_per_program():
  bound = qkv_rope_module.GROUP_HEADS_MIN_ROWS
  assert heads_per_program(bound - 1, 32, 8) == 1
  assert heads_per_program(bound, 32, 8) == 8
  assert heads_per_program(bound, 9, 3) == 1
  assert heads_per_program(bound, 12, 6) == 2


def test_rotation_keeps_pair_norms_interpret():
  """Each (i, i + H/2) pair is rotated: its length is kept."""
  B, N, K, H = 4, 4, 2, 32
  qkv, pos, inv = make_inputs(B, N, K, H, jnp.float32, seed=3)
  q, k, _ = qkv_rope(qkv, pos, inv, n_heads=N, n_kv_heads=K, head_dim=H, interpret=True)
  heads = np.asarray(qkv.reshape(B, N + 2 * K, H))[:, :N + K]
  got = np.concatenate([np.asarray(q), np.asarray(k)], axis=1)
  pair_norm = lambda a: a[..., :H // 2] ** 2 + a[..., H // 2:] ** 2  # noqa: E731
  np.testing.assert_allclose(pair_norm(got), pair_norm(heads), rtol=1e-5, atol=1e-6)


def test_reference_is_rotate_half():
  """The reference equals the textbook rotate-half form x cos + rotate_half(x) sin."""
  B, N, K, H = 3, 2, 1, 16
  qkv, pos, inv = make_inputs(B, N, K, H, jnp.float32, seed=4)
  q, k, _ = qkv_rope_reference(qkv, pos, inv, n_heads=N, n_kv_heads=K, head_dim=H)
  heads = qkv.reshape(B, N + 2 * K, H)[:, :N + K]
  ang = pos.astype(jnp.float32)[:, None, None] * jnp.concatenate([inv, inv])[None, None, :]
  rot = jnp.concatenate([-heads[..., H // 2:], heads[..., :H // 2]], axis=-1)
  want = heads * jnp.cos(ang) + rot * jnp.sin(ang)
  np.testing.assert_allclose(np.asarray(jnp.concatenate([q, k], axis=1)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_rejects_bad_args():
  qkv = jnp.ones((2, 8 * 16))
  pos = jnp.zeros((2,), jnp.int32)
  inv = jnp.ones((8,), jnp.float32)
  kw = dict(n_heads=4, n_kv_heads=2, head_dim=16)
  with pytest.raises(ValueError, match="width 128 must be"):
    qkv_rope(qkv, pos, inv, n_heads=4, n_kv_heads=1, head_dim=16)
  with pytest.raises(ValueError, match="qkv_BX.shape"):
    qkv_rope(qkv.reshape(2, 8, 16), pos, inv, **kw)
  with pytest.raises(ValueError, match="head_dim=24"):
    qkv_rope(jnp.ones((2, 8 * 24)), pos, jnp.ones((12,)), n_heads=4, n_kv_heads=2, head_dim=24)
  with pytest.raises(ValueError, match="n_kv_heads=0"):
    qkv_rope(qkv, pos, inv, n_heads=4, n_kv_heads=0, head_dim=16)
  with pytest.raises(ValueError, match="qkv_BX.dtype"):
    qkv_rope(qkv.astype(jnp.int32), pos, inv, **kw)
  with pytest.raises(ValueError, match="pos_B.shape"):
    qkv_rope(qkv, jnp.zeros((3,), jnp.int32), inv, **kw)
  with pytest.raises(ValueError, match="pos_B.dtype"):
    qkv_rope(qkv, jnp.zeros((2,), jnp.float32), inv, **kw)
  with pytest.raises(ValueError, match="inv_freq_half.shape"):
    qkv_rope(qkv, pos, jnp.ones((16,), jnp.float32), **kw)
  with pytest.raises(ValueError, match="inv_freq_half.dtype"):
    qkv_rope(qkv, pos, inv.astype(jnp.bfloat16), **kw)


def _lower(B, N, K, H, dtype):
  sd = jax.ShapeDtypeStruct
  return lower_for_h200(lambda x, p, i: qkv_rope(x, p, i, n_heads=N, n_kv_heads=K, head_dim=H),
                        sd((B, (N + 2 * K) * H), dtype), sd((B,), jnp.int32), sd((H // 2,), jnp.float32))


@pytest.mark.parametrize("B", [1, 8, 391])
def test_lowers_for_h200_through_triton(B):
  assert "rocketkv_qkv_rope" in _lower(B, 32, 8, 128, jnp.bfloat16)


def test_lowers_for_h200_odd_heads_f32():
  assert "rocketkv_qkv_rope" in _lower(3, 9, 3, 64, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_matches_reference_gpu(case):
  needs_gpu()
  check(**case, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_grouped_heads_match_reference_gpu(group_heads, case):
  needs_gpu()
  check(**case, interpret=False)
