"""How far a GPU's FP8 store may be from the XLA reference's (shared by the FP8 kernel and method tests)."""
import jax.numpy as jnp


def one_fp8_step(dtype) -> dict:
  """`assert_allclose` tolerances of one FP8 rounding step of `dtype`: a GPU's division may round a stored value to
  the neighbouring step, 2^-mantissa bits apart (e4m3fn 1/8, e5m2 1/4), or one subnormal step near zero (centred
  keys hold many small values)."""
  return dict(rtol=1.04 * 2.0 ** -jnp.finfo(dtype).nmant, atol=float(jnp.finfo(dtype).smallest_subnormal))
