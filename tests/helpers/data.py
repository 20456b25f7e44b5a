"""Random test inputs drawn with NumPy. Each `jax.random` draw, and each eager `jnp` op, on a shape not seen before
compiles an XLA program (the suite's `jax.random.normal` calls compiled 290 programs, 32 s on 2 cores); a NumPy
draw handed to `jnp.asarray` compiles none. `keys(seed, n)` / `key(seed)` stand where `jax.random.split(PRNGKey(seed),
n)` / `PRNGKey(seed)` stood: independent generators, one per draw."""
import jax.numpy as jnp
import numpy as np


def keys(seed: int, n: int) -> list:
  """n independent generators from one seed."""
  return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n)]


def key(seed: int) -> np.random.Generator:
  return np.random.default_rng(seed)


def normal(rng: np.random.Generator, shape, dtype=jnp.float32) -> jnp.ndarray:
  """Standard normal values of `dtype` (drawn in float32, then rounded), on the default device."""
  return jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))


def uniform(rng: np.random.Generator, shape, dtype=jnp.float32) -> jnp.ndarray:
  return jnp.asarray(rng.random(shape, np.float32).astype(dtype))


def randint(rng: np.random.Generator, shape, low: int, high: int, dtype=jnp.int32) -> jnp.ndarray:
  return jnp.asarray(rng.integers(low, high, shape).astype(dtype))
