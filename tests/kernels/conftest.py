"""Shared shape table and helpers for the kernel tests (the benchmark times the same ops)."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# One small table for interpret mode on CPU: H in {64, 128}, G in {1, 4, 8} (and a non-power-of-two
# 3), f32 and bf16, odd S that is not a multiple of any block.
CASES = [
    pytest.param(dict(B=2, K=2, G=1, H=64, S=37, dtype=jnp.float32), id="B2K2G1H64S37-f32"),
    pytest.param(dict(B=3, K=1, G=4, H=128, S=100, dtype=jnp.bfloat16), id="B3K1G4H128S100-bf16"),
    pytest.param(dict(B=2, K=2, G=8, H=64, S=67, dtype=jnp.bfloat16), id="B2K2G8H64S67-bf16"),
    pytest.param(dict(B=2, K=1, G=3, H=128, S=130, dtype=jnp.float32), id="B2K1G3H128S130-f32"),
]

# Larger shapes for the GPU runs (compiled Triton kernels).
GPU_CASES = [
    pytest.param(dict(B=1, K=8, G=4, H=128, S=4101, dtype=jnp.bfloat16), id="B1K8G4H128S4101-bf16"),
    pytest.param(dict(B=4, K=2, G=8, H=64, S=1031, dtype=jnp.bfloat16), id="B4K2G8H64S1031-bf16"),
    pytest.param(dict(B=3, K=2, G=1, H=128, S=777, dtype=jnp.float32), id="B3K2G1H128S777-f32"),
    pytest.param(dict(B=256, K=1, G=2, H=64, S=70, dtype=jnp.float32), id="B256K1G2H64S70-f32"),
    pytest.param(dict(B=2, K=1, G=3, H=128, S=130, dtype=jnp.bfloat16), id="B2K1G3H128S130-bf16"),
]

# f32 may run through TF32-free dots (interpret) but allow for it; bf16 inputs round.
TOL = {jnp.dtype(jnp.float32): 1e-3, jnp.dtype(jnp.bfloat16): 1e-2}


def tol(dtype) -> float:
  return TOL[jnp.dtype(dtype)]


def rel_err(out, ref, where=None) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  if where is not None:
    out, ref = out[where], ref[where]
  assert np.isfinite(out).all(), "output has non-finite values"
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def ragged_lengths(rng: np.random.Generator, B: int, S: int) -> jnp.ndarray:
  """Lengths in [1, S] with the extremes S and 1 and odd values among them."""
  base = [S, 1, S // 2 | 1, max(1, S - 2)]
  lengths = [base[i] if i < len(base) else int(rng.integers(1, S + 1)) for i in range(B)]
  return jnp.asarray(lengths, jnp.int32)


def poison_past_length(x_BKSX, length_B):
  """NaN in every slot at or past length (the cache's junk)."""
  S = x_BKSX.shape[2]
  junk = jnp.arange(S)[None, None, :, None] >= length_B[:, None, None, None]
  return jnp.where(junk, jnp.nan, x_BKSX)


@contextlib.contextmanager
def abstract_h200():
  """Trace for an abstract NVIDIA H200 so `.lower(lowering_platforms=("cuda",))` runs the real
  Pallas -> Triton lowering on a CPU-only machine (PLATFORM.md)."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", platform="gpu", num_cores=132))
  with use_abstract_mesh(mesh):
    yield


def lower_for_h200(fn, *args) -> str:
  with abstract_h200():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "__gpu$xla.gpu.triton" in text, "no Triton custom call in the lowered module"
  return text


def needs_gpu():
  if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("no GPU")


def assert_near_ties_only(out, ref, scores, length, *, page_size: int, k: int) -> None:
  """Index lists out / ref [B, K, M] (the first min(k, M, length) entries chosen slots) may differ only on
  slots whose page score ties (within float32 rounding) the lowest score the reference took: the kernels sum
  in another order than XLA."""
  B, K, M = out.shape
  for b in range(B):
    n = min(k, M, int(length[b]))
    for h in range(K):
      mine, theirs = set(out[b, h, :n].tolist()), set(ref[b, h, :n].tolist())
      threshold = min(scores[b, h, t // page_size] for t in theirs) if theirs else 0.0
      for slot in mine ^ theirs:
        assert np.isclose(scores[b, h, slot // page_size], threshold, rtol=1e-5), \
            f"(b={b}, h={h}) slot {slot} differs from the reference and is no near tie"
