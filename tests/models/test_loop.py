"""The one decode loop (models/loop.py) on a tiny random Llama: greedy equals step-by-step decoding, teacher
forcing scores the dense forward, stop ids and finished rows, static vs while loop, kernels (interpret) equal
XLA, and the argument checks."""

import jax
import numpy as np
import pytest

from rocketkv_jax import make_config
from rocketkv_jax.models import LoopConfig, decode, decode_loop, forward_full, prefill
from rocketkv_jax.models.loop import RowSampling

P = 24  # prompt tokens


def _start(model, method="full", max_new=8, lengths=(P, P), impl="xla", seed=1):
  toks = np.random.default_rng(seed).integers(3, 128, (len(lengths), P)).astype(np.int32)
  config = make_config(method, token_budget=64, prompt_len=P, max_new_tokens=max_new, head_dim=16, impl=impl)
  logits, caches = prefill(model, toks, np.array(lengths), config)
  return toks, config, logits, caches


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_equals_step_by_step_decode(tiny_model):
  _, config, logits, caches = _start(tiny_model)
  want = [np.asarray(logits).argmax(-1)]
  _, _, logits2, caches2 = _start(tiny_model)
  out = decode_loop(tiny_model, logits2, caches2, config, LoopConfig(max_new_tokens=6))
  for _ in range(5):
    logits, caches = decode(tiny_model, want[-1], caches, config)
    want.append(np.asarray(logits).argmax(-1))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.stack(want, 1))
  assert int(out.steps) == 5 and out.logprobs is None


def test_teacher_forcing_scores_the_dense_forward(tiny_model):
  toks, config, logits, caches = _start(tiny_model)
  forced = np.random.default_rng(2).integers(3, 128, (2, 6)).astype(np.int32)
  out = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=6, return_logprobs=True),
                    forced_BT=forced)
  full = np.asarray(forward_full(tiny_model, np.concatenate([toks, forced], 1)))[:, P - 1:P + 5]
  np.testing.assert_allclose(np.asarray(out.logprobs), _log_softmax(full), atol=1e-4)
  # out holds the model's own choice after each forced prefix
  np.testing.assert_array_equal(np.asarray(out.tokens), full.argmax(-1))


def test_forcing_the_greedy_tokens_reproduces_them(tiny_model):
  _, config, logits, caches = _start(tiny_model)
  greedy = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=7)).tokens)
  _, _, logits, caches = _start(tiny_model)
  forced = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=7), forced_BT=greedy)
  np.testing.assert_array_equal(np.asarray(forced.tokens), greedy)


def test_stop_ids_end_rows_and_the_loop(tiny_model):
  _, config, logits, caches = _start(tiny_model, max_new=10)
  free = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=10)).tokens)
  stop = int(free[0, 2])  # row 0 ends at its 3rd token
  _, _, logits, caches = _start(tiny_model, max_new=10)
  out = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=10, stop_ids=(stop,)))
  tokens = np.asarray(out.tokens)
  for b in range(2):
    row = free[b].tolist()
    k = row.index(stop) + 1 if stop in row else 10
    np.testing.assert_array_equal(tokens[b, :k], free[b, :k])
    assert (tokens[b, k:] == -1).all()
  ends = [free[b].tolist().index(stop) + 1 if stop in free[b].tolist() else 10 for b in range(2)]
  assert int(out.steps) == max(ends) - 1  # the loop stops once every row has ended


def test_finished_rows_emit_nothing(tiny_model):
  _, config, logits, caches = _start(tiny_model)
  out = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=5),
                    finished_B=np.array([False, True]))
  tokens = np.asarray(out.tokens)
  assert (tokens[1] == -1).all() and (tokens[0] >= 0).all()


def _rows(temperature, seed, index=0):
  return RowSampling(temperature=np.array(temperature, np.float32), top_p=np.array([0.9, 1.0], np.float32),
                     top_k=np.array([0, 5], np.int32), seed=np.array(seed, np.uint32),
                     index=np.full(2, index, np.int32))


def test_row_sampling_and_carried_logits(tiny_model):
  """Per-row sampling (what the serving engine runs): two calls of 3 tokens that carry the logits equal one call
  of 6; a greedy row equals the greedy loop; a row's tokens do not depend on the other row's sampling."""
  _, config, logits, caches = _start(tiny_model)
  greedy = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=6)).tokens)
  _, _, logits, caches = _start(tiny_model)
  one = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=6),
                               rows=_rows([0.0, 0.9], [1, 2])).tokens)
  np.testing.assert_array_equal(one[0], greedy[0])
  assert (one[1] != greedy[1]).any()  # row 1 samples
  _, _, logits, caches = _start(tiny_model)
  carry = LoopConfig(max_new_tokens=3, carry_logits=True)
  a = decode_loop(tiny_model, logits, caches, config, carry, rows=_rows([0.0, 0.9], [1, 2]))
  assert int(a.steps) == 3 and a.logits_BV.shape == logits.shape
  b = decode_loop(tiny_model, a.logits_BV, a.caches, config, carry, rows=_rows([0.0, 0.9], [1, 2], index=3))
  np.testing.assert_array_equal(np.concatenate([a.tokens, b.tokens], 1), one)
  _, _, logits, caches = _start(tiny_model)
  other = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=6),
                                 rows=_rows([1.3, 0.9], [7, 2])).tokens)
  np.testing.assert_array_equal(other[1], one[1])


@pytest.mark.parametrize("kernel_impl", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", ["rocketkv", "full"])
def test_kernels_in_the_loop_equal_xla(tiny_model, kernel_impl, method):
  """The loop with the kernels (interpret mode on CPU: the code the GPU runs; compiled with -m gpu) runs the
  fused norm/RoPE kernels and the core's decode kernels, teacher-forced: the same log-probs as XLA (float32,
  XLA's dots at full precision, no TF32)."""
  if kernel_impl == "pallas" and not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("needs a GPU")
  runs = {}
  with jax.default_matmul_precision("highest"):
    for impl in ("xla", kernel_impl):
      _, config, logits, caches = _start(tiny_model, method=method, max_new=4, lengths=(P, 17), impl=impl)
      forced = np.random.default_rng(3).integers(3, 128, (2, 3)).astype(np.int32)
      runs[impl] = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(
          max_new_tokens=4, return_logprobs=True), forced_BT=forced).logprobs)
  np.testing.assert_allclose(runs[kernel_impl], runs["xla"], atol=1e-4)


def test_loop_config_and_argument_checks(tiny_model):
  for bad, match in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_ids=(-3,)), "stop_ids"),
                     (dict(top_logprobs=-1), "top_logprobs")):
    with pytest.raises(ValueError, match=match):
      LoopConfig(**{"max_new_tokens": 2, **bad})
  assert LoopConfig(max_new_tokens=2, stop_ids=[5, 2, 5]).stop_ids == (2, 5)  # hashable, one order
  _, config, logits, caches = _start(tiny_model, max_new=4)
  assert config.capacity == P + 4  # room for 4 new tokens only
  with pytest.raises(ValueError, match="capacity"):
    decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=12))
  with pytest.raises(ValueError, match="stop_ids"):
    decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=3, stop_ids=(2,)),
                forced_BT=np.zeros((2, 2), np.int32))
  with pytest.raises(ValueError, match="forced_BT.shape"):
    decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=4), forced_BT=np.zeros((2, 2), np.int32))
  jax.block_until_ready(caches)  # the checks ran before any device work: nothing was donated
