"""RocketKV's decode step visits each room once (issue 38, docs/ARCHITECTURE.md "The way a token travels"):
api -> method (the config, methods/base.py, hands the step to its selector, methods/hsa.py's `HSASelector`) ->
ops -> kernel, never back into a core module it has already left on the way down (as the former mixin chain did:
methods/hsa.py -> methods/base.py -> methods/hsa.py)."""
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import rocketkv_jax as rk
from tests.helpers.data import keys, normal

CORE = pathlib.Path(rk.__file__).resolve().parent  # rocketkv_jax/: api, methods, stage2, ops, cache, ...
N, K, H, T = 4, 2, 16, 40


def _core_stack(frame):
  """The core modules on the stack from the outermost down, other frames (JAX, kernels) left out and consecutive
  frames of one module merged."""
  files = []
  while frame is not None:
    name = frame.f_code.co_filename
    if name.startswith(str(CORE)):
      rel = str(pathlib.Path(name).relative_to(CORE))
      if not files or files[-1] != rel:
        files.append(rel)
    frame = frame.f_back
  return files[::-1]


def _reentries(fn):
  """Every stack, during fn(), on which a core module appears twice with another core module between."""
  found = set()

  def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(str(CORE)):
      stack = _core_stack(frame)
      if len(set(stack)) != len(stack):
        found.add(" -> ".join(stack))

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return sorted(found)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("method", ["rocketkv", "hsa"])
def test_decode_visits_each_room_once(method, impl):
  config = rk.make_config(method, token_budget=32, prompt_len=T, max_new_tokens=4, head_dim=H, impl=impl)
  ks = keys(0, 6)
  q, k, v = (normal(x, (1, T, n, H)) for x, n in zip(ks[:3], (N, K, K)))
  cache = rk.prefill_compress(q, k, v, jnp.array([T], jnp.int32), config=config)
  q1, k1, v1 = (normal(x, (1, n, H)) for x, n in zip(ks[3:], (N, K, K)))
  jax.clear_caches()  # the step is traced (its Python runs) inside the profile
  paths = _reentries(lambda: jax.block_until_ready(rk.decode_step(cache, q1, k1, v1, config=config)))
  assert not paths, "core modules entered twice on one stack:\n" + "\n".join(paths)
