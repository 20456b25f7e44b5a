"""The decode budget (rocketkv_jax/decode_region.py): generated tokens in a region compacted when full, against the
NumPy reference model; off by default; a region that never fills changes nothing."""
import dataclasses

import numpy as np
import pytest

import rocketkv_jax as rk
from tests.core.reference import RefSequence
from tests.core.test_methods import K, random_inputs, poison_cache, random_steps, decode_steps, plan_config, run_steps

DB = dict(decode_budget=8, decode_buffer=4, decode_window=4)  # a region of 12: compacted every 4 steps after 12
N_STEPS = 21


@pytest.mark.parametrize("method,t,T,lengths", [("snapkv", 64, 200, [200, 141]), ("rocketkv", 64, 300, [300, 187]),
                                                ("rocketkv_plus", 64, 300, [300, 187])])
def test_compaction_matches_reference(method, t, T, lengths):
  """21 steps, three compactions: outputs and the kept keys equal the reference model's, the capacity stays
  prompt_budget + region whatever max_new_tokens is."""
  config = plan_config(method, t, T, 10_000, **DB)
  assert config.capacity == config.prompt_budget + 12
  q, k, v = random_inputs(11, len(lengths), T)
  steps = random_steps(11, len(lengths), N_STEPS)
  ours, cache = run_steps(config, q, k, v, lengths, steps)
  for b, L in enumerate(lengths):
    ref = RefSequence(method, config, q[b], k[b], v[b], L)
    want = np.stack([ref.step(*(s[i, b] for s in steps)) for i in range(N_STEPS)])
    np.testing.assert_allclose(ours[b], want, rtol=2e-4, atol=2e-4, err_msg=f"{method} sequence {b}")
    n = int(cache.length[b])
    assert n - int(cache.decode_start[b]) == 8 + (N_STEPS - 12) % 4
    for kh in range(K):
      np.testing.assert_allclose(np.asarray(cache.k[b, kh, :n]), np.stack(ref.k[kh]), rtol=1e-6)


def test_a_region_that_never_fills_changes_nothing():
  """Fewer new tokens than the region: bit-identical to the same knobs without a decode budget (and a budget of at
  least max_new_tokens reproduces the method)."""
  T, lengths, n_steps = 300, [300, 187], 12
  plain = plan_config("rocketkv", 64, T, n_steps)
  bounded = dataclasses.replace(plain, decode_budget=n_steps, decode_buffer=1, decode_window=4)
  assert bounded.capacity == plain.capacity
  q, k, v = random_inputs(12, 2, T)
  steps = random_steps(12, 2, n_steps)
  a, _ = run_steps(plain, q, k, v, lengths, steps)
  b, _ = run_steps(bounded, q, k, v, lengths, steps)
  np.testing.assert_array_equal(a, b)


def test_ragged_rows_and_poisoned_junk():
  """Rows of different prompt sets compact at different steps, each as it would alone; NaN in every junk slot
  (the padding, the slots past length, empty pages) never reaches an output."""
  T, lengths = 260, [260, 130]
  config = plan_config("rocketkv", 64, T, 10_000, **DB)
  q, k, v = random_inputs(13, 2, T)
  steps = random_steps(13, 2, 20)
  cache = rk.prefill_compress(q, k, v, np.asarray(lengths, np.int32), config=config)
  batch, _ = decode_steps(config, poison_cache(cache), steps)
  assert np.isfinite(batch).all()
  for b, L in enumerate(lengths):
    alone, _ = run_steps(config, q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], [L],
                         tuple(s[:, b:b + 1] for s in steps))
    np.testing.assert_allclose(batch[b], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"seq {b}")


@pytest.mark.parametrize("method,kw,match", [
    ("full", dict(decode_budget=64), "full takes no decode budget"),
    ("rocketkv", dict(decode_budget=4, decode_window=8), "decode_budget=4 must be >= 8"),
    ("rocketkv", dict(decode_budget=64, decode_buffer=0), "decode_buffer=0 must be >= 1"),
])
def test_bad_decode_budgets_are_refused(method, kw, match):
  with pytest.raises(ValueError, match=match):
    plan_config(method, 64, 300, 100, **kw)


@pytest.mark.gpu
def test_compaction_with_the_kernels_equals_xla():
  """On the GPU: the Pallas decode path (append with KT pages, HSA scoring and selection, sparse attention) with
  compactions between its steps gives the XLA path's outputs."""
  T, lengths = 300, [300, 187]
  config = plan_config("rocketkv", 64, T, 10_000, **DB)
  q, k, v = random_inputs(14, 2, T)
  steps = random_steps(14, 2, N_STEPS)
  want, _ = run_steps(config, q, k, v, lengths, steps)
  got, cache = run_steps(dataclasses.replace(config, impl="pallas"), q, k, v, lengths, steps)
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
  assert (np.asarray(cache.length) - np.asarray(cache.decode_start) == 8 + (N_STEPS - 12) % 4).all()
