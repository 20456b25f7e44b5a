"""Small helpers shared by the Pallas kernels (no dependency on the rocketkv_jax core)."""
from __future__ import annotations

import jax.numpy as jnp

# Scores of masked entries before the softmax. A large finite negative keeps exp() at exactly 0
# without producing inf - inf = NaN in the online-softmax correction.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's dot needs every dimension >= 16.
MIN_DOT_DIM = 16

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_dtype(name: str, dtype, allowed) -> None:
  if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in allowed):
    raise ValueError(f"{name}.dtype={jnp.dtype(dtype)} must be one of {[str(jnp.dtype(d)) for d in allowed]}")


def dot_precision(dtype):
  """float32 operands: full precision (no TF32); bf16: the native tensor-core path."""
  return "highest" if jnp.dtype(dtype) == jnp.float32 else None
