"""Property test of the public core API: random shapes, lengths, budgets, methods, dtypes and knobs. Every input
either gives the NumPy reference's answer (tests/core/reference.py: prefill_compress, then a few decode_step)
or raises a ValueError naming the offending value; an input the test knows to be bad must not pass silently."""
import dataclasses

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rocketkv_jax as rk
from tests.core.reference import RefSequence
from tests.helpers.data import normal

FLOATS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPES = [*FLOATS, "int32"]
# Knobs a user may override: (sane values, values that include invalid ones: 0, an even kernel, an unknown dtype).
KNOBS = {
    "window_size": (st.integers(1, 12), st.integers(0, 40)),
    "kernel_size": (st.sampled_from([1, 3, 7]), st.sampled_from([0, 2, 8])),
    "sink_tokens": (st.integers(0, 4), st.integers(-1, 40)),
    "recent": (st.integers(1, 15), st.integers(-1, 60)),
    "topk": (st.integers(1, 20), st.integers(-1, 0)),
    "page_size": (st.integers(1, 5), st.integers(-1, 0)),
    "topr": (st.integers(1, 4), st.integers(0, 9)),
    "kt_cache_dtype": (st.sampled_from([None, "float32"]), st.sampled_from(["int8", "float64"])),
}
# What a draw may get wrong (at most a few per example, so that most examples run the whole way).
WILD = ("budget", "prompt_len", "heads", "lengths", "dtype", *KNOBS)
# What an error message may name: an input, a knob, or a derived value the message explains.
NAMES = ("token_budget", "prompt_len", "max_new_tokens", "head_dim", "max_len", "lengths", "T=", "N=", "K=", "H=",
         "dtype", "capacity", "prompt_budget", *KNOBS)


@st.composite
def cases(draw):
  wild = draw(st.sets(st.sampled_from(WILD), max_size=3))
  pick = lambda name, sane, bad: draw(bad if name in wild else sane)
  method = draw(st.sampled_from(rk.METHODS))
  b, t = draw(st.integers(1, 2)), draw(st.one_of(st.integers(1, 40), st.integers(17, 40)))
  n_kv, h = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
  n = pick("heads", st.integers(1, 2).map(lambda g: g * n_kv), st.integers(0, 5))  # N % K == 0 or not
  lengths = pick("lengths", st.lists(st.one_of(st.just(t), st.integers(1, t)), min_size=b, max_size=b),
                 st.lists(st.integers(-3, t + 3), min_size=b, max_size=b))
  fields = {f.name for f in dataclasses.fields(rk.get_method(method))}
  knobs = draw(st.fixed_dictionaries({}, optional={
      k: (bad if k in wild else sane) for k, (sane, bad) in KNOBS.items() if k in fields}))
  return dict(method=method, b=b, t=t, n=n, n_kv=n_kv, h=h, lengths=lengths, knobs=knobs,
              budget=pick("budget", st.sampled_from([16, 20, 24, 32, 48]), st.sampled_from([-1, 0, 8, 15])),
              prompt_len=pick("prompt_len", st.integers(t, t + 4), st.integers(-1, t + 4)),
              new=draw(st.integers(0, 3)), steps=draw(st.integers(0, 3)),
              dtype=pick("dtype", st.sampled_from(list(FLOATS)), st.sampled_from(DTYPES)),
              seed=draw(st.integers(0, 2**16)))


def _named(err: ValueError) -> None:
  msg = str(err)
  assert "=" in msg and any(name in msg for name in NAMES), f"the error names no value: {msg}"


def _arrays(rng, shape, dtype):
  if dtype == "int32":
    return jnp.asarray(rng.integers(-3, 4, shape), jnp.int32)
  return normal(rng, shape, FLOATS[dtype])


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_public_api_answers_or_names_the_value(c):
  try:
    cfg = rk.make_config(c["method"], token_budget=c["budget"], prompt_len=c["prompt_len"],
                         max_new_tokens=c["new"], head_dim=c["h"], impl="xla", **c["knobs"])
  except ValueError as e:
    _named(e)
    event("make_config refused")
    return
  b, t, n, n_kv, h, dtype = c["b"], c["t"], c["n"], c["n_kv"], c["h"], c["dtype"]
  rng = np.random.default_rng(c["seed"])
  q, k, v = (_arrays(rng, s, dtype) for s in ((b, t, n, h), (b, t, n_kv, h), (b, t, n_kv, h)))
  if max(c["lengths"]) > getattr(cfg, "prompt_budget", cfg.capacity):
    event("prefill evicts")
  lengths = np.asarray(c["lengths"])
  bad = [dtype == "int32", n < 1 or n % n_kv != 0, (lengths < 1).any() or (lengths > t).any(),
         hasattr(cfg, "max_len") and t > cfg.capacity, getattr(cfg, "topr", 0) > h]
  try:
    cache = rk.prefill_compress(q, k, v, lengths, config=cfg)
  except ValueError as e:
    _named(e)
    assert any(bad), f"a valid input was refused: {e}"
    event("prefill_compress refused")
    return
  assert not any(bad), f"a bad input was accepted: {bad}"

  refs = [RefSequence(c["method"], cfg, q[i], k[i], v[i], int(lengths[i])) for i in range(b)]
  tol = 2e-4 if dtype == "float32" else 3e-2
  for step in range(c["steps"]):
    qs, ks, vs = (_arrays(rng, s, dtype) for s in ((b, n, h), (b, n_kv, h), (b, n_kv, h)))
    full = not cfg.evicts and max(len(r.keep[0]) for r in refs) >= cfg.capacity
    try:
      out, cache = rk.decode_step(cache, qs, ks, vs, config=cfg)
    except ValueError as e:
      assert full and f"capacity={cfg.capacity}" in str(e), f"step {step}: {e}"
      event("decode_step refused at capacity")
      return
    assert not full, f"step {step}: a step past capacity was accepted"
    assert out.shape == (b, n, h) and out.dtype == FLOATS[dtype]
    event(f"decoded, {dtype}")
    for i, ref in enumerate(refs):
      want = ref.step(qs[i], ks[i], vs[i])
      np.testing.assert_allclose(np.asarray(out[i], np.float64), want, rtol=tol, atol=tol,
                                 err_msg=f"{cfg} sequence {i} step {step}")
