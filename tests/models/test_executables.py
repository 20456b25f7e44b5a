"""The one compile cache (`models.executables.Executables`): a new shape, static value or key compiles once; the
same ones reuse the executable; compiles are counted and the limit drops the oldest."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax.models.executables import Executables


@functools.partial(jax.jit, static_argnames=("scale",))
def _scaled(x, *, scale):
  return x * scale


def test_compiles_once_per_shape_and_static_value():
  seen = []
  exes = Executables(on_compile=lambda lower_s, compile_s: seen.append((lower_s, compile_s)))
  a = exes.for_args(_scaled, jnp.ones((2, 3)), scale=2.0)
  assert a is exes.for_args(_scaled, jax.ShapeDtypeStruct((2, 3), jnp.float32), scale=2.0)  # shapes, not values
  assert a is exes.for_args(_scaled, np.zeros((2, 3), np.float32), scale=2.0)
  np.testing.assert_array_equal(a(jnp.ones((2, 3))), np.full((2, 3), 2.0))
  b = exes.for_args(_scaled, jnp.ones((4,)), scale=2.0)
  c = exes.for_args(_scaled, jnp.ones((2, 3)), scale=3.0)
  d = exes.for_args(_scaled, jnp.ones((2, 3), jnp.int32), scale=2)
  assert len({id(a), id(b), id(c), id(d)}) == 4 and len(exes) == 4
  assert exes.stats["compiles"] == 4 and len(seen) == 4 and exes.stats["compile_s"] > 0
  np.testing.assert_array_equal(c(jnp.ones((2, 3))), np.full((2, 3), 3.0))
  with pytest.raises(TypeError):  # an executable checks its arguments' shapes
    a(jnp.ones((4,)))


def test_own_keys_and_limit():
  exes = Executables(limit=2)
  lowered = []

  def lower(n):
    lowered.append(n)
    return _scaled.lower(jnp.ones((n,)), scale=1.0)

  for n in (1, 2, 1, 2):
    exes.get(("row", n), lambda: lower(n))
  assert lowered == [1, 2] and len(exes) == 2
  exes.get(("row", 3), lambda: lower(3))  # past the limit: the oldest half dropped
  assert len(exes) <= 2 and lowered == [1, 2, 3]
  exes.get(("row", 3), lambda: lower(3))
  assert lowered == [1, 2, 3]
